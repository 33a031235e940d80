// gloo_perf: the Gloo baseline of collectives_perf. It sweeps Gloo's all-reduce (f32 sum, ring),
// broadcast and all-gather over Gloo's TCP transport with the same flags (-b -e -f -i -c -n -w
// --check --csv --root --local), the same size conventions and the same columns as
// collectives_perf, so that bench/plot_sweep.py can draw both on one figure. The CSV has
// collectives_perf's columns up to `wrong` (not its baseline columns nor `algorithm`), then
// `implementation`, which reads "gloo".
//
// Gloo has no reduce-scatter in its current API (only the older ReduceScatterHalvingDoubling,
// in place, with its own count layout), so -c reduce_scatter is refused.
//
// Per size, as collectives_perf does it: build the call's options once, -w warm-up calls, with
// --check one more call verified element by element on every rank, a barrier, -n timed calls;
// time = mean per call of the slowest rank (an all-reduce max of the per-rank means); algbw =
// bytes / time, busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather), x 1 (broadcast).
// Buffers are out of place.
//
// How the ranks start:
//   --local N  this process forks N ranks on loopback and waits for them; they rendezvous
//              through a Gloo FileStore in a fresh temporary folder, removed at the end, also
//              when the run is interrupted (SIGINT, SIGTERM, SIGHUP: the ranks are stopped,
//              the folder removed, then this process ends by the same signal).
//   otherwise  RANK and WORLD_SIZE from the environment and --store DIR, a folder every rank
//              can read and write (on several hosts: a shared file system; pass --hostname).
//
// Exit status: 0 success (--help too), 1 error (a bad command line too), 2 the run finished but
// --check found wrong elements.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/config.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/transport/tcp/device.h"

#ifndef GLOO_PERF_BUILD_TYPE
#define GLOO_PERF_BUILD_TYPE "unknown"
#endif

namespace collectives::gloo_perf {
namespace {

using bench::Format;
using bench::OpenCsv;
using bench::ParseBytes;
using bench::PrintWrongSummary;
using bench::SplitList;
using Clock = std::chrono::steady_clock;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitWrong = 2;

// Every operation of this program runs alone, so one tag serves them all.
constexpr uint32_t kTag = 0x67700001;

enum class Collective { kAllReduce, kBroadcast, kAllGather };
constexpr Collective kAllCollectives[] = {Collective::kAllReduce, Collective::kBroadcast,
                                          Collective::kAllGather};

const char* ToString(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kAllGather:
      return "all_gather";
  }
  return "?";
}

double BusBandwidthFactor(Collective collective, int world_size) {
  const double n = world_size;
  switch (collective) {
    case Collective::kAllReduce:
      return 2.0 * (n - 1.0) / n;
    case Collective::kAllGather:
      return (n - 1.0) / n;
    case Collective::kBroadcast:
      return 1.0;
  }
  return 1.0;
}

// ---------------------------------------------------------------------------------------------
// Command line.
// ---------------------------------------------------------------------------------------------

struct Config {
  size_t min_bytes = 8;
  size_t max_bytes = size_t{64} << 20;
  size_t step_factor = 2;
  size_t step_bytes = 0;  // > 0: sizes grow by this many bytes instead of by step_factor
  std::vector<Collective> collectives = {Collective::kAllReduce};
  int iters = 20;
  int warmup_iters = 5;
  // Rounds of `iters` timed calls per size, and what a row reports of them ("median" or
  // "min"), as collectives_perf's -r and --stat.
  int repeat = 1;
  std::string stat = "median";
  bool check = false;
  std::string csv_path;
  int root = 0;
  std::string algorithm = "ring";
  double timeout_s = 120;
  int local = 0;
  std::string store_dir;
  std::string hostname = "127.0.0.1";

  std::chrono::milliseconds timeout() const { return bench::TimeoutFromSeconds(timeout_s); }
};

std::vector<Collective> ParseCollectives(const std::string& text) {
  if (text == "all") return {std::begin(kAllCollectives), std::end(kAllCollectives)};
  std::vector<Collective> result;
  for (const std::string& name : SplitList(text)) {
    if (name == "reduce_scatter") {
      throw CLI::ValidationError("-c: Gloo has no reduce-scatter in its current API");
    }
    const auto it = std::find_if(std::begin(kAllCollectives), std::end(kAllCollectives),
                                 [&](Collective c) { return name == ToString(c); });
    if (it == std::end(kAllCollectives)) {
      throw CLI::ValidationError("-c: unknown collective '" + name +
                                 "' (all_reduce, broadcast, all_gather or all)");
    }
    result.push_back(*it);
  }
  if (result.empty()) throw CLI::ValidationError("-c: no collective given");
  return result;
}

// ---------------------------------------------------------------------------------------------
// Buffers and check data. Values are small integers, so every f32 sum is exact.
// ---------------------------------------------------------------------------------------------

// `count` floats (at least one page), page-aligned and zeroed.
class FloatBuffer {
 public:
  FloatBuffer(size_t count, const std::string& what) : bytes_(count * sizeof(float), what) {}
  float* data() const { return reinterpret_cast<float*>(bytes_.data()); }

 private:
  bench::AlignedBuffer bytes_;
};

// Element i of rank r's input.
// A hash of (rank, i), not (7 i + 3 rank) mod 5, whose sum is the same at every element for any
// multiple of 5 ranks (a misplaced result would pass the check).
float ReductionInput(size_t i, int rank) {
  return static_cast<float>(bench::MixRankAndIndex(rank, i) % 5);
}
float CopyInput(size_t i, int rank) { return static_cast<float>((i + 37 * rank) % 101); }

// ---------------------------------------------------------------------------------------------
// One rank.
// ---------------------------------------------------------------------------------------------

struct Row {
  Collective collective = Collective::kAllReduce;
  size_t bytes = 0;
  size_t count = 0;
  bool skipped = false;
  double time_us = 0;
  double algbw = 0;
  double busbw = 0;
  std::optional<int64_t> wrong;
};

class Sweep {
 public:
  Sweep(const Config& config, std::shared_ptr<gloo::Context> context, std::ofstream* csv)
      : config_(config),
        context_(std::move(context)),
        rank_(context_->rank),
        world_size_(context_->size),
        csv_(csv),
        send_(config.max_bytes / sizeof(float), "the send buffer (-e)"),
        recv_(config.max_bytes / sizeof(float), "the receive buffer (-e)") {}

  int Run() {
    PrintHeader();
    if (csv_ != nullptr && rank_ == 0) {
      *csv_ << "collective,world_size,size_bytes,count,dtype,op,root,time_us,algbw_gbps,"
               "busbw_gbps,wrong,implementation\n";
    }
    int64_t total_wrong = 0;
    double busbw_sum = 0;
    size_t timed_rows = 0;
    for (Collective collective : config_.collectives) {
      PrintTableHeader(collective);
      for (size_t bytes : bench::SweepSizes(config_.min_bytes, config_.max_bytes,
                                            config_.step_factor, config_.step_bytes)) {
        const Row row = RunCase(collective, bytes);
        PrintRow(row);
        WriteCsvRow(row);
        if (row.wrong) total_wrong += *row.wrong;
        if (!row.skipped) {
          busbw_sum += row.busbw;
          ++timed_rows;
        }
      }
    }
    if (rank_ == 0) {
      PrintWrongSummary(config_.check, total_wrong);
      std::printf("# average busbw: %.3f GB/s over %zu sizes\n",
                  timed_rows == 0 ? 0.0 : busbw_sum / static_cast<double>(timed_rows), timed_rows);
      std::fflush(stdout);
    }
    return total_wrong == 0 ? kExitOk : kExitWrong;
  }

 private:
  using ReduceFn = void (*)(void*, const void*, const void*, size_t);

  Row RunCase(Collective collective, size_t requested_bytes) {
    Row row;
    row.collective = collective;
    const size_t n = static_cast<size_t>(world_size_);
    size_t count = requested_bytes / sizeof(float);
    if (collective == Collective::kAllGather) count = count / n * n;
    const size_t per_rank = collective == Collective::kAllGather ? count / n : count;
    row.count = count;
    row.bytes = count * sizeof(float);
    if (per_rank == 0) {
      row.bytes = requested_bytes;
      row.skipped = true;
      return row;
    }

    // Options are built once per size and reused by every call, so the timed loop measures
    // Gloo's algorithm and transport, not the construction of its buffer objects.
    std::function<void()> run_once;
    std::unique_ptr<gloo::AllreduceOptions> allreduce;
    std::unique_ptr<gloo::BroadcastOptions> broadcast;
    std::unique_ptr<gloo::AllgatherOptions> allgather;
    switch (collective) {
      case Collective::kAllReduce:
        allreduce = std::make_unique<gloo::AllreduceOptions>(context_);
        allreduce->setInput(send_.data(), count);
        allreduce->setOutput(recv_.data(), count);
        allreduce->setReduceFunction(static_cast<ReduceFn>(&gloo::sum<float>));
        allreduce->setAlgorithm(config_.algorithm == "bcube"
                                    ? gloo::AllreduceOptions::Algorithm::BCUBE
                                    : gloo::AllreduceOptions::Algorithm::RING);
        allreduce->setTag(kTag);
        run_once = [&] { gloo::allreduce(*allreduce); };
        break;
      case Collective::kBroadcast:
        broadcast = std::make_unique<gloo::BroadcastOptions>(context_);
        if (rank_ == config_.root) broadcast->setInput(send_.data(), count);
        broadcast->setOutput(recv_.data(), count);
        broadcast->setRoot(config_.root);
        broadcast->setTag(kTag);
        run_once = [&] { gloo::broadcast(*broadcast); };
        break;
      case Collective::kAllGather:
        allgather = std::make_unique<gloo::AllgatherOptions>(context_);
        allgather->setInput(send_.data(), per_rank);
        allgather->setOutput(recv_.data(), count);
        allgather->setTag(kTag);
        run_once = [&] { gloo::allgather(*allgather); };
        break;
    }

    FillInput(collective, per_rank);
    for (int i = 0; i < config_.warmup_iters; ++i) run_once();

    if (config_.check) {
      FillInput(collective, per_rank);
      std::fill_n(recv_.data(), count, std::numeric_limits<float>::quiet_NaN());
      run_once();
      double wrong = static_cast<double>(CountWrong(collective, count, per_rank));
      AllReduceDouble(&wrong, static_cast<ReduceFn>(&gloo::sum<double>));
      row.wrong = static_cast<int64_t>(wrong);
    }

    // Each round's time is the slowest rank's; the row reports the median round, or the
    // fastest (--stat min).
    std::vector<double> rounds;
    for (int round = 0; round < config_.repeat; ++round) {
      Barrier();
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < config_.iters; ++i) run_once();
      double round_seconds =
          std::chrono::duration<double>(Clock::now() - start).count() / config_.iters;
      AllReduceDouble(&round_seconds, static_cast<ReduceFn>(&gloo::max<double>));
      rounds.push_back(round_seconds);
    }
    std::sort(rounds.begin(), rounds.end());
    const size_t half = rounds.size() / 2;
    const double seconds = config_.stat == "min"        ? rounds.front()
                           : rounds.size() % 2 == 1 ? rounds[half]
                                                    : (rounds[half - 1] + rounds[half]) / 2;

    row.time_us = seconds * 1e6;
    row.algbw = static_cast<double>(row.bytes) / seconds / 1e9;
    row.busbw = row.algbw * BusBandwidthFactor(collective, world_size_);
    return row;
  }

  void FillInput(Collective collective, size_t send_count) {
    float* send = send_.data();
    for (size_t i = 0; i < send_count; ++i) {
      send[i] =
          collective == Collective::kAllReduce ? ReductionInput(i, rank_) : CopyInput(i, rank_);
    }
  }

  int64_t CountWrong(Collective collective, size_t count, size_t per_rank) const {
    const float* recv = recv_.data();
    int64_t wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      float expected = 0;
      switch (collective) {
        case Collective::kAllReduce:
          for (int r = 0; r < world_size_; ++r) expected += ReductionInput(i, r);
          break;
        case Collective::kBroadcast:
          expected = CopyInput(i, config_.root);
          break;
        case Collective::kAllGather:
          expected = CopyInput(i % per_rank, static_cast<int>(i / per_rank));
          break;
      }
      if (recv[i] != expected) {
        if (wrong < 3) {
          std::fprintf(stderr,
                       "gloo_perf: rank %d: %s count=%zu: element %zu: got %g, "
                       "expected %g\n",
                       rank_, ToString(collective), count, i, static_cast<double>(recv[i]),
                       static_cast<double>(expected));
        }
        ++wrong;
      }
    }
    return wrong;
  }

  void AllReduceDouble(double* value, ReduceFn fn) {
    gloo::AllreduceOptions options(context_);
    options.setOutput(value, 1);
    options.setReduceFunction(fn);
    options.setTag(kTag);
    gloo::allreduce(options);
  }

  void Barrier() {
    gloo::BarrierOptions options(context_);
    options.setTag(kTag);
    gloo::barrier(options);
  }

  void PrintHeader() {
    if (rank_ != 0) return;
    const std::string build = GLOO_PERF_BUILD_TYPE;
    std::printf("# gloo_perf  Gloo %d.%d.%d (headers' version)  bench build %s\n",
                GLOO_VERSION_MAJOR, GLOO_VERSION_MINOR, GLOO_VERSION_PATCH, build.c_str());
    if (build != "Release") {
      const char* warning = "# !!! WARNING: not a Release build: timings are NOT representative.\n";
      std::printf("%s", warning);
      std::fprintf(stderr, "%s", warning);
    }
    std::printf(
        "# world size %d  launched by %s\n", world_size_,
        config_.local > 0
            ? ("--local " + std::to_string(config_.local) + " (processes on one host)").c_str()
            : "environment (RANK / WORLD_SIZE, --store)");
    std::printf(
        "# implementation gloo  transport Gloo TCP (%s)  all_reduce algorithm %s  "
        "rendezvous FileStore\n",
        config_.hostname.c_str(), config_.algorithm.c_str());
    std::printf(
        "# dtype f32  op sum  iterations %d x %d rounds (%s)  warm-up %d  check %s  buffers "
        "out-of-place  timeout %.0f s\n",
        config_.iters, config_.repeat, config_.stat.c_str(), config_.warmup_iters,
        config_.check ? "on" : "off", config_.timeout_s);
    std::printf(
        "# busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather), x 1 (broadcast)\n");
    std::fflush(stdout);
  }

  void PrintTableHeader(Collective collective) {
    if (rank_ != 0) return;
    std::printf(
        "#\n# %s (gloo)\n"
        "#          size         count   type  redop   root       time     algbw     busbw   "
        "#wrong\n"
        "#           (B)    (elements)                            (us)    (GB/s)    (GB/s)\n",
        ToString(collective));
    std::fflush(stdout);
  }

  std::string OpOf(const Row& row) const {
    return row.collective == Collective::kAllReduce ? "sum" : "";
  }
  std::string RootOf(const Row& row) const {
    return row.collective == Collective::kBroadcast ? std::to_string(config_.root) : "";
  }

  void PrintRow(const Row& row) {
    if (rank_ != 0) return;
    const std::string op = OpOf(row).empty() ? "-" : OpOf(row);
    const std::string root = RootOf(row).empty() ? "-" : RootOf(row);
    std::string line =
        Format("%15zu %13zu %6s %6s %6s", row.bytes, row.count, "f32", op.c_str(), root.c_str());
    if (row.skipped) {
      line += Format(" %10s %9s %9s %8s", "skipped", "-", "-", "-");
    } else {
      line += Format(" %10.2f %9.3f %9.3f", row.time_us, row.algbw, row.busbw);
      line +=
          row.wrong ? Format(" %8lld", static_cast<long long>(*row.wrong)) : Format(" %8s", "n/a");
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }

  void WriteCsvRow(const Row& row) {
    if (csv_ == nullptr || rank_ != 0) return;
    *csv_ << ToString(row.collective) << ',' << world_size_ << ',' << row.bytes << ',' << row.count
          << ",f32," << OpOf(row) << ',' << RootOf(row) << ',';
    if (row.skipped) {
      *csv_ << ",,,";
    } else {
      *csv_ << Format("%.3f,%.6f,%.6f,", row.time_us, row.algbw, row.busbw);
      if (row.wrong) *csv_ << *row.wrong;
    }
    *csv_ << ",gloo\n";
    csv_->flush();
  }

  const Config& config_;
  std::shared_ptr<gloo::Context> context_;
  const int rank_;
  const int world_size_;
  std::ofstream* csv_;
  FloatBuffer send_;
  FloatBuffer recv_;
};

// Connects this rank to the others (TCP device on config.hostname, FileStore rendezvous in
// store_dir) and runs the sweep. Returns the exit code.
int RunRank(const Config& config, int rank, int world_size, const std::string& store_dir) {
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = config.hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    gloo::rendezvous::FileStore store(store_dir);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, world_size);
    context->setTimeout(config.timeout());
    context->connectFullMesh(store, device);

    if (config.root >= world_size) {
      throw std::runtime_error("--root " + std::to_string(config.root) +
                               " is not a rank (world size " + std::to_string(world_size) + ")");
    }
    std::unique_ptr<std::ofstream> csv;
    if (!config.csv_path.empty() && rank == 0) csv = OpenCsv(config.csv_path);
    Sweep sweep(config, context, csv.get());
    return sweep.Run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_perf: rank %d: error: %s\n", rank, e.what());
    return kExitError;
  }
}

// ---------------------------------------------------------------------------------------------
// The --local launcher.
// ---------------------------------------------------------------------------------------------

int ExitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return kExitError;
}

// Forks `world_size` ranks (this process has no threads yet, so fork is safe) that rendezvous
// in a fresh temporary folder, and waits for them. When a rank fails, the others get two
// seconds to finish, then SIGTERM, then two more seconds, then SIGKILL. Returns the first
// non-zero exit code. SIGINT, SIGTERM and SIGHUP are blocked from before the folder exists and
// taken in the wait loop: the ranks get SIGTERM at once (SIGKILL two seconds later), and once
// they are gone and the folder is removed, this process ends by the signal it received.
int RunLocal(const Config& config) {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction action {};
    sigaction(sig, nullptr, &action);
    // One this process was started ignoring (a background job's SIGINT) stays ignored: Linux
    // would queue it while it is blocked.
    if (action.sa_handler != SIG_IGN) sigaddset(&stop_signals, sig);
  }
  sigset_t old_mask;
  sigprocmask(SIG_BLOCK, &stop_signals, &old_mask);
  std::string dir_template = (std::filesystem::temp_directory_path() / "gloo_perf.XXXXXX").string();
  if (mkdtemp(dir_template.data()) == nullptr) {
    std::fprintf(stderr, "gloo_perf: mkdtemp: %s\n", std::strerror(errno));
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    return kExitError;
  }
  const std::string store_dir = dir_template;

  std::vector<pid_t> pids;
  const pid_t launcher = getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  for (int rank = 0; rank < config.local; ++rank) {
    const pid_t pid = fork();
    if (pid < 0) {
      std::fprintf(stderr, "gloo_perf: fork: %s\n", std::strerror(errno));
      for (pid_t started : pids) kill(started, SIGKILL);
      break;
    }
    if (pid == 0) {
      sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // die with the launcher rather than linger
      if (getppid() != launcher) _exit(kExitError);
      const int rc = RunRank(config, rank, config.local, store_dir);
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(rc);
    }
    pids.push_back(pid);
  }

  int result = static_cast<int>(pids.size()) == config.local ? kExitOk : kExitError;
  size_t alive = pids.size();
  std::optional<Clock::time_point> terminate_at;
  std::optional<Clock::time_point> kill_at;
  int stop_signal = 0;
  while (alive > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) break;
    if (pid > 0) {
      const auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) continue;
      *it = -1;
      --alive;
      const int code = ExitCodeOf(status);
      if (code != kExitOk && code != kExitWrong && !terminate_at && stop_signal == 0) {
        std::fprintf(stderr, "gloo_perf: rank %d exited with code %d\n",
                     static_cast<int>(it - pids.begin()), code);
        terminate_at = Clock::now() + std::chrono::seconds(2);
      }
      if (result == kExitOk && code != kExitOk) result = code;
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (terminate_at && !kill_at && now >= *terminate_at) {
      for (pid_t p : pids) {
        if (p > 0) kill(p, SIGTERM);
      }
      kill_at = now + std::chrono::seconds(2);
    } else if (kill_at && now >= *kill_at) {
      for (pid_t p : pids) {
        if (p > 0) kill(p, SIGKILL);
      }
      kill_at = now + std::chrono::hours(1);
    }
    timespec poll_interval{0, 20'000'000};
    const int sig = sigtimedwait(&stop_signals, nullptr, &poll_interval);
    if (sig > 0 && stop_signal == 0) {
      stop_signal = sig;
      std::fprintf(stderr, "gloo_perf: %s: stopping the ranks\n", strsignal(sig));
      for (pid_t p : pids) {
        if (p > 0) kill(p, SIGTERM);
      }
      terminate_at = Clock::now();
      kill_at = *terminate_at + std::chrono::seconds(2);
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(store_dir, ignored);
  if (stop_signal != 0) {
    signal(stop_signal, SIG_DFL);
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    raise(stop_signal);
  }
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  return result;
}

// `text` as a number of at most 1 << 20 written in digits only, else -1.
int ParseEnvironmentCount(const char* text) {
  const std::string value = text;
  if (value.empty() || value.size() > 7 ||
      !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  const int number = std::stoi(value);
  return number <= (1 << 20) ? number : -1;
}

int Main(int argc, char** argv) {
  Config config;
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  std::string step_bytes = "0";
  std::string collectives = "all_reduce";
  CLI::App app{
      "gloo_perf: Gloo baseline of collectives_perf (all-reduce, broadcast, all-gather"
      " over Gloo's TCP transport)"};
  app.add_option("-b,--minbytes", min_bytes, "Smallest size: bytes of the full result buffer")
      ->capture_default_str();
  app.add_option("-e,--maxbytes", max_bytes, "Largest size")->capture_default_str();
  app.add_option("-f,--stepfactor", config.step_factor, "Multiply the size by this factor")
      ->capture_default_str()
      ->check(CLI::Range(size_t{2}, size_t{1} << 20));
  app.add_option("-i,--stepbytes", step_bytes,
                 "Add this many bytes per step instead of multiplying by -f");
  app.add_option("-c,--collective", collectives,
                 "all_reduce, broadcast, all_gather, a comma-separated list, or all")
      ->capture_default_str();
  app.add_option("-n,--iters", config.iters, "Timed iterations per size")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("-w,--warmup_iters", config.warmup_iters, "Warm-up iterations per size")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  app.add_option("-r,--repeat", config.repeat,
                 "Rounds of -n timed calls per size; the median round is reported (--stat)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--stat", config.stat,
                 "What a row reports of its rounds: median or min (the fastest round)")
      ->capture_default_str()
      ->check(CLI::IsMember({"median", "min"}));
  app.add_flag("--check", config.check, "Verify one extra call per size on every rank");
  app.add_option("--csv", config.csv_path, "Rank 0 writes the rows to this CSV file");
  app.add_option("--root", config.root, "Root rank of broadcast")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--algorithm", config.algorithm, "Gloo all-reduce algorithm")
      ->capture_default_str()
      ->check(CLI::IsMember({"ring", "bcube"}));
  app.add_option("--timeout", config.timeout_s, "Seconds a collective or the rendezvous may take")
      ->capture_default_str()
      ->check(bench::TimeoutSeconds());
  app.add_option("--local", config.local, "Fork this many ranks on loopback and wait for them")
      ->check(CLI::Range(1, 1024));
  app.add_option("--store", config.store_dir,
                 "Without --local (refused with it): the FileStore folder every rank shares");
  app.add_option("--hostname", config.hostname, "Address of this rank's Gloo TCP device")
      ->capture_default_str();
  app.footer(
      "Launching N ranks (Gloo's own rendezvous, not the library's):\n"
      "  gloo_perf --local N ...   (N processes on this host)\n"
      "  RANK=r WORLD_SIZE=N gloo_perf --store DIR [--hostname ADDR] ...   (each rank r; DIR a "
      "folder every rank shares)\n"
      "Environment: RANK, WORLD_SIZE (without --local); no COLLECTIVES_* variable.");
  try {
    app.parse(argc, argv);
    config.min_bytes = ParseBytes(min_bytes);
    config.max_bytes = ParseBytes(max_bytes);
    config.step_bytes = ParseBytes(step_bytes);
    config.collectives = ParseCollectives(collectives);
    if (config.min_bytes == 0) throw CLI::ValidationError("-b must be at least 1 byte");
    if (config.min_bytes > config.max_bytes) throw CLI::ValidationError("-b is larger than -e");
    if (config.local == 0 && config.store_dir.empty()) {
      throw CLI::ValidationError("pass --local N, or RANK / WORLD_SIZE and --store DIR");
    }
    // The ranks of --local meet in a temporary folder of their own: a --store beside it is
    // refused rather than ignored.
    if (config.local > 0 && !config.store_dir.empty()) {
      throw CLI::ValidationError("--store " + config.store_dir + " and --local " +
                                 std::to_string(config.local) +
                                 ": --local ranks meet in a temporary folder of their own; "
                                 "pass --store only without --local");
    }
    // Gloo's FileStore says only "realpath: No such file or directory", naming neither.
    std::error_code error;
    if (config.local == 0 && !std::filesystem::is_directory(config.store_dir, error)) {
      throw CLI::ValidationError("--store " + config.store_dir +
                                 ": not a folder (create it; every rank must share it)");
    }
  } catch (const CLI::ParseError& e) {
    // --help is 0; a bad command line is an error (1), not CLI11's own code (104 to 114).
    return app.exit(e) == 0 ? kExitOk : kExitError;
  }

  if (config.local > 0) return RunLocal(config);
  const char* rank = std::getenv("RANK");
  const char* world_size = std::getenv("WORLD_SIZE");
  if (rank == nullptr || world_size == nullptr) {
    std::fprintf(stderr, "gloo_perf: without --local, RANK and WORLD_SIZE must be set\n");
    return kExitError;
  }
  // Digits only, rank < world size: atoi would read "abc" as rank 0, which would wait for the
  // other ranks until --timeout.
  const int rank_number = ParseEnvironmentCount(rank);
  const int world_number = ParseEnvironmentCount(world_size);
  if (rank_number < 0 || world_number < 1 || rank_number >= world_number) {
    std::fprintf(stderr,
                 "gloo_perf: RANK='%s' WORLD_SIZE='%s' is not a rank of a world (digits only, "
                 "0 <= RANK < WORLD_SIZE <= 1048576)\n",
                 rank, world_size);
    return kExitError;
  }
  return RunRank(config, rank_number, world_number, config.store_dir);
}

}  // namespace
}  // namespace collectives::gloo_perf

int main(int argc, char** argv) { return collectives::gloo_perf::Main(argc, argv); }
