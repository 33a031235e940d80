// Reduction kernels: dst = a op b for every (dtype, op), and the division that finishes kAvg.
//
// How the code is shaped, and why:
//  - One switch per call picks a (element type, operator) pair; the inner loops are templates
//    over both, so every combination is its own plain loop that GCC vectorises at -O2/-O3, for
//    baseline x86-64 (SSE2), for AVX2 and for AVX-512, picked at run time (ReduceTyped,
//    ActiveKernelIsa). Nothing is decided per element.
//  - The loops take `__restrict` pointers, so the compiler needs no run-time overlap checks. The
//    contract lets dst alias a or b exactly, which `__restrict` would forbid if the same pointer
//    were passed twice, so ReduceTyped picks one of four loops: no alias, dst == a, dst == b, and
//    dst == a == b. Each loop names every distinct buffer once.
//  - Integer sum and prod wrap modulo 2^bits: they are computed in the unsigned type of the same
//    width (signed overflow would be undefined behaviour); the bits are the same.
//  - f16 and bf16 are reduced in f32, 256 elements at a time: both inputs are widened into f32
//    arrays on the stack, reduced there, and rounded back into dst. Every step is a separate
//    simple loop, and the conversions are written without branches (all cases computed, the
//    right one selected), so each loop vectorises. Because a block is read completely before any
//    of it is written, exact aliasing needs no special case here. f32 has more than twice the
//    precision of either format (24 >= 2 x 11 + 2), so rounding the f32 result once more gives
//    the correctly rounded sum, product or quotient, as if computed in the 16-bit format.
//  - Float min and max propagate NaN: if either input is NaN the result is a NaN (which one,
//    sign and payload, is unspecified). For min(+0, -0) and max(+0, -0) the result is b (the
//    values compare equal).
#include "src/core/kernels.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "collectives/errors.h"
#include "src/core/aligned_bytes.h"
#include "src/core/half.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define COLLECTIVES_HAVE_F16C_PATH 1
#endif

namespace collectives::core {
namespace {

// The conversions of the 16-bit float types, inlined into the block loops below.
using half::BFloat16BitsToFloat;
using half::FloatToBFloat16Bits;
using half::FloatToHalfBits;
using half::HalfBitsToFloat;
using half::Mask;
using half::Select;

struct HalfCodec {
  static float Widen(uint16_t v) { return HalfBitsToFloat(v); }
  static uint16_t Narrow(float v) { return FloatToHalfBits(v); }
};

struct BFloat16Codec {
  static float Widen(uint16_t v) { return BFloat16BitsToFloat(v); }
  static uint16_t Narrow(float v) { return FloatToBFloat16Bits(v); }
};

// ---- Operators. ----

template <typename T>
inline T WrappingAdd(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename T>
inline T WrappingMultiply(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    // U is at least 8 bits; 8-bit operands promote to int and their product fits in it.
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

struct SumOp {
  template <typename T>
  T operator()(T a, T b) const {
    return WrappingAdd(a, b);
  }
};

struct ProdOp {
  template <typename T>
  T operator()(T a, T b) const {
    return WrappingMultiply(a, b);
  }
};

// Float min and max, with NaN propagated from either side. `a < b ? a : b` alone is one
// minps/minpd instruction, but gives b when a is NaN; OR-ing a's bits back in where a is NaN
// restores a NaN (exponent all ones, mantissa non-zero survive an OR), at two more instructions
// and a compare, cheaper than a full blend.
template <typename T>
inline T PropagateNaN(T a, T result) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  const Bits a_nan = Bits{0} - static_cast<Bits>(a != a);
  return std::bit_cast<T>(
      static_cast<Bits>(std::bit_cast<Bits>(result) | (a_nan & std::bit_cast<Bits>(a))));
}

struct MinOp {
  template <typename T>
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      return PropagateNaN(a, a < b ? a : b);  // a NaN b fails `a < b` and is chosen
    } else {
      return b < a ? b : a;
    }
  }
};

struct MaxOp {
  template <typename T>
  T operator()(T a, T b) const {
    if constexpr (std::is_floating_point_v<T>) {
      return PropagateNaN(a, a > b ? a : b);
    } else {
      return a < b ? b : a;
    }
  }
};

// ---- Loops over plain element types. ----
//
// Each loop runs its bulk in chunks of a constant kChunkBytes / sizeof(T) elements and finishes
// with a plain loop over the remaining < 1 chunk. GCC 12 at -O2 vectorises only with its "very
// cheap" cost model, which takes loops whose trip count is a known multiple of the vector width
// and nothing else; the constant inner loop is such a loop, so the kernels vectorise at -O2 as
// well as at -O3 (where the tail loop vectorises too).

constexpr size_t kChunkBytes = 256;

template <typename T>
constexpr size_t kChunk = kChunkBytes / sizeof(T);

// Elements to do one by one before `p` reaches a 64-byte boundary (0 when p is not aligned to
// its element, where no peeling helps). The loops peel them first, so that the vector loop's
// accesses through p never straddle two cache lines: malloc aligns only to 16 bytes, and with
// that offset every other 32-byte load of an AVX2 loop is split across two lines, which slows
// it in cache (see docs/tuning.md; ReduceTest.EveryStartWithinACacheLine covers every offset).
template <typename T>
size_t HeadToAlign(const T* p, size_t count) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(T) != 0) return 0;
  return std::min(count, BytesToCacheLine(p) / sizeof(T));
}

template <typename T, typename Op>
[[gnu::always_inline]] inline void LoopDistinct(T* __restrict dst, const T* __restrict a,
                                                const T* __restrict b, size_t count, Op op) {
  size_t i = 0;
  for (const size_t head = HeadToAlign(a, count); i < head; ++i) dst[i] = op(a[i], b[i]);
  for (; i + kChunk<T> <= count; i += kChunk<T>) {
    for (size_t j = 0; j < kChunk<T>; ++j) dst[i + j] = op(a[i + j], b[i + j]);
  }
  for (; i < count; ++i) dst[i] = op(a[i], b[i]);
}

template <typename T, typename Op>
[[gnu::always_inline]] inline void LoopIntoA(T* __restrict dst_a, const T* __restrict b,
                                             size_t count, Op op) {
  size_t i = 0;
  for (const size_t head = HeadToAlign(dst_a, count); i < head; ++i) dst_a[i] = op(dst_a[i], b[i]);
  for (; i + kChunk<T> <= count; i += kChunk<T>) {
    for (size_t j = 0; j < kChunk<T>; ++j) dst_a[i + j] = op(dst_a[i + j], b[i + j]);
  }
  for (; i < count; ++i) dst_a[i] = op(dst_a[i], b[i]);
}

template <typename T, typename Op>
[[gnu::always_inline]] inline void LoopIntoB(T* __restrict dst_b, const T* __restrict a,
                                             size_t count, Op op) {
  size_t i = 0;
  for (const size_t head = HeadToAlign(dst_b, count); i < head; ++i) dst_b[i] = op(a[i], dst_b[i]);
  for (; i + kChunk<T> <= count; i += kChunk<T>) {
    for (size_t j = 0; j < kChunk<T>; ++j) dst_b[i + j] = op(a[i + j], dst_b[i + j]);
  }
  for (; i < count; ++i) dst_b[i] = op(a[i], dst_b[i]);
}

template <typename T, typename Op>
[[gnu::always_inline]] inline void LoopAllSame(T* __restrict data, size_t count, Op op) {
  size_t i = 0;
  for (const size_t head = HeadToAlign(data, count); i < head; ++i) data[i] = op(data[i], data[i]);
  for (; i + kChunk<T> <= count; i += kChunk<T>) {
    for (size_t j = 0; j < kChunk<T>; ++j) data[i + j] = op(data[i + j], data[i + j]);
  }
  for (; i < count; ++i) data[i] = op(data[i], data[i]);
}

// The loops are inlined into this body, which is compiled three times: for baseline x86-64 and,
// where the CPU has them (chosen once per process, see ActiveKernelIsa), for AVX2, whose 32-byte
// vectors double what one instruction handles, and for AVX-512 (below); that counts where the
// buffers sit in cache, as a ring's chunks do (see docs/tuning.md). Every element is the same
// operation on the same two values either way, so the results are the same bits.
template <typename T, typename Op>
[[gnu::always_inline]] inline void ReduceTypedBody(void* dst_v, const void* a_v, const void* b_v,
                                                   size_t count, Op op) {
  T* dst = static_cast<T*>(dst_v);
  const T* a = static_cast<const T*>(a_v);
  const T* b = static_cast<const T*>(b_v);
  if (dst == a) {
    if (a == b) {
      LoopAllSame(dst, count, op);
    } else {
      LoopIntoA(dst, b, count, op);
    }
  } else if (dst == b) {
    LoopIntoB(dst, a, count, op);
  } else {
    // a == b (both only read) is fine under __restrict.
    LoopDistinct(dst, a, b, count, op);
  }
}

// The same body once more for AVX-512 (F, BW, VL, DQ: every element type and operator), where
// one instruction handles 64 bytes; it is faster than AVX2 in cache (see docs/tuning.md).
// ChooseKernelIsa leaves it off on Intel CPUs without AVX-VNNI (Skylake-SP to Ice Lake), whose
// clock 512-bit instructions can lower, slowing the caller's own code on that core; as glibc's
// string functions (Prefer_No_AVX512 only without AVX_VNNI), CPUs with AVX-VNNI get it.
#ifdef COLLECTIVES_HAVE_F16C_PATH
template <typename T, typename Op>
[[gnu::target("avx2")]] void ReduceTypedAvx2(void* dst, const void* a, const void* b, size_t count,
                                             Op op) {
  ReduceTypedBody<T>(dst, a, b, count, op);
}

template <typename T, typename Op>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq")]] void ReduceTypedAvx512(void* dst,
                                                                             const void* a,
                                                                             const void* b,
                                                                             size_t count, Op op) {
  ReduceTypedBody<T>(dst, a, b, count, op);
}
#endif

template <typename T, typename Op>
void ReduceTyped(void* dst, const void* a, const void* b, size_t count, Op op) {
#ifdef COLLECTIVES_HAVE_F16C_PATH
  switch (ActiveKernelIsa()) {
    case KernelIsa::kAvx512:
      return ReduceTypedAvx512<T>(dst, a, b, count, op);
    case KernelIsa::kAvx2:
      return ReduceTypedAvx2<T>(dst, a, b, count, op);
    case KernelIsa::kBaseline:
      break;
  }
#endif
  ReduceTypedBody<T>(dst, a, b, count, op);
}

// ---- Loops over f16 / bf16, in f32 blocks. ----

constexpr size_t kBlock = 256;  // elements: 2 x 1 KiB of f32 on the stack

// The block loops are inlined into ReduceBlock, so that in the call for a full block their trip
// count is the constant kBlock (which -O2 vectorises, see above).
template <typename Codec>
[[gnu::always_inline]] inline void WidenBlock(float* __restrict out, const uint16_t* __restrict in,
                                              size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = Codec::Widen(in[i]);
}

template <typename Codec>
[[gnu::always_inline]] inline void NarrowBlock(uint16_t* __restrict out, const float* __restrict in,
                                               size_t count) {
  for (size_t i = 0; i < count; ++i) out[i] = Codec::Narrow(in[i]);
}

// The operator on widened elements. Min and max put a NaN in a back whole (a blend, as the F16C
// loop's vblendvps does), not OR-ed into the result as PropagateNaN does for f32 and f64: the
// F16C loop does runs of 8 of a call and this code the rest, so they must give the same NaN bits.
template <typename Op>
inline float ApplyWidened(Op op, float a, float b) {
  if constexpr (std::is_same_v<Op, MinOp> || std::is_same_v<Op, MaxOp>) {
    const float chosen = std::is_same_v<Op, MinOp> ? (a < b ? a : b) : (a > b ? a : b);
    return std::bit_cast<float>(
        Select(a != a, std::bit_cast<uint32_t>(a), std::bit_cast<uint32_t>(chosen)));
  } else {
    return op(a, b);
  }
}

template <typename Op>
[[gnu::always_inline]] inline void ReduceFloatBlock(float* __restrict a_out,
                                                    const float* __restrict b, size_t count,
                                                    Op op) {
  for (size_t i = 0; i < count; ++i) a_out[i] = ApplyWidened(op, a_out[i], b[i]);
}

// Reduces `count` <= kBlock elements.
template <typename Codec, typename Op>
[[gnu::always_inline]] inline void ReduceBlock(uint16_t* dst, const uint16_t* a, const uint16_t* b,
                                               size_t count, Op op) {
  alignas(64) float fa[kBlock];
  alignas(64) float fb[kBlock];
  WidenBlock<Codec>(fa, a, count);
  WidenBlock<Codec>(fb, b, count);
  ReduceFloatBlock(fa, fb, count, op);
  NarrowBlock<Codec>(dst, fa, count);
}

template <typename Codec, typename Op>
void ReduceWidened(void* dst_v, const void* a_v, const void* b_v, size_t count, Op op) {
  uint16_t* dst = static_cast<uint16_t*>(dst_v);
  const uint16_t* a = static_cast<const uint16_t*>(a_v);
  const uint16_t* b = static_cast<const uint16_t*>(b_v);
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) ReduceBlock<Codec>(dst + i, a + i, b + i, kBlock, op);
  if (i < count) ReduceBlock<Codec>(dst + i, a + i, b + i, count - i, op);
}

// ---- f16 and bf16 on CPUs with F16C and AVX2, chosen at run time. ----
//
// Baseline x86-64 has no instruction for binary16, and the branch-free bit conversions above
// run below what one TCP stream delivers, so f16 all-reduce would be bound by its reduction.
// F16C converts 8 halves per instruction, with the same round-to-nearest-even; this loop runs
// near memory bandwidth (see docs/tuning.md). It is the only hand-vectorised loop: the compiler
// does not vectorise _Float16 conversions well.
// Semantics are those of the scalar operators: vminps / vmaxps return b unless a < b (a > b),
// exactly like `a < b ? a : b`, and a NaN in a is put back whole, as ApplyWidened does.

#ifdef COLLECTIVES_HAVE_F16C_PATH
// F16C is CPUID leaf 1, ECX bit 29 (Clang's __builtin_cpu_supports does not know "f16c").
bool HasF16c() {
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
    return f16c && ActiveKernelIsa() != KernelIsa::kBaseline;
  }();
  return has;
}

[[gnu::target("avx2,f16c")]] inline __m256 ApplyVector(SumOp, __m256 a, __m256 b) {
  return _mm256_add_ps(a, b);
}
[[gnu::target("avx2,f16c")]] inline __m256 ApplyVector(ProdOp, __m256 a, __m256 b) {
  return _mm256_mul_ps(a, b);
}
[[gnu::target("avx2,f16c")]] inline __m256 ApplyVector(MinOp, __m256 a, __m256 b) {
  return _mm256_blendv_ps(_mm256_min_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
[[gnu::target("avx2,f16c")]] inline __m256 ApplyVector(MaxOp, __m256 a, __m256 b) {
  return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}

// Reduces the largest multiple of 8 elements; returns how many it did. Each group of 8 is
// loaded before it is stored, so dst may alias a or b exactly.
template <typename Op>
[[gnu::target("avx2,f16c")]] size_t ReduceHalfF16c(uint16_t* dst, const uint16_t* a,
                                                   const uint16_t* b, size_t count, Op op) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(ApplyVector(op, x, y), _MM_FROUND_TO_NEAREST_INT));
  }
  return i;
}

// Aligned to a cache line, so that its short loop stays in one wherever the linker puts the
// function: a loop across two lines runs slower (see docs/tuning.md).
[[gnu::target("avx2,f16c"), gnu::aligned(64)]] size_t DivideHalfF16c(uint16_t* data, size_t count,
                                                                     float divisor) {
  const __m256 d = _mm256_set1_ps(divisor);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(data + i),
                     _mm256_cvtps_ph(_mm256_div_ps(x, d), _MM_FROUND_TO_NEAREST_INT));
  }
  return i;
}
// bf16 with AVX2: the same arithmetic as FloatToBFloat16Bits / BFloat16BitsToFloat, 8 lanes
// at a time (the compiler vectorises the scalar form only 4 wide and with poor packing).
[[gnu::target("avx2")]] inline __m256 WidenBFloat16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

[[gnu::target("avx2")]] inline void NarrowBFloat16(uint16_t* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x0040));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  const __m256i halves = _mm256_blendv_epi8(rounded, nan, is_nan);
  // Pack the 8 32-bit lanes (each < 2^16) to 16 bits: packus works per 128-bit half, so
  // gather quadwords 0 and 2 into the low half afterwards.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

template <typename Op>
[[gnu::target("avx2,f16c")]] size_t ReduceBFloat16Avx2(uint16_t* dst, const uint16_t* a,
                                                       const uint16_t* b, size_t count, Op op) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    NarrowBFloat16(dst + i, ApplyVector(op, WidenBFloat16(a + i), WidenBFloat16(b + i)));
  }
  return i;
}
#endif  // COLLECTIVES_HAVE_F16C_PATH

template <typename Op>
void ReduceBFloat16(void* dst_v, const void* a_v, const void* b_v, size_t count, Op op) {
  size_t done = 0;
#ifdef COLLECTIVES_HAVE_F16C_PATH
  if (HasF16c()) {
    done = ReduceBFloat16Avx2(static_cast<uint16_t*>(dst_v), static_cast<const uint16_t*>(a_v),
                              static_cast<const uint16_t*>(b_v), count, op);
  }
#endif
  ReduceWidened<BFloat16Codec>(static_cast<uint16_t*>(dst_v) + done,
                               static_cast<const uint16_t*>(a_v) + done,
                               static_cast<const uint16_t*>(b_v) + done, count - done, op);
}

template <typename Op>
void ReduceHalf(void* dst_v, const void* a_v, const void* b_v, size_t count, Op op) {
  size_t done = 0;
#ifdef COLLECTIVES_HAVE_F16C_PATH
  if (HasF16c()) {
    done = ReduceHalfF16c(static_cast<uint16_t*>(dst_v), static_cast<const uint16_t*>(a_v),
                          static_cast<const uint16_t*>(b_v), count, op);
  }
#endif
  ReduceWidened<HalfCodec>(static_cast<uint16_t*>(dst_v) + done,
                           static_cast<const uint16_t*>(a_v) + done,
                           static_cast<const uint16_t*>(b_v) + done, count - done, op);
}

// ---- Dispatch: once per call. ----

template <typename Op>
void ReduceWithOp(DataType dtype, void* dst, const void* a, const void* b, size_t count, Op op) {
  switch (dtype) {
    case DataType::kFloat32:
      return ReduceTyped<float>(dst, a, b, count, op);
    case DataType::kFloat64:
      return ReduceTyped<double>(dst, a, b, count, op);
    case DataType::kFloat16:
      return ReduceHalf(dst, a, b, count, op);
    case DataType::kBFloat16:
      return ReduceBFloat16(dst, a, b, count, op);
    case DataType::kInt8:
      return ReduceTyped<int8_t>(dst, a, b, count, op);
    case DataType::kUInt8:
      return ReduceTyped<uint8_t>(dst, a, b, count, op);
    case DataType::kInt32:
      return ReduceTyped<int32_t>(dst, a, b, count, op);
    case DataType::kInt64:
      return ReduceTyped<int64_t>(dst, a, b, count, op);
  }
  throw Error(ErrorCode::kInvalidArgument,
              "Reduce: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

// ---- Division for kAvg. ----

// Applies f to every element of data, in constant-length chunks as the reduce loops do.
template <typename T, typename F>
[[gnu::always_inline]] inline void TransformInPlace(T* __restrict data, size_t count, F f) {
  size_t i = 0;
  for (const size_t head = HeadToAlign(data, count); i < head; ++i) data[i] = f(data[i]);
  for (; i + kChunk<T> <= count; i += kChunk<T>) {
    for (size_t j = 0; j < kChunk<T>; ++j) data[i + j] = f(data[i + j]);
  }
  for (; i < count; ++i) data[i] = f(data[i]);
}

// f32 / f64: true division, not a multiplication by 1 / divisor, which would round twice.
template <typename T>
void DivideFloat(T* data, size_t count, T divisor) {
  TransformInPlace(data, count, [divisor](T x) { return x / divisor; });
}

// f16 / bf16: divided in f32 and rounded once more. This double rounding gives the correctly
// rounded quotient for divisors below kWidenedDivisorLimit: a quotient x / d of a p-bit x that is
// not a tie of the 16-bit format lies at least 2^-(p + 1) / d of itself away from one (2^-12 / d
// for f16, p = 11; 2^-134 / d among bf16's subnormals, a fixed grid), more than the rounding to
// f32 moves it (2^-24 of itself; 2^-150 among f32's subnormals). Past that the f32 quotient can
// land on a tie (f16 0x3956 / 8195 rounded to 0x0556, not 0x0555), so larger divisors take
// DivideWidenedExactly.
constexpr size_t kWidenedDivisorLimit = size_t{1} << 12;

template <typename Codec>
void DivideWidened(uint16_t* data, size_t count, float divisor) {
  TransformInPlace(data, count,
                   [divisor](uint16_t x) { return Codec::Narrow(Codec::Widen(x) / divisor); });
}

// f16 / bf16 by a divisor of kWidenedDivisorLimit or more (kAvg over that many ranks), one
// element at a time: the quotient in double, whose rounding (2^-53) stays far inside the gap
// above for any divisor below 2^41, then rounded to f32 toward zero with the lowest bit set when
// inexact ("round to odd"), which keeps the sticky information a tie needs: rounding that f32 to
// 16 bits gives the correctly rounded quotient. A NaN is divided as in DivideWidened (the same
// bits: payload kept, quiet bit set).
template <typename Codec>
void DivideWidenedExactly(uint16_t* data, size_t count, double divisor) {
  for (size_t i = 0; i < count; ++i) {
    const double quotient = static_cast<double>(Codec::Widen(data[i])) / divisor;
    float rounded = static_cast<float>(quotient);
    if (static_cast<double>(rounded) != quotient && quotient == quotient) {
      uint32_t bits = std::bit_cast<uint32_t>(rounded);
      if (std::fabs(static_cast<double>(rounded)) > std::fabs(quotient)) --bits;
      rounded = std::bit_cast<float>(bits | 1u);
    }
    data[i] = Codec::Narrow(rounded);
  }
}

// Integers of at most 32 bits: divided in double, then truncated toward zero, which vectorises
// (cvtdq2pd, divpd, cvttpd2dq) where integer division does not. It is exact: |x| <= 2^31 and
// d <= 2^53 are exact doubles; if q = |x| / d is not an integer and k = floor(q), then
// (k + 1) - q = ((k + 1) d - |x|) / d >= 1 / d, which relative to k + 1 is at least
// 1 / ((k + 1) d) >= 2^-32 (for k >= 1, (k + 1) d <= 2 |x|; for k = 0 and d > 2^32 the gap
// is over one half), far above the 2^-53 a rounding moves, so the rounded quotient stays below
// k + 1 and truncates to k. A divisor above 2^53 is rounded, but the quotient is then below
// 2^-22 and truncates to 0 either way.
template <typename T>
void DivideSmallInt(T* data, size_t count, double divisor) {
  static_assert(std::is_integral_v<T> && sizeof(T) <= 4);
  TransformInPlace(data, count, [divisor](T x) {
    return static_cast<T>(static_cast<int32_t>(static_cast<double>(x) / divisor));
  });
}

// i64: integer division of the magnitude, so that every divisor (even one above INT64_MAX) and
// every value (even INT64_MIN) is handled without overflow.
void DivideInt64(int64_t* __restrict data, size_t count, uint64_t divisor) {
  for (size_t i = 0; i < count; ++i) {
    const int64_t x = data[i];
    const uint64_t magnitude =
        x < 0 ? uint64_t{0} - static_cast<uint64_t>(x) : static_cast<uint64_t>(x);
    const uint64_t quotient = magnitude / divisor;
    data[i] = static_cast<int64_t>(x < 0 ? uint64_t{0} - quotient : quotient);
  }
}

}  // namespace

const char* KernelIsaName(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kBaseline:
      return "baseline";
    case KernelIsa::kAvx2:
      return "avx2";
    case KernelIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

KernelIsa ChooseKernelIsa(const char* asked, const KernelCpu& cpu) {
  const KernelIsa best = cpu.avx512 ? KernelIsa::kAvx512
                         : cpu.avx2 ? KernelIsa::kAvx2
                                    : KernelIsa::kBaseline;
  const bool clock_may_drop = cpu.intel && !cpu.avx_vnni;
  const KernelIsa by_default =
      best == KernelIsa::kAvx512 && clock_may_drop ? KernelIsa::kAvx2 : best;
  if (asked == nullptr || *asked == '\0') return by_default;
  const std::string name = asked;
  for (const KernelIsa isa : {KernelIsa::kBaseline, KernelIsa::kAvx2, KernelIsa::kAvx512}) {
    if (name != KernelIsaName(isa)) continue;
    if (isa <= best) return isa;
    std::fprintf(stderr,
                 "collectives: COLLECTIVES_KERNEL_ISA=%s, but this CPU lacks it; the kernels run "
                 "with %s\n",
                 asked, KernelIsaName(best));
    return best;
  }
  std::fprintf(stderr,
               "collectives: COLLECTIVES_KERNEL_ISA=%s is not one of baseline, avx2, avx512; the "
               "kernels run with %s\n",
               asked, KernelIsaName(by_default));
  return by_default;
}

KernelCpu DetectKernelCpu() {
  KernelCpu cpu;
#ifdef COLLECTIVES_HAVE_F16C_PATH
  cpu.avx2 = __builtin_cpu_supports("avx2");
  cpu.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  cpu.intel = __builtin_cpu_is("intel");
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  cpu.avx_vnni = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 4)) != 0;
#endif
  return cpu;
}

KernelIsa ActiveKernelIsa() {
  static const KernelIsa isa = [] {
    const KernelCpu cpu = DetectKernelCpu();
    return ChooseKernelIsa(std::getenv("COLLECTIVES_KERNEL_ISA"), cpu);
  }();
  return isa;
}

void Reduce(DataType dtype, ReduceOp op, void* dst, const void* a, const void* b, size_t count) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return ReduceWithOp(dtype, dst, a, b, count, SumOp{});
    case ReduceOp::kProd:
      return ReduceWithOp(dtype, dst, a, b, count, ProdOp{});
    case ReduceOp::kMin:
      return ReduceWithOp(dtype, dst, a, b, count, MinOp{});
    case ReduceOp::kMax:
      return ReduceWithOp(dtype, dst, a, b, count, MaxOp{});
  }
  throw Error(ErrorCode::kInvalidArgument,
              "Reduce: unknown reduce op " + std::to_string(static_cast<int>(op)));
}

void DivideInPlace(DataType dtype, void* data, size_t count, size_t divisor) {
  if (divisor == 0) {
    throw Error(ErrorCode::kInvalidArgument, "DivideInPlace: divisor is 0");
  }
  switch (dtype) {
    case DataType::kFloat32:
      return DivideFloat(static_cast<float*>(data), count, static_cast<float>(divisor));
    case DataType::kFloat64:
      return DivideFloat(static_cast<double*>(data), count, static_cast<double>(divisor));
    case DataType::kFloat16: {
      if (divisor >= kWidenedDivisorLimit) {
        return DivideWidenedExactly<HalfCodec>(static_cast<uint16_t*>(data), count,
                                               static_cast<double>(divisor));
      }
      size_t done = 0;
#ifdef COLLECTIVES_HAVE_F16C_PATH
      if (HasF16c()) {
        done = DivideHalfF16c(static_cast<uint16_t*>(data), count, static_cast<float>(divisor));
      }
#endif
      return DivideWidened<HalfCodec>(static_cast<uint16_t*>(data) + done, count - done,
                                      static_cast<float>(divisor));
    }
    case DataType::kBFloat16:
      if (divisor >= kWidenedDivisorLimit) {
        return DivideWidenedExactly<BFloat16Codec>(static_cast<uint16_t*>(data), count,
                                                   static_cast<double>(divisor));
      }
      return DivideWidened<BFloat16Codec>(static_cast<uint16_t*>(data), count,
                                          static_cast<float>(divisor));
    case DataType::kInt8:
      return DivideSmallInt(static_cast<int8_t*>(data), count, static_cast<double>(divisor));
    case DataType::kUInt8:
      return DivideSmallInt(static_cast<uint8_t*>(data), count, static_cast<double>(divisor));
    case DataType::kInt32:
      return DivideSmallInt(static_cast<int32_t*>(data), count, static_cast<double>(divisor));
    case DataType::kInt64:
      return DivideInt64(static_cast<int64_t*>(data), count, static_cast<uint64_t>(divisor));
  }
  throw Error(ErrorCode::kInvalidArgument,
              "DivideInPlace: unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

float HalfToFloat(uint16_t h) { return HalfBitsToFloat(h); }
uint16_t FloatToHalf(float f) { return FloatToHalfBits(f); }
float BFloat16ToFloat(uint16_t b) { return BFloat16BitsToFloat(b); }
uint16_t FloatToBFloat16(float f) { return FloatToBFloat16Bits(f); }

}  // namespace collectives::core
