// A TCP port nobody listens on right now, for the tests that start a job on a port of their
// choosing.
//
// The port is drawn below the kernel's ephemeral range (ip_local_port_range), checked by binding
// it on every address, and released. A port handed out by bind(port 0) would come from the
// ephemeral range, where any connect() made in the meantime (by this test, or by another test
// that ctest runs beside it) may take it before the job's listener binds it. Below the range only
// another listener can: another test drawing the same port within the same few milliseconds.
#ifndef COLLECTIVES_TESTS_FREE_PORT_H_
#define COLLECTIVES_TESTS_FREE_PORT_H_

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <random>

namespace collectives::testing {

namespace free_port_internal {

// Binds `port` (0: any) on every address and returns the port bound, or 0 when it is taken.
inline uint16_t TryBind(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(port);
  uint16_t bound = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
    socklen_t length = sizeof(address);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
      bound = ntohs(address.sin_port);
    }
  }
  close(fd);
  return bound;
}

// The first port of the ephemeral range (Linux's default when it cannot be read).
inline uint32_t EphemeralLow() {
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  uint32_t low = 0;
  uint32_t high = 0;
  if (range >> low >> high && low > 0) return low;
  return 32768;
}

}  // namespace free_port_internal

inline uint16_t FreePort() {
  constexpr uint32_t kLowest = 10000;
  const uint32_t limit = free_port_internal::EphemeralLow();
  if (limit > kLowest + 1000) {
    static thread_local std::mt19937 draw(static_cast<uint32_t>(
        getpid() ^ std::chrono::steady_clock::now().time_since_epoch().count()));
    std::uniform_int_distribution<uint32_t> pick(kLowest, limit - 1);
    for (int attempt = 0; attempt < 200; ++attempt) {
      const uint16_t port = free_port_internal::TryBind(static_cast<uint16_t>(pick(draw)));
      if (port != 0) return port;
    }
  }
  // A machine whose ephemeral range starts low: the kernel's choice, race and all.
  const uint16_t port = free_port_internal::TryBind(0);
  EXPECT_NE(port, 0) << "no free TCP port";
  return port;
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_FREE_PORT_H_
