// Argument checks shared by the communicators (see arguments.h).
#include "src/core/arguments.h"

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

}  // namespace collectives::core
