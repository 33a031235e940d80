// Helpers of the tests of CUDA tensors (tests/ring/staged_test.cc, staged_collectives_test.cc,
// tests/hierarchical/auto_device_test.cc): the small staging slot, the check that CUDA is there
// (or the skip that says why), a device buffer, a collective checked on it, each rank's wrong
// elements, the fake CUDA's copy counters and the staging bound they show.
#ifndef COLLECTIVES_TESTS_RING_STAGED_DEVICE_H_
#define COLLECTIVES_TESTS_RING_STAGED_DEVICE_H_

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "collectives/communication.h"
#include "collectives/types.h"
#include "src/nccl/nccl_loader.h"
#include "tests/ring/collective_checks.h"

namespace collectives::testing {

// Before the first CUDA tensor reads it (CudaStagingBytes reads it once).
inline const bool kSlotSet = [] {
  setenv("COLLECTIVES_CUDA_STAGING_BYTES", "4096", /*overwrite=*/0);
  return true;
}();

inline bool GpuRequired() {
  const char* value = std::getenv("COLLECTIVES_REQUIRE_GPU");
  return value != nullptr && std::string(value) == "1";
}

// The CUDA runtime with at least `devices` devices as `api`, else skip (or fail where required).
#define COLLECTIVES_REQUIRE_CUDA_DEVICES(devices)                                        \
  std::string cuda_reason;                                                               \
  const nccl::NcclApi* api_ptr = nccl::TryLoadCudart(&cuda_reason);                      \
  if (api_ptr != nullptr && api_ptr->device_count < (devices)) {                         \
    cuda_reason = "fewer than " + std::to_string(devices) + " CUDA devices";             \
    api_ptr = nullptr;                                                                   \
  }                                                                                      \
  if (api_ptr == nullptr) {                                                              \
    if (GpuRequired()) GTEST_FAIL() << "COLLECTIVES_REQUIRE_GPU=1, but " << cuda_reason; \
    GTEST_SKIP() << cuda_reason;                                                         \
  }                                                                                      \
  const nccl::NcclApi& api = *api_ptr

// The CUDA runtime as `api`, else skip (or fail where required).
#define COLLECTIVES_REQUIRE_CUDA() COLLECTIVES_REQUIRE_CUDA_DEVICES(0)

// A device buffer of `count` elements of `dtype`, filled from and read back into host memory.
class DeviceBuffer {
 public:
  DeviceBuffer(const nccl::NcclApi& api, int device, DataType dtype, size_t count)
      : api_(api), device_(device), dtype_(dtype), bytes_(count * SizeOf(dtype)), count_(count) {
    EXPECT_EQ(api_.cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(api_.cudaMalloc(&data_, std::max<size_t>(bytes_, 1)), cudaSuccess);
  }
  ~DeviceBuffer() { api_.cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void Upload(const void* host) {
    if (bytes_ > 0) {
      EXPECT_EQ(api_.cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  void Upload(const std::vector<uint8_t>& host) { Upload(host.data()); }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> host(bytes_);
    if (bytes_ > 0) {
      EXPECT_EQ(api_.cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }
  Tensor tensor(size_t offset = 0, size_t elements = SIZE_MAX) const {
    const size_t n = elements == SIZE_MAX ? count_ - offset : elements;
    return Tensor{static_cast<uint8_t*>(data_) + offset * SizeOf(dtype_), n, dtype_,
                  Device::Cuda(device_)};
  }

 private:
  const nccl::NcclApi& api_;
  int device_;
  DataType dtype_;
  size_t bytes_;
  size_t count_;
  void* data_ = nullptr;
};

using CopyStats = void (*)(uint64_t* stats);
using ResetCopyStats = void (*)();

struct FakeCounters {
  CopyStats stats = nullptr;
  ResetCopyStats reset = nullptr;
};

inline FakeCounters FindFakeCounters() {
  FakeCounters found;
  if (nccl::TryLoadCudart() == nullptr) return found;
  for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
    void* handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    found.stats = reinterpret_cast<CopyStats>(dlsym(handle, "collectivesFakeCudaCopyStats"));
    found.reset =
        reinterpret_cast<ResetCopyStats>(dlsym(handle, "collectivesFakeCudaResetCopyStats"));
    dlclose(handle);  // the loader keeps it loaded
    if (found.stats != nullptr && found.reset != nullptr) return found;
  }
  return FakeCounters{};
}

// One collective on CUDA tensors of `device`, with collective_checks.h's inputs, its result
// against the reference computed on the host. An average may differ from the reference by
// `avg_tolerance` relative (at least that much absolute); every other result must be exact.
inline CheckResult CheckCollectiveOnDevice(const nccl::NcclApi& api, CollectiveCommunication& comm,
                                           int device, const std::string& collective,
                                           DataType dtype, ReduceOp op, size_t count,
                                           bool in_place, int root, double avg_tolerance) {
  const int n = comm.size(), rank = comm.rank();
  const std::string what = "rank " + std::to_string(rank) + " cuda:" + std::to_string(device) +
                           " " + collective + " " + ToString(dtype) + " " + ToString(op) +
                           " count=" + std::to_string(count) + (in_place ? " in-place" : "") +
                           " root=" + std::to_string(root);
  CheckResult result;
  const size_t e = SizeOf(dtype), whole = count * size_t(n);
  const bool blocks = collective == "all_gather" || collective == "reduce_scatter";
  DeviceBuffer send(api, device, dtype, blocks ? whole : count);
  DeviceBuffer recv(api, device, dtype, blocks ? whole : count);
  std::vector<uint8_t> host((blocks ? whole : count) * e, 0);
  if (collective == "all_reduce") {
    for (size_t i = 0; i < count; ++i) Store(dtype, host.data(), i, InputValue(op, dtype, rank, i));
    (in_place ? recv : send).Upload(host);
    comm.AllReduce((in_place ? recv : send).tensor(0, count), recv.tensor(0, count), op);
    const std::vector<uint8_t> got = recv.Download();
    for (size_t i = 0; i < count; ++i) {
      const double want = Expected(op, dtype, n, i), value = Load(dtype, got.data(), i);
      const double slack =
          op == ReduceOp::kAvg ? avg_tolerance * std::max(1.0, std::abs(want)) : 0;
      if (!(std::abs(value - want) <= slack)) result.Note(what, i, value, want);
    }
  } else if (collective == "broadcast") {
    if (rank == root) {
      for (size_t i = 0; i < count; ++i) {
        Store(dtype, host.data(), i, InputValue(op, dtype, root, i));
      }
      (in_place ? recv : send).Upload(host);
    }
    comm.Broadcast(rank == root ? (in_place ? recv : send).tensor(0, count) : Tensor{},
                   recv.tensor(0, count), root);
    const std::vector<uint8_t> got = recv.Download();
    for (size_t i = 0; i < count; ++i) {
      const double want = Stored(dtype, InputValue(op, dtype, root, i));
      const double value = Load(dtype, got.data(), i);
      if (value != want) result.Note(what, i, value, want);
    }
  } else if (collective == "all_gather") {
    for (size_t i = 0; i < count; ++i) {
      Store(dtype, host.data(), (in_place ? size_t(rank) * count : 0) + i,
            InputValue(op, dtype, rank, i));
    }
    (in_place ? recv : send).Upload(host);
    comm.AllGather(in_place ? recv.tensor(size_t(rank) * count, count) : send.tensor(0, count),
                   recv.tensor(0, whole));
    const std::vector<uint8_t> got = recv.Download();
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) {
        const size_t at = size_t(r) * count + i;
        const double want = Stored(dtype, InputValue(op, dtype, r, i));
        const double value = Load(dtype, got.data(), at);
        if (value != want) result.Note(what, at, value, want);
      }
    }
  } else if (collective == "reduce_scatter") {
    for (size_t i = 0; i < whole; ++i) Store(dtype, host.data(), i, InputValue(op, dtype, rank, i));
    send.Upload(host);
    const Tensor output =
        in_place ? send.tensor(size_t(rank) * count, count) : recv.tensor(0, count);
    comm.ReduceScatter(send.tensor(0, whole), output, op);
    const std::vector<uint8_t> all = (in_place ? send : recv).Download();
    const uint8_t* got = all.data() + (in_place ? size_t(rank) * count * e : 0);
    for (size_t i = 0; i < count; ++i) {
      const double want = Expected(op, dtype, n, size_t(rank) * count + i);
      const double value = Load(dtype, got, i);
      if (value != want) result.Note(what, i, value, want);
    }
  }
  return result;
}

// Each rank's wrong elements over its checks and the first of them, noted from the ranks' threads
// (each thread notes only its own rank's).
class RankChecks {
 public:
  explicit RankChecks(size_t ranks) : wrong_(ranks, 0), first_(ranks) {}
  void Note(int rank, const CheckResult& result) {
    const size_t r = size_t(rank);
    wrong_[r] += result.wrong;
    if (result.wrong > 0 && first_[r].empty()) first_[r] = result.first;
  }
  // No rank has a wrong element; a failure names each rank's first.
  void ExpectNoneWrong() const {
    for (size_t r = 0; r < wrong_.size(); ++r) {
      EXPECT_EQ(wrong_[r], 0u) << "rank " << r << ": " << first_[r];
    }
  }

 private:
  std::vector<size_t> wrong_;
  std::vector<std::string> first_;
};

// Runs `run` (the ranks' calls on `devices` devices' tensors) between two readings of the fake
// CUDA's counters, and checks the staging bound: no copy between host and device larger than
// `slot`, `crossing` bytes between them in all, no copy with a pageable host side, at most two
// slots of pinned memory per rank at once and none left allocated after.
inline void ExpectStagingBound(const nccl::NcclApi& api, const FakeCounters& fake, int ranks,
                               size_t slot, uint64_t crossing, const std::function<void()>& run) {
  for (int r = 0; r < ranks; ++r) {
    ASSERT_EQ(api.cudaSetDevice(r % api.device_count), cudaSuccess);
    ASSERT_EQ(api.cudaDeviceSynchronize(), cudaSuccess);
  }
  fake.reset();
  uint64_t before[6];
  fake.stats(before);
  run();
  uint64_t after[6];
  fake.stats(after);
  EXPECT_LE(after[1], slot) << "largest single copy between host and device";
  EXPECT_EQ(after[0], crossing) << "bytes copied between host and device";
  EXPECT_EQ(after[3], 0u) << "copies with a pageable host side";
  // Each communicator opened its two slots for its device and freed them when it went.
  EXPECT_LE(after[5] - before[4], size_t(ranks) * 2 * slot) << "peak pinned bytes";
  EXPECT_EQ(after[4], before[4]) << "pinned bytes left allocated";
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_RING_STAGED_DEVICE_H_
