// Helpers shared by the strategy tests: workers of a MultiWorkerMirroredStrategy as threads of the
// test process (a shared memory store, real loopback TCP between them), a strategy with any
// worker layout and no communicator (for the dataset, which only reads the layout), and bitwise
// comparisons.
#ifndef COLLECTIVES_TESTS_STRATEGY_STRATEGY_TEST_UTIL_H_
#define COLLECTIVES_TESTS_STRATEGY_STRATEGY_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "collectives/strategy.h"
#include "src/strategy/strategy_impl.h"

namespace collectives::strategy::testing {

// The options of worker `rank` of `world` workers with `local` replicas each.
inline MultiWorkerOptions WorkerOptions(int rank, int world, int local,
                                        std::shared_ptr<Store> store,
                                        CrossDeviceOps ops = CrossDeviceOps::kAuto) {
  MultiWorkerOptions options;
  ClusterSpec spec;
  spec.rank = rank;
  spec.world_size = world;
  spec.master_port = 1;  // unused: the store is given
  options.cluster = spec;
  options.store = std::move(store);
  options.num_local_replicas = local;
  options.cross_device_ops = ops;
  options.communication.timeout = std::chrono::seconds(20);  // a failing test must not hang
  return options;
}

// Runs `body(strategy, rank)` on `world` worker threads, each with its own
// MultiWorkerMirroredStrategy of `local` replicas. Returns each worker's exception (null if none).
inline std::vector<std::exception_ptr> RunWorkersCatching(
    int world, int local, CrossDeviceOps ops,
    const std::function<void(Strategy&, int)>& body,
    const std::function<void(MultiWorkerOptions&)>& adjust = {}) {
  auto store = CreateMemoryStore();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        MultiWorkerOptions options = WorkerOptions(rank, world, local, store, ops);
        if (adjust) adjust(options);
        MultiWorkerMirroredStrategy strategy(options);
        body(strategy, rank);
      } catch (...) {
        errors[static_cast<size_t>(rank)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

inline std::string Describe(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "non-std exception";
  }
}

// As RunWorkersCatching; any exception is a test failure.
inline void RunWorkers(int world, int local, CrossDeviceOps ops,
                       const std::function<void(Strategy&, int)>& body,
                       const std::function<void(MultiWorkerOptions&)>& adjust = {}) {
  const auto errors = RunWorkersCatching(world, local, ops, body, adjust);
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r]) ADD_FAILURE() << "worker " << r << " threw: " << Describe(errors[r]);
  }
}

// A strategy claiming to be worker `worker` of `workers`, with `local` CPU replicas and no
// communicator: enough for what only reads the layout (DistributedDataset).
class LayoutStrategy : public Strategy {
 public:
  LayoutStrategy(int workers, int worker, int local) : Strategy(Make(workers, worker, local)) {}

 private:
  static std::unique_ptr<StrategyImpl> Make(int workers, int worker, int local) {
    StrategyImpl::Config config;
    config.name = "layout";
    config.devices.assign(static_cast<size_t>(local), Device::Cpu());
    config.num_workers = workers;
    config.worker_index = worker;
    return std::make_unique<StrategyImpl>(std::move(config));
  }
};

// Expects `fn` to throw collectives::Error with `code` and a message containing every fragment.
template <typename Fn>
void ExpectError(ErrorCode code, std::initializer_list<const char*> fragments, Fn&& fn) {
  try {
    fn();
    ADD_FAILURE() << "expected Error(" << ToString(code) << "), nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const char* f : fragments) {
      EXPECT_NE(e.message().find(f), std::string::npos) << "'" << f << "' not in: " << e.what();
    }
  }
}

inline void ExpectErrorPtr(const std::exception_ptr& error, ErrorCode code,
                           std::initializer_list<const char*> fragments) {
  ASSERT_TRUE(error) << "expected Error(" << ToString(code) << ")";
  ExpectError(code, fragments, [&] { std::rethrow_exception(error); });
}

inline bool BitEqual(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size_bytes()) == 0);
}

}  // namespace collectives::strategy::testing

#endif  // COLLECTIVES_TESTS_STRATEGY_STRATEGY_TEST_UTIL_H_
