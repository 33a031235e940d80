// Plain POSIX loopback sockets for the fuzz targets that play a stranger, a hostile server or a
// peer: a listener on 127.0.0.1 (an ephemeral port), a connect, and sends and reads that each end
// by a deadline (poll), so that no target can hang on a socket of its own. Not a
// *_fuzzer.cc, so not a target itself.
//
// Thread-safety: plain functions over descriptors; a descriptor is used by one thread at a time.
#ifndef COLLECTIVES_TESTS_FUZZ_LOOPBACK_H_
#define COLLECTIVES_TESTS_FUZZ_LOOPBACK_H_

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace collectives::fuzz {

using Clock = std::chrono::steady_clock;

inline Clock::time_point After(std::chrono::milliseconds timeout) { return Clock::now() + timeout; }

// Waits until `fd` is ready for `events` or `deadline` passes; false on the deadline.
inline bool WaitFor(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd entry{fd, events, 0};
    const int ready = ::poll(&entry, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) return false;
  }
}

// A listening socket on 127.0.0.1, an ephemeral port (in `*port`); -1 on failure.
inline int ListenLoopback(uint16_t* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::listen(fd, 64) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    ::close(fd);
    return -1;
  }
  *port = ntohs(address.sin_port);
  return fd;
}

// A connected (blocking) socket to 127.0.0.1:port; -1 on failure.
inline int ConnectLoopback(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    ::close(fd);
    return -1;
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

// Sends all `size` bytes by `deadline` (never raising SIGPIPE); false if the peer is gone or the
// deadline passed first.
inline bool SendAll(int fd, const void* data, size_t size, Clock::time_point deadline) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t sent = ::send(fd, bytes, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0) {
      bytes += sent;
      size -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && WaitFor(fd, POLLOUT, deadline)) {
      continue;
    }
    return false;
  }
  return true;
}

// Reads exactly `size` bytes by `deadline`; false on EOF, an error or the deadline.
inline bool ReadExact(int fd, void* data, size_t size, Clock::time_point deadline) {
  auto* bytes = static_cast<uint8_t*>(data);
  while (size > 0) {
    if (!WaitFor(fd, POLLIN, deadline)) return false;
    const ssize_t got = ::recv(fd, bytes, size, MSG_DONTWAIT);
    if (got > 0) {
      bytes += got;
      size -= static_cast<size_t>(got);
      continue;
    }
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    return false;
  }
  return true;
}

// Reads until the peer closes (true: EOF or reset) or `deadline` passes (false), appending what
// came to `*out` (at most `limit` bytes kept).
inline bool ReadUntilClosed(int fd, std::string* out, Clock::time_point deadline,
                            size_t limit = 1 << 20) {
  char buffer[4096];
  for (;;) {
    if (!WaitFor(fd, POLLIN, deadline)) return false;
    const ssize_t got = ::recv(fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (got > 0) {
      out->append(buffer, std::min(static_cast<size_t>(got), limit - std::min(limit, out->size())));
      continue;
    }
    if (got < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    return true;  // 0: EOF; otherwise reset or another error: closed either way
  }
}

}  // namespace collectives::fuzz

#endif  // COLLECTIVES_TESTS_FUZZ_LOOPBACK_H_
