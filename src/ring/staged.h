// CUDA tensors on the RING implementation (and on AUTO's paths over TCP): the device memory is
// staged through page-locked host memory, one segment at a time, and the ring's algorithms run
// on the host copy of each segment.
//
// The schedule, per call: the tensor is cut into segments that fill one staging slot (slot_bytes,
// COLLECTIVES_CUDA_STAGING_BYTES, default kDefaultCudaStagingBytes). There are two slots. The
// device-to-host copies of segment k+1 are queued on a copy stream of the device before the ring
// works on segment k, and the host-to-device copies of segment k are queued once it is done, so
// while the ring reduces segment k the stream brings segment k+1 in and takes segment k-1 out.
// The stream runs its copies in order, so a slot is refilled only after its last result has
// left. The extra host memory is the two slots (2 x slot_bytes, pinned, per device and
// communicator, allocated at the first CUDA call and kept), never a copy of the tensor.
//
// The copy stream is a blocking one: it waits for the work queued on the device's legacy default
// stream before the call, and no other stream; the call's result is on the device when Run
// returns.
//
// Every rank cuts the same segments: the segment size depends only on slot_bytes, the dtype, the
// world size and the call (how many blocks a slot holds; for a message, how many of its frames),
// so every rank must run with the same COLLECTIVES_CUDA_STAGING_BYTES. The calls' plans and
// works are in ring_communication.cc (RunSegments); docs/gpu.md has what a slot holds per call.
//
// Without CUDA (a build without -DCOLLECTIVES_WITH_NCCL, or libcudart missing, or no device)
// Open throws Error(kNotSupported) naming why.
//
// Thread-safety: Open and CheckDeviceMemory from any thread; Run by one thread at a time (the
// communicator's calls run one at a time).
#ifndef COLLECTIVES_SRC_RING_STAGED_H_
#define COLLECTIVES_SRC_RING_STAGED_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/types.h"

namespace collectives::ring {

// Bytes of one staging slot unless COLLECTIVES_CUDA_STAGING_BYTES says otherwise: large enough
// that a segment is many of the ring's chunks (kDefaultChunkBytes), small enough that the two
// slots of each device stay a few MiB of pinned memory.
inline constexpr size_t kDefaultCudaStagingBytes = 4 * 1024 * 1024;

// The slot size in force: COLLECTIVES_CUDA_STAGING_BYTES when set to a count of at least 64,
// else kDefaultCudaStagingBytes.
size_t CudaStagingBytes();

class CudaStaging {
 public:
  // One copy of a segment: `bytes` between host slot offset `host_offset` and `device`.
  struct Copy {
    size_t host_offset;
    void* device;
    size_t bytes;
  };
  // Fills the copies into the slot (`in`) and out of it (`out`) of segment k.
  using Plan = std::function<void(size_t k, std::vector<Copy>* in, std::vector<Copy>* out)>;
  // Runs the ring on segment k, whose inputs are in `slot`, leaving its outputs there.
  using Work = std::function<void(size_t k, uint8_t* slot)>;

  // The staging of CUDA device `device` with two slots of `slot_bytes`: a copy stream and the
  // pinned slots. Throws Error(kNotSupported) without CUDA, Error(kSystem) when CUDA refuses.
  static std::shared_ptr<CudaStaging> Open(int device, size_t slot_bytes);

  virtual ~CudaStaging() = default;
  virtual int device() const = 0;
  virtual size_t slot_bytes() const = 0;

  // Throws Error(kInvalidArgument), starting with `prefix`, unless `t` (count > 0) is memory of
  // CUDA device t.device.index (device or managed memory).
  virtual void CheckDeviceMemory(const std::string& prefix, const Tensor& t) const = 0;

  // Runs `segments` segments as the file comment says; returns once every copy out has landed.
  // A CUDA failure throws Error(kSystem) naming `what`; the deadline passing while a copy is
  // awaited throws Error(kTimeout).
  virtual void Run(size_t segments, const Plan& plan, const Work& work,
                   std::chrono::steady_clock::time_point deadline, const std::string& what) = 0;
};

}  // namespace collectives::ring

#endif  // COLLECTIVES_SRC_RING_STAGED_H_
