// Conversions between f32 and the 16-bit float types, bit for bit as the reduction kernels
// compute them (src/core/kernels.cc inlines them into its block loops; bench/perf_check.cc
// fills and checks buffers with them; the fake CUDA library under tests/nccl/fake rounds with
// them). Header only, standard headers only, so that programs outside the library can use it.
#ifndef COLLECTIVES_SRC_CORE_HALF_H_
#define COLLECTIVES_SRC_CORE_HALF_H_

#include <bit>
#include <cstdint>

namespace collectives::core::half {

// binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits. bfloat16: the top half of
// an f32 (1, 8 with bias 127, 7).
//
// Every case is computed and the right one picked with Select, a mask blend, not `?:`: GCC may
// turn `?:` back into a branch around the float arithmetic (which it then will not speculate,
// since float operations may trap), and a loop with a branch does not vectorise.

// All ones if c, else zero.
inline uint32_t Mask(bool c) { return uint32_t{0} - static_cast<uint32_t>(c); }

// c ? if_true : if_false, without a branch.
inline uint32_t Select(bool c, uint32_t if_true, uint32_t if_false) {
  const uint32_t mask = Mask(c);
  return (if_true & mask) | (if_false & ~mask);
}

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int32_t magnitude = h & 0x7fff;  // exponent and mantissa
  // Normal numbers: move the mantissa into place and re-bias the exponent (15 -> 127).
  uint32_t normal = (static_cast<uint32_t>(magnitude) << 13) + ((127u - 15u) << 23);
  // Inf and NaN (exponent 31): the exponent must become 255, i.e. 112 more than re-biasing gave.
  // A NaN keeps its payload and gains the quiet bit, as F16C's vcvtph2ps does (see
  // FloatToHalfBits for why the two paths must agree).
  normal += Mask(magnitude >= 0x7c00) & ((255u - 31u - (127u - 15u)) << 23);
  normal |= Mask(magnitude > 0x7c00) & 0x00400000u;
  // Zero and subnormals: value = mantissa * 2^-24, exactly representable in f32. Computed by
  // converting the integer, which vectorises (cvtdq2ps) where a normalising shift would not.
  const uint32_t subnormal = std::bit_cast<uint32_t>(static_cast<float>(magnitude) * 0x1p-24f);
  return std::bit_cast<float>(sign | Select(magnitude < 0x0400, subnormal, normal));
}

inline uint16_t FloatToHalfBits(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  // Signed compares below: SSE2 has no unsigned 32-bit compare, and magnitude < 2^31.
  const int32_t magnitude = static_cast<int32_t>(bits & 0x7fffffffu);

  // Normal halves (|f| >= 2^-14): re-bias the exponent (127 -> 15) and round the 13 dropped
  // mantissa bits to nearest, ties to even: add 0xfff plus the lowest kept bit, then shift. A
  // carry out of the mantissa correctly bumps the exponent.
  const uint32_t rebased = static_cast<uint32_t>(magnitude) - ((127u - 15u) << 23);
  const uint32_t normal = (rebased + 0x0fffu + ((rebased >> 13) & 1u)) >> 13;

  // Subnormal halves (|f| < 2^-14) are multiples of 2^-24. Adding 0.5f puts |f| in the binade
  // [0.5, 1), whose spacing is exactly 2^-24, so the FPU rounds it to nearest-even for us (in
  // the default rounding mode, which the library never changes); the number of 2^-24 steps is
  // then the low bits of the sum (0x400 when it rounds up to 2^-14, which is the encoding of
  // 2^-14). With denormals-are-zero set, an f32 subnormal input becomes 0, which is also what
  // it rounds to.
  const float abs_f = std::bit_cast<float>(static_cast<uint32_t>(magnitude));
  const uint32_t subnormal = std::bit_cast<uint32_t>(abs_f + 0.5f) - std::bit_cast<uint32_t>(0.5f);

  // |f| >= 65520 (halfway between the largest half, 65504, and 65536; the tie goes to the even
  // neighbour, which is infinity) and inf: inf. NaN: the top 10 bits of its payload, with the
  // quiet bit set, as F16C's vcvtps2ph does. The kernels' F16C loop does runs of 8 and this code
  // the rest (and everything under COLLECTIVES_KERNEL_ISA=baseline); recursive doubling has both
  // partners compute the same sum, so NaN bits that depended on the path would differ between
  // ranks (0x7d00 + 1 would be 0x7f00 in a run of 8 and 0x7e00 in the tail).
  const uint32_t nan = 0x0200u | ((static_cast<uint32_t>(magnitude) >> 13) & 0x03ffu);
  const uint32_t special = 0x7c00u | (Mask(magnitude > 0x7f800000) & nan);
  uint32_t result = Select(magnitude < 0x38800000, subnormal, normal);
  result = Select(magnitude >= 0x477ff000, special, result);
  return static_cast<uint16_t>(sign | result);
}

inline float BFloat16BitsToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t FloatToBFloat16Bits(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  // Round the 16 dropped bits to nearest, ties to even. A carry overflows the largest finite
  // values into infinity, as it should; inf stays inf. Subnormals need no special case.
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  // NaN would be rounded into inf (or into the other sign), so keep its top bits and set the
  // quiet bit instead.
  const uint32_t nan = (bits >> 16) | 0x0040u;
  const bool is_nan = static_cast<int32_t>(bits & 0x7fffffffu) > 0x7f800000;
  return static_cast<uint16_t>(Select(is_nan, nan, rounded));
}

}  // namespace collectives::core::half

#endif  // COLLECTIVES_SRC_CORE_HALF_H_
