// Tests of the reduction kernels (src/core/kernels.h): every (dtype, op) element by element
// against a plain scalar reference, at several counts, with and without aliasing; the f16 and
// bf16 conversions against an independent reference (exhaustively where there are 2^16 cases);
// integer wrap-around; and DivideInPlace for every dtype.
//
// One file: the conversion, reduce and DivideInPlace suites all check against the same
// independent 16-bit references (Format16, RefDecode, RefEncode), the last two over one dtype list.
#include "src/core/kernels.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "collectives/errors.h"
#include "collectives/types.h"

namespace collectives {

// Readable parameters in gtest's failure messages ("f16" rather than "1-byte object <02>").
void PrintTo(DataType dtype, std::ostream* os) { *os << ToString(dtype); }
void PrintTo(ReduceOp op, std::ostream* os) { *os << ToString(op); }

namespace core {
namespace {

__extension__ typedef __int128 Int128;

constexpr DataType kAllDataTypes[] = {
    DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
    DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64,
};
constexpr ReduceOp kAllReduceOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin,
                                      ReduceOp::kMax, ReduceOp::kAvg};
constexpr size_t kCounts[] = {0, 1, 7, 1000, 1000003};

// ---- Independent references for the 16-bit float formats. ----
//
// A format is described by its exponent and mantissa widths; values are decoded with ldexp and
// rounded by searching for the neighbours and comparing in double, never by bit tricks.

struct Format16 {
  int exponent_bits;
  int mantissa_bits;
};
constexpr Format16 kHalf{5, 10};
constexpr Format16 kBFloat16{8, 7};

int Bias(Format16 f) { return (1 << (f.exponent_bits - 1)) - 1; }
uint16_t InfCode(Format16 f) {
  return static_cast<uint16_t>(((1 << f.exponent_bits) - 1) << f.mantissa_bits);
}

bool IsNaN16(Format16 f, uint16_t code) { return (code & 0x7fff) > InfCode(f); }

// The value of a non-negative code; the infinity code decodes as the finite value it would have
// with an unbounded exponent (65536 for f16), which is what rounding compares against.
double DecodeMagnitude(Format16 f, uint16_t code) {
  const int exponent = (code & 0x7fff) >> f.mantissa_bits;
  const int mantissa = code & ((1 << f.mantissa_bits) - 1);
  if (exponent == 0) return std::ldexp(mantissa, 1 - Bias(f) - f.mantissa_bits);
  return std::ldexp(mantissa + (1 << f.mantissa_bits), exponent - Bias(f) - f.mantissa_bits);
}

double RefDecode(Format16 f, uint16_t code) {
  if (IsNaN16(f, code)) return std::numeric_limits<double>::quiet_NaN();
  double magnitude = (code & 0x7fff) == InfCode(f) ? std::numeric_limits<double>::infinity()
                                                   : DecodeMagnitude(f, code);
  return (code & 0x8000) ? -magnitude : magnitude;
}

// Round to nearest, ties to even. NaN gives some NaN code.
uint16_t RefEncode(Format16 f, double x) {
  if (std::isnan(x)) return static_cast<uint16_t>(InfCode(f) | 1);
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  // lo = the largest finite code with value <= a (binary search over monotonic codes).
  uint16_t lo = 0;
  uint16_t hi = InfCode(f);  // exclusive
  while (hi - lo > 1) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    if (DecodeMagnitude(f, mid) <= a) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  if (std::isinf(a)) return sign | InfCode(f);
  const uint16_t up = static_cast<uint16_t>(lo + 1);
  // 2a against lo + up is exact in double (both neighbours have few bits).
  const double twice = 2 * a;
  const double sum = DecodeMagnitude(f, lo) + DecodeMagnitude(f, up);
  uint16_t code;
  if (twice < sum) {
    code = lo;
  } else if (twice > sum) {
    code = up;
  } else {
    code = (lo & 1) ? up : lo;
  }
  return sign | code;
}

float BitsToFloat(uint32_t bits) { return std::bit_cast<float>(bits); }
uint32_t FloatToBits(float f) { return std::bit_cast<uint32_t>(f); }

// ---- Conversions. ----

TEST(HalfConversionTest, WidensEveryCodeExactly) {
  for (uint32_t code = 0; code <= 0xffff; ++code) {
    const uint16_t h = static_cast<uint16_t>(code);
    const float f = HalfToFloat(h);
    SCOPED_TRACE("code 0x" + std::to_string(code));
    if (IsNaN16(kHalf, h)) {
      ASSERT_TRUE(std::isnan(f));
      EXPECT_EQ(std::signbit(f), (h & 0x8000) != 0);
      // The payload moves to the top of the f32 mantissa, and the quiet bit is set (a
      // signalling NaN becomes quiet), as F16C's vcvtph2ps does.
      EXPECT_EQ(FloatToBits(f) & 0x7fffffffu, 0x7fc00000u | (h & 0x3ffu) << 13);
    } else {
      ASSERT_EQ(static_cast<double>(f), RefDecode(kHalf, h));
      EXPECT_EQ(std::signbit(f), (h & 0x8000) != 0);  // -0 stays -0
    }
  }
}

TEST(HalfConversionTest, RoundTripsEveryCode) {
  for (uint32_t code = 0; code <= 0xffff; ++code) {
    const uint16_t h = static_cast<uint16_t>(code);
    const uint16_t back = FloatToHalf(HalfToFloat(h));
    if (IsNaN16(kHalf, h)) {
      EXPECT_EQ(back, h | 0x0200) << std::hex << code << " -> " << back;  // quieted
    } else {
      ASSERT_EQ(back, h) << std::hex << code;
    }
  }
}

TEST(BFloat16ConversionTest, WidensEveryCodeExactly) {
  for (uint32_t code = 0; code <= 0xffff; ++code) {
    const uint16_t b = static_cast<uint16_t>(code);
    const float f = BFloat16ToFloat(b);
    ASSERT_EQ(FloatToBits(f), code << 16);
    if (!IsNaN16(kBFloat16, b)) {
      ASSERT_EQ(static_cast<double>(f), RefDecode(kBFloat16, b)) << std::hex << code;
    }
  }
}

TEST(BFloat16ConversionTest, RoundTripsEveryCode) {
  for (uint32_t code = 0; code <= 0xffff; ++code) {
    const uint16_t b = static_cast<uint16_t>(code);
    const uint16_t back = FloatToBFloat16(BFloat16ToFloat(b));
    if (IsNaN16(kBFloat16, b)) {
      EXPECT_EQ(back, b | 0x0040) << std::hex << code << " -> " << back;  // quieted
    } else {
      ASSERT_EQ(back, b) << std::hex << code;
    }
  }
}

// Floats to check narrowing on: a stride through all 2^32 patterns, and for every pair of
// neighbouring finite codes of the narrow format, their midpoint (a tie) and the floats just
// either side of it.
std::vector<float> NarrowingProbes(Format16 f) {
  std::vector<float> probes;
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 9973) {
    probes.push_back(BitsToFloat(static_cast<uint32_t>(bits)));
  }
  for (uint16_t code = 0; code < InfCode(f); ++code) {
    const double mid =
        (DecodeMagnitude(f, code) + DecodeMagnitude(f, static_cast<uint16_t>(code + 1))) / 2;
    const float m = static_cast<float>(mid);
    EXPECT_EQ(static_cast<double>(m), mid);  // the midpoint is exact in f32
    for (float p : {std::nextafter(m, 0.0f), m, std::nextafter(m, INFINITY)}) {
      probes.push_back(p);
      probes.push_back(-p);
    }
  }
  return probes;
}

TEST(HalfConversionTest, NarrowsLikeTheReference) {
  for (float x : NarrowingProbes(kHalf)) {
    const uint16_t got = FloatToHalf(x);
    if (std::isnan(x)) {
      // Sign, the quiet bit, and the top 10 bits of the payload, as F16C's vcvtps2ph.
      const uint32_t bits = FloatToBits(x);
      ASSERT_EQ(got, ((bits >> 16) & 0x8000) | 0x7e00 | ((bits >> 13) & 0x3ff)) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(got, RefEncode(kHalf, x)) << std::hex << "f32 bits 0x" << FloatToBits(x);
#ifdef __FLT16_MAX__
    // GCC's own conversion (libgcc) as a second, independent opinion.
    ASSERT_EQ(got, std::bit_cast<uint16_t>(static_cast<_Float16>(x)));
#endif
  }
}

TEST(BFloat16ConversionTest, NarrowsLikeTheReference) {
  for (float x : NarrowingProbes(kBFloat16)) {
    const uint16_t got = FloatToBFloat16(x);
    if (std::isnan(x)) {
      // The top half of the bits, with the quiet bit set.
      const uint32_t bits = FloatToBits(x);
      ASSERT_EQ(got, (bits >> 16) | 0x0040) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(got, RefEncode(kBFloat16, x)) << std::hex << "f32 bits 0x" << FloatToBits(x);
  }
}

TEST(HalfConversionTest, KnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);  // the largest finite half
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x03ff), std::ldexp(1023.0f, -24));  // the largest subnormal
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));     // the smallest normal
  EXPECT_EQ(HalfToFloat(0x7c00), INFINITY);
  EXPECT_EQ(HalfToFloat(0xfc00), -INFINITY);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));

  // Ties go to the even neighbour.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // 1 + half an ulp
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // 1 + 1.5 ulp
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);             // half the smallest
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);             // 1.5 x the smallest
  EXPECT_EQ(FloatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  // Rounding up out of the subnormals into the smallest normal.
  EXPECT_EQ(FloatToHalf(std::ldexp(1023.5f, -24)), 0x0400);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -30)), 0x0000);  // underflow to zero
  EXPECT_EQ(FloatToHalf(-std::ldexp(1.0f, -30)), 0x8000);

  // Overflow: from 65520 (the midpoint to 65536, tie to even = inf) up.
  EXPECT_EQ(FloatToHalf(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalf(1e6f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e6f), 0xfc00);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::max()), 0x7c00);
  EXPECT_EQ(FloatToHalf(INFINITY), 0x7c00);
  EXPECT_EQ(FloatToHalf(-INFINITY), 0xfc00);
  EXPECT_TRUE(IsNaN16(kHalf, FloatToHalf(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsNaN16(kHalf, FloatToHalf(-std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsNaN16(kHalf, FloatToHalf(std::numeric_limits<float>::signaling_NaN())));
  EXPECT_TRUE(IsNaN16(kHalf, FloatToHalf(BitsToFloat(0x7f800001))));  // payload only in low bits
}

TEST(BFloat16ConversionTest, KnownValues) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie, to even
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie, to even
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x3f808001)), 0x3f81);          // just above a tie
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x00000001)), 0x0000);          // smallest f32 subnormal
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x00008000)), 0x0000);          // subnormal tie, to even
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x00018000)), 0x0002);
  EXPECT_EQ(BFloat16ToFloat(0x0001), BitsToFloat(0x00010000));            // smallest bf16 subnormal
  EXPECT_EQ(FloatToBFloat16(BitsToFloat(0x7f7f7fff)), 0x7f7f);            // stays finite
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // overflows to inf
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::max()), 0xff80);
  EXPECT_EQ(FloatToBFloat16(INFINITY), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-INFINITY), 0xff80);
  EXPECT_TRUE(IsNaN16(kBFloat16, FloatToBFloat16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsNaN16(kBFloat16, FloatToBFloat16(BitsToFloat(0x7f800001))));  // would round to inf
  EXPECT_TRUE(IsNaN16(kBFloat16, FloatToBFloat16(BitsToFloat(0x7fffffff))));  // would carry out
  EXPECT_TRUE(IsNaN16(kBFloat16, FloatToBFloat16(BitsToFloat(0xffffffff))));
}

// ---- Reduce against a scalar reference. ----

// Scalar reference on one element. Integer sum and prod wrap; float min/max return NaN if
// either input is NaN, and b when the inputs compare equal.
template <typename T>
T RefApply(ReduceOp op, T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return static_cast<T>(static_cast<uint64_t>(static_cast<U>(a)) +
                              static_cast<uint64_t>(static_cast<U>(b)));
      case ReduceOp::kProd:
        return static_cast<T>(static_cast<uint64_t>(static_cast<U>(a)) *
                              static_cast<uint64_t>(static_cast<U>(b)));
      case ReduceOp::kMin:
        return a < b ? a : b;
      case ReduceOp::kMax:
        return a > b ? a : b;
    }
  } else {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return a + b;
      case ReduceOp::kProd:
        return a * b;
      case ReduceOp::kMin:
        if (std::isnan(a)) return a;
        if (std::isnan(b)) return b;
        return a < b ? a : b;
      case ReduceOp::kMax:
        if (std::isnan(a)) return a;
        if (std::isnan(b)) return b;
        return a > b ? a : b;
    }
  }
  return T{};
}

// One element of any dtype, as raw bits in a uint64_t, reduced by the reference.
uint64_t RefElement(DataType dtype, ReduceOp op, uint64_t a, uint64_t b) {
  // f16 / bf16: widen exactly, reduce in f32, round with the independent reference.
  auto reduce16 = [&](Format16 f) -> uint64_t {
    const float wide_a = static_cast<float>(RefDecode(f, static_cast<uint16_t>(a)));
    const float wide_b = static_cast<float>(RefDecode(f, static_cast<uint16_t>(b)));
    return RefEncode(f, RefApply(op, wide_a, wide_b));
  };
  switch (dtype) {
    case DataType::kFloat32:
      return FloatToBits(RefApply(op, BitsToFloat(static_cast<uint32_t>(a)),
                                  BitsToFloat(static_cast<uint32_t>(b))));
    case DataType::kFloat64:
      return std::bit_cast<uint64_t>(
          RefApply(op, std::bit_cast<double>(a), std::bit_cast<double>(b)));
    case DataType::kFloat16:
      return reduce16(kHalf);
    case DataType::kBFloat16:
      return reduce16(kBFloat16);
    case DataType::kInt8:
      return static_cast<uint8_t>(RefApply(op, static_cast<int8_t>(a), static_cast<int8_t>(b)));
    case DataType::kUInt8:
      return RefApply(op, static_cast<uint8_t>(a), static_cast<uint8_t>(b));
    case DataType::kInt32:
      return static_cast<uint32_t>(RefApply(op, static_cast<int32_t>(a), static_cast<int32_t>(b)));
    case DataType::kInt64:
      return static_cast<uint64_t>(RefApply(op, static_cast<int64_t>(a), static_cast<int64_t>(b)));
  }
  return 0;
}

// Raw bits of element i of a buffer of dtype.
uint64_t Load(DataType dtype, const std::vector<unsigned char>& buffer, size_t offset, size_t i) {
  uint64_t bits = 0;
  std::memcpy(&bits, buffer.data() + (offset + i) * SizeOf(dtype), SizeOf(dtype));
  return bits;
}

bool IsNaNBits(DataType dtype, uint64_t bits) {
  switch (dtype) {
    case DataType::kFloat32:
      return std::isnan(BitsToFloat(static_cast<uint32_t>(bits)));
    case DataType::kFloat64:
      return std::isnan(std::bit_cast<double>(bits));
    case DataType::kFloat16:
      return IsNaN16(kHalf, static_cast<uint16_t>(bits));
    case DataType::kBFloat16:
      return IsNaN16(kBFloat16, static_cast<uint16_t>(bits));
    default:
      return false;
  }
}

// Random elements of dtype, with the special values of float types mixed in, as raw bytes.
std::vector<unsigned char> RandomBuffer(DataType dtype, size_t count, std::mt19937_64& rng) {
  std::vector<unsigned char> buffer(count * SizeOf(dtype));
  std::uniform_real_distribution<double> moderate(-4.0, 4.0);
  std::uniform_int_distribution<int> pick(0, 15);
  const double specials[] = {0.0,     -0.0, INFINITY, -INFINITY, NAN, 1e-40,
                             -1e-310, 1e30, -1e300,   65504.0,   3e-8};
  for (size_t i = 0; i < count; ++i) {
    const uint64_t raw = rng();
    const int choice = pick(rng);
    const double value = choice < 11 ? specials[choice] : moderate(rng);
    const bool special_or_moderate = choice < 11 || (raw & 1);
    unsigned char* out = buffer.data() + i * SizeOf(dtype);
    switch (dtype) {
      case DataType::kFloat32: {
        const uint32_t bits = special_or_moderate ? FloatToBits(static_cast<float>(value))
                                                  : static_cast<uint32_t>(raw >> 8);
        std::memcpy(out, &bits, 4);
        break;
      }
      case DataType::kFloat64: {
        const uint64_t bits = special_or_moderate ? std::bit_cast<uint64_t>(value) : raw;
        std::memcpy(out, &bits, 8);
        break;
      }
      case DataType::kFloat16:
      case DataType::kBFloat16: {
        // Every 16-bit pattern is a value; uniform bits cover subnormals, inf and NaN.
        const uint16_t bits = static_cast<uint16_t>(raw >> 16);
        std::memcpy(out, &bits, 2);
        break;
      }
      default:
        // Integers: full range, so that sums and products wrap.
        std::memcpy(out, &raw, SizeOf(dtype));
        break;
    }
  }
  return buffer;
}

// How dst, a and b relate.
enum class Aliasing { kDistinct, kDstIsA, kDstIsB, kAllSame, kSameInputs, kMisaligned };
constexpr Aliasing kAllAliasings[] = {Aliasing::kDistinct,   Aliasing::kDstIsA,
                                      Aliasing::kDstIsB,     Aliasing::kAllSame,
                                      Aliasing::kSameInputs, Aliasing::kMisaligned};
const char* ToString(Aliasing aliasing) {
  switch (aliasing) {
    case Aliasing::kDistinct:
      return "distinct";
    case Aliasing::kDstIsA:
      return "dst==a";
    case Aliasing::kDstIsB:
      return "dst==b";
    case Aliasing::kAllSame:
      return "dst==a==b";
    case Aliasing::kSameInputs:
      return "a==b";
    case Aliasing::kMisaligned:
      return "misaligned";
  }
  return "?";
}

class ReduceEveryTypeAndOpTest : public testing::TestWithParam<std::tuple<DataType, ReduceOp>> {};

TEST_P(ReduceEveryTypeAndOpTest, MatchesScalarReference) {
  const auto [dtype, op] = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(dtype) * 131 + static_cast<uint64_t>(op));
  for (size_t count : kCounts) {
    for (Aliasing aliasing : kAllAliasings) {
      // The largest count only with the common cases, to keep the test quick.
      if (count > 100000 && aliasing != Aliasing::kDistinct && aliasing != Aliasing::kDstIsA &&
          aliasing != Aliasing::kDstIsB) {
        continue;
      }
      SCOPED_TRACE("count " + std::to_string(count) + ", " + ToString(aliasing));
      // Buffers have 3 spare elements, for the misaligned case (a, b and dst at offsets 1, 3, 0).
      std::vector<unsigned char> a = RandomBuffer(dtype, count + 3, rng);
      std::vector<unsigned char> b = RandomBuffer(dtype, count + 3, rng);
      std::vector<unsigned char> dst = RandomBuffer(dtype, count + 3, rng);
      const size_t a_offset = aliasing == Aliasing::kMisaligned ? 1 : 0;
      const size_t b_offset = aliasing == Aliasing::kMisaligned ? 3 : 0;
      if (aliasing == Aliasing::kAllSame || aliasing == Aliasing::kSameInputs) b = a;

      // The expected result, from copies of the inputs taken before the call.
      std::vector<uint64_t> expected(count);
      for (size_t i = 0; i < count; ++i) {
        expected[i] =
            RefElement(dtype, op, Load(dtype, a, a_offset, i), Load(dtype, b, b_offset, i));
      }

      const size_t size = SizeOf(dtype);
      unsigned char* a_ptr = a.data() + a_offset * size;
      unsigned char* b_ptr = b.data() + b_offset * size;
      unsigned char* dst_ptr = dst.data();
      std::vector<unsigned char>* dst_buffer = &dst;
      if (aliasing == Aliasing::kAllSame || aliasing == Aliasing::kSameInputs) b_ptr = a_ptr;
      if (aliasing == Aliasing::kDstIsA || aliasing == Aliasing::kAllSame) {
        dst_ptr = a_ptr;
        dst_buffer = &a;
      } else if (aliasing == Aliasing::kDstIsB) {
        dst_ptr = b_ptr;
        dst_buffer = &b;
      }
      const size_t dst_offset = static_cast<size_t>(dst_ptr - dst_buffer->data()) / size;
      const std::vector<unsigned char> before = *dst_buffer;

      Reduce(dtype, op, dst_ptr, a_ptr, b_ptr, count);

      size_t mismatches = 0;
      for (size_t i = 0; i < count; ++i) {
        const uint64_t got = Load(dtype, *dst_buffer, dst_offset, i);
        const bool ok =
            got == expected[i] || (IsNaNBits(dtype, got) && IsNaNBits(dtype, expected[i]));
        if (!ok && ++mismatches <= 5) {
          ADD_FAILURE() << "element " << i << ": got 0x" << std::hex << got << ", expected 0x"
                        << expected[i];
        }
      }
      ASSERT_EQ(mismatches, 0u);
      // Nothing outside dst[0, count) was written.
      for (size_t byte = 0; byte < before.size(); ++byte) {
        const bool inside = byte >= dst_offset * size && byte < (dst_offset + count) * size;
        if (!inside) {
          ASSERT_EQ((*dst_buffer)[byte], before[byte]) << "byte " << byte;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllDataTypesAndOps, ReduceEveryTypeAndOpTest,
    testing::Combine(testing::ValuesIn(kAllDataTypes), testing::ValuesIn(kAllReduceOps)),
    [](const testing::TestParamInfo<ReduceEveryTypeAndOpTest::ParamType>& param_info) {
      return std::string(ToString(std::get<0>(param_info.param))) + "_" +
             ToString(std::get<1>(param_info.param));
    });

// The loops do the elements before the first 64-byte boundary of one operand one by one, then
// the rest in vectors: every start offset within a cache line (so every head length, 0 to 63
// bytes), with the other input at a different offset, and counts around the head and the
// vector chunk, against the reference. Buffers come from a 64-byte aligned pool, so the offsets
// are the addresses' offsets.
TEST(ReduceTest, EveryStartWithinACacheLine) {
  std::mt19937_64 rng(23);
  const size_t counts[] = {0, 1, 3, 15, 16, 17, 63, 64, 65, 127, 200, 1001};
  for (DataType dtype : kAllDataTypes) {
    const size_t size = SizeOf(dtype);
    const size_t max_count = 1001;
    for (size_t shift = 0; shift < 64; shift += size) {
      SCOPED_TRACE(std::string(ToString(dtype)) + ", offset " + std::to_string(shift) + " B");
      const size_t other = (shift + 3 * size) % 64;  // b elsewhere in its line
      for (size_t count : counts) {
        for (Aliasing aliasing : {Aliasing::kDistinct, Aliasing::kDstIsA, Aliasing::kDstIsB}) {
          SCOPED_TRACE("count " + std::to_string(count) + ", " + ToString(aliasing));
          alignas(64) static unsigned char pool[3][(1001 + 64) * 8 + 64];
          const std::vector<unsigned char> a_in = RandomBuffer(dtype, max_count + 64, rng);
          const std::vector<unsigned char> b_in = RandomBuffer(dtype, max_count + 64, rng);
          std::memcpy(pool[0], a_in.data(), a_in.size());
          std::memcpy(pool[1], b_in.data(), b_in.size());
          std::memset(pool[2], 0x5a, sizeof(pool[2]));
          unsigned char* a = pool[0] + shift;
          unsigned char* b = pool[1] + other;
          unsigned char* dst = aliasing == Aliasing::kDstIsA   ? a
                               : aliasing == Aliasing::kDstIsB ? b
                                                               : pool[2] + shift;
          std::vector<uint64_t> expected(count);
          for (size_t i = 0; i < count; ++i) {
            uint64_t x = 0;
            uint64_t y = 0;
            std::memcpy(&x, a + i * size, size);
            std::memcpy(&y, b + i * size, size);
            expected[i] = RefElement(dtype, ReduceOp::kSum, x, y);
          }
          Reduce(dtype, ReduceOp::kSum, dst, a, b, count);
          for (size_t i = 0; i < count; ++i) {
            uint64_t got = 0;
            std::memcpy(&got, dst + i * size, size);
            ASSERT_TRUE(got == expected[i] ||
                        (IsNaNBits(dtype, got) && IsNaNBits(dtype, expected[i])))
                << "element " << i << ": got 0x" << std::hex << got << ", expected 0x"
                << expected[i];
          }
          if (aliasing == Aliasing::kDistinct) {
            for (size_t byte = 0; byte < sizeof(pool[2]); ++byte) {
              const bool inside = byte >= shift && byte < shift + count * size;
              if (!inside) {
                ASSERT_EQ(pool[2][byte], 0x5a) << "byte " << byte;
              }
            }
          }
        }
      }
    }
  }
}

// ---- Specific behaviours. ----

template <typename T>
T ReduceOne(DataType dtype, ReduceOp op, T a, T b) {
  T dst{};
  Reduce(dtype, op, &dst, &a, &b, 1);
  return dst;
}

TEST(ReduceTest, IntegerSumAndProductWrap) {
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kSum, 127, 1), -128);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kSum, -128, -1), 127);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kProd, 16, 16), 0);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kProd, -128, -1), -128);
  EXPECT_EQ(ReduceOne<uint8_t>(DataType::kUInt8, ReduceOp::kSum, 255, 1), 0);
  EXPECT_EQ(ReduceOne<uint8_t>(DataType::kUInt8, ReduceOp::kProd, 255, 255), 1);
  constexpr int32_t kMax32 = std::numeric_limits<int32_t>::max();
  constexpr int32_t kMin32 = std::numeric_limits<int32_t>::min();
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kSum, kMax32, 1), kMin32);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kAvg, kMax32, 1), kMin32);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kProd, 65536, 65536), 0);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kProd, kMin32, -1), kMin32);
  constexpr int64_t kMax64 = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin64 = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kSum, kMax64, 1), kMin64);
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kProd, kMin64, -1), kMin64);
  EXPECT_EQ(
      ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kProd, int64_t{1} << 32, int64_t{1} << 32), 0);
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kMin, kMin64, kMax64), kMin64);
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kMax, kMin64, kMax64), kMax64);
}

TEST(ReduceTest, FloatMinMaxPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (ReduceOp op : {ReduceOp::kMin, ReduceOp::kMax}) {
    EXPECT_TRUE(std::isnan(ReduceOne<float>(DataType::kFloat32, op, nan, 1.0f)));
    EXPECT_TRUE(std::isnan(ReduceOne<float>(DataType::kFloat32, op, 1.0f, nan)));
    EXPECT_TRUE(std::isnan(ReduceOne<double>(DataType::kFloat64, op, 1.0, NAN)));
    EXPECT_TRUE(IsNaN16(kHalf, ReduceOne<uint16_t>(DataType::kFloat16, op, 0x3c00, 0x7e00)));
    EXPECT_TRUE(IsNaN16(kBFloat16, ReduceOne<uint16_t>(DataType::kBFloat16, op, 0x7fc0, 0x3f80)));
  }
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMin, -INFINITY, 3.0f), -INFINITY);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMax, -INFINITY, 3.0f), 3.0f);
}

TEST(ReduceTest, HalfSumRoundsAndOverflows) {
  // 1 + 2^-11 is a tie between 1 and 1 + 2^-10: even, so 1.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, 0x3c00, 0x1000), 0x3c00);
  // 65504 + 65504 overflows to inf; 65504 + 8 rounds back to 65504 (below the 65520 midpoint).
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, 0x7bff, 0x7bff), 0x7c00);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, 0x7bff, 0x4800), 0x7bff);
  // Two smallest subnormals.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, 0x0001, 0x0001), 0x0002);
  // bf16: the largest finite doubled is inf.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kSum, 0x7f7f, 0x7f7f), 0x7f80);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kProd, 0x4000, 0xc040), 0xc0c0);
}

// The kAvg examples types.h gives, for 2 ranks: a sum, then DivideInPlace.
template <typename T>
T AvgOfTwo(DataType dtype, T a, T b) {
  T sum = ReduceOne<T>(dtype, ReduceOp::kAvg, a, b);
  DivideInPlace(dtype, &sum, 1, 2);
  return sum;
}

TEST(ReduceTest, TypesHeaderAvgExamplesHold) {
  EXPECT_EQ(AvgOfTwo<uint8_t>(DataType::kUInt8, 200, 200), 72);
  EXPECT_EQ(AvgOfTwo<uint16_t>(DataType::kFloat16, FloatToHalf(65504), FloatToHalf(15)),
            FloatToHalf(32752));
  EXPECT_EQ(AvgOfTwo<uint16_t>(DataType::kFloat16, FloatToHalf(65504), FloatToHalf(16)), 0x7c00);
  EXPECT_EQ(AvgOfTwo<uint16_t>(DataType::kFloat16, FloatToHalf(40000), FloatToHalf(40000)), 0x7c00);
}

TEST(ReduceTest, UnknownDataTypeOrOpIsInvalidArgument) {
  float a = 1, b = 2, dst = 0;
  try {
    Reduce(static_cast<DataType>(99), ReduceOp::kSum, &dst, &a, &b, 1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find("99"), std::string::npos) << e.message();
  }
  try {
    Reduce(DataType::kFloat32, static_cast<ReduceOp>(42), &dst, &a, &b, 1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find("42"), std::string::npos) << e.message();
  }
}

TEST(ReduceTest, ZeroCountTouchesNothing) {
  for (DataType dtype : kAllDataTypes) {
    for (ReduceOp op : kAllReduceOps) Reduce(dtype, op, nullptr, nullptr, nullptr, 0);
  }
}

// ---- DivideInPlace. ----

constexpr size_t kDivisors[] = {1, 2, 3, 7, 8, 1000};

template <typename T>
std::vector<T> IntegerValues(size_t count, std::mt19937_64& rng) {
  std::vector<T> values = {std::numeric_limits<T>::min(),
                           std::numeric_limits<T>::max(),
                           0,
                           1,
                           static_cast<T>(-1),
                           static_cast<T>(-7),
                           7,
                           6,
                           static_cast<T>(-6)};
  while (values.size() < count) values.push_back(static_cast<T>(rng()));
  return values;
}

template <typename T>
void ExpectIntegerDivision(DataType dtype, std::mt19937_64& rng) {
  for (size_t divisor : kDivisors) {
    SCOPED_TRACE("divisor " + std::to_string(divisor));
    const std::vector<T> input = IntegerValues<T>(1003, rng);
    std::vector<T> data = input;
    DivideInPlace(dtype, data.data(), data.size(), divisor);
    for (size_t i = 0; i < data.size(); ++i) {
      // __int128 division truncates toward zero, whatever T is.
      const T expected =
          static_cast<T>(static_cast<Int128>(input[i]) / static_cast<Int128>(divisor));
      ASSERT_EQ(data[i], expected) << "element " << i << " = " << +input[i];
    }
  }
}

TEST(DivideInPlaceTest, IntegersTruncateTowardZero) {
  std::mt19937_64 rng(7);
  ExpectIntegerDivision<int8_t>(DataType::kInt8, rng);
  ExpectIntegerDivision<uint8_t>(DataType::kUInt8, rng);
  ExpectIntegerDivision<int32_t>(DataType::kInt32, rng);
  ExpectIntegerDivision<int64_t>(DataType::kInt64, rng);

  int32_t i32[] = {-7, 7, std::numeric_limits<int32_t>::min()};
  DivideInPlace(DataType::kInt32, i32, 3, 2);
  EXPECT_EQ(i32[0], -3);
  EXPECT_EQ(i32[1], 3);
  EXPECT_EQ(i32[2], std::numeric_limits<int32_t>::min() / 2);

  // Divisors too large for the element type.
  int64_t i64[] = {std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), -5};
  DivideInPlace(DataType::kInt64, i64, 3, size_t{1} << 63);
  EXPECT_EQ(i64[0], -1);
  EXPECT_EQ(i64[1], 0);
  EXPECT_EQ(i64[2], 0);
  int32_t big[] = {std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()};
  DivideInPlace(DataType::kInt32, big, 2, std::numeric_limits<size_t>::max());
  EXPECT_EQ(big[0], 0);
  EXPECT_EQ(big[1], 0);
  DivideInPlace(DataType::kInt32, big, 2, size_t{1} << 31);
  EXPECT_EQ(big[0], 0);
}

template <typename T>
void ExpectFloatDivision(DataType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<T> dist(-1000, 1000);
  for (size_t divisor : kDivisors) {
    std::vector<T> input = {0,
                            -0.0,
                            1,
                            3,
                            INFINITY,
                            -INFINITY,
                            std::numeric_limits<T>::denorm_min(),
                            std::numeric_limits<T>::max()};
    while (input.size() < 1003) input.push_back(dist(rng));
    std::vector<T> data = input;
    DivideInPlace(dtype, data.data(), data.size(), divisor);
    for (size_t i = 0; i < data.size(); ++i) {
      ASSERT_EQ(data[i], input[i] / static_cast<T>(divisor)) << "element " << i;
    }
  }
  std::vector<T> nan = {std::numeric_limits<T>::quiet_NaN()};
  DivideInPlace(dtype, nan.data(), 1, 4);
  EXPECT_TRUE(std::isnan(nan[0]));
}

TEST(DivideInPlaceTest, FloatsDivideExactly) {
  std::mt19937_64 rng(11);
  ExpectFloatDivision<float>(DataType::kFloat32, rng);
  ExpectFloatDivision<double>(DataType::kFloat64, rng);
  // A case where multiplying by the reciprocal rounds differently from dividing.
  float x[] = {3.0f};
  DivideInPlace(DataType::kFloat32, x, 1, 3);
  EXPECT_EQ(x[0], 1.0f);
}

TEST(DivideInPlaceTest, HalfTypesAreCorrectlyRounded) {
  for (auto [dtype, format] :
       {std::pair{DataType::kFloat16, kHalf}, std::pair{DataType::kBFloat16, kBFloat16}}) {
    SCOPED_TRACE(ToString(dtype));
    for (size_t divisor : kDivisors) {
      std::vector<uint16_t> data(65536);
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint16_t>(i);
      DivideInPlace(dtype, data.data(), data.size(), divisor);
      for (size_t i = 0; i < data.size(); ++i) {
        const uint16_t code = static_cast<uint16_t>(i);
        if (IsNaN16(format, code)) {
          ASSERT_TRUE(IsNaN16(format, data[i]));
          continue;
        }
        // Exact quotient rounded once (the double quotient is rounded, but 53 bits of it are
        // far more than enough for a correctly rounded 16-bit result).
        const uint16_t expected =
            RefEncode(format, RefDecode(format, code) / static_cast<double>(divisor));
        ASSERT_EQ(data[i], expected) << std::hex << "code 0x" << i << " / " << std::dec << divisor;
      }
    }
  }
}

TEST(DivideInPlaceTest, ZeroDivisorIsInvalidArgument) {
  float x[] = {1.0f};
  try {
    DivideInPlace(DataType::kFloat32, x, 1, 0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  try {
    DivideInPlace(static_cast<DataType>(200), x, 1, 2);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
}

// NaN bits as F16C converts them: widening keeps the sign and payload and sets the quiet bit
// (bf16 widens exactly, by a shift); narrowing keeps the sign and the payload's top bits and sets
// the quiet bit.
uint32_t WidenNaNLikeF16c(DataType dtype, uint16_t code) {
  if (dtype == DataType::kBFloat16) return uint32_t{code} << 16;
  return (uint32_t{code} & 0x8000u) << 16 | 0x7fc00000u | (uint32_t{code} & 0x3ffu) << 13;
}
uint16_t NarrowNaNLikeF16c(DataType dtype, uint32_t bits) {
  if (dtype == DataType::kBFloat16) return static_cast<uint16_t>(bits >> 16 | 0x0040u);
  return static_cast<uint16_t>((bits >> 16 & 0x8000u) | 0x7e00u | (bits >> 13 & 0x3ffu));
}

// The vector paths (F16C / AVX2, taken for runs of 8 when the CPU has them) agree bit for bit
// with the scalar path (taken for a single element, and for the tail of a run) on every pair of
// codes tried, NaNs included, signalling ones too, except two NaNs summed or multiplied (either
// may come out: the exception types.h states): ranks whose CPUs take different paths (or a
// rank whose kernels run with COLLECTIVES_KERNEL_ISA=baseline) reduce the same inputs, and
// recursive doubling has both partners compute a sum, so different NaN bits would leave ranks with
// different results. Both follow F16C's conversions; the NaN results are checked against them
// too, so that the run with only the scalar path (baseline) checks it.
TEST(ReduceTest, VectorAndScalarHalfPathsAgree) {
  for (DataType dtype : {DataType::kFloat16, DataType::kBFloat16}) {
    const Format16 format = dtype == DataType::kFloat16 ? kHalf : kBFloat16;
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax}) {
      SCOPED_TRACE(std::string(ToString(dtype)) + " " + ToString(op));
      std::vector<uint16_t> a(65536), b(65536), vector_out(65536), scalar_out(65536);
      for (size_t i = 0; i < a.size(); ++i) {
        a[i] = static_cast<uint16_t>(i);
        b[i] = static_cast<uint16_t>((i * 40503u + 17u) & 0xffffu);
      }
      Reduce(dtype, op, vector_out.data(), a.data(), b.data(), a.size());
      for (size_t i = 0; i < a.size(); ++i) Reduce(dtype, op, &scalar_out[i], &a[i], &b[i], 1);
      size_t nan_inputs = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        const bool a_nan = IsNaN16(format, a[i]);
        const bool b_nan = IsNaN16(format, b[i]);
        if (a_nan || b_nan) ++nan_inputs;
        const uint16_t from_a =
            a_nan ? NarrowNaNLikeF16c(dtype, WidenNaNLikeF16c(dtype, a[i])) : uint16_t{0};
        const uint16_t from_b =
            b_nan ? NarrowNaNLikeF16c(dtype, WidenNaNLikeF16c(dtype, b[i])) : uint16_t{0};
        if (a_nan && b_nan && (op == ReduceOp::kSum || op == ReduceOp::kProd)) {
          // Two NaNs: the hardware returns its first operand, whichever the compiler put first,
          // on either path (types.h: the one exception to identical bits). Which one may differ
          // between the paths, and between builds (the sanitizers' code generation, for one).
          for (const uint16_t out : {vector_out[i], scalar_out[i]}) {
            ASSERT_TRUE(out == from_a || out == from_b)
                << std::hex << "0x" << a[i] << " , 0x" << b[i] << " gave 0x" << out;
          }
          continue;
        }
        ASSERT_EQ(vector_out[i], scalar_out[i])
            << std::hex << "0x" << a[i] << " , 0x" << b[i] << ": vector path 0x" << vector_out[i]
            << ", scalar path 0x" << scalar_out[i];
        if (!a_nan && !b_nan) continue;
        // One NaN, or min and max, which put a NaN in a back whole: that NaN, quieted.
        ASSERT_EQ(vector_out[i], a_nan ? from_a : from_b)
            << std::hex << "0x" << a[i] << " , 0x" << b[i] << " gave 0x" << vector_out[i];
      }
      EXPECT_GT(nan_inputs, 400u);  // f16 has 2046 NaN codes, bf16 254
    }
  }
}

// The same for the division that finishes kAvg: every code, NaNs (signalling ones too) quieted
// with their payload, by the vector path (runs of 8) and the scalar one (single elements).
TEST(DivideInPlaceTest, VectorAndScalarHalfPathsAgree) {
  for (DataType dtype : {DataType::kFloat16, DataType::kBFloat16}) {
    const Format16 format = dtype == DataType::kFloat16 ? kHalf : kBFloat16;
    for (size_t divisor : {size_t{1}, size_t{3}}) {
      std::vector<uint16_t> vector_out(65536), scalar_out(65536);
      for (size_t i = 0; i < vector_out.size(); ++i) {
        vector_out[i] = scalar_out[i] = static_cast<uint16_t>(i);
      }
      DivideInPlace(dtype, vector_out.data(), vector_out.size(), divisor);
      for (uint16_t& x : scalar_out) DivideInPlace(dtype, &x, 1, divisor);
      for (size_t i = 0; i < vector_out.size(); ++i) {
        ASSERT_EQ(vector_out[i], scalar_out[i])
            << ToString(dtype) << " 0x" << std::hex << i << " / " << std::dec << divisor;
        const uint16_t code = static_cast<uint16_t>(i);
        if (IsNaN16(format, code)) {  // quieted, payload kept
          ASSERT_EQ(vector_out[i], NarrowNaNLikeF16c(dtype, WidenNaNLikeF16c(dtype, code)))
              << ToString(dtype) << " 0x" << std::hex << i;
        }
      }
    }
  }
}

// kAvg over many ranks: an f32 quotient rounded to f32 and then to 16 bits can land on a tie of
// the 16-bit format that the exact quotient is not on, once the divisor has more bits than the
// format (f16 0x3956 / 8195 gave 0x0556 for 0x0555; bf16 subnormal 0x0690 / 69391 gave 0x0008
// for 0x0009). Every code, the NaNs quieted with their payload as below.
TEST(DivideInPlaceTest, HalfTypesAreCorrectlyRoundedByLargeDivisors) {
  for (auto [dtype, format] :
       {std::pair{DataType::kFloat16, kHalf}, std::pair{DataType::kBFloat16, kBFloat16}}) {
    SCOPED_TRACE(ToString(dtype));
    for (size_t divisor : {size_t{4096}, size_t{8195}, size_t{69391}, size_t{92671},
                           size_t{1000003}, size_t{1} << 40}) {
      std::vector<uint16_t> data(65536);
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint16_t>(i);
      DivideInPlace(dtype, data.data(), data.size(), divisor);
      for (size_t i = 0; i < data.size(); ++i) {
        const uint16_t code = static_cast<uint16_t>(i);
        const uint16_t expected =
            IsNaN16(format, code)
                ? NarrowNaNLikeF16c(dtype, WidenNaNLikeF16c(dtype, code))
                : RefEncode(format, RefDecode(format, code) / static_cast<double>(divisor));
        ASSERT_EQ(data[i], expected) << std::hex << "code 0x" << i << " / " << std::dec << divisor;
      }
    }
  }
}

// As ReduceTest.EveryStartWithinACacheLine, for the division that finishes kAvg.
TEST(DivideInPlaceTest, EveryStartWithinACacheLine) {
  alignas(64) static float f32[1001 + 16];
  alignas(64) static int32_t i32[1001 + 16];
  for (size_t shift = 0; shift < 16; ++shift) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{15}, size_t{17}, size_t{65}, size_t{1001}}) {
      SCOPED_TRACE("offset " + std::to_string(4 * shift) + " B, count " + std::to_string(count));
      for (size_t i = 0; i < std::size(f32); ++i) {
        f32[i] = static_cast<float>(i) * 1.5f - 300.0f;
        i32[i] = static_cast<int32_t>(i * 7) - 3000;
      }
      DivideInPlace(DataType::kFloat32, f32 + shift, count, 3);
      DivideInPlace(DataType::kInt32, i32 + shift, count, 3);
      for (size_t i = 0; i < std::size(f32); ++i) {
        const bool inside = i >= shift && i < shift + count;
        const float f = static_cast<float>(i) * 1.5f - 300.0f;
        const int32_t n = static_cast<int32_t>(i * 7) - 3000;
        ASSERT_EQ(f32[i], inside ? f / 3.0f : f) << "element " << i;
        ASSERT_EQ(i32[i], inside ? n / 3 : n) << "element " << i;
      }
    }
  }
}

TEST(DivideInPlaceTest, ZeroCountTouchesNothing) {
  for (DataType dtype : kAllDataTypes) DivideInPlace(dtype, nullptr, 0, 3);
}

// ---- Which instruction set the kernels run with. ----

// A CPU with the sets named: "avx2", "avx512" (F, BW, VL, DQ), "vnni" (AVX-VNNI), "intel".
KernelCpu Cpu(std::initializer_list<std::string_view> has) {
  KernelCpu cpu;
  for (std::string_view what : has) {
    if (what == "avx2") cpu.avx2 = true;
    if (what == "avx512") cpu.avx512 = true;
    if (what == "vnni") cpu.avx_vnni = true;
    if (what == "intel") cpu.intel = true;
  }
  return cpu;
}

TEST(KernelIsaTest, ChoosesTheBestTheCpuHasUnlessAsked) {
  // Unset or empty: the best, but AVX2 on Intel CPUs with AVX-512 and without AVX-VNNI
  // (Skylake-SP to Ice Lake, whose clock 512-bit instructions may lower); Intel CPUs with both
  // (Sapphire Rapids on) get AVX-512, as glibc's string functions do.
  EXPECT_EQ(ChooseKernelIsa(nullptr, Cpu({})), KernelIsa::kBaseline);
  EXPECT_EQ(ChooseKernelIsa(nullptr, Cpu({"avx2", "intel"})), KernelIsa::kAvx2);
  EXPECT_EQ(ChooseKernelIsa(nullptr, Cpu({"avx2", "vnni", "intel"})), KernelIsa::kAvx2);
  EXPECT_EQ(ChooseKernelIsa(nullptr, Cpu({"avx2", "avx512"})), KernelIsa::kAvx512);
  EXPECT_EQ(ChooseKernelIsa(nullptr, Cpu({"avx2", "avx512", "intel"})), KernelIsa::kAvx2);
  EXPECT_EQ(ChooseKernelIsa(nullptr, Cpu({"avx2", "avx512", "vnni", "intel"})), KernelIsa::kAvx512);
  EXPECT_EQ(ChooseKernelIsa("", Cpu({"avx2", "avx512"})), KernelIsa::kAvx512);
  EXPECT_EQ(ChooseKernelIsa("", Cpu({"avx2", "avx512", "intel"})), KernelIsa::kAvx2);
  // Asked for: any set the CPU has, AVX-512 on any Intel CPU included.
  EXPECT_EQ(ChooseKernelIsa("baseline", Cpu({"avx2", "avx512"})), KernelIsa::kBaseline);
  EXPECT_EQ(ChooseKernelIsa("avx2", Cpu({"avx2", "avx512"})), KernelIsa::kAvx2);
  EXPECT_EQ(ChooseKernelIsa("avx2", Cpu({"avx2", "avx512", "vnni", "intel"})), KernelIsa::kAvx2);
  EXPECT_EQ(ChooseKernelIsa("avx512", Cpu({"avx2", "avx512", "intel"})), KernelIsa::kAvx512);
}

TEST(KernelIsaTest, ASetTheCpuLacksOrAnUnknownNameIsSaidOnStderr) {
  testing::internal::CaptureStderr();
  EXPECT_EQ(ChooseKernelIsa("avx512", Cpu({"avx2"})), KernelIsa::kAvx2);
  EXPECT_EQ(ChooseKernelIsa("avx2", Cpu({})), KernelIsa::kBaseline);
  std::string said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("COLLECTIVES_KERNEL_ISA=avx512, but this CPU lacks it; the kernels run "
                      "with avx2"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("COLLECTIVES_KERNEL_ISA=avx2, but this CPU lacks it; the kernels run "
                      "with baseline"),
            std::string::npos)
      << said;

  testing::internal::CaptureStderr();
  EXPECT_EQ(ChooseKernelIsa("AVX2", Cpu({"avx2", "avx512"})), KernelIsa::kAvx512);
  EXPECT_EQ(ChooseKernelIsa("sse", Cpu({"avx2", "avx512", "intel"})), KernelIsa::kAvx2);
  said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("COLLECTIVES_KERNEL_ISA=AVX2 is not one of baseline, avx2, avx512; the "
                      "kernels run with avx512"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("COLLECTIVES_KERNEL_ISA=sse is not one of"), std::string::npos) << said;
}

// DetectKernelCpu reads CPUID itself (AVX-VNNI is leaf 7, subleaf 1, EAX bit 4); the kernel's
// own list of flags must agree, or the default set would be chosen on wrong facts.
TEST(KernelIsaTest, DetectsWhatTheKernelListsInProcCpuinfo) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string word; words >> word;) flags.insert(word);
    break;
  }
  if (flags.empty()) GTEST_SKIP() << "no flags line in /proc/cpuinfo (not Linux on x86-64?)";
  const KernelCpu cpu = DetectKernelCpu();
  EXPECT_EQ(cpu.avx2, flags.count("avx2") == 1);
  EXPECT_EQ(cpu.avx512, flags.count("avx512f") == 1 && flags.count("avx512bw") == 1 &&
                            flags.count("avx512vl") == 1 && flags.count("avx512dq") == 1);
  EXPECT_EQ(cpu.avx_vnni, flags.count("avx_vnni") == 1);
}

// ctest runs the reduce and divide tests of this binary once more per set, with
// COLLECTIVES_KERNEL_ISA naming it (tests/CMakeLists.txt): this checks that such a run takes the
// path it names, so that each compiled copy of the loops is tested where the CPU has it.
TEST(KernelIsaTest, RunsTheSetTheEnvironmentNames) {
  const KernelIsa active = ActiveKernelIsa();
  testing::Test::RecordProperty("kernel_isa", KernelIsaName(active));
  const KernelCpu cpu = DetectKernelCpu();
  const char* asked = std::getenv("COLLECTIVES_KERNEL_ISA");
  const std::string name = asked == nullptr ? "" : asked;
  if ((name == "avx512" && !cpu.avx512) || (name == "avx2" && !cpu.avx2)) {
    GTEST_SKIP() << "this CPU lacks " << name << "; the kernels run with " << KernelIsaName(active);
  }
  EXPECT_EQ(active, ChooseKernelIsa(asked, cpu));
  if (!name.empty()) {
    EXPECT_EQ(KernelIsaName(active), name);
  }
}

}  // namespace
}  // namespace core
}  // namespace collectives
