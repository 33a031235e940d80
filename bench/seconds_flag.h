// The --timeout flag of the benchmarks and of the training demo: its check and its conversion,
// header-only so that the demo (which does not link bench_util) shares them. Only the standard
// library.
#ifndef COLLECTIVES_BENCH_SECONDS_FLAG_H_
#define COLLECTIVES_BENCH_SECONDS_FLAG_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

namespace collectives::bench {

// The whole of `text` read as a number by strtod ("1e3", "nan", "inf" included), or nothing where
// it is empty or something follows the number.
inline std::optional<double> WholeNumber(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) return std::nullopt;
  return value;
}

// A check for --timeout, CLI11's way (empty when `text` is fine, else why not): a number of
// seconds, at least 0.001 (a millisecond, the library's unit). CLI::PositiveNumber let NaN
// through, whose conversion to milliseconds is undefined: here it gave -2^63 ms, which every rank
// refused naming neither the flag nor its value.
inline std::string CheckTimeoutSeconds(const std::string& text) {
  const std::optional<double> seconds = WholeNumber(text);
  if (seconds && *seconds >= 0.001) return {};  // false for NaN
  return "'" + text + "' is not a number of seconds >= 0.001";
}

// --timeout in seconds as milliseconds, at most a year (the library reads more as a year; the
// clamp keeps the conversion of a huge value, 1e300, defined: it overflowed to a negative count).
inline std::chrono::milliseconds TimeoutFromSeconds(double seconds) {
  constexpr double kYear = 365.0 * 24 * 3600;
  return std::chrono::milliseconds(static_cast<int64_t>(std::min(seconds, kYear) * 1000.0));
}

}  // namespace collectives::bench

#endif  // COLLECTIVES_BENCH_SECONDS_FLAG_H_
