// Real processes on one host: the test starts ring_worker N times with torchrun-style
// environment variables and checks every collective in every process, with RING (TCP over
// loopback) and with AUTO (shared memory: the worker must report the "shm" algorithm). Faults
// between processes are in fault_test.cc.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "tests/ring/worker_processes.h"

namespace {

using namespace collectives::testing;

using MultiProcessParam = std::tuple<int, std::string>;  // world size, implementation

// Runs `size` workers in check mode (an all-reduce of `count` floats among the collectives) with
// `placement` until they end, 240 s at most; false when they did not.
bool RunChecks(int size, const std::string& count, const Placement& placement,
               std::vector<Worker>* workers) {
  *workers = Start(size, {"check", count}, placement);
  const bool finished = WaitAll(*workers, All(size), std::chrono::seconds(240));
  KillAll(*workers);
  return finished;
}

// Expects every worker to have ended exactly, its all-reduce run as `algorithm`.
void ExpectExactWith(const std::vector<Worker>& workers, const std::string& algorithm) {
  for (size_t rank = 0; rank < workers.size(); ++rank) {
    const Worker& w = workers[rank];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)
        << "rank " << rank << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("rank " + std::to_string(rank) + ": 0 wrong"), std::string::npos)
        << w.output;
    EXPECT_NE(w.output.find("algorithm " + algorithm), std::string::npos) << w.output;
  }
}

// RunChecks, expecting every worker to finish exactly, with the shared-memory algorithm or
// without it (every collective over TCP) as `shm` says.
void ExpectExact(int size, const std::string& count, const Placement& placement, bool shm) {
  std::vector<Worker> workers;
  ASSERT_TRUE(RunChecks(size, count, placement, &workers)) << "workers did not finish in time";
  for (int rank = 0; rank < size; ++rank) {
    const Worker& w = workers[rank];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)
        << "rank " << rank << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("0 wrong"), std::string::npos) << w.output;
    EXPECT_EQ(w.output.find("algorithm shm") != std::string::npos, shm) << w.output;
  }
}

// A wrapper that runs a worker in a mount namespace of its own, with a tmpfs mounted with
// `options` at /dev/shm; the worker exits 77 where that cannot be made (not root).
std::vector<std::string> OwnDevShm(const std::string& options) {
  return {"unshare", "-m", "sh", "-c",
          "mount --make-rprivate / && mount -t tmpfs -o " + options +
              " tmpfs /dev/shm || exit 77; exec \"$0\" \"$@\""};
}

class MultiProcessTest : public ::testing::TestWithParam<MultiProcessParam> {};

TEST_P(MultiProcessTest, EveryCollectiveIsExactInEveryProcess) {
  const auto& [size, implementation] = GetParam();
  Placement placement;
  placement.implementation = implementation;
  ExpectExact(size, "1000003", placement, implementation == "auto");
}

INSTANTIATE_TEST_SUITE_P(Processes, MultiProcessTest,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values("ring", "auto")),
                         [](const ::testing::TestParamInfo<MultiProcessParam>& param_info) {
                           return std::get<1>(param_info.param) + "_" +
                                  std::to_string(std::get<0>(param_info.param)) + "ranks";
                         });

// One rank's environment turns shared memory off (COLLECTIVES_SHM=0): every rank learns it at
// set-up and they all run over TCP, exactly, instead of half of them waiting in shared memory.
TEST(MultiProcessShmTest, OneRankWithoutSharedMemoryTurnsItOffForAll) {
  Placement placement;
  placement.shm_off_rank = 1;
  ExpectExact(3, "100003", placement, /*shm=*/false);
}

// Pretend hosts of different rank counts (two ranks on "a", one on "b"), AUTO left to choose:
// it calibrates the two levels against the flat ring and runs every collective exactly. (The
// planner once read a host's rank list past its end here; the address sanitizer run of this
// test catches that.)
TEST(MultiProcessShmTest, HostsOfDifferentRankCountsRunExactly) {
  Placement placement;
  placement.host_ids = {"a", "a", "b"};
  ExpectExact(3, "100003", placement, /*shm=*/false);
}

// Hosts of different rank counts with the two levels forced: every all-reduce crosses hosts in
// as many lanes as the smallest host of several ranks has (a rank alone on its host takes part
// in every lane, ranks past the lanes only add their input), the other collectives but the
// broadcast run on the flat ring; and hosts of as many ranks each, where every collective but
// the barrier runs in two levels. Every collective, dtype and op exact on every rank, with small
// steps (several per call) on some.
struct UnevenCase {
  const char* name;
  std::vector<std::string> host_ids;
  std::string slot_bytes;  // COLLECTIVES_SHM_SLOT_BYTES of every rank, or empty
};

void PrintTo(const UnevenCase& c, std::ostream* os) { *os << c.name; }

class UnevenHostsTest : public ::testing::TestWithParam<UnevenCase> {};

TEST_P(UnevenHostsTest, EveryCollectiveIsExactInTwoLevels) {
  const UnevenCase& c = GetParam();
  const int size = int(c.host_ids.size());
  Placement placement;
  placement.host_ids = c.host_ids;
  placement.algorithm = "two_level";
  if (!c.slot_bytes.empty()) placement.slot_bytes.assign(size_t(size), c.slot_bytes);
  std::vector<Worker> workers;
  ASSERT_TRUE(RunChecks(size, "100003", placement, &workers)) << "workers did not finish in time";
  ExpectExactWith(workers, "two_level");
}

INSTANTIATE_TEST_SUITE_P(
    Auto, UnevenHostsTest,
    ::testing::Values(
        UnevenCase{"TwoAndOne", {"a", "a", "b"}, "65536"},
        UnevenCase{"ThreeAndTwo", {"a", "a", "a", "b", "b"}, ""},
        UnevenCase{"OneTwoAndThree", {"a", "b", "b", "c", "c", "c"}, "65536"},
        // Hosts of interleaved ranks; a slot size the groups round up (to 5056):
        // the rank alone on no host here, but every host cuts the same steps.
        UnevenCase{"ThreeAndTwoInterleaved", {"a", "b", "a", "b", "a"}, "5000"},
        UnevenCase{"TwoAndOneOddSlot", {"a", "a", "b"}, "5000"},
        // One lone rank in three lanes; two lone ranks, which share a connection
        // in every lane.
        UnevenCase{"OneAndThree", {"a", "b", "b", "b"}, "65536"},
        UnevenCase{"OneOneAndThree", {"a", "b", "c", "c", "c"}, "65536"},
        // Hosts of as many ranks each: the reduce-scatter in two levels too (each
        // local rank reduces its lane's blocks in shared memory, the lane
        // reduce-scatters them across hosts), in many small steps, with
        // interleaved ranks, and with three hosts of three.
        UnevenCase{"TwoAndTwoSmallSlots", {"a", "a", "b", "b"}, "5000"},
        UnevenCase{"TwoAndTwoInterleaved", {"a", "b", "b", "a"}, "65536"},
        UnevenCase{"ThreeHostsOfThree", {"a", "b", "c", "a", "b", "c", "c", "b", "a"}, "65536"}),
    [](const ::testing::TestParamInfo<UnevenCase>& p) { return std::string(p.param.name); });

// A rank alone on its host whose /dev/shm is read-only (a mount namespace of its own) needs no
// shared memory: the two levels still run on the other host, exactly. It does not turn shared
// memory off for the other ranks, and a forced "two_level" is accepted.
TEST(MultiProcessShmTest, ARankAloneOnItsHostNeedsNoSharedMemory) {
  constexpr int kSize = 3;
  Placement placement;
  placement.host_ids = {"a", "a", "b"};
  placement.algorithm = "two_level";
  placement.wrappers.resize(kSize);
  placement.wrappers[2] = OwnDevShm("ro");
  std::vector<Worker> workers;
  ASSERT_TRUE(RunChecks(kSize, "10007", placement, &workers)) << "workers did not finish in time";
  if (WIFEXITED(workers[2].status) && WEXITSTATUS(workers[2].status) == 77) {
    GTEST_SKIP() << "cannot mount a read-only /dev/shm in a mount namespace of its own (root)";
  }
  ExpectExactWith(workers, "two_level");
  for (const Worker& w : workers) {
    EXPECT_EQ(w.output.find("cannot use shared memory"), std::string::npos) << w.output;
  }
}

// Two pretend hosts of two ranks, the ranks of one with another COLLECTIVES_SHM_SLOT_BYTES: the
// steps between hosts would be cut at different sizes. Every rank fails at set-up naming the
// variable and the ranks that differ, not later in calibration with a frame of an unexpected
// size, or "peer lost", naming neither.
TEST(MultiProcessShmTest, ASlotSizeThatDiffersBetweenHostsIsNamedOnEveryRank) {
  constexpr int kSize = 4;
  Placement placement;
  placement.host_ids = {"a", "a", "b", "b"};
  placement.slot_bytes = {"", "", "262144", "262144"};
  std::vector<Worker> workers = Start(kSize, {"check", "1003"}, placement);
  const bool finished = WaitAll(workers, All(kSize), std::chrono::seconds(240));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < kSize; ++rank) {
    const Worker& w = workers[rank];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) != 0)
        << "rank " << rank << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("COLLECTIVES_SHM_SLOT_BYTES is unset on rank 0 but 262144 on rank 2"),
              std::string::npos)
        << w.output;
  }
}

// A slot of 2^62 bytes: every rank refuses it at set-up, naming the variable. The segment's size
// (members x 2 x slot) would wrap past 2^64 to a few KiB, every check would agree with the
// wrapped size, and zeroing a member's slots would run off the mapping (SIGSEGV on every rank).
TEST(MultiProcessShmTest, AnAbsurdSlotSizeIsRefusedOnEveryRank) {
  constexpr int kSize = 2;
  Placement placement;
  placement.host_ids = {"a", "a"};
  placement.slot_bytes.assign(kSize, "4611686018427387904");
  std::vector<Worker> workers = Start(kSize, {"check", "10"}, placement);
  const bool finished = WaitAll(workers, All(kSize), std::chrono::seconds(120));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < kSize; ++rank) {
    const Worker& w = workers[size_t(rank)];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 21)  // 20 + kInvalidArgument
        << "rank " << rank << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("rank " + std::to_string(rank) +
                            ": COLLECTIVES_SHM_SLOT_BYTES is 4611686018427387904, more than the "
                            "1073741824 bytes a slot may have"),
              std::string::npos)
        << w.output;
  }
}

// Two pretend hosts, where the creator of host b's segment (rank 2) has a /dev/shm too small for
// it (a mount namespace of its own). Every rank publishes how its shared memory went and raises
// the first failure, code and text: host a's ranks too raise "/dev/shm is too small", not a
// "peer lost: lost rank 2 ... while sending #0 barrier()" in the calibration, which would name
// neither shared memory nor the cause.
TEST(MultiProcessShmTest, ASharedMemoryFailureOnOneHostIsRaisedOnEveryHost) {
  constexpr int kSize = 4;
  Placement placement;
  placement.host_ids = {"a", "a", "b", "b"};
  placement.wrappers.resize(kSize);
  placement.wrappers[2] = OwnDevShm("size=256k");
  std::vector<Worker> workers = Start(kSize, {"check", "10"}, placement);
  const bool finished = WaitAll(workers, All(kSize), std::chrono::seconds(120));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  if (WIFEXITED(workers[2].status) && WEXITSTATUS(workers[2].status) == 77) {
    GTEST_SKIP() << "cannot mount a small /dev/shm in a mount namespace of its own (needs root)";
  }
  for (int rank = 0; rank < kSize; ++rank) {
    const Worker& w = workers[size_t(rank)];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 23)  // 20 + kSystem
        << "rank " << rank << " status " << w.status << ": " << w.output;
    const std::string who = "rank " + std::to_string(rank) + ": " + (rank == 2 ? "" : "rank 2: ");
    EXPECT_NE(w.output.find(who + "shared memory: sizing"), std::string::npos) << w.output;
    EXPECT_NE(w.output.find("/dev/shm is too small"), std::string::npos) << w.output;
  }
}

// Runs `size` workers in mismatch mode (`collective`, or each rank's RING_WORKER_COLLECTIVE in
// placement.env) and expects every one to raise kMismatch, neither returning nor writing recv,
// within `limit`.
void ExpectMismatchOnEveryRank(int size, const std::string& collective, const Placement& placement,
                               std::chrono::seconds limit) {
  std::vector<Worker> workers = Start(size, {"mismatch", collective}, placement);
  const bool finished = WaitAll(workers, All(size), limit);
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (const Worker& w : workers) {
    // A rank still finishing its set-up's last call when a faster one raised gets the abort
    // there (the communicator is broken before its user could call it): kMismatch all the same.
    EXPECT_NE(w.output.find("error 5 [mismatch]"), std::string::npos) << w.output;
    EXPECT_EQ(w.output.find("returned"), std::string::npos) << w.output;
    EXPECT_EQ(w.output.find("recv written"), std::string::npos) << w.output;
  }
}

// `host_ids` pretend hosts (empty: RING), rank `differing` calling `other`
// (RING_WORKER_COLLECTIVE).
Placement OneRankCalls(const std::vector<std::string>& host_ids, int size, int differing,
                       const std::string& other) {
  Placement placement;
  placement.host_ids = host_ids;
  if (host_ids.empty()) placement.implementation = "ring";
  placement.env.resize(size_t(size));
  placement.env[size_t(differing)].push_back("RING_WORKER_COLLECTIVE=" + other);
  return placement;
}

// Two pretend hosts (and three) whose ranks make different calls that a two-level plan could
// let pass: a broadcast whose hosts name different roots (the root's host only sends, so no
// rank of it would check anyone, and every host would return its own root's data), and calls
// of zero elements on one host against one element on another (nothing crosses, so the
// zero-element host would return and the other raise kPeerLost later). Every rank raises
// kMismatch, with recv untouched, as on RING.
struct MismatchCase {
  const char* name;
  std::vector<std::string> host_ids;
  const char* collective;
  std::vector<std::string> roots;   // RING_WORKER_ROOT per rank, or empty
  std::vector<std::string> counts;  // RING_WORKER_COUNT per rank, or empty
  std::string algorithm{};          // forced, or empty (calibrated)
};

void PrintTo(const MismatchCase& c, std::ostream* os) { *os << c.name; }

class TwoLevelMismatchTest : public ::testing::TestWithParam<MismatchCase> {};

TEST_P(TwoLevelMismatchTest, EveryRankRaisesWithNothingWritten) {
  const MismatchCase& c = GetParam();
  const int size = int(c.host_ids.size());
  Placement placement;
  placement.host_ids = c.host_ids;
  placement.algorithm = c.algorithm;
  placement.env.resize(size_t(size));
  for (int rank = 0; rank < size; ++rank) {
    if (!c.roots.empty())
      placement.env[size_t(rank)].push_back("RING_WORKER_ROOT=" + c.roots[size_t(rank)]);
    if (!c.counts.empty())
      placement.env[size_t(rank)].push_back("RING_WORKER_COUNT=" + c.counts[size_t(rank)]);
  }
  ExpectMismatchOnEveryRank(size, c.collective, placement, std::chrono::seconds(120));
}

INSTANTIATE_TEST_SUITE_P(
    Auto, TwoLevelMismatchTest,
    ::testing::Values(
        MismatchCase{"BroadcastRootsOnDifferentHosts",
                     {"a", "a", "b", "b"},
                     "broadcast",
                     {"0", "0", "2", "2"},
                     {}},
        MismatchCase{"BroadcastRootsOfDifferentLocalIndex",
                     {"a", "a", "b", "b"},
                     "broadcast",
                     {"0", "0", "1", "1"},
                     {}},
        MismatchCase{"BroadcastOfThreeHostsOneDiffering",
                     {"a", "a", "b", "b", "c", "c"},
                     "broadcast",
                     {"0", "0", "0", "0", "4", "4"},
                     {}},
        MismatchCase{"AllReduceOfNothingOnOneHost",
                     {"a", "a", "b", "b"},
                     "all_reduce",
                     {},
                     {"0", "0", "1", "1"}},
        MismatchCase{"AllReduceOfNothingOnOneOfThreeHosts",
                     {"a", "a", "b", "b", "c", "c"},
                     "all_reduce",
                     {},
                     {"1", "1", "1", "1", "0", "0"}},
        MismatchCase{"AllGatherOfNothingOnOneHost",
                     {"a", "a", "b", "b"},
                     "all_gather",
                     {},
                     {"0", "0", "1", "1"}},
        // The two-level reduce-scatter (blocks of count / 4 or / 6
        // elements): nothing on one host, another count inside a
        // host, another count on one host of three.
        MismatchCase{"ReduceScatterOfNothingOnOneHost",
                     {"a", "a", "b", "b"},
                     "reduce_scatter",
                     {},
                     {"0", "0", "8", "8"},
                     "two_level"},
        MismatchCase{"ReduceScatterOfAnotherCountInsideAHost",
                     {"a", "a", "b", "b"},
                     "reduce_scatter",
                     {},
                     {"8", "12", "8", "8"},
                     "two_level"},
        MismatchCase{"ReduceScatterOfAnotherCountOnOneOfThreeHosts",
                     {"a", "a", "b", "b", "c", "c"},
                     "reduce_scatter",
                     {},
                     {"12", "12", "12", "12", "18", "18"},
                     "two_level"},
        // Hosts of different rank counts, the two levels
        // forced: the host of one rank calls with nothing,
        // or with another count.
        MismatchCase{"AllReduceOfNothingOnTheHostOfOne",
                     {"a", "a", "b"},
                     "all_reduce",
                     {},
                     {"1", "1", "0"},
                     "two_level"},
        MismatchCase{"AllReduceOfAnotherCountOnTheHostOfOne",
                     {"a", "a", "b"},
                     "all_reduce",
                     {},
                     {"5", "5", "3"},
                     "two_level"},
        MismatchCase{"AllReduceOfAnotherCountOnTheSmallerHost",
                     {"a", "a", "a", "b", "b"},
                     "all_reduce",
                     {},
                     {"5", "5", "5", "3", "3"},
                     "two_level"},
        // A rank past the lanes (rank 2) differs; one host's
        // call is small (its first member crosses it whole),
        // the other's large (two lanes cross it).
        MismatchCase{"AllReduceOfAnotherCountPastTheLanes",
                     {"a", "a", "a", "b", "b"},
                     "all_reduce",
                     {},
                     {"5", "5", "3", "5", "5"},
                     "two_level"},
        MismatchCase{"AllReduceSmallOnOneHostLargeOnTheOther",
                     {"a", "a", "a", "b", "b"},
                     "all_reduce",
                     {},
                     {"1", "1", "1", "10000", "10000"},
                     "two_level"},
        // Broadcasts on hosts of different rank counts:
        // each host names a root of its own (both only
        // send); a root the smaller host has no local index
        // for; the lone root's host and the other disagree.
        MismatchCase{
            "BroadcastRootsOnHostsOfTwoAndOne", {"a", "a", "b"}, "broadcast", {"0", "0", "2"}, {}},
        MismatchCase{"BroadcastRootPastTheSmallerHostsRanks",
                     {"a", "a", "a", "b", "b"},
                     "broadcast",
                     {"2", "2", "2", "1", "1"},
                     {}},
        MismatchCase{
            "BroadcastRootsInsideTheLargerHost", {"a", "b", "b"}, "broadcast", {"0", "0", "1"}, {}},
        // A member that differs from its own host's leader,
        // the leaders agreeing: the other host raises too,
        // rather than return (with recv written).
        MismatchCase{"BroadcastRootsDifferInsideAReceivingHost",
                     {"a", "a", "b", "b"},
                     "broadcast",
                     {"0", "0", "0", "1"},
                     {}},
        MismatchCase{"BroadcastRootsDifferInsideTheRootsHost",
                     {"a", "a", "b", "b"},
                     "broadcast",
                     {"0", "1", "0", "0"},
                     {}},
        MismatchCase{"AllReduceOfNothingAgainstOneInsideAHost",
                     {"a", "a", "b", "b"},
                     "all_reduce",
                     {},
                     {"0", "0", "0", "1"}},
        MismatchCase{"AllGatherOfNothingAgainstOneInsideAHost",
                     {"a", "a", "b", "b"},
                     "all_gather",
                     {},
                     {"0", "0", "0", "1"}},
        // A rank alone on its host on the path of a broadcast whose other receiving host calls
        // with another count: the lone rank's frames match its sender's call, so it must wait
        // for the hosts' round before it writes recv.
        MismatchCase{"BroadcastPastALoneRankToAHostThatDiffers",
                     {"a", "a", "b", "c", "c"},
                     "broadcast",
                     {},
                     {"5", "5", "5", "3", "3"}}),
    [](const ::testing::TestParamInfo<MismatchCase>& p) { return std::string(p.param.name); });

// Every ordered pair of different collectives (20), one rank calling the second while the others
// call the first, on layouts of two hosts where the plans differ by collective (two levels,
// the flat ring, a rank alone on its host, which has no group), and on RING: every rank raises
// kMismatch with recv untouched, none at its deadline (the workers' timeout is 60 s; a run
// gets 50).
struct PairsCase {
  const char* name;
  std::vector<std::string> host_ids;  // pretend hosts (AUTO), or empty: RING, one per rank
  int differing;                      // the rank that calls the second collective
  int ring_size = 0;                  // RING's world size
};

void PrintTo(const PairsCase& c, std::ostream* os) { *os << c.name; }

class EveryPairOfCollectivesTest : public ::testing::TestWithParam<PairsCase> {};

TEST_P(EveryPairOfCollectivesTest, RaisesMismatchOnEveryRank) {
  const PairsCase& c = GetParam();
  const int size = c.host_ids.empty() ? c.ring_size : int(c.host_ids.size());
  const std::vector<std::string> kinds = {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                          "barrier"};
  for (const std::string& most : kinds) {
    for (const std::string& one : kinds) {
      if (one == most) continue;
      SCOPED_TRACE(most + " on every rank but " + std::to_string(c.differing) + ", " + one +
                   " there");
      ExpectMismatchOnEveryRank(size, most, OneRankCalls(c.host_ids, size, c.differing, one),
                                std::chrono::seconds(50));
      if (HasFatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, EveryPairOfCollectivesTest,
    ::testing::Values(PairsCase{"TwoHostsOfTwo", {"a", "a", "b", "b"}, 3},
                      PairsCase{"TheLoneRankOfTwoAndOne", {"a", "a", "b"}, 2},
                      PairsCase{"TheLoneRankOfOneAndTwo", {"a", "b", "b"}, 0},
                      PairsCase{"AMemberOfThreeAndTwo", {"a", "a", "a", "b", "b"}, 1},
                      PairsCase{"TheLoneRankBetweenTwoHostsOfTwo", {"a", "a", "b", "c", "c"}, 2},
                      PairsCase{"RingOfThree", {}, 2, 3}, PairsCase{"RingOfFive", {}, 0, 5}),
    [](const ::testing::TestParamInfo<PairsCase>& p) { return std::string(p.param.name); });

// Single pairs beyond those (another differing rank, three hosts, the two levels forced so that
// the all-reduce waits in shared memory whatever the calibration says): one rank calls a
// collective the plan leaves to the flat ring while the others of its host call one that waits
// for it in shared memory, or the other way round, or a rank alone on its host (no group to
// announce in: the frames that reach it, or that it sends, name the other call). Every rank
// raises kMismatch, not kTimeout at the deadline: the ring call is announced in shared memory
// and the fabric knows the call it runs.
struct OtherCallCase {
  const char* name;
  std::vector<std::string> host_ids;
  const char* collective;  // every rank's but one
  int differing;
  const char* other;      // that rank's
  std::string algorithm;  // forced, or empty (calibrated)
};

void PrintTo(const OtherCallCase& c, std::ostream* os) { *os << c.name; }

class OneRankCallsAnotherCollectiveTest : public ::testing::TestWithParam<OtherCallCase> {};

TEST_P(OneRankCallsAnotherCollectiveTest, RaisesMismatchOnEveryRank) {
  const OtherCallCase& c = GetParam();
  const int size = int(c.host_ids.size());
  Placement placement = OneRankCalls(c.host_ids, size, c.differing, c.other);
  placement.algorithm = c.algorithm;
  ExpectMismatchOnEveryRank(size, c.collective, placement, std::chrono::seconds(120));
}

INSTANTIATE_TEST_SUITE_P(
    Auto, OneRankCallsAnotherCollectiveTest,
    ::testing::Values(OtherCallCase{"ABarrierInsideAHostOfAllGathers",
                                    {"a", "a", "b", "b"},
                                    "all_gather",
                                    0,
                                    "barrier",
                                    ""},
                      OtherCallCase{"AnAllReduceInsideAHostOfReduceScatters",
                                    {"a", "a", "b", "b"},
                                    "reduce_scatter",
                                    3,
                                    "all_reduce",
                                    "two_level"},
                      OtherCallCase{"AnAllReduceAmongAllGathersOnHostsOfThreeAndTwo",
                                    {"a", "a", "a", "b", "b"},
                                    "all_gather",
                                    1,
                                    "all_reduce",
                                    "two_level"},
                      OtherCallCase{"AnAllReduceOfTheLoneRankAgainstAllGathers",
                                    {"a", "a", "b"},
                                    "all_gather",
                                    2,
                                    "all_reduce",
                                    "two_level"},
                      OtherCallCase{"BarriersAgainstAnAllReduceOfTheLoneRank",
                                    {"a", "b", "b"},
                                    "barrier",
                                    0,
                                    "all_reduce",
                                    "two_level"},
                      OtherCallCase{"ABarrierInsideOneOfThreeHostsOfBroadcasts",
                                    {"a", "a", "b", "b", "c", "c"},
                                    "broadcast",
                                    4,
                                    "barrier",
                                    ""}),
    [](const ::testing::TestParamInfo<OtherCallCase>& p) { return std::string(p.param.name); });

// The set-up's deadline bounds the set-up only. AUTO's calibration (two pretend hosts of two:
// it times each candidate plan) runs each of its calls under what is left of the deadline, then gives the
// communicator its whole timeout back. Here rank 1 starts 4 s into a 9 s timeout, so the others
// calibrate with under 5 s left; rank 1 then keeps them waiting 5.5 s in the first call, which a
// communicator left with the calibration's timeout would give up on (kTimeout).
TEST(MultiProcessShmTest, TheFirstCallAfterCalibrationHasTheWholeTimeout) {
  constexpr int kSize = 4;
  Placement placement;
  placement.host_ids = {"a", "a", "b", "b"};
  std::vector<Worker> workers = Start(kSize, {"late", "9000", "4000", "5500"}, placement);
  const bool finished = WaitAll(workers, All(kSize), std::chrono::seconds(120));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < kSize; ++rank) {
    const Worker& w = workers[rank];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)
        << "rank " << rank << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("joined right"), std::string::npos)
        << "rank " << rank << ": " << w.output;
  }
}

}  // namespace
