// RING collectives with ranks as threads of this process, over the in-process transport and
// over real loopback TCP: every collective x dtype x op x count x in-place, world sizes 1 to 8,
// with the default algorithm choice, with the ring forced and a tiny chunk (the pipelined path),
// and with the small-message algorithms forced.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/core/internal_communication.h"
#include "src/ring/ring_communication.h"
#include "src/transport/inproc_fabric.h"
#include "tests/ring/collective_checks.h"
#include "tests/ring/run_ranks.h"
#include "tests/time_scale.h"

namespace collectives {
namespace {

using testing::CheckCollective;
using testing::CheckMatrix;

using testing::RunRanks;
using testing::Transport;

// Waits until `flag` is set by another rank's thread, or 30 s at most (so that a rank that
// failed before setting it does not hang the test).
void WaitFor(const std::atomic<bool>& flag) {
  const auto cap = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!flag && std::chrono::steady_clock::now() < cap) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(flag) << "gave up waiting for another rank after 30 s";
}

enum class Algorithms { kDefault, kRingTinyChunks, kSmallMessage, kHalvingDoubling };

struct MatrixParam {
  Transport transport;
  int size;
  Algorithms algorithms;
};

std::string Name(const ::testing::TestParamInfo<MatrixParam>& param_info) {
  const MatrixParam& p = param_info.param;
  std::string name = p.transport == Transport::kTcp           ? "Tcp"
                     : p.transport == Transport::kTcpInPieces ? "TcpInPieces"
                     : p.transport == Transport::kInProcess   ? "InProcess"
                                                              : "AutoShm";
  name += std::to_string(p.size) + "Ranks";
  switch (p.algorithms) {
    case Algorithms::kDefault:
      return name + "Default";
    case Algorithms::kRingTinyChunks:
      return name + "RingTinyChunks";
    case Algorithms::kSmallMessage:
      return name + "SmallMessage";
    case Algorithms::kHalvingDoubling:
      return name + "HalvingDoubling";
  }
  return name;
}

class CollectiveMatrixTest : public ::testing::TestWithParam<MatrixParam> {};

TEST_P(CollectiveMatrixTest, EveryCollectiveDtypeOpAndCountIsExactOnEveryRank) {
  const MatrixParam p = GetParam();
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  size_t large = 0;
  switch (p.algorithms) {
    case Algorithms::kDefault:
      large = 1'000'003;
      break;
    case Algorithms::kRingTinyChunks:
      options.small_message_bytes = 1;  // every non-empty all-reduce, broadcast, all-gather: ring
      options.chunk_bytes = 24;         // several chunks per block even for a handful of elements
      large = 1'001;
      break;
    case Algorithms::kSmallMessage:
      options.small_message_bytes = SIZE_MAX;  // recursive doubling at every size
      large = 100'003;
      break;
    case Algorithms::kHalvingDoubling:
      options.small_message_bytes = 1;          // no recursive doubling for non-empty tensors
      options.medium_message_bytes = SIZE_MAX;  // halving-doubling at 4 and 8 ranks, at every size
      options.chunk_bytes = 24;                 // several chunks per exchange
      large = 10'007;
      break;
  }
  RunRanks(p.transport, p.size, options, [&](CollectiveCommunication& comm) {
    std::vector<std::string> failures;
    const size_t wrong = CheckMatrix(comm, large, &failures);
    EXPECT_EQ(wrong, 0u) << "rank " << comm.rank() << ": " << failures.front();
  });
}

std::vector<MatrixParam> MatrixParams() {
  std::vector<MatrixParam> params;
  for (Transport t : {Transport::kInProcess, Transport::kTcp}) {
    for (int size = 1; size <= 8; ++size) {
      for (Algorithms a : {Algorithms::kDefault, Algorithms::kRingTinyChunks,
                           Algorithms::kSmallMessage, Algorithms::kHalvingDoubling}) {
        params.push_back({t, size, a});
      }
    }
  }
  // TCP with every byte stream handed on in random pieces (a header, a payload, a frame's
  // tail and the next header each split anywhere): the receive path's partial reads.
  for (int size : {2, 3, 4, 5}) {
    for (Algorithms a : {Algorithms::kDefault, Algorithms::kRingTinyChunks,
                         Algorithms::kSmallMessage, Algorithms::kHalvingDoubling}) {
      params.push_back({Transport::kTcpInPieces, size, a});
    }
  }
  // AUTO on one host: shared memory; the ring's algorithm options do not apply.
  for (int size = 1; size <= 8; ++size)
    params.push_back({Transport::kAuto, size, Algorithms::kDefault});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Ring, CollectiveMatrixTest, ::testing::ValuesIn(MatrixParams()), Name);

// Several asynchronous calls in flight at once, waited on in reverse and in random order.
TEST(RingAsyncTest, CallsInFlightCompleteInAnyWaitOrder) {
  for (Transport transport : {Transport::kInProcess, Transport::kTcp}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(60);
    options.chunk_bytes = 4096;
    RunRanks(transport, 4, options, [&](CollectiveCommunication& comm) {
      constexpr int kCalls = 12;
      std::vector<std::vector<float>> buffers;
      std::vector<std::shared_ptr<Work>> works;
      for (int k = 0; k < kCalls; ++k) {
        const size_t count = 1 + size_t(k) * 7919;  // small and large, different per call
        buffers.emplace_back(count, float(comm.rank() + k));
        Tensor t{buffers.back().data(), count, DataType::kFloat32};
        works.push_back(comm.AllReduceAsync(t, t, ReduceOp::kSum));
      }
      const std::vector<int> order = {11, 0, 5, 3, 10, 1, 9, 2, 8, 4, 7, 6};
      for (int k : order) works[k]->Wait();
      for (int k = 0; k < kCalls; ++k) {
        EXPECT_TRUE(works[k]->Done());
        const float want = float(0 + 1 + 2 + 3 + 4 * k);
        for (float v : buffers[k]) {
          ASSERT_EQ(v, want) << "call " << k << " on rank " << comm.rank();
        }
      }
    });
  }
}

// Asynchronous calls waited on at once (every collective), waited on out of order (a later
// one's Work completes after every earlier one's), and one call waited on by three threads at
// once: every result checked, on every rank.
TEST(RingAsyncTest, CallsWaitedOnAtOnceOutOfOrderAndByManyThreadsGiveTheirResults) {
  for (Transport transport : {Transport::kInProcess, Transport::kTcp}) {
    for (int size : {2, 3}) {
      CommunicationOptions options;
      options.timeout = std::chrono::seconds(60);
      RunRanks(transport, size, options, [&](CollectiveCommunication& comm) {
        const int n = comm.size();
        const int r = comm.rank();
        for (int iter = 0; iter < 120; ++iter) {
          const std::string at =
              "rank " + std::to_string(r) + ", iteration " + std::to_string(iter);
          const int count = 1 + iter % 5;
          std::vector<int32_t> mine(size_t(count), r + iter);
          std::vector<int32_t> all(size_t(count * n), -1);
          switch (iter % 4) {
            case 0:
              comm.AllReduceAsync(Tensor{mine.data(), mine.size(), DataType::kInt32},
                                  Tensor{mine.data(), mine.size(), DataType::kInt32},
                                  ReduceOp::kSum)
                  ->Wait();
              for (int32_t v : mine) ASSERT_EQ(v, n * iter + n * (n - 1) / 2) << at;
              break;
            case 1:
              comm.BroadcastAsync(Tensor{mine.data(), mine.size(), DataType::kInt32},
                                  Tensor{mine.data(), mine.size(), DataType::kInt32}, n - 1)
                  ->Wait();
              for (int32_t v : mine) ASSERT_EQ(v, n - 1 + iter) << at;
              break;
            case 2:
              comm.AllGatherAsync(Tensor{mine.data(), mine.size(), DataType::kInt32},
                                  Tensor{all.data(), all.size(), DataType::kInt32})
                  ->Wait();
              for (size_t i = 0; i < all.size(); ++i) {
                ASSERT_EQ(all[i], int32_t(i) / count + iter) << at << ", element " << i;
              }
              break;
            case 3:
              comm.ReduceScatterAsync(Tensor{all.data(), all.size(), DataType::kInt32},
                                      Tensor{mine.data(), mine.size(), DataType::kInt32},
                                      ReduceOp::kMin)
                  ->Wait();
              for (int32_t v : mine) ASSERT_EQ(v, -1) << at;
              break;
          }
          if (iter % 7 == 0) {
            int32_t a = r, b = 10 * r;
            auto first = comm.AllReduceAsync(Tensor{&a, 1, DataType::kInt32},
                                             Tensor{&a, 1, DataType::kInt32}, ReduceOp::kMax);
            auto second = comm.AllReduceAsync(Tensor{&b, 1, DataType::kInt32},
                                              Tensor{&b, 1, DataType::kInt32}, ReduceOp::kMax);
            second->Wait();
            EXPECT_TRUE(first->Done()) << at;
            first->Wait();
            ASSERT_EQ(a, n - 1) << at;
            ASSERT_EQ(b, 10 * (n - 1)) << at;
          }
          if (iter % 11 == 0) {
            int64_t value = r + 1;
            auto work = comm.AllReduceAsync(Tensor{&value, 1, DataType::kInt64},
                                            Tensor{&value, 1, DataType::kInt64}, ReduceOp::kSum);
            std::vector<std::thread> waiters;
            for (int w = 0; w < 3; ++w) waiters.emplace_back([&] { work->Wait(); });
            for (std::thread& t : waiters) t.join();
            ASSERT_EQ(value, int64_t(n) * (n + 1) / 2) << at;
          }
        }
      });
    }
  }
}

// A Work waited on by another thread while its communicator is destroyed: the destructor runs
// every queued call first, so every waiter returns with its result (TSan and ASan watch this
// one).
TEST(RingAsyncTest, AWorkWaitedOnWhileItsCommunicatorIsDestroyedCompletes) {
  for (int round = 0; round < 30; ++round) {
    constexpr int kSize = 2;
    auto fabrics = transport::CreateInProcessFabrics(kSize);
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < kSize; ++rank) {
      ranks.emplace_back([&, rank] {
        CommunicationOptions options;
        options.timeout = std::chrono::seconds(30);
        auto comm =
            ring::CreateRingCommunication(std::move(fabrics[size_t(rank)]), nullptr, options);
        std::vector<int32_t> values(3, rank + 1);
        std::vector<std::shared_ptr<Work>> works;
        for (int32_t& v : values) {
          works.push_back(comm->AllReduceAsync(Tensor{&v, 1, DataType::kInt32},
                                               Tensor{&v, 1, DataType::kInt32}, ReduceOp::kSum));
        }
        std::thread waiter([&] {
          for (size_t k = 0; k < works.size(); ++k) {
            EXPECT_NO_THROW(works[k]->Wait()) << "rank " << rank << ", call " << k;
          }
        });
        if (round % 2 == 1) std::this_thread::yield();
        comm.reset();
        waiter.join();
        for (int32_t v : values) EXPECT_EQ(v, 3) << "rank " << rank << ", round " << round;
      });
    }
    for (std::thread& t : ranks) t.join();
  }
}

// A gate that throws (core::Gate, on one rank or on all): its Wait raises
// the exception as an Error naming the call, the peers' calls raise too, and the communicator
// stays broken, every later call raising at once; nothing hangs, nothing is written.
TEST(RingAsyncTest, AGateThatThrowsBreaksTheCommunicatorOnEveryRank) {
  for (bool everywhere : {false, true}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(30);
    RunRanks(Transport::kInProcess, 3, options, [&](CollectiveCommunication& comm) {
      const bool throws = everywhere || comm.rank() == 1;
      int32_t value = comm.rank() + 1;
      const Tensor t{&value, 1, DataType::kInt32};
      const core::Gate gate = [&] {
        if (throws) throw std::runtime_error("the gate failed");
        return true;
      };
      auto work = core::Internal(comm)->AllReduceAsync(t, t, ReduceOp::kSum, {{}, gate});
      try {
        work->Wait();
        ADD_FAILURE() << "rank " << comm.rank() << ": the call went through";
      } catch (const Error& e) {
        if (throws) {
          EXPECT_EQ(e.code(), ErrorCode::kInternal) << e.what();
          EXPECT_NE(e.message().find("the gate failed"), std::string::npos) << e.what();
        }
      }
      EXPECT_EQ(value, comm.rank() + 1) << "rank " << comm.rank() << ": written";
      EXPECT_THROW(comm.AllReduce(t, ReduceOp::kSum), Error) << "rank " << comm.rank();
    });
  }
}

// An async call waited on at once, with nothing ahead of it, runs on the waiting thread (the
// hand-off to the progress thread and back is what a small collective costs most), as the gate
// sees; calls queued behind another still complete, in order, whoever runs them.
TEST(RingAsyncTest, ACallWaitedOnAtOnceRunsOnTheWaitingThread) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(30);
  options.spin_us = 0;  // the idle progress thread sleeps: the waiter comes first
  RunRanks(Transport::kInProcess, 2, options, [&](CollectiveCommunication& comm) {
    int on_waiter = 0;
    for (int i = 0; i < 50; ++i) {
      std::thread::id ran_on;
      int32_t value = comm.rank() + 1;
      const Tensor t{&value, 1, DataType::kInt32};
      const core::Gate gate = [&] {
        ran_on = std::this_thread::get_id();
        return true;
      };
      core::Internal(comm)->AllReduceAsync(t, t, ReduceOp::kSum, {{}, gate})->Wait();
      EXPECT_EQ(value, 3) << "rank " << comm.rank();
      on_waiter += ran_on == std::this_thread::get_id();
    }
    // Most, not all: the progress thread takes a call whose waiter is late (a loaded machine).
    EXPECT_GT(on_waiter, 25) << "rank " << comm.rank() << ": of 50 calls waited on at once";
    std::vector<int32_t> values(8);
    std::vector<std::shared_ptr<Work>> works;
    for (size_t i = 0; i < values.size(); ++i) {
      values[i] = int32_t(i) * (comm.rank() + 1);
      works.push_back(comm.AllReduceAsync(Tensor{&values[i], 1, DataType::kInt32},
                                          Tensor{&values[i], 1, DataType::kInt32}, ReduceOp::kSum));
    }
    for (size_t i = values.size(); i-- > 0;) works[i]->Wait();
    for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(values[i], 3 * int32_t(i));
  });
}

// An async call that no one waits on runs all the same (the progress thread takes it, whether
// it was polling the queue after a call waited on at once or asleep after an idle spell), on a
// thread of the communicator's: Done turns true with the result written while the caller only
// polls Done.
TEST(RingAsyncTest, ACallNoOneWaitsOnRunsOnTheProgressThread) {
  for (Transport transport : {Transport::kInProcess, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(30);
    RunRanks(transport, 3, options, [&](CollectiveCommunication& comm) {
      const std::string at = "rank " + std::to_string(comm.rank());
      for (int i = 0; i < 8; ++i) {
        if (i % 2 == 0) {
          int32_t before = 1;
          comm.AllReduceAsync(Tensor{&before, 1, DataType::kInt32},
                              Tensor{&before, 1, DataType::kInt32}, ReduceOp::kSum)
              ->Wait();
          EXPECT_EQ(before, 3) << at << ", call " << i;
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        std::thread::id ran_on;
        int32_t value = comm.rank() + i;
        const Tensor t{&value, 1, DataType::kInt32};
        const core::Gate gate = [&] {
          ran_on = std::this_thread::get_id();
          return true;
        };
        auto work = core::Internal(comm)->AllReduceAsync(t, t, ReduceOp::kSum, {{}, gate});
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!work->Done() && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        ASSERT_TRUE(work->Done()) << at << ", call " << i << ": not run after 20 s";
        EXPECT_NE(ran_on, std::this_thread::get_id()) << at << ", call " << i;
        EXPECT_EQ(value, 0 + 1 + 2 + 3 * i) << at << ", call " << i;
        work->Wait();
      }
    });
  }
}

// Bad arguments are refused on the caller's thread with kInvalidArgument naming the fault.
TEST(RingArgumentTest, WrongSizesAndTypesAreInvalidArguments) {
  RunRanks(Transport::kInProcess, 2, {}, [](CollectiveCommunication& comm) {
    std::vector<float> a(10), b(11);
    std::vector<int32_t> c(10);
    auto expect_invalid = [](const std::function<void()>& call, const std::string& needle) {
      try {
        call();
        ADD_FAILURE() << "expected an Error mentioning '" << needle << "'";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    Tensor ta{a.data(), a.size(), DataType::kFloat32};
    Tensor tb{b.data(), b.size(), DataType::kFloat32};
    Tensor tc{c.data(), c.size(), DataType::kInt32};
    expect_invalid([&] { comm.AllReduce(ta, tb, ReduceOp::kSum); }, "all_reduce");
    expect_invalid([&] { comm.AllReduce(ta, tc, ReduceOp::kSum); }, "i32");
    expect_invalid([&] { comm.AllGather(ta, tb); }, "all_gather");
    expect_invalid([&] { comm.ReduceScatter(tb, ta, ReduceOp::kSum); }, "reduce_scatter");
    expect_invalid([&] { comm.Broadcast(ta, 2); }, "root 2");
    expect_invalid(
        [&] {
          comm.AllReduce(Tensor{nullptr, 5, DataType::kFloat32}, ReduceOp::kSum);
        },
        "null");
    // An element that straddles its alignment (the kernels read typed elements: UBSan's
    // "misaligned address").
    void* odd = reinterpret_cast<char*>(a.data()) + 1;
    expect_invalid(
        [&] {
          comm.AllReduce(Tensor{odd, 3, DataType::kFloat32}, ReduceOp::kSum);
        },
        "is not aligned to its 4-byte f32 elements");
    expect_invalid(
        [&] {
          comm.AllGather(Tensor{odd, 1, DataType::kInt32}, tc);
        },
        "send tensor data");
    // Byte sizes past size_t: 2^62 + 1 floats wrapped to 4 bytes, and a broadcast moved those
    // 4 bytes and succeeded; a block of 2^63 + 1 floats times 2 ranks wrapped to a whole of 2.
    const size_t wraps = (size_t{1} << 62) + 1;
    expect_invalid(
        [&] {
          comm.Broadcast(Tensor{a.data(), wraps, DataType::kFloat32}, 0);
        },
        "more bytes than size_t holds");
    expect_invalid(
        [&] {
          comm.AllGather(Tensor{a.data(), (size_t{1} << 63) + 1, DataType::kUInt8},
                         Tensor{a.data(), 2, DataType::kUInt8});
        },
        "2 x 9223372036854775809 elements");
    try {
      Tensor gpu = ta;
      gpu.device = Device::Cuda(0);
      comm.AllReduce(gpu, ReduceOp::kSum);
      ADD_FAILURE() << "host memory named as cuda:0 was accepted by RING";
    } catch (const Error& e) {
      // kNotSupported where CUDA is not usable; where it is (tests/ring/staged_test.cc), host
      // memory named as a device's is an invalid argument.
      EXPECT_TRUE(e.code() == ErrorCode::kNotSupported || e.code() == ErrorCode::kInvalidArgument)
          << e.what();
      EXPECT_NE(e.message().find("cuda:0"), std::string::npos) << e.what();
    }
    // The communicator still works after refused calls.
    std::vector<float> ok(3, 1.0f);
    comm.AllReduce(Tensor{ok.data(), ok.size(), DataType::kFloat32}, ReduceOp::kSum);
    EXPECT_EQ(ok[2], 2.0f);
  });
}

// Send and recv that overlap without being the collective's in-place form are refused on every
// rank before anything moves: the ring all-gather would receive a peer's block into recv before
// copying its own send out of it, and return another rank's data as a success. The
// documented in-place forms run exactly, over TCP and past the small-message sizes.
TEST(RingArgumentTest, OverlappingBuffersAreRefusedButTheInPlaceFormsRun) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
    options.implementation = impl;
    RunRanks(Transport::kTcp, 3, options, [](CollectiveCommunication& comm) {
      const int n = comm.size();
      const int me = comm.rank();
      const size_t block = 40'000;  // 160 KB blocks: the ring algorithms, not the small ones
      std::vector<float> buffer(block * size_t(n) + 1);
      const auto f32 = [](float* data, size_t count) {
        return Tensor{data, count, DataType::kFloat32};
      };
      const auto expect_overlap = [&](const std::function<void()>& call, const char* what) {
        try {
          call();
          ADD_FAILURE() << what << ": overlapping buffers were accepted on rank " << me;
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
          EXPECT_NE(e.message().find(std::string(what) + ": send [0x"), std::string::npos)
              << e.what();
          EXPECT_NE(e.message().find("overlap without being the in-place form"), std::string::npos)
              << e.what();
        }
      };
      float* base = buffer.data();
      const size_t other = size_t((me + 1) % n) * block;  // another rank's block: not in place
      expect_overlap([&] { comm.AllGather(f32(base + other, block), f32(base, block * 3)); },
                     "all_gather");
      expect_overlap(
          [&] {
            comm.ReduceScatter(f32(base, block * 3), f32(base + other, block), ReduceOp::kSum);
          },
          "reduce_scatter");
      expect_overlap(
          [&] { comm.AllReduce(f32(base, block), f32(base + 1, block), ReduceOp::kSum); },
          "all_reduce");
      if (me == 0) {  // only the root reads send
        expect_overlap([&] { comm.Broadcast(f32(base, block), f32(base + 7, block), 0); },
                       "broadcast");
      }
      // The in-place forms, checked element by element.
      const size_t mine = size_t(me) * block;
      for (size_t i = 0; i < block; ++i) buffer[mine + i] = float(me * 1000 + int(i % 997));
      comm.AllGather(f32(base + mine, block), f32(base, block * 3));
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < block; ++i) {
          ASSERT_EQ(buffer[size_t(r) * block + i], float(r * 1000 + int(i % 997)))
              << "all_gather in place: rank " << me << " block " << r << " element " << i;
        }
      }
      for (size_t i = 0; i < block * 3; ++i) buffer[i] = float(me + int(i % 13));
      comm.ReduceScatter(f32(base, block * 3), f32(base + mine, block), ReduceOp::kSum);
      for (size_t i = 0; i < block; ++i) {
        ASSERT_EQ(buffer[mine + i], float(0 + 1 + 2 + 3 * int((mine + i) % 13)))
            << "reduce_scatter in place: rank " << me << " element " << i;
      }
    });
  }
}

// Ranks that call different collectives raise kMismatch (naming both calls), and the
// communicator stays broken afterwards.
TEST(RingMismatchTest, DifferentCountsRaiseMismatchAndBreakTheCommunicator) {
  for (Transport transport : {Transport::kInProcess, Transport::kTcp}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(10);
    RunRanks(transport, 2, options, [](CollectiveCommunication& comm) {
      std::vector<float> data(comm.rank() == 0 ? 100 : 120, 1.0f);
      Tensor t{data.data(), data.size(), DataType::kFloat32};
      try {
        comm.AllReduce(t, ReduceOp::kSum);
        ADD_FAILURE() << "rank " << comm.rank() << ": mismatched all-reduce succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
        EXPECT_NE(std::string(e.what()).find("count=100"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("count=120"), std::string::npos) << e.what();
      }
      try {
        comm.Barrier();
        ADD_FAILURE() << "a broken communicator ran a barrier";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
      }
    });
  }
}

// SetTimeout changes the deadline of the calls issued after it: a call whose peer never comes
// raises kTimeout after the short deadline, not the communicator's long one.
TEST(RingTimeoutTest, SetTimeoutAppliesToTheNextCalls) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  std::atomic<bool> rank0_done{false};
  RunRanks(Transport::kTcp, 2, options, [&](CollectiveCommunication& comm) {
    std::vector<float> data(100, 1.0f);
    const Tensor t{data.data(), data.size(), DataType::kFloat32};
    comm.AllReduce(t, ReduceOp::kSum);  // the long deadline is plenty
    EXPECT_EQ(data[0], 2.0f);
    try {
      comm.SetTimeout(std::chrono::milliseconds(0));
      ADD_FAILURE() << "a zero timeout was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    }
    if (comm.rank() == 1) {  // never joins the next all-reduce; waits until rank 0 gave up
      WaitFor(rank0_done);
      return;
    }
    comm.SetTimeout(std::chrono::milliseconds(300));
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.AllReduce(t, ReduceOp::kSum);
      ADD_FAILURE() << "an all-reduce without its peer succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    rank0_done = true;
    EXPECT_GE(waited, std::chrono::milliseconds(250));
    EXPECT_LT(waited,
              test_time::Scaled(std::chrono::seconds(5)));  // far below the communicator's 60 s
  });
}

// "Never time out" written as the largest duration: read as a year, so the deadline (now +
// timeout, in nanoseconds) does not overflow into the past, which would make every call time out
// at once. Over TCP (the set-up deadline too), in shared memory (AUTO), and through SetTimeout.
TEST(RingTimeoutTest, TheLargestTimeoutMeansAYearNotAnOverflow) {
  for (Transport transport : {Transport::kInProcess, Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::milliseconds::max();
    RunRanks(transport, 3, options, [&](CollectiveCommunication& comm) {
      std::vector<float> data(1000, 1.0f);
      const Tensor t{data.data(), data.size(), DataType::kFloat32};
      comm.AllReduce(t, ReduceOp::kSum);
      comm.SetTimeout(std::chrono::milliseconds::max());
      comm.AllReduce(t, ReduceOp::kSum);
      comm.SetTimeout(std::chrono::hours(24 * 365 * 1000));
      comm.Barrier();
      EXPECT_EQ(std::count(data.begin(), data.end(), 9.0f), 1000) << TransportName(transport);
    });
  }
}

// Options a communicator cannot keep are refused when it is built, naming the option, on every
// rank alike: no timeout, a chunk too large to stage (sizes near SIZE_MAX wrapped the staging
// area's size), halving-doubling forced on a world it cannot run on.
TEST(RingOptionsTest, OptionsItCannotKeepAreRefusedWhenBuilt) {
  struct Case {
    const char* what;
    std::function<void(CommunicationOptions&)> set;
    int size;
    ErrorCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"zero timeout", [](CommunicationOptions& o) { o.timeout = std::chrono::milliseconds(0); }, 2,
       ErrorCode::kInvalidArgument,
       ": CommunicationOptions::timeout needs a positive timeout, got 0 ms"},
      {"negative timeout",
       [](CommunicationOptions& o) { o.timeout = std::chrono::milliseconds(-5); }, 2,
       ErrorCode::kInvalidArgument,
       ": CommunicationOptions::timeout needs a positive timeout, got -5 ms"},
      {"SIZE_MAX chunk", [](CommunicationOptions& o) { o.chunk_bytes = SIZE_MAX; }, 3,
       ErrorCode::kInvalidArgument,
       ": CommunicationOptions::chunk_bytes is 18446744073709551615, more than the largest "
       "chunk, 1073741824 bytes (0 picks the default)"},
      {"spin_us below -1", [](CommunicationOptions& o) { o.spin_us = -2; }, 2,
       ErrorCode::kInvalidArgument,
       ": CommunicationOptions::spin_us is -2: -1 (the default) or 0..1000000 microseconds"},
      {"yield_us past a second", [](CommunicationOptions& o) { o.yield_us = 1'000'001; }, 2,
       ErrorCode::kInvalidArgument,
       ": CommunicationOptions::yield_us is 1000001: -1 (the default) or 0..1000000 "
       "microseconds"},
      {"an implementation that is none",
       [](CommunicationOptions& o) { o.implementation = static_cast<Implementation>(7); }, 2,
       ErrorCode::kInvalidArgument,
       ": CommunicationOptions::implementation is 7, which names no implementation (kRing, kNccl "
       "or kAuto)"},
      {"halving-doubling on 3", [](CommunicationOptions& o) { o.algorithm = "halving_doubling"; },
       3, ErrorCode::kNotSupported,
       ": CommunicationOptions::algorithm 'halving_doubling' needs a power-of-two number of "
       "ranks, at least 4; this communicator has 3"},
      {"halving-doubling on 2", [](CommunicationOptions& o) { o.algorithm = "halving_doubling"; },
       2, ErrorCode::kNotSupported,
       ": CommunicationOptions::algorithm 'halving_doubling' needs a power-of-two number of "
       "ranks, at least 4; this communicator has 2"},
  };
  for (const Case& c : cases) {
    for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
      auto store = CreateMemoryStore();
      std::vector<std::thread> threads;
      for (int rank = 0; rank < c.size; ++rank) {
        threads.emplace_back([&, rank] {
          ClusterSpec spec;
          spec.rank = rank;
          spec.world_size = c.size;
          spec.master_port = 1;  // unused: the store is given
          CommunicationOptions options;
          options.implementation = impl;
          c.set(options);
          try {
            CreateCommunication(spec, store, options);
            ADD_FAILURE() << c.what << ": rank " << rank << " built a communicator";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), c.code) << c.what << ": " << e.what();
            EXPECT_EQ(e.message(), "rank " + std::to_string(rank) + c.message) << c.what;
          }
        });
      }
      for (std::thread& t : threads) t.join();
    }
  }
  // Directly over in-process fabrics too.
  CommunicationOptions options;
  options.chunk_bytes = SIZE_MAX;
  auto fabrics = transport::CreateInProcessFabrics(2);
  EXPECT_THROW(ring::CreateRingCommunication(std::move(fabrics[0]), nullptr, options), Error);
  // The largest chunk and halving-doubling on 4 ranks are accepted and run.
  options.chunk_bytes = size_t{1} << 30;
  options.algorithm = "halving_doubling";
  RunRanks(Transport::kInProcess, 4, options, [](CollectiveCommunication& comm) {
    std::vector<int32_t> data(1001, comm.rank());
    comm.AllReduce(Tensor{data.data(), data.size(), DataType::kInt32}, ReduceOp::kSum);
    EXPECT_EQ(std::count(data.begin(), data.end(), 6), 1001);
    EXPECT_EQ(comm.AllReduceAlgorithm(4004), "halving_doubling");
  });
}

// Every socket of a communicator is close-on-exec: a process the trainer spawns (a checkpoint
// uploader, say) would otherwise hold copies of the data connections, so when the rank died its
// peers would see no close and raise kTimeout after the whole timeout instead of kPeerLost at
// once.
TEST(RingOptionsTest, EverySocketIsCloseOnExec) {
  for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
    CommunicationOptions options;
    options.implementation = impl;
    std::atomic<int> ready{0};
    std::atomic<bool> checked{false};
    RunRanks(Transport::kTcp, 3, options, [&](CollectiveCommunication& comm) {
      comm.Barrier();
      if (++ready == comm.size()) {  // every rank's sockets exist: look at all of them
        int sockets = 0;
        for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
          std::error_code ec;
          const auto target = std::filesystem::read_symlink(entry.path(), ec).string();
          if (ec || target.rfind("socket:", 0) != 0) continue;
          const int fd = std::stoi(entry.path().filename().string());
          const int flags = fcntl(fd, F_GETFD);
          if (flags < 0) continue;  // closed since the listing
          ++sockets;
          EXPECT_NE(flags & FD_CLOEXEC, 0) << "socket fd " << fd << " (" << target << ")";
        }
        EXPECT_GE(sockets, 6) << "3 ranks: a connection between every pair, both ends";
        checked = true;
      }
      while (!checked.load()) std::this_thread::yield();
      comm.Barrier();
    });
  }
}

// The idle progress thread polls its queue for spin_us before it sleeps; the destructor cuts
// that short rather than wait out the whole spin (up to the largest spin_us: 1 s here).
TEST(RingOptionsTest, TheDestructorDoesNotWaitOutTheSpin) {
  CommunicationOptions options;
  options.spin_us = 1'000'000;
  auto fabrics = transport::CreateInProcessFabrics(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto comm = ring::CreateRingCommunication(std::move(fabrics[size_t(rank)]), nullptr, options);
      std::vector<int32_t> data(5, rank + 1);
      const Tensor t{data.data(), data.size(), DataType::kInt32};
      comm->AllReduceAsync(t, t, ReduceOp::kSum)->Wait();
      EXPECT_EQ(data[4], 3);
      const auto start = std::chrono::steady_clock::now();
      comm.reset();  // the progress thread is spinning on its empty queue now
      EXPECT_LT(std::chrono::steady_clock::now() - start,
                test_time::Scaled(std::chrono::milliseconds(500)))
          << "rank " << rank;
    });
  }
  for (std::thread& t : threads) t.join();
}

// Out of memory inside a collective (here the staging area of recursive doubling, forced for
// every size, under an address-space limit) is kSystem "out of memory", not kInternal, which
// the C API documents as a bug in this library. In a child process, as the limit is its own.
TEST(RingOptionsTest, OutOfMemoryInACollectiveIsASystemError) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizers reserve address space of their own";
#endif
  const pid_t child = fork();  // before this test starts any thread
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::atomic<int> system_errors{0};
    {
      CommunicationOptions options;
      options.small_message_bytes = SIZE_MAX;  // recursive doubling: staging of 2x the message
      auto fabrics = transport::CreateInProcessFabrics(2);
      std::vector<std::unique_ptr<CollectiveCommunication>> comms;
      std::vector<std::vector<float>> data;
      for (int rank = 0; rank < 2; ++rank) {
        comms.push_back(
            ring::CreateRingCommunication(std::move(fabrics[size_t(rank)]), nullptr, options));
        data.emplace_back(size_t{8} << 20, 1.0f);  // 32 MiB each
      }
      std::atomic<bool> go{false};
      std::vector<std::thread> threads;
      for (int rank = 0; rank < 2; ++rank) {
        threads.emplace_back([&, rank] {
          while (!go.load()) std::this_thread::yield();
          std::vector<float>& d = data[size_t(rank)];
          try {
            comms[size_t(rank)]->AllReduce(Tensor{d.data(), d.size(), DataType::kFloat32},
                                           ReduceOp::kSum);
          } catch (const Error& e) {
            if (e.code() == ErrorCode::kSystem &&
                e.message().find("out of memory") != std::string::npos) {
              ++system_errors;
            } else {
              std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
            }
          }
        });
      }
      // Room for the call's small allocations, not for 64 MiB of staging.
      long pages = 0;
      if (FILE* statm = std::fopen("/proc/self/statm", "r")) {
        if (std::fscanf(statm, "%ld", &pages) != 1) pages = 0;
        std::fclose(statm);
      }
      const rlim_t limit = rlim_t(pages) * rlim_t(sysconf(_SC_PAGESIZE)) + (rlim_t{16} << 20);
      const rlimit address_space{limit, limit};
      if (pages == 0 || setrlimit(RLIMIT_AS, &address_space) != 0) _exit(3);
      go = true;
      for (std::thread& t : threads) t.join();
    }
    _exit(system_errors.load() == 2 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "child status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: not kSystem \"out of memory\" on both ranks (see "
                                       "stderr); 3: could not set the limit";
}

// Abort from another thread wakes a rank blocked in a collective its peer has not joined, over
// TCP and in shared memory (AUTO), and the peer's later call raises too.
TEST(RingAbortTest, AbortWakesABlockedCall) {
  for (Transport transport : {Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(20);
    std::atomic<bool> aborted{false};
    std::atomic<bool> rank1_tried{false};
    RunRanks(transport, 2, options, [&](CollectiveCommunication& comm) {
      std::vector<float> data(1000, 1.0f);
      const Tensor t{data.data(), data.size(), DataType::kFloat32};
      if (comm.rank() == 1) {  // joins only after rank 0's aborted call returned
        WaitFor(aborted);
        try {
          comm.AllReduce(t, ReduceOp::kSum);
          ADD_FAILURE() << "rank 1: an all-reduce with an aborted peer succeeded";
        } catch (const Error& e) {
          EXPECT_TRUE(e.code() == ErrorCode::kAborted || e.code() == ErrorCode::kPeerLost)
              << e.what();
        }
        rank1_tried = true;
        return;
      }
      auto work = comm.AllReduceAsync(t, t, ReduceOp::kSum);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // lets the call block
      EXPECT_FALSE(work->Done());
      const auto start = std::chrono::steady_clock::now();
      comm.Abort();
      try {
        work->Wait();
        ADD_FAILURE() << "an aborted call succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
      }
      // Set after the call returned, not at Abort: the thread driving the call sends the abort
      // to the peer before the call raises; rank 1, joining earlier, could find rank 0's data
      // and complete its all-reduce before the abort reached it.
      aborted = true;
      // Far below the 20 s timeout: the abort, not the deadline, ended the call.
      EXPECT_LT(std::chrono::steady_clock::now() - start,
                test_time::Scaled(std::chrono::seconds(5)));
      WaitFor(rank1_tried);  // keeps this communicator until rank 1 has tried
    });
  }
}

// The sockets this process has open, by their "socket:[inode]" names.
std::set<std::string> OpenSockets() {
  std::set<std::string> sockets;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (!ec && target.rfind("socket:", 0) == 0) sockets.insert(target);
  }
  return sockets;
}

// When Abort returns, the peers have been told: the abort is sent and this rank's connections
// are closed, so that a process may exit right after. Here another thread drives the fabric
// (a call blocked on a peer that never joins); Abort does not leave the shutdown to it (the
// connection would close only after the shutdown's linger, some 200 ms later).
TEST(RingAbortTest, AbortReturnsOnceThePeersAreTold) {
  for (Transport transport : {Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(20);
    std::atomic<bool> checked{false};
    RunRanks(transport, 2, options, [&](CollectiveCommunication& comm) {
      if (comm.rank() == 1) {  // never joins; keeps its end open until rank 0 has looked
        WaitFor(checked);
        return;
      }
      std::vector<float> data(1000, 1.0f);
      const Tensor t{data.data(), data.size(), DataType::kFloat32};
      auto work = comm.AllReduceAsync(t, t, ReduceOp::kSum);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // lets the call block
      const std::set<std::string> before = OpenSockets();
      const auto start = std::chrono::steady_clock::now();
      comm.Abort();
      const auto took = std::chrono::steady_clock::now() - start;
      const std::set<std::string> after = OpenSockets();
      int closed = 0;
      for (const std::string& socket : before) closed += after.count(socket) == 0 ? 1 : 0;
      EXPECT_GE(closed, 1) << "rank 0's connection to rank 1 was still open when Abort returned";
      EXPECT_LT(took, test_time::Scaled(std::chrono::seconds(2)));
      EXPECT_THROW(work->Wait(), Error);
      checked = true;
    });
  }
}

// Every call an Abort ends says which call it was and what the Abort found it doing: the one
// running, those queued behind it, one made after: a caller waiting on several Works learns
// which had run.
TEST(RingAbortTest, EveryCallItEndsIsNamed) {
  for (Transport transport : {Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(20);
    std::atomic<bool> checked{false};
    RunRanks(transport, 2, options, [&](CollectiveCommunication& comm) {
      if (comm.rank() == 1) {  // never joins
        WaitFor(checked);
        return;
      }
      std::vector<float> data(1000, 1.0f);
      const Tensor t{data.data(), data.size(), DataType::kFloat32};
      const Tensor u{data.data(), 7, DataType::kFloat32};
      auto running = comm.AllReduceAsync(t, t, ReduceOp::kSum);
      auto queued = comm.AllReduceAsync(u, u, ReduceOp::kMax);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // lets #0 block
      comm.Abort();
      const auto message = [](const std::shared_ptr<Work>& work) -> std::string {
        try {
          work->Wait();
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
          return e.message();
        }
        ADD_FAILURE() << "an aborted call succeeded";
        return {};
      };
      const std::string first = message(running);
      EXPECT_NE(first.find("aborted by its caller"), std::string::npos) << first;
      EXPECT_NE(first.find("#0 all_reduce(f32, sum, count=1000) was running"), std::string::npos)
          << first;
      const std::string second = message(queued);
      EXPECT_NE(second.find("aborted by its caller"), std::string::npos) << second;
      EXPECT_NE(second.find("#1 all_reduce(f32, max, count=7) did not run"), std::string::npos)
          << second;
      const std::string later = message(comm.BroadcastAsync(u, u, 0));
      EXPECT_NE(later.find("#2 broadcast(f32, root=0, count=7) did not run"), std::string::npos)
          << later;
      try {
        comm.AllReduce(u, ReduceOp::kSum);
        ADD_FAILURE() << "a call after Abort succeeded";
      } catch (const Error& e) {
        EXPECT_NE(e.message().find("#3 all_reduce(f32, sum, count=7) did not run"),
                  std::string::npos)
            << e.what();
      }
      checked = true;
    });
  }
}

// A call whose peer never shows up ends with kTimeout after the deadline, not a hang, whether
// the waiter sleeps at once (yield_us 0), yields for the default 10 ms first, or would yield
// for the longest yield_us, 1 s, twice the deadline (the deadline ends the yielding phase too).
class RingSilentPeerTest : public ::testing::TestWithParam<int> {};

TEST_P(RingSilentPeerTest, RaisesTimeoutAtTheDeadline) {
  CommunicationOptions options;
  options.timeout = std::chrono::milliseconds(500);
  options.yield_us = GetParam();
  std::atomic<bool> rank0_done{false};
  RunRanks(Transport::kTcp, 2, options, [&](CollectiveCommunication& comm) {
    if (comm.rank() == 1) {  // keeps its communicator (silent) until rank 0 gave up
      WaitFor(rank0_done);
      return;
    }
    std::vector<double> data(10, 1.0);
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.AllReduce(Tensor{data.data(), data.size(), DataType::kFloat64}, ReduceOp::kSum);
      ADD_FAILURE() << "an all-reduce without its peer succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    }
    const auto elapsed = std::chrono::steady_clock::now() - start;
    rank0_done = true;
    EXPECT_GE(elapsed, std::chrono::milliseconds(450));
    EXPECT_LT(elapsed, test_time::Scaled(std::chrono::seconds(5)));
  });
}

INSTANTIATE_TEST_SUITE_P(Yield, RingSilentPeerTest, ::testing::Values(0, -1, 1'000'000),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return param_info.param == 0 ? std::string("SleepAtOnce")
                                  : param_info.param < 0
                                      ? std::string("DefaultYield")
                                      : std::string("YieldLongerThanTheDeadline");
                         });

}  // namespace
}  // namespace collectives
