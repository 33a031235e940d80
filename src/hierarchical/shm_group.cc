// ShmGroup's collectives: the step loop every one of them is made of (ShmGroup::Step: the
// waits, the tags, the checks between sleeps) and AllReduce, Broadcast, AllGather,
// ReduceScatter, their two-level halves, AnnounceOutside and Barrier. The protocol is described in
// shm_group.h, the segment's layout in shm_layout.h, its set-up and breaking in shm_segment.cc.
#include "src/hierarchical/shm_group.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <limits>
#include <span>
#include <string>

#include "src/core/kernels.h"
#include "src/core/work.h"
#include "src/hierarchical/shm_layout.h"
#include "src/transport/fabric_errors.h"

namespace collectives::hierarchical {
namespace {

// Step counters wrap; a is at or past b when the signed distance is not negative.
bool Reached(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

// Calls fn(in, out, at, n) for each stretch of bytes [offset, offset + bytes) of a message read
// from `send` and written into `recv` that lies in one run of each: n bytes at `in` and `out`,
// `at` bytes past `offset`. Two buffers are one call, and a message in place (one Runs as both)
// one call per run.
template <typename Fn>
void ForEachRun(const core::Runs& send, const core::Runs& recv, size_t offset, size_t bytes,
                Fn&& fn) {
  if (bytes == 0) return;
  if (send.contiguous() && recv.contiguous()) {
    fn(send.data() + offset, recv.data() + offset, size_t{0}, bytes);
    return;
  }
  size_t at = 0;
  if (&send == &recv) {
    recv.ForEach(offset, bytes, [&](uint8_t* data, size_t run) {
      fn(data, data, at, run);
      at += run;
    });
    return;
  }
  while (at < bytes) {
    const auto [in, in_run] = send.At(offset + at);
    const auto [out, out_run] = recv.At(offset + at);
    const size_t run = std::min({bytes - at, in_run, out_run});
    fn(in, out, at, run);
    at += run;
  }
}

}  // namespace

Part PartOf(size_t count, int parts, int part) {
  const size_t base = count / size_t(parts);
  const size_t extra = count % size_t(parts);
  const size_t p = size_t(part);
  return Part{p * base + std::min(p, extra), base + (p < extra ? 1 : 0)};
}

int CrossingOwners(size_t message_bytes, size_t small_bytes, int lanes) {
  return message_bytes <= small_bytes ? 1 : lanes;
}

// One collective's view of the group: its tag and deadline, and the waits and publications
// every algorithm is made of.
class ShmGroup::Step {
 public:
  Step(ShmGroup& group, const core::CallTag& tag, Clock::time_point deadline)
      : g_(group), seg_(*group.segment_), tag_(tag), wire_(WireTag::Of(tag)), deadline_(deadline) {
    ThrowIfBroken();
  }

  int me() const { return g_.index_; }
  int n() const { return g_.size(); }
  uint8_t* own_slot(uint32_t s) const { return seg_.slot(me(), s); }
  const uint8_t* slot(int j, uint32_t s) const { return seg_.slot(j, s); }

  // The next step's number; waits until this member may overwrite its buffer for it (every
  // member has finished the step before the last).
  uint32_t Begin(bool writes) {
    const uint32_t s = ++g_.step_;
    if (writes && !Reached(g_.known_done_, s - 2)) {
      for (int j = 0; j < n(); ++j) {
        if (j != me()) Await(j, &Control::done, s - 2, "the release of a shared slot");
      }
      g_.known_done_ = s - 2;
    }
    return s;
  }
  // This member's slot for step s holds its input.
  void Arrive(uint32_t s) {
    seg_.control(me()).tag[s & 1] = wire_;
    Publish(&Control::arrived, s);
  }
  // Member j's input for step s is in its slot and belongs to the same call.
  void AwaitArrival(int j, uint32_t s) {
    Await(j, &Control::arrived, s, "its input");
    const WireTag theirs = seg_.control(j).tag[s & 1];
    if (!(theirs == wire_)) {
      Fail(Error(ErrorCode::kMismatch,
                 "rank " + std::to_string(g_.rank_) + ": shared-memory step from rank " +
                     std::to_string(g_.members_[size_t(j)]) + " does not match: expected " +
                     tag_.ToString() + ", got " + theirs.ToTag().ToString()));
    }
  }
  void AwaitEveryArrival(uint32_t s) {
    for (int j = 0; j < n(); ++j) {
      if (j != me()) AwaitArrival(j, s);
    }
    if (!Reached(g_.known_done_, s - 1)) g_.known_done_ = s - 1;
  }
  void Reduced(uint32_t s) { Publish(&Control::reduced, s); }
  void AwaitReduced(int j, uint32_t s) { Await(j, &Control::reduced, s, "its reduced slice"); }
  void Done(uint32_t s) { Publish(&Control::done, s); }

  // Breaks the group with `error` (or the error that broke it first) and throws it.
  [[noreturn]] void Fail(const Error& error) { throw g_.BreakWith(error, deadline_); }

 private:
  void ThrowIfBroken() {
    if (seg_.header().broken.load(std::memory_order_acquire) != 0) throw g_.BrokenError(deadline_);
  }

  void Publish(std::atomic<uint32_t> Control::*word, uint32_t s) {
    Control& own = seg_.control(me());
    (own.*word).store(s, std::memory_order_seq_cst);
    if (own.sleepers.load(std::memory_order_seq_cst) != 0) FutexWakeAll(&(own.*word));
  }

  // Waits until member j's `word` reaches step s: polls for the spin budget, then sleeps on the
  // word in slices, checking the broken flag, the deadline and j's liveness between them.
  void Await(int j, std::atomic<uint32_t> Control::*word, uint32_t s, const char* what) {
    Control& theirs = seg_.control(j);
    std::atomic<uint32_t>& w = theirs.*word;
    const auto reached = [&] { return Reached(w.load(std::memory_order_acquire), s); };
    if (reached()) return;
    if (g_.spin_.count() > 0) {
      // Never past the deadline: a spin budget near the call's timeout would overshoot it.
      const auto left =
          std::chrono::duration_cast<std::chrono::microseconds>(deadline_ - Clock::now());
      const Header& header = seg_.header();
      if (core::SpinUntil(std::min(g_.spin_, left), [&] {
            if (reached()) return true;
            if (header.broken.load(std::memory_order_relaxed) != 0) ThrowIfBroken();
            return false;
          })) {
        return;
      }
    } else {
      // More members than cores: hand the core over (to the member we wait for, most likely)
      // for up to kShmYieldBudget before paying a futex sleep and wake-up. A bound in time, not
      // in polls: with two members per core a few yields are gone in microseconds while the
      // member on the other core still runs, and the futex wake-up then costs tens of them
      // (8-byte all-reduce, 4 ranks on 2 cores: 11-14 us with 16 yields, 3.4 us with 200 us).
      const auto left =
          std::chrono::duration_cast<std::chrono::microseconds>(deadline_ - Clock::now());
      if (core::YieldUntil(std::min(left, kShmYieldBudget), std::numeric_limits<int>::max(),
                           reached)) {
        return;
      }
    }
    for (;;) {
      CheckNoOutsideCall();
      theirs.sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t seen = w.load(std::memory_order_seq_cst);
      if (!Reached(seen, s)) FutexWait(&w, seen, kSleepSliceMs);
      theirs.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (Reached(w.load(std::memory_order_acquire), s)) return;
      ThrowIfBroken();
      // Every slice (a trylock in the segment, no system call): a member that is gone is found
      // within a slice, and is the cause even when the deadline has passed meanwhile.
      CheckAlive(j);
      if (Clock::now() >= deadline_) {
        // Member j reduces (or, a broadcast's root, releases) step s once every member arrived
        // at it: a member that has not holds j up, and is the one to name, not j.
        std::string from = std::string(what) + ", in shared memory) from rank " +
                           std::to_string(g_.members_[size_t(j)]);
        for (int k = 0; word == &Control::reduced && k < n(); ++k) {
          if (k != me() && k != j && !Reached(seg_.control(k).arrived.load(), s)) {
            from = "its input, which rank " + std::to_string(g_.members_[size_t(j)]) +
                   " waits for, in shared memory) from rank " +
                   std::to_string(g_.members_[size_t(k)]);
            break;
          }
        }
        Fail(Error(ErrorCode::kTimeout, "rank " + std::to_string(g_.rank_) +
                                            ": deadline passed while waiting for " +
                                            tag_.ToString() + " (" + from));
      }
    }
  }

  // Throws kMismatch when a member announced another call of this call's number outside the
  // group (AnnounceOutside): it will never arrive here. Read under the sequence lock; a member
  // that is changing its words (for this call or a later one) is left for the next look.
  void CheckNoOutsideCall() {
    for (int j = 0; j < n(); ++j) {
      if (j == me()) continue;
      Control& c = seg_.control(j);
      const uint64_t seq = c.outside_seq.load(std::memory_order_seq_cst);
      if (seq != wire_.seq + 1) continue;
      const WireTag theirs =
          WireTag::With(wire_.seq, c.outside_count.load(), c.outside_rest.load());
      if (c.outside_seq.load(std::memory_order_seq_cst) != seq || theirs == wire_) continue;
      Fail(Error(ErrorCode::kMismatch, "rank " + std::to_string(g_.rank_) + ": rank " +
                                           std::to_string(g_.members_[size_t(j)]) +
                                           " runs another call outside shared memory: expected " +
                                           tag_.ToString() + ", got " + theirs.ToTag().ToString()));
    }
  }

  // Throws kPeerLost when member j's process died or its communicator is gone.
  void CheckAlive(int j) {
    const char* reason = WhyGone(seg_.control(j));
    if (reason == nullptr) return;
    Fail(transport::PeerLostError(g_.rank_, g_.members_[size_t(j)], reason, &tag_, false));
  }

  ShmGroup& g_;
  Segment& seg_;
  const core::CallTag tag_;
  const WireTag wire_;
  const Clock::time_point deadline_;
};

void ShmGroup::AllReduce(const core::CallTag& tag, Clock::time_point deadline,
                         const core::Runs& send, const core::Runs& recv, DataType dtype,
                         ReduceOp op, const TwoLevelHooks& hooks) {
  // Refused on this member alone, before any step (the others would wait for it until their
  // deadline): the ring's entry hands over whole elements of a known dtype only.
  const size_t es = SizeOf(dtype);
  const auto check = [&](const uint8_t* data, size_t bytes) {
    if (bytes % es != 0 || data == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  "rank " + std::to_string(rank_) + ": all_reduce in runs: a run of " +
                      std::to_string(bytes) + " bytes is not a whole number of " + ToString(dtype) +
                      " elements, or has no data");
    }
  };
  send.ForEach(0, send.bytes(), check);
  if (&recv != &send) recv.ForEach(0, recv.bytes(), check);
  if (send.bytes() != recv.bytes()) {
    throw Error(ErrorCode::kInternal, "rank " + std::to_string(rank_) + ": all_reduce of " +
                                          std::to_string(send.bytes()) + " bytes into " +
                                          std::to_string(recv.bytes()));
  }
  const size_t count = recv.bytes() / es;
  const auto& cross = hooks.cross;
  const size_t avg_divisor = hooks.avg_divisor;
  const int lanes = hooks.lanes;
  Step step(*this, tag, deadline);
  const int n = size();
  const int me = index_;
  const ReduceOp kernel_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const size_t divisor = avg_divisor != 0 ? avg_divisor : size_t(n);

  if (count * es <= small_bytes_ && !cross) {
    // One synchronisation: everyone reduces everything, in member order, so the results are
    // identical bit for bit.
    const uint32_t s = step.Begin(true);
    send.Read(0, count * es, step.own_slot(s));
    step.Arrive(s);
    step.AwaitEveryArrival(s);
    ForEachRun(send, recv, 0, count * es, [&](const uint8_t*, uint8_t* out, size_t at, size_t run) {
      const size_t c = run / es;
      if (n == 1) {
        std::memmove(out, step.slot(0, s) + at, run);
      } else {
        core::Reduce(dtype, kernel_op, out, step.slot(0, s) + at, step.slot(1, s) + at, c);
        for (int j = 2; j < n; ++j)
          core::Reduce(dtype, kernel_op, out, out, step.slot(j, s) + at, c);
      }
      if (op == ReduceOp::kAvg) core::DivideInPlace(dtype, out, c, divisor);
    });
    step.Done(s);
    return;
  }

  // Who reduces: every member its slice; with a crossing, the members of the lanes across hosts
  // (all of them where every host has as many ranks), and for a small message the first member
  // alone (one crossing of the whole message beats n crossings of slivers).
  const int owners =
      cross ? CrossingOwners(count * es, small_bytes_, lanes > 0 ? std::min(lanes, n) : n) : n;
  const auto part_of = [owners](size_t c, int j) {
    return j < owners ? PartOf(c, owners, j) : Part{0, 0};
  };
  const size_t per_step = slot_bytes_ / es;
  size_t offset = 0;
  do {
    const size_t c = std::min(per_step, count - offset);
    const size_t step_begin = offset * es;  // in the message
    const uint32_t s = step.Begin(true);
    uint8_t* mine = step.own_slot(s);
    // This member's slice is reduced by this member alone, from every member's slot, so every
    // member ends with the same bits whatever the order. Without a crossing, its own input for
    // that slice is read straight from the caller's and the result written straight into the
    // caller's (then copied into the slot for the others): the slot only needs the other slices.
    const Part own = part_of(c, me);
    const size_t own_begin = own.offset * es, own_end = (own.offset + own.length) * es;
    if (cross) {
      send.Read(step_begin, c * es, mine);
    } else {
      send.Read(step_begin, own_begin, mine);
      send.Read(step_begin + own_end, c * es - own_end, mine + own_end);
    }
    step.Arrive(s);
    step.AwaitEveryArrival(s);
    // acc = first op (every other member's slot), in member order; `at` bytes into the slice.
    const auto reduce_own = [&](uint8_t* acc, const uint8_t* first, size_t at, size_t length) {
      bool reduced = false;
      for (int j = 0; j < n; ++j) {
        if (j == me) continue;
        core::Reduce(dtype, kernel_op, acc, reduced ? acc : first, step.slot(j, s) + own_begin + at,
                     length);
        reduced = true;
      }
      if (!reduced && acc != first) std::memcpy(acc, first, length * es);
    };
    if (own.length != 0 && cross) {
      uint8_t* acc = mine + own_begin;
      reduce_own(acc, acc, 0, own.length);
      cross(acc, own.length);
      if (op == ReduceOp::kAvg) core::DivideInPlace(dtype, acc, own.length, divisor);
      recv.Write(step_begin + own_begin, acc, own.length * es);
    } else if (own.length != 0) {
      ForEachRun(send, recv, step_begin + own_begin, own.length * es,
                 [&](const uint8_t* in, uint8_t* out, size_t at, size_t run) {
                   reduce_own(out, in, at, run / es);
                   if (op == ReduceOp::kAvg) core::DivideInPlace(dtype, out, run / es, divisor);
                   std::memcpy(mine + own_begin + at, out, run);
                 });
    }
    step.Reduced(s);
    for (int k = 1; k < n; ++k) {
      const int j = (me + k) % n;
      const Part part = part_of(c, j);
      if (part.length == 0) continue;
      step.AwaitReduced(j, s);
      recv.Write(step_begin + part.offset * es, step.slot(j, s) + part.offset * es,
                 part.length * es);
    }
    step.Done(s);
    offset += c;
  } while (offset < count);
}

void ShmGroup::Broadcast(const core::CallTag& tag, Clock::time_point deadline,
                         const core::Runs& send, const core::Runs& recv, int root,
                         const TwoLevelHooks& hooks) {
  const size_t bytes = recv.bytes();
  const auto& fill = hooks.fill;
  const auto& before_arrive = hooks.before_arrive;
  Step step(*this, tag, deadline);
  const bool is_root = root == index_;
  size_t offset = 0;
  do {
    const size_t c = std::min(slot_bytes_, bytes - offset);
    const uint32_t s = step.Begin(is_root);
    // Everyone publishes its call; the root checks every member's and then says so ("reduced"),
    // the others check the root's and wait for that word. A member that runs another call (or
    // names another root) breaks the group before anyone writes into a caller's buffer.
    if (is_root) {
      uint8_t* slot = step.own_slot(s);
      if (fill) {
        fill(slot, offset, c);
      } else {
        send.Read(offset, c, slot);
      }
      if (offset == 0 && before_arrive) before_arrive();
      step.Arrive(s);
      step.AwaitEveryArrival(s);
      step.Reduced(s);
      if (fill) {
        recv.Write(offset, slot, c);
      } else {
        ForEachRun(send, recv, offset, c, [](const uint8_t* in, uint8_t* out, size_t, size_t run) {
          if (in != out) std::memcpy(out, in, run);
        });
      }
    } else {
      if (offset == 0 && before_arrive) before_arrive();
      step.Arrive(s);
      step.AwaitArrival(root, s);
      step.AwaitReduced(root, s);
      recv.Write(offset, step.slot(root, s), c);
    }
    step.Done(s);
    offset += c;
  } while (offset < bytes);
}

void ShmGroup::AllGather(const core::CallTag& tag, Clock::time_point deadline, const void* send,
                         void* recv, size_t bytes) {
  Step step(*this, tag, deadline);
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  const int n = size();
  size_t offset = 0;
  do {
    const size_t c = std::min(slot_bytes_, bytes - offset);
    const uint32_t s = step.Begin(true);
    if (c != 0) std::memcpy(step.own_slot(s), in + offset, c);
    step.Arrive(s);
    step.AwaitEveryArrival(s);
    for (int j = 0; j < n && c != 0; ++j) {
      std::memmove(out + size_t(j) * bytes + offset, step.slot(j, s), c);
    }
    step.Done(s);
    offset += c;
  } while (offset < bytes);
}

void ShmGroup::AllGatherAcross(const core::CallTag& tag, Clock::time_point deadline, void* recv,
                               size_t block_bytes, int parts, const TwoLevelHooks& hooks) {
  const auto& fill = hooks.fill;
  const auto& rank_of = hooks.rank_of;
  Step step(*this, tag, deadline);
  auto* out = static_cast<uint8_t*>(recv);
  const int n = size();
  const size_t per_step = std::max<size_t>(1, slot_bytes_ / size_t(parts));
  size_t offset = 0;
  do {
    const size_t c = std::min(per_step, block_bytes - offset);
    const uint32_t s = step.Begin(true);
    if (c != 0) fill(step.own_slot(s), offset, c);
    step.Arrive(s);
    step.AwaitEveryArrival(s);
    for (int j = 0; j < n && c != 0; ++j) {
      for (int h = 0; h < parts; ++h) {
        std::memcpy(out + rank_of(h, j) * block_bytes + offset, step.slot(j, s) + size_t(h) * c, c);
      }
    }
    step.Done(s);
    offset += c;
  } while (offset < block_bytes);
}

void ShmGroup::ReduceScatter(const core::CallTag& tag, Clock::time_point deadline, const void* send,
                             void* recv, size_t count, DataType dtype, ReduceOp op) {
  RunReduceScatter(tag, deadline, send, recv, count, dtype, op, TwoLevelHooks{});
}

void ShmGroup::ReduceScatterAcross(const core::CallTag& tag, Clock::time_point deadline,
                                   const void* send, void* recv, size_t count, DataType dtype,
                                   ReduceOp op, const TwoLevelHooks& hooks) {
  const size_t es = SizeOf(dtype);
  const size_t blocks = hooks.order.size();
  if (blocks == 0 || blocks % size_t(size()) != 0 || blocks * es > slot_bytes_ ||
      !hooks.cross_lane) {
    throw Error(ErrorCode::kInternal,
                "rank " + std::to_string(rank_) +
                    ": reduce_scatter across hosts: " + std::to_string(blocks) + " blocks of " +
                    std::to_string(es) + "-byte elements do not fit the members' lanes and slots");
  }
  RunReduceScatter(tag, deadline, send, recv, count, dtype, op, hooks);
}

void ShmGroup::RunReduceScatter(const core::CallTag& tag, Clock::time_point deadline,
                                const void* send, void* recv, size_t count, DataType dtype,
                                ReduceOp op, const TwoLevelHooks& hooks) {
  const std::span<const int> order = hooks.order;
  const auto& cross = hooks.cross_lane;
  const size_t avg_divisor = hooks.avg_divisor != 0 ? hooks.avg_divisor : size_t(size());
  Step step(*this, tag, deadline);
  const size_t es = SizeOf(dtype);
  const auto* in = static_cast<const uint8_t*>(send);
  auto* out = static_cast<uint8_t*>(recv);
  const int n = size();
  const size_t blocks = order.empty() ? size_t(n) : order.size();
  const size_t per_lane = blocks / size_t(n);
  const ReduceOp kernel_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  // Each step carries the same c elements of every block, in member (or lane) order.
  const size_t per_step = std::max<size_t>(1, slot_bytes_ / (es * blocks));
  size_t offset = 0;
  do {
    const size_t c = std::min(per_step, count - offset);
    const uint32_t s = step.Begin(true);
    uint8_t* mine = step.own_slot(s);
    for (size_t k = 0; k < blocks && c != 0; ++k) {
      const size_t block = order.empty() ? k : size_t(order[k]);
      std::memcpy(mine + k * c * es, in + (block * count + offset) * es, c * es);
    }
    step.Arrive(s);
    step.AwaitEveryArrival(s);
    const size_t at = size_t(index_) * per_lane * c * es;
    uint8_t* dst = out + offset * es;
    if (cross) {
      // This member's lane, reduced into its own slot (no other member reads that part of it),
      // then across hosts into recv.
      uint8_t* partial = mine + at;
      for (int j = 0; j < n && c != 0; ++j) {
        if (j != index_)
          core::Reduce(dtype, kernel_op, partial, partial, step.slot(j, s) + at, per_lane * c);
      }
      cross(partial, c, dst);
    } else if (c != 0 && n == 1) {
      std::memmove(dst, step.slot(0, s) + at, c * es);
    } else if (c != 0) {
      // Its own block, straight into recv, in member order.
      core::Reduce(dtype, kernel_op, dst, step.slot(0, s) + at, step.slot(1, s) + at, c);
      for (int j = 2; j < n; ++j) core::Reduce(dtype, kernel_op, dst, dst, step.slot(j, s) + at, c);
    }
    if (op == ReduceOp::kAvg && c != 0) core::DivideInPlace(dtype, dst, c, avg_divisor);
    step.Done(s);
    offset += c;
  } while (offset < count);
}

void ShmGroup::AnnounceOutside(const core::CallTag& tag) {
  Control& own = segment_->control(index_);
  const WireTag wire = WireTag::Of(tag);
  own.outside_seq.store(0, std::memory_order_seq_cst);
  own.outside_count.store(wire.count, std::memory_order_seq_cst);
  own.outside_rest.store(wire.Rest(), std::memory_order_seq_cst);
  own.outside_seq.store(wire.seq + 1, std::memory_order_seq_cst);
}

void ShmGroup::Barrier(const core::CallTag& tag, Clock::time_point deadline) {
  Step step(*this, tag, deadline);
  const uint32_t s = step.Begin(false);
  step.Arrive(s);
  step.AwaitEveryArrival(s);
  step.Done(s);
}

}  // namespace collectives::hierarchical
