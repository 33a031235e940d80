// RingCommunication: argument checks, the choice of algorithm per call, and the calls themselves
// (the gated ones and those in pieces among them); the order they run in is the CallQueue's.
#include "src/ring/ring_communication.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "src/core/algorithm_names.h"
#include "src/core/arguments.h"
#include "src/core/call.h"
#include "src/core/environment.h"
#include "src/core/internal_communication.h"
#include "src/ring/algorithms.h"
#include "src/ring/call_queue.h"
#include "src/ring/staged.h"

namespace collectives::ring {
namespace {

using core::CallDescriptor;
using core::CollectiveKind;
using StagedCopy = CudaStaging::Copy;
using StagedCopies = std::vector<StagedCopy>;

// Elements [first, first + count) of each block a staged call stages: one segment.
struct Segment {
  size_t first;
  size_t count;
};

class RingCommunication final : public core::InternalCommunication {
 public:
  RingCommunication(std::unique_ptr<transport::Fabric> fabric, std::shared_ptr<Store> store,
                    const CommunicationOptions& options, std::unique_ptr<Planner> planner,
                    SplitBuilder split);
  ~RingCommunication() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Implementation implementation() const override {
    return planner_ ? Implementation::kAuto : Implementation::kRing;
  }
  std::string AllReduceAlgorithm(size_t bytes) const override;

  std::shared_ptr<Work> AllReduceAsync(const Tensor& send, const Tensor& recv,
                                       ReduceOp op) override;
  std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv,
                                       int root) override;
  std::shared_ptr<Work> AllGatherAsync(const Tensor& send, const Tensor& recv) override;
  std::shared_ptr<Work> ReduceScatterAsync(const Tensor& send, const Tensor& recv,
                                           ReduceOp op) override;
  std::shared_ptr<Work> BarrierAsync() override;

  void AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    RunBlocking(PrepareAllReduce(send, recv, op));
  }
  void Broadcast(const Tensor& send, const Tensor& recv, int root) override {
    RunBlocking(PrepareBroadcast(send, recv, root));
  }
  void AllGather(const Tensor& send, const Tensor& recv) override {
    RunBlocking(PrepareAllGather(send, recv));
  }
  void ReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    RunBlocking(PrepareReduceScatter(send, recv, op));
  }
  void Barrier() override { RunBlocking(PrepareBarrier()); }

  std::shared_ptr<Work> ReduceAsync(const Tensor& send, const Tensor& recv, ReduceOp op,
                                    int root) override {
    return Submit(PrepareReduce(send, recv, op, root));
  }
  std::shared_ptr<Work> GatherAsync(const Tensor& send, const Tensor& recv, int root) override {
    return Submit(PrepareGather(send, recv, root));
  }
  std::shared_ptr<Work> ScatterAsync(const Tensor& send, const Tensor& recv, int root) override {
    return Submit(PrepareScatter(send, recv, root));
  }
  std::shared_ptr<Work> AllToAllAsync(const Tensor& send, const Tensor& recv,
                                      const std::vector<size_t>& send_counts,
                                      const std::vector<size_t>& recv_counts) override {
    return Submit(PrepareAllToAll(send, recv, send_counts, recv_counts));
  }
  std::shared_ptr<Work> SendAsync(const Tensor& tensor, int peer, int64_t tag) override {
    return Submit(PreparePointToPoint(true, tensor, peer, tag));
  }
  std::shared_ptr<Work> RecvAsync(const Tensor& tensor, int peer, int64_t tag) override {
    return Submit(PreparePointToPoint(false, tensor, peer, tag));
  }
  void Reduce(const Tensor& send, const Tensor& recv, ReduceOp op, int root) override {
    RunBlocking(PrepareReduce(send, recv, op, root));
  }
  void Gather(const Tensor& send, const Tensor& recv, int root) override {
    RunBlocking(PrepareGather(send, recv, root));
  }
  void Scatter(const Tensor& send, const Tensor& recv, int root) override {
    RunBlocking(PrepareScatter(send, recv, root));
  }
  void AllToAll(const Tensor& send, const Tensor& recv, const std::vector<size_t>& send_counts,
                const std::vector<size_t>& recv_counts) override {
    RunBlocking(PrepareAllToAll(send, recv, send_counts, recv_counts));
  }
  void Send(const Tensor& tensor, int peer, int64_t tag) override {
    RunBlocking(PreparePointToPoint(true, tensor, peer, tag));
  }
  void Recv(const Tensor& tensor, int peer, int64_t tag) override {
    RunBlocking(PreparePointToPoint(false, tensor, peer, tag));
  }

  // core::InternalCommunication (src/core/internal_communication.h).
  bool RunsGatedCalls() const override { return true; }
  std::shared_ptr<Work> AllReduceAsync(const Tensor& send, const Tensor& recv, ReduceOp op,
                                       const core::CallOptions& options) override {
    return Submit(
        Gated(PrepareAllReduce(send, recv, op, options.checked_as.value_or(op)), options.gate));
  }
  void AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op,
                 const core::CallOptions& options) override {
    RunBlocking(
        Gated(PrepareAllReduce(send, recv, op, options.checked_as.value_or(op)), options.gate));
  }
  std::shared_ptr<Work> BroadcastAsync(const Tensor& send, const Tensor& recv, int root,
                                       const core::CallOptions& options) override {
    return Submit(Gated(PrepareBroadcast(send, recv, root), options.gate));
  }
  void Broadcast(const Tensor& send, const Tensor& recv, int root,
                 const core::CallOptions& options) override {
    RunBlocking(Gated(PrepareBroadcast(send, recv, root), options.gate));
  }
  std::shared_ptr<Work> AllReduceAsync(const std::vector<Tensor>& pieces, ReduceOp op,
                                       const core::CallOptions& options) override {
    return Submit(
        PrepareAllReduceInRuns(pieces, op, options.checked_as.value_or(op), options.gate));
  }
  void AllReduce(const std::vector<Tensor>& pieces, ReduceOp op,
                 const core::CallOptions& options) override {
    RunBlocking(
        PrepareAllReduceInRuns(pieces, op, options.checked_as.value_or(op), options.gate));
  }
  std::shared_ptr<Work> BroadcastAsync(const std::vector<Tensor>& pieces, int root,
                                       const core::CallOptions& options) override {
    return Submit(PrepareBroadcastInRuns(pieces, root, options.gate));
  }
  void Broadcast(const std::vector<Tensor>& pieces, int root,
                 const core::CallOptions& options) override {
    RunBlocking(PrepareBroadcastInRuns(pieces, root, options.gate));
  }
  void Abort(const Error& reason) override { Break(reason); }

  std::unique_ptr<CollectiveCommunication> Split(int color, int key) override;
  void Abort() override;
  void SetTimeout(std::chrono::milliseconds timeout) override;

 private:
  using Body = Planner::Body;
  enum class Algorithm { kRecursiveDoubling, kHalvingDoubling, kRing };
  // The ring's all-reduce algorithm for `bytes` (forced by options.algorithm, or by size).
  Algorithm ChooseAllReduce(size_t bytes) const;
  using Prepared = PreparedCall;

  // Argument checks (throwing on the caller's thread) and the choice of algorithm. An all-reduce
  // reduces with `op` and is checked against the other ranks as `checked_as` (the op of its
  // descriptor), which is `op` unless core::CallOptions::checked_as says otherwise.
  Prepared PrepareAllReduce(const Tensor& send, const Tensor& recv, ReduceOp op) const {
    return PrepareAllReduce(send, recv, op, op);
  }
  Prepared PrepareAllReduce(const Tensor& send, const Tensor& recv, ReduceOp op,
                            ReduceOp checked_as) const;
  Prepared PrepareAllReduceInRuns(const std::vector<Tensor>& pieces, ReduceOp op,
                                    ReduceOp checked_as, core::Gate go) const;
  Prepared PrepareBroadcastInRuns(const std::vector<Tensor>& pieces, int root,
                                    core::Gate go) const;
  // The elements of `pieces` (tensors of one known dtype and one device, with data), or Error
  // naming `name`.
  size_t CountOfPieces(const char* name, const std::vector<Tensor>& pieces) const;
  // The staging of the CUDA pieces' device, every piece checked as StagingFor checks a tensor.
  std::shared_ptr<CudaStaging> StagingOfPieces(const char* name,
                                               const std::vector<Tensor>& pieces) const;
  // The ring's own bodies for the calls in pieces (no planner): see PrepareAllReduceInRuns.
  Body AllReduceInRuns(const std::vector<Tensor>& pieces, size_t count, ReduceOp op) const;
  Body BroadcastInRuns(const std::vector<Tensor>& pieces, int root) const;
  Prepared PrepareBroadcast(const Tensor& send, const Tensor& recv, int root) const;
  Prepared PrepareAllGather(const Tensor& send, const Tensor& recv) const;
  Prepared PrepareReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op) const;
  Prepared PrepareBarrier() const;
  Prepared PrepareReduce(const Tensor& send, const Tensor& recv, ReduceOp op, int root) const;
  Prepared PrepareGather(const Tensor& send, const Tensor& recv, int root) const;
  Prepared PrepareScatter(const Tensor& send, const Tensor& recv, int root) const;
  Prepared PrepareAllToAll(const Tensor& send, const Tensor& recv,
                           const std::vector<size_t>& send_counts,
                           const std::vector<size_t>& recv_counts) const;
  // A send (`sending`) or a receive of `tensor` to / from `peer`: no planner, no number of the
  // collective sequence (PreparedCall::collective), messages numbered per peer and direction.
  Prepared PreparePointToPoint(bool sending, const Tensor& tensor, int peer, int64_t tag);
  // Throws Error(kInvalidArgument) unless 0 <= root < size().
  void CheckRoot(const char* collective, int root) const;
  // `prepared`, which runs only if `go()` says so when its turn comes (always without one): the
  // packer's buckets after a list check that found the lists differ are skipped on every rank.
  static Prepared Gated(Prepared prepared, core::Gate go) {
    prepared.go = std::move(go);
    return prepared;
  }
  // The ring's own body for a call the planner (if any) left to it: the planner hears of the
  // call first (Planner::RunningOnRing).
  Prepared OnRing(const CallDescriptor& call, Body body) const;

  // The call queue's, with the communicator's timeout as the call's.
  std::shared_ptr<Work> Submit(Prepared prepared) {
    return queue_.Submit(std::move(prepared), std::chrono::milliseconds(timeout_ms_.load()));
  }
  void RunBlocking(Prepared prepared) {
    queue_.RunBlocking(std::move(prepared), std::chrono::milliseconds(timeout_ms_.load()));
  }
  Error Break(const Error& error, bool* first = nullptr) { return queue_.Break(error, first); }
  // The call queue's Runner: runs one call on this thread, which holds the fabric; returns its
  // failure, if any.
  std::optional<Error> Execute(const core::CallTag& tag, const Body& body,
                               std::chrono::milliseconds timeout);
  // The call queue's Breaker: breaks the planner's waits and the fabric with `first`.
  void BreakTransport(const Error& first);

  // Throws Error(kInvalidArgument / kNotSupported) naming the collective and the fault: a CPU
  // tensor, or a CUDA one (staged.h), with data.
  void CheckTensor(const char* collective, const char* name, const Tensor& t) const;
  // The staging of `t`'s device, opened at its first use (kNotSupported without CUDA), after
  // checking that t's data is memory of that device.
  std::shared_ptr<CudaStaging> StagingFor(const char* collective, const char* name,
                                          const Tensor& t) const;
  // Both of a call's tensors on one device (where both are used: not send off the root of a
  // broadcast or scatter, nor recv off the root of a reduce or gather).
  void CheckOneDevice(const char* collective, const Tensor& send, const Tensor& recv) const;

  // The calls on CUDA tensors: the ring's algorithms on each staged segment. A plan fills the
  // copies of a segment into the slot and out of it; a work runs the ring on the slot.
  using SegmentPlan = std::function<void(const Segment&, StagedCopies* in, StagedCopies* out)>;
  using SegmentWork = std::function<void(Context&, const Segment&, uint8_t* slot)>;
  // Runs the segments of `count` elements per block, `per` at a time, through `staging`.
  static void RunSegments(Context& ctx, CudaStaging& staging, size_t count, size_t per,
                          const SegmentPlan& plan, const SegmentWork& work);
  // The body of a call whose slot holds `blocks` segments of `dtype` elements, of `count`
  // elements per block in all.
  Prepared Staged(const CallDescriptor& call, std::shared_ptr<CudaStaging> staging, size_t count,
                  size_t blocks, DataType dtype, SegmentPlan plan, SegmentWork work) const;
  // All-reduce and broadcast of `count` elements held by `in` and `out`: a tensor each, or a
  // fused bucket's pieces.
  Prepared StagedAllReduce(const CallDescriptor& call, std::shared_ptr<CudaStaging> staging,
                           std::vector<Tensor> in, std::vector<Tensor> out, size_t count,
                           DataType dtype, ReduceOp op) const;
  Prepared StagedBroadcast(const CallDescriptor& call, std::shared_ptr<CudaStaging> staging,
                           std::vector<Tensor> in, std::vector<Tensor> out, size_t count,
                           DataType dtype, int root) const;
  Prepared StagedAllGather(const CallDescriptor& call, const Tensor& send,
                           const Tensor& recv) const;
  Prepared StagedReduceScatter(const CallDescriptor& call, const Tensor& send, const Tensor& recv,
                               ReduceOp op) const;
  Prepared StagedReduce(const CallDescriptor& call, const Tensor& send, const Tensor& recv,
                        ReduceOp op, int root) const;
  Prepared StagedGather(const CallDescriptor& call, const Tensor& send, const Tensor& recv,
                        int root) const;
  Prepared StagedScatter(const CallDescriptor& call, const Tensor& send, const Tensor& recv,
                         int root) const;
  Prepared StagedAllToAll(const CallDescriptor& call, const Tensor& send, const Tensor& recv,
                          std::vector<size_t> sends, std::vector<size_t> recvs) const;
  // `prepared` (a send or a receive) with the body of a CUDA tensor's; `next` numbers messages.
  Prepared StagedPointToPoint(Prepared prepared, bool sending, const Tensor& tensor, int peer,
                              int64_t tag, uint64_t& next);
  void CheckSameType(const char* collective, const Tensor& send, const Tensor& recv) const;
  // whole.count == size() * block.count (all-gather's recv and send, reduce-scatter's send and
  // recv).
  void CheckWholeIsSizeTimesBlock(const char* collective, const char* whole_name,
                                  const Tensor& whole, const char* block_name,
                                  const Tensor& block) const;
  // Both tensors valid, of one dtype.
  void CheckSendRecv(const char* collective, const Tensor& send, const Tensor& recv) const {
    CheckTensor(collective, "send", send);
    CheckTensor(collective, "recv", recv);
    CheckOneDevice(collective, send, recv);
    CheckSameType(collective, send, recv);
  }

  const int rank_;
  const int size_;
  const size_t chunk_bytes_;
  const size_t small_message_bytes_;
  const size_t medium_message_bytes_;
  const std::string algorithm_;  // options.algorithm
  // Milliseconds a call may take; read when a call is issued (SetTimeout changes later calls).
  std::atomic<int64_t> timeout_ms_;
  // How long the thread driving the network polls before it sleeps: plain polls, then polls
  // with a yield between them.
  const std::chrono::microseconds spin_;
  const std::chrono::microseconds yield_;
  std::shared_ptr<Store> store_;
  std::unique_ptr<Planner> planner_;           // may be null
  const SplitBuilder split_;                   // may be empty
  uint64_t splits_ = 0;                        // Split calls so far; guarded by split_mu_
  std::mutex split_mu_;
  // The fabric and the staging area are used by the thread running a call (the call queue keeps
  // it to one at a time) and the fabric by Abort.
  std::unique_ptr<transport::Fabric> fabric_;
  Staging staging_;
  // Point-to-point messages sent to / received from each peer so far: the number of the next
  // one. Used by the thread running a call.
  std::vector<uint64_t> messages_sent_;
  std::vector<uint64_t> messages_received_;
  // The CUDA staging of each device a call has used, by device index; kept for later calls.
  mutable std::mutex cuda_mu_;
  mutable std::map<int, std::shared_ptr<CudaStaging>> cuda_staging_;  // guarded by cuda_mu_

  // Last: its destructor runs the queued calls and joins the progress thread, whose calls use
  // the members above.
  CallQueue queue_;
};

// Polling only pays when every polling thread has a core of its own (core::CoresFor, over the
// ranks on this host, all of them unless the launcher says). A blocking call polls on one thread
// per rank (the caller drives the network itself); an asynchronous one on two (the progress
// thread drives the network while the caller waits), so hand-off polling needs twice the cores:
// with fewer, a spinning waiter steals the core its own progress thread or a peer needs (see
// docs/tuning.md).
std::chrono::microseconds SpinBudget(int spin_us, int world_size, int threads_per_rank) {
  if (spin_us >= 0) return std::chrono::microseconds(spin_us);
  return std::chrono::microseconds(
      core::CoresFor(core::LocalRanks(world_size), threads_per_rank) ? kDefaultSpinUs : 0);
}

// options.yield_us, else $COLLECTIVES_YIELD_US (for tuning a job without rebuilding it), else
// the default.
std::chrono::microseconds YieldBudget(int yield_us) {
  if (yield_us >= 0) return std::chrono::microseconds(yield_us);
  if (const auto env = core::EnvCount("COLLECTIVES_YIELD_US", "microseconds")) {
    return std::chrono::microseconds(std::min<uint64_t>(*env, core::kMaxPollUs));
  }
  return std::chrono::microseconds(kDefaultYieldUs);
}

RingCommunication::RingCommunication(std::unique_ptr<transport::Fabric> fabric,
                                     std::shared_ptr<Store> store,
                                     const CommunicationOptions& options,
                                     std::unique_ptr<Planner> planner, SplitBuilder split)
    : rank_(fabric->rank()),
      size_(fabric->size()),
      chunk_bytes_(options.chunk_bytes ? options.chunk_bytes : kDefaultChunkBytes),
      small_message_bytes_(options.small_message_bytes ? options.small_message_bytes
                                                       : kDefaultSmallMessageBytes),
      medium_message_bytes_(options.medium_message_bytes ? options.medium_message_bytes
                                                         : kDefaultMediumMessageBytes),
      algorithm_(options.algorithm),
      timeout_ms_(options.timeout.count()),
      spin_(SpinBudget(options.spin_us, fabric->size(), 1)),
      yield_(YieldBudget(options.yield_us)),
      store_(std::move(store)),
      planner_(std::move(planner)),
      split_(std::move(split)),
      fabric_(std::move(fabric)),
      messages_sent_(size_t(size_), 0),
      messages_received_(size_t(size_), 0),
      queue_(
          rank_, SpinBudget(options.spin_us, size_, 2), yield_,
          [this](const core::CallTag& tag, const Body& body, std::chrono::milliseconds timeout) {
            return Execute(tag, body, timeout);
          },
          [this](const Error& first) { BreakTransport(first); }) {
  fabric_->SetSpin(spin_, yield_);
}

RingCommunication::~RingCommunication() = default;

std::optional<Error> RingCommunication::Execute(const core::CallTag& tag, const Body& body,
                                                std::chrono::milliseconds timeout) {
  if (const std::optional<Error> broken = queue_.broken()) {
    return Stopped(*broken, tag, "did not run");
  }
  // A failure of the call's own is its error (it names the call); a failure that comes of an
  // earlier one (an Abort, another call's) names this call as one it stopped.
  const auto fail = [this, &tag](const Error& error) {
    bool first = false;
    const Error broken = Break(error, &first);
    return first ? broken : Stopped(broken, tag, "was running");
  };
  try {
    const auto deadline = transport::Clock::now() + timeout;
    fabric_->SetDeadline(deadline);
    fabric_->SetCall(tag);
    Context ctx{*fabric_, tag, chunk_bytes_, staging_, deadline};
    body(ctx);
    // An Abort from another thread that came while the body's last wait was returning left the
    // fabric's shutdown (the abort frames that tell the peers) to the thread driving the fabric,
    // which returned without seeing it, and later calls fail on the queue's first error without
    // touching the fabric. This thread drives it no more, so the fabric's Abort shuts it down.
    if (const std::optional<Error> aborted = queue_.broken()) fabric_->Abort(*aborted);
    return std::nullopt;
  } catch (const Error& e) {
    return fail(e);
  } catch (const std::bad_alloc&) {  // staging or scratch: the machine's limit, not a bug
    return fail(Error(ErrorCode::kSystem,
                      "rank " + std::to_string(rank_) + ": " + tag.ToString() + ": out of memory"));
  } catch (const std::exception& e) {
    return fail(Error(ErrorCode::kInternal,
                      "rank " + std::to_string(rank_) + ": " + tag.ToString() + ": " + e.what()));
  }
}

void RingCommunication::BreakTransport(const Error& first) {
  // The planner first: its waits end at once, and a thread driving a call may be in one. The
  // fabric's Abort then waits for the thread driving it to tell the peers.
  if (planner_) planner_->Abort(first);
  fabric_->Abort(first);
}

void RingCommunication::SetTimeout(std::chrono::milliseconds timeout) {
  timeout_ms_.store(
      core::CheckTimeout("rank " + std::to_string(rank_) + ": SetTimeout", timeout).count());
}

std::unique_ptr<CollectiveCommunication> RingCommunication::Split(int color, int key) {
  if (!split_) {
    throw Error(ErrorCode::kNotSupported,
                "rank " + std::to_string(rank_) +
                    ": split: this communicator was built without a rendezvous store");
  }
  // Every rank learns every (color, key) through this communicator: the split is itself a
  // collective, checked like any other, and of a kind of its own: a peer's all-gather of two
  // int64 is a mismatch, not a peer that takes this rank's color and key for its data.
  std::lock_guard<std::mutex> lock(split_mu_);
  int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * size_t(size_));
  Prepared exchange = PrepareAllGather(Tensor{mine, 2, DataType::kInt64},
                                       Tensor{all.data(), all.size(), DataType::kInt64});
  exchange.descriptor.kind = CollectiveKind::kSplit;
  RunBlocking(std::move(exchange));
  const uint64_t split = ++splits_;
  if (color < 0) return nullptr;
  std::vector<std::pair<int64_t, int>> members;  // (key, rank) of every rank of this color
  for (int r = 0; r < size_; ++r) {
    if (all[2 * size_t(r)] == color) members.emplace_back(all[2 * size_t(r) + 1], r);
  }
  std::sort(members.begin(), members.end());
  const auto me = std::find(members.begin(), members.end(), std::make_pair(int64_t(key), rank_));
  // The child's set-up polls for an Abort of this communicator and gives up (kAborted) within
  // transport::kCancelPoll: a set-up waits for every member, and one that never comes would
  // otherwise hold the split, and the Abort meant to end it, for the whole timeout.
  std::unique_ptr<CollectiveCommunication> child;
  try {
    child = split_(int(me - members.begin()), int(members.size()),
                   "/split" + std::to_string(split) + "/" + std::to_string(color),
                   std::chrono::milliseconds(timeout_ms_.load()),
                   [this] { return queue_.broken().has_value(); });
  } catch (const Error&) {
    // The Abort's own error, not the set-up's "abandoned".
    if (const std::optional<Error> broken = queue_.broken()) throw *broken;
    throw;
  }
  // An Abort while the child was being connected: the split fails as every call does from then
  // on, rather than hand out a working child of an aborted communicator.
  if (const std::optional<Error> broken = queue_.broken()) throw *broken;
  return child;
}

void RingCommunication::Abort() {
  Break(Error(ErrorCode::kAborted,
              "rank " + std::to_string(rank_) + ": the communicator was aborted by its caller"));
}

void RingCommunication::CheckTensor(const char* collective, const char* name,
                                    const Tensor& t) const {
  if (t.device.kind != Device::Kind::kCpu && t.device.kind != Device::Kind::kCuda) {
    throw Error(ErrorCode::kNotSupported, core::TensorPrefix(rank_, collective, name) + "is on " +
                                              t.device.ToString() +
                                              "; RING takes CPU and CUDA tensors only");
  }
  core::CheckTensorData(rank_, collective, name, t);
}

void RingCommunication::CheckOneDevice(const char* collective, const Tensor& send,
                                       const Tensor& recv) const {
  if (!(send.device == recv.device)) {
    throw Error(ErrorCode::kInvalidArgument,
                core::ArgumentPrefix(rank_, collective) + "send is on " + send.device.ToString() +
                    " and recv on " + recv.device.ToString() + "; both must be on one device");
  }
}

std::shared_ptr<CudaStaging> RingCommunication::StagingFor(const char* collective,
                                                           const char* name,
                                                           const Tensor& t) const {
  std::shared_ptr<CudaStaging> staging;
  {
    std::lock_guard<std::mutex> lock(cuda_mu_);
    std::shared_ptr<CudaStaging>& slot = cuda_staging_[t.device.index];
    if (!slot) {
      try {
        slot = CudaStaging::Open(t.device.index, CudaStagingBytes());
      } catch (const Error& e) {
        cuda_staging_.erase(t.device.index);
        throw Error(e.code(), core::TensorPrefix(rank_, collective, name) + "is on " +
                                  t.device.ToString() + ": " + e.message());
      }
    }
    staging = slot;
  }
  staging->CheckDeviceMemory(core::TensorPrefix(rank_, collective, name), t);
  return staging;
}

std::shared_ptr<CudaStaging> RingCommunication::StagingOfPieces(
    const char* name, const std::vector<Tensor>& pieces) const {
  std::shared_ptr<CudaStaging> staging;
  for (const Tensor& piece : pieces) {
    std::shared_ptr<CudaStaging> mine = StagingFor(name, "piece", piece);
    if (!staging) staging = std::move(mine);
  }
  return staging;
}

namespace {

// Elements of one staged segment when a slot of `slot_bytes` holds `blocks` blocks of them.
size_t SegmentCount(size_t slot_bytes, size_t blocks, DataType dtype) {
  return std::max<size_t>(1, slot_bytes / (blocks * SizeOf(dtype)));
}

// Segments of `count` elements, `per` at a time (one, empty, when count is 0).
size_t Segments(size_t count, size_t per) { return count == 0 ? 1 : (count + per - 1) / per; }

std::string What(const Context& ctx) {
  return "rank " + std::to_string(ctx.rank()) + ": " + ctx.tag.ToString();
}

// The copies between bytes [offset, offset + bytes) of `runs` (a tensor, or a fused bucket's
// pieces, back to back) and the slot from `host_offset` on.
void CopiesOf(const std::vector<Tensor>& runs, size_t offset, size_t bytes, size_t host_offset,
              StagedCopies* copies) {
  size_t at = 0;  // where the current run starts
  for (const Tensor& run : runs) {
    const size_t length = run.bytes();
    if (bytes == 0) return;
    if (offset < at + length) {
      const size_t skip = offset - at, take = std::min(bytes, length - skip);
      copies->push_back({host_offset, static_cast<uint8_t*>(run.data) + skip, take});
      host_offset += take;
      offset += take;
      bytes -= take;
    }
    at += length;
  }
}

// The byte range [first, first + count) elements of `block` of `block_count` elements of `t`.
StagedCopy BlockCopy(const Tensor& t, size_t block, size_t block_count, size_t first, size_t count,
                     size_t host_offset) {
  const size_t e = SizeOf(t.dtype);
  return {host_offset, static_cast<uint8_t*>(t.data) + (block * block_count + first) * e,
          count * e};
}

}  // namespace

// The one loop of every staged call: segment k is elements [k * per, k * per + count) of each
// block the call stages; CudaStaging::Run brings segment k+1 in while `work` runs on k.
void RingCommunication::RunSegments(Context& ctx, CudaStaging& staging, size_t count, size_t per,
                                    const SegmentPlan& plan, const SegmentWork& work) {
  const auto segment = [count, per](size_t k) {
    return Segment{k * per, std::min(per, count - k * per)};
  };
  staging.Run(
      Segments(count, per),
      [&](size_t k, StagedCopies* in, StagedCopies* out) { plan(segment(k), in, out); },
      [&](size_t k, uint8_t* slot) { work(ctx, segment(k), slot); }, ctx.deadline, What(ctx));
}

RingCommunication::Prepared RingCommunication::Staged(const CallDescriptor& call,
                                                      std::shared_ptr<CudaStaging> staging,
                                                      size_t count, size_t blocks, DataType dtype,
                                                      SegmentPlan plan, SegmentWork work) const {
  const size_t per = SegmentCount(staging->slot_bytes(), blocks, dtype);
  return OnRing(call, [=](Context& ctx) { RunSegments(ctx, *staging, count, per, plan, work); });
}

RingCommunication::Prepared RingCommunication::StagedAllReduce(
    const CallDescriptor& call, std::shared_ptr<CudaStaging> staging, std::vector<Tensor> in,
    std::vector<Tensor> out, size_t count, DataType dtype, ReduceOp op) const {
  const size_t e = SizeOf(dtype);
  return Staged(
      call, std::move(staging), count, 1, dtype,
      [=](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
        CopiesOf(in, s.first * e, s.count * e, 0, copy_in);
        CopiesOf(out, s.first * e, s.count * e, 0, copy_out);
      },
      [this, dtype, op, e](Context& ctx, const Segment& s, uint8_t* slot) {
        switch (ChooseAllReduce(s.count * e)) {
          case Algorithm::kRecursiveDoubling:
            return RecursiveDoublingAllReduce(ctx, slot, slot, s.count, dtype, op);
          case Algorithm::kHalvingDoubling:
            return HalvingDoublingAllReduce(ctx, slot, slot, s.count, dtype, op);
          case Algorithm::kRing:
            return RingAllReduce(ctx, slot, slot, s.count, dtype, op);
        }
      });
}

RingCommunication::Prepared RingCommunication::StagedBroadcast(
    const CallDescriptor& call, std::shared_ptr<CudaStaging> staging, std::vector<Tensor> in,
    std::vector<Tensor> out, size_t count, DataType dtype, int root) const {
  const size_t e = SizeOf(dtype);
  const bool is_root = rank_ == root;
  const size_t small = small_message_bytes_;
  return Staged(
      call, std::move(staging), count, 1, dtype,
      [=](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
        if (is_root) CopiesOf(in, s.first * e, s.count * e, 0, copy_in);
        CopiesOf(out, s.first * e, s.count * e, 0, copy_out);
      },
      [=](Context& ctx, const Segment& s, uint8_t* slot) {
        const size_t bytes = s.count * e;
        if (bytes <= small) return SmallBroadcast(ctx, is_root ? slot : nullptr, slot, bytes, root);
        CallAgreement agreement(
            ctx, is_root ? CallAgreement::Pair::kDataOut : CallAgreement::Pair::kDataIn);
        ChainBroadcast(ctx, is_root ? slot : nullptr, slot, bytes, root, &agreement);
        agreement.Wait();
      });
}

// A slot holds the segment of this rank's block and that segment of every rank's.
RingCommunication::Prepared RingCommunication::StagedAllGather(const CallDescriptor& call,
                                                               const Tensor& send,
                                                               const Tensor& recv) const {
  std::shared_ptr<CudaStaging> staging = StagingFor("all_gather", "send", send);
  StagingFor("all_gather", "recv", recv);
  const size_t n = size_t(size_), e = SizeOf(send.dtype), count = send.count;
  const DataType dtype = send.dtype;
  const size_t small = small_message_bytes_;
  return Staged(
      call, std::move(staging), count, n + 1, dtype,
      [=](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
        const size_t bytes = s.count * e;
        copy_in->push_back(BlockCopy(send, 0, count, s.first, s.count, 0));
        for (size_t r = 0; r < n; ++r) {
          copy_out->push_back(BlockCopy(recv, r, count, s.first, s.count, bytes + r * bytes));
        }
      },
      [=](Context& ctx, const Segment& s, uint8_t* slot) {
        const size_t bytes = s.count * e;
        if (n * bytes <= small) return SmallAllGather(ctx, slot, slot + bytes, bytes);
        CallAgreement agreement(ctx, CallAgreement::Pair::kDataBothWays);
        RingAllGather(ctx, slot, slot + bytes, s.count, dtype, &agreement);
        agreement.Wait();
      });
}

// A slot holds the segment of every rank's block of send and that segment of recv.
RingCommunication::Prepared RingCommunication::StagedReduceScatter(const CallDescriptor& call,
                                                                   const Tensor& send,
                                                                   const Tensor& recv,
                                                                   ReduceOp op) const {
  std::shared_ptr<CudaStaging> staging = StagingFor("reduce_scatter", "send", send);
  StagingFor("reduce_scatter", "recv", recv);
  const size_t n = size_t(size_), e = SizeOf(recv.dtype), count = recv.count;
  const DataType dtype = recv.dtype;
  const size_t small = small_message_bytes_;
  return Staged(
      call, std::move(staging), count, n + 1, dtype,
      [=](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
        const size_t bytes = s.count * e;
        for (size_t r = 0; r < n; ++r) {
          copy_in->push_back(BlockCopy(send, r, count, s.first, s.count, r * bytes));
        }
        copy_out->push_back(BlockCopy(recv, 0, count, s.first, s.count, n * bytes));
      },
      [=](Context& ctx, const Segment& s, uint8_t* slot) {
        const size_t bytes = s.count * e;
        if (n * bytes <= small) {
          return SmallReduceScatter(ctx, slot, slot + n * bytes, s.count, dtype, op);
        }
        RingReduceScatter(ctx, slot, slot + n * bytes, s.count, dtype, op);
      });
}

// A slot holds the segment of send, reduced in place; the root copies it out.
RingCommunication::Prepared RingCommunication::StagedReduce(const CallDescriptor& call,
                                                            const Tensor& send, const Tensor& recv,
                                                            ReduceOp op, int root) const {
  const bool is_root = rank_ == root;
  std::shared_ptr<CudaStaging> staging = StagingFor("reduce", "send", send);
  if (is_root) StagingFor("reduce", "recv", recv);
  const size_t e = SizeOf(send.dtype), count = send.count;
  const DataType dtype = send.dtype;
  const size_t small = small_message_bytes_;
  return Staged(
      call, std::move(staging), count, 1, dtype,
      [=](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
        copy_in->push_back(BlockCopy(send, 0, count, s.first, s.count, 0));
        if (is_root) copy_out->push_back(BlockCopy(recv, 0, count, s.first, s.count, 0));
      },
      [=](Context& ctx, const Segment& s, uint8_t* slot) {
        uint8_t* const out = is_root ? slot : nullptr;
        if (s.count * e <= small) return SmallReduce(ctx, slot, out, s.count, dtype, op, root);
        CallAgreement agreement(ctx);
        ChainReduce(ctx, slot, out, s.count, dtype, op, root, agreement);
      });
}

// A slot holds the segment of this rank's block and, on the root, that segment of every rank's
// (every rank cuts the same segments, so every rank's slot has room for them).
RingCommunication::Prepared RingCommunication::StagedGather(const CallDescriptor& call,
                                                            const Tensor& send, const Tensor& recv,
                                                            int root) const {
  const bool is_root = rank_ == root;
  std::shared_ptr<CudaStaging> staging = StagingFor("gather", "send", send);
  if (is_root) StagingFor("gather", "recv", recv);
  const size_t n = size_t(size_), e = SizeOf(send.dtype), count = send.count;
  const size_t small = small_message_bytes_;
  return Staged(
      call, std::move(staging), count, n + 1, send.dtype,
      [=](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
        const size_t bytes = s.count * e;
        copy_in->push_back(BlockCopy(send, 0, count, s.first, s.count, 0));
        for (size_t r = 0; is_root && r < n; ++r) {
          copy_out->push_back(BlockCopy(recv, r, count, s.first, s.count, bytes + r * bytes));
        }
      },
      [=](Context& ctx, const Segment& s, uint8_t* slot) {
        const size_t bytes = s.count * e;
        uint8_t* const out = is_root ? slot + bytes : nullptr;
        if (n * bytes <= small) return SmallGather(ctx, slot, out, bytes, root);
        CallAgreement agreement(ctx);
        DirectGather(ctx, slot, out, bytes, root, agreement);
      });
}

// A slot holds, on the root, the segment of every rank's block of send, and this rank's segment.
RingCommunication::Prepared RingCommunication::StagedScatter(const CallDescriptor& call,
                                                             const Tensor& send, const Tensor& recv,
                                                             int root) const {
  const bool is_root = rank_ == root;
  std::shared_ptr<CudaStaging> staging = StagingFor("scatter", "recv", recv);
  if (is_root) StagingFor("scatter", "send", send);
  const size_t n = size_t(size_), e = SizeOf(recv.dtype), count = recv.count;
  const size_t small = small_message_bytes_;
  return Staged(
      call, std::move(staging), count, n + 1, recv.dtype,
      [=](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
        const size_t bytes = s.count * e;
        for (size_t r = 0; is_root && r < n; ++r) {
          copy_in->push_back(BlockCopy(send, r, count, s.first, s.count, r * bytes));
        }
        copy_out->push_back(BlockCopy(recv, 0, count, s.first, s.count, n * bytes));
      },
      [=](Context& ctx, const Segment& s, uint8_t* slot) {
        const size_t bytes = s.count * e;
        const uint8_t* const in = is_root ? slot : nullptr;
        if (n * bytes <= small) return SmallScatter(ctx, in, slot + n * bytes, bytes, root);
        CallAgreement agreement(ctx);
        DirectScatter(ctx, in, slot + n * bytes, bytes, root, agreement);
      });
}

// Segment k is elements [k * per, k * per + per) of every block (those a block has), so a block
// of c elements takes part in the first ceil(c / per) segments. A slot holds a segment of every
// block of send and of recv (2 x size blocks). The number of segments follows from the largest
// block of any rank, which the ranks learn first (a max all-reduce of one element); then every
// segment is one pairwise all-to-all, whose own check of the counts holds for the segment's.
RingCommunication::Prepared RingCommunication::StagedAllToAll(const CallDescriptor& call,
                                                              const Tensor& send,
                                                              const Tensor& recv,
                                                              std::vector<size_t> sends,
                                                              std::vector<size_t> recvs) const {
  std::shared_ptr<CudaStaging> staging = StagingFor("all_to_all", "send", send);
  StagingFor("all_to_all", "recv", recv);
  const size_t n = size_t(size_), e = SizeOf(send.dtype);
  const DataType dtype = send.dtype;
  const size_t per = SegmentCount(staging->slot_bytes(), 2 * n, dtype);
  std::vector<size_t> send_at(n, 0), recv_at(n, 0);
  int64_t largest = 0;
  for (size_t j = 0; j < n; ++j) {
    if (j > 0) send_at[j] = send_at[j - 1] + sends[j - 1];
    if (j > 0) recv_at[j] = recv_at[j - 1] + recvs[j - 1];
    largest = std::max<int64_t>({largest, int64_t(sends[j]), int64_t(recvs[j])});
  }
  // The part of a block of `c` elements in the segment from `first`.
  const auto part = [per](size_t c, size_t first) {
    return c > first ? std::min(per, c - first) : 0;
  };
  return OnRing(call, [=](Context& ctx) {
    int64_t count = largest;
    RecursiveDoublingAllReduce(ctx, &count, &count, 1, DataType::kInt64, ReduceOp::kMax);
    RunSegments(
        ctx, *staging, size_t(count), per,
        [&](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
          for (size_t j = 0, in_at = 0, out_at = n * per * e; j < n; ++j) {
            const size_t to = part(sends[j], s.first), from = part(recvs[j], s.first);
            copy_in->push_back(
                {in_at, static_cast<uint8_t*>(send.data) + (send_at[j] + s.first) * e, to * e});
            copy_out->push_back(
                {out_at, static_cast<uint8_t*>(recv.data) + (recv_at[j] + s.first) * e, from * e});
            in_at += to * e;
            out_at += from * e;
          }
        },
        [&](Context&, const Segment& s, uint8_t* slot) {
          std::vector<size_t> to(n), from(n);
          for (size_t j = 0; j < n; ++j) {
            to[j] = part(sends[j], s.first);
            from[j] = part(recvs[j], s.first);
          }
          PairwiseAllToAll(ctx, slot, slot + n * per * e, dtype, to, from);
        });
  });
}

// A message goes in runs of whole frames (SendMessageFrames): a slot holds as many of the
// message's frames as fit, so the peer, staged or not, sees the frames of one message.
RingCommunication::Prepared RingCommunication::StagedPointToPoint(Prepared prepared, bool sending,
                                                                  const Tensor& tensor, int peer,
                                                                  int64_t tag, uint64_t& next) {
  const char* const name = sending ? "send" : "recv";
  std::shared_ptr<CudaStaging> staging = StagingFor(name, "message", tensor);
  const size_t bytes = tensor.bytes();
  const size_t frames = MessageFrames(chunk_bytes_, bytes);
  const size_t frame_bytes = MessageFrameOffset(chunk_bytes_, bytes, 1);
  if (frame_bytes > staging->slot_bytes()) {
    throw Error(ErrorCode::kNotSupported,
                core::TensorPrefix(rank_, name, "message") + "is on " + tensor.device.ToString() +
                    ": its frames of " + std::to_string(frame_bytes) +
                    " bytes (CommunicationOptions::chunk_bytes) do not fit the staging slot of " +
                    std::to_string(staging->slot_bytes()) +
                    " bytes (COLLECTIVES_CUDA_STAGING_BYTES)");
  }
  const size_t per = std::max<size_t>(1, staging->slot_bytes() / std::max<size_t>(1, frame_bytes));
  auto* const data = static_cast<uint8_t*>(tensor.data);
  const size_t chunk = chunk_bytes_;
  prepared.body = [=, &next](Context& ctx) {
    const uint64_t number = next++;
    RunSegments(
        ctx, *staging, frames, per,
        [&](const Segment& s, StagedCopies* copy_in, StagedCopies* copy_out) {
          const size_t begin = MessageFrameOffset(chunk, bytes, s.first);
          const size_t end = MessageFrameOffset(chunk, bytes, s.first + s.count);
          (sending ? copy_in : copy_out)->push_back({0, data + begin, end - begin});
        },
        [&](Context&, const Segment& s, uint8_t* slot) {
          if (sending) {
            SendMessageFrames(ctx, peer, number, slot, tensor.count, tensor.dtype, tag, s.first,
                              s.first + s.count);
          } else {
            RecvMessageFrames(ctx, peer, number, slot, tensor.count, tensor.dtype, tag, s.first,
                              s.first + s.count);
          }
        });
  };
  return prepared;
}

void RingCommunication::CheckSameType(const char* collective, const Tensor& send,
                                      const Tensor& recv) const {
  core::CheckSameDtype(core::ArgumentPrefix(rank_, collective), send, recv);
}

void CheckOp(int rank, const char* collective, ReduceOp op) {
  core::CheckReduceOp(core::ArgumentPrefix(rank, collective), op);
}

std::string CountMismatch(int rank, const char* collective, const std::string& expected,
                          size_t got) {
  return core::ArgumentPrefix(rank, collective) + expected + ", got " + std::to_string(got) +
         " elements";
}

void RingCommunication::CheckWholeIsSizeTimesBlock(const char* collective,
                                                   const char* whole_name, const Tensor& whole,
                                                   const char* block_name,
                                                   const Tensor& block) const {
  if (block.count > SIZE_MAX / size_t(size_) || whole.count != block.count * size_t(size_)) {
    throw Error(ErrorCode::kInvalidArgument,
                CountMismatch(rank_, collective,
                              std::string(whole_name) + " must have size x " + block_name +
                                  " = " + std::to_string(size_) + " x " +
                                  std::to_string(block.count) + " elements",
                              whole.count));
  }
}

RingCommunication::Prepared RingCommunication::PrepareAllReduce(const Tensor& send,
                                                                const Tensor& recv, ReduceOp op,
                                                                ReduceOp checked_as) const {
  constexpr const char* kName = "all_reduce";
  CheckSendRecv(kName, send, recv);
  CheckOp(rank_, kName, op);
  CheckOp(rank_, kName, checked_as);
  if (send.count != recv.count) {
    throw Error(ErrorCode::kInvalidArgument,
                CountMismatch(rank_, kName, "recv must have send's " +
                                                std::to_string(send.count) + " elements",
                              recv.count));
  }
  core::CheckBuffersApart(rank_, kName, send, recv, reinterpret_cast<uintptr_t>(recv.data),
                          "recv.data");
  const CallDescriptor call{CollectiveKind::kAllReduce, send.dtype, checked_as, 0, send.count};
  if (send.device.kind == Device::Kind::kCuda) {
    std::shared_ptr<CudaStaging> staging = StagingFor(kName, "send", send);
    StagingFor(kName, "recv", recv);
    Prepared staged =
        StagedAllReduce(call, std::move(staging), {send}, {recv}, send.count, send.dtype, op);
    if (planner_) staged.body = planner_->DeviceAllReduce(send, recv, op, std::move(staged.body));
    return staged;
  }
  if (planner_) {
    if (Body body = planner_->AllReduce(send, recv, op)) return Prepared{call, std::move(body)};
  }
  const Algorithm algorithm = ChooseAllReduce(send.bytes());
  return OnRing(call, [send, recv, op, algorithm](Context& ctx) {
    switch (algorithm) {
      case Algorithm::kRecursiveDoubling:
        return RecursiveDoublingAllReduce(ctx, send.data, recv.data, send.count, send.dtype, op);
      case Algorithm::kHalvingDoubling:
        return HalvingDoublingAllReduce(ctx, send.data, recv.data, send.count, send.dtype, op);
      case Algorithm::kRing:
        return RingAllReduce(ctx, send.data, recv.data, send.count, send.dtype, op);
    }
  });
}

size_t RingCommunication::CountOfPieces(const char* name, const std::vector<Tensor>& pieces) const {
  if (pieces.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) + ": " + name +
                                                 ": no pieces (the message needs a dtype)");
  }
  // The caller (the packer) has checked that the pieces lie apart and their byte counts fit.
  if (static_cast<unsigned>(pieces.front().dtype) >= kNumDataTypes) {
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) + ": " + name +
                                                 ": unknown dtype " +
                                                 std::to_string(int(pieces.front().dtype)));
  }
  const Device device = pieces.front().device;
  if (device.kind != Device::Kind::kCpu && device.kind != Device::Kind::kCuda) {
    throw Error(ErrorCode::kNotSupported, "rank " + std::to_string(rank_) + ": " + name +
                                              ": the pieces are on " + device.ToString() +
                                              "; RING takes CPU and CUDA tensors only");
  }
  size_t count = 0;
  for (const Tensor& piece : pieces) {
    if (piece.dtype != pieces.front().dtype || !(piece.device == device) ||
        (piece.data == nullptr && piece.count > 0)) {
      throw Error(ErrorCode::kInvalidArgument,
                  "rank " + std::to_string(rank_) + ": " + name +
                      ": every piece must be a tensor with data, of the first one's dtype (" +
                      ToString(pieces.front().dtype) + ") and device (" + device.ToString() + ")");
    }
    count += piece.count;
  }
  return count;
}

RingCommunication::Prepared RingCommunication::PrepareAllReduceInRuns(
    const std::vector<Tensor>& pieces, ReduceOp op, ReduceOp checked_as, core::Gate go) const {
  constexpr const char* kName = "all_reduce in pieces";
  CheckOp(rank_, kName, op);
  CheckOp(rank_, kName, checked_as);
  const size_t count = CountOfPieces(kName, pieces);
  const CallDescriptor call{CollectiveKind::kAllReduce, pieces.front().dtype, checked_as, 0, count};
  if (pieces.front().device.kind == Device::Kind::kCuda) {
    return Gated(StagedAllReduce(call, StagingOfPieces(kName, pieces), pieces, pieces, count,
                                 pieces.front().dtype, op),
                 std::move(go));
  }
  Body body = planner_ ? planner_->AllReduceInRuns(pieces, op) : Body{};
  return Gated(
      body ? Prepared{call, std::move(body)} : OnRing(call, AllReduceInRuns(pieces, count, op)),
      std::move(go));
}

// Over the fabric alone, the ring's all-reduce algorithms run in place on the pieces as one
// message in runs: halving-doubling and the ring send every frame straight from the pieces
// and receive it straight into them (core::Runs), the frames and bits of the packed bucket
// without the copies into a fusion buffer and out. Recursive doubling, for the latency-bound
// sizes, goes through a buffer of staging (gathered, reduced there, scattered back).
Planner::Body RingCommunication::AllReduceInRuns(const std::vector<Tensor>& pieces, size_t count,
                                                 ReduceOp op) const {
  auto runs = std::make_shared<const core::Runs>(core::RunsOf(pieces));
  const DataType dtype = pieces.front().dtype;
  const Algorithm algorithm = ChooseAllReduce(runs->bytes());
  return [runs, count, dtype, op, algorithm](Context& ctx) {
    switch (algorithm) {
      case Algorithm::kHalvingDoubling:
        return HalvingDoublingAllReduce(ctx, *runs, count, dtype, op);
      case Algorithm::kRing:
        return RingAllReduce(ctx, *runs, count, dtype, op);
      case Algorithm::kRecursiveDoubling: {
        const size_t bytes = runs->bytes();
        uint8_t* const buffer = ctx.staging.Get(3 * bytes);
        runs->Read(0, bytes, buffer);
        RecursiveDoublingAllReduce(ctx, buffer, buffer, count, dtype, op, buffer + bytes);
        runs->Write(0, buffer, bytes);
        return;
      }
    }
  };
}

// The broadcast likewise: the chain from and into the pieces; a small message through a buffer.
Planner::Body RingCommunication::BroadcastInRuns(const std::vector<Tensor>& pieces,
                                                 int root) const {
  auto runs = std::make_shared<const core::Runs>(core::RunsOf(pieces));
  const bool small = runs->bytes() <= small_message_bytes_;
  return [runs, root, small](Context& ctx) {
    const bool is_root = ctx.rank() == root;
    if (small) {
      // The message behind the 3 x bytes of staging SmallBroadcast uses: Get does not move
      // a buffer that is large enough.
      const size_t bytes = runs->bytes();
      uint8_t* const buffer = ctx.staging.Get(4 * bytes) + 3 * bytes;
      if (is_root) runs->Read(0, bytes, buffer);
      SmallBroadcast(ctx, buffer, buffer, bytes, root);
      if (!is_root) runs->Write(0, buffer, bytes);
      return;
    }
    CallAgreement agreement(ctx,
                            is_root ? CallAgreement::Pair::kDataOut : CallAgreement::Pair::kDataIn);
    ChainBroadcast(ctx, *runs, root, &agreement);
    agreement.Wait();
  };
}

RingCommunication::Prepared RingCommunication::PrepareBroadcastInRuns(
    const std::vector<Tensor>& pieces, int root, core::Gate go) const {
  constexpr const char* kName = "broadcast in pieces";
  if (root < 0 || root >= size_) {
    throw Error(ErrorCode::kInvalidArgument,
                "rank " + std::to_string(rank_) + ": " + kName + ": root " + std::to_string(root) +
                    " is not a rank of this communicator (size " + std::to_string(size_) + ")");
  }
  const size_t count = CountOfPieces(kName, pieces);
  const CallDescriptor call{CollectiveKind::kBroadcast, pieces.front().dtype, ReduceOp::kSum, root,
                            count};
  if (pieces.front().device.kind == Device::Kind::kCuda) {
    return Gated(StagedBroadcast(call, StagingOfPieces(kName, pieces),
                                 rank_ == root ? pieces : std::vector<Tensor>{}, pieces, count,
                                 pieces.front().dtype, root),
                 std::move(go));
  }
  Body body = planner_ ? planner_->BroadcastInRuns(pieces, root) : Body{};
  return Gated(body ? Prepared{call, std::move(body)} : OnRing(call, BroadcastInRuns(pieces, root)),
               std::move(go));
}

RingCommunication::Prepared RingCommunication::PrepareBroadcast(const Tensor& send,
                                                                const Tensor& recv,
                                                                int root) const {
  constexpr const char* kName = "broadcast";
  if (root < 0 || root >= size_) {
    throw Error(ErrorCode::kInvalidArgument,
                "rank " + std::to_string(rank_) + ": broadcast: root " + std::to_string(root) +
                    " is not a rank of this communicator (size " + std::to_string(size_) + ")");
  }
  CheckTensor(kName, "recv", recv);
  if (rank_ == root) {
    CheckTensor(kName, "send", send);
    CheckOneDevice(kName, send, recv);
    CheckSameType(kName, send, recv);
    if (send.count != recv.count) {
      throw Error(ErrorCode::kInvalidArgument,
                  CountMismatch(rank_, kName, "the root's recv must have send's " +
                                                  std::to_string(send.count) + " elements",
                                recv.count));
    }
    core::CheckBuffersApart(rank_, kName, send, recv, reinterpret_cast<uintptr_t>(recv.data),
                            "recv.data");
  }
  const CallDescriptor call{CollectiveKind::kBroadcast, recv.dtype, ReduceOp::kSum, root,
                            recv.count};
  if (recv.device.kind == Device::Kind::kCuda) {
    std::shared_ptr<CudaStaging> staging = StagingFor(kName, "recv", recv);
    if (rank_ == root) StagingFor(kName, "send", send);
    Prepared staged = StagedBroadcast(
        call, std::move(staging), rank_ == root ? std::vector<Tensor>{send} : std::vector<Tensor>{},
        {recv}, recv.count, recv.dtype, root);
    if (planner_) staged.body = planner_->DeviceBroadcast(send, recv, root, std::move(staged.body));
    return staged;
  }
  const bool small = recv.bytes() <= small_message_bytes_;
  const void* source = rank_ == root ? send.data : nullptr;
  if (planner_) {
    if (Body body = planner_->Broadcast(source, recv, root)) {
      return Prepared{call, std::move(body)};
    }
  }
  return OnRing(call, [source, recv, root, small](Context& ctx) {
    if (small) return SmallBroadcast(ctx, source, recv.data, recv.bytes(), root);
    CallAgreement agreement(
        ctx, ctx.rank() == root ? CallAgreement::Pair::kDataOut : CallAgreement::Pair::kDataIn);
    ChainBroadcast(ctx, source, recv.data, recv.bytes(), root, &agreement);
    agreement.Wait();
  });
}

RingCommunication::Prepared RingCommunication::PrepareAllGather(const Tensor& send,
                                                                const Tensor& recv) const {
  constexpr const char* kName = "all_gather";
  CheckSendRecv(kName, send, recv);
  CheckWholeIsSizeTimesBlock(kName, "recv", recv, "send", send);
  core::CheckBuffersApart(rank_, kName, send, recv,
                          reinterpret_cast<uintptr_t>(recv.data) + size_t(rank_) * send.bytes(),
                          "recv.data + rank * send.count elements");
  const CallDescriptor call{CollectiveKind::kAllGather, send.dtype, ReduceOp::kSum, 0,
                            send.count};
  if (send.device.kind == Device::Kind::kCuda) {
    Prepared staged = StagedAllGather(call, send, recv);
    if (planner_) staged.body = planner_->DeviceAllGather(send, recv, std::move(staged.body));
    return staged;
  }
  if (planner_) {
    if (Body body = planner_->AllGather(send, recv)) return Prepared{call, std::move(body)};
  }
  const bool small = recv.bytes() <= small_message_bytes_;
  return OnRing(call, [send, recv, small](Context& ctx) {
    if (small) return SmallAllGather(ctx, send.data, recv.data, send.bytes());
    CallAgreement agreement(ctx, CallAgreement::Pair::kDataBothWays);
    RingAllGather(ctx, send.data, recv.data, send.count, send.dtype, &agreement);
    agreement.Wait();
  });
}

RingCommunication::Prepared RingCommunication::PrepareReduceScatter(const Tensor& send,
                                                                    const Tensor& recv,
                                                                    ReduceOp op) const {
  constexpr const char* kName = "reduce_scatter";
  CheckSendRecv(kName, send, recv);
  CheckOp(rank_, kName, op);
  CheckWholeIsSizeTimesBlock(kName, "send", send, "recv", recv);
  core::CheckBuffersApart(rank_, kName, send, recv,
                          reinterpret_cast<uintptr_t>(recv.data) - size_t(rank_) * recv.bytes(),
                          "recv.data - rank * recv.count elements");
  const CallDescriptor call{CollectiveKind::kReduceScatter, recv.dtype, op, 0, recv.count};
  if (send.device.kind == Device::Kind::kCuda) {
    Prepared staged = StagedReduceScatter(call, send, recv, op);
    if (planner_) {
      staged.body = planner_->DeviceReduceScatter(send, recv, op, std::move(staged.body));
    }
    return staged;
  }
  if (planner_) {
    if (Body body = planner_->ReduceScatter(send, recv, op)) {
      return Prepared{call, std::move(body)};
    }
  }
  const bool small = send.bytes() <= small_message_bytes_;
  return OnRing(call, [send, recv, op, small](Context& ctx) {
    if (small) return SmallReduceScatter(ctx, send.data, recv.data, recv.count, recv.dtype, op);
    RingReduceScatter(ctx, send.data, recv.data, recv.count, recv.dtype, op);
  });
}

RingCommunication::Prepared RingCommunication::PrepareBarrier() const {
  const CallDescriptor call{CollectiveKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0};
  if (planner_) {
    if (Body body = planner_->Barrier()) return Prepared{call, std::move(body)};
  }
  return OnRing(call, [](Context& ctx) { ring::Barrier(ctx); });
}

void RingCommunication::CheckRoot(const char* collective, int root) const {
  if (root < 0 || root >= size_) {
    throw Error(ErrorCode::kInvalidArgument,
                core::ArgumentPrefix(rank_, collective) + "root " + std::to_string(root) +
                    " is not a rank of this communicator (size " + std::to_string(size_) + ")");
  }
}

RingCommunication::Prepared RingCommunication::PrepareReduce(const Tensor& send, const Tensor& recv,
                                                             ReduceOp op, int root) const {
  constexpr const char* kName = "reduce";
  CheckRoot(kName, root);
  CheckTensor(kName, "send", send);
  CheckOp(rank_, kName, op);
  const bool is_root = rank_ == root;
  if (is_root) {
    CheckTensor(kName, "recv", recv);
    CheckOneDevice(kName, send, recv);
    CheckSameType(kName, send, recv);
    if (send.count != recv.count) {
      throw Error(ErrorCode::kInvalidArgument,
                  CountMismatch(rank_, kName,
                                "the root's recv must have send's " + std::to_string(send.count) +
                                    " elements",
                                recv.count));
    }
    core::CheckBuffersApart(rank_, kName, send, recv, reinterpret_cast<uintptr_t>(recv.data),
                            "recv.data");
  }
  const CallDescriptor call{CollectiveKind::kReduce, send.dtype, op, root, send.count};
  if (send.device.kind == Device::Kind::kCuda) return StagedReduce(call, send, recv, op, root);
  const bool small = send.bytes() <= small_message_bytes_;
  void* const out = is_root ? recv.data : nullptr;
  if (planner_) {
    if (Body body = planner_->Reduce(send, out, op, root)) return Prepared{call, std::move(body)};
  }
  return OnRing(call, [send, out, op, root, small](Context& ctx) {
    if (small) return SmallReduce(ctx, send.data, out, send.count, send.dtype, op, root);
    CallAgreement agreement(ctx);
    ChainReduce(ctx, send.data, out, send.count, send.dtype, op, root, agreement);
  });
}

RingCommunication::Prepared RingCommunication::PrepareGather(const Tensor& send, const Tensor& recv,
                                                             int root) const {
  constexpr const char* kName = "gather";
  CheckRoot(kName, root);
  CheckTensor(kName, "send", send);
  const bool is_root = rank_ == root;
  if (is_root) {
    CheckTensor(kName, "recv", recv);
    CheckOneDevice(kName, send, recv);
    CheckSameType(kName, send, recv);
    CheckWholeIsSizeTimesBlock(kName, "the root's recv", recv, "send", send);
    core::CheckBuffersApart(rank_, kName, send, recv,
                            reinterpret_cast<uintptr_t>(recv.data) + size_t(root) * send.bytes(),
                            "recv.data + root * send.count elements");
  } else if (send.count > SIZE_MAX / size_t(size_) / SizeOf(send.dtype)) {
    throw Error(ErrorCode::kInvalidArgument, core::ArgumentPrefix(rank_, kName) +
                                                 "size x send.count elements of " +
                                                 ToString(send.dtype) + " do not fit size_t");
  }
  const CallDescriptor call{CollectiveKind::kGather, send.dtype, ReduceOp::kSum, root, send.count};
  if (send.device.kind == Device::Kind::kCuda) return StagedGather(call, send, recv, root);
  const bool small = size_t(size_) * send.bytes() <= small_message_bytes_;
  void* const out = is_root ? recv.data : nullptr;
  if (planner_) {
    if (Body body = planner_->Gather(send, out, root)) return Prepared{call, std::move(body)};
  }
  return OnRing(call, [send, out, root, small](Context& ctx) {
    if (small) return SmallGather(ctx, send.data, out, send.bytes(), root);
    CallAgreement agreement(ctx);
    DirectGather(ctx, send.data, out, send.bytes(), root, agreement);
  });
}

RingCommunication::Prepared RingCommunication::PrepareScatter(const Tensor& send,
                                                              const Tensor& recv, int root) const {
  constexpr const char* kName = "scatter";
  CheckRoot(kName, root);
  CheckTensor(kName, "recv", recv);
  const bool is_root = rank_ == root;
  if (is_root) {
    CheckTensor(kName, "send", send);
    CheckOneDevice(kName, send, recv);
    CheckSameType(kName, send, recv);
    CheckWholeIsSizeTimesBlock(kName, "the root's send", send, "recv", recv);
    core::CheckBuffersApart(rank_, kName, send, recv,
                            reinterpret_cast<uintptr_t>(recv.data) - size_t(root) * recv.bytes(),
                            "recv.data - root * recv.count elements");
  } else if (recv.count > SIZE_MAX / size_t(size_) / SizeOf(recv.dtype)) {
    throw Error(ErrorCode::kInvalidArgument, core::ArgumentPrefix(rank_, kName) +
                                                 "size x recv.count elements of " +
                                                 ToString(recv.dtype) + " do not fit size_t");
  }
  const CallDescriptor call{CollectiveKind::kScatter, recv.dtype, ReduceOp::kSum, root, recv.count};
  if (recv.device.kind == Device::Kind::kCuda) return StagedScatter(call, send, recv, root);
  const bool small = size_t(size_) * recv.bytes() <= small_message_bytes_;
  const void* const in = is_root ? send.data : nullptr;
  return OnRing(call, [in, recv, root, small](Context& ctx) {
    if (small) return SmallScatter(ctx, in, recv.data, recv.bytes(), root);
    CallAgreement agreement(ctx);
    DirectScatter(ctx, in, recv.data, recv.bytes(), root, agreement);
  });
}

RingCommunication::Prepared RingCommunication::PrepareAllToAll(
    const Tensor& send, const Tensor& recv, const std::vector<size_t>& send_counts,
    const std::vector<size_t>& recv_counts) const {
  constexpr const char* kName = "all_to_all";
  CheckSendRecv(kName, send, recv);
  const std::string prefix = core::ArgumentPrefix(rank_, kName);
  std::vector<size_t> sends = send_counts;
  std::vector<size_t> recvs = recv_counts;
  if (sends.empty() && recvs.empty()) {
    if (send.count != recv.count || send.count % size_t(size_) != 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  prefix + "without counts, send and recv must have one count, a multiple of " +
                      "size " + std::to_string(size_) + "; got send.count " +
                      std::to_string(send.count) + " and recv.count " + std::to_string(recv.count));
    }
    sends.assign(size_t(size_), send.count / size_t(size_));
    recvs = sends;
  } else {
    const auto check = [&](const char* name, const std::vector<size_t>& counts, size_t total,
                           const char* tensor) {
      if (counts.size() != size_t(size_)) {
        throw Error(ErrorCode::kInvalidArgument,
                    prefix + name + " has " + std::to_string(counts.size()) +
                        " entries; it needs one per rank (" + std::to_string(size_) +
                        "), or both count vectors empty");
      }
      size_t sum = 0;
      for (const size_t c : counts) {
        if (c > total - sum) {
          throw Error(ErrorCode::kInvalidArgument, prefix + name + " adds up to more than " +
                                                       tensor + ".count " + std::to_string(total));
        }
        sum += c;
      }
      if (sum != total) {
        throw Error(ErrorCode::kInvalidArgument, prefix + name + " adds up to " +
                                                     std::to_string(sum) + ", not " + tensor +
                                                     ".count " + std::to_string(total));
      }
    };
    check("send_counts", sends, send.count, "send");
    check("recv_counts", recvs, recv.count, "recv");
    if (sends[size_t(rank_)] != recvs[size_t(rank_)]) {
      throw Error(ErrorCode::kInvalidArgument, prefix + "send_counts[" + std::to_string(rank_) +
                                                   "] (" + std::to_string(sends[size_t(rank_)]) +
                                                   ") and recv_counts[" + std::to_string(rank_) +
                                                   "] (" + std::to_string(recvs[size_t(rank_)]) +
                                                   ") differ: this rank's block to itself");
    }
  }
  // No in-place form: a block received may land where a block still to be sent lies.
  const uintptr_t s = reinterpret_cast<uintptr_t>(send.data);
  const uintptr_t r = reinterpret_cast<uintptr_t>(recv.data);
  if (send.bytes() > 0 && recv.bytes() > 0 && (s - r < recv.bytes() || r - s < send.bytes())) {
    throw Error(ErrorCode::kInvalidArgument,
                prefix + "send and recv overlap; an all-to-all needs them apart");
  }
  const CallDescriptor call{CollectiveKind::kAllToAll, send.dtype, ReduceOp::kSum, 0, 0};
  if (send.device.kind == Device::Kind::kCuda) {
    return StagedAllToAll(call, send, recv, std::move(sends), std::move(recvs));
  }
  return OnRing(call,
                [send, recv, sends = std::move(sends), recvs = std::move(recvs)](Context& ctx) {
                  PairwiseAllToAll(ctx, send.data, recv.data, send.dtype, sends, recvs);
                });
}

RingCommunication::Prepared RingCommunication::PreparePointToPoint(bool sending,
                                                                   const Tensor& tensor, int peer,
                                                                   int64_t tag) {
  const char* const name = sending ? "send" : "recv";
  CheckTensor(name, "message", tensor);
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw Error(ErrorCode::kInvalidArgument,
                core::ArgumentPrefix(rank_, name) + "peer " + std::to_string(peer) +
                    (peer == rank_ ? " is this rank"
                                   : " is not a rank of this communicator (size " +
                                         std::to_string(size_) + ")"));
  }
  Prepared prepared;
  prepared.descriptor = PointToPointDescriptor(tensor.dtype, tensor.count, tag);
  prepared.collective = false;
  // Numbered when it runs: sends and receives run in issue order, one at a time.
  uint64_t& next = sending ? messages_sent_[size_t(peer)] : messages_received_[size_t(peer)];
  if (tensor.device.kind == Device::Kind::kCuda) {
    return StagedPointToPoint(std::move(prepared), sending, tensor, peer, tag, next);
  }
  prepared.body = [sending, tensor, peer, tag, &next](Context& ctx) {
    const uint64_t number = next++;
    if (sending) {
      SendMessage(ctx, peer, number, tensor.data, tensor.count, tensor.dtype, tag);
    } else {
      RecvMessage(ctx, peer, number, tensor.data, tensor.count, tensor.dtype, tag);
    }
  };
  return prepared;
}

RingCommunication::Prepared RingCommunication::OnRing(const CallDescriptor& call, Body body) const {
  if (!planner_) return Prepared{call, std::move(body)};
  return Prepared{call, [planner = planner_.get(), body = std::move(body)](Context& ctx) {
                    planner->RunningOnRing(ctx.tag);
                    body(ctx);
                  }};
}

RingCommunication::Algorithm RingCommunication::ChooseAllReduce(size_t bytes) const {
  if (algorithm_ == core::algorithm::kRecursiveDoubling) return Algorithm::kRecursiveDoubling;
  if (algorithm_ == core::algorithm::kRing) return Algorithm::kRing;
  if (algorithm_ == core::algorithm::kHalvingDoubling) {
    return Algorithm::kHalvingDoubling;  // CheckRingAlgorithm
  }
  const bool power_of_two = HalvingDoublingRunsOn(size_);
  if (planner_) {  // AUTO across hosts: its cost model's choice
    const std::string planned = planner_->FlatAllReduceAlgorithm(bytes);
    if (planned == core::algorithm::kRecursiveDoubling) return Algorithm::kRecursiveDoubling;
    if (planned == core::algorithm::kRing) return Algorithm::kRing;
    if (planned == core::algorithm::kHalvingDoubling && power_of_two) {
      return Algorithm::kHalvingDoubling;
    }
  }
  // Latency-bound sizes: recursive doubling. Medium sizes on a power-of-two world of at least
  // 4: halving-doubling, the ring's bytes in fewer steps. Else the ring.
  if (bytes <= small_message_bytes_) return Algorithm::kRecursiveDoubling;
  if (power_of_two && bytes <= medium_message_bytes_) return Algorithm::kHalvingDoubling;
  return Algorithm::kRing;
}

std::string RingCommunication::AllReduceAlgorithm(size_t bytes) const {
  if (planner_) {
    std::string name = planner_->AllReduceAlgorithm(bytes);
    if (!name.empty()) return name;
  }
  switch (ChooseAllReduce(bytes)) {
    case Algorithm::kRecursiveDoubling:
      return std::string(core::algorithm::kRecursiveDoubling);
    case Algorithm::kHalvingDoubling:
      return std::string(core::algorithm::kHalvingDoubling);
    case Algorithm::kRing:
      return std::string(core::algorithm::kRing);
  }
  return "?";
}

std::shared_ptr<Work> RingCommunication::AllReduceAsync(const Tensor& send, const Tensor& recv,
                                                        ReduceOp op) {
  return Submit(PrepareAllReduce(send, recv, op));
}

std::shared_ptr<Work> RingCommunication::BroadcastAsync(const Tensor& send, const Tensor& recv,
                                                        int root) {
  return Submit(PrepareBroadcast(send, recv, root));
}

std::shared_ptr<Work> RingCommunication::AllGatherAsync(const Tensor& send, const Tensor& recv) {
  return Submit(PrepareAllGather(send, recv));
}

std::shared_ptr<Work> RingCommunication::ReduceScatterAsync(const Tensor& send,
                                                            const Tensor& recv, ReduceOp op) {
  return Submit(PrepareReduceScatter(send, recv, op));
}

std::shared_ptr<Work> RingCommunication::BarrierAsync() { return Submit(PrepareBarrier()); }

}  // namespace

std::unique_ptr<CollectiveCommunication> CreateRingCommunication(
    std::unique_ptr<transport::Fabric> fabric, std::shared_ptr<Store> store,
    const CommunicationOptions& options, std::unique_ptr<Planner> planner, SplitBuilder split) {
  if (!fabric) throw Error(ErrorCode::kInvalidArgument, "CreateRingCommunication: no fabric");
  const CommunicationOptions checked = core::CheckOptions(fabric->rank(), options);
  CheckRingAlgorithm(fabric->rank(), fabric->size(), options.algorithm);
  if (!options.algorithm.empty() && !planner && !IsRingAlgorithm(options.algorithm)) {
    throw Error(ErrorCode::kNotSupported,
                "rank " + std::to_string(fabric->rank()) + ": algorithm '" + options.algorithm +
                    "' is not one of RING's (ring, recursive_doubling, halving_doubling)");
  }
  return std::make_unique<RingCommunication>(std::move(fabric), std::move(store), checked,
                                             std::move(planner), std::move(split));
}

bool HalvingDoublingRunsOn(int size) { return size >= 4 && (size & (size - 1)) == 0; }

void CheckRingAlgorithm(int rank, int size, const std::string& algorithm) {
  if (algorithm == core::algorithm::kHalvingDoubling && !HalvingDoublingRunsOn(size)) {
    throw Error(ErrorCode::kNotSupported,
                "rank " + std::to_string(rank) +
                    ": CommunicationOptions::algorithm 'halving_doubling' needs a power-of-two "
                    "number of ranks, at least 4; this communicator has " +
                    std::to_string(size));
  }
}

bool IsRingAlgorithm(const std::string& name) {
  return name == core::algorithm::kRing || name == core::algorithm::kRecursiveDoubling ||
         name == core::algorithm::kHalvingDoubling;
}

}  // namespace collectives::ring
