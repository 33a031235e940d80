// The RING implementation of CollectiveCommunication: validates calls on the caller's thread,
// queues them, and runs them in order, one at a time, on one progress thread (or, for a blocking
// call when nothing is queued or running, on the caller's), whichever holds the fabric
// (ring::CallQueue).
//
// Thread-safety: every public method may be called from any thread (see communication.h).
#ifndef COLLECTIVES_SRC_RING_RING_COMMUNICATION_H_
#define COLLECTIVES_SRC_RING_RING_COMMUNICATION_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/ring/algorithms.h"
#include "src/transport/connection.h"

namespace collectives::ring {

// Defaults behind the 0 values of CommunicationOptions (see there for the reasons).
inline constexpr size_t kDefaultChunkBytes = 512 * 1024;
inline constexpr size_t kDefaultSmallMessageBytes = 64 * 1024;
inline constexpr size_t kDefaultMediumMessageBytes = 8 * 1024 * 1024;
inline constexpr int kDefaultSpinUs = 50;
inline constexpr int kDefaultYieldUs = 10000;

// A layer above the ring that may take calls over (the hierarchical layer: shared memory, the
// two-level plan). Each method is called on the caller's thread after the argument checks and
// returns the body to run in its turn (on the progress thread or a caller's), or an empty one to
// leave the call to the ring's own algorithms. Every rank must decide the same way for the same
// call.
class Planner {
 public:
  using Body = std::function<void(Context&)>;
  virtual ~Planner() = default;
  // `algorithm` is CommunicationOptions::algorithm when it names one of the planner's.
  virtual Body AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op) = 0;
  // An all-reduce in place of `pieces` (CPU tensors of one dtype, apart; the message is their
  // elements back to back), without a buffer that holds the whole message; an empty body leaves
  // it to the ring's, in runs, as for the other calls.
  virtual Body AllReduceInRuns(const std::vector<Tensor>& pieces, ReduceOp op) {
    (void)pieces;
    (void)op;
    return {};
  }
  // A broadcast in place of `pieces` from `root`, likewise.
  virtual Body BroadcastInRuns(const std::vector<Tensor>& pieces, int root) {
    (void)pieces;
    (void)root;
    return {};
  }
  // `source` is the root's send data (null elsewhere).
  virtual Body Broadcast(const void* source, const Tensor& recv, int root) = 0;
  virtual Body AllGather(const Tensor& send, const Tensor& recv) = 0;
  virtual Body ReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op) = 0;
  virtual Body Barrier() = 0;
  // A reduce to `root` and a gather to `root`; `recv` is null off the root (where the caller's
  // recv is neither read nor written). Empty bodies (the default) leave them to the ring.
  virtual Body Reduce(const Tensor& send, void* recv, ReduceOp op, int root) {
    (void)send;
    (void)recv;
    (void)op;
    (void)root;
    return {};
  }
  virtual Body Gather(const Tensor& send, void* recv, int root) {
    (void)send;
    (void)recv;
    (void)root;
    return {};
  }
  // A call on CUDA tensors: `staged` is the ring's own body for it (the tensors staged through
  // pinned host memory, staged.h); the body returned runs instead, and may run `staged` itself
  // (a fallback every rank must choose alike). The default runs `staged`.
  virtual Body DeviceAllReduce(const Tensor& send, const Tensor& recv, ReduceOp op, Body staged) {
    (void)send, (void)recv, (void)op;
    return staged;
  }
  virtual Body DeviceBroadcast(const Tensor& send, const Tensor& recv, int root, Body staged) {
    (void)send, (void)recv, (void)root;
    return staged;
  }
  virtual Body DeviceAllGather(const Tensor& send, const Tensor& recv, Body staged) {
    (void)send, (void)recv;
    return staged;
  }
  virtual Body DeviceReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op,
                                   Body staged) {
    (void)send, (void)recv, (void)op;
    return staged;
  }
  // A call the planner left to the ring (an empty body) is about to run, tagged `tag`: a planner
  // whose bodies wait for the other ranks of a host in shared memory tells them, so that one of
  // them waiting there during a call of the same number and another descriptor raises kMismatch
  // rather than waiting for this rank until its deadline.
  virtual void RunningOnRing(const core::CallTag& tag) { (void)tag; }
  // For an all-reduce of `bytes` the planner leaves to the ring (an empty body): the ring
  // algorithm to run (a name of CommunicationOptions::algorithm the world can run), "" for the
  // ring's own choice by size. Not consulted where CommunicationOptions::algorithm forces one.
  virtual std::string FlatAllReduceAlgorithm(size_t bytes) const {
    (void)bytes;
    return "";
  }
  // The name of the planner's algorithm for an all-reduce of `bytes`, "" when it leaves it to
  // the ring.
  virtual std::string AllReduceAlgorithm(size_t bytes) const = 0;
  // Breaks whatever the planner's bodies wait on, with `error`. Any thread.
  virtual void Abort(const Error& error) = 0;
};

// Builds the communicator of a Split: this rank's new rank and size, a suffix that gives its
// rendezvous keys a space of their own (the factory knows the store and the job), the parent's
// timeout at the time of the split (for the set-up and the child's calls), and whether the
// parent has been aborted since (polled while the set-up waits: then it throws kAborted).
using SplitBuilder = std::function<std::unique_ptr<CollectiveCommunication>(
    int rank, int size, const std::string& key_suffix, std::chrono::milliseconds timeout,
    const std::function<bool()>& parent_aborted)>;

// Takes over `fabric` (already connected). `store` is kept alive as long as the communicator
// (rank 0 may host it); it may be null. With a `planner` the communicator reports
// Implementation::kAuto and offers the planner every call first. Without `split` (a fabric
// built by hand, as in tests), Split throws Error(kNotSupported). The communicator has an
// internal side (core::Internal) that runs every call of core::InternalCommunication.
std::unique_ptr<CollectiveCommunication> CreateRingCommunication(
    std::unique_ptr<transport::Fabric> fabric, std::shared_ptr<Store> store,
    const CommunicationOptions& options, std::unique_ptr<Planner> planner = nullptr,
    SplitBuilder split = {});

// The ring's own all-reduce algorithms, by the names of CommunicationOptions::algorithm.
bool IsRingAlgorithm(const std::string& name);

// Whether halving-doubling can run on `size` ranks: a power of two of at least 4.
bool HalvingDoublingRunsOn(int size);

// Throws Error(kNotSupported) when `algorithm` forces a ring algorithm that `size` ranks cannot
// run ("halving_doubling" elsewhere than HalvingDoublingRunsOn), as the option promises, rather
// than measure another algorithm: "rank R: CommunicationOptions::algorithm ...".
void CheckRingAlgorithm(int rank, int size, const std::string& algorithm);

}  // namespace collectives::ring

#endif  // COLLECTIVES_SRC_RING_RING_COMMUNICATION_H_
