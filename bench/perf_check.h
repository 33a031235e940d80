// The data of collectives_perf --check: what each rank's input holds and what every result
// element must be, as tables over the element's pattern class, and the counting of the elements
// of a result that differ from them. The pattern is described below.
#ifndef COLLECTIVES_BENCH_PERF_CHECK_H_
#define COLLECTIVES_BENCH_PERF_CHECK_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "collectives/collectives.h"

namespace collectives::perf {

bool IsFloatingPoint(DataType dtype);

// Relative tolerance for floating-point averages (the only inexact result): two units in the
// last place, which covers "sum, then one division or one multiplication by 1/n".
double AverageTolerance(DataType dtype);

// What an unwritten receive buffer holds during a check: NaN for floats (never equal to
// anything), an otherwise unused value for integers.
double Sentinel(DataType dtype);

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

// The tables of a check: this rank's reduction input, every rank's expected reduction result,
// and the input of a copy (broadcast, all-gather) from `rank`.
PatternTable ReductionInputTable(DataType dtype, ReduceOp op, int world_size, int rank);
PatternTable ReductionExpectedTable(DataType dtype, ReduceOp op, int world_size);
PatternTable CopyTable(int rank);

// buffer[i] = table[PatternIndex(i)] for i in [0, count).
void FillFromTable(void* buffer, DataType dtype, size_t count, const PatternTable& table);
void FillWith(void* buffer, DataType dtype, size_t count, double value);

// Where a check runs, for messages about the elements it finds wrong.
struct CheckContext {
  int rank = 0;
  std::string call;  // "all_reduce f32 sum count=1024"
  int64_t reported = 0;
};

// Counts elements of buffer[0, count) that differ from table[PatternIndex(index_offset + i)];
// with tolerance > 0 a relative difference up to tolerance passes.
int64_t CountWrong(const void* buffer, DataType dtype, size_t count, size_t index_offset,
                   size_t buffer_offset, const PatternTable& table, double tolerance,
                   CheckContext& context);

}  // namespace collectives::perf

#endif  // COLLECTIVES_BENCH_PERF_CHECK_H_
