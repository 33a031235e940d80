// The connection handshake: hello encoding and bounds, refusals, HMAC proofs (bound to role,
// ranks, nonces, job and token), and client/server sessions over real loopback sockets:
// success, a wrong token, a wrong job id or world size (refused, and the client told why), an
// unexpected rank, a silent or garbage-sending stranger, a stranger's job id in the log, a
// server that closes before answering, a server that cannot prove the token, and a session
// cancelled after its last read completed but before that read's handler ran.
#include "src/transport/handshake.h"

#include <gtest/gtest.h>
#include <sys/ioctl.h>

#include <asio.hpp>
#include <optional>
#include <thread>

#include "tests/time_scale.h"

namespace collectives::transport {
namespace {

using asio::ip::tcp;
using namespace std::chrono_literals;

Hello SampleHello() {
  Hello hello;
  hello.version = kWireVersion;
  hello.rank = 3;
  hello.world_size = 8;
  for (size_t i = 0; i < hello.nonce.size(); ++i) hello.nonce[i] = static_cast<uint8_t>(i * 7);
  hello.job_id = "job-42";
  return hello;
}

TEST(HelloTest, RoundTrips) {
  const Hello hello = SampleHello();
  const std::vector<uint8_t> bytes = EncodeHello(hello);
  ASSERT_EQ(bytes.size(), kHelloFixedBytes + hello.job_id.size());
  size_t job_id_bytes = 0;
  std::string why;
  auto decoded = DecodeHelloFixed(bytes.data(), &job_id_bytes, &why);
  ASSERT_TRUE(decoded) << why;
  EXPECT_EQ(decoded->version, kWireVersion);
  EXPECT_EQ(decoded->rank, 3);
  EXPECT_EQ(decoded->world_size, 8);
  EXPECT_EQ(decoded->nonce, hello.nonce);
  EXPECT_EQ(job_id_bytes, hello.job_id.size());
  EXPECT_EQ(std::string(bytes.begin() + kHelloFixedBytes, bytes.end()), "job-42");
}

TEST(HelloTest, RejectsBadMagicReservedAndOverlongJobIds) {
  std::vector<uint8_t> bytes = EncodeHello(SampleHello());
  size_t job_id_bytes = 0;
  std::string why;
  auto bad = bytes;
  bad[0] ^= 0xFF;
  EXPECT_FALSE(DecodeHelloFixed(bad.data(), &job_id_bytes, &why));
  EXPECT_NE(why.find("magic"), std::string::npos) << why;
  bad = bytes;
  bad[5] = 1;
  EXPECT_FALSE(DecodeHelloFixed(bad.data(), &job_id_bytes, &why));
  bad = bytes;
  bad[6] = 0xFF;
  bad[7] = 0xFF;  // 65535 bytes announced: rejected before anything is read or allocated
  EXPECT_FALSE(DecodeHelloFixed(bad.data(), &job_id_bytes, &why));
  EXPECT_NE(why.find("65535"), std::string::npos) << why;

  Hello too_long = SampleHello();
  too_long.job_id.assign(kMaxJobIdBytes + 1, 'j');
  EXPECT_THROW(EncodeHello(too_long), Error);
  too_long.job_id.assign(kMaxJobIdBytes, 'j');
  EXPECT_NO_THROW(EncodeHello(too_long));
}

// A refusal is a hello-shaped answer with a reason in byte 5 and no job id; only a client,
// which waits for the server's answer, decodes one.
TEST(HelloTest, RefusalsDecodeOnlyWhereOneIsExpected) {
  const std::vector<uint8_t> refusal = EncodeRefusal(HelloRefusal::kWorldSize, 2, 4);
  ASSERT_EQ(refusal.size(), kHelloFixedBytes);
  EXPECT_EQ(refusal[5], 3);
  size_t job_id_bytes = 99;
  std::string why;
  EXPECT_FALSE(DecodeHelloFixed(refusal.data(), &job_id_bytes, &why));
  EXPECT_NE(why.find("reserved hello byte"), std::string::npos) << why;
  auto decoded = DecodeHelloFixed(refusal.data(), &job_id_bytes, &why, /*refusal_allowed=*/true);
  ASSERT_TRUE(decoded) << why;
  EXPECT_EQ(decoded->refusal, HelloRefusal::kWorldSize);
  EXPECT_EQ(decoded->version, kWireVersion);
  EXPECT_EQ(decoded->rank, 2);
  EXPECT_EQ(decoded->world_size, 4);
  EXPECT_EQ(job_id_bytes, 0u);
  // A plain hello still decodes where a refusal may come, with no refusal.
  const std::vector<uint8_t> hello = EncodeHello(SampleHello());
  decoded = DecodeHelloFixed(hello.data(), &job_id_bytes, &why, true);
  ASSERT_TRUE(decoded) << why;
  EXPECT_EQ(decoded->refusal, HelloRefusal::kNone);

  auto bad = refusal;
  bad[5] = 5;  // no such reason
  EXPECT_FALSE(DecodeHelloFixed(bad.data(), &job_id_bytes, &why, true));
  EXPECT_NE(why.find("unknown refusal reason 5"), std::string::npos) << why;
  bad = refusal;
  bad[6] = 10;  // a refusal carries no text of the server's
  EXPECT_FALSE(DecodeHelloFixed(bad.data(), &job_id_bytes, &why, true));
  EXPECT_NE(why.find("refusal with a job id"), std::string::npos) << why;
  Hello with_job_id = SampleHello();
  with_job_id.refusal = HelloRefusal::kJobId;
  EXPECT_THROW(EncodeHello(with_job_id), Error);
}

TEST(ProofTest, IsBoundToEveryInput) {
  const Nonce a = RandomNonce();
  const Nonce b = RandomNonce();
  EXPECT_NE(a, b);
  const Proof base = ComputeProof("secret", "job", 0, 1, a, b, HandshakeRole::kClient);
  EXPECT_TRUE(ProofsEqual(base, ComputeProof("secret", "job", 0, 1, a, b, HandshakeRole::kClient)));
  EXPECT_FALSE(
      ProofsEqual(base, ComputeProof("secret", "job", 0, 1, a, b, HandshakeRole::kServer)));
  EXPECT_FALSE(
      ProofsEqual(base, ComputeProof("secreT", "job", 0, 1, a, b, HandshakeRole::kClient)));
  EXPECT_FALSE(ProofsEqual(base, ComputeProof("secret", "jo", 0, 1, a, b, HandshakeRole::kClient)));
  EXPECT_FALSE(
      ProofsEqual(base, ComputeProof("secret", "job", 1, 0, a, b, HandshakeRole::kClient)));
  EXPECT_FALSE(
      ProofsEqual(base, ComputeProof("secret", "job", 0, 2, a, b, HandshakeRole::kClient)));
  EXPECT_FALSE(
      ProofsEqual(base, ComputeProof("secret", "job", 0, 1, b, a, HandshakeRole::kClient)));
  // An empty token is allowed (a job without a secret still checks job id and ranks).
  const Proof empty = ComputeProof("", "job", 0, 1, a, b, HandshakeRole::kClient);
  EXPECT_FALSE(ProofsEqual(base, empty));
}

// A loopback listener that runs a server session on every connection it accepts.
class HandshakeSessionTest : public ::testing::Test {
 protected:
  HandshakeConfig Config(int rank, const std::string& token = "token",
                         const std::string& job = "job") {
    HandshakeConfig config;
    config.job_id = job;
    config.token = token;
    config.rank = rank;
    config.world_size = 4;
    return config;
  }

  void Listen(const HandshakeConfig& server, Clock::duration limit = 5s) {
    server_ = server;
    acceptor_.open(tcp::v4());
    acceptor_.bind(tcp::endpoint(asio::ip::address_v4::loopback(), 0));
    acceptor_.listen();
    server_deadline_ = Clock::now() + limit;
    Accept();
  }

  void Accept() {
    acceptor_.async_accept([this](const asio::error_code& ec, tcp::socket socket) {
      if (ec) return;
      HandshakeSession::StartServer(
          std::move(socket), server_, [](int rank) { return rank == 1; }, server_deadline_,
          [this](const HandshakeResult& result, tcp::socket) {
            server_results_.push_back(result);
          });
      Accept();
    });
  }

  // A listener that accepts connections and closes each at once, as a rank does that stopped
  // or gave up its set-up while the client's connection waited in its backlog.
  void ListenAndClose() {
    acceptor_.open(tcp::v4());
    acceptor_.bind(tcp::endpoint(asio::ip::address_v4::loopback(), 0));
    acceptor_.listen();
    CloseNext();
  }

  void CloseNext() {
    acceptor_.async_accept([this](const asio::error_code& ec, tcp::socket socket) {
      if (ec) return;
      asio::error_code ignored;
      socket.close(ignored);
      CloseNext();
    });
  }

  // Connects a client session; returns its result once it finished.
  HandshakeResult Client(const HandshakeConfig& config, int server_rank) {
    std::optional<HandshakeResult> out;
    tcp::socket socket(io_);
    socket.connect(acceptor_.local_endpoint());
    HandshakeSession::StartClient(
        std::move(socket), config, server_rank, Clock::now() + 5s,
        [&](const HandshakeResult& result, tcp::socket) { out = result; });
    const auto until = Clock::now() + 10s;
    while (!out && Clock::now() < until) io_.run_one_for(100ms);
    EXPECT_TRUE(out) << "client handshake did not finish";
    return out.value_or(HandshakeResult{});
  }

  // Runs the io_context until the server finished `count` sessions.
  void WaitServer(size_t count) {
    const auto until = Clock::now() + 10s;
    while (server_results_.size() < count && Clock::now() < until) io_.run_one_for(100ms);
    ASSERT_GE(server_results_.size(), count);
  }

  asio::io_context io_;
  tcp::acceptor acceptor_{io_};
  HandshakeConfig server_;
  Clock::time_point server_deadline_;
  std::vector<HandshakeResult> server_results_;
};

TEST_F(HandshakeSessionTest, GoodHandshake) {
  Listen(Config(2));
  const HandshakeResult client = Client(Config(1), 2);
  EXPECT_TRUE(client.ok) << client.why;
  EXPECT_EQ(client.peer_rank, 2);
  WaitServer(1);
  EXPECT_TRUE(server_results_[0].ok) << server_results_[0].why;
  EXPECT_EQ(server_results_[0].peer_rank, 1);
}

TEST_F(HandshakeSessionTest, WrongTokenIsUnauthenticatedAndTheServerKeepsAccepting) {
  Listen(Config(2));
  const HandshakeResult bad = Client(Config(1, "not the token"), 2);
  EXPECT_FALSE(bad.ok);
  EXPECT_EQ(bad.code, ErrorCode::kUnauthenticated);
  EXPECT_NE(bad.why.find("rejected this rank's proof"), std::string::npos) << bad.why;
  WaitServer(1);
  EXPECT_FALSE(server_results_[0].ok);
  EXPECT_NE(server_results_[0].why.find("wrong proof"), std::string::npos);

  const HandshakeResult good = Client(Config(1), 2);
  EXPECT_TRUE(good.ok) << good.why;
  WaitServer(2);
  EXPECT_TRUE(server_results_[1].ok);
}

TEST_F(HandshakeSessionTest, WrongJobIdIsRejected) {
  Listen(Config(2));
  const HandshakeResult client = Client(Config(1, "token", "another job"), 2);
  EXPECT_FALSE(client.ok);
  EXPECT_EQ(client.code, ErrorCode::kUnauthenticated);
  EXPECT_NE(client.why.find("rank 2 refused this rank's hello: it is in another job than this "
                            "rank's job id 'another job'"),
            std::string::npos)
      << client.why;
  WaitServer(1);
  EXPECT_FALSE(server_results_[0].ok);
  EXPECT_NE(server_results_[0].why.find("another job"), std::string::npos)
      << server_results_[0].why;
}

TEST_F(HandshakeSessionTest, UnexpectedRankIsRejected) {
  Listen(Config(2));
  const HandshakeResult client = Client(Config(3), 2);  // the server accepts only rank 1
  EXPECT_FALSE(client.ok);
  EXPECT_EQ(client.code, ErrorCode::kUnauthenticated);
  EXPECT_NE(client.why.find("rank 2 refused this rank's hello: it does not expect rank 3"),
            std::string::npos)
      << client.why;
  WaitServer(1);
  EXPECT_NE(server_results_[0].why.find("claims rank 3"), std::string::npos);
}

// The server refuses a hello of another world size with a refusal, so the client can say what
// differs (the server has the world size, the client its own).
TEST_F(HandshakeSessionTest, WorldSizeMismatchIsNamedOnTheClient) {
  Listen(Config(2));
  HandshakeConfig three = Config(1);
  three.world_size = 3;
  const HandshakeResult client = Client(three, 2);
  EXPECT_FALSE(client.ok);
  EXPECT_EQ(client.code, ErrorCode::kUnauthenticated);
  EXPECT_NE(client.why.find("rank 2 refused this rank's hello: its world size is 4, this rank's "
                            "is 3"),
            std::string::npos)
      << client.why;
  WaitServer(1);
  EXPECT_NE(server_results_[0].why.find("world size 3"), std::string::npos)
      << server_results_[0].why;
}

// A server that closes without a refusal (it stopped, gave up its set-up, or made room) is not
// a rejection: kPeerLost, which the caller retries, and no talk of tokens.
TEST_F(HandshakeSessionTest, AServerThatClosesBeforeAnsweringIsLostNotARejection) {
  ListenAndClose();
  const HandshakeResult client = Client(Config(1), 2);
  EXPECT_FALSE(client.ok);
  EXPECT_EQ(client.code, ErrorCode::kPeerLost) << client.why;
  EXPECT_NE(client.why.find("rank 2 closed the connection before answering"), std::string::npos)
      << client.why;
  EXPECT_EQ(client.why.find("token"), std::string::npos) << client.why;
  EXPECT_EQ(client.why.find("reject"), std::string::npos) << client.why;
}

// A stranger's job id goes into the server's log line escaped: it cannot end the line and
// forge another, or move the cursor. Its refusal does not send the job id back either.
TEST_F(HandshakeSessionTest, AStrangersJobIdIsEscapedInTheLog) {
  Listen(Config(2));
  tcp::socket stranger(io_);
  stranger.connect(acceptor_.local_endpoint());
  Hello hello;
  hello.version = kWireVersion;
  hello.rank = 1;
  hello.world_size = 4;
  hello.job_id = "x\ncollectives: rank 0 says all is well\x1b[2K\r";
  asio::write(stranger, asio::buffer(EncodeHello(hello)));
  WaitServer(1);
  const std::string& why = server_results_[0].why;
  EXPECT_EQ(server_results_[0].code, ErrorCode::kUnauthenticated);
  for (char c : why) {
    const auto byte = static_cast<unsigned char>(c);
    EXPECT_TRUE(byte >= 0x20 && byte < 0x7f) << "raw byte " << int(byte) << " in: " << why;
  }
  EXPECT_NE(why.find("\\x0a"), std::string::npos) << why;
  EXPECT_NE(why.find("\\x1b"), std::string::npos) << why;
  std::vector<uint8_t> answer(kHelloFixedBytes);
  asio::read(stranger, asio::buffer(answer));
  size_t job_id_bytes = 0;
  std::string decode_why;
  auto refusal = DecodeHelloFixed(answer.data(), &job_id_bytes, &decode_why, true);
  ASSERT_TRUE(refusal) << decode_why;
  EXPECT_EQ(refusal->refusal, HelloRefusal::kJobId);
  EXPECT_EQ(job_id_bytes, 0u);
  asio::error_code ec;
  uint8_t more = 0;
  asio::read(stranger, asio::buffer(&more, 1), ec);
  EXPECT_EQ(ec, asio::error::eof) << "the server sent more than the refusal";
}

TEST_F(HandshakeSessionTest, ClientRejectsAServerOfAnotherRank) {
  Listen(Config(2));
  const HandshakeResult client = Client(Config(1), 3);  // expects rank 3, finds rank 2
  EXPECT_FALSE(client.ok);
  EXPECT_EQ(client.code, ErrorCode::kUnauthenticated);
  EXPECT_NE(client.why.find("expected rank 3"), std::string::npos) << client.why;
}

TEST_F(HandshakeSessionTest, SilentStrangerTimesOutAndGarbageIsRefused) {
  Listen(Config(2), 300ms);
  tcp::socket silent(io_);
  silent.connect(acceptor_.local_endpoint());
  tcp::socket garbage(io_);
  garbage.connect(acceptor_.local_endpoint());
  std::string junk(100, 'x');
  asio::write(garbage, asio::buffer(junk));
  const auto start = Clock::now();
  WaitServer(2);
  EXPECT_LT(Clock::now() - start, test_time::Scaled(3s));
  bool saw_timeout = false;
  bool saw_malformed = false;
  for (const auto& result : server_results_) {
    EXPECT_FALSE(result.ok);
    saw_timeout |= result.code == ErrorCode::kTimeout;
    saw_malformed |= result.why.find("malformed hello") != std::string::npos;
  }
  EXPECT_TRUE(saw_timeout);
  EXPECT_TRUE(saw_malformed);
}

// A server that answers with a well-formed hello but cannot prove the token: the client must
// not accept it (it would otherwise hand its frames to an impostor).
TEST(HandshakeImpostorTest, ClientRejectsAServerThatCannotProveTheToken) {
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
  std::thread impostor([&] {
    asio::error_code ec;
    tcp::socket socket = acceptor.accept(ec);
    if (ec) return;
    std::vector<uint8_t> fixed(kHelloFixedBytes);
    asio::read(socket, asio::buffer(fixed), ec);
    size_t job_id_bytes = 0;
    auto hello = DecodeHelloFixed(fixed.data(), &job_id_bytes, nullptr);
    if (!hello) return;
    std::vector<uint8_t> job_id(job_id_bytes);
    asio::read(socket, asio::buffer(job_id), ec);
    Hello mine;
    mine.version = kWireVersion;
    mine.rank = 2;
    mine.world_size = 4;
    mine.nonce = RandomNonce();
    mine.job_id.assign(job_id.begin(), job_id.end());
    asio::write(socket, asio::buffer(EncodeHello(mine)), ec);
    std::array<uint8_t, kProofBytes> proof;
    asio::read(socket, asio::buffer(proof), ec);
    std::array<uint8_t, 1 + kProofBytes> verdict{};
    verdict[0] = 1;  // "accepted", with a zero proof
    asio::write(socket, asio::buffer(verdict), ec);
    uint8_t last;
    asio::read(socket, asio::buffer(&last, 1), ec);  // until the client closes
  });
  std::optional<HandshakeResult> out;
  tcp::socket socket(io);
  socket.connect(acceptor.local_endpoint());
  HandshakeConfig config;
  config.job_id = "job";
  config.token = "token";
  config.rank = 1;
  config.world_size = 4;
  HandshakeSession::StartClient(std::move(socket), config, 2, Clock::now() + 5s,
                                [&](const HandshakeResult& result, tcp::socket) { out = result; });
  while (!out) io.run_one_for(100ms);
  impostor.join();
  EXPECT_FALSE(out->ok);
  EXPECT_EQ(out->code, ErrorCode::kUnauthenticated);
  EXPECT_NE(out->why.find("failed to prove"), std::string::npos) << out->why;
}

// The race at the set-up deadline: the server's last read (the client's verdict) completed, but
// its handler was still queued when the caller cancelled the session (MeshBuilder::Build leaving
// at its deadline). The session must not then report a success with a closed socket, which the
// caller would admit as a connection. Built step by step on one io_context: the client (this
// test, with blocking calls) sends its proof and its verdict together, so that the server's
// verdict read finds its byte already there and completes at once, queued behind the completion
// of the server's verdict write; the Cancel posted behind that write's completion runs between
// the read's completion and its handler.
TEST(HandshakeCancelTest, AReadCompletedButNotHandledBeforeCancelIsNotASuccess) {
  asio::io_context io(1);
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::address_v4::loopback(), 0));
  asio::io_context client_io;  // the client's socket, used with blocking calls only
  tcp::socket client(client_io);
  client.connect(acceptor.local_endpoint());
  tcp::socket server = acceptor.accept();
  const int server_fd = server.native_handle();

  HandshakeConfig config;
  config.job_id = "job";
  config.token = "token";
  config.rank = 2;
  config.world_size = 4;
  Hello hello;
  hello.version = kWireVersion;
  hello.rank = 1;
  hello.world_size = 4;
  hello.nonce = RandomNonce();
  hello.job_id = "job";
  asio::write(client, asio::buffer(EncodeHello(hello)));

  std::optional<HandshakeResult> result;
  bool socket_open = false;
  std::weak_ptr<HandshakeSession> session = HandshakeSession::StartServer(
      std::move(server), config, [](int rank) { return rank == 1; }, Clock::now() + 60s,
      [&](const HandshakeResult& done, tcp::socket socket) {
        result = done;
        socket_open = socket.is_open();
      });
  const auto until = Clock::now() + 30s;
  // Until the server's hello is out, then until nothing is left to run: the server waits for the
  // client's proof.
  const size_t server_hello_bytes = kHelloFixedBytes + config.job_id.size();
  while (client.available() < server_hello_bytes && Clock::now() < until) io.run_one_for(10ms);
  ASSERT_GE(client.available(), server_hello_bytes);
  while (io.poll() > 0) {
  }
  ASSERT_FALSE(result) << result->why;
  std::vector<uint8_t> server_hello(server_hello_bytes);
  asio::read(client, asio::buffer(server_hello));
  size_t job_id_bytes = 0;
  auto decoded = DecodeHelloFixed(server_hello.data(), &job_id_bytes, nullptr);
  ASSERT_TRUE(decoded);

  const Proof proof = ComputeProof(config.token, config.job_id, 1, 2, hello.nonce, decoded->nonce,
                                   HandshakeRole::kClient);
  std::vector<uint8_t> proof_and_verdict(proof.begin(), proof.end());
  proof_and_verdict.push_back(1);
  asio::write(client, asio::buffer(proof_and_verdict));
  // Both in the server's socket before the server looks.
  int in_server = 0;
  while (Clock::now() < until && ioctl(server_fd, FIONREAD, &in_server) == 0 &&
         in_server < static_cast<int>(proof_and_verdict.size())) {
    std::this_thread::yield();
  }
  ASSERT_EQ(in_server, static_cast<int>(proof_and_verdict.size()));
  // One handler: the proof's, which writes the verdict and queues the write's completion.
  while (client.available() < 1 + kProofBytes && Clock::now() < until) io.run_one_for(10ms);
  ASSERT_GE(client.available(), 1 + kProofBytes);
  ASSERT_FALSE(result) << result->why;
  // Behind the write's completion, whose handler starts the verdict read (complete at once).
  asio::post(io, [session] {
    if (auto locked = session.lock()) locked->Cancel();
  });
  while (!result && Clock::now() < until) io.run_one_for(10ms);
  ASSERT_TRUE(result);
  EXPECT_FALSE(result->ok) << "a cancelled session reported success";
  EXPECT_EQ(result->code, ErrorCode::kAborted) << result->why;
  EXPECT_FALSE(socket_open);
}

}  // namespace
}  // namespace collectives::transport
