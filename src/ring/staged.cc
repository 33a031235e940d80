// CUDA staging for RING (see staged.h): the copy stream, the pinned slots and the pipeline.
#include "src/ring/staged.h"

#include <algorithm>
#include <string>
#include <thread>

#include "collectives/errors.h"
#include "src/core/environment.h"

#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#endif

namespace collectives::ring {

size_t CudaStagingBytes() {
  static const size_t bytes = [] {
    const std::optional<uint64_t> value =
        core::EnvCount("COLLECTIVES_CUDA_STAGING_BYTES", "a count of bytes, at least 64");
    return value && *value >= 64 ? size_t(*value) : kDefaultCudaStagingBytes;
  }();
  return bytes;
}

#ifndef COLLECTIVES_WITH_NCCL

std::shared_ptr<CudaStaging> CudaStaging::Open(int, size_t) {
  throw Error(ErrorCode::kNotSupported,
              "CUDA is not available: this library is built without CUDA (configure with "
              "-DCOLLECTIVES_WITH_NCCL=ON)");
}

#else

namespace {

using nccl::NcclApi;

// Makes `device` current on this thread and restores the previous one on leaving.
class DeviceGuard {
 public:
  DeviceGuard(const NcclApi& api, int device) : api_(api) {
    if (api_.cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) api_.cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous_ >= 0 && api_.cudaGetDevice(&now) == cudaSuccess && now != previous_) {
      api_.cudaSetDevice(previous_);
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  const NcclApi& api_;
  int previous_ = -1;
};

class CudaStagingImpl final : public CudaStaging {
 public:
  CudaStagingImpl(const NcclApi& api, int device, size_t slot_bytes)
      : api_(api), device_(device), slot_bytes_(slot_bytes) {}

  ~CudaStagingImpl() override {
    DeviceGuard guard(api_, device_);
    if (stream_ != nullptr) api_.cudaStreamSynchronize(stream_);
    for (cudaEvent_t& event : ready_) {
      if (event != nullptr) api_.cudaEventDestroy(event);
    }
    if (done_ != nullptr) api_.cudaEventDestroy(done_);
    if (stream_ != nullptr) api_.cudaStreamDestroy(stream_);
    for (void* slot : slots_) {
      if (slot != nullptr) api_.cudaFreeHost(slot);
    }
  }

  void Init() {
    DeviceGuard guard(api_, device_);
    // A blocking stream: its copies wait for the work queued before them on the legacy default
    // stream (cudaMemcpy, kernels launched on stream 0), as a caller using that stream expects.
    Check(api_.cudaStreamCreateWithFlags(&stream_, cudaStreamDefault), "cudaStreamCreate",
          "staging");
    for (cudaEvent_t& event : ready_) {
      Check(api_.cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate",
            "staging");
    }
    Check(api_.cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate",
          "staging");
    for (void*& slot : slots_) {
      Check(api_.cudaHostAlloc(&slot, slot_bytes_, cudaHostAllocPortable), "cudaHostAlloc",
            "staging");
    }
  }

  int device() const override { return device_; }
  size_t slot_bytes() const override { return slot_bytes_; }

  void CheckDeviceMemory(const std::string& prefix, const Tensor& t) const override {
    if (t.count == 0) return;
    cudaPointerAttributes attributes{};
    const cudaError_t status = api_.cudaPointerGetAttributes(&attributes, t.data);
    if (status != cudaSuccess) {
      api_.cudaGetLastError();
      throw Error(ErrorCode::kInvalidArgument,
                  prefix + "data is not CUDA memory (cudaPointerGetAttributes: " +
                      api_.cudaGetErrorString(status) + ")");
    }
    if (attributes.type == cudaMemoryTypeManaged) return;
    if (attributes.type != cudaMemoryTypeDevice) {
      throw Error(ErrorCode::kInvalidArgument,
                  prefix + "is on " + t.device.ToString() + " but its data is host memory");
    }
    if (attributes.device != t.device.index) {
      throw Error(ErrorCode::kInvalidArgument,
                  prefix + "is on " + t.device.ToString() + " but its data is memory of cuda:" +
                      std::to_string(attributes.device));
    }
  }

  void Run(size_t segments, const Plan& plan, const Work& work,
           std::chrono::steady_clock::time_point deadline, const std::string& what) override {
    DeviceGuard guard(api_, device_);
    std::vector<Copy> in[2], out[2];
    auto issue_in = [&](size_t k) {
      const size_t s = k % 2;
      in[s].clear();
      out[s].clear();
      plan(k, &in[s], &out[s]);
      for (const Copy& c : in[s]) {
        if (c.bytes == 0) continue;
        Check(api_.cudaMemcpyAsync(static_cast<uint8_t*>(slots_[s]) + c.host_offset, c.device,
                                   c.bytes, cudaMemcpyDeviceToHost, stream_),
              "cudaMemcpyAsync (device to host)", what);
      }
      Check(api_.cudaEventRecord(ready_[s], stream_), "cudaEventRecord", what);
    };
    if (segments == 0) return;
    issue_in(0);
    for (size_t k = 0; k < segments; ++k) {
      // Segment k+1 comes in while the ring works on k (its slot's last copies out were queued
      // before, and the stream keeps their order).
      if (k + 1 < segments) issue_in(k + 1);
      const size_t s = k % 2;
      Await(ready_[s], deadline, what);
      work(k, static_cast<uint8_t*>(slots_[s]));
      for (const Copy& c : out[s]) {
        if (c.bytes == 0) continue;
        Check(api_.cudaMemcpyAsync(c.device, static_cast<uint8_t*>(slots_[s]) + c.host_offset,
                                   c.bytes, cudaMemcpyHostToDevice, stream_),
              "cudaMemcpyAsync (host to device)", what);
      }
    }
    Check(api_.cudaEventRecord(done_, stream_), "cudaEventRecord", what);
    Await(done_, deadline, what);
  }

 private:
  void Check(cudaError_t status, const char* call, const std::string& what) const {
    if (status == cudaSuccess) return;
    api_.cudaGetLastError();  // not sticky for the next call's check
    throw Error(ErrorCode::kSystem, what + ": staging through host memory on cuda:" +
                                        std::to_string(device_) + ": " + call + ": " +
                                        api_.cudaGetErrorString(status));
  }

  // Polls `event` until it has passed, yielding between polls, up to `deadline`.
  void Await(cudaEvent_t event, std::chrono::steady_clock::time_point deadline,
             const std::string& what) const {
    for (int polls = 0;; ++polls) {
      const cudaError_t status = api_.cudaEventQuery(event);
      if (status == cudaSuccess) return;
      if (status != cudaErrorNotReady) Check(status, "cudaEventQuery", what);
      if (std::chrono::steady_clock::now() > deadline) {
        throw Error(ErrorCode::kTimeout, what + ": the copies between cuda:" +
                                             std::to_string(device_) +
                                             " and host memory passed the call's deadline");
      }
      if (polls < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }

  const NcclApi& api_;
  const int device_;
  const size_t slot_bytes_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_[2] = {nullptr, nullptr};
  cudaEvent_t done_ = nullptr;
  void* slots_[2] = {nullptr, nullptr};
};

}  // namespace

std::shared_ptr<CudaStaging> CudaStaging::Open(int device, size_t slot_bytes) {
  const NcclApi& api = nccl::LoadCudart();
  if (device < 0 || device >= api.device_count) {
    throw Error(ErrorCode::kInvalidArgument,
                "cuda:" + std::to_string(device) + " is not a visible CUDA device (" +
                    std::to_string(api.device_count) + " visible)");
  }
  auto staging = std::make_shared<CudaStagingImpl>(api, device, slot_bytes);
  staging->Init();
  return staging;
}

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace collectives::ring
