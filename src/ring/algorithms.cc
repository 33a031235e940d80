// The RING algorithms: ring all-reduce, reduce-scatter and all-gather, chain and tree
// broadcast, recursive-doubling all-reduce and barrier, chain reduce, direct gather and scatter,
// pairwise all-to-all, and point-to-point messages.
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
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "collectives/errors.h"
#include "src/core/kernels.h"

namespace collectives::ring {

uint8_t* Staging::Get(size_t bytes) {
  if (bytes > bytes_) {
    data_ = core::AllocateAligned(bytes);
    bytes_ = bytes;
  }
  return data_.get();
}

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

// Byte `offset` of a message (core::Runs): the caller's buffers, its runs in place (the packer's
// bucket), or staging, which is one run. Runs are whole elements, so every element lies in one
// run. A message of one run is addressed without a search, and a frame from or into it takes the
// connection's one-buffer form.
struct Place {
  const core::Runs* runs = nullptr;
  size_t offset = 0;

  Place() = default;
  Place(const core::Runs& r, size_t o) : runs(&r), offset(o) {}

  bool none() const { return runs == nullptr; }
  Place operator+(size_t bytes) const { return Place(*runs, offset + bytes); }
  // The same bytes: the same place of one message, or the same address of two buffers (a call
  // in place on one buffer names it twice).
  bool operator==(const Place& other) const {
    if (runs == other.runs) return offset == other.offset;
    return runs != nullptr && other.runs != nullptr && runs->contiguous() &&
           other.runs->contiguous() && runs->data() + offset == other.runs->data() + other.offset;
  }
  // The address of this byte, and how many bytes follow it contiguously (SIZE_MAX: one buffer).
  std::pair<uint8_t*, size_t> Contiguous() const {
    if (runs->contiguous()) return {runs->data() + offset, SIZE_MAX};
    return runs->At(offset);
  }
};

uint64_t Send(Connection& to, const core::CallTag& tag, Place from, size_t bytes) {
  if (!from.runs->contiguous()) return to.PostSend(tag, *from.runs, from.offset, bytes);
  return to.PostSend(tag, from.runs->data() + from.offset, bytes);
}
uint64_t Recv(Connection& from, const core::CallTag& tag, Place to, size_t bytes) {
  if (!to.runs->contiguous()) return from.PostRecv(tag, *to.runs, to.offset, bytes);
  return from.PostRecv(tag, to.runs->data() + to.offset, bytes);
}

// Calls f(uint8_t* a, uint8_t* b, uint8_t* c, size_t bytes) over `bytes` of three buffers, in
// spans that are contiguous in all three.
template <typename F>
void ForEachSpan(size_t bytes, Place a, Place b, Place c, F f) {
  while (bytes > 0) {
    const auto [pa, na] = a.Contiguous();
    const auto [pb, nb] = b.Contiguous();
    const auto [pc, nc] = c.Contiguous();
    const size_t n = std::min({bytes, na, nb, nc});
    f(pa, pb, pc, n);
    a = a + n;
    b = b + n;
    c = c + n;
    bytes -= n;
  }
}

// core::Reduce and DivideInPlace on Places.
void Reduce(DataType dtype, ReduceOp op, Place out, Place a, Place b, size_t count) {
  const size_t es = SizeOf(dtype);
  ForEachSpan(count * es, out, a, b, [&](uint8_t* o, uint8_t* x, uint8_t* y, size_t n) {
    core::Reduce(dtype, op, o, x, y, n / es);
  });
}
void DivideInPlace(DataType dtype, Place data, size_t count, size_t n) {
  const size_t es = SizeOf(dtype);
  ForEachSpan(count * es, data, data, data, [&](uint8_t* d, uint8_t*, uint8_t*, size_t bytes) {
    core::DivideInPlace(dtype, d, bytes / es, n);
  });
}
void CopyUnlessSame(Place dst, Place src, size_t bytes) {
  if (dst == src) return;
  ForEachSpan(bytes, dst, src, src,
              [](uint8_t* d, uint8_t* s, uint8_t*, size_t n) { std::memcpy(d, s, n); });
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
      ticket_[posted_ % kStagingSlots] = Recv(from_, tag_, data, bytes);
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
  Place data;
  size_t bytes;
};

// Ring reduce-scatter over n blocks of a vector, block b being the elements
// [blocks.Offset(b), blocks.Offset(b) + blocks.Length(b)) of `send`: `out` receives the final
// value of block r (divided by n for kAvg).
//
// Schedule: n-1 steps; at step s rank r sends block (r - s - 1) mod n and receives block
// (r - s - 2) mod n, so its last step receives block r, which it reduces into `out`. Partial
// sums never touch `out`: a received chunk is reduced in its staging slot and forwarded from
// there, so the slot is free only once that forward has left. To keep that wait free of cycles,
// the blocks are processed in iterations of kSlices slices each (of at most chunk_bytes; a
// slice of a shorter block is clipped to it): within an iteration the frames go step by step,
// and a slot is reused kStagingSlots items later while a forward happens kSlices items later,
// so kSlices < kStagingSlots bounds every chain of waits (each hop around the ring moves it
// kStagingSlots - kSlices items back, down to the first items, whose slots are free from the
// start).
//
// Why a mismatched call writes nothing, with no agreement round: the transport checks every
// frame's tag against this rank's call before it reads the payload, and a rank forwards a
// partial sum only after its frame passed that check. The last-step frame that rank r receives
// was thus checked hop by hop by r-1, r-2, ..., r+2, each against its left neighbour, and r
// checks it against its own call: a chain of equal calls through all n ranks. A rank whose call
// differs breaks every such chain, so no rank reaches its first write into `out`, and all learn
// of the mismatch from the abort of the rank that saw it.
void ReduceScatterBlocks(Context& ctx, Place send, Split blocks, Place out, DataType dtype,
                         ReduceOp op) {
  constexpr size_t kSlices = kStagingSlots / 2;
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t es = SizeOf(dtype);
  const size_t slice_elems = std::max<size_t>(1, ctx.chunk_bytes / es);
  const size_t iteration_elems = kSlices * slice_elems;
  const size_t iterations = std::max<size_t>(1, CeilDiv(blocks.Length(0), iteration_elems));
  // A slot holds one slice: at most slice_elems, and at most a kSlices-th of the largest block
  // (the first), so a large chunk_bytes does not stage more than the call moves.
  const size_t slot_bytes =
      std::min(slice_elems, std::max<size_t>(1, CeilDiv(blocks.Length(0), kSlices))) * es;
  const size_t steps = static_cast<size_t>(n - 1);
  const size_t items = iterations * steps * kSlices;  // as many sends as receives

  auto send_block = [&](size_t s) { return size_t(Mod(int64_t{r} - int64_t(s) - 1, n)); };
  auto recv_block = [&](size_t s) { return size_t(Mod(int64_t{r} - int64_t(s) - 2, n)); };
  auto step_of = [&](size_t t) { return (t / kSlices) % steps; };
  // Item t = (iteration, step, slice), in wire order; its elements within `block`.
  auto range_of = [&](size_t t, size_t block) {
    const size_t length = blocks.Length(block);
    const size_t begin = std::min(length, (t / (kSlices * steps)) * iteration_elems);
    const Split slices{std::min(length, begin + iteration_elems) - begin, kSlices};
    return Range{begin + slices.Offset(t % kSlices), slices.Length(t % kSlices)};
  };
  const core::Runs slots(ctx.staging.Get(slot_bytes * kStagingSlots), slot_bytes * kStagingSlots);
  auto slot = [&](size_t t) { return Place(slots, (t % kStagingSlots) * slot_bytes); };

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
      const size_t step = step_of(next_send);
      const size_t block = send_block(step);
      const Range range = range_of(next_send, block);
      if (step == 0) {
        const size_t offset = blocks.Offset(block) + range.offset;
        last_send = Send(right, ctx.tag, send + offset * es, range.length * es);
      } else {
        const size_t source = next_send - kSlices;
        if (source >= processed) break;
        last_send = Send(right, ctx.tag, slot(source), range.length * es);
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
      const Range range = range_of(posted, recv_block(step_of(posted)));
      recv_ticket[posted % kStagingSlots] = Recv(left, ctx.tag, slot(posted), range.length * es);
    }
  };

  post_sends(0);
  for (size_t t = 0; t < items; ++t) {
    post_receives(t, /*must_post_next=*/true);
    left.WaitRecv(recv_ticket[t % kStagingSlots]);
    const size_t step = step_of(t);
    const size_t block = recv_block(step);
    const Range range = range_of(t, block);
    const Place own = send + (blocks.Offset(block) + range.offset) * es;
    if (step + 1 == steps) {
      const Place result = out + range.offset * es;
      Reduce(dtype, op, result, own, slot(t), range.length);
      if (op == ReduceOp::kAvg) DivideInPlace(dtype, result, range.length, size_t(n));
    } else {
      Reduce(dtype, op, slot(t), own, slot(t), range.length);
    }
    post_sends(t + 1);
    post_receives(t + 1, /*must_post_next=*/false);
  }
  right.WaitSend(last_send);
}

// Ring all-gather over n blocks of `recv` laid out by `blocks`: block r comes from
// `own_source` (copied to its place unless already there), every other block from its rank.
//
// Schedule: n-1 steps; at step s rank r sends block (r - s) mod n and receives block
// (r - s - 1) mod n straight into `recv`, forwarding each chunk at step s+1 as soon as it has
// arrived. Every block is cut into as many chunks as the largest needs, so both ends of a frame
// agree on its size. Step 0 sends from `own_source`, so the copy of the own block (when not in
// place) overlaps the first transfer.
void AllGatherBlocks(Context& ctx, Place own_source, Place recv, Split blocks, size_t es,
                     CallAgreement* agreement) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const Place own = recv + blocks.Offset(size_t(r)) * es;
  const size_t own_bytes = blocks.Length(size_t(r)) * es;
  if (n == 1) return CopyUnlessSame(own, own_source, own_bytes);

  const size_t chunks = std::max<size_t>(1, CeilDiv(blocks.Length(0) * es, ctx.chunk_bytes));
  const size_t items = size_t(n - 1) * chunks;
  auto chunk_of = [&](size_t block, size_t c) {
    const Split in_block{blocks.Length(block), chunks};
    return Range{blocks.Offset(block) + in_block.Offset(c), in_block.Length(c)};
  };
  auto recv_chunk = [&](size_t t) {
    return chunk_of(size_t(Mod(int64_t{r} - int64_t(t / chunks) - 1, n)), t % chunks);
  };

  Connection& right = ctx.right();
  Connection& left = ctx.left();
  uint64_t last_send = 0;
  for (size_t c = 0; c < chunks; ++c) {
    const Range chunk = chunk_of(size_t(r), c);
    last_send = Send(right, ctx.tag, own_source + (chunk.offset - blocks.Offset(size_t(r))) * es,
                     chunk.length * es);
  }
  if (agreement != nullptr) agreement->Wait();

  ReceiveWindow window(left, ctx.tag, items, [&](size_t t) {
    const Range chunk = recv_chunk(t);
    return Destination{recv + chunk.offset * es, chunk.length * es};
  });
  for (size_t t = 0; t < items; ++t) {
    window.Wait(t);
    // After the first frame from the left, checked against this call: with two ranks that frame
    // is the agreement with the only peer (CallAgreement::Pair).
    if (t == 0) CopyUnlessSame(own, own_source, own_bytes);
    if (t / chunks + 1 < size_t(n - 1)) {
      const Range chunk = recv_chunk(t);
      last_send = Send(right, ctx.tag, recv + chunk.offset * es, chunk.length * es);
    }
  }
  right.WaitSend(last_send);
}

}  // namespace

// Ring all-reduce.
//
// Reduce-scatter, then all-gather, both around the ring over the same n blocks of near-equal
// size (block b: Split{count, n}): ReduceScatterBlocks leaves the final value of block r (divided
// by n for kAvg) in recv at block r's place, and AllGatherBlocks circulates every final block
// into every rank's recv. Block b's final value is computed once, by rank b, and copied
// everywhere else, which is why the result is the same bits on every rank.
//
// No separate agreement round: the reduce-scatter keeps its partial sums in staging, so the
// first write into `recv` is the last reduce-scatter step, whose frame vouches for every rank
// (see ReduceScatterBlocks); a mismatched call raises on every rank with `recv` untouched.
namespace {

void RingAllReduceOn(Context& ctx, const core::Runs& send, const core::Runs& recv, size_t count,
                     DataType dtype, ReduceOp op) {
  const int n = ctx.size();
  const size_t es = SizeOf(dtype);
  if (n == 1) return CopyUnlessSame(Place(recv, 0), Place(send, 0), count * es);
  const Split blocks{count, static_cast<size_t>(n)};
  const Place own = Place(recv, 0) + blocks.Offset(size_t(ctx.rank())) * es;
  ReduceScatterBlocks(ctx, Place(send, 0), blocks, own, dtype, op);
  AllGatherBlocks(ctx, own, Place(recv, 0), blocks, es, /*agreement=*/nullptr);
}

}  // namespace

void RingAllReduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                   ReduceOp op) {
  const size_t bytes = count * SizeOf(dtype);
  RingAllReduceOn(ctx, core::Runs(send, bytes), core::Runs(recv, bytes), count, dtype, op);
}

void RingAllReduce(Context& ctx, const core::Runs& message, size_t count, DataType dtype,
                   ReduceOp op) {
  RingAllReduceOn(ctx, message, message, count, dtype, op);
}

std::vector<int> PeersAtSetUp(int rank, int size) {
  std::vector<int> peers;
  if (size < 2) return peers;
  peers.push_back((rank + 1) % size);
  peers.push_back((rank + size - 1) % size);
  for (int mask = 1; mask < size; mask <<= 1) {
    if ((rank ^ mask) < size) peers.push_back(rank ^ mask);
  }
  // Recursive doubling's fold and its virtual ranks (RecursiveDoublingAllReduce below).
  int p2 = 1;
  while (p2 * 2 <= size) p2 *= 2;
  const int rem = size - p2;
  if (rem > 0) {
    auto real_rank = [rem](int v) { return v < rem ? 2 * v + 1 : v + rem; };
    int virtual_rank = -1;
    if (rank < 2 * rem) {
      peers.push_back(rank % 2 == 0 ? rank + 1 : rank - 1);
      if (rank % 2 == 1) virtual_rank = rank / 2;
    } else {
      virtual_rank = rank - rem;
    }
    if (virtual_rank >= 0) {
      for (int mask = 1; mask < p2; mask <<= 1) peers.push_back(real_rank(virtual_rank ^ mask));
    }
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  std::erase(peers, rank);
  return peers;
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
                                DataType dtype, ReduceOp op, uint8_t* scratch) {
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
  uint8_t* const acc = scratch != nullptr ? scratch : ctx.staging.Get(2 * bytes);
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
// half of its partial sums, receives the partner's contribution to the kept half chunk by chunk
// (straight into where the sum goes, or through staging slots where that is where its own
// partial sums are), and reduces it. The first step reads `send` (so an out-of-place call
// needs no copy); the partial sums of the steps before the last live in `acc`, a staging buffer
// of the first kept half; the last step (d = 1) writes block r's final value (divided by p for
// kAvg) into `recv`, computed there alone, so every rank ends with the same bits. All-gather by
// recursive doubling: with d = 1, 2, ..., p/2 rank r sends its range to r ^ d and receives the
// adjacent range of the same size straight into `recv`. Each exchange is cut into chunks of at
// most chunk_bytes; sends are posted at once and never wait on receives, so the two partners of
// a step cannot block each other.
//
// A mismatched call writes nothing, with no agreement round: as in the ring (see
// ReduceScatterBlocks), a rank sends partial sums only from frames whose tags it checked, so the
// last halving frame that reaches rank r carries checks between every rank and the ones it
// exchanged with, which link all p ranks, before anything is written into `recv`.
namespace {

void HalvingDoublingAllReduceOn(Context& ctx, const core::Runs& send_runs,
                                const core::Runs& recv_runs, size_t count, DataType dtype,
                                ReduceOp op) {
  const Place send(send_runs, 0);
  const Place recv(recv_runs, 0);
  const int p = ctx.size();
  const int r = ctx.rank();
  const size_t es = SizeOf(dtype);
  if (p == 1) return CopyUnlessSame(recv, send, count * es);

  const Split blocks{count, static_cast<size_t>(p)};
  // Elements of blocks [lo, hi).
  auto span = [&](int lo, int hi) {
    return Range{blocks.Offset(size_t(lo)), blocks.Offset(size_t(hi)) - blocks.Offset(size_t(lo))};
  };
  // Chunks of at most chunk_bytes, and of at most the largest exchange (the first step's half,
  // span(0, p / 2) being the larger), so a large chunk_bytes does not stage more than the call
  // moves. Both partners compute the same slot_elems, hence the same chunks.
  const size_t slot_elems = std::min(std::max<size_t>(1, ctx.chunk_bytes / es),
                                     std::max<size_t>(1, span(0, p / 2).length));
  const size_t slots_bytes = slot_elems * es * kStagingSlots;
  const Range first_keep = (r & (p / 2)) == 0 ? span(0, p / 2) : span(p / 2, p);
  // The staging slots, then `acc`.
  const size_t staging_bytes = slots_bytes + first_keep.length * es;
  const core::Runs staging(ctx.staging.Get(staging_bytes), staging_bytes);
  const Place acc(staging, slots_bytes);
  const auto slot = [&](size_t c) { return Place(staging, (c % kStagingSlots) * slot_elems * es); };
  // Where element `offset` of this rank's partial sums lives: `send` before the first step,
  // `acc` after it.
  auto partial = [&](bool first, size_t offset) -> Place {
    return first ? send + offset * es : acc + (offset - first_keep.offset) * es;
  };

  // Sends `give` (read from `from`) to `partner` and receives the partner's frames for `take`,
  // both cut into chunks of at most slot_elems. With `mine`, to[c] = mine[c] op the received
  // chunk: the chunk lands in `to` itself and is reduced there in place, unless `to` is `mine`
  // (the middle steps, and an in-place call's only step at p = 2), where it lands in a staging
  // slot first. Without `mine`, it lands in `to`. Landing in `to` saves a pass over the slots
  // and uses the in-place kernel; the payload is still read only after its frame's header
  // matched this call, so the last step's first write into `recv` still follows every check.
  auto exchange = [&](Connection& partner, Place from, Range give, Place to, Place mine,
                      Range take) {
    const bool via_slots = !mine.none() && mine == to;
    const Split give_chunks{give.length, std::max<size_t>(1, CeilDiv(give.length, slot_elems))};
    const Split take_chunks{take.length, std::max<size_t>(1, CeilDiv(take.length, slot_elems))};
    uint64_t last_send = 0;
    for (size_t c = 0; c < give_chunks.parts; ++c) {
      last_send =
          Send(partner, ctx.tag, from + give_chunks.Offset(c) * es, give_chunks.Length(c) * es);
    }
    ReceiveWindow window(partner, ctx.tag, take_chunks.parts, [&](size_t c) {
      const Place dst = via_slots ? slot(c) : to + take_chunks.Offset(c) * es;
      return Destination{dst, take_chunks.Length(c) * es};
    });
    for (size_t c = 0; c < take_chunks.parts; ++c) {
      window.Wait(c);
      if (!mine.none()) {
        const size_t offset = take_chunks.Offset(c) * es;
        const Place theirs = via_slots ? slot(c) : to + offset;
        // (lower rank's data) op (higher rank's data), as everywhere in this file.
        if (partner.peer() < r) {
          Reduce(dtype, op, to + offset, theirs, mine + offset, take_chunks.Length(c));
        } else {
          Reduce(dtype, op, to + offset, mine + offset, theirs, take_chunks.Length(c));
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
    const bool first = d == p / 2;
    // The last step writes the caller's buffer; the others, `acc` (in place after the first).
    const Place to =
        d == 1 ? recv + keep.offset * es : acc + (keep.offset - first_keep.offset) * es;
    exchange(ctx.peer(r ^ d), partial(first, give.offset), give, to, partial(first, keep.offset),
             keep);
    if (keep_lower) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  if (op == ReduceOp::kAvg) {
    const Range own = span(lo, hi);
    DivideInPlace(dtype, recv + own.offset * es, own.length, size_t(p));
  }
  for (int d = 1; d < p; d *= 2) {
    const int width = hi - lo;
    const bool partner_above = (r & d) == 0;
    const int other_lo = partner_above ? hi : lo - width;
    const Range mine = span(lo, hi);
    const Range theirs = span(other_lo, other_lo + width);
    exchange(ctx.peer(r ^ d), recv + mine.offset * es, mine, recv + theirs.offset * es,
             /*mine=*/Place(), theirs);
    lo = std::min(lo, other_lo);
    hi = lo + 2 * width;
  }
}

}  // namespace

void HalvingDoublingAllReduce(Context& ctx, const void* send, void* recv, size_t count,
                              DataType dtype, ReduceOp op) {
  const size_t bytes = count * SizeOf(dtype);
  HalvingDoublingAllReduceOn(ctx, core::Runs(send, bytes), core::Runs(recv, bytes), count, dtype,
                             op);
}

void HalvingDoublingAllReduce(Context& ctx, const core::Runs& message, size_t count, DataType dtype,
                              ReduceOp op) {
  HalvingDoublingAllReduceOn(ctx, message, message, count, dtype, op);
}

// Ring reduce-scatter: the blocks are the ranks' shares of `send` (count elements each), and
// rank r's share of the result goes to `recv` (see ReduceScatterBlocks, which also says why no
// agreement round is needed).
void RingReduceScatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                       ReduceOp op) {
  const size_t n = size_t(ctx.size());
  if (n == 1) return CopyUnlessSame(recv, send, count * SizeOf(dtype));
  const size_t block_bytes = count * SizeOf(dtype);
  const core::Runs in(send, n * block_bytes);
  const core::Runs out(recv, block_bytes);
  ReduceScatterBlocks(ctx, Place(in, 0), Split{n * count, n}, Place(out, 0), dtype, op);
}

// Ring all-gather: block r of `recv` (count elements) comes from `send` (see AllGatherBlocks).
void RingAllGather(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                   CallAgreement* agreement) {
  const size_t n = size_t(ctx.size());
  const size_t block_bytes = count * SizeOf(dtype);
  const core::Runs in(send, block_bytes);
  const core::Runs out(recv, n * block_bytes);
  AllGatherBlocks(ctx, Place(in, 0), Place(out, 0), Split{n * count, n}, SizeOf(dtype), agreement);
}

// Chain broadcast: the ranks in the order root, root+1, ..., root-1 form a chain; the message
// is cut into chunks, and each rank forwards chunk k to its successor as soon as it has it, so
// all links of the chain are busy at once and the time approaches one message transfer. With
// `agreement`, the root sends at once (from `send`) and waits for it only before its own copy;
// the others wait for it before their first receive into `recv`.
//
// A chain of one hop (two ranks) has nothing to pipeline, and every frame costs the receiver a
// wait of its own: its frames are twice chunk_bytes (fewer waits where they pay; one frame of a
// whole large message loses to the pipeline).
namespace {

void ChainBroadcastOn(Context& ctx, const core::Runs& send_runs, const core::Runs& recv_runs,
                      int root, CallAgreement* agreement) {
  const Place send(send_runs, 0);
  const Place recv(recv_runs, 0);
  const size_t bytes = recv_runs.bytes();
  const int n = ctx.size();
  const int r = ctx.rank();
  const int position = Mod(int64_t{r} - root, n);
  const size_t chunk_bytes =
      n == 2 && ctx.chunk_bytes <= SIZE_MAX / 2 ? 2 * ctx.chunk_bytes : ctx.chunk_bytes;
  const Split chunk_split{bytes, std::max<size_t>(1, CeilDiv(bytes, chunk_bytes))};
  const size_t chunks = chunk_split.parts;
  Connection* next = position + 1 < n ? &ctx.right() : nullptr;
  uint64_t last_send = 0;

  if (position == 0) {
    if (next != nullptr) {
      for (size_t c = 0; c < chunks; ++c) {
        last_send = Send(*next, ctx.tag, send + chunk_split.Offset(c), chunk_split.Length(c));
      }
    }
    if (agreement != nullptr) agreement->Wait();
    CopyUnlessSame(recv, send, bytes);
  } else {
    if (agreement != nullptr) agreement->Wait();
    ReceiveWindow window(ctx.left(), ctx.tag, chunks, [&](size_t c) {
      return Destination{recv + chunk_split.Offset(c), chunk_split.Length(c)};
    });
    for (size_t c = 0; c < chunks; ++c) {
      window.Wait(c);
      if (next != nullptr) {
        last_send = Send(*next, ctx.tag, recv + chunk_split.Offset(c), chunk_split.Length(c));
      }
    }
  }
  if (next != nullptr) next->WaitSend(last_send);
}

}  // namespace

void ChainBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root,
                    CallAgreement* agreement) {
  ChainBroadcastOn(ctx, core::Runs(send, bytes), core::Runs(recv, bytes), root, agreement);
}

void ChainBroadcast(Context& ctx, const core::Runs& message, int root, CallAgreement* agreement) {
  ChainBroadcastOn(ctx, message, message, root, agreement);
}

// Binomial-tree broadcast. With ranks renumbered so the root is 0 (position p), p receives the
// whole message from p minus its lowest set bit, then sends it to p + 2^k for every 2^k below
// that bit (largest subtree first): ceil(log2 n) hops. `agreement` as for ChainBroadcast.
void TreeBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root,
                   CallAgreement* agreement) {
  const int n = ctx.size();
  const int position = Mod(int64_t{ctx.rank()} - root, n);
  auto real_rank = [&](int p) { return (p + root) % n; };
  int mask = 1;
  while (mask < n) {
    if (position & mask) {
      if (agreement != nullptr) agreement->Wait();
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
  if (position == 0) {
    if (agreement != nullptr) agreement->Wait();
    CopyUnlessSame(recv, send, bytes);
  }
  for (size_t i = 0; i < num_sends; ++i) sends[i].first->WaitSend(sends[i].second);
}

// The small collectives keep their extra vector (a rank's contribution, or the whole reduced
// input) in staging behind the all-reduce's own 2 x `bytes`, so a call allocates nothing once
// the staging area has grown to the largest small message.
void SmallBroadcast(Context& ctx, const void* send, void* recv, size_t bytes, int root) {
  if (ctx.rank() == root) {
    return RecursiveDoublingAllReduce(ctx, send, recv, bytes, DataType::kUInt8, ReduceOp::kMax);
  }
  uint8_t* const scratch = ctx.staging.Get(3 * bytes);
  uint8_t* const zeros = scratch + 2 * bytes;
  if (bytes > 0) std::memset(zeros, 0, bytes);
  RecursiveDoublingAllReduce(ctx, zeros, recv, bytes, DataType::kUInt8, ReduceOp::kMax, scratch);
}

void SmallAllGather(Context& ctx, const void* send, void* recv, size_t block_bytes) {
  const size_t bytes = size_t(ctx.size()) * block_bytes;
  uint8_t* const scratch = ctx.staging.Get(3 * bytes);
  uint8_t* const mine = scratch + 2 * bytes;
  if (bytes > 0) std::memset(mine, 0, bytes);
  CopyUnlessSame(mine + size_t(ctx.rank()) * block_bytes, send, block_bytes);
  RecursiveDoublingAllReduce(ctx, mine, recv, bytes, DataType::kUInt8, ReduceOp::kMax, scratch);
}

void SmallReduceScatter(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                        ReduceOp op) {
  const size_t n = size_t(ctx.size());
  const size_t block_bytes = count * SizeOf(dtype);
  uint8_t* const scratch = ctx.staging.Get(3 * n * block_bytes);
  uint8_t* const whole = scratch + 2 * n * block_bytes;
  RecursiveDoublingAllReduce(ctx, send, whole, n * count, dtype, op, scratch);
  CopyUnlessSame(recv, whole + size_t(ctx.rank()) * block_bytes, block_bytes);
}

CallAgreement::CallAgreement(Context& ctx, Pair pair) {
  const int n = ctx.size();
  const int r = ctx.rank();
  // The measurement switch that turns the frame checks off (tcp_fabric_impl.h) turns this off too.
  static const bool skip = [] {
    const char* value = std::getenv("COLLECTIVES_UNSAFE_SKIP_CALL_CHECK");
    return value != nullptr && std::string(value) == "1";
  }();
  if (n == 1 || skip) return;
  const bool data_out = n == 2 && (pair == Pair::kDataBothWays || pair == Pair::kDataOut);
  const bool data_in = n == 2 && (pair == Pair::kDataBothWays || pair == Pair::kDataIn);
  receives_.reserve(size_t(n - 1));
  sends_.reserve(size_t(n - 1));
  for (int k = 1; k < n; ++k) {
    Connection& peer = ctx.peer((r + k) % n);
    if (!data_in) receives_.emplace_back(&peer, peer.PostRecv(ctx.tag, nullptr, 0));
    if (!data_out) sends_.emplace_back(&peer, peer.PostSend(ctx.tag, nullptr, 0));
  }
}

void CallAgreement::Wait() {
  if (done_) return;
  for (const auto& [peer, ticket] : receives_) peer->WaitRecv(ticket);
  for (const auto& [peer, ticket] : sends_) peer->WaitSend(ticket);
  done_ = true;
}

void Barrier(Context& ctx) {
  RecursiveDoublingAllReduce(ctx, nullptr, nullptr, 0, DataType::kUInt8, ReduceOp::kMax);
}

void ChainReduce(Context& ctx, const void* send_ptr, void* recv_ptr, size_t count, DataType dtype,
                 ReduceOp op, int root, CallAgreement& agreement) {
  const int n = ctx.size();
  const size_t es = SizeOf(dtype);
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  if (n == 1) {
    agreement.Wait();
    return CopyUnlessSame(recv, send, count * es);
  }
  const int position = Mod(int64_t{ctx.rank()} - root, n);
  // Data flows from position n - 1 (rank root - 1) down to position 0 (the root): from the right
  // neighbour to the left one.
  Connection* const to = position > 0 ? &ctx.left() : nullptr;
  Connection* const from = position + 1 < n ? &ctx.right() : nullptr;
  const size_t chunk_elems = std::max<size_t>(1, ctx.chunk_bytes / es);
  const Split chunks{count, std::max<size_t>(1, CeilDiv(count, chunk_elems))};
  if (from == nullptr) {  // the chain's far end: its own chunks, straight from send
    uint64_t last = 0;
    for (size_t c = 0; c < chunks.parts; ++c) {
      last = to->PostSend(ctx.tag, send + chunks.Offset(c) * es, chunks.Length(c) * es);
    }
    to->WaitSend(last);
    agreement.Wait();
    return;
  }
  // Chunk c lands in slot c % kStagingSlots; a slot takes its next chunk once the previous one
  // was reduced and, off the root, forwarded (its send completed).
  const size_t slot_bytes = chunks.Length(0) * es;
  uint8_t* const slots = ctx.staging.Get(kStagingSlots * std::max<size_t>(1, slot_bytes));
  const auto slot = [&](size_t c) { return slots + (c % kStagingSlots) * slot_bytes; };
  std::array<uint64_t, kStagingSlots> received{};
  std::array<uint64_t, kStagingSlots> forwarded{};
  size_t posted = 0;
  const auto post_until = [&](size_t end) {
    for (; posted < std::min(end, chunks.parts); ++posted) {
      if (to != nullptr && posted >= kStagingSlots) {
        to->WaitSend(forwarded[posted % kStagingSlots]);
      }
      received[posted % kStagingSlots] =
          from->PostRecv(ctx.tag, slot(posted), chunks.Length(posted) * es);
    }
  };
  post_until(kStagingSlots);
  if (to == nullptr) agreement.Wait();  // the root, before its first write into recv
  uint64_t last_forward = 0;
  for (size_t c = 0; c < chunks.parts; ++c) {
    from->WaitRecv(received[c % kStagingSlots]);
    const size_t offset = chunks.Offset(c) * es;
    const size_t length = chunks.Length(c);
    if (to != nullptr) {
      if (length > 0) core::Reduce(dtype, op, slot(c), send + offset, slot(c), length);
      last_forward = to->PostSend(ctx.tag, slot(c), length * es);
      forwarded[c % kStagingSlots] = last_forward;
    } else if (length > 0) {
      core::Reduce(dtype, op, recv + offset, send + offset, slot(c), length);
      if (op == ReduceOp::kAvg) core::DivideInPlace(dtype, recv + offset, length, size_t(n));
    }
    post_until(c + 1 + kStagingSlots);
  }
  if (to != nullptr) {
    to->WaitSend(last_forward);
    agreement.Wait();
  }
}

void SmallReduce(Context& ctx, const void* send, void* recv, size_t count, DataType dtype,
                 ReduceOp op, int root) {
  if (ctx.rank() == root) return RecursiveDoublingAllReduce(ctx, send, recv, count, dtype, op);
  const size_t bytes = count * SizeOf(dtype);
  uint8_t* const scratch = ctx.staging.Get(3 * bytes);
  RecursiveDoublingAllReduce(ctx, send, scratch + 2 * bytes, count, dtype, op, scratch);
}

namespace {

// The frames of `bytes` bytes: at most chunk_bytes each, one header-only frame when empty.
Split FramesOf(const Context& ctx, size_t bytes) {
  return Split{bytes, std::max<size_t>(1, CeilDiv(bytes, ctx.chunk_bytes))};
}

// Posts the frames of `bytes` at `data` to / from one peer; returns the last ticket.
uint64_t PostFramesOut(Context& ctx, Connection& to, const core::CallTag& tag, const uint8_t* data,
                       size_t bytes) {
  const Split frames = FramesOf(ctx, bytes);
  uint64_t last = 0;
  for (size_t f = 0; f < frames.parts; ++f) {
    last = to.PostSend(tag, data + frames.Offset(f), frames.Length(f));
  }
  return last;
}
uint64_t PostFramesIn(Context& ctx, Connection& from, const core::CallTag& tag, uint8_t* data,
                      size_t bytes) {
  const Split frames = FramesOf(ctx, bytes);
  uint64_t last = 0;
  for (size_t f = 0; f < frames.parts; ++f) {
    last = from.PostRecv(tag, data + frames.Offset(f), frames.Length(f));
  }
  return last;
}

using Tickets = std::vector<std::pair<Connection*, uint64_t>>;
void WaitSends(const Tickets& tickets) {
  for (const auto& [connection, ticket] : tickets) connection->WaitSend(ticket);
}
void WaitRecvs(const Tickets& tickets) {
  for (const auto& [connection, ticket] : tickets) connection->WaitRecv(ticket);
}

}  // namespace

void DirectGather(Context& ctx, const void* send_ptr, void* recv_ptr, size_t block_bytes, int root,
                  CallAgreement& agreement) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  if (r != root) {
    Connection& to = ctx.peer(root);
    to.WaitSend(PostFramesOut(ctx, to, ctx.tag, send, block_bytes));
    agreement.Wait();
    return;
  }
  agreement.Wait();
  Tickets receives;
  for (int k = 1; k < n; ++k) {
    const int j = (r + k) % n;
    Connection& from = ctx.peer(j);
    receives.emplace_back(
        &from, PostFramesIn(ctx, from, ctx.tag, recv + size_t(j) * block_bytes, block_bytes));
  }
  CopyUnlessSame(recv + size_t(r) * block_bytes, send, block_bytes);
  WaitRecvs(receives);
}

void SmallGather(Context& ctx, const void* send, void* recv, size_t block_bytes, int root) {
  if (ctx.rank() == root) return SmallAllGather(ctx, send, recv, block_bytes);
  const size_t bytes = size_t(ctx.size()) * block_bytes;
  // The result behind the 3 x bytes of staging SmallAllGather uses (Get does not move a buffer
  // that is large enough).
  uint8_t* const whole = ctx.staging.Get(4 * bytes) + 3 * bytes;
  SmallAllGather(ctx, send, whole, block_bytes);
}

void DirectScatter(Context& ctx, const void* send_ptr, void* recv_ptr, size_t block_bytes, int root,
                   CallAgreement& agreement) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  if (r == root) {
    Tickets sends;
    for (int k = 1; k < n; ++k) {
      const int j = (r + k) % n;
      Connection& to = ctx.peer(j);
      sends.emplace_back(
          &to, PostFramesOut(ctx, to, ctx.tag, send + size_t(j) * block_bytes, block_bytes));
    }
    agreement.Wait();
    CopyUnlessSame(recv, send + size_t(r) * block_bytes, block_bytes);
    WaitSends(sends);
    return;
  }
  agreement.Wait();
  Connection& from = ctx.peer(root);
  from.WaitRecv(PostFramesIn(ctx, from, ctx.tag, recv, block_bytes));
}

void SmallScatter(Context& ctx, const void* send_ptr, void* recv, size_t block_bytes, int root) {
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  const size_t bytes = size_t(ctx.size()) * block_bytes;
  const size_t mine = size_t(ctx.rank()) * block_bytes;
  // The root's whole send behind the 3 x bytes of staging SmallBroadcast uses.
  uint8_t* const whole = ctx.staging.Get(4 * bytes) + 3 * bytes;
  if (ctx.rank() == root) {
    SmallBroadcast(ctx, send, whole, bytes, root);
    return CopyUnlessSame(recv, send + mine, block_bytes);
  }
  SmallBroadcast(ctx, nullptr, whole, bytes, root);
  CopyUnlessSame(recv, whole + mine, block_bytes);
}

void PairwiseAllToAll(Context& ctx, const void* send_ptr, void* recv_ptr, DataType dtype,
                      const std::vector<size_t>& send_counts,
                      const std::vector<size_t>& recv_counts) {
  const int n = ctx.size();
  const int r = ctx.rank();
  const size_t es = SizeOf(dtype);
  const auto* send = static_cast<const uint8_t*>(send_ptr);
  auto* recv = static_cast<uint8_t*>(recv_ptr);
  std::vector<size_t> send_at(size_t(n), 0);
  std::vector<size_t> recv_at(size_t(n), 0);
  for (int j = 1; j < n; ++j) {
    send_at[size_t(j)] = send_at[size_t(j - 1)] + send_counts[size_t(j - 1)];
    recv_at[size_t(j)] = recv_at[size_t(j - 1)] + recv_counts[size_t(j - 1)];
  }
  if (n > 1) {
    // The count round: row j of `matrix` is rank j's send_counts then its recv_counts.
    const size_t row = 2 * size_t(n);
    std::vector<uint64_t> matrix(row * size_t(n));
    uint64_t* const mine = matrix.data() + size_t(r) * row;
    for (int j = 0; j < n; ++j) {
      mine[size_t(j)] = send_counts[size_t(j)];
      mine[size_t(n + j)] = recv_counts[size_t(j)];
    }
    Tickets sends;
    Tickets receives;
    for (int k = 1; k < n; ++k) {
      const int j = (r + k) % n;
      Connection& peer = ctx.peer(j);
      sends.emplace_back(&peer, peer.PostSend(ctx.tag, mine, row * sizeof(uint64_t)));
      receives.emplace_back(
          &peer, peer.PostRecv(ctx.tag, matrix.data() + size_t(j) * row, row * sizeof(uint64_t)));
    }
    WaitRecvs(receives);
    WaitSends(sends);
    // Every pair, the ones this rank is part of first (its own message names them).
    std::string fault;
    for (int i = 0; i < n && fault.empty(); ++i) {
      for (int j = 0; j < n && fault.empty(); ++j) {
        const bool concerns_me = i == r || j == r;
        const uint64_t sent = matrix[size_t(i) * row + size_t(j)];
        const uint64_t expected = matrix[size_t(j) * row + size_t(n + i)];
        if (sent != expected && concerns_me) {
          fault = "rank " + std::to_string(i) + " sends " + std::to_string(sent) +
                  " elements to rank " + std::to_string(j) + ", which expects " +
                  std::to_string(expected) + " from it";
        }
      }
    }
    for (int i = 0; i < n && fault.empty(); ++i) {
      for (int j = 0; j < n && fault.empty(); ++j) {
        const uint64_t sent = matrix[size_t(i) * row + size_t(j)];
        const uint64_t expected = matrix[size_t(j) * row + size_t(n + i)];
        if (sent != expected) {
          fault = "rank " + std::to_string(i) + " sends " + std::to_string(sent) +
                  " elements to rank " + std::to_string(j) + ", which expects " +
                  std::to_string(expected) + " from it";
        }
      }
    }
    if (!fault.empty()) {
      throw Error(ErrorCode::kMismatch, "rank " + std::to_string(r) + ": " + ctx.tag.ToString() +
                                            ": the ranks' counts do not fit: " + fault);
    }
  }
  Tickets sends;
  Tickets receives;
  for (int k = 1; k < n; ++k) {
    const int to = (r + k) % n;
    const int from = (r + n - k) % n;
    Connection& out = ctx.peer(to);
    sends.emplace_back(&out, PostFramesOut(ctx, out, ctx.tag, send + send_at[size_t(to)] * es,
                                           send_counts[size_t(to)] * es));
    Connection& in = ctx.peer(from);
    receives.emplace_back(&in, PostFramesIn(ctx, in, ctx.tag, recv + recv_at[size_t(from)] * es,
                                            recv_counts[size_t(from)] * es));
  }
  CopyUnlessSame(recv + recv_at[size_t(r)] * es, send + send_at[size_t(r)] * es,
                 recv_counts[size_t(r)] * es);
  WaitRecvs(receives);
  WaitSends(sends);
}

core::CallDescriptor PointToPointDescriptor(DataType dtype, size_t count, int64_t tag) {
  const bool fits = tag > INT32_MIN && tag <= INT32_MAX;
  return core::CallDescriptor{core::CollectiveKind::kSend, dtype, ReduceOp::kSum,
                              fits ? int32_t(tag) : INT32_MIN, count};
}

void SendMessage(Context& ctx, int peer, uint64_t number, const void* data, size_t count,
                 DataType dtype, int64_t tag) {
  SendMessageFrames(ctx, peer, number, data, count, dtype, tag, 0,
                    MessageFrames(ctx.chunk_bytes, count * SizeOf(dtype)));
}

void RecvMessage(Context& ctx, int peer, uint64_t number, void* data, size_t count, DataType dtype,
                 int64_t tag) {
  RecvMessageFrames(ctx, peer, number, data, count, dtype, tag, 0,
                    MessageFrames(ctx.chunk_bytes, count * SizeOf(dtype)));
}

size_t MessageFrames(size_t chunk_bytes, size_t bytes) {
  return std::max<size_t>(1, CeilDiv(bytes, chunk_bytes));
}

size_t MessageFrameOffset(size_t chunk_bytes, size_t bytes, size_t f) {
  return Split{bytes, MessageFrames(chunk_bytes, bytes)}.Offset(f);
}

void SendMessageFrames(Context& ctx, int peer, uint64_t number, const void* data, size_t count,
                       DataType dtype, int64_t tag, size_t first, size_t last) {
  const core::CallTag frame{core::kPointToPointSeqBit | number,
                            PointToPointDescriptor(dtype, count, tag)};
  Connection& to = ctx.peer(peer);
  const int64_t wide = tag;
  if (first == 0 && frame.call.root == INT32_MIN) to.PostSend(frame, &wide, sizeof wide);
  const Split frames = FramesOf(ctx, count * SizeOf(dtype));
  const auto* bytes = static_cast<const uint8_t*>(data);
  uint64_t sent = 0;
  for (size_t f = first; f < last; ++f) {
    sent = to.PostSend(frame, bytes + (frames.Offset(f) - frames.Offset(first)), frames.Length(f));
  }
  if (last > first) to.WaitSend(sent);
}

void RecvMessageFrames(Context& ctx, int peer, uint64_t number, void* data, size_t count,
                       DataType dtype, int64_t tag, size_t first, size_t last) {
  const core::CallTag frame{core::kPointToPointSeqBit | number,
                            PointToPointDescriptor(dtype, count, tag)};
  Connection& from = ctx.peer(peer);
  if (first == 0 && frame.call.root == INT32_MIN) {
    int64_t got = 0;
    from.WaitRecv(from.PostRecv(frame, &got, sizeof got));
    if (got != tag) {
      throw Error(ErrorCode::kMismatch,
                  "rank " + std::to_string(ctx.rank()) + ": frame from rank " +
                      std::to_string(peer) + " does not match: expected " + frame.ToString() +
                      " with tag " + std::to_string(tag) + ", got tag " + std::to_string(got));
    }
  }
  const Split frames = FramesOf(ctx, count * SizeOf(dtype));
  auto* bytes = static_cast<uint8_t*>(data);
  uint64_t received = 0;
  for (size_t f = first; f < last; ++f) {
    received =
        from.PostRecv(frame, bytes + (frames.Offset(f) - frames.Offset(first)), frames.Length(f));
  }
  if (last > first) from.WaitRecv(received);
}

}  // namespace collectives::ring
