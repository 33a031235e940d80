// Fuzz target: the server side of the fabric handshake, as a listening rank runs it on a
// connection from anyone. The input is what a stranger sends on a fresh loopback connection
// (then it closes its sending side); the session must end, once, with a result (accepted only
// with a valid proof, which random bytes do not have), within its deadline, without a crash.
#include <asio.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "src/transport/handshake.h"
#include "tests/fuzz/asio_loopback.h"

using namespace collectives;
using asio::ip::tcp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::AsioLoopback& lo = fuzz::SharedAsioLoopback();
  asio::error_code ec;
  tcp::socket client(lo.io);
  client.connect(lo.acceptor.local_endpoint(), ec);
  if (ec) return 0;
  tcp::socket server = lo.acceptor.accept(ec);
  if (ec) return 0;
  // What the stranger sends; the kernel buffers it (inputs are small), then EOF.
  asio::write(client, asio::buffer(data, size), ec);
  client.shutdown(tcp::socket::shutdown_send, ec);

  transport::HandshakeConfig config;
  config.job_id = "fuzz";
  config.token = "fuzz-token";
  config.rank = 0;
  config.world_size = 4;
  int calls = 0;
  bool ok = false;
  transport::HandshakeSession::StartServer(
      std::move(server), config, [](int rank) { return rank > 0 && rank < 4; },
      transport::Clock::now() + std::chrono::seconds(2),
      [&](const transport::HandshakeResult& result, tcp::socket) {
        ++calls;
        ok = result.ok;
      });
  lo.io.restart();
  lo.io.run();
  if (calls != 1) {
    std::fprintf(stderr, "handshake_fuzzer: done ran %d times\n", calls);
    std::abort();
  }
  if (ok) {
    std::fprintf(stderr, "handshake_fuzzer: a stranger without the token was accepted\n");
    std::abort();
  }
  client.close(ec);
  return 0;
}
