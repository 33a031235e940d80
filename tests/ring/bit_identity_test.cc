// Every rank ends a float reduction with the same bits, where the order of the additions could
// differ between ranks; and broadcast from every root.
//
// The matrix tests (ring_test.cc) reduce small integers, which add up exactly in any order: a rank
// that reduced in another order than its peers would pass there. Here the inputs are random
// floats spread over many binades (tests/ring/float_inputs.h), all-reduced with kSum and kAvg in
// f32, f64, f16 and bf16, and reduce-scattered, on 3, 5, 6 and 8 ranks (with 2, every reduction
// is a single commutative addition) through each RING algorithm, forced: the ring, recursive
// doubling (its fold for non-powers of two included) and halving-doubling. The result must be
// the same bytes on every rank, and exactly the sum in the order the algorithm adds (each
// algorithm fixes it), which the test checks would differ from another order somewhere. Then
// the same across processes, with shared memory and the two-level all-reduce over pretend hosts,
// where the order is the planner's: there the fingerprints of the results must agree across
// ranks and every element be within rounding of the exact sum.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <ostream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/communication.h"
#include "tests/ring/float_inputs.h"
#include "tests/ring/run_ranks.h"
#include "tests/ring/worker_processes.h"

namespace collectives {
namespace {

using testing::CloseToExactSum;
using testing::ExpectedInOrder;
using testing::FloatAt;
using testing::Order;
using testing::RandomFloats;
using testing::RunRanks;
using testing::Transport;

constexpr DataType kFloatTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                                    DataType::kBFloat16};
constexpr ReduceOp kSumAndAvg[] = {ReduceOp::kSum, ReduceOp::kAvg};
// All-reduce counts: one element; fewer than the ranks (empty blocks); a few chunks per block;
// more than small_message_bytes (64 KiB) even in f16, and several iterations of the ring's
// slices; and, in f32 only, a large one.
constexpr size_t kAllReduceCounts[] = {1, 7, 4099, 65539};
constexpr size_t kLargeCount = 300007;
// Reduce-scatter counts per rank.
constexpr size_t kReduceScatterCounts[] = {1, 7, 4099};

struct IdentityParam {
  Transport transport;
  int size;
  Order order;
};

// Options that make the RING implementation all-reduce (and reduce-scatter) in `order` at every
// size: the ring and halving-doubling with small chunks (many per block), recursive doubling
// always (its reduce-scatter too, SmallReduceScatter).
CommunicationOptions OptionsFor(Order order) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(120);
  options.algorithm = testing::OrderName(order);
  options.small_message_bytes = order == Order::kRecursiveDoubling ? SIZE_MAX : 1;
  options.chunk_bytes = order == Order::kRecursiveDoubling ? 0 : 8192;
  return options;
}

// What one rank got from one call, kept for the checks after every rank has finished.
struct Call {
  std::string what;
  DataType dtype;
  ReduceOp op;
  bool reduce_scatter;
  size_t count;  // elements of the all-reduce, or per rank of the reduce-scatter
  uint64_t seed;
  std::vector<std::vector<uint8_t>> results;  // per rank
};

// The checks of one call: identical bytes on every rank (all-reduce), the order's exact result,
// and closeness to the exact sum. Returns the number of elements whose expected value in
// `order` differs from the one in another order (the ranks' values added from the last rank to
// the first), to show that the inputs tell orders apart.
size_t CheckCall(const Call& call, Order order, int n) {
  SCOPED_TRACE(call.what);
  const size_t es = SizeOf(call.dtype);
  const size_t total = call.reduce_scatter ? call.count * size_t(n) : call.count;
  std::vector<std::vector<uint8_t>> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(RandomFloats(call.dtype, total, r, call.seed));
  if (!call.reduce_scatter) {
    for (int r = 1; r < n; ++r) {
      if (call.results[size_t(r)] != call.results[0]) {
        size_t i = 0;
        while (std::memcmp(call.results[size_t(r)].data() + i * es, call.results[0].data() + i * es,
                           es) == 0) {
          ++i;
        }
        ADD_FAILURE() << "rank " << r << " differs from rank 0 first at element " << i << ": "
                      << FloatAt(call.dtype, call.results[size_t(r)].data(), i) << " vs "
                      << FloatAt(call.dtype, call.results[0].data(), i);
        return 0;
      }
    }
  }
  size_t order_matters = 0;
  for (int r = 0; r < (call.reduce_scatter ? n : 1); ++r) {
    const std::vector<uint8_t>& got = call.results[size_t(r)];
    const size_t first = call.reduce_scatter ? size_t(r) * call.count : 0;
    for (size_t j = 0; j < got.size() / es; ++j) {
      const size_t i = first + j;
      const uint64_t want = ExpectedInOrder(call.dtype, call.op, order, inputs, total, i);
      const uint64_t bits = testing::BitsAt(call.dtype, got.data(), j);
      if (bits != want) {
        uint64_t want_cell = want;
        ADD_FAILURE() << "rank " << r << " element " << i << " is "
                      << FloatAt(call.dtype, got.data(), j) << ", the sum in the "
                      << testing::OrderName(order) << " order "
                      << FloatAt(call.dtype, &want_cell, 0) << std::hex << " (bits 0x" << bits
                      << " vs 0x" << want << ")";
        return order_matters;
      }
      std::string why;
      if (!CloseToExactSum(call.dtype, call.op, inputs, i, FloatAt(call.dtype, got.data(), j),
                           &why)) {
        ADD_FAILURE() << "rank " << r << ": " << why;
        return order_matters;
      }
      // The same values added in another order, from the last rank to the first.
      uint64_t other = testing::BitsAt(call.dtype, inputs[size_t(n - 1)].data(), i);
      for (int k = n - 2; k >= 0; --k) {
        other = testing::AddAsKernels(
            call.dtype, testing::BitsAt(call.dtype, inputs[size_t(k)].data(), i), other);
      }
      if (call.op == ReduceOp::kAvg) other = testing::DivideAsKernels(call.dtype, other, size_t(n));
      if (other != want) ++order_matters;
    }
  }
  return order_matters;
}

void PrintTo(const IdentityParam& p, std::ostream* os) {
  *os << testing::TransportName(p.transport) << ", " << p.size << " ranks, "
      << testing::OrderName(p.order);
}

class BitIdentityTest : public ::testing::TestWithParam<IdentityParam> {};

TEST_P(BitIdentityTest, EveryRankEndsWithTheBitsOfTheAlgorithmsOrder) {
  const IdentityParam p = GetParam();
  const bool reduce_scatter = p.order != Order::kHalvingDoubling;  // no halving-doubling one
  // The calls, in the order every rank issues them.
  std::vector<Call> calls;
  for (DataType dtype : kFloatTypes) {
    for (ReduceOp op : kSumAndAvg) {
      for (size_t count : kAllReduceCounts) {
        calls.push_back({"", dtype, op, false, count, calls.size() + 1, {}});
      }
      if (dtype == DataType::kFloat32) {
        calls.push_back({"", dtype, op, false, kLargeCount, calls.size() + 1, {}});
      }
      if (!reduce_scatter) continue;
      for (size_t count : kReduceScatterCounts) {
        calls.push_back({"", dtype, op, true, count, calls.size() + 1, {}});
      }
    }
  }
  for (size_t c = 0; c < calls.size(); ++c) {
    Call& call = calls[c];
    std::ostringstream what;
    what << (call.reduce_scatter ? "reduce_scatter " : "all_reduce ") << ToString(call.dtype) << " "
         << ToString(call.op) << " count=" << call.count
         << (c % 2 == 1 ? " in place" : " out of place") << ", " << p.size << " ranks, "
         << testing::OrderName(p.order);
    call.what = what.str();
    call.results.resize(size_t(p.size));
  }

  RunRanks(p.transport, p.size, OptionsFor(p.order), [&](CollectiveCommunication& comm) {
    const int n = comm.size();
    const int rank = comm.rank();
    for (size_t c = 0; c < calls.size(); ++c) {
      Call& call = calls[c];
      const size_t es = SizeOf(call.dtype);
      const bool in_place = c % 2 == 1;
      const size_t total = call.reduce_scatter ? call.count * size_t(n) : call.count;
      std::vector<uint8_t> send = RandomFloats(call.dtype, total, rank, call.seed);
      std::vector<uint8_t>& result = call.results[size_t(rank)];  // this rank's alone
      if (call.reduce_scatter) {
        const Tensor whole{send.data(), total, call.dtype};
        if (in_place) {
          uint8_t* own = send.data() + size_t(rank) * call.count * es;
          comm.ReduceScatter(whole, Tensor{own, call.count, call.dtype}, call.op);
          result.assign(own, own + call.count * es);
        } else {
          result.assign(call.count * es, 0xA5);
          comm.ReduceScatter(whole, Tensor{result.data(), call.count, call.dtype}, call.op);
        }
      } else {
        EXPECT_EQ(comm.AllReduceAlgorithm(send.size()), testing::OrderName(p.order)) << call.what;
        if (in_place) {
          comm.AllReduce(Tensor{send.data(), total, call.dtype}, call.op);
          result = send;
        } else {
          const std::vector<uint8_t> before = send;
          result.assign(send.size(), 0xA5);
          comm.AllReduce(Tensor{send.data(), total, call.dtype},
                         Tensor{result.data(), total, call.dtype}, call.op);
          EXPECT_EQ(send, before) << "rank " << rank << " " << call.what << ": send was written";
        }
      }
    }
  });

  for (const Call& call : calls) {
    const size_t order_matters = CheckCall(call, p.order, p.size);
    if (::testing::Test::HasFailure()) return;
    // The inputs tell this order from another one, so a rank that added in another order would
    // have been seen.
    if (call.count * (call.reduce_scatter ? size_t(p.size) : 1) >= 4099) {
      EXPECT_GT(order_matters, 0u) << call.what;
    }
  }
}

std::vector<IdentityParam> IdentityParams() {
  std::vector<IdentityParam> params;
  for (int size : {3, 5, 6, 8}) {
    params.push_back({Transport::kInProcess, size, Order::kRing});
    params.push_back({Transport::kInProcess, size, Order::kRecursiveDoubling});
  }
  for (int size : {4, 8}) params.push_back({Transport::kInProcess, size, Order::kHalvingDoubling});
  // Over loopback TCP too, where frames arrive in other pieces and at other times.
  params.push_back({Transport::kTcp, 5, Order::kRing});
  params.push_back({Transport::kTcp, 6, Order::kRecursiveDoubling});
  params.push_back({Transport::kTcp, 8, Order::kHalvingDoubling});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Ring, BitIdentityTest, ::testing::ValuesIn(IdentityParams()),
                         [](const ::testing::TestParamInfo<IdentityParam>& param_info) {
                           const IdentityParam& p = param_info.param;
                           std::string order = p.order == Order::kRing ? "Ring"
                                               : p.order == Order::kRecursiveDoubling
                                                   ? "RecursiveDoubling"
                                                   : "HalvingDoubling";
                           return std::string(p.transport == Transport::kTcp ? "Tcp"
                                                                             : "InProcess") +
                                  std::to_string(p.size) + "Ranks" + order;
                         });

// Broadcast from every root of 3, 6 and 8 ranks, in place and out of place, at counts of f32
// that take each of its algorithms: none (0 elements), the small-message one (1 and 4099: at most
// small_message_bytes, 64 KiB), and the chain (16385: just above; 300007: 19 chunks of 64 KiB,
// more than the receive window's slots). Random bit patterns, NaNs among them, checked element by
// element on every rank; the root's send stays as it was, and nothing is written past recv.
struct BroadcastParam {
  Transport transport;
  int size;
};

void PrintTo(const BroadcastParam& p, std::ostream* os) {
  *os << testing::TransportName(p.transport) << ", " << p.size << " ranks";
}

class BroadcastEveryRootTest : public ::testing::TestWithParam<BroadcastParam> {};

TEST_P(BroadcastEveryRootTest, EveryRankGetsTheRootsElements) {
  const BroadcastParam p = GetParam();
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(120);
  options.chunk_bytes = 65536;
  constexpr uint32_t kGuard = 0xA5A5A5A5u;
  RunRanks(p.transport, p.size, options, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    for (int root = 0; root < comm.size(); ++root) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{4099}, size_t{16385}, size_t{300007}}) {
        for (bool in_place : {false, true}) {
          std::ostringstream what;
          what << "rank " << rank << ": broadcast from " << root << " of " << count << " f32 "
               << (in_place ? "in place" : "out of place") << " on " << comm.size() << " ranks";
          std::mt19937 rng(uint32_t(root * 1000003 + int(count) * 2 + int(in_place)));
          std::vector<uint32_t> expected(count);
          for (uint32_t& x : expected) x = uint32_t(rng());
          std::vector<uint32_t> recv(count + 1, kGuard);  // one guard element past the end
          const Tensor out{recv.data(), count, DataType::kFloat32};
          if (rank == root && in_place) {
            std::copy(expected.begin(), expected.end(), recv.begin());
            comm.Broadcast(out, root);
          } else if (rank == root) {
            std::vector<uint32_t> send = expected;
            comm.Broadcast(Tensor{send.data(), count, DataType::kFloat32}, out, root);
            EXPECT_EQ(send, expected) << what.str() << ": the root's send was written";
          } else if (in_place) {
            comm.Broadcast(out, root);
          } else {
            comm.Broadcast(Tensor{}, out, root);
          }
          for (size_t i = 0; i < count; ++i) {
            if (recv[i] != expected[i]) {
              ADD_FAILURE() << what.str() << ": element " << i << " is 0x" << std::hex << recv[i]
                            << ", the root's 0x" << expected[i];
              break;
            }
          }
          EXPECT_EQ(recv[count], kGuard) << what.str() << ": written past the end";
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Ring, BroadcastEveryRootTest,
    ::testing::Values(BroadcastParam{Transport::kInProcess, 3},
                      BroadcastParam{Transport::kInProcess, 6},
                      BroadcastParam{Transport::kInProcess, 8}, BroadcastParam{Transport::kTcp, 6}),
    [](const ::testing::TestParamInfo<BroadcastParam>& param_info) {
      return std::string(param_info.param.transport == Transport::kTcp ? "Tcp" : "InProcess") +
             std::to_string(param_info.param.size) + "Ranks";
    });

// Processes on pretend hosts (COLLECTIVES_HOST_ID), AUTO: shared memory inside a host, and the
// two-level all-reduce (forced, so that it runs at every size), whose order of additions is the
// planner's: inside a host each member sums its slice over the members, the slices cross hosts by
// recursive doubling or the ring, and kAvg divides once. ring_worker's identity mode all-reduces
// random f32 with kSum and f16 with kAvg, odd counts from one element to several slots' worth,
// and prints a fingerprint of each result; they must agree across every rank, and every element
// be within rounding of the exact result.
struct ProcessParam {
  const char* name;
  std::vector<std::string> host_ids;
  std::string algorithm;             // RING_WORKER_ALGORITHM
  std::string slot_bytes;            // COLLECTIVES_SHM_SLOT_BYTES of every rank, or empty
  std::set<std::string> algorithms;  // what AllReduceAlgorithm may say
};

void PrintTo(const ProcessParam& p, std::ostream* os) { *os << p.name; }

class ProcessBitIdentityTest : public ::testing::TestWithParam<ProcessParam> {};

TEST_P(ProcessBitIdentityTest, EveryRankEndsWithTheSameBits) {
  const ProcessParam& p = GetParam();
  const int size = int(p.host_ids.size());
  testing::Placement placement;
  placement.host_ids = p.host_ids;
  placement.algorithm = p.algorithm;
  if (!p.slot_bytes.empty()) placement.slot_bytes.assign(size_t(size), p.slot_bytes);
  std::vector<testing::Worker> workers =
      testing::Start(size, {"identity", "1", "7", "4099", "65539", "300007"}, placement);
  const bool finished = testing::WaitAll(workers, testing::All(size), std::chrono::seconds(240));
  testing::KillAll(workers);
  ASSERT_TRUE(finished) << "workers did not finish in time";
  // "dtype op count" -> the fingerprint of each rank that printed one.
  std::map<std::string, std::map<int, std::string>> fingerprints;
  for (int rank = 0; rank < size; ++rank) {
    const testing::Worker& w = workers[size_t(rank)];
    EXPECT_TRUE(WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)
        << "rank " << rank << " status " << w.status << ": " << w.output;
    EXPECT_NE(w.output.find("rank " + std::to_string(rank) + ": 0 far"), std::string::npos)
        << w.output;
    std::istringstream lines(w.output);
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream words(line);
      std::string rank_word, colon_rank, mode, dtype, op, count, fingerprint, algorithm;
      words >> rank_word >> colon_rank >> mode >> dtype >> op >> count >> fingerprint >> algorithm;
      if (mode != "identity") continue;
      fingerprints[dtype + " " + op + " " + count][rank] = fingerprint;
      EXPECT_TRUE(p.algorithms.count(algorithm) == 1) << "rank " << rank << ": " << line;
    }
  }
  EXPECT_EQ(fingerprints.size(), 10u);  // 5 counts x (f32 sum, f16 avg)
  for (const auto& [call, by_rank] : fingerprints) {
    ASSERT_EQ(by_rank.size(), size_t(size)) << call;
    for (const auto& [rank, fingerprint] : by_rank) {
      EXPECT_EQ(fingerprint, by_rank.begin()->second)
          << call << ": rank " << rank << "'s result differs from rank 0's";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Auto, ProcessBitIdentityTest,
    ::testing::Values(
        // One host: every all-reduce in shared memory (small ones reduced by every member in
        // member order, larger ones a slice per member), with 64 KiB slots: many steps.
        ProcessParam{"OneHostOfThree", {"a", "a", "a"}, "", "65536", {"shm", "shm_small"}},
        ProcessParam{"TwoHostsOfTwo", {"a", "a", "b", "b"}, "two_level", "", {"two_level"}},
        ProcessParam{
            "TwoHostsOfThree", {"a", "a", "a", "b", "b", "b"}, "two_level", "65536", {"two_level"}},
        // Three hosts: the crossing itself adds in an order that matters (recursive doubling
        // with its fold, or the ring of three).
        ProcessParam{
            "ThreeHostsOfTwo", {"a", "a", "b", "b", "c", "c"}, "two_level", "", {"two_level"}},
        // Hosts of different rank counts: as many lanes cross as the smallest host of several
        // ranks has; a rank alone on its host takes part in every lane, ranks past the lanes
        // only add their input (and the hosts' ranks need not be consecutive).
        ProcessParam{"HostsOfTwoAndOne", {"a", "a", "b"}, "two_level", "65536", {"two_level"}},
        ProcessParam{"HostsOfThreeAndTwoInterleaved",
                     {"a", "b", "a", "b", "a"},
                     "two_level",
                     "65536",
                     {"two_level"}},
        ProcessParam{"HostsOfOneTwoAndThree",
                     {"a", "b", "b", "c", "c", "c"},
                     "two_level",
                     "",
                     {"two_level"}},
        ProcessParam{"HostsOfOneOneAndThree",
                     {"a", "b", "c", "c", "c"},
                     "two_level",
                     "65536",
                     {"two_level"}}),
    [](const ::testing::TestParamInfo<ProcessParam>& param_info) {
      return std::string(param_info.param.name);
    });

}  // namespace
}  // namespace collectives
