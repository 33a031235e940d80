// DistributedDataset: which example indices every replica of every worker gets at every step.
//
// The order of an epoch: 0..n-1, or with shuffle a permutation of it drawn by Fisher-Yates from
// std::mt19937_64 seeded with a mix (SplitMix64) of (seed, epoch). The standard fixes
// mt19937_64's output but not std::shuffle's or std::uniform_int_distribution's algorithm, so
// both are written here (bounded draws by rejection: no modulo bias): every worker, built with
// any standard library, computes the same permutation.
//
// The batches: global batch `step` is order[step*B, step*B + b), b = min(B, n - step*B). With
// N = NumReplicasInSync() replicas and p = B/N, global replica g (= worker * local replicas +
// local id) takes elements [min(g*p, b), min((g+1)*p, b)) of it. For a full batch this is the
// DATA-policy split (worker w takes its contiguous 1/W, then splits it over its local replicas);
// for a last partial batch it fills the replicas in order of g with p examples each, so the last
// replicas may get fewer or none.
#include <algorithm>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <utility>

#include "collectives/errors.h"
#include "collectives/strategy.h"
#include "src/strategy/strategy_impl.h"

namespace collectives::strategy {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, "DistributedDataset: " + message);
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [0, bound), bound > 0: draws below 2^64 mod bound are rejected, so the accepted
// range is a whole number of copies of [0, bound).
uint64_t Below(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t x = rng();
    if (x >= threshold) return x % bound;
  }
}

std::vector<size_t> ShuffledOrder(size_t n, uint64_t seed, int64_t epoch) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937_64 rng(SplitMix64(seed ^ SplitMix64(static_cast<uint64_t>(epoch))));
  for (size_t i = n; i > 1; --i) {
    const size_t j = static_cast<size_t>(Below(rng, i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

}  // namespace

struct DistributedDataset::OrderCache {
  std::mutex mu;
  int64_t epoch = -1;
  std::shared_ptr<const std::vector<size_t>> order;
};

DistributedDataset::DistributedDataset(const Strategy& strategy, size_t num_examples,
                                       DatasetOptions options)
    : num_examples_(num_examples),
      options_(options),
      num_replicas_(strategy.NumReplicasInSync()),
      replicas_per_worker_(strategy.num_local_replicas()),
      worker_index_(strategy.worker_index()) {
  // Workers given different datasets would each cover their own order: some examples twice per
  // epoch, others never, and nothing would say so. First, so that the checks below
  // fail on every worker or on none.
  StrategyImpl& impl = strategy.impl();
  impl.CheckCrossReplica("DistributedDataset");
  StrategyImpl::Description mine{{"num_examples", std::to_string(num_examples_)},
                                 {"global_batch_size", std::to_string(options_.global_batch_size)},
                                 {"drop_remainder", options_.drop_remainder ? "true" : "false"},
                                 {"shuffle", options_.shuffle ? "true" : "false"}};
  if (options_.shuffle) mine.emplace_back("seed", std::to_string(options_.seed));
  impl.AgreeAcrossWorkers("DistributedDataset", mine);
  if (options_.global_batch_size == 0) Invalid("global_batch_size must be > 0");
  if (options_.global_batch_size % static_cast<size_t>(num_replicas_) != 0) {
    Invalid("global_batch_size " + std::to_string(options_.global_batch_size) +
            " is not divisible by the " + std::to_string(num_replicas_) +
            " replicas in sync (" + std::to_string(strategy.num_workers()) + " workers x " +
            std::to_string(replicas_per_worker_) + " local replicas)");
  }
  if (options_.shuffle) order_cache_ = std::make_shared<OrderCache>();
}

size_t DistributedDataset::per_replica_batch_size() const {
  return options_.global_batch_size / static_cast<size_t>(num_replicas_);
}

size_t DistributedDataset::steps_per_epoch() const {
  const size_t b = options_.global_batch_size;
  // Rounded up without n + b - 1, which wraps around for a b near the largest size_t.
  const size_t full = num_examples_ / b;
  return options_.drop_remainder || num_examples_ % b == 0 ? full : full + 1;
}

size_t DistributedDataset::GlobalBatchSize(size_t step) const {
  if (step >= steps_per_epoch()) {
    Invalid("step " + std::to_string(step) + " is out of range (an epoch has " +
            std::to_string(steps_per_epoch()) + " steps)");
  }
  return std::min(options_.global_batch_size, num_examples_ - step * options_.global_batch_size);
}

std::vector<size_t> DistributedDataset::Order(int64_t epoch) const {
  if (epoch < 0) Invalid("epoch " + std::to_string(epoch) + " is negative");
  if (!options_.shuffle) {
    std::vector<size_t> order(num_examples_);
    std::iota(order.begin(), order.end(), size_t{0});
    return order;
  }
  return ShuffledOrder(num_examples_, options_.seed, epoch);
}

std::vector<size_t> DistributedDataset::ReplicaBatch(int64_t epoch, size_t step,
                                                     int local_replica) const {
  if (local_replica < 0 || local_replica >= replicas_per_worker_) {
    Invalid("local replica " + std::to_string(local_replica) + " is out of range (this worker has " +
            std::to_string(replicas_per_worker_) + ")");
  }
  return GlobalReplicaBatch(epoch, step, worker_index_ * replicas_per_worker_ + local_replica);
}

std::vector<size_t> DistributedDataset::GlobalReplicaBatch(int64_t epoch, size_t step,
                                                           int replica_id) const {
  if (epoch < 0) Invalid("epoch " + std::to_string(epoch) + " is negative");
  if (replica_id < 0 || replica_id >= num_replicas_) {
    Invalid("replica " + std::to_string(replica_id) + " is out of range (there are " +
            std::to_string(num_replicas_) + " replicas in sync)");
  }
  const size_t b = GlobalBatchSize(step);
  const size_t p = per_replica_batch_size();
  const size_t g = static_cast<size_t>(replica_id);
  const size_t base = step * options_.global_batch_size;
  const size_t begin = base + std::min(g * p, b);
  const size_t end = base + std::min((g + 1) * p, b);
  std::vector<size_t> out;
  out.reserve(end - begin);
  if (!options_.shuffle) {
    for (size_t i = begin; i < end; ++i) out.push_back(i);
    return out;
  }
  // The replicas of a worker ask for the same epoch at once: the first computes the order, the
  // others share it.
  std::shared_ptr<const std::vector<size_t>> order;
  {
    std::lock_guard<std::mutex> lock(order_cache_->mu);
    if (order_cache_->epoch != epoch || !order_cache_->order) {
      order_cache_->order = std::make_shared<const std::vector<size_t>>(
          ShuffledOrder(num_examples_, options_.seed, epoch));
      order_cache_->epoch = epoch;
    }
    order = order_cache_->order;
  }
  out.assign(order->begin() + static_cast<std::ptrdiff_t>(begin),
             order->begin() + static_cast<std::ptrdiff_t>(end));
  return out;
}

}  // namespace collectives::strategy
