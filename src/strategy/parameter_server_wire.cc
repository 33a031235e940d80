// The parameter-server runtime's sockets, frames, handshake and client (parameter_server_wire.h).
//
// Plain POSIX sockets with poll(2) for every deadline: each connection is driven by the one
// thread that owns it (a server's connection thread, a client's caller), so an event loop would
// add nothing but a hand-off. Writes use MSG_NOSIGNAL: a peer that died is an error, not SIGPIPE.
#include "src/strategy/parameter_server_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>

#include "src/cluster/host_port.h"
#include "src/core/auth.h"

namespace collectives::strategy::ps {
namespace {

[[noreturn]] void Malformed(const std::string& what) {
  throw Error(ErrorCode::kPeerLost, "malformed message: " + what);
}

// Milliseconds poll may wait for `deadline`: -1 for none, else at least 0.
int PollTimeout(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return -1;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left.count() + 1, 1 << 30));
}

// Waits for `events` on `fd` by `deadline`: true when ready.
bool WaitFor(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, PollTimeout(deadline));
    if (n > 0) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && Clock::now() < deadline) continue;  // rounding: wait out the rest
    return false;
  }
}

void Put32(uint8_t* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = uint8_t(v >> (8 * i));
}
uint32_t Get32(const uint8_t* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t(in[i]) << (8 * i);
  return v;
}

core::Proof PsProof(const std::string& token, const core::Nonce& client_nonce,
                    const core::Nonce& server_nonce, Kind kind, uint8_t role) {
  static constexpr char kContext[] = "collectives-ps-v1";
  std::vector<uint8_t> message(sizeof(kContext) - 1 + 2 * core::kNonceBytes + 2);
  std::memcpy(message.data(), kContext, sizeof(kContext) - 1);
  uint8_t* out = message.data() + sizeof(kContext) - 1;
  std::memcpy(out, client_nonce.data(), core::kNonceBytes);
  std::memcpy(out + core::kNonceBytes, server_nonce.data(), core::kNonceBytes);
  out[2 * core::kNonceBytes] = static_cast<uint8_t>(kind);
  out[2 * core::kNonceBytes + 1] = role;
  return core::HmacSha256(token, message);
}

constexpr uint8_t kClientRole = 1;
constexpr uint8_t kServerRole = 2;

// getaddrinfo for a numeric or named host; empty on failure (`*why` says why).
std::vector<sockaddr_storage> Resolve(const std::string& host, uint16_t port, bool passive,
                                      std::vector<socklen_t>* lengths, std::string* why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* list = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
  std::vector<sockaddr_storage> out;
  if (rc != 0) {
    *why = "cannot resolve '" + host + "': " + ::gai_strerror(rc);
    return out;
  }
  for (addrinfo* a = list; a != nullptr; a = a->ai_next) {
    sockaddr_storage s{};
    std::memcpy(&s, a->ai_addr, a->ai_addrlen);
    out.push_back(s);
    lengths->push_back(a->ai_addrlen);
  }
  ::freeaddrinfo(list);
  return out;
}

}  // namespace

const char* KindName(Kind kind) { return kind == Kind::kPs ? "ps" : "worker"; }

void In::Raw(void* out, size_t n) {
  if (n > bytes_.size() - pos_) {
    Malformed("needs " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) + ", " +
              std::to_string(bytes_.size() - pos_) + " remain");
  }
  if (n > 0) std::memcpy(out, bytes_.data() + pos_, n);
  pos_ += n;
}

std::string In::Str() {
  const uint64_t n = U64();
  if (n > remaining()) Malformed("a string of " + std::to_string(n) + " bytes");
  std::string s(n, '\0');
  Raw(s.data(), n);
  return s;
}

std::vector<float> In::Floats() {
  const uint64_t n = U64();
  if (n > remaining() / sizeof(float)) Malformed("an array of " + std::to_string(n) + " floats");
  std::vector<float> v(n);
  Raw(v.data(), n * sizeof(float));
  return v;
}

void In::FloatsInto(float* out, size_t n) {
  const uint64_t got = U64();
  if (got != n) {
    Malformed("an array of " + std::to_string(got) + " floats where " + std::to_string(n) +
              " belong");
  }
  Raw(out, n * sizeof(float));
}

Socket::~Socket() { Close(); }

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = other.fd_.exchange(-1);
  }
  return *this;
}

void Socket::Shutdown() {
  const int fd = fd_.load();
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

void Socket::Close() {
  const int fd = fd_.exchange(-1);
  if (fd >= 0) ::close(fd);
}

std::string Socket::PeerName() const {
  sockaddr_storage s{};
  socklen_t length = sizeof s;
  if (fd_ < 0 || ::getpeername(fd_, reinterpret_cast<sockaddr*>(&s), &length) != 0) {
    return "an unknown peer";
  }
  char host[NI_MAXHOST];
  char port[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&s), length, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "an unknown peer";
  }
  return cluster::FormatHostPort(host, static_cast<uint16_t>(std::stoi(port)));
}

bool Socket::Connect(const std::string& address, Clock::time_point deadline, std::string* why) {
  Close();
  std::string parse_error;
  const std::optional<cluster::HostPort> hp = cluster::ParseHostPort(address, &parse_error);
  if (!hp) {
    *why = "bad address '" + address + "': " + parse_error;
    return false;
  }
  std::vector<socklen_t> lengths;
  const std::vector<sockaddr_storage> addresses = Resolve(hp->host, hp->port, false, &lengths, why);
  for (size_t i = 0; i < addresses.size(); ++i) {
    const int fd = ::socket(addresses[i].ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      *why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addresses[i]), lengths[i]);
    if (rc != 0 && errno == EINPROGRESS) {
      if (!WaitFor(fd, POLLOUT, deadline)) {
        ::close(fd);
        *why = "deadline passed while connecting";
        return false;
      }
      int error = 0;
      socklen_t length = sizeof error;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
      rc = error == 0 ? 0 : -1;
      errno = error;
    }
    if (rc != 0) {
      *why = std::string("connect: ") + std::strerror(errno);
      ::close(fd);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    fd_ = fd;
    return true;
  }
  return false;
}

bool Socket::SendAll(const void* data, size_t n, Clock::time_point deadline, std::string* why) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const int fd = fd_.load();
    if (fd < 0) {
      *why = "the connection is closed";
      return false;
    }
    const ssize_t sent = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0) {
      p += sent;
      n -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!WaitFor(fd, POLLOUT, deadline)) {
        *why = "deadline passed while sending";
        return false;
      }
      continue;
    }
    *why = std::string("send: ") + std::strerror(errno);
    return false;
  }
  return true;
}

bool Socket::ReceiveAll(void* data, size_t n, Clock::time_point deadline, std::string* why) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const int fd = fd_.load();
    if (fd < 0) {
      *why = "the connection is closed";
      return false;
    }
    const ssize_t got = ::recv(fd, p, n, MSG_DONTWAIT);
    if (got > 0) {
      p += got;
      n -= static_cast<size_t>(got);
      continue;
    }
    if (got == 0) {
      *why = "the peer closed the connection";
      return false;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!WaitFor(fd, POLLIN, deadline)) {
        *why = "deadline passed while waiting for the peer";
        return false;
      }
      continue;
    }
    *why = std::string("recv: ") + std::strerror(errno);
    return false;
  }
  return true;
}

bool SendFrame(Socket& socket, uint8_t code, const std::vector<uint8_t>& body,
               Clock::time_point deadline, std::string* why) {
  uint8_t header[kFrameHeaderBytes] = {};
  Put32(header, kFrameMagic);
  header[4] = code;
  const uint64_t size = body.size();
  std::memcpy(header + 8, &size, 8);
  return socket.SendAll(header, sizeof header, deadline, why) &&
         socket.SendAll(body.data(), body.size(), deadline, why);
}

bool ReceiveFrame(Socket& socket, uint8_t* code, std::vector<uint8_t>* body,
                  Clock::time_point deadline, std::string* why) {
  uint8_t header[kFrameHeaderBytes];
  if (!socket.ReceiveAll(header, sizeof header, deadline, why)) return false;
  if (Get32(header) != kFrameMagic) {
    *why = "a frame with a bad magic";
    return false;
  }
  if (header[5] != 0 || header[6] != 0 || header[7] != 0) {
    *why = "a frame whose reserved bytes are not zero";
    return false;
  }
  uint64_t size;
  std::memcpy(&size, header + 8, 8);
  if (size > kMaxBodyBytes) {
    *why = "a frame of " + std::to_string(size) + " bytes (limit " +
           std::to_string(kMaxBodyBytes) + ")";
    return false;
  }
  *code = header[4];
  body->resize(size);
  return socket.ReceiveAll(body->data(), size, deadline, why);
}

std::vector<uint8_t> ErrorBody(ErrorCode code, int lost_ps, const std::string& message) {
  Out out;
  out.U32(static_cast<uint32_t>(code));
  out.I32(lost_ps);
  out.Str(message);
  return std::move(out.bytes());
}

HandshakeResult ClientHandshake(Socket& socket, const std::string& token, Kind kind,
                                Clock::time_point deadline, std::string* why) {
  uint8_t challenge[4 + 1 + core::kNonceBytes];
  if (!socket.ReceiveAll(challenge, sizeof challenge, deadline, why)) {
    *why = "no challenge from the server (" + *why + ")";
    return HandshakeResult::kFailed;
  }
  if (Get32(challenge) != kHandshakeMagic) {
    *why = "the server did not open with a parameter-server challenge (another service?)";
    return HandshakeResult::kRejected;
  }
  if (challenge[4] != static_cast<uint8_t>(kind)) {
    *why = std::string("the server is a ") +
           (challenge[4] == uint8_t(Kind::kPs) ? "ps" : challenge[4] == uint8_t(Kind::kWorker)
                                                             ? "worker"
                                                             : "server of an unknown kind") +
           ", not a " + KindName(kind) + " (are the addresses in the right lists?)";
    return HandshakeResult::kRejected;
  }
  core::Nonce server_nonce;
  std::memcpy(server_nonce.data(), challenge + 5, core::kNonceBytes);
  const core::Nonce client_nonce = core::RandomNonce();
  const core::Proof proof = PsProof(token, client_nonce, server_nonce, kind, kClientRole);
  uint8_t response[core::kNonceBytes + core::kProofBytes];
  std::memcpy(response, client_nonce.data(), core::kNonceBytes);
  std::memcpy(response + core::kNonceBytes, proof.data(), core::kProofBytes);
  if (!socket.SendAll(response, sizeof response, deadline, why)) return HandshakeResult::kFailed;
  uint8_t verdict[1 + core::kProofBytes];
  if (!socket.ReceiveAll(verdict, sizeof verdict, deadline, why)) {
    *why = "no verdict from the server (" + *why + ")";
    return HandshakeResult::kFailed;
  }
  if (verdict[0] != 1) {
    *why = "the server rejected this task's proof of the job token (is COLLECTIVES_JOB_TOKEN "
           "the same on every task?)";
    return HandshakeResult::kRejected;
  }
  core::Proof server_proof;
  std::memcpy(server_proof.data(), verdict + 1, core::kProofBytes);
  if (!core::ProofsEqual(server_proof,
                         PsProof(token, client_nonce, server_nonce, kind, kServerRole))) {
    *why = "the server could not prove that it holds the job token";
    return HandshakeResult::kRejected;
  }
  return HandshakeResult::kOk;
}

bool ServerHandshake(Socket& socket, const std::string& token, Kind kind,
                     Clock::time_point deadline, std::string* why) {
  const core::Nonce server_nonce = core::RandomNonce();
  uint8_t challenge[4 + 1 + core::kNonceBytes];
  Put32(challenge, kHandshakeMagic);
  challenge[4] = static_cast<uint8_t>(kind);
  std::memcpy(challenge + 5, server_nonce.data(), core::kNonceBytes);
  if (!socket.SendAll(challenge, sizeof challenge, deadline, why)) return false;
  uint8_t response[core::kNonceBytes + core::kProofBytes];
  if (!socket.ReceiveAll(response, sizeof response, deadline, why)) return false;
  core::Nonce client_nonce;
  core::Proof client_proof;
  std::memcpy(client_nonce.data(), response, core::kNonceBytes);
  std::memcpy(client_proof.data(), response + core::kNonceBytes, core::kProofBytes);
  uint8_t verdict[1 + core::kProofBytes] = {};
  if (!core::ProofsEqual(client_proof,
                         PsProof(token, client_nonce, server_nonce, kind, kClientRole))) {
    std::string ignored;
    socket.SendAll(verdict, sizeof verdict, deadline, &ignored);
    *why = "it failed the job-token proof";
    return false;
  }
  verdict[0] = 1;
  const core::Proof proof = PsProof(token, client_nonce, server_nonce, kind, kServerRole);
  std::memcpy(verdict + 1, proof.data(), core::kProofBytes);
  return socket.SendAll(verdict, sizeof verdict, deadline, why);
}

Socket Listen(const std::string& address, uint16_t* port) {
  std::string why;
  const std::optional<cluster::HostPort> hp = cluster::ParseHostPort(address, &why);
  // "host:0" does not parse (ports are 1..65535 in addresses): accept it here, for tests.
  std::string host;
  uint16_t wanted = 0;
  if (hp) {
    host = hp->host;
    wanted = hp->port;
  } else if (address.size() > 2 && address.ends_with(":0")) {
    host = cluster::StripBrackets(address.substr(0, address.size() - 2));
  } else {
    throw Error(ErrorCode::kInvalidArgument, "bad server address '" + address + "': " + why);
  }
  std::vector<socklen_t> lengths;
  const std::vector<sockaddr_storage> addresses = Resolve(host, wanted, true, &lengths, &why);
  for (size_t i = 0; i < addresses.size(); ++i) {
    const int fd = ::socket(addresses[i].ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&addresses[i]), lengths[i]) != 0 ||
        ::listen(fd, 128) != 0) {
      why = std::string("bind: ") + std::strerror(errno);
      ::close(fd);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
    *port = ntohs(bound.ss_family == AF_INET6
                      ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                      : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return Socket(fd);
  }
  throw Error(ErrorCode::kSystem, "cannot listen on " + address + ": " + why);
}

Client::Client(std::string address, std::string name, Kind kind, std::string token,
               std::chrono::milliseconds timeout)
    : address_(std::move(address)),
      name_(std::move(name)),
      kind_(kind),
      token_(std::move(token)),
      timeout_(timeout) {}

Client::~Client() = default;

void Client::Interrupt() {
  std::lock_guard<std::mutex> lock(socket_mutex_);
  socket_.Shutdown();
}

void Client::CloseSocket() {
  std::lock_guard<std::mutex> lock(socket_mutex_);
  socket_.Close();
}

bool Client::EnsureConnected(Clock::time_point deadline, std::string* why) {
  if (socket_.valid()) return true;
  Socket fresh;
  if (!fresh.Connect(address_, deadline, why)) return false;
  {
    std::lock_guard<std::mutex> lock(socket_mutex_);
    socket_ = std::move(fresh);
  }
  const HandshakeResult result = ClientHandshake(socket_, token_, kind_, deadline, why);
  if (result == HandshakeResult::kOk) return true;
  CloseSocket();
  if (result == HandshakeResult::kRejected) {
    throw Error(ErrorCode::kUnauthenticated, name_ + ": " + *why);
  }
  return false;
}

std::vector<uint8_t> Client::Call(Op op, const std::vector<uint8_t>& body,
                                  Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(call_mutex_);
  if (deadline == Clock::time_point::min()) deadline = Clock::now() + timeout_;
  std::string why;
  const auto fail = [&](const std::string& doing) {
    CloseSocket();
    const bool timed_out = why.starts_with("deadline passed");
    throw Error(timed_out ? ErrorCode::kTimeout : ErrorCode::kPeerLost,
                name_ + " " + doing + ": " + why);
  };
  if (!EnsureConnected(deadline, &why)) fail("cannot be reached");
  uint8_t status = 0;
  std::vector<uint8_t> reply;
  if (!SendFrame(socket_, static_cast<uint8_t>(op), body, deadline, &why)) fail("was lost");
  if (!ReceiveFrame(socket_, &status, &reply, deadline, &why)) fail("did not answer");
  if (status == static_cast<uint8_t>(Status::kOk)) return reply;
  if (status != static_cast<uint8_t>(Status::kError)) {
    why = "a reply of unknown status " + std::to_string(status);
    fail("sent");
  }
  In in(reply);
  const uint32_t code = in.U32();
  const int32_t lost_ps = in.I32();
  const std::string message = in.Str();
  const bool known = code >= uint32_t(ErrorCode::kInvalidArgument) &&
                     code <= uint32_t(ErrorCode::kInternal);
  throw RemoteError(known ? static_cast<ErrorCode>(code) : ErrorCode::kInternal, message,
                    lost_ps);
}

}  // namespace collectives::strategy::ps
