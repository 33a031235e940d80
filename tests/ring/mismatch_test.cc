// Ranks that issue different calls: a different count, dtype, op, collective or root. Every rank
// raises kMismatch (none hangs, none succeeds at the call after it), the detecting ranks name
// both calls, and the communicator stays broken.
//
// Whether one rank differs or all do ("all differ": rank r uses count base + 4r, the r-th dtype,
// the r-th op, ...), at a small size (recursive doubling, the tree) and a large one (the ring at
// 2 and 3 ranks, halving-doubling at 4, the chain, all-gather, reduce-scatter), the mismatched
// call itself raises on every rank and neither its send nor its recv buffer changed: recursive
// doubling writes the caller's buffer only in its last round, which no rank reaches; the ring,
// halving-doubling and reduce-scatter keep partial sums in staging until a frame checked hop by
// hop through every rank arrives; all-gather and the broadcasts wait, before their first write,
// for a round in which every rank compares its call with every other's (CallAgreement; with two
// ranks a data frame stands in for an empty one, which TwoRankMismatchTest covers); shared
// memory checks every member's call before any step writes.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/communication.h"
#include "collectives/errors.h"
#include "tests/ring/run_ranks.h"
#include "tests/time_scale.h"

namespace collectives::testing {
namespace {

enum class Differ { kCount, kDtype, kOp, kCollective, kRoot };
const char* Name(Differ d) {
  switch (d) {
    case Differ::kCount: return "count";
    case Differ::kDtype: return "dtype";
    case Differ::kOp: return "op";
    case Differ::kCollective: return "collective";
    case Differ::kRoot: return "root";
  }
  return "?";
}

// What rank `rank` calls. `all_differ`: every rank's call differs from every other's where the
// parameter allows; else only the last rank differs.
struct Call {
  std::string collective = "all_reduce";
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
};

Call CallFor(Differ differ, int rank, int size, bool all_differ, size_t base) {
  Call call;
  call.count = base;
  const int variant = all_differ ? rank : (rank == size - 1 ? 1 : 0);
  static const DataType kDtypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kInt32,
                                     DataType::kInt64};
  static const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin,
                                  ReduceOp::kProd};
  static const char* kCollectives[] = {"all_reduce", "all_gather", "reduce_scatter",
                                       "broadcast"};
  switch (differ) {
    case Differ::kCount: call.count = base + size_t(variant) * 4; break;
    case Differ::kDtype: call.dtype = kDtypes[variant]; break;
    case Differ::kOp: call.op = kOps[variant]; break;
    case Differ::kCollective: call.collective = kCollectives[variant]; break;
    case Differ::kRoot:
      call.collective = "broadcast";
      call.root = variant;
      break;
  }
  return call;
}

// What differs, world size, all differ, transport, elements per call (1000: the small-message
// algorithms; 100000, 400 KB of f32: the large ones).
using Param = std::tuple<Differ, int, bool, Transport, size_t>;

class MismatchTest : public ::testing::TestWithParam<Param> {};

// Runs `size` ranks, rank r issuing call_of(r), and checks that every rank raised kMismatch at
// that call, that the communicator stays broken, and that neither buffer of any rank changed.
void ExpectMismatchEverywhereWithBuffersUntouched(Transport transport, int size,
                                                  const std::function<Call(int)>& call_of) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(10);
  RunRanks(transport, size, options, [&](CollectiveCommunication& comm) {
    const Call call = call_of(comm.rank());
    const size_t bytes = call.count * SizeOf(call.dtype);
    // Send and receive buffers, large enough for an all-gather's output, filled with a marker.
    std::vector<uint8_t> send(bytes * size_t(size), 0x5a);
    std::vector<uint8_t> recv(bytes * size_t(size), 0xa5);
    const std::vector<uint8_t> send_before = send;
    const Tensor in{send.data(), call.count, call.dtype};
    auto issue = [&] {
      if (call.collective == "all_reduce") {
        comm.AllReduce(in, call.op);  // in place: a write would show in `send`
      } else if (call.collective == "all_gather") {
        comm.AllGather(in, Tensor{recv.data(), call.count * size_t(size), call.dtype});
      } else if (call.collective == "reduce_scatter") {
        comm.ReduceScatter(Tensor{send.data(), call.count * size_t(size), call.dtype},
                           Tensor{recv.data(), call.count, call.dtype}, call.op);
      } else {
        comm.Broadcast(in, Tensor{recv.data(), call.count, call.dtype}, call.root);
      }
    };
    std::string error;
    bool raised_at_call = false;
    try {
      issue();
      comm.Barrier();
      ADD_FAILURE() << "rank " << comm.rank() << ": a mismatched " << call.collective
                    << " went unnoticed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMismatch) << "rank " << comm.rank() << ": " << e.what();
      error = e.what();
      raised_at_call = error.find("barrier") == std::string::npos;
    }
    // Broken for good.
    try {
      comm.Barrier();
      ADD_FAILURE() << "rank " << comm.rank() << ": a broken communicator ran a barrier";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
    }
    // Whatever differs and whichever ranks differ: the call itself raised, and neither buffer
    // changed (an in-place all-reduce's result would show in `send`).
    EXPECT_TRUE(raised_at_call) << "rank " << comm.rank() << ": " << error;
    EXPECT_TRUE(send == send_before) << "rank " << comm.rank() << ": send was written: " << error;
    EXPECT_TRUE(recv == std::vector<uint8_t>(recv.size(), 0xa5))
        << "rank " << comm.rank() << ": recv was written: " << error;
  });
}

TEST_P(MismatchTest, EveryRankRaisesMismatchAndNoBufferIsWrittenWhenAllDiffer) {
  const auto [differ, size, all_differ, transport, base] = GetParam();
  ExpectMismatchEverywhereWithBuffersUntouched(
      transport, size,
      [differ = differ, size = size, all_differ = all_differ, base = base](int rank) {
        return CallFor(differ, rank, size, all_differ, base);
      });
}

std::string ParamName(const ::testing::TestParamInfo<Param>& param_info) {
  const auto& [differ, size, all_differ, transport, base] = param_info.param;
  return std::string(Name(differ)) + "_" + std::to_string(size) + "ranks_" +
         (all_differ ? "all_differ" : "one_differs") + (base > 1000 ? "_large_" : "_small_") +
         TransportName(transport);
}

INSTANTIATE_TEST_SUITE_P(
    Ring, MismatchTest,
    ::testing::Combine(::testing::Values(Differ::kCount, Differ::kDtype, Differ::kOp,
                                         Differ::kCollective, Differ::kRoot),
                       ::testing::Values(2, 3, 4), ::testing::Bool(),
                       ::testing::Values(Transport::kInProcess, Transport::kTcp, Transport::kAuto,
                                         Transport::kTcpInPieces),
                       ::testing::Values(size_t{1000}, size_t{100000})),
    ParamName);

// With two ranks, a broadcast's or an all-gather's data frame stands in for the empty frame of
// the call agreement on its connection (CallAgreement::Pair). Pairs of large calls (past the
// small-message size, so the agreement path) where that matters: each rank taking the other
// for the root, both taking themselves, a broadcast against an all-gather either way, and
// all-gathers or broadcasts that differ in count or dtype only.
struct TwoRankPair {
  const char* name;
  Call first;
  Call second;
};

void PrintTo(const TwoRankPair& pair, std::ostream* os) { *os << pair.name; }

Call Large(const char* collective, int root = 0, size_t count = 100000,
           DataType dtype = DataType::kFloat32) {
  Call call;
  call.collective = collective;
  call.root = root;
  call.count = count;
  call.dtype = dtype;
  return call;
}

class TwoRankMismatchTest : public ::testing::TestWithParam<std::tuple<TwoRankPair, Transport>> {};

TEST_P(TwoRankMismatchTest, BothRaiseAndNeitherBufferIsWritten) {
  const auto& [pair, transport] = GetParam();
  ExpectMismatchEverywhereWithBuffersUntouched(
      transport, 2, [&pair = pair](int rank) { return rank == 0 ? pair.first : pair.second; });
}

const TwoRankPair kTwoRankPairs[] = {
    {"each_takes_the_other_for_root", Large("broadcast", 1), Large("broadcast", 0)},
    {"both_take_themselves_for_root", Large("broadcast", 0), Large("broadcast", 1)},
    {"broadcast_root_against_all_gather", Large("broadcast", 0), Large("all_gather")},
    {"broadcast_receiver_against_all_gather", Large("broadcast", 1), Large("all_gather")},
    {"all_gather_against_broadcast_root", Large("all_gather"), Large("broadcast", 1)},
    {"all_gather_counts", Large("all_gather"), Large("all_gather", 0, 100004)},
    {"all_gather_dtypes_of_one_size", Large("all_gather"),
     Large("all_gather", 0, 100000, DataType::kInt32)},
    {"broadcast_counts", Large("broadcast", 0), Large("broadcast", 0, 100004)},
    {"broadcast_dtypes_of_one_size", Large("broadcast", 1),
     Large("broadcast", 1, 100000, DataType::kInt32)},
    {"all_gather_against_all_reduce", Large("all_gather"), Large("all_reduce")},
};

std::string TwoRankName(
    const ::testing::TestParamInfo<std::tuple<TwoRankPair, Transport>>& param_info) {
  return std::string(std::get<0>(param_info.param).name) + "_" +
         TransportName(std::get<1>(param_info.param));
}

INSTANTIATE_TEST_SUITE_P(Ring, TwoRankMismatchTest,
                         ::testing::Combine(::testing::ValuesIn(kTwoRankPairs),
                                            ::testing::Values(Transport::kInProcess,
                                                              Transport::kTcp,
                                                              Transport::kTcpInPieces)),
                         TwoRankName);

}  // namespace
}  // namespace collectives::testing

namespace collectives::testing {
namespace {

// A Split's exchange of colors and keys is a collective of its own kind: a rank that splits
// while its peer all-gathers two int64 (what the exchange moves) raises kMismatch on both, naming
// the split. Taken for an all-gather, the exchange would hand the peer the splitting rank's
// color and key as its data, and leave the splitting rank waiting in the child's set-up until
// the timeout.
TEST(SplitMismatchTest, ASplitAgainstAnAllGatherOfTwoInt64IsAMismatch) {
  for (Transport transport : {Transport::kTcp, Transport::kAuto}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(10);
    RunRanks(transport, 2, options, [&](CollectiveCommunication& comm) {
      const auto start = std::chrono::steady_clock::now();
      try {
        if (comm.rank() == 0) {
          comm.Split(0, 0);
        } else {
          std::vector<int64_t> mine = {7, 7}, all(4, -1);
          comm.AllGather(Tensor{mine.data(), 2, DataType::kInt64},
                         Tensor{all.data(), 4, DataType::kInt64});
        }
        ADD_FAILURE() << TransportName(transport) << ": rank " << comm.rank()
                      << ": a split against an all-gather went unnoticed";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kMismatch) << TransportName(transport) << ": " << e.what();
        EXPECT_NE(e.message().find("split(i64, count=2)"), std::string::npos) << e.what();
      }
      EXPECT_LT(std::chrono::steady_clock::now() - start,
                test_time::Scaled(std::chrono::seconds(5)))
          << TransportName(transport) << ": rank " << comm.rank();
    });
  }
}

}  // namespace
}  // namespace collectives::testing
