// The NCCL implementation of CollectiveCommunication, for tensors in CUDA memory.
//
// Set-up: rank 0 makes an ncclUniqueId and publishes it, hex-encoded, in the store under
// "<key_prefix>/id"; every rank reads it and starts a non-blocking ncclCommInitRankConfig, polled
// with ncclCommGetAsyncError until it completes or the communicator timeout passes (then the
// half-built communicator is aborted and Error(kTimeout) raised).
//
// Calls: each collective is validated on the caller's thread, issued to NCCL on the
// communicator's stream (NcclOptions::stream, else one it creates), and followed by a CUDA event.
// Work::Wait polls that event, checks ncclCommGetAsyncError between polls, and on the deadline
// aborts the communicator and raises Error(kTimeout). Issuing is serialised by a mutex, so calls
// reach NCCL in the order they entered the library, as communication.h requires. The first
// failure breaks the communicator (sticky, as for RING); Abort calls ncclCommAbort.
// NCCL cannot check that ranks agree on counts, dtypes or ops: a mismatch is undefined there
// (typically a hang until the timeout), not Error(kMismatch).
//
// Thread-safety: every public method may be called from any thread (see communication.h). The
// CUDA device of the communicator is made current on the calling thread by each call.
#ifndef COLLECTIVES_SRC_NCCL_NCCL_COMMUNICATION_H_
#define COLLECTIVES_SRC_NCCL_NCCL_COMMUNICATION_H_

#include <nccl.h>

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
  // as long as the communicator. Null: the communicator creates a non-blocking stream of its own.
  // Default: null.
  void* stream = nullptr;
};

// Builds rank `rank` of `size` over NCCL, rendezvousing through `store` under `key_prefix`
// (unique to this communicator: the factory uses "<job_id>/nccl/<generation>"). `store` is
// kept alive as long as the communicator (rank 0 may host it). Blocks until every rank has
// joined or options.timeout passed.
// Throws Error(kNotSupported) when NCCL or a GPU is not usable here (see nccl_loader.h),
// Error(kInvalidArgument) for a bad device, Error(kTimeout) when the set-up takes too long, and
// NCCL's failures mapped by ToErrorCode.
std::unique_ptr<CollectiveCommunication> CreateNcclCommunication(
    int rank, int size, std::shared_ptr<Store> store, const std::string& key_prefix,
    const CommunicationOptions& options, const NcclOptions& nccl_options = {});

// The mappings, exposed for tests.
ErrorCode ToErrorCode(ncclResult_t result);
ncclDataType_t ToNcclDataType(DataType dtype);  // every DataType has one
ncclRedOp_t ToNcclRedOp(ReduceOp op);           // every ReduceOp has one (kAvg -> ncclAvg)

// Hex text of a unique id and back (Error(kInvalidArgument) on malformed text).
std::string EncodeUniqueId(const ncclUniqueId& id);
ncclUniqueId DecodeUniqueId(const std::string& text);

}  // namespace collectives::nccl

#endif  // COLLECTIVES_SRC_NCCL_NCCL_COMMUNICATION_H_
