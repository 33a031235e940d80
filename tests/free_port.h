// A loopback port nobody listens on right now (bound, read back and released: good enough on a
// test machine), for the tests that start a job on a port of their choosing.
#ifndef COLLECTIVES_TESTS_FREE_PORT_H_
#define COLLECTIVES_TESTS_FREE_PORT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>

namespace collectives::testing {

inline uint16_t FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_FREE_PORT_H_
