// The CUDA runtime and NCCL as the strategy layer uses them for GPU replicas: counting the
// visible devices, device memory for mirrored variables, copies between host and device, and
// the NCCL communicator that joins the local replicas of one process.
//
// Everything goes through the tables of src/nccl/nccl_loader.h (libcudart and libnccl opened at
// run time), so a build without CUDA or NCCL, or a machine without a GPU, still builds and runs
// CPU replicas; asking it for a CUDA device raises Error(kNotSupported) naming why.
//
// Thread-safety: every function may be called from any thread. Each sets the device it works
// on as the calling thread's current device.
#ifndef COLLECTIVES_SRC_STRATEGY_DEVICE_H_
#define COLLECTIVES_SRC_STRATEGY_DEVICE_H_

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communication.h"
#include "collectives/types.h"

namespace collectives::strategy::internal {

// The CUDA devices this process sees. Throws Error(kNotSupported) "<who>: CUDA is not
// available: <why>" when the build has no CUDA support, libcudart cannot be loaded or no device
// is visible.
int CudaDeviceCount(const std::string& who);

// Empty when NCCL is usable here; else why not (the loader's reason, or that the build has no
// NCCL).
std::string NcclUnavailableReason();

// `bytes` of memory on CUDA device `device` (cudaMalloc), freed (cudaFree) with the last
// reference. Error(kNotSupported) without CUDA; Error(kSystem) when the allocation fails.
std::shared_ptr<void> AllocateOnDevice(const Device& device, size_t bytes);

// Synchronous copies (cudaMemcpy on the legacy default stream) between host memory and memory
// of `device`. CopyToHost returns once the bytes are in `dst`; CopyToDevice returns once `src`
// may be reused (the copy itself is ordered before later work on the device's streams).
void CopyToDevice(const Device& device, void* dst, const void* src, size_t bytes);
void CopyToHost(const Device& device, void* dst, const void* src, size_t bytes);

// One NCCL communicator per device, rank i on devices[i] (each a distinct CUDA device), joined
// through an in-process memory store; built on one thread per rank, since NCCL's set-up blocks
// until every rank has joined. Error(kNotSupported) naming why when NCCL is not usable.
std::vector<std::unique_ptr<CollectiveCommunication>> CreateLocalNccl(
    const std::vector<Device>& devices, std::chrono::milliseconds timeout, const std::string& who);

}  // namespace collectives::strategy::internal

#endif  // COLLECTIVES_SRC_STRATEGY_DEVICE_H_
