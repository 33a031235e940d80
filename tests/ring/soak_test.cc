// Soak: 20,000 mixed collectives (every kind, dtype and op, in place or not, random roots) of
// random sizes on 4 ranks over loopback TCP, every result checked element by element on every
// rank. No error, and resident memory is flat: what the process holds after the last call is
// within a bound of what it held after the first 2,000 (buffers, staging and connection queues
// are reused, so a leak per call would show).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tests/ring/collective_checks.h"
#include "tests/ring/run_ranks.h"

namespace collectives::testing {
namespace {

// Resident set size of this process, in bytes.
size_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * size_t(sysconf(_SC_PAGESIZE));
}

TEST(SoakTest, TwentyThousandMixedCollectivesAreExactAndMemoryStaysFlat) {
  constexpr int kSize = 4;
  constexpr int kCalls = 20000;
  constexpr int kWarmup = 2000;
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  size_t rss_after_warmup = 0, rss_at_end = 0;
  std::vector<size_t> wrong(kSize, 0);
  std::vector<std::string> first(kSize);
  RunRanks(Transport::kTcp, kSize, options, [&](CollectiveCommunication& comm) {
    // Every rank draws the same sequence of calls.
    std::mt19937_64 rng(20261122);
    const auto& collectives = AllCollectives();
    const auto dtypes = AllDataTypes();
    const auto ops = AllReduceOps();
    for (int call = 0; call < kCalls; ++call) {
      const std::string& collective = collectives[rng() % collectives.size()];
      const DataType dtype = dtypes[rng() % dtypes.size()];
      const ReduceOp op = ops[rng() % ops.size()];
      const bool in_place = rng() % 2 == 0;
      const int root = int(rng() % kSize);
      // Log-uniform sizes from 0 to 128 Ki elements: mostly small, some that take the
      // pipelined paths.
      const int bits = int(rng() % 18);
      const size_t count = bits == 0 ? 0 : (size_t{1} << (bits - 1)) + rng() % (size_t{1} << (bits - 1));
      const CheckResult result =
          CheckCollective(comm, collective, dtype, op, count, in_place, root);
      if (result.wrong > 0 && wrong[comm.rank()] == 0) first[comm.rank()] = result.first;
      wrong[comm.rank()] += result.wrong;
      if (call + 1 == kWarmup || call + 1 == kCalls) {
        comm.Barrier();  // every rank is at the same point
        if (comm.rank() == 0) (call + 1 == kWarmup ? rss_after_warmup : rss_at_end) = ResidentBytes();
        comm.Barrier();
      }
    }
  });
  for (int rank = 0; rank < kSize; ++rank) {
    EXPECT_EQ(wrong[rank], 0u) << "rank " << rank << ": " << first[rank];
  }
  const double mib = 1.0 / (1 << 20);
  std::printf("resident memory: %.1f MiB after %d calls, %.1f MiB after %d\n",
              rss_after_warmup * mib, kWarmup, rss_at_end * mib, kCalls);
  // Flat: allocator noise of a few MiB at most (4 ranks' largest buffers are ~3 MiB each).
  // Under AddressSanitizer freed blocks wait in its quarantine (up to 256 MiB), so resident
  // memory says nothing there; LeakSanitizer checks for leaks at exit instead.
#if !defined(__SANITIZE_ADDRESS__)
  EXPECT_LT(rss_at_end, rss_after_warmup + (size_t{8} << 20));
#endif
}

}  // namespace
}  // namespace collectives::testing
