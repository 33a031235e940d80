// Send and Recv under RING (loopback TCP) and AUTO (every rank on this host), ranks as threads
// of this process: every dtype, counts 0, 1, a prime and a message of many frames, tags of every
// width (int32 and past it), messages between several pairs in issue order, messages between
// collectives in the same order on both ranks, and the faults: another tag, count or dtype on
// the receiver (kMismatch there, and on the sender at the latest at its next call), a send and
// a collective issued in different orders, a receive with no send (kTimeout), a peer that is
// gone, and bad arguments.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communication.h"
#include "collectives/errors.h"
#include "tests/ring/collective_checks.h"
#include "tests/ring/run_ranks.h"
#include "tests/time_scale.h"

namespace collectives::testing {
namespace {

// Element i of message `m` from rank `from`: exact in every dtype (0..120).
double Value(int from, int m, size_t i) {
  return double((size_t(from) * 13 + size_t(m) * 7 + i * 3) % 121);
}

class PointToPointTest : public ::testing::TestWithParam<Transport> {};

// Every rank sends to the next one and receives from the previous one: even ranks send first,
// odd ranks receive first (a large send waits for its receive), every dtype and count, tags
// from the int32 range and past it.
TEST_P(PointToPointTest, MessagesAroundTheRingAreExact) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  options.chunk_bytes = 64 * 1024;
  for (int size : {2, 3, 5}) {
    RunRanks(GetParam(), size, options, [&](CollectiveCommunication& comm) {
      const int n = comm.size();
      const int rank = comm.rank();
      const int next = (rank + 1) % n;
      const int prev = (rank + n - 1) % n;
      const std::vector<int64_t> tags = {0,
                                         7,
                                         -3,
                                         std::numeric_limits<int32_t>::max(),
                                         std::numeric_limits<int32_t>::min(),
                                         int64_t{1} << 40,
                                         -(int64_t{1} << 50)};
      int m = 0;
      for (DataType d : AllDataTypes()) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{13}, size_t{200'003}}) {
          const int64_t tag = tags[size_t(m) % tags.size()];
          Buffer out(d, count), in(d, count);
          for (size_t i = 0; i < count; ++i) Store(d, out.bytes.data(), i, Value(rank, m, i));
          const auto send = [&] { comm.Send(out.tensor(), next, tag); };
          const auto recv = [&] { comm.Recv(in.tensor(), prev, tag); };
          if (rank % 2 == 0) {  // rank 1 receives first, so no cycle of sends waits
            send();
            recv();
          } else {
            recv();
            send();
          }
          for (size_t i = 0; i < count; ++i) {
            uint64_t cell = 0;
            Store(d, &cell, 0, Value(prev, m, i));
            ASSERT_EQ(Load(d, in.bytes.data(), i), Load(d, &cell, 0))
                << "rank " << rank << " " << ToString(d) << " count " << count << " element " << i;
          }
          EXPECT_EQ(in.bytes.back(), 0xA5) << "guard byte";
          ++m;
        }
      }
    });
  }
}

// Several messages between several pairs, asynchronous: rank 0 sends three messages to each
// other rank with different tags; each receives them in issue order, and answers with one.
// Receives are posted before the sends they wait for are issued.
TEST_P(PointToPointTest, MessagesBetweenSeveralPairsArriveInIssueOrder) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  RunRanks(GetParam(), 4, options, [&](CollectiveCommunication& comm) {
    const int n = comm.size();
    const int rank = comm.rank();
    if (rank == 0) {
      std::vector<std::vector<int32_t>> replies(size_t(n), std::vector<int32_t>(5, -1));
      std::vector<std::shared_ptr<Work>> works;
      std::vector<std::vector<int32_t>> messages;
      for (int k = 0; k < 3; ++k) {
        for (int j = 1; j < n; ++j)
          messages.push_back(std::vector<int32_t>(size_t(10 + k), j * 100 + k));
      }
      size_t at = 0;
      for (int k = 0; k < 3; ++k) {
        for (int j = 1; j < n; ++j, ++at) {
          works.push_back(comm.SendAsync(
              Tensor{messages[at].data(), messages[at].size(), DataType::kInt32}, j, k));
        }
      }
      for (int j = 1; j < n; ++j) {
        works.push_back(
            comm.RecvAsync(Tensor{replies[size_t(j)].data(), 5, DataType::kInt32}, j, 99));
      }
      for (auto& w : works) w->Wait();
      for (int j = 1; j < n; ++j) {
        EXPECT_EQ(replies[size_t(j)], std::vector<int32_t>(5, j * 1000));
      }
    } else {
      std::vector<std::vector<int32_t>> got;
      std::vector<std::shared_ptr<Work>> works;
      for (int k = 0; k < 3; ++k) got.push_back(std::vector<int32_t>(size_t(10 + k), -1));
      for (int k = 0; k < 3; ++k) {
        works.push_back(comm.RecvAsync(
            Tensor{got[size_t(k)].data(), got[size_t(k)].size(), DataType::kInt32}, 0, k));
      }
      std::vector<int32_t> reply(5, rank * 1000);
      works.push_back(comm.SendAsync(Tensor{reply.data(), 5, DataType::kInt32}, 0, 99));
      for (auto& w : works) w->Wait();
      for (int k = 0; k < 3; ++k) {
        EXPECT_EQ(got[size_t(k)], std::vector<int32_t>(size_t(10 + k), rank * 100 + k));
      }
    }
  });
}

// Messages between collectives, issued in the same order on both ranks of each pair: a send
// before an all-reduce on rank 0 and its receive before the same all-reduce on rank 1, then
// a rooted collective, then messages the other way, blocking and asynchronous; ranks that take
// no part in the messages run only the collectives.
TEST_P(PointToPointTest, MessagesInterleavedWithCollectives) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(60);
  RunRanks(GetParam(), 3, options, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    std::vector<double> msg(1000), got(1000, -1);
    for (size_t i = 0; i < msg.size(); ++i) msg[i] = rank * 10000.0 + double(i);
    const Tensor out{msg.data(), msg.size(), DataType::kFloat64};
    const Tensor in{got.data(), got.size(), DataType::kFloat64};
    std::vector<int64_t> value(4, rank + 1);
    for (int round = 0; round < 3; ++round) {
      if (rank == 0) comm.Send(out, 1, round);
      if (rank == 1) comm.Recv(in, 0, round);
      comm.AllReduce(Tensor{value.data(), 4, DataType::kInt64}, ReduceOp::kSum);
      std::vector<int64_t> gathered(3, -1);
      comm.Gather(Tensor{&value[0], 1, DataType::kInt64},
                  rank == 2 ? Tensor{gathered.data(), 3, DataType::kInt64} : Tensor{}, 2);
      std::shared_ptr<Work> w;
      if (rank == 1) w = comm.SendAsync(out, 0, -round);
      if (rank == 0) w = comm.RecvAsync(in, 1, -round);
      comm.Barrier();
      if (w) w->Wait();
      if (rank == 1 || rank == 0) {
        const int from = 1 - rank;
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], from * 10000.0 + double(i)) << "rank " << rank << " round " << round;
        }
        got.assign(got.size(), -1);
      }
    }
    EXPECT_EQ(value, std::vector<int64_t>(4, 54));  // 1 + 2 + 3, then times 3 twice
  });
}

std::string TransportParamName(const ::testing::TestParamInfo<Transport>& param) {
  return TransportName(param.param);
}

INSTANTIATE_TEST_SUITE_P(Transports, PointToPointTest,
                         ::testing::Values(Transport::kTcp, Transport::kAuto,
                                           Transport::kInProcess),
                         TransportParamName);

// What the receive of rank 1 gets wrong about rank 0's send.
enum class Wrong { kTag, kWideTag, kCount, kDtype, kOrder };

struct FaultParam {
  Wrong wrong;
  Transport transport;
  size_t count;
};

class PointToPointMismatchTest : public ::testing::TestWithParam<FaultParam> {};

// Rank 0 sends to rank 1, which receives with another tag (in the int32 range, or past it),
// count or dtype, or runs an all-reduce before the receive that rank 0 issued after its send.
// Rank 1 raises kMismatch at that call and writes nothing; rank 0 (and rank 2, which takes no
// part) raise kMismatch at the latest at the barrier after it; nobody waits for the deadline.
TEST_P(PointToPointMismatchTest, TheReceiverRaisesMismatchAndEveryRankLearnsIt) {
  const FaultParam p = GetParam();
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(20);
  options.chunk_bytes = 16 * 1024;
  RunRanks(p.transport, 3, options, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    std::vector<float> data(p.count + 1, 5.f), got(p.count + 1, -1.f);
    const std::vector<float> got_before = got;
    const auto start = std::chrono::steady_clock::now();
    std::string error;
    bool at_call = false;
    try {
      if (rank == 0) {
        const int64_t tag = p.wrong == Wrong::kWideTag ? (int64_t{5} << 33) : 5;
        comm.Send(Tensor{data.data(), p.count, DataType::kFloat32}, 1, tag);
        if (p.wrong == Wrong::kOrder)
          comm.AllReduce(Tensor{data.data(), 1, DataType::kFloat32}, ReduceOp::kSum);
      } else if (rank == 1) {
        int64_t tag = 5;
        size_t count = p.count;
        DataType dtype = DataType::kFloat32;
        if (p.wrong == Wrong::kTag) tag = 6;
        if (p.wrong == Wrong::kWideTag) tag = (int64_t{5} << 33) + 1;
        if (p.wrong == Wrong::kCount) count = p.count - 1;
        if (p.wrong == Wrong::kDtype) dtype = DataType::kInt32;
        at_call = true;
        if (p.wrong == Wrong::kOrder) {
          comm.AllReduce(Tensor{data.data(), 1, DataType::kFloat32}, ReduceOp::kSum);
        }
        comm.Recv(Tensor{got.data(), count, dtype}, 0, tag);
        at_call = false;
        ADD_FAILURE() << "rank 1: the mismatched receive went unnoticed";
      } else if (p.wrong == Wrong::kOrder) {
        comm.AllReduce(Tensor{data.data(), 1, DataType::kFloat32}, ReduceOp::kSum);
      }
      comm.Barrier();
      ADD_FAILURE() << "rank " << rank << ": the mismatch went unnoticed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMismatch) << "rank " << rank << ": " << e.what();
      error = e.what();
    }
    if (rank == 1) {
      EXPECT_TRUE(at_call) << "rank 1 raised past its receive: " << error;
      EXPECT_EQ(got, got_before) << "rank 1 wrote part of a mismatched message";
      if (p.wrong == Wrong::kWideTag) {
        EXPECT_NE(error.find("got tag " + std::to_string(int64_t{5} << 33)), std::string::npos)
            << error;
      }
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              test_time::Scaled(10.0))
        << "rank " << rank << ": " << error;
    EXPECT_THROW(comm.Barrier(), Error) << "rank " << rank << ": not broken after the mismatch";
  });
}

std::vector<FaultParam> FaultParams() {
  std::vector<FaultParam> params;
  for (Wrong w : {Wrong::kTag, Wrong::kWideTag, Wrong::kCount, Wrong::kDtype, Wrong::kOrder}) {
    for (Transport t : {Transport::kTcp, Transport::kAuto}) {
      // AUTO runs the all-reduce in shared memory, where no frame of the send meets it: the
      // order does not matter there as long as the socket buffers hold the message.
      if (w == Wrong::kOrder && t == Transport::kAuto) continue;
      params.push_back({w, t, 10});
      params.push_back({w, t, 100'000});
    }
  }
  return params;
}

std::string FaultName(const ::testing::TestParamInfo<FaultParam>& param) {
  static const char* const kWrong[] = {"Tag", "WideTag", "Count", "Dtype", "Order"};
  return std::string(kWrong[int(param.param.wrong)]) + TransportName(param.param.transport) +
         std::to_string(param.param.count);
}

INSTANTIATE_TEST_SUITE_P(Faults, PointToPointMismatchTest, ::testing::ValuesIn(FaultParams()),
                         FaultName);

// A receive that no send answers ends with kTimeout at the communicator's deadline; one whose
// peer is gone with kPeerLost (or kAborted) well before it.
TEST(PointToPointFaultTest, AReceiveWithoutSendTimesOutAndAGonePeerRaises) {
  for (Transport transport : {Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::milliseconds(500);
    std::atomic<bool> timed_out{false};
    RunRanks(transport, 2, options, [&](CollectiveCommunication& comm) {
      std::vector<int32_t> buffer(10, -1);
      if (comm.rank() == 1) {  // present, silent, until rank 0 has given up
        const auto cap = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (!timed_out && std::chrono::steady_clock::now() < cap) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return;
      }
      {
        const auto start = std::chrono::steady_clock::now();
        try {
          comm.Recv(Tensor{buffer.data(), 10, DataType::kInt32}, 1, 0);
          ADD_FAILURE() << "a receive without a send returned";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
          EXPECT_NE(std::string(e.what()).find("send(i32, tag=0, count=10)"), std::string::npos)
              << e.what();
        }
        EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(450));
        timed_out = true;
      }
    });
    options.timeout = std::chrono::seconds(20);
    std::atomic<bool> past_barrier{false};
    RunRanks(transport, 2, options, [&](CollectiveCommunication& comm) {
      comm.Barrier();
      if (comm.rank() == 1) {  // gone once rank 0 is past the barrier: its connections close
        const auto cap = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (!past_barrier && std::chrono::steady_clock::now() < cap) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        return;
      }
      past_barrier = true;
      std::vector<int32_t> buffer(10, -1);
      const auto start = std::chrono::steady_clock::now();
      try {
        comm.Recv(Tensor{buffer.data(), 10, DataType::kInt32}, 1, 0);
        ADD_FAILURE() << "a receive from a rank that is gone returned";
      } catch (const Error& e) {
        EXPECT_TRUE(e.code() == ErrorCode::kPeerLost || e.code() == ErrorCode::kAborted)
            << e.what();
      }
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                test_time::Scaled(10.0));
    });
  }
}

TEST(PointToPointFaultTest, BadArgumentsRaiseInvalidArgument) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(20);
  RunRanks(Transport::kTcp, 2, options, [&](CollectiveCommunication& comm) {
    std::vector<float> data(4, 1.f);
    const Tensor t{data.data(), 4, DataType::kFloat32};
    const auto expect_invalid = [&](const std::function<void()>& call, const std::string& words) {
      try {
        call();
        ADD_FAILURE() << "no error; expected: " << words;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    };
    expect_invalid([&] { comm.Send(t, comm.rank(), 0); }, "is this rank");
    expect_invalid([&] { comm.Recv(t, 2, 0); }, "recv: peer 2 is not a rank");
    expect_invalid([&] { comm.SendAsync(t, -1, 0); }, "send: peer -1");
    expect_invalid(
        [&] {
          comm.Send(Tensor{nullptr, 4, DataType::kFloat32}, 1 - comm.rank(), 0);
        },
        "send: message tensor has null data");
    // Still usable, and the numbering of messages is untouched by the refused calls.
    if (comm.rank() == 0) comm.Send(t, 1, 3);
    if (comm.rank() == 1) {
      std::vector<float> got(4, 0.f);
      comm.Recv(Tensor{got.data(), 4, DataType::kFloat32}, 0, 3);
      EXPECT_EQ(got, data);
    }
  });
}

}  // namespace
}  // namespace collectives::testing
