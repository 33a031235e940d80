// Behaviour every Store must have, run over each implementation: the memory store, the file
// store, the TCP store used by its hosting process and the TCP store used by a client.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/cancellable_store.h"
#include "src/cluster/store_common.h"
#include "tests/time_scale.h"

namespace collectives {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr milliseconds kLong{5000};  // for waits that should succeed quickly

// Where file stores of the tests live: tmpfs when there is one, because the file store fsyncs
// every write and a disk makes 400 Adds take seconds.
std::filesystem::path TempRoot() {
  if (access("/dev/shm", W_OK) == 0) return "/dev/shm";
  return std::filesystem::temp_directory_path();
}

enum class Kind { kMemory, kFile, kTcpServer, kTcpClient, kCancellable };

std::string KindName(const testing::TestParamInfo<Kind>& param_info) {
  switch (param_info.param) {
    case Kind::kMemory:
      return "Memory";
    case Kind::kFile:
      return "File";
    case Kind::kTcpServer:
      return "TcpServer";
    case Kind::kTcpClient:
      return "TcpClient";
    case Kind::kCancellable:
      return "CancellableOverTcp";
  }
  return "Unknown";
}

class StoreTest : public testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    switch (GetParam()) {
      case Kind::kMemory:
        store_ = CreateMemoryStore();
        break;
      case Kind::kFile: {
        std::string pattern = TempRoot() / "store_test.XXXXXX";
        ASSERT_NE(mkdtemp(pattern.data()), nullptr);
        directory_ = pattern;
        store_ = CreateFileStore(directory_);
        break;
      }
      case Kind::kTcpServer:
        store_ = CreateTcpStore("127.0.0.1", 0, true, kLong);
        server_ = store_;
        break;
      case Kind::kTcpClient:
        server_ = CreateTcpStore("127.0.0.1", 0, true, kLong);
        store_ = CreateTcpStore("127.0.0.1", TcpStorePort(*server_), false, kLong);
        break;
      case Kind::kCancellable:  // never cancelled, and its Gets wait in slices of 20 ms
        server_ = CreateTcpStore("127.0.0.1", 0, true, kLong);
        store_ = std::make_shared<cluster::CancellableStore>(
            CreateTcpStore("127.0.0.1", TcpStorePort(*server_), false, kLong), [] { return false; },
            "cancelled", milliseconds(20));
        break;
    }
  }

  void TearDown() override {
    store_.reset();
    server_.reset();
    if (!directory_.empty()) std::filesystem::remove_all(directory_);
  }

  // Another handle on the same store, as another rank would hold it.
  std::shared_ptr<Store> Peer() {
    switch (GetParam()) {
      case Kind::kMemory:
        return store_;
      case Kind::kFile:
        return CreateFileStore(directory_);
      case Kind::kTcpServer:
      case Kind::kTcpClient:
      case Kind::kCancellable:
        return CreateTcpStore("127.0.0.1", TcpStorePort(*server_), false, kLong);
    }
    return nullptr;
  }

  std::shared_ptr<Store> store_;
  std::shared_ptr<Store> server_;
  std::string directory_;
};

TEST_P(StoreTest, SetThenGet) {
  store_->Set("a", "1");
  store_->Set("b", "");
  EXPECT_EQ(store_->Get("a", kLong), "1");
  EXPECT_EQ(store_->Get("b", kLong), "");
  store_->Set("a", "2");
  EXPECT_EQ(store_->Get("a", kLong), "2");
  EXPECT_EQ(Peer()->Get("a", kLong), "2");
}

TEST_P(StoreTest, BinaryKeysAndValues) {
  std::string key("k\0/../\xff", 7);
  std::string value("\0\1\2\xfe", 4);
  store_->Set(key, value);
  EXPECT_EQ(store_->Get(key, kLong), value);
  EXPECT_EQ(Peer()->Get(key, kLong), value);
  EXPECT_THROW(store_->Get(std::string("k\0", 2), milliseconds(0)), Error);
}

TEST_P(StoreTest, LargeValueAndLongKey) {
  std::string key(4096, 'k');
  std::string value(1 << 20, 'v');
  value[12345] = 'x';
  store_->Set(key, value);
  EXPECT_EQ(Peer()->Get(key, kLong), value);
}

TEST_P(StoreTest, LimitsAreCheckedBeforeSending) {
  auto expect_invalid = [](const std::function<void()>& body, const std::string& part) {
    try {
      body();
      ADD_FAILURE() << "expected kInvalidArgument";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find(part), std::string::npos) << e.message();
    }
  };
  expect_invalid([&] { store_->Set("", "x"); }, "empty");
  expect_invalid([&] { store_->Set(std::string(4097, 'k'), "x"); }, "4097 bytes");
  expect_invalid([&] { store_->Get(std::string(4097, 'k'), milliseconds(0)); }, "4097 bytes");
  expect_invalid([&] { store_->Add(std::string(4097, 'k'), 1); }, "4097 bytes");
  expect_invalid([&] { store_->Set("big", std::string((16 << 20) + 1, 'v')); }, "16777217 bytes");
  // The store still works afterwards.
  store_->Set("after", "ok");
  EXPECT_EQ(store_->Get("after", kLong), "ok");
}

TEST_P(StoreTest, GetWaitsForALaterSetFromAnotherThread) {
  std::shared_ptr<Store> peer = Peer();
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(30));
    peer->Set("late", "value");
    std::this_thread::sleep_for(milliseconds(30));
    store_->Set("late2", "value2");  // through the handle the waiter also uses
  });
  EXPECT_EQ(store_->Get("late", kLong), "value");
  EXPECT_EQ(peer->Get("late2", kLong), "value2");
  setter.join();
}

// "w<i>", appended rather than concatenated: GCC 12 warns (-Wrestrict, a known false
// positive) on "w" + std::to_string(i) where it inlines it here.
std::string WaiterKey(int i) {
  std::string key = "w";
  key += std::to_string(i);
  return key;
}

TEST_P(StoreTest, ManyWaitersOnDifferentKeys) {
  constexpr int kThreads = 6;
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      std::shared_ptr<Store> handle = i % 2 == 0 ? store_ : Peer();
      if (handle->Get(WaiterKey(i), kLong) == std::to_string(i * 7)) ++good;
    });
  }
  std::this_thread::sleep_for(milliseconds(20));
  for (int i = kThreads - 1; i >= 0; --i) store_->Set(WaiterKey(i), std::to_string(i * 7));
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(good.load(), kThreads);
}

TEST_P(StoreTest, GetTimesOutNamingTheKey) {
  Clock::time_point start = Clock::now();
  try {
    store_->Get("never-set", milliseconds(200));
    ADD_FAILURE() << "expected kTimeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("'never-set'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("200 ms"), std::string::npos) << e.message();
  }
  auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, milliseconds(190));
  EXPECT_LT(elapsed, test_time::Scaled(milliseconds(2000)));
  // A zero timeout does not wait; the store works afterwards.
  start = Clock::now();
  EXPECT_THROW(store_->Get("never-set", milliseconds(0)), Error);
  EXPECT_LT(Clock::now() - start, test_time::Scaled(milliseconds(500)));
  store_->Set("never-set", "now");
  EXPECT_EQ(store_->Get("never-set", milliseconds(0)), "now");
}

TEST_P(StoreTest, AddStartsAtZeroAndReturnsTheSum) {
  EXPECT_EQ(store_->Add("n", 5), 5);
  EXPECT_EQ(store_->Add("n", -7), -2);
  EXPECT_EQ(store_->Add("n", 0), -2);
  EXPECT_EQ(store_->Get("n", kLong), "-2");
  store_->Set("m", "40");
  EXPECT_EQ(Peer()->Add("m", 2), 42);
}

TEST_P(StoreTest, AddOnANonIntegerIsInvalid) {
  store_->Set("text", "abc");
  try {
    store_->Add("text", 1);
    ADD_FAILURE() << "expected kInvalidArgument";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(e.message().find("'text'"), std::string::npos) << e.message();
  }
  store_->Set("max", std::to_string(INT64_MAX));
  EXPECT_THROW(store_->Add("max", 1), Error);
  EXPECT_EQ(store_->Add("fine", 1), 1);  // the connection (if any) is still usable
}

TEST_P(StoreTest, AddIsAtomicUnderContention) {
  constexpr int kThreads = 4;
  constexpr int kAdds = 100;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    // Half the threads share one handle, half have their own.
    std::shared_ptr<Store> handle = t % 2 == 0 ? store_ : Peer();
    threads.emplace_back([handle] {
      for (int i = 0; i < kAdds; ++i) handle->Add("counter", 1);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(store_->Add("counter", 0), kThreads * kAdds);
  EXPECT_EQ(store_->Get("counter", kLong), std::to_string(kThreads * kAdds));
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreTest,
                         testing::Values(Kind::kMemory, Kind::kFile, Kind::kTcpServer,
                                         Kind::kTcpClient, Kind::kCancellable),
                         KindName);

// A split's child is set up through a CancellableStore polling the parent's Abort: a Get waiting
// for a rank that never comes ends within a poll of the cancel, not at its timeout.
TEST(CancellableStoreTest, ACancelEndsAWaitingGetWithinAPoll) {
  std::atomic<bool> cancelled{false};
  cluster::CancellableStore store(
      CreateMemoryStore(), [&] { return cancelled.load(); }, "rank 0: abandoned", milliseconds(20));
  std::thread canceller([&] {
    std::this_thread::sleep_for(milliseconds(200));
    cancelled = true;
  });
  const auto start = Clock::now();
  try {
    store.Get("never", milliseconds(30'000));
    ADD_FAILURE() << "a Get of a key nobody sets returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    EXPECT_EQ(e.message(), "rank 0: abandoned");
  }
  canceller.join();
  EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::seconds(5)))
      << "not the Get's 30 s";
  EXPECT_THROW(store.Set("k", "v"), Error);
  EXPECT_THROW(store.Add("k", 1), Error);
  EXPECT_THROW(store.Get("k", milliseconds(0)), Error);
}

// A slice that timed out for another reason than the key's absence (a TCP store that could not
// connect, or got no reply, within its own limit: a cluster::StoreFailure) ends the Get: another
// slice would wait that limit again, past the Get's timeout.
TEST(CancellableStoreTest, AnotherTimeoutEndsTheGetAtOnce) {
  struct Unreachable final : Store {
    std::atomic<int> gets{0};
    void Set(const std::string&, const std::string&) override {}
    std::string Get(const std::string&, milliseconds) override {
      ++gets;
      throw cluster::StoreFailure(ErrorCode::kTimeout,
                                  "TCP store at h:1: could not connect within 5000 ms");
    }
    int64_t Add(const std::string&, int64_t) override { return 0; }
  };
  auto inner = std::make_shared<Unreachable>();
  cluster::CancellableStore store(
      inner, [] { return false; }, "unused", milliseconds(20));
  try {
    store.Get("k", milliseconds(10'000));
    ADD_FAILURE() << "a Get of an unreachable store returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_EQ(e.message(), "TCP store at h:1: could not connect within 5000 ms");
  }
  EXPECT_EQ(inner->gets.load(), 1);
  EXPECT_THROW(cluster::CancellableStore(inner, {}, "unused", milliseconds(20)), Error);
}

// Sliced, a Get still returns a value set while it waits, and its timeout names the whole wait.
TEST(CancellableStoreTest, ASlicedGetSeesALateSetAndNamesTheWholeTimeout) {
  auto inner = CreateMemoryStore();
  cluster::CancellableStore store(
      inner, [] { return false; }, "unused", milliseconds(20));
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(150));
    inner->Set("late", "here");
  });
  EXPECT_EQ(store.Get("late", kLong), "here");
  setter.join();
  try {
    store.Get("missing", milliseconds(130));
    ADD_FAILURE() << "a Get of a key nobody sets returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("was not set within 130 ms"), std::string::npos) << e.what();
  }
}

// A store the user wrote says that a key is not set with Error(kTimeout) in words of its own
// (cluster.h asks no more): that is the key's absence, worth another slice, not a failure of
// the store: a split set up over such a store waits its whole timeout, not one 50 ms slice.
TEST(CancellableStoreTest, AUserStoresTimeoutInItsOwnWordsIsTheKeysAbsence) {
  struct OwnWords final : Store {
    std::shared_ptr<Store> inner = CreateMemoryStore();
    void Set(const std::string& key, const std::string& value) override { inner->Set(key, value); }
    std::string Get(const std::string& key, milliseconds timeout) override {
      try {
        return inner->Get(key, timeout);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kTimeout) throw;
        throw Error(ErrorCode::kTimeout, "my store: no " + key + " yet");
      }
    }
    int64_t Add(const std::string& key, int64_t delta) override { return inner->Add(key, delta); }
  };
  auto own = std::make_shared<OwnWords>();
  cluster::CancellableStore store(
      own, [] { return false; }, "unused", milliseconds(20));
  std::thread setter([&] {
    std::this_thread::sleep_for(milliseconds(150));
    own->Set("late", "here");
  });
  try {
    EXPECT_EQ(store.Get("late", kLong), "here");
  } catch (const Error& e) {
    ADD_FAILURE() << "a Get of a key set after 150 ms failed: " << e.what();
  }
  setter.join();
  const auto start = Clock::now();
  try {
    store.Get("missing", milliseconds(130));
    ADD_FAILURE() << "a Get of a key nobody sets returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_EQ(e.message(), "my store: no missing yet");
  }
  EXPECT_GE(Clock::now() - start, milliseconds(120)) << "ended before the Get's 130 ms";
}

}  // namespace
}  // namespace collectives
