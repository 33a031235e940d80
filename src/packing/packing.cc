// The packer: bucket planning (a pure function), and all-reduce / broadcast of a list of tensors
// through fusion buffers.
//
// A bucket of one tensor (not counting zero-size ones) is issued on that tensor, in place,
// without a copy or a fusion buffer; a bucket with no bytes (only zero-size tensors) issues
// nothing, on every rank alike (after the check every call makes, CheckListsAgree). Other
// buckets are packed into a fusion buffer, reduced (or broadcast) in one collective, unpacked;
// but where the communicator takes a bucket's tensors as they are (core::InternalCommunication:
// RING, whose frames are gathered from the tensors and scattered into them, and AUTO, in shared
// memory on one host and in two levels) each fused bucket is issued on them, no fusion buffer. Two
// schedules walk the buckets 0..B-1 (src/packing/schedule.h; names as in RunBuckets):
//
// Overlapped (RunOverlapped):
//   Start(0)
//   for k in 1..B-1:  Start(k)        pack k into the free fusion buffer, issue it (async)
//                     Finish(k-1)     wait for k-1, unpack it (its buffer is free again)
//   Finish(B-1)
// so bucket k+1 is packed while bucket k is on the wire, k+1 is queued behind k on the
// communicator's progress thread (no idle gap between them), and bucket k is unpacked while k+1
// is on the wire. At most two buckets are in flight and two fusion buffers in use.
//
// Serial (RunSerial): pack k, blocking collective on k, unpack k; one fusion buffer. The
// blocking form may run on the caller's thread (no hand-off to the progress thread and back),
// and nothing competes with the collective for a core. A list that is one bucket always runs
// this way: there is nothing to overlap.
//
// A fused bucket is at most bytes_per_pack; fusion buffers are kept between calls, per thread
// (FusionBuffer).
//
// Failure: a collective that fails breaks the communicator (communication.h), so every bucket
// still in flight fails at once; we wait for all of them before the fusion buffers are given
// back, then rethrow the first error. Any other failure once the call has begun issuing (an
// allocation) aborts the communicator with it (AbortPartlyIssued): the other ranks would
// otherwise wait for the collectives this rank did not issue.
#include "collectives/packing.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "collectives/errors.h"
#include "src/core/aligned_bytes.h"
#include "src/core/arguments.h"
#include "src/core/environment.h"
#include "src/core/fnv1a.h"
#include "src/core/internal_communication.h"
#include "src/packing/schedule.h"

namespace collectives::packing {
namespace {

// The default bucket cap: small tensors gain from any cap of 1 MiB or more, and lists of large
// tensors lose from larger ones, over TCP and in shared memory alike (see docs/tuning.md).
constexpr size_t kDefaultBytesPerPack = size_t{1} << 20;

// bytes_per_pack as given, or comm's default for 0.
size_t CapOf(const CollectiveCommunication& comm, size_t bytes_per_pack) {
  return bytes_per_pack == 0 ? DefaultBytesPerPack(comm) : bytes_per_pack;
}

// "rank 3: packing all_reduce: tensor 7 "
std::string Where(const CollectiveCommunication& comm, const char* collective, size_t index) {
  return "rank " + std::to_string(comm.rank()) + ": packing " + collective + ": tensor " +
         std::to_string(index) + " ";
}

// Refuses, before anything is issued, what the packer cannot handle. CUDA tensors go where the
// communicator takes a fused bucket's tensors as they are (RING and AUTO, which stage each
// bucket through pinned host memory in segments): a fusion buffer is host memory.
void CheckTensors(CollectiveCommunication& comm, const char* collective,
                  const std::vector<Tensor>& tensors) {
  const core::InternalCommunication* const internal = core::Internal(comm);
  const bool takes_cuda = internal != nullptr && internal->RunsGatedCalls();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (t.device.kind != Device::Kind::kCpu &&
        !(t.device.kind == Device::Kind::kCuda && takes_cuda)) {
      throw Error(ErrorCode::kNotSupported,
                  Where(comm, collective, i) + "is on " + t.device.ToString() +
                      "; the packer takes CPU tensors, and CUDA tensors on RING and AUTO only");
    }
    core::CheckTensorData(t, [&] { return Where(comm, collective, i); });
  }
  // Tensors that share bytes would be reduced twice where they sit in different buckets (once
  // where they share one): each tensor of the list must be memory of its own.
  struct Span {
    uintptr_t begin;
    uintptr_t end;
    size_t index;
  };
  std::vector<Span> spans;
  spans.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(tensors[i].data);
    if (tensors[i].bytes() > 0) spans.push_back({begin, begin + tensors[i].bytes(), i});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t k = 1, reach = 0; k < spans.size(); ++k) {  // spans[reach] ends furthest so far
    if (spans[k].begin < spans[reach].end) {
      const size_t i = std::min(spans[k].index, spans[reach].index);
      const size_t j = std::max(spans[k].index, spans[reach].index);
      throw Error(ErrorCode::kInvalidArgument,
                  Where(comm, collective, j) + "shares memory with tensor " + std::to_string(i) +
                      " of the list; every tensor must be memory of its own");
    }
    if (spans[k].end > spans[reach].end) reach = k;
  }
}

// Lists that differ across ranks but plan into buckets of the same sizes (tensors of 100 and 200
// elements on one rank, 200 and 100 on another) would be reduced into each other's tensors, and
// no frame would tell: a fused bucket's collective carries only its total count. So every rank
// first all-reduces, with max, (h, ~h) for a hash h of its list's (dtype, count) sequence: all
// lists hash alike exactly when every rank gets back its own pair (a rank below the largest h
// sees a larger max(h); the one with the largest h sees max(~h) from a smaller h). Then every
// rank raises kMismatch before anything is packed or written. A second pair does the same for
// the plan (which tensors share a bucket): equal lists cut by different bytes_per_pack would
// send buckets of different sizes, which the frames catch, but only once the first bucket is on
// the wire, and as a broken communicator that does not say why.
// The check runs on every call, whatever this rank's plan: whether a plan fuses, or moves any
// byte at all, depends on the list, and a rank whose list differs may not fuse (or may hold only
// zero-size tensors) where another does. A rank that skipped the check would send its first
// tensor's collective, or its next call's, against the other's check, and an int64 max of two
// elements matches it: that tensor would be reduced with the hash and returned as a success.
// Running it on every call also makes a broken communicator's error come back from a call that
// moves nothing. Cost: one 32-byte all-reduce per packed call.
//
// The asynchronous calls issue the same check first and read its answer in Wait, once every
// bucket has completed (ListsDiffer).
using ListHashes = std::array<int64_t, 4>;

ListHashes HashLists(const std::vector<Tensor>& tensors, const std::vector<Bucket>& planned) {
  uint64_t list = core::kFnv1aBasis;  // over (dtype, count) of every tensor
  core::Fnv1a(list, tensors.size());
  for (const Tensor& t : tensors) {
    core::Fnv1a(list, static_cast<uint64_t>(t.dtype));
    core::Fnv1a(list, t.count);
  }
  uint64_t plan = core::kFnv1aBasis;  // over the index lists of the buckets
  core::Fnv1a(plan, planned.size());
  for (const Bucket& bucket : planned) {
    core::Fnv1a(plan, bucket.size());
    for (size_t index : bucket) core::Fnv1a(plan, index);
  }
  return {std::bit_cast<int64_t>(list), std::bit_cast<int64_t>(~list), std::bit_cast<int64_t>(plan),
          std::bit_cast<int64_t>(~plan)};
}

// The kMismatch error of a list check whose answer `seen` (the max over ranks) is not this
// rank's own hashes `mine`, or nothing when the lists and plans agree. `outcome` says what the
// call left undone (a blocking call's BucketRunner::untouched).
std::optional<Error> ListsDiffer(int rank, const char* collective, size_t tensors,
                                 size_t bytes_per_pack, const ListHashes& mine,
                                 const ListHashes& seen, const std::string& outcome) {
  const std::string who = "rank " + std::to_string(rank) + ": packing " + collective + ": ";
  if (seen[0] != mine[0] || seen[1] != mine[1]) {
    return Error(ErrorCode::kMismatch,
                 who + "the list of " + std::to_string(tensors) +
                     " tensors differs from another rank's (dtype and count of each tensor, in "
                     "order); " +
                     outcome);
  }
  if (seen[2] != mine[2] || seen[3] != mine[3]) {
    const size_t cap = bytes_per_pack == 0 ? DefaultBytesPerPack() : bytes_per_pack;
    return Error(ErrorCode::kMismatch,
                 who + "the list is cut into buckets other than another rank's: bytes_per_pack (" +
                     std::to_string(cap) + " here) must be the same on every rank; " + outcome);
  }
  return std::nullopt;
}

void CheckListsAgree(CollectiveCommunication& comm, const char* collective,
                     const std::vector<Tensor>& tensors, const std::vector<Bucket>& planned,
                     size_t bytes_per_pack, const char* untouched) {
  const ListHashes mine = HashLists(tensors, planned);
  ListHashes seen = mine;
  comm.AllReduce(Tensor{seen.data(), seen.size(), DataType::kInt64}, ReduceOp::kMax);
  if (auto error = ListsDiffer(comm.rank(), collective, tensors.size(), bytes_per_pack, mine, seen,
                               untouched)) {
    throw *error;
  }
}

std::vector<TensorSpec> SpecsOf(const std::vector<Tensor>& tensors) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const Tensor& t : tensors) specs.push_back(TensorSpec{t.dtype, t.device, t.count});
  return specs;
}

// Fusion buffers outlive a call, one pair per calling thread: a fresh multi-megabyte
// allocation comes from mmap (or a trimmed heap) and page-faults on first touch, which costs as
// much as the all-reduce it feeds (see docs/tuning.md). A buffer
// larger than kMaxCachedBytes is freed at the end of the call, so a thread keeps at most
// 2 x kMaxCachedBytes (2 x the largest bucket it has used, 2 MiB with the default cap); the
// cache is freed when the thread exits.
constexpr size_t kMaxCachedBytes = size_t{64} << 20;

struct CachedBuffer {
  core::AlignedBytes data;
  size_t bytes = 0;
};
thread_local CachedBuffer tls_fusion_cache[2];

// A fusion buffer for one call, taken from the thread's cache slot on first use (allocated
// when the cached one is too small) and given back when the call ends. Not zeroed: packing
// overwrites what the collective reads.
class FusionBuffer {
 public:
  FusionBuffer(size_t bytes, CachedBuffer& home) : bytes_(bytes), home_(home) {}
  FusionBuffer(const FusionBuffer&) = delete;
  FusionBuffer& operator=(const FusionBuffer&) = delete;
  ~FusionBuffer() {
    if (buffer_.data && buffer_.bytes <= kMaxCachedBytes) home_ = std::move(buffer_);
  }

  uint8_t* data() {
    if (!buffer_.data) {
      if (home_.bytes >= bytes_) {
        buffer_ = std::move(home_);
      } else {
        home_ = CachedBuffer{};  // free the small one first: never both alive
        buffer_.data = core::AllocateAligned(bytes_);
        buffer_.bytes = bytes_;
      }
      home_.bytes = 0;
    }
    return buffer_.data.get();
  }

 private:
  const size_t bytes_;
  CachedBuffer& home_;
  CachedBuffer buffer_;
};

// The tensors of `bucket`, back to back, into `out`; and back.
void CopyIn(const std::vector<Tensor>& tensors, const Bucket& bucket, uint8_t* out) {
  for (size_t index : bucket) {
    const Tensor& t = tensors[index];
    if (t.count > 0) std::memcpy(out, t.data, t.bytes());
    out += t.bytes();
  }
}
void CopyOut(const std::vector<Tensor>& tensors, const Bucket& bucket, const uint8_t* in) {
  for (size_t index : bucket) {
    const Tensor& t = tensors[index];
    if (t.count > 0) std::memcpy(t.data, in, t.bytes());
    in += t.bytes();
  }
}

// What to do with each bucket: how to issue its collective (on one tensor, in place), and
// whether the fusion buffer must be filled from the tensors before (pack) and copied back to
// them after (unpack).
struct BucketRunner {
  bool pack;
  bool unpack;
  // Issues the collective on `t` in place; returns its Work.
  std::function<std::shared_ptr<Work>(const Tensor& t)> issue_async;
  // The same, blocking.
  std::function<void(const Tensor& t)> issue_blocking;
  // What a blocking call whose list check fails has left undone, in the collective's words.
  const char* untouched;
  // Where set (a communicator that runs calls in pieces: core::InternalCommunication), a fused
  // bucket is issued on its tensors as they are, no fusion buffer, no packing or unpacking:
  // blocking, and asynchronous.
  std::function<void(const std::vector<Tensor>& pieces)> issue_pieces_blocking;
  // Where set (RING and AUTO), the asynchronous form's buckets are issued so, each doing nothing
  // unless `go` (core::Gate).
  std::function<std::shared_ptr<Work>(const Tensor& t, core::Gate go)> issue_gated_async;
  std::function<std::shared_ptr<Work>(const std::vector<Tensor>& pieces, core::Gate go)>
      issue_pieces_async;
};

// The buckets of one call: those with bytes, and how to pack, issue and unpack them.
class Buckets {
 public:
  Buckets(const BucketRunner& runner, const std::vector<Tensor>& tensors,
          const std::vector<Bucket>& planned)
      : runner_(runner), tensors_(tensors) {
    for (const Bucket& bucket : planned) {
      size_t bytes = 0;
      size_t non_empty = 0;
      const Tensor* last_non_empty = nullptr;
      for (size_t index : bucket) {
        bytes += tensors[index].bytes();
        if (tensors[index].count > 0) {
          ++non_empty;
          last_non_empty = &tensors[index];
        }
      }
      if (bytes == 0) continue;  // moves nothing; every rank has the same list
      if (non_empty == 1) {      // zero-size companions aside, a single tensor: in place
        buckets_.push_back(Entry{&bucket, last_non_empty});
      } else {
        buckets_.push_back(Entry{&bucket, nullptr});
        fusion_bytes_ = std::max(fusion_bytes_, bytes);
      }
    }
  }

  size_t size() const { return buckets_.size(); }
  const Bucket& operator[](size_t k) const { return *buckets_[k].bucket; }
  // The largest bucket that needs a fusion buffer.
  size_t fusion_bytes() const { return fusion_bytes_; }
  // The one tensor of bucket k with elements, if it has only one; else null (the bucket is fused).
  const Tensor* Single(size_t k) const { return buckets_[k].single; }

  // The fused view of `bucket` over `data`: its tensors back to back.
  Tensor FusedView(const Bucket& bucket, void* data) const {
    size_t count = 0;
    for (size_t index : bucket) count += tensors_[index].count;
    const Tensor& first = tensors_[bucket.front()];
    return Tensor{data, count, first.dtype, first.device};
  }
  // The tensors of `bucket` that have elements, in order.
  std::vector<Tensor> Pieces(const Bucket& bucket) const {
    std::vector<Tensor> pieces;
    pieces.reserve(bucket.size());
    for (size_t index : bucket) {
      if (tensors_[index].count > 0) pieces.push_back(tensors_[index]);
    }
    return pieces;
  }
  // Bucket's bytes; the bytes of every tensor of it, in order.
  size_t Bytes(const Bucket& bucket) const {
    size_t bytes = 0;
    for (size_t index : bucket) bytes += tensors_[index].bytes();
    return bytes;
  }
  void Pack(const Bucket& bucket, uint8_t* out) const {
    if (runner_.pack) CopyIn(tensors_, bucket, out);
  }
  void Unpack(const Bucket& bucket, const uint8_t* in) const {
    if (runner_.unpack) CopyOut(tensors_, bucket, in);
  }

 private:
  struct Entry {
    const Bucket* bucket;
    const Tensor* single;
  };
  const BucketRunner& runner_;
  const std::vector<Tensor>& tensors_;
  std::vector<Entry> buckets_;
  size_t fusion_bytes_ = 0;
};

void RunSerial(const BucketRunner& runner, const Buckets& buckets) {
  FusionBuffer buffer(buckets.fusion_bytes(), tls_fusion_cache[0]);
  for (size_t k = 0; k < buckets.size(); ++k) {
    const Bucket& bucket = buckets[k];
    if (const Tensor* single = buckets.Single(k)) {
      runner.issue_blocking(*single);
      continue;
    }
    if (runner.issue_pieces_blocking) {
      runner.issue_pieces_blocking(buckets.Pieces(bucket));
      continue;
    }
    uint8_t* data = buffer.data();
    buckets.Pack(bucket, data);
    runner.issue_blocking(buckets.FusedView(bucket, data));
    buckets.Unpack(bucket, data);
  }
}

void RunOverlapped(const BucketRunner& runner, const Buckets& buckets) {
  struct InFlight {
    const Bucket* bucket = nullptr;
    std::shared_ptr<Work> work;
    int slot = -1;  // the fusion buffer it uses; -1: a single tensor, in place
  };
  FusionBuffer buffers[2] = {FusionBuffer(buckets.fusion_bytes(), tls_fusion_cache[0]),
                             FusionBuffer(buckets.fusion_bytes(), tls_fusion_cache[1])};
  bool slot_busy[2] = {false, false};
  std::vector<InFlight> in_flight;  // oldest first; at most two
  in_flight.reserve(2);

  auto start = [&](size_t k) {
    const Bucket& bucket = buckets[k];
    InFlight f;
    f.bucket = &bucket;
    if (const Tensor* single = buckets.Single(k)) {
      f.work = runner.issue_async(*single);
    } else if (runner.issue_pieces_async) {
      f.work = runner.issue_pieces_async(buckets.Pieces(bucket), {});
    } else {
      f.slot = slot_busy[0] ? 1 : 0;
      uint8_t* data = buffers[f.slot].data();
      buckets.Pack(bucket, data);
      slot_busy[f.slot] = true;  // from here on the collective may read or write it
      f.work = runner.issue_async(buckets.FusedView(bucket, data));
    }
    in_flight.push_back(std::move(f));
  };
  auto finish = [&] {
    InFlight f = std::move(in_flight.front());
    in_flight.erase(in_flight.begin());
    f.work->Wait();
    if (f.slot >= 0) {
      buckets.Unpack(*f.bucket, buffers[f.slot].data());
      slot_busy[f.slot] = false;
    }
  };

  try {
    start(0);
    for (size_t k = 1; k < buckets.size(); ++k) {
      start(k);
      finish();
    }
    finish();
  } catch (...) {
    // The communicator is broken (or the issue was refused): what is still in flight fails
    // promptly. Wait for it, so that no collective outlives the buffers it uses.
    for (InFlight& f : in_flight) {
      try {
        f.work->Wait();
      } catch (...) {
      }
    }
    throw;
  }
}

// A failure that is not the communicator's own (an allocation) once part of a call was issued:
// the other ranks would wait for the rest, or pair it with this rank's next call. Aborts `comm`
// with it, "rank R: packing <collective>: out of memory <when()>; the communicator is aborted,
// since the other ranks' calls would wait for the rest", and throws that error (when even its
// message cannot be built, aborts plainly and throws `failure`).
template <typename When>
[[noreturn]] void AbortPartlyIssued(CollectiveCommunication& comm, const char* collective,
                                    When&& when, std::exception_ptr failure) {
  std::optional<Error> error;
  try {
    ErrorCode code = ErrorCode::kInternal;
    std::string what;
    try {
      std::rethrow_exception(failure);
    } catch (const Error& e) {
      code = e.code();
      what = e.message();
    } catch (const std::bad_alloc&) {
      code = ErrorCode::kSystem;
      what = "out of memory";
    } catch (const std::exception& e) {
      what = std::string("unexpected exception: ") + e.what();
    } catch (...) {
      what = "unexpected exception of unknown type";
    }
    error = Error(code, "rank " + std::to_string(comm.rank()) + ": packing " + collective + ": " +
                            what + " " + when() +
                            "; the communicator is aborted, since the other ranks' calls would "
                            "wait for the rest");
  } catch (...) {
    comm.Abort();
    std::rethrow_exception(failure);
  }
  if (core::InternalCommunication* const internal = core::Internal(comm)) {
    internal->Abort(*error);
  } else {
    comm.Abort();
  }
  throw *error;
}

void RunBuckets(CollectiveCommunication& comm, const char* collective, const BucketRunner& runner,
                const std::vector<Tensor>& tensors, size_t bytes_per_pack,
                internal::Schedule schedule) {
  bytes_per_pack = CapOf(comm, bytes_per_pack);
  const std::vector<Bucket> planned = PlanBuckets(SpecsOf(tensors), bytes_per_pack);
  const Buckets buckets(runner, tensors, planned);
  try {
    CheckListsAgree(comm, collective, tensors, planned, bytes_per_pack, runner.untouched);
    if (buckets.size() == 0) return;
    if (schedule == internal::Schedule::kAuto) schedule = internal::AutoSchedule(comm.size());
    if (buckets.size() == 1 || schedule == internal::Schedule::kSerial) {
      RunSerial(runner, buckets);
    } else {
      RunOverlapped(runner, buckets);
    }
  } catch (const Error&) {
    throw;  // a collective's (the communicator is broken), or the lists differ (it is not)
  } catch (...) {
    AbortPartlyIssued(
        comm, collective,
        [&] {
          return "while issuing the call's " + std::to_string(1 + buckets.size()) +
                 " collectives (the list check and the buckets)";
        },
        std::current_exception());
  }
}

// The buffers of finished asynchronous calls, kept for the next ones (from any thread: a call may
// finish on another thread than its own): a fresh allocation of a list's fused bytes is faulted
// in page by page on every call (see docs/tuning.md). Holds at most kPooledBuffers buffers of at
// most kMaxCachedBytes each; a call takes the smallest one large enough.
constexpr size_t kPooledBuffers = 2;

class BufferPool {
 public:
  CachedBuffer Take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->bytes >= bytes && (best == free_.end() || it->bytes < best->bytes)) best = it;
      }
      if (best != free_.end()) {
        CachedBuffer taken = std::move(*best);
        free_.erase(best);
        return taken;
      }
    }
    CachedBuffer fresh;
    fresh.data = core::AllocateAligned(bytes);
    fresh.bytes = bytes;
    return fresh;
  }

  void Give(CachedBuffer buffer) {
    if (!buffer.data || buffer.bytes > kMaxCachedBytes) return;
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(buffer));
    if (free_.size() > kPooledBuffers) {  // drop the smallest
      free_.erase(std::min_element(
          free_.begin(), free_.end(),
          [](const CachedBuffer& a, const CachedBuffer& b) { return a.bytes < b.bytes; }));
    }
  }

 private:
  std::mutex mu_;
  std::vector<CachedBuffer> free_;
};

BufferPool& AsyncBuffers() {
  static BufferPool* const pool = new BufferPool();  // never destroyed: calls may outlive main
  return *pool;
}

// The Work of AllReduceAsync / BroadcastAsync. Start issues every collective of the call, in
// order, on the calling thread: the list check first, then each bucket, a tensor alone in its
// bucket in place, a fused bucket packed first into the call's own buffer (one buffer for all
// of them, each bucket at a cache-line offset of its own: no bucket waits for a buffer to come
// free; taken from AsyncBuffers). Once every collective has completed, Wait or Done finishes the
// call: the list check's answer, then the unpacking, then the buffer goes back to the pool.
// Where the communicator takes a bucket's tensors as they are (RunsGatedCalls), every bucket is
// issued on them instead, no buffer, and runs only if the list check, which completes before it,
// found the lists alike: else it does nothing, on every rank, and Wait raises the difference.
class PackedWork final : public Work {
 public:
  PackedWork(int rank, const char* collective, std::vector<Tensor> tensors, size_t bytes_per_pack)
      : rank_(rank),
        collective_(collective),
        tensors_(std::move(tensors)),
        bytes_per_pack_(bytes_per_pack) {}
  PackedWork(const PackedWork&) = delete;
  PackedWork& operator=(const PackedWork&) = delete;
  // What is still in flight may be writing this object's buffers: it is waited for (errors
  // dropped; nobody asked for them).
  ~PackedWork() override {
    if (finished_) return;
    for (const std::shared_ptr<Work>& work : AllWorks()) {
      try {
        work->Wait();
      } catch (...) {
      }
    }
    AsyncBuffers().Give(std::move(buffer_));
  }

  void Start(CollectiveCommunication& comm, const BucketRunner& runner) {
    planned_ = PlanBuckets(SpecsOf(tensors_), bytes_per_pack_);
    const Buckets buckets(runner, tensors_, planned_);
    unpack_ = runner.unpack;
    mine_ = HashLists(tensors_, planned_);
    seen_ = mine_;
    std::vector<size_t> offsets(buckets.size(), kInPlace);
    size_t total = 0;
    for (size_t k = 0; k < buckets.size(); ++k) {
      if (buckets.Single(k) != nullptr || runner.issue_pieces_async) continue;
      offsets[k] =
          (total + core::kCacheLineBytes - 1) / core::kCacheLineBytes * core::kCacheLineBytes;
      total = offsets[k] + buckets.Bytes(buckets[k]);
    }
    if (total > 0) buffer_ = AsyncBuffers().Take(total);
    collectives_ = 1 + buckets.size();
    check_ =
        comm.AllReduceAsync(Tensor{seen_.data(), seen_.size(), DataType::kInt64},
                            Tensor{seen_.data(), seen_.size(), DataType::kInt64}, ReduceOp::kMax);
    issued_.reserve(buckets.size());
    // Every bucket runs after the list check has completed and, where the communicator can gate
    // it, does nothing unless the check found the lists alike, on every rank alike (every rank
    // sees the same answer): a tensor alone in its bucket too, since where the lists differ a
    // bucket that is one tensor here may be fused on another rank, and no rank may run a
    // collective the others skip. Then a list that differs writes nothing.
    const auto gate = [this] { return seen_ == mine_; };
    untouched_ = runner.issue_gated_async
                     ? runner.untouched
                     : "no fused tensor was written (a tensor alone in its bucket was issued "
                       "before the answer came)";
    const auto issue = [&](const Tensor& t) {
      return runner.issue_gated_async ? runner.issue_gated_async(t, gate) : runner.issue_async(t);
    };
    for (size_t k = 0; k < buckets.size(); ++k) {
      const Bucket& bucket = buckets[k];
      // A tensor alone goes as it is (gated wherever pieces are: the same communicators run
      // both), not as a message in runs of one, which recursive doubling would copy.
      if (const Tensor* single = buckets.Single(k)) {
        issued_.push_back(Issued{&bucket, issue(*single), kInPlace});
        continue;
      }
      if (runner.issue_pieces_async) {
        issued_.push_back(
            Issued{&bucket, runner.issue_pieces_async(buckets.Pieces(bucket), gate), kInPlace});
        continue;
      }
      uint8_t* data = buffer_.data.get() + offsets[k];
      buckets.Pack(bucket, data);
      issued_.push_back(Issued{&bucket, issue(buckets.FusedView(bucket, data)), offsets[k]});
    }
  }

  // How many collectives Start queued, and how many the call has.
  size_t Queued() const { return (check_ ? 1 : 0) + issued_.size(); }
  size_t Collectives() const { return collectives_; }

  void Wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked();
    if (failure_) std::rethrow_exception(failure_);
  }

  // Finishes the call (a copy, never a wait for a peer) once every collective has completed.
  bool Done() const override {
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return false;  // another thread is finishing it, or waiting
    if (finished_) return true;
    for (const std::shared_ptr<Work>& work : AllWorks()) {
      if (!work->Done()) return false;
    }
    FinishLocked();
    return true;
  }

 private:
  static constexpr size_t kInPlace = SIZE_MAX;
  struct Issued {
    const Bucket* bucket;
    std::shared_ptr<Work> work;
    size_t offset;  // into buffer_; kInPlace for a tensor alone in its bucket
  };

  std::vector<std::shared_ptr<Work>> AllWorks() const {
    std::vector<std::shared_ptr<Work>> works;
    if (check_) works.push_back(check_);
    for (const Issued& issued : issued_) works.push_back(issued.work);
    return works;
  }

  // Waits for every collective; the call's error is the list check's own failure, else its
  // answer (lists that differ make the buckets fail or mix tensors: the cause comes first), else
  // the first bucket's failure. Unpacks only when there is none.
  void FinishLocked() const {
    if (finished_) return;
    std::exception_ptr check_failure;
    std::exception_ptr bucket_failure;
    try {
      check_->Wait();
    } catch (...) {
      check_failure = std::current_exception();
    }
    for (const Issued& issued : issued_) {
      try {
        issued.work->Wait();
      } catch (...) {
        if (!bucket_failure) bucket_failure = std::current_exception();
      }
    }
    finished_ = true;
    if (check_failure) {
      failure_ = check_failure;
    } else if (std::optional<Error> differ =
                   ListsDiffer(rank_, collective_, tensors_.size(), bytes_per_pack_, mine_, seen_,
                               untouched_)) {
      failure_ = std::make_exception_ptr(*differ);
    } else if (bucket_failure) {
      failure_ = bucket_failure;
    } else if (unpack_) {
      for (const Issued& issued : issued_) {
        if (issued.offset != kInPlace) {
          CopyOut(tensors_, *issued.bucket, buffer_.data.get() + issued.offset);
        }
      }
    }
    AsyncBuffers().Give(std::move(buffer_));
    buffer_ = CachedBuffer{};
  }

  const int rank_;
  const char* const collective_;
  const std::vector<Tensor> tensors_;
  const size_t bytes_per_pack_;
  // Set by Start, read by FinishLocked.
  std::vector<Bucket> planned_;
  bool unpack_ = false;
  const char* untouched_ = "";  // what a list that differs left undone
  ListHashes mine_{};
  ListHashes seen_{};  // the list check's buffer, then its answer
  size_t collectives_ = 0;  // the list check and the buckets
  std::shared_ptr<Work> check_;
  std::vector<Issued> issued_;
  // Under mu_ once Start has returned (Done, a const call, finishes the call too).
  mutable std::mutex mu_;
  mutable CachedBuffer buffer_;  // from AsyncBuffers, given back when the call finishes
  mutable bool finished_ = false;
  mutable std::exception_ptr failure_;
};

// Where the communicator runs gated calls and calls in pieces (core::InternalCommunication:
// RING and AUTO), the asynchronous form's buckets are gated on the list check, and a fused bucket
// is issued on its tensors as they are: packing would copy every byte twice more (see
// docs/tuning.md).
void SetGates(BucketRunner& runner, CollectiveCommunication& comm, ReduceOp op,
              ReduceOp checked_as) {
  core::InternalCommunication* const internal = core::Internal(comm);
  if (internal == nullptr || !internal->RunsGatedCalls()) return;
  runner.issue_gated_async = [internal, op, checked_as](const Tensor& t, core::Gate go) {
    return internal->AllReduceAsync(t, t, op, {checked_as, std::move(go)});
  };
  runner.issue_pieces_blocking = [internal, op, checked_as](const std::vector<Tensor>& pieces) {
    internal->AllReduce(pieces, op, {checked_as, {}});
  };
  runner.issue_pieces_async = [internal, op, checked_as](const std::vector<Tensor>& pieces,
                                                         core::Gate go) {
    return internal->AllReduceAsync(pieces, op, {checked_as, std::move(go)});
  };
}

BucketRunner AllReduceRunner(CollectiveCommunication& comm, const std::vector<Tensor>& tensors,
                             ReduceOp op) {
  CheckTensors(comm, "all_reduce", tensors);
  core::CheckReduceOp(core::ArgumentPrefix(comm.rank(), "packing all_reduce"), op);
  BucketRunner runner{/*pack=*/true,
                      /*unpack=*/true,
                      [&comm, op](const Tensor& t) { return comm.AllReduceAsync(t, t, op); },
                      [&comm, op](const Tensor& t) { comm.AllReduce(t, t, op); },
                      "nothing was reduced or written",
                      {},
                      {},
                      {}};
  SetGates(runner, comm, op, op);
  return runner;
}

// The buckets reduce with `op` and are checked as `checked_as` (internal::AllReduce).
BucketRunner AllReduceCheckedAsRunner(CollectiveCommunication& comm,
                                      const std::vector<Tensor>& tensors, ReduceOp op,
                                      ReduceOp checked_as) {
  BucketRunner runner = AllReduceRunner(comm, tensors, op);
  core::CheckReduceOp(core::ArgumentPrefix(comm.rank(), "packing all_reduce"), checked_as);
  // Checked as `checked_as` where the communicator has an internal side; a user's wrapper takes
  // the plain all-reduce.
  if (core::InternalCommunication* const internal = core::Internal(comm)) {
    runner.issue_async = [internal, op, checked_as](const Tensor& t) {
      return internal->AllReduceAsync(t, t, op, {checked_as, {}});
    };
    runner.issue_blocking = [internal, op, checked_as](const Tensor& t) {
      internal->AllReduce(t, t, op, {checked_as, {}});
    };
  }
  SetGates(runner, comm, op, checked_as);
  return runner;
}

BucketRunner BroadcastRunner(CollectiveCommunication& comm, const std::vector<Tensor>& tensors,
                             int root) {
  CheckTensors(comm, "broadcast", tensors);
  if (root < 0 || root >= comm.size()) {
    throw Error(ErrorCode::kInvalidArgument,
                "rank " + std::to_string(comm.rank()) + ": packing broadcast: root " +
                    std::to_string(root) + " is not a rank of this communicator (size " +
                    std::to_string(comm.size()) + ")");
  }
  const bool is_root = comm.rank() == root;
  // The root packs and its tensors are already the result; the others only unpack.
  BucketRunner runner{/*pack=*/is_root,
                      /*unpack=*/!is_root,
                      [&comm, root](const Tensor& t) { return comm.BroadcastAsync(t, t, root); },
                      [&comm, root](const Tensor& t) { comm.Broadcast(t, t, root); },
                      "no tensor was broadcast or written",
                      {},
                      {},
                      {}};
  core::InternalCommunication* const internal = core::Internal(comm);
  if (internal != nullptr && internal->RunsGatedCalls()) {  // as SetGates
    runner.issue_gated_async = [internal, root](const Tensor& t, core::Gate go) {
      return internal->BroadcastAsync(t, t, root, {{}, std::move(go)});
    };
    runner.issue_pieces_blocking = [internal, root](const std::vector<Tensor>& pieces) {
      internal->Broadcast(pieces, root, {});
    };
    runner.issue_pieces_async = [internal, root](const std::vector<Tensor>& pieces, core::Gate go) {
      return internal->BroadcastAsync(pieces, root, {{}, std::move(go)});
    };
  }
  return runner;
}

std::shared_ptr<Work> StartAsync(CollectiveCommunication& comm, const char* collective,
                                 const BucketRunner& runner, const std::vector<Tensor>& tensors,
                                 size_t bytes_per_pack) {
  auto work = std::make_shared<PackedWork>(comm.rank(), collective, tensors,
                                           CapOf(comm, bytes_per_pack));
  try {
    work->Start(comm, runner);
  } catch (...) {
    // Nothing queued: the call did not happen, on this rank as on the others (they wait for it).
    if (work->Queued() == 0) throw;
    // Part of the call is queued, an allocation having failed (the communicator's own failures
    // complete the Work instead). `work`, released, waits for what was queued (failing at once).
    AbortPartlyIssued(
        comm, collective,
        [&] {
          return "after " + std::to_string(work->Queued()) + " of the call's " +
                 std::to_string(work->Collectives()) + " collectives were queued";
        },
        std::current_exception());
  }
  return work;
}

}  // namespace

size_t DefaultBytesPerPack() { return kDefaultBytesPerPack; }

size_t DefaultBytesPerPack(const CollectiveCommunication& comm) {
  (void)comm;  // the same for every implementation
  return kDefaultBytesPerPack;
}

// One open bucket per (dtype, device) kind; lists rarely hold more than two or three kinds, so
// a linear search is cheapest. A tensor larger than the cap closes the open bucket of its kind
// (it does not fit) and takes a closed bucket of its own; the next tensor of that kind opens a
// new one. A tensor of exactly the cap fits an empty bucket.
std::vector<Bucket> PlanBuckets(const std::vector<TensorSpec>& tensors, size_t bytes_per_pack) {
  const size_t cap = bytes_per_pack == 0 ? DefaultBytesPerPack() : bytes_per_pack;
  struct Open {
    DataType dtype;
    Device device;
    size_t bucket;  // index into `buckets`
    size_t bytes;
  };
  std::vector<Open> open;
  std::vector<Bucket> buckets;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const size_t size = SizeOf(t.dtype);
    if (size == 0) {
      throw Error(ErrorCode::kInvalidArgument, "PlanBuckets: tensor " + std::to_string(i) +
                                                   " has an unknown dtype " +
                                                   std::to_string(int(t.dtype)));
    }
    // A byte count past size_t is larger than any cap: alone in its bucket.
    const size_t bytes = t.count > SIZE_MAX / size ? SIZE_MAX : t.count * size;
    auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) {
      return o.dtype == t.dtype && o.device == t.device;
    });
    if (it != open.end() && bytes <= cap - it->bytes) {  // fits (cap - bytes cannot underflow)
      buckets[it->bucket].push_back(i);
      it->bytes += bytes;
      continue;
    }
    if (it != open.end()) open.erase(it);  // does not fit: close it
    buckets.push_back(Bucket{i});
    if (bytes <= cap) open.push_back(Open{t.dtype, t.device, buckets.size() - 1, bytes});
  }
  return buckets;
}

void AllReduce(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, ReduceOp op,
               size_t bytes_per_pack) {
  internal::AllReduce(comm, tensors, op, bytes_per_pack, internal::Schedule::kAuto);
}

void Broadcast(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, int root,
               size_t bytes_per_pack) {
  internal::Broadcast(comm, tensors, root, bytes_per_pack, internal::Schedule::kAuto);
}

std::shared_ptr<Work> AllReduceAsync(CollectiveCommunication& comm,
                                     const std::vector<Tensor>& tensors, ReduceOp op,
                                     size_t bytes_per_pack) {
  return StartAsync(comm, "all_reduce", AllReduceRunner(comm, tensors, op), tensors,
                    bytes_per_pack);
}

std::shared_ptr<Work> BroadcastAsync(CollectiveCommunication& comm,
                                     const std::vector<Tensor>& tensors, int root,
                                     size_t bytes_per_pack) {
  return StartAsync(comm, "broadcast", BroadcastRunner(comm, tensors, root), tensors,
                    bytes_per_pack);
}

namespace internal {

// Overlap pays when the caller's packing and the progress thread's collective each have a core;
// otherwise the two threads (and the Wait that polls) take cores from the peers' ranks (see
// docs/tuning.md). Every rank counts as local unless the launcher says how many are.
Schedule AutoSchedule(int world_size) {
  return core::CoresFor(std::max(1, core::LocalRanks(world_size)), 2) ? Schedule::kOverlapped
                                                                      : Schedule::kSerial;
}

void AllReduce(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, ReduceOp op,
               size_t bytes_per_pack, Schedule schedule) {
  RunBuckets(comm, "all_reduce", AllReduceRunner(comm, tensors, op), tensors, bytes_per_pack,
             schedule);
}

void AllReduce(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, ReduceOp op,
               ReduceOp checked_as, size_t bytes_per_pack) {
  RunBuckets(comm, "all_reduce", AllReduceCheckedAsRunner(comm, tensors, op, checked_as), tensors,
             bytes_per_pack, Schedule::kAuto);
}

void Broadcast(CollectiveCommunication& comm, const std::vector<Tensor>& tensors, int root,
               size_t bytes_per_pack, Schedule schedule) {
  RunBuckets(comm, "broadcast", BroadcastRunner(comm, tensors, root), tensors, bytes_per_pack,
             schedule);
}

}  // namespace internal
}  // namespace collectives::packing
