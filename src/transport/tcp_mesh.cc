// Mesh set-up with strangers: MeshBuilder (tcp_mesh.h) and LocalAddressToward (tcp_fabric.h).
#include "src/transport/tcp_mesh.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <iterator>

#include "src/cluster/store_common.h"

namespace collectives::transport {
namespace {

using asio::ip::tcp;
using cluster::AfterAcceptFailure;

std::string JoinRanks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}

// How long the listener gives one handshake: what the store gives a connection to prove the
// token (tcp_store.h). A stranger that connects and says nothing is closed after it rather than
// at the set-up deadline; a rank's handshake takes a few round trips.
constexpr std::chrono::seconds kServerHandshakeLimit{10};

}  // namespace

MeshBuilder::MeshBuilder(int rank, int size, const TcpFabricOptions& options)
    : rank_(rank),
      size_(size),
      options_(options),
      start_(Clock::now()),
      // Capped (a year), so that a timeout of milliseconds::max() ("never") cannot overflow
      // the clock into a deadline already past.
      deadline_(std::min(start_ + cluster::ClampTimeout(options.timeout), options.deadline)),
      receive_buffer_(ConfiguredReceiveBuffer(size)),
      send_buffers_(SendBufferBytes(std::getenv("COLLECTIVES_SOCKET_SNDBUF"))),
      acceptor_(io_),
      sockets_(size),
      status_(size),
      addresses_(size),
      attempts_(size, 0),
      wanted_(size, !options.on_demand) {
  if (options.on_demand) {
    for (int peer : options.peers_at_setup) {
      if (peer >= 0 && peer < size && peer != rank) wanted_[peer] = true;
    }
  }
  wanted_[rank] = false;
  config_.job_id = options.job_id;
  config_.token = options.token;
  config_.rank = rank;
  config_.world_size = size;
}

void MeshBuilder::Listen() {
  asio::error_code ec;
  asio::ip::address address = asio::ip::make_address(options_.bind_host, ec);
  if (ec) {
    // A name, looked up as the peers' are (NameLookups): by the deadline, and cancellable.
    std::optional<asio::error_code> answer;
    lookups_.Resolve(options_.bind_host,
                     [&answer, &address](const asio::error_code& error,
                                         const tcp::resolver::results_type& found) {
                       answer = !error && found.empty() ? asio::error::host_not_found : error;
                       if (!*answer) address = found.begin()->endpoint().address();
                     });
    RunUntil([&answer] { return answer.has_value(); });  // past it, ~NameLookups drops the answer
    if (failure_) throw *failure_;
    if (!answer) {
      throw Error(ErrorCode::kTimeout, Prefix() + "timed out after " +
                                           std::to_string(options_.timeout.count()) +
                                           " ms setting up connections: the lookup of bind host '" +
                                           options_.bind_host + "' has not answered");
    }
    if (*answer) {
      throw Error(ErrorCode::kSystem, Prefix() + "cannot resolve bind host '" + options_.bind_host +
                                          "': " + answer->message());
    }
  }
  const tcp::endpoint endpoint(address, 0);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) cluster::SetCloseOnExec(acceptor_.native_handle());
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw Error(ErrorCode::kSystem,
                Prefix() + "cannot listen on " + options_.bind_host + ": " + ec.message());
  }
}

void MeshBuilder::RunUntil(const std::function<bool()>& done) {
  io_.restart();  // a run that ran out of work stopped the io_context
  while (!done() && !failure_ && Clock::now() < deadline_) {
    if (!options_.cancelled) {
      io_.run_one_until(deadline_);
    } else if (options_.cancelled()) {
      failure_.emplace(ErrorCode::kAborted, Prefix() + "set-up abandoned: its caller cancelled it");
    } else {
      io_.run_one_until(std::min(deadline_, Clock::now() + kCancelPoll));
    }
  }
}

void MeshBuilder::ReadAddresses(Store& store) {
  std::vector<int> unpublished;
  for (int peer = rank_ + 1; peer < size_; ++peer) {
    if (!wanted_[peer]) continue;
    const std::string key = options_.key_prefix + "/addr/" + std::to_string(peer);
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    std::string value;
    try {
      value = store.Get(key, std::max(left, std::chrono::milliseconds(0)));
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kTimeout) throw;
      // Only the key's absence says the peer never published; any other timeout is the store's
      // own (a TCP store that did not answer), which the next peer's Get would meet again.
      if (!cluster::IsNotSet(error)) {
        throw Error(ErrorCode::kTimeout,
                    Prefix() + "timed out after " + std::to_string(options_.timeout.count()) +
                        " ms setting up connections: reading rank " + std::to_string(peer) +
                        "'s address from the store: " + error.message());
      }
      unpublished.push_back(peer);
      continue;
    }
    std::string why;
    auto parsed = cluster::ParseHostPort(value, &why);
    if (!parsed) {
      throw Error(ErrorCode::kInvalidArgument,
                  Prefix() + "rank " + std::to_string(peer) + " published a malformed address " +
                      cluster::QuoteKey(value) + " under '" + key + "': " + why);
    }
    addresses_[peer] = *parsed;
  }
  if (!unpublished.empty()) {
    throw Error(ErrorCode::kTimeout,
                Prefix() + "timed out after " + std::to_string(options_.timeout.count()) +
                    " ms setting up connections: rank(s) " + JoinRanks(unpublished) +
                    " never published an address under '" + options_.key_prefix + "/addr/'");
  }
}

void MeshBuilder::AcceptNext() {
  acceptor_.async_accept([this](const asio::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) return OnAcceptError(ec);
    cluster::SetCloseOnExec(socket.native_handle());
    asio::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    std::erase_if(server_handshakes_, [](const std::weak_ptr<HandshakeSession>& weak) {
      const auto session = weak.lock();
      return !session || session->finished();
    });
    if (server_handshakes_.size() >= MaxServerHandshakes()) {
      EvictOldestStranger("to make room for a new connection");
    }
    if (sessions_.size() >= prune_sessions_at_) {
      std::erase_if(sessions_,
                    [](const std::weak_ptr<HandshakeSession>& weak) { return weak.expired(); });
      prune_sessions_at_ = 2 * sessions_.size() + 64;
    }
    auto accept_rank = [this](int client) {
      return client < rank_ && client >= 0 && !sockets_[client].has_value();
    };
    auto session = HandshakeSession::StartServer(
        std::move(socket), config_, accept_rank,
        std::min(deadline_, Clock::now() + kServerHandshakeLimit),
        [this](const HandshakeResult& result, tcp::socket admitted) {
          if (result.ok) {
            return Admit(result.peer_rank, std::move(admitted));
          }
          if (result.code != ErrorCode::kAborted) {
            ++refusals_;
            refusal_log_.Write("rank " + std::to_string(rank_) + " refused a connection from " +
                               result.remote + ": " + result.why);
          }
          // keep accepting
        });
    server_handshakes_.push_back(session);
    sessions_.push_back(std::move(session));
    AcceptNext();
  });
}

void MeshBuilder::OnAcceptError(const asio::error_code& ec) {
  last_accept_error_ = ec.message();
  accept_log_.Write(Prefix() + "accepting a connection failed: " + ec.message());
  switch (cluster::DecideAfterAcceptFailure(
      ec, acceptor_.native_handle(), [this] { return EvictOldestStranger("out of descriptors"); },
      spare_)) {
    case AfterAcceptFailure::kAcceptAgain:
      return AcceptNext();
    case AfterAcceptFailure::kWaitForConnection:
      acceptor_.async_wait(tcp::acceptor::wait_read, [this](const asio::error_code& wait_ec) {
        if (!wait_ec && acceptor_.is_open()) AcceptNext();
      });
      return;
    case AfterAcceptFailure::kRetryShortly: {
      auto timer = std::make_unique<asio::steady_timer>(io_, cluster::kAcceptRetryDelay);
      timer->async_wait([this](const asio::error_code& timer_ec) {
        if (!timer_ec) AcceptNext();
      });
      timers_.push_back(std::move(timer));
      return;
    }
  }
}

bool MeshBuilder::EvictOldestStranger(const char* why) {
  for (auto it = server_handshakes_.begin(); it != server_handshakes_.end();) {
    const auto session = it->lock();
    if (!session || session->finished()) {
      it = server_handshakes_.erase(it);
      continue;
    }
    // A client that proved the token is a rank, whose handshake ends with its next message. It
    // is not cancelled: it would take the connection for made (its side of the handshake is
    // over), and the mesh would lose it.
    if (session->proven()) {
      ++it;
      continue;
    }
    server_handshakes_.erase(it);
    session->Cancel();  // closes its socket now; its `done` runs later with kAborted
    eviction_log_.Write(Prefix() + "closed the oldest of the connections still in their " +
                        "handshake (" + why + ")");
    return true;
  }
  return false;
}

void MeshBuilder::Connect(int peer) {
  ++attempts_[peer];
  const cluster::HostPort& address = addresses_[peer];
  asio::error_code ec;
  const auto numeric = asio::ip::make_address(address.host, ec);
  if (!ec) return ConnectTo(peer, tcp::endpoint(numeric, address.port));
  status_[peer] = "the lookup of host " + address.host + " has not answered";
  lookups_.Resolve(address.host, [this, peer](const asio::error_code& error,
                                              const tcp::resolver::results_type& results) {
    const cluster::HostPort& looked_up = addresses_[peer];
    if (error || results.empty()) {
      status_[peer] = "cannot resolve " + looked_up.host + ": " + error.message();
      RetryConnect(peer);
      return;
    }
    // A name may resolve to several addresses, of which the listener may take only some (a rank
    // that listens on "0.0.0.0" gives its host name, whose first address may be an IPv6 one):
    // each attempt takes the next address, so that every one is tried.
    auto entry = results.begin();
    std::advance(entry, static_cast<size_t>(attempts_[peer] - 1) % results.size());
    ConnectTo(peer, tcp::endpoint(entry->endpoint().address(), looked_up.port));
  });
}

void MeshBuilder::ConnectTo(int peer, const tcp::endpoint& endpoint) {
  asio::error_code ec;
  // Opened close-on-exec (async_connect would open it without): a process this one spawns must
  // not hold the connection open, or the peer would not see this rank die (a timeout where a
  // lost peer should be raised at once).
  auto socket = std::make_shared<tcp::socket>(io_);
  const int fd = ::socket(endpoint.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
  if (fd < 0) {
    status_[peer] = std::string("socket: ") + std::strerror(errno);
    RetryConnect(peer);
    return;
  }
  socket->assign(endpoint.protocol(), fd, ec);
  if (ec) {
    ::close(fd);
    status_[peer] = "socket: " + ec.message();
    RetryConnect(peer);
    return;
  }
  socket->async_connect(endpoint, [this, peer, socket, endpoint](const asio::error_code& error) {
    const std::string where =
        cluster::FormatHostPort(endpoint.address().to_string(), endpoint.port());
    if (error) {
      status_[peer] = "connect to " + where + ": " + error.message();
      RetryConnect(peer);
      return;
    }
    asio::error_code ignored;
    socket->set_option(tcp::no_delay(true), ignored);
    status_[peer] = "handshake with " + where + " not finished";
    sessions_.push_back(HandshakeSession::StartClient(
        std::move(*socket), config_, peer, deadline_,
        [this, peer, where](const HandshakeResult& result, tcp::socket connected) {
          if (result.ok) return Admit(peer, std::move(connected));
          if (result.code == ErrorCode::kTimeout || result.code == ErrorCode::kAborted) {
            status_[peer] = "handshake with " + where + ": " + result.why;
            return;
          }
          if (result.code == ErrorCode::kPeerLost) {
            // Closed without a refusal: the peer stopped, gave up, or cancelled this handshake
            // to make room. Like a refused connect: try again until the deadline.
            status_[peer] = "handshake with " + where + ": " + result.why;
            RetryConnect(peer);
            return;
          }
          if (!failure_) {
            failure_.emplace(result.code, Prefix() + "handshake with rank " + std::to_string(peer) +
                                              " at " + where + " failed: " + result.why);
          }
        }));
  });
}

void MeshBuilder::RetryConnect(int peer) {
  // Back off 2, 4, 8 ... ms, at most 128 ms, never past the deadline.
  const auto delay = std::chrono::milliseconds(1 << std::min(attempts_[peer], 7));
  const auto when = std::min(Clock::now() + delay, deadline_);
  if (when >= deadline_) return;
  auto timer = std::make_unique<asio::steady_timer>(io_, when);
  timer->async_wait([this, peer](const asio::error_code& ec) {
    if (!ec) Connect(peer);
  });
  timers_.push_back(std::move(timer));
}

void MeshBuilder::Admit(int peer, tcp::socket socket) {
  if (sockets_[peer].has_value()) {
    std::cerr << "collectives: rank " + std::to_string(rank_) +
                     " dropped a second connection claiming rank " + std::to_string(peer) + "\n";
    return;
  }
  SetDataSocketBuffers(socket, receive_buffer_, send_buffers_);
  sockets_[peer].emplace(std::move(socket));
  if (wanted_[peer]) --missing_;
}

void MeshBuilder::ThrowTimeout() {
  std::string message = Prefix() + "timed out after " + std::to_string(options_.timeout.count()) +
                        " ms setting up connections: still missing ";
  bool first = true;
  for (int peer = 0; peer < size_; ++peer) {
    if (!wanted_[peer] || sockets_[peer].has_value()) continue;
    if (!first) message += ", ";
    first = false;
    message += "rank " + std::to_string(peer) + " (";
    if (!status_[peer].empty()) {
      message += status_[peer];
    } else if (peer < rank_) {
      message += "it never completed a connection to this rank";
    } else {
      message += "no attempt finished";
    }
    message += ")";
  }
  if (!last_accept_error_.empty()) {
    message +=
        "; this rank's listener last failed to accept a connection with: " + last_accept_error_;
  }
  throw Error(ErrorCode::kTimeout, message);
}

std::vector<std::optional<tcp::socket>>& MeshBuilder::Build(Store& store) {
  Listen();
  const auto port = acceptor_.local_endpoint().port();
  std::string host = options_.bind_host;
  asio::error_code ec;
  const auto bind_address = asio::ip::make_address(host, ec);
  if (!ec && bind_address.is_unspecified()) host = asio::ip::host_name();
  store.Set(options_.key_prefix + "/addr/" + std::to_string(rank_),
            cluster::FormatHostPort(host, port));
  ReadAddresses(store);

  missing_ = static_cast<int>(std::count(wanted_.begin(), wanted_.end(), true));
  if (rank_ > 0) AcceptNext();
  for (int peer = rank_ + 1; peer < size_; ++peer) {
    if (wanted_[peer]) Connect(peer);
  }
  RunUntil([this] { return missing_ == 0; });
  if (options_.on_demand && missing_ == 0 && !failure_) {
    // A lower rank that connects on demand and has proved the token takes the connection for
    // made once it reads the verdict: let such handshakes finish (a second at most) rather than
    // cancel them below; the others are tried again against the fabric's listener.
    const auto until = std::min(deadline_, Clock::now() + std::chrono::seconds(1));
    auto proven_pending = [this] {
      for (auto& weak : sessions_) {
        const auto session = weak.lock();
        if (session && session->proven() && !session->finished()) return true;
      }
      return false;
    };
    io_.restart();
    while (proven_pending() && Clock::now() < until) io_.run_one_until(until);
  }

  // Stop what is still going on (strangers' handshakes, retries, lookups) before leaving. With
  // on_demand the listener stays open (ReleaseListener): a rank whose handshake is cancelled here
  // connects again, to the fabric's accept.
  lookups_.Close();
  if (!options_.on_demand || failure_ || missing_ > 0) acceptor_.close(ec);
  acceptor_.cancel(ec);
  for (auto& weak : sessions_) {
    if (auto session = weak.lock()) session->Cancel();
  }
  for (auto& timer : timers_) timer->cancel();
  io_.restart();
  io_.poll();
  if (refusals_ > refusals_logged_) {
    const std::string line = "collectives: rank " + std::to_string(rank_) + " refused " +
                             std::to_string(refusals_) + " connections in its set-up, " +
                             std::to_string(refusals_ - refusals_logged_) +
                             " of them not logged above\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
  if (failure_) throw *failure_;
  if (missing_ > 0) ThrowTimeout();
  return sockets_;
}

int MeshBuilder::ReleaseListener(tcp* protocol) {
  asio::error_code ec;
  const auto local = acceptor_.local_endpoint(ec);
  *protocol = ec ? tcp::v4() : local.protocol();
  return acceptor_.release(ec);
}

std::optional<std::string> LocalAddressToward(const std::string& remote_host,
                                              Clock::time_point deadline) {
  asio::io_context io;
  asio::error_code ec;
  std::vector<asio::ip::address> addresses;
  if (const auto address = asio::ip::make_address(remote_host, ec); !ec) {
    addresses.push_back(address);
  } else {
    // A name server that does not answer cannot hold the caller past its deadline.
    const auto results = cluster::LookUpBy(remote_host, deadline);
    if (!results) return std::nullopt;
    for (const auto& entry : *results) addresses.push_back(entry.endpoint().address());
  }
  for (const auto& address : addresses) {
    if (address.is_loopback()) return remote_host;
    const asio::ip::udp::endpoint endpoint(address, 9);
    asio::ip::udp::socket socket(io);
    socket.open(endpoint.protocol(), ec);
    if (ec) continue;
    socket.connect(endpoint, ec);  // no packet is sent: only the route is chosen
    if (ec) continue;
    const auto local = socket.local_endpoint(ec);
    if (ec) continue;
    if (local.address() == address) return remote_host;  // the remote host is this host
    return local.address().to_string();
  }
  return "127.0.0.1";
}

}  // namespace collectives::transport
