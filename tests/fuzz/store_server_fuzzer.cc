// Fuzz target: the TCP store's server (tcp_store_server.cc) as rank 0 runs it, fed what a
// stranger sends on one connection. The first input byte picks the server: even, one that holds
// a token the job set (it enrols nobody); odd, one that generated its token and enrols ranks
// 1..kWorldSize-1 (trust on first use, tcp_store_auth.h). The rest is the stranger's stream on a
// fresh loopback connection, after which it closes its sending side. Checks, on every input:
//   - the server closes the stranger's connection within 2 s of its EOF (no session is left
//     hanging), what it sent starts with a store challenge, and no verdict it sent accepts;
//   - the stranger's writes never land: the key of every well-formed Set or Add request found
//     anywhere in its stream is absent from the table (the stranger cannot prove the token:
//     random bytes do not, even after an enrolment handed it the token);
//   - the server still serves: a new client that proves the token Sets a key and Gets it back.
// Both servers live across inputs (one listener each, on an ephemeral port), so what earlier
// strangers left (ranks they enrolled for, sessions being closed) is part of what is fuzzed.
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "collectives/errors.h"
#include "src/cluster/tcp_store.h"
#include "src/cluster/tcp_store_auth.h"
#include "src/cluster/tcp_store_wire.h"
#include "tests/fuzz/loopback.h"

using namespace collectives;
namespace auth = cluster::auth;
namespace wire = cluster::wire;

namespace {

constexpr int kWorldSize = 64;
constexpr char kHealthKey[] = "fuzz/health";
constexpr auto kBound = std::chrono::milliseconds(2000);

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "store_server_fuzzer: %s\n", what.c_str());
  std::abort();
}

struct Servers {
  cluster::TcpStoreServer given{"127.0.0.1", 0, "fuzz-token", kWorldSize};
  cluster::TcpStoreServer enrolling{"127.0.0.1", 0, "", kWorldSize};
  long checks = 0;
};

Servers& Shared() {
  static Servers* servers = new Servers();  // never destroyed: its thread serves to the end
  return *servers;
}

// Whether what the server sent the stranger (`received`) holds a verdict that accepts it: past
// the challenge, the answer to the stranger's first response (to a proof, a verdict; to an
// enrolment request, the enrolment reply, then the verdict on the proof that follows it).
bool AcceptedStranger(const uint8_t* stream, size_t size, const std::string& received) {
  size_t at = auth::kChallengeBytes;
  if (size >= auth::kResponseBytes) {
    auth::Response response{};
    std::memcpy(response.data(), stream, response.size());
    uint32_t rank = 0;
    if (auth::ClassifyResponse(response, &rank) == auth::ResponseKind::kEnrolment &&
        received.size() >= at + auth::kEnrolReplyHeaderBytes &&
        static_cast<uint8_t>(received[at]) == auth::kEnrolled) {
      at += auth::kEnrolReplyHeaderBytes + static_cast<uint8_t>(received[at + 2]);
    }
  }
  return received.size() > at && received[at] == 1;
}

// Fails if a key that a well-formed Set or Add request anywhere in `stream` names is in `server`.
void CheckNoStrangerKeys(cluster::TcpStoreServer& server, const uint8_t* stream, size_t size) {
  for (size_t at = 0; at + wire::kHeaderBytes <= size; ++at) {
    wire::HeaderBytes bytes;
    std::memcpy(bytes.data(), stream + at, bytes.size());
    const wire::Header header = wire::Decode(bytes);
    if (!wire::CheckRequest(header).empty()) continue;
    if (header.code == static_cast<uint8_t>(wire::Op::kGet)) continue;
    if (header.key_bytes > size - at - wire::kHeaderBytes) continue;
    const std::string key(reinterpret_cast<const char*>(stream + at + wire::kHeaderBytes),
                          header.key_bytes);
    if (key == kHealthKey) continue;
    try {
      server.Get(key, std::chrono::milliseconds(0));
    } catch (const Error&) {
      continue;  // not set (or not a key this store could hold)
    }
    Fail("a stranger's request set key '" + key + "' without proving the token");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Servers& servers = Shared();
  cluster::TcpStoreServer& server = (data[0] & 1) ? servers.enrolling : servers.given;
  const uint8_t* stream = data + 1;
  const size_t stream_bytes = size - 1;

  const int fd = fuzz::ConnectLoopback(server.port());
  if (fd < 0) Fail("cannot connect to the server");
  const auto deadline = fuzz::After(kBound);
  fuzz::SendAll(fd, stream, stream_bytes, deadline);  // the server may close before it all went
  ::shutdown(fd, SHUT_WR);
  std::string received;
  if (!fuzz::ReadUntilClosed(fd, &received, deadline)) {
    Fail("the server kept a stranger's connection open for 2 s after the stranger's EOF");
  }
  ::close(fd);
  if (received.size() >= 4) {
    std::array<uint8_t, auth::kChallengeBytes> challenge{};
    std::memcpy(challenge.data(), received.data(), std::min(received.size(), challenge.size()));
    core::Nonce nonce;
    if (!auth::DecodeChallenge(challenge, &nonce)) Fail("the server did not open with a challenge");
  }
  if (AcceptedStranger(stream, stream_bytes, received)) {
    Fail("the server sent an accepting verdict to a stranger");
  }
  CheckNoStrangerKeys(server, stream, stream_bytes);

  // A rank's client still gets in and is served.
  const std::string value = std::to_string(++servers.checks);
  try {
    cluster::TcpStoreClient client("127.0.0.1", server.port(), kBound, server.JobToken());
    client.Set(kHealthKey, value);
    if (client.Get(kHealthKey, std::chrono::milliseconds(0)) != value) {
      Fail("a client read back another value than it set");
    }
  } catch (const Error& error) {
    Fail(std::string("a client with the token is no longer served: ") + error.what());
  }
  return 0;
}
