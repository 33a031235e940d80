// packing_perf: what the packer buys. For each workload (a list of f32 tensors, as a model's
// gradients), one "step" all-reduces every tensor of the list once, in three ways:
//
//   one-by-one  comm.AllReduce per tensor, blocking (what a naive trainer does);
//   async       comm.AllReduceAsync per tensor, all issued, then all waited on (the calls are
//               queued back to back, but each is still one collective with its own latency);
//   packed      packing::AllReduce with each --bytes-per-pack cap (fusion buckets).
//
// With --compute-ms X, what the packer's asynchronous form buys a trainer, which issues the
// gradients' reduction and computes while it runs: a step is then X ms of computation on the
// calling thread (a busy loop calibrated at start-up to take X ms on an otherwise idle core, the
// same number of iterations on every rank), and per cap four more modes run:
//
//   compute       the computation alone (once per workload, not per cap);
//   packed-async  packing::AllReduceAsync, then Wait at once (the async form's own cost);
//   sequential    packing::AllReduce, then the computation (no overlap);
//   overlapped    packing::AllReduceAsync, the computation, then Wait.
//
// hidden = (sequential - overlapped) / (sequential - compute): the share of the communication's
// time in a sequential step that overlapping took off the step (1: all of it, the step costs only
// its computation; 0: none; below 0: overlapping made the step slower). The progress thread that
// runs the collectives needs a core of its own to overlap anything: with as many ranks as cores,
// the computation and the progress thread of a rank share one.
//
// Per workload: three rounds; in each, every mode runs -w warm-up steps then a third of its -n
// timed steps, each after a barrier (rounds spread whatever else the host does over every
// mode; warm-ups absorb the slow first steps after a change of mode). A step's time is that of
// its slowest rank; time = the median over steps (--mean: the mean); speed-up = one-by-one time
// / this time.
// Every timed step starts from the same inputs, restored (outside the timed region) before it:
// the steps reduce in place, and a sum of the previous step's results doubled every element per
// step with 2 ranks, so that f32 sums reached infinity after ~130 steps and the steps timed
// arithmetic on infinities. The inputs are kept twice for this.
// With --check, every packed cap is run once more on inputs with an exact answer and every
// element of every tensor is verified on every rank (#wrong, summed over ranks); with
// --compute-ms, the overlapped mode of every cap too; and what the last timed step (of the last
// mode) left, on a line of its own. Only the public API is used.
//
// Workloads (--workload, a comma list):
//   NxS       N tensors of S bytes each (1000x4K, 200x256K, ...: K, M, G suffixes);
//   resnet50  the 161 trainable tensors of ResNet-50 (25,557,032 parameters, 102 MB in f32).
//
// --device cuda: the tensors are on this rank's CUDA device (rank % visible devices), views into
// one device allocation as a caching allocator hands them out, and RING and AUTO stage them
// through pinned host memory (docs/gpu.md); their inputs are restored and checked through a host
// copy, outside the timed region. Needs a build with CUDA (-DCOLLECTIVES_WITH_NCCL=ON).
//
// How the ranks start: --local N, mpirun, or the environment, as for collectives_perf (see
// bench/local_launcher.h). Exit status: 0 success (--help too), 1 error (a bad command line
// too), 2 --check found wrong elements.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/launch_help.h"
#include "bench/local_launcher.h"
#include "bench/perf_device.h"
#include "collectives/collectives.h"
#include "collectives/packing.h"

#ifdef COLLECTIVES_WITH_MPI
#include <mpi.h>
#endif

#ifndef COLLECTIVES_PERF_BUILD_TYPE
#define COLLECTIVES_PERF_BUILD_TYPE "unknown"
#endif

namespace collectives::perf {
namespace {

using bench::CountHosts;
using bench::OpenCsv;
using bench::ParseBytes;
using bench::PrintBuildHeader;
using bench::PrintWrongSummary;
using bench::SplitList;
using Clock = std::chrono::steady_clock;

// Element counts of ResNet-50's trainable tensors, in the order the model defines them
// (torchvision.models.resnet50, after He et al., "Deep Residual Learning for Image
// Recognition", 2015, table 1): convolutions have no bias; every batch norm has a gamma and a
// beta; a bottleneck is 1x1 (in -> w), 3x3 (w -> w), 1x1 (w -> 4w), and the first block of
// each stage adds a 1x1 downsample convolution (in -> 4w) with its batch norm. A trainer's
// backward pass produces them in reverse order; the sizes, which is what packing sees, are the
// same. 161 tensors, 25,557,032 elements (checked at start-up).
// One line per block reads better than one number per line.
// clang-format off
// The most tensors and bytes a workload may list (NxSIZE past these is a typo, not a benchmark).
constexpr size_t kMaxWorkloadTensors = 10'000'000;
constexpr size_t kMaxWorkloadBytes = size_t{1} << 40;

constexpr size_t kResNet50Counts[] = {
    // stem: conv1 64x3x7x7, bn1
    9408, 64, 64,
    // stage 1: 3 bottlenecks of width 64, output 256; block 1 takes 64 channels
    4096, 64, 64, 36864, 64, 64, 16384, 256, 256, 16384, 256, 256,
    16384, 64, 64, 36864, 64, 64, 16384, 256, 256,
    16384, 64, 64, 36864, 64, 64, 16384, 256, 256,
    // stage 2: 4 bottlenecks of width 128, output 512; block 1 takes 256 channels
    32768, 128, 128, 147456, 128, 128, 65536, 512, 512, 131072, 512, 512,
    65536, 128, 128, 147456, 128, 128, 65536, 512, 512,
    65536, 128, 128, 147456, 128, 128, 65536, 512, 512,
    65536, 128, 128, 147456, 128, 128, 65536, 512, 512,
    // stage 3: 6 bottlenecks of width 256, output 1024; block 1 takes 512 channels
    131072, 256, 256, 589824, 256, 256, 262144, 1024, 1024, 524288, 1024, 1024,
    262144, 256, 256, 589824, 256, 256, 262144, 1024, 1024,
    262144, 256, 256, 589824, 256, 256, 262144, 1024, 1024,
    262144, 256, 256, 589824, 256, 256, 262144, 1024, 1024,
    262144, 256, 256, 589824, 256, 256, 262144, 1024, 1024,
    262144, 256, 256, 589824, 256, 256, 262144, 1024, 1024,
    // stage 4: 3 bottlenecks of width 512, output 2048; block 1 takes 1024 channels
    524288, 512, 512, 2359296, 512, 512, 1048576, 2048, 2048, 2097152, 2048, 2048,
    1048576, 512, 512, 2359296, 512, 512, 1048576, 2048, 2048,
    1048576, 512, 512, 2359296, 512, 512, 1048576, 2048, 2048,
    // fc: 2048x1000 weight, 1000 bias
    2048000, 1000,
};
// clang-format on
static_assert(std::size(kResNet50Counts) == 161);

// ---------------------------------------------------------------------------------------------
// Command line.
// ---------------------------------------------------------------------------------------------

struct Workload {
  std::string name;
  std::vector<size_t> counts;  // f32 elements per tensor
};

struct Config : bench::CommunicationFlags {
  std::vector<Workload> workloads;
  std::vector<size_t> caps;  // bytes_per_pack values; 0 = the library default
  double compute_ms = 0;     // > 0: the overlap modes, with this much computation per step
  ReduceOp op = ReduceOp::kSum;
  int iters = 20;
  int warmup_iters = 3;
  bool check = false;
  bool mean = false;
  std::string csv_path;
  int local = 0;
  std::string impl = "ring";
  std::string device = "cpu";  // or cuda
};

Workload ParseWorkload(const std::string& name) {
  Workload workload{name, {}};
  if (name == "resnet50") {
    workload.counts.assign(std::begin(kResNet50Counts), std::end(kResNet50Counts));
    return workload;
  }
  const size_t x = name.find('x');
  if (x == std::string::npos || x == 0) {
    throw CLI::ValidationError("workload '" + name + "': expected NxSIZE (1000x4K) or resnet50");
  }
  size_t tensors = 0;
  try {
    size_t pos = 0;
    if (!std::isdigit(static_cast<unsigned char>(name[0]))) throw std::invalid_argument(name);
    tensors = std::stoul(name.substr(0, x), &pos);
    if (pos != x) throw std::invalid_argument(name);
  } catch (const std::exception&) {
    throw CLI::ValidationError("workload '" + name + "': '" + name.substr(0, x) +
                               "' is not a number of tensors");
  }
  const size_t bytes = ParseBytes(name.substr(x + 1));
  if (tensors == 0 || bytes < sizeof(float) || bytes % sizeof(float) != 0) {
    throw CLI::ValidationError("workload '" + name +
                               "': needs at least one tensor of a whole number of f32 elements");
  }
  if (tensors > kMaxWorkloadTensors || tensors > kMaxWorkloadBytes / bytes) {
    throw CLI::ValidationError("workload '" + name + "': more than " +
                               std::to_string(kMaxWorkloadTensors) + " tensors or " +
                               std::to_string(kMaxWorkloadBytes >> 30) + " GiB in all");
  }
  workload.counts.assign(tensors, bytes / sizeof(float));
  return workload;
}

std::string FormatBytes(size_t bytes) {
  if (bytes == 0) return "default";
  const char* units[] = {"", "K", "M", "G"};
  int unit = 0;
  while (unit < 3 && bytes % 1024 == 0 && bytes >= 1024) {
    bytes /= 1024;
    ++unit;
  }
  return std::to_string(bytes) + units[unit];
}

// ---------------------------------------------------------------------------------------------
// Check data: small integers with an exact result for every op and world size (f32 holds every
// partial sum and product exactly); the average allows for the division's rounding.
// ---------------------------------------------------------------------------------------------

float CheckInput(ReduceOp op, int rank, size_t tensor, size_t i) {
  const size_t r = static_cast<size_t>(rank);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      // A hash, not a linear pattern: (3 r + 7 tensor + 13 i) mod 5 summed to the same value at
      // every element for any multiple of 5 ranks, so a misplaced result passed the check.
      return static_cast<float>(bench::MixRankAndIndex(rank, tensor * 1'000'003 + i) % 5);
    case ReduceOp::kProd:
      return (r + tensor + i) % 3 == 0 ? 2.0f : ((r * 5 + i) % 7 == 0 ? -1.0f : 1.0f);
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      return static_cast<float>((r * 31 + tensor * 7 + i * 17) % 11) - 5.0f;
  }
  return 0;
}

double CheckExpected(ReduceOp op, int world_size, size_t tensor, size_t i) {
  double acc = CheckInput(op, 0, tensor, i);
  for (int r = 1; r < world_size; ++r) {
    const double v = CheckInput(op, r, tensor, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += v;
        break;
      case ReduceOp::kProd:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  return op == ReduceOp::kAvg ? acc / world_size : acc;
}

// ---------------------------------------------------------------------------------------------
// The computation of a step (--compute-ms): `units` blocks of a dependent xorshift chain, which
// keeps a core busy without touching memory (it competes with the collectives for a core, not
// for memory bandwidth) and cannot be shortened by the compiler. A unit is 1024 steps of the
// chain; what it takes in time is measured on each rank (CalibrateUnitsPerMs).
// ---------------------------------------------------------------------------------------------

volatile uint64_t compute_sink;

void Compute(uint64_t units) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t u = 0; u < units; ++u) {
    for (int i = 0; i < 1024; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
    }
  }
  compute_sink = x;
}

// Units of Compute per millisecond on this rank: the fastest of five runs of ~20 ms (the least
// disturbed by whatever else the host does).
double CalibrateUnitsPerMs() {
  double best = 0;
  uint64_t units = 1000;
  for (int run = 0; run < 5; ++run) {
    const Clock::time_point start = Clock::now();
    Compute(units);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    best = std::max(best, static_cast<double>(units) / std::max(ms, 1e-3));
    units = static_cast<uint64_t>(std::max(best * 20, 1.0));  // the next runs take ~20 ms
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// The benchmark.
// ---------------------------------------------------------------------------------------------

struct Row {
  std::string workload;
  size_t tensors = 0;
  size_t bytes = 0;
  std::string mode;  // one-by-one, async, packed; compute, packed-async, sequential, overlapped
  std::optional<size_t> cap;
  size_t buckets = 0;
  double time_ms = 0;
  std::optional<double> speedup;  // one-by-one time / this time; none for rows that compute
  std::optional<double> hidden;   // overlapped rows (see the file comment)
  std::optional<int64_t> wrong;
};

class Bench {
 public:
  Bench(const Config& config, CollectiveCommunication& comm, std::string launcher,
        std::ofstream* csv)
      : config_(config),
        comm_(comm),
        rank_(comm.rank()),
        world_size_(comm.size()),
        launcher_(std::move(launcher)),
        csv_(csv) {}

  int Run() {
    if (config_.compute_ms > 0) CalibrateCompute();
    PrintHeader();
    int64_t total_wrong = 0;
    for (const Workload& workload : config_.workloads) {
      // The tensors: separate allocations, as a model's gradients are. With --device cuda,
      // `storage` is one host allocation whose views `host` the device's copy mirrors, and
      // `tensors` are the device views.
      std::vector<std::vector<float>> storage;
      std::vector<Tensor> tensors;
      std::vector<Tensor> host;  // where CountWrong reads the results
      std::vector<packing::TensorSpec> specs;
      size_t bytes = 0;
      for (size_t count : workload.counts) bytes += count * sizeof(float);
      const bool on_device = config_.device == "cuda";
      std::unique_ptr<DeviceMirror> mirror;
      // What cannot be allocated names the workload and its size, not a bare std::bad_alloc.
      auto out_of_memory = [&] {
        return std::runtime_error(bench::Format(
            "workload '%s': cannot allocate its tensors and a copy of their inputs, twice %zu "
            "bytes (%.1f GiB): out of memory",
            workload.name.c_str(), bytes, static_cast<double>(bytes) / (1 << 30)));
      };
      try {
        if (on_device) {
          storage.emplace_back(bytes / sizeof(float));
          size_t at = 0;
          for (size_t count : workload.counts) {
            host.push_back(Tensor{storage.back().data() + at, count, DataType::kFloat32});
            at += count;
          }
          mirror = std::make_unique<DeviceMirror>(rank_, storage.back().data(), bytes,
                                                  &mirror_spare_, sizeof mirror_spare_);
          for (const Tensor& t : host) tensors.push_back(mirror->OnDevice(t));
        } else {
          storage.reserve(workload.counts.size());
          for (size_t count : workload.counts) {
            storage.emplace_back(count);
            tensors.push_back(Tensor{storage.back().data(), count, DataType::kFloat32});
          }
          host = tensors;
        }
        for (const Tensor& t : tensors) {
          specs.push_back(packing::TensorSpec{DataType::kFloat32, t.device, t.count});
        }
      } catch (const std::bad_alloc&) {
        throw out_of_memory();
      }
      // The host side to the device (--device cuda), and back.
      const Tensor whole{storage.empty() ? nullptr : storage.front().data(),
                         on_device ? bytes / sizeof(float) : 0, DataType::kFloat32};
      auto upload = [&] {
        if (mirror) mirror->Upload(whole);
      };
      auto download = [&] {
        if (mirror) mirror->Download(whole);
      };
      auto fill = [&] {
        for (size_t t = 0; t < host.size(); ++t) {
          auto* data = static_cast<float*>(host[t].data);
          for (size_t i = 0; i < host[t].count; ++i) data[i] = CheckInput(config_.op, rank_, t, i);
        }
        upload();
      };
      fill();  // also what the timed steps reduce: no denormals, no NaNs
      const std::vector<std::vector<float>> inputs = [&] {
        try {
          return storage;
        } catch (const std::bad_alloc&) {
          throw out_of_memory();
        }
      }();
      auto restore = [&] {
        for (size_t t = 0; t < storage.size(); ++t) {
          std::copy(inputs[t].begin(), inputs[t].end(), storage[t].begin());
        }
        upload();
      };
      Row base;
      base.workload = workload.name;
      base.tensors = tensors.size();
      base.bytes = bytes;

      // The modes, timed together (see TimeSteps).
      std::vector<Row> rows;
      std::vector<std::function<void()>> steps;
      Row one = base;
      one.mode = "one-by-one";
      one.buckets = tensors.size();
      rows.push_back(one);
      steps.push_back([&] {
        for (const Tensor& t : tensors) comm_.AllReduce(t, config_.op);
      });
      Row async = base;
      async.mode = "async";
      async.buckets = tensors.size();
      rows.push_back(async);
      steps.push_back([&] {
        std::vector<std::shared_ptr<Work>> works;
        works.reserve(tensors.size());
        for (const Tensor& t : tensors) works.push_back(comm_.AllReduceAsync(t, t, config_.op));
        for (const std::shared_ptr<Work>& w : works) w->Wait();
      });
      for (size_t cap : config_.caps) {
        Row packed = base;
        packed.mode = "packed";
        packed.cap = cap;
        packed.buckets = packing::PlanBuckets(specs, cap).size();
        rows.push_back(packed);
        steps.push_back([&, cap] { packing::AllReduce(comm_, tensors, config_.op, cap); });
      }
      const size_t timed_modes = rows.size();  // those with a speed-up
      if (config_.compute_ms > 0) {
        Row compute = base;
        compute.mode = "compute";
        rows.push_back(compute);
        steps.push_back([&] { Compute(compute_units_); });
        for (size_t cap : config_.caps) {
          Row packed = base;
          packed.cap = cap;
          packed.buckets = packing::PlanBuckets(specs, cap).size();
          packed.mode = "packed-async";
          rows.push_back(packed);
          steps.push_back(
              [&, cap] { packing::AllReduceAsync(comm_, tensors, config_.op, cap)->Wait(); });
          packed.mode = "sequential";
          rows.push_back(packed);
          steps.push_back([&, cap] {
            packing::AllReduce(comm_, tensors, config_.op, cap);
            Compute(compute_units_);
          });
          packed.mode = "overlapped";
          rows.push_back(packed);
          steps.push_back([&, cap] {
            const std::shared_ptr<Work> work =
                packing::AllReduceAsync(comm_, tensors, config_.op, cap);
            Compute(compute_units_);
            work->Wait();
          });
        }
      }
      const std::vector<double> times = TimeSteps(steps, restore);
      // The last timed step (the last mode's, a packed or overlapped all-reduce of every tensor)
      // left one all-reduce of the inputs.
      int64_t last_step_wrong = 0;
      if (config_.check) {
        download();
        last_step_wrong = CountWrong(workload, host);
        comm_.AllReduce(Tensor{&last_step_wrong, 1, DataType::kInt64}, ReduceOp::kSum);
        total_wrong += last_step_wrong;
      }
      for (size_t m = 0; m < rows.size(); ++m) {
        Row& row = rows[m];
        row.time_ms = times[m];
        if (m < timed_modes) row.speedup = rows[0].time_ms / row.time_ms;
        if (row.mode == "overlapped") {
          // rows[m - 1] is this cap's sequential mode, rows[timed_modes] the computation alone.
          const double communication = rows[m - 1].time_ms - rows[timed_modes].time_ms;
          if (communication > 0) row.hidden = (rows[m - 1].time_ms - row.time_ms) / communication;
        }
        if (config_.check && row.cap && (row.mode == "packed" || row.mode == "overlapped")) {
          fill();
          if (row.mode == "packed") {
            packing::AllReduce(comm_, tensors, config_.op, *row.cap);
          } else {
            const std::shared_ptr<Work> work =
                packing::AllReduceAsync(comm_, tensors, config_.op, *row.cap);
            Compute(compute_units_);
            work->Wait();
          }
          download();
          int64_t wrong = CountWrong(workload, host);
          comm_.AllReduce(Tensor{&wrong, 1, DataType::kInt64}, ReduceOp::kSum);
          row.wrong = wrong;
          total_wrong += wrong;
        }
        Emit(row);
      }
      if (config_.check && rank_ == 0) {
        std::printf("  # %s: last timed step (%s, %s): %lld wrong elements\n",
                    workload.name.c_str(), rows.back().mode.c_str(),
                    FormatBytes(*rows.back().cap).c_str(), static_cast<long long>(last_step_wrong));
        std::fflush(stdout);
      }
    }
    if (rank_ == 0) {
      PrintWrongSummary(config_.check, total_wrong);
      std::fflush(stdout);
    }
    return total_wrong == 0 ? kExitOk : kExitWrong;
  }

 private:
  // --compute-ms: every rank calibrates (at the same time) and every rank then runs the mean of
  // the ranks' units: the same work everywhere, --compute-ms of a core that nothing else wants.
  // With more busy threads than cores it takes longer; the compute mode says how long.
  void CalibrateCompute() {
    comm_.Barrier();
    double units_per_ms = CalibrateUnitsPerMs();
    comm_.AllReduce(Tensor{&units_per_ms, 1, DataType::kFloat64}, ReduceOp::kSum);
    units_per_ms /= world_size_;
    compute_units_ =
        static_cast<uint64_t>(std::max(std::llround(units_per_ms * config_.compute_ms), 1LL));
  }

  // Milliseconds per step of each of `steps`, timed in kRounds rounds; in each round every mode
  // runs -w warm-up steps and then its share of the -n timed steps, each after `restore` (not
  // timed) and a barrier (so no rank carries the skew of one step into the next). A mode's first
  // steps after another mode run slower (threads migrate, caches refill), hence the warm-up per
  // round; rounds spread what else the host does over every mode. A step's time is that of its
  // slowest rank; the result is the median over steps (or the mean, --mean).
  static constexpr size_t kRounds = 3;
  std::vector<double> TimeSteps(const std::vector<std::function<void()>>& steps,
                                const std::function<void()>& restore) {
    const size_t iters = static_cast<size_t>(config_.iters);
    std::vector<double> seconds(steps.size() * iters);  // [mode][step]
    for (size_t round = 0; round < kRounds; ++round) {
      const size_t first = iters * round / kRounds;
      const size_t last = iters * (round + 1) / kRounds;
      for (size_t m = 0; m < steps.size(); ++m) {
        if (first == last) continue;
        for (int i = 0; i < config_.warmup_iters; ++i) steps[m]();
        for (size_t i = first; i < last; ++i) {
          restore();
          comm_.Barrier();
          const Clock::time_point start = Clock::now();
          steps[m]();
          seconds[m * iters + i] = std::chrono::duration<double>(Clock::now() - start).count();
        }
      }
    }
    comm_.AllReduce(Tensor{seconds.data(), seconds.size(), DataType::kFloat64}, ReduceOp::kMax);
    std::vector<double> ms(steps.size());
    for (size_t m = 0; m < steps.size(); ++m) {
      const auto first = seconds.begin() + static_cast<std::ptrdiff_t>(m * iters);
      const auto last = first + static_cast<std::ptrdiff_t>(iters);
      if (config_.mean) {
        ms[m] = std::accumulate(first, last, 0.0) / static_cast<double>(iters) * 1e3;
      } else {
        std::sort(first, last);
        ms[m] =
            (iters % 2 == 1 ? first[iters / 2] : (first[iters / 2 - 1] + first[iters / 2]) / 2) *
            1e3;
      }
    }
    return ms;
  }

  // Wrong elements of the tensors' host views.
  int64_t CountWrong(const Workload& workload, const std::vector<Tensor>& host) {
    int64_t wrong = 0;
    for (size_t t = 0; t < host.size(); ++t) {
      for (size_t i = 0; i < host[t].count; ++i) {
        const double want = CheckExpected(config_.op, world_size_, t, i);
        const double got = static_cast<const float*>(host[t].data)[i];
        const double tolerance =
            config_.op == ReduceOp::kAvg ? 2.0 * std::abs(want) * 1.2e-7 + 1e-30 : 0.0;
        if (std::abs(got - want) > tolerance) {
          if (wrong++ < 3) {
            std::fprintf(stderr,
                         "packing_perf: rank %d: %s tensor %zu element %zu is %.9g, expected "
                         "%.9g\n",
                         rank_, workload.name.c_str(), t, i, got, want);
          }
        }
      }
    }
    return wrong;
  }

  void PrintHeader() {
    const size_t hosts = CountHosts(comm_);
    if (rank_ != 0) return;

    PrintBuildHeader("packing_perf", COLLECTIVES_PERF_BUILD_TYPE);
    std::printf("# world size %d  hosts %zu  launched by %s\n", world_size_, hosts,
                launcher_.c_str());
    // As collectives_perf says it: AUTO's calls within a host go through shared memory, and
    // only RING's (and AUTO's between hosts) take this link.
    std::printf("# implementation %s  hosts' link %s  cores %u\n", ToString(comm_.implementation()),
                hosts == 1 ? "TCP loopback (one host)" : "TCP",
                std::thread::hardware_concurrency());
    if (config_.device == "cuda") {
      std::printf("# device cuda (rank %% visible devices), staged through pinned host memory\n");
    }
    std::printf("# f32 %s  steps %d  warm-up %d  check %s  default bytes_per_pack %s\n",
                ToString(config_.op), config_.iters, config_.warmup_iters,
                config_.check ? "on" : "off",
                FormatBytes(packing::DefaultBytesPerPack(comm_)).c_str());
    std::printf(
        "# a step all-reduces every tensor once; time = %s over steps of the slowest rank's step\n"
        "# time; speed-up = one-by-one time / this time\n",
        config_.mean ? "mean" : "median");
    if (config_.compute_ms > 0) {
      std::printf(
          "# compute: %.3g ms of an idle core per step on the calling thread (%llu units of a\n"
          "# busy loop, the same on every rank)\n"
          "# hidden = (sequential - overlapped) / (sequential - compute)\n",
          config_.compute_ms, static_cast<unsigned long long>(compute_units_));
    }
    std::printf("#\n# %-10s %8s %13s %-12s %8s %8s %14s %9s %7s%s\n", "workload", "tensors",
                "bytes", "mode", "cap", "buckets", "time/step(ms)", "speed-up", "#wrong",
                config_.compute_ms > 0 ? "  hidden" : "");
    std::fflush(stdout);
    if (csv_ != nullptr) {
      *csv_ << "workload,world_size,tensors,total_bytes,mode,bytes_per_pack,buckets,time_ms,"
               "speedup,wrong,compute_ms,hidden\n";
    }
  }

  void Emit(const Row& row) {
    if (rank_ != 0) return;
    const std::string cap = row.cap ? FormatBytes(*row.cap) : "-";
    const std::string wrong = row.wrong ? std::to_string(*row.wrong) : "-";
    const std::string speedup = row.speedup ? bench::Format("%.2f", *row.speedup) : "-";
    std::string hidden;  // a column only with --compute-ms
    if (config_.compute_ms > 0)
      hidden = row.hidden ? bench::Format("%8.2f", *row.hidden) : "       -";
    std::printf("  %-10s %8zu %13zu %-12s %8s %8zu %14.3f %9s %7s%s\n", row.workload.c_str(),
                row.tensors, row.bytes, row.mode.c_str(), cap.c_str(), row.buckets, row.time_ms,
                speedup.c_str(), wrong.c_str(), hidden.c_str());
    std::fflush(stdout);
    if (csv_ != nullptr) {
      *csv_ << row.workload << ',' << world_size_ << ',' << row.tensors << ',' << row.bytes << ','
            << row.mode << ','
            << (row.cap
                    ? std::to_string(*row.cap == 0 ? packing::DefaultBytesPerPack(comm_) : *row.cap)
                    : "")
            << ',' << row.buckets << ',' << row.time_ms << ',';
      if (row.speedup) *csv_ << *row.speedup;
      *csv_ << ',' << (row.wrong ? std::to_string(*row.wrong) : "") << ',';
      if (config_.compute_ms > 0) *csv_ << config_.compute_ms;
      *csv_ << ',';
      if (row.hidden) *csv_ << *row.hidden;
      *csv_ << '\n';
      csv_->flush();
    }
  }

  const Config& config_;
  CollectiveCommunication& comm_;
  const int rank_;
  const int world_size_;
  const std::string launcher_;
  std::ofstream* csv_;
  uint64_t compute_units_ = 0;  // of Compute per step (--compute-ms)
  float mirror_spare_ = 0;      // DeviceMirror's receive side, which this bench does not use
};

// ---------------------------------------------------------------------------------------------
// main.
// ---------------------------------------------------------------------------------------------

CommunicationOptions MakeOptions(const Config& config) {
  CommunicationOptions options;
  options.implementation = ParseImplementation(config.impl);
  config.ApplyTo(options);
  return options;
}

int Main(int argc, char** argv) {
  const bool local_child = IsLocalChild();
  const bool under_mpi_launcher = UnderMpiLauncher();
  bench::MpiStartup mpi(under_mpi_launcher && !local_child, &argc, &argv);
  const bool mpi_initialized = mpi.initialized();
  auto finalize = [&] { mpi.Finalize(); };
  const int env_rank = RankFromEnvironment();

  Config config;
  std::string workloads = "1000x4K,200x256K,resnet50";
  std::string caps = "1M,4M,16M,64M";
  std::string op = "sum";
  CLI::App app{"packing_perf: many tensors all-reduced one by one vs through the packer"};
  app.add_option("--workload", workloads,
                 "Comma list of NxSIZE (N f32 tensors of SIZE bytes: 1000x4K) or resnet50")
      ->capture_default_str();
  app.add_option("--bytes-per-pack", caps,
                 "Comma list of bucket caps for packing::AllReduce (0: the library default)")
      ->capture_default_str();
  app.add_option("-o,--op", op, "sum prod min max avg")->capture_default_str();
  app.add_option("-n,--iters", config.iters, "Timed steps per mode")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("-w,--warmup_iters", config.warmup_iters, "Warm-up steps per mode")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_flag("--check", config.check,
               "Verify every packed cap on exact inputs on every rank; exit 2 on a wrong element");
  app.add_option("--compute-ms", config.compute_ms,
                 "Also time a step of this many ms of computation on the calling thread, alone, "
                 "after a packed all-reduce and overlapped with an async one (0: not)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 60'000.0));
  app.add_flag("--mean", config.mean,
               "Report the mean step time of the slowest rank instead of the median");
  app.add_option("--csv", config.csv_path, "Rank 0 writes the rows to this CSV file");
  bench::AddCommunicationFlags(app, config);
  app.add_option("--impl", config.impl,
                 "Implementation: ring (TCP) or auto (shared memory between the ranks of a host)")
      ->capture_default_str()
      ->check(CLI::IsMember({"ring", "auto"}));
  app.add_option("--local", config.local,
                 "Start this many ranks as processes on loopback and wait for them")
      ->check(CLI::Range(1, 4096));
  app.add_option("--device", config.device,
                 "Where the tensors are: cpu, or cuda (device rank % visible devices; RING and "
                 "AUTO stage them through pinned host memory)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.footer(bench::LaunchHelp("packing_perf",
                               "  packing_perf --local N ...   (N processes on this host)\n"));
  try {
    app.parse(argc, argv);
    for (const std::string& name : SplitList(workloads)) {
      config.workloads.push_back(ParseWorkload(name));
    }
    for (const std::string& cap : SplitList(caps)) config.caps.push_back(ParseBytes(cap));
    try {
      config.op = ParseReduceOp(op);
    } catch (const Error& e) {
      throw CLI::ValidationError(e.message());
    }
    // CLI::Range lets NaN through (it fails every comparison); it then ran without the overlap
    // modes, as if --compute-ms had not been given.
    if (std::isnan(config.compute_ms)) {
      throw CLI::ValidationError("--compute-ms: nan is not a number of milliseconds (0 to 60000)");
    }
    if (config.workloads.empty()) throw CLI::ValidationError("--workload: none given");
    if (config.caps.empty()) throw CLI::ValidationError("--bytes-per-pack: none given");
    if (config.device == "cuda" && !DeviceBuffersBuilt()) {
      throw CLI::ValidationError(
          "--device cuda needs a build with CUDA and NCCL (cmake -DCOLLECTIVES_WITH_NCCL=ON)");
    }
    if (config.local > 0 && under_mpi_launcher && !local_child) {
      throw CLI::ValidationError("--local starts its own ranks: do not combine it with mpirun");
    }
  } catch (const CLI::ParseError& e) {
    std::ostream quiet(nullptr);
    const int rc = env_rank == 0 ? app.exit(e) : app.exit(e, quiet, quiet);
    finalize();
    // --help is 0; a bad command line is an error (1), not CLI11's own code (104 to 114).
    return rc == 0 ? kExitOk : kExitError;
  } catch (const std::exception& e) {  // out of memory for the lists, say
    std::fprintf(stderr, "packing_perf: %s\n", e.what());
    finalize();
    return kExitError;
  }
  const size_t resnet_total =
      std::accumulate(std::begin(kResNet50Counts), std::end(kResNet50Counts), size_t{0});
  if (resnet_total != 25'557'032) {
    std::fprintf(stderr, "packing_perf: the ResNet-50 list has %zu elements\n", resnet_total);
    return kExitError;
  }

  if (config.local > 0 && !local_child) {
    return RunLocalLauncher("packing_perf", config.local, argv,
                            config.timeout() + std::chrono::seconds(10));
  }

  int rank = env_rank;
  try {
    std::unique_ptr<CollectiveCommunication> comm;
    std::string launcher;
    const CommunicationOptions options = MakeOptions(config);
    if (local_child) {
      launcher = "--local " + std::to_string(config.local) + " (processes on one host)";
      comm = ConnectLocalRank("packing_perf", config.local, options);
    } else if (mpi_initialized) {
#ifdef COLLECTIVES_WITH_MPI
      comm = ConnectMpiRank("packing_perf", options, &launcher);
#endif
    } else {
      SayWhenSingleRankByDefault("packing_perf");
      launcher = std::getenv("TF_CONFIG") != nullptr ? "TF_CONFIG"
                 : std::getenv("RANK") != nullptr
                     ? "environment (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)"
                 : std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr
                     ? "mpirun environment (OMPI_COMM_WORLD_*, MASTER_ADDR / MASTER_PORT)"
                     : "single process";
      comm = CreateCommunication(ClusterSpec::FromEnvironment(), options);
    }
    rank = comm->rank();
    std::unique_ptr<std::ofstream> csv;
    if (!config.csv_path.empty() && rank == 0) csv = OpenCsv(config.csv_path);
    int rc = kExitOk;
    {
      Bench bench(config, *comm, launcher, csv.get());
      rc = bench.Run();
    }
    comm.reset();
    finalize();
    return rc;
  } catch (const Error& e) {
    std::fprintf(stderr, "packing_perf: rank %d: error [%s]: %s\n", rank, ToString(e.code()),
                 e.message().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "packing_perf: rank %d: error: %s\n", rank, e.what());
  }
#ifdef COLLECTIVES_WITH_MPI
  if (mpi_initialized) MPI_Abort(MPI_COMM_WORLD, kExitError);
#endif
  return kExitError;
}

}  // namespace
}  // namespace collectives::perf

int main(int argc, char** argv) { return collectives::perf::Main(argc, argv); }
