// One rank of a two-process TCP measurement: an 8-byte ping-pong (mean round trip) and a
// one-way stream of large frames (throughput). Both ranks meet through a file store.
//
//   transport_pingpong_worker RANK STORE_DIR [ROUND_TRIPS] [STREAM_FRAMES] [FRAME_BYTES] [SPIN_US]
//
// Rank 0 prints "rtt_us=<mean> throughput_gbps=<GB/s>" (GB = 1e9 bytes). Exit status 0 on
// success, 1 with the error on stderr otherwise.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/transport/tcp_fabric.h"

namespace {

using collectives::transport::Clock;
using collectives::transport::Connection;

collectives::core::CallTag Tag(uint64_t seq, uint64_t count) {
  collectives::core::CallTag tag;
  tag.seq = seq;
  tag.call.dtype = collectives::DataType::kUInt8;
  tag.call.count = count;
  return tag;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: %s RANK STORE_DIR [ROUND_TRIPS] [STREAM_FRAMES] [FRAME_BYTES] "
                 "[SPIN_US]\n",
                 argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const std::string dir = argv[2];
  const int round_trips = argc > 3 ? std::atoi(argv[3]) : 20000;
  const int frames = argc > 4 ? std::atoi(argv[4]) : 200;
  const size_t frame_bytes = argc > 5 ? std::strtoull(argv[5], nullptr, 10) : (4u << 20);
  const int spin_us = argc > 6 ? std::atoi(argv[6]) : -1;
  try {
    auto store = collectives::CreateFileStore(dir);
    collectives::transport::TcpFabricOptions options;
    options.timeout = std::chrono::milliseconds(30'000);
    auto fabric = collectives::transport::ConnectTcpFabric(rank, 2, *store, options);
    if (spin_us >= 0) fabric->SetSpin(std::chrono::microseconds(spin_us), std::chrono::microseconds(0));
    fabric->SetDeadline(Clock::now() + std::chrono::seconds(120));
    Connection& peer = fabric->connection(1 - rank);

    // Ping-pong: rank 0 sends, rank 1 echoes.
    uint64_t out = 0;
    uint64_t in = 0;
    const int warmup = round_trips / 10 + 1;
    Clock::time_point start;
    for (int i = 0; i < warmup + round_trips; ++i) {
      if (i == warmup) start = Clock::now();
      const auto tag = Tag(static_cast<uint64_t>(i), 8);
      if (rank == 0) {
        out = static_cast<uint64_t>(i);
        peer.PostSend(tag, &out, 8);
        peer.WaitRecv(peer.PostRecv(tag, &in, 8));
        if (in != out) throw std::runtime_error("ping-pong payload corrupted");
      } else {
        peer.WaitRecv(peer.PostRecv(tag, &in, 8));
        out = in;
        peer.PostSend(tag, &out, 8);
      }
    }
    const double rtt_us =
        std::chrono::duration<double, std::micro>(Clock::now() - start).count() / round_trips;

    // Stream: rank 0 sends `frames` frames, rank 1 receives them with 4 buffers in rotation.
    constexpr int kInFlight = 4;
    std::vector<std::vector<uint8_t>> buffers(kInFlight, std::vector<uint8_t>(frame_bytes, 1));
    const uint64_t base = static_cast<uint64_t>(warmup + round_trips);
    uint8_t go = 0;
    const auto go_tag = Tag(base, 1);
    if (rank == 1) peer.WaitSend(peer.PostSend(go_tag, &go, 1));  // start timing together
    if (rank == 0) peer.WaitRecv(peer.PostRecv(go_tag, &go, 1));
    const auto stream_start = Clock::now();
    std::vector<uint64_t> tickets(frames);
    for (int i = 0; i < frames; ++i) {
      auto& buffer = buffers[i % kInFlight];
      const auto tag = Tag(base + 1 + i, frame_bytes);
      if (rank == 0) {
        if (i >= kInFlight) peer.WaitSend(tickets[i - kInFlight]);
        tickets[i] = peer.PostSend(tag, buffer.data(), frame_bytes);
      } else {
        if (i >= kInFlight) peer.WaitRecv(tickets[i - kInFlight]);
        tickets[i] = peer.PostRecv(tag, buffer.data(), frame_bytes);
      }
    }
    uint8_t done = 0;
    const auto done_tag = Tag(base + 1 + frames, 1);
    if (rank == 0) {
      peer.WaitRecv(peer.PostRecv(done_tag, &done, 1));  // rank 1 has every byte
    } else {
      if (frames > 0) peer.WaitRecv(tickets[frames - 1]);
      peer.WaitSend(peer.PostSend(done_tag, &done, 1));
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - stream_start).count();
    const double gbps = static_cast<double>(frame_bytes) * frames / seconds / 1e9;
    if (rank == 0) {
      if (frames > 0) peer.WaitSend(tickets[frames - 1]);
      std::printf("rtt_us=%.2f throughput_gbps=%.2f\n", rtt_us, gbps);
      std::fflush(stdout);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "rank %d: %s\n", rank, error.what());
    return 1;
  }
  return 0;
}
