// Fuzz target: the TCP fabric's frame reader (tcp_receive.cc, TcpConnection's receive side:
// header decode, matching against the posted receive, inline and direct payload reads, abort
// frames, EOF) on an established connection, fed what a peer sends after the handshake. There
// is no seam below ConnectTcpFabric, so each input sets up a real two-rank mesh on loopback:
// the fabric under test is rank 1 (it listens, through a memory store); this target is rank 0,
// which holds the token and completes a real client handshake (HandshakeSession::StartClient),
// then sends the input's stream and closes its sending side.
//
// The first input byte is the plan of rank 1: bits 0-1 how many receives (1 + value % 3), bits
// 2-3 which sizes (kPlans), bit 4 whether it posts every receive before waiting (else it posts
// and waits for one at a time). Receive i expects the data frame tagged #(i + 1)
// all_reduce(u8, sum, count = its bytes). The rest of the input is the stream. Checks:
//   - every call ends with success or a collectives::Error long before its deadline (the
//     peer closed: nothing may wait for more), never a crash;
//   - a receive succeeds only when it and every frame before it were exactly the expected
//     frames, and then its buffer holds the frame's payload; after the first error every later
//     wait fails too (the error is sticky);
//   - a stream that is exactly the expected frames is received in full;
//   - nothing is written outside the receive buffers (guard bytes on both sides, checked after
//     the fabric is destroyed).
#include <array>
#include <asio.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/errors.h"
#include "src/cluster/memory_store.h"
#include "src/transport/frame.h"
#include "src/transport/handshake.h"
#include "src/transport/tcp_fabric.h"
#include "tests/fuzz/loopback.h"

using namespace collectives;
using asio::ip::tcp;

namespace {

constexpr char kJob[] = "fuzz";
constexpr char kToken[] = "fuzz-token";
constexpr char kPrefix[] = "fuzz";
constexpr auto kSetup = std::chrono::milliseconds(30000);
// The peer closed after its stream: every wait ends at once (EOF), long before the deadline,
// which only catches a hang. The margins are wide for a loaded machine under a sanitizer.
constexpr auto kDeadline = std::chrono::milliseconds(30000);
// A wait that fails this long after the receives were posted waited for its deadline.
constexpr auto kTooLong = std::chrono::milliseconds(10000);
constexpr size_t kGuard = 64;
constexpr uint8_t kGuardByte = 0xA5;

// Receive sizes, by bits 2-3 of the plan byte: small ones read inline with their header (up to
// 4096 bytes), larger ones read straight into the buffer, and empty frames.
constexpr std::array<std::array<size_t, 3>, 4> kPlans = {{
    {8, 8, 8},
    {0, 40, 4096},
    {4097, 1, 0},
    {16, 0, 100},
}};

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "fabric_stream_fuzzer: %s\n", what.c_str());
  std::abort();
}

core::CallTag TagOf(size_t index, size_t bytes) {
  core::CallTag tag;
  tag.seq = index + 1;
  tag.call.kind = core::CollectiveKind::kAllReduce;
  tag.call.dtype = DataType::kUInt8;
  tag.call.op = ReduceOp::kSum;
  tag.call.count = bytes;
  return tag;
}

// Rank 0's side: the connection to rank 1, after a real handshake with the token.
tcp::socket ConnectAsRankZero(asio::io_context& io, cluster::MemoryStore& store) {
  const std::string address = store.Get(std::string(kPrefix) + "/addr/1", kSetup);
  const size_t colon = address.rfind(':');
  const tcp::endpoint endpoint(asio::ip::make_address(address.substr(0, colon)),
                               static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  tcp::socket socket(io);
  asio::error_code ec;
  socket.connect(endpoint, ec);
  if (ec) Fail("cannot connect to rank 1: " + ec.message());
  transport::HandshakeConfig config;
  config.job_id = kJob;
  config.token = kToken;
  config.rank = 0;
  config.world_size = 2;
  std::optional<tcp::socket> connected;
  transport::HandshakeResult result;
  transport::HandshakeSession::StartClient(
      std::move(socket), config, 1, transport::Clock::now() + kSetup,
      [&](const transport::HandshakeResult& got, tcp::socket done) {
        result = got;
        if (got.ok) connected.emplace(std::move(done));
      });
  io.restart();
  io.run();
  if (!connected) Fail("the handshake with rank 1 failed: " + result.why);
  return std::move(*connected);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static asio::io_context* io = new asio::io_context();
  const size_t receives = 1 + (data[0] & 3) % 3;
  const auto& sizes = kPlans[(data[0] >> 2) & 3];
  const bool post_all_first = (data[0] & 0x10) != 0;
  const uint8_t* stream = data + 1;
  const size_t stream_bytes = size - 1;

  // How many receives the stream completes, frame by frame, and whether it is nothing more.
  size_t complete = 0;
  size_t at = 0;
  while (complete < receives) {
    transport::FrameHeader header;
    header.tag = TagOf(complete, sizes[complete]);
    header.bytes = sizes[complete];
    const transport::EncodedHeader expected = transport::EncodeHeader(header);
    if (stream_bytes - at < expected.size() + header.bytes ||
        std::memcmp(stream + at, expected.data(), expected.size()) != 0) {
      break;
    }
    at += expected.size() + header.bytes;
    ++complete;
  }
  const bool exact = complete == receives && at == stream_bytes;

  // Rank 1, the fabric under test, sets up on its own thread while this one is rank 0.
  cluster::MemoryStore store;
  std::unique_ptr<transport::Fabric> fabric;
  std::string setup_error;
  std::thread rank_one([&] {
    transport::TcpFabricOptions options;
    options.job_id = kJob;
    options.token = kToken;
    options.key_prefix = kPrefix;
    options.timeout = kSetup;
    try {
      fabric = transport::ConnectTcpFabric(1, 2, store, options);
    } catch (const Error& error) {
      setup_error = error.what();
    }
  });
  tcp::socket peer = ConnectAsRankZero(*io, store);
  rank_one.join();
  if (!fabric) Fail("rank 1 did not set up: " + setup_error);

  fuzz::SendAll(peer.native_handle(), stream, stream_bytes, fuzz::After(kDeadline));
  asio::error_code ec;
  peer.shutdown(tcp::socket::shutdown_send, ec);

  std::vector<std::vector<uint8_t>> buffers(receives);
  for (size_t i = 0; i < receives; ++i) buffers[i].assign(kGuard + sizes[i] + kGuard, kGuardByte);
  transport::Connection& connection = fabric->connection(0);
  const auto start = transport::Clock::now();
  fabric->SetDeadline(start + kDeadline);
  std::vector<uint64_t> tickets(receives, 0);
  std::optional<std::string> failed;  // the first error
  auto post = [&](size_t i) {
    tickets[i] = connection.PostRecv(TagOf(i, sizes[i]), buffers[i].data() + kGuard, sizes[i]);
  };
  for (size_t i = 0; i < receives; ++i) {
    try {
      if (post_all_first && i == 0) {
        for (size_t j = 0; j < receives; ++j) post(j);
      } else if (!post_all_first) {
        post(i);
      }
      connection.WaitRecv(tickets[i] == 0 ? 1 : tickets[i]);
    } catch (const Error& error) {
      if (transport::Clock::now() - start >= kTooLong) {
        Fail(std::string("a receive waited for its deadline after the peer closed: ") +
             error.what());
      }
      if (!failed) failed = error.what();
      continue;
    }
    if (failed) Fail("a wait succeeded after the fabric broke with: " + *failed);
    if (i >= complete)
      Fail("receive " + std::to_string(i) + " succeeded on a frame it must refuse");
    size_t offset = 0;
    for (size_t j = 0; j < i; ++j) offset += transport::kFrameHeaderBytes + sizes[j];
    offset += transport::kFrameHeaderBytes;
    if (sizes[i] > 0 && std::memcmp(buffers[i].data() + kGuard, stream + offset, sizes[i]) != 0) {
      Fail("receive " + std::to_string(i) + " holds other bytes than its frame carried");
    }
  }
  if (exact && failed) Fail("a stream of exactly the expected frames failed: " + *failed);
  fabric.reset();
  for (size_t i = 0; i < receives; ++i) {
    for (size_t k = 0; k < kGuard; ++k) {
      if (buffers[i][k] != kGuardByte || buffers[i][kGuard + sizes[i] + k] != kGuardByte) {
        Fail("a byte next to receive buffer " + std::to_string(i) + " was overwritten");
      }
    }
  }
  return 0;
}
