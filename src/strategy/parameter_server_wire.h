// The parameter-server runtime's connections: blocking TCP sockets with deadlines, the job-token
// handshake, framed requests and replies, and a client that reconnects.
//
// Handshake (every connection, before any request; integers little-endian):
//   server -> client: u32 magic 0x41535043 ("CPSA"), u8 server kind (1 ps, 2 worker),
//                     32-byte server nonce                                            37 bytes
//   client -> server: 32-byte client nonce, 32-byte client proof                      64 bytes
//   server -> client: u8 verdict (1 accepted, 0 rejected), 32-byte server proof (zeros when
//                     rejected)                                                       33 bytes
//   proof = HMAC-SHA256(token, "collectives-ps-v1" | client nonce | server nonce | kind | role),
//   role 1 for the client's proof, 2 for the server's: the TCP store's scheme (tcp_store_auth.h)
//   with a context of its own, so a proof made for one service is worth nothing at the other.
//   A server logs a client that fails the proof (with its address) and closes the connection
//   without a byte of data.
//
// Frames: a 16-byte header, then the body.
//   u32 magic 0x31535043 ("CPS1"), u8 op (a request) or status (a reply), 3 reserved zero bytes,
//   u64 body bytes (at most kMaxBodyBytes, checked before anything is allocated).
// A connection carries one request at a time; the reply comes before the next request.
// A reply's status is kOk with the op's answer, or kError with: u32 ErrorCode, i32 the index of
// the parameter server that was lost (-1 when the error is of the request itself), a message.
//
// Thread-safety: a Socket is used by one thread at a time, except Shutdown, which any thread may
// call to wake the one blocked on it. A Client may be called from any thread (calls take turns).
#ifndef COLLECTIVES_SRC_STRATEGY_PARAMETER_SERVER_WIRE_H_
#define COLLECTIVES_SRC_STRATEGY_PARAMETER_SERVER_WIRE_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/errors.h"

namespace collectives::strategy::ps {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kHandshakeMagic = 0x41535043;
constexpr uint32_t kFrameMagic = 0x31535043;
constexpr size_t kFrameHeaderBytes = 16;
constexpr uint64_t kMaxBodyBytes = uint64_t(1) << 32;

// Server kinds in the handshake. Wire values: append, never renumber.
enum class Kind : uint8_t { kPs = 1, kWorker = 2 };
const char* KindName(Kind kind);  // "ps", "worker"

// Requests. Wire values: append, never renumber.
enum class Op : uint8_t {
  kPing = 1,           // -> empty
  kStop = 2,           // -> empty, then the server stops
  kCreateShard = 3,    // ps: key, optimizer, values -> empty
  kReadShards = 4,     // ps: n keys -> n value arrays
  kPushGradients = 5,  // ps: n (key, gradient) -> empty
  kGetShards = 6,      // ps: n keys -> n (value, slots, t)
  kSetShards = 7,      // ps: n (key, value, slots, t) -> empty
  kRunFunction = 8,    // worker: layout, function, args -> result bytes
  kCreateDataset = 9,  // worker: layout, dataset name, function, args -> empty
};
enum class Status : uint8_t { kOk = 0, kError = 1 };

// ---- Bodies ----

class Out {
 public:
  void Raw(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes_.insert(bytes_.end(), b, b + n);
  }
  void U8(uint8_t v) { Raw(&v, 1); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void I32(int32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I64(int64_t v) { Raw(&v, 8); }
  void F32(float v) { Raw(&v, 4); }
  void Str(const std::string& s) {
    U64(s.size());
    Raw(s.data(), s.size());
  }
  void Floats(const float* p, size_t n) {
    U64(n);
    Raw(p, n * sizeof(float));
  }
  void Floats(const std::vector<float>& v) { Floats(v.data(), v.size()); }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

// Reads a body; every read is bounds-checked. A short or malformed body throws
// Error(kPeerLost, "malformed ...") (the peer does not speak the protocol).
class In {
 public:
  explicit In(const std::vector<uint8_t>& bytes) : bytes_(bytes) {}
  void Raw(void* out, size_t n);
  uint8_t U8() { uint8_t v; Raw(&v, 1); return v; }
  uint32_t U32() { uint32_t v; Raw(&v, 4); return v; }
  int32_t I32() { int32_t v; Raw(&v, 4); return v; }
  uint64_t U64() { uint64_t v; Raw(&v, 8); return v; }
  int64_t I64() { int64_t v; Raw(&v, 8); return v; }
  float F32() { float v; Raw(&v, 4); return v; }
  std::string Str();
  std::vector<float> Floats();
  // Reads n floats into `out` (throws when the body holds another count).
  void FloatsInto(float* out, size_t n);
  size_t remaining() const { return bytes_.size() - pos_; }

 private:
  const std::vector<uint8_t>& bytes_;
  size_t pos_ = 0;
};

// ---- Sockets ----

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& other) noexcept : fd_(other.fd_.exchange(-1)) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  // Connects to "host:port" by `deadline`. False with the reason in `*why`.
  bool Connect(const std::string& address, Clock::time_point deadline, std::string* why);
  // Sends / receives exactly `n` bytes by `deadline` (Clock::time_point::max(): no deadline).
  // False with the reason in `*why` ("the peer closed the connection", "deadline passed ...").
  bool SendAll(const void* data, size_t n, Clock::time_point deadline, std::string* why);
  bool ReceiveAll(void* data, size_t n, Clock::time_point deadline, std::string* why);
  // Wakes a thread blocked on this socket (its call fails) and makes every later call fail.
  void Shutdown();
  void Close();
  // "127.0.0.1:5555" of the peer, or "an unknown peer".
  std::string PeerName() const;

 private:
  std::atomic<int> fd_{-1};
};

// Sends one frame (header and body) by `deadline`.
bool SendFrame(Socket& socket, uint8_t code, const std::vector<uint8_t>& body,
               Clock::time_point deadline, std::string* why);
// Receives one frame. False with the reason in `*why` (a bad header names what is wrong).
bool ReceiveFrame(Socket& socket, uint8_t* code, std::vector<uint8_t>* body,
                  Clock::time_point deadline, std::string* why);

// The error reply's body.
std::vector<uint8_t> ErrorBody(ErrorCode code, int lost_ps, const std::string& message);

// The client side of the handshake. kOk, kRejected (a wrong token either way, or a server of
// another kind), or kFailed (the connection broke or the deadline passed).
enum class HandshakeResult { kOk, kRejected, kFailed };
HandshakeResult ClientHandshake(Socket& socket, const std::string& token, Kind kind,
                                Clock::time_point deadline, std::string* why);
// The server side. True when the client proved the token.
bool ServerHandshake(Socket& socket, const std::string& token, Kind kind,
                     Clock::time_point deadline, std::string* why);

// A listening socket on "host:port" (port 0: any). Throws Error(kSystem) naming the address.
Socket Listen(const std::string& address, uint16_t* port);

// ---- A client of one server ----

// One connection to a server, opened when first needed and again after it broke. Call sends a
// request and returns the reply's body, or throws: Error(kPeerLost) or Error(kTimeout) naming
// the server (`name`, e.g. "ps 1 at 127.0.0.1:2223") when it cannot be reached, the connection
// breaks or the deadline passes; Error(kUnauthenticated) when the handshake is rejected; the
// remote error (its code and message) for a kError reply, as RemoteError.
class RemoteError : public Error {
 public:
  RemoteError(ErrorCode code, const std::string& message, int lost_ps)
      : Error(code, message), lost_ps_(lost_ps) {}
  // The parameter server a worker lost while running the request, or -1.
  int lost_ps() const { return lost_ps_; }

 private:
  int lost_ps_;
};

class Client {
 public:
  Client(std::string address, std::string name, Kind kind, std::string token,
         std::chrono::milliseconds timeout);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const std::string& name() const { return name_; }
  const std::string& address() const { return address_; }
  // One request by `deadline` (default: now + the client's timeout); the connection is opened
  // first when there is none (one attempt).
  std::vector<uint8_t> Call(Op op, const std::vector<uint8_t>& body,
                            Clock::time_point deadline = Clock::time_point::min());
  // Opens the connection now when there is none; false with the reason in `*why`. Throws
  // Error(kUnauthenticated) when the server rejects the token. Called by one thread at a time,
  // and not during a Call.
  bool EnsureConnected(Clock::time_point deadline, std::string* why);
  // Closes the connection and wakes a call blocked on it (from any thread).
  void Interrupt();

 private:
  std::string address_;
  std::string name_;
  Kind kind_;
  std::string token_;
  std::chrono::milliseconds timeout_;
  void CloseSocket();

  std::mutex call_mutex_;  // one call at a time
  // Guards closing and replacing socket_ against Interrupt, which must never shut down a
  // descriptor number that was closed and given to another socket meanwhile.
  std::mutex socket_mutex_;
  Socket socket_;
};

}  // namespace collectives::strategy::ps

#endif  // COLLECTIVES_SRC_STRATEGY_PARAMETER_SERVER_WIRE_H_
