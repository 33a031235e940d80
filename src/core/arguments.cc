// Argument checks shared by the communicators (see arguments.h).
#include "src/core/arguments.h"

#include <algorithm>
#include <cstdint>

#include "collectives/errors.h"

namespace collectives::core {

std::string ArgumentPrefix(int rank, const char* collective) {
  return "rank " + std::to_string(rank) + ": " + collective + ": ";
}

std::string TensorPrefix(int rank, const char* collective, const char* name) {
  return ArgumentPrefix(rank, collective) + name + " tensor ";
}

void CheckTensorData(int rank, const char* collective, const char* name, const Tensor& t) {
  if (static_cast<unsigned>(t.dtype) >= kNumDataTypes) {
    throw Error(ErrorCode::kInvalidArgument, TensorPrefix(rank, collective, name) +
                                                 "has an unknown dtype " +
                                                 std::to_string(int(t.dtype)));
  }
  if (t.count > SIZE_MAX / SizeOf(t.dtype)) {
    throw Error(ErrorCode::kInvalidArgument,
                TensorPrefix(rank, collective, name) + "has " + std::to_string(t.count) +
                    " elements of " + ToString(t.dtype) + ": more bytes than size_t holds");
  }
  if (t.data == nullptr && t.count > 0) {
    throw Error(ErrorCode::kInvalidArgument, TensorPrefix(rank, collective, name) +
                                                 "has null data and " +
                                                 std::to_string(t.count) + " elements");
  }
}

void CheckSameDtype(const std::string& prefix, const Tensor& send, const Tensor& recv) {
  if (send.dtype != recv.dtype) {
    throw Error(ErrorCode::kInvalidArgument, prefix + "send is " + ToString(send.dtype) +
                                                 " but recv is " + ToString(recv.dtype));
  }
}

void CheckReduceOp(const std::string& prefix, ReduceOp op) {
  if (static_cast<unsigned>(op) >= kNumReduceOps) {
    throw Error(ErrorCode::kInvalidArgument,
                prefix + "unknown reduce op " + std::to_string(int(op)));
  }
}

std::chrono::milliseconds CheckTimeout(const std::string& who, std::chrono::milliseconds timeout) {
  if (timeout <= std::chrono::milliseconds::zero()) {
    throw Error(ErrorCode::kInvalidArgument,
                who + " needs a positive timeout, got " + std::to_string(timeout.count()) + " ms");
  }
  return std::min(timeout, kMaxTimeout);
}

CommunicationOptions CheckOptions(int rank, const CommunicationOptions& options) {
  const std::string prefix = "rank " + std::to_string(rank) + ": CommunicationOptions::";
  CommunicationOptions checked = options;
  checked.timeout = CheckTimeout(prefix + "timeout", options.timeout);
  if (options.chunk_bytes > kMaxChunkBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                prefix + "chunk_bytes is " + std::to_string(options.chunk_bytes) +
                    ", more than the largest chunk, " + std::to_string(kMaxChunkBytes) +
                    " bytes (0 picks the default)");
  }
  return checked;
}

}  // namespace collectives::core
