// The io_context and the loopback acceptor (127.0.0.1, an ephemeral port) that the handshake
// fuzz targets keep for all their inputs: one per process, never destroyed (libFuzzer exits
// without running destructors). Not a *_fuzzer.cc, so not a target itself.
//
// Thread-safety: used by the target's one thread.
#ifndef COLLECTIVES_TESTS_FUZZ_ASIO_LOOPBACK_H_
#define COLLECTIVES_TESTS_FUZZ_ASIO_LOOPBACK_H_

#include <asio.hpp>

namespace collectives::fuzz {

struct AsioLoopback {
  asio::io_context io;
  asio::ip::tcp::acceptor acceptor{io,
                                   asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)};
};

inline AsioLoopback& SharedAsioLoopback() {
  static AsioLoopback* loopback = new AsioLoopback();
  return *loopback;
}

}  // namespace collectives::fuzz

#endif  // COLLECTIVES_TESTS_FUZZ_ASIO_LOOPBACK_H_
