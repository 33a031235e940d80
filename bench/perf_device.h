// collectives_perf's --device cuda and --baseline nccl: the sweep's buffers on this rank's CUDA
// device, mirrored by the host buffers that --check fills and reads, and the raw NCCL baseline
// (nccl-tests' method: -n calls queued on one stream, then one synchronise) on the same device
// buffers. CUDA comes through the library's run-time loader (src/nccl/nccl_loader.h); a build
// without NCCL, or a machine without a driver, gets a clear error, never a crash.
//
// Thread-safety: one thread (the rank's).
#ifndef COLLECTIVES_BENCH_PERF_DEVICE_H_
#define COLLECTIVES_BENCH_PERF_DEVICE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "bench/perf_options.h"
#include "collectives/collectives.h"

namespace collectives::perf {

// Whether this build can put buffers on a CUDA device (built with -DCOLLECTIVES_WITH_NCCL=ON).
bool DeviceBuffersBuilt();

class DeviceMirror {
 public:
  // Device copies of the host buffers [host_send, +send_bytes) and [host_recv, +recv_bytes) on
  // CUDA device rank % visible devices. Throws std::runtime_error naming why when there is no
  // usable CUDA.
  DeviceMirror(int rank, const void* host_send, size_t send_bytes, const void* host_recv,
               size_t recv_bytes);
  ~DeviceMirror();
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;

  int device() const;
  // `host` (a view into either host buffer) as the same view of the device copy.
  Tensor OnDevice(const Tensor& host) const;
  // The bytes of `host` to the device copy, and back.
  void Upload(const Tensor& host);
  void Download(const Tensor& host);
  // Waits for everything queued on the device.
  void Synchronize();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Raw NCCL on the same buffers: one communicator of its own (its unique id through `store` under
// `key`), one stream.
class NcclBaseline {
 public:
  NcclBaseline(Store& store, const std::string& key, int rank, int size, int device);
  ~NcclBaseline();
  NcclBaseline(const NcclBaseline&) = delete;
  NcclBaseline& operator=(const NcclBaseline&) = delete;

  // Queues `warmup` calls, synchronises, `barrier()`, then times `iters` calls queued back to
  // back and one synchronise: seconds per call on this rank. send and recv are device views.
  template <typename Barrier>
  double Time(Collective collective, DataType dtype, ReduceOp op, int root, const Tensor& send,
              const Tensor& recv, int warmup, int iters, const Barrier& barrier) {
    Issue(collective, dtype, op, root, send, recv, warmup);
    Synchronize();
    barrier();
    return TimeIssued(collective, dtype, op, root, send, recv, iters);
  }

 private:
  void Issue(Collective collective, DataType dtype, ReduceOp op, int root, const Tensor& send,
             const Tensor& recv, int calls);
  double TimeIssued(Collective collective, DataType dtype, ReduceOp op, int root,
                    const Tensor& send, const Tensor& recv, int iters);
  void Synchronize();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace collectives::perf

#endif  // COLLECTIVES_BENCH_PERF_DEVICE_H_
