// Parameter-server training with a coordinator: TensorFlow's ParameterServerStrategy and
// ClusterCoordinator, in C++.
//
// A cluster has three kinds of task (TF_CONFIG task types):
//   - "chief": the coordinator. It creates the variables, schedules training steps, writes
//     checkpoints and deals with failures. It runs the user's training loop.
//   - "ps": parameter servers. They hold the variables (and the optimizer's slots beside them)
//     and apply the optimizer to the gradients workers send them.
//   - "worker": they wait for steps from the coordinator and run them: read the current
//     variables from the parameter servers, compute gradients on a batch of their own data, and
//     push the gradients back. Training is asynchronous: workers do not wait for each other.
// Every task runs the same binary; workers and parameter servers call RunServer (or StartServer)
// and wait for work, forever or until the coordinator tells them to stop.
//
// Functions, not closures. tf.distribute sends a tf.function's graph to the workers; a C++
// program cannot send a closure. So step functions (and per-worker dataset functions) are
// registered by name in the binary every task runs, and the coordinator schedules them by name
// with serialised arguments: this is the C++ form of tf.function dispatch.
//
//   // Every task, before anything else:
//   RegisterFunction("train_step", [](WorkerContext& ctx, const std::string& args) {
//     std::vector<float> w = ctx.Read("dense/kernel");          // every shard, put together
//     auto& data = ctx.PerWorker<MyIterator>("train");          // this worker's iterator
//     ... forward and backward on data.Next() ...
//     ctx.PushGradients({{"dense/kernel", grad_w}});            // the ps apply the optimizer
//     return EncodeLoss(loss);                                  // the step's result bytes
//   });
//   RegisterDatasetFunction("train", [](WorkerContext& ctx, const std::string& args) {
//     return std::make_shared<MyIterator>(ctx.worker_index(), args);
//   });
//   ParameterServerOptions options;                             // the cluster from TF_CONFIG
//   const ClusterSpec spec = ClusterSpec::FromEnvironment();
//   if (spec.task_type == "ps" || spec.task_type == "worker") { RunServer(options); return 0; }
//   // The coordinator:
//   ParameterServerStrategy strategy(options);
//   strategy.CreateVariable("dense/kernel", {784, 64}, GlorotUniform(784, 64, seed));
//   ClusterCoordinator coordinator(strategy);
//   coordinator.CreatePerWorkerDataset("train");
//   std::vector<RemoteValue> losses;
//   for (int i = 0; i < steps; ++i) losses.push_back(coordinator.Schedule("train_step"));
//   coordinator.Join();                                         // throws the first step error
//   strategy.SaveCheckpoint("ckpt", {epoch, 0});
//   coordinator.StopServers();                                  // optional: servers exit
//
// Failures, as the guide describes them:
//   - a worker that dies (its connection breaks, or a step outlives step_timeout) has its
//     unfinished steps run again on the other workers; the coordinator keeps reconnecting to it
//     and gives it steps again (after creating its per-worker datasets anew) once it is back.
//     A step runs at least once: one that died after pushing its gradients has pushed them
//     again when it runs again (TensorFlow's rule too). One whose workers were lost
//     max_step_attempts times fails with kPeerLost (a step that kills every worker it runs on
//     must not go round them forever).
//   - a parameter server that dies makes the coordinator raise Error(kPeerLost) naming it
//     ("ps 1 at 127.0.0.1:2223") within ps_timeout: from Fetch, Join, Schedule and every
//     strategy call. A new coordinator resumes from the last checkpoint once it is back.
//   - a coordinator that dies leaves the servers waiting for a new one; the new one creates the
//     variables again (which resets them) and restores the checkpoint (RestoreCheckpoint).
// No call waits forever: every request has a deadline (the options below).
//
// Security: every connection to a server proves the job token both ways (HMAC-SHA256 over fresh
// nonces of both sides, as the collectives' connections and the TCP store do); a server logs a
// connection that cannot prove it to stderr, with its address, and closes it unanswered.
//
// Thread-safety: ParameterServerStrategy, ClusterCoordinator and RemoteValue may be called from
// any thread. A WorkerContext belongs to the step (or dataset function) it is given to. The
// function registry may be written before servers or coordinators start, and read from any thread.
#ifndef COLLECTIVES_PARAMETER_SERVER_H_
#define COLLECTIVES_PARAMETER_SERVER_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/strategy.h"

namespace collectives::strategy {

// ---- Options -----------------------------------------------------------------------------------

// How variables are split over the parameter servers (TF's variable partitioners). A variable is
// split along its first dimension into contiguous row ranges (shards); each shard lives on one
// parameter server. Shards of one variable go to consecutive parameter servers, round-robin over
// all variables' shards. The step code never sees the shards: WorkerContext::Read puts them back
// together and PushGradients cuts the gradient the same way.
struct Partitioner {
  // FixedShardsPartitioner: every variable is cut into min(fixed_shards, rows) shards of nearly
  // equal rows. 0 or 1: no cut from this rule.
  int fixed_shards = 0;
  // MaxSizePartitioner: a variable larger than this many bytes is cut into the fewest shards of
  // at most this many bytes each (whole rows; a row larger than the cap is a shard of its own).
  // 0: no cap. With both rules set, a variable gets the larger number of shards.
  size_t max_shard_bytes = 0;

  static Partitioner None() { return {}; }
  static Partitioner FixedShards(int shards) { return {shards, 0}; }
  static Partitioner MaxShardBytes(size_t bytes) { return {0, bytes}; }
};

// The learning rate the parameter servers use for an update, as a function of the updates that
// variable shard has received before it (Keras evaluates a LearningRateSchedule at
// optimizer.iterations the same way): "none" keeps the optimizer's learning_rate; "cosine" is
// Keras' CosineDecay from learning_rate to 0 over decay_steps updates (alpha 0), then 0.
//   rate(k) = learning_rate * 0.5 * (1 + cos(pi * min(k, decay_steps) / decay_steps))
// The count is the shard's own: it is read and advanced under the shard's lock with the update,
// so every update sees one rate and the count travels with the shard into checkpoints (a
// restored job continues the schedule where it stopped). A step number sent with each push
// would need no such care, but asynchronous pushes land out of order, so it would run backwards
// and repeat when a lost worker's step is run again.
struct PsLearningRateSchedule {
  std::string decay = "none";  // "none" or "cosine"
  int64_t decay_steps = 0;     // "cosine": updates until the rate reaches 0 (> 0)

  static PsLearningRateSchedule Constant() { return {}; }
  static PsLearningRateSchedule CosineDecay(int64_t decay_steps) { return {"cosine", decay_steps}; }
};

// The optimizer the parameter servers apply to pushed gradients, with Keras' formulas (as Sgd
// and Adam in strategy.h): "sgd" (slot "momentum" when momentum > 0) or "adam" (slots "m" and
// "v"), at the learning rate of `schedule`. Slots live beside their variable's shard, on the
// same parameter server. The step count t of Adam's bias correction is the number of updates
// that shard has received (every step pushes every variable, so it is the number of steps
// applied).
struct PsOptimizer {
  std::string name = "sgd";  // "sgd" or "adam"
  SgdOptions sgd{};
  AdamOptions adam{};
  PsLearningRateSchedule schedule{};  // Default: constant

  static PsOptimizer Sgd(SgdOptions options = {}, PsLearningRateSchedule schedule = {}) {
    return {"sgd", options, {}, std::move(schedule)};
  }
  static PsOptimizer Adam(AdamOptions options = {}, PsLearningRateSchedule schedule = {}) {
    return {"adam", {}, options, std::move(schedule)};
  }
};

struct ParameterServerOptions {
  // The cluster: TF_CONFIG's "chief" (the coordinator), "worker" and "ps" tasks. Default:
  // ClusterSpec::FromEnvironment(). This task's role is its task_type and task_index.
  std::optional<ClusterSpec> cluster{};
  // "host:port" of every parameter server and every worker, in task index order. When empty,
  // they are the cluster spec's (ClusterSpec::cluster["ps"] and ["worker"], from TF_CONFIG),
  // whose layout is then checked (CheckClusterLayout(spec, "parameter_server"): a chief, at least
  // one worker and one ps; kInvalidArgument naming the field otherwise). A server listens on the
  // host and port of its own entry.
  std::vector<std::string> ps_addresses{};
  std::vector<std::string> worker_addresses{};
  // The job's shared secret, proven on every connection. Empty: the cluster's job_token, else
  // $COLLECTIVES_JOB_TOKEN, else the empty token (which keeps out only peers that do not speak
  // the protocol; set one on any network you do not trust).
  std::string job_token{};

  // Coordinator: how variables are cut into shards and which optimizer the ps apply.
  Partitioner partitioner{};
  PsOptimizer optimizer{};

  // Coordinator: how long it waits for every parameter server to answer at start (they may start
  // after it), and for the workers to make a per-worker dataset. Default 60 s.
  std::chrono::milliseconds connect_timeout{60'000};
  // Every request to a server (a read, a push, a variable's creation) must be answered within
  // this. Default 30 s.
  std::chrono::milliseconds request_timeout{30'000};
  // The coordinator checks every parameter server this often...
  std::chrono::milliseconds heartbeat_interval{500};
  // ...and raises Error(kPeerLost) naming one that has not answered for this long. Default 5 s.
  std::chrono::milliseconds ps_timeout{5'000};
  // A step that has not finished on its worker within this is taken from it (the worker is
  // treated as lost) and run on another. Default 10 min.
  std::chrono::milliseconds step_timeout{600'000};
  // Pending steps fail with Error(kPeerLost) when no worker has been reachable for this long.
  // Default 10 min.
  std::chrono::milliseconds no_worker_timeout{600'000};
  // How often the coordinator tries to reach a lost worker again. Default 200 ms.
  std::chrono::milliseconds reconnect_interval{200};
  // How many workers one step may be given, each lost while running it, before it fails with
  // kPeerLost. Default 5.
  int max_step_attempts = 5;
};

// ---- What runs on a worker ---------------------------------------------------------------------

// Where one variable lives: its name and shape as created, and its shards (row ranges along the
// first dimension, in order; a variable of rank 0 or 1 counts its elements as rows).
struct PsShard {
  int ps_index = 0;    // the "ps" task that holds it
  size_t offset = 0;   // first element of the variable in this shard
  size_t count = 0;    // elements in this shard
};
struct PsVariable {
  std::string name;
  std::vector<size_t> shape;
  size_t count = 0;  // elements
  std::vector<PsShard> shards;
};

// What a step function (or a dataset function) sees on its worker. Valid only during that call.
class WorkerContext {
 public:
  virtual ~WorkerContext();

  // This worker's task index and the number of workers in the cluster.
  virtual int worker_index() const = 0;
  virtual int num_workers() const = 0;
  // The variables the coordinator created, in creation order.
  virtual const std::vector<PsVariable>& variables() const = 0;

  // The current value of variable `name` (count() floats, every shard read from its parameter
  // server and put together). Each shard is read atomically (never half an update). Throws
  // kInvalidArgument for an unknown name, kPeerLost naming the parameter server that does not
  // answer.
  virtual std::vector<float> Read(const std::string& name) = 0;
  // Several variables at once: one request per parameter server. Same order as `names`.
  virtual std::vector<std::vector<float>> Read(const std::vector<std::string>& names) = 0;

  // Sends the gradient of each named variable (count() floats each) to the parameter servers,
  // which apply the optimizer to each shard atomically, one update after another. Returns once
  // every shard is updated. One request per parameter server.
  virtual void PushGradients(
      const std::vector<std::pair<std::string, std::span<const float>>>& gradients) = 0;

  // The object that the per-worker dataset `name`'s function made on this worker
  // (ClusterCoordinator::CreatePerWorkerDataset). Throws kInvalidArgument when there is none.
  // The same object across steps of this worker, until the coordinator creates it again.
  template <typename T>
  T& PerWorker(const std::string& name) {
    return *static_cast<T*>(PerWorkerObject(name).get());
  }
  virtual std::shared_ptr<void> PerWorkerObject(const std::string& name) = 0;

 protected:
  WorkerContext() = default;
};

// A step function: runs on a worker with the arguments the coordinator gave Schedule, returns
// the result bytes RemoteValue::Fetch hands back. An exception it throws is the step's error
// (Fetch rethrows it as an Error with the same code and message; other exceptions become
// kInternal); such a step is not run again.
using StepFunction = std::function<std::string(WorkerContext&, const std::string& args)>;
// A per-worker dataset function: makes this worker's dataset or iterator object.
using DatasetFunction =
    std::function<std::shared_ptr<void>(WorkerContext&, const std::string& args)>;

// Registers `fn` under `name` in this process (every task runs the same registrations).
// Registering a name again replaces it. Throws kInvalidArgument for an empty name.
void RegisterFunction(const std::string& name, StepFunction fn);
void RegisterDatasetFunction(const std::string& name, DatasetFunction fn);

// ---- Servers (the "ps" and "worker" tasks) -----------------------------------------------------

// A running server: what tf.distribute.Server is for these tasks. A "ps" server holds variable
// shards; a "worker" server runs scheduled functions. Both accept a new coordinator whenever
// the last one went away, and keep their state (a ps its variables, a worker its datasets until
// the new coordinator creates them again).
class Server {
 public:
  virtual ~Server();  // stops (as Stop) and joins its threads
  // The port it listens on (useful when the address said port 0).
  virtual uint16_t port() const = 0;
  // Waits until Stop() or a coordinator's StopServers. Returns false when `timeout` passed first.
  virtual bool Wait(std::chrono::milliseconds timeout = std::chrono::milliseconds::max()) = 0;
  // Closes the listener and every connection; requests in flight fail at their senders.
  virtual void Stop() = 0;
};

// Starts the server of this task (options.cluster's task_type "ps" or "worker" and task_index)
// and returns once it listens. Throws kInvalidArgument for another task type or an index with no
// address, kSystem when the address cannot be bound.
std::unique_ptr<Server> StartServer(const ParameterServerOptions& options);
// StartServer, then Wait() until the coordinator stops the servers: the main of a ps or worker.
void RunServer(const ParameterServerOptions& options);

// ---- The coordinator ---------------------------------------------------------------------------

// The coordinator's side of the variables. The constructor connects to every parameter server
// (waiting up to connect_timeout for each; kTimeout naming the one that never answered,
// kUnauthenticated when one refuses the job token, kInvalidArgument for a cluster without ps or
// workers) and starts watching them (heartbeat_interval, ps_timeout): once one is lost, every call here and
// on the coordinator throws Error(kPeerLost) naming it.
class ParameterServerStrategy {
 public:
  explicit ParameterServerStrategy(ParameterServerOptions options = {});
  ~ParameterServerStrategy();
  ParameterServerStrategy(const ParameterServerStrategy&) = delete;
  ParameterServerStrategy& operator=(const ParameterServerStrategy&) = delete;

  // "parameter_server".
  const std::string& name() const;
  int num_ps() const;
  int num_workers() const;
  const ParameterServerOptions& options() const;

  // Creates a variable on the parameter servers: `init` runs here, on the coordinator, and the
  // value is cut into shards by the partitioner and sent to their parameter servers (whole
  // variables go round-robin over them). A variable of that name already on a parameter server
  // (left by an earlier coordinator) is replaced, its slots reset. Names must be unique
  // (kInvalidArgument). Returns where it lives (a copy).
  PsVariable CreateVariable(const std::string& name, std::vector<size_t> shape,
                            const Initializer& init);
  // Every variable, in creation order (a copy).
  std::vector<PsVariable> variables() const;

  // The current value of a variable, read from its parameter servers; and its replacement.
  std::vector<float> Read(const std::string& name);
  void Assign(const std::string& name, std::span<const float> value);
  // Updates applied so far: the most any shard has received (Keras' optimizer.iterations when
  // every step pushes every variable).
  int64_t iterations();

  // Writes `<directory>/checkpoint` in the format of SaveCheckpoint (strategy.h): every
  // variable, the optimizer's name, slots and iterations, and `state`; atomically (a temporary
  // file renamed into place). Each shard is read atomically; while workers push, shards may be
  // of different steps (asynchronous training; TF's checkpoints are the same).
  void SaveCheckpoint(const std::string& directory, TrainingState state);
  // Reads `<directory>/checkpoint`, checks it against the variables created here (names,
  // shapes) and the optimizer (name, slots), and sends every value and slot to the parameter
  // servers. Returns the saved state, nullopt when there is no checkpoint (nothing changed).
  // Throws kInvalidArgument on a corrupt or mismatching file.
  std::optional<TrainingState> RestoreCheckpoint(const std::string& directory);

  // Throws the error that broke the cluster (a parameter server lost), if any.
  void CheckHealth() const;

  class Impl;
  Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// The result of a scheduled step, available once a worker has run it.
class RemoteValue {
 public:
  RemoteValue();
  // Waits until the step has run and returns its result bytes; throws the step's error, or
  // Error(kPeerLost) naming the parameter server that was lost, or kTimeout after `timeout`.
  std::string Fetch(std::chrono::milliseconds timeout = std::chrono::milliseconds::max()) const;
  // True once Fetch would not wait.
  bool Done() const;

  struct State;
  explicit RemoteValue(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// A per-worker dataset: made on every worker by its registered function; a step reads it with
// WorkerContext::PerWorker<T>(name()).
class PerWorkerDataset {
 public:
  explicit PerWorkerDataset(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

// Dispatches steps to the workers: each worker runs one step at a time, taken from a queue in
// the order they were scheduled (a free worker takes the next one). Connects to the workers in
// the background: a worker that is not up yet (or lost) gets steps once it answers. The strategy
// must outlive its coordinator.
class ClusterCoordinator {
 public:
  explicit ClusterCoordinator(ParameterServerStrategy& strategy);
  // Stops dispatching; steps not yet run fail with kAborted. The servers keep running.
  ~ClusterCoordinator();
  ClusterCoordinator(const ClusterCoordinator&) = delete;
  ClusterCoordinator& operator=(const ClusterCoordinator&) = delete;

  ParameterServerStrategy& strategy() const;

  // Queues one run of the registered function `function` with `args`; returns at once. Throws
  // the cluster's error when a parameter server is lost.
  RemoteValue Schedule(const std::string& function, std::string args = {});
  // Waits until every step scheduled so far has run; throws the first error of a step that
  // failed since the last Join (and the cluster's error), or kTimeout after `timeout`.
  void Join(std::chrono::milliseconds timeout = std::chrono::milliseconds::max());
  // True when every step scheduled so far has run.
  bool Done() const;

  // Runs the registered dataset function `function` (`name` defaults to `function`) on every
  // worker, now and whenever a worker comes back after a loss, before it takes a step. Waits
  // until every worker reachable now has made it (kTimeout after connect_timeout); throws the
  // error the function threw on a worker.
  PerWorkerDataset CreatePerWorkerDataset(const std::string& function, std::string args = {},
                                          std::string name = {});

  // The workers that are connected now.
  int num_available_workers() const;
  // Steps that were taken from a lost worker and queued again (for tests and logs).
  int64_t rescheduled_steps() const;

  // Tells every reachable worker and parameter server to stop (their Wait returns, RunServer
  // returns). After Join, at the end of training.
  void StopServers();

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace collectives::strategy

#endif  // COLLECTIVES_PARAMETER_SERVER_H_
