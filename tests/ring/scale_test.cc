// Many ranks as processes on loopback (RING over TCP), small messages:
//   - 16, 32 and 64 ranks run every collective (ring_worker scale), each checked against the
//     references of collective_checks.h and rooted_checks.h, and the set-up of each rank holds
//     at most 2 ceil(log2 n) + 4 connections (connections on demand: the rest are made at their
//     first use, which the all-to-all and a message to a far peer then exercise);
//   - a rank killed with SIGKILL in a 32-rank job, inside an all-reduce loop (whose partners
//     are set-up connections) and a gather loop with a turning root (connections made on
//     demand): every survivor raises peer-lost naming it within 5 s, including the ranks that
//     hold no connection to it (the abort travels over the connections that exist).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "collectives/errors.h"
#include "tests/ring/worker_processes.h"

namespace {

using namespace collectives::testing;
using collectives::ErrorCode;

Placement Ring() {
  Placement placement;
  placement.implementation = "ring";
  return placement;
}

int CeilLog2(int n) {
  int bits = 0;
  while ((1 << bits) < n) ++bits;
  return bits;
}

// The number after `key` in `text` ("rank 3: setup connections 7 ms 12.5"), or -1.
double After(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size()));
}

// Every worker inherits COLLECTIVES_CONNECT=on_demand (the default), whatever the caller's
// environment says.
class OnDemand : public ::testing::Environment {
 public:
  void SetUp() override { setenv("COLLECTIVES_CONNECT", "on_demand", 1); }
};
const auto* const kOnDemand = ::testing::AddGlobalTestEnvironment(new OnDemand);

class ScaleTest : public ::testing::TestWithParam<int> {};

TEST_P(ScaleTest, EveryCollectiveIsExactAndTheSetUpOpensLogarithmicallyMany) {
  const int size = GetParam();
  const int bound = 2 * CeilLog2(size) + 4;
  std::vector<Worker> workers = Start(size, {"scale"}, Ring());
  const bool all_exited = WaitAll(workers, All(size), std::chrono::seconds(120));
  KillAll(workers);
  ASSERT_TRUE(all_exited) << "a rank was still running after 120 s";
  int most = 0;
  int most_after = 0;
  double slowest_ms = 0;
  for (int r = 0; r < size; ++r) {
    const Worker& w = workers[r];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)
        << "rank " << r << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("scale 0 wrong"), std::string::npos)
        << "rank " << r << ": " << w.output;
    const double opened = After(w.output, "setup connections ");
    ASSERT_GE(opened, 1) << "rank " << r << " printed no count: " << w.output;
    EXPECT_LE(opened, bound) << "rank " << r << " opened " << opened << " connections at set-up";
    most = std::max(most, int(opened));
    most_after = std::max(most_after, int(After(w.output, ": connections ")));
    slowest_ms = std::max(slowest_ms, After(w.output, " ms "));
  }
  // The all-to-all made the rest on demand: every pair is connected at the end.
  EXPECT_EQ(most_after, size - 1);
  std::printf(
      "%d ranks: at most %d connections per rank after set-up (bound %d), %d after the "
      "all-to-all; slowest set-up %.0f ms\n",
      size, most, bound, most_after, slowest_ms);
}

INSTANTIATE_TEST_SUITE_P(Processes, ScaleTest, ::testing::Values(16, 32, 64),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return std::to_string(param_info.param) + "ranks";
                         });

// Waits until every worker printed "ready" (finished one collective). False after 90 s.
bool WaitReady(std::vector<Worker>& workers) {
  const auto deadline = Clock::now() + std::chrono::seconds(90);
  for (;;) {
    bool ready = true;
    for (Worker& w : workers) {
      Drain(w);
      ready = ready && w.output.find("ready") != std::string::npos;
    }
    if (ready) return true;
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

class ScaleKillTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ScaleKillTest, EverySurvivorOfThirtyTwoNamesTheDeadRank) {
  constexpr int kSize = 32;
  constexpr int kVictim = 21;  // neither the store's host nor a neighbour of it
  std::vector<Worker> workers = Start(kSize, {"loop", GetParam(), "1024", "60000"}, Ring());
  ASSERT_TRUE(WaitReady(workers)) << "the workers never started their loop";
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(workers[kVictim].pid, SIGKILL);
  const auto killed_at = Clock::now();
  std::vector<int> survivors;
  for (int r = 0; r < kSize; ++r) {
    if (r != kVictim) survivors.push_back(r);
  }
  const bool all_exited = WaitAll(workers, survivors, std::chrono::seconds(5));
  const auto elapsed = Clock::now() - killed_at;
  KillAll(workers);
  ASSERT_TRUE(all_exited) << "a survivor was still running 5 s after the kill";
  const int peer_lost = 20 + int(ErrorCode::kPeerLost);
  for (int r : survivors) {
    const Worker& w = workers[r];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == peer_lost)
        << "rank " << r << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("lost rank " + std::to_string(kVictim)), std::string::npos)
        << "rank " << r << " does not name the dead rank: " << w.output;
  }
  std::printf("%s, %d ranks: every survivor exited %.2f s after the kill\n", GetParam().c_str(),
              kSize, std::chrono::duration<double>(elapsed).count());
}

INSTANTIATE_TEST_SUITE_P(Processes, ScaleKillTest, ::testing::Values("all_reduce", "gather"),
                         [](const ::testing::TestParamInfo<std::string>& param_info) {
                           return param_info.param;
                         });

}  // namespace
