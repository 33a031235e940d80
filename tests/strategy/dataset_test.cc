// DistributedDataset: every example exactly once per epoch over all replicas of all workers (with
// and without drop_remainder, with partial last batches), per-replica sizes, the DATA-policy
// split, the same answer on every worker, shuffles that change with epoch and seed and are fixed
// across standard libraries (golden values), and argument errors. Also ComputeAverageLoss.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "collectives/strategy.h"
#include "tests/strategy/strategy_test_util.h"

namespace collectives::strategy {
namespace {

using testing::ExpectError;
using testing::LayoutStrategy;

struct Layout {
  size_t n;
  size_t batch;
  int workers;
  int local;
};

class DistributedDatasetCoverageTest : public ::testing::TestWithParam<Layout> {};

TEST_P(DistributedDatasetCoverageTest, EveryExampleOncePerEpochAcrossAllReplicasOfAllWorkers) {
  const Layout l = GetParam();
  const int replicas = l.workers * l.local;
  const size_t per_replica = l.batch / static_cast<size_t>(replicas);
  for (bool drop : {false, true}) {
    for (bool shuffle : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "drop_remainder " << drop << " shuffle " << shuffle);
      DatasetOptions options{.global_batch_size = l.batch, .drop_remainder = drop,
                             .shuffle = shuffle, .seed = 7};
      // One dataset per worker, as every worker builds its own.
      std::vector<std::unique_ptr<LayoutStrategy>> strategies;
      std::vector<DistributedDataset> datasets;
      for (int w = 0; w < l.workers; ++w) {
        strategies.push_back(std::make_unique<LayoutStrategy>(l.workers, w, l.local));
        datasets.emplace_back(*strategies.back(), l.n, options);
      }
      const size_t steps = datasets[0].steps_per_epoch();
      EXPECT_EQ(steps, drop ? l.n / l.batch : (l.n + l.batch - 1) / l.batch);
      EXPECT_EQ(datasets[0].per_replica_batch_size(), per_replica);
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        std::vector<int> seen(l.n, 0);
        for (size_t step = 0; step < steps; ++step) {
          const size_t b = datasets[0].GlobalBatchSize(step);
          EXPECT_EQ(b, std::min(l.batch, l.n - step * l.batch));
          std::vector<size_t> global;  // the global batch, replicas in order
          for (int w = 0; w < l.workers; ++w) {
            for (int r = 0; r < l.local; ++r) {
              const int g = w * l.local + r;
              const std::vector<size_t> mine = datasets[w].ReplicaBatch(epoch, step, r);
              // Replicas are filled in order with up to B/N examples each.
              const size_t expected = std::min(per_replica, b - std::min(b, g * per_replica));
              EXPECT_EQ(mine.size(), expected) << "worker " << w << " replica " << r;
              // Every worker computes the same batch for any global replica.
              for (int other = 0; other < l.workers; ++other) {
                EXPECT_EQ(datasets[other].GlobalReplicaBatch(epoch, step, g), mine);
              }
              for (size_t i : mine) {
                ASSERT_LT(i, l.n);
                ++seen[i];
              }
              global.insert(global.end(), mine.begin(), mine.end());
            }
          }
          EXPECT_EQ(global.size(), b);
          if (!shuffle) {  // the global batch is a contiguous run of indices
            for (size_t k = 0; k < global.size(); ++k) EXPECT_EQ(global[k], step * l.batch + k);
          }
        }
        const size_t covered = static_cast<size_t>(std::count(seen.begin(), seen.end(), 1));
        EXPECT_EQ(std::count_if(seen.begin(), seen.end(), [](int c) { return c > 1; }), 0);
        EXPECT_EQ(covered, drop ? steps * l.batch : l.n) << "epoch " << epoch;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, DistributedDatasetCoverageTest,
    ::testing::Values(Layout{100, 10, 1, 1}, Layout{100, 12, 1, 4}, Layout{101, 12, 2, 2},
                      Layout{7, 12, 2, 3},  // one partial batch, smaller than a replica's share
                      Layout{25, 24, 3, 2}, Layout{0, 8, 2, 2}, Layout{48, 48, 2, 2},
                      Layout{1000, 30, 3, 1}, Layout{59, 8, 1, 8}),
    [](const ::testing::TestParamInfo<Layout>& p) {
      const Layout& l = p.param;
      return "n" + std::to_string(l.n) + "_B" + std::to_string(l.batch) + "_W" +
             std::to_string(l.workers) + "_R" + std::to_string(l.local);
    });

TEST(DistributedDatasetTest, PartialLastBatchFillsReplicasInOrder) {
  // 2 workers x 2 replicas, B = 8 (2 per replica), n = 13: the last batch has 5 examples.
  LayoutStrategy worker1(2, 1, 2);
  DistributedDataset data(worker1, 13, {.global_batch_size = 8});
  ASSERT_EQ(data.steps_per_epoch(), 2u);
  EXPECT_EQ(data.GlobalBatchSize(1), 5u);
  EXPECT_EQ(data.GlobalReplicaBatch(0, 1, 0), (std::vector<size_t>{8, 9}));
  EXPECT_EQ(data.GlobalReplicaBatch(0, 1, 1), (std::vector<size_t>{10, 11}));
  EXPECT_EQ(data.ReplicaBatch(0, 1, 0), (std::vector<size_t>{12}));  // global replica 2
  EXPECT_EQ(data.ReplicaBatch(0, 1, 1), (std::vector<size_t>{}));    // global replica 3
  // A full batch: worker 1 takes the second half, split over its replicas.
  EXPECT_EQ(data.ReplicaBatch(0, 0, 0), (std::vector<size_t>{4, 5}));
  EXPECT_EQ(data.ReplicaBatch(0, 0, 1), (std::vector<size_t>{6, 7}));

  DistributedDataset dropped(worker1, 13, {.global_batch_size = 8, .drop_remainder = true});
  EXPECT_EQ(dropped.steps_per_epoch(), 1u);
  ExpectError(ErrorCode::kInvalidArgument, {"step 1", "1 steps"},
              [&] { dropped.ReplicaBatch(0, 1, 0); });
}

// A global batch larger than the dataset is one partial batch per epoch, whatever its size: the
// largest size_t (one batch of everything, on one replica or on 3, which divide it) too, whose
// round-up (n + B - 1) / B must not wrap around to 0 steps, which would have every epoch
// silently see nothing.
TEST(DistributedDatasetTest, AGlobalBatchLargerThanTheDatasetIsOneStep) {
  constexpr size_t kLargest = std::numeric_limits<size_t>::max();
  for (int local : {1, 3}) {
    SCOPED_TRACE(local);
    LayoutStrategy worker(1, 0, local);
    DistributedDataset data(worker, 10, {.global_batch_size = kLargest});
    ASSERT_EQ(data.steps_per_epoch(), 1u);
    EXPECT_EQ(data.GlobalBatchSize(0), 10u);
    std::vector<size_t> all = data.ReplicaBatch(0, 0, 0);
    std::vector<size_t> expected(10);
    std::iota(expected.begin(), expected.end(), size_t{0});
    EXPECT_EQ(all, expected);  // replica 0 takes up to B / N: all of them
    DistributedDataset dropped(worker, 10, {.global_batch_size = kLargest, .drop_remainder = true});
    EXPECT_EQ(dropped.steps_per_epoch(), 0u);
  }
}

TEST(DistributedDatasetTest, ShuffleDependsOnSeedAndEpochOnly) {
  LayoutStrategy one(1, 0, 1);
  const auto order = [&](uint64_t seed, int64_t epoch) {
    DistributedDataset d(one, 50, {.global_batch_size = 50, .shuffle = true, .seed = seed});
    return d.GlobalReplicaBatch(epoch, 0, 0);
  };
  const std::vector<size_t> a = order(1, 0);
  std::vector<size_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  std::vector<size_t> identity(50);
  std::iota(identity.begin(), identity.end(), size_t{0});
  EXPECT_EQ(sorted, identity);           // a permutation
  EXPECT_NE(a, identity);                // that moves things
  EXPECT_EQ(order(1, 0), a);             // deterministic
  EXPECT_NE(order(1, 1), a);             // a new order every epoch
  EXPECT_NE(order(2, 0), a);             // and per seed
  // Without shuffle: the identity whatever the seed.
  DistributedDataset plain(one, 50, {.global_batch_size = 50, .seed = 3});
  EXPECT_EQ(plain.GlobalReplicaBatch(5, 0, 0), identity);
}

TEST(DistributedDatasetTest, ShuffleIsTheSameWithEveryStandardLibrary) {
  // Golden values: mt19937_64 is fixed by the standard and the shuffle is our own, so this order
  // must never change (checkpointed jobs resume on the same data order).
  LayoutStrategy one(1, 0, 1);
  DistributedDataset d(one, 10, {.global_batch_size = 10, .shuffle = true, .seed = 42});
  EXPECT_EQ(d.GlobalReplicaBatch(0, 0, 0), (std::vector<size_t>{9, 6, 2, 0, 1, 4, 3, 8, 5, 7}));
  EXPECT_EQ(d.GlobalReplicaBatch(3, 0, 0), (std::vector<size_t>{6, 5, 7, 9, 4, 2, 0, 8, 3, 1}));
}

TEST(DistributedDatasetTest, ReplicasOfOneWorkerAskConcurrently) {
  MirroredStrategy strategy({.num_replicas = 4});
  DistributedDataset data(strategy, 1000, {.global_batch_size = 40, .shuffle = true, .seed = 9});
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int> seen(1000, 0);
    for (size_t step = 0; step < data.steps_per_epoch(); ++step) {
      auto batches = strategy.Run([&](ReplicaContext& ctx) {
        return data.ReplicaBatch(epoch, step, ctx.local_replica_id());
      });
      for (const auto& batch : batches) {
        for (size_t i : batch) ++seen[i];
      }
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), 1000);
  }
}

TEST(DistributedDatasetTest, BadArguments) {
  LayoutStrategy four(2, 0, 2);
  ExpectError(ErrorCode::kInvalidArgument, {"global_batch_size 30", "4 replicas", "2 workers x 2"},
              [&] { DistributedDataset(four, 100, {.global_batch_size = 30}); });
  ExpectError(ErrorCode::kInvalidArgument, {"global_batch_size must be > 0"},
              [&] { DistributedDataset(four, 100, {.global_batch_size = 0}); });
  DistributedDataset data(four, 100, {.global_batch_size = 8});
  ExpectError(ErrorCode::kInvalidArgument, {"local replica 2"}, [&] { data.ReplicaBatch(0, 0, 2); });
  ExpectError(ErrorCode::kInvalidArgument, {"replica 4"}, [&] { data.GlobalReplicaBatch(0, 0, 4); });
  ExpectError(ErrorCode::kInvalidArgument, {"epoch -1"}, [&] { data.ReplicaBatch(-1, 0, 0); });
  ExpectError(ErrorCode::kInvalidArgument, {"step 13"}, [&] { data.GlobalBatchSize(13); });
}

TEST(DistributedDatasetTest, WorkersGivenDifferentDatasetsAllGetMismatch) {
  testing::RunWorkers(3, 1, CrossDeviceOps::kAuto, [](Strategy& s, int rank) {
    const std::string seed = "worker " + std::to_string(rank) +
                             " DistributedDataset: the workers disagree on seed: worker 0 has "
                             "'7', worker 1 has '8'";
    ExpectError(ErrorCode::kMismatch, {seed.c_str()}, [&] {
      DistributedDataset(s, 100,
                         {.global_batch_size = 12, .shuffle = true, .seed = rank == 1 ? 8u : 7u});
    });
    // Worker 2's batch is not divisible by the 3 replicas: a mismatch on every worker still, not
    // an argument error on worker 2 alone while the others wait.
    ExpectError(ErrorCode::kMismatch,
                {"disagree on global_batch_size: worker 0 has '12', worker 2 has '10'"},
                [&] { DistributedDataset(s, 100, {.global_batch_size = rank == 2 ? 10u : 12u}); });
    ExpectError(ErrorCode::kMismatch,
                {"disagree on num_examples: worker 0 has '100', worker 1 has '99'"},
                [&] { DistributedDataset(s, rank == 1 ? 99 : 100, {.global_batch_size = 12}); });
    ExpectError(ErrorCode::kMismatch,
                {"disagree on drop_remainder: worker 0 has 'false', worker 2 has 'true'"}, [&] {
                  DistributedDataset(s, 100,
                                     {.global_batch_size = 12, .drop_remainder = rank == 2});
                });
    ExpectError(
        ErrorCode::kMismatch, {"disagree on shuffle: worker 0 has 'true', worker 1 has 'false'"},
        [&] { DistributedDataset(s, 100, {.global_batch_size = 12, .shuffle = rank != 1}); });
    // Without shuffle the seed is not used, so it may differ.
    DistributedDataset plain(s, 100,
                             {.global_batch_size = 12, .seed = static_cast<uint64_t>(rank)});
    EXPECT_EQ(plain.steps_per_epoch(), 9u);
    // Every worker stopped at the same point, so the strategy is still usable.
    EXPECT_EQ(s.Reduce(ReduceOp::kSum, PerReplica<double>{1.0}), 3.0);
  });
}

TEST(DatasetComputeAverageLossTest, DividesByTheGlobalBatch) {
  const std::vector<float> losses = {1.0f, 2.0f, 3.5f};
  EXPECT_DOUBLE_EQ(ComputeAverageLoss(losses, 12), 6.5 / 12);
  const std::vector<float> weights = {0.5f, 0.0f, 2.0f};
  EXPECT_DOUBLE_EQ(ComputeAverageLoss(losses, 12, weights), (0.5 + 7.0) / 12);
  EXPECT_DOUBLE_EQ(ComputeAverageLoss({}, 4), 0.0);
  // Summed over replicas, the shares are the mean of the global batch.
  const std::vector<float> a = {1, 2}, b = {3, 4};
  EXPECT_DOUBLE_EQ(ComputeAverageLoss(a, 4) + ComputeAverageLoss(b, 4), 2.5);
  ExpectError(ErrorCode::kInvalidArgument, {"global_batch_size"},
              [&] { ComputeAverageLoss(losses, 0); });
  ExpectError(ErrorCode::kInvalidArgument, {"2 sample weights for 3 losses"},
              [&] { ComputeAverageLoss(losses, 3, std::vector<float>{1, 1}); });
}

}  // namespace
}  // namespace collectives::strategy
