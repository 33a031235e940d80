// A stranger on the ports of a running job. While three ranks (threads of this process, each with
// its own communicator over loopback TCP and the TCP store that rank 0 hosts) run checked
// all-reduces, a stranger connects to every port the job listens on and sends garbage, a
// valid-looking fabric handshake with a wrong proof, and half-open connections that send part of
// a header and then nothing. The job's collectives all complete with correct results.
//
// Ports: the store's (master_port, open for the job's lifetime; it asks every connection for a
// proof of the job token, so a client without it learns nothing) and each rank's fabric listener
// (published in the store; it is closed once the mesh is built, so connecting there is refused,
// which the test accepts as the strongest outcome).
// Then the token as part of the ClusterSpec: proven like one from the options or the environment.
// Then a job that sets no token anywhere: the store's creator generates one, the other ranks
// enrol for it, and every connection proves it; a stranger who enrols first takes a rank's
// place (loudly), one who comes later is refused.
#include <gtest/gtest.h>

#include <asio.hpp>
#include <atomic>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/job_token.h"
#include "src/cluster/tcp_store.h"
#include "src/transport/handshake.h"
#include "tests/loopback_spec.h"
#include "tests/ring/worker_processes.h"
#include "tests/scoped_env.h"

namespace collectives::testing {
namespace {

using asio::ip::tcp;

// What the stranger did, for the test's log.
struct StrangerReport {
  int connections = 0;
  int refused = 0;
};

// Connects to host:port; false if refused.
bool Connect(asio::io_context& io, tcp::socket& socket, const std::string& host, uint16_t port) {
  asio::error_code ec;
  socket = tcp::socket(io);
  socket.connect(tcp::endpoint(asio::ip::make_address(host), port), ec);
  return !ec;
}

// `io` outlives every socket made here, the half-open ones kept in `half_open` included.
void Attack(asio::io_context& io, const std::string& host, uint16_t port,
            std::vector<tcp::socket>& half_open, StrangerReport& report, std::mt19937& rng) {
  asio::error_code ec;
  // Garbage.
  {
    tcp::socket socket(io);
    if (!Connect(io, socket, host, port)) {
      ++report.refused;
      return;
    }
    ++report.connections;
    std::vector<uint8_t> junk(4096);
    for (auto& b : junk) b = uint8_t(rng());
    asio::write(socket, asio::buffer(junk), ec);
    socket.close(ec);
  }
  // A valid-looking hello of this job's id, claiming rank 1, then a wrong proof.
  {
    tcp::socket socket(io);
    if (Connect(io, socket, host, port)) {
      ++report.connections;
      transport::Hello hello;
      hello.version = 1;
      hello.rank = 1;
      hello.world_size = 3;
      hello.nonce = transport::RandomNonce();
      hello.job_id = "collectives";
      asio::write(socket, asio::buffer(transport::EncodeHello(hello)), ec);
      transport::Proof wrong{};
      asio::write(socket, asio::buffer(wrong), ec);
      socket.close(ec);
    }
  }
  // Half-open: a few bytes of a header, then silence (kept open until the job is done).
  for (int i = 0; i < 3; ++i) {
    tcp::socket socket(io);
    if (!Connect(io, socket, host, port)) break;
    ++report.connections;
    const uint8_t partial[5] = {0x43, 0x53, 0x54, 0x31, 0x02};
    asio::write(socket, asio::buffer(partial, size_t(1 + i * 2)), ec);
    half_open.push_back(std::move(socket));
  }
}

TEST(StrangerTest, ARunningJobIgnoresStrangersOnEveryPort) {
  constexpr int kSize = 3;
  constexpr int kIterations = 200;
  const uint16_t port = uint16_t(FreePort());
  std::atomic<int> ready{0};
  std::atomic<bool> attacked{false};
  std::vector<std::string> failures(kSize);
  std::vector<int> completed(kSize, 0);

  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kSize; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        const ClusterSpec spec = LoopbackSpec(rank, kSize, port);
        CommunicationOptions options;
        options.timeout = std::chrono::seconds(30);
        options.job_token = "stranger-test-secret";
        auto comm = CreateCommunication(spec, options);
        ++ready;
        for (int i = 0; i < kIterations; ++i) {
          const size_t count = 1 + size_t(i) * 997 % 20000;
          std::vector<float> data(count);
          for (size_t k = 0; k < count; ++k) data[k] = float((rank + 1) * (k % 13) + i % 7);
          comm->AllReduce(Tensor{data.data(), count, DataType::kFloat32}, ReduceOp::kSum);
          for (size_t k = 0; k < count; ++k) {
            const float want = float(6 * (k % 13) + 3 * (i % 7));
            if (data[k] != want) {
              failures[rank] = "iteration " + std::to_string(i) + " element " + std::to_string(k) +
                               ": " + std::to_string(data[k]) + " != " + std::to_string(want);
              return;
            }
          }
          ++completed[rank];
          // Keep the job running until the stranger is done.
          if (i == kIterations / 2) {
            while (!attacked) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
        }
        comm->Barrier();
      } catch (const std::exception& e) {
        failures[rank] = e.what();
      }
    });
  }

  while (ready < kSize) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Without the job token the store tells a stranger nothing.
  try {
    CreateTcpStore("127.0.0.1", port, false, std::chrono::seconds(5), "a guess");
    ADD_FAILURE() << "the store served a client without the job token";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
  }
  // The test (not the stranger) reads the fabric listeners' addresses, to aim at them too.
  std::vector<std::pair<std::string, uint16_t>> targets = {{"127.0.0.1", port}};
  {
    auto client =
        CreateTcpStore("127.0.0.1", port, false, std::chrono::seconds(5), "stranger-test-secret");
    for (int rank = 0; rank < kSize; ++rank) {
      const std::string address =
          client->Get("collectives/1/addr/" + std::to_string(rank), std::chrono::seconds(5));
      std::string why;
      const auto parsed = cluster::ParseHostPort(address, &why);
      ASSERT_TRUE(parsed.has_value()) << address << ": " << why;
      targets.emplace_back(parsed->host, parsed->port);
    }
  }
  StrangerReport report;
  asio::io_context io;  // before half_open: destroyed after the sockets
  std::vector<tcp::socket> half_open;
  std::mt19937 rng(7);
  for (const auto& [host, target_port] : targets) {
    Attack(io, host, target_port, half_open, report, rng);
  }
  attacked = true;

  for (std::thread& t : ranks) t.join();
  half_open.clear();
  for (int rank = 0; rank < kSize; ++rank) {
    EXPECT_EQ(failures[rank], "") << "rank " << rank;
    EXPECT_EQ(completed[rank], kIterations) << "rank " << rank;
  }
  EXPECT_GE(report.connections, 5) << "the stranger did not reach the store";
  std::printf("stranger: %d connections accepted, %d refused (closed fabric listeners)\n",
              report.connections, report.refused);
}

// The job token can come with the ClusterSpec (as FromEnvironment reads COLLECTIVES_JOB_TOKEN):
// ranks whose specs carry the same token form the job; a rank whose spec carries another is
// refused by the store with kUnauthenticated, and the others time out waiting for it.
TEST(JobTokenTest, TheClusterSpecsTokenIsProvenOnEveryConnection) {
  for (const bool same : {true, false}) {
    const uint16_t port = uint16_t(FreePort());
    std::vector<ErrorCode> codes(2, ErrorCode::kInternal);
    std::vector<int> summed(2, 0);  // not vector<bool>: its bits share words across threads
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        ClusterSpec spec = LoopbackSpec(rank, 2, port);
        spec.job_token = rank == 1 && !same ? "another-secret" : "the-job-secret";
        CommunicationOptions options;
        // Long enough for the set-up (with authentication) on a busy host; rank 0, which waits
        // for the refused rank 1 until its deadline, has the shortest that still covers it.
        options.timeout = std::chrono::seconds(rank == 0 && !same ? 10 : 30);
        try {
          auto comm = CreateCommunication(spec, options);
          std::vector<float> data(10, 1.0f);
          comm->AllReduce(Tensor{data.data(), data.size(), DataType::kFloat32}, ReduceOp::kSum);
          summed[size_t(rank)] = data[9] == 2.0f ? 1 : 0;
        } catch (const Error& e) {
          codes[size_t(rank)] = e.code();
        }
      });
    }
    for (std::thread& t : ranks) t.join();
    if (same) {
      EXPECT_TRUE(summed[0] == 1 && summed[1] == 1)
          << "ranks sharing the spec's token did not connect";
    } else {
      EXPECT_EQ(codes[1], ErrorCode::kUnauthenticated) << "the stranger's token was accepted";
      EXPECT_EQ(codes[0], ErrorCode::kTimeout);
    }
  }
}

TEST(JobTokenTest, FromEnvironmentReadsTheTokenAndOptionsWin) {
  const ClusterSpec spec = ClusterSpec::FromEnvironment(
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"COLLECTIVES_JOB_TOKEN", "from-env"}});
  EXPECT_EQ(spec.job_token, "from-env");
  CommunicationOptions options;
  EXPECT_EQ(ResolveJobToken(spec, options), "from-env");
  options.job_token = "from-options";
  EXPECT_EQ(ResolveJobToken(spec, options), "from-options");
}

// `iterations` checked all-reduces of varied sizes; "" or what went wrong.
std::string CheckedAllReduces(CollectiveCommunication& comm, int iterations) {
  const int size = comm.size();
  for (int i = 0; i < iterations; ++i) {
    const size_t count = 1 + size_t(i) * 997 % 20000;
    std::vector<float> data(count);
    for (size_t k = 0; k < count; ++k) data[k] = float((comm.rank() + 1) * (k % 13) + i % 7);
    comm.AllReduce(Tensor{data.data(), count, DataType::kFloat32}, ReduceOp::kSum);
    for (size_t k = 0; k < count; ++k) {
      const float want = float(size * (size + 1) / 2 * (k % 13) + size * (i % 7));
      if (data[k] != want) {
        return "iteration " + std::to_string(i) + " element " + std::to_string(k) + ": " +
               std::to_string(data[k]) + " != " + std::to_string(want);
      }
    }
  }
  return "";
}

// Runs body(rank) on one thread per rank of `size` and joins them; each rank's entry is what its
// body returned ("" for success) or what it threw.
std::vector<std::string> OnRankThreads(int size, const std::function<std::string(int)>& body) {
  std::vector<std::string> failures(static_cast<size_t>(size));
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < size; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        failures[size_t(rank)] = body(rank);
      } catch (const std::exception& e) {
        failures[size_t(rank)] = e.what();
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  return failures;
}

// How a stranger's enrolment for `rank` ends: "enrolled", or the kUnauthenticated message.
std::string StrangerEnrols(uint16_t port, int rank) {
  try {
    cluster::TcpStoreClient stranger("127.0.0.1", port, std::chrono::seconds(5), "", rank);
    return "enrolled";
  } catch (const Error& e) {
    return e.code() == ErrorCode::kUnauthenticated ? e.message() : "wrong code: " + e.message();
  }
}

// The store path of CreateCommunication(spec, options), spelled out to read the token the
// store gives the communicator.
TEST(JobTokenTest, WithNoTokenAnywhereTheStoreGeneratesOneThatEveryRankProves) {
  const ScopedEnv no_token("COLLECTIVES_JOB_TOKEN", nullptr);
  constexpr int kSize = 3;
  const uint16_t port = FreePort();
  std::vector<std::string> tokens(kSize);
  const std::vector<std::string> failures = OnRankThreads(kSize, [&](int rank) {
    const ClusterSpec spec = LoopbackSpec(rank, kSize, port);
    CommunicationOptions options;
    options.implementation = Implementation::kRing;
    options.timeout = std::chrono::seconds(30);
    auto store = CreateStoreFor(spec, options.timeout, ResolveJobToken(spec, options));
    tokens[size_t(rank)] = cluster::StoreJobToken(*store);
    auto comm = CreateCommunication(spec, store, options);
    return CheckedAllReduces(*comm, 20);
  });
  for (int rank = 0; rank < kSize; ++rank) {
    EXPECT_EQ(failures[size_t(rank)], "") << "rank " << rank;
    EXPECT_EQ(tokens[size_t(rank)].size(), 32u) << "rank " << rank;
    EXPECT_EQ(tokens[size_t(rank)], tokens[0]) << "rank " << rank;
  }
}

// The same through a file store: the folder's .job-token, made by the first rank to ask.
TEST(JobTokenTest, AFileStoreJobWithNoTokenProvesTheFoldersToken) {
  const ScopedEnv no_token("COLLECTIVES_JOB_TOKEN", nullptr);
  constexpr int kSize = 3;
  std::string folder = "/tmp/stranger_test.XXXXXX";
  ASSERT_NE(mkdtemp(folder.data()), nullptr);
  const std::vector<std::string> failures = OnRankThreads(kSize, [&](int rank) {
    CommunicationOptions options;
    options.implementation = Implementation::kRing;
    options.timeout = std::chrono::seconds(30);
    auto comm = CreateCommunication(LoopbackSpec(rank, kSize, 1), CreateFileStore(folder), options);
    return CheckedAllReduces(*comm, 5);
  });
  for (int rank = 0; rank < kSize; ++rank) {
    EXPECT_EQ(failures[size_t(rank)], "") << "rank " << rank;
  }
  EXPECT_EQ(access((folder + "/.job-token").c_str(), F_OK), 0) << "no token file in " << folder;
  std::filesystem::remove_all(folder);
}

// Rank 2 reaches the store through a wrapper, which hides the token it enrolled for, so its
// fabric proves the empty token: the others, proving the generated one, do not let it in.
TEST(JobTokenTest, AFabricPeerThatProvesTheEmptyTokenIsRefused) {
  class Wrapper : public Store {
   public:
    explicit Wrapper(std::shared_ptr<Store> inner) : inner_(std::move(inner)) {}
    void Set(const std::string& key, const std::string& value) override { inner_->Set(key, value); }
    std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
      return inner_->Get(key, timeout);
    }
    int64_t Add(const std::string& key, int64_t delta) override { return inner_->Add(key, delta); }

   private:
    std::shared_ptr<Store> inner_;
  };
  const ScopedEnv no_token("COLLECTIVES_JOB_TOKEN", nullptr);
  constexpr int kSize = 3;
  const uint16_t port = FreePort();
  std::vector<ErrorCode> codes(kSize, ErrorCode::kInternal);
  std::vector<int> connected(kSize, 0);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kSize; ++rank) {
    ranks.emplace_back([&, rank] {
      const ClusterSpec spec = LoopbackSpec(rank, kSize, port);
      CommunicationOptions options;
      options.implementation = Implementation::kRing;
      // Long enough that a rank reaches a failed proof before any times out, on a busy host.
      options.timeout = std::chrono::seconds(10);
      try {
        std::shared_ptr<Store> store = CreateStoreFor(spec, options.timeout);
        if (rank == 2) store = std::make_shared<Wrapper>(store);
        auto comm = CreateCommunication(spec, store, options);
        connected[size_t(rank)] = 1;
      } catch (const Error& e) {
        codes[size_t(rank)] = e.code();
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  int unauthenticated = 0;
  for (int rank = 0; rank < kSize; ++rank) {
    EXPECT_EQ(connected[size_t(rank)], 0) << "rank " << rank << " formed a job with rank 2";
    unauthenticated += codes[size_t(rank)] == ErrorCode::kUnauthenticated ? 1 : 0;
  }
  EXPECT_GE(unauthenticated, 1) << "no rank saw a failed proof";
}

TEST(JobTokenTest, AStrangerWhoEnrolsFirstTakesTheRanksPlaceAndTheRankSaysSo) {
  const ScopedEnv no_token("COLLECTIVES_JOB_TOKEN", nullptr);
  constexpr int kSize = 3;
  const uint16_t port = FreePort();
  std::vector<ErrorCode> codes(kSize, ErrorCode::kInternal);
  std::vector<std::string> messages(kSize);
  auto run_rank = [&](int rank) {
    CommunicationOptions options;
    // Rank 2 returns once refused; ranks 0 and 1 wait for it until their deadline, which must
    // keep the store up until rank 2 was refused, on a busy host too.
    options.timeout = std::chrono::seconds(rank == 2 ? 30 : 10);
    try {
      auto comm = CreateCommunication(LoopbackSpec(rank, kSize, port), options);
    } catch (const Error& e) {
      codes[size_t(rank)] = e.code();
      messages[size_t(rank)] = e.message();
    }
  };
  std::vector<std::thread> ranks;
  ranks.emplace_back(run_rank, 0);
  // The stranger's client retries until rank 0's store is up, and enrols for rank 2.
  cluster::TcpStoreClient stranger("127.0.0.1", port, std::chrono::seconds(10), "", 2);
  ranks.emplace_back(run_rank, 1);
  ranks.emplace_back(run_rank, 2);
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(codes[2], ErrorCode::kUnauthenticated) << messages[2];
  EXPECT_NE(messages[2].find("rank 2's enrolment in the job's store was already taken by "
                             "127.0.0.1:"),
            std::string::npos)
      << messages[2];
  // The job cannot form without its rank 2; it fails in bounded time rather than hanging.
  EXPECT_NE(codes[0], ErrorCode::kInternal) << messages[0];
  EXPECT_NE(codes[1], ErrorCode::kInternal) << messages[1];
}

TEST(JobTokenTest, AStrangerWhoEnrolsAfterTheJobFormedIsRefusedAndTheJobGoesOn) {
  const ScopedEnv no_token("COLLECTIVES_JOB_TOKEN", nullptr);
  constexpr int kSize = 3;
  const uint16_t port = FreePort();
  std::atomic<int> ready{0};
  std::atomic<bool> refused{false};
  std::vector<std::string> failures(kSize);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kSize; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        CommunicationOptions options;
        options.implementation = Implementation::kRing;
        options.timeout = std::chrono::seconds(30);
        auto comm = CreateCommunication(LoopbackSpec(rank, kSize, port), options);
        ++ready;
        while (!refused) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        failures[size_t(rank)] = CheckedAllReduces(*comm, 50);
      } catch (const std::exception& e) {
        failures[size_t(rank)] = e.what();
        ++ready;
      }
    });
  }
  while (ready < kSize) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (int rank = 1; rank < kSize; ++rank) {
    const std::string error = StrangerEnrols(port, rank);
    EXPECT_NE(error.find("rank " + std::to_string(rank) +
                         "'s enrolment in the job's store was "
                         "already taken by 127.0.0.1:"),
              std::string::npos)
        << error;
  }
  for (int rank : {0, kSize}) {
    const std::string error = StrangerEnrols(port, rank);
    EXPECT_NE(error.find("outside the job's"), std::string::npos) << error;
  }
  try {
    CreateTcpStore("127.0.0.1", port, false, std::chrono::seconds(5));  // the empty token
    ADD_FAILURE() << "the store served a client that proved the empty token";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
  }
  refused = true;
  for (std::thread& t : ranks) t.join();
  for (int rank = 0; rank < kSize; ++rank) {
    EXPECT_EQ(failures[size_t(rank)], "") << "rank " << rank;
  }
}

}  // namespace
}  // namespace collectives::testing
