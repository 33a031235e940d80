// Argument checks shared by the communicators (see arguments.h).
#include "src/core/arguments.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <utility>

#include "collectives/errors.h"

namespace collectives::core {

std::string ArgumentPrefix(int rank, const char* collective) {
  return "rank " + std::to_string(rank) + ": " + collective + ": ";
}

std::string TensorPrefix(int rank, const char* collective, const char* name) {
  return ArgumentPrefix(rank, collective) + name + " tensor ";
}

void CheckTensorData(int rank, const char* collective, const char* name, const Tensor& t) {
  CheckTensorData(t, [&] { return TensorPrefix(rank, collective, name); });
}

std::string MisalignedText(const void* data, DataType dtype) {
  char address[32];
  std::snprintf(address, sizeof address, "%p", data);
  return std::string("data ") + address + " is not aligned to its " +
         std::to_string(SizeOf(dtype)) + "-byte " + ToString(dtype) +
         " elements (a typed pointer always is)";
}

void CheckBuffersApart(int rank, const char* collective, const Tensor& send, const Tensor& recv,
                       uintptr_t in_place_send, const char* form) {
  const uintptr_t s = reinterpret_cast<uintptr_t>(send.data);
  const uintptr_t r = reinterpret_cast<uintptr_t>(recv.data);
  const size_t send_bytes = send.count * SizeOf(send.dtype);  // CheckTensorData: no overflow
  const size_t recv_bytes = recv.count * SizeOf(recv.dtype);
  if (send_bytes == 0 || recv_bytes == 0 || s == in_place_send) return;
  if (s - r < recv_bytes || r - s < send_bytes) {  // one starts inside the other
    const auto range = [](uintptr_t at, size_t bytes) {
      char text[64];
      std::snprintf(text, sizeof text, "[%#llx, +%zu bytes)", static_cast<unsigned long long>(at),
                    bytes);
      return std::string(text);
    };
    throw Error(ErrorCode::kInvalidArgument,
                ArgumentPrefix(rank, collective) + "send " + range(s, send_bytes) + " and recv " +
                    range(r, recv_bytes) +
                    " overlap without being the in-place form (send.data == " + form + ")");
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
  if (options.implementation != Implementation::kRing &&
      options.implementation != Implementation::kNccl &&
      options.implementation != Implementation::kAuto) {
    throw Error(ErrorCode::kInvalidArgument,
                prefix + "implementation is " +
                    std::to_string(static_cast<int>(options.implementation)) +
                    ", which names no implementation (kRing, kNccl or kAuto)");
  }
  checked.timeout = CheckTimeout(prefix + "timeout", options.timeout);
  if (options.chunk_bytes > kMaxChunkBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                prefix + "chunk_bytes is " + std::to_string(options.chunk_bytes) +
                    ", more than the largest chunk, " + std::to_string(kMaxChunkBytes) +
                    " bytes (0 picks the default)");
  }
  for (const auto& [name, value] :
       {std::pair{"spin_us", options.spin_us}, std::pair{"yield_us", options.yield_us}}) {
    if (value < -1 || value > kMaxPollUs) {
      throw Error(ErrorCode::kInvalidArgument, prefix + name + " is " + std::to_string(value) +
                                                   ": -1 (the default) or 0.." +
                                                   std::to_string(kMaxPollUs) + " microseconds");
    }
  }
  return checked;
}

}  // namespace collectives::core
