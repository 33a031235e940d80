// Helpers shared by the sweep benchmarks (collectives_perf, packing_perf, gloo_perf): size and
// list parsing for their command lines, the sizes of a sweep, printf-style formatting, the CSV
// file, page-aligned buffers and the common lines of their headers and summaries. Only the
// public API is used.
#ifndef COLLECTIVES_BENCH_BENCH_UTIL_H_
#define COLLECTIVES_BENCH_BENCH_UTIL_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/seconds_flag.h"
#include "collectives/collectives.h"

namespace CLI {
class App;
}  // namespace CLI

namespace collectives::bench {

// A CLI11 check for --timeout (CheckTimeoutSeconds in seconds_flag.h, which also has
// TimeoutFromSeconds).
std::function<std::string(const std::string&)> TimeoutSeconds();

// The CommunicationOptions the sweeps take as flags, with the library's defaults: 0 for the
// sizes, -1 (adaptive, default) for the waits; timeout_s is the communicator's and the set-up's.
struct CommunicationFlags {
  size_t chunk_bytes = 0;
  size_t small_message_bytes = 0;
  int spin_us = -1;
  int yield_us = -1;
  double timeout_s = 120;

  std::chrono::milliseconds timeout() const { return TimeoutFromSeconds(timeout_s); }
  // Sets the five options in `options`.
  void ApplyTo(CommunicationOptions& options) const;
};

// Adds --chunk-bytes, --small-bytes, --spin-us, --yield-us and --timeout to `app`, into `flags`.
void AddCommunicationFlags(CLI::App& app, CommunicationFlags& flags);

// "8", "64K", "64M", "1G" (binary multiples; a trailing "B" or "iB" is accepted) -> bytes.
// Throws CLI::ValidationError on anything else.
size_t ParseBytes(const std::string& text);

// A CLI11 transform for a numeric option that takes a size: rewrites "512K" as "524288" (by
// ParseBytes, whose ValidationError CLI11 reports) before CLI11 converts it, so size flags
// accept what -b and -e accept.
std::function<std::string(std::string)> BytesSuffix();

// The non-empty items of a comma-separated list.
std::vector<std::string> SplitList(const std::string& text);

// The sizes of a sweep in bytes: from min_bytes up to max_bytes, growing by step_bytes when it
// is > 0, else multiplied by step_factor (>= 2).
std::vector<size_t> SweepSizes(size_t min_bytes, size_t max_bytes, size_t step_factor,
                               size_t step_bytes);

// printf into a std::string (at most 511 characters).
std::string Format(const char* format, ...) __attribute__((format(printf, 1, 2)));

// Opens `path` for writing, creating its parent folders; throws std::runtime_error if it cannot.
std::unique_ptr<std::ofstream> OpenCsv(const std::string& path);

// A zeroed, page-aligned buffer of at least `bytes` bytes (and at least one page); every page
// is touched before timing. Where it cannot be allocated, throws std::runtime_error naming
// `what` (the buffer and the flag that sized it: "the receive buffer (-e)") and the size, not a
// bare std::bad_alloc.
class AlignedBuffer {
 public:
  AlignedBuffer(size_t bytes, const std::string& what);
  std::byte* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, Free> data_;
};

// The number of distinct hosts the ranks of `comm` run on (every rank takes part).
size_t CountHosts(CollectiveCommunication& comm);

// Rank 0's first header line, "# <program>  version ...  library build ...  bench build ...",
// and a warning on stdout and stderr when either build is not a Release build.
void PrintBuildHeader(const char* program, const std::string& bench_build);

// The summary's opening "#" line and its line on wrong elements (total_wrong, or "not
// checked" without --check).
void PrintWrongSummary(bool checked, int64_t total_wrong);

// MPI for a benchmark's main: the constructor calls MPI_Init_thread (MPI_THREAD_FUNNELED) when
// `start` is true and this build has MPI (COLLECTIVES_WITH_MPI); Finalize calls MPI_Finalize if
// it did. Without MPI in the build, initialized() is false and Finalize does nothing.
// Throws std::runtime_error naming `what` and MPI's error text when rc is not MPI_SUCCESS
// (rc is an MPI return code; defined only in builds with MPI).
void CheckMpi(int rc, const char* what);

class MpiStartup {
 public:
  MpiStartup(bool start, int* argc, char*** argv);
  bool initialized() const { return initialized_; }
  void Finalize();

 private:
  bool initialized_ = false;
};

// A well-mixed 64-bit hash of (rank, index) (splitmix64's finaliser), for check inputs: each
// rank's value at an index taken from it (mod a small k) makes the sum over ranks depend on the
// index at any world size, so that a result at the wrong offset fails the check (a linear
// pattern such as (index + 3 rank) mod 4 sums to the same value everywhere at some world sizes).
inline uint64_t MixRankAndIndex(int rank, size_t index) {
  uint64_t h = (static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull) ^
               (static_cast<uint64_t>(rank) * 0xC2B2AE3D27D4EB4Full);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 32);
}

}  // namespace collectives::bench

#endif  // COLLECTIVES_BENCH_BENCH_UTIL_H_
