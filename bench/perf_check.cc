// The check data of collectives_perf --check (bench/perf_check.h): conversions of every element
// type to and from double, the input and expected tables, and the count of wrong elements.
#include "bench/perf_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "bench/bench_util.h"
#include "src/core/half.h"

namespace collectives::perf {
namespace {

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
}  // namespace

bool IsFloatingPoint(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat64 ||
         dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}
namespace {

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
}  // namespace

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
namespace {

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
}  // namespace

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
namespace {

constexpr int64_t kMaxReportedPerCheck = 3;
}  // namespace

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
}  // namespace collectives::perf
