// collectives_perf's command line (bench/perf_options.h): the names of the collectives, the
// parsers of the list flags, the checks of --algorithm and --versus, and the flags.
#include "bench/perf_options.h"

#include <algorithm>
#include <string_view>

#include "src/core/algorithm_names.h"

namespace collectives::perf {

using bench::SplitList;

const char* ToString(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
  }
  return "?";
}

bool HasOp(Collective collective) {
  return collective == Collective::kAllReduce || collective == Collective::kReduceScatter;
}

bool SplitsAcrossRanks(Collective collective) {
  return collective == Collective::kAllGather || collective == Collective::kReduceScatter;
}

double BusBandwidthFactor(Collective collective, int world_size) {
  const double n = world_size;
  switch (collective) {
    case Collective::kAllReduce:
      return 2.0 * (n - 1.0) / n;
    case Collective::kAllGather:
    case Collective::kReduceScatter:
      return (n - 1.0) / n;
    case Collective::kBroadcast:
      return 1.0;
  }
  return 1.0;
}

std::vector<Collective> ParseCollectives(const std::string& text) {
  if (text == "all") return {kAllCollectives.begin(), kAllCollectives.end()};
  std::vector<Collective> result;
  for (const std::string& name : SplitList(text)) {
    auto it = std::find_if(kAllCollectives.begin(), kAllCollectives.end(),
                           [&](Collective c) { return name == ToString(c); });
    if (it == kAllCollectives.end()) {
      throw CLI::ValidationError("-c: unknown collective '" + name +
                                 "' (all_reduce, broadcast, all_gather, reduce_scatter or all)");
    }
    result.push_back(*it);
  }
  if (result.empty()) throw CLI::ValidationError("-c: no collective given");
  return result;
}

std::vector<DataType> ParseDataTypes(const std::string& text) {
  std::vector<DataType> result;
  if (text == "all") {
    for (int i = 0; i < kNumDataTypes; ++i) result.push_back(static_cast<DataType>(i));
    return result;
  }
  for (const std::string& name : SplitList(text)) {
    try {
      result.push_back(ParseDataType(name));
    } catch (const Error& e) {
      throw CLI::ValidationError("-d: " + e.message());
    }
  }
  if (result.empty()) throw CLI::ValidationError("-d: no dtype given");
  return result;
}

std::vector<ReduceOp> ParseReduceOps(const std::string& text) {
  std::vector<ReduceOp> result;
  if (text == "all") {
    for (int i = 0; i < kNumReduceOps; ++i) result.push_back(static_cast<ReduceOp>(i));
    return result;
  }
  for (const std::string& name : SplitList(text)) {
    try {
      result.push_back(ParseReduceOp(name));
    } catch (const Error& e) {
      throw CLI::ValidationError("-o: " + e.message());
    }
  }
  if (result.empty()) throw CLI::ValidationError("-o: no op given");
  return result;
}

namespace {

// The all-reduce algorithms CommunicationOptions::algorithm names (--algorithm, --versus
// IMPL:ALGORITHM). Whether the implementation can run one on this job is known only once its
// communicator is built (halving_doubling needs 4, 8, ... ranks; two_level several hosts).
constexpr std::array<std::string_view, 5> kAlgorithms = {
    collectives::core::algorithm::kRing, collectives::core::algorithm::kRecursiveDoubling,
    collectives::core::algorithm::kHalvingDoubling, collectives::core::algorithm::kShm,
    collectives::core::algorithm::kTwoLevel};

// `algorithm`, given by `what`, is empty (chosen per call) or one of kAlgorithms.
void CheckAlgorithm(const std::string& what, const std::string& algorithm) {
  if (algorithm.empty() ||
      std::find(kAlgorithms.begin(), kAlgorithms.end(), algorithm) != kAlgorithms.end()) {
    return;
  }
  throw CLI::ValidationError(what + ": unknown algorithm '" + algorithm +
                             "' (ring, recursive_doubling, halving_doubling, shm, two_level)");
}

}  // namespace

void CheckAlgorithms(const Config& config) {
  CheckAlgorithm("--algorithm", config.algorithm);
  for (const std::string& item : config.versus) {
    const size_t colon = item.find(':');
    const std::string impl = item.substr(0, colon);
    if (impl != "ring" && impl != "auto") {
      throw CLI::ValidationError("--versus: '" + item + "': unknown implementation '" + impl +
                                 "' (IMPL or IMPL:ALGORITHM, IMPL ring or auto)");
    }
    if (colon != std::string::npos) {
      CheckAlgorithm("--versus: '" + item + "'", item.substr(colon + 1));
    }
  }
}

void AddOptions(CLI::App& app, Config& config, std::string& min_bytes, std::string& max_bytes,
                std::string& step_bytes, std::string& collectives, std::string& dtypes,
                std::string& ops) {
  app.add_option("-b,--minbytes", min_bytes,
                 "Smallest size: bytes of the full result buffer (8, 64K, 64M, 1G)")
      ->capture_default_str();
  app.add_option("-e,--maxbytes", max_bytes, "Largest size")->capture_default_str();
  app.add_option("-f,--stepfactor", config.step_factor, "Multiply the size by this factor")
      ->capture_default_str()
      ->check(CLI::Range(size_t{2}, size_t{1} << 20));
  app.add_option("-i,--stepbytes", step_bytes,
                 "Add this many bytes per step instead of multiplying by -f (64K, 1M, ...)");
  app.add_option(
         "-c,--collective", collectives,
         "all_reduce, broadcast, all_gather, reduce_scatter, a comma-separated list, or all")
      ->capture_default_str();
  app.add_option("-d,--dtype", dtypes,
                 "f32 f64 f16 bf16 i8 u8 i32 i64, a comma-separated list, or all")
      ->capture_default_str();
  app.add_option("-o,--op", ops,
                 "sum prod min max avg, a comma-separated list, or all (all_reduce and "
                 "reduce_scatter only)")
      ->capture_default_str();
  app.add_option("-n,--iters", config.iters, "Timed iterations per size")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("-w,--warmup_iters", config.warmup_iters, "Warm-up iterations per size")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  app.add_option("-r,--repeat", config.repeat,
                 "Rounds of -n timed calls per size; the median round is reported (--stat; "
                 "with --baseline or --versus, the configurations' rounds alternate)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--stat", config.stat,
                 "What a row reports of its rounds, for every configuration alike: median or "
                 "min (the fastest round)")
      ->capture_default_str()
      ->check(CLI::IsMember({"median", "min"}));
  app.add_flag("--check", config.check,
               "Verify one extra call per size element by element on every rank; exit 2 on any "
               "wrong element");
  app.add_option("--csv", config.csv_path, "Rank 0 writes the rows to this CSV file");
  app.add_option("--algorithm", config.algorithm,
                 "Force the all-reduce algorithm (CommunicationOptions::algorithm): ring, "
                 "recursive_doubling, halving_doubling, shm, two_level; default: chosen per call");
  app.add_option("--impl", config.impl, "Implementation (nccl needs --device cuda)")
      ->capture_default_str()
      ->check(CLI::IsMember({"ring", "auto", "nccl"}));
  app.add_option("--device", config.device,
                 "Where the buffers are: cpu, or cuda (device rank % visible devices; RING and "
                 "AUTO stage them through pinned host memory, NCCL runs on them)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--inplace", config.in_place,
               "One buffer for send and recv (the API's in-place forms) instead of two");
  app.add_flag("--async", config.async,
               "Time each call of ours through its asynchronous form (AllReduceAsync, ...), "
               "waited on at once: the hand-off to the progress thread and back (MPI's stay "
               "blocking)");
  app.add_option("--root", config.root, "Root rank of broadcast")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  bench::AddCommunicationFlags(app, config);
  app.add_option("--medium-bytes", config.medium_message_bytes,
                 "CommunicationOptions::medium_message_bytes (0: library default; 1: never "
                 "halving-doubling)")
      ->transform(bench::BytesSuffix());
  app.add_option("--local", config.local,
                 "Start this many ranks as processes on loopback and wait for them")
      ->check(CLI::Range(1, 4096));
  app.add_option("--versus", config.versus,
                 "Also time these configurations round for round with ours, in the same run: "
                 "IMPL or IMPL:ALGORITHM, comma-separated (ring, auto:shm, auto:two_level, "
                 "ring:recursive_doubling, ...)")
      ->delimiter(',');
  app.add_option("--pretend-hosts", config.pretend_hosts,
                 "With --local: cut the ranks into this many pretend hosts of consecutive ranks "
                 "(COLLECTIVES_HOST_ID), so that AUTO plans in two levels over loopback TCP")
      ->check(CLI::Range(0, 4096));
  app.add_option("--baseline", config.baseline,
                 "Also time the matching MPI collective (mpi: needs an MPI build, under mpirun) "
                 "or raw nccl* calls on the same device buffers (nccl: needs --device cuda)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "mpi", "nccl"}));
}
}  // namespace collectives::perf
