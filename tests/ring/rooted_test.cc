// Reduce, gather, scatter and all-to-all under RING (loopback TCP, and the in-process transport)
// and AUTO (every rank on this host), ranks as threads of this process: every dtype and op,
// counts 0, 1, a prime and sizes past the small-message threshold, in place and out of place,
// every root, uneven all-to-all counts with zeros, argument errors, mismatched calls (another
// root, count, collective or all-to-all split) raising kMismatch on every rank within the
// deadline with no buffer written, and a peer that is gone; then the same checks in real
// processes (ring_worker rooted), and a process killed during reduces, gathers or messages. Every result is checked against a reference computed in
// double / int64 from the inputs (tests/ring/rooted_checks.h).
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communication.h"
#include "collectives/errors.h"
#include "tests/ring/rooted_checks.h"
#include "tests/ring/run_ranks.h"
#include "tests/ring/worker_processes.h"
#include "tests/time_scale.h"

namespace collectives::testing {
namespace {

enum class Mode { kDefault, kLargeTinyChunks, kSmallMessage };

struct MatrixParam {
  Transport transport;
  int size;
  Mode mode;
};

std::string Name(const ::testing::TestParamInfo<MatrixParam>& info) {
  const MatrixParam& p = info.param;
  std::string name = p.transport == Transport::kTcp         ? "Tcp"
                     : p.transport == Transport::kInProcess ? "InProcess"
                                                            : "AutoShm";
  name += std::to_string(p.size) + "Ranks";
  switch (p.mode) {
    case Mode::kDefault:
      return name + "Default";
    case Mode::kLargeTinyChunks:
      return name + "LargeTinyChunks";
    case Mode::kSmallMessage:
      return name + "SmallMessage";
  }
  return name;
}

class RootedMatrixTest : public ::testing::TestWithParam<MatrixParam> {};

TEST_P(RootedMatrixTest, EveryDtypeOpCountAndPlacementIsExactOnEveryRank) {
  const MatrixParam p = GetParam();
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  size_t large = 0;
  switch (p.mode) {
    case Mode::kDefault:
      large = 300'007;  // past the 64 KiB small-message bytes: chain, direct, pairwise
      break;
    case Mode::kLargeTinyChunks:
      options.small_message_bytes = 1;  // the large forms for every non-empty message
      options.chunk_bytes = 24;         // several frames per block, several staging slots
      large = 1'001;
      break;
    case Mode::kSmallMessage:
      options.small_message_bytes = SIZE_MAX;  // the recursive-doubling forms at every size
      large = 30'011;
      break;
  }
  RunRanks(p.transport, p.size, options, [&](CollectiveCommunication& comm) {
    Failures f;
    CheckRootedMatrix(comm, large, f);
    EXPECT_EQ(f.wrong, 0u) << f.first;
  });
}

std::vector<MatrixParam> MatrixParams() {
  std::vector<MatrixParam> params;
  for (int size = 1; size <= 8; ++size) {
    for (Mode m : {Mode::kDefault, Mode::kLargeTinyChunks, Mode::kSmallMessage}) {
      params.push_back({Transport::kTcp, size, m});
    }
    params.push_back({Transport::kAuto, size, Mode::kDefault});
  }
  for (int size : {3, 4}) params.push_back({Transport::kInProcess, size, Mode::kLargeTinyChunks});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Rooted, RootedMatrixTest, ::testing::ValuesIn(MatrixParams()), Name);

// Every root of every rooted collective, small and large, and async calls of every kind in
// flight at once, mixed with an all-reduce, waited on in reverse.
TEST(RootedTest, EveryRootSmallAndLargeAndAsyncCallsInFlight) {
  for (Transport transport : {Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(60);
    options.chunk_bytes = 4096;
    RunRanks(transport, 5, options, [&](CollectiveCommunication& comm) {
      Failures f;
      for (int root = 0; root < comm.size(); ++root) {
        for (size_t count : {size_t{3}, size_t{20'011}}) {
          CheckReduce(comm, DataType::kFloat64, ReduceOp::kSum, count, root % 2 == 0, root, f);
          CheckGather(comm, DataType::kInt32, count, root % 2 == 1, root, f);
          CheckScatter(comm, DataType::kUInt8, count, root % 2 == 0, root, f);
        }
      }
      EXPECT_EQ(f.wrong, 0u) << f.first;

      const int n = comm.size();
      const int rank = comm.rank();
      const size_t count = 5'003;
      std::vector<float> red(count, float(rank + 1)), red_out(count, -1.f);
      std::vector<int64_t> all(count, rank), all_out(count, -1);
      std::vector<int32_t> gat(count, rank * 10), gat_out(count * size_t(n), -1);
      std::vector<int32_t> sca(count * size_t(n)), sca_out(count, -1);
      for (size_t i = 0; i < sca.size(); ++i) sca[i] = int32_t(i);
      std::vector<double> a2a(count * size_t(n)), a2a_out(count * size_t(n), -1);
      for (size_t i = 0; i < a2a.size(); ++i) a2a[i] = rank * 1e6 + double(i);
      std::vector<std::shared_ptr<Work>> works;
      works.push_back(comm.ReduceAsync(Tensor{red.data(), count, DataType::kFloat32},
                                       Tensor{red_out.data(), count, DataType::kFloat32},
                                       ReduceOp::kSum, 1));
      works.push_back(comm.AllReduceAsync(Tensor{all.data(), count, DataType::kInt64},
                                          Tensor{all_out.data(), count, DataType::kInt64},
                                          ReduceOp::kSum));
      works.push_back(comm.GatherAsync(Tensor{gat.data(), count, DataType::kInt32},
                                       Tensor{gat_out.data(), gat_out.size(), DataType::kInt32},
                                       n - 1));
      works.push_back(comm.ScatterAsync(Tensor{sca.data(), sca.size(), DataType::kInt32},
                                        Tensor{sca_out.data(), count, DataType::kInt32}, 0));
      works.push_back(
          comm.AllToAllAsync(Tensor{a2a.data(), a2a.size(), DataType::kFloat64},
                             Tensor{a2a_out.data(), a2a_out.size(), DataType::kFloat64}));
      for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->Wait();
      const float sum = float(n * (n + 1) / 2);
      EXPECT_EQ(red_out, std::vector<float>(count, rank == 1 ? sum : -1.f));
      EXPECT_EQ(all_out, std::vector<int64_t>(count, int64_t(n) * (n - 1) / 2));
      if (rank == n - 1) {
        for (size_t i = 0; i < gat_out.size(); ++i) {
          ASSERT_EQ(gat_out[i], int32_t(i / count) * 10) << i;
        }
      }
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(sca_out[i], int32_t(size_t(rank) * count + i));
      for (size_t j = 0; j < size_t(n); ++j) {
        for (size_t e = 0; e < count; ++e) {
          ASSERT_EQ(a2a_out[j * count + e], double(j) * 1e6 + double(size_t(rank) * count + e));
        }
      }
    });
  }
}

// Reduces and gathers past the 16 MiB that AUTO's shared-memory forms stage at once (a reduce
// runs in pieces there, a gather on the ring), in place and out of place, element by element.
TEST(RootedTest, LargeReduceAndGatherInPieces) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(120);
  RunRanks(Transport::kAuto, 3, options, [&](CollectiveCommunication& comm) {
    Failures f;
    CheckReduce(comm, DataType::kInt32, ReduceOp::kSum, 4'200'007, false, 1, f);
    CheckReduce(comm, DataType::kFloat32, ReduceOp::kMax, 4'200'011, true, 2, f);
    CheckGather(comm, DataType::kInt32, 1'500'007, false, 0, f);
    CheckGather(comm, DataType::kUInt8, 6'000'001, true, 2, f);
    EXPECT_EQ(f.wrong, 0u) << f.first;
  });
}

// Equal blocks passed without counts on one rank and as explicit counts on the others are the
// same call.
TEST(RootedTest, AllToAllWithAndWithoutCountsMixAcrossRanks) {
  for (Transport transport : {Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(30);
    RunRanks(transport, 3, options, [&](CollectiveCommunication& comm) {
      std::vector<int32_t> send(6), recv(6, -1);
      for (size_t i = 0; i < 6; ++i) send[i] = comm.rank() * 100 + int32_t(i);
      const Tensor in{send.data(), 6, DataType::kInt32};
      const Tensor out{recv.data(), 6, DataType::kInt32};
      if (comm.rank() == 0) {
        comm.AllToAll(in, out);
      } else {
        comm.AllToAll(in, out, {2, 2, 2}, {2, 2, 2});
      }
      for (size_t j = 0; j < 3; ++j) {
        for (size_t e = 0; e < 2; ++e) {
          EXPECT_EQ(recv[j * 2 + e], int32_t(j) * 100 + comm.rank() * 2 + int32_t(e));
        }
      }
    });
  }
}

// Arguments one rank alone can tell are wrong: Error(kInvalidArgument) on the caller's thread,
// naming the collective, nothing written, the communicator still usable.
TEST(RootedTest, BadArgumentsRaiseInvalidArgumentAndWriteNothing) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(30);
  RunRanks(Transport::kTcp, 3, options, [&](CollectiveCommunication& comm) {
    std::vector<float> a(12, 1.f), b(12, 2.f);
    const std::vector<float> b_before = b;
    const auto t = [](std::vector<float>& v, size_t count, size_t offset = 0) {
      return Tensor{v.data() + offset, count, DataType::kFloat32};
    };
    const auto expect_invalid = [&](const std::function<void()>& call, const std::string& words) {
      try {
        call();
        ADD_FAILURE() << "rank " << comm.rank() << ": no error; expected: " << words;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    };
    expect_invalid([&] { comm.Reduce(t(a, 4), t(b, 4), ReduceOp::kSum, 3); }, "reduce: root 3");
    expect_invalid([&] { comm.Gather(t(a, 4), t(b, 12), -1); }, "gather: root -1");
    expect_invalid([&] { comm.Scatter(t(a, 12), t(b, 4), 7); }, "scatter: root 7");
    expect_invalid([&] { comm.ReduceAsync(t(a, 4), t(b, 4), ReduceOp(9), 0); }, "reduce");
    if (comm.rank() == 0) {
      expect_invalid([&] { comm.Reduce(t(a, 4), t(b, 5), ReduceOp::kSum, 0); }, "reduce");
      expect_invalid([&] { comm.Gather(t(a, 4), t(b, 11), 0); }, "gather");
      expect_invalid([&] { comm.Scatter(t(a, 11), t(b, 4), 0); }, "scatter");
      // Overlapping without being the in-place form.
      expect_invalid([&] { comm.Reduce(t(a, 4, 1), t(a, 4), ReduceOp::kSum, 0); }, "overlap");
      expect_invalid([&] { comm.Gather(t(a, 4, 1), t(a, 12), 0); }, "overlap");
      expect_invalid([&] { comm.Scatter(t(a, 12), t(a, 4, 1), 0); }, "overlap");
    }
    expect_invalid([&] { comm.AllToAll(t(a, 4), t(b, 4)); }, "multiple of size 3");
    expect_invalid([&] { comm.AllToAll(t(a, 6), t(b, 3)); }, "all_to_all");
    expect_invalid(
        [&] {
          comm.AllToAll(t(a, 6), t(b, 6), {2, 2}, {2, 2, 2});
        },
        "send_counts has 2 entries");
    expect_invalid(
        [&] {
          comm.AllToAll(t(a, 6), t(b, 6), {2, 2, 3}, {2, 2, 2});
        },
        "send_counts adds up to more than send.count 6");
    expect_invalid(
        [&] {
          comm.AllToAll(t(a, 6), t(b, 6), {2, 2, 1}, {2, 2, 2});
        },
        "send_counts adds up to 5");
    expect_invalid([&] { comm.AllToAll(t(a, 6), t(b, 6), {2, 2, 2}, {}); }, "recv_counts has 0");
    expect_invalid([&] { comm.AllToAll(t(a, 6), t(a, 6, 3)); }, "overlap");
    EXPECT_EQ(b, b_before);
    // Still usable.
    std::vector<float> out(3, 0.f);
    comm.Gather(t(a, 1), comm.rank() == 2 ? t(out, 3) : Tensor{}, 2);
    if (comm.rank() == 2) {
      EXPECT_EQ(out, std::vector<float>(3, 1.f));
    }
  });
}

// What differs between the ranks' calls.
enum class Differ { kRoot, kCount, kCollective, kSplit };

struct MismatchParam {
  Differ differ;
  Transport transport;
  int size;
  size_t count;  // per-rank elements: small (recursive doubling) or large (chain, direct, pairwise)
};

std::string MismatchName(const ::testing::TestParamInfo<MismatchParam>& info) {
  const MismatchParam& p = info.param;
  std::string name = p.differ == Differ::kRoot         ? "Root"
                     : p.differ == Differ::kCount      ? "Count"
                     : p.differ == Differ::kCollective ? "Collective"
                                                       : "AllToAllSplit";
  name += p.transport == Transport::kTcp ? "Tcp" : "Auto";
  return name + std::to_string(p.size) + "Ranks" + std::to_string(p.count) + "Elements";
}

class RootedMismatchTest : public ::testing::TestWithParam<MismatchParam> {};

// The last rank's call differs (another root, count, rooted collective, or an all-to-all whose
// counts disagree with its peers'): every rank raises kMismatch at that call, well within the
// deadline, no buffer of any rank changed, and the communicator stays broken.
TEST_P(RootedMismatchTest, EveryRankRaisesMismatchAndNoBufferChanges) {
  const MismatchParam p = GetParam();
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(20);
  RunRanks(p.transport, p.size, options, [&](CollectiveCommunication& comm) {
    const int n = comm.size();
    const int rank = comm.rank();
    const bool odd = rank == n - 1;
    const size_t count = p.count + (p.differ == Differ::kCount && odd ? 4 : 0);
    const int root = p.differ == Differ::kRoot && odd ? 1 : 0;
    std::vector<float> send(count * size_t(n) + 8, 3.f);
    std::vector<float> recv(count * size_t(n) + 8, 7.f);
    const std::vector<float> send_before = send, recv_before = recv;
    const auto start = std::chrono::steady_clock::now();
    const auto t = [&](std::vector<float>& v, size_t c) {
      return Tensor{v.data(), c, DataType::kFloat32};
    };
    std::string error;
    try {
      switch (p.differ) {
        case Differ::kRoot:
        case Differ::kCount:
          comm.Reduce(t(send, count), t(recv, count), ReduceOp::kSum, root);
          break;
        case Differ::kCollective:
          if (odd) {
            comm.Scatter(t(send, count * size_t(n)), t(recv, count), 0);
          } else {
            comm.Gather(t(send, count), t(recv, count * size_t(n)), 0);
          }
          break;
        case Differ::kSplit: {
          // Rank n-1 expects one element more from rank 0 than rank 0 sends it.
          std::vector<size_t> sends(size_t(n), count), recvs(size_t(n), count);
          if (odd) recvs[0] += 1, recvs[size_t(n - 1)] -= 1, sends[size_t(n - 1)] -= 1;
          size_t total_send = 0, total_recv = 0;
          for (int j = 0; j < n; ++j)
            total_send += sends[size_t(j)], total_recv += recvs[size_t(j)];
          comm.AllToAll(t(send, total_send), t(recv, total_recv), sends, recvs);
          break;
        }
      }
      comm.Barrier();
      ADD_FAILURE() << "rank " << rank << ": the mismatch went unnoticed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMismatch) << "rank " << rank << ": " << e.what();
      error = e.what();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, test_time::Scaled(10.0)) << "rank " << rank << ": " << error;
    EXPECT_EQ(error.find("barrier"), std::string::npos)
        << "rank " << rank << " raised at the barrier, not at the mismatched call: " << error;
    EXPECT_EQ(send, send_before) << "rank " << rank;
    EXPECT_EQ(recv, recv_before) << "rank " << rank;
    if (p.differ == Differ::kSplit && rank == 0) {
      EXPECT_NE(
          error.find("rank 0 sends " + std::to_string(p.count) + " elements to rank " +
                     std::to_string(n - 1) + ", which expects " + std::to_string(p.count + 1)),
          std::string::npos)
          << error;
    }
    EXPECT_THROW(comm.Barrier(), Error) << "rank " << rank << ": not broken after the mismatch";
  });
}

std::vector<MismatchParam> MismatchParams() {
  std::vector<MismatchParam> params;
  for (Differ d : {Differ::kRoot, Differ::kCount, Differ::kCollective, Differ::kSplit}) {
    for (int size : {2, 3, 5}) {
      for (size_t count : {size_t{10}, size_t{40'000}}) {
        params.push_back({d, Transport::kTcp, size, count});
      }
    }
    params.push_back({d, Transport::kAuto, 4, 10});
    params.push_back({d, Transport::kAuto, 4, 40'000});
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Rooted, RootedMismatchTest, ::testing::ValuesIn(MismatchParams()),
                         MismatchName);

// A rank whose communicator is gone: the others' gather (which waits for its block), reduce and
// all-to-all raise, kPeerLost or kAborted, within the deadline rather than hanging.
TEST(RootedTest, APeerThatIsGoneEndsTheCallWithAnError) {
  for (Transport transport : {Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(20);
    std::atomic<int> gone{0};
    std::atomic<int> past_barrier{0};
    RunRanks(transport, 4, options, [&](CollectiveCommunication& comm) {
      std::vector<int32_t> send(100'000, comm.rank()), recv(400'000, -1);
      comm.Barrier();
      if (comm.rank() == 3) {
        // Gone once the others are past the barrier (they would see it leave during it): its
        // communicator is destroyed, its connections close.
        const auto cap = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (past_barrier < 3 && std::chrono::steady_clock::now() < cap) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return;
      }
      past_barrier++;
      const auto start = std::chrono::steady_clock::now();
      try {
        if (comm.rank() == 0) {
          comm.Gather(Tensor{send.data(), send.size(), DataType::kInt32},
                      Tensor{recv.data(), recv.size(), DataType::kInt32}, 0);
        } else {
          comm.Gather(Tensor{send.data(), send.size(), DataType::kInt32}, Tensor{}, 0);
        }
        comm.AllToAll(Tensor{recv.data(), 4, DataType::kInt32},
                      Tensor{recv.data() + 4, 4, DataType::kInt32});
        ADD_FAILURE() << "rank " << comm.rank() << ": no error with rank 3 gone";
      } catch (const Error& e) {
        EXPECT_TRUE(e.code() == ErrorCode::kPeerLost || e.code() == ErrorCode::kAborted)
            << e.what();
        gone++;
      }
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                test_time::Scaled(10.0));
    });
    EXPECT_EQ(gone.load(), 3);
  }
}

// Real processes: ring_worker in its "rooted" mode (the matrix above and messages around the
// ring) under RING, under AUTO on one host (shared memory for the other collectives), and under
// AUTO on pretend hosts of different rank counts (the calls here on the flat ring beside the
// two-level plans).
struct ProcessCase {
  const char* name;
  int size;
  std::string implementation;
  std::vector<std::string> host_ids;
};

void PrintTo(const ProcessCase& c, std::ostream* os) { *os << c.name; }

class RootedProcessTest : public ::testing::TestWithParam<ProcessCase> {};

TEST_P(RootedProcessTest, EveryCallIsExactInEveryProcess) {
  const ProcessCase& c = GetParam();
  Placement placement;
  placement.implementation = c.implementation;
  placement.host_ids = c.host_ids;
  std::vector<Worker> workers = Start(c.size, {"rooted", "100003"}, placement);
  const bool finished = WaitAll(workers, All(c.size), std::chrono::seconds(120));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < c.size; ++rank) {
    const Worker& w = workers[size_t(rank)];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)
        << "rank " << rank << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("rank " + std::to_string(rank) + ": rooted 0 wrong"), std::string::npos)
        << w.output;
  }
}

INSTANTIATE_TEST_SUITE_P(Processes, RootedProcessTest,
                         ::testing::Values(ProcessCase{"Ring3", 3, "ring", {}},
                                           ProcessCase{"Auto3OneHost", 3, "auto", {}},
                                           ProcessCase{"Auto3TwoHosts", 3, "auto", {"a", "a", "b"}},
                                           ProcessCase{
                                               "Auto4TwoHosts", 4, "auto", {"a", "b", "a", "b"}}),
                         [](const ::testing::TestParamInfo<ProcessCase>& param) {
                           return std::string(param.param.name);
                         });

// A rank killed (SIGKILL) while the others loop over reduces or gathers (the root turning), or
// while its partner trades messages with it: every rank that waits for it exits within 5 s,
// raising kPeerLost naming it.
struct KillCase {
  const char* name;
  std::string collective;
  int size;
  std::string implementation;
  std::vector<int> waiters;  // the ranks that must notice
};

void PrintTo(const KillCase& c, std::ostream* os) { *os << c.name; }

class RootedKillTest : public ::testing::TestWithParam<KillCase> {};

TEST_P(RootedKillTest, EveryRankThatWaitsForTheDeadOneRaisesPeerLost) {
  const KillCase& c = GetParam();
  const int victim = 1;
  Placement placement;
  placement.implementation = c.implementation;
  std::vector<Worker> workers = Start(c.size, {"loop", c.collective, "262144", "60000"}, placement);
  const auto ready_by = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (bool ready = false; !ready;) {
    ready = true;
    for (Worker& w : workers) {
      Drain(w);
      ready = ready && w.output.find("ready") != std::string::npos;
    }
    if (!ready && std::chrono::steady_clock::now() > ready_by) {
      KillAll(workers);
      FAIL() << "the workers never started their loop";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(workers[size_t(victim)].pid, SIGKILL);
  const bool exited = WaitAll(workers, c.waiters, std::chrono::seconds(5));
  KillAll(workers);
  ASSERT_TRUE(exited) << "a rank that waits for the dead one was still running 5 s after the kill";
  for (int r : c.waiters) {
    const Worker& w = workers[size_t(r)];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 20 + int(ErrorCode::kPeerLost))
        << "rank " << r << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("lost rank " + std::to_string(victim)), std::string::npos)
        << "rank " << r << ": " << w.output;
  }
}

INSTANTIATE_TEST_SUITE_P(Processes, RootedKillTest,
                         ::testing::Values(KillCase{"ReduceRing", "reduce", 4, "ring", {0, 2, 3}},
                                           KillCase{"GatherRing", "gather", 4, "ring", {0, 2, 3}},
                                           KillCase{"ReduceAuto", "reduce", 4, "auto", {0, 2, 3}},
                                           KillCase{"GatherAuto", "gather", 4, "auto", {0, 2, 3}},
                                           KillCase{"SendRecvRing", "send_recv", 4, "ring", {0}},
                                           KillCase{"SendRecvAuto", "send_recv", 2, "auto", {0}}),
                         [](const ::testing::TestParamInfo<KillCase>& param) {
                           return std::string(param.param.name);
                         });

}  // namespace
}  // namespace collectives::testing
