// StrategyImpl: running the replicas, the cross-replica all-reduce, Reduce, variables.
//
// ReplicaContext::AllReduce of a list of tensors, on W workers of N local replicas each:
//
//   1. Enter: the N local replicas meet (LocalGroup::Enter), each publishing its list, and check
//      that they agree (the same call, op, counts and dtypes, distinct buffers).
//   2. Local reduction, by the strategy's CrossDeviceOps:
//      - kReductionToOneDevice: replica 0 folds every replica's tensors into its own, in replica
//        order (((t0 op t1) op t2) ...); the others wait.
//      - kHierarchicalCopy: the list is seen as one concatenation of T elements cut into N
//        contiguous slices; replica i folds slice i of every replica, in replica order, into its
//        own buffer (a reduce-scatter through shared memory, all threads busy). Folding in the
//        same order as kReductionToOneDevice makes the two give the same bits.
//   3. With one worker: kAvg is finished (one division by N) by whoever reduced the elements;
//      then every replica copies the elements it did not reduce (kReductionToOneDevice: all of
//      replica 0's; kHierarchicalCopy: every other replica's slice, an all-gather).
//      With several workers: under kHierarchicalCopy every replica first copies its slice into
//      replica 0's buffers; then replica 0 alone all-reduces its buffers with the other workers
//      through the packer (fused into buckets of bytes_per_pack, kSum for kAvg, checked as kAvg
//      against the other workers), divides once by NumReplicasInSync() for kAvg, and every other
//      replica copies replica 0's result.
//   4. A last Step, so that no replica returns (and lets its caller overwrite its buffers) while
//      another still reads them.
// Every element of the result is computed once, on one thread, and copied byte for byte to the
// other replicas; the cross-worker all-reduce gives every worker the same bytes. So every replica
// of every worker ends with the same bits, which keeps mirrored variables identical.
//
// kNccl (GPU replicas): after Enter, every replica works on its own device's memory only: host
// tensors are copied into a device buffer of the replica; with one worker each replica issues
// an ncclAllReduce per tensor on its local communicator (local_nccl_, rank r on devices_[r]);
// with several, an ncclReduce onto replica 0, replica 0's cross-worker step on host copies of
// its tensors (CrossWorkerStaged), a Step, then an ncclBroadcast from replica 0. No replica
// reads another's buffers, so no last Step is needed; NCCL gives every rank the same bits.
//
// UpdateOnce, CentralStorageStrategy's optimizer step, is kReductionToOneDevice without the copy
// back before the update: the replicas enter, replica 0 folds every replica's gradients into its
// own in replica order and runs the update of the central variables while the others wait at a
// Step; then the others copy the sums, and a last Step keeps replica 0's buffers alive until
// they have.
//
// One local replica: no rendezvous; with several workers the tensors go straight through the
// packer (then the kAvg division); with one worker there is nothing to do but kAvg's division
// by 1, which is skipped.
#include "src/strategy/strategy_impl.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string_view>
#include <utility>

#include "collectives/errors.h"
#include "collectives/packing.h"
#include "src/core/fnv1a.h"
#include "src/core/internal_communication.h"
#include "src/core/kernels.h"
#include "src/core/text.h"
#include "src/packing/schedule.h"
#include "src/strategy/device.h"

namespace collectives::strategy {
namespace {

using internal::LocalGroup;
using internal::WhatOf;

// The bytes a Description travels as: every key and every value after its length (4 bytes,
// little-endian), in order.
std::string Encode(const StrategyImpl::Description& description) {
  std::string out;
  const auto put = [&out](const std::string& text) {
    const auto n = static_cast<uint32_t>(text.size());
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xffu));
    out += text;
  };
  for (const auto& [field, value] : description) {
    put(field);
    put(value);
  }
  return out;
}

// The inverse of Encode; nothing when `bytes` is not an encoding.
std::optional<StrategyImpl::Description> Decode(std::string_view bytes) {
  StrategyImpl::Description out;
  const auto take = [&bytes](std::string& text) {
    if (bytes.size() < 4) return false;
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i)
      n |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
    bytes.remove_prefix(4);
    if (bytes.size() < n) return false;
    text.assign(bytes.substr(0, n));
    bytes.remove_prefix(n);
    return true;
  };
  while (!bytes.empty()) {
    std::pair<std::string, std::string> field;
    if (!take(field.first) || !take(field.second)) return std::nullopt;
    out.push_back(std::move(field));
  }
  return out;
}

uint64_t Fingerprint(std::string_view bytes) {
  uint64_t h = core::kFnv1aBasis;
  core::Fnv1a(h, bytes.data(), bytes.size());
  return h;
}

// First element of part `k` of `total` elements cut into `parts` contiguous parts whose sizes
// differ by at most one (the first total % parts parts have one more).
size_t PartBegin(size_t total, int parts, int k) {
  const size_t p = static_cast<size_t>(parts);
  const size_t i = static_cast<size_t>(k);
  return total / p * i + std::min(i, total % p);
}

// Calls fn(j, first, count) for every piece of elements [lo, hi) of the concatenation of
// `tensors`: tensor j's elements [first, first + count).
template <typename Fn>
void ForEachPiece(const std::vector<Tensor>& tensors, size_t lo, size_t hi, Fn&& fn) {
  size_t start = 0;  // index of tensor j's first element in the concatenation
  for (size_t j = 0; j < tensors.size() && start < hi; ++j) {
    const size_t end = start + tensors[j].count;
    const size_t a = std::max(lo, start);
    const size_t b = std::min(hi, end);
    if (a < b) fn(j, a - start, b - a);
    start = end;
  }
}

unsigned char* Bytes(const Tensor& t, size_t first) {
  return static_cast<unsigned char*>(t.data) + first * SizeOf(t.dtype);
}

// dst[0, count) = src[0][.] op src[1][.] op ... in source order, through a small stack block so
// that dst may be one of the sources.
void FoldInOrder(DataType dtype, ReduceOp op, unsigned char* dst,
                 const std::vector<const unsigned char*>& src, size_t count) {
  alignas(64) unsigned char block[4096];
  const size_t elem = SizeOf(dtype);
  const size_t per_block = sizeof(block) / elem;
  for (size_t done = 0; done < count; done += per_block) {
    const size_t n = std::min(per_block, count - done);
    const size_t offset = done * elem;
    std::memcpy(block, src[0] + offset, n * elem);
    for (size_t k = 1; k < src.size(); ++k) core::Reduce(dtype, op, block, block, src[k] + offset, n);
    std::memcpy(dst + offset, block, n * elem);
  }
}

void CopyTensor(const Tensor& dst, const Tensor& src) {
  if (dst.count > 0 && dst.data != src.data) std::memcpy(dst.data, src.data, dst.bytes());
}

// kAvg is a sum divided once by NumReplicasInSync(), here: the replicas and the workers sum. The
// workers' collectives are still checked as kAvg (core::CallOptions::checked_as), so that a
// worker that sums where another averages is a mismatch on every worker.
ReduceOp WireOp(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

// comm.AllReduce(t, t, WireOp(op)) checked as `op`; on a communicator without an internal side
// (a user's wrapper), unchecked.
void AllReduceAcrossWorkers(CollectiveCommunication& comm, const Tensor& t, ReduceOp op) {
  if (core::InternalCommunication* const internal = core::Internal(comm)) {
    internal->AllReduce(t, t, WireOp(op), core::CallOptions{op, {}});
  } else {
    comm.AllReduce(t, t, WireOp(op));
  }
}

}  // namespace

StrategyImpl::StrategyImpl(Config config)
    : name_(std::move(config.name)),
      devices_(std::move(config.devices)),
      cross_device_ops_(config.cross_device_ops),
      timeout_(config.timeout),
      bytes_per_pack_(config.bytes_per_pack),
      worker_index_(config.worker_index),
      num_workers_(config.num_workers),
      who_(config.num_workers > 1 ? "worker " + std::to_string(config.worker_index) + " " : ""),
      placement_(config.placement),
      comm_(std::move(config.comm)),
      seq_(devices_.size(), 0) {
  if (central() && (num_workers_ != 1 || comm_)) {
    throw Error(ErrorCode::kInternal,
                "central variables need a single worker, got " + std::to_string(num_workers_));
  }
  if (devices_.size() > 1) {
    group_ = std::make_unique<LocalGroup>(static_cast<int>(devices_.size()), timeout_, who_);
    group_->SetFailureHook([this](const std::string& reason) { AbortCommunication(reason); });
    if (cross_device_ops_ == CrossDeviceOps::kNccl) {
      local_nccl_ = internal::CreateLocalNccl(devices_, timeout_, who_ + name_);
    }
  }
}

StrategyImpl::~StrategyImpl() = default;

void StrategyImpl::CheckCrossReplica(const char* call) const {
  if (in_run_.load(std::memory_order_relaxed)) {
    throw Error(ErrorCode::kInvalidUsage,
                who_ + call +
                    " is a cross-replica call: call it outside Strategy::Run, not from a "
                    "replica's function");
  }
  if (broken_) std::rethrow_exception(broken_);
}

void StrategyImpl::Break(std::exception_ptr error, const std::string& who_failed) {
  if (!broken_) broken_ = error;
  if (comm_) AbortCommunication(who_failed + WhatOf(error));
}

void StrategyImpl::Refuse(const Error& error) {
  if (comm_) Break(std::make_exception_ptr(error));
  throw error;
}

void StrategyImpl::AbortCommunication(const std::string& reason) {
  // The local replicas' NCCL calls wait on each other too: release them.
  for (const auto& local : local_nccl_) local->Abort();
  if (!comm_) return;
  const Error error(ErrorCode::kAborted,
                    "rank " + std::to_string(comm_->rank()) +
                        ": the strategy aborted the communicator: " + core::OneLine(reason, 1024));
  if (core::InternalCommunication* const internal = core::Internal(*comm_)) {
    internal->Abort(error);
  } else {
    comm_->Abort();
  }
}

void StrategyImpl::RunEach(const std::function<void(ReplicaContext&)>& fn) {
  if (in_run_.load(std::memory_order_relaxed)) {
    throw Error(ErrorCode::kInvalidUsage,
                who_ + "Strategy::Run called from inside Run (a replica's function)");
  }
  if (broken_) std::rethrow_exception(broken_);
  in_run_.store(true, std::memory_order_relaxed);
  struct Reset {
    std::atomic<bool>& flag;
    ~Reset() { flag.store(false, std::memory_order_relaxed); }
  } reset{in_run_};

  const int n = num_local_replicas();
  auto body = [&](int r) {
    ReplicaContext ctx(owner_, r, worker_index_ * n + r, NumReplicasInSync());
    fn(ctx);
  };
  if (!group_) {
    // One local replica: nothing local can be left half done; with several workers the others
    // may wait for this one in a collective, so the communicator is aborted.
    try {
      body(0);
    } catch (...) {
      if (comm_) Break(std::current_exception(), who_ + "replica 0 failed: ");
      throw;
    }
    return;
  }
  try {
    group_->Run(body);
  } catch (...) {
    Break(std::current_exception());
    throw;
  }
}

void StrategyImpl::CheckTensors(int r, const LocalGroup::Call& call,
                                const std::vector<Tensor>& tensors) const {
  const auto where = [&] {
    return who_ + "replica " + std::to_string(r) + ": " + LocalGroup::Describe(call) + ": ";
  };
  if (static_cast<unsigned>(call.op) >= static_cast<unsigned>(kNumReduceOps)) {
    throw Error(ErrorCode::kInvalidArgument,
                where() + "unknown reduce op " + std::to_string(static_cast<int>(call.op)));
  }
  for (size_t j = 0; j < tensors.size(); ++j) {
    const Tensor& t = tensors[j];
    if (static_cast<unsigned>(t.dtype) >= static_cast<unsigned>(kNumDataTypes)) {
      throw Error(ErrorCode::kInvalidArgument, where() + "tensor " + std::to_string(j) +
                                                   " has an unknown dtype " +
                                                   std::to_string(static_cast<int>(t.dtype)));
    }
    if (t.device.kind != Device::Kind::kCpu && t.device != devices_[static_cast<size_t>(r)]) {
      throw Error(ErrorCode::kNotSupported, where() + "tensor " + std::to_string(j) + " is on " +
                                                t.device.ToString() + "; replica " +
                                                std::to_string(r) +
                                                " reduces tensors of the CPU or of its "
                                                "own device, " +
                                                devices_[static_cast<size_t>(r)].ToString());
    }
    if (t.data == nullptr && t.count > 0) {
      throw Error(ErrorCode::kInvalidArgument, where() + "tensor " + std::to_string(j) +
                                                   " has null data and " +
                                                   std::to_string(t.count) + " elements");
    }
  }
}

void StrategyImpl::CrossWorker(ReduceOp op, const std::vector<Tensor>& tensors) {
  if (comm_) packing::internal::AllReduce(*comm_, tensors, WireOp(op), op, bytes_per_pack_);
  const size_t divisor = static_cast<size_t>(NumReplicasInSync());
  if (op == ReduceOp::kAvg && divisor > 1) {
    for (const Tensor& t : tensors) {
      if (t.count > 0) core::DivideInPlace(t.dtype, t.data, t.count, divisor);
    }
  }
}

void StrategyImpl::AllReduce(int r, ReduceOp op, const std::vector<Tensor>& tensors) {
  const LocalGroup::Call call{"all_reduce", ++seq_[r], op};
  CheckTensors(r, call, tensors);
  if (!group_ && cross_device_ops_ != CrossDeviceOps::kNccl) {
    CrossWorker(op, tensors);
    return;
  }
  if (!group_) {
    NcclReduce(r, call, op, tensors);
    return;
  }
  group_->Enter(r, call, tensors);
  try {
    if (cross_device_ops_ == CrossDeviceOps::kNccl) {
      NcclReduce(r, call, op, tensors);
    } else if (cross_device_ops_ == CrossDeviceOps::kReductionToOneDevice) {
      ReduceToOneDevice(r, call, op, tensors);
    } else {
      HierarchicalCopy(r, call, op, tensors);
    }
  } catch (...) {
    // Abort the group before the error leaves this call, even if the caller catches it.
    group_->Fail(r, std::current_exception());
    throw;
  }
}

void StrategyImpl::UpdateOnce(int r, const std::vector<Tensor>& tensors,
                              const std::function<void()>& apply) {
  const LocalGroup::Call call{"apply_gradients", ++seq_[r], ReduceOp::kSum};
  CheckTensors(r, call, tensors);
  if (!group_) {
    apply();
    return;
  }
  group_->Enter(r, call, tensors);
  try {
    const int n = group_->size();
    if (r == 0) {
      std::vector<const unsigned char*> sources(static_cast<size_t>(n));
      for (size_t j = 0; j < tensors.size(); ++j) {
        const Tensor& mine = tensors[j];
        if (mine.count == 0) continue;
        for (int k = 0; k < n; ++k) sources[k] = Bytes(group_->Published(k)[j], 0);
        FoldInOrder(mine.dtype, ReduceOp::kSum, Bytes(mine, 0), sources, mine.count);
      }
      apply();
    }
    group_->Step(r, call, "replica 0 sums the gradients and updates the central variables");
    if (r != 0) {
      const std::vector<Tensor>& root = group_->Published(0);
      for (size_t j = 0; j < tensors.size(); ++j) CopyTensor(tensors[j], root[j]);
    }
    group_->Step(r, call, "the replicas copy the summed gradients");
  } catch (...) {
    group_->Fail(r, std::current_exception());
    throw;
  }
}

void StrategyImpl::CrossWorkerStaged(const Device& device, ReduceOp op,
                                     const std::vector<Tensor>& tensors) {
  std::vector<std::vector<unsigned char>> host(tensors.size());
  std::vector<Tensor> views(tensors.size());
  for (size_t j = 0; j < tensors.size(); ++j) {
    host[j].resize(tensors[j].bytes());
    internal::CopyToHost(device, host[j].data(), tensors[j].data, tensors[j].bytes());
    views[j] = Tensor{host[j].data(), tensors[j].count, tensors[j].dtype};
  }
  CrossWorker(op, views);
  for (size_t j = 0; j < tensors.size(); ++j) {
    internal::CopyToDevice(device, tensors[j].data, host[j].data(), tensors[j].bytes());
  }
}

void StrategyImpl::NcclReduce(int r, const LocalGroup::Call& call, ReduceOp op,
                              const std::vector<Tensor>& tensors) {
  const Device device = devices_[static_cast<size_t>(r)];
  // Host tensors (a scalar of ReplicaContext::AllReduce, host gradients) travel through
  // memory of this replica's device: NCCL reads and writes device memory only.
  std::vector<Tensor> on_device = tensors;
  std::vector<std::shared_ptr<void>> staged;
  for (Tensor& t : on_device) {
    if (t.device.kind != Device::Kind::kCpu || t.count == 0) continue;
    staged.push_back(internal::AllocateOnDevice(device, t.bytes()));
    internal::CopyToDevice(device, staged.back().get(), t.data, t.bytes());
    t = Tensor{staged.back().get(), t.count, t.dtype, device};
  }
  if (!group_) {  // one local replica: nothing to reduce locally
    if (comm_) CrossWorkerStaged(device, op, on_device);
  } else if (!comm_) {
    // One worker: NCCL's kAvg (ncclAvg) divides by the local replicas, NumReplicasInSync().
    for (const Tensor& t : on_device) {
      if (t.count > 0) local_nccl_[static_cast<size_t>(r)]->AllReduce(t, t, op);
    }
  } else {
    CollectiveCommunication& local = *local_nccl_[static_cast<size_t>(r)];
    for (const Tensor& t : on_device) {
      if (t.count > 0) local.Reduce(t, t, WireOp(op), 0);
    }
    if (r == 0) CrossWorkerStaged(device, op, on_device);
    group_->Step(r, call, "replica 0 all-reduces across workers",
                 LocalGroup::StepWait::kForReplicaZerosCollectives);
    for (const Tensor& t : on_device) {
      if (t.count > 0) local.Broadcast(t, t, 0);
    }
  }
  for (size_t j = 0; j < tensors.size(); ++j) {
    if (tensors[j].device.kind == Device::Kind::kCpu && tensors[j].count > 0) {
      internal::CopyToHost(device, tensors[j].data, on_device[j].data, tensors[j].bytes());
    }
  }
}

void StrategyImpl::ReduceToOneDevice(int r, const LocalGroup::Call& call, ReduceOp op,
                                     const std::vector<Tensor>& tensors) {
  const int n = group_->size();
  if (r == 0) {
    const ReduceOp wire = WireOp(op);
    for (size_t j = 0; j < tensors.size(); ++j) {
      const Tensor& mine = tensors[j];
      if (mine.count == 0) continue;
      for (int k = 1; k < n; ++k) {
        core::Reduce(mine.dtype, wire, mine.data, mine.data, group_->Published(k)[j].data,
                     mine.count);
      }
    }
    CrossWorker(op, tensors);
  }
  group_->Step(r, call,
               comm_ ? "replica 0 reduces and all-reduces across workers" : "replica 0 reduces",
               comm_ ? LocalGroup::StepWait::kForReplicaZerosCollectives
                     : LocalGroup::StepWait::kTwiceTheTimeout);
  if (r != 0) {
    const std::vector<Tensor>& root = group_->Published(0);
    for (size_t j = 0; j < tensors.size(); ++j) CopyTensor(tensors[j], root[j]);
  }
  group_->Step(r, call, "the replicas copy replica 0's result");
}

void StrategyImpl::HierarchicalCopy(int r, const LocalGroup::Call& call, ReduceOp op,
                                    const std::vector<Tensor>& tensors) {
  const int n = group_->size();
  size_t total = 0;
  for (const Tensor& t : tensors) total += t.count;
  const size_t divisor = static_cast<size_t>(NumReplicasInSync());
  const bool divide_here = !comm_ && op == ReduceOp::kAvg && divisor > 1;

  // Reduce-scatter: this replica folds its slice of every replica into its own buffers.
  std::vector<const unsigned char*> sources(static_cast<size_t>(n));
  ForEachPiece(tensors, PartBegin(total, n, r), PartBegin(total, n, r + 1),
               [&](size_t j, size_t first, size_t count) {
                 for (int k = 0; k < n; ++k) sources[k] = Bytes(group_->Published(k)[j], first);
                 unsigned char* dst = Bytes(tensors[j], first);
                 FoldInOrder(tensors[j].dtype, WireOp(op), dst, sources, count);
                 if (divide_here) core::DivideInPlace(tensors[j].dtype, dst, count, divisor);
               });
  group_->Step(r, call, "the replicas reduce their slices");

  // Copies a slice of replica `from`'s buffers into replica `to`'s.
  const auto copy_slice = [&](int from, int to, int slice) {
    const std::vector<Tensor>& src = group_->Published(from);
    const std::vector<Tensor>& dst = group_->Published(to);
    ForEachPiece(tensors, PartBegin(total, n, slice), PartBegin(total, n, slice + 1),
                 [&](size_t j, size_t first, size_t count) {
                   std::memcpy(Bytes(dst[j], first), Bytes(src[j], first),
                               count * SizeOf(tensors[j].dtype));
                 });
  };
  if (!comm_) {
    // All-gather: copy every slice this replica did not reduce from its owner.
    for (int k = 0; k < n; ++k) {
      if (k != r) copy_slice(k, r, k);
    }
    group_->Step(r, call, "the replicas copy each other's slices");
    return;
  }
  if (r != 0) copy_slice(r, 0, r);  // gather the local result on replica 0
  group_->Step(r, call, "the replicas gather their slices on replica 0");
  if (r == 0) CrossWorker(op, tensors);
  group_->Step(r, call, "replica 0 all-reduces across workers",
               LocalGroup::StepWait::kForReplicaZerosCollectives);
  if (r != 0) {
    const std::vector<Tensor>& root = group_->Published(0);
    for (size_t j = 0; j < tensors.size(); ++j) CopyTensor(tensors[j], root[j]);
  }
  group_->Step(r, call, "the replicas copy replica 0's result");
}

double StrategyImpl::Reduce(ReduceOp op, const PerReplica<double>& values) {
  CheckCrossReplica("Strategy::Reduce");
  if (values.size() != devices_.size()) {
    Refuse(Error(ErrorCode::kInvalidArgument,
                 who_ + "Strategy::Reduce got " + std::to_string(values.size()) + " values for " +
                     std::to_string(devices_.size()) + " local replicas"));
  }
  if (static_cast<unsigned>(op) >= static_cast<unsigned>(kNumReduceOps)) {
    Refuse(Error(ErrorCode::kInvalidArgument, who_ + "Strategy::Reduce: unknown reduce op"));
  }
  const ReduceOp wire = WireOp(op);
  double acc = values[0];
  for (size_t k = 1; k < values.size(); ++k) {
    core::Reduce(DataType::kFloat64, wire, &acc, &acc, &values[k], 1);
  }
  if (comm_) {
    const Tensor t{&acc, 1, DataType::kFloat64};
    AllReduceAcrossWorkers(*comm_, t, op);
  }
  if (op == ReduceOp::kAvg) acc /= static_cast<double>(NumReplicasInSync());
  return acc;
}

std::vector<float> StrategyImpl::Reduce(ReduceOp op, const PerReplica<std::vector<float>>& values) {
  CheckCrossReplica("Strategy::Reduce");
  if (values.size() != devices_.size()) {
    Refuse(Error(ErrorCode::kInvalidArgument,
                 who_ + "Strategy::Reduce got " + std::to_string(values.size()) + " vectors for " +
                     std::to_string(devices_.size()) + " local replicas"));
  }
  if (static_cast<unsigned>(op) >= static_cast<unsigned>(kNumReduceOps)) {
    Refuse(Error(ErrorCode::kInvalidArgument, who_ + "Strategy::Reduce: unknown reduce op"));
  }
  for (size_t k = 1; k < values.size(); ++k) {
    if (values[k].size() != values[0].size()) {
      Refuse(Error(ErrorCode::kInvalidArgument, who_ + "Strategy::Reduce: replica 0's vector has " +
                                                    std::to_string(values[0].size()) +
                                                    " elements, replica " + std::to_string(k) +
                                                    "'s " + std::to_string(values[k].size())));
    }
  }
  const ReduceOp wire = WireOp(op);
  std::vector<float> acc = values[0];
  const size_t count = acc.size();
  if (count > 0) {
    for (size_t k = 1; k < values.size(); ++k) {
      core::Reduce(DataType::kFloat32, wire, acc.data(), acc.data(), values[k].data(), count);
    }
  }
  // Empty vectors too: a worker that skipped the call would leave the others waiting in theirs;
  // this way a count that differs is a mismatch on every worker.
  const Tensor t{acc.data(), count, DataType::kFloat32};
  if (comm_) AllReduceAcrossWorkers(*comm_, t, op);
  const size_t divisor = static_cast<size_t>(NumReplicasInSync());
  if (op == ReduceOp::kAvg && divisor > 1 && count > 0) {
    core::DivideInPlace(DataType::kFloat32, acc.data(), count, divisor);
  }
  return acc;
}

MirroredVariable& StrategyImpl::CreateVariable(const std::string& name, std::vector<size_t> shape,
                                               const Initializer& init) {
  CheckCrossReplica("Strategy::CreateVariable");
  // First, so that the checks below fail on every worker or on none.
  std::string dims = "[";
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  AgreeAcrossWorkers("CreateVariable('" + core::OneLine(name, 256) + "')",
                     {{"the name", name},
                      {"the shape", dims + "]"},
                      {"whether an initializer is given", init ? "yes" : "no"}});
  if (name.empty()) {
    throw Error(ErrorCode::kInvalidArgument, who_ + "CreateVariable: the name is empty");
  }
  if (by_name_.count(name) != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                who_ + "CreateVariable: a variable named '" + name + "' already exists");
  }
  if (!init) {
    throw Error(ErrorCode::kInvalidArgument,
                who_ + "CreateVariable('" + name + "'): the initializer is empty");
  }
  const bool on_device = devices_[0].kind == Device::Kind::kCuda;
  auto variable = on_device ? std::make_unique<MirroredVariable>(name, std::move(shape), devices_)
                            : std::make_unique<MirroredVariable>(name, std::move(shape),
                                                                 num_local_replicas(), placement_);
  variable->strategy_ = this;
  // Device copies start from a host value, initialised and broadcast here, then copied in.
  std::vector<float> host(on_device ? variable->count() : 0);
  const std::span<float> first = on_device ? std::span<float>(host) : variable->value(0);
  std::exception_ptr failure;
  if (IsChief()) {
    try {
      init(first);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (comm_) {
    // The chief says whether its initializer ran (16 bytes: 0 or the length of why not, then
    // the text), so that the other workers, which would wait for its value in the broadcast
    // below, throw with the reason instead; every worker stops here, the strategy stays usable.
    std::string why;
    if (failure) {
      why = WhatOf(failure);
      why.resize(std::min<size_t>(why.size(), 64 << 10));
    }
    int64_t header[2] = {failure ? 1 : 0, static_cast<int64_t>(why.size())};
    comm_->Broadcast(Tensor{header, 2, DataType::kInt64}, 0);
    if (header[0] != 0) {
      why.resize(static_cast<size_t>(header[1]));
      if (!why.empty()) comm_->Broadcast(Tensor{why.data(), why.size(), DataType::kUInt8}, 0);
      if (failure) std::rethrow_exception(failure);
      throw Error(ErrorCode::kAborted,
                  who_ + "CreateVariable('" + name +
                      "'): the initializer failed on the chief, worker 0: " + why);
    }
  } else if (failure) {
    std::rethrow_exception(failure);
  }
  if (comm_ && variable->count() > 0) {
    comm_->Broadcast(Tensor{first.data(), first.size(), DataType::kFloat32}, 0);
  }
  if (on_device) {
    for (int r = 0; r < variable->num_local_replicas(); ++r) variable->Write(r, host);
  } else {
    const std::span<const float> value = std::as_const(*variable).value(0);
    for (int r = 1; r < variable->num_copies(); ++r) {
      std::copy(value.begin(), value.end(), variable->value(r).begin());
    }
  }
  MirroredVariable& out = *variable;
  variables_.push_back(std::move(variable));
  by_name_.emplace(name, &out);
  return out;
}

std::vector<MirroredVariable*> StrategyImpl::variables() const {
  std::vector<MirroredVariable*> out;
  out.reserve(variables_.size());
  for (const auto& v : variables_) out.push_back(v.get());
  return out;
}

MirroredVariable* StrategyImpl::FindVariable(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

void StrategyImpl::BroadcastFromChief(const std::vector<Tensor>& values) {
  CheckCrossReplica("Strategy::BroadcastFromChief");
  if (comm_) packing::Broadcast(*comm_, values, 0, bytes_per_pack_);
}

void StrategyImpl::Barrier() {
  CheckCrossReplica("Strategy::Barrier");
  if (comm_) comm_->Barrier();
}

void StrategyImpl::AgreeAcrossWorkers(const std::string& what, const Description& mine) {
  if (!comm_) return;
  const size_t workers = static_cast<size_t>(num_workers_);
  const std::string bytes = Encode(mine);
  int64_t own = static_cast<int64_t>(Fingerprint(bytes));
  std::vector<int64_t> prints(workers);
  comm_->AllGather({&own, 1, DataType::kInt64}, {prints.data(), workers, DataType::kInt64});
  const auto differs =
      std::find_if(prints.begin(), prints.end(), [&](int64_t p) { return p != prints[0]; });
  if (differs == prints.end()) return;
  const size_t other = static_cast<size_t>(differs - prints.begin());
  const std::string head = who_ + what + ": the workers disagree";
  const std::string tail =
      " (every worker must make the same cross-replica calls with the same arguments, in the "
      "same order)";

  // Every worker saw the same fingerprints, so every worker is here: fetch the descriptions.
  constexpr int64_t kMaxBytes = int64_t{1} << 20;
  int64_t own_size = static_cast<int64_t>(bytes.size());
  std::vector<int64_t> sizes(workers);
  comm_->AllGather({&own_size, 1, DataType::kInt64}, {sizes.data(), workers, DataType::kInt64});
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  const bool sane =
      std::all_of(sizes.begin(), sizes.end(), [&](int64_t n) { return n >= 0 && n <= kMaxBytes; });
  if (!sane) {  // every worker decides this on the same sizes
    throw Error(ErrorCode::kMismatch, head + " (worker " + std::to_string(other) +
                                          " describes it in a way this one cannot read)" + tail);
  }
  const size_t width = static_cast<size_t>(longest);
  std::string own_padded = bytes;
  own_padded.resize(width, '\0');
  std::string all(workers * width, '\0');
  if (width > 0) {
    comm_->AllGather({own_padded.data(), width, DataType::kUInt8},
                     {all.data(), all.size(), DataType::kUInt8});
  }
  const auto described = [&](size_t w) {
    return Decode(std::string_view(all).substr(w * width, static_cast<size_t>(sizes[w])));
  };
  const std::optional<Description> first = described(0);
  const std::optional<Description> theirs = described(other);
  const auto quote = [](const std::string& text) {
    std::string out(1, '\'');
    out += core::OneLine(text, 256);  // appended, not concatenated: GCC 12's -Wrestrict misfires
    out += '\'';
    return out;
  };
  if (first && theirs) {
    for (size_t i = 0; i < std::max(first->size(), theirs->size()); ++i) {
      if (i < first->size() && i < theirs->size() && (*first)[i] == (*theirs)[i]) continue;
      if (i >= first->size() || i >= theirs->size() || (*first)[i].first != (*theirs)[i].first) {
        break;  // different fields: not the same call, or not the same program
      }
      throw Error(ErrorCode::kMismatch, head + " on " + (*first)[i].first + ": worker 0 has " +
                                            quote((*first)[i].second) + ", worker " +
                                            std::to_string(other) + " has " +
                                            quote((*theirs)[i].second) + tail);
    }
  }
  throw Error(ErrorCode::kMismatch, head + ": worker 0 and worker " + std::to_string(other) +
                                        " describe it with different fields (do they run the "
                                        "same program?)" +
                                        tail);
}

}  // namespace collectives::strategy
