// Random floating inputs whose sum depends on the order of the additions, and what an all-reduce
// of them must give: shared by the thread-per-rank bit-identity tests (bit_identity_test.cc) and
// the process-per-rank worker (ring_worker.cc).
//
// The small integers of collective_checks.h add up exactly in any order, so a rank that reduced in
// another order than its peers (and ended with other bits) would pass there. Here every element
// is a random sign times a random mantissa times 2^e, with e spread over more binades than the
// format's mantissa holds, so most sums round, and differently in different orders. The checks:
//  - every rank ends with the same bytes;
//  - where the algorithm fixes the order of the additions, the result is that order's, bit for
//    bit: each addition is done here as the kernels document it (f32 and f64 in their type; f16
//    and bf16 widened to f32, added, and rounded back, every step), and kAvg divides the sum once,
//    correctly rounded (ExpectedInOrder);
//  - whatever the order, the result is within the rounding error of n additions of the exact
//    sum, taken in double (CloseToExactSum).
#ifndef COLLECTIVES_TESTS_RING_FLOAT_INPUTS_H_
#define COLLECTIVES_TESTS_RING_FLOAT_INPUTS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/types.h"
#include "src/core/kernels.h"

namespace collectives::testing {

// Element i of a float buffer, as double (exact for every float type).
inline double FloatAt(DataType dtype, const void* data, size_t i) {
  const auto* bytes = static_cast<const uint8_t*>(data) + i * SizeOf(dtype);
  switch (dtype) {
    case DataType::kFloat32: {
      float f;
      std::memcpy(&f, bytes, 4);
      return f;
    }
    case DataType::kFloat64: {
      double d;
      std::memcpy(&d, bytes, 8);
      return d;
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, bytes, 2);
      return dtype == DataType::kFloat16 ? core::HalfToFloat(h) : core::BFloat16ToFloat(h);
    }
    default:
      return 0;
  }
}

// Rank `rank`'s input of `count` random elements of a float `dtype`; `seed` tells calls apart.
// |x| in [2^-12, 2^7) for f16 (n <= 64 ranks cannot overflow it, and no value is subnormal), in
// [2^-30, 2^30) for the others; the mantissa's bits and the sign are random.
inline std::vector<uint8_t> RandomFloats(DataType dtype, size_t count, int rank, uint64_t seed) {
  uint64_t state = seed * 0x9e3779b97f4a7c15u + uint64_t(rank) * 0xbf58476d1ce4e5b9u +
                   uint64_t(dtype) * 0x94d049bb133111ebu;
  auto next = [&state] {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
  };
  const int low = dtype == DataType::kFloat16 ? -12 : -30;
  const int binades = dtype == DataType::kFloat16 ? 19 : 60;
  std::vector<uint8_t> out(count * SizeOf(dtype));
  for (size_t i = 0; i < count; ++i) {
    const uint64_t r = next();
    const int exponent = low + int((r & 0xffff) % uint64_t(binades));
    const double mantissa = 1.0 + double(next() >> 12) * 0x1p-52;  // [1, 2)
    const double v = std::ldexp((r & 0x10000) ? -mantissa : mantissa, exponent);
    uint8_t* at = out.data() + i * SizeOf(dtype);
    switch (dtype) {
      case DataType::kFloat32: {
        const float f = float(v);
        std::memcpy(at, &f, 4);
        break;
      }
      case DataType::kFloat64:
        std::memcpy(at, &v, 8);
        break;
      case DataType::kFloat16: {
        const uint16_t h = core::FloatToHalf(float(v));
        std::memcpy(at, &h, 2);
        break;
      }
      case DataType::kBFloat16: {
        const uint16_t b = core::FloatToBFloat16(float(v));
        std::memcpy(at, &b, 2);
        break;
      }
      default:
        break;
    }
  }
  return out;
}

// One element as raw bits.
inline uint64_t BitsAt(DataType dtype, const void* data, size_t i) {
  uint64_t bits = 0;
  std::memcpy(&bits, static_cast<const uint8_t*>(data) + i * SizeOf(dtype), SizeOf(dtype));
  return bits;
}

// a + b as the kernels add: in the type itself, f16 and bf16 through f32 (both operands exact in
// f32, the sum rounded to f32 and then to the 16-bit format).
inline uint64_t AddAsKernels(DataType dtype, uint64_t a, uint64_t b) {
  switch (dtype) {
    case DataType::kFloat32: {
      float x, y;
      const uint32_t xa = uint32_t(a), yb = uint32_t(b);
      std::memcpy(&x, &xa, 4);
      std::memcpy(&y, &yb, 4);
      const float s = x + y;
      uint32_t out;
      std::memcpy(&out, &s, 4);
      return out;
    }
    case DataType::kFloat64: {
      double x, y;
      std::memcpy(&x, &a, 8);
      std::memcpy(&y, &b, 8);
      const double s = x + y;
      uint64_t out;
      std::memcpy(&out, &s, 8);
      return out;
    }
    case DataType::kFloat16:
      return core::FloatToHalf(core::HalfToFloat(uint16_t(a)) + core::HalfToFloat(uint16_t(b)));
    case DataType::kBFloat16:
      return core::FloatToBFloat16(core::BFloat16ToFloat(uint16_t(a)) +
                                   core::BFloat16ToFloat(uint16_t(b)));
    default:
      return 0;
  }
}

// x / n, correctly rounded (f16 and bf16 through f32, which holds the quotient closely enough).
inline uint64_t DivideAsKernels(DataType dtype, uint64_t x, size_t n) {
  switch (dtype) {
    case DataType::kFloat32: {
      float v;
      const uint32_t xa = uint32_t(x);
      std::memcpy(&v, &xa, 4);
      const float q = v / float(n);
      uint32_t out;
      std::memcpy(&out, &q, 4);
      return out;
    }
    case DataType::kFloat64: {
      double v;
      std::memcpy(&v, &x, 8);
      const double q = v / double(n);
      uint64_t out;
      std::memcpy(&out, &q, 8);
      return out;
    }
    case DataType::kFloat16:
      return core::FloatToHalf(core::HalfToFloat(uint16_t(x)) / float(n));
    case DataType::kBFloat16:
      return core::FloatToBFloat16(core::BFloat16ToFloat(uint16_t(x)) / float(n));
    default:
      return 0;
  }
}

// The orders of addition of the RING algorithms (src/ring/algorithms.cc), for element `i` of
// a vector of `count` elements cut into n blocks as the ring cuts it. Each takes the ranks'
// values of that element and returns their sum in that order.
enum class Order {
  // Block b (b = Split{count, n}'s block of i) is summed by the ring reduce-scatter: it starts
  // at rank b+1 and each rank adds its own value to what it received: x[b+1], + x[b+2], ...,
  // + x[b]. Ring all-reduce, and ring reduce-scatter over n blocks of `count / n`.
  kRing,
  // Recursive doubling: ranks 0 .. 2*rem-1 fold pairwise (x[2v] + x[2v+1]) into p2 virtual
  // ranks, which then combine with the virtual rank at distance 1, 2, 4, ... (lower + higher).
  kRecursiveDoubling,
  // Halving-doubling (p a power of two): partners at distance p/2, p/4, ..., 1 combine.
  kHalvingDoubling,
};

inline const char* OrderName(Order o) {
  switch (o) {
    case Order::kRing:
      return "ring";
    case Order::kRecursiveDoubling:
      return "recursive_doubling";
    case Order::kHalvingDoubling:
      return "halving_doubling";
  }
  return "?";
}

// The block of element i when `count` elements are cut into n near-equal blocks, the first
// count % n one element longer (the ring's Split).
inline size_t BlockOf(size_t i, size_t count, size_t n) {
  const size_t base = count / n, extra = count % n;
  const size_t long_part = extra * (base + 1);
  return i < long_part ? i / (base + 1) : extra + (i - long_part) / base;
}

// At most this many ranks.
inline constexpr size_t kMaxRanks = 64;

// Sums values[0, n) (bits of each rank's element) in the order of `order`, for an element of
// block `block` (kRing only).
inline uint64_t SumInOrder(DataType dtype, Order order, const uint64_t* values, size_t n,
                           size_t block) {
  if (n == 1) return values[0];
  if (order == Order::kRing) {
    uint64_t acc = values[(block + 1) % n];
    for (size_t k = 2; k <= n; ++k) acc = AddAsKernels(dtype, values[(block + k) % n], acc);
    return acc;
  }
  // Butterflies over a power-of-two number of partial sums.
  uint64_t partial[kMaxRanks];
  uint64_t next[kMaxRanks];
  size_t p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  const size_t rem = order == Order::kRecursiveDoubling ? n - p2 : 0;  // halving-doubling: n == p2
  for (size_t v = 0; v < p2; ++v) {
    partial[v] = v < rem ? AddAsKernels(dtype, values[2 * v], values[2 * v + 1]) : values[v + rem];
  }
  auto combine = [&](size_t distance) {
    for (size_t v = 0; v < p2; ++v) {
      const size_t lo = std::min(v, v ^ distance), hi = std::max(v, v ^ distance);
      next[v] = AddAsKernels(dtype, partial[lo], partial[hi]);
    }
    std::copy(next, next + p2, partial);
  };
  if (order == Order::kRecursiveDoubling) {
    for (size_t d = 1; d < p2; d *= 2) combine(d);
  } else {
    for (size_t d = p2 / 2; d >= 1; d /= 2) combine(d);
  }
  return partial[0];
}

// The result of element `i` of a kSum or kAvg all-reduce of `inputs` (one buffer per rank) that
// adds in `order`, cutting `count` elements into the ring's blocks.
inline uint64_t ExpectedInOrder(DataType dtype, ReduceOp op, Order order,
                                const std::vector<std::vector<uint8_t>>& inputs, size_t count,
                                size_t i) {
  const size_t n = inputs.size();
  uint64_t values[kMaxRanks];
  for (size_t r = 0; r < n; ++r) values[r] = BitsAt(dtype, inputs[r].data(), i);
  const uint64_t sum = SumInOrder(dtype, order, values, n, BlockOf(i, count, n));
  return op == ReduceOp::kAvg ? DivideAsKernels(dtype, sum, n) : sum;
}

// Whether `got` (element i) is within the rounding error of the exact sum (or mean) of the
// ranks' values: n roundings of at most half an ulp of the largest partial sum (bounded by the
// sum of magnitudes), plus one for the division; u = 2^-p, p the format's precision. Doubled,
// for the reference's own rounding in double (which matters for f64 only).
inline bool CloseToExactSum(DataType dtype, ReduceOp op,
                            const std::vector<std::vector<uint8_t>>& inputs, size_t i, double got,
                            std::string* why) {
  const size_t n = inputs.size();
  double exact = 0, magnitude = 0;
  for (const auto& in : inputs) {
    const double v = FloatAt(dtype, in.data(), i);
    exact += v;
    magnitude += std::fabs(v);
  }
  const int precision = dtype == DataType::kFloat32   ? 24
                        : dtype == DataType::kFloat64 ? 53
                        : dtype == DataType::kFloat16 ? 11
                                                      : 8;
  const double u = std::ldexp(1.0, -precision);
  double bound = 2 * double(n) * u * magnitude;
  if (op == ReduceOp::kAvg) {
    exact /= double(n);
    bound = bound / double(n) + 2 * u * std::fabs(exact);
  }
  if (std::fabs(got - exact) <= bound) return true;
  if (why != nullptr) {
    std::ostringstream out;
    out.precision(17);
    out << "element " << i << " is " << got << ", the exact result " << exact << ", more than "
        << bound << " apart";
    *why = out.str();
  }
  return false;
}

// FNV-1a of a byte range: a short fingerprint of a result, for ranks in other processes.
inline uint64_t Fingerprint(const void* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_RING_FLOAT_INPUTS_H_
