// Micro benchmark of the reduction kernels (src/core/kernels.h): Reduce(sum) for every dtype
// next to a memcpy of the same size, min/max/prod for f32, and the f16/bf16 conversions.
//
// Convention: bytes_per_second counts the bytes of ONE buffer per iteration (count x element
// size), for the kernels and for memcpy alike. A reduce moves three buffers (reads a and b,
// writes dst) where memcpy moves two, so at memory bandwidth a reduce shows about 2/3 of the
// memcpy figure; in cache, the compute shows. The `moved` counter counts every buffer read or
// written (STREAM's convention: 2 for memcpy, 3 for a reduce), so it compares the memory
// traffic each sustains. Sizes are bytes of one buffer.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "collectives/types.h"
#include "src/core/aligned_bytes.h"
#include "src/core/kernels.h"

namespace collectives::core {
namespace {

// Buffer bytes: in L1/L2, in L2, past L2, far past L2.
void Sizes(benchmark::internal::Benchmark* bench) {
  for (int64_t bytes :
       {int64_t{4} << 10, int64_t{256} << 10, int64_t{4} << 20, int64_t{64} << 20}) {
    bench->Arg(bytes);
  }
}

// Buffer contents for dtype: small values (no NaN, inf or subnormal slow paths), so the figure
// is the kernel's steady state.
std::vector<unsigned char> Filled(DataType dtype, size_t count, int seed) {
  std::vector<unsigned char> buffer(count * SizeOf(dtype));
  for (size_t i = 0; i < count; ++i) {
    const float value = static_cast<float>((i * 7 + static_cast<size_t>(seed)) % 13) * 0.25f + 1.0f;
    unsigned char* out = buffer.data() + i * SizeOf(dtype);
    switch (dtype) {
      case DataType::kFloat32:
        std::memcpy(out, &value, 4);
        break;
      case DataType::kFloat64: {
        const double d = value;
        std::memcpy(out, &d, 8);
        break;
      }
      case DataType::kFloat16: {
        const uint16_t h = FloatToHalf(value);
        std::memcpy(out, &h, 2);
        break;
      }
      case DataType::kBFloat16: {
        const uint16_t b = FloatToBFloat16(value);
        std::memcpy(out, &b, 2);
        break;
      }
      default: {
        const uint64_t n = static_cast<uint64_t>(value * 4);
        std::memcpy(out, &n, SizeOf(dtype));
        break;
      }
    }
  }
  return buffer;
}

// The buffers of one benchmark at fixed places: buffer i starts 16 x (i + 1) bytes past a cache
// line (16, 32, 48: offsets malloc's 16-byte alignment gives, so that 64-byte accesses split
// lines as they do on malloc'd memory) and i x 1 KiB + that past a page, each in pages of its
// own. Separately malloc'd vectors would land wherever the heap had room, which moves with the
// set of benchmarks run before (the --benchmark_filter), and a small copy or sum would change
// speed from one filter to the next as two buffers' addresses do or do not share their low
// 12 bits (a load that seems to alias an earlier store waits for it). Contents: zeros.
class PlacedBuffers {
 public:
  static constexpr size_t kPage = 4096;
  PlacedBuffers(size_t count, size_t bytes)
      : stride_((bytes + 2 * kPage + kPage - 1) / kPage * kPage),
        arena_(new uint8_t[count * stride_ + kPage]()) {
    const auto address = reinterpret_cast<uintptr_t>(arena_.get());
    base_ = arena_.get() + (kPage - address % kPage) % kPage;
  }
  uint8_t* operator[](size_t i) const { return base_ + i * stride_ + i * 1024 + 16 * (i + 1); }
  // Buffer i holds Filled(dtype, count, seed).
  uint8_t* Fill(size_t i, DataType dtype, size_t count, int seed) const {
    const std::vector<unsigned char> filled = Filled(dtype, count, seed);
    if (!filled.empty()) std::memcpy((*this)[i], filled.data(), filled.size());
    return (*this)[i];
  }
  // The same for f32, typed.
  float* Floats(size_t i, size_t count, int seed) const {
    return reinterpret_cast<float*>(Fill(i, DataType::kFloat32, count, seed));
  }

 private:
  const size_t stride_;
  const std::unique_ptr<uint8_t[]> arena_;
  uint8_t* base_ = nullptr;
};

// Bytes of every buffer read or written per second: `buffers` x the size per iteration.
void CountMoved(benchmark::State& state, int buffers) {
  state.counters["moved"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * static_cast<double>(state.range(0)) * buffers,
      benchmark::Counter::kIsRate, benchmark::Counter::kIs1024);
}

// Times `step` once per iteration, its writes to `written` kept, and reports one buffer's bytes
// per second and `buffers` buffers moved (CountMoved).
template <typename Step>
void TimeSteps(benchmark::State& state, int buffers, const void* written, Step step) {
  for (auto _ : state) {
    step();
    benchmark::DoNotOptimize(written);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
  CountMoved(state, buffers);
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const PlacedBuffers buffers(2, bytes);
  uint8_t* const src = buffers[0];
  uint8_t* const dst = buffers[1];
  std::memset(src, 1, bytes);
  TimeSteps(state, 2, dst, [&] { std::memcpy(dst, src, bytes); });
}
BENCHMARK(BM_Memcpy)->Apply(Sizes);

// dst = a op b on three distinct buffers.
void ReduceBench(benchmark::State& state, DataType dtype, ReduceOp op) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / SizeOf(dtype);
  const PlacedBuffers buffers(3, bytes);
  const uint8_t* const a = buffers.Fill(0, dtype, count, 1);
  const uint8_t* const b = buffers.Fill(1, dtype, count, 2);
  uint8_t* const dst = buffers[2];
  TimeSteps(state, 3, dst, [&] { Reduce(dtype, op, dst, a, b, count); });
}

#if defined(__x86_64__) && defined(__GNUC__)
// Of one loop compiled three ways, the one for the instruction set the kernels run with
// (ActiveKernelIsa; COLLECTIVES_KERNEL_ISA picks it).
template <typename F>
F ForActiveIsa(F baseline, F avx2, F avx512) {
  switch (ActiveKernelIsa()) {
    case KernelIsa::kAvx512:
      return avx512;
    case KernelIsa::kAvx2:
      return avx2;
    case KernelIsa::kBaseline:
      break;
  }
  return baseline;
}
#endif

// The baseline a kernel cannot beat: the loop the compiler makes of dst[i] = a[i] + b[i] on
// the same three buffers (with the instruction set the kernels run with). Out of place, three
// streams share the bandwidth memcpy's two have, and dst's lines are read before they are
// written; a plain loop shows what that leaves, so f32_sum can be judged against it as well as
// against memcpy.
[[gnu::noinline]] void PlainAdd(float* __restrict dst, const float* __restrict a,
                                const float* __restrict b, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = a[i] + b[i];
}

#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target("avx2"), gnu::noinline]] void PlainAddAvx2(float* __restrict dst,
                                                         const float* __restrict a,
                                                         const float* __restrict b, size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = a[i] + b[i];
}

[[gnu::target("avx512f"), gnu::noinline]] void PlainAddAvx512(float* __restrict dst,
                                                              const float* __restrict a,
                                                              const float* __restrict b,
                                                              size_t count) {
  for (size_t i = 0; i < count; ++i) dst[i] = a[i] + b[i];
}
#endif

void BM_PlainF32Add(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / sizeof(float);
  const PlacedBuffers buffers(3, bytes);
  const float* const a = buffers.Floats(0, count, 1);
  const float* const b = buffers.Floats(1, count, 2);
  auto* const dst = reinterpret_cast<float*>(buffers[2]);
#if defined(__x86_64__) && defined(__GNUC__)
  auto* const add = ForActiveIsa(&PlainAdd, &PlainAddAvx2, &PlainAddAvx512);
#else
  auto* const add = &PlainAdd;
#endif
  TimeSteps(state, 3, dst, [&] { add(dst, a, b, count); });
}
BENCHMARK(BM_PlainF32Add)->Apply(Sizes);

// What bounds the out-of-place kernel from below: a loop that only reads three buffers (a, b,
// and the one dst would be) and stores nothing. dst = a + b brings three lines into the cache
// per line written, as this does (dst's line is read for ownership before it is written), where
// memcpy and the in-place kernel bring two; in cache and from L3 alike the time follows the lines
// brought in, so no out-of-place kernel that writes through the cache is faster than this (a
// store that bypasses it, movntps, writes to memory: slower in cache). Same counting as the
// kernels: one buffer's bytes per iteration.
// 64 partial sums (four vectors of 16), so that the adds' latency does not bound the loop
// before the loads do. Inlined into one function per instruction set.
[[gnu::always_inline]] inline float ReadThreeLoop(const float* __restrict a,
                                                  const float* __restrict b,
                                                  const float* __restrict c, size_t count) {
  float sums[64] = {};
  for (size_t i = 0; i + 64 <= count; i += 64) {
    for (size_t j = 0; j < 64; ++j) sums[j] += a[i + j] + b[i + j] + c[i + j];
  }
  float total = 0;
  for (float s : sums) total += s;
  return total;
}

[[gnu::noinline]] float ReadThree(const float* a, const float* b, const float* c, size_t count) {
  return ReadThreeLoop(a, b, c, count);
}

#if defined(__x86_64__) && defined(__GNUC__)
[[gnu::target("avx2"), gnu::noinline]] float ReadThreeAvx2(const float* a, const float* b,
                                                           const float* c, size_t count) {
  return ReadThreeLoop(a, b, c, count);
}

[[gnu::target("avx512f"), gnu::noinline]] float ReadThreeAvx512(const float* a, const float* b,
                                                                const float* c, size_t count) {
  return ReadThreeLoop(a, b, c, count);
}
#endif

void BM_ReadThreeF32(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / sizeof(float);
  const PlacedBuffers buffers(3, bytes);
  const float* const a = buffers.Floats(0, count, 1);
  const float* const b = buffers.Floats(1, count, 2);
  const float* const c = buffers.Floats(2, count, 3);
#if defined(__x86_64__) && defined(__GNUC__)
  auto* const read = ForActiveIsa(&ReadThree, &ReadThreeAvx2, &ReadThreeAvx512);
#else
  auto* const read = &ReadThree;
#endif
  for (auto _ : state) {
    benchmark::DoNotOptimize(read(a, b, c, count));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
  CountMoved(state, 3);
}
BENCHMARK(BM_ReadThreeF32)->Apply(Sizes);

// dst == a (the ring's case: a received chunk reduced into the user's buffer). Sum with a
// buffer of small values, so the values stay finite as iterations accumulate.
void ReduceInPlaceBench(benchmark::State& state, DataType dtype) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / SizeOf(dtype);
  const PlacedBuffers buffers(2, bytes);
  uint8_t* const a = buffers.Fill(0, dtype, count, 1);
  const uint8_t* const b = buffers[1];  // zeros: the sum does not grow
  TimeSteps(state, 3, a, [&] { Reduce(dtype, ReduceOp::kSum, a, a, b, count); });
}

// The f32 sum, in and out of place, and the copy once more on buffers aligned to 64 bytes, as
// the library's own buffers are (src/core/aligned_bytes.h) and as TensorFlow's and PyTorch's CPU
// allocators give tensors. The buffers above sit where malloc would put them, 16, 32 and 48
// bytes past a cache line (PlacedBuffers), so a 64-byte access of every buffer is split across
// two lines; these show what a kernel gets where that does not happen.
// Named apart from the ones above, so that a filter for those does not pick these up.
AlignedBytes AlignedFilled(DataType dtype, size_t count, int seed) {
  const std::vector<unsigned char> filled = Filled(dtype, count, seed);
  AlignedBytes aligned = AllocateAligned(filled.size());
  std::memcpy(aligned.get(), filled.data(), filled.size());
  return aligned;
}

void BM_CopyAligned(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const AlignedBytes src = AlignedFilled(DataType::kUInt8, bytes, 1);
  const AlignedBytes dst = AlignedFilled(DataType::kUInt8, bytes, 2);
  TimeSteps(state, 2, dst.get(), [&] { std::memcpy(dst.get(), src.get(), bytes); });
}
BENCHMARK(BM_CopyAligned)->Apply(Sizes);

// In place as ReduceInPlaceBench (dst == a, b of zeros); out of place as ReduceBench.
void F32SumAligned(benchmark::State& state, bool in_place) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / sizeof(float);
  const AlignedBytes a = AlignedFilled(DataType::kFloat32, count, 1);
  const AlignedBytes b = AlignedFilled(DataType::kFloat32, count, 2);
  const AlignedBytes out = AllocateAligned(bytes);
  if (in_place) std::memset(b.get(), 0, bytes);  // the sum does not grow
  uint8_t* const dst = in_place ? a.get() : out.get();
  TimeSteps(state, 3, dst,
            [&] { Reduce(DataType::kFloat32, ReduceOp::kSum, dst, a.get(), b.get(), count); });
}
BENCHMARK_CAPTURE(F32SumAligned, out_of_place, false)->Apply(Sizes);
BENCHMARK_CAPTURE(F32SumAligned, in_place, true)->Apply(Sizes);

BENCHMARK_CAPTURE(ReduceBench, f32_sum, DataType::kFloat32, ReduceOp::kSum)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, f64_sum, DataType::kFloat64, ReduceOp::kSum)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, f16_sum, DataType::kFloat16, ReduceOp::kSum)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, bf16_sum, DataType::kBFloat16, ReduceOp::kSum)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, i8_sum, DataType::kInt8, ReduceOp::kSum)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, u8_sum, DataType::kUInt8, ReduceOp::kSum)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, i32_sum, DataType::kInt32, ReduceOp::kSum)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, i64_sum, DataType::kInt64, ReduceOp::kSum)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, f32_min, DataType::kFloat32, ReduceOp::kMin)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, f32_max, DataType::kFloat32, ReduceOp::kMax)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceBench, f32_prod, DataType::kFloat32, ReduceOp::kProd)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceInPlaceBench, f32_sum, DataType::kFloat32)->Apply(Sizes);
BENCHMARK_CAPTURE(ReduceInPlaceBench, f16_sum, DataType::kFloat16)->Apply(Sizes);

// The public conversion functions, one call per element (they are out of line here; inside the
// kernels the same code is inlined and vectorised, which the f16/bf16 sums above measure).
// Bytes are those of the 16-bit side.
constexpr int64_t kConversionBytes = int64_t{256} << 10;

void BM_HalfToFloat(benchmark::State& state) {
  const size_t count = static_cast<size_t>(kConversionBytes) / 2;
  std::vector<unsigned char> in = Filled(DataType::kFloat16, count, 1);
  std::vector<uint16_t> codes(count);
  std::memcpy(codes.data(), in.data(), in.size());
  std::vector<float> out(count);
  for (auto _ : state) {
    for (size_t i = 0; i < count; ++i) out[i] = HalfToFloat(codes[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kConversionBytes);
}
BENCHMARK(BM_HalfToFloat);

void BM_FloatToHalf(benchmark::State& state) {
  const size_t count = static_cast<size_t>(kConversionBytes) / 2;
  std::vector<unsigned char> in = Filled(DataType::kFloat32, count, 1);
  std::vector<float> values(count);
  std::memcpy(values.data(), in.data(), in.size());
  std::vector<uint16_t> out(count);
  for (auto _ : state) {
    for (size_t i = 0; i < count; ++i) out[i] = FloatToHalf(values[i]);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kConversionBytes);
}
BENCHMARK(BM_FloatToHalf);

// A round trip through the kernels' vectorised conversions alone: f16 divided by 1.
void BM_HalfDivideInPlace(benchmark::State& state) {
  const size_t count = static_cast<size_t>(kConversionBytes) / 2;
  std::vector<unsigned char> data = Filled(DataType::kFloat16, count, 1);
  for (auto _ : state) {
    DivideInPlace(DataType::kFloat16, data.data(), count, 1);
    benchmark::DoNotOptimize(data.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * kConversionBytes);
}
BENCHMARK(BM_HalfDivideInPlace);

}  // namespace
}  // namespace collectives::core

// BENCHMARK_MAIN, with the instruction set the kernels run with in the context lines
// (COLLECTIVES_KERNEL_ISA=baseline|avx2|avx512 picks another, to compare them).
int main(int argc, char** argv) {
  benchmark::AddCustomContext(
      "kernel_isa", collectives::core::KernelIsaName(collectives::core::ActiveKernelIsa()));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
