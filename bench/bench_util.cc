// Helpers shared by the sweep benchmarks (collectives_perf, packing_perf, gloo_perf); see
// bench/bench_util.h.
#include "bench/bench_util.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <array>
#include <cctype>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#ifdef COLLECTIVES_WITH_MPI
#include <mpi.h>
#endif

namespace collectives::bench {

size_t ParseBytes(const std::string& text) {
  size_t pos = 0;
  unsigned long long value = 0;
  try {
    // stoull takes a sign and wraps "-1" to the largest value: a size starts with a digit.
    if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) {
      throw std::invalid_argument(text);
    }
    value = std::stoull(text, &pos);
  } catch (const std::exception&) {
    throw CLI::ValidationError("'" + text + "' is not a size (examples: 8, 64K, 64M, 1G)");
  }
  std::string suffix = text.substr(pos);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  // An optional K, M or G, then an optional "B" or "iB".
  if (suffix.ends_with("IB")) {
    suffix.resize(suffix.size() - 2);
  } else if (suffix.ends_with("B")) {
    suffix.resize(suffix.size() - 1);
  }
  int shift = 0;
  if (suffix.empty()) {
    shift = 0;
  } else if (suffix == "K") {
    shift = 10;
  } else if (suffix == "M") {
    shift = 20;
  } else if (suffix == "G") {
    shift = 30;
  } else {
    throw CLI::ValidationError("'" + text + "': unknown size suffix (use K, M or G)");
  }
  if (value > (std::numeric_limits<size_t>::max() >> shift)) {
    throw CLI::ValidationError("'" + text + "' is too large");
  }
  return static_cast<size_t>(value) << shift;
}

std::function<std::string(std::string)> BytesSuffix() {
  return [](std::string text) { return std::to_string(ParseBytes(text)); };
}

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, ',')) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

std::vector<size_t> SweepSizes(size_t min_bytes, size_t max_bytes, size_t step_factor,
                               size_t step_bytes) {
  std::vector<size_t> sizes;
  for (size_t bytes = min_bytes; bytes <= max_bytes;) {
    sizes.push_back(bytes);
    if (step_bytes > 0) {
      if (bytes > max_bytes - step_bytes) break;
      bytes += step_bytes;
    } else {
      if (bytes > max_bytes / step_factor) break;
      bytes *= step_factor;
    }
  }
  return sizes;
}

std::string Format(const char* format, ...) {
  char text[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof(text), format, args);
  va_end(args);
  return text;
}

std::unique_ptr<std::ofstream> OpenCsv(const std::string& path) {
  const std::filesystem::path file(path);
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  auto csv = std::make_unique<std::ofstream>(file);
  if (!*csv) throw std::runtime_error("cannot write " + path);
  return csv;
}

std::function<std::string(const std::string&)> TimeoutSeconds() {
  return [](const std::string& text) { return CheckTimeoutSeconds(text); };
}

void CommunicationFlags::ApplyTo(CommunicationOptions& options) const {
  options.chunk_bytes = chunk_bytes;
  options.small_message_bytes = small_message_bytes;
  options.spin_us = spin_us;
  options.yield_us = yield_us;
  options.timeout = timeout();
}

void AddCommunicationFlags(CLI::App& app, CommunicationFlags& flags) {
  app.add_option("--chunk-bytes", flags.chunk_bytes,
                 "CommunicationOptions::chunk_bytes (0: library default; 512K, ...)")
      ->capture_default_str()
      ->transform(BytesSuffix());
  app.add_option("--small-bytes", flags.small_message_bytes,
                 "CommunicationOptions::small_message_bytes (0: library default)")
      ->capture_default_str()
      ->transform(BytesSuffix());
  app.add_option("--spin-us", flags.spin_us, "CommunicationOptions::spin_us (-1: adaptive)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 1'000'000));
  app.add_option("--yield-us", flags.yield_us, "CommunicationOptions::yield_us (-1: default)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 1'000'000));
  app.add_option("--timeout", flags.timeout_s,
                 "Seconds a collective or the rendezvous may take before it fails")
      ->capture_default_str()
      ->check(TimeoutSeconds());
}

AlignedBuffer::AlignedBuffer(size_t bytes, const std::string& what) {
  constexpr size_t kAlignment = 4096;
  const size_t rounded =
      bytes > std::numeric_limits<size_t>::max() - kAlignment
          ? 0
          : std::max<size_t>(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  if (rounded > 0) data_.reset(static_cast<std::byte*>(std::aligned_alloc(kAlignment, rounded)));
  if (!data_) {
    throw std::runtime_error(Format("cannot allocate %s: %zu bytes (%.1f GiB): out of memory",
                                    what.c_str(), bytes, static_cast<double>(bytes) / (1 << 30)));
  }
  std::memset(data_.get(), 0, rounded);  // touch every page before timing
}

void AlignedBuffer::Free::operator()(std::byte* p) const { std::free(p); }

size_t CountHosts(CollectiveCommunication& comm) {
  // Every rank contributes a hash of its host name.
  std::array<char, 256> host{};
  gethostname(host.data(), host.size() - 1);
  int64_t host_hash = static_cast<int64_t>(std::hash<std::string>{}(host.data()));
  std::vector<int64_t> hashes(static_cast<size_t>(comm.size()));
  comm.AllGather(Tensor{&host_hash, 1, DataType::kInt64, Device::Cpu()},
                 Tensor{hashes.data(), hashes.size(), DataType::kInt64, Device::Cpu()});
  return std::set<int64_t>(hashes.begin(), hashes.end()).size();
}

void PrintBuildHeader(const char* program, const std::string& bench_build) {
  const std::string library_build = BuildType();
  std::printf("# %s  version %s  library build %s  bench build %s\n", program, Version(),
              library_build.c_str(), bench_build.c_str());
  if (library_build != "Release" || bench_build != "Release") {
    const char* warning =
        "# !!! WARNING: not a Release build: timings are NOT representative.\n"
        "# !!! Rebuild with -DCMAKE_BUILD_TYPE=Release (scripts/build.sh does).\n";
    std::printf("%s", warning);
    std::fprintf(stderr, "%s", warning);
  }
}

void PrintWrongSummary(bool checked, int64_t total_wrong) {
  std::printf("#\n");
  if (checked) {
    std::printf("# wrong elements: %lld%s\n", static_cast<long long>(total_wrong),
                total_wrong == 0 ? "" : "  <-- RESULTS ARE WRONG");
  } else {
    std::printf("# wrong elements: not checked (pass --check)\n");
  }
}

#ifdef COLLECTIVES_WITH_MPI
void CheckMpi(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(rc, text, &length);
    throw std::runtime_error(std::string(what) + " failed: " + std::string(text, length));
  }
}
#endif

MpiStartup::MpiStartup(bool start, int* argc, char*** argv) {
#ifdef COLLECTIVES_WITH_MPI
  if (start) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    initialized_ = true;
  }
#else
  (void)start;
  (void)argc;
  (void)argv;
#endif
}

void MpiStartup::Finalize() {
#ifdef COLLECTIVES_WITH_MPI
  if (initialized_) MPI_Finalize();
#endif
}

}  // namespace collectives::bench
