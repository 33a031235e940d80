// RING across real processes on loopback: the test starts ring_worker N times with torchrun-style
// environment variables and checks every collective in every process. Faults between processes
// are in fault_test.cc.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/ring/worker_processes.h"

namespace {

using namespace collectives::testing;

class MultiProcessTest : public ::testing::TestWithParam<int> {};

TEST_P(MultiProcessTest, EveryCollectiveIsExactInEveryProcess) {
  const int size = GetParam();
  std::vector<Worker> workers = Start(size, {"check", "1000003"});
  const bool finished = WaitAll(workers, All(size), std::chrono::seconds(240));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < size; ++rank) {
    const int status = workers[rank].status;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " status " << status << ": " << workers[rank].output;
    EXPECT_NE(workers[rank].output.find("0 wrong"), std::string::npos) << workers[rank].output;
  }
}

INSTANTIATE_TEST_SUITE_P(Ring, MultiProcessTest, ::testing::Values(2, 3, 4));

}  // namespace
