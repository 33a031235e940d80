// Split(color, key), as ncclCommSplit: ranks as threads over a memory store, with RING and AUTO.
//   - even and odd ranks split apart, ranked by key (reversed here): the new ranks and sizes are
//     right, and an all-reduce in each part sums only that part's ranks, exactly;
//   - a negative color gets no communicator, the others still split;
//   - the intra-host / inter-host pair of the two-level plan: color = host, then color = local
//     index; both communicators work, and the parent keeps working after the split;
//   - a communicator built over a hand-made fabric cannot split (kNotSupported).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/collectives.h"
#include "src/transport/inproc_fabric.h"
#include "tests/ring/run_ranks.h"
#include "tests/time_scale.h"

namespace {

using namespace collectives;
using namespace collectives::testing;

// Sums each rank's (rank + 1) over the communicator `comm` that `members` (parent ranks) form.
void ExpectSumOf(CollectiveCommunication& comm, int parent_rank, const std::vector<int>& members) {
  std::vector<int64_t> value(5, parent_rank + 1);
  comm.AllReduce(Tensor{value.data(), value.size(), DataType::kInt64}, ReduceOp::kSum);
  int64_t expected = 0;
  for (int r : members) expected += r + 1;
  for (int64_t v : value) EXPECT_EQ(v, expected) << "parent rank " << parent_rank;
}

class SplitTest : public ::testing::TestWithParam<Transport> {};

TEST_P(SplitTest, EvenAndOddRanksSplitApartRankedByKey) {
  constexpr int kSize = 5;
  RunRanks(GetParam(), kSize, {}, [](CollectiveCommunication& comm) {
    const int color = comm.rank() % 2;
    auto part = comm.Split(color, -comm.rank());
    ASSERT_NE(part, nullptr);
    std::vector<int> members;  // by key: descending parent rank
    for (int r = kSize - 1; r >= 0; --r) {
      if (r % 2 == color) members.push_back(r);
    }
    EXPECT_EQ(part->size(), int(members.size()));
    EXPECT_EQ(members[size_t(part->rank())], comm.rank());
    ExpectSumOf(*part, comm.rank(), members);
    ExpectSumOf(comm, comm.rank(), {0, 1, 2, 3, 4});  // the parent still works
  });
}

TEST_P(SplitTest, NegativeColorGetsNothingAndTheOthersStillSplit) {
  RunRanks(GetParam(), 4, {}, [](CollectiveCommunication& comm) {
    auto part = comm.Split(comm.rank() == 2 ? -1 : 7, comm.rank());
    if (comm.rank() == 2) {
      EXPECT_EQ(part, nullptr);
      return;
    }
    ASSERT_NE(part, nullptr);
    EXPECT_EQ(part->size(), 3);
    ExpectSumOf(*part, comm.rank(), {0, 1, 3});
  });
}

TEST_P(SplitTest, IntraHostAndInterHostCommunicatorsOfTheTwoLevelPlan) {
  // 2 pretend hosts of 3 ranks: ranks 0-2 and 3-5.
  RunRanks(GetParam(), 6, {}, [](CollectiveCommunication& comm) {
    const int host = comm.rank() / 3, local = comm.rank() % 3;
    auto intra = comm.Split(host, local);
    auto inter = comm.Split(local, host);
    ASSERT_NE(intra, nullptr);
    ASSERT_NE(inter, nullptr);
    EXPECT_EQ(intra->rank(), local);
    EXPECT_EQ(inter->rank(), host);
    ExpectSumOf(*intra, comm.rank(), {host * 3, host * 3 + 1, host * 3 + 2});
    ExpectSumOf(*inter, comm.rank(), {local, local + 3});
  });
}

// The child takes the parent's timeout at the time of the split (SetTimeout's, not the one the
// parent was built with): a barrier of the child that one member never joins times out after
// 10 s, not after the parent's original 60 s. (The timeout also bounds the split and the
// child's set-up, so it is not cut finer: a loaded machine may take a while to connect.)
TEST_P(SplitTest, TheChildTakesTheParentsCurrentTimeout) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  std::atomic<bool> rank0_done{false};
  RunRanks(GetParam(), 2, options, [&](CollectiveCommunication& comm) {
    comm.SetTimeout(std::chrono::seconds(10));
    auto child = comm.Split(0, comm.rank());
    ASSERT_NE(child, nullptr);
    if (comm.rank() == 1) {  // never joins; waits until rank 0 gave up (60 s at most)
      const auto cap = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!rank0_done && std::chrono::steady_clock::now() < cap) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      child->Barrier();
      ADD_FAILURE() << "a barrier without its peer succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start,
              test_time::Scaled(std::chrono::seconds(40)));  // not 60 s
    rank0_done = true;
  });
}

INSTANTIATE_TEST_SUITE_P(Split, SplitTest, ::testing::Values(Transport::kTcp, Transport::kAuto),
                         [](const ::testing::TestParamInfo<Transport>& param_info) {
                           return std::string(TransportName(param_info.param));
                         });

// A store that holds every Set of a key containing `held` until Release(): a rank whose set-up
// publishes such a key stands still there, as a rank that hung or died would.
class HoldingStore final : public Store {
 public:
  HoldingStore(std::shared_ptr<Store> store, std::string held)
      : store_(std::move(store)), held_(std::move(held)) {}
  void Set(const std::string& key, const std::string& value) override {
    if (key.find(held_) != std::string::npos) {
      std::unique_lock<std::mutex> lock(mu_);
      holding_ = true;
      cv_.notify_all();
      cv_.wait(lock, [this] { return released_; });
    }
    store_->Set(key, value);
  }
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    return store_->Get(key, timeout);
  }
  int64_t Add(const std::string& key, int64_t delta) override { return store_->Add(key, delta); }
  void WaitUntilHolding() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return holding_; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  const std::shared_ptr<Store> store_;
  const std::string held_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool holding_ = false;
  bool released_ = false;
};

// Two ranks as threads, set up through `store`.
std::vector<std::unique_ptr<CollectiveCommunication>> CreateTwo(
    const std::shared_ptr<Store>& store, const CommunicationOptions& options) {
  std::vector<std::unique_ptr<CollectiveCommunication>> comms(2);
  std::vector<std::thread> setup;
  for (int rank = 0; rank < 2; ++rank) {
    setup.emplace_back([&, rank] {
      ClusterSpec spec;
      spec.rank = rank;
      spec.world_size = 2;
      spec.master_port = 1;  // unused: the store is given
      comms[size_t(rank)] = CreateCommunication(spec, store, options);
    });
  }
  for (std::thread& t : setup) t.join();
  return comms;
}

// A split whose child waits for a member that never comes (rank 1 stands still publishing its
// address) ends at an Abort of the parent, within a poll, not at the 30 s timeout: the child's
// set-up polls the parent's state in its store waits and in the mesh. Both ranks raise the
// parent's kAborted, rank 1 too once it moves on.
TEST(SplitAbortTest, AnAbortEndsASplitWhoseMemberNeverComes) {
  for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
    auto store = std::make_shared<HoldingStore>(CreateMemoryStore(), "/split1/0/addr/1");
    CommunicationOptions options;
    options.implementation = impl;
    options.timeout = std::chrono::seconds(30);
    std::vector<std::unique_ptr<CollectiveCommunication>> comms = CreateTwo(store, options);
    ASSERT_TRUE(comms[0] && comms[1]);

    const auto split = [&](int rank, std::chrono::steady_clock::duration* took) {
      const auto start = std::chrono::steady_clock::now();
      try {
        comms[size_t(rank)]->Split(0, rank);
        ADD_FAILURE() << "rank " << rank << ": a split of an aborted communicator succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kAborted) << "rank " << rank << ": " << e.what();
        EXPECT_NE(e.message().find("aborted by its caller"), std::string::npos) << e.what();
      }
      *took = std::chrono::steady_clock::now() - start;
    };
    std::chrono::steady_clock::duration took0{}, took1{};
    std::thread rank1([&] { split(1, &took1); });
    std::thread rank0([&] { split(0, &took0); });
    store->WaitUntilHolding();                                    // rank 1 stands still
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0 waits for it
    const auto abort_at = std::chrono::steady_clock::now();
    comms[0]->Abort();
    rank0.join();
    EXPECT_LT(std::chrono::steady_clock::now() - abort_at,
              test_time::Scaled(std::chrono::seconds(5)))
        << "rank 0's split did not end at the Abort";
    comms[1]->Abort();
    store->Release();  // rank 1 moves on into its child's mesh, and gives up there
    rank1.join();
    EXPECT_LT(took1, test_time::Scaled(std::chrono::seconds(20)))
        << "rank 1's split waited for its timeout";
    (void)took0;
  }
}

// The other side: a member whose own parent is not aborted learns that another member's split
// was abandoned, and gives up within a poll instead of waiting for it until its timeout. Rank 1
// stands still publishing its address while rank 0's parent is aborted; released, rank 1 finds
// rank 0's address but nobody behind it, and raises kAborted naming rank 0's reason (not
// kTimeout "still missing rank 0" after 20 s); its parent, which nothing broke, is left as it
// was.
TEST(SplitAbortTest, TheOtherMembersLearnThatAMembersSplitWasAbandoned) {
  for (Implementation impl : {Implementation::kRing, Implementation::kAuto}) {
    auto store = std::make_shared<HoldingStore>(CreateMemoryStore(), "/split1/0/addr/1");
    CommunicationOptions options;
    options.implementation = impl;
    options.timeout = std::chrono::seconds(20);
    std::vector<std::unique_ptr<CollectiveCommunication>> comms = CreateTwo(store, options);
    ASSERT_TRUE(comms[0] && comms[1]);

    std::thread rank0([&] {
      try {
        comms[0]->Split(0, 0);
        ADD_FAILURE() << "rank 0: a split of an aborted communicator succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
      }
    });
    std::chrono::steady_clock::time_point rank1_ended{};
    std::thread rank1([&] {
      try {
        comms[1]->Split(0, 1);
        ADD_FAILURE() << "rank 1: a split whose other member gave up succeeded";
      } catch (const Error& e) {
        rank1_ended = std::chrono::steady_clock::now();
        EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
        EXPECT_NE(e.message().find("rank 1: split: set-up abandoned by another member: rank 0: "),
                  std::string::npos)
            << e.what();
      }
    });
    store->WaitUntilHolding();                                    // rank 1 stands still
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 0 waits for it
    comms[0]->Abort();
    rank0.join();
    const auto released_at = std::chrono::steady_clock::now();
    store->Release();  // rank 1 moves on, and finds rank 0 gone
    rank1.join();
    EXPECT_LT(rank1_ended - released_at, test_time::Scaled(std::chrono::seconds(5)))
        << ToString(impl) << ": rank 1's split waited for its timeout";
    comms[1]->SetTimeout(std::chrono::seconds(1));
    EXPECT_THROW(comms[1]->Barrier(), Error);  // its peer is gone, but it was not aborted
  }
}

// Counts the Adds of keys that contain `counted`.
class CountingStore final : public Store {
 public:
  CountingStore(std::shared_ptr<Store> store, std::string counted)
      : store_(std::move(store)), counted_(std::move(counted)) {}
  void Set(const std::string& key, const std::string& value) override { store_->Set(key, value); }
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    return store_->Get(key, timeout);
  }
  int64_t Add(const std::string& key, int64_t delta) override {
    if (key.find(counted_) != std::string::npos) ++adds_;
    return store_->Add(key, delta);
  }
  int adds() const { return adds_.load(); }

 private:
  const std::shared_ptr<Store> store_;
  const std::string counted_;
  std::atomic<int> adds_{0};
};

// A member waiting in its child's set-up asks the store whether another member gave up a few
// times a second, not on every poll of its waits: over a TCP store each ask is a round trip to
// rank 0's server, and every waiting member makes them. Rank 1 stands still publishing its
// address for a second while rank 0 waits for it.
TEST(SplitAbortTest, AWaitingMemberAsksWhetherAnotherGaveUpAFewTimesASecond) {
  auto server = CreateTcpStore("127.0.0.1", 0, /*is_server=*/true, std::chrono::seconds(10));
  auto client = CreateTcpStore("127.0.0.1", TcpStorePort(*server), /*is_server=*/false,
                               std::chrono::seconds(10));
  auto counting = std::make_shared<CountingStore>(client, "/gave_up/count");
  auto store = std::make_shared<HoldingStore>(counting, "/split1/0/addr/1");
  CommunicationOptions options;
  options.implementation = Implementation::kRing;
  options.timeout = std::chrono::seconds(20);
  std::vector<std::unique_ptr<CollectiveCommunication>> comms = CreateTwo(store, options);
  ASSERT_TRUE(comms[0] && comms[1]);

  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] { EXPECT_NE(comms[size_t(rank)]->Split(0, rank), nullptr); });
  }
  store->WaitUntilHolding();  // rank 1 stands still; rank 0 waits for its address
  const int before = counting->adds();
  const auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  const int asks = counting->adds() - before;
  const auto waited = std::chrono::steady_clock::now() - start;
  store->Release();
  for (std::thread& rank : ranks) rank.join();
  // One ask per 200 ms at most, and one more for a poll that straddles the start.
  EXPECT_LE(asks, int(waited / std::chrono::milliseconds(200)) + 1)
      << asks << " asks in "
      << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count() << " ms";
}

TEST(SplitWithoutStoreTest, IsNotSupported) {
  RunRanks(Transport::kInProcess, 1, {}, [](CollectiveCommunication& comm) {
    try {
      comm.Split(0, 0);
      ADD_FAILURE() << "split without a store succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotSupported) << e.what();
    }
  });
}

}  // namespace
