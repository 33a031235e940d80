// Micro benchmark of packing: copying N tensors of S bytes each into one contiguous fusion buffer
// (pack) and back out of it (unpack), next to one memcpy of the same total size. The gap between
// pack/unpack and the single memcpy is what fusing costs beyond the copy itself: a call per
// tensor, and source tensors that are scattered allocations rather than one range.
//
// Cases (N x S): 1000 x 4 KiB (many small gradients, 4 MiB in all, fits in L2/L3),
// 200 x 256 KiB (50 MiB), 16 x 4 MiB (64 MiB); the latter two run at memory bandwidth.
// bytes_per_second counts the N x S bytes copied per iteration (one side of the copy), for
// pack, unpack and memcpy alike, so the figures compare directly.
//
// The copy loops below mirror src/packing's pack / unpack (a std::memcpy per tensor into
// consecutive offsets of the fusion buffer), written here because the packer is being written
// at the same time; when it lands, this bench should call it instead.
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace collectives::packing {
namespace {

// N tensors as separate heap allocations (as a model's gradients are) and a fusion buffer of
// their total size. Every byte is written once up front so that no page fault is timed.
struct Tensors {
  Tensors(size_t num_tensors, size_t tensor_bytes) : bytes(tensor_bytes) {
    tensors.reserve(num_tensors);
    for (size_t i = 0; i < num_tensors; ++i) {
      tensors.push_back(std::make_unique<std::byte[]>(tensor_bytes));
      std::memset(tensors.back().get(), static_cast<int>(i & 0xFF), tensor_bytes);
    }
    fusion = std::make_unique<std::byte[]>(total());
    std::memset(fusion.get(), 0, total());
  }

  size_t total() const { return tensors.size() * bytes; }

  size_t bytes;  // of one tensor
  std::vector<std::unique_ptr<std::byte[]>> tensors;
  std::unique_ptr<std::byte[]> fusion;
};

// Mirrors src/packing's pack: tensor i lands at offset i x S of the fusion buffer.
void Pack(const Tensors& t) {
  size_t offset = 0;
  for (const std::unique_ptr<std::byte[]>& tensor : t.tensors) {
    std::memcpy(t.fusion.get() + offset, tensor.get(), t.bytes);
    offset += t.bytes;
  }
}

// Mirrors src/packing's unpack: the reverse copies.
void Unpack(const Tensors& t) {
  size_t offset = 0;
  for (const std::unique_ptr<std::byte[]>& tensor : t.tensors) {
    std::memcpy(tensor.get(), t.fusion.get() + offset, t.bytes);
    offset += t.bytes;
  }
}

// {N, S} pairs.
void Cases(benchmark::internal::Benchmark* bench) {
  bench->ArgNames({"tensors", "bytes"});
  bench->Args({1000, int64_t{4} << 10});
  bench->Args({200, int64_t{256} << 10});
  bench->Args({16, int64_t{4} << 20});
}

void Report(benchmark::State& state, const Tensors& t) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(t.total()));
  state.counters["total_MiB"] = static_cast<double>(t.total()) / (1 << 20);
}

void BM_Pack(benchmark::State& state) {
  const Tensors t(static_cast<size_t>(state.range(0)), static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    Pack(t);
    benchmark::DoNotOptimize(t.fusion.get());
    benchmark::ClobberMemory();
  }
  Report(state, t);
}
BENCHMARK(BM_Pack)->Apply(Cases);

void BM_Unpack(benchmark::State& state) {
  const Tensors t(static_cast<size_t>(state.range(0)), static_cast<size_t>(state.range(1)));
  for (auto _ : state) {
    Unpack(t);
    benchmark::DoNotOptimize(t.tensors.data());
    benchmark::ClobberMemory();
  }
  Report(state, t);
}
BENCHMARK(BM_Unpack)->Apply(Cases);

// One memcpy of N x S bytes between two contiguous buffers: the floor pack and unpack approach.
void BM_Memcpy(benchmark::State& state) {
  const size_t total = static_cast<size_t>(state.range(0)) * static_cast<size_t>(state.range(1));
  std::vector<std::byte> src(total, std::byte{1});
  std::vector<std::byte> dst(total, std::byte{0});
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), total);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(total));
  state.counters["total_MiB"] = static_cast<double>(total) / (1 << 20);
}
BENCHMARK(BM_Memcpy)->Apply(Cases);

}  // namespace
}  // namespace collectives::packing

// BENCHMARK_MAIN, plus a warning when this file, where the measured loops live, was built
// without NDEBUG (not as a Release build).
int main(int argc, char** argv) {
#ifndef NDEBUG
  std::fprintf(stderr,
               "pack_bench: WARNING: not a Release build: timings are NOT representative\n");
  benchmark::AddCustomContext("pack_bench_build", "debug (no NDEBUG)");
#else
  benchmark::AddCustomContext("pack_bench_build", "release (NDEBUG)");
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
