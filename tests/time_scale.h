// Upper time bounds in tests, scaled for the build: a sanitizer slows the code several times
// (AddressSanitizer about 3x, ThreadSanitizer about 10x), and COLLECTIVES_TEST_TIME_SCALE, a
// positive number, sets the factor instead (for valgrind or a loaded machine). A bound that
// tells a prompt result from a product deadline keeps its meaning only where the deadline is
// scaled alike.
#ifndef COLLECTIVES_TESTS_TIME_SCALE_H_
#define COLLECTIVES_TESTS_TIME_SCALE_H_

#include <chrono>
#include <cstdlib>

#if defined(__SANITIZE_THREAD__)
#define COLLECTIVES_TEST_SANITIZER_SCALE 10
#elif defined(__SANITIZE_ADDRESS__)
#define COLLECTIVES_TEST_SANITIZER_SCALE 3
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define COLLECTIVES_TEST_SANITIZER_SCALE 10
#elif __has_feature(address_sanitizer)
#define COLLECTIVES_TEST_SANITIZER_SCALE 3
#endif
#endif
#ifndef COLLECTIVES_TEST_SANITIZER_SCALE
#define COLLECTIVES_TEST_SANITIZER_SCALE 1
#endif

// Not in collectives::testing: a test in namespace collectives that means GoogleTest by
// `testing::` would find that namespace first.
namespace collectives::test_time {

// The factor: COLLECTIVES_TEST_TIME_SCALE where set to a positive number, else 10 under
// ThreadSanitizer, 3 under AddressSanitizer, 1 otherwise.
inline double TimeScale() {
  if (const char* text = std::getenv("COLLECTIVES_TEST_TIME_SCALE")) {
    char* end = nullptr;
    const double factor = std::strtod(text, &end);
    if (end != text && *end == '\0' && factor > 0) return factor;
  }
  return COLLECTIVES_TEST_SANITIZER_SCALE;
}

// `bound` times TimeScale().
template <typename Rep, typename Period>
std::chrono::nanoseconds Scaled(std::chrono::duration<Rep, Period> bound) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double, std::nano>(bound) * TimeScale());
}

// A bound in seconds as a double, times TimeScale().
inline double Scaled(double seconds) { return seconds * TimeScale(); }

}  // namespace collectives::test_time

#endif  // COLLECTIVES_TESTS_TIME_SCALE_H_
