// Mesh set-up with strangers: the listener, the address exchange through the store, connects
// with retry, accepts, and the handshakes (handshake.h) that admit ranks and refuse everyone
// else. It ends with one connected, authenticated socket per peer, which the fabric then takes.
//
// Every rank binds a listener, publishes "host:port" under "<key_prefix>/addr/<rank>", connects
// to the peers of higher rank and accepts the peers of lower rank: every peer, or with
// TcpFabricOptions::on_demand those of peers_at_setup. Then a lower rank that connects early
// (at its first use of the connection, its own set-up done) is admitted too, and the listener
// is handed to the fabric, which goes on accepting. Strangers who connect cannot
// hold the listener: server handshakes are bounded in number and in time, and refusals are
// logged a line a second at most.
#ifndef COLLECTIVES_SRC_TRANSPORT_TCP_MESH_H_
#define COLLECTIVES_SRC_TRANSPORT_TCP_MESH_H_

#include <asio.hpp>
#include <cstddef>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/listener_guard.h"
#include "src/cluster/name_lookups.h"
#include "src/transport/connection.h"
#include "src/transport/handshake.h"
#include "src/transport/socket_buffers.h"
#include "src/transport/tcp_fabric.h"

namespace collectives::transport {

// Builds the mesh on its own io_context; the finished sockets are then moved to the fabric's.
// Used by one thread, ConnectTcpFabric's caller; its handlers run on that thread, inside Build.
class MeshBuilder {
  using tcp = asio::ip::tcp;

 public:
  MeshBuilder(int rank, int size, const TcpFabricOptions& options);

  // Listens, publishes this rank's address, reads the peers', connects and accepts until every
  // peer is admitted. The sockets belong to this builder's io_context: the caller moves their
  // descriptors out (TcpFabric) before the builder goes. Throws as ConnectTcpFabric says.
  std::vector<std::optional<tcp::socket>>& Build(Store& store);

  // After Build, with on_demand: the listener's descriptor, which the caller now owns, and its
  // protocol; and the peers' addresses read during the set-up (an empty host: not read).
  int ReleaseListener(tcp* protocol);
  const std::vector<cluster::HostPort>& addresses() const { return addresses_; }
  const HandshakeConfig& handshake_config() const { return config_; }

 private:
  std::string Prefix() const { return "rank " + std::to_string(rank_) + ": "; }
  // Binds the listener to options_.bind_host, looking a name up first.
  void Listen();
  // Runs the set-up's event loop until `done`, a failure, the deadline or the caller's
  // cancellation (which becomes failure_).
  void RunUntil(const std::function<bool()>& done);
  void ReadAddresses(Store& store);
  void AcceptNext();
  // On a failed accept: makes room (EvictOldestStranger, or the spare descriptor) and accepts
  // again, waits for the next connection, or retries shortly.
  void OnAcceptError(const asio::error_code& ec);
  // Cancels the server handshake that has waited longest, of those whose client has not proved
  // the token; false if none is in progress.
  bool EvictOldestStranger(const char* why);
  // Looks the peer's host up (unless it is an address) and connects to it (ConnectTo).
  void Connect(int peer);
  void ConnectTo(int peer, const tcp::endpoint& endpoint);
  void RetryConnect(int peer);
  void Admit(int peer, tcp::socket socket);
  [[noreturn]] void ThrowTimeout();

  const int rank_;
  const int size_;
  const TcpFabricOptions options_;
  const Clock::time_point start_;
  const Clock::time_point deadline_;
  HandshakeConfig config_;
  const size_t receive_buffer_;     // SO_RCVBUF of the data connections; 0: autotuning
  const SendBuffers send_buffers_;  // SO_SNDBUF of the data connections; 0: autotuning

  asio::io_context io_{1};  // declared before every socket and timer
  cluster::NameLookups lookups_{io_};
  tcp::acceptor acceptor_;
  std::vector<std::optional<tcp::socket>> sockets_;  // admitted, by peer rank
  std::vector<std::string> status_;                  // last news of each missing peer
  std::vector<cluster::HostPort> addresses_;
  std::vector<int> attempts_;
  std::vector<bool> wanted_;  // the peers connected during the set-up
  std::vector<std::weak_ptr<HandshakeSession>> sessions_;
  std::vector<std::unique_ptr<asio::steady_timer>> timers_;
  size_t prune_sessions_at_ = 64;  // sessions_' size at which the finished ones are dropped
  // The server handshakes in progress, oldest first (and finished ones not yet dropped). At
  // most MaxServerHandshakes(): a new connection past it cancels the oldest, so that strangers
  // who connect and say nothing cannot hold every descriptor of the process while a rank waits
  // in the backlog; a rank whose handshake is cancelled sees a close and connects again.
  std::deque<std::weak_ptr<HandshakeSession>> server_handshakes_;
  // Two per rank that connects here (a retry may overlap a stale attempt) and 16 for strangers:
  // to cancel a rank's handshake, a stranger must open 16 connections within its round trips.
  size_t MaxServerHandshakes() const { return 2 * static_cast<size_t>(rank_) + 16; }
  cluster::SpareDescriptor spare_;
  std::string last_accept_error_;  // for ThrowTimeout
  cluster::RateLimitedLog accept_log_;
  cluster::RateLimitedLog eviction_log_;
  // Refused handshakes (strangers, a wrong token or job): a line a second at most, so that a
  // stranger who hammers the port cannot flood the log; Build ends with how many were left out.
  cluster::RateLimitedLog refusal_log_{[this](const std::string& text) {
    ++refusals_logged_;
    std::fwrite(text.data(), 1, text.size(), stderr);
  }};
  long refusals_ = 0;
  long refusals_logged_ = 0;
  std::optional<Error> failure_;
  int missing_ = 0;
};

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_TCP_MESH_H_
