// Lazy loading of the CUDA runtime and NCCL. The library is compiled against their headers only
// and links neither: the first NCCL communicator, the first CUDA tensor a RING communicator
// stages (libcudart alone), or a test dlopens libcudart and libnccl and looks up the few
// functions below. A build with NCCL therefore still loads, and its RING
// communicators still run, on a machine without CUDA; asking it for NCCL there raises
// Error(kNotSupported, "NCCL is not available: <why>").
//
// Thread-safety: the Load and TryLoad functions may be called from any thread; the table is built once
// and never changes (the libraries are never unloaded).
#ifndef COLLECTIVES_SRC_NCCL_NCCL_LOADER_H_
#define COLLECTIVES_SRC_NCCL_NCCL_LOADER_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>

namespace collectives::nccl {

// The functions used from libcudart: X(name).
#define COLLECTIVES_CUDART_FUNCTIONS(X) \
  X(cudaGetDeviceCount)                 \
  X(cudaGetErrorString)                 \
  X(cudaGetLastError)                   \
  X(cudaGetDevice)                      \
  X(cudaSetDevice)                      \
  X(cudaDeviceSynchronize)              \
  X(cudaPointerGetAttributes)           \
  X(cudaStreamCreateWithFlags)          \
  X(cudaStreamDestroy)                  \
  X(cudaStreamSynchronize)              \
  X(cudaEventCreateWithFlags)           \
  X(cudaEventDestroy)                   \
  X(cudaEventRecord)                    \
  X(cudaEventQuery)                     \
  X(cudaFree)                           \
  X(cudaMemcpy)                         \
  X(cudaMemset)                         \
  X(cudaMemcpyAsync)                    \
  X(cudaFreeHost)                       \
  X(cudaEventSynchronize)               \
  X(cudaStreamWaitEvent)                \
  X(cudaDeviceGetPCIBusId)

// The functions used from libnccl: X(name).
#define COLLECTIVES_NCCL_FUNCTIONS(X) \
  X(ncclGetVersion)                   \
  X(ncclGetUniqueId)                  \
  X(ncclCommInitRankConfig)           \
  X(ncclCommGetAsyncError)            \
  X(ncclCommFinalize)                 \
  X(ncclCommDestroy)                  \
  X(ncclCommAbort)                    \
  X(ncclGetErrorString)               \
  X(ncclGetLastError)                 \
  X(ncclAllReduce)                    \
  X(ncclBroadcast)                    \
  X(ncclAllGather)                    \
  X(ncclReduceScatter)                \
  X(ncclReduce)                       \
  X(ncclSend)                         \
  X(ncclRecv)                         \
  X(ncclGroupStart)                   \
  X(ncclGroupEnd)

// One pointer per function, named as the function (api.ncclAllReduce(...)).
struct NcclApi {
#define COLLECTIVES_NCCL_DECLARE_POINTER(name) decltype(&::name) name = nullptr;
  COLLECTIVES_CUDART_FUNCTIONS(COLLECTIVES_NCCL_DECLARE_POINTER)
  COLLECTIVES_NCCL_FUNCTIONS(COLLECTIVES_NCCL_DECLARE_POINTER)
#undef COLLECTIVES_NCCL_DECLARE_POINTER
  // Spelled out: C++ sees cudaMalloc overloaded (a template beside the C function).
  cudaError_t (*cudaMalloc)(void** pointer, size_t bytes) = nullptr;
  cudaError_t (*cudaHostAlloc)(void** pointer, size_t bytes, unsigned int flags) = nullptr;
  int device_count = 0;  // CUDA devices visible to this process (at least 1)
  int nccl_version = 0;  // ncclGetVersion's code, e.g. 22805; 0 in LoadCudart's table
};

// The oldest NCCL with non-blocking communicators and ncclCommFinalize.
inline constexpr int kMinNcclVersion = NCCL_VERSION(2, 14, 0);

// The table, loading the libraries on the first call. Throws Error(kNotSupported,
// "NCCL is not available: ...") when a library or a function is missing, NCCL is older than
// kMinNcclVersion, or the CUDA runtime reports no usable device (no driver, no GPU); every call
// then throws the same.
const NcclApi& LoadNccl();

// The same without throwing: the table, or null with *reason (if given) set to the message
// LoadNccl would throw.
const NcclApi* TryLoadNccl(std::string* reason = nullptr);

// The CUDA runtime alone, for the RING implementation's staging of CUDA tensors through pinned
// host memory (src/ring/staged.h): the table with its libcudart half filled (its NCCL pointers
// are null unless TryLoadNccl succeeds too), or Error(kNotSupported, "CUDA is not available:
// ...") when libcudart or one of its functions is missing or no device is visible. libnccl is
// not needed.
const NcclApi& LoadCudart();
const NcclApi* TryLoadCudart(std::string* reason = nullptr);

}  // namespace collectives::nccl

#endif  // COLLECTIVES_SRC_NCCL_NCCL_LOADER_H_
