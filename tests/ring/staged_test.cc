// RING and AUTO on CUDA tensors, staged through pinned host memory (src/ring/staged.h): every
// staged collective, dtype and op at odd counts on 1-4 ranks, checked element by element against
// the local reference of collective_checks.h; the copies stay within the staging bound (no
// whole-tensor host copy); the refusals name their reason.
//
// These tests need libcudart and a device: on a GPU machine (ctest label gpu, every rank on
// device rank % devices) or against the CPU stand-in of tests/nccl/fake ("fake_nccl:" entries,
// one fake device per rank). Without either they skip, saying why, or fail where
// COLLECTIVES_REQUIRE_GPU=1. The staging slot is made small (COLLECTIVES_CUDA_STAGING_BYTES,
// 4096 bytes unless set) so that modest tensors cross many segments.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <iostream>

#include "collectives/communication.h"
#include "src/ring/staged.h"
#include "tests/ring/collective_checks.h"
#include "tests/ring/run_ranks.h"
#include "tests/scoped_env.h"
#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#include "tests/ring/staged_device.h"
#endif

namespace collectives::testing {
namespace {

CommunicationOptions SmallChunks() {
  CommunicationOptions options;
  options.chunk_bytes = 1024;  // several of the ring's chunks per staged segment
  options.timeout = std::chrono::seconds(60);
  return options;
}

// Why CUDA is not usable here, or "" when it is.
std::string CudaUnavailableReason() {
#ifdef COLLECTIVES_WITH_NCCL
  std::string reason;
  return nccl::TryLoadCudart(&reason) != nullptr ? std::string() : reason;
#else
  return "this library is built without CUDA";
#endif
}

// Without a usable CUDA runtime (no libcudart, no driver, no device, or a build without CUDA) a
// CUDA tensor is refused with kNotSupported naming why, and the communicator keeps working on
// CPU tensors: never a crash.
TEST(StagedUnavailableTest, WithoutCudaACudaTensorIsNotSupported) {
  const std::string reason = CudaUnavailableReason();
  if (reason.empty()) GTEST_SKIP() << "CUDA is usable here: nothing to refuse";
  std::cout << "loader's reason: " << reason << "\n";
  RunRanks(Transport::kInProcess, 2, SmallChunks(), [&](CollectiveCommunication& comm) {
    alignas(8) static thread_local float fake_device[4];
    const Tensor t{fake_device, 4, DataType::kFloat32, Device::Cuda(0)};
    try {
      comm.AllReduce(t, t, ReduceOp::kSum);
      ADD_FAILURE() << "expected kNotSupported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotSupported) << e.what();
      EXPECT_NE(e.message().find("CUDA is not available"), std::string::npos) << e.what();
    }
    std::vector<float> host(4, float(comm.rank() + 1));
    const Tensor h{host.data(), 4, DataType::kFloat32};
    comm.AllReduce(h, h, ReduceOp::kSum);
    EXPECT_EQ(host[3], 3.0f);
  });
}

#ifdef COLLECTIVES_WITH_NCCL

// One collective on CUDA tensors of this rank's device, checked as CheckCollective checks the
// CPU path (the inputs and the reference are the same).
CheckResult CheckOnDevice(const nccl::NcclApi& api, CollectiveCommunication& comm,
                          const std::string& collective, DataType dtype, ReduceOp op,
                          size_t count, bool in_place, int root = 0) {
  return CheckCollectiveOnDevice(api, comm, comm.rank() % api.device_count, collective, dtype, op,
                                 count, in_place, root, /*avg_tolerance=*/0);
}

// ---- Every collective, dtype and op on 1-4 ranks ----

class StagedMatrixTest : public ::testing::TestWithParam<int> {};

TEST_P(StagedMatrixTest, EveryCollectiveDtypeAndOpAtOddCounts) {
  COLLECTIVES_REQUIRE_CUDA();
  const int size = GetParam();
  // 0, 1, a prime that crosses a few segments, and (below) a large prime that crosses many.
  const std::vector<size_t> counts = {0, 1, 1009};
  const size_t large = 100003;
  RankChecks checks{size_t(size)};
  RunRanks(Transport::kInProcess, size, SmallChunks(), [&](CollectiveCommunication& comm) {
    auto run = [&](const std::string& c, DataType d, ReduceOp o, size_t count, bool in_place,
                   int root) {
      checks.Note(comm.rank(), CheckOnDevice(api, comm, c, d, o, count, in_place, root));
    };
    for (const std::string& c : AllCollectives()) {
      const bool reduces = c == "all_reduce" || c == "reduce_scatter";
      for (DataType d : AllDataTypes()) {
        for (ReduceOp o : AllReduceOps()) {
          if (!reduces && o != ReduceOp::kSum) continue;
          for (size_t count : counts) {
            for (bool in_place : {false, true}) {
              run(c, d, o, count, in_place, c == "broadcast" ? int(count % size_t(size)) : 0);
            }
          }
        }
      }
    }
    run("all_reduce", DataType::kFloat32, ReduceOp::kSum, large, false, 0);
    run("all_reduce", DataType::kFloat16, ReduceOp::kAvg, large, true, 0);
    run("all_reduce", DataType::kInt64, ReduceOp::kMax, large, false, 0);
    run("all_reduce", DataType::kInt8, ReduceOp::kProd, large, true, 0);
    run("broadcast", DataType::kInt32, ReduceOp::kSum, large, false, size - 1);
    run("all_gather", DataType::kBFloat16, ReduceOp::kSum, large / size_t(size) + 1, true, 0);
    run("reduce_scatter", DataType::kFloat64, ReduceOp::kMin, large / size_t(size) + 1, false,
        0);
    run("reduce_scatter", DataType::kUInt8, ReduceOp::kSum, large / size_t(size) + 1, true, 0);
  });
  checks.ExpectNoneWrong();
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, StagedMatrixTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "ranks" + std::to_string(p.param);
                         });

// ---- Over TCP and through AUTO with NCCL turned off (the staged ring, as without NCCL) ----

class StagedTransportTest : public ::testing::TestWithParam<Transport> {};

TEST_P(StagedTransportTest, AllFourCollectivesOnThreeRanks) {
  COLLECTIVES_REQUIRE_CUDA();
  // AUTO's plan with NCCL is tests/hierarchical/auto_device_test.cc's.
  ScopedEnv staged("COLLECTIVES_AUTO_NCCL", "0");
  const int size = 3;
  RankChecks checks{size_t(size)};
  RunRanks(GetParam(), size, SmallChunks(), [&](CollectiveCommunication& comm) {
    for (const std::string& c : AllCollectives()) {
      for (size_t count : {size_t(1), size_t(5003)}) {
        checks.Note(comm.rank(),
                    CheckOnDevice(api, comm, c, DataType::kFloat32,
                                  c == "all_reduce" ? ReduceOp::kAvg : ReduceOp::kSum, count,
                                  count == 1, 1));
      }
    }
  });
  checks.ExpectNoneWrong();
}

INSTANTIATE_TEST_SUITE_P(Transports, StagedTransportTest,
                         ::testing::Values(Transport::kTcp, Transport::kAuto),
                         [](const ::testing::TestParamInfo<Transport>& p) {
                           return std::string(TransportName(p.param));
                         });

// ---- The staging bound, as the fake counts the copies (skipped on a real GPU) ----

// No copy between host and device is larger than one slot, the bytes that cross are the tensor's
// once each way, every async copy has a pinned host side, and the pinned memory a communicator
// holds is its two slots per device: a tensor of 4 MiB moves through 2 x 4 KiB (by default).
TEST(StagedBoundTest, NoCopyIsLargerThanASlotAndThePinnedMemoryIsTwoSlots) {
  COLLECTIVES_REQUIRE_CUDA();
  const FakeCounters fake = FindFakeCounters();
  if (fake.stats == nullptr) GTEST_SKIP() << "needs the fake CUDA of tests/nccl/fake to count copies";
  const size_t slot = ring::CudaStagingBytes();  // 4096 unless the environment says otherwise
  ASSERT_LT(slot, size_t(1) << 20);                // far below the tensors' 4 MiB
  const int size = 2;
  const size_t count = size_t(1) << 20;  // f32: 4 MiB per rank
  struct Case {
    const char* collective;
    size_t crossing;  // bytes between host and device, every rank's, each way once
  };
  const size_t bytes = count * 4, n = size_t(size);
  for (const Case& c : {Case{"all_reduce", n * (bytes + bytes)}, Case{"broadcast", bytes + n * bytes},
                        Case{"all_gather", n * (bytes / n + bytes)},
                        Case{"reduce_scatter", n * (bytes + bytes / n)}}) {
    SCOPED_TRACE(c.collective);
    const std::string name = c.collective;
    std::vector<std::unique_ptr<DeviceBuffer>> send, recv;
    std::vector<std::vector<uint8_t>> inputs;
    for (int r = 0; r < size; ++r) {
      const size_t in = name == "all_gather" ? count / size : count;
      const size_t out = name == "reduce_scatter" ? count / size : count;
      send.push_back(std::make_unique<DeviceBuffer>(api, r, DataType::kFloat32, in));
      recv.push_back(std::make_unique<DeviceBuffer>(api, r, DataType::kFloat32, out));
      std::vector<uint8_t> host(in * 4);
      for (size_t i = 0; i < in; ++i) Store(DataType::kFloat32, host.data(), i, double(i % 7 + r));
      send.back()->Upload(host.data());
      inputs.push_back(std::move(host));
    }
    ASSERT_NO_FATAL_FAILURE(ExpectStagingBound(api, fake, size, slot, c.crossing, [&] {
      RunRanks(Transport::kInProcess, size, SmallChunks(), [&](CollectiveCommunication& comm) {
        const size_t r = size_t(comm.rank());
        if (name == "all_reduce") {
          comm.AllReduce(send[r]->tensor(), recv[r]->tensor(), ReduceOp::kSum);
        }
        if (name == "broadcast") comm.Broadcast(send[r]->tensor(), recv[r]->tensor(), 0);
        if (name == "all_gather") comm.AllGather(send[r]->tensor(), recv[r]->tensor());
        if (name == "reduce_scatter") {
          comm.ReduceScatter(send[r]->tensor(), recv[r]->tensor(), ReduceOp::kSum);
        }
      });
    }));
    // And the results are right: element 0 of each rank.
    const std::vector<uint8_t> got = recv[1]->Download();
    if (name == "all_reduce") {
      EXPECT_EQ(Load(DataType::kFloat32, got.data(), 5), 5 + 5 + 1);
    }
    if (name == "broadcast") {
      EXPECT_EQ(Load(DataType::kFloat32, got.data(), 5), 5);
    }
    if (name == "all_gather") {
      EXPECT_EQ(Load(DataType::kFloat32, got.data(), count / size + 3), 3 + 1);
    }
    if (name == "reduce_scatter") {
      EXPECT_EQ(Load(DataType::kFloat32, got.data(), 0), double((count / size) % 7) * 2 + 1);
    }
  }
}

// The pipeline: the copy in of segment k+1 is issued before the ring works on segment k, so it is
// on the stream before segment k's copy out: on one rank, 4 segments go in, in, out, in, out,
// in, out, out. A staging that waits for each segment's round trip would issue in, out, in, ...
TEST(StagedBoundTest, TheNextSegmentComesInWhileTheRingWorksOnThisOne) {
  COLLECTIVES_REQUIRE_CUDA();
  if (FindFakeCounters().reset == nullptr) {
    GTEST_SKIP() << "needs the fake CUDA of tests/nccl/fake to see the order of the copies";
  }
  using CopyOrder = size_t (*)(char* out, size_t capacity);
  CopyOrder order = nullptr;
  for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
    if (void* handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) {
      order = reinterpret_cast<CopyOrder>(dlsym(handle, "collectivesFakeCudaCopyOrder"));
      dlclose(handle);
      if (order != nullptr) break;
    }
  }
  ASSERT_NE(order, nullptr);
  const size_t count = 4 * ring::CudaStagingBytes() / 4;  // f32: exactly 4 segments
  DeviceBuffer data(api, 0, DataType::kFloat32, count);
  std::vector<float> host(count, 1.0f);
  data.Upload(host.data());
  ASSERT_EQ(api.cudaDeviceSynchronize(), cudaSuccess);
  FindFakeCounters().reset();
  RunRanks(Transport::kInProcess, 1, SmallChunks(), [&](CollectiveCommunication& comm) {
    comm.AllReduce(data.tensor(), data.tensor(), ReduceOp::kSum);
  });
  char text[256];
  order(text, sizeof(text));
  EXPECT_EQ(std::string(text), "iioioioo");
}

// ---- Refusals ----

TEST(StagedRefusalTest, MismatchedDevicesAndHostMemoryAsCudaAreRefusedByName) {
  COLLECTIVES_REQUIRE_CUDA();
  RunRanks(Transport::kInProcess, 1, SmallChunks(), [&](CollectiveCommunication& comm) {
    DeviceBuffer device(api, 0, DataType::kFloat32, 16);
    std::vector<float> host(16, 1.0f);
    const Tensor on_host{host.data(), 16, DataType::kFloat32};
    // The root's send on the device, its recv on the host: refused for every collective that
    // uses both on the root.
    try {
      comm.Gather(device.tensor(), on_host, 0);
      ADD_FAILURE() << "gather from cuda:0 into host memory: expected kInvalidArgument";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("one device"), std::string::npos) << e.what();
    }
    // send on the device, recv on the host.
    try {
      comm.AllReduce(device.tensor(), on_host, ReduceOp::kSum);
      ADD_FAILURE() << "send and recv on two devices: expected kInvalidArgument";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("one device"), std::string::npos) << e.what();
    }
    // Host memory that claims to be on cuda:0.
    try {
      const Tensor lying{host.data(), 16, DataType::kFloat32, Device::Cuda(0)};
      comm.AllReduce(lying, lying, ReduceOp::kSum);
      ADD_FAILURE() << "host memory as cuda:0: expected kInvalidArgument";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("host memory"), std::string::npos) << e.what();
    }
    if (api.device_count >= 2) {  // memory of cuda:0 named as cuda:1
      try {
        Tensor wrong = device.tensor();
        wrong.device = Device::Cuda(1);
        comm.AllReduce(wrong, wrong, ReduceOp::kSum);
        ADD_FAILURE() << "memory of cuda:0 as cuda:1: expected kInvalidArgument";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_NE(e.message().find("memory of cuda:0"), std::string::npos) << e.what();
      }
    }
    // The communicator still works after refusals (they are argument errors, not failures).
    comm.AllReduce(device.tensor(), device.tensor(), ReduceOp::kSum);
  });
}

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace
}  // namespace collectives::testing
