// Connections that connect and say nothing, as idle strangers on a listener do: shared by the
// tests of the fabric's listener and of the TCP store's server under a flood of them.
#ifndef COLLECTIVES_TESTS_TRANSPORT_IDLE_CONNECTIONS_H_
#define COLLECTIVES_TESTS_TRANSPORT_IDLE_CONNECTIONS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

namespace collectives::testing {

// Blocking IPv4 connections, closed with the object. Used by one thread.
class IdleConnections {
 public:
  using Clock = std::chrono::steady_clock;

  IdleConnections() = default;
  IdleConnections(const IdleConnections&) = delete;
  IdleConnections& operator=(const IdleConnections&) = delete;
  ~IdleConnections() {
    for (int fd : fds_) ::close(fd);
  }

  // Opens up to `count` more connections to `address` ("a.b.c.d:port"), stopping at the first
  // that fails; returns how many are open in all.
  size_t Open(const std::string& address, int count) {
    const size_t colon = address.rfind(':');
    sockaddr_in target{};
    target.sin_family = AF_INET;
    target.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
    if (::inet_pton(AF_INET, address.substr(0, colon).c_str(), &target.sin_addr) != 1) {
      return fds_.size();
    }
    for (int i = 0; i < count; ++i) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) break;
      if (::connect(fd, reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
        ::close(fd);
        break;
      }
      fds_.push_back(fd);
    }
    return fds_.size();
  }

  const std::vector<int>& fds() const { return fds_; }
  size_t size() const { return fds_.size(); }

  // Waits until at least `count` of them were closed (or reset) by the peer, or `deadline`
  // passes; returns how many were. Bytes the peer sent are dropped.
  size_t WaitClosed(size_t count, Clock::time_point deadline) {
    closed_.resize(fds_.size(), false);
    for (;;) {
      size_t closed = 0;
      std::vector<pollfd> open;
      for (size_t i = 0; i < fds_.size(); ++i) {
        char buffer[256];
        ssize_t n = -1;
        while (!closed_[i] && (n = ::recv(fds_[i], buffer, sizeof(buffer), MSG_DONTWAIT)) != 0) {
          if (n < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) closed_[i] = true;
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          }
        }
        if (n == 0) closed_[i] = true;
        if (closed_[i]) {
          ++closed;
        } else {
          open.push_back(pollfd{fds_[i], POLLIN, 0});
        }
      }
      if (closed >= count || Clock::now() >= deadline || open.empty()) return closed;
      ::poll(open.data(), open.size(), 100);
    }
  }

 private:
  std::vector<int> fds_;
  std::vector<bool> closed_;
};

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_TRANSPORT_IDLE_CONNECTIONS_H_
