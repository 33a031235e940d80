// Fuzz target: the client side of the fabric handshake (HandshakeSession::StartClient), as a
// rank runs it on the connection it opened to a higher rank, against a hostile server on
// loopback. The client is rank 0 of 4 in job "fuzz" and expects rank 1. The first input byte
// picks the server (even: raw, odd: holds the token); the rest is what it sends:
//   raw: all of it, as is, then it closes its sending side. Nobody proves the token: the
//     session must end, once, and never accepted;
//   token: once the client's hello is in, the input's first hello (48 bytes and its job id, as
//     its bytes 6-7 say) and then a valid verdict with the server's proof, computed from the
//     client's nonce and the hello's rank and nonce (an input too short for its hello is sent
//     as is). The session must end, once, and be accepted exactly when that hello is one the
//     client must accept: magic, wire version 1, no refusal, job "fuzz", world size 4, rank 1.
// Every session ends by its deadline (2 s here), without a crash.
#include <asio.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "src/transport/handshake.h"
#include "tests/fuzz/asio_loopback.h"

using namespace collectives;
using asio::ip::tcp;

namespace {

constexpr char kJob[] = "fuzz";
constexpr char kFuzzToken[] = "fuzz-token";
constexpr int kWorld = 4;
constexpr int kServerRank = 1;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "handshake_client_fuzzer: %s\n", what.c_str());
  std::abort();
}

uint32_t GetU32(const uint8_t* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(in[i]) << (8 * i);
  return v;
}

// Whether `hello` (its whole length) is one the client must accept, checked by hand.
bool Acceptable(const std::vector<uint8_t>& hello) {
  if (hello.size() != transport::kHelloFixedBytes + sizeof(kJob) - 1) return false;
  return GetU32(hello.data()) == transport::kHelloMagic && hello[4] == 1 && hello[5] == 0 &&
         hello[6] == sizeof(kJob) - 1 && hello[7] == 0 &&
         GetU32(hello.data() + 8) == static_cast<uint32_t>(kServerRank) &&
         GetU32(hello.data() + 12) == static_cast<uint32_t>(kWorld) &&
         std::memcmp(hello.data() + transport::kHelloFixedBytes, kJob, sizeof(kJob) - 1) == 0;
}

// The server that holds the token: reads the client's hello, then sends `hello` and a valid
// verdict for it. Lives on the io_context; `socket` is closed by the caller when the client's
// session ended.
struct TokenServer : std::enable_shared_from_this<TokenServer> {
  TokenServer(tcp::socket& server_socket, std::vector<uint8_t> server_hello)
      : socket(server_socket), hello(std::move(server_hello)) {}

  void Start() {
    client_hello.resize(transport::kHelloFixedBytes + sizeof(kJob) - 1);
    asio::async_read(socket, asio::buffer(client_hello),
                     [self = shared_from_this()](const asio::error_code& ec, size_t) {
                       if (!ec) self->Answer();
                     });
  }

  void Answer() {
    transport::Nonce client_nonce;
    std::memcpy(client_nonce.data(), client_hello.data() + 16, client_nonce.size());
    transport::Nonce server_nonce;
    std::memcpy(server_nonce.data(), hello.data() + 16, server_nonce.size());
    const auto server_rank = static_cast<int32_t>(GetU32(hello.data() + 8));
    const transport::Proof proof =
        transport::ComputeProof(kFuzzToken, kJob, 0, server_rank, client_nonce, server_nonce,
                                transport::HandshakeRole::kServer);
    out = hello;
    out.push_back(1);
    out.insert(out.end(), proof.begin(), proof.end());
    asio::async_write(socket, asio::buffer(out),
                      [self = shared_from_this()](const asio::error_code&, size_t) {});
  }

  tcp::socket& socket;
  std::vector<uint8_t> hello;
  std::vector<uint8_t> client_hello;
  std::vector<uint8_t> out;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  fuzz::AsioLoopback& lo = fuzz::SharedAsioLoopback();
  const bool token_server = (data[0] & 1) != 0;
  const uint8_t* bytes = data + 1;
  const size_t bytes_size = size - 1;

  asio::error_code ec;
  tcp::socket client(lo.io);
  client.connect(lo.acceptor.local_endpoint(), ec);
  if (ec) return 0;
  tcp::socket server = lo.acceptor.accept(ec);
  // Connected but not accepted would leave the connection in the backlog for the next input.
  if (ec) {
    std::fprintf(stderr, "handshake_client_fuzzer: accept failed: %s\n", ec.message().c_str());
    std::abort();
  }

  // The server's hello in token mode: its length from its own bytes 6-7.
  std::vector<uint8_t> hello;
  if (token_server && bytes_size >= transport::kHelloFixedBytes) {
    const size_t job_id_bytes = bytes[6] | (size_t{bytes[7]} << 8);
    if (bytes_size - transport::kHelloFixedBytes >= job_id_bytes) {
      hello.assign(bytes, bytes + transport::kHelloFixedBytes + job_id_bytes);
    }
  }
  if (hello.empty()) {
    // What the server sends; the kernel buffers it (inputs are small), then EOF.
    asio::write(server, asio::buffer(bytes, bytes_size), ec);
    server.shutdown(tcp::socket::shutdown_send, ec);
  } else {
    std::make_shared<TokenServer>(server, hello)->Start();
  }

  transport::HandshakeConfig config;
  config.job_id = kJob;
  config.token = kFuzzToken;
  config.rank = 0;
  config.world_size = kWorld;
  int calls = 0;
  transport::HandshakeResult result;
  transport::HandshakeSession::StartClient(
      std::move(client), config, kServerRank, transport::Clock::now() + std::chrono::seconds(2),
      [&](const transport::HandshakeResult& got, tcp::socket) {
        ++calls;
        result = got;
        server.close(ec);  // ends the fake server's pending read, if any
      });
  lo.io.restart();
  lo.io.run();
  if (calls != 1) Fail("done ran " + std::to_string(calls) + " times");
  const bool acceptable = !hello.empty() && Acceptable(hello);
  if (result.ok && !acceptable) {
    Fail(hello.empty() ? "a server without the token was accepted"
                       : "a server whose hello must be refused was accepted");
  }
  if (!result.ok && acceptable && result.code != ErrorCode::kTimeout) {
    Fail("a server with the token and a valid hello was refused: " + result.why);
  }
  if (result.ok && result.peer_rank != kServerRank) Fail("accepted as another rank");
  if (!result.ok && result.code == ErrorCode::kInternal) Fail("failed with kInternal");
  server.close(ec);
  return 0;
}
