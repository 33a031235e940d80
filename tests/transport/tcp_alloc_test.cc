// The TCP data path allocates nothing per frame once warm: this binary counts every call of
// the global operator new and checks that a ping-pong and a pipelined exchange, after warm-up,
// make none. (Own binary: it replaces the global allocation functions.)
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "tests/replaced_operator_new.h"
#include "tests/transport/fabric_test_util.h"
#include "tests/time_scale.h"

namespace {
std::atomic<bool> counting{false};
std::atomic<long> allocations{0};

void CountIfCounting() {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1);
}
}  // namespace

namespace collectives::transport {
namespace {

using namespace std::chrono_literals;
using testing::Tag;

TEST(TcpAllocationTest, SteadyStateMakesNoAllocations) {
  // The counter works.
  collectives::testing::before_allocation = CountIfCounting;
  counting.store(true);
  ::operator delete(::operator new(16));
  counting.store(false);
  ASSERT_EQ(allocations.exchange(0), 1);

  auto store = CreateMemoryStore();
  auto group = testing::ConnectTcpGroup(2, *store, [](int) {
    TcpFabricOptions options;
    options.timeout = 20'000ms;
    return options;
  });
  ASSERT_FALSE(group.errors[0]);
  ASSERT_FALSE(group.errors[1]);
  std::atomic<int> arrived{0};
  auto barrier = [&arrived](int round) {
    arrived.fetch_add(1);
    while (arrived.load() < 2 * round) std::this_thread::yield();
  };
  constexpr int kRounds = 2000;
  std::vector<std::vector<uint8_t>> big_out(2, std::vector<uint8_t>(1 << 20, 1));
  std::vector<std::vector<uint8_t>> big_in(2, std::vector<uint8_t>(1 << 20));
  const auto errors = testing::RunRanks(2, [&](int rank) {
    Fabric& fabric = *group.fabrics[rank];
    fabric.SetDeadline(Clock::now() + test_time::Scaled(60s));
    Connection& peer = fabric.connection(1 - rank);
    uint64_t word = 0;
    uint64_t words_out[8] = {};
    uint64_t words_in[8] = {};
    auto exchange = [&](int i) {
      // A ping-pong of 8 bytes, then 8 frames in flight each way, then 1 MiB each way.
      const auto tag = Tag(static_cast<uint64_t>(i), 1);
      if (rank == 0) {
        peer.PostSend(tag, &word, 8);
        peer.WaitRecv(peer.PostRecv(tag, &word, 8));
      } else {
        peer.WaitRecv(peer.PostRecv(tag, &word, 8));
        peer.PostSend(tag, &word, 8);
      }
      uint64_t last_send;
      uint64_t last_recv;
      for (int k = 0; k < 8; ++k) {
        last_send = peer.PostSend(tag, &words_out[k], 8);
        last_recv = peer.PostRecv(tag, &words_in[k], 8);
      }
      last_send = peer.PostSend(tag, big_out[rank].data(), big_out[rank].size());
      last_recv = peer.PostRecv(tag, big_in[rank].data(), big_in[rank].size());
      peer.WaitRecv(last_recv);
      peer.WaitSend(last_send);
    };
    for (int i = 0; i < 200; ++i) exchange(i);  // warm up: queues and caches grow here
    barrier(1);
    if (rank == 0) counting.store(true);
    barrier(2);
    for (int i = 200; i < 200 + kRounds; ++i) exchange(i);
    barrier(3);
    if (rank == 0) counting.store(false);
  });
  ASSERT_FALSE(errors[0]) << errors[0]->what();
  ASSERT_FALSE(errors[1]) << errors[1]->what();
  EXPECT_EQ(allocations.load(), 0) << "allocations in " << kRounds << " warm rounds";
}

}  // namespace
}  // namespace collectives::transport
