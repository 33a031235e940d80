// Tests of the Work handle's waits (src/core/work.h): the bounded polls, and Wait through each
// of its phases (spin, yield, sleep), with and without an error.
#include "src/core/work.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

namespace collectives::core {
namespace {

using std::chrono::microseconds;

TEST(YieldUntilTest, StopsAfterItsPollsOrItsBudget) {
  int calls = 0;
  auto never = [&] {
    ++calls;
    return false;
  };
  EXPECT_FALSE(YieldUntil(microseconds(1'000'000), 16, never));
  EXPECT_EQ(calls, 17);  // 16 polls with a yield after each, then the last look
  calls = 0;
  EXPECT_FALSE(YieldUntil(microseconds(0), 16, never));  // yield_us = 0: no yielding
  EXPECT_EQ(calls, 1);
  calls = 0;
  EXPECT_FALSE(YieldUntil(microseconds(1'000'000), 0, never));
  EXPECT_EQ(calls, 1);
}

TEST(YieldUntilTest, ReturnsAsSoonAsReady) {
  int calls = 0;
  EXPECT_TRUE(YieldUntil(microseconds(1'000'000), 16, [&] { return ++calls == 3; }));
  EXPECT_EQ(calls, 3);
  EXPECT_TRUE(SpinUntil(microseconds(0), [] { return true; }));
}

// Wait returns (or throws) once another thread completes the work, whichever phase it is in by
// then: completed at once (spin), after a few yields, or long after (asleep on the condition).
TEST(WorkStateTest, WaitSeesTheCompletionFromEveryPhase) {
  for (const auto delay : {microseconds(0), microseconds(200), microseconds(50'000)}) {
    for (const bool fail : {false, true}) {
      WorkState work(microseconds(10), microseconds(100));
      EXPECT_FALSE(work.Done());
      std::thread completer([&] {
        std::this_thread::sleep_for(delay);
        if (fail) {
          work.Complete(Error(ErrorCode::kPeerLost, "rank 1: lost"));
        } else {
          work.Complete(std::nullopt);
        }
      });
      if (fail) {
        try {
          work.Wait();
          ADD_FAILURE() << "Wait did not throw (delay " << delay.count() << " us)";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kPeerLost);
        }
      } else {
        EXPECT_NO_THROW(work.Wait()) << "delay " << delay.count() << " us";
      }
      EXPECT_TRUE(work.Done());
      completer.join();
      // A second Wait returns at once with the same outcome.
      if (fail) {
        EXPECT_THROW(work.Wait(), Error);
      } else {
        EXPECT_NO_THROW(work.Wait());
      }
    }
  }
}

}  // namespace
}  // namespace collectives::core
