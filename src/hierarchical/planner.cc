// The AUTO planner: topology, the shared-memory group, and the choice per call.
#include "src/hierarchical/planner.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "src/core/algorithm_names.h"
#include "src/core/environment.h"
#include "src/core/kernels.h"
#include "src/core/text.h"
#include "src/hierarchical/cost_model.h"
#include "src/hierarchical/device_plan.h"
#include "src/hierarchical/shm_group.h"
#include "src/hierarchical/sub_fabric.h"
#include "src/ring/algorithms.h"

namespace collectives::hierarchical {
namespace {

enum class Plan { kRing, kShm, kTwoLevel };

// The most staging a reduce or a gather in shared memory takes for the results a rank does not
// keep (a non-root's reduce, every rank's pieces of a large gather): larger ones run in pieces.
constexpr size_t kShmScratchBytes = size_t{16} << 20;

// Two levels check a call across hosts where frames cross: a rank checks the call descriptor of
// every frame it receives, and its host's members check each other's calls in shared memory before
// a step writes. Data that crosses hosts reaches a caller's buffer only through frames checked hop
// by hop (the all-reduce and the all-gather write their slots, never the caller's buffer, while
// they cross; a rank alone on its host crosses from a buffer of its own, or in a broadcast receives
// once every host agreed), so a host whose call differs from another's stops every rank before
// anything is written, except where nothing crosses towards a host: a call of zero elements, and
// the root's host in a broadcast, which only sends. There every host's members first check each
// other's calls in shared memory (a barrier step), then the first rank of every host (its leader,
// whatever the call) exchanges empty frames with the other hosts' leaders before it arrives in the
// shared-memory call, where its host's members wait for it (a rank alone on its host: before it
// writes recv): a leader speaks for a host that agrees, every host compares its call directly with
// every other, so a mismatched call raises kMismatch on every rank with nothing written, as on
// RING. The barrier is what lets a leader speak for its host: a member of a receiving host that
// differed from its leader would otherwise break only its own host while the root's host returned,
// its recv written. Only the leaders send (a round among every member would cost a small
// broadcast several times its own time), and a broadcast posts the round before its crossing and
// waits only before it arrives, overlapping the two.

// What is left of the set-up until `deadline`, at least a millisecond: a key already in the
// store is still read; a wait times out at once.
std::chrono::milliseconds Left(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                  std::chrono::milliseconds(1));
}

// A step of the set-up that ran out of what was left of it: `what` (its own message, which
// names only what was left) after the set-up's whole `timeout`, as the mesh says it.
Error SetupTimedOut(int rank, std::chrono::milliseconds timeout, std::string what) {
  const std::string own = "rank " + std::to_string(rank) + ": ";
  if (what.starts_with(own)) what.erase(0, own.size());  // said once, in front
  return Error(ErrorCode::kTimeout, own + "timed out after " + std::to_string(timeout.count()) +
                                        " ms setting up the communicator: " + what);
}

// The host's barrier and the leaders' round described above, on construction (the round posted
// only); Wait() returns once every other host's leader sent the same call (kMismatch otherwise).
// Every member of a group constructs one; only the leaders send.
class HostAgreement {
 public:
  HostAgreement(ring::Context& ctx, ShmGroup* group, const std::vector<int>& leaders, int host,
                bool leader) {
    if (group != nullptr) group->Barrier(ctx.tag, ctx.deadline);  // the host agrees first
    if (!leader) return;
    sub_.emplace(ctx.fabric, leaders, host);
    round_.emplace(*sub_, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline);
    agreement_.emplace(*round_);
  }
  void Wait() {
    if (agreement_) agreement_->Wait();
  }

 private:
  std::optional<SubFabric> sub_;
  std::optional<ring::Context> round_;
  std::optional<ring::CallAgreement> agreement_;
};

// The part of a two-level broadcast that a crosser plays: the rank that carries each step of
// the message across hosts among the crossers (`cross`, one rank per host, the root's host
// `root_host`), a tree for steps of at most `small` bytes, a chain for larger ones. The root
// reads `send`; every crosser writes `recv` (the same Runs for a call in place).
struct BroadcastCrossing {
  ring::Context& cross;
  int root_host;
  size_t small;
  bool is_root;
  const core::Runs& send;
  const core::Runs& recv;

  void Step(const void* from, void* into, size_t n) const {
    if (n <= small) {
      ring::TreeBroadcast(cross, from, into, n, root_host);
    } else {
      ring::ChainBroadcast(cross, from, into, n, root_host);
    }
  }

  // A crosser with a group: each step crosses straight into its slot (the root sends it from its
  // message, or from the slot where the step spans runs), and the group broadcasts it from there
  // to the host's members, `agreed` before this rank arrives.
  void IntoGroup(ring::Context& ctx, ShmGroup& group, int host_root,
                 const std::function<void()>& agreed) const {
    const auto fill = [&](uint8_t* slot, size_t offset, size_t n) {
      if (!is_root) return Step(nullptr, slot, n);
      if (send.contiguous()) return Step(send.data() + offset, slot, n);
      send.Read(offset, n, slot);
      Step(slot, slot, n);
    };
    group.Broadcast(ctx.tag, ctx.deadline, send, recv, host_root,
                    {.fill = fill, .before_arrive = agreed});
  }

  // A crosser alone on its host: the steps of slot_bytes the groups cut. The root only sends,
  // and writes recv once every host agreed; the others wait for that before they receive into
  // recv (a frame is checked against its sender's call only, and a host off the path may
  // differ). A message in one run is sent from (received into) where it lies; one that spans
  // runs goes through a step buffer of its own.
  void Alone(size_t slot_bytes, const std::function<void()>& agreed) const {
    const core::Runs& mine = is_root ? send : recv;
    const size_t bytes = recv.bytes();
    if (!is_root) agreed();
    const auto buffer =
        mine.contiguous() ? nullptr
                          : std::make_unique_for_overwrite<uint8_t[]>(std::min(slot_bytes, bytes));
    size_t offset = 0;
    do {
      const size_t c = std::min(slot_bytes, bytes - offset);
      uint8_t* at = buffer ? buffer.get() : mine.data() + offset;
      if (is_root && buffer) send.Read(offset, c, at);
      Step(is_root ? at : nullptr, at, c);
      if (!is_root && buffer) recv.Write(offset, at, c);
      if (is_root && offset == 0) agreed();
      offset += c;
    } while (offset < bytes);
    if (is_root && send.contiguous() && send.data() != recv.data()) {
      recv.Write(0, send.data(), bytes);
    }
  }
};

class HierarchicalPlanner final : public ring::Planner {
 public:
  HierarchicalPlanner(int rank, int size, Topology topology, std::unique_ptr<ShmGroup> group,
                      Plan plan, bool forced, size_t slot_bytes, size_t shm_small_bytes,
                      const CommunicationOptions& options)
      : rank_(rank),
        size_(size),
        topology_(std::move(topology)),
        group_(std::move(group)),
        plan_(plan),
        forced_(forced),
        uniform_(topology_.Uniform()),
        slot_bytes_(slot_bytes),
        shm_small_bytes_(shm_small_bytes),
        small_message_bytes_(options.small_message_bytes ? options.small_message_bytes
                                                         : ring::kDefaultSmallMessageBytes) {
    // Two levels: the lanes across hosts are the local indices every host of several ranks has
    // (all of them when the hosts have as many ranks each). Lane i has one rank per host: local
    // index i, or the rank alone on its host, which is in every lane. A rank's place in a lane is
    // its host's index. Ranks past the last lane do not cross.
    if (plan_ != Plan::kTwoLevel) return;
    lanes_ = INT_MAX;
    for (const auto& ranks : topology_.hosts) {
      if (ranks.size() >= 2) lanes_ = std::min(lanes_, int(ranks.size()));
    }
    const int local = topology_.local_index[size_t(rank)];
    const bool alone = topology_.hosts[size_t(topology_.host_of[size_t(rank)])].size() == 1;
    cross_me_ = topology_.host_of[size_t(rank)];
    for (int lane = 0; lane < lanes_; ++lane) {
      std::vector<int> ranks;
      for (const auto& host : topology_.hosts) {
        ranks.push_back(host.size() == 1 ? host[0] : host[size_t(lane)]);
      }
      if (alone) {
        lone_lanes_.push_back(ranks);
      } else if (lane == local) {
        cross_ranks_ = ranks;
      }
    }
    for (const auto& host : topology_.hosts) leader_ranks_.push_back(host[0]);
  }

  Body AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    if (plan_ == Plan::kShm) {
      ShmGroup* group = group_.get();
      return [group, send, recv, op](ring::Context& ctx) {
        group->AllReduce(ctx.tag, ctx.deadline, send.data, recv.data, send.count, send.dtype, op);
      };
    }
    if (plan_ == Plan::kTwoLevel && TwoLevelPays(send.bytes())) {
      return TwoLevelAllReduce(core::Runs(send.data, send.bytes()),
                               core::Runs(recv.data, recv.bytes()), /*in_place=*/false, send.dtype,
                               op);
    }
    return {};
  }

  Body Broadcast(const void* source, const Tensor& recv, int root) override {
    ShmGroup* group = group_.get();
    const int root_index = topology_.local_index[size_t(root)];
    if (plan_ == Plan::kShm) {
      return [group, source, recv, root_index](ring::Context& ctx) {
        group->Broadcast(ctx.tag, ctx.deadline, source, recv.data, recv.bytes(), root_index);
      };
    }
    if (plan_ != Plan::kTwoLevel) return {};
    return TwoLevelBroadcast(core::Runs(source, recv.bytes()), core::Runs(recv.data, recv.bytes()),
                             /*in_place=*/false, root);
  }

  Body AllGather(const Tensor& send, const Tensor& recv) override {
    ShmGroup* group = group_.get();
    if (plan_ == Plan::kShm) {
      return [group, send, recv](ring::Context& ctx) {
        group->AllGather(ctx.tag, ctx.deadline, send.data, recv.data, send.bytes());
      };
    }
    if (plan_ != Plan::kTwoLevel || !uniform_) return {};  // hosts of different sizes: flat
    // Two levels, step by step: the ranks of each local index gather their blocks' step across
    // hosts (a ring among hosts) straight into their slots, then every rank copies every slot's
    // parts to their ranks' places. Each block crosses hosts once per host, not once per rank.
    const std::vector<int>* cross_ranks = &cross_ranks_;
    const int cross_me = cross_me_;
    const Topology* topology = &topology_;
    const std::vector<int>* leaders = &leader_ranks_;
    const bool leader = topology_.local_index[size_t(rank_)] == 0;
    return [=](ring::Context& ctx) {
      SubFabric sub(ctx.fabric, *cross_ranks, cross_me);
      ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
      // Every member takes the host's barrier, whatever its count: the crossing comes before a
      // step's arrival here, so a member that crossed while another of its host waited for the
      // leaders' round (zero elements) would wait for each other until the deadline.
      if (send.count == 0) {  // nothing else crosses
        HostAgreement(ctx, group, *leaders, cross_me, leader).Wait();
      } else {
        group->Barrier(ctx.tag, ctx.deadline);
      }
      const auto* from = static_cast<const uint8_t*>(send.data);
      const TwoLevelHooks hooks{
          .fill =
              [&](uint8_t* slot, size_t offset, size_t bytes) {
                ring::RingAllGather(cross, from + offset, slot, bytes, DataType::kUInt8);
              },
          .rank_of =
              [topology](int host, int member) {
                return size_t(topology->hosts[size_t(host)][size_t(member)]);
              },
      };
      group->AllGatherAcross(ctx.tag, ctx.deadline, recv.data, send.bytes(),
                             int(topology->hosts.size()), hooks);
    };
  }

  // In shared memory on one host: the group's, in place on the runs. Two levels where they pay:
  // the same steps as AllReduce's, each rank's runs read into the group's slots (or a lone
  // rank's step buffer) and the results written back. Elsewhere the ring's, in runs.
  Body AllReduceInRuns(const std::vector<Tensor>& pieces, ReduceOp op) override {
    const DataType dtype = pieces.front().dtype;
    if (plan_ == Plan::kTwoLevel) {
      size_t count = 0;
      for (const Tensor& piece : pieces) count += piece.count;
      // Left to the ring, which builds its own runs, unless two levels pay.
      if (!TwoLevelPays(count * SizeOf(dtype))) return {};
      return TwoLevelAllReduce(core::Runs(), core::RunsOf(pieces), /*in_place=*/true, dtype, op);
    }
    if (plan_ != Plan::kShm) return {};
    ShmGroup* group = group_.get();
    return [group, message = core::RunsOf(pieces), dtype, op](ring::Context& ctx) {
      group->AllReduce(ctx.tag, ctx.deadline, message, message, dtype, op);
    };
  }

  // Likewise: the group's on one host, the two-level broadcast across hosts, the ring's in runs
  // for the flat plan.
  Body BroadcastInRuns(const std::vector<Tensor>& pieces, int root) override {
    if (plan_ == Plan::kTwoLevel) {
      return TwoLevelBroadcast(core::Runs(), core::RunsOf(pieces), /*in_place=*/true, root);
    }
    if (plan_ != Plan::kShm) return {};
    ShmGroup* group = group_.get();
    return [group, message = core::RunsOf(pieces),
            root_index = topology_.local_index[size_t(root)]](ring::Context& ctx) {
      group->Broadcast(ctx.tag, ctx.deadline, message, message, root_index);
    };
  }

  Body ReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    ShmGroup* group = group_.get();
    if (plan_ == Plan::kShm) {
      return [group, send, recv, op](ring::Context& ctx) {
        group->ReduceScatter(ctx.tag, ctx.deadline, send.data, recv.data, recv.count, recv.dtype,
                             op);
      };
    }
    // Two levels, on hosts of as many ranks each, where the all-reduce's model says two levels
    // pay for the whole send: inside the host, local rank l reduces the blocks of lane l (the
    // ranks of local index l, one per host) over its host's members, step by step in shared
    // memory; across hosts, the lane reduce-scatters them by the ring among its hosts, straight
    // into recv. Each block crosses hosts (hosts - 1) / hosts times, where the flat ring sends
    // (ranks - 1) blocks per rank over TCP. Hosts of different rank counts run it flat.
    if (plan_ != Plan::kTwoLevel || !uniform_ || !TwoLevelPays(send.bytes()) ||
        size_t(size_) * SizeOf(recv.dtype) > slot_bytes_) {
      return {};
    }
    std::vector<int> order;
    for (size_t lane = 0; lane < topology_.hosts[0].size(); ++lane) {
      for (const auto& host : topology_.hosts) order.push_back(host[lane]);
    }
    const std::vector<int>* cross_ranks = &cross_ranks_;
    const int cross_me = cross_me_;
    const size_t world = size_t(size_);
    return [group, send, recv, op, order = std::move(order), cross_ranks, cross_me,
            world](ring::Context& ctx) {
      SubFabric sub(ctx.fabric, *cross_ranks, cross_me);
      ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
      const ReduceOp cross_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
      const DataType dtype = recv.dtype;
      const TwoLevelHooks hooks{
          .avg_divisor = world,
          .order = order,
          .cross_lane =
              [&](uint8_t* partial, size_t c, uint8_t* out) {
                ring::RingReduceScatter(cross, partial, out, c, dtype, cross_op);
              },
      };
      group->ReduceScatterAcross(ctx.tag, ctx.deadline, send.data, recv.data, recv.count, dtype, op,
                                 hooks);
    };
  }

  // On one host: the group's all-reduce, the root's result into recv, the others' into staging
  // (thrown away), in pieces of at most kShmScratchBytes so that staging stays bounded. Every
  // piece is a call of the group under this call's tag, checked across members before it
  // writes. Elsewhere the ring's chain.
  Body Reduce(const Tensor& send, void* recv, ReduceOp op, int /*root*/) override {
    if (plan_ != Plan::kShm) return {};
    ShmGroup* group = group_.get();
    return [group, send, recv, op](ring::Context& ctx) {
      const size_t es = SizeOf(send.dtype);
      const size_t piece = std::max<size_t>(1, kShmScratchBytes / es);
      uint8_t* const scratch =
          recv == nullptr ? ctx.staging.Get(std::min(send.count, piece) * es) : nullptr;
      const auto* in = static_cast<const uint8_t*>(send.data);
      auto* out = static_cast<uint8_t*>(recv);
      size_t done = 0;
      do {
        const size_t n = std::min(piece, send.count - done);
        group->AllReduce(ctx.tag, ctx.deadline, in + done * es,
                         out != nullptr ? out + done * es : scratch, n, send.dtype, op);
        done += n;
      } while (done < send.count);
    };
  }

  // On one host, up to kShmScratchBytes in all: the group's all-gather, into recv on the root
  // (in place when send is the root's block of it), into staging elsewhere. A larger gather runs
  // on the ring (direct to the root): in pieces through staging, the root's extra copy of every
  // piece costs more than the loopback saves.
  Body Gather(const Tensor& send, void* recv, int /*root*/) override {
    if (plan_ != Plan::kShm || size_t(size_) * send.bytes() > kShmScratchBytes) return {};
    ShmGroup* group = group_.get();
    const size_t members = size_t(size_);
    return [group, send, recv, members](ring::Context& ctx) {
      void* const into = recv != nullptr ? recv : ctx.staging.Get(members * send.bytes());
      group->AllGather(ctx.tag, ctx.deadline, send.data, into, send.bytes());
    };
  }

  Body Barrier() override {
    if (plan_ != Plan::kShm) return {};
    ShmGroup* group = group_.get();
    return [group](ring::Context& ctx) { group->Barrier(ctx.tag, ctx.deadline); };
  }

  std::string AllReduceAlgorithm(size_t bytes) const override {
    switch (plan_) {
      case Plan::kShm:
        return std::string(bytes <= group_->small_bytes() ? core::algorithm::kShmSmall
                                                          : core::algorithm::kShm);
      case Plan::kTwoLevel:  // else the ring's algorithm, which FlatAllReduceAlgorithm names
        return TwoLevelPays(bytes) ? std::string(core::algorithm::kTwoLevel) : "";
      case Plan::kRing:
        return "";
    }
    return "";
  }

  // Several hosts: the ring algorithm the model finds cheapest for `bytes` (or the one being
  // measured); "" (the ring's own choice by size) until calibrated, when forced, and elsewhere.
  std::string FlatAllReduceAlgorithm(size_t bytes) const override {
    if (plan_ != Plan::kTwoLevel || forced_) return "";
    std::optional<Candidate> candidate = measuring_;
    if (!candidate && calibrated_) candidate = model_.Choose(bytes);
    if (!candidate || *candidate == Candidate::kTwoLevel) return "";
    return std::string(NameOf(*candidate));
  }

  // CUDA tensors: the device plan's (device_plan.h), else the staged ring's. Either way the
  // call runs outside the shared-memory group, which hears of it (RunningOnRing): a member of
  // this host waiting there in a call of the same number then raises kMismatch.
  Body DeviceAllReduce(const Tensor& send, const Tensor& recv, ReduceOp op, Body staged) override {
    return Announced(device_ ? device_->AllReduce(send, recv, op, std::move(staged)) : staged);
  }
  Body DeviceBroadcast(const Tensor& send, const Tensor& recv, int root, Body staged) override {
    return Announced(device_ ? device_->Broadcast(send, recv, root, std::move(staged)) : staged);
  }
  Body DeviceAllGather(const Tensor& send, const Tensor& recv, Body staged) override {
    return Announced(device_ ? device_->AllGather(send, recv, std::move(staged)) : staged);
  }
  Body DeviceReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op,
                           Body staged) override {
    return Announced(device_ ? device_->ReduceScatter(send, recv, op, std::move(staged))
                             : staged);
  }

  void SetDevicePlan(std::unique_ptr<DevicePlan> plan) { device_ = std::move(plan); }

  void RunningOnRing(const core::CallTag& tag) override {
    if (group_) group_->AnnounceOutside(tag);
  }

  void Abort(const Error& error) override {
    if (group_) group_->Abort(error);
    if (device_) device_->Abort(error);
  }

 private:
  friend void hierarchical::Calibrate(ring::Planner& planner, CollectiveCommunication& comm,
                                      Clock::time_point deadline,
                                      std::chrono::milliseconds timeout);

  // `body`, after telling the host's group that this call runs outside it (RunningOnRing).
  Body Announced(Body body) {
    if (!group_) return body;
    return [this, body = std::move(body)](ring::Context& ctx) {
      RunningOnRing(ctx.tag);
      body(ctx);
    };
  }

  // The two-level broadcast of recv.bytes() from `root`: from send (the root's) into recv, or
  // in place on recv (the packer's fused bucket) with `in_place`, with the same steps. Pipelined
  // step by step: one rank per host (the root on its host; elsewhere the rank of the root's local
  // index, or the host's last where it has fewer ranks) carries each step across hosts straight
  // into its slot, and broadcasts it inside its host from there (BroadcastCrossing's parts).
  Body TwoLevelBroadcast(core::Runs send, core::Runs recv, bool in_place, int root) const {
    ShmGroup* group = group_.get();
    const int root_index = topology_.local_index[size_t(root)];
    const int root_host = topology_.host_of[size_t(root)];
    const int my_host = topology_.host_of[size_t(rank_)];
    std::vector<int> crossers;
    for (const auto& host : topology_.hosts) {
      crossers.push_back(host[std::min(size_t(root_index), host.size() - 1)]);
    }
    crossers[size_t(root_host)] = root;
    const int host_root = topology_.local_index[size_t(crossers[size_t(my_host)])];
    const bool crosses = crossers[size_t(my_host)] == rank_;
    const bool is_root = rank_ == root;
    const int cross_me = cross_me_;
    const size_t small = small_message_bytes_;
    const size_t slot_bytes = slot_bytes_;
    const std::vector<int>* leaders = &leader_ranks_;
    const bool leader = topology_.local_index[size_t(rank_)] == 0;
    return [=, send = std::move(send), recv = std::move(recv)](ring::Context& ctx) {
      // The root's host only sends, so nothing would check its call against the other hosts'
      // (HostAgreement). The host's barrier and the round come now, before any data; the round
      // is waited for before this rank arrives in shared memory, overlapping the first crossing.
      HostAgreement agreement(ctx, group, *leaders, cross_me, leader);
      const auto agreed = [&agreement] { agreement.Wait(); };
      // A rank that does not cross: its host's crosser broadcasts each step to it in shared memory.
      if (!crosses) {
        group->Broadcast(ctx.tag, ctx.deadline, recv, recv, host_root, {.before_arrive = agreed});
        return;
      }
      SubFabric sub(ctx.fabric, crossers, cross_me);
      ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
      const BroadcastCrossing crossing{cross, root_host, small, is_root, in_place ? recv : send,
                                       recv};
      if (group != nullptr) {
        crossing.IntoGroup(ctx, *group, host_root, agreed);
      } else {
        crossing.Alone(slot_bytes, agreed);
      }
    };
  }

  // The two-level all-reduce of recv.bytes(): from send into recv, or in place on recv (the
  // packer's fused bucket) with `in_place`, with the same steps and bits.
  Body TwoLevelAllReduce(core::Runs send, core::Runs recv, bool in_place, DataType dtype,
                         ReduceOp op) const {
    // Inside the host: each local rank of a lane reduces its slice of every step; across
    // hosts: the ranks of each lane all-reduce their slices at once (a host's lanes cross the
    // network together, each with 1/L of the bytes); inside the host again: everyone copies
    // every slice out. kAvg sums across hosts and divides once by the world size. Hosts of
    // different rank counts have as many lanes as the smallest host of several ranks: the
    // ranks past them only add their input and copy out; a rank alone on its host crosses
    // every slice of every step itself, one lane after the other.
    ShmGroup* group = group_.get();
    const std::vector<int>* cross_ranks = &cross_ranks_;
    const std::vector<std::vector<int>>* lone_lanes = &lone_lanes_;
    const int cross_me = cross_me_;
    const int lanes = lanes_;
    const size_t small = small_message_bytes_;
    const size_t slot_bytes = slot_bytes_;
    const size_t shm_small = shm_small_bytes_;
    const size_t world = size_t(size_);
    const std::vector<int>* leaders = &leader_ranks_;
    const bool leader = topology_.local_index[size_t(rank_)] == 0;
    return [=, send = std::move(send), recv = std::move(recv)](ring::Context& ctx) {
      const core::Runs& from = in_place ? recv : send;
      const size_t es = SizeOf(dtype);
      const size_t count = recv.bytes() / es;
      SubFabric sub(ctx.fabric, *cross_ranks, cross_me);
      ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
      if (count == 0) {  // nothing else crosses
        HostAgreement(ctx, group, *leaders, cross_me, leader).Wait();
      }
      const ReduceOp cross_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
      const auto all_reduce_in = [&](ring::Context& lane, void* slice, size_t n) {
        if (n * es <= small) {
          ring::RecursiveDoublingAllReduce(lane, slice, slice, n, dtype, cross_op);
        } else {
          ring::RingAllReduce(lane, slice, slice, n, dtype, cross_op);
        }
      };
      if (group != nullptr) {
        const TwoLevelHooks hooks{
            .cross = [&](void* slice, size_t n) { all_reduce_in(cross, slice, n); },
            .avg_divisor = world,
            .lanes = lanes,
        };
        group->AllReduce(ctx.tag, ctx.deadline, from, recv, dtype, op, hooks);
        return;
      }
      // Alone on this host: the steps and parts the groups cut, each part crossed in its lane
      // from a buffer of its own, so that recv is written only once a crossing checked the
      // other hosts' calls, as the groups write it.
      const size_t per_step = slot_bytes / es;
      const int owners = CrossingOwners(count * es, shm_small, lanes);
      const auto step = std::make_unique_for_overwrite<uint8_t[]>(std::min(per_step, count) * es);
      for (size_t offset = 0; offset < count;) {
        const size_t c = std::min(per_step, count - offset);
        from.Read(offset * es, c * es, step.get());
        // Lane by lane in increasing order, as every rank alone on its host does: two of them
        // share one connection in every lane, and frames of equal parts carry the same tag.
        for (int j = 0; j < owners; ++j) {
          const Part part = PartOf(c, owners, j);
          if (part.length == 0) continue;  // as the group's member j, which does not cross
          SubFabric lane_fabric(ctx.fabric, (*lone_lanes)[size_t(j)], cross_me);
          ring::Context lane{lane_fabric, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
          uint8_t* slice = step.get() + part.offset * es;
          all_reduce_in(lane, slice, part.length);
          if (op == ReduceOp::kAvg) core::DivideInPlace(dtype, slice, part.length, world);
        }
        recv.Write(offset * es, step.get(), c * es);
        offset += c;
      }
    };
  }

  // Whether an all-reduce of `bytes` runs in two levels: always when forced, when two levels are
  // being measured, never while another candidate is or before calibration, else when the model
  // finds them the cheapest.
  bool TwoLevelPays(size_t bytes) const {
    if (forced_) return true;
    if (measuring_) return *measuring_ == Candidate::kTwoLevel;
    return calibrated_ && model_.Choose(bytes) == Candidate::kTwoLevel;
  }

  // The candidate Calibrate is measuring (every all-reduce runs it), if any.
  std::optional<Candidate> measuring_;
  bool calibrated_ = false;  // until then: the flat ring, by its own choice per size
  CostModel model_;

  const int rank_;
  const int size_;
  const Topology topology_;
  const std::unique_ptr<ShmGroup> group_;  // null without shared memory
  const Plan plan_;
  const bool forced_;             // options.algorithm named the plan
  const bool uniform_;            // every host has as many ranks
  const size_t slot_bytes_;       // the groups' steps (two levels)
  const size_t shm_small_bytes_;  // the groups' small all-reduces (two levels)
  const size_t small_message_bytes_;
  int lanes_ = 0;  // the local indices that cross hosts (two levels)
  // This rank's lane, one rank per host (empty past the lanes, and for a rank alone on its host).
  std::vector<int> cross_ranks_;
  std::vector<std::vector<int>> lone_lanes_;  // every lane, for a rank alone on its host
  int cross_me_ = 0;  // its host's index: its place in cross_ranks_ (if any) and leader_ranks_
  // The first rank of every host, which check a call across hosts where nothing else crosses.
  std::vector<int> leader_ranks_;
  std::unique_ptr<DevicePlan> device_;  // CUDA tensors' plan; null: the staged ring
};

}  // namespace

Topology Topology::FromIdentities(const std::vector<std::string>& identities) {
  Topology t;
  std::map<std::string, int> host_index;
  t.host_of.resize(identities.size());
  t.local_index.resize(identities.size());
  for (size_t r = 0; r < identities.size(); ++r) {
    const auto [it, fresh] = host_index.emplace(identities[r], int(t.hosts.size()));
    if (fresh) t.hosts.emplace_back();
    std::vector<int>& ranks = t.hosts[size_t(it->second)];
    t.host_of[r] = it->second;
    t.local_index[r] = int(ranks.size());
    ranks.push_back(int(r));
  }
  return t;
}

bool Topology::Uniform() const {
  for (const auto& ranks : hosts) {
    if (ranks.size() != hosts.front().size()) return false;
  }
  return true;
}

std::unique_ptr<ring::Planner> CreatePlanner(int rank, int size, Store& store,
                                             const std::string& job_id,
                                             const std::string& key_prefix,
                                             const CommunicationOptions& options,
                                             Clock::time_point deadline,
                                             std::shared_ptr<Store> lasting_store) {
  // "<shm>\n<slot>\n<host>\n<machine>": whether this rank allows shared memory (COLLECTIVES_SHM),
  // its COLLECTIVES_SHM_SLOT_BYTES (empty: unset), the host AUTO plans by (pretended or real), and
  // the machine the process really runs on, whose ranks compete for its cores. Every rank
  // decides from what every rank published, so they decide alike even when one rank's
  // environment differs: shared memory only if all allow it.
  // The shm field is "n" where COLLECTIVES_SHM allows shared memory but the process cannot use
  // it (no /dev/shm, a read-only one, not this user's): that turns it off as "0" does, on every
  // rank alike, instead of failing the set-up at shm_open.
  const char* shm_env = std::getenv("COLLECTIVES_SHM");
  const bool shm_wanted = shm_env == nullptr || std::string(shm_env) != "0";
  const std::string shm_unusable = shm_wanted ? SharedMemoryUnavailable() : "";
  const bool shm_here = shm_wanted && shm_unusable.empty();
  const char* const shm_field = shm_here ? "1" : shm_wanted ? "n" : "0";
  const std::optional<uint64_t> slot_here =
      core::EnvCount("COLLECTIVES_SHM_SLOT_BYTES", "a byte count");
  const std::string machine = MachineIdentity();
  store.Set(key_prefix + "/host/" + std::to_string(rank),
            std::string(shm_field) + "\n" + (slot_here ? std::to_string(*slot_here) : "") + "\n" +
                HostIdentity() + "\n" + machine);
  // Rank r's value of `kind` (key_prefix/kind/r) by the set-up's deadline; a timeout names it
  // ("rank 3" + `missing`) and the set-up's whole timeout.
  const auto get_by_deadline = [&](const char* kind, int r, const char* missing) {
    try {
      return store.Get(key_prefix + "/" + kind + "/" + std::to_string(r), Left(deadline));
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kTimeout) throw;
      throw SetupTimedOut(rank, options.timeout,
                          "rank " + std::to_string(r) + missing + " (" + error.message() + ")");
    }
  };
  std::vector<std::string> identities;
  std::vector<std::string> slots;
  size_t ranks_on_machine = 0;
  std::vector<std::string> shm_fields;
  for (int r = 0; r < size; ++r) {
    const std::string all = get_by_deadline("host", r, "'s host record did not come");
    std::vector<std::string> fields;  // shm, slot, host; the machine is the rest
    size_t from = 0;
    for (size_t end; fields.size() < 3 && (end = all.find('\n', from)) != std::string::npos;) {
      fields.push_back(all.substr(from, end - from));
      from = end + 1;
    }
    if (fields.size() < 3) {
      throw Error(ErrorCode::kInternal, "rank " + std::to_string(rank) +
                                            ": malformed host record of rank " + std::to_string(r));
    }
    shm_fields.push_back(fields[0]);
    slots.push_back(fields[1]);
    identities.push_back(fields[2]);
    if (all.compare(from, std::string::npos, machine) == 0) ++ranks_on_machine;
  }
  Topology topology = Topology::FromIdentities(identities);
  const std::vector<int>& local = topology.hosts[size_t(topology.host_of[size_t(rank)])];
  // Shared memory only if every rank allows it ("0" turns it off for all) and every rank that
  // shares a host can use it: a rank alone on its host needs none.
  bool shm_allowed = true;
  int shm_unusable_on = -1;  // the first rank that cannot use shared memory ("n") and needs it
  for (int r = 0; r < size; ++r) {
    const std::string& field = shm_fields[size_t(r)];
    const bool alone = topology.hosts[size_t(topology.host_of[size_t(r)])].size() == 1;
    if (field == "1" || (field == "n" && alone)) continue;
    shm_allowed = false;
    if (field == "n" && shm_unusable_on < 0) shm_unusable_on = r;
  }

  if (shm_unusable_on >= 0 && local.size() >= 2) {
    // Once per process (a trainer that builds many communicators is told once).
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      const std::string line =
          "collectives: rank " + std::to_string(rank) + ": " +
          (shm_unusable.empty() ? "rank " + std::to_string(shm_unusable_on) +
                                      " cannot use shared memory (see its warning)"
                                : "shared memory cannot be used here (" + shm_unusable + ")") +
          ": AUTO runs every collective over TCP, on every rank\n";
      std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines of ranks do not mix
    }
  }

  // Every rank decides from the whole topology, so they decide alike: a rank alone on its host
  // takes part in the two levels of the others.
  size_t largest_host = 0;
  for (const auto& ranks : topology.hosts) largest_host = std::max(largest_host, ranks.size());
  Plan plan = Plan::kRing;
  if (shm_allowed && largest_host >= 2) {
    plan = topology.hosts.size() == 1 ? Plan::kShm : Plan::kTwoLevel;
  }
  // An error every rank reaches from the records above: each counts itself in the store before
  // it throws, and rank 0, whose process may serve the store, waits (10 s at most, and not past
  // the set-up's deadline) until every rank has, so that the others raise this error rather
  // than "store lost".
  const auto together = [&](Error error) {
    try {
      const std::string failed = key_prefix + "/host/failed";
      store.Add(failed, 1);
      const auto until =
          Clock::now() + std::min<Clock::duration>(Left(deadline), std::chrono::seconds(10));
      while (rank == 0 && store.Add(failed, 0) < size && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } catch (const std::exception&) {
      // The store is gone: the others find out from it.
    }
    return error;
  };
  const std::string& forced = options.algorithm;
  const auto refuse = [&](const std::string& why) {
    return together(Error(ErrorCode::kNotSupported,
                          "rank " + std::to_string(rank) + ": algorithm '" + forced + "' " + why));
  };
  if (forced == core::algorithm::kShm && plan != Plan::kShm) {
    throw refuse("needs every rank on one host, two ranks or more, and shared memory on");
  } else if (forced == core::algorithm::kTwoLevel && plan != Plan::kTwoLevel) {
    throw refuse("needs several hosts, one of them with two ranks or more, and shared memory on");
  } else if (ring::IsRingAlgorithm(forced)) {
    plan = Plan::kRing;  // the ring's algorithms over TCP, as forced
  } else if (!forced.empty() && forced != core::algorithm::kShm &&
             forced != core::algorithm::kTwoLevel) {
    throw refuse("is unknown (ring, recursive_doubling, halving_doubling, shm, two_level)");
  }

  std::unique_ptr<ShmGroup> group;
  // The steps' size and the small all-reduces' bound: a rank alone on its host cuts them as the
  // groups do.
  size_t slot_bytes = 0;
  size_t shm_small_bytes = 0;
  if (plan != Plan::kRing) {
    ShmGroupOptions shm;
    shm.job_id = job_id;
    shm.key_prefix = key_prefix;
    // Steps are cut at the slot size, within a host and between hosts alike: every rank must
    // have the same one.
    for (int r = 1; r < size; ++r) {
      if (slots[size_t(r)] == slots[0]) continue;
      const auto shown = [](const std::string& slot) { return slot.empty() ? "unset" : slot; };
      throw together(Error(ErrorCode::kInvalidArgument,
                           "rank " + std::to_string(rank) + ": COLLECTIVES_SHM_SLOT_BYTES is " +
                               shown(slots[0]) + " on rank 0 but " + shown(slots[size_t(r)]) +
                               " on rank " + std::to_string(r) + ": set it alike on every rank"));
    }
    if (slot_here && *slot_here > kMaxSlotBytes) {  // the same on every rank, checked above
      throw together(Error(ErrorCode::kInvalidArgument,
                           "rank " + std::to_string(rank) + ": COLLECTIVES_SHM_SLOT_BYTES is " +
                               std::to_string(*slot_here) + ", more than the " +
                               std::to_string(kMaxSlotBytes) + " bytes a slot may have"));
    }
    if (slot_here) shm.slot_bytes = static_cast<size_t>(*slot_here);
    slot_bytes = EffectiveSlotBytes(shm.slot_bytes);
    shm_small_bytes = EffectiveSmallBytes(shm.small_bytes, slot_bytes);
    // Busy-poll only when every rank on this machine can have a core (pretend hosts share
    // one machine's cores: a rank polling shared memory would starve its TCP partner).
    const int spin_us = options.spin_us >= 0 ? options.spin_us
                        : core::CoresFor(int(std::max(ranks_on_machine, local.size())))
                            ? ring::kDefaultSpinUs
                            : 0;
    shm.spin = std::chrono::microseconds(spin_us);
    shm.timeout = Left(deadline);
    std::optional<Error> failed;
    try {
      if (local.size() >= 2) group = ShmGroup::Create(rank, local, store, shm);
    } catch (const Error& error) {
      failed = error.code() == ErrorCode::kTimeout
                   ? SetupTimedOut(rank, options.timeout, error.message())
                   : error;
    } catch (const std::bad_alloc&) {  // before Create could report it: it raises Errors after
      failed = Error(ErrorCode::kSystem,
                     "rank " + std::to_string(rank) + ": shared memory: out of memory");
    } catch (const std::exception& error) {
      failed = Error(ErrorCode::kInternal,
                     "rank " + std::to_string(rank) + ": shared memory: " + error.what());
    }
    // A host's members learn of each other's failure through the store, but the other hosts
    // would not: they would go on to the mesh's first call and see a lost peer (or, when rank 0
    // failed, a lost store) naming neither shared memory nor the cause. So every rank publishes
    // how its group went and raises the first failure, the lowest rank's, with its code.
    store.Set(key_prefix + "/shm_outcome/" + std::to_string(rank),
              failed ? std::to_string(int(failed->code())) + "\n" + failed->message() : "ok");
    for (int r = 0; r < size; ++r) {
      const std::string outcome =
          get_by_deadline("shm_outcome", r, " did not say how its shared memory went");
      if (outcome == "ok") continue;
      if (r == rank) throw together(*failed);
      const size_t newline = outcome.find('\n');
      const int code = newline == std::string::npos ? 0 : std::atoi(outcome.c_str());
      const bool known =
          code >= int(ErrorCode::kInvalidArgument) && code <= int(ErrorCode::kInternal);
      std::string why = newline == std::string::npos ? outcome : outcome.substr(newline + 1);
      const std::string theirs = "rank " + std::to_string(r) + ": ";
      if (why.starts_with(theirs)) why.erase(0, theirs.size());  // said once, below
      throw together(Error(known ? ErrorCode(code) : ErrorCode::kInternal,
                           "rank " + std::to_string(rank) + ": " + theirs + core::OneLine(why)));
    }
  }
  // CUDA tensors: NCCL inside a host where some host has several ranks, unless a ring
  // algorithm is forced (then the staged ring runs them, as forced).
  std::unique_ptr<DevicePlan> device;
  if (lasting_store && largest_host >= 2 && !ring::IsRingAlgorithm(forced)) {
    device = CreateDevicePlan({rank, topology.hosts, topology.host_of, topology.local_index},
                              std::move(lasting_store), key_prefix, options);
  }
  auto planner = std::make_unique<HierarchicalPlanner>(
      rank, size, std::move(topology), std::move(group), plan,
      forced == core::algorithm::kTwoLevel, slot_bytes, shm_small_bytes, options);
  planner->SetDevicePlan(std::move(device));
  return planner;
}

void Calibrate(ring::Planner& base, CollectiveCommunication& comm, Clock::time_point deadline,
               std::chrono::milliseconds timeout) {
  auto* planner = dynamic_cast<HierarchicalPlanner*>(&base);
  if (planner == nullptr || planner->plan_ != Plan::kTwoLevel || planner->forced_) return;
  // Each candidate (two levels, and the flat ring's recursive doubling, halving-doubling where the
  // world is a power of two of at least 4, and ring), end to end through this communicator at
  // each of kCalibrationBytes, warmed up first (buffers, connections, pages), the fastest of 3
  // rounds, the slowest rank's figure (an all-reduce of the times, so every rank holds the same
  // numbers and decides alike). Every call ends by the set-up's deadline: a call's limit counts
  // from its start, so each gets what is left (setting it costs well under a microsecond, within
  // the noise of an 8 B all-reduce).
  const auto by_deadline = [&]() -> CollectiveCommunication& {
    comm.SetTimeout(Left(deadline));
    return comm;
  };
  std::vector<float> buffer(kCalibrationBytes.back() / sizeof(float), 0.0f);
  const auto round = [&](size_t count, int calls) {
    const Tensor t{buffer.data(), count, DataType::kFloat32};
    by_deadline().Barrier();
    const auto start = Clock::now();
    for (int i = 0; i < calls; ++i) by_deadline().AllReduce(t, ReduceOp::kSum);
    return std::chrono::duration<double>(Clock::now() - start).count() / calls;
  };
  constexpr size_t kSizes = kCalibrationBytes.size();
  constexpr int kRounds = 3;
  std::vector<Candidate> candidates;
  for (size_t c = 0; c < kCandidates; ++c) {
    if (Candidate(c) != Candidate::kHalvingDoubling || ring::HalvingDoublingRunsOn(comm.size())) {
      candidates.push_back(Candidate(c));
    }
  }
  double times[kCandidates * kSizes] = {};  // 0: not measured (cannot run here)
  try {
    for (const Candidate candidate : candidates) {
      planner->measuring_ = candidate;
      round(2, 3);  // warm-up
      round(buffer.size(), 1);
    }
    // Round by round, every candidate in turn, so that a burst of other work on the machine
    // slows every candidate alike; the fastest round counts (other work only adds time).
    for (size_t i = 0; i < kSizes; ++i) {
      const size_t bytes = kCalibrationBytes[i];
      // More calls where one is short, so that a round outlasts the clock's and the
      // scheduler's noise; one where it moves megabytes.
      const int calls = bytes <= 1024 ? 10 : bytes <= (size_t{1} << 20) ? 4 : 1;
      for (int r = 0; r < kRounds; ++r) {
        for (const Candidate candidate : candidates) {
          planner->measuring_ = candidate;
          double& best = times[size_t(candidate) * kSizes + i];
          const double t = round(bytes / sizeof(float), calls);
          best = r == 0 ? t : std::min(best, t);
        }
      }
    }
    planner->measuring_.reset();
    by_deadline().AllReduce(Tensor{times, kCandidates * kSizes, DataType::kFloat64},
                            ReduceOp::kMax);
  } catch (const Error& error) {
    if (error.code() != ErrorCode::kTimeout) throw;
    throw SetupTimedOut(comm.rank(), timeout, error.message());
  }
  comm.SetTimeout(timeout);
  for (size_t c = 0; c < kCandidates; ++c) {
    if (times[c * kSizes] <= 0) continue;
    std::vector<std::pair<size_t, double>> points;
    for (size_t i = 0; i < kSizes; ++i) {
      points.emplace_back(kCalibrationBytes[i], times[c * kSizes + i]);
    }
    planner->model_.Set(Candidate(c), CostCurve(std::move(points)));
  }
  planner->calibrated_ = true;
}

}  // namespace collectives::hierarchical
