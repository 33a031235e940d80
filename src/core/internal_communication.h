// The internal side of the library's communicators: the calls that the layers above (the packer,
// the strategy layer) make with per-call options, beyond the public CollectiveCommunication.
// RING and AUTO (src/ring) run them all; NCCL runs the plain calls and refuses the rest. A private
// header: never installed.
//
// Thread-safety: as CollectiveCommunication (communication.h): any method, any thread.
#ifndef COLLECTIVES_SRC_CORE_INTERNAL_COMMUNICATION_H_
#define COLLECTIVES_SRC_CORE_INTERNAL_COMMUNICATION_H_

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "collectives/communication.h"
#include "collectives/errors.h"
#include "collectives/types.h"

namespace collectives::core {

// A gate: called on the thread that runs the call, once the calls before it have completed and
// before anything of this one happens; false, and the call does nothing on this rank and takes
// no sequence number, so ranks that skipped different numbers of gated calls agree on the next
// call. Every rank must answer alike. It must not wait on a Work of the communicator (it runs on
// the thread that runs the calls); an exception it throws breaks the communicator with it.
using Gate = std::function<bool()>;

// Per-call options of the internal calls.
struct CallOptions {
  // The op the call is checked as against the other ranks (the op its frames and shared-memory
  // steps carry), where it differs from the op it reduces with: the strategy layer sums kAvg
  // across workers and divides once itself, yet a worker that sums where another averages must
  // raise kMismatch on every rank. Unset: the op it reduces with.
  std::optional<ReduceOp> checked_as;
  // Where set, the call runs only if the gate says so (see Gate). Only where RunsGatedCalls().
  Gate gate;
};

// Implemented by the library's communicators: RING and AUTO (src/ring/ring_communication.cc) and
// NCCL (src/nccl/nccl_communication.cc).
class InternalCommunication : public CollectiveCommunication {
 public:
  using CollectiveCommunication::Abort;
  using CollectiveCommunication::AllReduce;
  using CollectiveCommunication::AllReduceAsync;
  using CollectiveCommunication::Broadcast;
  using CollectiveCommunication::BroadcastAsync;

  // Whether the communicator runs gated calls and calls in pieces (RING and AUTO), the two
  // together; elsewhere those raise Error(kNotSupported).
  virtual bool RunsGatedCalls() const = 0;

  // The public all-reduce and broadcast under `options`. Without a gate every communicator runs
  // them; NCCL does not check across ranks, so checked_as changes nothing there. The blocking
  // forms may run on the caller's thread, as the public ones do.
  virtual std::shared_ptr<Work> AllReduceAsync(const Tensor& send, const Tensor& recv, ReduceOp op,
                                               const CallOptions& options) = 0;
  virtual void AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op,
                         const CallOptions& options) = 0;
  virtual std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv, int root,
                                               const CallOptions& options) = 0;
  virtual void Broadcast(const Tensor& send, const Tensor& recv, int root,
                         const CallOptions& options) = 0;

  // The packer's fused bucket without a fusion buffer: `pieces` (CPU tensors of one dtype, apart)
  // all-reduced in place as one message, their elements back to back, checked across ranks as an
  // all-reduce of one tensor of that many elements. RING sends and receives frames from and into
  // the pieces; AUTO copies them into and out of shared memory. Only where RunsGatedCalls().
  virtual std::shared_ptr<Work> AllReduceAsync(const std::vector<Tensor>& pieces, ReduceOp op,
                                               const CallOptions& options) = 0;
  virtual void AllReduce(const std::vector<Tensor>& pieces, ReduceOp op,
                         const CallOptions& options) = 0;
  // The same for a broadcast from `root`, checked as a broadcast of one tensor.
  virtual std::shared_ptr<Work> BroadcastAsync(const std::vector<Tensor>& pieces, int root,
                                               const CallOptions& options) = 0;
  virtual void Broadcast(const std::vector<Tensor>& pieces, int root,
                         const CallOptions& options) = 0;

  // Abort() with `reason` as the error that breaks the communicator, for a layer that aborts it
  // because of a failure of its own: pending and later calls raise `reason`, and RING's and
  // AUTO's peers receive it as the abort's reason ("rank 0: rank 1 aborted the job: <message>",
  // with its code; the message cut at transport::kMaxAbortPayload bytes). NCCL: Abort().
  virtual void Abort(const Error& reason) = 0;
};

// `comm`'s internal side, or null for a communicator built outside the library (a user's
// wrapper), on which callers use the public calls. The one place that asks.
inline InternalCommunication* Internal(CollectiveCommunication& comm) {
  return dynamic_cast<InternalCommunication*>(&comm);
}

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_INTERNAL_COMMUNICATION_H_
