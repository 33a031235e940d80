// A TCP relay that hands bytes on in pieces, for tests of the receive path.
//
// Loopback TCP between threads delivers a small frame in one segment, so a test over it rarely
// sees a header, a payload or a handshake message arrive in parts. A PieceRelay listens on
// 127.0.0.1, connects each connection it accepts to its target, and copies the bytes both ways
// in pieces of random length (half of them 1-8 bytes, a few up to 64 KiB), each its own
// segment (TCP_NODELAY), sleeping a little after some, so the reader finds every kind of split:
// inside a header, between a header and its payload, inside an abort frame, across two frames.
// An end that closes is passed on as a half-close of the other end (a reset too, as a close).
// With `close_first` > 0, the first that many connections are closed at once instead, as a
// listener does that stopped or gave up while they waited in its backlog.
//
// RelayingStore wraps a Store: a value set under a key that contains "/addr/" (where a TCP
// fabric publishes its listener, "host:port") goes to the inner store as the address of a new
// PieceRelay to it, so every connection of a mesh built through the store passes a relay.
// Keep the store alive until the fabrics or communicators built through it are gone; its
// destructor shuts every relay and joins their threads.
#ifndef COLLECTIVES_TESTS_TRANSPORT_PIECE_RELAY_H_
#define COLLECTIVES_TESTS_TRANSPORT_PIECE_RELAY_H_

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <asio.hpp>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"

namespace collectives::testing {

class PieceRelay {
 public:
  // `target` is "host:port" or "[v6]:port" with a numeric host, as a fabric publishes it.
  PieceRelay(const std::string& target, uint64_t seed, int close_first = 0)
      : seed_(seed), close_first_(close_first) {
    std::string why;
    const std::optional<cluster::HostPort> parsed = cluster::ParseHostPort(target, &why);
    if (!parsed) throw Error(ErrorCode::kInvalidArgument, "relay target " + target + ": " + why);
    target_ = asio::ip::tcp::endpoint(asio::ip::make_address(parsed->host), parsed->port);
    acceptor_.open(asio::ip::tcp::v4());
    acceptor_.bind({asio::ip::make_address("127.0.0.1"), 0});
    acceptor_.listen();
    accepter_ = std::thread([this] { AcceptLoop(); });
  }

  PieceRelay(const PieceRelay&) = delete;
  PieceRelay& operator=(const PieceRelay&) = delete;

  ~PieceRelay() {
    stopping_ = true;
    // shutdown(2) wakes a thread blocked in accept or recv on the descriptor; the objects are
    // closed only after every thread that uses them has been joined.
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
    accepter_.join();
    std::lock_guard<std::mutex> lock(mutex_);
    for (Link& link : links_) {
      ::shutdown(link.accepted.native_handle(), SHUT_RDWR);
      ::shutdown(link.connected.native_handle(), SHUT_RDWR);
    }
    for (Link& link : links_) {
      for (std::thread* t : {&link.up, &link.down}) {
        if (t->joinable()) t->join();
      }
    }
  }

  uint16_t port() const { return acceptor_.local_endpoint().port(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port()); }

 private:
  struct Link {
    explicit Link(asio::io_context& io) : accepted(io), connected(io) {}
    asio::ip::tcp::socket accepted;
    asio::ip::tcp::socket connected;
    std::thread up;
    std::thread down;
  };

  void AcceptLoop() {
    for (uint64_t n = 0; !stopping_; ++n) {
      auto socket = asio::ip::tcp::socket(io_);
      asio::error_code ec;
      acceptor_.accept(socket, ec);
      if (ec || stopping_) return;
      if (n < uint64_t(close_first_)) {
        socket.close(ec);
        continue;
      }
      std::lock_guard<std::mutex> lock(mutex_);
      Link& link = links_.emplace_back(io_);
      link.accepted = std::move(socket);
      link.connected.connect(target_, ec);
      if (ec) {
        // The target is gone: the client sees its connection close.
        ::shutdown(link.accepted.native_handle(), SHUT_RDWR);
        continue;
      }
      for (auto* s : {&link.accepted, &link.connected})
        s->set_option(asio::ip::tcp::no_delay(true));
      const int a = link.accepted.native_handle();
      const int b = link.connected.native_handle();
      link.up = std::thread([this, a, b, n] { Pump(a, b, seed_ * 1000 + 2 * n); });
      link.down = std::thread([this, b, a, n] { Pump(b, a, seed_ * 1000 + 2 * n + 1); });
    }
  }

  // Copies from `from` to `to` in random pieces until `from` ends; then half-closes `to`. A
  // failed write shuts `from` for reading, so its writer sees the connection go too.
  static void Pump(int from, int to, uint64_t seed) {
    std::mt19937_64 random(seed);
    std::vector<char> buffer(64 << 10);
    for (;;) {
      const ssize_t got = ::recv(from, buffer.data(), buffer.size(), 0);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) break;
      if (!SendInPieces(to, buffer.data(), size_t(got), random)) {
        ::shutdown(from, SHUT_RD);
        break;
      }
    }
    ::shutdown(to, SHUT_WR);
  }

  // Sends `bytes` as pieces of PieceLength, sleeping up to 200 us after one in eight. False when
  // a send fails.
  static bool SendInPieces(int to, const char* data, size_t bytes, std::mt19937_64& random) {
    for (size_t at = 0; at < bytes;) {
      const size_t piece = std::min(PieceLength(random), bytes - at);
      const ssize_t sent = ::send(to, data + at, piece, MSG_NOSIGNAL);
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) return false;
      at += size_t(sent);
      if (random() % 8 == 0) std::this_thread::sleep_for(std::chrono::microseconds(random() % 200));
    }
    return true;
  }

  static size_t PieceLength(std::mt19937_64& random) {
    const uint64_t kind = random() % 10;
    if (kind < 5) return 1 + random() % 8;
    if (kind < 8) return 9 + random() % 120;
    return 129 + random() % (64 << 10);
  }

  const uint64_t seed_;
  const int close_first_;
  asio::ip::tcp::endpoint target_;
  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_{io_};
  std::atomic<bool> stopping_{false};
  std::thread accepter_;
  std::mutex mutex_;
  std::list<Link> links_;
};

class RelayingStore : public Store {
 public:
  // `close_first`: as for PieceRelay, for every relay.
  RelayingStore(std::shared_ptr<Store> inner, uint64_t seed, int close_first = 0)
      : inner_(std::move(inner)), seed_(seed), close_first_(close_first) {}

  void Set(const std::string& key, const std::string& value) override {
    if (key.find("/addr/") == std::string::npos) return inner_->Set(key, value);
    std::string relayed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      relays_.push_back(std::make_unique<PieceRelay>(value, seed_ + relays_.size(), close_first_));
      relayed = relays_.back()->address();
    }
    inner_->Set(key, relayed);
  }
  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    return inner_->Get(key, timeout);
  }
  int64_t Add(const std::string& key, int64_t delta) override { return inner_->Add(key, delta); }

 private:
  std::shared_ptr<Store> inner_;
  const uint64_t seed_;
  const int close_first_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<PieceRelay>> relays_;
};

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_TRANSPORT_PIECE_RELAY_H_
