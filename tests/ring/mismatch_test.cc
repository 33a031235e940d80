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
// for a round in which every rank compares its call with every other's (CallAgreement); shared
// memory checks every member's call before any step writes.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/communication.h"
#include "collectives/errors.h"
#include "tests/ring/run_ranks.h"

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

TEST_P(MismatchTest, EveryRankRaisesMismatchAndNoBufferIsWrittenWhenAllDiffer) {
  const auto [differ, size, all_differ, transport, base] = GetParam();
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(10);
  RunRanks(transport, size, options, [&, differ = differ, size = size, all_differ = all_differ,
                                      base = base](
                                         CollectiveCommunication& comm) {
    const Call call = CallFor(differ, comm.rank(), size, all_differ, base);
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
      ADD_FAILURE() << "rank " << comm.rank() << ": a mismatched " << Name(differ)
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
                       ::testing::Values(Transport::kInProcess, Transport::kTcp,
                                         Transport::kAuto),
                       ::testing::Values(size_t{1000}, size_t{100000})),
    ParamName);

}  // namespace
}  // namespace collectives::testing
