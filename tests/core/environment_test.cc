// Tests of the environment counts and the cores-per-rank rule (src/core/environment.h), and of
// the tuning variables that go through them.
#include "src/core/environment.h"

#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>

namespace collectives::core {
namespace {

// CountFromText, with what it wrote on stderr.
std::optional<uint64_t> Parse(const char* text, std::string* warning) {
  ::testing::internal::CaptureStderr();
  const std::optional<uint64_t> value = CountFromText("COLLECTIVES_EXAMPLE", text, "a count");
  *warning = ::testing::internal::GetCapturedStderr();
  return value;
}

TEST(EnvCountTest, TakesDecimalDigitsOnly) {
  std::string warning;
  EXPECT_EQ(Parse(nullptr, &warning), std::nullopt);  // unset: nothing to say
  EXPECT_EQ(warning, "");
  EXPECT_EQ(Parse("0", &warning), 0u);
  EXPECT_EQ(Parse("4194304", &warning), 4194304u);
  EXPECT_EQ(Parse("007", &warning), 7u);
  EXPECT_EQ(Parse("18446744073709551615", &warning), UINT64_MAX);
  EXPECT_EQ(warning, "");
}

TEST(EnvCountTest, RefusesAnythingElseAndSaysSo) {
  // strtoull would take the blanks and the signs, wrap "-5" to a huge count, and stop quietly
  // at the first letter.
  for (const char* bad : {"", " 12", "12 ", "+12", "-5", " -5", "4M", "12abc", "0x10", "1e6",
                          "18446744073709551616", "x"}) {
    std::string warning;
    EXPECT_EQ(Parse(bad, &warning), std::nullopt) << "\"" << bad << "\"";
    EXPECT_EQ(warning, std::string("collectives: ignoring COLLECTIVES_EXAMPLE=\"") + bad +
                           "\" (expected a count)\n");
  }
}

TEST(LocalRanksTest, LauncherVariablesFirstThenTheWholeWorld) {
  EXPECT_EQ(LocalRanksFrom(nullptr, nullptr, 16), 16);  // nothing said: every rank
  EXPECT_EQ(LocalRanksFrom("4", nullptr, 16), 4);       // torchrun, our launcher
  EXPECT_EQ(LocalRanksFrom(nullptr, "2", 16), 2);       // mpirun
  EXPECT_EQ(LocalRanksFrom("4", "2", 16), 4);           // LOCAL_WORLD_SIZE wins
  EXPECT_EQ(LocalRanksFrom("0", "2", 16), 2);           // not a positive count: the next one
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(LocalRanksFrom("four", nullptr, 16), 16);
  EXPECT_EQ(LocalRanksFrom("99999999999", nullptr, 16), 16);  // more than an int
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warnings.find("ignoring LOCAL_WORLD_SIZE=\"four\""), std::string::npos) << warnings;
}

TEST(CoresForTest, ComparesRanksTimesThreadsWithTheMachine) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  ASSERT_GT(cores, 0) << "the machine's core count is unknown";
  EXPECT_TRUE(CoresFor(1));
  EXPECT_TRUE(CoresFor(cores));
  EXPECT_FALSE(CoresFor(cores + 1));
  EXPECT_TRUE(CoresFor(cores, 1));
  EXPECT_EQ(CoresFor(cores, 2), false);
  EXPECT_EQ(CoresFor((cores + 1) / 2, 2), cores % 2 == 0);
  EXPECT_FALSE(CoresFor(INT_MAX, INT_MAX));  // no overflow into a small product
}

}  // namespace
}  // namespace collectives::core
