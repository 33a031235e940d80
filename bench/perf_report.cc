// The report of collectives_perf (bench/perf_report.h): the header lines, the tables and the CSV.
#include "bench/perf_report.h"

#include <cstdio>

#include "bench/bench_util.h"

#ifndef COLLECTIVES_PERF_BUILD_TYPE
#define COLLECTIVES_PERF_BUILD_TYPE "unknown"
#endif

namespace collectives::perf {

using bench::CountHosts;
using bench::Format;
using bench::PrintBuildHeader;

void Report::PrintHeader() {
  // On host memory: the session's RING communicator where NCCL (device memory only) is timed.
  const size_t hosts = CountHosts(session_.control ? *session_.control : comm_);
  if (rank_ != 0) return;

  PrintBuildHeader("collectives_perf", COLLECTIVES_PERF_BUILD_TYPE);
  std::printf("# world size %d  hosts %zu  launched by %s\n", world_size_, hosts,
              session_.launcher.c_str());
  std::printf("# implementation %s  algorithm %s  hosts' link %s\n",
              ToString(comm_.implementation()),
              config_.algorithm.empty() ? "chosen per call" : config_.algorithm.c_str(),
              hosts == 1 ? "TCP loopback (one host)" : "TCP");
  std::printf("# chunk bytes %s  small-message bytes %s  spin us %s  yield us %s  timeout %.0f s\n",
              config_.chunk_bytes == 0 ? "default" : std::to_string(config_.chunk_bytes).c_str(),
              config_.small_message_bytes == 0
                  ? "default"
                  : std::to_string(config_.small_message_bytes).c_str(),
              config_.spin_us < 0 ? "adaptive" : std::to_string(config_.spin_us).c_str(),
              config_.yield_us < 0 ? "default" : std::to_string(config_.yield_us).c_str(),
              config_.timeout_s);
  std::printf("# iterations %d x %d rounds (%s)  warm-up %d  check %s  buffers %s  calls %s\n",
              config_.iters, config_.repeat, config_.stat.c_str(), config_.warmup_iters,
              config_.check ? "on" : "off",
              config_.in_place ? "in-place" : "out-of-place",
              config_.async ? "asynchronous, each waited on at once" : "blocking");
  for (const Versus& v : session_.versus) {
    std::printf(
        "# versus %s: timed round for round with ours on the same buffers; "
        "ratio = our time / its time\n",
        v.name.c_str());
  }
  if (config_.device == "cuda") {
    std::printf("# device: cuda (each rank's buffers on device rank %% visible devices)%s\n",
                config_.impl == "nccl"   ? ""
                : config_.impl == "auto" ? "; AUTO: NCCL inside a host, staged across hosts "
                                           "(all staged where NCCL is not usable)"
                                         : "; RING stages them through pinned host memory");
  }
  if (config_.baseline == "mpi") {
    std::printf(
        "# baseline: the matching MPI collective on the same buffers, same iterations "
        "(avg timed as MPI_SUM; f16/bf16: n/a); ratio = our time / MPI time\n");
  }
  if (config_.baseline == "nccl") {
    std::printf(
        "# baseline: raw nccl* calls on the same device buffers, same iterations, queued on one "
        "stream and synchronised once (nccl-tests' method); ratio = our time / NCCL time\n");
  }
  std::printf(
      "# busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, "
      "reduce_scatter), x 1 (broadcast)\n");
  std::fflush(stdout);
}

void Report::PrintTableHeader(Collective collective) {
  if (rank_ != 0) return;
  std::string line1 =
      "#          size         count   type  redop   root       time     algbw     busbw   "
      "#wrong";
  std::string line2 =
      "#           (B)    (elements)                            (us)    (GB/s)    (GB/s)";
  if (config_.baseline != "none") {
    const std::string& b = config_.baseline;
    line1 += Format(" %10s %10s %9s", (b + " time").c_str(), (b + " busbw").c_str(),
                    ("ours/" + b).c_str());
    line2 += "                (us)     (GB/s)    (time)";
  }
  for (const Versus& v : session_.versus) {
    line1 += Format(" %14s %6s", (v.name + " us").c_str(), "ratio");
  }
  line1 += "  algorithm";
  std::printf("#\n# %s\n%s\n%s\n", ToString(collective), line1.c_str(), line2.c_str());
  std::fflush(stdout);
}

void Report::PrintRow(const Row& row) {
  if (rank_ != 0) return;
  const std::string op = HasOp(row.collective) ? ToString(row.op) : "-";
  const std::string root =
      row.collective == Collective::kBroadcast ? std::to_string(row.root) : "-";
  std::string line = Format("%15zu %13zu %6s %6s %6s", row.bytes, row.count, ToString(row.dtype),
                            op.c_str(), root.c_str());
  if (row.skipped) {
    line += Format(" %10s %9s %9s %8s", "skipped", "-", "-", "-");
  } else {
    line += Format(" %10.2f %9.3f %9.3f", row.time_us, row.algbw, row.busbw);
    line +=
        row.wrong ? Format(" %8lld", static_cast<long long>(*row.wrong)) : Format(" %8s", "n/a");
  }
  if (row.has_baseline) {
    if (row.skipped) {
      line += Format(" %10s %10s %9s", "-", "-", "-");
    } else if (row.baseline_time_us) {
      line += Format(" %10.2f %10.3f %9.2f", *row.baseline_time_us, row.baseline_busbw,
                     row.time_us / *row.baseline_time_us);
    } else {
      line += Format(" %10s %10s %9s", "n/a", "n/a", "n/a");
    }
  }
  for (double t : row.versus_time_us) line += Format(" %14.2f %6.2f", t, row.time_us / t);
  line += "  " + AlgorithmOf(row);
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

std::string Report::AlgorithmOf(const Row& row) const {
  return row.collective == Collective::kAllReduce ? comm_.AllReduceAlgorithm(row.bytes) : "-";
}

void Report::WriteCsvHeader() {
  if (csv_ == nullptr || rank_ != 0) return;
  *csv_ << "collective,world_size,size_bytes,count,dtype,op,root,time_us,algbw_gbps,"
           "busbw_gbps,wrong";
  if (config_.baseline != "none") {
    const std::string& b = config_.baseline;
    *csv_ << ',' << b << "_time_us," << b << "_busbw_gbps,time_ratio_ours_over_" << b;
  }
  for (const Versus& v : session_.versus) {
    *csv_ << ',' << v.name << "_time_us,time_ratio_ours_over_" << v.name;
  }
  *csv_ << ",algorithm\n";
}

void Report::WriteCsvRow(const Row& row) {
  if (csv_ == nullptr || rank_ != 0) return;
  *csv_ << ToString(row.collective) << ',' << world_size_ << ',' << row.bytes << ',' << row.count
        << ',' << ToString(row.dtype) << ',' << (HasOp(row.collective) ? ToString(row.op) : "")
        << ',' << (row.collective == Collective::kBroadcast ? std::to_string(row.root) : "") << ',';
  if (row.skipped) {
    *csv_ << ",,,";
  } else {
    *csv_ << Format("%.3f,%.6f,%.6f,", row.time_us, row.algbw, row.busbw);
    if (row.wrong) *csv_ << *row.wrong;
  }
  if (row.has_baseline) {
    if (!row.skipped && row.baseline_time_us) {
      *csv_ << Format(",%.3f,%.6f,%.4f", *row.baseline_time_us, row.baseline_busbw,
                      row.time_us / *row.baseline_time_us);
    } else {
      *csv_ << ",,,";
    }
  }
  for (size_t v = 0; v < session_.versus.size(); ++v) {
    if (v < row.versus_time_us.size()) {
      *csv_ << Format(",%.3f,%.4f", row.versus_time_us[v], row.time_us / row.versus_time_us[v]);
    } else {
      *csv_ << ",,";
    }
  }
  *csv_ << ',' << AlgorithmOf(row) << '\n';
  csv_->flush();
}

}  // namespace collectives::perf
