// ParameterServerStrategy and ClusterCoordinator: servers as threads on loopback, and as real
// processes (this binary run again in a server role) for the cases that kill one.
//
// Every expected value is computed here, independently of the library: variable values from the
// initialisers' formulas, sums of pushed gradients, and Adam from Keras' formula in double.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "collectives/errors.h"
#include "collectives/parameter_server.h"
#include "src/strategy/parameter_server_wire.h"
#include "tests/free_port.h"
#include "tests/time_scale.h"

namespace collectives::strategy {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr char kToken[] = "parameter-server-test-token";

std::string EncodeFloats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}
std::vector<float> DecodeFloats(const std::string& s) {
  std::vector<float> v(s.size() / sizeof(float));
  std::memcpy(v.data(), s.data(), v.size() * sizeof(float));
  return v;
}

// The gradient of step `i` for a variable of `count` elements: small integers, so that sums are
// exact in float whatever the order.
std::vector<float> StepGradient(int i, size_t count) {
  std::vector<float> g(count);
  for (size_t j = 0; j < count; ++j) g[j] = float((i % 7) + 1) * float((j % 3) + 1);
  return g;
}

// A gradient for Adam's test: varies with the step and the element.
std::vector<float> AdamGradient(int step, size_t count) {
  std::vector<float> g(count);
  for (size_t j = 0; j < count; ++j) g[j] = float(std::sin(0.7 * step + 0.3 * double(j)));
  return g;
}

// The value the initialiser "pattern" gives element j of a variable.
float Pattern(size_t j, float scale) { return scale * float(int(j % 17) - 8) + 0.25f; }
Initializer PatternInit(float scale) {
  return [scale](std::span<float> v) {
    for (size_t j = 0; j < v.size(); ++j) v[j] = Pattern(j, scale);
  };
}

struct Counter {
  int worker = -1;
  int next = 0;
};

fs::path FlagDir() {
  const char* dir = std::getenv("COLLECTIVES_PS_TEST_DIR");
  return dir != nullptr ? fs::path(dir) : fs::temp_directory_path();
}

// Every task of every test registers the same functions (as one binary of a real job does).
void RegisterTestFunctions() {
  // Returns every variable's value, put together, in creation order.
  RegisterFunction("read_all", [](WorkerContext& ctx, const std::string&) {
    std::vector<std::string> names;
    for (const PsVariable& v : ctx.variables()) names.push_back(v.name);
    std::vector<float> all;
    for (const std::vector<float>& v : ctx.Read(names)) all.insert(all.end(), v.begin(), v.end());
    return EncodeFloats(all);
  });
  // Pushes StepGradient(i) to every variable; args: i as text.
  RegisterFunction("push_step", [](WorkerContext& ctx, const std::string& args) {
    const int i = std::stoi(args);
    std::vector<std::vector<float>> gradients;
    std::vector<std::pair<std::string, std::span<const float>>> pushes;
    for (const PsVariable& v : ctx.variables()) gradients.push_back(StepGradient(i, v.count));
    for (size_t k = 0; k < gradients.size(); ++k) {
      pushes.emplace_back(ctx.variables()[k].name, gradients[k]);
    }
    ctx.PushGradients(pushes);
    return std::to_string(ctx.worker_index());
  });
  RegisterFunction("adam_step", [](WorkerContext& ctx, const std::string& args) {
    const int i = std::stoi(args);
    std::vector<float> g = AdamGradient(i, ctx.variables()[0].count);
    ctx.PushGradients({{ctx.variables()[0].name, g}});
    return std::string();
  });
  // Sleeps `args` ms, then pushes ones to "w"; returns "<pid>". While <flags>/hang exists, a
  // step on worker 1 says so in <flags>/started-<pid> and sleeps for 60 s instead.
  RegisterFunction("slow_push", [](WorkerContext& ctx, const std::string& args) {
    const fs::path dir = FlagDir();
    if (ctx.worker_index() == 1 && fs::exists(dir / "hang")) {
      std::ofstream(dir / ("started-" + std::to_string(getpid()))) << "1";
      std::this_thread::sleep_for(std::chrono::seconds(60));
    }
    std::this_thread::sleep_for(milliseconds(std::stoi(args)));
    std::vector<float> ones(ctx.variables()[0].count, 1.0f);
    ctx.PushGradients({{"w", ones}});
    return std::to_string(getpid());
  });
  // Ends the worker's process (only in a child: never the test's own).
  RegisterFunction("die", [](WorkerContext&, const std::string&) -> std::string {
    if (std::getenv("COLLECTIVES_PS_TEST_ROLE") == nullptr) {
      throw Error(ErrorCode::kInvalidUsage, "'die' runs only on a worker process");
    }
    _exit(3);
  });
  RegisterFunction("fail", [](WorkerContext&, const std::string&) -> std::string {
    throw Error(ErrorCode::kInvalidArgument, "the step says boom");
  });
  RegisterFunction("next_from_dataset", [](WorkerContext& ctx, const std::string&) {
    Counter& c = ctx.PerWorker<Counter>("counter");
    return std::to_string(c.worker) + ":" + std::to_string(c.next++);
  });
  RegisterDatasetFunction("counter", [](WorkerContext& ctx, const std::string& args) {
    auto c = std::make_shared<Counter>();
    c->worker = ctx.worker_index();
    c->next = std::stoi(args);
    return std::shared_ptr<void>(c);
  });
}

std::vector<std::string> SplitComma(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

std::string JoinComma(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

// The coordinator the coordinator-kill test kills: 10 steps of push_step, a checkpoint in
// <flags>/ckpt, the file <flags>/saved, then steps until it is killed.
void RunTestCoordinator() {
  ParameterServerOptions options;
  ClusterSpec spec;
  spec.task_type = "chief";
  options.cluster = spec;
  options.ps_addresses = SplitComma(std::getenv("COLLECTIVES_PS_TEST_PS"));
  options.worker_addresses = SplitComma(std::getenv("COLLECTIVES_PS_TEST_WORKERS"));
  options.job_token = kToken;
  options.optimizer = PsOptimizer::Sgd({.learning_rate = 1.0f});
  try {
    ParameterServerStrategy strategy(options);
    strategy.CreateVariable("w", {5}, Zeros());
    ClusterCoordinator coordinator(strategy);
    for (int i = 0; i < 10; ++i) coordinator.Schedule("push_step", std::to_string(i));
    coordinator.Join(milliseconds(30'000));
    strategy.SaveCheckpoint((FlagDir() / "ckpt").string(), {1, 0});
    std::ofstream(FlagDir() / "saved") << "1";
    for (int i = 0; i < 1000; ++i) coordinator.Schedule("slow_push", "20");
    std::this_thread::sleep_for(std::chrono::seconds(60));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "coordinator: %s\n", e.what());
    _exit(1);
  }
}

// This binary run as a server: COLLECTIVES_PS_TEST_ROLE="ps:1" or "worker:0", the addresses in
// COLLECTIVES_PS_TEST_PS and COLLECTIVES_PS_TEST_WORKERS. Runs before main and never returns.
const bool kRegistered = [] {
  RegisterTestFunctions();
  const char* role = std::getenv("COLLECTIVES_PS_TEST_ROLE");
  if (role == nullptr) return true;
  const std::string text = role;
  const size_t colon = text.find(':');
  if (text.substr(0, colon) == "coordinator") {
    RunTestCoordinator();
    _exit(0);
  }
  ParameterServerOptions options;
  ClusterSpec spec;
  spec.task_type = text.substr(0, colon);
  spec.task_index = std::stoi(text.substr(colon + 1));
  options.cluster = spec;
  options.ps_addresses = SplitComma(std::getenv("COLLECTIVES_PS_TEST_PS"));
  options.worker_addresses = SplitComma(std::getenv("COLLECTIVES_PS_TEST_WORKERS"));
  options.job_token = kToken;
  try {
    RunServer(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "server %s: %s\n", role, e.what());
    _exit(1);
  }
  _exit(0);
}();

std::vector<std::string> LoopbackAddresses(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) {
    out.push_back("127.0.0.1:" + std::to_string(testing::FreePort()));
  }
  return out;
}

ParameterServerOptions Options(const std::vector<std::string>& ps,
                               const std::vector<std::string>& workers) {
  ParameterServerOptions options;
  ClusterSpec spec;
  spec.task_type = "chief";
  options.cluster = spec;
  options.ps_addresses = ps;
  options.worker_addresses = workers;
  options.job_token = kToken;
  options.connect_timeout = milliseconds(10'000);
  options.request_timeout = milliseconds(10'000);
  options.ps_timeout = milliseconds(3'000);
  options.heartbeat_interval = milliseconds(100);
  options.step_timeout = milliseconds(20'000);
  options.no_worker_timeout = milliseconds(20'000);
  options.reconnect_interval = milliseconds(50);
  return options;
}

std::unique_ptr<Server> StartThreadServer(const ParameterServerOptions& base, const char* type,
                                          int index) {
  ParameterServerOptions options = base;
  options.cluster->task_type = type;
  options.cluster->task_index = index;
  return StartServer(options);
}

// Servers as threads of this process.
struct ThreadCluster {
  ThreadCluster(int num_ps, int num_workers)
      : ps(LoopbackAddresses(num_ps)), workers(LoopbackAddresses(num_workers)) {
    const ParameterServerOptions options = Options(ps, workers);
    for (int i = 0; i < num_ps; ++i) servers.push_back(StartThreadServer(options, "ps", i));
    for (int i = 0; i < num_workers; ++i) {
      servers.push_back(StartThreadServer(options, "worker", i));
    }
  }
  ParameterServerOptions options() const { return Options(ps, workers); }
  std::vector<std::string> ps;
  std::vector<std::string> workers;
  std::vector<std::unique_ptr<Server>> servers;
};

// A server as a child process (this binary, in a server role); killed with the test.
class ChildServer {
 public:
  ChildServer(const std::string& role, const std::vector<std::string>& ps,
              const std::vector<std::string>& workers, const fs::path& flags) {
    const std::string ps_list = JoinComma(ps);
    const std::string worker_list = JoinComma(workers);
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      setenv("COLLECTIVES_PS_TEST_ROLE", role.c_str(), 1);
      setenv("COLLECTIVES_PS_TEST_PS", ps_list.c_str(), 1);
      setenv("COLLECTIVES_PS_TEST_WORKERS", worker_list.c_str(), 1);
      setenv("COLLECTIVES_PS_TEST_DIR", flags.c_str(), 1);
      execl("/proc/self/exe", "parameter_server_test", static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~ChildServer() { Kill(); }
  pid_t pid() const { return pid_; }
  // True when it exits with status 0 within `limit`.
  bool ExitsCleanlyWithin(std::chrono::nanoseconds limit) {
    int status = 0;
    const auto until = Clock::now() + limit;
    while (Clock::now() < until) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) && WEXITSTATUS(status) == 0;
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    return false;
  }
  void Kill() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

 private:
  pid_t pid_ = -1;
};

template <typename Predicate>
bool WaitUntil(Predicate done, std::chrono::nanoseconds limit) {
  const auto until = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

// ---- Tests ----

TEST(ParameterServerTest, PlacementAndShardingAreInvisibleToTheStep) {
  ThreadCluster cluster(3, 1);
  ParameterServerOptions options = cluster.options();
  // Cut into shards of at most 3 rows of 4 floats: "kernel" (10 x 4) gets 4 shards.
  options.partitioner = Partitioner::MaxShardBytes(3 * 4 * sizeof(float));
  ParameterServerStrategy strategy(options);
  const PsVariable& kernel = strategy.CreateVariable("kernel", {10, 4}, PatternInit(0.5f));
  const PsVariable& bias = strategy.CreateVariable("bias", {20}, PatternInit(-1.0f));
  const PsVariable& scalar = strategy.CreateVariable("scalar", {}, Constant(3.5f));

  // Shards: whole rows, in order, covering the variable, spread over every ps.
  ASSERT_EQ(kernel.shards.size(), 4u);
  std::set<int> used;
  size_t end = 0;
  for (const PsShard& s : kernel.shards) {
    EXPECT_EQ(s.offset, end);
    EXPECT_EQ(s.count % 4, 0u);
    EXPECT_LE(s.count, 12u);
    end += s.count;
    used.insert(s.ps_index);
  }
  EXPECT_EQ(end, 40u);
  EXPECT_EQ(used.size(), 3u);
  // The bias (20 floats, 80 bytes) is two shards of 10; the scalar one.
  ASSERT_EQ(bias.shards.size(), 2u);
  EXPECT_EQ(bias.shards[0].count, 10u);
  EXPECT_EQ(scalar.shards.size(), 1u);

  std::vector<float> expected;
  for (size_t j = 0; j < 40; ++j) expected.push_back(Pattern(j, 0.5f));
  for (size_t j = 0; j < 20; ++j) expected.push_back(Pattern(j, -1.0f));
  expected.push_back(3.5f);

  ClusterCoordinator coordinator(strategy);
  const std::vector<float> read = DecodeFloats(coordinator.Schedule("read_all").Fetch());
  EXPECT_EQ(read, expected);
  std::vector<float> kernel_value = strategy.Read("kernel");
  EXPECT_EQ(kernel_value, std::vector<float>(expected.begin(), expected.begin() + 40));

  // Fixed shards: min(rows, shards).
  ParameterServerOptions fixed = cluster.options();
  fixed.partitioner = Partitioner::FixedShards(3);
  ParameterServerStrategy fixed_strategy(fixed);
  EXPECT_EQ(fixed_strategy.CreateVariable("k2", {7, 2}, Zeros()).shards.size(), 3u);
  EXPECT_EQ(fixed_strategy.CreateVariable("b2", {2}, Zeros()).shards.size(), 2u);
  EXPECT_THROW(fixed_strategy.CreateVariable("k2", {1}, Zeros()), Error);
}

TEST(ParameterServerTest, TheClusterComesFromTfConfig) {
  const std::vector<std::string> a = LoopbackAddresses(4);
  const std::string cluster = R"({"cluster": {"chief": [")" + a[0] + R"("], "worker": [")" +
                              a[1] + R"("], "ps": [")" + a[2] + R"(", ")" + a[3] + R"("]}, )";
  const auto spec = [&](const std::string& type, int index) {
    ClusterSpec s = ClusterSpec::FromTfConfig(cluster + R"("task": {"type": ")" + type +
                                              R"(", "index": )" + std::to_string(index) + "}}");
    s.job_token = kToken;
    return s;
  };
  std::vector<std::unique_ptr<Server>> servers;
  for (const auto& [type, index] : {std::pair<std::string, int>{"ps", 0}, {"ps", 1}, {"worker", 0}}) {
    ParameterServerOptions options;
    options.cluster = spec(type, index);
    servers.push_back(StartServer(options));
  }
  ParameterServerOptions options;
  options.cluster = spec("chief", 0);
  ParameterServerStrategy strategy(options);
  EXPECT_EQ(strategy.num_ps(), 2);
  EXPECT_EQ(strategy.num_workers(), 1);
  strategy.CreateVariable("a", {2}, Constant(1.0f));
  strategy.CreateVariable("b", {1}, Constant(2.0f));
  EXPECT_EQ(strategy.variables()[1].shards[0].ps_index, 1);  // round-robin
  ClusterCoordinator coordinator(strategy);
  EXPECT_EQ(DecodeFloats(coordinator.Schedule("read_all").Fetch(milliseconds(10'000))),
            (std::vector<float>{1, 1, 2}));

  // A layout without a ps is refused, naming the rule.
  ParameterServerOptions no_ps;
  no_ps.cluster = ClusterSpec::FromTfConfig(R"({"cluster": {"chief": [")" + a[0] +
                                            R"("], "worker": [")" + a[1] +
                                            R"("]}, "task": {"type": "chief", "index": 0}})");
  try {
    ParameterServerStrategy refused(no_ps);
    ADD_FAILURE() << "a cluster without a ps was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find("ps"), std::string::npos) << e.what();
  }
}

TEST(ParameterServerTest, ConcurrentPushesFromEveryWorkerAllLand) {
  ThreadCluster cluster(2, 3);
  ParameterServerOptions options = cluster.options();
  options.partitioner = Partitioner::FixedShards(2);
  options.optimizer = PsOptimizer::Sgd({.learning_rate = 1.0f});
  ParameterServerStrategy strategy(options);
  strategy.CreateVariable("a", {6, 5}, PatternInit(2.0f));
  strategy.CreateVariable("b", {3}, Zeros());
  ClusterCoordinator coordinator(strategy);
  constexpr int kSteps = 240;
  std::vector<RemoteValue> values;
  for (int i = 0; i < kSteps; ++i) values.push_back(coordinator.Schedule("push_step", std::to_string(i)));
  coordinator.Join(milliseconds(60'000));
  EXPECT_TRUE(coordinator.Done());
  std::set<std::string> workers_used;
  for (const RemoteValue& v : values) workers_used.insert(v.Fetch());
  EXPECT_GT(workers_used.size(), 1u) << "every step ran on one worker";

  // w = init - sum of every step's gradient (lr 1), exact in float.
  for (const auto& [name, count, scale] :
       {std::tuple<std::string, size_t, float>{"a", 30, 2.0f}, {"b", 3, 0.0f}}) {
    std::vector<double> expected(count);
    for (size_t j = 0; j < count; ++j) expected[j] = name == "a" ? Pattern(j, scale) : 0.0;
    for (int i = 0; i < kSteps; ++i) {
      const std::vector<float> g = StepGradient(i, count);
      for (size_t j = 0; j < count; ++j) expected[j] -= g[j];
    }
    const std::vector<float> got = strategy.Read(name);
    for (size_t j = 0; j < count; ++j) EXPECT_EQ(double(got[j]), expected[j]) << name << j;
  }
  EXPECT_EQ(strategy.iterations(), kSteps);
}

TEST(ParameterServerTest, AdamOnTheParameterServersEqualsAReferenceAdam) {
  ThreadCluster cluster(2, 1);
  ParameterServerOptions options = cluster.options();
  options.partitioner = Partitioner::FixedShards(2);
  const AdamOptions adam{.learning_rate = 0.01f, .beta_1 = 0.9f, .beta_2 = 0.999f,
                         .epsilon = 1e-7f};
  options.optimizer = PsOptimizer::Adam(adam);
  ParameterServerStrategy strategy(options);
  constexpr size_t kCount = 12;
  strategy.CreateVariable("w", {4, 3}, PatternInit(0.1f));
  ClusterCoordinator coordinator(strategy);
  constexpr int kSteps = 30;
  for (int i = 1; i <= kSteps; ++i) coordinator.Schedule("adam_step", std::to_string(i));
  coordinator.Join(milliseconds(30'000));

  // Keras' Adam in double, one worker: the steps land in the order scheduled.
  std::vector<double> w(kCount), m(kCount, 0.0), v(kCount, 0.0);
  for (size_t j = 0; j < kCount; ++j) w[j] = Pattern(j, 0.1f);
  for (int t = 1; t <= kSteps; ++t) {
    const std::vector<float> g = AdamGradient(t, kCount);
    const double lr_t = 0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
    for (size_t j = 0; j < kCount; ++j) {
      m[j] = 0.9 * m[j] + 0.1 * g[j];
      v[j] = 0.999 * v[j] + 0.001 * double(g[j]) * g[j];
      w[j] -= lr_t * m[j] / (std::sqrt(v[j]) + 1e-7);
    }
  }
  const std::vector<float> got = strategy.Read("w");
  for (size_t j = 0; j < kCount; ++j) EXPECT_NEAR(got[j], w[j], 2e-5) << j;
  EXPECT_EQ(strategy.iterations(), kSteps);
}

// Keras' CosineDecay, written out here: `rate` to 0 over `decay_steps` updates, then 0.
double CosineRate(double rate, int64_t decay_steps, int64_t k) {
  return rate * 0.5 * (1 + std::cos(M_PI * double(std::min(k, decay_steps)) / double(decay_steps)));
}

// Keras' Adam in double from `w`, steps 1..steps with gradient AdamGradient(t) and learning rate
// CosineRate(rate, decay_steps, t - 1) (the schedule at the updates before step t).
std::vector<double> ReferenceCosineAdam(std::vector<double> w, int steps, double rate,
                                        int64_t decay_steps) {
  std::vector<double> m(w.size(), 0.0), v(w.size(), 0.0);
  for (int t = 1; t <= steps; ++t) {
    const std::vector<float> g = AdamGradient(t, w.size());
    const double lr_t = CosineRate(rate, decay_steps, t - 1) * std::sqrt(1 - std::pow(0.999, t)) /
                        (1 - std::pow(0.9, t));
    for (size_t j = 0; j < w.size(); ++j) {
      m[j] = 0.9 * m[j] + 0.1 * g[j];
      v[j] = 0.999 * v[j] + 0.001 * double(g[j]) * g[j];
      w[j] -= lr_t * m[j] / (std::sqrt(v[j]) + 1e-7);
    }
  }
  return w;
}

TEST(ParameterServerTest, CosineDecayOnTheParameterServersEqualsAReferenceAdam) {
  ThreadCluster cluster(2, 1);
  ParameterServerOptions options = cluster.options();
  options.partitioner = Partitioner::FixedShards(2);
  // 30 updates of a schedule over 20: the last 10 at rate 0 (the moments still move).
  constexpr int64_t kDecaySteps = 20;
  constexpr int kSteps = 30;
  options.optimizer = PsOptimizer::Adam({.learning_rate = 0.05f},
                                        PsLearningRateSchedule::CosineDecay(kDecaySteps));
  ParameterServerStrategy strategy(options);
  constexpr size_t kCount = 12;
  strategy.CreateVariable("w", {4, 3}, PatternInit(0.1f));
  ClusterCoordinator coordinator(strategy);
  // One worker: the steps land in the order scheduled.
  for (int i = 1; i <= kSteps; ++i) coordinator.Schedule("adam_step", std::to_string(i));
  coordinator.Join(milliseconds(30'000));

  std::vector<double> w0(kCount);
  for (size_t j = 0; j < kCount; ++j) w0[j] = Pattern(j, 0.1f);
  const std::vector<double> want = ReferenceCosineAdam(w0, kSteps, 0.05, kDecaySteps);
  const std::vector<double> constant = ReferenceCosineAdam(w0, kSteps, 0.05, 1'000'000'000);
  const std::vector<float> got = strategy.Read("w");
  double apart = 0;  // how far a constant rate ends from the schedule
  for (size_t j = 0; j < kCount; ++j) {
    EXPECT_NEAR(got[j], want[j], 2e-5) << j;
    apart = std::max(apart, std::abs(constant[j] - want[j]));
  }
  EXPECT_GT(apart, 1e-2);  // the tolerance above tells the two apart
  EXPECT_EQ(strategy.iterations(), kSteps);

  // A cosine without a length, or an unknown decay, is refused before anything is sent.
  for (const PsLearningRateSchedule& bad :
       {PsLearningRateSchedule::CosineDecay(0), PsLearningRateSchedule{"linear", 10}}) {
    ParameterServerOptions refused = cluster.options();
    refused.optimizer = PsOptimizer::Sgd({}, bad);
    try {
      ParameterServerStrategy other(refused);
      ADD_FAILURE() << "decay '" << bad.decay << "' over " << bad.decay_steps << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    }
  }
}

TEST(ParameterServerTest, ACheckpointRestoresTheSchedulesPosition) {
  ThreadCluster cluster(2, 1);
  const fs::path dir = fs::temp_directory_path() /
                       ("collectives_ps_lr_ckpt_" + std::to_string(getpid()));
  fs::remove_all(dir);
  ParameterServerOptions options = cluster.options();
  options.partitioner = Partitioner::FixedShards(2);
  constexpr int64_t kDecaySteps = 24;
  constexpr int kBefore = 10, kAfter = 14;
  options.optimizer = PsOptimizer::Adam({.learning_rate = 0.05f},
                                        PsLearningRateSchedule::CosineDecay(kDecaySteps));
  {
    ParameterServerStrategy strategy(options);
    strategy.CreateVariable("w", {6}, PatternInit(0.3f));
    ClusterCoordinator coordinator(strategy);
    for (int i = 1; i <= kBefore; ++i) coordinator.Schedule("adam_step", std::to_string(i));
    coordinator.Join(milliseconds(30'000));
    strategy.SaveCheckpoint(dir.string(), {1, 0});
    // Steps the checkpoint does not hold, then the coordinator goes away.
    for (int i = 0; i < 5; ++i) coordinator.Schedule("adam_step", "99");
    coordinator.Join(milliseconds(30'000));
  }
  // A new coordinator creates the variable afresh (its count at 0) and restores the checkpoint:
  // the schedule goes on from update kBefore, not from the start.
  ParameterServerStrategy strategy(options);
  strategy.CreateVariable("w", {6}, Zeros());
  ASSERT_TRUE(strategy.RestoreCheckpoint(dir.string()).has_value());
  EXPECT_EQ(strategy.iterations(), kBefore);
  ClusterCoordinator coordinator(strategy);
  for (int i = kBefore + 1; i <= kBefore + kAfter; ++i) {
    coordinator.Schedule("adam_step", std::to_string(i));
  }
  coordinator.Join(milliseconds(30'000));

  std::vector<double> w0(6);
  for (size_t j = 0; j < 6; ++j) w0[j] = Pattern(j, 0.3f);
  const std::vector<double> want = ReferenceCosineAdam(w0, kBefore + kAfter, 0.05, kDecaySteps);
  const std::vector<float> got = strategy.Read("w");
  for (size_t j = 0; j < 6; ++j) EXPECT_NEAR(got[j], want[j], 2e-5) << j;
  EXPECT_EQ(strategy.iterations(), kBefore + kAfter);
  fs::remove_all(dir);
}

TEST(ParameterServerTest, ScheduleFetchJoinAndStepErrors) {
  ThreadCluster cluster(1, 2);
  ParameterServerStrategy strategy(cluster.options());
  strategy.CreateVariable("w", {2}, Zeros());
  ClusterCoordinator coordinator(strategy);
  RemoteValue ok = coordinator.Schedule("read_all");
  RemoteValue bad = coordinator.Schedule("fail");
  RemoteValue unknown = coordinator.Schedule("no_such_function");
  EXPECT_EQ(DecodeFloats(ok.Fetch(milliseconds(10'000))), (std::vector<float>{0, 0}));
  try {
    bad.Fetch(milliseconds(10'000));
    ADD_FAILURE() << "the failing step returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find("boom"), std::string::npos) << e.what();
  }
  try {
    unknown.Fetch(milliseconds(10'000));
    ADD_FAILURE() << "an unknown function ran";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("no_such_function"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(bad.Done());
  EXPECT_THROW(coordinator.Join(milliseconds(10'000)), Error);  // the first step error, once
  coordinator.Join(milliseconds(10'000));
  EXPECT_TRUE(coordinator.Done());
  EXPECT_EQ(coordinator.rescheduled_steps(), 0);
}

TEST(ParameterServerTest, PerWorkerDatasetsLiveOnEachWorker) {
  ThreadCluster cluster(1, 2);
  ParameterServerStrategy strategy(cluster.options());
  strategy.CreateVariable("w", {1}, Zeros());
  ClusterCoordinator coordinator(strategy);
  ASSERT_TRUE(WaitUntil([&] { return coordinator.num_available_workers() == 2; },
                        test_time::Scaled(std::chrono::seconds(10))));
  const PerWorkerDataset dataset = coordinator.CreatePerWorkerDataset("counter", "100");
  EXPECT_EQ(dataset.name(), "counter");
  std::vector<RemoteValue> values;
  for (int i = 0; i < 40; ++i) values.push_back(coordinator.Schedule("next_from_dataset"));
  coordinator.Join(milliseconds(20'000));
  // Each worker's iterator hands out 100, 101, ... in order.
  std::map<int, std::vector<int>> seen;
  for (const RemoteValue& v : values) {
    const std::string r = v.Fetch();
    seen[std::stoi(r.substr(0, r.find(':')))].push_back(std::stoi(r.substr(r.find(':') + 1)));
  }
  size_t total = 0;
  for (auto& [worker, list] : seen) {
    EXPECT_TRUE(worker == 0 || worker == 1);
    for (size_t k = 0; k < list.size(); ++k) EXPECT_EQ(list[k], int(100 + k));
    total += list.size();
  }
  EXPECT_EQ(total, 40u);
}

TEST(ParameterServerTest, AStrangerGetsNothing) {
  ThreadCluster cluster(1, 1);
  {  // The right token works.
    ParameterServerStrategy strategy(cluster.options());
    strategy.CreateVariable("secret", {3}, Constant(42.0f));
  }
  // A coordinator with another token is refused by the ps...
  ParameterServerOptions wrong = cluster.options();
  wrong.job_token = "not-the-token";
  wrong.connect_timeout = milliseconds(2'000);
  try {
    ParameterServerStrategy stranger(wrong);
    ADD_FAILURE() << "a stranger's coordinator connected";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
  }
  // ...and a client that reads a shard directly gets no value.
  ps::Client reader(cluster.ps[0], "ps 0", ps::Kind::kPs, "not-the-token", milliseconds(2'000));
  ps::Out request;
  request.U32(1);
  request.Str("secret");
  try {
    reader.Call(ps::Op::kReadShards, request.bytes());
    ADD_FAILURE() << "a stranger read a shard";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
  }
  // A peer that skips the handshake and sends a request gets the challenge, a zero verdict,
  // and the close: never a frame.
  ps::Socket raw;
  std::string why;
  ASSERT_TRUE(raw.Connect(cluster.ps[0], Clock::now() + milliseconds(2'000), &why)) << why;
  std::vector<uint8_t> junk(64, 0x5a);
  ASSERT_TRUE(raw.SendAll(junk.data(), junk.size(), Clock::now() + milliseconds(2'000), &why));
  std::vector<uint8_t> got;
  uint8_t byte;
  while (raw.ReceiveAll(&byte, 1, Clock::now() + milliseconds(5'000), &why)) got.push_back(byte);
  EXPECT_NE(why.find("closed"), std::string::npos) << why;
  ASSERT_EQ(got.size(), 37u + 33u);
  for (size_t i = 37; i < got.size(); ++i) EXPECT_EQ(got[i], 0) << i;
}

TEST(ParameterServerTest, AWorkerKilledMidStepHasItsStepRunElsewhereAndRejoins) {
  const fs::path flags = fs::temp_directory_path() /
                         ("collectives_ps_test_" + std::to_string(getpid()));
  fs::create_directories(flags);
  std::ofstream(flags / "hang") << "1";
  const std::vector<std::string> ps = LoopbackAddresses(1);
  const std::vector<std::string> workers = LoopbackAddresses(2);
  ParameterServerOptions options = Options(ps, workers);
  options.optimizer = PsOptimizer::Sgd({.learning_rate = 1.0f});
  std::unique_ptr<Server> ps_server = StartThreadServer(options, "ps", 0);
  auto worker0 = std::make_unique<ChildServer>("worker:0", ps, workers, flags);
  auto worker1 = std::make_unique<ChildServer>("worker:1", ps, workers, flags);

  ParameterServerStrategy strategy(options);
  strategy.CreateVariable("w", {3}, Zeros());
  ClusterCoordinator coordinator(strategy);
  ASSERT_TRUE(WaitUntil([&] { return coordinator.num_available_workers() == 2; },
                        test_time::Scaled(std::chrono::seconds(15))));
  constexpr int kFirst = 30;
  std::vector<RemoteValue> values;
  for (int i = 0; i < kFirst; ++i) values.push_back(coordinator.Schedule("slow_push", "10"));
  // Worker 1 is inside a step (it said so): kill it there.
  const fs::path started = flags / ("started-" + std::to_string(worker1->pid()));
  ASSERT_TRUE(WaitUntil([&] { return fs::exists(started); },
                        test_time::Scaled(std::chrono::seconds(15))));
  const pid_t first_pid = worker1->pid();
  worker1->Kill();
  fs::remove(flags / "hang");
  coordinator.Join(milliseconds(30'000));
  for (const RemoteValue& v : values) EXPECT_NE(v.Fetch(), std::to_string(first_pid));
  EXPECT_GE(coordinator.rescheduled_steps(), 1);
  // Every step pushed exactly once: the killed one had not pushed, and ran again.
  EXPECT_EQ(strategy.Read("w"), (std::vector<float>(3, -float(kFirst))));

  // Restarted on the same address, it is given steps again.
  worker1 = std::make_unique<ChildServer>("worker:1", ps, workers, flags);
  ASSERT_TRUE(WaitUntil([&] { return coordinator.num_available_workers() == 2; },
                        test_time::Scaled(std::chrono::seconds(15))));
  values.clear();
  for (int i = 0; i < 20; ++i) values.push_back(coordinator.Schedule("slow_push", "50"));
  coordinator.Join(milliseconds(30'000));
  std::set<std::string> pids;
  for (const RemoteValue& v : values) pids.insert(v.Fetch());
  EXPECT_TRUE(pids.count(std::to_string(worker1->pid()))) << "the restarted worker got no step";
  EXPECT_EQ(strategy.Read("w"), (std::vector<float>(3, -float(kFirst + 20))));
  // The servers' RunServer returns when the coordinator stops them.
  coordinator.StopServers();
  EXPECT_TRUE(worker0->ExitsCleanlyWithin(test_time::Scaled(std::chrono::seconds(10))));
  EXPECT_TRUE(worker1->ExitsCleanlyWithin(test_time::Scaled(std::chrono::seconds(10))));
  EXPECT_TRUE(ps_server->Wait(milliseconds(10'000)));
  fs::remove_all(flags);
}

TEST(ParameterServerTest, AStepThatKillsEveryWorkerFailsAfterMaxAttempts) {
  const std::vector<std::string> ps = LoopbackAddresses(1);
  const std::vector<std::string> workers = LoopbackAddresses(2);
  ParameterServerOptions options = Options(ps, workers);
  options.max_step_attempts = 2;
  std::unique_ptr<Server> ps0 = StartThreadServer(options, "ps", 0);
  ChildServer w0("worker:0", ps, workers, fs::temp_directory_path());
  ChildServer w1("worker:1", ps, workers, fs::temp_directory_path());
  ParameterServerStrategy strategy(options);
  strategy.CreateVariable("w", {1}, Zeros());
  ClusterCoordinator coordinator(strategy);
  ASSERT_TRUE(WaitUntil([&] { return coordinator.num_available_workers() == 2; },
                        test_time::Scaled(std::chrono::seconds(15))));
  RemoteValue poison = coordinator.Schedule("die");
  try {
    poison.Fetch(milliseconds(30'000));
    ADD_FAILURE() << "the step that kills its worker returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
    EXPECT_NE(e.message().find("given to 2 workers"), std::string::npos) << e.what();
  }
  EXPECT_EQ(coordinator.rescheduled_steps(), 1);
}

TEST(ParameterServerTest, AKilledParameterServerIsNamedWithinTheDeadline) {
  const std::vector<std::string> ps = LoopbackAddresses(2);
  const std::vector<std::string> workers = LoopbackAddresses(2);
  ParameterServerOptions options = Options(ps, workers);
  options.ps_timeout = milliseconds(2'000);
  std::unique_ptr<Server> ps0 = StartThreadServer(options, "ps", 0);
  ChildServer ps1("ps:1", ps, workers, fs::temp_directory_path());
  std::unique_ptr<Server> w0 = StartThreadServer(options, "worker", 0);
  std::unique_ptr<Server> w1 = StartThreadServer(options, "worker", 1);
  ParameterServerStrategy strategy(options);
  strategy.CreateVariable("w", {4}, Zeros());
  strategy.CreateVariable("v", {4}, Zeros());  // on ps 1
  ASSERT_EQ(strategy.variables()[1].shards[0].ps_index, 1);
  ClusterCoordinator coordinator(strategy);
  for (int i = 0; i < 2000; ++i) coordinator.Schedule("slow_push", "5");
  std::this_thread::sleep_for(milliseconds(300));
  const auto killed = Clock::now();
  ps1.Kill();
  try {
    coordinator.Join(milliseconds(60'000));
    ADD_FAILURE() << "Join returned with a parameter server dead";
  } catch (const Error& e) {
    const auto elapsed = Clock::now() - killed;
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
    EXPECT_NE(e.message().find("ps 1 at " + ps[1]), std::string::npos) << e.what();
    EXPECT_LT(elapsed, options.ps_timeout + test_time::Scaled(std::chrono::seconds(2)));
  }
  // Every later call says the same.
  EXPECT_THROW(coordinator.Schedule("push_step", "0"), Error);
  EXPECT_THROW(strategy.Read("w"), Error);
}

TEST(ParameterServerTest, AParameterServerRestartedEmptyIsNamed) {
  const std::vector<std::string> ps = LoopbackAddresses(1);
  const std::vector<std::string> workers = LoopbackAddresses(1);
  ParameterServerOptions options = Options(ps, workers);
  options.ps_timeout = milliseconds(5'000);
  auto ps0 = std::make_unique<ChildServer>("ps:0", ps, workers, fs::temp_directory_path());
  ParameterServerStrategy strategy(options);
  strategy.CreateVariable("w", {4}, Zeros());
  ps0->Kill();
  ps0 = std::make_unique<ChildServer>("ps:0", ps, workers, fs::temp_directory_path());
  // Back within ps_timeout, but without its variables: named as restarted, not waited for.
  ASSERT_TRUE(WaitUntil(
      [&] {
        try {
          strategy.CheckHealth();
          return false;
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kPeerLost);
          EXPECT_NE(e.message().find("ps 0 at " + ps[0]), std::string::npos) << e.what();
          EXPECT_NE(e.message().find("restarted"), std::string::npos) << e.what();
          return true;
        }
      },
      test_time::Scaled(std::chrono::seconds(10))));
}

TEST(ParameterServerTest, ServersOutliveAKilledCoordinatorAndServeTheNext) {
  ThreadCluster cluster(2, 2);
  const fs::path flags = fs::temp_directory_path() /
                         ("collectives_ps_coord_" + std::to_string(getpid()));
  fs::remove_all(flags);
  fs::create_directories(flags);
  ChildServer first("coordinator:0", cluster.ps, cluster.workers, flags);
  ASSERT_TRUE(WaitUntil([&] { return fs::exists(flags / "saved"); },
                        test_time::Scaled(std::chrono::seconds(20))));
  std::this_thread::sleep_for(milliseconds(100));  // killed while its steps run
  first.Kill();
  // The steps it had started finish on their workers (their pushes land; their results have no
  // one to go to): give them their 20 ms before the restore, which they would otherwise follow.
  std::this_thread::sleep_for(milliseconds(500));

  ParameterServerOptions options = cluster.options();
  options.optimizer = PsOptimizer::Sgd({.learning_rate = 1.0f});
  ParameterServerStrategy strategy(options);
  strategy.CreateVariable("w", {5}, Constant(7.0f));
  ASSERT_EQ(strategy.RestoreCheckpoint((flags / "ckpt").string()), (TrainingState{1, 0}));
  std::vector<double> expected(5, 0.0);
  for (int i = 0; i < 10; ++i) {
    const std::vector<float> g = StepGradient(i, 5);
    for (size_t j = 0; j < 5; ++j) expected[j] -= g[j];
  }
  std::vector<float> restored = strategy.Read("w");
  for (size_t j = 0; j < 5; ++j) EXPECT_EQ(double(restored[j]), expected[j]) << j;
  // Both workers take steps from the new coordinator.
  ClusterCoordinator coordinator(strategy);
  ASSERT_TRUE(WaitUntil([&] { return coordinator.num_available_workers() == 2; },
                        test_time::Scaled(std::chrono::seconds(10))));
  for (int i = 10; i < 20; ++i) coordinator.Schedule("push_step", std::to_string(i));
  coordinator.Join(milliseconds(30'000));
  for (int i = 10; i < 20; ++i) {
    const std::vector<float> g = StepGradient(i, 5);
    for (size_t j = 0; j < 5; ++j) expected[j] -= g[j];
  }
  const std::vector<float> after = strategy.Read("w");
  for (size_t j = 0; j < 5; ++j) EXPECT_EQ(double(after[j]), expected[j]) << j;
  fs::remove_all(flags);
}

TEST(ParameterServerTest, ANewCoordinatorResumesFromTheCheckpoint) {
  ThreadCluster cluster(2, 2);
  const fs::path dir = fs::temp_directory_path() /
                       ("collectives_ps_ckpt_" + std::to_string(getpid()));
  fs::remove_all(dir);
  ParameterServerOptions options = cluster.options();
  options.partitioner = Partitioner::FixedShards(2);
  const AdamOptions adam{.learning_rate = 0.05f};
  options.optimizer = PsOptimizer::Adam(adam);
  // The same gradient every step: Adam's result does not depend on which worker pushes first.
  constexpr int kBefore = 12, kAfter = 8;
  std::vector<float> saved;
  {
    ParameterServerStrategy strategy(options);
    strategy.CreateVariable("w", {6}, PatternInit(0.3f));
    ClusterCoordinator coordinator(strategy);
    for (int i = 0; i < kBefore; ++i) coordinator.Schedule("adam_step", "1");
    coordinator.Join(milliseconds(30'000));
    strategy.SaveCheckpoint(dir.string(), {3, 0});
    saved = strategy.Read("w");
    // Then more steps that the checkpoint does not hold, and the coordinator dies.
    for (int i = 0; i < 5; ++i) coordinator.Schedule("adam_step", "1");
    coordinator.Join(milliseconds(30'000));
  }
  ParameterServerStrategy strategy(options);
  strategy.CreateVariable("w", {6}, Zeros());
  EXPECT_EQ(strategy.Read("w"), std::vector<float>(6, 0.0f));
  const std::optional<TrainingState> state = strategy.RestoreCheckpoint(dir.string());
  ASSERT_TRUE(state.has_value());
  EXPECT_EQ(*state, (TrainingState{3, 0}));
  EXPECT_EQ(strategy.Read("w"), saved);
  EXPECT_EQ(strategy.iterations(), kBefore);
  ClusterCoordinator coordinator(strategy);
  for (int i = 0; i < kAfter; ++i) coordinator.Schedule("adam_step", "1");
  coordinator.Join(milliseconds(30'000));

  // Reference: Keras' Adam, kBefore + kAfter steps of the same gradient.
  const std::vector<float> g = AdamGradient(1, 6);
  std::vector<double> w(6), m(6, 0.0), v(6, 0.0);
  for (size_t j = 0; j < 6; ++j) w[j] = Pattern(j, 0.3f);
  for (int t = 1; t <= kBefore + kAfter; ++t) {
    const double lr_t = 0.05 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
    for (size_t j = 0; j < 6; ++j) {
      m[j] = 0.9 * m[j] + 0.1 * g[j];
      v[j] = 0.999 * v[j] + 0.001 * double(g[j]) * g[j];
      w[j] -= lr_t * m[j] / (std::sqrt(v[j]) + 1e-7);
    }
  }
  const std::vector<float> got = strategy.Read("w");
  for (size_t j = 0; j < 6; ++j) EXPECT_NEAR(got[j], w[j], 2e-5) << j;

  // The file is the strategies' checkpoint format: a one-worker strategy restores it.
  DefaultStrategy local;
  local.CreateVariable("w", {6}, Zeros());
  Adam local_adam(local, adam);
  ASSERT_TRUE(strategy::RestoreCheckpoint(local, &local_adam, dir.string()).has_value());
  EXPECT_EQ(std::vector<float>(local.FindVariable("w")->value(0).begin(),
                               local.FindVariable("w")->value(0).end()),
            saved);
  EXPECT_EQ(local_adam.iterations(), kBefore);

  // A checkpoint of another optimizer or shape is refused, nothing changed.
  const std::vector<float> before = strategy.Read("w");
  ParameterServerOptions sgd = options;
  sgd.optimizer = PsOptimizer::Sgd();
  ParameterServerStrategy other(sgd);
  other.CreateVariable("w2", {6}, Zeros());
  try {
    other.RestoreCheckpoint(dir.string());
    ADD_FAILURE() << "an Adam checkpoint was restored under SGD";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
  }
  EXPECT_EQ(strategy.Read("w"), before);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace collectives::strategy
