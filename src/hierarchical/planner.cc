// The AUTO planner: topology, the shared-memory group, and the choice per call.
#include "src/hierarchical/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <thread>
#include <utility>

#include "src/hierarchical/shm_group.h"
#include "src/ring/algorithms.h"

namespace collectives::hierarchical {
namespace {

// A view of some ranks of a fabric as a fabric of their own (the ranks of one local index
// across hosts). Connections are the parent's, so frames still carry the parent's call tags.
class SubFabric final : public transport::Fabric {
 public:
  SubFabric(transport::Fabric& parent, const std::vector<int>& ranks, int me)
      : parent_(parent), ranks_(ranks), me_(me) {}
  int rank() const override { return me_; }
  int size() const override { return int(ranks_.size()); }
  transport::Connection& connection(int peer) override {
    return parent_.connection(ranks_[size_t(peer)]);
  }
  void SetDeadline(transport::Clock::time_point deadline) override {
    parent_.SetDeadline(deadline);
  }
  void SetSpin(std::chrono::microseconds spin) override { parent_.SetSpin(spin); }
  void Abort(const Error& error) override { parent_.Abort(error); }

 private:
  transport::Fabric& parent_;
  const std::vector<int>& ranks_;
  const int me_;
};

enum class Plan { kRing, kShm, kTwoLevel };

int CeilLog2(int p) {
  int steps = 0;
  while ((1 << steps) < p) ++steps;
  return steps;
}

// Measures this rank's LinkCosts: round trips of 8 B and 1 MiB with the rank of the same local
// index on the neighbouring host (hosts paired 0-1, 2-3, ...; the last of an odd number of
// hosts measures no link and leaves it to the others), barriers and one copy in shared memory. Frames carry a tag no collective uses (sequence numbers count up from 0).
LinkCosts MeasureOwnCosts(int rank, transport::Fabric& fabric, ShmGroup& group,
                          const Topology& topology, std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  LinkCosts costs;
  const auto deadline = Clock::now() + timeout;
  fabric.SetDeadline(deadline);
  const int host = topology.host_of[size_t(rank)];
  const int partner_host = host % 2 == 0 ? host + 1 : host - 1;
  const auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  if (partner_host < int(topology.hosts.size())) {
    const int partner =
        topology.hosts[size_t(partner_host)][size_t(topology.local_index[size_t(rank)])];
    transport::Connection& link = fabric.connection(partner);
    std::vector<uint8_t> buffer(1 << 20);
    const auto one_way = [&](size_t bytes, int rounds) {
      const core::CallTag tag{UINT64_MAX - 1, core::CallDescriptor{core::CollectiveKind::kBarrier,
                                                                   DataType::kUInt8,
                                                                   ReduceOp::kSum, 0, bytes}};
      const auto start = Clock::now();
      for (int i = 0; i < rounds; ++i) {
        if (host < partner_host) {
          link.WaitSend(link.PostSend(tag, buffer.data(), bytes));
          link.WaitRecv(link.PostRecv(tag, buffer.data(), bytes));
        } else {
          link.WaitRecv(link.PostRecv(tag, buffer.data(), bytes));
          link.WaitSend(link.PostSend(tag, buffer.data(), bytes));
        }
      }
      return seconds(Clock::now() - start) / (2.0 * rounds);
    };
    one_way(8, 5);  // warm-up
    costs.net_latency = one_way(8, 20);
    const double big = one_way(buffer.size(), 4);
    costs.net_bandwidth = double(buffer.size()) / std::max(big - costs.net_latency, 1e-9);
  }
  const core::CallTag barrier{UINT64_MAX - 2, core::CallDescriptor{
                                                  core::CollectiveKind::kBarrier,
                                                  DataType::kUInt8, ReduceOp::kSum, 0, 0}};
  for (int i = 0; i < 5; ++i) group.Barrier(barrier, deadline);
  auto start = Clock::now();
  for (int i = 0; i < 20; ++i) group.Barrier(barrier, deadline);
  costs.shm_latency = seconds(Clock::now() - start) / 20.0;
  std::vector<uint8_t> from(4 << 20, 1), to(4 << 20);
  std::memcpy(to.data(), from.data(), from.size());
  start = Clock::now();
  std::memcpy(to.data(), from.data(), from.size());
  costs.shm_bandwidth = double(from.size()) / std::max(seconds(Clock::now() - start), 1e-9);
  return costs;
}

// Every rank's figures through the store; the slowest of each, so that every rank decides alike.
LinkCosts AgreeOnCosts(int rank, int size, Store& store, const std::string& key_prefix,
                       const LinkCosts& own, std::chrono::milliseconds timeout) {
  std::ostringstream out;
  out.precision(17);
  out << own.net_latency << ' ' << own.net_bandwidth << ' ' << own.shm_latency << ' '
      << own.shm_bandwidth;
  store.Set(key_prefix + "/costs/" + std::to_string(rank), out.str());
  LinkCosts agreed{0, 1e300, 0, 1e300};
  for (int r = 0; r < size; ++r) {
    std::istringstream in(store.Get(key_prefix + "/costs/" + std::to_string(r), timeout));
    LinkCosts c;
    in >> c.net_latency >> c.net_bandwidth >> c.shm_latency >> c.shm_bandwidth;
    agreed.net_latency = std::max(agreed.net_latency, c.net_latency);
    if (c.net_latency > 0) agreed.net_bandwidth = std::min(agreed.net_bandwidth, c.net_bandwidth);
    agreed.shm_latency = std::max(agreed.shm_latency, c.shm_latency);
    agreed.shm_bandwidth = std::min(agreed.shm_bandwidth, c.shm_bandwidth);
  }
  return agreed;
}

class HierarchicalPlanner final : public ring::Planner {
 public:
  HierarchicalPlanner(int rank, int size, Topology topology, std::unique_ptr<ShmGroup> group,
                      Plan plan, bool forced, const LinkCosts& costs,
                      const CommunicationOptions& options)
      : rank_(rank),
        size_(size),
        topology_(std::move(topology)),
        group_(std::move(group)),
        plan_(plan),
        forced_(forced),
        costs_(costs),
        small_message_bytes_(options.small_message_bytes ? options.small_message_bytes
                                                         : ring::kDefaultSmallMessageBytes),
        medium_message_bytes_(options.medium_message_bytes ? options.medium_message_bytes
                                                           : ring::kDefaultMediumMessageBytes) {
    // The ranks of this rank's local index, one per host, and this rank's place among them.
    const int local = topology_.local_index[size_t(rank)];
    for (size_t h = 0; h < topology_.hosts.size(); ++h) {
      if (topology_.host_of[size_t(rank)] == int(h)) cross_me_ = int(cross_ranks_.size());
      cross_ranks_.push_back(topology_.hosts[h][size_t(local)]);
    }
  }

  Body AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    if (plan_ == Plan::kShm) {
      ShmGroup* group = group_.get();
      return [group, send, recv, op](ring::Context& ctx) {
        group->AllReduce(ctx.tag, ctx.deadline, send.data, recv.data, send.count, send.dtype, op);
      };
    }
    if (plan_ == Plan::kTwoLevel && TwoLevelPays(send.bytes())) {
      // Inside the host: each local rank reduces its slice of every step; across hosts: the
      // ranks of each local index all-reduce their slices at once (all of a host's ranks cross
      // the network together, each with 1/L of the bytes); inside the host again: everyone
      // copies every slice out. kAvg sums across hosts and divides once by the world size.
      ShmGroup* group = group_.get();
      const std::vector<int>* cross_ranks = &cross_ranks_;
      const int cross_me = cross_me_;
      const size_t small = small_message_bytes_;
      const size_t world = size_t(size_);
      return [=](ring::Context& ctx) {
        SubFabric sub(ctx.fabric, *cross_ranks, cross_me);
        ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
        const ReduceOp cross_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
        const size_t es = SizeOf(send.dtype);
        const auto hook = [&](void* slice, size_t count) {
          if (count * es <= small) {
            ring::RecursiveDoublingAllReduce(cross, slice, slice, count, send.dtype, cross_op);
          } else {
            ring::RingAllReduce(cross, slice, slice, count, send.dtype, cross_op);
          }
        };
        group->AllReduce(ctx.tag, ctx.deadline, send.data, recv.data, send.count, send.dtype, op,
                         hook, world);
      };
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
    // Two levels, pipelined step by step: the ranks of the root's local index (one per host)
    // carry each step across hosts (a tree for small steps, a chain for large ones) straight
    // into their slots, and each of them broadcasts it inside its host from there.
    const int root_host = topology_.host_of[size_t(root)];
    const bool crosses = topology_.local_index[size_t(rank_)] == root_index;
    const std::vector<int>* cross_ranks = &cross_ranks_;
    const int cross_me = cross_me_;
    const size_t small = small_message_bytes_;
    return [=](ring::Context& ctx) {
      if (!crosses) {
        group->Broadcast(ctx.tag, ctx.deadline, nullptr, recv.data, recv.bytes(), root_index);
        return;
      }
      SubFabric sub(ctx.fabric, *cross_ranks, cross_me);
      ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
      const auto* from = static_cast<const uint8_t*>(source);
      const auto fill = [&](uint8_t* slot, size_t offset, size_t bytes) {
        const void* send = from != nullptr ? from + offset : nullptr;
        if (bytes <= small) {
          ring::TreeBroadcast(cross, send, slot, bytes, root_host);
        } else {
          ring::ChainBroadcast(cross, send, slot, bytes, root_host);
        }
      };
      group->Broadcast(ctx.tag, ctx.deadline, source, recv.data, recv.bytes(), root_index, fill);
    };
  }

  Body AllGather(const Tensor& send, const Tensor& recv) override {
    if (plan_ != Plan::kShm) return {};
    ShmGroup* group = group_.get();
    return [group, send, recv](ring::Context& ctx) {
      group->AllGather(ctx.tag, ctx.deadline, send.data, recv.data, send.bytes());
    };
  }

  Body ReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    if (plan_ != Plan::kShm) return {};
    ShmGroup* group = group_.get();
    return [group, send, recv, op](ring::Context& ctx) {
      group->ReduceScatter(ctx.tag, ctx.deadline, send.data, recv.data, recv.count, recv.dtype,
                           op);
    };
  }

  Body Barrier() override {
    if (plan_ != Plan::kShm) return {};
    ShmGroup* group = group_.get();
    return [group](ring::Context& ctx) { group->Barrier(ctx.tag, ctx.deadline); };
  }

  std::string AllReduceAlgorithm(size_t bytes) const override {
    switch (plan_) {
      case Plan::kShm: return bytes <= group_->small_bytes() ? "shm_small" : "shm";
      case Plan::kTwoLevel: return TwoLevelPays(bytes) ? "two_level" : "";
      case Plan::kRing: return "";
    }
    return "";
  }

  void Abort(const Error& error) override {
    if (group_) group_->Abort(error);
  }

 private:
  // Whether the two-level plan beats the flat ring at this size by the measured costs (always
  // when forced).
  bool TwoLevelPays(size_t bytes) const {
    if (forced_) return true;
    return TwoLevelAllReduceCost(costs_, topology_, bytes, group_->slot_bytes(),
                                 group_->small_bytes()) <=
           FlatAllReduceCost(costs_, topology_, bytes, small_message_bytes_,
                             medium_message_bytes_);
  }

  const int rank_;
  const int size_;
  const Topology topology_;
  const std::unique_ptr<ShmGroup> group_;  // null without shared memory
  const Plan plan_;
  const bool forced_;  // options.algorithm named the plan
  const LinkCosts costs_;
  const size_t small_message_bytes_;
  const size_t medium_message_bytes_;
  std::vector<int> cross_ranks_;
  int cross_me_ = 0;
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

double FlatAllReduceCost(const LinkCosts& c, const Topology& topology, size_t bytes,
                         size_t small_message_bytes, size_t medium_message_bytes) {
  const int p = int(topology.host_of.size());
  if (p <= 1) return 0;
  const double n = double(bytes);
  const bool power_of_two = (p & (p - 1)) == 0;
  // Every step is taken as crossing hosts; the L ranks of a host share its link.
  const double beta = c.net_bandwidth / double(topology.hosts.front().size());
  if (bytes <= small_message_bytes) {
    const int steps = CeilLog2(p) + (power_of_two ? 0 : 1);
    return steps * (c.net_latency + n / beta);
  }
  const double volume = 2.0 * (p - 1) / p * n / beta;
  if (power_of_two && p >= 4 && bytes <= medium_message_bytes) {
    return 2.0 * CeilLog2(p) * c.net_latency + volume;
  }
  return 2.0 * (p - 1) * c.net_latency + volume;
}

double TwoLevelAllReduceCost(const LinkCosts& c, const Topology& topology, size_t bytes,
                             size_t slot_bytes, size_t small_bytes) {
  const int hosts = int(topology.hosts.size());
  const double local = double(topology.hosts.front().size());
  const double n = double(bytes);
  const double steps = std::max(1.0, std::ceil(n / double(slot_bytes)));
  // Inside: three synchronisations per step; a copy in, a reduction of 1/L of the step from L
  // slots, a copy out.
  const double inside = 3.0 * steps * c.shm_latency + 3.0 * n / c.shm_bandwidth;
  // Across: the first local rank alone for a small message, else all L ranks at once, each
  // with 1/L of the bytes over the shared link (recursive doubling or the ring among hosts).
  const bool leader = bytes <= small_bytes;
  const double per_rank = leader ? n : n / local;
  const double share = leader ? c.net_bandwidth : c.net_bandwidth / local;
  double across;
  if (per_rank / steps <= 64.0 * 1024) {
    across = steps * CeilLog2(hosts) * c.net_latency + CeilLog2(hosts) * per_rank / share;
  } else {
    across = steps * 2.0 * (hosts - 1) * c.net_latency +
             2.0 * (hosts - 1) / hosts * per_rank / share;
  }
  return inside + across;
}

std::unique_ptr<ring::Planner> CreatePlanner(int rank, int size, transport::Fabric& fabric,
                                             Store& store,
                                             const std::string& job_id,
                                             const std::string& key_prefix,
                                             const CommunicationOptions& options) {
  store.Set(key_prefix + "/host/" + std::to_string(rank), HostIdentity());
  std::vector<std::string> identities;
  for (int r = 0; r < size; ++r) {
    identities.push_back(store.Get(key_prefix + "/host/" + std::to_string(r), options.timeout));
  }
  Topology topology = Topology::FromIdentities(identities);
  const std::vector<int>& local = topology.hosts[size_t(topology.host_of[size_t(rank)])];

  const char* shm_env = std::getenv("COLLECTIVES_SHM");
  const bool shm_allowed = shm_env == nullptr || std::string(shm_env) != "0";
  // Every rank decides from the same facts: the topology, and whether shared memory is on
  // (which the launcher sets alike for every rank).
  Plan plan = Plan::kRing;
  if (shm_allowed && local.size() >= 2) {
    if (topology.hosts.size() == 1) {
      plan = Plan::kShm;
    } else if (topology.Uniform()) {
      plan = Plan::kTwoLevel;
    }
  }
  const std::string& forced = options.algorithm;
  const auto refuse = [&](const std::string& why) {
    return Error(ErrorCode::kNotSupported, "rank " + std::to_string(rank) + ": algorithm '" +
                                               forced + "' " + why);
  };
  if (forced == "shm" && plan != Plan::kShm) {
    throw refuse("needs every rank on one host and shared memory on");
  } else if (forced == "two_level" && plan != Plan::kTwoLevel) {
    throw refuse("needs several hosts of as many ranks each (two or more) and shared memory on");
  } else if (ring::IsRingAlgorithm(forced)) {
    plan = Plan::kRing;  // the ring's algorithms over TCP, as forced
  } else if (!forced.empty() && forced != "shm" && forced != "two_level") {
    throw refuse("is unknown (ring, recursive_doubling, halving_doubling, shm, two_level)");
  }

  std::unique_ptr<ShmGroup> group;
  if (plan != Plan::kRing) {
    ShmGroupOptions shm;
    shm.job_id = job_id;
    shm.key_prefix = key_prefix;
    shm.timeout = options.timeout;
    // Busy-poll only when every rank of the host can have a core.
    const unsigned cores = std::thread::hardware_concurrency();
    const int spin_us = options.spin_us >= 0 ? options.spin_us
                        : cores >= local.size() ? ring::kDefaultSpinUs
                                                : 0;
    shm.spin = std::chrono::microseconds(spin_us);
    group = ShmGroup::Create(rank, local, store, shm);
  }
  LinkCosts costs;
  const bool two_level_forced = forced == "two_level";
  if (plan == Plan::kTwoLevel && !two_level_forced) {
    costs = AgreeOnCosts(rank, size, store, key_prefix,
                         MeasureOwnCosts(rank, fabric, *group, topology, options.timeout),
                         options.timeout);
  }
  return std::make_unique<HierarchicalPlanner>(rank, size, std::move(topology), std::move(group),
                                               plan, two_level_forced, costs, options);
}

}  // namespace collectives::hierarchical
