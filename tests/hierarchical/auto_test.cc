// AUTO through the public API, with ranks as threads of this process (so every rank is on one
// host) rendezvousing through a memory store: the default options build an AUTO communicator
// that runs every collective in shared memory, exact for every collective x dtype x op x count x
// in-place at world sizes 1 to 8; it reports "shm_small"/"shm"; forcing the ring still gives
// exact results; plans the topology cannot run, and unknown names, are refused with
// kNotSupported; COLLECTIVES_SHM=0 turns shared memory off; several asynchronous calls in flight
// complete exactly. (Mismatches and Abort under AUTO: tests/ring/mismatch_test.cc and
// ring_test.cc.)
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/packing.h"
#include "tests/child_process.h"
#include "tests/ring/collective_checks.h"
#include "tests/ring/run_ranks.h"
#include "tests/scoped_env.h"
#include "tests/time_scale.h"

namespace collectives {
namespace {

using testing::CheckCollective;
using testing::CheckMatrix;
using testing::RunRanks;
using testing::ScopedEnv;
using testing::Transport;

// Every rank on one host with shared memory on, whatever the caller's environment says.
struct OneHost {
  ScopedEnv shm{"COLLECTIVES_SHM", nullptr};
  ScopedEnv host{"COLLECTIVES_HOST_ID", nullptr};
};

// Builds `size` communicators through the public factory on one memory store and returns, per
// rank, the message of what its construction threw (codes: its code, or 0 when it succeeded).
// `per_rank`, when given, changes each rank's copy of `options` first.
std::vector<std::string> ConstructionErrors(
    int size, const CommunicationOptions& options, std::vector<ErrorCode>* codes,
    const std::function<void(int rank, CommunicationOptions&)>& per_rank = {}) {
  auto store = CreateMemoryStore();
  std::vector<std::string> messages(static_cast<size_t>(size));
  codes->assign(size_t(size), ErrorCode(0));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      ClusterSpec spec;
      spec.rank = rank;
      spec.world_size = size;
      spec.master_port = 1;  // unused: the store is given
      CommunicationOptions mine = options;
      if (per_rank) per_rank(rank, mine);
      try {
        auto comm = CreateCommunication(spec, store, mine);
        messages[size_t(rank)] = "built (" + comm->AllReduceAlgorithm(8) + ")";
      } catch (const Error& e) {
        (*codes)[size_t(rank)] = e.code();
        messages[size_t(rank)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return messages;
}

// The options that pick the algorithms and cut the frames must be the same on every rank: where
// one rank's differ, every rank's set-up raises kInvalidArgument at once, naming the option, both
// values and the other rank (not a frame-size mismatch at the first call, nor the whole set-up
// timeout for a shared-memory group one rank never joins). 0 and the default's own value agree.
TEST(OptionsAgreementTest, OptionsThatDifferAcrossRanksFailEverySetUpNamingThem) {
  OneHost one_host;
  struct Case {
    const char* field;  // as the message names it
    std::function<void(CommunicationOptions&)> set;
  };
  const std::vector<Case> cases = {
      {"algorithm", [](CommunicationOptions& o) { o.algorithm = "ring"; }},
      {"chunk_bytes", [](CommunicationOptions& o) { o.chunk_bytes = 4096; }},
      {"small_message_bytes", [](CommunicationOptions& o) { o.small_message_bytes = 1; }},
      {"medium_message_bytes", [](CommunicationOptions& o) { o.medium_message_bytes = 1; }},
      {"implementation",
       [](CommunicationOptions& o) {
         o.implementation = o.implementation == Implementation::kAuto ? Implementation::kRing
                                                                      : Implementation::kAuto;
       }},
  };
  for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
    for (const Case& c : cases) {
      CommunicationOptions options;
      options.implementation = impl;
      options.timeout = std::chrono::seconds(20);
      std::vector<ErrorCode> codes;
      const auto start = std::chrono::steady_clock::now();
      const std::vector<std::string> messages =
          ConstructionErrors(3, options, &codes, [&](int rank, CommunicationOptions& o) {
            if (rank == 2) c.set(o);
          });
      EXPECT_LT(std::chrono::steady_clock::now() - start,
                test_time::Scaled(std::chrono::seconds(10)))
          << c.field << ": not at once";
      for (int r = 0; r < 3; ++r) {
        const std::string& m = messages[size_t(r)];
        EXPECT_EQ(codes[size_t(r)], ErrorCode::kInvalidArgument) << c.field << ": " << m;
        EXPECT_NE(m.find(std::string("CommunicationOptions::") + c.field + " is "),
                  std::string::npos)
            << m;
        EXPECT_NE(m.find(r == 2 ? "on rank 0" : "on rank 2"), std::string::npos) << m;
      }
    }
  }
  // The default given as 0 on some ranks and by its value on another: one communicator.
  std::vector<ErrorCode> codes;
  const std::vector<std::string> messages =
      ConstructionErrors(3, CommunicationOptions{}, &codes, [](int rank, CommunicationOptions& o) {
        if (rank == 1) {
          o.chunk_bytes = 512 * 1024;
          o.small_message_bytes = 64 * 1024;
          o.medium_message_bytes = 8 * 1024 * 1024;
        }
      });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(codes[size_t(r)], ErrorCode(0)) << messages[size_t(r)];
}

class AutoMatrixTest : public ::testing::TestWithParam<int> {};

// The default options: AUTO, shared memory for every collective, exact on every rank.
TEST_P(AutoMatrixTest, DefaultOptionsRunEveryCollectiveExactlyInSharedMemory) {
  OneHost one_host;
  const int size = GetParam();
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  // More than one 1 MiB slot of f32 on few ranks (several steps), less on many (2 cores).
  const size_t large = size <= 4 ? 600'011 : 300'007;
  RunRanks(Transport::kAuto, size, options, [&](CollectiveCommunication& comm) {
    EXPECT_EQ(comm.implementation(), Implementation::kAuto);
    EXPECT_EQ(comm.size(), size);
    if (size >= 2) {
      EXPECT_EQ(comm.AllReduceAlgorithm(8), "shm_small");
      EXPECT_EQ(comm.AllReduceAlgorithm(64 << 20), "shm");
    }
    std::vector<std::string> failures;
    const size_t wrong = CheckMatrix(comm, large, &failures);
    EXPECT_EQ(wrong, 0u) << "rank " << comm.rank() << ": "
                         << (failures.empty() ? "" : failures.front());
    comm.Barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, AutoMatrixTest, ::testing::Range(1, 9),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return std::to_string(param.param) + "Ranks";
                         });

// "shm" forced on one host is what AUTO picks anyway; "ring" and "recursive_doubling" forced run
// over TCP, report it, and stay exact.
TEST(AutoAlgorithmTest, ForcedAlgorithmsThatTheTopologyCanRunAreExact) {
  OneHost one_host;
  struct Case {
    std::string algorithm;
    std::string small;  // AllReduceAlgorithm(8)
    std::string large;  // AllReduceAlgorithm(64 MiB)
  };
  for (const Case& c : {Case{"shm", "shm_small", "shm"}, Case{"ring", "ring", "ring"},
                        Case{"recursive_doubling", "recursive_doubling", "recursive_doubling"}}) {
    SCOPED_TRACE(c.algorithm);
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(60);
    options.algorithm = c.algorithm;
    RunRanks(Transport::kAuto, 3, options, [&](CollectiveCommunication& comm) {
      EXPECT_EQ(comm.implementation(), Implementation::kAuto);
      EXPECT_EQ(comm.AllReduceAlgorithm(8), c.small);
      EXPECT_EQ(comm.AllReduceAlgorithm(64 << 20), c.large);
      std::vector<std::string> failures;
      const size_t wrong = CheckMatrix(comm, 10'007, &failures);
      EXPECT_EQ(wrong, 0u) << "rank " << comm.rank() << ": "
                           << (failures.empty() ? "" : failures.front());
    });
  }
}

// A plan this topology cannot run, or a name no implementation knows, is refused on every rank
// when the communicator is built.
TEST(AutoAlgorithmTest, UnrunnableOrUnknownAlgorithmsAreNotSupported) {
  OneHost one_host;
  struct Case {
    std::string algorithm;
    int size;
  };
  for (const Case& c : {Case{"two_level", 2}, Case{"two_level", 4}, Case{"bogus", 2},
                        Case{"bogus", 1}, Case{"SHM", 2}}) {
    SCOPED_TRACE(c.algorithm + " on " + std::to_string(c.size) + " ranks");
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(20);
    options.algorithm = c.algorithm;
    std::vector<ErrorCode> codes;
    const std::vector<std::string> messages = ConstructionErrors(c.size, options, &codes);
    for (int r = 0; r < c.size; ++r) {
      EXPECT_EQ(codes[size_t(r)], ErrorCode::kNotSupported)
          << "rank " << r << ": " << messages[size_t(r)];
      EXPECT_NE(messages[size_t(r)].find("'" + c.algorithm + "'"), std::string::npos)
          << messages[size_t(r)];
    }
  }
}

// COLLECTIVES_SHM=0: AUTO falls back to the ring's choices (and refuses a forced "shm"), still
// exact.
TEST(AutoAlgorithmTest, SharedMemoryOffFallsBackToTheRing) {
  ScopedEnv host("COLLECTIVES_HOST_ID", nullptr);
  ScopedEnv shm("COLLECTIVES_SHM", "0");
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  RunRanks(Transport::kAuto, 3, options, [&](CollectiveCommunication& comm) {
    EXPECT_EQ(comm.implementation(), Implementation::kAuto);
    EXPECT_EQ(comm.AllReduceAlgorithm(8), "recursive_doubling");
    EXPECT_EQ(comm.AllReduceAlgorithm(64 << 20), "ring");
    for (const std::string& c : testing::AllCollectives()) {
      for (bool in_place : {false, true}) {
        const auto r =
            CheckCollective(comm, c, DataType::kFloat32, ReduceOp::kSum, 1001, in_place, 2);
        EXPECT_EQ(r.wrong, 0u) << r.first;
      }
    }
  });
  options.algorithm = "shm";
  std::vector<ErrorCode> codes;
  const std::vector<std::string> messages = ConstructionErrors(2, options, &codes);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[size_t(r)], ErrorCode::kNotSupported) << messages[size_t(r)];
  }
}

// The packer's default cap is 1 MiB in shared memory as over TCP. A rank that passes 0 and one
// that passes 1 MiB
// cut the list alike; one that passes 256 KiB cuts it otherwise, and every rank is told so,
// nothing written.
TEST(AutoPackingTest, TheDefaultCapIs1MiBInSharedMemoryAndOverTcp) {
  OneHost one_host;
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  RunRanks(Transport::kAuto, 3, options, [&](CollectiveCommunication& comm) {
    EXPECT_EQ(packing::DefaultBytesPerPack(comm), size_t{1} << 20);
    // Eight f32 tensors of 64 KiB: two fused buckets at 256 KiB, one at 1 MiB.
    std::vector<std::vector<float>> data(8, std::vector<float>(16384, float(comm.rank() + 1)));
    std::vector<Tensor> list;
    for (auto& d : data) list.push_back(Tensor{d.data(), d.size(), DataType::kFloat32});
    packing::AllReduce(comm, list, ReduceOp::kSum, comm.rank() == 1 ? size_t{1} << 20 : 0);
    for (const auto& d : data) {
      for (float v : d) ASSERT_EQ(v, 6.0f) << "rank " << comm.rank();
    }
    try {
      packing::AllReduce(comm, list, ReduceOp::kSum, comm.rank() == 2 ? size_t{256} << 10 : 0);
      ADD_FAILURE() << "rank " << comm.rank() << ": lists cut differently went through";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
      const std::string cap = comm.rank() == 2 ? "262144" : "1048576";
      EXPECT_NE(std::string(e.what()).find("bytes_per_pack (" + cap + " here)"), std::string::npos)
          << e.what();
    }
    for (const auto& d : data) {
      for (float v : d) ASSERT_EQ(v, 6.0f) << "rank " << comm.rank();
    }
  });
  RunRanks(Transport::kTcp, 2, options, [&](CollectiveCommunication& comm) {
    EXPECT_EQ(packing::DefaultBytesPerPack(comm), size_t{1} << 20);
  });
}

// Several asynchronous calls of every kind in flight at once, waited on out of order: each
// result exact.
TEST(AutoAsyncTest, MixedCallsInFlightAreExact) {
  OneHost one_host;
  for (int size : {2, 4}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(60);
    RunRanks(Transport::kAuto, size, options, [&](CollectiveCommunication& comm) {
      const int n = comm.size();
      const int rank = comm.rank();
      ASSERT_EQ(comm.AllReduceAlgorithm(8), "shm_small");
      constexpr int kRounds = 3;
      std::vector<std::shared_ptr<Work>> works;
      std::vector<std::vector<float>> reduced;     // all-reduce, in place
      std::vector<std::vector<int32_t>> gathered;  // all-gather
      std::vector<std::vector<int32_t>> gather_in;
      std::vector<std::vector<double>> broadcast;  // from rank (round % n)
      std::vector<std::vector<float>> scatter_in, scatter_out;
      reduced.reserve(kRounds * 2);
      for (int k = 0; k < kRounds; ++k) {
        for (size_t count : {size_t(3 + k), size_t(70'001 + 1000 * k)}) {  // shm_small and shm
          reduced.emplace_back(count, float(rank + k));
          Tensor t{reduced.back().data(), count, DataType::kFloat32};
          works.push_back(comm.AllReduceAsync(t, t, ReduceOp::kSum));
        }
        const size_t gcount = 1000 + size_t(k);
        gather_in.emplace_back(gcount, rank * 10 + k);
        gathered.emplace_back(gcount * size_t(n), -1);
        works.push_back(comm.AllGatherAsync(
            Tensor{gather_in.back().data(), gcount, DataType::kInt32},
            Tensor{gathered.back().data(), gathered.back().size(), DataType::kInt32}));
        const int root = k % n;
        broadcast.emplace_back(5000 + size_t(k), rank == root ? double(k) + 0.5 : -1.0);
        Tensor b{broadcast.back().data(), broadcast.back().size(), DataType::kFloat64};
        works.push_back(comm.BroadcastAsync(b, b, root));
        const size_t scount = 777;
        scatter_in.emplace_back(scount * size_t(n));
        for (size_t i = 0; i < scatter_in.back().size(); ++i) {
          scatter_in.back()[i] = float((i + size_t(rank)) % 5);
        }
        scatter_out.emplace_back(scount, -1.0f);
        works.push_back(comm.ReduceScatterAsync(
            Tensor{scatter_in.back().data(), scatter_in.back().size(), DataType::kFloat32},
            Tensor{scatter_out.back().data(), scount, DataType::kFloat32}, ReduceOp::kMax));
        works.push_back(comm.BarrierAsync());
      }
      // Waited on from the last to the first.
      for (size_t w = works.size(); w-- > 0;) works[w]->Wait();
      for (const auto& w : works) EXPECT_TRUE(w->Done());
      int sum_ranks = 0;
      for (int r = 0; r < n; ++r) sum_ranks += r;
      for (int k = 0; k < kRounds; ++k) {
        for (int j = 0; j < 2; ++j) {
          const float want = float(sum_ranks + n * k);
          for (float v : reduced[size_t(2 * k + j)]) {
            ASSERT_EQ(v, want) << "all-reduce " << k << "/" << j << " on rank " << rank;
          }
        }
        for (int r = 0; r < n; ++r) {
          for (size_t i = 0; i < gather_in[size_t(k)].size(); ++i) {
            ASSERT_EQ(gathered[size_t(k)][size_t(r) * gather_in[size_t(k)].size() + i], r * 10 + k)
                << "all-gather " << k << " on rank " << rank;
          }
        }
        for (double v : broadcast[size_t(k)]) {
          ASSERT_EQ(v, double(k) + 0.5) << "broadcast " << k << " on rank " << rank;
        }
        for (size_t i = 0; i < scatter_out[size_t(k)].size(); ++i) {
          const size_t global = size_t(rank) * scatter_out[size_t(k)].size() + i;
          float want = 0;
          for (int r = 0; r < n; ++r) want = std::max(want, float((global + size_t(r)) % 5));
          ASSERT_EQ(scatter_out[size_t(k)][i], want)
              << "reduce-scatter " << k << " on rank " << rank;
        }
      }
    });
  }
}

// A store through which one rank's read of its host's shared-memory segment name (the key
// ".../shm/0") throws std::bad_alloc: an allocation that fails in the middle of the set-up, not a
// collectives::Error.
class NameReadRunsOutOfMemory final : public Store {
 public:
  explicit NameReadRunsOutOfMemory(std::shared_ptr<Store> store) : store_(std::move(store)) {}
  void Set(const std::string& key, const std::string& value) override { store_->Set(key, value); }
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    if (key.ends_with("/shm/0")) throw std::bad_alloc();
    return store_->Get(key, timeout);
  }
  int64_t Add(const std::string& key, int64_t delta) override { return store_->Add(key, delta); }

 private:
  std::shared_ptr<Store> store_;
};

// Rank 1 of two on one host fails to set up shared memory with something other than a
// collectives::Error (std::bad_alloc): both ranks raise kSystem "out of memory" naming shared
// memory at once, rank 0 (the segment's creator, waiting for rank 1 to attach) included, not a
// kTimeout at the set-up's end.
TEST(AutoSetupTest, ASharedMemoryFailureThatIsNotAnErrorReachesEveryRankAtOnce) {
  OneHost one_host;
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(4);
  auto memory = CreateMemoryStore();
  std::vector<std::string> outcomes(2);
  std::vector<std::chrono::steady_clock::duration> took(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      ClusterSpec spec;
      spec.rank = rank;
      spec.world_size = 2;
      spec.master_port = 1;  // unused: the store is given
      std::shared_ptr<Store> store =
          rank == 1 ? std::make_shared<NameReadRunsOutOfMemory>(memory) : memory;
      const auto start = std::chrono::steady_clock::now();
      try {
        auto comm = CreateCommunication(spec, store, options);
        outcomes[size_t(rank)] = "built";
      } catch (const Error& e) {
        outcomes[size_t(rank)] = std::to_string(int(e.code())) + " " + e.message();
      } catch (const std::exception& e) {
        outcomes[size_t(rank)] = std::string("not a collectives::Error: ") + e.what();
      }
      took[size_t(rank)] = std::chrono::steady_clock::now() - start;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) {
    const std::string& outcome = outcomes[size_t(rank)];
    EXPECT_EQ(
        outcome.rfind(
            std::to_string(int(ErrorCode::kSystem)) + " rank " + std::to_string(rank) + ": ", 0),
        0u)
        << outcome;
    EXPECT_NE(outcome.find("rank 1: shared memory: out of memory"), std::string::npos) << outcome;
    EXPECT_LT(took[size_t(rank)], test_time::Scaled(std::chrono::seconds(3)))
        << "rank " << rank << ": " << outcome;
  }
}

// Where shared memory cannot be had (here a /dev/shm mounted read-only; also none at all, or one
// this user may not use), AUTO runs inside the host over TCP, as with COLLECTIVES_SHM=0, on every
// rank, exact, and says why once per process on stderr; the set-up does not fail. Run in a child
// process with a mount
// namespace of its own, whose stderr the test reads; skipped where mount namespaces cannot be made
// (not root, or no CAP_SYS_ADMIN).
TEST(AutoSetupTest, WithoutUsableSharedMemoryEveryRankFallsBackToTcp) {
  OneHost one_host;
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pipe_fds[0]);
    if (dup2(pipe_fds[1], STDERR_FILENO) < 0 || !testing::EnterAPrivateMountNamespace() ||
        mount("tmpfs", "/dev/shm", "tmpfs", MS_RDONLY, "size=64k") != 0) {
      _exit(77);
    }
    std::string wrong;
    for (int round = 0; round < 2; ++round) {  // the warning comes once, not per communicator
      auto store = CreateMemoryStore();
      std::vector<std::string> errors(2);
      std::vector<std::thread> threads;
      for (int rank = 0; rank < 2; ++rank) {
        threads.emplace_back([&, rank] {
          ClusterSpec spec;
          spec.rank = rank;
          spec.world_size = 2;
          spec.master_port = 1;  // unused: the store is given
          CommunicationOptions options;
          options.timeout = std::chrono::seconds(20);
          try {
            auto comm = CreateCommunication(spec, store, options);
            if (comm->AllReduceAlgorithm(8) != "recursive_doubling") {
              errors[size_t(rank)] = "plans " + comm->AllReduceAlgorithm(8) + " for 8 bytes";
            }
            std::vector<float> data(1001, float(rank + 1));
            comm->AllReduce(Tensor{data.data(), data.size(), DataType::kFloat32}, ReduceOp::kSum);
            for (float v : data) {
              if (v != 3.0f) errors[size_t(rank)] = "all-reduce gave " + std::to_string(v);
            }
          } catch (const std::exception& e) {
            errors[size_t(rank)] = e.what();
          }
        });
      }
      for (std::thread& t : threads) t.join();
      for (int rank = 0; rank < 2; ++rank) {
        if (!errors[size_t(rank)].empty()) {
          wrong += "round " + std::to_string(round) + ", rank " + std::to_string(rank) + ": " +
                   errors[size_t(rank)] + "\n";
        }
      }
    }
    std::fprintf(stderr, "%s", wrong.c_str());
    _exit(wrong.empty() ? 0 : 1);
  }
  close(pipe_fds[1]);
  const std::string output = testing::ReadToEndAndClose(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "cannot mount a read-only /dev/shm in a mount namespace of its own";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << ": " << output;
  const std::string warning = "shared memory cannot be used here";
  const size_t at = output.find(warning);
  EXPECT_NE(at, std::string::npos) << output;
  EXPECT_EQ(output.find(warning, at + 1), std::string::npos) << "warned more than once: " << output;
  EXPECT_NE(output.find("Read-only file system"), std::string::npos) << output;
}

}  // namespace
}  // namespace collectives
