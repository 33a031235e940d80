// TCP-only behaviour: mesh set-up (strangers on the port, wrong token, job id or world size, a
// listener that closes before answering, a rank that never shows up), connections on demand
// (made at first use; a peer that is gone or never answers named), an abort frame that names
// a rank outside the world, LocalAddressToward, and measurements (8-byte ping-pong, 4 MiB
// stream) between threads and between two processes.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <asio.hpp>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <thread>

#include "collectives/communication.h"
#include "src/cluster/store_common.h"
#include "src/transport/frame.h"
#include "src/transport/handshake.h"
#include "src/transport/socket_buffers.h"
#include "tests/child_process.h"
#include "tests/time_scale.h"
#include "tests/transport/fabric_test_util.h"
#include "tests/transport/piece_relay.h"

namespace collectives::transport {
namespace {

using namespace std::chrono_literals;
using asio::ip::tcp;
using collectives::testing::EnterAPrivateMountNamespace;
using collectives::testing::ExpectEndedOnTime;
using collectives::testing::TimesOutSaying;
using collectives::testing::WithANameServerThatDoesNotAnswer;
using testing::ConnectTcpGroup;
using testing::Pattern;
using testing::RunRanks;
using testing::Tag;

TcpFabricOptions Options(std::chrono::milliseconds timeout = 20'000ms) {
  TcpFabricOptions options;
  options.timeout = timeout;
  options.token = "s3cret";
  options.job_id = "tcp-test";
  options.key_prefix = "tcp-test";
  return options;
}

tcp::endpoint ParseEndpoint(const std::string& text) {
  const size_t colon = text.rfind(':');
  return tcp::endpoint(asio::ip::make_address(text.substr(0, colon)),
                       static_cast<uint16_t>(std::stoi(text.substr(colon + 1))));
}

TEST(LocalAddressTowardTest, LoopbackAndUnknownNames) {
  const auto deadline = Clock::now() + 20s;
  EXPECT_EQ(LocalAddressToward("127.0.0.1", deadline).value_or("(no answer)"), "127.0.0.1");
  EXPECT_EQ(LocalAddressToward("localhost", deadline).value_or("(no answer)"), "localhost");
  EXPECT_EQ(LocalAddressToward("no-such-host.invalid", deadline).value_or("(no answer)"),
            "127.0.0.1");
}

// Connects sockets to rank 2's listener before the mesh forms: garbage, a huge job id, a
// well-formed hello with a wrong proof, and one that never speaks. The mesh forms regardless.
TEST(TcpSetupTest, StrangersDoNotStopTheMesh) {
  constexpr int kSize = 3;
  auto store = CreateMemoryStore();
  asio::io_context io;
  std::vector<tcp::socket> strangers;
  // Set when the stranger thread is done (its forged proof judged), however it ends.
  std::promise<void> strangers_done;
  std::future<void> strangers_done_future = strangers_done.get_future();
  std::thread stranger_thread([&] {
    struct SignalOnExit {
      std::promise<void>& done;
      ~SignalOnExit() { done.set_value(); }
    } signal_on_exit{strangers_done};
    const tcp::endpoint target = ParseEndpoint(store->Get("tcp-test/addr/2", 10'000ms));
    asio::error_code ec;
    for (int i = 0; i < 4; ++i) {
      strangers.emplace_back(io);
      strangers.back().connect(target, ec);
      ASSERT_FALSE(ec) << ec.message();
    }
    std::string junk(64, '\x5A');
    asio::write(strangers[0], asio::buffer(junk), ec);

    Hello hello;
    hello.version = kWireVersion;
    hello.rank = 0;
    hello.world_size = kSize;
    hello.nonce = RandomNonce();
    hello.job_id = "tcp-test";
    std::vector<uint8_t> huge = EncodeHello(hello);
    huge[6] = 0xFF;
    huge[7] = 0xFF;
    asio::write(strangers[1], asio::buffer(huge), ec);

    asio::write(strangers[2], asio::buffer(EncodeHello(hello)), ec);
    std::vector<uint8_t> reply(kHelloFixedBytes);
    asio::read(strangers[2], asio::buffer(reply), ec);
    size_t job_id_bytes = 0;
    auto server_hello = DecodeHelloFixed(reply.data(), &job_id_bytes, nullptr);
    ASSERT_TRUE(server_hello);
    std::vector<uint8_t> job_id(job_id_bytes);
    asio::read(strangers[2], asio::buffer(job_id), ec);
    Proof forged{};  // does not know the token
    asio::write(strangers[2], asio::buffer(forged), ec);
    std::array<uint8_t, 1 + kProofBytes> verdict{};
    asio::read(strangers[2], asio::buffer(verdict), ec);
    EXPECT_EQ(verdict[0], 0) << "the forged proof was accepted";
    // strangers[3] stays silent.
  });
  auto group = ConnectTcpGroup(kSize, *store, [&](int rank) {
    if (rank == 0) {  // rank 0 connects last, once the strangers had their say
      EXPECT_EQ(strangers_done_future.wait_for(10s), std::future_status::ready)
          << "the strangers had not finished after 10 s";
    }
    return Options();
  });
  stranger_thread.join();
  for (int rank = 0; rank < kSize; ++rank) {
    ASSERT_FALSE(group.errors[rank]) << group.errors[rank]->what();
  }
  const auto errors = RunRanks(kSize, [&](int rank) {
    Fabric& fabric = *group.fabrics[rank];
    const int right = (rank + 1) % kSize;
    const int left = (rank + kSize - 1) % kSize;
    const auto out = Pattern(rank, right, 0, 1000);
    std::vector<uint8_t> in(1000);
    fabric.connection(right).PostSend(Tag(0, 1000), out.data(), out.size());
    fabric.connection(left).WaitRecv(
        fabric.connection(left).PostRecv(Tag(0, 1000), in.data(), in.size()));
    fabric.connection(right).WaitSend(1);
    EXPECT_TRUE(in == Pattern(left, rank, 0, 1000));
  });
  for (const auto& error : errors) EXPECT_FALSE(error) << error->what();
}

TEST(TcpSetupTest, WrongTokenIsUnauthenticated) {
  auto store = CreateMemoryStore();
  auto group = ConnectTcpGroup(2, *store, [](int rank) {
    // Rank 1's deadline must cover rank 0's whole handshake (rank 0 returns once refused).
    TcpFabricOptions options = Options(rank == 0 ? 30'000ms : 5'000ms);
    if (rank == 0) options.token = "wrong";
    return options;
  });
  ASSERT_TRUE(group.errors[0]);
  EXPECT_EQ(group.errors[0]->code(), ErrorCode::kUnauthenticated);
  EXPECT_NE(group.errors[0]->message().find("rank 0: handshake with rank 1 at 127.0.0.1:"),
            std::string::npos)
      << group.errors[0]->message();
  EXPECT_NE(group.errors[0]->message().find("rejected this rank's proof of the job token"),
            std::string::npos)
      << group.errors[0]->message();
  // The server never admitted the impostor; it waited for the real rank 0 until its deadline.
  ASSERT_TRUE(group.errors[1]);
  EXPECT_EQ(group.errors[1]->code(), ErrorCode::kTimeout);
  EXPECT_NE(group.errors[1]->message().find("still missing rank 0"), std::string::npos)
      << group.errors[1]->message();
}

TEST(TcpSetupTest, WrongJobIdIsUnauthenticated) {
  auto store = CreateMemoryStore();
  auto group = ConnectTcpGroup(2, *store, [](int rank) {
    TcpFabricOptions options = Options(rank == 0 ? 30'000ms : 5'000ms);  // as above
    if (rank == 0) options.job_id = "another-job";
    return options;
  });
  ASSERT_TRUE(group.errors[0]);
  EXPECT_EQ(group.errors[0]->code(), ErrorCode::kUnauthenticated) << group.errors[0]->message();
  EXPECT_NE(group.errors[0]->message().find("rank 1 refused this rank's hello: it is in another "
                                            "job than this rank's job id 'another-job'"),
            std::string::npos)
      << group.errors[0]->message();
  ASSERT_TRUE(group.errors[1]);
  EXPECT_EQ(group.errors[1]->code(), ErrorCode::kTimeout);
}

// Ranks that disagree on the world size: the connecting rank is refused and told the other's.
TEST(TcpSetupTest, WrongWorldSizeIsUnauthenticatedAndNamed) {
  auto store = CreateMemoryStore();
  // Rank 1 of 3 waits for rank 2's address before it accepts: one where nobody listens.
  store->Set("tcp-test/addr/2", "127.0.0.1:1");
  std::optional<Error> errors[2];
  std::thread rank1([&] {
    try {
      ConnectTcpFabric(1, 3, *store, Options(5'000ms));  // covers rank 0's refused handshake
    } catch (const Error& error) {
      errors[1] = error;
    }
  });
  try {
    ConnectTcpFabric(0, 2, *store, Options(30'000ms));  // returns once refused
  } catch (const Error& error) {
    errors[0] = error;
  }
  rank1.join();
  ASSERT_TRUE(errors[0]);
  EXPECT_EQ(errors[0]->code(), ErrorCode::kUnauthenticated) << errors[0]->message();
  EXPECT_NE(errors[0]->message().find("rank 1 refused this rank's hello: its world size is 3, "
                                      "this rank's is 2"),
            std::string::npos)
      << errors[0]->message();
  ASSERT_TRUE(errors[1]);
  EXPECT_EQ(errors[1]->code(), ErrorCode::kTimeout) << errors[1]->message();
}

// A listener that closes a connection before answering (its rank stopped, gave up its set-up,
// or made room for others) does not end the connecting rank's set-up: it connects again, and
// the mesh forms. Here the relay in front of rank 1 closes the first connection at once.
TEST(TcpSetupTest, AListenerThatClosesBeforeAnsweringIsConnectedToAgain) {
  auto store =
      std::make_shared<collectives::testing::RelayingStore>(CreateMemoryStore(), /*seed=*/3,
                                                            /*close_first=*/1);
  auto group = ConnectTcpGroup(2, *store, [](int) { return Options(); });
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_FALSE(group.errors[rank]) << group.errors[rank]->what();
  }
  const auto errors = RunRanks(2, [&](int rank) {
    Connection& peer = group.fabrics[rank]->connection(1 - rank);
    const auto out = Pattern(rank, 1 - rank, 0, 100);
    std::vector<uint8_t> in(100);
    peer.PostSend(Tag(0, 100), out.data(), out.size());
    peer.WaitRecv(peer.PostRecv(Tag(0, 100), in.data(), in.size()));
    peer.WaitSend(1);
    EXPECT_TRUE(in == Pattern(1 - rank, rank, 0, 100));
  });
  for (const auto& error : errors) EXPECT_FALSE(error) << error->what();
}

// A listener that only ever closes: the connecting rank retries until its deadline and then
// says what it saw, as a timeout rather than a refusal.
TEST(TcpSetupTest, AListenerThatAlwaysClosesIsATimeoutNamingTheClose) {
  auto store =
      std::make_shared<collectives::testing::RelayingStore>(CreateMemoryStore(), /*seed=*/4,
                                                            /*close_first=*/1 << 30);
  store->Set("tcp-test/addr/1", "127.0.0.1:1");  // rank 1 never starts; the relay closes
  std::optional<Error> error;
  try {
    ConnectTcpFabric(0, 2, *store, Options(1'500ms));
  } catch (const Error& e) {
    error = e;
  }
  ASSERT_TRUE(error);
  EXPECT_EQ(error->code(), ErrorCode::kTimeout) << error->message();
  EXPECT_NE(error->message().find("rank 1 closed the connection before answering"),
            std::string::npos)
      << error->message();
  EXPECT_EQ(error->message().find("token"), std::string::npos) << error->message();
}

// Strangers that crowd the listener make it cancel its oldest handshakes, but not one whose client
// has proved the token: that client (here rank 0, played by hand, with its verdict held back) has
// its side done once it sends its verdict, and would hold a connection that rank 1 had closed.
// Rank 1's set-up must admit it after the crowd has come.
TEST(TcpSetupTest, ARankThatProvedTheTokenIsNotEvictedForStrangers) {
  auto store = CreateMemoryStore();
  std::optional<Error> error;
  std::thread rank1([&] {
    try {
      ConnectTcpFabric(1, 2, *store, Options(3'000ms));
    } catch (const Error& e) {
      error = e;
    }
  });
  asio::io_context io;
  const tcp::endpoint target = ParseEndpoint(store->Get("tcp-test/addr/1", 10'000ms));
  tcp::socket rank0(io);
  rank0.connect(target);
  Hello hello;
  hello.version = kWireVersion;
  hello.rank = 0;
  hello.world_size = 2;
  hello.nonce = RandomNonce();
  hello.job_id = "tcp-test";
  asio::write(rank0, asio::buffer(EncodeHello(hello)));
  std::vector<uint8_t> reply(kHelloFixedBytes);
  asio::read(rank0, asio::buffer(reply));
  size_t job_id_bytes = 0;
  auto server_hello = DecodeHelloFixed(reply.data(), &job_id_bytes, nullptr);
  ASSERT_TRUE(server_hello);
  std::vector<uint8_t> job_id(job_id_bytes);
  asio::read(rank0, asio::buffer(job_id));
  const Proof proof = ComputeProof("s3cret", "tcp-test", 0, 1, hello.nonce, server_hello->nonce,
                                   HandshakeRole::kClient);
  asio::write(rank0, asio::buffer(proof));
  std::array<uint8_t, 1 + kProofBytes> verdict{};
  asio::read(rank0, asio::buffer(verdict));
  ASSERT_EQ(verdict[0], 1);
  // More silent strangers than rank 1 keeps handshakes for (2 per lower rank and 16), then one
  // that sends junk: rank 1 accepts in order, so once the junk is refused, every stranger was
  // accepted (and the oldest handshakes evicted).
  std::vector<tcp::socket> strangers;
  for (int i = 0; i < 24; ++i) {
    strangers.emplace_back(io);
    strangers.back().connect(target);
  }
  tcp::socket probe(io);
  probe.connect(target);
  asio::write(probe, asio::buffer(std::string(kHelloFixedBytes, 'x')));
  asio::error_code ec;
  std::array<uint8_t, 1> byte{};
  asio::read(probe, asio::buffer(byte), ec);
  EXPECT_EQ(ec, asio::error::eof) << ec.message();
  const uint8_t accepted = 1;
  asio::write(rank0, asio::buffer(&accepted, 1), ec);  // fails where rank 1 evicted rank 0
  rank1.join();
  EXPECT_FALSE(error) << error->what();
}

// A stranger that hammers the listener is refused every time but logged at most once a second:
// 50 refusals within a set-up make a line or two, and the set-up's end says how many it left out.
TEST(TcpSetupTest, RefusedConnectionsAreLoggedAtMostOnceASecond) {
  constexpr int kStrangers = 50;
  auto store = CreateMemoryStore();
  ::testing::internal::CaptureStderr();
  std::optional<Error> errors[2];
  std::thread rank1([&] {
    try {
      ConnectTcpFabric(1, 2, *store, Options(10'000ms));
    } catch (const Error& e) {
      errors[1] = e;
    }
  });
  asio::io_context io;
  const tcp::endpoint target = ParseEndpoint(store->Get("tcp-test/addr/1", 10'000ms));
  for (int i = 0; i < kStrangers; ++i) {
    tcp::socket stranger(io);
    asio::error_code ec;
    stranger.connect(target, ec);
    asio::write(stranger, asio::buffer(std::string(kHelloFixedBytes, 'x')), ec);
    std::array<uint8_t, 1> byte{};
    asio::read(stranger, asio::buffer(byte), ec);  // until rank 1 closes it
  }
  try {
    ConnectTcpFabric(0, 2, *store, Options(10'000ms));
  } catch (const Error& e) {
    errors[0] = e;
  }
  rank1.join();
  const std::string log = ::testing::internal::GetCapturedStderr();
  for (const auto& error : errors) EXPECT_FALSE(error) << error->what();
  int lines = 0;
  for (size_t at = log.find("rank 1 refused a connection from"); at != std::string::npos;
       at = log.find("rank 1 refused a connection from", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1) << log;
  EXPECT_LE(lines, 5) << log;
  EXPECT_NE(log.find("rank 1 refused " + std::to_string(kStrangers) + " connections in its set-up"),
            std::string::npos)
      << log;
}

// Plays rank 0 of a 2-rank mesh: completes the handshake with the real rank 1, which then waits
// for #0 all_reduce(f32, sum, count=8) from it, and sends `stream` instead. Returns what rank 1's
// wait threw.
std::optional<Error> SendToAWaitingRank1(const std::string& stream) {
  auto store = CreateMemoryStore();
  std::optional<Error> error;
  std::promise<void> received;
  std::thread rank1([&] {
    try {
      auto fabric = ConnectTcpFabric(1, 2, *store, Options());
      fabric->SetDeadline(Clock::now() + test_time::Scaled(20s));
      std::vector<uint8_t> in(8);
      Connection& peer = fabric->connection(0);
      peer.WaitRecv(peer.PostRecv(Tag(0, 8), in.data(), in.size()));
    } catch (const Error& e) {
      error = e;
    }
    received.set_value();
  });
  asio::io_context io;
  tcp::socket socket(io);
  socket.connect(ParseEndpoint(store->Get("tcp-test/addr/1", 20'000ms)));
  HandshakeConfig config;
  config.job_id = "tcp-test";
  config.token = "s3cret";
  config.rank = 0;
  config.world_size = 2;
  std::optional<HandshakeResult> result;
  tcp::socket connected(io);
  HandshakeSession::StartClient(std::move(socket), config, 1, Clock::now() + 20s,
                                [&](const HandshakeResult& done, tcp::socket s) {
                                  result = done;
                                  connected = std::move(s);
                                });
  const auto until = Clock::now() + 20s;
  while (!result && Clock::now() < until) io.run_one_for(100ms);
  if (!result || !result->ok) {
    connected.close();
    rank1.join();  // it times out
    ADD_FAILURE() << "handshake: " << (result ? result->why : "no result");
    return error;
  }
  asio::write(connected, asio::buffer(stream));
  // Keep the connection open until rank 1 has read the stream: no EOF to race it.
  received.get_future().wait();
  rank1.join();
  return error;
}

// An abort frame whose culprit is not a rank of the world is a faulty peer's malformed frame,
// reported as such (naming the peer that sent it), never as "rank 12345 aborted the job".
TEST(TcpAbortFrameTest, ACulpritOutsideTheWorldIsAMalformedFrame) {
  AbortPayload payload;
  payload.code = ErrorCode::kAborted;
  payload.culprit = 12345;
  payload.message = "rank 12345: made up";
  const std::string body = EncodeAbortPayload(payload);
  FrameHeader header;
  header.kind = FrameKind::kAbort;
  header.bytes = body.size();
  const EncodedHeader head = EncodeHeader(header);
  const auto error = SendToAWaitingRank1(std::string(head.begin(), head.end()) + body);
  ASSERT_TRUE(error) << "rank 1 received a frame from an abort frame";
  EXPECT_EQ(error->code(), ErrorCode::kSystem) << error->message();
  EXPECT_NE(error->message().find("malformed abort frame from rank 0"), std::string::npos)
      << error->message();
  EXPECT_NE(error->message().find("culprit rank 12345"), std::string::npos) << error->message();
  EXPECT_NE(error->message().find("while waiting for #0 all_reduce(f32, sum, count=8)"),
            std::string::npos)
      << error->message();
}

// Bytes that are not a frame header (another protocol, a corrupted stream): the error names the
// peer, what is wrong, and the call that was waiting for the frame, as every error does.
TEST(TcpFrameTest, AMalformedHeaderNamesThePeerAndTheWaitingCall) {
  const auto error = SendToAWaitingRank1(std::string(kFrameHeaderBytes, 'x'));
  ASSERT_TRUE(error) << "rank 1 received a frame from 40 bytes of 'x'";
  EXPECT_EQ(error->code(), ErrorCode::kSystem) << error->message();
  EXPECT_NE(error->message().find("rank 1: malformed frame from rank 0: bad magic 0x78787878"),
            std::string::npos)
      << error->message();
  EXPECT_NE(error->message().find("while waiting for #0 all_reduce(f32, sum, count=8)"),
            std::string::npos)
      << error->message();
}

// A rank that listens on every interface ("0.0.0.0") tells its peers its host name, which may
// resolve to more than one address, an IPv6 one first (a dual-stack host): the listener only
// takes IPv4, so the connecting rank must try the other addresses rather than only the first.
// Run in a child process whose /etc/hosts (a mount namespace of its own) maps this host's name
// to ::1, then 127.0.0.1; skipped where mount namespaces cannot be made (needs root).
TEST(TcpSetupTest, EveryAddressOfAPeersHostNameIsTried) {
  const std::string hosts = (std::filesystem::temp_directory_path() /
                             ("tcp_fabric_test_hosts_" + std::to_string(getpid())))
                                .string();
  const std::string name = asio::ip::host_name();
  std::ofstream(hosts) << "::1 " << name << "\n127.0.0.1 " << name << "\n";
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (!EnterAPrivateMountNamespace() ||
        mount(hosts.c_str(), "/etc/hosts", nullptr, MS_BIND, nullptr) != 0) {
      _exit(77);
    }
    {
      asio::io_context io;
      asio::error_code ec;
      const auto results = tcp::resolver(io).resolve(name, "1", ec);
      if (ec || results.size() < 2 || !results.begin()->endpoint().address().is_v6()) _exit(78);
    }
    auto store = CreateMemoryStore();
    auto group = ConnectTcpGroup(2, *store, [](int rank) {
      TcpFabricOptions options = Options(3'000ms);
      if (rank == 1) options.bind_host = "0.0.0.0";
      return options;
    });
    for (const auto& error : group.errors) {
      if (error) {
        std::fprintf(stderr, "%s\n", error->what());
        _exit(1);
      }
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  std::filesystem::remove(hosts);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "cannot mount an /etc/hosts in a mount namespace of its own (needs root)";
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 78) {
    GTEST_SKIP() << "the private /etc/hosts does not resolve '" << name << "' to ::1 first";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the mesh did not form (status " << status << "; the error is above)";
}

// A peer's host name whose lookup never answers (a name server that is down or slow) does not
// hold the set-up past its timeout: it ends on time with a timeout naming the host.
TEST(TcpSetupTest, AHostNameThatDoesNotResolveIsBoundedByTheTimeout) {
  ExpectEndedOnTime(WithANameServerThatDoesNotAnswer([] {
    auto store = CreateMemoryStore();
    store->Set("tcp-test/addr/1", "peer.collectives-test.example:1");
    return TimesOutSaying([&] { ConnectTcpFabric(0, 2, *store, Options(1'000ms)); },
                          "the lookup of host peer.collectives-test.example has not answered");
  }));
}

// Likewise a bind host given by name, looked up before the listener binds: by the deadline, not
// the resolver's 30 s.
TEST(TcpSetupTest, ABindHostThatDoesNotResolveIsBoundedByTheTimeout) {
  ExpectEndedOnTime(WithANameServerThatDoesNotAnswer([] {
    auto store = CreateMemoryStore();
    TcpFabricOptions options = Options(1'000ms);
    options.bind_host = "self.collectives-test.example";
    return TimesOutSaying([&] { ConnectTcpFabric(1, 2, *store, options); },
                          "rank 1: timed out after 1000 ms setting up connections: the lookup of "
                          "bind host 'self.collectives-test.example' has not answered");
  }));
}

// LocalAddressToward gives up on a lookup at its deadline; a communicator's set-up, which asks
// it for the address toward master_addr, then raises kTimeout naming the rank and the name, by
// its own timeout, not the resolver's 30 s.
TEST(LocalAddressTowardTest, ALookupThatDoesNotAnswerEndsAtTheDeadline) {
  ExpectEndedOnTime(WithANameServerThatDoesNotAnswer([] {
    const auto start = Clock::now();
    if (LocalAddressToward("master.collectives-test.example", start + 500ms).has_value() ||
        Clock::now() - start > 2s) {
      std::fprintf(stderr, "LocalAddressToward answered, or not by its deadline\n");
      return 1;
    }
    ClusterSpec spec;
    spec.rank = 1;
    spec.world_size = 2;
    spec.master_addr = "master.collectives-test.example";
    spec.master_port = 1;  // unused: the store is given
    CommunicationOptions options;
    options.implementation = Implementation::kRing;
    options.timeout = 1'000ms;
    return TimesOutSaying([&] { CreateCommunication(spec, CreateMemoryStore(), options); },
                          "rank 1: timed out after 1000 ms setting up: the lookup of master_addr "
                          "'master.collectives-test.example'");
  }));
}

// A communicator whose ranks are listed by host name (TF_CONFIG) binds rank 1's listener to its
// listed name: the look-ups of that name (the check that it is not loopback only, then the
// bind) end by the set-up's deadline too, not the resolver's 30 s.
TEST(TcpSetupTest, AListedHostNameThatDoesNotResolveIsBoundedByTheTimeout) {
  ExpectEndedOnTime(WithANameServerThatDoesNotAnswer([] {
    ClusterSpec spec;
    spec.rank = 1;
    spec.world_size = 2;
    spec.addresses = {"chief.collectives-test.example:1", "worker.collectives-test.example:2"};
    spec.master_addr = "chief.collectives-test.example";
    spec.master_port = 1;  // unused: the store is given
    CommunicationOptions options;
    options.implementation = Implementation::kRing;
    options.timeout = 1'000ms;
    return TimesOutSaying([&] { CreateCommunication(spec, CreateMemoryStore(), options); },
                          "rank 1: timed out after 1000 ms setting up connections: the lookup of "
                          "bind host 'worker.collectives-test.example' has not answered");
  }));
}

TEST(TcpSetupTest, AMissingRankIsNamedInTheTimeout) {
  auto store = CreateMemoryStore();
  const auto start = Clock::now();
  // Ranks 0 and 1 of 3; rank 2 never starts.
  std::vector<std::optional<Error>> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        ConnectTcpFabric(rank, 3, *store, Options(800ms));
      } catch (const Error& error) {
        errors[rank] = error;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_LT(Clock::now() - start, test_time::Scaled(5s));
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_TRUE(errors[rank]);
    EXPECT_EQ(errors[rank]->code(), ErrorCode::kTimeout);
    EXPECT_NE(errors[rank]->message().find("rank(s) 2 never published"), std::string::npos)
        << errors[rank]->message();
  }
}

// A store that does not answer (its Get times out for its own reason, not because the key is
// missing) is named as such: rank 1 did publish, and saying it never did would send the user
// looking at the wrong process.
TEST(TcpSetupTest, AStoreThatDoesNotAnswerIsNotARankThatNeverPublished) {
  class SilentStore : public Store {
   public:
    explicit SilentStore(std::shared_ptr<Store> inner) : inner_(std::move(inner)) {}
    void Set(const std::string& key, const std::string& value) override { inner_->Set(key, value); }
    std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
      if (key.find("/addr/") == std::string::npos) return inner_->Get(key, timeout);
      throw cluster::StoreFailure(ErrorCode::kTimeout,
                                  "TCP store at h:1: Get of key '" + key +
                                      "' got no reply within 2000 ms of the end of its wait");
    }
    int64_t Add(const std::string& key, int64_t delta) override { return inner_->Add(key, delta); }

   private:
    std::shared_ptr<Store> inner_;
  };
  SilentStore store(CreateMemoryStore());
  store.Set("tcp-test/addr/1", "127.0.0.1:1");  // published: only the store fails to say so
  try {
    ConnectTcpFabric(0, 2, store, Options(2'000ms));
    ADD_FAILURE() << "a mesh formed without rank 1";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout) << error.what();
    EXPECT_EQ(error.message().find("never published"), std::string::npos) << error.message();
    EXPECT_NE(error.message().find("reading rank 1's address from the store: TCP store at h:1"),
              std::string::npos)
        << error.message();
  }
}

// A timeout of milliseconds::max() means "never": the mesh forms. The set-up must not add it to
// the clock as it is (a year at most): that would overflow into a deadline already past.
TEST(TcpSetupTest, ATimeoutOfMillisecondsMaxNeverTimesOut) {
  auto store = CreateMemoryStore();
  auto group =
      ConnectTcpGroup(2, *store, [](int) { return Options(std::chrono::milliseconds::max()); });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_FALSE(group.errors[rank]) << group.errors[rank]->what();
  }
}

// A store the user wrote says that a key is not set with Error(kTimeout) in words of its own
// (cluster.h asks no more): the rank that did not publish is named, as over our stores, not
// taken for a store that did not answer.
TEST(TcpSetupTest, AUserStoresTimeoutInItsOwnWordsNamesTheRankThatNeverPublished) {
  class OwnWords : public Store {
   public:
    void Set(const std::string& key, const std::string& value) override { inner_->Set(key, value); }
    std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
      try {
        return inner_->Get(key, timeout);
      } catch (const Error& error) {
        if (error.code() != ErrorCode::kTimeout) throw;
        throw Error(ErrorCode::kTimeout, "my store: no " + key + " yet");
      }
    }
    int64_t Add(const std::string& key, int64_t delta) override { return inner_->Add(key, delta); }

   private:
    std::shared_ptr<Store> inner_ = CreateMemoryStore();
  };
  OwnWords store;
  try {
    ConnectTcpFabric(0, 2, store, Options(300ms));
    ADD_FAILURE() << "a mesh formed without rank 1";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kTimeout) << error.what();
    EXPECT_NE(error.message().find("rank(s) 1 never published"), std::string::npos)
        << error.message();
  }
}

TEST(TcpSetupTest, SingleRankNeedsNoNetwork) {
  auto store = CreateMemoryStore();
  auto fabric = ConnectTcpFabric(0, 1, *store, Options());
  EXPECT_EQ(fabric->size(), 1);
  EXPECT_THROW(fabric->connection(0), Error);
}

TEST(TcpReceiveBufferTest, FollowsTheKernelCapTheCoresAndTheEnvironment) {
  constexpr size_t kMiB = size_t{1} << 20;
  // Unset: 4 MiB where the host has a core per rank and the kernel lets a process ask for it,
  // else the kernel's autotuning.
  EXPECT_EQ(ReceiveBufferBytes(nullptr, 4 * kMiB, true), kDefaultReceiveBuffer);
  EXPECT_EQ(ReceiveBufferBytes(nullptr, 64 * kMiB, true), kDefaultReceiveBuffer);
  EXPECT_EQ(ReceiveBufferBytes(nullptr, 64 * kMiB, false), 0u);  // oversubscribed
  EXPECT_EQ(ReceiveBufferBytes(nullptr, 212992, true), 0u);      // Debian's default rmem_max
  EXPECT_EQ(ReceiveBufferBytes(nullptr, 0, true), 0u);           // unknown
  // Set: what it says, 0 for autotuning, whatever the cap and the cores.
  EXPECT_EQ(ReceiveBufferBytes("0", 64 * kMiB, true), 0u);
  EXPECT_EQ(ReceiveBufferBytes("1048576", 0, false), kMiB);
  EXPECT_EQ(ReceiveBufferBytes("99999999999", 0, true), size_t{INT_MAX});
  // Not a byte count: ignored (with a line on stderr), as if unset.
  for (const char* bad : {"", "4M", "-1", " -5", " 12", "12 ", "x"}) {
    EXPECT_EQ(ReceiveBufferBytes(bad, 64 * kMiB, true), kDefaultReceiveBuffer)
        << "\"" << bad << "\"";
  }
}

// Connected TCP sockets of this process whose socket option `option` (SO_RCVBUF, SO_SNDBUF)
// reads `reported` bytes.
int ConnectedSocketsWithBuffer(int option, size_t reported) {
  int found = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::stoi(entry.path().filename().string());
    int type = 0;
    int listening = 0;
    int buffer = 0;
    socklen_t length = sizeof(int);
    sockaddr_storage peer{};
    socklen_t peer_length = sizeof(peer);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &length) != 0 || type != SOCK_STREAM) continue;
    length = sizeof(int);
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &length) != 0 || listening) continue;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length) != 0) continue;
    length = sizeof(int);
    if (getsockopt(fd, SOL_SOCKET, option, &buffer, &length) != 0) continue;
    if (static_cast<size_t>(buffer) == reported) ++found;
  }
  return found;
}

// The fabric's data connections ask for that buffer: both ends of a 2-rank mesh in this
// process show it (Linux reports twice the size asked for, its bookkeeping included).
TEST(TcpReceiveBufferTest, DataConnectionsAskForIt) {
  const size_t expected =
      ReceiveBufferBytes(std::getenv("COLLECTIVES_SOCKET_RCVBUF"), ReceiveBufferCap(),
                         std::thread::hardware_concurrency() >= 2);
  if (expected == 0) {
    GTEST_SKIP() << "net.core.rmem_max is " << ReceiveBufferCap()
                 << " (< 4 MiB), this host has one core, or COLLECTIVES_SOCKET_RCVBUF=0: "
                    "autotuning is left on";
  }
  auto store = CreateMemoryStore();
  auto group = ConnectTcpGroup(2, *store, [](int) { return Options(); });
  ASSERT_FALSE(group.errors[0]);
  ASSERT_FALSE(group.errors[1]);
  EXPECT_EQ(ConnectedSocketsWithBuffer(SO_RCVBUF, 2 * expected), 2)
      << "connected sockets with SO_RCVBUF " << 2 * expected;
}

// With more ranks than cores they leave it to autotuning (none asks for the 4 MiB).
TEST(TcpReceiveBufferTest, MoreRanksThanCoresKeepAutotuning) {
  const int ranks = static_cast<int>(std::thread::hardware_concurrency()) + 1;
  if (ranks > 9) GTEST_SKIP() << "a mesh of " << ranks << " ranks is too large for this test";
  if (std::getenv("COLLECTIVES_SOCKET_RCVBUF") != nullptr) {
    GTEST_SKIP() << "COLLECTIVES_SOCKET_RCVBUF is set";
  }
  auto store = CreateMemoryStore();
  auto group = ConnectTcpGroup(ranks, *store, [](int) { return Options(); });
  for (int rank = 0; rank < ranks; ++rank) ASSERT_FALSE(group.errors[rank]);
  EXPECT_EQ(ConnectedSocketsWithBuffer(SO_RCVBUF, 2 * kDefaultReceiveBuffer), 0);
}

TEST(TcpSendBufferTest, SmallForPeersOnThisHostAutotunedForOthersUnlessSet) {
  constexpr size_t kMiB = size_t{1} << 20;
  EXPECT_EQ(SendBufferBytes(nullptr).same_host, kDefaultLocalSendBuffer);
  EXPECT_EQ(SendBufferBytes(nullptr).other_host, 0u);
  // Set: what it says for every connection, 0 for autotuning.
  EXPECT_EQ(SendBufferBytes("0").same_host, 0u);
  EXPECT_EQ(SendBufferBytes("0").other_host, 0u);
  EXPECT_EQ(SendBufferBytes("1048576").same_host, kMiB);
  EXPECT_EQ(SendBufferBytes("1048576").other_host, kMiB);
  EXPECT_EQ(SendBufferBytes("99999999999").same_host, size_t{INT_MAX});
  // Not a byte count: ignored (with a line on stderr), as if unset.
  for (const char* bad : {"", "256K", "-1", " 12", "x"}) {
    EXPECT_EQ(SendBufferBytes(bad).same_host, kDefaultLocalSendBuffer) << "\"" << bad << "\"";
    EXPECT_EQ(SendBufferBytes(bad).other_host, 0u) << "\"" << bad << "\"";
  }
}

// A mesh over loopback is a mesh of peers on this host: both ends of a 2-rank mesh in this
// process ask for the local send buffer (Linux reports twice the size it was asked for, or
// twice net.core.wmem_max where that is lower).
TEST(TcpSendBufferTest, ConnectionsToThisHostAskForTheLocalBuffer) {
  if (std::getenv("COLLECTIVES_SOCKET_SNDBUF") != nullptr) {
    GTEST_SKIP() << "COLLECTIVES_SOCKET_SNDBUF is set";
  }
  const size_t wmem_max = SendBufferCap();
  if (wmem_max == 0) GTEST_SKIP() << "net.core.wmem_max cannot be read";
  const size_t expected = 2 * std::min(kDefaultLocalSendBuffer, wmem_max);
  auto store = CreateMemoryStore();
  auto group = ConnectTcpGroup(2, *store, [](int) { return Options(); });
  ASSERT_FALSE(group.errors[0]);
  ASSERT_FALSE(group.errors[1]);
  EXPECT_EQ(ConnectedSocketsWithBuffer(SO_SNDBUF, expected), 2)
      << "connected sockets with SO_SNDBUF " << expected;
}

// Measurements between two threads of this process (printed; checked only for sanity).
TEST(TcpMeasureTest, PingPongAndStreamBetweenThreads) {
  auto store = CreateMemoryStore();
  auto group = ConnectTcpGroup(2, *store, [](int) { return Options(); });
  ASSERT_FALSE(group.errors[0]);
  ASSERT_FALSE(group.errors[1]);
  constexpr int kRoundTrips = 5000;
  constexpr int kFrames = 64;
  constexpr size_t kFrameBytes = 4 << 20;
  double rtt_us = 0;
  double gbps = 0;
  const auto errors = RunRanks(2, [&](int rank) {
    Fabric& fabric = *group.fabrics[rank];
    fabric.SetDeadline(Clock::now() + test_time::Scaled(60s));
    Connection& peer = fabric.connection(1 - rank);
    uint64_t word = 0;
    Clock::time_point start;
    for (int i = 0; i < kRoundTrips + 500; ++i) {
      if (i == 500) start = Clock::now();
      if (rank == 0) {
        peer.PostSend(Tag(i, 1), &word, 8);
        peer.WaitRecv(peer.PostRecv(Tag(i, 1), &word, 8));
      } else {
        peer.WaitRecv(peer.PostRecv(Tag(i, 1), &word, 8));
        peer.PostSend(Tag(i, 1), &word, 8);
      }
    }
    if (rank == 0) {
      rtt_us =
          std::chrono::duration<double, std::micro>(Clock::now() - start).count() / kRoundTrips;
    }
    std::vector<std::vector<uint8_t>> buffers(4, std::vector<uint8_t>(kFrameBytes, 3));
    std::vector<uint64_t> tickets(kFrames);
    const auto stream_start = Clock::now();
    for (int i = 0; i < kFrames; ++i) {
      if (rank == 0) {
        if (i >= 4) peer.WaitSend(tickets[i - 4]);
        tickets[i] = peer.PostSend(Tag(10000 + i, kFrameBytes), buffers[i % 4].data(), kFrameBytes);
      } else {
        if (i >= 4) peer.WaitRecv(tickets[i - 4]);
        tickets[i] = peer.PostRecv(Tag(10000 + i, kFrameBytes), buffers[i % 4].data(), kFrameBytes);
      }
    }
    if (rank == 0) {
      peer.WaitSend(tickets.back());
    } else {
      peer.WaitRecv(tickets.back());
      gbps = static_cast<double>(kFrameBytes) * kFrames /
             std::chrono::duration<double>(Clock::now() - stream_start).count() / 1e9;
    }
  });
  ASSERT_FALSE(errors[0]) << errors[0]->what();
  ASSERT_FALSE(errors[1]) << errors[1]->what();
  std::printf("threads: 8-byte round trip %.2f us, 4 MiB stream %.2f GB/s\n", rtt_us, gbps);
  RecordProperty("rtt_us", std::to_string(rtt_us));
  RecordProperty("stream_gbps", std::to_string(gbps));
  EXPECT_GT(rtt_us, 0);
  EXPECT_GT(gbps, 0);
}

// The same between two processes (the worker binary), with short runs.
TEST(TcpMeasureTest, PingPongBetweenTwoProcesses) {
  const std::string binary = std::string(COLLECTIVES_TEST_BIN_DIR) + "/transport_pingpong_worker";
  if (access(binary.c_str(), X_OK) != 0) GTEST_SKIP() << binary << " is not built";
  const auto dir =
      std::filesystem::temp_directory_path() / ("transport_pingpong_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < 2; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) {
      if (rank == 0) dup2(pipe_fds[1], STDOUT_FILENO);
      close(pipe_fds[0]);
      close(pipe_fds[1]);
      const std::string rank_text = std::to_string(rank);
      execl(binary.c_str(), binary.c_str(), rank_text.c_str(), dir.c_str(), "2000", "32", nullptr);
      _exit(127);
    }
    pids.push_back(pid);
  }
  close(pipe_fds[1]);
  std::string output;
  char buffer[256];
  ssize_t n;
  while ((n = read(pipe_fds[0], buffer, sizeof(buffer))) > 0) output.append(buffer, n);
  close(pipe_fds[0]);
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  std::filesystem::remove_all(dir);
  std::printf("processes: %s", output.c_str());
  EXPECT_NE(output.find("rtt_us="), std::string::npos) << output;
}

// ---- Connections on demand. ----

TcpFabricOptions OnDemand(std::shared_ptr<Store> store, std::vector<int> peers,
                          std::chrono::milliseconds timeout = 20'000ms) {
  TcpFabricOptions options = Options(timeout);
  options.on_demand = true;
  options.peers_at_setup = std::move(peers);
  options.address_store = std::move(store);
  return options;
}

// Eight ranks connect only their ring neighbours at set-up; then every rank sends a frame to
// every other and receives one from each: the other pairs connect at that first use, both
// directions carry the right bytes, and every pair ends connected once.
TEST(TcpOnDemandTest, OnlyTheListedPeersConnectAtSetUpAndTheRestAtFirstUse) {
  constexpr int kSize = 8;
  constexpr size_t kBytes = 3000;
  std::shared_ptr<Store> store = CreateMemoryStore();
  const int open_before = TcpConnectionsOpen();
  auto group = ConnectTcpGroup(kSize, *store, [&](int rank) {
    return OnDemand(store, {(rank + 1) % kSize, (rank + kSize - 1) % kSize});
  });
  for (int rank = 0; rank < kSize; ++rank) {
    ASSERT_FALSE(group.errors[rank]) << group.errors[rank]->what();
  }
  EXPECT_EQ(TcpConnectionsOpen() - open_before, kSize * 2);  // two ends per ring pair
  const auto errors = RunRanks(kSize, [&](int rank) {
    Fabric& fabric = *group.fabrics[rank];
    fabric.SetDeadline(Clock::now() + test_time::Scaled(20s));
    std::vector<std::vector<uint8_t>> out(kSize), in(kSize);
    std::vector<uint64_t> sends(kSize), recvs(kSize);
    for (int k = 1; k < kSize; ++k) {
      const int to = (rank + k) % kSize;
      const int from = (rank + kSize - k) % kSize;
      out[to] = Pattern(rank, to, 0, kBytes);
      in[from].assign(kBytes, 0);
      sends[to] = fabric.connection(to).PostSend(Tag(1, kBytes), out[to].data(), kBytes);
      recvs[from] = fabric.connection(from).PostRecv(Tag(1, kBytes), in[from].data(), kBytes);
    }
    for (int peer = 0; peer < kSize; ++peer) {
      if (peer == rank) continue;
      fabric.connection(peer).WaitRecv(recvs[peer]);
      fabric.connection(peer).WaitSend(sends[peer]);
      EXPECT_EQ(in[peer], Pattern(peer, rank, 0, kBytes)) << "rank " << rank << " from " << peer;
    }
  });
  for (int rank = 0; rank < kSize; ++rank) {
    EXPECT_FALSE(errors[rank]) << errors[rank]->what();
  }
  EXPECT_EQ(TcpConnectionsOpen() - open_before, kSize * (kSize - 1));
  group.fabrics.clear();
  EXPECT_EQ(TcpConnectionsOpen(), open_before);
}

// A peer whose communicator is gone refuses the connection made at first use: the sender
// raises peer-lost naming it, within the write grace, not at the deadline.
TEST(TcpOnDemandTest, APeerThatIsGoneIsNamedAtFirstUse) {
  std::shared_ptr<Store> store = CreateMemoryStore();
  auto group = ConnectTcpGroup(3, *store, [&](int) { return OnDemand(store, {}); });
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_FALSE(group.errors[rank]) << group.errors[rank]->what();
  }
  group.fabrics[2].reset();
  Fabric& fabric = *group.fabrics[0];
  fabric.SetDeadline(Clock::now() + 20s);
  const auto start = Clock::now();
  std::vector<uint8_t> data(100, 1);
  try {
    Connection& to = fabric.connection(2);
    to.WaitSend(to.PostSend(Tag(1, 100), data.data(), data.size()));
    ADD_FAILURE() << "a send to a rank that is gone completed";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPeerLost) << error.what();
    EXPECT_NE(error.message().find("rank 0: lost rank 2 (cannot connect to it"), std::string::npos)
        << error.what();
  }
  EXPECT_LT(Clock::now() - start, test_time::Scaled(5s));
}

// A peer whose listener is there but which never drives its fabric (a stopped process): the
// connection's handshake never ends, and the wait raises kTimeout naming the peer and the call
// at the deadline; so does the higher rank that waits for a lower one that never connects.
TEST(TcpOnDemandTest, APeerThatNeverAnswersIsATimeoutNamingIt) {
  std::shared_ptr<Store> store = CreateMemoryStore();
  auto group = ConnectTcpGroup(3, *store, [&](int) { return OnDemand(store, {}); });
  for (int rank = 0; rank < 3; ++rank) {
    ASSERT_FALSE(group.errors[rank]) << group.errors[rank]->what();
  }
  const auto errors = RunRanks(3, [&](int rank) {
    if (rank == 1) return;  // never drives its fabric
    Fabric& fabric = *group.fabrics[rank];
    fabric.SetDeadline(Clock::now() + 500ms);
    std::vector<uint8_t> data(64, 0);
    Connection& peer = fabric.connection(1);
    if (rank == 0) {
      peer.WaitSend(peer.PostSend(Tag(1, 64), data.data(), data.size()));
    } else {
      peer.WaitRecv(peer.PostRecv(Tag(1, 64), data.data(), data.size()));
    }
  });
  ASSERT_TRUE(errors[0]);
  EXPECT_EQ(errors[0]->code(), ErrorCode::kTimeout) << errors[0]->what();
  EXPECT_NE(errors[0]->message().find("to rank 1"), std::string::npos) << errors[0]->what();
  ASSERT_TRUE(errors[2]);
  EXPECT_EQ(errors[2]->code(), ErrorCode::kTimeout) << errors[2]->what();
  EXPECT_NE(errors[2]->message().find("from rank 1"), std::string::npos) << errors[2]->what();
}

// A peer that closes a connection made on demand with no abort frame on it, before any frame
// came from it, is not declared lost at once: its fabric may have broken while the connection
// was being attached on its side, and the abort frame another rank relays within the grace
// decides, naming the error at fault. A connection the peer has written on, or one made at
// set-up, that closes so is a lost peer at once (a dead rank is named as fast as before). Rank 1
// connects to 0 and 2 at set-up; 0 and 2 connect on demand or at set-up, and 2 sends 0 a frame
// first or 0 sends 2 one.
TEST(TcpOnDemandTest, ACloseBeforeAnyFrameWaitsForTheAbortFrameRelayedOverAnother) {
  struct Case {
    const char* name;
    bool at_setup;
    bool zero_heard_from_two;
    bool mismatch;  // else kPeerLost naming rank 2
  };
  for (const Case& c : {Case{"on demand, nothing heard from 2", false, false, true},
                        Case{"on demand, a frame heard from 2", false, true, false},
                        Case{"at set-up", true, false, false}}) {
    SCOPED_TRACE(c.name);
    std::shared_ptr<Store> store = CreateMemoryStore();
    auto group = ConnectTcpGroup(3, *store, [&](int rank) {
      if (rank == 1) return OnDemand(store, {0, 2});
      if (c.at_setup) return OnDemand(store, {1, 2 - rank});
      return OnDemand(store, {1});
    });
    for (int rank = 0; rank < 3; ++rank) {
      ASSERT_FALSE(group.errors[rank]) << group.errors[rank]->what();
    }
    // One frame between 0 and 2: the connection is attached on both ends.
    const int sender = c.zero_heard_from_two ? 2 : 0;
    std::vector<uint8_t> first(64, 7), got(64, 0);
    const auto connected = RunRanks(3, [&](int rank) {
      if (rank == 1) return;
      Fabric& fabric = *group.fabrics[rank];
      fabric.SetDeadline(Clock::now() + test_time::Scaled(20s));
      Connection& peer = fabric.connection(2 - rank);
      if (rank == sender) {
        peer.WaitSend(peer.PostSend(Tag(1, 64), first.data(), first.size()));
      } else {
        peer.WaitRecv(peer.PostRecv(Tag(1, 64), got.data(), got.size()));
      }
    });
    ASSERT_FALSE(connected[0]) << connected[0]->what();
    ASSERT_FALSE(connected[2]) << connected[2]->what();
    ASSERT_EQ(got, first);
    // Rank 0 waits for a frame from 2; 2 closes with no abort frame, then 1 aborts with a
    // mismatch: within the grace after the close, or (where the close decides at once) well
    // after it.
    std::optional<Error> error;
    std::thread waiter([&] {
      Fabric& fabric = *group.fabrics[0];
      fabric.SetDeadline(Clock::now() + test_time::Scaled(20s));
      try {
        Connection& peer = fabric.connection(2);
        peer.WaitRecv(peer.PostRecv(Tag(2, 64), got.data(), got.size()));
      } catch (const Error& e) {
        error = e;
      }
    });
    std::this_thread::sleep_for(20ms);
    group.fabrics[2].reset();
    std::this_thread::sleep_for(c.mismatch ? 30ms : 400ms);
    group.fabrics[1]->Abort(Error(ErrorCode::kMismatch, "rank 1: the calls differ"));
    waiter.join();
    ASSERT_TRUE(error) << "the receive from a closed peer completed";
    if (c.mismatch) {
      EXPECT_EQ(error->code(), ErrorCode::kMismatch) << error->what();
      EXPECT_NE(error->message().find("rank 1 aborted the job"), std::string::npos)
          << error->what();
    } else {
      EXPECT_EQ(error->code(), ErrorCode::kPeerLost) << error->what();
      EXPECT_NE(error->message().find("rank 0: lost rank 2"), std::string::npos) << error->what();
    }
  }
}

}  // namespace
}  // namespace collectives::transport
