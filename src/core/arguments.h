// Argument checks every communicator makes before it issues a call, with one wording for all of
// them ("rank R: <collective>: ..."). Where a tensor may live is each backend's own check.
//
// Thread-safety: pure functions.
#ifndef COLLECTIVES_SRC_CORE_ARGUMENTS_H_
#define COLLECTIVES_SRC_CORE_ARGUMENTS_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "collectives/communication.h"
#include "collectives/errors.h"
#include "collectives/types.h"

namespace collectives::core {

// "rank R: <collective>: ", the start of every argument error.
std::string ArgumentPrefix(int rank, const char* collective);

// "rank R: <collective>: <name> tensor ", the start of an error about one tensor.
std::string TensorPrefix(int rank, const char* collective, const char* name);

// Throws Error(kInvalidArgument) when `t`'s dtype is not a DataType, its byte size does not fit
// size_t, or its data is null or not aligned to its element size with count > 0, naming the
// tensor as TensorPrefix does. (The kernels read elements through typed pointers: an element
// that straddles its alignment is undefined behaviour, which UBSan reports.) Builds no string
// unless it throws: it runs on every call.
void CheckTensorData(int rank, const char* collective, const char* name, const Tensor& t);

// "data 0x... is not aligned to its 4-byte f32 elements (...)", for the check above.
std::string MisalignedText(const void* data, DataType dtype);

// The same checks with the start of each message from prefix(), called only when it throws, for
// a caller that names its tensors otherwise (the packer: "rank R: packing all_reduce: tensor 7 ").
template <typename Prefix>
void CheckTensorData(const Tensor& t, const Prefix& prefix) {
  if (static_cast<unsigned>(t.dtype) >= kNumDataTypes) {
    throw Error(ErrorCode::kInvalidArgument,
                prefix() + "has an unknown dtype " + std::to_string(int(t.dtype)));
  }
  if (t.count > SIZE_MAX / SizeOf(t.dtype)) {
    throw Error(ErrorCode::kInvalidArgument, prefix() + "has " + std::to_string(t.count) +
                                                 " elements of " + ToString(t.dtype) +
                                                 ": more bytes than size_t holds");
  }
  if (t.data == nullptr && t.count > 0) {
    throw Error(ErrorCode::kInvalidArgument,
                prefix() + "has null data and " + std::to_string(t.count) + " elements");
  }
  if (t.count > 0 && reinterpret_cast<uintptr_t>(t.data) % SizeOf(t.dtype) != 0) {
    throw Error(ErrorCode::kInvalidArgument, prefix() + MisalignedText(t.data, t.dtype));
  }
}

// Throws Error(kInvalidArgument) when the bytes of send and recv overlap and send.data is not at
// `in_place_send`, the address of the collective's in-place form (recv.data for all-reduce,
// recv.data + rank * send bytes for all-gather, ...), which `form` names in the message. No
// algorithm is correct on buffers that overlap otherwise (the ring all-gather, for one, receives
// into recv before it has copied send out of it). Builds no string unless it throws.
void CheckBuffersApart(int rank, const char* collective, const Tensor& send, const Tensor& recv,
                       uintptr_t in_place_send, const char* form);

// Throws Error(kInvalidArgument) when send and recv have different dtypes; `prefix` as above.
void CheckSameDtype(const std::string& prefix, const Tensor& send, const Tensor& recv);

// Throws Error(kInvalidArgument) when `op` is not a ReduceOp; `prefix` as above.
void CheckReduceOp(const std::string& prefix, ReduceOp op);

// The longest timeout anything in the library keeps: a year. A longer one (milliseconds::max()
// for "never time out") is read as a year, so that now + timeout cannot overflow the clock,
// which counts nanoseconds in an int64 (about 292 years).
inline constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 365);

// `timeout` capped at kMaxTimeout. Throws Error(kInvalidArgument) when it is not positive:
// "<who> needs a positive timeout, got N ms".
std::chrono::milliseconds CheckTimeout(const std::string& who, std::chrono::milliseconds timeout);

// The largest CommunicationOptions::chunk_bytes: 1 GiB. The ring stages 4 chunks per
// communicator; a larger chunk hardly pipelines, and sizes near SIZE_MAX would overflow.
inline constexpr size_t kMaxChunkBytes = size_t{1} << 30;

// The longest CommunicationOptions::spin_us and yield_us: one second. A waiter that polls longer
// than that cuts no latency, and the progress thread's idle spin delays the communicator's
// destructor by as much.
inline constexpr int kMaxPollUs = 1'000'000;

// `options` as a communicator keeps them: the timeout checked and capped (CheckTimeout),
// chunk_bytes at most kMaxChunkBytes, spin_us and yield_us from -1 (the default) to kMaxPollUs.
// Throws Error(kInvalidArgument) naming the option otherwise, "rank R: CommunicationOptions::...".
// (Whether the world can run a forced algorithm is each implementation's check:
// ring::CheckRingAlgorithm.)
CommunicationOptions CheckOptions(int rank, const CommunicationOptions& options);

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_ARGUMENTS_H_
