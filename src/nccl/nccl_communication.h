// The NCCL implementation of CollectiveCommunication, for tensors in CUDA memory.
//
// Set-up: rank 0 makes an ncclUniqueId and publishes it, hex-encoded, in the store under
// "<key_prefix>/id"; every rank reads it and starts a non-blocking ncclCommInitRankConfig, polled
// with ncclCommGetAsyncError until it completes or the communicator timeout passes (then the
// half-built communicator is aborted and Error(kTimeout) raised).
//
// Calls: each collective is validated on the caller's thread (its tensors must be memory of the
// communicator's device, or managed memory: NCCL does not check pointers, and a host pointer
// would fault in its kernel), issued to NCCL on the communicator's stream (NcclOptions::stream,
// else one it creates), and followed by a CUDA event. Work::Wait polls that event, checks
// ncclCommGetAsyncError between polls, and on the deadline aborts the communicator and raises
// Error(kTimeout); Work::Done makes the same checks (at most every millisecond), so a caller
// that only polls it sees a dead peer too. A call's timeout counts from when it starts running,
// that is from when the call before it on the stream is seen complete (or from its issue when
// nothing ran), so calls queued behind a long one do not time out while they wait. Issuing is
// serialised by a mutex, so calls reach NCCL in the order they entered the library, as
// communication.h requires.
// An async call returns once NCCL has put the collective on the stream, so that work queued
// after the call runs after it (NcclOptions::stream). A non-blocking communicator may take a
// while for that (ncclInProgress, polled under the mutex): at the first collective NCCL
// connects the ranks (NCCL 2.22+ connects at run time), which needs every peer to issue its
// own. So the first async call of a rank can return only when every rank has issued its first,
// unlike RING's, which return at once; a program that drives several ranks from one thread
// times out there (Error(kTimeout), "NCCL did not accept the call within ...", after the
// timeout; Abort ends the wait sooner): it needs a thread per rank. Returning before NCCL has
// accepted the call would let work queued after it run first.
// The first failure breaks the communicator (sticky, as for RING),
// NCCL's refusal of a call included: NCCL then sets an asynchronous error on a non-blocking
// communicator, which leaves it unusable. Abort calls ncclCommAbort; after it, NCCL's kernels
// return early and the events after them complete over partial data, so a Work whose event
// completes on a broken communicator raises the communicator's error (Error(kAborted) after
// Abort), not success.
// NCCL cannot check that ranks agree on counts, dtypes or ops: a mismatch is undefined there
// (typically a hang until the timeout), not Error(kMismatch).
// Reduce is ncclReduce. Gather, Scatter, AllToAll, Send and Recv are ncclSend and ncclRecv
// between ncclGroupStart and ncclGroupEnd, one group per call, as nccl-tests and PyTorch's
// ProcessGroupNCCL issue them: a root's receive from (or send to) itself is a self send/receive
// pair in the same group, left out when the call is in place; a block of 0 elements is neither
// sent nor received. Each is one call on the stream with one event, its Work as above. Nothing
// is checked across ranks there either: a root, a count vector or a dtype that disagrees, a send
// without its receive, or a receive longer than its send, is undefined (typically a hang until
// the timeout raises Error(kTimeout) and aborts the communicator), never Error(kMismatch).
// Send and Recv take no place in the collective sequence (NCCL's collectives and its sends meet
// only the ranks they name). NCCL has no tags: between two ranks, sends pair with receives in
// the order each rank issues them, and the tag is accepted and named in messages, but neither
// checked nor used to pair (a tag that differs is not Error(kMismatch) here). A peer must be
// another rank: a send to this rank would wait for its receive, queued behind it on the stream
// (Error(kInvalidArgument)). A Send may wait for its Recv, so the ranks of a chain of blocking
// sends and receives must order them (even ranks send first, odd ones receive first).
// CommunicationOptions::algorithm cannot be forced (NCCL picks its own; NCCL_ALGO does that):
// any value raises Error(kNotSupported) when the communicator is built.
//
// Thread-safety: every public method may be called from any thread (see communication.h). The
// CUDA device of the communicator is made current on the calling thread by each call, Work's
// Wait, Done and destructor included (the runtime would otherwise make device 0 current, and
// build a context there, on a thread that never chose a device).
#ifndef COLLECTIVES_SRC_NCCL_NCCL_COMMUNICATION_H_
#define COLLECTIVES_SRC_NCCL_NCCL_COMMUNICATION_H_

#include <nccl.h>

#include <chrono>
#include <memory>
#include <string>

#include "collectives/cluster.h"
#include "collectives/communication.h"

namespace collectives::nccl {

struct NcclOptions {
  // CUDA ordinal of the device this rank uses; every tensor must be on it.
  // -1 picks rank % (number of visible devices), right for one process per GPU on each host
  // with ranks numbered host by host.
  // Default: -1.
  int device = -1;

  // The cudaStream_t the collectives are issued on, owned by the caller, who keeps it alive
  // as long as the communicator and orders it with the work that fills and reads the tensors.
  // Null: the communicator creates a blocking stream of its own (not cudaStreamNonBlocking), so
  // that its collectives run after the work queued before them on the legacy default stream
  // (kernels launched without a stream, cudaMemcpy, whose copy from pageable memory may return
  // before the data lands) and before the work queued there after them. A program built with
  // per-thread default streams, or using streams of its own, must order those itself (an event
  // and cudaStreamWaitEvent, or a synchronisation) before it issues a collective.
  // Default: null.
  void* stream = nullptr;

  // When the set-up must be done, if sooner than options.timeout after this call starts: the
  // factory's set-up began before (connecting to the store), and options.timeout bounds it as a
  // whole. Errors still name options.timeout.
  // Default: none.
  std::chrono::steady_clock::time_point setup_deadline =
      std::chrono::steady_clock::time_point::max();
};

// Builds rank `rank` of `size` over NCCL, rendezvousing through `store` under `key_prefix`
// (unique to this communicator: the factory uses "<job_id>/nccl/<generation>"). `store` is
// kept alive as long as the communicator (rank 0 may host it). Blocks until every rank has
// joined, options.timeout passed or nccl_options.setup_deadline came.
// Throws Error(kNotSupported) when options.algorithm is set (CheckNcclAlgorithm) or NCCL or a GPU
// is not usable here (see nccl_loader.h), both before the store is touched,
// Error(kInvalidArgument) for a bad device, Error(kTimeout) when the set-up takes too long, and
// NCCL's failures mapped by ToErrorCode.
std::unique_ptr<CollectiveCommunication> CreateNcclCommunication(
    int rank, int size, std::shared_ptr<Store> store, const std::string& key_prefix,
    const CommunicationOptions& options, const NcclOptions& nccl_options = {});

// Throws Error(kNotSupported) naming `algorithm` unless it is empty: an NCCL communicator cannot
// be made to run one of the library's algorithms. CreateNcclCommunication calls it first; a
// caller that touches the store before (the factory's generation counter) may call it earlier.
void CheckNcclAlgorithm(int rank, const std::string& algorithm);

// The mappings, exposed for tests.
ErrorCode ToErrorCode(ncclResult_t result);
ncclDataType_t ToNcclDataType(DataType dtype);  // every DataType has one
ncclRedOp_t ToNcclRedOp(ReduceOp op);           // every ReduceOp has one (kAvg -> ncclAvg)

// Hex text of a unique id and back (Error(kInvalidArgument) on malformed text).
std::string EncodeUniqueId(const ncclUniqueId& id);
ncclUniqueId DecodeUniqueId(const std::string& text);

}  // namespace collectives::nccl

#endif  // COLLECTIVES_SRC_NCCL_NCCL_COMMUNICATION_H_
