// collectives_perf: an nccl-tests style sweep of the collectives over a range of message sizes.
//
// For every chosen collective, dtype, op and size it runs `-w` warm-up calls, with --check one
// more call whose result every rank verifies element by element, a barrier, and `-n` timed calls
// of the blocking collective. It prints one row per size: the time per call of the slowest rank,
// the algorithm bandwidth (bytes / time) and the bus bandwidth (nccl-tests conventions; see
// README.md), and the number of wrong elements summed over ranks. Rank 0 prints and, with --csv,
// writes the same rows as CSV. Only the public API is used, and the header-only 16-bit float
// conversions of the kernels (src/core/half.h).
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
#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "bench/bench_util.h"
#include "bench/launch_help.h"
#include "bench/local_launcher.h"
#include "collectives/collectives.h"
#include "src/core/algorithm_names.h"
#include "src/core/half.h"

#ifdef COLLECTIVES_WITH_MPI
#include <mpi.h>
#endif

#ifndef COLLECTIVES_PERF_BUILD_TYPE
#define COLLECTIVES_PERF_BUILD_TYPE "unknown"
#endif

namespace collectives::perf {
namespace {

using bench::AlignedBuffer;
#ifdef COLLECTIVES_WITH_MPI
using bench::CheckMpi;
#endif
using bench::CountHosts;
using bench::Format;
using bench::OpenCsv;
using bench::ParseBytes;
using bench::PrintBuildHeader;
using bench::PrintWrongSummary;
using bench::SplitList;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// Collectives and their size conventions.
// ---------------------------------------------------------------------------------------------

enum class Collective { kAllReduce, kBroadcast, kAllGather, kReduceScatter };
constexpr std::array<Collective, 4> kAllCollectives = {
    Collective::kAllReduce, Collective::kBroadcast, Collective::kAllGather,
    Collective::kReduceScatter};

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

// Whether the collective takes a reduction operator.
bool HasOp(Collective collective) {
  return collective == Collective::kAllReduce || collective == Collective::kReduceScatter;
}

// Whether the full result buffer is split into one block per rank (the per-rank count is then
// the full count / world size).
bool SplitsAcrossRanks(Collective collective) {
  return collective == Collective::kAllGather || collective == Collective::kReduceScatter;
}

// busbw = algbw x this factor: what each rank's link must carry relative to the buffer size for
// a bandwidth-optimal algorithm, so that busbw is comparable across world sizes.
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

// ---------------------------------------------------------------------------------------------
// Command line.
// ---------------------------------------------------------------------------------------------

struct Config {
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
  size_t chunk_bytes = 0;
  size_t small_message_bytes = 0;
  size_t medium_message_bytes = 0;
  int spin_us = -1;
  int yield_us = -1;
  double timeout_s = 120;
  int local = 0;
  std::string baseline = "none";

  std::chrono::milliseconds timeout() const { return bench::TimeoutFromSeconds(timeout_s); }
};

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

// --algorithm, and every --versus item: IMPL (ring or auto, as --impl) or IMPL:ALGORITHM.
// Checked before any rank starts, not by each rank when it builds that communicator.
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

// ---------------------------------------------------------------------------------------------
// Element types: conversions to and from double for filling and checking buffers.
// ---------------------------------------------------------------------------------------------

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// The kernels' own conversions (src/core/half.h), rounding to nearest even.
using core::half::BFloat16BitsToFloat;
using core::half::FloatToBFloat16Bits;
using core::half::FloatToHalfBits;
using core::half::HalfBitsToFloat;

template <typename T>
T FromDouble(double value) {
  return static_cast<T>(value);
}
template <>
Half FromDouble<Half>(double value) {
  return Half{FloatToHalfBits(static_cast<float>(value))};
}
template <>
BFloat16 FromDouble<BFloat16>(double value) {
  return BFloat16{FloatToBFloat16Bits(static_cast<float>(value))};
}

template <typename T>
double ToDouble(T value) {
  return static_cast<double>(value);
}
double ToDouble(Half value) { return HalfBitsToFloat(value.bits); }
double ToDouble(BFloat16 value) { return BFloat16BitsToFloat(value.bits); }

// Calls fn(T{}) with the C++ type that stores `dtype`.
template <typename Fn>
void VisitDataType(DataType dtype, Fn&& fn) {
  switch (dtype) {
    case DataType::kFloat32:
      return fn(float{});
    case DataType::kFloat64:
      return fn(double{});
    case DataType::kFloat16:
      return fn(Half{});
    case DataType::kBFloat16:
      return fn(BFloat16{});
    case DataType::kInt8:
      return fn(int8_t{});
    case DataType::kUInt8:
      return fn(uint8_t{});
    case DataType::kInt32:
      return fn(int32_t{});
    case DataType::kInt64:
      return fn(int64_t{});
  }
}

bool IsFloatingPoint(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat64 ||
         dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}

// Largest integer up to which every integer (and so every partial sum of our non-negative check
// values) is exact in `dtype`.
int64_t MaxExactInteger(DataType dtype) {
  switch (dtype) {
    case DataType::kInt8:
      return 127;
    case DataType::kUInt8:
      return 255;
    case DataType::kFloat16:
      return 2048;
    case DataType::kBFloat16:
      return 256;
    default:
      return int64_t{1} << 30;
  }
}

// Relative tolerance for floating-point averages (the only inexact result): two units in the
// last place, which covers "sum, then one division or one multiplication by 1/n".
double AverageTolerance(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16:
      return 2.0 * std::ldexp(1.0, -10);
    case DataType::kBFloat16:
      return 2.0 * std::ldexp(1.0, -7);
    case DataType::kFloat32:
      return 2.0 * std::ldexp(1.0, -23);
    case DataType::kFloat64:
      return 2.0 * std::ldexp(1.0, -52);
    default:
      return 0.0;
  }
}

// What an unwritten receive buffer holds during a check: NaN for floats (never equal to
// anything), an otherwise unused value for integers.
double Sentinel(DataType dtype) {
  switch (dtype) {
    case DataType::kInt8:
      return -128;
    case DataType::kUInt8:
      return 251;
    case DataType::kInt32:
      return std::numeric_limits<int32_t>::min();
    case DataType::kInt64:
      return -9.0e18;
    default:
      return std::numeric_limits<double>::quiet_NaN();
  }
}

// ---------------------------------------------------------------------------------------------
// Check data.
//
// Element i of a rank's input is a function of (rank, PatternIndex(i)), where PatternIndex
// scatters i over kPatternPeriod classes with a multiplicative hash (so that a block landing
// at the wrong offset is caught). Values are small integers chosen so that every result is
// exact in every dtype with any number of ranks:
//   sum, avg  v in 0..k, k = min(3, MaxExactInteger / world size): no partial sum overflows an
//             i8/u8 or leaves the exact-integer range of f16/bf16; avg is then one division.
//             v is a hash of (rank, p), so that the sum depends on p for any world size (with
//             v = (p + 3 rank) mod 4, every multiple of 4 ranks summed to the same value at
//             every p, and a result at the wrong offset passed the check).
//   prod      v in {1, 2}, exactly t = p mod (min(world size, 6) + 1) ranks give 2, so every
//             partial product is at most 2^6 = 64.
//   min, max  v in -3..3 (0..6 for u8).
//   copies    (broadcast, all-gather) v = (p + 37 rank) mod 101, at most 100.
// The expected result of a reduction depends on p only, so it is a table of kPatternPeriod
// entries computed once per check.
// ---------------------------------------------------------------------------------------------

constexpr size_t kPatternPeriod = 420;
using PatternTable = std::array<double, kPatternPeriod>;

inline size_t PatternIndex(size_t i) {
  return static_cast<size_t>((static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull) >> 40) %
         kPatternPeriod;
}

double ReductionInput(DataType dtype, ReduceOp op, int world_size, int rank, size_t p) {
  const int64_t r = rank;
  const int64_t j = static_cast<int64_t>(p);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: {
      const int64_t k = std::min<int64_t>(3, MaxExactInteger(dtype) / world_size);
      return static_cast<double>(bench::MixRankAndIndex(rank, p) % static_cast<uint64_t>(k + 1));
    }
    case ReduceOp::kProd: {
      const int64_t twos = j % (std::min(world_size, 6) + 1);
      return (j + r) % world_size < twos ? 2.0 : 1.0;
    }
    case ReduceOp::kMin:
    case ReduceOp::kMax: {
      const int64_t v = (5 * j + 3 * r) % 7;
      return static_cast<double>(dtype == DataType::kUInt8 ? v : v - 3);
    }
  }
  return 0.0;
}

PatternTable ReductionInputTable(DataType dtype, ReduceOp op, int world_size, int rank) {
  PatternTable table{};
  for (size_t p = 0; p < kPatternPeriod; ++p) {
    table[p] = ReductionInput(dtype, op, world_size, rank, p);
  }
  return table;
}

PatternTable ReductionExpectedTable(DataType dtype, ReduceOp op, int world_size) {
  PatternTable table{};
  for (size_t p = 0; p < kPatternPeriod; ++p) {
    double result = ReductionInput(dtype, op, world_size, 0, p);
    for (int r = 1; r < world_size; ++r) {
      const double v = ReductionInput(dtype, op, world_size, r, p);
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg:
          result += v;
          break;
        case ReduceOp::kProd:
          result *= v;
          break;
        case ReduceOp::kMin:
          result = std::min(result, v);
          break;
        case ReduceOp::kMax:
          result = std::max(result, v);
          break;
      }
    }
    if (op == ReduceOp::kAvg) {
      result /= world_size;
      if (!IsFloatingPoint(dtype)) result = std::trunc(result);
    }
    table[p] = result;
  }
  return table;
}

PatternTable CopyTable(int rank) {
  PatternTable table{};
  for (size_t p = 0; p < kPatternPeriod; ++p) {
    table[p] = static_cast<double>((p + 37 * static_cast<size_t>(rank)) % 101);
  }
  return table;
}

// buffer[i] = table[PatternIndex(i)] for i in [0, count).
void FillFromTable(void* buffer, DataType dtype, size_t count, const PatternTable& table) {
  VisitDataType(dtype, [&](auto tag) {
    using T = decltype(tag);
    std::array<T, kPatternPeriod> typed;
    for (size_t p = 0; p < kPatternPeriod; ++p) typed[p] = FromDouble<T>(table[p]);
    T* data = static_cast<T*>(buffer);
    for (size_t i = 0; i < count; ++i) data[i] = typed[PatternIndex(i)];
  });
}

void FillWith(void* buffer, DataType dtype, size_t count, double value) {
  VisitDataType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T typed = FromDouble<T>(value);
    std::fill_n(static_cast<T*>(buffer), count, typed);
  });
}

// Where a check runs, for messages about the elements it finds wrong.
struct CheckContext {
  int rank = 0;
  std::string call;  // "all_reduce f32 sum count=1024"
  int64_t reported = 0;
};

constexpr int64_t kMaxReportedPerCheck = 3;

// Counts elements of buffer[0, count) that differ from table[PatternIndex(index_offset + i)];
// with tolerance > 0 a relative difference up to tolerance passes.
int64_t CountWrong(const void* buffer, DataType dtype, size_t count, size_t index_offset,
                   size_t buffer_offset, const PatternTable& table, double tolerance,
                   CheckContext& context) {
  int64_t wrong = 0;
  VisitDataType(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* data = static_cast<const T*>(buffer);
    for (size_t i = 0; i < count; ++i) {
      const double got = ToDouble(data[i]);
      const double expected = table[PatternIndex(index_offset + i)];
      const bool ok = tolerance == 0.0 ? got == expected
                                       : std::fabs(got - expected) <=
                                             tolerance * std::max(1.0, std::fabs(expected));
      if (ok) continue;
      ++wrong;
      if (context.reported < kMaxReportedPerCheck) {
        ++context.reported;
        std::fprintf(stderr,
                     "collectives_perf: rank %d: %s: element %zu: got %.9g, expected %.9g\n",
                     context.rank, context.call.c_str(), buffer_offset + i, got, expected);
      }
    }
  });
  return wrong;
}

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
        CheckMpi(in_place ? MPI_Reduce_scatter_block(MPI_IN_PLACE, send, per_rank, *type,
                                                     MpiOp(op), MPI_COMM_WORLD)
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

// A configuration timed beside ours (--versus): its name and its communicator.
struct Versus {
  std::string name;
  std::unique_ptr<CollectiveCommunication> comm;
};

struct Session {
  std::unique_ptr<CollectiveCommunication> comm;
  std::vector<Versus> versus;
  std::string launcher;  // how the ranks were started, for the header
  bool mpi = false;      // MPI is initialised and the MPI baseline is available
};

CommunicationOptions MakeOptions(const Config& config) {
  CommunicationOptions options;
  options.implementation = ParseImplementation(config.impl);
  options.algorithm = config.algorithm;
  options.chunk_bytes = config.chunk_bytes;
  options.small_message_bytes = config.small_message_bytes;
  options.medium_message_bytes = config.medium_message_bytes;
  options.spin_us = config.spin_us;
  options.yield_us = config.yield_us;
  options.timeout = config.timeout();
  return options;
}

// The --versus communicators, built on the same job after the main one (same order everywhere).
void ConnectVersus(const Config& config, const Job& job, Session& session) {
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
  bool has_baseline = false;  // a baseline was asked for (columns are printed)
  std::optional<double> baseline_time_us;
  double baseline_busbw = 0;
};

class Sweep {
 public:
  Sweep(const Config& config, const Session& session, std::ofstream* csv)
      : config_(config),
        session_(session),
        comm_(*session.comm),
        rank_(comm_.rank()),
        world_size_(comm_.size()),
        csv_(csv),
        send_(config.in_place ? 0 : config.max_bytes, "the send buffer (-e)"),
        recv_(config.max_bytes, "the receive buffer (-e)"),
        rotate_checked_result_(std::getenv("COLLECTIVES_BENCH_TEST_ROTATE_RESULT") != nullptr) {}

  // Runs every case; returns the exit code.
  int Run() {
    PrintHeader();
    int64_t total_wrong = 0;
    double busbw_sum = 0;
    size_t timed_rows = 0;
    if (csv_ != nullptr) WriteCsvHeader();
    for (Collective collective : config_.collectives) {
      PrintTableHeader(collective);
      const std::vector<ReduceOp> ops =
          HasOp(collective) ? config_.ops : std::vector<ReduceOp>{ReduceOp::kSum};
      for (DataType dtype : config_.dtypes) {
        for (ReduceOp op : ops) {
          // Requested bytes of the full result buffer.
          for (size_t bytes : bench::SweepSizes(config_.min_bytes, config_.max_bytes,
                                                config_.step_factor, config_.step_bytes)) {
            const Row row = RunCase(collective, dtype, op, bytes);
            PrintRow(row);
            if (csv_ != nullptr) WriteCsvRow(row);
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
    row.has_baseline = config_.baseline == "mpi";
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
    FillInput(collective, dtype, op, send);
    for (int i = 0; i < config_.warmup_iters; ++i) run_once();

    // One checked call on `comm`: the wrong elements summed over ranks. Out of place, recv starts
    // as the sentinel; in place, the part of it that is not input does (an in-place all-gather's
    // other blocks: else they would still hold the warm-ups' correct result). An in-place
    // all-reduce, broadcast or reduce-scatter has no such part: its buffer is all input, and a
    // broadcast's non-roots start from their own pattern, not the root's.
    auto check_on = [&](CollectiveCommunication& comm) {
      if (!config_.in_place || collective == Collective::kAllGather) {
        FillWith(recv.data, dtype, recv.count, Sentinel(dtype));
      }
      FillInput(collective, dtype, op, send);
      run_on(comm);
      if (rotate_checked_result_ && rank_ == world_size_ - 1) RotateByOneElement(recv);
      int64_t wrong = Verify(collective, dtype, op, send, recv);
      comm_.AllReduce(Tensor{&wrong, 1, DataType::kInt64, Device::Cpu()}, ReduceOp::kSum);
      return wrong;
    };
    if (config_.check) {
      // Every configuration timed is checked: ours and each --versus one.
      row.wrong = check_on(comm_);
      for (auto& versus : session_.versus) *row.wrong += check_on(*versus.comm);
      FillInput(collective, dtype, op, send);
    }

    // `repeat` rounds of `iters` timed calls; with a baseline, ours and MPI's rounds alternate
    // so that both see the same machine. Each round's time is the slowest rank's (the same
    // value on every rank); the row reports the median round.
    auto time_on = [&](CollectiveCommunication& comm, int warmup) {
      for (int i = 0; i < warmup; ++i) run_on(comm);
      comm.Barrier();
      const Clock::time_point start = Clock::now();
      for (int i = 0; i < config_.iters; ++i) run_on(comm);
      double seconds = std::chrono::duration<double>(Clock::now() - start).count() / config_.iters;
      comm.AllReduce(Tensor{&seconds, 1, DataType::kFloat64, Device::Cpu()}, ReduceOp::kMax);
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
#ifdef COLLECTIVES_WITH_MPI
      if (row.has_baseline) {
        const std::optional<double> mpi_seconds = TimeMpiBaseline(
            collective, dtype, op, config_.root, send.data, recv.data, count, per_rank,
            config_.in_place, round == 0 ? config_.warmup_iters : 0, config_.iters);
        if (mpi_seconds) theirs.push_back(*mpi_seconds);
      }
#endif
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      const size_t half = v.size() / 2;
      return v.size() % 2 == 1 ? v[half] : (v[half - 1] + v[half]) / 2;
    };
    for (const std::vector<double>& rounds : versus) row.versus_time_us.push_back(median(rounds) * 1e6);
    const double seconds = median(ours);
    row.time_us = seconds * 1e6;
    row.algbw = static_cast<double>(row.bytes) / seconds / 1e9;
    row.busbw = row.algbw * BusBandwidthFactor(collective, world_size_);
    if (!theirs.empty()) {
      const double mpi_seconds = median(theirs);
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

  void PrintHeader() {
    const size_t hosts = CountHosts(comm_);
    if (rank_ != 0) return;

    PrintBuildHeader("collectives_perf", COLLECTIVES_PERF_BUILD_TYPE);
    std::printf("# world size %d  hosts %zu  launched by %s\n", world_size_, hosts,
                session_.launcher.c_str());
    std::printf("# implementation %s  algorithm %s  hosts' link %s\n",
                ToString(comm_.implementation()),
                config_.algorithm.empty() ? "chosen per call" : config_.algorithm.c_str(),
                hosts == 1 ? "TCP loopback (one host)" : "TCP");
    std::printf(
        "# chunk bytes %s  small-message bytes %s  spin us %s  yield us %s  timeout %.0f s\n",
        config_.chunk_bytes == 0 ? "default" : std::to_string(config_.chunk_bytes).c_str(),
        config_.small_message_bytes == 0 ? "default"
                                         : std::to_string(config_.small_message_bytes).c_str(),
        config_.spin_us < 0 ? "adaptive" : std::to_string(config_.spin_us).c_str(),
        config_.yield_us < 0 ? "default" : std::to_string(config_.yield_us).c_str(),
        config_.timeout_s);
    std::printf(
        "# iterations %d x %d rounds (median)  warm-up %d  check %s  buffers %s  calls %s\n",
        config_.iters, config_.repeat, config_.warmup_iters, config_.check ? "on" : "off",
        config_.in_place ? "in-place" : "out-of-place",
        config_.async ? "asynchronous, each waited on at once" : "blocking");
    for (const Versus& v : session_.versus) {
      std::printf("# versus %s: timed round for round with ours on the same buffers; "
                  "ratio = our time / its time\n",
                  v.name.c_str());
    }
    if (config_.baseline == "mpi") {
      std::printf(
          "# baseline: the matching MPI collective on the same buffers, same iterations "
          "(avg timed as MPI_SUM; f16/bf16: n/a); ratio = our time / MPI time\n");
    }
    std::printf(
        "# busbw = algbw x 2(n-1)/n (all_reduce), x (n-1)/n (all_gather, "
        "reduce_scatter), x 1 (broadcast)\n");
    std::fflush(stdout);
  }

  void PrintTableHeader(Collective collective) {
    if (rank_ != 0) return;
    std::string line1 =
        "#          size         count   type  redop   root       time     algbw     busbw   "
        "#wrong";
    std::string line2 =
        "#           (B)    (elements)                            (us)    (GB/s)    (GB/s)";
    if (config_.baseline == "mpi") {
      line1 += "   mpi time  mpi busbw  ours/mpi";
      line2 += "                (us)     (GB/s)    (time)";
    }
    for (const Versus& v : session_.versus) {
      line1 += Format(" %14s %6s", (v.name + " us").c_str(), "ratio");
    }
    line1 += "  algorithm";
    std::printf("#\n# %s\n%s\n%s\n", ToString(collective), line1.c_str(), line2.c_str());
    std::fflush(stdout);
  }

  void PrintRow(const Row& row) {
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

  // The all-reduce algorithm the communicator runs at this size (the same on every rank).
  std::string AlgorithmOf(const Row& row) const {
    return row.collective == Collective::kAllReduce ? comm_.AllReduceAlgorithm(row.bytes) : "-";
  }

  void WriteCsvHeader() {
    if (rank_ != 0) return;
    *csv_ << "collective,world_size,size_bytes,count,dtype,op,root,time_us,algbw_gbps,"
             "busbw_gbps,wrong";
    if (config_.baseline == "mpi") *csv_ << ",mpi_time_us,mpi_busbw_gbps,time_ratio_ours_over_mpi";
    for (const Versus& v : session_.versus) {
      *csv_ << ',' << v.name << "_time_us,time_ratio_ours_over_" << v.name;
    }
    *csv_ << ",algorithm\n";
  }

  // Columns that do not apply (op of a broadcast, time of a skipped size) are left empty.
  void WriteCsvRow(const Row& row) {
    if (rank_ != 0) return;
    *csv_ << ToString(row.collective) << ',' << world_size_ << ',' << row.bytes << ',' << row.count
          << ',' << ToString(row.dtype) << ',' << (HasOp(row.collective) ? ToString(row.op) : "")
          << ',' << (row.collective == Collective::kBroadcast ? std::to_string(row.root) : "")
          << ',';
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

  const Config& config_;
  const Session& session_;
  CollectiveCommunication& comm_;
  const int rank_;
  const int world_size_;
  std::ofstream* csv_;
  AlignedBuffer send_;
  AlignedBuffer recv_;
  const bool rotate_checked_result_;
};

// ---------------------------------------------------------------------------------------------
// main.
// ---------------------------------------------------------------------------------------------

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
                 "Rounds of -n timed calls per size; the median round is reported (with "
                 "--baseline, ours and MPI's rounds alternate)")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--check", config.check,
               "Verify one extra call per size element by element on every rank; exit 2 on any "
               "wrong element");
  app.add_option("--csv", config.csv_path, "Rank 0 writes the rows to this CSV file");
  app.add_option("--algorithm", config.algorithm,
                 "Force the all-reduce algorithm (CommunicationOptions::algorithm): ring, "
                 "recursive_doubling, halving_doubling, shm, two_level; default: chosen per call");
  app.add_option("--impl", config.impl, "Implementation")
      ->capture_default_str()
      ->check(CLI::IsMember({"ring", "auto"}));
  app.add_flag("--inplace", config.in_place,
               "One buffer for send and recv (the API's in-place forms) instead of two");
  app.add_flag("--async", config.async,
               "Time each call of ours through its asynchronous form (AllReduceAsync, ...), "
               "waited on at once: the hand-off to the progress thread and back (MPI's stay "
               "blocking)");
  app.add_option("--root", config.root, "Root rank of broadcast")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--chunk-bytes", config.chunk_bytes,
                 "CommunicationOptions::chunk_bytes (0: library default; 512K, ...)")
      ->capture_default_str()
      ->transform(bench::BytesSuffix());
  app.add_option("--medium-bytes", config.medium_message_bytes,
                 "CommunicationOptions::medium_message_bytes (0: library default; 1: never "
                 "halving-doubling)")
      ->transform(bench::BytesSuffix());
  app.add_option("--small-bytes", config.small_message_bytes,
                 "CommunicationOptions::small_message_bytes (0: library default)")
      ->capture_default_str()
      ->transform(bench::BytesSuffix());
  app.add_option("--spin-us", config.spin_us, "CommunicationOptions::spin_us (-1: adaptive)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 1'000'000));
  app.add_option("--yield-us", config.yield_us, "CommunicationOptions::yield_us (-1: default)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 1'000'000));
  app.add_option("--timeout", config.timeout_s,
                 "Seconds a collective or the rendezvous may take before it fails")
      ->capture_default_str()
      ->check(bench::TimeoutSeconds());
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
                 "Also time the matching MPI collective (needs an MPI build, under mpirun)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "mpi"}));
}

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
