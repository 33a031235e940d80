// collectives_perf's device buffers and raw NCCL baseline (see perf_device.h).
#include "bench/perf_device.h"

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_communication.h"
#include "src/nccl/nccl_loader.h"
#endif

namespace collectives::perf {

#ifndef COLLECTIVES_WITH_NCCL

bool DeviceBuffersBuilt() { return false; }

struct DeviceMirror::Impl {};
DeviceMirror::DeviceMirror(int, const void*, size_t, const void*, size_t) {
  throw std::runtime_error(
      "--device cuda needs a build with CUDA and NCCL (cmake -DCOLLECTIVES_WITH_NCCL=ON)");
}
DeviceMirror::~DeviceMirror() = default;
int DeviceMirror::device() const { return -1; }
Tensor DeviceMirror::OnDevice(const Tensor& host) const { return host; }
void DeviceMirror::Upload(const Tensor&) {}
void DeviceMirror::Download(const Tensor&) {}
void DeviceMirror::Synchronize() {}

struct NcclBaseline::Impl {};
NcclBaseline::NcclBaseline(Store&, const std::string&, int, int, int) {
  throw std::runtime_error(
      "--baseline nccl needs a build with CUDA and NCCL (cmake -DCOLLECTIVES_WITH_NCCL=ON)");
}
NcclBaseline::~NcclBaseline() = default;
void NcclBaseline::Issue(Collective, DataType, ReduceOp, int, const Tensor&, const Tensor&, int) {}
double NcclBaseline::TimeIssued(Collective, DataType, ReduceOp, int, const Tensor&,
                                const Tensor&, int) {
  return 0;
}
void NcclBaseline::Synchronize() {}

#else

namespace {

void CheckCuda(const nccl::NcclApi& api, cudaError_t status, const char* call) {
  if (status == cudaSuccess) return;
  throw std::runtime_error(std::string(call) + ": " + api.cudaGetErrorString(status));
}

void CheckNccl(const nccl::NcclApi& api, ncclResult_t status, const char* call) {
  if (status == ncclSuccess) return;
  throw std::runtime_error(std::string(call) + ": " + api.ncclGetErrorString(status) + " (" +
                           api.ncclGetLastError(nullptr) + ")");
}

}  // namespace

bool DeviceBuffersBuilt() { return true; }

struct DeviceMirror::Impl {
  const nccl::NcclApi* api = nullptr;
  int device = 0;
  const uint8_t* host_send = nullptr;
  size_t send_bytes = 0;
  const uint8_t* host_recv = nullptr;
  size_t recv_bytes = 0;
  uint8_t* send = nullptr;
  uint8_t* recv = nullptr;

  uint8_t* Map(const void* host) const {
    const auto* p = static_cast<const uint8_t*>(host);
    if (p >= host_recv && p <= host_recv + recv_bytes) return recv + (p - host_recv);
    if (p >= host_send && p <= host_send + send_bytes) return send + (p - host_send);
    throw std::logic_error("a host view outside the mirrored buffers");
  }
};

DeviceMirror::DeviceMirror(int rank, const void* host_send, size_t send_bytes,
                           const void* host_recv, size_t recv_bytes)
    : impl_(std::make_unique<Impl>()) {
  std::string reason;
  impl_->api = nccl::TryLoadCudart(&reason);
  if (impl_->api == nullptr) throw std::runtime_error("--device cuda: " + reason);
  const nccl::NcclApi& api = *impl_->api;
  impl_->device = rank % api.device_count;
  impl_->host_send = static_cast<const uint8_t*>(host_send);
  impl_->send_bytes = send_bytes;
  impl_->host_recv = static_cast<const uint8_t*>(host_recv);
  impl_->recv_bytes = recv_bytes;
  CheckCuda(api, api.cudaSetDevice(impl_->device), "cudaSetDevice");
  void* memory = nullptr;
  if (send_bytes > 0) {
    CheckCuda(api, api.cudaMalloc(&memory, send_bytes), "cudaMalloc (the send buffer)");
    impl_->send = static_cast<uint8_t*>(memory);
  }
  CheckCuda(api, api.cudaMalloc(&memory, recv_bytes), "cudaMalloc (the receive buffer)");
  impl_->recv = static_cast<uint8_t*>(memory);
}

DeviceMirror::~DeviceMirror() {
  if (impl_->send != nullptr) impl_->api->cudaFree(impl_->send);
  if (impl_->recv != nullptr) impl_->api->cudaFree(impl_->recv);
}

int DeviceMirror::device() const { return impl_->device; }

Tensor DeviceMirror::OnDevice(const Tensor& host) const {
  Tensor t = host;
  t.data = impl_->Map(host.data);
  t.device = Device::Cuda(impl_->device);
  return t;
}

void DeviceMirror::Upload(const Tensor& host) {
  if (host.bytes() == 0) return;
  CheckCuda(*impl_->api,
            impl_->api->cudaMemcpy(impl_->Map(host.data), host.data, host.bytes(),
                                   cudaMemcpyHostToDevice),
            "cudaMemcpy (host to device)");
  Synchronize();
}

void DeviceMirror::Download(const Tensor& host) {
  if (host.bytes() == 0) return;
  Synchronize();
  CheckCuda(*impl_->api,
            impl_->api->cudaMemcpy(host.data, impl_->Map(host.data), host.bytes(),
                                   cudaMemcpyDeviceToHost),
            "cudaMemcpy (device to host)");
}

void DeviceMirror::Synchronize() {
  CheckCuda(*impl_->api, impl_->api->cudaSetDevice(impl_->device), "cudaSetDevice");
  CheckCuda(*impl_->api, impl_->api->cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

struct NcclBaseline::Impl {
  const nccl::NcclApi* api = nullptr;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
};

NcclBaseline::NcclBaseline(Store& store, const std::string& key, int rank, int size, int device)
    : impl_(std::make_unique<Impl>()) {
  std::string reason;
  impl_->api = nccl::TryLoadNccl(&reason);
  if (impl_->api == nullptr) throw std::runtime_error("--baseline nccl: " + reason);
  const nccl::NcclApi& api = *impl_->api;
  impl_->device = device;
  ncclUniqueId id;
  if (rank == 0) {
    CheckNccl(api, api.ncclGetUniqueId(&id), "ncclGetUniqueId");
    store.Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  } else {
    const std::string value = store.Get(key, std::chrono::seconds(60));
    if (value.size() != sizeof(id)) throw std::runtime_error("--baseline nccl: a bad unique id");
    std::memcpy(&id, value.data(), sizeof(id));
  }
  CheckCuda(api, api.cudaSetDevice(device), "cudaSetDevice");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;  // blocking, as nccl-tests
  CheckNccl(api, api.ncclCommInitRankConfig(&impl_->comm, size, id, rank, &config),
            "ncclCommInitRankConfig");
  CheckCuda(api, api.cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags");
}

NcclBaseline::~NcclBaseline() {
  const nccl::NcclApi& api = *impl_->api;
  if (impl_->stream != nullptr) {
    api.cudaStreamSynchronize(impl_->stream);
    api.cudaStreamDestroy(impl_->stream);
  }
  if (impl_->comm != nullptr) {
    api.ncclCommFinalize(impl_->comm);
    api.ncclCommDestroy(impl_->comm);
  }
}

void NcclBaseline::Issue(Collective collective, DataType dtype, ReduceOp op, int root,
                         const Tensor& send, const Tensor& recv, int calls) {
  const nccl::NcclApi& api = *impl_->api;
  const ncclDataType_t type = nccl::ToNcclDataType(dtype);
  for (int i = 0; i < calls; ++i) {
    switch (collective) {
      case Collective::kAllReduce:
        CheckNccl(api,
                  api.ncclAllReduce(send.data, recv.data, recv.count, type,
                                    nccl::ToNcclRedOp(op), impl_->comm, impl_->stream),
                  "ncclAllReduce");
        break;
      case Collective::kBroadcast:
        CheckNccl(api,
                  api.ncclBroadcast(send.data, recv.data, recv.count, type, root, impl_->comm,
                                    impl_->stream),
                  "ncclBroadcast");
        break;
      case Collective::kAllGather:
        CheckNccl(api,
                  api.ncclAllGather(send.data, recv.data, send.count, type, impl_->comm,
                                    impl_->stream),
                  "ncclAllGather");
        break;
      case Collective::kReduceScatter:
        CheckNccl(api,
                  api.ncclReduceScatter(send.data, recv.data, recv.count, type,
                                        nccl::ToNcclRedOp(op), impl_->comm, impl_->stream),
                  "ncclReduceScatter");
        break;
    }
  }
}

void NcclBaseline::Synchronize() {
  CheckCuda(*impl_->api, impl_->api->cudaStreamSynchronize(impl_->stream),
            "cudaStreamSynchronize");
}

double NcclBaseline::TimeIssued(Collective collective, DataType dtype, ReduceOp op, int root,
                                const Tensor& send, const Tensor& recv, int iters) {
  const auto start = std::chrono::steady_clock::now();
  Issue(collective, dtype, op, root, send, recv, iters);
  Synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
}

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace collectives::perf
