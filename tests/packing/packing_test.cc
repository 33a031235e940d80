// The packer: bucket plans for every edge case (exact bucket lists), properties of plans over
// random lists, and multi-rank AllReduce / Broadcast of tensor lists (ranks as threads, over the
// in-process transport and over loopback TCP) whose results must equal, byte for byte, one
// collective per tensor; the schedule (in place for single tensors, at most two buckets in
// flight, fusion buffers within the cap) seen through a recording communicator; argument checks;
// ranks whose lists differ end in kMismatch, not a hang.
//
// One file: the plan and list suites build their lists with Spec(), and the multi-rank suites
// share TensorList, MixedList, ForEachOddRank and ExpectListsDiffer.
#include "collectives/packing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/core/internal_communication.h"
#include "src/core/kernels.h"
#include "src/packing/schedule.h"
#include "src/ring/ring_communication.h"
#include "src/transport/inproc_fabric.h"
#include "tests/ring/collective_checks.h"
#include "tests/ring/run_ranks.h"
#include "tests/scoped_env.h"
#include "tests/time_scale.h"

namespace collectives::packing {
namespace {

using internal::Schedule;
using testing::InputValue;
using testing::Load;

constexpr DataType kF32 = DataType::kFloat32;
constexpr DataType kF16 = DataType::kFloat16;
constexpr DataType kF64 = DataType::kFloat64;
constexpr DataType kI32 = DataType::kInt32;
constexpr DataType kI8 = DataType::kInt8;

TensorSpec Spec(DataType dtype, size_t count, Device device = Device::Cpu()) {
  return TensorSpec{dtype, device, count};
}

// ---------------------------------------------------------------------------------------------
// PlanBuckets: exact plans.
// ---------------------------------------------------------------------------------------------

TEST(PlanBucketsTest, EmptyListHasNoBuckets) {
  EXPECT_TRUE(PlanBuckets({}, 0).empty());
  EXPECT_TRUE(PlanBuckets({}, 1).empty());
}

TEST(PlanBucketsTest, ConsecutiveTensorsFillBucketsUpToTheCap) {
  // 40, 40, 20 bytes fill a 100-byte bucket exactly; 4 more bytes open the next.
  const std::vector<TensorSpec> tensors = {Spec(kF32, 10), Spec(kF32, 10), Spec(kF32, 5),
                                           Spec(kF32, 1),  Spec(kF32, 24), Spec(kF32, 1)};
  EXPECT_EQ(PlanBuckets(tensors, 100), (std::vector<Bucket>{{0, 1, 2}, {3, 4}, {5}}));
  // 99: 40 + 40, then 20 + 4, then 96 alone (100 > 99), then 4.
  EXPECT_EQ(PlanBuckets(tensors, 99), (std::vector<Bucket>{{0, 1}, {2, 3}, {4}, {5}}));
}

TEST(PlanBucketsTest, ATensorOfExactlyTheCapFitsAnEmptyBucket) {
  const std::vector<TensorSpec> tensors = {Spec(kF32, 25), Spec(kF32, 25), Spec(kF32, 0)};
  EXPECT_EQ(PlanBuckets(tensors, 100), (std::vector<Bucket>{{0}, {1, 2}}));
}

TEST(PlanBucketsTest, ZeroSizeTensorsJoinTheOpenBucketOfTheirKind) {
  const std::vector<TensorSpec> tensors = {
      Spec(kF32, 0),                                 // opens the f32 bucket
      Spec(kF32, 10), Spec(kF32, 0), Spec(kF16, 0),  // the f16 one opens its own bucket
      Spec(kF32, 15), Spec(kF32, 0),                 // 100 bytes: full, yet 0 bytes still fit
      Spec(kF16, 4),  Spec(kF32, 1), Spec(kF32, 0)};
  EXPECT_EQ(PlanBuckets(tensors, 100), (std::vector<Bucket>{{0, 1, 2, 4, 5}, {3, 6}, {7, 8}}));
  // Only zero-size tensors: one bucket per kind.
  EXPECT_EQ(PlanBuckets({Spec(kF32, 0), Spec(kI32, 0), Spec(kF32, 0)}, 1),
            (std::vector<Bucket>{{0, 2}, {1}}));
}

TEST(PlanBucketsTest, InterleavedDtypesGetOneOpenBucketEach) {
  // f32, f16, i32, f64 interleaved, 8 of each kind; with a large cap one bucket per dtype,
  // in the order of their first tensor.
  std::vector<TensorSpec> tensors;
  const DataType kinds[] = {kF32, kF16, kI32, kF64};
  for (size_t i = 0; i < 32; ++i) tensors.push_back(Spec(kinds[i % 4], 3 + i));
  std::vector<Bucket> want(4);
  for (size_t i = 0; i < 32; ++i) want[i % 4].push_back(i);
  EXPECT_EQ(PlanBuckets(tensors, 1 << 20), want);

  // A cap of 16 bytes: each kind closes and opens its own buckets without disturbing the other.
  const std::vector<TensorSpec> small = {Spec(kF32, 2), Spec(kF16, 2), Spec(kF32, 2), Spec(kF16, 2),
                                         Spec(kF32, 1), Spec(kF16, 5), Spec(kF16, 1)};
  // f32: 8 + 8 = 16 fits, then 4 does not -> {0, 2}, {4}; f16: 4 + 4 + 10 = 18 > 16 ->
  // {1, 3}, {5, 6} (10 + 2 = 12).
  EXPECT_EQ(PlanBuckets(small, 16), (std::vector<Bucket>{{0, 2}, {1, 3}, {4}, {5, 6}}));
}

TEST(PlanBucketsTest, DevicesSplitBucketsLikeDtypes) {
  const Device cpu = Device::Cpu(), gpu0 = Device::Cuda(0), gpu1 = Device::Cuda(1);
  const std::vector<TensorSpec> tensors = {
      Spec(kF32, 4, cpu),  Spec(kF32, 4, gpu0), Spec(kF32, 4, gpu1), Spec(kF32, 4, cpu),
      Spec(kF32, 4, gpu0), Spec(kF16, 4, gpu0), Spec(kF32, 4, gpu1), Spec(kF32, 4, gpu0)};
  EXPECT_EQ(PlanBuckets(tensors, 1024), (std::vector<Bucket>{{0, 3}, {1, 4, 7}, {2, 6}, {5}}));
  EXPECT_EQ(PlanBuckets(tensors, 32), (std::vector<Bucket>{{0, 3}, {1, 4}, {2, 6}, {5}, {7}}));
}

TEST(PlanBucketsTest, OneHugeTensorIsAloneAndClosesTheOpenBucket) {
  const size_t huge = size_t{1} << 40;  // 4 TiB of f32: planning never touches data
  EXPECT_EQ(PlanBuckets({Spec(kF32, huge)}, 0), (std::vector<Bucket>{{0}}));
  const std::vector<TensorSpec> tensors = {Spec(kF32, 1), Spec(kF16, 1), Spec(kF32, huge),
                                           Spec(kF32, 1), Spec(kF16, 1), Spec(kF32, 0)};
  EXPECT_EQ(PlanBuckets(tensors, 1024), (std::vector<Bucket>{{0}, {1, 4}, {2}, {3, 5}}));
}

TEST(PlanBucketsTest, ACapSmallerThanEveryTensorGivesOneBucketPerTensor) {
  const std::vector<TensorSpec> tensors = {Spec(kF32, 1), Spec(kF64, 1), Spec(kF32, 3),
                                           Spec(kI8, 2)};
  EXPECT_EQ(PlanBuckets(tensors, 1), (std::vector<Bucket>{{0}, {1}, {2}, {3}}));
  // ... except zero-size tensors, which fit in any bucket but cannot join an oversize one.
  const std::vector<TensorSpec> with_empty = {Spec(kF32, 0), Spec(kF32, 2), Spec(kF32, 0),
                                              Spec(kF32, 0)};
  EXPECT_EQ(PlanBuckets(with_empty, 1), (std::vector<Bucket>{{0}, {1}, {2, 3}}));
}

TEST(PlanBucketsTest, CapZeroIsTheDefault) {
  const size_t cap = DefaultBytesPerPack();
  ASSERT_GE(cap, size_t{1} << 20);
  ASSERT_LE(cap, size_t{256} << 20);
  const size_t quarter = cap / 4 / sizeof(float);
  std::vector<TensorSpec> tensors(9, Spec(kF32, quarter));
  EXPECT_EQ(PlanBuckets(tensors, 0), PlanBuckets(tensors, cap));
  EXPECT_EQ(PlanBuckets(tensors, 0), (std::vector<Bucket>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8}}));
  tensors[0].count += 1;  // 4 bytes over
  EXPECT_EQ(PlanBuckets(tensors, 0), (std::vector<Bucket>{{0, 1, 2}, {3, 4, 5, 6}, {7, 8}}));
}

// A spec whose byte size does not fit size_t is larger than any cap (its product does not wrap
// to a few bytes and join its neighbours); a spec of no known dtype is refused.
TEST(PlanBucketsTest, AnOverflowingTensorIsAloneAndAnUnknownDtypeIsRefused) {
  const size_t huge = (size_t{1} << 62) + 1;  // x 4 bytes wraps to 4
  EXPECT_EQ(PlanBuckets({Spec(kF32, 1), Spec(kF32, huge), Spec(kF32, 1)}, 4096),
            (std::vector<Bucket>{{0}, {1}, {2}}));
  try {
    PlanBuckets({Spec(kF32, 1), Spec(static_cast<DataType>(42), 1)}, 4096);
    ADD_FAILURE() << "an unknown dtype was planned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("tensor 1 has an unknown dtype 42"), std::string::npos)
        << e.what();
  }
}

TEST(PlanBucketsTest, ACapOfSizeMaxPacksEachKindIntoOneBucket) {
  const std::vector<TensorSpec> tensors = {Spec(kF32, size_t{1} << 40), Spec(kF16, 7),
                                           Spec(kF32, size_t{1} << 40), Spec(kF16, 7)};
  EXPECT_EQ(PlanBuckets(tensors, SIZE_MAX), (std::vector<Bucket>{{0, 2}, {1, 3}}));
}

// Properties every plan has, over random lists and caps.
TEST(PlanBucketsTest, RandomListsGiveValidPlans) {
  std::mt19937_64 rng(12345);
  const DataType kinds[] = {kF32, kF16, kI32, kF64, kI8};
  const Device devices[] = {Device::Cpu(), Device::Cuda(0)};
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<TensorSpec> tensors(rng() % 60);
    for (TensorSpec& t : tensors) {
      t.dtype = kinds[rng() % 5];
      t.device = devices[rng() % 4 == 0 ? 1 : 0];
      t.count = rng() % 5 == 0 ? 0 : rng() % 300;
    }
    const size_t cap = 1 + rng() % 2000;
    const std::vector<Bucket> plan = PlanBuckets(tensors, cap);
    std::vector<int> seen(tensors.size(), 0);
    size_t last_first = 0;
    for (size_t b = 0; b < plan.size(); ++b) {
      const Bucket& bucket = plan[b];
      ASSERT_FALSE(bucket.empty());
      if (b > 0) {
        EXPECT_GT(bucket.front(), last_first) << "buckets out of order";
      }
      last_first = bucket.front();
      size_t bytes = 0;
      for (size_t k = 0; k < bucket.size(); ++k) {
        const size_t i = bucket[k];
        ASSERT_LT(i, tensors.size());
        ++seen[i];
        if (k > 0) {
          EXPECT_GT(i, bucket[k - 1]);
        }
        EXPECT_EQ(tensors[i].dtype, tensors[bucket[0]].dtype);
        EXPECT_EQ(tensors[i].device, tensors[bucket[0]].device);
        bytes += tensors[i].count * SizeOf(tensors[i].dtype);
      }
      if (bytes > cap) {  // only a single oversize tensor (with zero-size ones after it) exceeds
        size_t nonzero = 0;
        for (size_t i : bucket) nonzero += tensors[i].count > 0 ? 1 : 0;
        EXPECT_EQ(nonzero, 1u) << "trial " << trial;
        EXPECT_EQ(bucket.size(), 1u) << "an oversize tensor shares its bucket";
      }
    }
    for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << "tensor " << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Ranks as threads.
// ---------------------------------------------------------------------------------------------

using testing::RunRanks;
using testing::Transport;

// A list of tensors that owns its memory (each tensor its own allocation with a guard byte).
class TensorList {
 public:
  explicit TensorList(const std::vector<TensorSpec>& specs) : specs_(specs) {
    for (const TensorSpec& s : specs) storage_.emplace_back(s.count * SizeOf(s.dtype) + 1, 0xA5);
  }
  std::vector<Tensor> tensors() {
    std::vector<Tensor> out;
    for (size_t i = 0; i < specs_.size(); ++i) {
      out.push_back(Tensor{storage_[i].data(), specs_[i].count, specs_[i].dtype});
    }
    return out;
  }
  // Element j of tensor i = InputValue(op, dtype, rank, i * 7919 + j): small integers for which
  // every reduction is exact in every dtype, different per tensor, element and rank.
  void Fill(ReduceOp op, int rank) {
    for (size_t i = 0; i < specs_.size(); ++i) {
      for (size_t j = 0; j < specs_[i].count; ++j) {
        testing::Store(specs_[i].dtype, storage_[i].data(), j,
                       InputValue(op, specs_[i].dtype, rank, i * 7919 + j));
      }
    }
  }
  const std::vector<uint8_t>& bytes(size_t i) const { return storage_[i]; }
  std::vector<uint8_t>& bytes(size_t i) { return storage_[i]; }
  size_t size() const { return specs_.size(); }
  const TensorSpec& spec(size_t i) const { return specs_[i]; }

 private:
  std::vector<TensorSpec> specs_;
  std::vector<std::vector<uint8_t>> storage_;
};

// f32, f16, i32, f64 interleaved; zero-size tensors; counts that are multiples of nothing in
// particular; one tensor above the small-message threshold (64 KiB) so the ring runs too.
std::vector<TensorSpec> MixedList() {
  return {Spec(kF32, 7),    Spec(kF16, 13),    Spec(kI32, 1), Spec(kF64, 5),    Spec(kF32, 0),
          Spec(kF16, 1021), Spec(kI32, 333),   Spec(kF64, 0), Spec(kF32, 4099), Spec(kF16, 2),
          Spec(kI32, 0),    Spec(kF64, 1),     Spec(kF32, 1), Spec(kF16, 0),    Spec(kI32, 17),
          Spec(kF64, 257),  Spec(kF32, 20011), Spec(kF16, 3), Spec(kI32, 4096), Spec(kF64, 9),
          Spec(kF32, 0),    Spec(kF32, 5)};
}

// Caps from smaller than every tensor to larger than the whole list.
const std::vector<size_t>& Caps() {
  static const std::vector<size_t> kCaps = {1, 8, 100, 4096, 65536, 0, SIZE_MAX};
  return kCaps;
}

const std::vector<Schedule>& Schedules() {
  static const std::vector<Schedule> kSchedules = {Schedule::kOverlapped, Schedule::kSerial};
  return kSchedules;
}

const char* Name(Schedule schedule) {
  switch (schedule) {
    case Schedule::kAuto:
      return "auto";
    case Schedule::kOverlapped:
      return "overlapped";
    case Schedule::kSerial:
      return "serial";
  }
  return "?";
}

std::string Describe(const TensorList& list, size_t i) {
  return "tensor " + std::to_string(i) + " (" + ToString(list.spec(i).dtype) + " x" +
         std::to_string(list.spec(i).count) + ")";
}

// On every rank: one AllReduce per tensor on one copy, packing::AllReduce on another for each
// cap, and the bytes must be identical (and equal the exact expected value).
void CheckAllReduceMatchesOneByOne(CollectiveCommunication& comm, const std::vector<ReduceOp>& ops,
                                   const std::vector<size_t>& caps) {
  const std::vector<TensorSpec> specs = MixedList();
  for (ReduceOp op : ops) {
    TensorList reference(specs);
    reference.Fill(op, comm.rank());
    for (const Tensor& t : reference.tensors()) comm.AllReduce(t, op);
    for (size_t i = 0; i < reference.size(); ++i) {
      for (size_t j = 0; j < specs[i].count; ++j) {
        const double want = testing::Expected(op, specs[i].dtype, comm.size(), i * 7919 + j);
        ASSERT_EQ(Load(specs[i].dtype, reference.bytes(i).data(), j), want)
            << "one-by-one reference wrong: " << Describe(reference, i) << " element " << j;
      }
    }
    for (size_t cap : caps) {
      for (Schedule schedule : Schedules()) {
        TensorList packed(specs);
        packed.Fill(op, comm.rank());
        internal::AllReduce(comm, packed.tensors(), op, cap, schedule);
        for (size_t i = 0; i < packed.size(); ++i) {
          ASSERT_EQ(packed.bytes(i), reference.bytes(i))
              << "rank " << comm.rank() << " of " << comm.size() << ", " << ToString(op) << ", cap "
              << cap << ", " << Name(schedule) << ": " << Describe(packed, i)
              << " differs from one-by-one";
        }
      }
    }
    // The public entry point (automatic schedule, default cap).
    TensorList packed(specs);
    packed.Fill(op, comm.rank());
    AllReduce(comm, packed.tensors(), op);
    for (size_t i = 0; i < packed.size(); ++i) {
      ASSERT_EQ(packed.bytes(i), reference.bytes(i)) << "default cap: " << Describe(packed, i);
    }
    // The asynchronous form, every cap.
    for (size_t cap : caps) {
      TensorList async(specs);
      async.Fill(op, comm.rank());
      AllReduceAsync(comm, async.tensors(), op, cap)->Wait();
      for (size_t i = 0; i < async.size(); ++i) {
        ASSERT_EQ(async.bytes(i), reference.bytes(i))
            << "rank " << comm.rank() << " of " << comm.size() << ", " << ToString(op) << ", cap "
            << cap << ", async: " << Describe(async, i) << " differs from one-by-one";
      }
    }
  }
}

class PackedAllReduceTest : public ::testing::TestWithParam<int> {};

TEST_P(PackedAllReduceTest, EqualsOneAllReducePerTensorInProcess) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(30);
  RunRanks(Transport::kInProcess, GetParam(), options, [](CollectiveCommunication& comm) {
    CheckAllReduceMatchesOneByOne(comm, testing::AllReduceOps(), Caps());
  });
}

TEST_P(PackedAllReduceTest, EqualsOneAllReducePerTensorOverTcp) {
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(30);
  RunRanks(Transport::kTcp, GetParam(), options, [](CollectiveCommunication& comm) {
    CheckAllReduceMatchesOneByOne(comm, {ReduceOp::kSum, ReduceOp::kAvg}, {1, 4096, 0});
  });
}

// AUTO on one host: the fused buckets go into shared memory straight from the tensors, no
// fusion buffer (core::InternalCommunication), with the same results; a single rank (no group)
// takes them in runs on the ring. RING takes them in pieces too (RingInRunsTest below); a call with
// no pieces is refused.
TEST_P(PackedAllReduceTest, EqualsOneAllReducePerTensorInSharedMemory) {
  testing::ScopedEnv shm("COLLECTIVES_SHM", nullptr);
  testing::ScopedEnv host("COLLECTIVES_HOST_ID", nullptr);
  CommunicationOptions options;
  options.timeout = std::chrono::seconds(30);
  RunRanks(Transport::kAuto, GetParam(), options, [](CollectiveCommunication& comm) {
    EXPECT_TRUE(core::Internal(comm)->RunsGatedCalls());
    CheckAllReduceMatchesOneByOne(comm, testing::AllReduceOps(), {1, 100, 4096, 0, SIZE_MAX});
  });
  RunRanks(Transport::kTcp, 2, options, [](CollectiveCommunication& comm) {
    EXPECT_TRUE(core::Internal(comm)->RunsGatedCalls());
    std::vector<Tensor> none;
    EXPECT_THROW(core::Internal(comm)->AllReduce(none, ReduceOp::kSum, core::CallOptions{}), Error);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, PackedAllReduceTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return std::to_string(param.param) + "Ranks";
                         });

// RING takes a fused bucket in pieces over the fabric (core::InternalCommunication): the frames
// go straight from and into the tensors (core::Runs), and the bits are those of one all-reduce
// of the bucket packed into one tensor, with random floats (whose sums depend on the order), for
// every algorithm (recursive doubling through a buffer; halving-doubling on 4 and 8 ranks),
// chunks that end inside a piece, every transport, 1 to 8 ranks. Broadcasts likewise, small (one
// buffer) and chained.
class RingInRunsTest
    : public ::testing::TestWithParam<std::tuple<Transport, int, const char*, size_t>> {
 protected:
  // The parameters' algorithm and chunk size, a 30 s timeout.
  static CommunicationOptions Options() {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(30);
    options.algorithm = std::get<2>(GetParam());
    options.chunk_bytes = std::get<3>(GetParam());
    return options;
  }
};

TEST_P(RingInRunsTest, PiecesGiveTheBitsOfTheOneBufferCall) {
  const Transport transport = std::get<0>(GetParam());
  const int size = std::get<1>(GetParam());
  const CommunicationOptions options = Options();
  RunRanks(transport, size, options, [&](CollectiveCommunication& comm) {
    ASSERT_TRUE(core::Internal(comm)->RunsGatedCalls());
    // Under 64 KiB in all (the small-message sizes) and over it.
    for (const std::vector<size_t>& counts : {std::vector<size_t>{7, 0, 1, 1000, 13},
                                              std::vector<size_t>{4099, 0, 1, 20011, 3, 1024}}) {
      size_t total = 0;
      for (size_t c : counts) total += c;
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProd, ReduceOp::kMin}) {
        std::mt19937 rng(uint32_t(comm.rank() * 1000 + int(op)));
        std::uniform_real_distribution<float> value(0.5f, 1.5f);
        std::vector<float> whole(total);
        for (float& x : whole) x = value(rng);
        std::vector<std::vector<float>> pieces;
        std::vector<Tensor> tensors;
        size_t at = 0;
        for (size_t c : counts) {
          pieces.emplace_back(whole.begin() + std::ptrdiff_t(at),
                              whole.begin() + std::ptrdiff_t(at + c));
          at += c;
        }
        for (std::vector<float>& piece : pieces) {
          tensors.push_back(Tensor{piece.data(), piece.size(), kF32});
        }
        comm.AllReduce(Tensor{whole.data(), whole.size(), kF32}, op);
        core::Internal(comm)->AllReduce(tensors, op, core::CallOptions{});
        at = 0;
        for (size_t i = 0; i < pieces.size(); ++i) {
          ASSERT_TRUE(pieces[i].empty() ||
                      std::memcmp(pieces[i].data(), whole.data() + at, pieces[i].size() * 4) == 0)
              << ToString(op) << ", " << total << " elements, piece " << i;
          at += pieces[i].size();
        }
      }
      // Broadcast from the last rank.
      const int root = comm.size() - 1;
      std::vector<std::vector<int32_t>> pieces;
      std::vector<Tensor> tensors;
      for (size_t i = 0; i < counts.size(); ++i) {
        pieces.emplace_back(counts[i], comm.rank() == root ? int32_t(i * 100003) : -1);
        for (size_t j = 0; j < counts[i] && comm.rank() == root; ++j) pieces[i][j] += int32_t(j);
      }
      for (std::vector<int32_t>& piece : pieces) {
        tensors.push_back(Tensor{piece.data(), piece.size(), kI32});
      }
      core::Internal(comm)->Broadcast(tensors, root, core::CallOptions{});
      for (size_t i = 0; i < counts.size(); ++i) {
        for (size_t j = 0; j < counts[i]; ++j) {
          ASSERT_EQ(pieces[i][j], int32_t(i * 100003 + j)) << "piece " << i << " element " << j;
        }
      }
    }
  });
}

// The same for the other element sizes (2, 8 and 1 bytes): every chunk and block boundary, and
// every span the reductions run over, holds whole elements, so the pieces give the one-buffer
// call's bits; f16 and bf16 reduce through f32 (the F16C loop in runs of 8, scalars for the rest).
TEST_P(RingInRunsTest, PiecesOfEveryElementSizeGiveTheBitsOfTheOneBufferCall) {
  const Transport transport = std::get<0>(GetParam());
  const int size = std::get<1>(GetParam());
  const CommunicationOptions options = Options();
  const std::vector<size_t> counts = {4099, 0, 1, 20011, 3, 1024, 17};
  RunRanks(transport, size, options, [&](CollectiveCommunication& comm) {
    for (DataType dtype : {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat64,
                           DataType::kInt64, DataType::kUInt8}) {
      const size_t es = SizeOf(dtype);
      const bool floating = dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
                            dtype == DataType::kFloat64;
      for (ReduceOp op :
           {ReduceOp::kSum, ReduceOp::kMax, floating ? ReduceOp::kAvg : ReduceOp::kMin}) {
        std::mt19937 rng(uint32_t(comm.rank() * 1000 + int(op) * 10 + int(dtype)));
        std::uniform_real_distribution<float> value(0.5f, 1.5f);
        size_t total = 0;
        for (size_t c : counts) total += c;
        std::vector<uint8_t> whole(total * es);
        for (size_t i = 0; i < total; ++i) {
          uint8_t* out = whole.data() + i * es;
          const float v = value(rng);
          if (dtype == DataType::kFloat16) {
            const uint16_t h = core::FloatToHalf(v);
            std::memcpy(out, &h, 2);
          } else if (dtype == DataType::kBFloat16) {
            const uint16_t h = core::FloatToBFloat16(v);
            std::memcpy(out, &h, 2);
          } else if (dtype == DataType::kFloat64) {
            const double d = double(v) * 1.000000123;
            std::memcpy(out, &d, 8);
          } else if (dtype == DataType::kInt64) {
            const int64_t n = int64_t(rng() % 2000001) - 1000000;
            std::memcpy(out, &n, 8);
          } else {
            *out = uint8_t(rng());  // sums wrap alike in both calls
          }
        }
        std::vector<std::vector<uint8_t>> pieces;
        std::vector<Tensor> tensors;
        size_t at = 0;
        for (size_t c : counts) {
          pieces.emplace_back(whole.begin() + std::ptrdiff_t(at * es),
                              whole.begin() + std::ptrdiff_t((at + c) * es));
          at += c;
        }
        for (size_t i = 0; i < pieces.size(); ++i) {
          tensors.push_back(Tensor{pieces[i].data(), counts[i], dtype});
        }
        comm.AllReduce(Tensor{whole.data(), total, dtype}, op);
        core::Internal(comm)->AllReduce(tensors, op, core::CallOptions{});
        at = 0;
        for (size_t i = 0; i < pieces.size(); ++i) {
          ASSERT_TRUE(pieces[i].empty() ||
                      std::memcmp(pieces[i].data(), whole.data() + at, pieces[i].size()) == 0)
              << ToString(dtype) << " " << ToString(op) << ", piece " << i;
          at += pieces[i].size();
        }
      }
    }
  });
}

// The cases of RingInRunsTest with two ranks or more.
class RingInRunsMismatchTest : public RingInRunsTest {};

// A call in pieces that another rank makes with another operator (or, for a broadcast, another
// root) raises kMismatch on every rank and leaves every piece as it was: the first write into a
// piece follows frames checked through every rank, in every algorithm.
TEST_P(RingInRunsMismatchTest, AMismatchedCallInPiecesWritesNoPiece) {
  const Transport transport = std::get<0>(GetParam());
  const int size = std::get<1>(GetParam());
  ASSERT_GE(size, 2);
  const CommunicationOptions options = Options();
  for (const bool broadcast : {false, true}) {
    // Under 64 KiB in all (through one buffer) and over it (in runs).
    for (const std::vector<size_t>& counts :
         {std::vector<size_t>{7, 1, 1000}, std::vector<size_t>{70001, 1, 29998}}) {
      RunRanks(transport, size, options, [&](CollectiveCommunication& comm) {
        const bool odd = comm.rank() == comm.size() - 1;
        std::vector<std::vector<float>> pieces;
        std::vector<Tensor> tensors;
        for (size_t c : counts) pieces.emplace_back(c, float(comm.rank() + 2));
        for (auto& piece : pieces) tensors.push_back(Tensor{piece.data(), piece.size(), kF32});
        try {
          if (broadcast) {
            core::Internal(comm)->Broadcast(tensors, odd ? 1 : 0, core::CallOptions{});
          } else {
            const ReduceOp op = odd ? ReduceOp::kMax : ReduceOp::kSum;
            core::Internal(comm)->AllReduce(tensors, op, core::CallOptions{});
          }
          ADD_FAILURE() << "rank " << comm.rank() << ": a mismatched call went through";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kMismatch) << "rank " << comm.rank() << ": " << e.what();
        }
        for (size_t i = 0; i < pieces.size(); ++i) {
          for (size_t j = 0; j < pieces[i].size(); ++j) {
            ASSERT_EQ(pieces[i][j], float(comm.rank() + 2))
                << "rank " << comm.rank() << (broadcast ? " broadcast" : " all-reduce")
                << ": piece " << i << " element " << j << " was written";
          }
        }
      });
    }
  }
}

// Every transport, world size, algorithm (halving-doubling where it runs: 4 and 8 ranks) and
// chunking.
std::vector<RingInRunsTest::ParamType> RingInRunsCases() {
  std::vector<RingInRunsTest::ParamType> cases;
  for (Transport transport : {Transport::kInProcess, Transport::kTcp, Transport::kTcpInPieces}) {
    for (int size : {1, 2, 3, 4, 5, 8}) {
      for (const char* algorithm : {"", "ring", "recursive_doubling", "halving_doubling"}) {
        if (std::string(algorithm) == "halving_doubling" && size != 4 && size != 8) continue;
        for (size_t chunk_bytes : {size_t{0}, size_t{3000}}) {
          cases.emplace_back(transport, size, algorithm, chunk_bytes);
        }
      }
    }
  }
  return cases;
}

std::vector<RingInRunsTest::ParamType> RingInRunsCasesOfTwoOrMore() {
  std::vector<RingInRunsTest::ParamType> cases;
  for (const RingInRunsTest::ParamType& c : RingInRunsCases()) {
    if (std::get<1>(c) >= 2) cases.push_back(c);
  }
  return cases;
}

std::string RingInRunsCaseName(const ::testing::TestParamInfo<RingInRunsTest::ParamType>& info) {
  const std::string algorithm = std::get<2>(info.param);
  return std::string(testing::TransportName(std::get<0>(info.param))) + "_" +
         std::to_string(std::get<1>(info.param)) + "_" +
         (algorithm.empty() ? "default" : algorithm) + "_chunk" +
         std::to_string(std::get<3>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Transports, RingInRunsTest, ::testing::ValuesIn(RingInRunsCases()),
                         RingInRunsCaseName);
INSTANTIATE_TEST_SUITE_P(Transports, RingInRunsMismatchTest,
                         ::testing::ValuesIn(RingInRunsCasesOfTwoOrMore()), RingInRunsCaseName);

// Floats that are not small integers: with two ranks every reduction is one commutative
// operation, so packed and one-by-one agree bit for bit whatever the algorithm.
TEST(PackedAllReduceFloatTest, RandomFloatsTwoRanksBitIdentical) {
  RunRanks(Transport::kInProcess, 2, {}, [](CollectiveCommunication& comm) {
    const std::vector<TensorSpec> specs = {Spec(kF32, 1001), Spec(kF16, 77),    Spec(kF64, 5000),
                                           Spec(kF32, 3),    Spec(kF16, 20000), Spec(kF64, 1)};
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProd, ReduceOp::kMax}) {
      TensorList reference(specs), packed(specs);
      std::mt19937 rng(uint32_t(comm.rank()) * 77 + uint32_t(op));
      std::uniform_real_distribution<double> value(-3.0, 3.0);
      for (size_t i = 0; i < specs.size(); ++i) {
        for (size_t j = 0; j < specs[i].count; ++j) {
          testing::Store(specs[i].dtype, reference.bytes(i).data(), j, value(rng));
        }
        packed.bytes(i) = reference.bytes(i);
      }
      const TensorList input = packed;
      for (const Tensor& t : reference.tensors()) comm.AllReduce(t, op);
      for (Schedule schedule : Schedules()) {
        packed = input;
        internal::AllReduce(comm, packed.tensors(), op, 32 << 10, schedule);
        for (size_t i = 0; i < specs.size(); ++i) {
          EXPECT_EQ(packed.bytes(i), reference.bytes(i))
              << ToString(op) << " " << Name(schedule) << " tensor " << i;
        }
      }
    }
  });
}

TEST(PackedBroadcastTest, ListFromANonZeroRootReachesEveryRank) {
  // The buckets go in pieces, no fusion buffer: over the fabric (RING), and into and out of shared
  // memory (AUTO on one host).
  testing::ScopedEnv shm("COLLECTIVES_SHM", nullptr);
  testing::ScopedEnv host("COLLECTIVES_HOST_ID", nullptr);
  for (Transport transport : {Transport::kInProcess, Transport::kTcp, Transport::kAuto}) {
    for (int size : {2, 3, 4}) {
      CommunicationOptions options;
      options.timeout = std::chrono::seconds(30);
      RunRanks(transport, size, options, [&](CollectiveCommunication& comm) {
        EXPECT_TRUE(core::Internal(comm)->RunsGatedCalls());
        const int root = comm.size() - 1;
        const std::vector<TensorSpec> specs = MixedList();
        TensorList expected(specs);
        expected.Fill(ReduceOp::kMin, root);
        for (size_t cap : {size_t{1}, size_t{4096}, size_t{0}}) {
          for (Schedule schedule : {Schedule::kOverlapped, Schedule::kSerial, Schedule::kAuto}) {
            TensorList list(specs);
            if (comm.rank() == root) {
              list.Fill(ReduceOp::kMin, root);
            } else {
              list.Fill(ReduceOp::kSum, comm.rank());  // overwritten by the root's values
            }
            internal::Broadcast(comm, list.tensors(), root, cap, schedule);
            for (size_t i = 0; i < list.size(); ++i) {
              ASSERT_EQ(list.bytes(i), expected.bytes(i))
                  << "rank " << comm.rank() << " of " << size << ", root " << root << ", cap "
                  << cap << ", " << Name(schedule) << ": " << Describe(list, i);
            }
          }
          TensorList list(specs);
          list.Fill(comm.rank() == root ? ReduceOp::kMin : ReduceOp::kSum, comm.rank());
          BroadcastAsync(comm, list.tensors(), root, cap)->Wait();
          for (size_t i = 0; i < list.size(); ++i) {
            ASSERT_EQ(list.bytes(i), expected.bytes(i))
                << "rank " << comm.rank() << " of " << size << ", root " << root << ", cap " << cap
                << ", async: " << Describe(list, i);
          }
        }
      });
    }
  }
}

// Runs `body` on every rank of 2 and 3 ranks, in one process, over TCP and with AUTO on one host,
// with one rank `odd`: the first, then the last.
void ForEachOddRank(const std::function<void(CollectiveCommunication&, bool odd)>& body) {
  // AUTO on one host: fused buckets in shared memory without a fusion buffer.
  testing::ScopedEnv shm("COLLECTIVES_SHM", nullptr);
  testing::ScopedEnv host("COLLECTIVES_HOST_ID", nullptr);
  for (Transport transport : {Transport::kInProcess, Transport::kTcp, Transport::kAuto}) {
    for (int size : {2, 3}) {
      for (int odd_one : {0, size - 1}) {
        CommunicationOptions options;
        options.timeout = std::chrono::seconds(30);
        RunRanks(transport, size, options,
                 [&](CollectiveCommunication& comm) { body(comm, comm.rank() == odd_one); });
      }
    }
  }
}

// Lists that differ across ranks but bucket alike (100 + 200 floats on one rank, 200 + 100 on
// the others: one 300-float bucket everywhere) would mix tensors without any frame noticing.
// Every rank raises kMismatch naming the list, nothing is written, and the communicator still
// works; with lists that agree, the same call goes through.
TEST(PackedMismatchTest, ListsThatDifferButBucketAlikeRaiseOnEveryRank) {
  ForEachOddRank([](CollectiveCommunication& comm, bool odd) {
    std::vector<float> a(odd ? 200 : 100, float(comm.rank() + 1));
    std::vector<float> b(odd ? 100 : 200, float(comm.rank() + 1));
    const std::vector<Tensor> list = {Tensor{a.data(), a.size(), DataType::kFloat32},
                                      Tensor{b.data(), b.size(), DataType::kFloat32}};
    for (bool broadcast : {false, true}) {
      try {
        if (broadcast) {
          packing::Broadcast(comm, list, 0, 4096);
        } else {
          packing::AllReduce(comm, list, ReduceOp::kSum, 4096);
        }
        ADD_FAILURE() << "rank " << comm.rank() << ": differing lists were "
                      << (broadcast ? "broadcast" : "reduced");
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
        EXPECT_NE(std::string(e.what()).find("list of 2 tensors differs"), std::string::npos)
            << e.what();
        // What the call left undone, in the words of the collective it is.
        const std::string outcome =
            broadcast ? "no tensor was broadcast or written" : "nothing was reduced or written";
        EXPECT_NE(std::string(e.what()).find(outcome), std::string::npos) << e.what();
      }
      for (float v : a) ASSERT_EQ(v, float(comm.rank() + 1)) << "a was written";
      for (float v : b) ASSERT_EQ(v, float(comm.rank() + 1)) << "b was written";
    }
    // The communicator is not broken, and lists that agree go through.
    std::vector<float> c(100, 1.0f), d(200, 2.0f);
    packing::AllReduce(comm,
                       {Tensor{c.data(), c.size(), DataType::kFloat32},
                        Tensor{d.data(), d.size(), DataType::kFloat32}},
                       ReduceOp::kSum, 4096);
    for (float v : c) ASSERT_EQ(v, float(comm.size()));
    for (float v : d) ASSERT_EQ(v, 2.0f * float(comm.size()));
  });
}

// A packed all-reduce (kMax, cap 4096) of `list`, which differs from another rank's: kMismatch
// naming the list.
void ExpectListsDiffer(CollectiveCommunication& comm, const std::vector<Tensor>& list) {
  try {
    packing::AllReduce(comm, list, ReduceOp::kMax, 4096);
    ADD_FAILURE() << "rank " << comm.rank() << ": differing lists were reduced";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
    EXPECT_NE(std::string(e.what()).find("differs from another rank's"), std::string::npos)
        << e.what();
  }
}

// The asynchronous form of a call whose lists (or caps) differ, cut into buckets of other
// shapes on some ranks: Wait raises kMismatch on every rank, at once, never a timeout. Every
// bucket, a tensor alone in its bucket too, waits for the list check (core::Gate, and the
// pieces in shared memory), so nothing is written, and the communicator still works after it,
// whether or not every rank issued as many buckets: no rank is left in a collective the others
// skipped, and a bucket that does not run takes no sequence number (else a rank that issued more
// buckets than another would be a number ahead of it, and every later call would raise
// kMismatch).
void ExpectListsDifferAsync(CollectiveCommunication& comm, const std::vector<Tensor>& list,
                            size_t cap, const std::vector<std::vector<uint8_t>*>& untouched) {
  std::vector<std::vector<uint8_t>> before;
  for (const auto* bytes : untouched) before.push_back(*bytes);
  const auto start = std::chrono::steady_clock::now();
  try {
    packing::AllReduceAsync(comm, list, ReduceOp::kMax, cap)->Wait();
    ADD_FAILURE() << "rank " << comm.rank() << ": differing lists were reduced";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, test_time::Scaled(std::chrono::seconds(10)))
      << "rank " << comm.rank() << ": not at once";
  for (size_t i = 0; i < untouched.size(); ++i) {
    EXPECT_EQ(*untouched[i], before[i]) << "rank " << comm.rank() << ": buffer " << i;
  }
  std::vector<int64_t> next = {5, comm.rank() + 7};
  comm.AllReduce(Tensor{next.data(), 2, DataType::kInt64}, ReduceOp::kMax);
  EXPECT_EQ(next, (std::vector<int64_t>{5, comm.size() + 6})) << "rank " << comm.rank();
  std::vector<int64_t> first = {comm.rank() + 1}, second = {1, 2, comm.rank()};
  packing::AllReduceAsync(
      comm, {Tensor{first.data(), 1, DataType::kInt64}, Tensor{second.data(), 3, DataType::kInt64}},
      ReduceOp::kMax, 8)
      ->Wait();
  EXPECT_EQ(first, (std::vector<int64_t>{comm.size()})) << "rank " << comm.rank();
  EXPECT_EQ(second, (std::vector<int64_t>{1, 2, comm.size() - 1})) << "rank " << comm.rank();
}

// One rank's list is one tensor where the others' fuse two (one bucket each), or the same list
// is cut by caps that differ (two buckets against one): the asynchronous form
// (ExpectListsDifferAsync): every bucket waits for the list check, so no rank reduces its one
// tensor with the others' fused bucket, nor runs it alone in shared memory until its timeout.
TEST(PackedAsyncTest, ListsOrCapsThatBucketOtherwiseRaiseInWaitAtOnce) {
  ForEachOddRank([](CollectiveCommunication& comm, bool odd) {
    std::vector<uint8_t> bytes(2 * sizeof(int64_t));
    auto* values = reinterpret_cast<int64_t*>(bytes.data());
    values[0] = values[1] = comm.rank() + 1;
    std::vector<Tensor> list;
    if (odd) {
      list = {Tensor{values, 2, DataType::kInt64}};
    } else {
      list = {Tensor{values, 1, DataType::kInt64}, Tensor{values + 1, 1, DataType::kInt64}};
    }
    ExpectListsDifferAsync(comm, list, 4096, {&bytes});
    std::vector<uint8_t> floats(192 * sizeof(float));
    auto* data = reinterpret_cast<float*>(floats.data());
    std::vector<Tensor> three;
    for (int i = 0; i < 3; ++i) three.push_back(Tensor{data + 64 * i, 64, DataType::kFloat32});
    // Two buckets here, one there; then three (a cap under every tensor) against one.
    ExpectListsDifferAsync(comm, three, odd ? 512 : 0, {&floats});
    ExpectListsDifferAsync(comm, three, odd ? 0 : 64, {&floats});
  });
}

// One rank's list does not fuse (one int64 tensor of 2) where the others' does (two of 1): that
// rank takes part in the list check too (its tensor's all-reduce, int64 max of 2 elements, looks
// like the check), so every rank raises kMismatch, nothing written.
TEST(PackedMismatchTest, ARankWhoseListDoesNotFuseStillRaises) {
  ForEachOddRank([](CollectiveCommunication& comm, bool odd) {
    std::vector<int64_t> values(2, comm.rank() + 1);
    std::vector<Tensor> list;
    if (odd) {
      list = {Tensor{values.data(), 2, DataType::kInt64}};
    } else {
      list = {Tensor{values.data(), 1, DataType::kInt64},
              Tensor{values.data() + 1, 1, DataType::kInt64}};
    }
    ExpectListsDiffer(comm, list);
    for (int64_t v : values) ASSERT_EQ(v, comm.rank() + 1) << "rank " << comm.rank();
  });
}

// One rank's list moves nothing (an empty list, or only zero-size tensors) where the others'
// moves two int64. That rank takes part in the list check too, so the others' check (an int64
// max of two elements) does not meet its next call: every rank raises kMismatch, and the next
// call is exact.
TEST(PackedMismatchTest, ARankWhoseListMovesNothingStillRaises) {
  for (bool empty_list : {false, true}) {
    SCOPED_TRACE(empty_list ? "an empty list" : "one zero-size tensor");
    ForEachOddRank([&](CollectiveCommunication& comm, bool odd) {
      std::vector<int64_t> values(2, comm.rank() + 1);
      std::vector<Tensor> list;
      if (!odd) {
        list = {Tensor{values.data(), 2, DataType::kInt64}};
      } else if (!empty_list) {
        list = {Tensor{values.data(), 0, DataType::kInt64}};
      }
      ExpectListsDiffer(comm, list);
      for (int64_t v : values) ASSERT_EQ(v, comm.rank() + 1) << "rank " << comm.rank();
      std::vector<int64_t> next = {5, comm.rank() + 7};
      comm.AllReduce(Tensor{next.data(), 2, DataType::kInt64}, ReduceOp::kMax);
      EXPECT_EQ(next, (std::vector<int64_t>{5, comm.size() + 6})) << "rank " << comm.rank();
    });
  }
}

// Equal lists cut by different caps (three tensors of 64 floats: one bucket of 768 bytes with
// the default cap, buckets of 512 and 256 bytes with a cap of 512): every rank raises kMismatch
// naming bytes_per_pack, nothing written, communicator intact (not a frame of the wrong size).
TEST(PackedMismatchTest, CapsThatDifferAcrossRanksAreNamed) {
  ForEachOddRank([](CollectiveCommunication& comm, bool odd) {
    std::vector<float> data(192, float(comm.rank() + 1));
    std::vector<Tensor> list;
    for (int i = 0; i < 3; ++i)
      list.push_back(Tensor{data.data() + 64 * i, 64, DataType::kFloat32});
    for (bool broadcast : {false, true}) {
      try {
        if (broadcast) {
          packing::Broadcast(comm, list, 0, odd ? 512 : 0);
        } else {
          packing::AllReduce(comm, list, ReduceOp::kSum, odd ? 512 : 0);
        }
        ADD_FAILURE() << "rank " << comm.rank() << ": lists cut differently went through";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
        const std::string expected =
            "the list is cut into buckets other than another rank's: bytes_per_pack (" +
            std::string(odd ? "512" : std::to_string(packing::DefaultBytesPerPack(comm))) +
            " here) must be the same on every rank; " +
            (broadcast ? "no tensor was broadcast or written" : "nothing was reduced or written");
        EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      }
      for (float v : data) ASSERT_EQ(v, float(comm.rank() + 1)) << "rank " << comm.rank();
    }
    // Caps that differ but cut alike are fine: 768 bytes fit in one bucket under both.
    packing::AllReduce(comm, list, ReduceOp::kSum, odd ? 1024 : 0);
    const float sum = float(comm.size() * (comm.size() + 1) / 2);
    for (float v : data) ASSERT_EQ(v, sum) << "rank " << comm.rank();
  });
}

// A packed call that moves nothing still reports a broken communicator, as every call does.
TEST(PackedMismatchTest, ACallThatMovesNothingReportsAnAbort) {
  RunRanks(Transport::kInProcess, 2, CommunicationOptions{}, [](CollectiveCommunication& comm) {
    comm.Abort();
    float x = 0;
    for (const std::vector<Tensor>& list :
         {std::vector<Tensor>{}, std::vector<Tensor>{Tensor{&x, 0, DataType::kFloat32}}}) {
      try {
        packing::AllReduce(comm, list, ReduceOp::kSum);
        ADD_FAILURE() << "rank " << comm.rank() << ": a call on an aborted communicator succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
      }
    }
  });
}

// The asynchronous form issues every collective before it returns: a blocking call and a second
// packed call made after it, before any Wait, follow it on every rank, and each gets its own
// result. A Done that returns true has finished the call (the fused buckets are unpacked), and
// a Work dropped unwaited waits for its collectives before its buffer goes.
TEST(PackedAsyncTest, CallsAfterItFollowItAndDoneFinishesIt) {
  for (Transport transport : {Transport::kInProcess, Transport::kTcp}) {
    CommunicationOptions options;
    options.timeout = std::chrono::seconds(30);
    RunRanks(transport, 3, options, [](CollectiveCommunication& comm) {
      const std::vector<TensorSpec> specs = MixedList();
      TensorList first(specs), second(specs), expected_sum(specs), expected_max(specs);
      first.Fill(ReduceOp::kSum, comm.rank());
      second.Fill(ReduceOp::kMax, comm.rank());
      expected_sum.Fill(ReduceOp::kSum, comm.rank());
      expected_max.Fill(ReduceOp::kMax, comm.rank());
      {  // dropped unwaited: its destructor waits for what its buffer holds
        TensorList dropped(specs);
        dropped.Fill(ReduceOp::kSum, comm.rank());
        AllReduceAsync(comm, dropped.tensors(), ReduceOp::kSum, 4096);
      }
      const std::shared_ptr<Work> a = AllReduceAsync(comm, first.tensors(), ReduceOp::kSum, 4096);
      std::vector<int32_t> plain(1001, comm.rank() + 1);
      comm.AllReduce(Tensor{plain.data(), plain.size(), DataType::kInt32}, ReduceOp::kSum);
      const std::shared_ptr<Work> b = AllReduceAsync(comm, second.tensors(), ReduceOp::kMax, 100);
      while (!b->Done()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_TRUE(a->Done()) << "the call issued before b has not completed";
      for (const Tensor& t : expected_sum.tensors()) comm.AllReduce(t, ReduceOp::kSum);
      for (const Tensor& t : expected_max.tensors()) comm.AllReduce(t, ReduceOp::kMax);
      for (size_t i = 0; i < specs.size(); ++i) {
        ASSERT_EQ(second.bytes(i), expected_max.bytes(i)) << "after Done: " << Describe(second, i);
      }
      a->Wait();
      a->Wait();  // again: returns again
      for (size_t i = 0; i < specs.size(); ++i) {
        ASSERT_EQ(first.bytes(i), expected_sum.bytes(i)) << Describe(first, i);
      }
      const int32_t sum = comm.size() * (comm.size() + 1) / 2;
      for (int32_t v : plain) ASSERT_EQ(v, sum);
    });
  }
}

// Lists that differ but bucket alike: Wait raises kMismatch on every rank, saying nothing was
// written (every bucket waits for the list check's answer), the tensors are untouched, and the
// communicator still works.
TEST(PackedAsyncTest, ListsThatDifferRaiseInWaitAndWriteNoFusedTensor) {
  ForEachOddRank([](CollectiveCommunication& comm, bool odd) {
    std::vector<float> a(odd ? 200 : 100, float(comm.rank() + 1));
    std::vector<float> b(odd ? 100 : 200, float(comm.rank() + 1));
    const std::vector<Tensor> list = {Tensor{a.data(), a.size(), DataType::kFloat32},
                                      Tensor{b.data(), b.size(), DataType::kFloat32}};
    for (bool broadcast : {false, true}) {
      const std::shared_ptr<Work> work =
          broadcast ? packing::BroadcastAsync(comm, list, 0, 4096)
                    : packing::AllReduceAsync(comm, list, ReduceOp::kSum, 4096);
      try {
        work->Wait();
        ADD_FAILURE() << "rank " << comm.rank() << ": differing lists went through";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
        EXPECT_NE(e.message().find("list of 2 tensors differs"), std::string::npos) << e.what();
        EXPECT_NE(e.message().find(broadcast ? "no tensor was broadcast or written"
                                             : "nothing was reduced or written"),
                  std::string::npos)
            << e.what();
      }
      EXPECT_THROW(work->Wait(), Error) << "a second Wait forgot the error";
      for (float v : a) ASSERT_EQ(v, float(comm.rank() + 1)) << "a was written";
      for (float v : b) ASSERT_EQ(v, float(comm.rank() + 1)) << "b was written";
    }
    std::vector<float> c(100, 1.0f), d(200, 2.0f);
    packing::AllReduceAsync(comm,
                            {Tensor{c.data(), c.size(), DataType::kFloat32},
                             Tensor{d.data(), d.size(), DataType::kFloat32}},
                            ReduceOp::kSum, 4096)
        ->Wait();
    for (float v : c) ASSERT_EQ(v, float(comm.size()));
    for (float v : d) ASSERT_EQ(v, 2.0f * float(comm.size()));
  });
}

void ExpectError(const std::function<void()>& call, ErrorCode code, const std::string& needle);

// Argument errors come from the call itself, before anything is issued; the collectives' errors
// (here an Abort) from Wait.
TEST(PackedAsyncTest, ArgumentErrorsAreThrownAndCollectiveErrorsWaited) {
  RunRanks(Transport::kInProcess, 2, CommunicationOptions{}, [](CollectiveCommunication& comm) {
    std::vector<float> x(10, 1.0f);
    const std::vector<Tensor> shared = {Tensor{x.data(), 10, DataType::kFloat32},
                                        Tensor{x.data() + 5, 5, DataType::kFloat32}};
    ExpectError([&] { AllReduceAsync(comm, shared, ReduceOp::kSum); }, ErrorCode::kInvalidArgument,
                "shares memory with tensor 0");
    ExpectError([&] { BroadcastAsync(comm, {}, 2); }, ErrorCode::kInvalidArgument, "root 2");
    comm.Abort();
    const std::shared_ptr<Work> work =
        AllReduceAsync(comm, {Tensor{x.data(), 10, DataType::kFloat32}}, ReduceOp::kSum);
    try {
      work->Wait();
      ADD_FAILURE() << "rank " << comm.rank() << ": a call on an aborted communicator succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    }
    EXPECT_TRUE(work->Done());
  });
}

// ---------------------------------------------------------------------------------------------
// The schedule, seen through a communicator that records what the packer issues.
// ---------------------------------------------------------------------------------------------

// Forwards to a real communicator and records each call: its tensor, and how many calls were
// still unwaited when it was issued.
class RecordingCommunication final : public CollectiveCommunication {
 public:
  struct Call {
    const char* kind;
    Tensor tensor;
    int in_flight_before;  // issued but not yet waited on, when this call was issued
  };

  explicit RecordingCommunication(CollectiveCommunication& inner) : inner_(inner) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Implementation implementation() const override { return inner_.implementation(); }

  std::shared_ptr<Work> AllReduceAsync(const Tensor& send, const Tensor& recv,
                                       ReduceOp op) override {
    EXPECT_EQ(send.data, recv.data) << "the packer's collectives are in place";
    return Record("all_reduce", recv, inner_.AllReduceAsync(send, recv, op));
  }
  std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv, int root) override {
    EXPECT_EQ(send.data, recv.data) << "the packer's collectives are in place";
    return Record("broadcast", recv, inner_.BroadcastAsync(send, recv, root));
  }
  std::shared_ptr<Work> AllGatherAsync(const Tensor& send, const Tensor& recv) override {
    return inner_.AllGatherAsync(send, recv);
  }
  std::shared_ptr<Work> ReduceScatterAsync(const Tensor& send, const Tensor& recv,
                                           ReduceOp op) override {
    return inner_.ReduceScatterAsync(send, recv, op);
  }
  std::shared_ptr<Work> BarrierAsync() override { return inner_.BarrierAsync(); }
  void Abort() override { inner_.Abort(); }
  void SetTimeout(std::chrono::milliseconds timeout) override { inner_.SetTimeout(timeout); }

  std::vector<Call> calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  class CountedWork final : public Work {
   public:
    CountedWork(std::shared_ptr<Work> inner, std::atomic<int>& unwaited)
        : inner_(std::move(inner)), unwaited_(unwaited) {}
    void Wait() override {
      inner_->Wait();
      if (!waited_.exchange(true)) unwaited_.fetch_sub(1);
    }
    bool Done() const override { return inner_->Done(); }

   private:
    std::shared_ptr<Work> inner_;
    std::atomic<int>& unwaited_;
    std::atomic<bool> waited_{false};
  };

  std::shared_ptr<Work> Record(const char* kind, const Tensor& t, std::shared_ptr<Work> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.push_back(Call{kind, t, unwaited_.load()});
    }
    unwaited_.fetch_add(1);
    return std::make_shared<CountedWork>(std::move(work), unwaited_);
  }

  CollectiveCommunication& inner_;
  std::mutex mu_;
  std::vector<Call> calls_;  // guarded by mu_
  std::atomic<int> unwaited_{0};
};

// Overlapped: at most two buckets in flight, two fusion buffers; serial: one of each.
TEST(PackingScheduleTest, SingleTensorsInPlaceBoundedInFlightBuffersWithinTheCap) {
  RunRanks(Transport::kInProcess, 3, {}, [](CollectiveCommunication& real) {
    RecordingCommunication comm(real);
    const std::vector<TensorSpec> specs = MixedList();
    for (size_t cap : {size_t{1}, size_t{100}, size_t{4096}, size_t{65536}}) {
      for (auto [broadcast, schedule] :
           {std::pair{false, Schedule::kOverlapped}, std::pair{true, Schedule::kOverlapped},
            std::pair{false, Schedule::kSerial}, std::pair{true, Schedule::kSerial}}) {
        const int max_in_flight = schedule == Schedule::kOverlapped ? 2 : 1;
        TensorList list(specs);
        list.Fill(ReduceOp::kSum, comm.rank());
        const std::vector<Tensor> tensors = list.tensors();
        const size_t before = comm.calls().size();
        if (broadcast) {
          internal::Broadcast(comm, tensors, 1, cap, schedule);
        } else {
          internal::AllReduce(comm, tensors, ReduceOp::kSum, cap, schedule);
        }
        const std::vector<RecordingCommunication::Call> all = comm.calls();
        std::vector<RecordingCommunication::Call> calls(all.begin() + long(before), all.end());
        // One call per bucket that has bytes, in plan order, after the lists' agreement check
        // (a 4 x i64 max all-reduce), fused or not.
        std::vector<Bucket> plan = PlanBuckets(specs, cap);
        std::erase_if(plan, [&](const Bucket& b) {
          size_t bytes = 0;
          for (size_t i : b) bytes += tensors[i].bytes();
          return bytes == 0;
        });
        ASSERT_FALSE(calls.empty());
        EXPECT_STREQ(calls.front().kind, "all_reduce");
        EXPECT_EQ(calls.front().tensor.dtype, DataType::kInt64);
        EXPECT_EQ(calls.front().tensor.count, 4u);
        calls.erase(calls.begin());
        ASSERT_EQ(calls.size(), plan.size()) << "cap " << cap;
        std::set<void*> fusion_buffers;
        for (size_t k = 0; k < plan.size(); ++k) {
          const Tensor& t = calls[k].tensor;
          EXPECT_STREQ(calls[k].kind, broadcast ? "broadcast" : "all_reduce");
          EXPECT_LT(calls[k].in_flight_before, max_in_flight)
              << "too many buckets in flight, " << Name(schedule);
          size_t count = 0;
          for (size_t i : plan[k]) count += tensors[i].count;
          EXPECT_EQ(t.count, count);
          EXPECT_EQ(t.dtype, tensors[plan[k].front()].dtype);
          std::vector<size_t> non_empty;
          for (size_t i : plan[k]) {
            if (tensors[i].count > 0) non_empty.push_back(i);
          }
          if (non_empty.size() == 1) {
            EXPECT_EQ(t.data, tensors[non_empty[0]].data) << "a lone tensor was copied";
          } else {
            EXPECT_LE(t.bytes(), cap) << "a fusion buffer beyond the cap";
            for (const Tensor& user : tensors) EXPECT_NE(t.data, user.data);
            fusion_buffers.insert(t.data);
          }
        }
        EXPECT_LE(fusion_buffers.size(), size_t(max_in_flight))
            << "cap " << cap << ", " << Name(schedule);
        // The result is right too.
        if (broadcast) {
          TensorList expected(specs);
          expected.Fill(ReduceOp::kSum, 1);
          for (size_t i = 0; i < specs.size(); ++i) EXPECT_EQ(list.bytes(i), expected.bytes(i));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------------------------

void ExpectError(const std::function<void()>& call, ErrorCode code, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "expected an Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(PackingArgumentTest, BadTensorsAreRefusedBeforeAnythingIsIssued) {
  RunRanks(Transport::kInProcess, 2, {}, [](CollectiveCommunication& real) {
    RecordingCommunication comm(real);
    std::vector<float> a(10, 1.0f), b(4, 1.0f);
    std::vector<Tensor> tensors = {Tensor{a.data(), a.size(), kF32},
                                   Tensor{b.data(), b.size(), kF32},
                                   Tensor{nullptr, 0, kF16}};  // zero-size, null: fine
    Tensor gpu = tensors[1];
    gpu.device = Device::Cuda(0);
    ExpectError(
        [&] {
          AllReduce(comm, {tensors[0], tensors[1], gpu}, ReduceOp::kSum);
        },
        ErrorCode::kNotSupported, "tensor 2 is on cuda:0");
    ExpectError([&] { Broadcast(comm, {gpu}, 0); }, ErrorCode::kNotSupported, "tensor 0");
    ExpectError(
        [&] {
          AllReduce(comm, {tensors[0], Tensor{nullptr, 3, kF32}}, ReduceOp::kSum);
        },
        ErrorCode::kInvalidArgument, "tensor 1 has null data");
    ExpectError([&] { Broadcast(comm, tensors, 2); }, ErrorCode::kInvalidArgument, "root 2");
    ExpectError([&] { AllReduce(comm, tensors, static_cast<ReduceOp>(9)); },
                ErrorCode::kInvalidArgument, "packing all_reduce: unknown reduce op 9");
    // Tensors that share memory: a tensor twice in the list (in different buckets it would be
    // summed twice), and one that starts inside another.
    ExpectError(
        [&] {
          AllReduce(comm, {tensors[0], tensors[1], tensors[0]}, ReduceOp::kSum, 16);
        },
        ErrorCode::kInvalidArgument, "tensor 2 shares memory with tensor 0");
    ExpectError(
        [&] {
          AllReduce(comm, {Tensor{a.data() + 9, 1, kF32}, tensors[1], tensors[0]}, ReduceOp::kSum);
        },
        ErrorCode::kInvalidArgument, "tensor 2 shares memory with tensor 0");
    ExpectError(
        [&] {
          AllReduce(comm, {tensors[1], Tensor{reinterpret_cast<char*>(a.data()) + 2, 2, kF32}},
                    ReduceOp::kSum);
        },
        ErrorCode::kInvalidArgument, "tensor 1 data 0x");
    EXPECT_TRUE(comm.calls().empty()) << "a refused list issued a collective";

    // Empty lists and lists of zero-size tensors succeed, issuing the lists' check alone (a
    // rank that skipped it could meet another rank's check with its next call).
    AllReduce(comm, {}, ReduceOp::kSum);
    AllReduce(comm, {tensors[2], Tensor{nullptr, 0, kF32}}, ReduceOp::kSum);
    Broadcast(comm, {tensors[2]}, 1);
    ASSERT_EQ(comm.calls().size(), 3u);
    for (const auto& call : comm.calls()) {
      EXPECT_STREQ(call.kind, "all_reduce");
      EXPECT_EQ(call.tensor.dtype, DataType::kInt64);
      EXPECT_EQ(call.tensor.count, 4u);
    }

    // The communicator still works.
    AllReduce(comm, tensors, ReduceOp::kSum);
    EXPECT_EQ(a[9], 2.0f);
    EXPECT_EQ(b[0], 2.0f);
  });
}

// Ranks whose lists differ in one tensor's count: kMismatch on every rank, not a hang, whether
// the differing tensor is fused with others (large cap) or alone, with buckets in flight
// behind it (tiny cap).
TEST(PackingMismatchTest, DifferentCountsRaiseMismatch) {
  for (Transport transport : {Transport::kInProcess, Transport::kTcp}) {
    for (size_t cap : {size_t{1}, size_t{64}, size_t{0}}) {
      CommunicationOptions options;
      options.timeout = std::chrono::seconds(3);
      for (Schedule schedule : Schedules()) {
        const auto start = std::chrono::steady_clock::now();
        RunRanks(transport, 2, options, [&](CollectiveCommunication& comm) {
          std::vector<TensorSpec> specs(12, Spec(kF32, 5));
          specs[3].count = comm.rank() == 0 ? 5 : 6;
          TensorList list(specs);
          list.Fill(ReduceOp::kSum, comm.rank());
          auto call = [&] {
            internal::AllReduce(comm, list.tensors(), ReduceOp::kSum, cap, schedule);
          };
          ExpectError(call, ErrorCode::kMismatch, "all_reduce");
          // Broken for good: the next list fails the same way.
          ExpectError(call, ErrorCode::kMismatch, "");
        });
        EXPECT_LT(std::chrono::steady_clock::now() - start,
                  test_time::Scaled(std::chrono::seconds(3)))
            << "cap " << cap << ", " << Name(schedule);
      }
    }
  }
}

TEST(PackingScheduleTest, AutoOverlapsOnlyWithTwoCoresPerLocalRank) {
  if (std::getenv("LOCAL_WORLD_SIZE") != nullptr ||
      std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE") != nullptr) {
    GTEST_SKIP() << "the launcher set the number of local ranks";
  }
  const unsigned cores = std::thread::hardware_concurrency();
  EXPECT_EQ(internal::AutoSchedule(1), cores >= 2 ? Schedule::kOverlapped : Schedule::kSerial);
  EXPECT_EQ(internal::AutoSchedule(int(cores)), Schedule::kSerial);
}

}  // namespace
}  // namespace collectives::packing
