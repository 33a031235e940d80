// collectives_perf's command line: the collectives it sweeps and their size conventions, the
// Config its flags fill, the parsers of the list flags (-c, -d, -o), the checks of --algorithm
// and --versus, and the flags themselves (AddOptions), so that --help lists them in one place.
#ifndef COLLECTIVES_BENCH_PERF_OPTIONS_H_
#define COLLECTIVES_BENCH_PERF_OPTIONS_H_

#include <CLI/CLI.hpp>
#include <array>
#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "collectives/collectives.h"

namespace collectives::perf {

// ---------------------------------------------------------------------------------------------
// Collectives and their size conventions.
// ---------------------------------------------------------------------------------------------

enum class Collective { kAllReduce, kBroadcast, kAllGather, kReduceScatter };
constexpr std::array<Collective, 4> kAllCollectives = {
    Collective::kAllReduce, Collective::kBroadcast, Collective::kAllGather,
    Collective::kReduceScatter};

const char* ToString(Collective collective);

// Whether the collective takes a reduction operator.
bool HasOp(Collective collective);

// Whether the full result buffer is split into one block per rank (the per-rank count is then
// the full count / world size).
bool SplitsAcrossRanks(Collective collective);

// busbw = algbw x this factor: what each rank's link must carry relative to the buffer size for
// a bandwidth-optimal algorithm, so that busbw is comparable across world sizes.
double BusBandwidthFactor(Collective collective, int world_size);

// ---------------------------------------------------------------------------------------------
// Command line.
// ---------------------------------------------------------------------------------------------

struct Config : bench::CommunicationFlags {
  size_t min_bytes = 8;
  size_t max_bytes = size_t{64} << 20;
  size_t step_factor = 2;
  size_t step_bytes = 0;  // > 0: sizes grow by this many bytes instead of by step_factor
  std::vector<Collective> collectives = {Collective::kAllReduce};
  std::vector<DataType> dtypes = {DataType::kFloat32};
  std::vector<ReduceOp> ops = {ReduceOp::kSum};
  int iters = 20;
  int warmup_iters = 5;
  int repeat = 1;
  // What a row reports of its -r rounds, for ours, every --versus configuration and the
  // baseline alike: "median" or "min" (the least disturbed round: on a shared or oversubscribed
  // machine the noise only slows a round, so the fastest round of each is the fairest match).
  std::string stat = "median";
  bool check = false;
  std::string csv_path;
  std::string impl = "ring";
  std::string algorithm;  // CommunicationOptions::algorithm
  int pretend_hosts = 0;  // with --local: cut the ranks into this many pretend hosts
  // Other configurations timed in the same run, round for round: "impl" or "impl:algorithm".
  std::vector<std::string> versus;
  int root = 0;
  bool in_place = false;
  // Each call through its asynchronous form, waited on at once: what the hand-off to the
  // communicator's progress thread and back costs (the blocking form of a small call runs on
  // the caller's thread).
  bool async = false;
  size_t medium_message_bytes = 0;
  int local = 0;
  std::string baseline = "none";  // none, mpi or nccl
  std::string device = "cpu";      // where the buffers are: cpu or cuda (rank % visible devices)
};

// The list flags: a comma-separated list of names, or all.
std::vector<Collective> ParseCollectives(const std::string& text);
std::vector<DataType> ParseDataTypes(const std::string& text);
std::vector<ReduceOp> ParseReduceOps(const std::string& text);

// --algorithm, and every --versus item: IMPL (ring or auto, as --impl) or IMPL:ALGORITHM.
// Checked before any rank starts, not by each rank when it builds that communicator.
void CheckAlgorithms(const Config& config);

// Adds every flag to `app`: those with a plain value into `config`, the size and list flags into
// the strings that Main parses after CLI11 has run.
void AddOptions(CLI::App& app, Config& config, std::string& min_bytes, std::string& max_bytes,
                std::string& step_bytes, std::string& collectives, std::string& dtypes,
                std::string& ops);

}  // namespace collectives::perf

#endif  // COLLECTIVES_BENCH_PERF_OPTIONS_H_
