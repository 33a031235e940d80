// StrategyImpl: what every strategy is underneath (the public classes of strategy.h only pick a
// configuration): the local replicas (a LocalGroup), the communicator between workers, the
// variables (mirrored, or central for CentralStorageStrategy), and the cross-replica reductions.
//
// Thread-safety: as Strategy. The cross-replica-context methods (RunEach, Reduce,
// CreateVariable, BroadcastFromChief, Barrier, ...) are called from the owner's thread, outside
// RunEach; they throw kInvalidUsage when called from inside. AllReduce is called by the local
// replicas of a running RunEach, each with its own local_replica.
#ifndef COLLECTIVES_SRC_STRATEGY_STRATEGY_IMPL_H_
#define COLLECTIVES_SRC_STRATEGY_STRATEGY_IMPL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collectives/communication.h"
#include "collectives/strategy.h"
#include "src/strategy/local_group.h"

namespace collectives::strategy {

class StrategyImpl {
 public:
  struct Config {
    std::string name;              // "default", "one_device", "mirrored", ... (Strategy::name)
    std::vector<Device> devices;   // one per local replica: all CPU, or distinct CUDA devices
    CrossDeviceOps cross_device_ops = CrossDeviceOps::kHierarchicalCopy;  // resolved, never kAuto
    std::chrono::milliseconds timeout{300'000};
    size_t bytes_per_pack = 0;     // for the cross-worker packer
    int worker_index = 0;
    int num_workers = 1;
    std::unique_ptr<CollectiveCommunication> comm;  // null with one worker
    // Where CreateVariable puts variables: kCentral (one copy, updated once per step through
    // UpdateOnce) needs a single worker.
    MirroredVariable::Placement placement = MirroredVariable::Placement::kMirrored;
  };
  explicit StrategyImpl(Config config);
  ~StrategyImpl();
  StrategyImpl(const StrategyImpl&) = delete;
  StrategyImpl& operator=(const StrategyImpl&) = delete;

  // Set by Strategy's constructor: the public object ReplicaContexts point at.
  void Attach(Strategy* owner) { owner_ = owner; }

  const std::string& name() const { return name_; }
  int num_local_replicas() const { return static_cast<int>(devices_.size()); }
  int num_workers() const { return num_workers_; }
  int worker_index() const { return worker_index_; }
  int NumReplicasInSync() const { return num_workers_ * num_local_replicas(); }
  // The worker with rank 0 is the chief. ClusterSpec::FromTfConfig gives rank 0 to the "chief"
  // task when TF_CONFIG lists one (then the workers follow in list order), else to worker 0; so
  // rank 0 is TensorFlow's chief in both cases, and worker 0 under torchrun or mpirun.
  bool IsChief() const { return worker_index_ == 0; }
  const std::vector<Device>& devices() const { return devices_; }
  CrossDeviceOps cross_device_ops() const { return cross_device_ops_; }
  CollectiveCommunication* communication() const { return comm_.get(); }
  size_t bytes_per_pack() const { return bytes_per_pack_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // "worker 1 " with several workers, "" with one: the prefix of this worker's messages.
  const std::string& who() const { return who_; }
  MirroredVariable::Placement placement() const { return placement_; }
  bool central() const { return placement_ == MirroredVariable::Placement::kCentral; }
  // True while RunEach runs the replicas' functions.
  bool in_run() const { return in_run_.load(std::memory_order_relaxed); }

  void RunEach(const std::function<void(ReplicaContext&)>& fn);
  void AllReduce(int local_replica, ReduceOp op, const std::vector<Tensor>& tensors);
  // The central-storage update, called by every local replica of a running RunEach with its
  // gradients (the same counts and dtypes; empty lists for gradients already summed): the
  // replicas meet, replica 0 sums every replica's tensors into its own in replica order (the
  // fold of AllReduce, so the same bits), then calls `apply` once, on its thread, while the
  // others wait; then every other replica copies replica 0's sums into its own tensors. A
  // failure of `apply` aborts the group (the others throw kAborted), as any replica's failure
  // does. With one local replica: `apply` runs at once. Needs a single worker.
  void UpdateOnce(int local_replica, const std::vector<Tensor>& tensors,
                  const std::function<void()>& apply);

  double Reduce(ReduceOp op, const PerReplica<double>& values);
  std::vector<float> Reduce(ReduceOp op, const PerReplica<std::vector<float>>& values);

  MirroredVariable& CreateVariable(const std::string& name, std::vector<size_t> shape,
                                   const Initializer& init);
  std::vector<MirroredVariable*> variables() const;
  MirroredVariable* FindVariable(const std::string& name) const;

  void BroadcastFromChief(const std::vector<Tensor>& values);
  void Barrier();

  // What one worker says it is doing: (field, value) pairs, values as text.
  using Description = std::vector<std::pair<std::string, std::string>>;
  // Cross-replica context, every worker at the same point: checks that every worker describes
  // `what` ("DistributedDataset", "CreateVariable('dense/kernel')") with the same fields. When a
  // worker differs from worker 0, every worker throws the same kMismatch naming the first field
  // that differs, worker 0's value and that worker's, and the strategy stays usable (every worker
  // stopped at the same point). Costs one 8-byte all-gather when the workers agree (two more to
  // fetch the descriptions when they do not); nothing with one worker.
  void AgreeAcrossWorkers(const std::string& what, const Description& mine);

  // Throws kInvalidUsage naming `call` when called from inside RunEach, and rethrows the error
  // that broke the strategy (see broken_) when one did.
  void CheckCrossReplica(const char* call) const;
  // Marks the strategy broken by `error` and aborts the communicator with it as the reason
  // (see AbortCommunication), so that the other workers, which may wait in a collective this
  // worker will never issue, fail at once and learn why. `who_failed` ("worker 1 replica 0
  // failed: ") goes before the error's message in that reason.
  void Break(std::exception_ptr error, const std::string& who_failed = "");
  // Aborts the communicator, if any, with `reason`: the other workers' calls raise kAborted
  // "rank 0: rank 1 aborted the job: rank 1: the strategy aborted the communicator: <reason>"
  // (core::InternalCommunication::Abort; the public Abort() on a user's wrapper). Any thread.
  void AbortCommunication(const std::string& reason);
  // Throws `error`, a caller mistake that only this worker sees (Strategy::Reduce's arguments).
  // With several workers, breaks the strategy with it first (Break), as a failed Run does: the
  // other workers, which would wait for this worker's all-reduce until their timeout, throw
  // kAborted naming it at once. With one worker the strategy stays usable.
  [[noreturn]] void Refuse(const Error& error);

 private:
  void ReduceToOneDevice(int r, const internal::LocalGroup::Call& call, ReduceOp op,
                         const std::vector<Tensor>& tensors);
  void HierarchicalCopy(int r, const internal::LocalGroup::Call& call, ReduceOp op,
                        const std::vector<Tensor>& tensors);
  // kNccl: host tensors are staged through memory of replica r's device; the replicas
  // all-reduce (one worker) or reduce onto replica 0 (several) over local_nccl_; replica 0 runs
  // the cross-worker step on host copies (CrossWorkerStaged) and broadcasts the result.
  void NcclReduce(int r, const internal::LocalGroup::Call& call, ReduceOp op,
                  const std::vector<Tensor>& tensors);
  // CrossWorker for tensors in memory of device `device`: copied to the host, all-reduced
  // across workers there, divided for kAvg, copied back.
  void CrossWorkerStaged(const Device& device, ReduceOp op, const std::vector<Tensor>& tensors);
  // Replica 0's cross-worker step: all-reduce its tensors (which hold the local reduction) over
  // the workers through the packer, then finish kAvg.
  void CrossWorker(ReduceOp op, const std::vector<Tensor>& tensors);
  void CheckTensors(int r, const internal::LocalGroup::Call& call,
                    const std::vector<Tensor>& tensors) const;

  Strategy* owner_ = nullptr;
  const std::string name_;
  const std::vector<Device> devices_;
  const CrossDeviceOps cross_device_ops_;
  const std::chrono::milliseconds timeout_;
  const size_t bytes_per_pack_;
  const int worker_index_;
  const int num_workers_;
  const std::string who_;
  const MirroredVariable::Placement placement_;
  std::unique_ptr<CollectiveCommunication> comm_;
  // kNccl with several local replicas: rank r on devices_[r], joined in this process.
  std::vector<std::unique_ptr<CollectiveCommunication>> local_nccl_;
  // Null with one local replica (RunEach then calls fn on the caller's thread).
  std::unique_ptr<internal::LocalGroup> group_;

  std::atomic<bool> in_run_{false};
  // The first error of a RunEach with several replicas or workers: later RunEach calls and
  // cross-replica calls rethrow it (a strategy whose replicas stopped at different points cannot
  // be used again).
  std::exception_ptr broken_;
  // Cross-replica calls made so far by each local replica (element r written only by replica r).
  std::vector<uint64_t> seq_;

  std::deque<std::unique_ptr<MirroredVariable>> variables_;
  std::map<std::string, MirroredVariable*> by_name_;
};

}  // namespace collectives::strategy

#endif  // COLLECTIVES_SRC_STRATEGY_STRATEGY_IMPL_H_
