// Where a rank's data listener binds when asked: CommunicationOptions::listen_address, else
// $COLLECTIVES_LISTEN_ADDRESS (by default, the address the job names: never every interface).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/core/environment.h"
#include "tests/free_port.h"
#include "tests/loopback_spec.h"
#include "tests/scoped_env.h"
#include "tests/time_scale.h"

namespace collectives::testing {
namespace {

// What each rank of a 2-rank all-reduce of ones got: its error code (kInternal: none) and
// message, or whether the sum was right.
struct Outcome {
  std::vector<ErrorCode> codes = std::vector<ErrorCode>(2, ErrorCode::kInternal);
  std::vector<std::string> messages = std::vector<std::string>(2);
  std::vector<int> summed = std::vector<int>(2, 0);  // not vector<bool>: threads write it
};

// Rank 1 is given `listen` as its CommunicationOptions::listen_address; the store is at
// `master_addr`.
Outcome RunTwoRanks(const std::string& listen, const std::string& master_addr = "127.0.0.1") {
  const uint16_t port = uint16_t(FreePort());
  Outcome outcome;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      ClusterSpec spec = LoopbackSpec(rank, 2, port);
      spec.master_addr = master_addr;
      spec.job_token = "listen-test";
      CommunicationOptions options;
      options.implementation = Implementation::kRing;
      options.timeout = std::chrono::seconds(10);  // set-up with authentication, on a busy host
      if (rank == 1) options.listen_address = listen;
      try {
        auto comm = CreateCommunication(spec, options);
        std::vector<float> data(10, 1.0f);
        comm->AllReduce(Tensor{data.data(), data.size(), DataType::kFloat32}, ReduceOp::kSum);
        outcome.summed[size_t(rank)] = data[9] == 2.0f ? 1 : 0;
      } catch (const Error& e) {
        outcome.codes[size_t(rank)] = e.code();
        outcome.messages[size_t(rank)] = e.what();
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  return outcome;
}

TEST(ListenAddressTest, AnAddressAskedForIsTheOneBound) {
  ScopedEnv unset("COLLECTIVES_LISTEN_ADDRESS", nullptr);
  const Outcome ok = RunTwoRanks("127.0.0.1");
  EXPECT_TRUE(ok.summed[0] == 1 && ok.summed[1] == 1) << ok.messages[0] << " / " << ok.messages[1];

  // An address of no local interface (TEST-NET-1): rank 1 cannot bind it and says which.
  const Outcome refused = RunTwoRanks("192.0.2.1");
  EXPECT_EQ(refused.codes[1], ErrorCode::kSystem) << refused.messages[1];
  EXPECT_NE(refused.messages[1].find("192.0.2.1"), std::string::npos) << refused.messages[1];
}

TEST(ListenAddressTest, TheEnvironmentAsksWhenTheOptionIsEmpty) {
  // Both ranks read it (threads of one process); rank 0, which hosts the store, fails first.
  ScopedEnv set("COLLECTIVES_LISTEN_ADDRESS", "192.0.2.1");
  const Outcome refused = RunTwoRanks("");
  EXPECT_EQ(refused.codes[0], ErrorCode::kSystem) << refused.messages[0];
  EXPECT_NE(refused.messages[0].find("192.0.2.1"), std::string::npos) << refused.messages[0];
}

// A listen address that is no host (a port in it, an unbalanced bracket) is refused before the
// store is reached, naming the option or the variable, not a failure to bind (kSystem).
TEST(ListenAddressTest, AnAddressThatIsNoHostIsRefusedAtOnce) {
  const uint16_t port = uint16_t(FreePort());  // nobody listens: rank 1 would wait for rank 0
  CommunicationOptions options;
  options.implementation = Implementation::kRing;
  options.timeout = std::chrono::seconds(20);
  auto expect_refused = [&](const std::vector<std::string>& parts) {
    const auto start = std::chrono::steady_clock::now();
    try {
      CreateCommunication(LoopbackSpec(1, 2, port), options);
      ADD_FAILURE() << "created";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      for (const std::string& part : parts) {
        EXPECT_NE(e.message().find(part), std::string::npos) << e.message() << " lacks " << part;
      }
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, test_time::Scaled(std::chrono::seconds(2)));
  };
  {
    ScopedEnv unset("COLLECTIVES_LISTEN_ADDRESS", nullptr);
    options.listen_address = "127.0.0.1:29500";
    expect_refused({"rank 1: CommunicationOptions::listen_address='127.0.0.1:29500'",
                    "holds a port (':29500')"});
    options.listen_address = "::1]";
    expect_refused({"CommunicationOptions::listen_address='::1]'", "bracket"});
  }
  {
    ScopedEnv set("COLLECTIVES_LISTEN_ADDRESS", "0.0.0.0/0");
    options.listen_address = "";
    expect_refused({"environment variable COLLECTIVES_LISTEN_ADDRESS='0.0.0.0/0'", "'/'"});
  }
}

// A job that names this host by a name that resolves to loopback addresses only (Debian's
// 127.0.1.1) works on this host, and every rank says that other hosts could not reach it.
TEST(ListenAddressTest, EveryRankSaysWhenItsListenerIsOnlyOnLoopback) {
  ScopedEnv unset("COLLECTIVES_LISTEN_ADDRESS", nullptr);
  const std::string name = core::HostName();
  const std::string loopback = cluster::LoopbackOnlyAddresses(name);
  if (loopback.empty()) {
    GTEST_SKIP() << "this host's name '" << name << "' does not resolve to loopback only here";
  }
  ::testing::internal::CaptureStderr();
  const Outcome named = RunTwoRanks("", name);
  const std::string logged = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(named.summed[0] == 1 && named.summed[1] == 1)
      << named.messages[0] << " / " << named.messages[1];
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(logged.find("rank " + std::to_string(rank) + ": the data listener binds to '" + name +
                          "', which is " + loopback + " here"),
              std::string::npos)
        << logged;
  }
  EXPECT_NE(logged.find("COLLECTIVES_LISTEN_ADDRESS"), std::string::npos) << logged;
  EXPECT_NE(logged.find("rank 0: the store binds to '" + name + "'"), std::string::npos) << logged;
}

}  // namespace
}  // namespace collectives::testing
