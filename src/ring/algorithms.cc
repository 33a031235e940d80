// The RING algorithms: ring all-reduce, reduce-scatter and all-gather, chain and tree
// broadcast, recursive-doubling all-reduce and barrier.
//
// Conventions shared by the ring algorithms. Ranks form the ring 0 -> 1 -> ... -> n-1 -> 0;
// every rank sends to its right neighbour and receives from its left one. A tensor of `count`
// elements is cut into n blocks of near-equal size (the first count % n blocks get one element
// more); each block is cut into `chunks` near-equal chunks of at most chunk_bytes, so that while
// chunk k is on the wire, chunk k+1 is being received and chunk k-1 reduced. Every frame carries
// the call's tag; a zero-length chunk still travels as a header-only frame, so the frame
// schedule depends only on (count, n, chunk_bytes) and a mismatch is caught on the first frame.
#include "src/ring/algorithms.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "src/core/kernels.h"

namespace collectives::ring {
namespace {

using transport::Connection;

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

// (a mod n) for a possibly negative a.
int Mod(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

// `count` items cut into `parts` near-equal ranges; the first count % parts get one more.
struct Split {
  size_t count;
  size_t parts;
  size_t Offset(size_t i) const { return i * (count / parts) + std::min(i, count % parts); }
  size_t Length(size_t i) const { return count / parts + (i < count % parts ? 1 : 0); }
};

struct Range {
  size_t offset;  // elements
  size_t length;  // elements
};

// dst = src, unless the call is in place (same memory) or empty.
void CopyUnlessSame(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memcpy(dst, src, bytes);
}

// Receives items 0, 1, 2, ... from one connection, in order, with up to kStagingSlots receives
// posted ahead of the one waited on. `where(t)` gives item t's destination and bytes. Wait(t)
// posts items up to t + kStagingSlots - 1 before waiting for t, so an item that lands in staging
// slot t % kStagingSlots is posted only after its slot's previous item (t - kStagingSlots) was
// waited on and, by then, consumed: the caller must be done with item t - 1 when it calls
// Wait(t).
template <typename Where>
class ReceiveWindow {
 public:
  ReceiveWindow(Connection& from, const core::CallTag& tag, size_t items, Where where)
      : from_(from), tag_(tag), items_(items), where_(where) {}

  void Wait(size_t t) {
    for (; posted_ < items_ && posted_ < t + kStagingSlots; ++posted_) {
      const auto [data, bytes] = where_(posted_);
      ticket_[posted_ % kStagingSlots] = from_.PostRecv(tag_, data, bytes);
    }
    from_.WaitRecv(ticket_[t % kStagingSlots]);
  }

 private:
  Connection& from_;
  const core::CallTag& tag_;
  const size_t items_;
  Where where_;
  size_t posted_ = 0;
  std::array<uint64_t, kStagingSlots> ticket_{};
};

struct Destination {
  uint8_t* data;
  size_t bytes;
};

}  // namespace

uint8_t* Staging::Get(size_t bytes) {
  if (bytes > bytes_) {
    data_ = std::make_unique_for_overwrite<uint8_t[]>(bytes);
    bytes_ = bytes;
  }
  return data_.get();
}

// Ring all-reduce.
//
// Schedule: 2(n-1) steps. At step s rank r sends block (r - s) mod n and receives block
// (r - s - 1) mod n. Steps 0 .. n-2 are the reduce-scatter: the received chunk lands in a
// staging slot and is reduced with this rank's own contribution (from `send`) into `recv`; after
// step n-2 rank r holds the final value of block (r + 1) mod n (divided by n for kAvg). Steps
// n-1 .. 2n-3 are the all-gather: chunks are received straight into `recv`. Every chunk
// received at step s is forwarded at step s+1 as soon as it is ready, so sending, receiving
// and reducing overlap across chunks.
//
// Items t = s * chunks + c are processed in order. Up to kStagingSlots receives are posted
// ahead; item t uses staging slot t % kStagingSlots, which is free again once item t is
// reduced. Sends never wait on anything but their data, so there is no cycle of waits.
// Step 0 sends straight from `send`; later steps send from `recv`, which is why the result is
// the same bits on every rank (block b's final value is computed once, by its owner).
void RingAllReduce(Context& ctx, const void* send_ptr, void* recv_ptr, size_t count,
                   DataType dtype, ReduceOp op) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t es = SizeOf(dtype);
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  if (n == 1) return CopyUnlessSame(recv, send, count * es);

  const Split blocks{count, static_cast<size_t>(n)};
  const size_t chunks = std::max<size_t>(1, CeilDiv(blocks.Length(0) * es, ctx.chunk_bytes));
  const size_t slot_bytes = CeilDiv(blocks.Length(0), chunks) * es;
  uint8_t* staging = ctx.staging.Get(slot_bytes * kStagingSlots);
  const size_t steps = 2 * static_cast<size_t>(n - 1);
  const size_t items = steps * chunks;

  auto chunk_of = [&](int block, size_t c) {
    const Split in_block{blocks.Length(block), chunks};
    return Range{blocks.Offset(block) + in_block.Offset(c), in_block.Length(c)};
  };
  auto recv_block = [&](size_t s) { return Mod(int64_t{r} - int64_t(s) - 1, n); };

  Connection& right = ctx.right();
  Connection& left = ctx.left();
  uint64_t last_send = 0;
  for (size_t c = 0; c < chunks; ++c) {
    const Range chunk = chunk_of(r, c);
    last_send = right.PostSend(ctx.tag, send + chunk.offset * es, chunk.length * es);
  }

  ReceiveWindow window(left, ctx.tag, items, [&](size_t t) {
    const size_t s = t / chunks;
    const Range chunk = chunk_of(recv_block(s), t % chunks);
    uint8_t* dst = s < static_cast<size_t>(n - 1) ? staging + (t % kStagingSlots) * slot_bytes
                                                  : recv + chunk.offset * es;
    return Destination{dst, chunk.length * es};
  });

  for (size_t t = 0; t < items; ++t) {
    window.Wait(t);
    const size_t s = t / chunks;
    const Range chunk = chunk_of(recv_block(s), t % chunks);
    uint8_t* out = recv + chunk.offset * es;
    if (s < static_cast<size_t>(n - 1)) {
      core::Reduce(dtype, op, out, send + chunk.offset * es,
                   staging + (t % kStagingSlots) * slot_bytes, chunk.length);
      if (s == static_cast<size_t>(n - 2) && op == ReduceOp::kAvg) {
        core::DivideInPlace(dtype, out, chunk.length, n);
      }
    }
    if (s + 1 < steps) last_send = right.PostSend(ctx.tag, out, chunk.length * es);
  }
  right.WaitSend(last_send);
}

// Recursive-doubling all-reduce.
//
// Let p2 be the largest power of two <= n and rem = n - p2. Fold: among ranks 0 .. 2*rem-1,
// each even rank sends its vector to the odd rank above it and drops out; the odd rank reduces
// the two. The p2 remaining ranks (virtual rank v) then run log2(p2) rounds: in round k, v
// exchanges its whole vector with v ^ 2^k and reduces. Unfold: each odd rank sends the result to
// the even rank that dropped out. Every reduction is computed as (lower rank's data) op (higher
// rank's data) on both partners, so every rank ends with the same bits. Partial results stay in
// staging and only the last round writes the caller's buffer, so a call that fails (a mismatch
// found at any round, a lost peer) leaves that buffer untouched.
void RecursiveDoublingAllReduce(Context& ctx, const void* send_ptr, void* recv_ptr, size_t count,
                                DataType dtype, ReduceOp op) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t bytes = count * SizeOf(dtype);
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  if (n == 1) {
    CopyUnlessSame(recv, send, bytes);
    return;
  }
  // Partial results live in `acc` (staging), never in `recv`: the last reduction writes `recv`,
  // so a call that fails part-way (a mismatch, a lost peer) leaves the caller's buffer as it was.
  uint8_t* const acc = ctx.staging.Get(2 * bytes);
  uint8_t* const other = acc + bytes;
  const uint8_t* current = send;  // this rank's partial result so far

  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  const int rem = n - p2;
  int virtual_rank;
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      Connection& partner = ctx.peer(r + 1);
      partner.WaitSend(partner.PostSend(ctx.tag, send, bytes));
      partner.WaitRecv(partner.PostRecv(ctx.tag, recv, bytes));
      return;
    }
    Connection& partner = ctx.peer(r - 1);
    partner.WaitRecv(partner.PostRecv(ctx.tag, other, bytes));
    core::Reduce(dtype, op, acc, other, send, count);
    current = acc;
    virtual_rank = r / 2;
  } else {
    virtual_rank = r - rem;
  }

  auto real_rank = [rem](int v) { return v < rem ? 2 * v + 1 : v + rem; };
  for (int mask = 1; mask < p2; mask <<= 1) {
    const int partner_rank = real_rank(virtual_rank ^ mask);
    Connection& partner = ctx.peer(partner_rank);
    const uint64_t sent = partner.PostSend(ctx.tag, current, bytes);
    const uint64_t received = partner.PostRecv(ctx.tag, other, bytes);
    partner.WaitRecv(received);
    partner.WaitSend(sent);
    uint8_t* out = mask * 2 < p2 ? acc : recv;  // the last round writes the caller's buffer
    if (partner_rank < r) {
      core::Reduce(dtype, op, out, other, current, count);
    } else {
      core::Reduce(dtype, op, out, current, other, count);
    }
    current = out;
  }
  if (op == ReduceOp::kAvg) core::DivideInPlace(dtype, recv, count, n);
  if (r < 2 * rem) {
    Connection& partner = ctx.peer(r - 1);
    partner.WaitSend(partner.PostSend(ctx.tag, recv, bytes));
  }
}

// Halving-doubling (Rabenseifner) all-reduce, for a power-of-two world size p.
//
// The tensor is cut into p blocks (block b near-equal, as in the ring). Reduce-scatter by
// recursive halving: rank r starts responsible for blocks [0, p); in the step with distance
// d = p/2, p/4, ..., 1 it exchanges with partner r ^ d, keeps the half of its current range
// whose blocks have bit d equal to its own (the lower half when r & d == 0), sends the other
// half from `recv`, receives the partner's contribution to the kept half chunk by chunk through
// the staging slots, and reduces it into `recv`. After log2(p) steps rank r holds the final
// value of block r (divided by p for kAvg), computed there alone, so every rank ends with the
// same bits. All-gather by recursive doubling: with d = 1, 2, ..., p/2 rank r sends its range to
// r ^ d and receives the adjacent range of the same size straight into `recv`. Each exchange is
// cut into chunks of at most chunk_bytes; sends are posted at once and never wait on receives,
// so the two partners of a step cannot block each other.
void HalvingDoublingAllReduce(Context& ctx, const void* send_ptr, void* recv_ptr, size_t count,
                              DataType dtype, ReduceOp op) {
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t es = SizeOf(dtype);
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  if (p == 1) return CopyUnlessSame(recv, send, count * es);

  const Split blocks{count, static_cast<size_t>(p)};
  // Elements of blocks [lo, hi).
  auto span = [&](int lo, int hi) {
    return Range{blocks.Offset(size_t(lo)), blocks.Offset(size_t(hi)) - blocks.Offset(size_t(lo))};
  };
  const size_t slot_elems = std::max<size_t>(1, ctx.chunk_bytes / es);
  uint8_t* staging = ctx.staging.Get(slot_elems * es * kStagingSlots);

  // Sends `give` (read from `source`) to `partner` and receives the partner's frames for `take`,
  // both cut into chunks of at most slot_elems. With `reduce`, a received chunk lands in a
  // staging slot and recv[take] = source[take] op it; without, it lands in recv directly.
  // `source` is `send` in the first step (so an out-of-place call needs no copy) and `recv` after.
  auto exchange = [&](Connection& partner, const uint8_t* source, Range give, Range take,
                      bool reduce) {
    const Split give_chunks{give.length, std::max<size_t>(1, CeilDiv(give.length, slot_elems))};
    const Split take_chunks{take.length, std::max<size_t>(1, CeilDiv(take.length, slot_elems))};
    uint64_t last_send = 0;
    for (size_t c = 0; c < give_chunks.parts; ++c) {
      last_send = partner.PostSend(ctx.tag, source + (give.offset + give_chunks.Offset(c)) * es,
                                   give_chunks.Length(c) * es);
    }
    ReceiveWindow window(partner, ctx.tag, take_chunks.parts, [&](size_t c) {
      uint8_t* dst = reduce ? staging + (c % kStagingSlots) * slot_elems * es
                            : recv + (take.offset + take_chunks.Offset(c)) * es;
      return Destination{dst, take_chunks.Length(c) * es};
    });
    for (size_t c = 0; c < take_chunks.parts; ++c) {
      window.Wait(c);
      if (reduce) {
        const size_t offset = (take.offset + take_chunks.Offset(c)) * es;
        const uint8_t* theirs = staging + (c % kStagingSlots) * slot_elems * es;
        // (lower rank's data) op (higher rank's data), as everywhere in this file.
        if (partner.peer() < r) {
          core::Reduce(dtype, op, recv + offset, theirs, source + offset, take_chunks.Length(c));
        } else {
          core::Reduce(dtype, op, recv + offset, source + offset, theirs, take_chunks.Length(c));
        }
      }
    }
    partner.WaitSend(last_send);
  };

  int lo = 0;
  int hi = p;
  for (int d = p / 2; d >= 1; d /= 2) {
    const int mid = lo + (hi - lo) / 2;
    const bool keep_lower = (r & d) == 0;
    const Range keep = keep_lower ? span(lo, mid) : span(mid, hi);
    const Range give = keep_lower ? span(mid, hi) : span(lo, mid);
    exchange(ctx.peer(r ^ d), d == p / 2 ? send : recv, give, keep, /*reduce=*/true);
    if (keep_lower) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  if (op == ReduceOp::kAvg) {
    const Range own = span(lo, hi);
    core::DivideInPlace(dtype, recv + own.offset * es, own.length, size_t(p));
  }
  for (int d = 1; d < p; d *= 2) {
    const int width = hi - lo;
    const bool partner_above = (r & d) == 0;
    const int other_lo = partner_above ? hi : lo - width;
    exchange(ctx.peer(r ^ d), recv, span(lo, hi), span(other_lo, other_lo + width),
             /*reduce=*/false);
    lo = std::min(lo, other_lo);
    hi = lo + 2 * width;
  }
}

// Ring reduce-scatter.
//
// Schedule: n-1 steps; at step s rank r sends block (r - s - 1) mod n and receives block
// (r - s - 2) mod n, so its last step receives block r, which it reduces into `recv`. Unlike
// all-reduce there is no tensor-sized buffer for the partial sums of the other blocks (`send`
// is read-only), so a received chunk is reduced in its staging slot and forwarded from there;
// the slot is free only once that forward has left. To keep that wait free of cycles, the
// tensor is processed in iterations of kSlices slices per block: within an iteration the
// frames go step by step, and a slot is reused kStagingSlots items later while a forward
// happens kSlices items later, so kSlices < kStagingSlots bounds every chain of waits (each
// hop around the ring moves it kStagingSlots - kSlices items back, down to the first items,
// whose slots are free from the start).
void RingReduceScatter(Context& ctx, const void* send_ptr, void* recv_ptr, size_t count,
                       DataType dtype, ReduceOp op) {
  constexpr size_t kSlices = kStagingSlots / 2;
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t es = SizeOf(dtype);
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  if (n == 1) return CopyUnlessSame(recv, send, count * es);

  const size_t slice_elems = std::max<size_t>(1, ctx.chunk_bytes / es);
  const size_t iteration_elems = kSlices * slice_elems;
  const size_t iterations = std::max<size_t>(1, CeilDiv(count, iteration_elems));
  const size_t slot_bytes = slice_elems * es;
  uint8_t* staging = ctx.staging.Get(slot_bytes * kStagingSlots);
  const size_t steps = static_cast<size_t>(n - 1);
  const size_t items = iterations * steps * kSlices;  // as many sends as receives

  // Item t = (iteration, step, slice), in wire order.
  struct Item {
    size_t step;
    Range range;  // within a block
  };
  auto item_of = [&](size_t t) {
    const size_t slice = t % kSlices;
    const size_t step = (t / kSlices) % steps;
    const size_t iteration = t / (kSlices * steps);
    const size_t begin = iteration * iteration_elems;
    const Split slices{std::min(count, begin + iteration_elems) - std::min(count, begin), kSlices};
    return Item{step, Range{begin + slices.Offset(slice), slices.Length(slice)}};
  };
  auto send_block = [&](size_t s) { return Mod(int64_t{r} - int64_t(s) - 1, n); };
  auto recv_block = [&](size_t s) { return Mod(int64_t{r} - int64_t(s) - 2, n); };
  auto slot = [&](size_t t) { return staging + (t % kStagingSlots) * slot_bytes; };

  Connection& right = ctx.right();
  Connection& left = ctx.left();
  std::array<uint64_t, kStagingSlots> recv_ticket{};
  std::array<uint64_t, kStagingSlots> forward_ticket{};  // 0: the slot has no send in flight
  uint64_t last_send = 0;
  size_t next_send = 0;
  size_t posted = 0;

  // Sends go out in wire order: a step-0 slice straight from `send`, a later one from the slot
  // of the item it forwards (kSlices items back) once that item is reduced.
  auto post_sends = [&](size_t processed) {
    for (; next_send < items; ++next_send) {
      const Item item = item_of(next_send);
      if (item.step == 0) {
        const size_t offset = size_t(send_block(0)) * count + item.range.offset;
        last_send = right.PostSend(ctx.tag, send + offset * es, item.range.length * es);
      } else {
        const size_t source = next_send - kSlices;
        if (source >= processed) break;
        last_send = right.PostSend(ctx.tag, slot(source), item.range.length * es);
        forward_ticket[source % kStagingSlots] = last_send;
      }
    }
  };
  // Receives are posted up to kStagingSlots ahead, each once its slot's forward has left (not a
  // ReceiveWindow: here a slot frees when a send completes, not when the item is consumed).
  auto post_receives = [&](size_t processed, bool must_post_next) {
    for (; posted < items && posted < processed + kStagingSlots; ++posted) {
      uint64_t& pending = forward_ticket[posted % kStagingSlots];
      if (pending != 0) {
        if (must_post_next && posted == processed) {
          right.WaitSend(pending);
        } else if (!right.TestSend(pending)) {
          break;
        }
        pending = 0;
      }
      recv_ticket[posted % kStagingSlots] =
          left.PostRecv(ctx.tag, slot(posted), item_of(posted).range.length * es);
    }
  };

  post_sends(0);
  for (size_t t = 0; t < items; ++t) {
    post_receives(t, /*must_post_next=*/true);
    left.WaitRecv(recv_ticket[t % kStagingSlots]);
    const Item item = item_of(t);
    const uint8_t* own = send + (size_t(recv_block(item.step)) * count + item.range.offset) * es;
    if (item.step + 1 == steps) {
      uint8_t* out = recv + item.range.offset * es;
      core::Reduce(dtype, op, out, own, slot(t), item.range.length);
      if (op == ReduceOp::kAvg) core::DivideInPlace(dtype, out, item.range.length, n);
    } else {
      core::Reduce(dtype, op, slot(t), own, slot(t), item.range.length);
    }
    post_sends(t + 1);
    post_receives(t + 1, /*must_post_next=*/false);
  }
  right.WaitSend(last_send);
}

// Ring all-gather.
//
// Schedule: n-1 steps; at step s rank r sends block (r - s) mod n and receives block
// (r - s - 1) mod n straight into `recv`, forwarding each chunk at step s+1 as soon as it has
// arrived. Step 0 sends from `send`, so the copy of the own block into `recv` (when not in
// place) overlaps the first transfer.
void RingAllGather(Context& ctx, const void* send_ptr, void* recv_ptr, size_t count,
                   DataType dtype) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t es = SizeOf(dtype);
  const size_t block_bytes = count * es;
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  uint8_t* own = recv + size_t(r) * block_bytes;
  if (n == 1) return CopyUnlessSame(own, send, block_bytes);

  const Split chunk_split{count, std::max<size_t>(1, CeilDiv(block_bytes, ctx.chunk_bytes))};
  const size_t chunks = chunk_split.parts;
  const size_t items = size_t(n - 1) * chunks;
  auto recv_block = [&](size_t s) { return Mod(int64_t{r} - int64_t(s) - 1, n); };
  auto where = [&](size_t t) {
    const size_t c = t % chunks;
    return recv + (size_t(recv_block(t / chunks)) * count + chunk_split.Offset(c)) * es;
  };

  Connection& right = ctx.right();
  Connection& left = ctx.left();
  uint64_t last_send = 0;
  for (size_t c = 0; c < chunks; ++c) {
    last_send = right.PostSend(ctx.tag, send + chunk_split.Offset(c) * es,
                               chunk_split.Length(c) * es);
  }
  CopyUnlessSame(own, send, block_bytes);

  ReceiveWindow window(left, ctx.tag, items, [&](size_t t) {
    return Destination{where(t), chunk_split.Length(t % chunks) * es};
  });
  for (size_t t = 0; t < items; ++t) {
    window.Wait(t);
    if (t / chunks + 1 < size_t(n - 1)) {
      last_send = right.PostSend(ctx.tag, where(t), chunk_split.Length(t % chunks) * es);
    }
  }
  right.WaitSend(last_send);
}

// Chain broadcast: the ranks in the order root, root+1, ..., root-1 form a chain; the message
// is cut into chunks, and each rank forwards chunk k to its successor as soon as it has it, so
// all links of the chain are busy at once and the time approaches one message transfer.
void ChainBroadcast(Context& ctx, const void* send_ptr, void* recv_ptr, size_t bytes, int root) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  const int position = Mod(int64_t{r} - root, n);
  const Split chunk_split{bytes, std::max<size_t>(1, CeilDiv(bytes, ctx.chunk_bytes))};
  const size_t chunks = chunk_split.parts;
  Connection* next = position + 1 < n ? &ctx.right() : nullptr;
  uint64_t last_send = 0;

  if (position == 0) {
    if (next != nullptr) {
      for (size_t c = 0; c < chunks; ++c) {
        last_send = next->PostSend(ctx.tag, send + chunk_split.Offset(c), chunk_split.Length(c));
      }
    }
    CopyUnlessSame(recv, send, bytes);
  } else {
    ReceiveWindow window(ctx.left(), ctx.tag, chunks, [&](size_t c) {
      return Destination{recv + chunk_split.Offset(c), chunk_split.Length(c)};
    });
    for (size_t c = 0; c < chunks; ++c) {
      window.Wait(c);
      if (next != nullptr) {
        last_send = next->PostSend(ctx.tag, recv + chunk_split.Offset(c), chunk_split.Length(c));
      }
    }
  }
  if (next != nullptr) next->WaitSend(last_send);
}

// Binomial-tree broadcast. With ranks renumbered so the root is 0 (position p), p receives the
// whole message from p minus its lowest set bit, then sends it to p + 2^k for every 2^k below
// that bit (largest subtree first): ceil(log2 n) hops.
void TreeBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root) {
  const int n = ctx.size();
  const int position = Mod(int64_t{ctx.rank()} - root, n);
  auto real_rank = [&](int p) { return (p + root) % n; };
  int mask = 1;
  while (mask < n) {
    if (position & mask) {
      Connection& parent = ctx.peer(real_rank(position - mask));
      parent.WaitRecv(parent.PostRecv(ctx.tag, recv, bytes));
      break;
    }
    mask <<= 1;
  }
  const void* source = position == 0 ? send : recv;
  std::array<std::pair<Connection*, uint64_t>, 64> sends{};
  size_t num_sends = 0;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (position + mask < n) {
      Connection& child = ctx.peer(real_rank(position + mask));
      sends[num_sends++] = {&child, child.PostSend(ctx.tag, source, bytes)};
    }
  }
  if (position == 0) CopyUnlessSame(recv, send, bytes);
  for (size_t i = 0; i < num_sends; ++i) sends[i].first->WaitSend(sends[i].second);
}

void AgreeOnCall(Context& ctx) {
  const int n = ctx.size();
  const int r = ctx.rank();
  // The measurement switch that turns the frame checks off (tcp_fabric.cc) turns this off too.
  static const bool skip = [] {
    const char* value = std::getenv("COLLECTIVES_UNSAFE_SKIP_CALL_CHECK");
    return value != nullptr && std::string(value) == "1";
  }();
  if (n == 1 || skip) return;
  std::vector<std::pair<Connection*, uint64_t>> receives, sends;
  receives.reserve(size_t(n - 1));
  sends.reserve(size_t(n - 1));
  for (int k = 1; k < n; ++k) {
    Connection& peer = ctx.peer((r + k) % n);
    receives.emplace_back(&peer, peer.PostRecv(ctx.tag, nullptr, 0));
    sends.emplace_back(&peer, peer.PostSend(ctx.tag, nullptr, 0));
  }
  for (const auto& [peer, ticket] : receives) peer->WaitRecv(ticket);
  for (const auto& [peer, ticket] : sends) peer->WaitSend(ticket);
}

void Barrier(Context& ctx) {
  RecursiveDoublingAllReduce(ctx, nullptr, nullptr, 0, DataType::kUInt8, ReduceOp::kMax);
}

}  // namespace collectives::ring
