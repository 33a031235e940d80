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
#include "tests/free_port.h"
#include "tests/loopback_spec.h"
#include "tests/scoped_env.h"

namespace collectives::testing {
namespace {

// What each rank of a 2-rank all-reduce of ones got: its error code (kInternal: none) and
// message, or whether the sum was right.
struct Outcome {
  std::vector<ErrorCode> codes = std::vector<ErrorCode>(2, ErrorCode::kInternal);
  std::vector<std::string> messages = std::vector<std::string>(2);
  std::vector<int> summed = std::vector<int>(2, 0);  // not vector<bool>: threads write it
};

// Rank 1 is given `listen` as its CommunicationOptions::listen_address.
Outcome RunTwoRanks(const std::string& listen) {
  const uint16_t port = uint16_t(FreePort());
  Outcome outcome;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.emplace_back([&, rank] {
      ClusterSpec spec = LoopbackSpec(rank, 2, port);
      spec.job_token = "listen-test";
      CommunicationOptions options;
      options.implementation = Implementation::kRing;
      options.timeout = std::chrono::seconds(3);
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

}  // namespace
}  // namespace collectives::testing
