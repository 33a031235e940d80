// The strategy layer: synchronous data-parallel training with the semantics of TensorFlow's
// tf.distribute, in C++ and model-agnostic.
//
// Vocabulary (as in tf.distribute):
//   - a *replica* is one copy of the model; a *worker* is one process; a worker runs one or more
//     *local replicas* (threads, each with a device: the CPU, or one CUDA device per replica).
//   - NumReplicasInSync() = workers x local replicas. Every replica of every worker takes part in
//     every cross-replica reduction.
//   - *cross-replica context*: the caller's thread, outside Run(). *replica context*: inside the
//     function given to Run(), which runs once per local replica, replicas in parallel.
//   - a *mirrored variable* has one copy per local replica. Copies start identical on every
//     replica of every worker (the chief initialises, the others receive a broadcast) and stay
//     identical because every replica applies the same update to the same summed gradient.
//   - a *central variable* (CentralStorageStrategy) has one copy that every local replica reads;
//     the optimizer updates it once per step.
//
// A training step, as in a custom training loop of the guide:
//
//   auto& w = strategy.CreateVariable("dense/kernel", {784, 256}, GlorotUniform(784, 256, seed));
//   Adam adam(strategy, {.learning_rate = 1e-3f});
//   DistributedDataset data(strategy, train_size, {.global_batch_size = 256, .drop_remainder = true});
//   for (size_t step = 0; step < data.steps_per_epoch(); ++step) {
//     PerReplica<double> losses = strategy.Run([&](ReplicaContext& ctx) {
//       std::vector<size_t> batch = data.ReplicaBatch(epoch, step, ctx.local_replica_id());
//       ... forward and backward on ctx's copy of the variables (w.data(ctx.local_replica_id())),
//       ... per-example losses scaled by ComputeAverageLoss(losses, data.global_batch_size())
//       adam.ApplyGradients(ctx, {&w, ...}, {grad_w, ...});  // sums gradients over all replicas
//       return scaled_loss;
//     });
//     double loss = strategy.Reduce(ReduceOp::kSum, losses);  // the mean loss of the global batch
//   }
//
// Thread-safety: a Strategy is driven from one thread (the cross-replica context). Inside Run(),
// each replica's thread may use its own ReplicaContext, its own copy of each variable, and the
// optimizers; every collective inside Run() must be called by every local replica in the same
// order (as every rank must issue the same collectives in the same order).
#ifndef COLLECTIVES_STRATEGY_H_
#define COLLECTIVES_STRATEGY_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/types.h"

namespace collectives::strategy {

class Strategy;
class StrategyImpl;  // private, src/strategy/

// One value per local replica, indexed by local replica id (what TF calls PerReplica).
template <typename T>
using PerReplica = std::vector<T>;

// How the local replicas of one worker reduce among themselves (TF's cross_device_ops).
//   kReductionToOneDevice: replica 0 sums every replica's tensors into its own, then copies the
//     result back to the others. Simple; one thread does all the arithmetic.
//   kHierarchicalCopy: every replica reduces a 1/N slice of each tensor from all replicas (a
//     reduce-scatter in shared memory, all threads busy), then every replica copies the slices it
//     does not own (an all-gather). The CPU equivalent of TF's hierarchical copy.
//   kNccl: NCCL among local GPUs: one NCCL communicator per replica, joined inside the process
//     (through an in-memory store); each replica all-reduces its own device's tensors in place
//     (host tensors are staged through its device's memory). With several workers the replicas
//     reduce onto replica 0, which all-reduces with the other workers over the strategy's
//     communicator through host copies, then broadcasts the result. CUDA replicas need it; CPU
//     replicas, and a build or machine without NCCL, get kNotSupported naming why.
//   kAuto: kNccl when every local replica is a CUDA device (then NCCL must be usable), else
//     kHierarchicalCopy.
enum class CrossDeviceOps { kAuto, kReductionToOneDevice, kHierarchicalCopy, kNccl };
const char* ToString(CrossDeviceOps ops);
CrossDeviceOps ParseCrossDeviceOps(const std::string& name);  // "auto", "reduction_to_one_device", ...

// Fills a variable's initial value. Runs once, on the chief, on local replica 0's copy; the
// result is broadcast to every other copy. Must be deterministic for a given seed if runs are
// to be compared.
using Initializer = std::function<void(std::span<float> value)>;
Initializer Zeros();
Initializer Constant(float value);
// Glorot (Xavier) uniform: U(-l, l), l = sqrt(6 / (fan_in + fan_out)), from a seeded mt19937_64.
Initializer GlorotUniform(size_t fan_in, size_t fan_out, uint64_t seed);

// A float32 variable of a strategy. Created by Strategy::CreateVariable, owned by the strategy,
// alive as long as it is.
//
// Placement (TensorFlow's MirroredVariable and the variables of CentralStorageStrategy):
//   kMirrored: one copy per local replica, kept identical by identical updates.
//   kCentral: one copy in host memory; every local replica's value(i) is a view of it
//     (value(0).data() == value(1).data()). Inside Strategy::Run the replicas only read it: the
//     optimizer writes it once per ApplyGradients, on one replica's thread, while every other
//     replica waits inside that call. A replica that writes it itself races with the others.
//
// Devices: a mirrored variable of a strategy whose replicas are CUDA devices keeps replica i's
// copy in the memory of its device (cudaMalloc): tensor(i) is a Tensor on cuda:N, value(i) and
// data(i) throw kInvalidUsage (host code cannot read that memory), and Read and Write copy
// through the CUDA runtime. Copies of CPU replicas are host memory, as above.
class MirroredVariable {
 public:
  enum class Placement { kMirrored, kCentral };
  MirroredVariable(std::string name, std::vector<size_t> shape, int num_local_replicas,
                   Placement placement = Placement::kMirrored);
  // Mirrored, one copy per local replica on devices[i] (CPU or CUDA). Throws kNotSupported
  // naming why when a CUDA device is asked for and CUDA is not available.
  MirroredVariable(std::string name, std::vector<size_t> shape, std::vector<Device> devices);
  MirroredVariable(const MirroredVariable&) = delete;
  MirroredVariable& operator=(const MirroredVariable&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<size_t>& shape() const { return shape_; }
  size_t count() const { return count_; }
  int num_local_replicas() const { return num_local_replicas_; }
  Placement placement() const { return placement_; }
  // Copies in memory: num_local_replicas() when mirrored, 1 when central.
  int num_copies() const {
    return static_cast<int>(on_device() ? device_copies_.size() : copies_.size());
  }

  // The value local replica `local_replica` sees (0 <= id < num_local_replicas()): its own copy
  // when mirrored, the central copy when central. Host memory only: kInvalidUsage for a copy in
  // device memory (use tensor, Read and Write).
  std::span<float> value(int local_replica);
  std::span<const float> value(int local_replica) const;
  float* data(int local_replica) { return value(local_replica).data(); }
  // The copy as a tensor on its device (device memory for a CUDA replica).
  Tensor tensor(int local_replica);
  // Where local replica `local_replica`'s copy lives.
  Device device(int local_replica) const;
  // True when any copy is in CUDA memory.
  bool on_device() const { return !device_copies_.empty(); }
  // Copies of one copy's value to and from the host, wherever it lives (cudaMemcpy for device
  // memory). Write changes that copy alone: the caller keeps the copies identical.
  std::vector<float> Read(int local_replica) const;
  void Write(int local_replica, std::span<const float> value);

  // Cross-replica context: sets every local copy to `value` (count() elements). The caller sets
  // the same value on every worker (for example after reading a checkpoint). On a variable of a
  // strategy, throws kInvalidUsage inside Run (it would write the copies other replicas are
  // using) and rethrows the error that broke the strategy, as other cross-replica calls do.
  void Assign(std::span<const float> value);

 private:
  friend class StrategyImpl;  // sets strategy_
  // The strategy that created it (null for one constructed directly): Assign asks it whether
  // a Run is in progress.
  const StrategyImpl* strategy_ = nullptr;
  std::string name_;
  std::vector<size_t> shape_;
  size_t count_ = 0;
  int num_local_replicas_ = 1;
  Placement placement_ = Placement::kMirrored;
  std::vector<Device> devices_;                       // one per local replica
  std::vector<std::vector<float>> copies_;            // host copies (empty when on_device())
  std::vector<std::shared_ptr<void>> device_copies_;  // device copies, one per replica
};

// What a function given to Strategy::Run sees: who this replica is, and the cross-replica
// collectives. Valid only inside that call, on that replica's thread.
class ReplicaContext {
 public:
  // Global id in [0, NumReplicasInSync()): worker_index * local replicas + local id.
  int replica_id_in_sync_group() const { return replica_id_in_sync_group_; }
  int local_replica_id() const { return local_replica_id_; }
  int num_replicas_in_sync() const { return num_replicas_in_sync_; }
  Strategy& strategy() const { return *strategy_; }

  // Reduces `tensors` over every replica of every worker, in place: on return every replica's
  // tensors hold the result. Every local replica calls it with tensors of the same count and
  // dtype, in the same order. Local replicas reduce with the strategy's CrossDeviceOps; workers
  // then all-reduce through the packer (fused into buckets of bytes_per_pack).
  // Any dtype and op; CPU tensors, and with GPU replicas (kNccl) also tensors in the memory of
  // the replica's own device (host tensors are staged through it). kAvg is a sum divided once by
  // NumReplicasInSync() (integer division for integer types; NCCL's ncclAvg among the local
  // GPU replicas of a single worker). Every replica of every worker gets the same bits. Replicas
  // that pass different counts, dtypes or ops get kMismatch, kAvg where another worker passes kSum
  // included (kAvg crosses workers as a sum, checked as kAvg). Tensors that share any memory
  // (the same buffer on two replicas, one replica's tensor inside another's, a buffer twice in
  // one list) get kInvalidArgument, nothing written.
  void AllReduce(ReduceOp op, const std::vector<Tensor>& tensors);
  // The same for one scalar: returns the reduction of `value` over every replica.
  double AllReduce(ReduceOp op, double value);

 private:
  friend class StrategyImpl;
  ReplicaContext(Strategy* strategy, int local_replica_id, int replica_id_in_sync_group,
                 int num_replicas_in_sync)
      : strategy_(strategy),
        local_replica_id_(local_replica_id),
        replica_id_in_sync_group_(replica_id_in_sync_group),
        num_replicas_in_sync_(num_replicas_in_sync) {}
  Strategy* strategy_;
  int local_replica_id_;
  int replica_id_in_sync_group_;
  int num_replicas_in_sync_;
};

// What every strategy has. Construct one of the subclasses below.
class Strategy {
 public:
  virtual ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // "default", "one_device", "mirrored", "multi_worker_mirrored" or "central_storage".
  const std::string& name() const;
  int NumReplicasInSync() const;
  int num_local_replicas() const;
  int num_workers() const;
  int worker_index() const;
  // True on the worker that writes checkpoints: the "chief" task of TF_CONFIG when there is one,
  // else worker 0.
  bool IsChief() const;
  // The devices of the local replicas, one per replica.
  const std::vector<Device>& devices() const;
  CrossDeviceOps cross_device_ops() const;
  // The communicator between workers; null when there is one worker.
  CollectiveCommunication* communication() const;

  // Runs `fn(ReplicaContext&)` once per local replica, replicas in parallel (replica 0 on the
  // calling thread, the others on threads the strategy keeps). Returns one result per local
  // replica. If any replica throws, the others are released from whatever cross-replica call they
  // wait in (they throw kAborted), and Run rethrows the first error once all have returned.
  // A replica that waits longer than the timeout (MirroredOptions::timeout, or the
  // communication timeout) for the others at a cross-replica call throws kTimeout; one whose
  // call can never be met because another replica returned from fn without making it throws
  // kMismatch at once.
  // A failed Run with several local replicas or several workers breaks the strategy: later Run
  // calls, and every cross-replica call (Reduce, CreateVariable, BroadcastFromChief, Barrier,
  // SaveCheckpoint, RestoreCheckpoint, an optimizer's SaveSlots, RestoreSlots and iterations(),
  // a variable's Assign), rethrow the same error (a checkpoint of replicas that stopped at
  // different points must not replace a good one), and with several workers the communicator is
  // aborted, so that the other workers fail at once instead of waiting for collectives this one
  // will not issue: they throw kAborted naming the cause ("rank 0: rank 1 aborted the job: rank
  // 1: the strategy aborted the communicator: worker 1 replica 1 failed: <its error>").
  // With one replica and one worker an exception just propagates and the strategy stays usable.
  //
  // A replica's result is kept in its own std::optional until every replica has returned, so
  // results need not be default-constructible, and replicas never write to a shared object
  // (a PerReplica<bool> is a std::vector<bool>, whose elements share words).
  // A function returning void gives a Run returning void.
  template <typename Fn>
  auto Run(Fn&& fn) {
    using R = std::invoke_result_t<Fn&, ReplicaContext&>;
    if constexpr (std::is_void_v<R>) {
      RunEach([&](ReplicaContext& ctx) { fn(ctx); });
      return;
    } else {
      std::vector<std::optional<R>> slots(static_cast<size_t>(num_local_replicas()));
      RunEach([&](ReplicaContext& ctx) { slots[ctx.local_replica_id()].emplace(fn(ctx)); });
      PerReplica<R> results;
      results.reserve(slots.size());
      for (std::optional<R>& slot : slots) results.push_back(std::move(*slot));
      return results;
    }
  }
  void RunEach(const std::function<void(ReplicaContext&)>& fn);

  // Cross-replica context: reduces one value per local replica over every replica of every
  // worker (kSum, kAvg over NumReplicasInSync(), kMin, kMax). The same result on every worker;
  // workers that pass different ops (kAvg and kSum included) all get kMismatch, as for AllReduce.
  // A mistake one worker can see alone (values for another number of replicas than
  // num_local_replicas(), an unknown op) throws kInvalidArgument there; with several workers it
  // also breaks the strategy, as a failed Run does, so that the other workers, which would wait
  // for this one's all-reduce, throw kAborted naming it at once. With one worker the strategy
  // stays usable.
  double Reduce(ReduceOp op, const PerReplica<double>& values);
  // The same, element-wise, for float vectors of equal size (local vectors of different sizes:
  // kInvalidArgument, as above). Workers whose vectors differ in size (one empty included) all
  // get kMismatch naming both counts.
  std::vector<float> Reduce(ReduceOp op, const PerReplica<std::vector<float>>& values);

  // Cross-replica context, every worker in the same order ("inside the scope"): creates a
  // mirrored variable. The chief runs `init` on one copy; every copy on every worker receives it.
  // Names must be unique. Workers that pass different names or shapes (or one an empty `init`)
  // all get kMismatch naming both values, and no variable is created on any of them (an 8-byte
  // all-gather checks this before the broadcast). When `init` throws, the chief rethrows it, every
  // other worker throws kAborted with its message, and no variable is created on any of them.
  MirroredVariable& CreateVariable(const std::string& name, std::vector<size_t> shape,
                                   const Initializer& init);
  // Every variable, in creation order.
  std::vector<MirroredVariable*> variables() const;
  // nullptr when there is none of that name.
  MirroredVariable* FindVariable(const std::string& name) const;

  // Cross-replica context: broadcasts `values` from the chief to every worker (every worker
  // calls it with the same counts). Used to share restored checkpoints.
  void BroadcastFromChief(const std::vector<Tensor>& values);
  // Cross-replica context: waits until every worker gets here.
  void Barrier();

  StrategyImpl& impl() const { return *impl_; }

 protected:
  explicit Strategy(std::unique_ptr<StrategyImpl> impl);

 private:
  std::unique_ptr<StrategyImpl> impl_;
};

// The strategy in effect when none is chosen: one replica on the CPU, no distribution.
class DefaultStrategy : public Strategy {
 public:
  DefaultStrategy();
};

// One replica on one named device. With a CPU device it computes what DefaultStrategy does; it
// exists so that code written for a strategy runs unchanged on one device.
class OneDeviceStrategy : public Strategy {
 public:
  explicit OneDeviceStrategy(Device device = Device::Cpu());
};

// Local replicas' devices from text: "cpu" (one CPU replica), "gpu" (one replica per visible
// CUDA device), or a comma-separated list ("cuda:0,cuda:1"; "cpu,cpu" gives two CPU replicas).
// kNotSupported naming why for "gpu" without CUDA or without a visible device; kInvalidArgument
// for anything else, a CUDA device named twice, or CPU and CUDA devices mixed.
std::vector<Device> ParseDevices(const std::string& spec);

struct MirroredOptions {
  // Number of local CPU replicas (threads). 0: one.
  int num_replicas = 0;
  // Explicit devices; overrides num_replicas when not empty. CUDA devices (ParseDevices("gpu"))
  // give GPU replicas: variables in device memory, cross_device_ops kNccl (kAuto picks it).
  std::vector<Device> devices{};
  CrossDeviceOps cross_device_ops = CrossDeviceOps::kAuto;
  // Packer bucket cap for cross-replica all-reduces. 0: packing::DefaultBytesPerPack(comm).
  size_t bytes_per_pack = 0;
  // How long a replica waits for the others at a cross-replica call before kTimeout.
  std::chrono::milliseconds timeout{300'000};
};

// One worker, several local replicas, synchronous: every step all-reduces the gradients over
// the local replicas.
class MirroredStrategy : public Strategy {
 public:
  explicit MirroredStrategy(const MirroredOptions& options = {});
};

struct CentralStorageOptions {
  // Number of local CPU replicas (threads) the step runs on. 0: one.
  int num_replicas = 0;
  // Explicit compute devices; overrides num_replicas when not empty.
  std::vector<Device> devices{};
  // How long a replica waits for the others at a cross-replica call before kTimeout.
  std::chrono::milliseconds timeout{300'000};
  // The cluster this process belongs to, which must be a single worker. Default: the
  // environment (TF_CONFIG, WORLD_SIZE, OMPI_COMM_WORLD_SIZE), where none of them or one worker
  // is accepted.
  std::optional<ClusterSpec> cluster{};
};

// TensorFlow's CentralStorageStrategy: one worker, synchronous. Variables live in one place,
// host memory, a single copy (Placement::kCentral), not one per replica; the step runs on every
// local replica, as MirroredStrategy's does. Optimizer::ApplyGradients sums the replicas'
// gradients onto local replica 0 (in replica order, so the sum has the same bits as
// MirroredStrategy's), applies the update to the central copy once, on replica 0's thread, with
// the optimizer's one set of slots, while the other replicas wait; then every replica goes on
// and reads the new value. NumReplicasInSync() is the number of local replicas. Cross-replica
// AllReduce and Reduce work as on MirroredStrategy (cross_device_ops() is
// kReductionToOneDevice).
// More than one worker is refused (kInvalidArgument naming the source: TF_CONFIG's "cluster",
// WORLD_SIZE, OMPI_COMM_WORLD_SIZE or CentralStorageOptions::cluster).
class CentralStorageStrategy : public Strategy {
 public:
  explicit CentralStorageStrategy(const CentralStorageOptions& options = {});
};

struct MultiWorkerOptions {
  // The workers. Default: ClusterSpec::FromEnvironment() (TF_CONFIG, RANK/WORLD_SIZE/MASTER_*, or
  // mpirun's OMPI_COMM_WORLD_*).
  std::optional<ClusterSpec> cluster{};
  // Rendezvous store. Default: the one CreateCommunication makes for the cluster (a TCP store
  // hosted by worker 0). Tests pass a memory store to run workers as threads.
  std::shared_ptr<Store> store{};
  // Local replicas per worker and how they reduce among themselves, as for MirroredStrategy.
  int num_local_replicas = 1;
  // Explicit local devices; overrides num_local_replicas when not empty (as
  // MirroredOptions::devices). Every worker runs as many local replicas.
  std::vector<Device> local_devices{};
  CrossDeviceOps cross_device_ops = CrossDeviceOps::kAuto;
  // RING, NCCL or AUTO between workers, timeout, bytes_per_pack, job token.
  CommunicationOptions communication{};
};

// Several workers (processes, maybe on several hosts), each with one or more local replicas.
// Gradients are reduced over the local replicas, then all-reduced between workers.
class MultiWorkerMirroredStrategy : public Strategy {
 public:
  explicit MultiWorkerMirroredStrategy(MultiWorkerOptions options = {});
};

// Checks that `spec`'s layout fits the strategy named `strategy`, with TensorFlow's rules, and
// throws Error(kInvalidArgument) naming the TF_CONFIG field and the rule when it does not:
//   "multi_worker_mirrored": a chief or worker task; no "ps" tasks (they are only for
//     ParameterServerStrategy); an "evaluator" task may be listed: it is not in the collective.
//   "parameter_server": TF_CONFIG's cluster with a "chief" (the coordinator), at least one
//     "worker" and at least one "ps".
//   "default", "one_device", "mirrored", "central_storage" (one process): not a "ps" task; a
//     chief or worker task only in a cluster of one chief or worker; an evaluator task runs one
//     of these whatever the training's size.
// MultiWorkerMirroredStrategy calls it on its cluster; a program that picks its strategy from the
// role (ClusterSpec::task_type) calls it before it builds one. Unknown names: kInvalidArgument.
void CheckClusterLayout(const ClusterSpec& spec, std::string_view strategy);

// Per-example losses -> the replica's share of the mean loss of the global batch:
// sum(losses[i] * weights[i]) / global_batch_size (weights default to 1). Summed over all
// replicas it is the mean over the global batch, so gradients summed over replicas are the
// gradients of that mean.
double ComputeAverageLoss(std::span<const float> per_example_losses, size_t global_batch_size,
                          std::span<const float> sample_weights = {});

// ---- Input -----------------------------------------------------------------------------------

struct DatasetOptions {
  // Examples per step over all replicas of all workers. Must be > 0.
  size_t global_batch_size = 0;
  // Drop the last global batch when it is smaller than global_batch_size.
  bool drop_remainder = false;
  // Shuffle the order of the examples every epoch with a permutation from (seed, epoch), the
  // same on every worker.
  bool shuffle = false;
  uint64_t seed = 0;
};

// A dataset of `num_examples` examples, addressed by index, batched by the global batch and split
// over the replicas. Model-agnostic: it hands out example indices; the caller reads the examples.
//
// Sharding between workers is by data, like TF's AutoShardPolicy.DATA: every worker computes
// the same order of indices, and each worker takes its own contiguous slice of every global
// batch (worker w of W takes elements [w*B/W, (w+1)*B/W)), then splits it over its local
// replicas the same way. A worker reads only the examples it is given. global_batch_size must be
// divisible by NumReplicasInSync().
//
// The last partial batch (drop_remainder false, r < B examples left): as TF's rebatching does,
// replicas are filled in order of replica_id_in_sync_group with up to B/N examples each, so the
// last replicas may get fewer or none. Losses are still divided by the full global batch size
// unless the caller passes GlobalBatchSize(step).
//
// Constructing one is a cross-replica call that every worker makes at the same point: the workers
// check that they were given the same num_examples and options (the seed only with shuffle),
// and all get kMismatch naming the first that differs when they were not (workers with
// different datasets would otherwise see some examples twice per epoch and others never,
// silently). TensorFlow does not check this.
class DistributedDataset {
 public:
  DistributedDataset(const Strategy& strategy, size_t num_examples, DatasetOptions options);

  size_t num_examples() const { return num_examples_; }
  size_t global_batch_size() const { return options_.global_batch_size; }
  size_t per_replica_batch_size() const;
  size_t steps_per_epoch() const;
  // Examples in the global batch of `step` (global_batch_size, or fewer for a last partial one).
  size_t GlobalBatchSize(size_t step) const;
  // The example indices local replica `local_replica` of this worker gets at `step` of `epoch`.
  std::vector<size_t> ReplicaBatch(int64_t epoch, size_t step, int local_replica) const;
  // The same for any replica of any worker (global replica id); for tests and tools.
  std::vector<size_t> GlobalReplicaBatch(int64_t epoch, size_t step, int replica_id) const;

 private:
  std::vector<size_t> Order(int64_t epoch) const;
  // The shuffled order of the last epoch asked for, shared by the replicas' threads (ReplicaBatch
  // is called from every replica at once) and by copies of this dataset. Null without shuffle.
  struct OrderCache;
  std::shared_ptr<OrderCache> order_cache_;
  size_t num_examples_;
  DatasetOptions options_;
  int num_replicas_;
  int replicas_per_worker_;
  int worker_index_;
};

// ---- Optimizers ------------------------------------------------------------------------------

// An optimizer whose state (slots) is placed like the variables: mirrored (one copy per local
// replica) or, on CentralStorageStrategy, central (one copy, updated once per step).
// ApplyGradients is called in replica context by every local replica of every worker.
class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Sums `gradients` over every replica (ReplicaContext::AllReduce, kSum, through the packer),
  // then applies the same update to this replica's copy of each variable. gradients[i] has
  // variables[i]->count() elements and is overwritten with the summed gradient.
  // On CentralStorageStrategy: the replicas meet, local replica 0 sums every replica's
  // gradients (in replica order) and updates the central variables once, the others wait and
  // then copy the sum into their gradients; every replica returns with the new values.
  void ApplyGradients(ReplicaContext& ctx, const std::vector<MirroredVariable*>& variables,
                      const std::vector<std::span<float>>& gradients);
  // The same with gradients as float32 tensors: in host memory, or (GPU replicas) in the memory
  // of ctx's device, reduced there in place by NCCL.
  //
  // Variables in device memory: the update itself runs on the host, since the library has no
  // CUDA kernels: each replica copies the summed gradient and its copy of the variable to the
  // host (cudaMemcpy), updates them with its slots (kept in host memory), and copies the
  // variable back. Per step and variable that is three transfers of count() floats over the
  // bus per replica (gradient and variable down, variable up), serialised with the step.
  void ApplyGradients(ReplicaContext& ctx, const std::vector<MirroredVariable*>& variables,
                      const std::vector<Tensor>& gradients);
  // Applies already-summed gradients without any communication (for a caller that reduced them
  // itself). Same update as ApplyGradients. On CentralStorageStrategy the update is applied
  // once: with local_replica 0's gradients, by that call; the other replicas' calls apply
  // nothing (inside Run, every replica calls it and the others wait until replica 0 is done).
  void ApplyReducedGradients(int local_replica, const std::vector<MirroredVariable*>& variables,
                             const std::vector<std::span<const float>>& gradients);

  // Updates applied so far (TF's optimizer.iterations); the same on every replica between Run
  // calls. Cross-replica context: throws kInvalidUsage inside Run (replica 0's thread may be
  // updating the count it reads) and rethrows the error that broke the strategy.
  int64_t iterations() const;
  // Replica context: the updates `ctx`'s replica has applied so far, read from its own count
  // (written only by its own thread, so no race with the other replicas). Replicas that made the
  // same ApplyGradients calls see the same value. kInvalidArgument for a context of another
  // strategy.
  int64_t iterations(const ReplicaContext& ctx) const;
  const std::string& name() const { return name_; }

  // Checkpoint support: named float state per variable (for Adam "m" and "v"), read from local
  // replica 0, and written back to every local copy. Slots are created (zero) at a variable's
  // first update, so only variables updated so far have them; SaveSlots lists them in the
  // strategy's variable order. RestoreSlots replaces all slots and checks names and sizes
  // (kInvalidArgument) before changing anything. Both are cross-replica calls.
  struct Slot {
    std::string name;  // "<variable>/<slot>", e.g. "dense/kernel/m"
    std::vector<float> value;
  };
  std::vector<Slot> SaveSlots() const;
  void RestoreSlots(const std::vector<Slot>& slots, int64_t iterations);
  // RestoreSlots' checks alone: throws what it would throw, changes nothing (for a caller that
  // must know that every worker can restore before any does, as RestoreCheckpoint).
  void CheckSlots(const std::vector<Slot>& slots, int64_t iterations) const;
  // The names of each variable's slots ({"m", "v"} for Adam, {"momentum"} for SGD with momentum,
  // none without), in the order Update receives them.
  const std::vector<std::string>& slot_names() const { return slot_names_; }

 protected:
  Optimizer(Strategy& strategy, std::string name, std::vector<std::string> slot_names);
  // Updates one variable copy with its summed gradient; `slots` holds this replica's copy of each
  // slot of that variable (in slot_names order); `step` counts from 1.
  virtual void Update(std::span<float> variable, std::span<const float> gradient,
                      std::span<std::span<float>> slots, int64_t step) = 0;

 private:
  // ApplyReducedGradients' checks of its arguments (kInvalidArgument); changes nothing.
  void CheckUpdate(int local_replica, const std::vector<MirroredVariable*>& variables,
                   const std::vector<std::span<const float>>& gradients) const;
  // Counts one update and applies it to local replica `local_replica`'s value of each variable,
  // with its slots.
  void Apply(int local_replica, const std::vector<MirroredVariable*>& variables,
             const std::vector<std::span<const float>>& gradients);

  struct State;
  Strategy& strategy_;
  std::string name_;
  std::vector<std::string> slot_names_;
  std::unique_ptr<State> state_;
};

struct SgdOptions {
  float learning_rate = 0.01f;
  float momentum = 0.0f;  // 0: plain SGD, no slot
  bool nesterov = false;
};
// Keras SGD: v = momentum * v - lr * g; w += v (nesterov: w += momentum * v - lr * g).
class Sgd : public Optimizer {
 public:
  Sgd(Strategy& strategy, SgdOptions options = {});

 private:
  void Update(std::span<float> variable, std::span<const float> gradient,
              std::span<std::span<float>> slots, int64_t step) override;
  SgdOptions options_;
};

struct AdamOptions {
  float learning_rate = 0.001f;
  float beta_1 = 0.9f;
  float beta_2 = 0.999f;
  float epsilon = 1e-7f;
  // Keras' LearningRateSchedule: when set, the rate of an update is
  // learning_rate_schedule(iterations before it) instead of learning_rate. Called from every
  // replica's thread: a pure function of its argument. A schedule that returns learning_rate
  // gives learning_rate's weights bit for bit.
  std::function<double(int64_t iterations)> learning_rate_schedule{};
};
// Keras Adam: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// w -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps).
class Adam : public Optimizer {
 public:
  Adam(Strategy& strategy, AdamOptions options = {});

 private:
  void Update(std::span<float> variable, std::span<const float> gradient,
              std::span<std::span<float>> slots, int64_t step) override;
  AdamOptions options_;
};

// ---- Checkpoints -----------------------------------------------------------------------------

// Where training stands: the next epoch and step to run.
struct TrainingState {
  int64_t epoch = 0;
  int64_t step = 0;  // step within the epoch
  bool operator==(const TrainingState&) const = default;
};

// Collective (every worker calls it): saves every variable of the strategy, the optimizer's slots
// and iterations, and `state`. Every worker passes the same `state` and an optimizer of the same
// name and slots, or none (else every worker throws kMismatch naming the field, and nothing is
// written). The chief writes `<directory>/checkpoint` atomically: a temporary
// file in the same directory, fsync, rename over the old one, fsync of the directory; a crash at
// any point leaves either the old or the new checkpoint, never a torn one. Other workers write the
// same bytes to their own temporary place (`<directory>/.worker-<index>.tmp-...`)
// and delete it, as the guide advises, so that no two workers write the same file. The file
// carries a checksum.
// Directories it creates are made durable too (their parents are fsynced). Several savers may
// save to one directory at once (each has its own temporary; the last rename wins). When the
// chief fails, every worker throws the chief's error code, with its message. Only the chief's file
// is the checkpoint: when another worker fails (to write or delete its temporary, say its disk is
// full), that worker writes a line saying why to stderr and every worker returns, the chief's new
// checkpoint in place.
void SaveCheckpoint(Strategy& strategy, const Optimizer* optimizer, const std::string& directory,
                    TrainingState state);

// Collective: the chief reads `<directory>/checkpoint` (if any) and broadcasts it to every worker;
// every worker assigns the variables and optimizer state. Returns the saved state, or nullopt when
// there is no checkpoint (nothing changed). Throws kInvalidArgument on a corrupt file or one whose
// variables do not match the strategy's (names, shapes) or whose optimizer state does not match
// `optimizer` (name, slots), and on a path that is not a regular file (a FIFO, a device, a
// directory: refused before it is read, which could block or never end).
// It succeeds on every worker or on none: the workers first check that they all pass an
// optimizer or all pass none, of the same name with the same slot names (else every worker throws
// kMismatch naming the field); then every worker checks the file against its variables and
// optimizer without changing anything; when one fails, every worker throws the lowest failing
// worker's error code, with a message naming that worker and saying why, and nothing changes
// anywhere. Only then does every worker assign.
std::optional<TrainingState> RestoreCheckpoint(Strategy& strategy, Optimizer* optimizer,
                                               const std::string& directory);

// A checkpoint file's contents as values, for a program that reads or writes checkpoints without
// a strategy (an evaluator, a parameter-server coordinator, a tool). The same file format and
// checks as SaveCheckpoint and RestoreCheckpoint.
struct CheckpointData {
  struct Tensor {
    std::string name;
    std::vector<size_t> shape;
    std::vector<float> values;  // row-major; as many as the product of `shape`
    bool operator==(const Tensor&) const = default;
  };
  TrainingState state;
  std::string optimizer;   // the optimizer's name; "" when saved without one
  int64_t iterations = 0;  // the optimizer's updates so far (TF's optimizer.iterations)
  std::vector<Tensor> variables;  // in the strategy's creation order
  // The optimizer's slots, named "<variable>/<slot>" ("dense/kernel/m"), each of shape {count}.
  std::vector<Tensor> slots;
  // nullptr when there is no variable of that name.
  const Tensor* FindVariable(const std::string& name) const;
  bool operator==(const CheckpointData&) const = default;
};

// Reads and verifies `<directory>/checkpoint`: the magic, the size field against the file's
// size and the checksum, then every record. Returns nullopt when there is none (no file, or no
// directory). Throws kInvalidArgument naming the file and what is wrong for a partial, corrupt
// or foreign file ("checkpoint ckpt/checkpoint is corrupt: truncated: the file has 100 bytes,
// its header says 4156") and for a path that is not a regular file; kSystem when it cannot be
// read. Thread-safe; never blocks on a FIFO.
std::optional<CheckpointData> ReadCheckpointFile(const std::string& directory);

// Writes `data` to `<directory>/checkpoint` (creating the directory) as the chief's
// SaveCheckpoint does: a temporary file in the directory, fsync, rename over the old one, fsync
// of the directory, so that a reader sees the old checkpoint or the new one, never a torn one.
// Throws kInvalidArgument (nothing written) when a tensor's values do not fill its shape or the
// state or iterations are negative; kSystem when the file cannot be written.
void WriteCheckpointFile(const std::string& directory, const CheckpointData& data);

// Keras' BackupAndRestore for a custom loop: restores at the start of training when a backup
// exists, saves at the end of every epoch (and every `save_every_steps` steps when > 0), and
// deletes the backup when training ends normally. Every call is collective. When the chief
// cannot delete the backup, OnTrainEnd throws on every worker (kSystem, naming the file): a
// backup left behind would make the next run with this directory resume a finished training.
//
//   BackupAndRestore backup(strategy, &adam, "ckpt", {});
//   TrainingState start = backup.OnTrainBegin();    // {0, 0} on a fresh start
//   for (epoch = start.epoch; ...) { for (step = (epoch == start.epoch ? start.step : 0); ...) {
//       ...; backup.OnStepEnd(epoch, step); }
//     backup.OnEpochEnd(epoch); }
//   backup.OnTrainEnd();
class BackupAndRestore {
 public:
  struct Options {
    int64_t save_every_steps = 0;
    bool delete_on_train_end = true;
  };
  BackupAndRestore(Strategy& strategy, Optimizer* optimizer, std::string directory,
                   Options options);
  TrainingState OnTrainBegin();
  void OnStepEnd(int64_t epoch, int64_t step);
  void OnEpochEnd(int64_t epoch);
  void OnTrainEnd();
  const std::string& directory() const { return directory_; }

 private:
  Strategy& strategy_;
  Optimizer* optimizer_;
  std::string directory_;
  Options options_;
};

}  // namespace collectives::strategy

#endif  // COLLECTIVES_STRATEGY_H_
