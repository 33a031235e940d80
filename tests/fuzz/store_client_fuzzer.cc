// Fuzz target: the TCP store's client (tcp_store_client.cc) against a hostile server. A fake
// server on loopback accepts the client's connection and answers with the input. The first
// input byte picks how (bits 0-1, modulo 3) and which call the client makes once connected
// (bits 2-3, modulo 3: Set, Get with no wait, Add); the rest is what the server sends:
//   0  raw: all of it, as is (challenge, verdict, replies: whatever the bytes are);
//   1  the server holds the client's token: the first 36 bytes as its challenge, then a valid
//      verdict with its proof (computed from the client's nonce), then the rest as replies;
//   2  the client holds no token and enrols for rank 1: the first 36 bytes as the challenge,
//      then the enrolment reply from the input; when that is a well-formed grant of a token,
//      a valid verdict for that token and the rest as replies, else the rest as is.
// After its bytes the server closes its sending side. The client's calls must end (by their
// deadlines, 1 s here) with a collectives::Error, or succeed only where the bytes were a valid
// answer: connecting only with a valid challenge (never in mode 0, where nobody proves the
// token), an enrolment granted only by a well-formed grant (and then the token granted is the
// one the client proves), a Get's value and an Add's sum only as the reply carried them, and
// the reply's status as the error code (kInvalidArgument, a Get's kTimeout; a timeout
// answering a Set or an Add is malformed: kPeerLost; so is a value or an argument a reply to
// that call does not carry). Never a crash.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/errors.h"
#include "src/cluster/tcp_store.h"
#include "src/cluster/tcp_store_auth.h"
#include "src/cluster/tcp_store_wire.h"
#include "tests/fuzz/loopback.h"

using namespace collectives;
namespace auth = cluster::auth;
namespace wire = cluster::wire;

namespace {

constexpr char kFuzzToken[] = "fuzz-token";
constexpr char kKey[] = "fuzz/key";
constexpr auto kBound = std::chrono::milliseconds(3000);  // the fake server's own reads

enum class Mode { kRaw = 0, kToken = 1, kEnrol = 2 };
enum class Call { kSet = 0, kGet = 1, kAdd = 2 };

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "store_client_fuzzer: %s\n", what.c_str());
  std::abort();
}

struct Listener {
  uint16_t port = 0;
  int fd = fuzz::ListenLoopback(&port);
};

Listener& Shared() {
  static Listener* listener = new Listener();
  if (listener->fd < 0) Fail("cannot listen on 127.0.0.1");
  return *listener;
}

bool ValidChallenge(const std::vector<uint8_t>& bytes, core::Nonce* nonce) {
  if (bytes.size() < auth::kChallengeBytes) return false;
  std::array<uint8_t, auth::kChallengeBytes> challenge{};
  std::memcpy(challenge.data(), bytes.data(), challenge.size());
  return auth::DecodeChallenge(challenge, nonce);
}

// The enrolment reply at the start of `bytes`, when it is complete and well formed.
struct EnrolReply {
  bool granted = false;
  std::string payload;  // the token when granted
  size_t bytes = 0;     // its length on the wire
};

std::optional<EnrolReply> ParseEnrolReply(const uint8_t* bytes, size_t size) {
  if (size < auth::kEnrolReplyHeaderBytes) return std::nullopt;
  std::array<uint8_t, auth::kEnrolReplyHeaderBytes> header{};
  std::memcpy(header.data(), bytes, header.size());
  if (!auth::CheckEnrolReply(header).empty()) return std::nullopt;
  const size_t n = header[2];
  if (size < header.size() + n) return std::nullopt;
  EnrolReply reply;
  reply.granted = header[0] == auth::kEnrolled;
  reply.payload.assign(reinterpret_cast<const char*>(bytes) + header.size(), n);
  reply.bytes = header.size() + n;
  return reply;
}

// What a call may return given the server's reply bytes: an error of any code (nullopt code:
// the reply is cut or malformed), an error of one code, or success with this value or sum.
struct Expected {
  bool ok = false;
  std::optional<ErrorCode> code;
  std::string value;
  int64_t sum = 0;
};

Expected ExpectReply(Call call, const uint8_t* bytes, size_t size) {
  Expected expected;
  if (size < wire::kHeaderBytes) return expected;
  wire::HeaderBytes header_bytes;
  std::memcpy(header_bytes.data(), bytes, header_bytes.size());
  const wire::Header header = wire::Decode(header_bytes);
  if (!wire::CheckReplyHeader(header).empty()) return expected;
  if (size - wire::kHeaderBytes < header.value_bytes) return expected;
  const std::string value(reinterpret_cast<const char*>(bytes) + wire::kHeaderBytes,
                          header.value_bytes);
  // The rules of the format (tcp_store_wire.h), stated here again rather than asked of
  // wire::CheckReply: a reply that breaks one is malformed (any error code).
  switch (static_cast<wire::Status>(header.code)) {
    case wire::Status::kInvalidArgument:
      if (header.arg != 0) return expected;
      expected.code = ErrorCode::kInvalidArgument;
      return expected;
    case wire::Status::kTimeout:
      // A Get's wait ran out; only a Get waits, so for a Set or an Add it is malformed.
      if (call != Call::kGet) {
        expected.code = ErrorCode::kPeerLost;
        return expected;
      }
      if (header.value_bytes != 0 || header.arg != 0) return expected;
      expected.code = ErrorCode::kTimeout;
      return expected;
    case wire::Status::kOk:
      if (call != Call::kGet && header.value_bytes != 0) return expected;  // only a Get's value
      if (call != Call::kAdd && header.arg != 0) return expected;          // only an Add's sum
      break;
  }
  expected.ok = true;
  expected.value = value;
  expected.sum = header.arg;
  return expected;
}

// The fake server: answers the first connection as `mode` says with `input` (see the top), keeps
// every connection open until it is destroyed, and answers any later one (a client retrying)
// with a close.
class FakeServer {
 public:
  FakeServer(int listener, Mode mode, const uint8_t* input, size_t size)
      : listener_(listener), mode_(mode), input_(input, input + size) {
    if (::pipe2(wake_, O_CLOEXEC) != 0) Fail("pipe2 failed");
    thread_ = std::thread([this] { Run(); });
  }
  ~FakeServer() {
    const char stop = 0;
    if (::write(wake_[1], &stop, 1) != 1) Fail("cannot wake the fake server");
    thread_.join();
    for (int fd : open_) ::close(fd);
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

 private:
  void Run() {
    bool first = true;
    for (;;) {
      std::array<pollfd, 2> wait = {pollfd{listener_, POLLIN, 0}, pollfd{wake_[0], POLLIN, 0}};
      if (::poll(wait.data(), wait.size(), -1) < 0) continue;  // EINTR
      if (wait[1].revents != 0) return;
      const int fd = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      open_.push_back(fd);
      if (first) {
        Answer(fd);
        first = false;
      }
      ::shutdown(fd, SHUT_WR);
    }
  }

  bool Send(int fd, const uint8_t* bytes, size_t size) {
    return fuzz::SendAll(fd, bytes, size, fuzz::After(kBound));
  }

  // Reads the client's 64-byte response and sends a valid verdict on it for `token`, then
  // `after` in the same send (two sends could be a second apart on a loaded machine: past the
  // client's deadline for a reply that was valid).
  bool Verdict(int fd, const std::string& token, const core::Nonce& server_nonce,
               const uint8_t* after, size_t after_bytes) {
    auth::Response response{};
    if (!fuzz::ReadExact(fd, response.data(), response.size(), fuzz::After(kBound))) return false;
    core::Nonce client_nonce;
    core::Proof proof;
    std::memcpy(client_nonce.data(), response.data(), client_nonce.size());
    std::memcpy(proof.data(), response.data() + client_nonce.size(), proof.size());
    if (!core::ProofsEqual(
            proof, auth::StoreProof(token, client_nonce, server_nonce, auth::kClientRole))) {
      Fail("the client's proof of its token is wrong");
    }
    std::array<uint8_t, auth::kVerdictBytes> verdict{};
    verdict[0] = 1;
    const core::Proof mine = auth::StoreProof(token, client_nonce, server_nonce, auth::kServerRole);
    std::memcpy(verdict.data() + 1, mine.data(), mine.size());
    std::vector<uint8_t> out(verdict.begin(), verdict.end());
    out.insert(out.end(), after, after + after_bytes);
    return Send(fd, out.data(), out.size());
  }

  void Answer(int fd) {
    const uint8_t* bytes = input_.data();
    const size_t size = input_.size();
    core::Nonce server_nonce;
    if (mode_ == Mode::kRaw || !ValidChallenge(input_, &server_nonce)) {
      Send(fd, bytes, size);
      return;
    }
    if (!Send(fd, bytes, auth::kChallengeBytes)) return;
    size_t at = auth::kChallengeBytes;
    std::string token = kFuzzToken;
    if (mode_ == Mode::kEnrol) {
      auth::Response request{};
      if (!fuzz::ReadExact(fd, request.data(), request.size(), fuzz::After(kBound))) return;
      uint32_t rank = 0;
      if (auth::ClassifyResponse(request, &rank) != auth::ResponseKind::kEnrolment || rank != 1) {
        Fail("the client did not send an enrolment request for rank 1");
      }
      const auto reply = ParseEnrolReply(bytes + at, size - at);
      if (!reply || !reply->granted) {
        Send(fd, bytes + at, size - at);
        return;
      }
      if (!Send(fd, bytes + at, reply->bytes)) return;
      at += reply->bytes;
      token = reply->payload;
    }
    Verdict(fd, token, server_nonce, bytes + at, size - at);
  }

  const int listener_;
  const Mode mode_;
  const std::vector<uint8_t> input_;
  int wake_[2] = {-1, -1};  // written once, by the destructor, to stop the server thread
  std::vector<int> open_;   // the server thread's until it is joined
  std::thread thread_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Listener& listener = Shared();
  const Mode mode = static_cast<Mode>((data[0] & 3) % 3);
  const Call call = static_cast<Call>(((data[0] >> 2) & 3) % 3);
  const uint8_t* bytes = data + 1;
  const size_t bytes_size = size - 1;

  // What the client may make of the bytes (see the top).
  const std::vector<uint8_t> input(bytes, bytes + bytes_size);
  core::Nonce ignored;
  const bool challenge = mode != Mode::kRaw && ValidChallenge(input, &ignored);
  std::optional<EnrolReply> enrolment;
  size_t replies_at = auth::kChallengeBytes;
  if (challenge && mode == Mode::kEnrol) {
    enrolment = ParseEnrolReply(bytes + replies_at, bytes_size - replies_at);
    if (enrolment) replies_at += enrolment->bytes;
  }
  const bool may_connect = challenge && (mode == Mode::kToken || (enrolment && enrolment->granted));

  // A connection an earlier input's client left in the backlog (it gave up before the fake
  // server accepted it) would take this input's answer.
  for (pollfd waiting{listener.fd, POLLIN, 0}; ::poll(&waiting, 1, 0) > 0;) {
    const int stale = ::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (stale < 0) break;
    ::close(stale);
  }
  FakeServer server(listener.fd, mode, bytes, bytes_size);
  std::optional<cluster::TcpStoreClient> client;
  try {
    // A zero connect timeout: one attempt (each step of it still gets 1 s).
    client.emplace("127.0.0.1", listener.port, std::chrono::milliseconds(0),
                   mode == Mode::kToken ? kFuzzToken : "", mode == Mode::kEnrol ? 1 : -1);
  } catch (const Error& error) {
    if (may_connect && error.code() == ErrorCode::kUnauthenticated) {
      Fail(std::string("a server that answered properly was refused: ") + error.what());
    }
    if (challenge && mode == Mode::kEnrol && enrolment && !enrolment->granted &&
        error.code() != ErrorCode::kUnauthenticated && error.code() != ErrorCode::kTimeout) {
      Fail(std::string("a refused enrolment raised another error: ") + error.what());
    }
    return 0;
  }
  if (!may_connect) Fail("the client connected to a server that did not prove the token");
  if (mode == Mode::kEnrol && client->JobToken() != enrolment->payload) {
    Fail("the client proves another token than the one it was granted");
  }

  const Expected expected = ExpectReply(call, bytes + replies_at, bytes_size - replies_at);
  try {
    switch (call) {
      case Call::kSet:
        client->Set(kKey, "value");
        break;
      case Call::kGet: {
        const std::string value = client->Get(kKey, std::chrono::milliseconds(0));
        if (expected.ok && value != expected.value) Fail("Get returned another value than sent");
        break;
      }
      case Call::kAdd: {
        const int64_t sum = client->Add(kKey, 5);
        if (expected.ok && sum != expected.sum) Fail("Add returned another sum than sent");
        break;
      }
    }
  } catch (const Error& error) {
    if (expected.ok) Fail(std::string("a valid reply raised: ") + error.what());
    if (expected.code && error.code() != *expected.code) {
      Fail(std::string("a reply's status raised another error code: ") + error.what());
    }
    return 0;
  }
  if (!expected.ok) Fail("a call succeeded on a cut or malformed reply");
  return 0;
}
