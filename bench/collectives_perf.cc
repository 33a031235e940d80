// collectives_perf: an nccl-tests style sweep of the collectives over a range of message sizes.
//
// For every chosen collective, dtype, op and size it runs `-w` warm-up calls, with --check one
// more call whose result every rank verifies element by element, a barrier, and `-n` timed calls
// of the blocking collective. It prints one row per size: the time per call of the slowest rank,
// the algorithm bandwidth (bytes / time) and the bus bandwidth (nccl-tests conventions; see
// docs/benchmarks.md), and the number of wrong elements summed over ranks. Rank 0 prints and,
// with --csv, writes the same rows as CSV. Only the public API is used, with two header-only
// pieces of the library: the 16-bit float conversions (src/core/half.h) and the algorithm names
// (src/core/algorithm_names.h).
//
// How the ranks start (bench/local_launcher.h, shared with packing_perf):
//   --local N  this process starts N copies of itself on loopback and waits for them. Rank 0
//              hosts the rendezvous store on a port the kernel picks and hands it back through
//              a pipe; the launcher then starts ranks 1..N-1 with MASTER_PORT set.
//   mpirun     built with COLLECTIVES_WITH_MPI: MPI_Init, rank 0 hosts the store on a free port
//              and MPI_Bcast's it. Built without: ClusterSpec::FromEnvironment, which reads
//              OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE and needs MASTER_ADDR / MASTER_PORT.
//   otherwise  ClusterSpec::FromEnvironment: TF_CONFIG, RANK / WORLD_SIZE / MASTER_*, or one rank.
//
// Exit status: 0 success (--help too), 1 error (a bad command line too), 2 the run finished but
// --check found wrong elements.
//
// Test hook: with COLLECTIVES_BENCH_TEST_ROTATE_RESULT set, the last rank moves every element of
// each checked result one place on before it verifies it, as a result written at the wrong
// offset would be, so that a test can show that --check catches it.
//
// The files: bench/perf_options.{h,cc} the command line, bench/perf_check.{h,cc} the --check
// data, bench/perf_report.{h,cc} the tables and the CSV, bench/perf_session.h this rank's
// communicators; this file the bootstrap, the runs (timing, --check, --versus, --baseline mpi)
// and main.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "bench/launch_help.h"
#include "bench/local_launcher.h"
#include "bench/perf_check.h"
#include "bench/perf_device.h"
#include "bench/perf_options.h"
#include "bench/perf_report.h"
#include "bench/perf_session.h"
#include "collectives/collectives.h"

#ifdef COLLECTIVES_WITH_MPI
#include <mpi.h>
#endif

namespace collectives::perf {
namespace {

using bench::AlignedBuffer;
#ifdef COLLECTIVES_WITH_MPI
using bench::CheckMpi;
#endif
using bench::OpenCsv;
using bench::ParseBytes;
using bench::PrintWrongSummary;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// MPI: bootstrap and baseline.
// ---------------------------------------------------------------------------------------------

#ifdef COLLECTIVES_WITH_MPI

std::optional<MPI_Datatype> MpiDataType(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return MPI_FLOAT;
    case DataType::kFloat64:
      return MPI_DOUBLE;
    case DataType::kInt8:
      return MPI_INT8_T;
    case DataType::kUInt8:
      return MPI_UINT8_T;
    case DataType::kInt32:
      return MPI_INT32_T;
    case DataType::kInt64:
      return MPI_INT64_T;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return std::nullopt;  // no standard MPI type
  }
  return std::nullopt;
}

// MPI has no average: the baseline times the sum, which is what an average costs on the wire.
MPI_Op MpiOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return MPI_SUM;
    case ReduceOp::kProd:
      return MPI_PROD;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
  }
  return MPI_SUM;
}

// Seconds per call of the matching MPI collective on the same buffers, slowest rank; nullopt
// when MPI cannot express the call (f16/bf16, a count beyond int).
// With `in_place`, the MPI calls take MPI_IN_PLACE, on the buffers our in-place call used:
// recv for all-reduce and all-gather (the whole result), send (the whole input) for
// reduce-scatter. MPI_Bcast has one buffer either way.
std::optional<double> TimeMpiBaseline(Collective collective, DataType dtype, ReduceOp op, int root,
                                      void* send, void* recv, size_t count, size_t per_rank_count,
                                      bool in_place, int warmup_iters, int iters) {
  const std::optional<MPI_Datatype> type = MpiDataType(dtype);
  if (!type || count > static_cast<size_t>(std::numeric_limits<int>::max())) return std::nullopt;
  const int n = static_cast<int>(count);
  const int per_rank = static_cast<int>(per_rank_count);
  auto call = [&] {
    switch (collective) {
      case Collective::kAllReduce:
        CheckMpi(MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, n, *type, MpiOp(op),
                               MPI_COMM_WORLD),
                 "MPI_Allreduce");
        break;
      case Collective::kBroadcast:
        CheckMpi(MPI_Bcast(recv, n, *type, root, MPI_COMM_WORLD), "MPI_Bcast");
        break;
      case Collective::kAllGather:
        CheckMpi(MPI_Allgather(in_place ? MPI_IN_PLACE : send, per_rank, *type, recv, per_rank,
                               *type, MPI_COMM_WORLD),
                 "MPI_Allgather");
        break;
      case Collective::kReduceScatter:
        CheckMpi(in_place ? MPI_Reduce_scatter_block(MPI_IN_PLACE, send, per_rank, *type, MpiOp(op),
                                                     MPI_COMM_WORLD)
                          : MPI_Reduce_scatter_block(send, recv, per_rank, *type, MpiOp(op),
                                                     MPI_COMM_WORLD),
                 "MPI_Reduce_scatter_block");
        break;
    }
  };
  for (int i = 0; i < warmup_iters; ++i) call();
  CheckMpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < iters; ++i) call();
  const double local = std::chrono::duration<double>(Clock::now() - start).count() / iters;
  double slowest = 0;
  CheckMpi(MPI_Allreduce(&local, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD),
           "MPI_Allreduce");
  return slowest;
}

#endif  // COLLECTIVES_WITH_MPI

// ---------------------------------------------------------------------------------------------
// Bootstrap: build this rank's communicator.
// ---------------------------------------------------------------------------------------------

CommunicationOptions MakeOptions(const Config& config) {
  CommunicationOptions options;
  options.implementation = ParseImplementation(config.impl);
  options.algorithm = config.algorithm;
  config.ApplyTo(options);
  options.medium_message_bytes = config.medium_message_bytes;
  return options;
}

// The --versus communicators, built on the same job after the main one (same order everywhere),
// and with --impl nccl the RING communicator for the sweep's bookkeeping on host memory.
void ConnectVersus(const Config& config, const Job& job, Session& session) {
  session.store = job.store;
  if (config.impl == "nccl") {
    CommunicationOptions options = MakeOptions(config);
    options.implementation = Implementation::kRing;
    options.algorithm.clear();
    session.control = job.Connect(options);
  }
  for (const std::string& item : config.versus) {
    const size_t colon = item.find(':');
    CommunicationOptions options = MakeOptions(config);
    options.implementation = ParseImplementation(item.substr(0, colon));
    options.algorithm = colon == std::string::npos ? "" : item.substr(colon + 1);
    session.versus.push_back(Versus{item, job.Connect(options)});
  }
}

// A rank started by the --local launcher.
Session BootstrapLocalChild(const Config& config) {
  Session session;
  session.launcher = "--local " + std::to_string(config.local) + " (processes on one host)";
  const Job job = JoinLocalJob("collectives_perf", config.local, MakeOptions(config));
  session.comm = job.Connect(MakeOptions(config));
  ConnectVersus(config, job, session);
  return session;
}

#ifdef COLLECTIVES_WITH_MPI
// A rank started by mpirun (see ConnectMpiRank).
Session BootstrapMpi(const Config& config) {
  Session session;
  session.mpi = true;
  const Job job = JoinMpiJob("collectives_perf", MakeOptions(config), &session.launcher);
  session.comm = job.Connect(MakeOptions(config));
  ConnectVersus(config, job, session);
  return session;
}
#endif  // COLLECTIVES_WITH_MPI

// Any other launch: TF_CONFIG, torchrun-style RANK / WORLD_SIZE, or mpirun's environment.
Session BootstrapFromEnvironment(const Config& config) {
  Session session;
  if (std::getenv("TF_CONFIG") != nullptr) {
    session.launcher = "TF_CONFIG";
  } else if (std::getenv("RANK") != nullptr) {
    session.launcher = "environment (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT)";
  } else if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
    if (std::getenv("MASTER_PORT") == nullptr) {
      throw std::runtime_error(
          "launched by mpirun, but this build has no MPI bootstrap (COLLECTIVES_WITH_MPI=OFF): "
          "pass the rendezvous address, e.g. mpirun -x MASTER_ADDR=127.0.0.1 -x "
          "MASTER_PORT=29500 ...");
    }
    session.launcher = "mpirun environment (OMPI_COMM_WORLD_*, MASTER_ADDR / MASTER_PORT)";
  } else {
    session.launcher = "single process";
  }
  Job job;
  job.spec = ClusterSpec::FromEnvironment();
  job.job_token = ResolveJobToken(MakeOptions(config));
  job.store = CreateStoreFor(job.spec, config.timeout(), job.job_token);
  session.comm = job.Connect(MakeOptions(config));
  ConnectVersus(config, job, session);
  return session;
}

// ---------------------------------------------------------------------------------------------
// The sweep.
// ---------------------------------------------------------------------------------------------

class Sweep {
 public:
  Sweep(const Config& config, const Session& session, std::ofstream* csv)
      : config_(config),
        session_(session),
        comm_(*session.comm),
        rank_(comm_.rank()),
        world_size_(comm_.size()),
        report_(config, session, csv),
        send_(config.in_place ? 0 : config.max_bytes, "the send buffer (-e)"),
        recv_(config.max_bytes, "the receive buffer (-e)"),
        rotate_checked_result_(std::getenv("COLLECTIVES_BENCH_TEST_ROTATE_RESULT") != nullptr),
        control_(session.control ? *session.control : *session.comm) {
    if (config.device == "cuda") {
      device_ = std::make_unique<DeviceMirror>(rank_, send_.data(),
                                               config.in_place ? 0 : config.max_bytes,
                                               recv_.data(), config.max_bytes);
    }
    if (config.baseline == "nccl") {
      nccl_baseline_ = std::make_unique<NcclBaseline>(
          *session.store, "collectives_perf/nccl_baseline/id", rank_, world_size_,
          device_->device());
    }
  }

  // Runs every case; returns the exit code.
  int Run() {
    report_.PrintHeader();
    int64_t total_wrong = 0;
    double busbw_sum = 0;
    size_t timed_rows = 0;
    report_.WriteCsvHeader();
    for (Collective collective : config_.collectives) {
      report_.PrintTableHeader(collective);
      const std::vector<ReduceOp> ops =
          HasOp(collective) ? config_.ops : std::vector<ReduceOp>{ReduceOp::kSum};
      for (DataType dtype : config_.dtypes) {
        for (ReduceOp op : ops) {
          // Requested bytes of the full result buffer.
          for (size_t bytes : bench::SweepSizes(config_.min_bytes, config_.max_bytes,
                                                config_.step_factor, config_.step_bytes)) {
            const Row row = RunCase(collective, dtype, op, bytes);
            report_.PrintRow(row);
            report_.WriteCsvRow(row);
            if (row.wrong) total_wrong += *row.wrong;
            if (!row.skipped) {
              busbw_sum += row.busbw;
              ++timed_rows;
            }
          }
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
  // Runs one (collective, dtype, op, size) case on every rank.
  Row RunCase(Collective collective, DataType dtype, ReduceOp op, size_t requested_bytes) {
    Row row;
    row.collective = collective;
    row.dtype = dtype;
    row.op = op;
    row.root = config_.root;
    row.has_baseline = config_.baseline != "none";
    const size_t element_bytes = SizeOf(dtype);
    const size_t n = static_cast<size_t>(world_size_);
    size_t count = requested_bytes / element_bytes;
    if (SplitsAcrossRanks(collective)) count = count / n * n;
    const size_t per_rank = SplitsAcrossRanks(collective) ? count / n : count;
    row.count = count;
    row.bytes = count * element_bytes;
    if (per_rank == 0) {
      row.bytes = requested_bytes;
      row.skipped = true;
      return row;
    }

    Tensor send{send_.data(), 0, dtype, Device::Cpu()};
    Tensor recv{recv_.data(), 0, dtype, Device::Cpu()};
    // In place (--inplace): one buffer, at the offsets the API defines for each collective.
    const size_t own_block_offset = static_cast<size_t>(rank_) * per_rank * element_bytes;
    switch (collective) {
      case Collective::kAllReduce:
      case Collective::kBroadcast:
        send.count = count;
        recv.count = count;
        if (config_.in_place) send.data = recv.data;
        break;
      case Collective::kAllGather:
        send.count = per_rank;
        recv.count = count;
        if (config_.in_place) send.data = recv_.data() + own_block_offset;
        break;
      case Collective::kReduceScatter:
        send.count = count;
        recv.count = per_rank;
        if (config_.in_place) {
          send.data = recv_.data();
          recv.data = recv_.data() + own_block_offset;
        }
        break;
    }
    // --device cuda: the calls run on the device copies of these host views, which the host
    // views fill (Upload) and check (Download).
    const Tensor host_send = send, host_recv = recv;
    auto upload = [&] {
      if (device_) {
        device_->Upload(host_recv);
        device_->Upload(host_send);
      }
    };
    if (device_) {
      send = device_->OnDevice(host_send);
      recv = device_->OnDevice(host_recv);
    }
    // --async: the same call through its asynchronous form, waited on at once.
    const bool async = config_.async;
    auto run_on = [&](CollectiveCommunication& comm) {
      switch (collective) {
        case Collective::kAllReduce:
          async ? comm.AllReduceAsync(send, recv, op)->Wait() : comm.AllReduce(send, recv, op);
          break;
        case Collective::kBroadcast:
          async ? comm.BroadcastAsync(send, recv, config_.root)->Wait()
                : comm.Broadcast(send, recv, config_.root);
          break;
        case Collective::kAllGather:
          async ? comm.AllGatherAsync(send, recv)->Wait() : comm.AllGather(send, recv);
          break;
        case Collective::kReduceScatter:
          async ? comm.ReduceScatterAsync(send, recv, op)->Wait()
                : comm.ReduceScatter(send, recv, op);
          break;
      }
    };
    auto run_once = [&] { run_on(comm_); };

    // The timed calls see the check data too: defined values of this dtype (no denormals or
    // NaNs left over from a previous dtype).
    FillInput(collective, dtype, op, host_send);
    upload();
    for (int i = 0; i < config_.warmup_iters; ++i) run_once();

    // One checked call on `comm`: the wrong elements summed over ranks. Out of place, recv starts
    // as the sentinel; in place, the part of it that is not input does (an in-place all-gather's
    // other blocks: else they would still hold the warm-ups' correct result). An in-place
    // all-reduce, broadcast or reduce-scatter has no such part: its buffer is all input, and a
    // broadcast's non-roots start from their own pattern, not the root's.
    auto check_on = [&](CollectiveCommunication& comm) {
      if (!config_.in_place || collective == Collective::kAllGather) {
        FillWith(host_recv.data, dtype, host_recv.count, Sentinel(dtype));
      }
      FillInput(collective, dtype, op, host_send);
      upload();
      run_on(comm);
      if (device_) device_->Download(host_recv);
      if (rotate_checked_result_ && rank_ == world_size_ - 1) RotateByOneElement(host_recv);
      int64_t wrong = Verify(collective, dtype, op, host_send, host_recv);
      control_.AllReduce(Tensor{&wrong, 1, DataType::kInt64, Device::Cpu()}, ReduceOp::kSum);
      return wrong;
    };
    if (config_.check) {
      // Every configuration timed is checked: ours and each --versus one.
      row.wrong = check_on(comm_);
      for (auto& versus : session_.versus) *row.wrong += check_on(*versus.comm);
      FillInput(collective, dtype, op, host_send);
      upload();
    }

    // `repeat` rounds of `iters` timed calls; with a baseline, ours and MPI's rounds alternate
    // so that both see the same machine. Each round's time is the slowest rank's (the same
    // value on every rank); the row reports the median round (or the fastest: --stat min).
    auto time_on = [&](CollectiveCommunication& comm, int warmup) {
      for (int i = 0; i < warmup; ++i) run_on(comm);
      control_.Barrier();
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < config_.iters; ++i) run_on(comm);
      double seconds = std::chrono::duration<double>(Clock::now() - start).count() / config_.iters;
      control_.AllReduce(Tensor{&seconds, 1, DataType::kFloat64, Device::Cpu()}, ReduceOp::kMax);
      return seconds;
    };
    std::vector<double> ours;
    std::vector<double> theirs;
    std::vector<std::vector<double>> versus(session_.versus.size());
    for (int round = 0; round < config_.repeat; ++round) {
      // With --versus, ours runs first in even rounds and last in odd ones, so that neither
      // side always follows the other (the first timed after a pause ran a few % slower).
      const bool ours_last = round % 2 == 1 && !versus.empty();
      if (!ours_last) ours.push_back(time_on(comm_, 0));
      for (size_t v = 0; v < versus.size(); ++v) {
        versus[v].push_back(
            time_on(*session_.versus[v].comm, round == 0 ? config_.warmup_iters : 0));
      }
      if (ours_last) ours.push_back(time_on(comm_, 0));
      if (nccl_baseline_) {
        double seconds = nccl_baseline_->Time(collective, dtype, op, config_.root, send, recv,
                                              round == 0 ? config_.warmup_iters : 0,
                                              config_.iters, [&] { control_.Barrier(); });
        control_.AllReduce(Tensor{&seconds, 1, DataType::kFloat64, Device::Cpu()},
                           ReduceOp::kMax);
        theirs.push_back(seconds);
      }
#ifdef COLLECTIVES_WITH_MPI
      if (config_.baseline == "mpi") {
        const std::optional<double> mpi_seconds = TimeMpiBaseline(
            collective, dtype, op, config_.root, send.data, recv.data, count, per_rank,
            config_.in_place, round == 0 ? config_.warmup_iters : 0, config_.iters);
        if (mpi_seconds) theirs.push_back(*mpi_seconds);
      }
#endif
    }
    // --stat of the rounds, the same for every configuration.
    const bool fastest = config_.stat == "min";
    auto of_rounds = [fastest](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      if (fastest) return v.front();
      const size_t half = v.size() / 2;
      return v.size() % 2 == 1 ? v[half] : (v[half - 1] + v[half]) / 2;
    };
    for (const std::vector<double>& rounds : versus)
      row.versus_time_us.push_back(of_rounds(rounds) * 1e6);
    const double seconds = of_rounds(ours);
    row.time_us = seconds * 1e6;
    row.algbw = static_cast<double>(row.bytes) / seconds / 1e9;
    row.busbw = row.algbw * BusBandwidthFactor(collective, world_size_);
    if (!theirs.empty()) {
      const double mpi_seconds = of_rounds(theirs);
      row.baseline_time_us = mpi_seconds * 1e6;
      row.baseline_busbw = static_cast<double>(row.bytes) / mpi_seconds / 1e9 *
                           BusBandwidthFactor(collective, world_size_);
    }
    return row;
  }

  // The test hook behind COLLECTIVES_BENCH_TEST_ROTATE_RESULT: every element of `recv` moves
  // one place on (the last to the front), as a result written at the wrong offset would be.
  static void RotateByOneElement(const Tensor& recv) {
    auto* bytes = static_cast<std::byte*>(recv.data);
    const size_t element_bytes = SizeOf(recv.dtype);
    const size_t total = recv.count * element_bytes;
    std::rotate(bytes, bytes + total - element_bytes, bytes + total);
  }

  // Fills this rank's send buffer with its check input.
  void FillInput(Collective collective, DataType dtype, ReduceOp op, const Tensor& send) {
    if (HasOp(collective)) {
      FillFromTable(send.data, dtype, send.count,
                    ReductionInputTable(dtype, op, world_size_, rank_));
    } else {
      FillFromTable(send.data, dtype, send.count, CopyTable(rank_));
    }
  }

  // Counts this rank's wrong result elements (and reports the first few on stderr).
  int64_t Verify(Collective collective, DataType dtype, ReduceOp op, const Tensor& send,
                 const Tensor& recv) {
    CheckContext context;
    context.rank = rank_;
    context.call =
        std::string(ToString(collective)) + " " + ToString(dtype) +
        (HasOp(collective) ? std::string(" ") + ToString(op) : "") +
        (collective == Collective::kBroadcast ? " root=" + std::to_string(config_.root) : "") +
        " send count=" + std::to_string(send.count) + " recv count=" + std::to_string(recv.count);
    switch (collective) {
      case Collective::kAllReduce:
      case Collective::kReduceScatter: {
        const PatternTable expected = ReductionExpectedTable(dtype, op, world_size_);
        const double tolerance =
            op == ReduceOp::kAvg && IsFloatingPoint(dtype) ? AverageTolerance(dtype) : 0.0;
        // Reduce-scatter's block `rank` starts at element rank * recv.count of the input.
        const size_t offset =
            collective == Collective::kReduceScatter ? static_cast<size_t>(rank_) * recv.count : 0;
        return CountWrong(recv.data, dtype, recv.count, offset, 0, expected, tolerance, context);
      }
      case Collective::kBroadcast:
        return CountWrong(recv.data, dtype, recv.count, 0, 0, CopyTable(config_.root), 0.0,
                          context);
      case Collective::kAllGather: {
        int64_t wrong = 0;
        const size_t element_bytes = SizeOf(dtype);
        for (int r = 0; r < world_size_; ++r) {
          const size_t offset = static_cast<size_t>(r) * send.count;
          wrong += CountWrong(static_cast<const std::byte*>(recv.data) + offset * element_bytes,
                              dtype, send.count, 0, offset, CopyTable(r), 0.0, context);
        }
        return wrong;
      }
    }
    return 0;
  }

  const Config& config_;
  const Session& session_;
  CollectiveCommunication& comm_;
  const int rank_;
  const int world_size_;
  Report report_;
  AlignedBuffer send_;
  AlignedBuffer recv_;
  const bool rotate_checked_result_;
  // The sweep's bookkeeping on host memory (times, wrong counts, barriers): comm_ or, with
  // --impl nccl, the session's RING communicator.
  CollectiveCommunication& control_;
  std::unique_ptr<DeviceMirror> device_;          // --device cuda
  std::unique_ptr<NcclBaseline> nccl_baseline_;  // --baseline nccl
};

// ---------------------------------------------------------------------------------------------
// main.
// ---------------------------------------------------------------------------------------------

int Main(int argc, char** argv) {
  const bool local_child = IsLocalChild();
  const bool under_mpi_launcher = UnderMpiLauncher();
  bench::MpiStartup mpi(under_mpi_launcher && !local_child, &argc, &argv);
  const bool mpi_initialized = mpi.initialized();
  auto finalize = [&] { mpi.Finalize(); };
  const int env_rank = RankFromEnvironment();

  Config config;
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  std::string step_bytes = "0";
  std::string collectives = "all_reduce";
  std::string dtypes = "f32";
  std::string ops = "sum";
  CLI::App app{
      "collectives_perf: nccl-tests style sweep of all-reduce, broadcast, all-gather "
      "and reduce-scatter"};
  AddOptions(app, config, min_bytes, max_bytes, step_bytes, collectives, dtypes, ops);
  app.footer(bench::LaunchHelp("collectives_perf",
                               "  collectives_perf --local N ...   (N processes on this host)\n"));
  try {
    app.parse(argc, argv);
    config.min_bytes = ParseBytes(min_bytes);
    config.max_bytes = ParseBytes(max_bytes);
    config.step_bytes = ParseBytes(step_bytes);
    config.collectives = ParseCollectives(collectives);
    config.dtypes = ParseDataTypes(dtypes);
    config.ops = ParseReduceOps(ops);
    CheckAlgorithms(config);
    if (config.min_bytes == 0) throw CLI::ValidationError("-b must be at least 1 byte");
    if (config.min_bytes > config.max_bytes) throw CLI::ValidationError("-b is larger than -e");
    if (config.pretend_hosts > 0 && config.local == 0) {
      throw CLI::ValidationError(
          "--pretend-hosts needs --local (other launchers: set COLLECTIVES_HOST_ID per rank)");
    }
    if (config.pretend_hosts > config.local) {
      throw CLI::ValidationError("--pretend-hosts " + std::to_string(config.pretend_hosts) +
                                 " is more hosts than --local " + std::to_string(config.local) +
                                 " ranks");
    }
    if (config.local > 0 && under_mpi_launcher && !local_child) {
      throw CLI::ValidationError("--local starts its own ranks: do not combine it with mpirun");
    }
    if (config.device == "cuda" && !DeviceBuffersBuilt()) {
      throw CLI::ValidationError(
          "--device cuda needs a build with CUDA and NCCL (cmake -DCOLLECTIVES_WITH_NCCL=ON)");
    }
    if (config.impl == "nccl" && config.device != "cuda") {
      throw CLI::ValidationError("--impl nccl needs --device cuda (NCCL takes device memory)");
    }
    if (config.baseline == "nccl" && config.device != "cuda") {
      throw CLI::ValidationError("--baseline nccl needs --device cuda");
    }
    if (config.baseline == "mpi") {
#ifdef COLLECTIVES_WITH_MPI
      if (config.local > 0 || !under_mpi_launcher) {
        throw CLI::ValidationError("--baseline mpi needs mpirun (not --local)");
      }
#else
      throw CLI::ValidationError(
          "--baseline mpi needs a build with MPI (cmake -DCOLLECTIVES_WITH_MPI=ON)");
#endif
    }
  } catch (const CLI::ParseError& e) {
    std::ostream quiet(nullptr);
    const int rc = env_rank == 0 ? app.exit(e) : app.exit(e, quiet, quiet);
    finalize();
    // --help is 0; a bad command line is an error (1), not CLI11's own code (104 to 114).
    return rc == 0 ? kExitOk : kExitError;
  }

  if (config.local > 0 && !local_child) {
    if (config.pretend_hosts > 0) {
      setenv("COLLECTIVES_PERF_PRETEND_HOSTS", std::to_string(config.pretend_hosts).c_str(), 1);
    }
    return RunLocalLauncher("collectives_perf", config.local, argv,
                            config.timeout() + std::chrono::seconds(10),
                            1 + static_cast<int>(config.versus.size()));
  }

  int rank = env_rank;
  try {
    Session session;
    if (local_child) {
      session = BootstrapLocalChild(config);
    } else if (mpi_initialized) {
#ifdef COLLECTIVES_WITH_MPI
      session = BootstrapMpi(config);
#endif
    } else {
      SayWhenSingleRankByDefault("collectives_perf");
      session = BootstrapFromEnvironment(config);
    }
    rank = session.comm->rank();
    if (config.root >= session.comm->size()) {
      throw std::runtime_error("--root " + std::to_string(config.root) +
                               " is not a rank (world size " +
                               std::to_string(session.comm->size()) + ")");
    }
    std::unique_ptr<std::ofstream> csv;
    if (!config.csv_path.empty() && rank == 0) csv = OpenCsv(config.csv_path);
    int rc = kExitOk;
    {
      Sweep sweep(config, session, csv.get());
      rc = sweep.Run();
    }
    session.versus.clear();
    session.comm.reset();
    session.control.reset();
    finalize();
    return rc;
  } catch (const Error& e) {
    std::fprintf(stderr, "collectives_perf: rank %d: error [%s]: %s\n", rank, ToString(e.code()),
                 e.message().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "collectives_perf: rank %d: error: %s\n", rank, e.what());
  }
#ifdef COLLECTIVES_WITH_MPI
  if (mpi_initialized) MPI_Abort(MPI_COMM_WORLD, kExitError);
#endif
  return kExitError;
}

}  // namespace
}  // namespace collectives::perf

int main(int argc, char** argv) { return collectives::perf::Main(argc, argv); }
