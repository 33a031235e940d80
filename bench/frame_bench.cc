// Micro benchmark of the wire format (src/transport/frame.h): EncodeHeader / DecodeHeader of
// the 40-byte frame header that precedes every chunk on a connection, and the abort payload's
// encoder and decoder. Time per iteration is the cost of one call (ns per op); items_per_second
// is calls per second.
//
// The header is on the path of every chunk (a 64 MiB ring all-reduce among 4 ranks with 512 KiB
// chunks sends ~200 of them per rank), so its cost should be a few ns, far below one 8-byte
// round trip (~5-10 us). Abort payloads are sent once per broken communicator; their figures
// are here to show they allocate and copy no more than the message.
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/errors.h"
#include "collectives/types.h"
#include "collectives/version.h"
#include "src/core/call.h"
#include "src/transport/frame.h"

namespace collectives::transport {
namespace {

// A data frame header as the ring sends it: all-reduce f32 sum of 16 Mi elements, 512 KiB chunk.
FrameHeader DataHeader(uint64_t seq) {
  FrameHeader header;
  header.kind = FrameKind::kData;
  header.tag.seq = seq;
  header.tag.call.kind = core::CollectiveKind::kAllReduce;
  header.tag.call.dtype = DataType::kFloat32;
  header.tag.call.op = ReduceOp::kSum;
  header.tag.call.root = 0;
  header.tag.call.count = uint64_t{16} << 20;
  header.bytes = size_t{512} << 10;
  return header;
}

void BM_EncodeHeader(benchmark::State& state) {
  FrameHeader header = DataHeader(1);
  for (auto _ : state) {
    ++header.tag.seq;  // a new value every call, so the encoding cannot be hoisted
    benchmark::DoNotOptimize(header);
    EncodedHeader encoded = EncodeHeader(header);
    benchmark::DoNotOptimize(encoded);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}
BENCHMARK(BM_EncodeHeader);

// A valid header: every check passes (the receiver's common case).
void BM_DecodeHeader(benchmark::State& state) {
  const EncodedHeader encoded = EncodeHeader(DataHeader(17));
  std::string why;
  for (auto _ : state) {
    const uint8_t* bytes = encoded.data();
    benchmark::DoNotOptimize(bytes);
    std::optional<FrameHeader> header = DecodeHeader(bytes, &why);
    benchmark::DoNotOptimize(header);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}
BENCHMARK(BM_DecodeHeader);

// Encode then decode, the round trip of one header through a connection minus the socket.
void BM_EncodeDecodeHeader(benchmark::State& state) {
  FrameHeader header = DataHeader(1);
  std::string why;
  for (auto _ : state) {
    ++header.tag.seq;
    const EncodedHeader encoded = EncodeHeader(header);
    std::optional<FrameHeader> decoded = DecodeHeader(encoded.data(), &why);
    benchmark::DoNotOptimize(decoded);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}
BENCHMARK(BM_EncodeDecodeHeader);

// A header with a bad magic: the rejection path, which formats the reason into *why.
void BM_DecodeHeaderRejected(benchmark::State& state) {
  EncodedHeader encoded = EncodeHeader(DataHeader(17));
  encoded[0] ^= 0xFF;
  std::string why;
  for (auto _ : state) {
    const uint8_t* bytes = encoded.data();
    benchmark::DoNotOptimize(bytes);
    std::optional<FrameHeader> header = DecodeHeader(bytes, &why);
    benchmark::DoNotOptimize(header);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}
BENCHMARK(BM_DecodeHeaderRejected);

// Abort payloads with a message of state.range(0) bytes: a typical message (~100 B) and one
// longer than kMaxAbortPayload, which the encoder cuts at a character boundary.
AbortPayload Abort(size_t message_bytes) {
  AbortPayload payload;
  payload.code = ErrorCode::kPeerLost;
  payload.culprit = 3;
  payload.message.assign(message_bytes, 'x');
  return payload;
}

void AbortSizes(benchmark::internal::Benchmark* bench) {
  bench->Arg(100)->Arg(static_cast<int64_t>(kMaxAbortPayload) * 2);
}

void BM_EncodeAbortPayload(benchmark::State& state) {
  const AbortPayload payload = Abort(static_cast<size_t>(state.range(0)));
  for (auto _ : state) {
    std::string encoded = EncodeAbortPayload(payload);
    benchmark::DoNotOptimize(encoded);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
}
BENCHMARK(BM_EncodeAbortPayload)->Apply(AbortSizes);

void BM_DecodeAbortPayload(benchmark::State& state) {
  const std::string encoded = EncodeAbortPayload(Abort(static_cast<size_t>(state.range(0))));
  const auto* bytes = reinterpret_cast<const uint8_t*>(encoded.data());
  std::string why;
  for (auto _ : state) {
    std::optional<AbortPayload> payload = DecodeAbortPayload(bytes, encoded.size(), &why);
    benchmark::DoNotOptimize(payload);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()));
  state.counters["payload_bytes"] = static_cast<double>(encoded.size());
}
BENCHMARK(BM_DecodeAbortPayload)->Apply(AbortSizes);

}  // namespace
}  // namespace collectives::transport

// BENCHMARK_MAIN, plus the library's version and build type in the context block, and a warning
// when the code measured here (the library's frame.cc) was not built for release.
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help") {  // before Google Benchmark's own flags
      std::printf(
          "frame_bench: micro benchmark of the wire format's frame header and abort payload.\n"
          "Launching: one process, no ranks (run it directly); it reads no COLLECTIVES_* "
          "variable.\n\n");
    }
  }
  benchmark::AddCustomContext("collectives_version", collectives::Version());
  benchmark::AddCustomContext("collectives_build", collectives::BuildType());
  if (std::string_view(collectives::BuildType()) != "Release") {
    std::fprintf(stderr,
                 "frame_bench: WARNING: the library is a %s build, not Release: "
                 "timings are NOT representative\n",
                 collectives::BuildType());
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
