// The public strategy classes of strategy.h: each builds a StrategyImpl configuration (devices,
// cross-device reduction, communicator) and forwards to it. Also ReplicaContext, the names of
// CrossDeviceOps and ComputeAverageLoss.
#include "collectives/strategy.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "collectives/errors.h"
#include "src/core/text.h"
#include "src/strategy/device.h"
#include "src/strategy/strategy_impl.h"

namespace collectives::strategy {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

// The strategies without GPU replicas (one device, central storage): CPU devices only.
void RequireCpu(const char* strategy, const Device& device) {
  if (device.kind != Device::Kind::kCpu) {
    throw Error(ErrorCode::kNotSupported,
                std::string(strategy) + ": device " + device.ToString() +
                    " is not supported: its replicas run on the CPU (GPU replicas: "
                    "MirroredStrategy or MultiWorkerMirroredStrategy with CUDA devices)");
  }
}

// Local devices: all CPU, or distinct CUDA devices that exist.
void CheckDevices(const std::string& strategy, const std::vector<Device>& devices) {
  const bool cuda = devices[0].kind == Device::Kind::kCuda;
  for (size_t i = 0; i < devices.size(); ++i) {
    const Device& d = devices[i];
    if ((d.kind == Device::Kind::kCuda) != cuda) {
      Invalid(std::string(strategy) + ": local replicas on " + devices[0].ToString() + " and " +
              d.ToString() + ": the replicas are either all CPU or all CUDA devices");
    }
    if (!cuda) continue;
    for (size_t k = 0; k < i; ++k) {
      if (devices[k] == d) {
        Invalid(std::string(strategy) + ": " + d.ToString() +
                " is named twice: each GPU replica has a device of its own");
      }
    }
  }
  if (!cuda) return;
  const int visible = internal::CudaDeviceCount(strategy);  // kNotSupported without CUDA
  for (const Device& d : devices) {
    if (d.index < 0 || d.index >= visible) {
      Invalid(std::string(strategy) + ": " + d.ToString() + " does not exist (" +
              std::to_string(visible) + " CUDA devices visible)");
    }
  }
}

// kAuto -> what it means for these devices; kNccl needs CUDA replicas and NCCL, CUDA replicas
// need kNccl (the other two read every replica's memory from the host).
CrossDeviceOps Resolve(const char* strategy, CrossDeviceOps ops,
                       const std::vector<Device>& devices) {
  const bool cuda = devices[0].kind == Device::Kind::kCuda;
  const auto need_nccl = [&] {
    if (const std::string why = internal::NcclUnavailableReason(); !why.empty()) {
      throw Error(ErrorCode::kNotSupported, std::string(strategy) +
                                                ": GPU replicas reduce with cross_device_ops nccl, "
                                                "and NCCL is not usable here: " +
                                                why);
    }
    return CrossDeviceOps::kNccl;
  };
  switch (ops) {
    case CrossDeviceOps::kAuto:
      return cuda ? need_nccl() : CrossDeviceOps::kHierarchicalCopy;
    case CrossDeviceOps::kReductionToOneDevice:
    case CrossDeviceOps::kHierarchicalCopy:
      if (cuda) {
        throw Error(ErrorCode::kNotSupported,
                    std::string(strategy) + ": cross_device_ops " + ToString(ops) +
                        " reads every replica's memory from the host, and the replicas are CUDA "
                        "devices; use nccl (or auto)");
      }
      return ops;
    case CrossDeviceOps::kNccl:
      if (!cuda) {
        throw Error(ErrorCode::kNotSupported,
                    std::string(strategy) +
                        ": cross_device_ops nccl needs CUDA devices, and the local replicas are "
                        "CPU threads; use hierarchical_copy or reduction_to_one_device (or give "
                        "CUDA devices)");
      }
      return need_nccl();
  }
  Invalid(std::string(strategy) + ": unknown cross_device_ops " +
          std::to_string(static_cast<int>(ops)));
}

int LocalReplicaCount(const char* strategy, int requested) {
  constexpr int kMaxLocalReplicas = 1024;
  if (requested < 0 || requested > kMaxLocalReplicas) {
    Invalid(std::string(strategy) + ": " + std::to_string(requested) +
            " local replicas (expected 0 for the default, or 1.." +
            std::to_string(kMaxLocalReplicas) + ")");
  }
  return requested == 0 ? 1 : requested;  // 0: one replica (CPU replicas only)
}

// A mirrored strategy's local devices: those given, checked, else `num_replicas` CPU replicas.
std::vector<Device> MirroredDevices(const char* strategy, const std::vector<Device>& devices,
                                    int num_replicas) {
  if (!devices.empty()) {
    CheckDevices(strategy, devices);
    return devices;
  }
  return std::vector<Device>(static_cast<size_t>(LocalReplicaCount(strategy, num_replicas)),
                             Device::Cpu());
}

void RequirePositive(const char* strategy, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    Invalid(std::string(strategy) + ": timeout must be positive, got " +
            std::to_string(timeout.count()) + " ms");
  }
}

// Every worker must run as many local replicas as the others (TensorFlow's multi-worker
// strategy assumes the same too): replica ids, NumReplicasInSync and the divisor of MEAN are
// computed from this worker's count. Workers that differ would all run, every collective
// matching in size, and average with different divisors; instead every worker learns all the
// counts (one all-gather, the same on every worker) and raises the same error.
void RequireSameReplicaCount(const char* strategy, CollectiveCommunication& comm, size_t mine) {
  int64_t own = static_cast<int64_t>(mine);
  std::vector<int64_t> all(static_cast<size_t>(comm.size()));
  comm.AllGather(Tensor{&own, 1, DataType::kInt64},
                 Tensor{all.data(), all.size(), DataType::kInt64});
  if (std::all_of(all.begin(), all.end(), [&](int64_t n) { return n == all[0]; })) return;
  std::string counts;
  for (size_t w = 0; w < all.size(); ++w) {
    counts += (w ? ", " : "") + std::string("worker ") + std::to_string(w) + ": " +
              std::to_string(all[w]);
  }
  Invalid(std::string(strategy) + ": worker " + std::to_string(comm.rank()) +
          ": the workers run different numbers of local replicas (" + counts +
          "); every worker must run the same number (num_local_replicas)");
}

std::unique_ptr<StrategyImpl> SingleDevice(std::string name, Device device) {
  RequireCpu(name == "default" ? "DefaultStrategy" : "OneDeviceStrategy", device);
  StrategyImpl::Config config;
  config.name = std::move(name);
  config.devices = {device};
  return std::make_unique<StrategyImpl>(std::move(config));
}

std::unique_ptr<StrategyImpl> Mirrored(const MirroredOptions& options) {
  constexpr const char* kWho = "MirroredStrategy";
  StrategyImpl::Config config;
  config.name = "mirrored";
  config.devices = MirroredDevices(kWho, options.devices, options.num_replicas);
  config.cross_device_ops = Resolve(kWho, options.cross_device_ops, config.devices);
  RequirePositive(kWho, options.timeout);
  config.timeout = options.timeout;
  config.bytes_per_pack = options.bytes_per_pack;
  return std::make_unique<StrategyImpl>(std::move(config));
}

// CentralStorageStrategy trains on one worker: refuses a cluster of several, naming where it
// comes from. Follows ClusterSpec::FromEnvironment's order of sources (TF_CONFIG, then WORLD_SIZE,
// then OMPI_COMM_WORLD_SIZE), but reads only the size, so that a layout of several workers is
// refused for what it is rather than for a variable (MASTER_PORT) it would also need.
void RequireOneWorker(const CentralStorageOptions& options) {
  constexpr const char* kRule =
      "CentralStorageStrategy trains on a single worker (one process, whose local replicas share "
      "the one copy of the variables), as TensorFlow's does; for several workers use "
      "MultiWorkerMirroredStrategy";
  if (options.cluster) {
    options.cluster->Validate();
    if (options.cluster->world_size != 1) {
      Invalid("CentralStorageStrategy: CentralStorageOptions::cluster has world_size " +
              std::to_string(options.cluster->world_size) + "; " + kRule);
    }
    return;
  }
  const auto blank = [](const char* text) {
    return std::all_of(text, text + std::strlen(text),
                       [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; });
  };
  if (const char* tf_config = std::getenv("TF_CONFIG"); tf_config != nullptr && !blank(tf_config)) {
    const ClusterSpec spec = ClusterSpec::FromTfConfig(tf_config);
    if (spec.world_size != 1) {
      Invalid("CentralStorageStrategy: TF_CONFIG field 'cluster' lists " +
              std::to_string(spec.world_size) + " training tasks ('chief' and 'worker'); " + kRule +
              " (give TF_CONFIG one worker, or unset it)");
    }
    return;
  }
  const bool rank_variables =
      std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr;
  const char* size_name = rank_variables ? "WORLD_SIZE" : "OMPI_COMM_WORLD_SIZE";
  const char* size = std::getenv(size_name);
  if (size != nullptr && std::string(size) != "1") {
    Invalid(std::string("CentralStorageStrategy: ") + size_name + "=" + core::OneLine(size, 64) +
            " asks for several workers; " + kRule + " (set " + size_name + "=1, or unset it)");
  }
}

std::unique_ptr<StrategyImpl> CentralStorage(const CentralStorageOptions& options) {
  constexpr const char* kWho = "CentralStorageStrategy";
  RequireOneWorker(options);
  StrategyImpl::Config config;
  config.name = "central_storage";
  if (!options.devices.empty()) {
    for (const Device& d : options.devices) RequireCpu(kWho, d);
    config.devices = options.devices;
  } else {
    config.devices.assign(static_cast<size_t>(LocalReplicaCount(kWho, options.num_replicas)),
                          Device::Cpu());
  }
  // Reductions of the replicas' own tensors (ReplicaContext::AllReduce, Strategy::Reduce) gather
  // on replica 0, as the gradients do onto the central copy.
  config.cross_device_ops = CrossDeviceOps::kReductionToOneDevice;
  RequirePositive(kWho, options.timeout);
  config.timeout = options.timeout;
  config.placement = MirroredVariable::Placement::kCentral;
  return std::make_unique<StrategyImpl>(std::move(config));
}

std::unique_ptr<StrategyImpl> MultiWorker(MultiWorkerOptions options) {
  constexpr const char* kWho = "MultiWorkerMirroredStrategy";
  StrategyImpl::Config config;
  config.name = "multi_worker_mirrored";
  config.devices = MirroredDevices(kWho, options.local_devices, options.num_local_replicas);
  config.cross_device_ops = Resolve(kWho, options.cross_device_ops, config.devices);
  RequirePositive(kWho, options.communication.timeout);
  config.timeout = options.communication.timeout;
  config.bytes_per_pack = options.communication.bytes_per_pack;
  const ClusterSpec spec = options.cluster ? *options.cluster : ClusterSpec::FromEnvironment();
  spec.Validate();
  CheckClusterLayout(spec, config.name);
  config.worker_index = spec.rank;
  config.num_workers = spec.world_size;
  if (spec.world_size > 1) {
    config.comm = options.store
                      ? CreateCommunication(spec, std::move(options.store), options.communication)
                      : CreateCommunication(spec, options.communication);
    RequireSameReplicaCount(kWho, *config.comm, config.devices.size());
  }
  return std::make_unique<StrategyImpl>(std::move(config));
}

}  // namespace

// ---- Names -------------------------------------------------------------------------------------

const char* ToString(CrossDeviceOps ops) {
  switch (ops) {
    case CrossDeviceOps::kAuto: return "auto";
    case CrossDeviceOps::kReductionToOneDevice: return "reduction_to_one_device";
    case CrossDeviceOps::kHierarchicalCopy: return "hierarchical_copy";
    case CrossDeviceOps::kNccl: return "nccl";
  }
  return "?";
}

CrossDeviceOps ParseCrossDeviceOps(const std::string& name) {
  // Our names, and TensorFlow's class names.
  if (name == "auto") return CrossDeviceOps::kAuto;
  if (name == "reduction_to_one_device" || name == "ReductionToOneDevice") {
    return CrossDeviceOps::kReductionToOneDevice;
  }
  if (name == "hierarchical_copy" || name == "HierarchicalCopyAllReduce") {
    return CrossDeviceOps::kHierarchicalCopy;
  }
  if (name == "nccl" || name == "NcclAllReduce") return CrossDeviceOps::kNccl;
  Invalid("unknown cross_device_ops '" + name +
          "' (expected auto, reduction_to_one_device, hierarchical_copy or nccl)");
}

std::vector<Device> ParseDevices(const std::string& spec) {
  if (spec == "gpu") {
    const int visible = internal::CudaDeviceCount("devices 'gpu'");
    if (visible < 1) {
      throw Error(ErrorCode::kNotSupported, "devices 'gpu': no CUDA device is visible");
    }
    std::vector<Device> out;
    for (int i = 0; i < visible; ++i) out.push_back(Device::Cuda(i));
    return out;
  }
  std::vector<Device> out;
  size_t start = 0;
  while (start <= spec.size()) {
    const size_t comma = std::min(spec.find(',', start), spec.size());
    const std::string item = spec.substr(start, comma - start);
    if (item == "cpu") {
      out.push_back(Device::Cpu());
    } else if (item.rfind("cuda:", 0) == 0 && item.size() > 5 && item.size() <= 9 &&
               std::all_of(item.begin() + 5, item.end(),
                           [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      out.push_back(Device::Cuda(std::stoi(item.substr(5))));
    } else {
      Invalid("devices '" + core::OneLine(spec, 256) + "': '" + core::OneLine(item, 64) +
              "' is not a device (expected gpu, or a list of cpu and cuda:N)");
    }
    start = comma + 1;
  }
  CheckDevices("devices '" + core::OneLine(spec, 256) + "'", out);
  return out;
}

// ---- ReplicaContext ----------------------------------------------------------------------------

void ReplicaContext::AllReduce(ReduceOp op, const std::vector<Tensor>& tensors) {
  strategy_->impl().AllReduce(local_replica_id_, op, tensors);
}

double ReplicaContext::AllReduce(ReduceOp op, double value) {
  strategy_->impl().AllReduce(local_replica_id_, op, {Tensor{&value, 1, DataType::kFloat64}});
  return value;
}

// ---- Strategy ----------------------------------------------------------------------------------

Strategy::Strategy(std::unique_ptr<StrategyImpl> impl) : impl_(std::move(impl)) {
  impl_->Attach(this);
}
Strategy::~Strategy() = default;

const std::string& Strategy::name() const { return impl_->name(); }
int Strategy::NumReplicasInSync() const { return impl_->NumReplicasInSync(); }
int Strategy::num_local_replicas() const { return impl_->num_local_replicas(); }
int Strategy::num_workers() const { return impl_->num_workers(); }
int Strategy::worker_index() const { return impl_->worker_index(); }
bool Strategy::IsChief() const { return impl_->IsChief(); }
const std::vector<Device>& Strategy::devices() const { return impl_->devices(); }
CrossDeviceOps Strategy::cross_device_ops() const { return impl_->cross_device_ops(); }
CollectiveCommunication* Strategy::communication() const { return impl_->communication(); }

void Strategy::RunEach(const std::function<void(ReplicaContext&)>& fn) { impl_->RunEach(fn); }

double Strategy::Reduce(ReduceOp op, const PerReplica<double>& values) {
  return impl_->Reduce(op, values);
}
std::vector<float> Strategy::Reduce(ReduceOp op, const PerReplica<std::vector<float>>& values) {
  return impl_->Reduce(op, values);
}

MirroredVariable& Strategy::CreateVariable(const std::string& name, std::vector<size_t> shape,
                                           const Initializer& init) {
  return impl_->CreateVariable(name, std::move(shape), init);
}
std::vector<MirroredVariable*> Strategy::variables() const { return impl_->variables(); }
MirroredVariable* Strategy::FindVariable(const std::string& name) const {
  return impl_->FindVariable(name);
}

void Strategy::BroadcastFromChief(const std::vector<Tensor>& values) {
  impl_->BroadcastFromChief(values);
}
void Strategy::Barrier() { impl_->Barrier(); }

DefaultStrategy::DefaultStrategy() : Strategy(SingleDevice("default", Device::Cpu())) {}

OneDeviceStrategy::OneDeviceStrategy(Device device)
    : Strategy(SingleDevice("one_device", device)) {}

MirroredStrategy::MirroredStrategy(const MirroredOptions& options)
    : Strategy(Mirrored(options)) {}

CentralStorageStrategy::CentralStorageStrategy(const CentralStorageOptions& options)
    : Strategy(CentralStorage(options)) {}

MultiWorkerMirroredStrategy::MultiWorkerMirroredStrategy(MultiWorkerOptions options)
    : Strategy(MultiWorker(std::move(options))) {}

// ---- Cluster layouts ---------------------------------------------------------------------------

void CheckClusterLayout(const ClusterSpec& spec, std::string_view strategy) {
  auto count = [&](const char* role) -> size_t {
    auto it = spec.cluster.find(role);
    return it == spec.cluster.end() ? 0 : it->second.size();
  };
  const std::string name(strategy);
  const std::string task = "TF_CONFIG field 'task.type' = '" + spec.task_type + "'";
  if (name == "multi_worker_mirrored") {
    if (spec.task_type == "ps") {
      Invalid(task + ": parameter servers run only under ParameterServerStrategy, not " + name);
    }
    if (spec.task_type == "evaluator") {
      Invalid(task + ": the evaluator is not part of the training collective; it runs a "
                     "SidecarEvaluator with a local strategy, not " + name);
    }
    if (count("ps") > 0) {
      Invalid("TF_CONFIG field 'cluster.ps' lists " + std::to_string(count("ps")) +
              " tasks: " + name + " has no parameter servers ('ps' tasks are only for "
              "ParameterServerStrategy)");
    }
    return;
  }
  if (name == "parameter_server") {
    if (spec.cluster.empty()) {
      Invalid("parameter_server needs TF_CONFIG's 'cluster' with a 'chief' (the coordinator), "
              "'worker' and 'ps' tasks; this ClusterSpec lists none");
    }
    if (count("chief") == 0) {
      Invalid("TF_CONFIG field 'cluster.chief' is missing: parameter_server needs a chief, the "
              "coordinator that creates the variables and schedules the steps");
    }
    if (count("worker") == 0) {
      Invalid("TF_CONFIG field 'cluster.worker' is empty or missing: parameter_server needs at "
              "least one worker to run the steps");
    }
    if (count("ps") == 0) {
      Invalid("TF_CONFIG field 'cluster.ps' is empty or missing: parameter_server needs at least "
              "one parameter server to hold the variables");
    }
    return;
  }
  if (name == "default" || name == "one_device" || name == "mirrored" ||
      name == "central_storage") {
    if (spec.task_type == "ps") {
      Invalid(task + ": parameter servers run only under ParameterServerStrategy, not " + name);
    }
    const size_t training = count("chief") + count("worker");
    if (spec.InTrainingCollective() && training > 1) {
      Invalid("TF_CONFIG field 'cluster' lists " + std::to_string(training) +
              " chief and worker tasks: " + name +
              " runs in one process (MultiWorkerMirroredStrategy or ParameterServerStrategy "
              "train over several)");
    }
    return;
  }
  Invalid("CheckClusterLayout: unknown strategy '" + name +
          "' (expected default, one_device, mirrored, central_storage, multi_worker_mirrored or "
          "parameter_server)");
}

// ---- Loss scaling ------------------------------------------------------------------------------

double ComputeAverageLoss(std::span<const float> per_example_losses, size_t global_batch_size,
                          std::span<const float> sample_weights) {
  if (global_batch_size == 0) Invalid("ComputeAverageLoss: global_batch_size must be > 0");
  if (!sample_weights.empty() && sample_weights.size() != per_example_losses.size()) {
    Invalid("ComputeAverageLoss: " + std::to_string(sample_weights.size()) +
            " sample weights for " + std::to_string(per_example_losses.size()) + " losses");
  }
  double sum = 0;
  if (sample_weights.empty()) {
    for (float loss : per_example_losses) sum += loss;
  } else {
    for (size_t i = 0; i < per_example_losses.size(); ++i) {
      sum += static_cast<double>(per_example_losses[i]) * sample_weights[i];
    }
  }
  return sum / static_cast<double>(global_batch_size);
}

}  // namespace collectives::strategy
