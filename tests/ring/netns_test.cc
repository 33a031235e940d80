// Multi-host over network namespaces: three "hosts", each a network namespace with its own
// address on a bridge (veth pairs), run ring_worker processes that find each other through
// TF_CONFIG-free torchrun-style variables, as on real machines. Needs root (CAP_NET_ADMIN) and
// iproute2; where namespaces cannot be made the tests skip and say why.
//   - every collective is exact across the three hosts;
//   - with 2 pretend hosts x 2 ranks and 2 x 3 (ranks of one namespace share a host identity),
//     the two-level all-reduce (shared memory inside, TCP across; forced, since AUTO's cost
//     model may prefer the flat ring on this machine) and every other collective are exact; so
//     with hosts of 2, 1 and 3 ranks;
//   - the link of one host is cut (`ip link set ... down`) in the middle of an all-reduce loop:
//     every rank raises an error (timeout, or the abort of a rank that timed out) within the
//     collective deadline + 2 s; none hangs.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "collectives/errors.h"
#include "tests/ring/worker_processes.h"

namespace {

using namespace collectives::testing;

int Shell(const std::string& command) {
  return std::system((command + " >/dev/null 2>&1").c_str());
}

// Three namespaces on one bridge, named after this process so parallel runs do not collide, and
// after a count of the sets this process made: the outer end of a veth whose namespace was just
// deleted goes away asynchronously, so a name used again at once may still be taken (every test
// after the first skipped when one process ran them all).
class Hosts {
 public:
  static constexpr int kHosts = 3;

  Hosts() {
    static std::atomic<int> sets{0};
    const int pid = int(getpid());
    tag_ = std::to_string(pid % 100000) + char('a' + sets++ % 26);
    subnet_ = "10." + std::to_string(100 + pid % 100) + "." + std::to_string((pid / 100) % 250);
    bridge_ = "cb" + tag_;
    if (Shell("ip link add " + bridge_ + " type bridge") != 0) {
      why_ = "cannot create a bridge (needs root / CAP_NET_ADMIN and iproute2)";
      return;
    }
    Shell("ip link set " + bridge_ + " up");
    for (int h = 0; h < kHosts; ++h) {
      const std::string ns = Namespace(h), outer = "cv" + tag_ + "-" + std::to_string(h);
      const std::string inner = Interface(h);
      const bool ok =
          Shell("ip netns add " + ns) == 0 &&
          Shell("ip link add " + outer + " type veth peer name " + inner) == 0 &&
          Shell("ip link set " + inner + " netns " + ns) == 0 &&
          Shell("ip link set " + outer + " master " + bridge_ + " up") == 0 &&
          Shell("ip netns exec " + ns + " ip addr add " + Address(h) + "/24 dev " + inner) == 0 &&
          Shell("ip netns exec " + ns + " ip link set " + inner + " up") == 0 &&
          Shell("ip netns exec " + ns + " ip link set lo up") == 0;
      namespaces_.push_back(ns);
      if (!ok) {
        why_ = "cannot set up network namespace " + ns;
        return;
      }
    }
    // The bridge forwards at once (no STP); connects retry until the set-up deadline anyway.
  }

  ~Hosts() {
    // Each veth first (both ends go at once): a deleted namespace lives on while orphaned TCP
    // sockets in it retransmit (for minutes after a cut link), and its veth with it.
    for (size_t h = 0; h < namespaces_.size(); ++h) {
      Shell("ip netns exec " + namespaces_[h] + " ip link del " + Interface(int(h)));
      Shell("ip netns del " + namespaces_[h]);
    }
    Shell("ip link del " + bridge_);
  }

  const std::string& why_not() const { return why_; }
  std::string Namespace(int h) const { return "coll" + tag_ + "-h" + std::to_string(h); }
  std::string Interface(int h) const { return "ce" + tag_ + "-" + std::to_string(h); }
  std::string Address(int h) const { return subnet_ + "." + std::to_string(h + 1); }
  // Each namespace is a host of its own (COLLECTIVES_HOST_ID), as on separate machines.
  Placement OneRankPerHost() const {
    Placement placement;
    placement.master_addr = Address(0);
    placement.namespaces = namespaces_;
    placement.host_ids = namespaces_;
    return placement;
  }
  // `per_host` ranks in each of the first `hosts` namespaces: shared memory inside each, TCP
  // across them (the two-level plan).
  Placement RanksPerHost(int hosts, int per_host) const {
    return RanksOnHosts(std::vector<int>(size_t(hosts), per_host));
  }
  // counts[h] consecutive ranks in namespace h.
  Placement RanksOnHosts(const std::vector<int>& counts) const {
    Placement placement;
    placement.master_addr = Address(0);
    for (size_t h = 0; h < counts.size(); ++h) {
      for (int i = 0; i < counts[h]; ++i) {
        placement.namespaces.push_back(namespaces_[h]);
        placement.host_ids.push_back(namespaces_[h]);
      }
    }
    return placement;
  }

 private:
  std::string tag_, subnet_, bridge_, why_;
  std::vector<std::string> namespaces_;
};

TEST(NetnsTest, EveryCollectiveIsExactAcrossThreeHosts) {
  Hosts hosts;
  if (!hosts.why_not().empty()) GTEST_SKIP() << hosts.why_not();
  std::vector<Worker> workers = Start(Hosts::kHosts, {"check", "300007"}, hosts.OneRankPerHost());
  const bool finished = WaitAll(workers, All(Hosts::kHosts), std::chrono::seconds(240));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < Hosts::kHosts; ++rank) {
    const int status = workers[rank].status;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " status " << status << ": " << workers[rank].output;
    EXPECT_NE(workers[rank].output.find("0 wrong"), std::string::npos) << workers[rank].output;
  }
}

class TwoLevelTest : public ::testing::TestWithParam<int> {};  // ranks per host

TEST_P(TwoLevelTest, EveryCollectiveIsExactOnTwoHosts) {
  Hosts hosts;
  if (!hosts.why_not().empty()) GTEST_SKIP() << hosts.why_not();
  const int per_host = GetParam();
  const int size = 2 * per_host;
  Placement placement = hosts.RanksPerHost(2, per_host);
  placement.algorithm = "two_level";
  std::vector<Worker> workers = Start(size, {"check", "300007"}, placement);
  const bool finished = WaitAll(workers, All(size), std::chrono::seconds(240));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < size; ++rank) {
    const int status = workers[rank].status;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " status " << status << ": " << workers[rank].output;
    EXPECT_NE(workers[rank].output.find("0 wrong"), std::string::npos) << workers[rank].output;
    EXPECT_NE(workers[rank].output.find("algorithm two_level"), std::string::npos)
        << workers[rank].output;
  }
}

INSTANTIATE_TEST_SUITE_P(Netns, TwoLevelTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return "2hosts_x" + std::to_string(param_info.param);
                         });

// Hosts of different rank counts (2, 1 and 3 ranks in the three namespaces), the two levels
// forced: every all-reduce crosses hosts in two lanes (the rank alone on its host takes part in
// both, the third rank of the last host only adds its input), every other collective runs on the
// flat ring; all exact on every rank.
TEST(NetnsTest, EveryCollectiveIsExactOnHostsOfDifferentRankCounts) {
  Hosts hosts;
  if (!hosts.why_not().empty()) GTEST_SKIP() << hosts.why_not();
  Placement placement = hosts.RanksOnHosts({2, 1, 3});
  placement.algorithm = "two_level";
  const int size = int(placement.host_ids.size());
  std::vector<Worker> workers = Start(size, {"check", "300007"}, placement);
  const bool finished = WaitAll(workers, All(size), std::chrono::seconds(240));
  KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  for (int rank = 0; rank < size; ++rank) {
    const int status = workers[size_t(rank)].status;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "rank " << rank << " status " << status << ": " << workers[size_t(rank)].output;
    EXPECT_NE(workers[size_t(rank)].output.find("0 wrong"), std::string::npos)
        << workers[size_t(rank)].output;
    EXPECT_NE(workers[size_t(rank)].output.find("algorithm two_level"), std::string::npos)
        << workers[size_t(rank)].output;
  }
}

TEST(NetnsTest, CuttingAHostsLinkMakesEveryRankRaiseWithinTheDeadline) {
  Hosts hosts;
  if (!hosts.why_not().empty()) GTEST_SKIP() << hosts.why_not();
  constexpr int kDeadlineMs = 3000;
  constexpr int kCut = 2;
  std::vector<Worker> workers =
      Start(Hosts::kHosts, {"loop", "all_reduce", "262144", std::to_string(kDeadlineMs)},
            hosts.OneRankPerHost());
  const auto ready_deadline = Clock::now() + std::chrono::seconds(60);
  bool ready = false;
  while (!ready && Clock::now() < ready_deadline) {
    ready = true;
    for (Worker& w : workers) {
      Drain(w);
      ready = ready && w.output.find("ready") != std::string::npos;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(ready) << "the workers never started their loop";
  ASSERT_EQ(Shell("ip netns exec " + hosts.Namespace(kCut) + " ip link set " +
                  hosts.Interface(kCut) + " down"),
            0);
  const auto cut_at = Clock::now();
  const bool all_exited = WaitAll(workers, All(Hosts::kHosts),
                                  std::chrono::milliseconds(kDeadlineMs) + std::chrono::seconds(2));
  const auto elapsed = Clock::now() - cut_at;
  KillAll(workers);
  ASSERT_TRUE(all_exited) << "a rank was still running at the deadline + 2 s";
  for (int rank = 0; rank < Hosts::kHosts; ++rank) {
    const Worker& w = workers[rank];
    const int code = WIFEXITED(w.status) ? WEXITSTATUS(w.status) - 20 : -1;
    EXPECT_TRUE(code == int(collectives::ErrorCode::kTimeout) ||
                code == int(collectives::ErrorCode::kPeerLost) ||
                code == int(collectives::ErrorCode::kAborted))
        << "rank " << rank << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("error "), std::string::npos) << w.output;
  }
  std::printf("every rank raised %.2f s after the cut (deadline %.1f s)\n",
              std::chrono::duration<double>(elapsed).count(), kDeadlineMs / 1000.0);
}

}  // namespace
