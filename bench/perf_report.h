// The report of collectives_perf: the header lines of a run, one table per collective with a row
// per size (time, algbw, busbw, wrong elements, the --baseline and --versus columns and the
// all-reduce algorithm run), and the same rows as CSV (--csv). Rank 0 prints and writes; on the
// other ranks every call but PrintHeader does nothing.
#ifndef COLLECTIVES_BENCH_PERF_REPORT_H_
#define COLLECTIVES_BENCH_PERF_REPORT_H_

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "bench/perf_options.h"
#include "bench/perf_session.h"
#include "collectives/collectives.h"

namespace collectives::perf {

// One size of one (collective, dtype, op) case, as the runs measured it.
struct Row {
  Collective collective = Collective::kAllReduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  size_t bytes = 0;  // of the full result buffer
  size_t count = 0;  // elements of the full result buffer
  bool skipped = false;
  double time_us = 0;
  double algbw = 0;  // GB/s
  double busbw = 0;  // GB/s
  std::optional<int64_t> wrong;
  std::vector<double> versus_time_us;  // one per --versus configuration
  bool has_baseline = false;           // a baseline was asked for (columns are printed)
  std::optional<double> baseline_time_us;
  double baseline_busbw = 0;
};

// Called by the runs on the caller's thread of every rank, in the same order everywhere:
// PrintHeader counts the hosts, a collective call.
class Report {
 public:
  // `csv` is null, or the open --csv file on rank 0.
  Report(const Config& config, const Session& session, std::ofstream* csv)
      : config_(config),
        session_(session),
        comm_(*session.comm),
        rank_(comm_.rank()),
        world_size_(comm_.size()),
        csv_(csv) {}

  void PrintHeader();
  void PrintTableHeader(Collective collective);
  void PrintRow(const Row& row);
  // The CSV lines, on rank 0 with --csv; nothing otherwise.
  void WriteCsvHeader();
  // Columns that do not apply (op of a broadcast, time of a skipped size) are left empty.
  void WriteCsvRow(const Row& row);

 private:
  // The all-reduce algorithm the communicator runs at this size (the same on every rank).
  std::string AlgorithmOf(const Row& row) const;

  const Config& config_;
  const Session& session_;
  CollectiveCommunication& comm_;
  const int rank_;
  const int world_size_;
  std::ofstream* csv_;
};

}  // namespace collectives::perf

#endif  // COLLECTIVES_BENCH_PERF_REPORT_H_
