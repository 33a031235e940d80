// AUTO on CUDA tensors (src/hierarchical/device_plan.h): NCCL inside a pretend host, the staged
// ring over TCP across hosts. Ranks are threads of this process, each on a pretend host of its own
// choosing (ScopedThreadHostIdentity) and on device cuda:rank; all_reduce, broadcast, all_gather
// and reduce_scatter at counts 0, 1, a prime and one larger than the staging slot, float32,
// float64 and int32, sum and max, in and out of place, checked element by element against
// collective_checks.h's reference (computed on the host from the inputs, not by the library).
// Also: that the calls go through NCCL (DevicePlanNcclCalls), and that without NCCL
// (COLLECTIVES_AUTO_NCCL=0, or a libcudart without libnccl) they run on the staged ring and
// give the same results.
//
// These tests need libcudart, libnccl and four devices: the CPU stand-in of tests/nccl/fake
// ("fake_nccl:" entries; "fake_cudart:" for the one without libnccl) or a GPU machine (ctest
// label gpu). Without them they skip, saying why, or fail where COLLECTIVES_REQUIRE_GPU=1.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/hierarchical/device_plan.h"
#include "src/hierarchical/shm_group.h"
#include "tests/ring/collective_checks.h"
#include "tests/scoped_env.h"
#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#include "tests/ring/staged_device.h"
#endif

namespace collectives::testing {
namespace {

#ifdef COLLECTIVES_WITH_NCCL

#define COLLECTIVES_REQUIRE_DEVICES() COLLECTIVES_REQUIRE_CUDA_DEVICES(4)

// Runs a rank per entry of `hosts` as threads, rank r on pretend host hosts[r], through AUTO.
void RunOnHosts(const std::vector<std::string>& hosts,
                const std::function<void(CollectiveCommunication&)>& body,
                std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  ScopedEnv shm("COLLECTIVES_SHM", nullptr);
  std::shared_ptr<collectives::Store> store = CreateMemoryStore();
  const int size = int(hosts.size());
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        hierarchical::ScopedThreadHostIdentity host(hosts[size_t(rank)]);
        ClusterSpec spec;
        spec.rank = rank;
        spec.world_size = size;
        spec.master_port = 1;  // unused: the store is given
        CommunicationOptions options;
        options.implementation = Implementation::kAuto;
        options.chunk_bytes = 1024;
        options.timeout = timeout;
        std::unique_ptr<CollectiveCommunication> comm = CreateCommunication(spec, store, options);
        body(*comm);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

// One collective on this rank's device (cuda:rank, or cuda:(rank % devices) where devices is
// not 0), its result against the reference. NCCL's average divides in its own way: its last bits
// may differ.
CheckResult CheckOnDevice(const nccl::NcclApi& api, CollectiveCommunication& comm,
                          const std::string& collective, DataType dtype, ReduceOp op, size_t count,
                          bool in_place, int root, int devices = 0) {
  const int device = devices > 0 ? comm.rank() % devices : comm.rank();
  return CheckCollectiveOnDevice(api, comm, device, collective, dtype, op, count, in_place, root,
                                 /*avg_tolerance=*/1e-6);
}

// Every collective, dtype and op of the plan on `hosts`, at 0, 1, a prime and a count larger
// than the staging slot; the number of wrong elements over every rank (and the first).
void CheckEveryCollective(const nccl::NcclApi& api, const std::vector<std::string>& hosts,
                          int devices = 0) {
  const size_t size = hosts.size();
  RankChecks checks{size};
  RunOnHosts(hosts, [&](CollectiveCommunication& comm) {
    EXPECT_EQ(comm.implementation(), Implementation::kAuto);
    const auto run = [&](const std::string& c, DataType d, ReduceOp o, size_t count, bool in_place,
                         int root) {
      checks.Note(comm.rank(), CheckOnDevice(api, comm, c, d, o, count, in_place, root, devices));
    };
    for (const std::string c : {"all_reduce", "broadcast", "all_gather", "reduce_scatter"}) {
      const bool reduces = c == "all_reduce" || c == "reduce_scatter";
      for (DataType d : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32}) {
        for (ReduceOp o : {ReduceOp::kSum, ReduceOp::kMax}) {
          if (!reduces && o != ReduceOp::kSum) continue;
          for (size_t count : {size_t{0}, size_t{1}, size_t{1009}, size_t{5003}, size_t{5006}}) {
            for (bool in_place : {false, true}) {
              run(c, d, o, count, in_place, int((count + size_t(in_place)) % size));
            }
          }
        }
      }
    }
    // The average: NCCL's inside a host and the leaders' across, where the hosts are alike.
    run("all_reduce", DataType::kFloat32, ReduceOp::kAvg, 1009, false, 0);
    run("all_reduce", DataType::kFloat32, ReduceOp::kAvg, 1012, true, 0);
    run("all_reduce", DataType::kFloat64, ReduceOp::kAvg, 5003, true, 0);
  });
  checks.ExpectNoneWrong();
}

std::string NcclUnavailableReason() {
  std::string reason;
  return nccl::TryLoadNccl(&reason) != nullptr ? std::string() : reason;
}

#define COLLECTIVES_REQUIRE_NCCL()                                               \
  if (const std::string why = NcclUnavailableReason(); !why.empty()) {           \
    if (GpuRequired()) GTEST_FAIL() << "COLLECTIVES_REQUIRE_GPU=1, but " << why; \
    GTEST_SKIP() << why;                                                         \
  }

struct Layout {
  const char* name;
  std::vector<std::string> hosts;
};

class AutoDeviceTest : public ::testing::TestWithParam<Layout> {};

// The results are right, and the calls went through NCCL.
TEST_P(AutoDeviceTest, EveryCollectiveMatchesTheReferenceThroughNccl) {
  COLLECTIVES_REQUIRE_DEVICES();
  COLLECTIVES_REQUIRE_NCCL();
  ScopedEnv nccl_on("COLLECTIVES_AUTO_NCCL", nullptr);
  const uint64_t before = hierarchical::DevicePlanNcclCalls();
  CheckEveryCollective(api, GetParam().hosts);
  EXPECT_GT(hierarchical::DevicePlanNcclCalls(), before);
}

INSTANTIATE_TEST_SUITE_P(Layouts, AutoDeviceTest,
                         ::testing::Values(Layout{"two_hosts_of_two", {"a", "a", "b", "b"}},
                                           Layout{"two_hosts_interleaved", {"a", "b", "a", "b"}},
                                           Layout{"one_host_of_four", {"a", "a", "a", "a"}},
                                           Layout{"one_host_of_three", {"a", "a", "a"}},
                                           Layout{"hosts_of_two_and_one", {"a", "a", "b"}}),
                         [](const ::testing::TestParamInfo<Layout>& param_info) {
                           return std::string(param_info.param.name);
                         });

// Every NCCL call the plan issues, counted: one host of two ranks runs an all-reduce as one NCCL
// call per rank; two hosts of two as a reduce and a broadcast per rank.
TEST(AutoDeviceCountTest, OneHostIsOneNcclCallTwoHostsAreTwo) {
  COLLECTIVES_REQUIRE_DEVICES();
  COLLECTIVES_REQUIRE_NCCL();
  ScopedEnv nccl_on("COLLECTIVES_AUTO_NCCL", nullptr);
  for (const auto& [hosts, per_rank] :
       {std::pair<std::vector<std::string>, uint64_t>{{"a", "a"}, 1},
        std::pair<std::vector<std::string>, uint64_t>{{"a", "a", "b", "b"}, 2}}) {
    uint64_t before = 0, after = 0;
    RunOnHosts(hosts, [&](CollectiveCommunication& comm) {
      // The first call makes the host's communicator; count from the second.
      EXPECT_EQ(
          CheckOnDevice(api, comm, "all_reduce", DataType::kFloat32, ReduceOp::kSum, 7, false, 0)
              .wrong,
          0u);
      comm.Barrier();
      if (comm.rank() == 0) before = hierarchical::DevicePlanNcclCalls();
      comm.Barrier();
      EXPECT_EQ(
          CheckOnDevice(api, comm, "all_reduce", DataType::kFloat32, ReduceOp::kSum, 7, false, 0)
              .wrong,
          0u);
      comm.Barrier();
      if (comm.rank() == 0) after = hierarchical::DevicePlanNcclCalls();
    });
    EXPECT_EQ(after - before, per_rank * hosts.size()) << hosts.size() << " ranks";
  }
}

// An Abort ends a CUDA call that waits inside NCCL (rank 3 never makes it, so its host's NCCL
// step waits for it) and the ones waiting across hosts: each raises an Error, none waits for the
// call's timeout.
TEST(AutoDeviceAbortTest, AbortEndsACallWaitingInNccl) {
  COLLECTIVES_REQUIRE_DEVICES();
  COLLECTIVES_REQUIRE_NCCL();
  ScopedEnv nccl_on("COLLECTIVES_AUTO_NCCL", nullptr);
  std::latch ready(4);
  const auto start = std::chrono::steady_clock::now();
  RunOnHosts(
      {"a", "a", "b", "b"},
      [&](CollectiveCommunication& comm) {
        const int rank = comm.rank();
        DeviceBuffer buffer(api, rank, DataType::kFloat32, 64);
        buffer.Upload(std::vector<uint8_t>(64 * sizeof(float), 0));
        comm.AllReduce(buffer.tensor(0, 64), buffer.tensor(0, 64), ReduceOp::kSum);  // set-up
        ready.arrive_and_wait();
        std::shared_ptr<Work> work;
        if (rank != 3) {
          work = comm.AllReduceAsync(buffer.tensor(0, 64), buffer.tensor(0, 64), ReduceOp::kSum);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        comm.Abort();
        if (work) {
          EXPECT_THROW(work->Wait(), Error) << "rank " << rank;
        }
      },
      std::chrono::seconds(30));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// A CPU all-reduce on one rank of a host where the other makes a CUDA one of the same number:
// with another count, the rank waiting in shared memory hears of the other's call and raises
// kMismatch well before the timeout; with the same descriptor (the device is not part of it) both
// wait until the timeout and raise kTimeout, never longer.
TEST(AutoDeviceMismatchTest, ACudaCallBesideACpuCallFailsByItsTimeout) {
  COLLECTIVES_REQUIRE_DEVICES();
  COLLECTIVES_REQUIRE_NCCL();
  ScopedEnv nccl_on("COLLECTIVES_AUTO_NCCL", nullptr);
  for (const size_t cuda_count : {size_t{32}, size_t{64}}) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<ErrorCode> codes(2, ErrorCode::kInternal);
    RunOnHosts(
        {"a", "a"},
        [&](CollectiveCommunication& comm) {
          const int rank = comm.rank();
          std::vector<float> host(64, 1.0f);
          DeviceBuffer device(api, rank, DataType::kFloat32, 64);
          device.Upload(std::vector<uint8_t>(64 * sizeof(float), 0));
          try {
            if (rank == 0) {
              comm.AllReduce(Tensor{host.data(), 64, DataType::kFloat32}, ReduceOp::kSum);
            } else {
              comm.AllReduce(device.tensor(0, cuda_count), ReduceOp::kSum);
            }
            ADD_FAILURE() << "rank " << rank << ": no error";
          } catch (const Error& e) {
            codes[size_t(rank)] = e.code();
          }
        },
        std::chrono::seconds(3));
    const auto took = std::chrono::steady_clock::now() - start;
    if (cuda_count != 64) {
      EXPECT_EQ(codes[0], ErrorCode::kMismatch);
      EXPECT_LT(took, std::chrono::seconds(3));
    } else {
      EXPECT_EQ(codes[0], ErrorCode::kTimeout);
      EXPECT_EQ(codes[1], ErrorCode::kTimeout);
      EXPECT_LT(took, std::chrono::seconds(10));
    }
  }
}

// COLLECTIVES_AUTO_NCCL=0: no NCCL call, the staged ring's results.
TEST(AutoDeviceFallbackTest, WithNcclTurnedOffRunsOnTheStagedRing) {
  COLLECTIVES_REQUIRE_DEVICES();
  ScopedEnv nccl_off("COLLECTIVES_AUTO_NCCL", "0");
  const uint64_t before = hierarchical::DevicePlanNcclCalls();
  CheckEveryCollective(api, {"a", "a", "b", "b"});
  EXPECT_EQ(hierarchical::DevicePlanNcclCalls(), before);
}

// Two ranks of a host on one GPU (which NCCL refuses): the staged ring, the same results.
TEST(AutoDeviceFallbackTest, RanksOfAHostSharingAGpuRunOnTheStagedRing) {
  COLLECTIVES_REQUIRE_DEVICES();
  ScopedEnv nccl_on("COLLECTIVES_AUTO_NCCL", nullptr);
  const uint64_t before = hierarchical::DevicePlanNcclCalls();
  CheckEveryCollective(api, {"a", "a", "a"}, /*devices=*/2);  // ranks 0 and 2 on cuda:0
  EXPECT_EQ(hierarchical::DevicePlanNcclCalls(), before);
}

// A libcudart without libnccl (the "fake_cudart:" entry): the staged ring, the same results.
TEST(AutoDeviceFallbackTest, WithoutLibncclRunsOnTheStagedRing) {
  COLLECTIVES_REQUIRE_DEVICES();
  if (NcclUnavailableReason().empty()) GTEST_SKIP() << "NCCL loads here";
  ScopedEnv nccl_on("COLLECTIVES_AUTO_NCCL", nullptr);
  const uint64_t before = hierarchical::DevicePlanNcclCalls();
  CheckEveryCollective(api, {"a", "a", "a"});
  EXPECT_EQ(hierarchical::DevicePlanNcclCalls(), before);
}

#else

TEST(AutoDeviceTest, NeedsTheNcclBuild) { GTEST_SKIP() << "this library is built without NCCL"; }

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace
}  // namespace collectives::testing
