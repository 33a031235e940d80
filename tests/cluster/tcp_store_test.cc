// Tests of the TCP store beyond what every store does (store_test.cc): many clients, a client
// that starts before its server, strangers that send garbage or huge lengths, shutdown with
// clients connected, the store a ClusterSpec names, and names whose lookup does not answer.
//
// One file: the store, auth and enrolment suites drive the server through RawClient (a socket the
// test writes byte by byte) and share Server() and Client(); every suite uses the kLong deadline.
#include "src/cluster/tcp_store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/job_token.h"
#include "src/cluster/tcp_store_auth.h"
#include "src/cluster/tcp_store_wire.h"
#include "src/core/environment.h"
#include "tests/child_process.h"
#include "tests/free_port.h"
#include "tests/loopback_spec.h"
#include "tests/scoped_env.h"
#include "tests/time_scale.h"
#include "tests/transport/piece_relay.h"

namespace collectives {
namespace {

using collectives::testing::ExpectEndedOnTime;
using collectives::testing::FreePort;
using collectives::testing::InAMountNamespace;
using collectives::testing::LoopbackSpec;
using collectives::testing::ScopedEnv;
using collectives::testing::TimesOutSaying;
using collectives::testing::WithANameServerThatDoesNotAnswer;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
namespace wire = cluster::wire;

constexpr milliseconds kLong{5000};

// A blocking POSIX socket to 127.0.0.1:port that the test drives byte by byte.
class RawClient {
 public:
  explicit RawClient(uint16_t port) : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~RawClient() { close(fd_); }

  bool connected() const { return connected_; }

  bool Send(const void* data, size_t bytes) {
    return send(fd_, data, bytes, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes);
  }

  bool Receive(void* data, size_t bytes) {
    size_t got = 0;
    while (got < bytes) {
      const ssize_t n = recv(fd_, static_cast<char*>(data) + got, bytes - got, 0);
      if (n <= 0) return false;
      got += size_t(n);
    }
    return true;
  }

  // Runs the client side of the store's token proof (tcp_store_auth.h) with `token`; true if
  // the server accepted it.
  bool Authenticate(const std::string& token = "") { return ReadChallenge() && Prove(token); }

  // The first half of it: reads the server's challenge; true if it is one.
  bool ReadChallenge() {
    std::array<uint8_t, cluster::auth::kChallengeBytes> challenge{};
    return Receive(challenge.data(), challenge.size()) &&
           cluster::auth::DecodeChallenge(challenge, &server_nonce_);
  }

  // The second half (after ReadChallenge, and after an enrolment): proves `token`.
  bool Prove(const std::string& token) {
    const core::Nonce client_nonce = core::RandomNonce();
    const core::Proof proof =
        cluster::auth::StoreProof(token, client_nonce, server_nonce_, cluster::auth::kClientRole);
    if (!Send(client_nonce.data(), client_nonce.size()) || !Send(proof.data(), proof.size())) {
      return false;
    }
    std::array<uint8_t, cluster::auth::kVerdictBytes> verdict{};
    return Receive(verdict.data(), verdict.size()) && verdict[0] == 1;
  }

  // True when the peer closed the connection within `timeout` (reads discard any bytes).
  bool ClosedByPeerWithin(milliseconds timeout) {
    Clock::time_point deadline = Clock::now() + timeout;
    char buffer[256];
    while (Clock::now() < deadline) {
      pollfd poll_fd{fd_, POLLIN, 0};
      int left = static_cast<int>(
          std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count());
      if (poll(&poll_fd, 1, std::max(left, 1)) <= 0) continue;
      ssize_t n = recv(fd_, buffer, sizeof(buffer), 0);
      if (n <= 0) return true;
    }
    return false;
  }

 private:
  int fd_;
  bool connected_ = false;
  core::Nonce server_nonce_{};
};

std::shared_ptr<Store> Server() { return CreateTcpStore("127.0.0.1", 0, true, kLong); }

std::shared_ptr<Store> Client(const Store& server) {
  return CreateTcpStore("127.0.0.1", TcpStorePort(server), false, kLong);
}

TEST(TcpStoreTest, PortZeroPicksAFreePort) {
  auto server = Server();
  EXPECT_NE(TcpStorePort(*server), 0);
  auto client = Client(*server);
  try {
    TcpStorePort(*client);
    ADD_FAILURE() << "a client is not a server";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
  EXPECT_THROW(TcpStorePort(*CreateMemoryStore()), Error);
}

TEST(TcpStoreTest, SocketsAreCloseOnExec) {
  auto server = Server();
  auto client = Client(*server);
  client->Set("k", "v");  // the server has accepted by now
  int sockets = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    std::string target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (ec || target.rfind("socket:", 0) != 0) continue;
    int fd = std::stoi(entry.path().filename().string());
    ++sockets;
    EXPECT_NE(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0) << "fd " << fd;
  }
  EXPECT_GE(sockets, 3);  // listener, client end, server end
}

TEST(TcpStoreTest, BindingATakenPortIsASystemError) {
  auto server = Server();
  uint16_t port = TcpStorePort(*server);
  try {
    CreateTcpStore("127.0.0.1", port, true, kLong);
    ADD_FAILURE() << "expected kSystem";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystem) << e.what();
    EXPECT_NE(e.message().find(std::to_string(port)), std::string::npos) << e.message();
  }
}

TEST(TcpStoreTest, Ipv6Loopback) {
  std::shared_ptr<Store> server;
  try {
    server = CreateTcpStore("::1", 0, true, kLong);
  } catch (const Error& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
  auto client = CreateTcpStore("[::1]", TcpStorePort(*server), false, kLong);
  client->Set("v6", "yes");
  EXPECT_EQ(server->Get("v6", kLong), "yes");
}

TEST(TcpStoreTest, EightClientThreadsRendezvous) {
  constexpr int kClients = 8;
  auto server = Server();
  uint16_t port = TcpStorePort(*server);
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int rank = 0; rank < kClients; ++rank) {
    threads.emplace_back([&, rank] {
      auto store = CreateTcpStore("127.0.0.1", port, false, kLong);
      store->Set("addr/" + std::to_string(rank), "host" + std::to_string(rank));
      int64_t arrived = store->Add("arrived", 1);
      bool ok = arrived >= 1 && arrived <= kClients;
      for (int peer = 0; peer < kClients; ++peer) {
        ok = ok &&
             store->Get("addr/" + std::to_string(peer), kLong) == "host" + std::to_string(peer);
      }
      if (ok) ++good;
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(good.load(), kClients);
  EXPECT_EQ(server->Get("arrived", kLong), std::to_string(kClients));
}

// Clients whose connections pass a relay that hands every byte stream on in pieces of random
// length: the proof exchange, requests and replies (keys and values of 0 bytes to 1 MiB, a
// parked Get answered later, Add) each arrive split anywhere, and every answer is exact.
TEST(TcpStoreTest, RequestsAndRepliesSplitIntoPiecesAreReadWhole) {
  auto server = CreateTcpStore("127.0.0.1", 0, true, kLong, "token");
  testing::PieceRelay relay("127.0.0.1:" + std::to_string(TcpStorePort(*server)), /*seed=*/7);
  const uint16_t relay_port = relay.port();
  constexpr int kClients = 3;
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto store = CreateTcpStore("127.0.0.1", relay_port, false, kLong, "token");
      bool ok = true;
      for (size_t bytes : {size_t{0}, size_t{1}, size_t{39}, size_t{4097}, size_t{1} << 20}) {
        const std::string key = std::to_string(c) + "/" + std::to_string(bytes);
        const std::string value(bytes, static_cast<char>('a' + c));
        store->Set(key, value);
        ok = ok && store->Get(key, kLong) == value;
      }
      ok = ok && store->Add("arrived", 1) >= 1;
      // A Get parked until the last client's Set.
      ok = ok && store->Get("last", kLong) == std::string(1000, 'z');
      if (ok) ++good;
    });
  }
  while (server->Add("arrived", 0) < kClients) std::this_thread::sleep_for(milliseconds(5));
  auto last = CreateTcpStore("127.0.0.1", relay_port, false, kLong, "token");
  last->Set("last", std::string(1000, 'z'));
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(good.load(), kClients);
  EXPECT_EQ(server->Get("2/1048576", kLong), std::string(size_t{1} << 20, 'c'));
}

TEST(TcpStoreTest, RemoteGetIsAnsweredByTheHostsSetAndTheOtherWayRound) {
  auto server = Server();
  auto client = Client(*server);
  auto remote_get = std::async(std::launch::async, [&] { return client->Get("from-host", kLong); });
  std::this_thread::sleep_for(milliseconds(20));
  server->Set("from-host", "1");
  EXPECT_EQ(remote_get.get(), "1");
  auto local_get =
      std::async(std::launch::async, [&] { return server->Get("from-client", kLong); });
  std::this_thread::sleep_for(milliseconds(20));
  client->Set("from-client", "2");
  EXPECT_EQ(local_get.get(), "2");
}

TEST(TcpStoreTest, ParkedGetsTimeOutAndTheConnectionIsReused) {
  auto server = Server();
  auto client = Client(*server);
  for (int i = 0; i < 3; ++i) {
    EXPECT_THROW(client->Get("missing", milliseconds(20)), Error);
  }
  server->Set("missing", "found");
  EXPECT_EQ(client->Get("missing", milliseconds(20)), "found");
}

TEST(TcpStoreTest, ClientStartedBeforeTheServer) {
  uint16_t port = FreePort();
  auto client_future = std::async(std::launch::async, [port] {
    auto client = CreateTcpStore("127.0.0.1", port, false, milliseconds(3000));
    client->Set("early", "bird");
    return client->Get("reply", kLong);
  });
  std::this_thread::sleep_for(milliseconds(100));
  auto server = CreateTcpStore("127.0.0.1", port, true, kLong);
  EXPECT_EQ(server->Get("early", kLong), "bird");
  server->Set("reply", "welcome");
  EXPECT_EQ(client_future.get(), "welcome");
}

TEST(TcpStoreTest, ClientGivesUpWhenNoServerComes) {
  uint16_t port = FreePort();
  Clock::time_point start = Clock::now();
  try {
    CreateTcpStore("127.0.0.1", port, false, milliseconds(200));
    ADD_FAILURE() << "expected kTimeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.message();
  }
  auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, milliseconds(190));
  EXPECT_LT(elapsed, test_time::Scaled(milliseconds(2000)));
}

TEST(TcpStoreTest, ClientNeedsAPort) {
  EXPECT_THROW(CreateTcpStore("127.0.0.1", 0, false, kLong), Error);
}

TEST(TcpStoreTest, GarbageFromAStrangerDoesNotBreakTheServer) {
  auto server = Server();
  uint16_t port = TcpStorePort(*server);
  auto before = Client(*server);
  before->Set("k", "v");

  RawClient stranger(port);
  ASSERT_TRUE(stranger.connected());
  // Garbage where the token proof belongs (64 bytes or more): refused at once.
  std::string garbage =
      "GET / HTTP/1.1\r\nHost: example\r\nUser-Agent: a stranger on the port\r\n\r\n";
  ASSERT_TRUE(stranger.Send(garbage.data(), garbage.size()));
  EXPECT_TRUE(stranger.ClosedByPeerWithin(milliseconds(2000)));

  EXPECT_EQ(before->Get("k", kLong), "v");
  auto after = Client(*server);
  after->Set("k2", "v2");
  EXPECT_EQ(before->Get("k2", kLong), "v2");
}

TEST(TcpStoreTest, OversizeLengthsAreRejectedBeforeAllocating) {
  auto server = Server();
  uint16_t port = TcpStorePort(*server);
  struct Case {
    const char* what;
    wire::Header header;
  };
  std::vector<Case> cases;
  wire::Header huge_key;
  huge_key.code = static_cast<uint8_t>(wire::Op::kSet);
  huge_key.key_bytes = 0xffffffffu;
  cases.push_back({"huge key", huge_key});
  wire::Header huge_value;
  huge_value.code = static_cast<uint8_t>(wire::Op::kSet);
  huge_value.key_bytes = 1;
  huge_value.value_bytes = static_cast<uint32_t>(cluster::kMaxValueBytes + 1);
  cases.push_back({"huge value", huge_value});
  wire::Header get_with_value;
  get_with_value.code = static_cast<uint8_t>(wire::Op::kGet);
  get_with_value.key_bytes = 1;
  get_with_value.value_bytes = 1000;
  cases.push_back({"get with value", get_with_value});
  wire::Header unknown_op;
  unknown_op.code = 99;
  unknown_op.key_bytes = 1;
  cases.push_back({"unknown op", unknown_op});
  wire::Header empty_key;
  empty_key.code = static_cast<uint8_t>(wire::Op::kGet);
  cases.push_back({"empty key", empty_key});

  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    RawClient stranger(port);
    ASSERT_TRUE(stranger.connected());
    ASSERT_TRUE(stranger.Authenticate());
    wire::HeaderBytes bytes = wire::Encode(c.header);
    ASSERT_TRUE(stranger.Send(bytes.data(), bytes.size()));
    EXPECT_TRUE(stranger.ClosedByPeerWithin(milliseconds(2000)));
  }
  auto client = Client(*server);
  client->Set("still", "alive");
  EXPECT_EQ(client->Get("still", kLong), "alive");
}

TEST(TcpStoreTest, TruncatedRequestAndAbruptCloseAreHarmless) {
  auto server = Server();
  uint16_t port = TcpStorePort(*server);
  {
    RawClient stranger(port);
    ASSERT_TRUE(stranger.Authenticate());
    wire::Header header;
    header.code = static_cast<uint8_t>(wire::Op::kSet);
    header.key_bytes = 10;
    header.value_bytes = 10;
    wire::HeaderBytes bytes = wire::Encode(header);
    ASSERT_TRUE(stranger.Send(bytes.data(), bytes.size()));
    ASSERT_TRUE(stranger.Send("abc", 3));
  }  // closes mid-request
  {
    RawClient half_header(port);
    ASSERT_TRUE(half_header.Authenticate());
    ASSERT_TRUE(half_header.Send("\x43\x53", 2));
  }
  // A well-formed raw request gets a well-formed reply.
  {
    RawClient raw(port);
    ASSERT_TRUE(raw.Authenticate());
    wire::Header header;
    header.code = static_cast<uint8_t>(wire::Op::kAdd);
    header.key_bytes = 3;
    header.arg = 5;
    wire::HeaderBytes bytes = wire::Encode(header);
    ASSERT_TRUE(raw.Send(bytes.data(), bytes.size()));
    ASSERT_TRUE(raw.Send("raw", 3));
    EXPECT_EQ(server->Get("raw", kLong), "5");
  }
  auto client = Client(*server);
  EXPECT_EQ(client->Add("raw", 1), 6);
}

// Sends a raw Get of `key` that waits up to `timeout_ms`.
void SendGet(RawClient& raw, const std::string& key, int64_t timeout_ms) {
  wire::Header header;
  header.code = static_cast<uint8_t>(wire::Op::kGet);
  header.key_bytes = static_cast<uint32_t>(key.size());
  header.arg = timeout_ms;
  wire::HeaderBytes bytes = wire::Encode(header);
  ASSERT_TRUE(raw.Send(bytes.data(), bytes.size()));
  ASSERT_TRUE(raw.Send(key.data(), key.size()));
}

TEST(TcpStoreTest, ParkedGetOfAClientThatLeavesOrTalksOutOfTurn) {
  auto server = Server();
  uint16_t port = TcpStorePort(*server);
  {
    RawClient leaver(port);
    ASSERT_TRUE(leaver.Authenticate());
    SendGet(leaver, "later", 10000);
  }  // closes while its Get is parked
  RawClient talker(port);
  ASSERT_TRUE(talker.Authenticate());
  SendGet(talker, "later", 10000);
  std::this_thread::sleep_for(milliseconds(20));
  ASSERT_TRUE(talker.Send("x", 1));  // a request before the reply of the last one
  EXPECT_TRUE(talker.ClosedByPeerWithin(milliseconds(2000)));
  // Setting the key now answers nobody and breaks nothing.
  server->Set("later", "v");
  auto client = Client(*server);
  EXPECT_EQ(client->Get("later", kLong), "v");
}

// Every connection proves the job token both ways before its first request.
TEST(TcpStoreAuthTest, AClientWithTheWrongTokenIsRefusedAndTheServerGoesOn) {
  auto server = CreateTcpStore("127.0.0.1", 0, true, kLong, "the job's secret");
  const uint16_t port = TcpStorePort(*server);
  try {
    CreateTcpStore("127.0.0.1", port, false, kLong, "a guess");
    ADD_FAILURE() << "a client with the wrong token was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
    EXPECT_NE(std::string(e.what()).find("rejected"), std::string::npos) << e.what();
  }
  // A stranger that proves nothing never reaches the table.
  RawClient stranger(port);
  EXPECT_FALSE(stranger.Authenticate("another guess"));
  EXPECT_TRUE(stranger.ClosedByPeerWithin(milliseconds(2000)));
  // The right token works, before and after.
  auto client = CreateTcpStore("127.0.0.1", port, false, kLong, "the job's secret");
  client->Set("k", "v");
  EXPECT_EQ(server->Get("k", kLong), "v");
  EXPECT_EQ(client->Get("k", kLong), "v");
}

TEST(TcpStoreAuthTest, AClientRefusesAServerThatCannotProveTheToken) {
  // A server with another token: the client's proof fails there first; a server that accepted
  // anything would still fail the client's check of the server's proof.
  auto server = CreateTcpStore("127.0.0.1", 0, true, kLong, "server token");
  try {
    CreateTcpStore("127.0.0.1", TcpStorePort(*server), false, kLong, "client token");
    ADD_FAILURE() << "the client trusted a server with another token";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
  }
}

// Enrolment (tcp_store_auth.h): a job that sets no token gets one from the store's creator.

// What CreateStoreFor's rank would get, but for any rank a stranger cares to name.
std::string EnrolmentError(uint16_t port, int rank) {
  try {
    cluster::TcpStoreClient stranger("127.0.0.1", port, kLong, "", rank);
    return "enrolled";
  } catch (const Error& e) {
    return e.code() == ErrorCode::kUnauthenticated ? e.message() : "wrong code: " + e.message();
  }
}

TEST(TcpStoreEnrolTest, EveryRankEnrolsOnceForTheGeneratedTokenAndReconnectsWithIt) {
  const uint16_t port = FreePort();
  auto server = CreateStoreFor(LoopbackSpec(0, 3, port), kLong);
  auto one = CreateStoreFor(LoopbackSpec(1, 3, port), kLong);
  auto two = CreateStoreFor(LoopbackSpec(2, 3, port), kLong);
  const std::string token = cluster::StoreJobToken(*server);
  EXPECT_EQ(token.size(), cluster::auth::kGeneratedTokenBytes);
  EXPECT_NE(token, std::string(token.size(), '\0'));
  EXPECT_EQ(cluster::StoreJobToken(*one), token);
  EXPECT_EQ(cluster::StoreJobToken(*two), token);
  one->Set("k", "v");
  EXPECT_EQ(two->Get("k", kLong), "v");
  // A parked Get holds rank 1's connection, so its Set opens another: with the token it got,
  // not by enrolling again (which the server would refuse).
  auto parked = std::async(std::launch::async, [&] { return one->Get("later", kLong); });
  std::this_thread::sleep_for(milliseconds(50));
  one->Set("later", "set on a second connection");
  EXPECT_EQ(parked.get(), "set on a second connection");
  // Another server generates another token.
  auto other = CreateStoreFor(LoopbackSpec(0, 3, FreePort()), kLong);
  EXPECT_NE(cluster::StoreJobToken(*other), token);
}

TEST(TcpStoreEnrolTest, AStrangerWhoEnrolsFirstTakesTheRankAndTheRealRankIsRefused) {
  const uint16_t port = FreePort();
  auto server = CreateStoreFor(LoopbackSpec(0, 3, port), kLong);
  cluster::TcpStoreClient stranger("127.0.0.1", port, kLong, "", 2);
  try {
    CreateStoreFor(LoopbackSpec(2, 3, port), kLong);
    ADD_FAILURE() << "rank 2 enrolled twice";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
    EXPECT_NE(e.message().find("rank 2's enrolment in the job's store was already taken by "
                               "127.0.0.1:"),
              std::string::npos)
        << e.message();
    EXPECT_NE(e.message().find("COLLECTIVES_JOB_TOKEN"), std::string::npos) << e.message();
  }
  // The other rank is not disturbed.
  auto one = CreateStoreFor(LoopbackSpec(1, 3, port), kLong);
  one->Set("k", "v");
  EXPECT_EQ(server->Get("k", kLong), "v");
}

TEST(TcpStoreEnrolTest, OnceEveryRankEnrolledEnrolmentIsClosed) {
  const uint16_t port = FreePort();
  auto server = CreateStoreFor(LoopbackSpec(0, 3, port), kLong);
  auto one = CreateStoreFor(LoopbackSpec(1, 3, port), kLong);
  auto two = CreateStoreFor(LoopbackSpec(2, 3, port), kLong);
  for (int rank : {1, 2}) {
    const std::string error = EnrolmentError(port, rank);
    EXPECT_NE(error.find("rank " + std::to_string(rank) +
                         "'s enrolment in the job's store was "
                         "already taken by 127.0.0.1:"),
              std::string::npos)
        << error;
  }
  for (int rank : {0, 3, 1000}) {
    const std::string error = EnrolmentError(port, rank);
    EXPECT_NE(error.find("rank is outside the job's"), std::string::npos) << error;
  }
  one->Set("still", "serving");
  EXPECT_EQ(two->Get("still", kLong), "serving");
}

TEST(TcpStoreEnrolTest, TheEmptyTokenOpensNothingOnAServerThatGeneratedOne) {
  const uint16_t port = FreePort();
  auto server = CreateStoreFor(LoopbackSpec(0, 2, port), kLong);
  try {
    CreateTcpStore("127.0.0.1", port, false, kLong);  // no token, no rank: proves ""
    ADD_FAILURE() << "the empty token was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
  }
  RawClient stranger(port);
  EXPECT_FALSE(stranger.Authenticate(""));
  EXPECT_TRUE(stranger.ClosedByPeerWithin(milliseconds(2000)));
  auto one = CreateStoreFor(LoopbackSpec(1, 2, port), kLong);
  one->Set("k", "v");
  EXPECT_EQ(server->Get("k", kLong), "v");
}

TEST(TcpStoreEnrolTest, AServerWithAJobTokenEnrolsNobody) {
  const uint16_t port = FreePort();
  auto server = CreateStoreFor(LoopbackSpec(0, 3, port), kLong, "the job's secret");
  EXPECT_EQ(cluster::StoreJobToken(*server), "the job's secret");
  const std::string error = EnrolmentError(port, 1);
  EXPECT_NE(error.find("the store holds a job token and this rank has none"), std::string::npos)
      << error;
  auto one = CreateStoreFor(LoopbackSpec(1, 3, port), kLong, "the job's secret");
  EXPECT_EQ(cluster::StoreJobToken(*one), "the job's secret");
}

TEST(TcpStoreEnrolTest, AServerWithoutWorldSizeOrTokenKeepsTheEmptyToken) {
  auto server = Server();  // CreateTcpStore with neither a world size nor a token
  const uint16_t port = TcpStorePort(*server);
  EXPECT_EQ(cluster::StoreJobToken(*server), "");
  auto plain = Client(*server);
  auto enrolled = CreateStoreFor(LoopbackSpec(1, 3, port), kLong);  // gets the empty token
  EXPECT_EQ(cluster::StoreJobToken(*enrolled), "");
  enrolled->Set("k", "v");
  EXPECT_EQ(plain->Get("k", kLong), "v");
  EXPECT_EQ(cluster::StoreJobToken(*CreateMemoryStore()), "");
}

// The server's side of the enrolment handshake against bytes a stranger makes up: every bad
// request closes that connection only.
TEST(TcpStoreEnrolTest, MalformedEnrolmentsCloseTheConnectionAndTheServerGoesOn) {
  const uint16_t port = FreePort();
  auto server = CreateStoreFor(LoopbackSpec(0, 3, port), kLong);
  auto reply_of = [](RawClient& raw) {
    std::array<uint8_t, cluster::auth::kEnrolReplyHeaderBytes> header{};
    EXPECT_TRUE(raw.Receive(header.data(), header.size()));
    std::string payload(header[2], '\0');
    EXPECT_TRUE(raw.Receive(payload.data(), payload.size()));
    return std::make_pair(header, payload);
  };
  {
    SCOPED_TRACE("rank out of range: refused with its reason, then closed");
    RawClient raw(port);
    ASSERT_TRUE(raw.ReadChallenge());
    const auto request = cluster::auth::EncodeEnrolment(7);
    ASSERT_TRUE(raw.Send(request.data(), request.size()));
    const auto [header, payload] = reply_of(raw);
    EXPECT_EQ(header[0], cluster::auth::kEnrolRefused);
    EXPECT_EQ(header[1], uint8_t(cluster::auth::EnrolRefusal::kRankOutOfRange));
    EXPECT_TRUE(raw.ClosedByPeerWithin(milliseconds(2000)));
  }
  {
    SCOPED_TRACE("enrolment magic with padding that is not zero");
    RawClient raw(port);
    ASSERT_TRUE(raw.ReadChallenge());
    auto request = cluster::auth::EncodeEnrolment(1);
    request[40] = 1;
    ASSERT_TRUE(raw.Send(request.data(), request.size()));
    EXPECT_TRUE(raw.ClosedByPeerWithin(milliseconds(2000)));
  }
  {
    SCOPED_TRACE("a short enrolment request, then the client leaves");
    RawClient raw(port);
    ASSERT_TRUE(raw.ReadChallenge());
    const auto request = cluster::auth::EncodeEnrolment(1);
    ASSERT_TRUE(raw.Send(request.data(), 6));
  }
  {
    SCOPED_TRACE("a second enrolment on the connection that got the token");
    RawClient raw(port);
    ASSERT_TRUE(raw.ReadChallenge());
    const auto request = cluster::auth::EncodeEnrolment(1);
    ASSERT_TRUE(raw.Send(request.data(), request.size()));
    const auto [header, token] = reply_of(raw);
    EXPECT_EQ(header[0], cluster::auth::kEnrolled);
    EXPECT_EQ(token, cluster::StoreJobToken(*server));
    ASSERT_TRUE(raw.Send(request.data(), request.size()));
    EXPECT_TRUE(raw.ClosedByPeerWithin(milliseconds(2000)));
  }
  {
    SCOPED_TRACE("rank 2 enrols raw and proves the token it got");
    RawClient raw(port);
    ASSERT_TRUE(raw.ReadChallenge());
    const auto request = cluster::auth::EncodeEnrolment(2);
    ASSERT_TRUE(raw.Send(request.data(), request.size()));
    const auto [header, token] = reply_of(raw);
    ASSERT_EQ(header[0], cluster::auth::kEnrolled);
    EXPECT_TRUE(raw.Prove(token));
  }
  // Every rank has enrolled (rank 1 on the connection closed above); the table still serves.
  EXPECT_NE(EnrolmentError(port, 1).find("already taken"), std::string::npos);
  cluster::TcpStoreClient holder("127.0.0.1", port, kLong, cluster::StoreJobToken(*server));
  holder.Set("k", "v");
  EXPECT_EQ(server->Get("k", kLong), "v");
}

TEST(TcpStoreTest, ShutdownWithClientsConnectedAndAGetParked) {
  auto server = Server();
  auto idle_client = Client(*server);
  auto waiting_client = Client(*server);
  RawClient stranger(TcpStorePort(*server));  // connected, silent
  idle_client->Set("x", "1");
  auto parked = std::async(std::launch::async, [&] {
    try {
      waiting_client->Get("never", milliseconds(10000));
      return ErrorCode::kInternal;
    } catch (const Error& e) {
      return e.code();
    }
  });
  std::this_thread::sleep_for(milliseconds(50));
  Clock::time_point start = Clock::now();
  server.reset();
  EXPECT_LT(Clock::now() - start, test_time::Scaled(milliseconds(1000)));
  ASSERT_EQ(parked.wait_for(milliseconds(2000)), std::future_status::ready);
  EXPECT_EQ(parked.get(), ErrorCode::kPeerLost);
  EXPECT_TRUE(stranger.ClosedByPeerWithin(milliseconds(1000)));
  // The idle client finds out on its next call, with an error rather than a hang.
  start = Clock::now();
  EXPECT_THROW(idle_client->Set("y", "2"), Error);
  EXPECT_LT(Clock::now() - start, test_time::Scaled(milliseconds(7000)));
}

// A communicator's set-up Sets and Adds by its deadline (SetBy, AddBy): one whose deadline has
// passed still gets a moment, which a server that is up answers in, and with the server gone
// one ends by its deadline, not after the store's 5 s timeout.
TEST(TcpStoreTest, ASetOrAnAddByADeadlineEndsByItAndAServerThatIsUpStillAnswers) {
  auto server = Server();
  cluster::TcpStoreClient client("127.0.0.1", TcpStorePort(*server), kLong);
  try {
    client.SetBy("k", "v", Clock::now() - milliseconds(100));
    EXPECT_EQ(client.AddBy("n", 2, Clock::now() - milliseconds(100)), 2);
    EXPECT_EQ(server->Get("k", kLong), "v");
  } catch (const Error& e) {
    ADD_FAILURE() << "a server that is up did not answer a call past its deadline: " << e.what();
  }
  server.reset();
  for (int call = 0; call < 2; ++call) {  // on the pooled connection, then on a new one
    const auto start = Clock::now();
    try {
      client.AddBy("n", 1, start + milliseconds(300));
      ADD_FAILURE() << "a stopped server answered";
    } catch (const Error& e) {
      EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kPeerLost) << e.what();
    }
    EXPECT_LT(Clock::now() - start, test_time::Scaled(milliseconds(1500))) << "call " << call;
  }
}

// A server that stops and starts again on its port: the client's call that finds its connection
// gone raises kPeerLost, and the next call connects to the new server, however many connections
// the client had pooled (each of them led to the old server).
TEST(TcpStoreTest, AfterTheServerRestartsOnlyTheCallThatFoundItOutFails) {
  const uint16_t port = FreePort();
  auto server = CreateTcpStore("127.0.0.1", port, true, kLong, "the token");
  cluster::TcpStoreClient client("127.0.0.1", port, kLong, "the token");
  // Two pooled connections: a Set runs on a second one while a Get waits on the first.
  auto parked = std::async(std::launch::async, [&] { return client.Get("k", kLong); });
  std::this_thread::sleep_for(milliseconds(50));
  client.Set("k", "v");
  ASSERT_EQ(parked.get(), "v");
  server.reset();
  server = CreateTcpStore("127.0.0.1", port, true, kLong, "the token");
  try {
    client.Set("a", "1");
    ADD_FAILURE() << "a connection to the stopped server answered";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
  }
  try {
    client.Set("a", "2");
    EXPECT_EQ(client.Get("a", kLong), "2");
    EXPECT_EQ(server->Get("a", kLong), "2");
  } catch (const Error& e) {
    ADD_FAILURE() << "the call after the one that found the server gone: " << e.what();
  }
}

// A client whose connection is refused on reconnecting (the server that answers on its port now
// holds another token) raises kUnauthenticated; in a communicator's set-up naming the rank, as
// the store's other failures do.
TEST(TcpStoreTest, ARefusalOnReconnectingInTheSetUpNamesTheRank) {
  const uint16_t port = FreePort();
  auto server = CreateTcpStore("127.0.0.1", port, true, kLong, "the token");
  auto client = CreateTcpStore("127.0.0.1", port, false, kLong, "the token");
  server.reset();
  server = CreateTcpStore("127.0.0.1", port, true, kLong, "another token");
  // The pooled connection led to the stopped server: the call that finds it out fails.
  EXPECT_THROW(client->Set("a", "1"), Error);
  CommunicationOptions options;
  options.implementation = Implementation::kRing;
  options.timeout = milliseconds(1000);
  try {
    CreateCommunication(LoopbackSpec(1, 2, port), client, options);
    ADD_FAILURE() << "a set-up went on through a store that refused the client";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
    EXPECT_EQ(e.message().rfind("rank 1: TCP store at 127.0.0.1:" + std::to_string(port) +
                                    ": the server rejected this client's proof",
                                0),
              0u)
        << e.what();
  }
}

// A refusal of the store (the server's kInvalidArgument reply: here an Add on a key whose value
// is no number, the set-up's count of communicators, which the caller's own Set took) raised in
// a communicator's set-up names the rank, as the store's other failures there do, not only the
// server's words.
TEST(TcpStoreTest, ARefusalOfTheStoreInTheSetUpNamesTheRank) {
  auto server = Server();
  const uint16_t port = TcpStorePort(*server);
  auto client = CreateTcpStore("127.0.0.1", port, false, kLong);
  client->Set("collectives/generation/1", "not a number");  // the spec's job id, then its rank
  CommunicationOptions options;
  options.implementation = Implementation::kRing;
  options.timeout = milliseconds(1000);
  try {
    CreateCommunication(LoopbackSpec(1, 2, port), client, options);
    ADD_FAILURE() << "a set-up went on though the store refused its Add";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_EQ(e.message().rfind("rank 1: ", 0), 0u) << e.what();
    EXPECT_NE(e.message().find("Add on key 'collectives/generation/1', whose value is not a "
                               "decimal integer"),
              std::string::npos)
        << e.what();
  }
}

// A stranger who connects again and again to rank 0's store, which listens for as long as the
// job runs, gets a line in the log a second at most, as in the mesh's set-up, not one per
// closed connection.
TEST(TcpStoreTest, ConnectionsThatFailTheProofDoNotFloodTheLog) {
  auto server = CreateTcpStore("127.0.0.1", 0, true, kLong, "the token");
  const uint16_t port = TcpStorePort(*server);
  constexpr int kStrangers = 100;
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < kStrangers; ++i) {
    RawClient stranger(port);
    ASSERT_TRUE(stranger.connected());
    ASSERT_TRUE(stranger.ReadChallenge());
    EXPECT_FALSE(stranger.Prove("a wrong token"));
    // The server logs before it closes: once the close is seen, so is this stranger's line.
    EXPECT_TRUE(stranger.ClosedByPeerWithin(kLong));
  }
  const std::string logged = ::testing::internal::GetCapturedStderr();
  size_t lines = 0;
  for (size_t at = logged.find("failed the proof"); at != std::string::npos;
       at = logged.find("failed the proof", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1u) << logged;
  EXPECT_LE(lines, 10u) << lines << " lines for " << kStrangers << " strangers:\n"
                        << logged.substr(0, 1000);
}

// A refused enrolment (what the operator of a misconfigured rank must see) is logged even right
// after a stranger's line: the two are limited apart.
TEST(TcpStoreTest, ARefusedEnrolmentIsLoggedRightAfterAStrangersLine) {
  const uint16_t port = FreePort();
  auto server = CreateStoreFor(LoopbackSpec(0, 3, port), kLong);
  ::testing::internal::CaptureStderr();
  {
    RawClient stranger(port);
    ASSERT_TRUE(stranger.ReadChallenge());
    EXPECT_FALSE(stranger.Prove("a wrong token"));
    EXPECT_TRUE(stranger.ClosedByPeerWithin(kLong));
  }
  {
    RawClient raw(port);
    ASSERT_TRUE(raw.ReadChallenge());
    const auto request = cluster::auth::EncodeEnrolment(7);  // out of range: refused
    ASSERT_TRUE(raw.Send(request.data(), request.size()));
    EXPECT_TRUE(raw.ClosedByPeerWithin(kLong));
  }
  const std::string logged = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(logged.find("failed the proof"), std::string::npos) << logged;
  EXPECT_NE(logged.find("rank 7"), std::string::npos) << logged;
}

// A Get that has to connect again (its server went away) tries for as long as the Get may take,
// its wait and a short grace, not for the store's whole timeout, and says which Get it was.
TEST(TcpStoreTest, AGetThatMustReconnectTriesOnlyForItsOwnWait) {
  auto server = Server();
  const uint16_t port = TcpStorePort(*server);
  cluster::TcpStoreClient client("127.0.0.1", port, milliseconds(6000));
  client.Set("k", "v");
  server.reset();
  EXPECT_THROW(client.Set("k", "w"), Error);  // finds the connection gone
  const Clock::time_point start = Clock::now();
  try {
    client.Get("k", milliseconds(200));
    ADD_FAILURE() << "no server, yet the Get succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("Get of key 'k'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.message();
  }
  EXPECT_LT(Clock::now() - start, test_time::Scaled(milliseconds(4500)))
      << "the Get tried to connect for the store's 6 s timeout, not its own 200 ms";
}

TEST(CreateStoreForTest, SingleRankGetsAMemoryStore) {
  ClusterSpec spec;
  auto store = CreateStoreFor(spec, kLong);
  store->Set("a", "b");
  EXPECT_EQ(store->Get("a", kLong), "b");
  EXPECT_THROW(TcpStorePort(*store), Error);
}

TEST(CreateStoreForTest, RankZeroHostsOthersConnect) {
  ClusterSpec spec;
  spec.world_size = 3;
  spec.master_addr = "localhost";
  spec.master_port = FreePort();
  std::vector<std::future<std::string>> ranks;
  for (int rank = 1; rank < 3; ++rank) {
    ranks.push_back(std::async(std::launch::async, [spec, rank]() mutable {
      spec.rank = rank;
      auto store = CreateStoreFor(spec, kLong);  // may start before rank 0
      store->Set("rank/" + std::to_string(rank), "here");
      return store->Get("go", kLong);
    }));
  }
  spec.rank = 0;
  auto store = CreateStoreFor(spec, kLong);
  EXPECT_EQ(TcpStorePort(*store), spec.master_port);
  EXPECT_EQ(store->Get("rank/1", kLong), "here");
  EXPECT_EQ(store->Get("rank/2", kLong), "here");
  store->Set("go", "now");
  for (auto& rank : ranks) EXPECT_EQ(rank.get(), "now");
}

// 127.0.0.2 is a loopback address too (all of 127/8 is), but a listener bound to 127.0.0.1 does
// not answer there: it stands for another host's view of a store bound to a loopback address.
// A server that closes a connection after the client's proof but before its verdict (it made
// room for other connections, or stopped) has not rejected the client: the client connects
// again and proves the token there. (A wrong proof gets a verdict of 0 before the close; that
// one is a rejection.) A scripted server: the first connection is closed after the proof.
TEST(TcpStoreClientTest, ACloseBeforeTheVerdictIsRetriedNotARejection) {
  const std::string token = "a shared secret";
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const auto exchange = [](int fd, void* data, size_t bytes, bool write_it) {
    auto* p = static_cast<uint8_t*>(data);
    while (bytes > 0) {
      const ssize_t n = write_it ? write(fd, p, bytes) : read(fd, p, bytes);
      if (n <= 0) return false;
      p += n;
      bytes -= size_t(n);
    }
    return true;
  };
  std::atomic<int> proofs{0};
  std::thread server([&] {
    for (int attempt = 0; attempt < 2; ++attempt) {
      const int fd = accept(listener, nullptr, nullptr);
      if (fd < 0) return;
      const core::Nonce nonce = core::RandomNonce();
      auto challenge = cluster::auth::EncodeChallenge(nonce);
      cluster::auth::Response response{};
      if (!exchange(fd, challenge.data(), challenge.size(), true) ||
          !exchange(fd, response.data(), response.size(), false)) {
        close(fd);
        return;
      }
      ++proofs;
      if (attempt == 1) {
        core::Nonce client_nonce;
        std::memcpy(client_nonce.data(), response.data(), client_nonce.size());
        std::array<uint8_t, cluster::auth::kVerdictBytes> verdict{};
        verdict[0] = 1;
        const core::Proof mine =
            cluster::auth::StoreProof(token, client_nonce, nonce, cluster::auth::kServerRole);
        std::memcpy(verdict.data() + 1, mine.data(), mine.size());
        exchange(fd, verdict.data(), verdict.size(), true);
        uint8_t rest = 0;
        while (read(fd, &rest, 1) > 0) {
        }  // until the client closes
      }
      close(fd);
    }
  });
  try {
    cluster::TcpStoreClient client("127.0.0.1", ntohs(address.sin_port), std::chrono::seconds(20),
                                   token);
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
    shutdown(listener, SHUT_RDWR);
  }
  server.join();
  close(listener);
  EXPECT_EQ(proofs.load(), 2);
}

// A reply is checked against the request it answers: a Set's "ok" carrying a value, a Get's
// carrying an argument or a timeout answering an Add is a server out of step with the client
// (the client drops the connection: kPeerLost), not an answer. The fuzz seeds
// tests/fuzz/corpus/store_client/token_*_with_* drive the same rules through a real client.
TEST(TcpStoreWireTest, AReplyCarriesOnlyWhatItsRequestAnswers) {
  using cluster::wire::Op;
  using cluster::wire::Status;
  struct Case {
    Status status;
    uint32_t value_bytes;
    int64_t arg;
    bool set_ok, get_ok, add_ok;  // well formed as the answer to a Set, a Get, an Add
  };
  const Case cases[] = {
      {Status::kOk, 0, 0, true, true, true},
      {Status::kOk, 5, 0, false, true, false},
      {Status::kOk, 0, 42, false, false, true},
      {Status::kOk, 0, -3, false, false, true},
      {Status::kOk, 5, 42, false, false, false},
      {Status::kTimeout, 0, 0, false, true, false},
      {Status::kTimeout, 1, 0, false, false, false},
      {Status::kTimeout, 0, 1, false, false, false},
      {Status::kInvalidArgument, 9, 0, true, true, true},
      {Status::kInvalidArgument, 9, 1, false, false, false},
  };
  for (const Case& c : cases) {
    cluster::wire::Header reply;
    reply.code = static_cast<uint8_t>(c.status);
    reply.value_bytes = c.value_bytes;
    reply.arg = c.arg;
    const std::string label = "status " + std::to_string(reply.code) + ", value " +
                              std::to_string(c.value_bytes) + " B, arg " + std::to_string(c.arg);
    EXPECT_EQ(cluster::wire::CheckReply(reply, Op::kSet).empty(), c.set_ok) << label;
    EXPECT_EQ(cluster::wire::CheckReply(reply, Op::kGet).empty(), c.get_ok) << label;
    EXPECT_EQ(cluster::wire::CheckReply(reply, Op::kAdd).empty(), c.add_ok) << label;
  }
  cluster::wire::Header reply;
  reply.reserved[1] = 1;
  EXPECT_EQ(cluster::wire::CheckReply(reply, Op::kGet), "reserved header bytes are not zero");
  reply = cluster::wire::Header{};
  reply.code = 3;
  EXPECT_EQ(cluster::wire::CheckReply(reply, Op::kGet), "unknown reply status 3");
  reply = cluster::wire::Header{};
  reply.key_bytes = 1;
  EXPECT_EQ(cluster::wire::CheckReply(reply, Op::kSet), "a reply carries a key");
  reply = cluster::wire::Header{};
  reply.value_bytes = 4;
  EXPECT_EQ(cluster::wire::CheckReply(reply, Op::kSet), "status 'ok' with a value answering a Set");
}

TEST(CreateStoreForTest, TheStoreListensWhereTheSpecSays) {
  const uint16_t port = FreePort();
  ClusterSpec host = LoopbackSpec(0, 2, port);
  host.store_listen_address = "0.0.0.0";
  auto server = CreateStoreFor(host, kLong);
  ClusterSpec other = LoopbackSpec(1, 2, port);
  other.master_addr = "127.0.0.2";
  auto client = CreateStoreFor(other, kLong);
  client->Set("k", "v");
  EXPECT_EQ(server->Get("k", kLong), "v");
}

TEST(CreateStoreForTest, AStoreAtMasterAddrIsNotReachedAtAnotherAddress) {
  const uint16_t port = FreePort();
  auto server = CreateStoreFor(LoopbackSpec(0, 2, port), kLong);
  ClusterSpec other = LoopbackSpec(1, 2, port);
  other.master_addr = "127.0.0.2";
  try {
    CreateStoreFor(other, milliseconds(300));
    ADD_FAILURE() << "reached a store that listens at 127.0.0.1 only through 127.0.0.2";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("127.0.0.2"), std::string::npos) << e.what();
  }
}

// Debian maps a host's own name to 127.0.1.1: a store at that name is out of other hosts' reach,
// and rank 0 says so (once, at creation) with what to set.
TEST(CreateStoreForTest, RankZeroSaysWhenMasterAddrIsALoopbackName) {
  const std::string name = core::HostName();
  const std::string loopback = cluster::LoopbackOnlyAddresses(name);
  if (loopback.empty()) {
    GTEST_SKIP() << "this host's name '" << name << "' does not resolve to loopback only here";
  }
  ClusterSpec spec = LoopbackSpec(0, 2, FreePort());
  spec.master_addr = name;
  ::testing::internal::CaptureStderr();
  auto warned = CreateStoreFor(spec, kLong);
  std::string logged = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(logged.find("rank 0: the store binds to '" + name + "', which is " + loopback +
                        " here, a loopback address: ranks on other hosts cannot reach it"),
            std::string::npos)
      << logged;
  EXPECT_NE(logged.find("COLLECTIVES_STORE_LISTEN_ADDRESS"), std::string::npos) << logged;

  // An address (even a loopback one), or a listen address of its own: nothing to say.
  spec.master_addr = "127.0.0.1";
  spec.master_port = FreePort();
  ::testing::internal::CaptureStderr();
  auto literal = CreateStoreFor(spec, kLong);
  spec.master_addr = name;
  spec.master_port = FreePort();
  spec.store_listen_address = "127.0.0.1";
  auto listening = CreateStoreFor(spec, kLong);
  logged = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(logged, "");
}

TEST(CreateStoreForTest, TheTokenComesFromTheSpecOrTheEnvironment) {
  // A server that holds the job's secret: a client that proves it got it from the spec, or
  // from COLLECTIVES_JOB_TOKEN, rather than enrolling.
  const uint16_t port = FreePort();
  auto server = CreateTcpStore("127.0.0.1", port, true, kLong, "the job's secret");
  ClusterSpec spec = LoopbackSpec(1, 2, port);
  spec.job_token = "the job's secret";
  EXPECT_NO_THROW(CreateStoreFor(spec, kLong));
  spec.job_token.clear();
  {
    ScopedEnv token("COLLECTIVES_JOB_TOKEN", "the job's secret");
    EXPECT_NO_THROW(CreateStoreFor(spec, kLong));
  }
  ScopedEnv unset("COLLECTIVES_JOB_TOKEN", nullptr);
  EXPECT_THROW(CreateStoreFor(spec, kLong), Error);  // enrols; this server has a token
}

TEST(CreateStoreForTest, InvalidSpecIsRejected) {
  ClusterSpec spec;
  spec.world_size = 2;  // no port
  EXPECT_THROW(CreateStoreFor(spec, kLong), Error);
}

// Rank 0's store at a master_addr given by name, whose lookup never answers (a name server that
// is down or slow), ends by the store's timeout with kTimeout naming the name: neither the
// check that the name is not loopback only nor the server's own lookup blocks for the
// resolver's 30 s.
TEST(CreateStoreForTest, AMasterAddrThatDoesNotResolveIsBoundedByTheTimeout) {
  ExpectEndedOnTime(WithANameServerThatDoesNotAnswer([] {
    ClusterSpec spec = LoopbackSpec(0, 2, FreePort());
    spec.master_addr = "store.collectives-test.example";
    return TimesOutSaying(
        [&] { CreateStoreFor(spec, milliseconds(1000)); },
        "TCP store server at store.collectives-test.example:" + std::to_string(spec.master_port) +
            ": the lookup of 'store.collectives-test.example' has not "
            "answered within 1000 ms");
  }));
}

// Likewise a client: its lookup of the server's name ends by its timeout, not the resolver's
// 30 s.
TEST(CreateStoreForTest, AClientsMasterAddrThatDoesNotResolveIsBoundedByTheTimeout) {
  ExpectEndedOnTime(WithANameServerThatDoesNotAnswer([] {
    ClusterSpec spec = LoopbackSpec(1, 2, 1);
    spec.master_addr = "store.collectives-test.example";
    return TimesOutSaying([&] { CreateStoreFor(spec, milliseconds(1000)); },
                          "TCP store at store.collectives-test.example:1: could not connect within "
                          "1000 ms (last error: the lookup of 'store.collectives-test.example' "
                          "has not answered)");
  }));
}

// A server's name that resolves to two addresses, the first of which drops connection requests
// (a host that is down, a firewall) while the second serves: the client goes on to the second
// rather than spending its whole timeout on the first. Run in a child process whose /etc/hosts
// (a mount namespace of its own) maps a name to 127.0.0.1, where a listener whose backlog one
// connection fills drops every later SYN, then to 127.0.0.2, where the store listens.
TEST(TcpStoreClientTest, AnAddressThatDropsConnectionsDoesNotHideTheNext) {
  const std::string name = "store.collectives-test.example";
  const int status =
      InAMountNamespace("/etc/hosts", "127.0.0.1 " + name + "\n127.0.0.2 " + name + "\n", [&name] {
        // As the client asks (asio's flags), 127.0.0.1 must come first: getaddrinfo sorts.
        addrinfo hints{};
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_ADDRCONFIG;
        addrinfo* list = nullptr;
        if (getaddrinfo(name.c_str(), "1", &hints, &list) != 0) return 78;
        const auto first = reinterpret_cast<const sockaddr_in*>(list->ai_addr);
        const bool in_order = list->ai_family == AF_INET && list->ai_next != nullptr &&
                              ntohl(first->sin_addr.s_addr) == INADDR_LOOPBACK;
        freeaddrinfo(list);
        if (!in_order) return 78;
        // The store's port at 127.0.0.1 may be another test's: try other ports a few times.
        std::unique_ptr<cluster::TcpStoreServer> listening;
        for (int attempt = 0; attempt < 20 && !listening; ++attempt) {
          auto candidate = std::make_unique<cluster::TcpStoreServer>("127.0.0.2", 0);
          sockaddr_in address{};
          address.sin_family = AF_INET;
          address.sin_port = htons(candidate->port());
          address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          const auto to = reinterpret_cast<sockaddr*>(&address);
          const int full = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
          const int filler = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
          if (bind(full, to, sizeof(address)) == 0 && listen(full, 0) == 0 &&
              connect(filler, to, sizeof(address)) == 0) {
            listening = std::move(candidate);  // `full` and `filler` stay open until _exit
          } else {
            close(full);
            close(filler);
          }
        }
        if (!listening) return 79;
        cluster::TcpStoreServer& server = *listening;
        const auto start = Clock::now();
        try {
          auto client =
              CreateTcpStore(name, server.port(), /*is_server=*/false, milliseconds(3000));
          client->Set("k", "v");
          return server.Get("k", kLong) == "v" ? 0 : 1;
        } catch (const Error& e) {
          std::fprintf(stderr, "after %lld ms: %s\n",
                       static_cast<long long>(
                           std::chrono::duration_cast<milliseconds>(Clock::now() - start).count()),
                       e.what());
          return 1;
        }
      });
  if (status == 77) GTEST_SKIP() << "cannot mount an /etc/hosts in a mount namespace (needs root)";
  if (status == 78) GTEST_SKIP() << "the private /etc/hosts does not give 127.0.0.1 first";
  if (status == 79) GTEST_SKIP() << "cannot make a listener at 127.0.0.1 that drops SYNs";
  EXPECT_EQ(status, 0) << "the client did not reach the store at the name's second address";
}

}  // namespace
}  // namespace collectives
