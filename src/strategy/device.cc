// The strategy layer's CUDA runtime and NCCL calls (device.h), through the loader's tables.
#include "src/strategy/device.h"

#include <exception>
#include <thread>
#include <utility>

#include "collectives/cluster.h"
#include "collectives/errors.h"

#if COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_communication.h"
#include "src/nccl/nccl_loader.h"
#endif

namespace collectives::strategy::internal {
namespace {

#if !COLLECTIVES_WITH_NCCL
[[noreturn]] void NoCuda(const std::string& who) {
  throw Error(ErrorCode::kNotSupported,
              who + ": CUDA is not available: this build of collectives has no CUDA support "
                    "(build with COLLECTIVES_WITH_NCCL=ON)");
}
#else

const nccl::NcclApi& Cudart(const std::string& who) {
  std::string reason;
  const nccl::NcclApi* api = nccl::TryLoadCudart(&reason);
  if (api == nullptr)
    throw Error(ErrorCode::kNotSupported, who + ": " + reason);  // "CUDA is not available: ..."
  return *api;
}

void Check(const nccl::NcclApi& api, cudaError_t status, const std::string& what) {
  if (status == cudaSuccess) return;
  throw Error(ErrorCode::kSystem, what + " failed: " + api.cudaGetErrorString(status));
}

void SetDevice(const nccl::NcclApi& api, const Device& device, const std::string& what) {
  if (device.kind != Device::Kind::kCuda) {
    throw Error(ErrorCode::kInvalidArgument,
                what + ": " + device.ToString() + " is not a CUDA device");
  }
  Check(api, api.cudaSetDevice(device.index),
        what + ": cudaSetDevice(" + std::to_string(device.index) + ")");
}

// One copy of `bytes` between host and `device` (none for 0), `kind` saying which way.
void Copy(const Device& device, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
          const std::string& what) {
  if (bytes == 0) return;
  const nccl::NcclApi& api = Cudart(what);
  SetDevice(api, device, what);
  Check(api, api.cudaMemcpy(dst, src, bytes, kind), what + ": cudaMemcpy");
}

#endif

}  // namespace

int CudaDeviceCount(const std::string& who) {
#if COLLECTIVES_WITH_NCCL
  return Cudart(who).device_count;
#else
  NoCuda(who);
#endif
}

std::string NcclUnavailableReason() {
#if COLLECTIVES_WITH_NCCL
  std::string reason;
  return nccl::TryLoadNccl(&reason) != nullptr ? std::string() : reason;
#else
  return "this build of collectives has no NCCL (build with COLLECTIVES_WITH_NCCL=ON)";
#endif
}

std::shared_ptr<void> AllocateOnDevice(const Device& device, size_t bytes) {
  const std::string what = "allocating " + std::to_string(bytes) + " bytes on " + device.ToString();
#if COLLECTIVES_WITH_NCCL
  const nccl::NcclApi& api = Cudart(what);
  SetDevice(api, device, what);
  void* pointer = nullptr;
  Check(api, api.cudaMalloc(&pointer, bytes == 0 ? 1 : bytes), what + ": cudaMalloc");
  const nccl::NcclApi* table = &api;
  const int index = device.index;
  return std::shared_ptr<void>(pointer, [table, index](void* p) {
    table->cudaSetDevice(index);
    table->cudaFree(p);
  });
#else
  NoCuda(what);
#endif
}

void CopyToDevice(const Device& device, void* dst, const void* src, size_t bytes) {
  const std::string what = "copying " + std::to_string(bytes) + " bytes to " + device.ToString();
#if COLLECTIVES_WITH_NCCL
  Copy(device, dst, src, bytes, cudaMemcpyHostToDevice, what);
#else
  (void)dst, (void)src;
  NoCuda(what);
#endif
}

void CopyToHost(const Device& device, void* dst, const void* src, size_t bytes) {
  const std::string what = "copying " + std::to_string(bytes) + " bytes from " + device.ToString();
#if COLLECTIVES_WITH_NCCL
  Copy(device, dst, src, bytes, cudaMemcpyDeviceToHost, what);
#else
  (void)dst, (void)src;
  NoCuda(what);
#endif
}

std::vector<std::unique_ptr<CollectiveCommunication>> CreateLocalNccl(
    const std::vector<Device>& devices, std::chrono::milliseconds timeout, const std::string& who) {
#if COLLECTIVES_WITH_NCCL
  if (const std::string why = NcclUnavailableReason(); !why.empty()) {
    throw Error(ErrorCode::kNotSupported, who + ": cross_device_ops nccl: " + why);
  }
  const int n = static_cast<int>(devices.size());
  std::shared_ptr<Store> store = CreateMemoryStore();
  CommunicationOptions options;
  options.timeout = timeout;
  std::vector<std::unique_ptr<CollectiveCommunication>> comms(devices.size());
  std::vector<std::exception_ptr> errors(devices.size());
  std::vector<std::thread> threads;
  threads.reserve(devices.size());
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        nccl::NcclOptions nccl_options;
        nccl_options.device = devices[static_cast<size_t>(r)].index;
        comms[static_cast<size_t>(r)] = nccl::CreateNcclCommunication(
            r, n, store, "strategy/local_nccl", options, nccl_options);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return comms;
#else
  (void)devices, (void)timeout;
  throw Error(ErrorCode::kNotSupported,
              who +
                  ": cross_device_ops nccl: this build of collectives has no NCCL (build with "
                  "COLLECTIVES_WITH_NCCL=ON)");
#endif
}

}  // namespace collectives::strategy::internal
