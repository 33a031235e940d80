// CommunicationOptions::timeout bounds a communicator's set-up as a whole, not each of its steps:
// two ranks as threads under AUTO over a memory store, where rank 1 publishes its mesh address,
// and then its host record, each a little under the timeout late. Either delay alone fits in the
// timeout; both together do not, and rank 0 raises kTimeout about when the timeout has passed,
// naming it and the rank it still waited for. (With a timeout of its own per step, the set-up
// would succeed after about 1.6 times the timeout.)
//   - CreateCommunication with a given store;
//   - Split: the child's set-up, under the parent's timeout.
// And a TCP store whose server is gone in the middle of a job: a split's set-up ends about its
// timeout, not one store timeout per Set and Add later.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "tests/time_scale.h"

namespace collectives {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr std::chrono::milliseconds kTimeout{1500};
constexpr std::chrono::milliseconds kDelay{1200};  // of each slow step
// Room above the timeout for a loaded machine. A set-up that gives each step the whole timeout
// takes at least 2 * kDelay before rank 0 sees what it waited for.
constexpr std::chrono::milliseconds kSlack{1500};

// Opened once rank 0 is done, so that rank 1 stops dawdling and the test ends early.
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    opened_.notify_all();
  }
  void WaitFor(std::chrono::milliseconds delay) {
    std::unique_lock<std::mutex> lock(mu_);
    opened_.wait_for(lock, delay, [this] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable opened_;
  bool open_ = false;
};

// Rank 1's view of the store: a Set of a key that `slow` picks waits kDelay first (or until the
// gate opens).
class SlowStore final : public Store {
 public:
  SlowStore(std::shared_ptr<Store> inner, std::function<bool(const std::string&)> slow, Gate& gate)
      : inner_(std::move(inner)), slow_(std::move(slow)), gate_(gate) {}

  void Set(const std::string& key, const std::string& value) override {
    if (slow_(key)) gate_.WaitFor(kDelay);
    inner_->Set(key, value);
  }
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_->Get(key, timeout);
  }
  int64_t Add(const std::string& key, int64_t delta) override { return inner_->Add(key, delta); }

 private:
  const std::shared_ptr<Store> inner_;
  const std::function<bool(const std::string&)> slow_;
  Gate& gate_;
};

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The mesh address (ring's TCP fabric) and the host record (AUTO's planner).
bool AddressOrHostRecord(const std::string& key) {
  return Contains(key, "/addr/") || Contains(key, "/host/");
}

// The set-up under test for one rank: it sets `*start` just before the step whose time counts
// (after what it builds first, such as a split's parent).
using SetUp = std::function<std::unique_ptr<CollectiveCommunication>(
    int rank, std::shared_ptr<Store> store, Clock::time_point* start)>;

// Runs `set_up` on rank 0 and rank 1 (whose store is `slow`), each on its own thread, and checks
// that rank 0's raises kTimeout within the timeout and some slack.
void ExpectRankZeroTimesOutInTime(const std::function<bool(const std::string&)>& slow,
                                  const SetUp& set_up) {
  const auto store = CreateMemoryStore();
  Gate gate;
  std::thread rank1([&] {
    try {
      Clock::time_point ignored;
      set_up(1, std::make_shared<SlowStore>(store, slow, gate), &ignored);
    } catch (const Error&) {
      // Rank 0 gave up on it: whatever it raises, it raised rather than hung.
    }
  });
  auto start = Clock::now();
  try {
    set_up(0, store, &start);
    ADD_FAILURE()
        << "rank 0's set-up succeeded after "
        << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()
        << " ms, past its " << kTimeout.count() << " ms timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_TRUE(Contains(e.message(),
                         "timed out after " + std::to_string(kTimeout.count()) + " ms setting up"))
        << e.what();
    EXPECT_TRUE(Contains(e.message(), "rank 1")) << e.what();
  }
  EXPECT_LT(Clock::now() - start, kTimeout + test_time::Scaled(kSlack));
  gate.Open();
  rank1.join();
}

ClusterSpec Spec(int rank) {
  ClusterSpec spec;
  spec.rank = rank;
  spec.world_size = 2;
  spec.master_port = 1;  // unused: the store is given
  return spec;
}

CommunicationOptions Options() {
  CommunicationOptions options;
  options.implementation = Implementation::kAuto;
  options.timeout = kTimeout;
  return options;
}

TEST(SetupDeadlineTest, CreateCommunicationSharesOneTimeoutAmongItsSteps) {
  ExpectRankZeroTimesOutInTime(
      AddressOrHostRecord, [](int rank, std::shared_ptr<Store> store, Clock::time_point* start) {
        *start = Clock::now();
        return CreateCommunication(Spec(rank), std::move(store), Options());
      });
}

TEST(SetupDeadlineTest, SplitSharesOneTimeoutAmongTheChildsSteps) {
  // The parents are built without delay; only the child's keys (under ".../split1/0/") are slow.
  ExpectRankZeroTimesOutInTime(
      [](const std::string& key) { return Contains(key, "/split") && AddressOrHostRecord(key); },
      [](int rank, std::shared_ptr<Store> store, Clock::time_point* start) {
        auto parent = CreateCommunication(Spec(rank), std::move(store), Options());
        *start = Clock::now();
        return parent->Split(0, rank);
      });
}

// Two ranks build their parent over a TCP store (the server apart, as rank 0's process hosts it,
// each rank a client whose own timeout is 3 s), then the server stops, and both split. Each
// child's set-up ends about its 1 s timeout: its Sets and Adds end by its deadline, not each
// by the store's 3 s.
TEST(SetupDeadlineTest, ASplitEndsNearItsDeadlineWhenTheStoresServerStops) {
  constexpr std::chrono::milliseconds kStoreTimeout{3000};
  constexpr std::chrono::milliseconds kSplitTimeout{1000};
  auto server = CreateTcpStore("127.0.0.1", 0, /*is_server=*/true, kStoreTimeout);
  const uint16_t port = TcpStorePort(*server);
  CommunicationOptions options;
  options.implementation = Implementation::kRing;
  options.timeout = kSplitTimeout;
  std::vector<std::unique_ptr<CollectiveCommunication>> comms(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto client = CreateTcpStore("127.0.0.1", port, /*is_server=*/false, kStoreTimeout);
      comms[size_t(rank)] = CreateCommunication(Spec(rank), std::move(client), options);
    });
  }
  for (std::thread& thread : threads) thread.join();
  ASSERT_TRUE(comms[0] && comms[1]);
  server.reset();  // rank 0's process, say, is gone

  std::vector<Clock::duration> took(2);
  threads.clear();
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      const auto start = Clock::now();
      try {
        comms[size_t(rank)]->Split(0, rank);
        ADD_FAILURE() << "rank " << rank << ": a split without the store's server succeeded";
      } catch (const Error& e) {
        // Whatever it raises (the store's timeout, or the other member's notice), it raised,
        // naming the rank, even when the address's Set is what fails.
        EXPECT_EQ(e.message().rfind("rank " + std::to_string(rank) + ": ", 0), 0u) << e.what();
      }
      took[size_t(rank)] = Clock::now() - start;
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_LT(took[size_t(rank)], kSplitTimeout + test_time::Scaled(kSlack))
        << "rank " << rank << "'s split took "
        << std::chrono::duration_cast<std::chrono::milliseconds>(took[size_t(rank)]).count()
        << " ms";
  }
}

// A set-up over a TCP store whose server is gone raises the store's failure under its code,
// naming the rank as every message does.
TEST(SetupDeadlineTest, AStoreFailureInTheSetUpNamesTheRank) {
  auto server = CreateTcpStore("127.0.0.1", 0, /*is_server=*/true, kTimeout);
  const uint16_t port = TcpStorePort(*server);
  auto client = CreateTcpStore("127.0.0.1", port, /*is_server=*/false, 500ms);
  server.reset();
  CommunicationOptions options;
  options.implementation = Implementation::kRing;
  options.timeout = 500ms;
  try {
    CreateCommunication(Spec(1), std::move(client), options);
    ADD_FAILURE() << "a set-up without the store's server succeeded";
  } catch (const Error& e) {
    EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kPeerLost) << e.what();
    EXPECT_EQ(e.message().rfind("rank 1: TCP store at 127.0.0.1:" + std::to_string(port) + ": ", 0),
              0u)
        << e.what();
  }
}

// Rank 0 whose store cannot listen (its port is taken, here by a listener of this test) says so
// naming the rank.
TEST(SetupDeadlineTest, AStoreThatCannotListenNamesTheRank) {
  auto taken = CreateTcpStore("127.0.0.1", 0, /*is_server=*/true, kTimeout);
  ClusterSpec spec = Spec(0);
  spec.master_addr = "127.0.0.1";
  spec.master_port = TcpStorePort(*taken);
  try {
    CreateCommunication(spec, Options());
    ADD_FAILURE() << "a store listened on a port that another holds";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystem) << e.what();
    EXPECT_EQ(e.message().rfind("rank 0: TCP store server at 127.0.0.1:" +
                                    std::to_string(spec.master_port) + ": cannot listen",
                                0),
              0u)
        << e.what();
  }
}

// A job id longer than the mesh's handshake carries is refused before the store is touched (no
// generation counted, rank 0's store not waited for), naming the rank, without the whole id.
TEST(SetupDeadlineTest, AJobIdTooLongForTheHandshakeIsRefusedBeforeTheStore) {
  ClusterSpec spec = Spec(1);
  spec.job_id = std::string(300, 'j');
  auto store = CreateMemoryStore();
  CommunicationOptions options = Options();
  try {
    CreateCommunication(spec, store, options);
    ADD_FAILURE() << "a job id of 300 bytes was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_EQ(e.message().rfind("rank 1: ", 0), 0u) << e.what();
    EXPECT_LT(e.message().size(), 300u) << e.what();
  }
  EXPECT_EQ(store->Add(spec.job_id + "/generation/1", 0), 0) << "the store was touched";
}

// A world size no job can have (INT_MAX ranks, or one more than 2^20) is refused before any
// store is made or touched, naming it and the rank: with the store given, and with rank 0 to
// host the TCP store (whose record per rank would end in std::bad_alloc).
TEST(SetupDeadlineTest, AWorldSizeNoJobCanHaveIsRefusedBeforeTheStore) {
  for (int world_size : {std::numeric_limits<int>::max(), (1 << 20) + 1}) {
    for (bool given_store : {true, false}) {
      ClusterSpec spec = Spec(0);
      spec.world_size = world_size;
      spec.master_addr = "127.0.0.1";
      auto store = CreateMemoryStore();
      try {
        if (given_store) {
          CreateCommunication(spec, store, Options());
        } else {
          CreateCommunication(spec, Options());
        }
        ADD_FAILURE() << "world_size " << world_size << " was taken";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_EQ(e.message().rfind("rank 0: world_size=" + std::to_string(world_size) +
                                        " is more ranks than a job can have (1048576",
                                    0),
                  0u)
            << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "world_size " << world_size << ": " << e.what();
      }
      EXPECT_EQ(store->Add(spec.job_id + "/generation/0", 0), 0) << "the store was touched";
    }
  }
}

}  // namespace
}  // namespace collectives
