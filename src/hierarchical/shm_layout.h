// The shared-memory group's segment as both of its halves see it: the layout of the header and
// the control blocks (shm_group.h describes the protocol), the waits on their words, and
// ShmGroup::Segment, the mapping with its keeper thread. Private to src/hierarchical:
// shm_segment.cc sets the segment up and breaks it, shm_group.cc runs the collectives over it.
#ifndef COLLECTIVES_SRC_HIERARCHICAL_SHM_LAYOUT_H_
#define COLLECTIVES_SRC_HIERARCHICAL_SHM_LAYOUT_H_

#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "src/core/call.h"
#include "src/hierarchical/shm_group.h"

namespace collectives::hierarchical {

inline constexpr size_t kPage = 4096;
// Header::broken: kSound; kBrokenWritten, the error that broke the group is written; or
// kBreakingBy + i, member i has begun to break it (the index goes with the claim, so that a
// breaker killed before it wrote why can still be named).
inline constexpr uint32_t kSound = 0;
inline constexpr uint32_t kBrokenWritten = 2;
inline constexpr uint32_t kBreakingBy = 3;
// How long a sleeping waiter sleeps before it looks at the deadline, the broken flag and the
// liveness of the member it waits for.
inline constexpr int kSleepSliceMs = 20;

// How long a member that waits, with more members than cores, yields its core before it sleeps
// on the futex (ShmGroup's Await).
inline constexpr std::chrono::microseconds kShmYieldBudget{200};

// A CallTag as it sits in shared memory.
struct WireTag {
  uint64_t seq;
  uint64_t count;
  int32_t root;
  uint8_t kind;
  uint8_t dtype;
  uint8_t op;
  uint8_t pad;

  static WireTag Of(const core::CallTag& t) {
    return WireTag{t.seq,
                   t.call.count,
                   t.call.root,
                   uint8_t(t.call.kind),
                   uint8_t(t.call.dtype),
                   uint8_t(t.call.op),
                   0};
  }
  core::CallTag ToTag() const {
    return core::CallTag{seq, core::CallDescriptor{core::CollectiveKind(kind), DataType(dtype),
                                                   ReduceOp(op), root, count}};
  }
  bool operator==(const WireTag&) const = default;

  // The fields after seq and count, in one word (AnnounceOutside).
  uint64_t Rest() const {
    uint64_t word;
    std::memcpy(&word, reinterpret_cast<const unsigned char*>(this) + offsetof(WireTag, root),
                sizeof word);
    return word;
  }
  static WireTag With(uint64_t seq, uint64_t count, uint64_t rest) {
    WireTag t{seq, count, 0, 0, 0, 0, 0};
    std::memcpy(reinterpret_cast<unsigned char*>(&t) + offsetof(WireTag, root), &rest, sizeof rest);
    return t;
  }
};
static_assert(offsetof(WireTag, pad) + 1 - offsetof(WireTag, root) == sizeof(uint64_t));

// One member's control block: written by its member only (but for `sleepers`), read by all.
// The counters and the tags share one cache line, so that a reader that sees an arrival finds
// the tag that goes with it in the same transfer.
struct alignas(64) Control {
  std::atomic<uint32_t> arrived;   // the last step whose input is in this member's slot
  std::atomic<uint32_t> reduced;   // the last step whose slice this member has reduced
  std::atomic<uint32_t> done;      // the last step this member finished reading
  std::atomic<uint32_t> sleepers;  // waiters asleep on one of the three words above
  WireTag tag[2];                  // the call of the last step in each buffer
  alignas(64) int32_t pid;  // set once `alive` is held (atomic_ref: others read it meanwhile)
  pthread_mutex_t alive;    // held by the member's keeper thread while it lives
  // The call this member runs outside the group (AnnounceOutside), a WireTag in three words
  // behind a sequence lock: outside_seq is 0 while the words change, else 1 + the tag's seq.
  alignas(64) std::atomic<uint64_t> outside_seq;
  std::atomic<uint64_t> outside_count;
  std::atomic<uint64_t> outside_rest;  // root, kind, dtype, op (WireTag::Rest)
};
static_assert(offsetof(Control, pid) == 64, "counters and tags fill exactly one cache line");

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t members;
  uint64_t slot_bytes;
  std::atomic<uint32_t> attached;
  alignas(64) std::atomic<uint32_t> broken;  // kSound, kBrokenWritten or kBreakingBy + i
  int32_t broken_code;
  int32_t broken_rank;
  char broken_message[1024];
};
static_assert(sizeof(Header) <= kPage);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);  // Control::outside_*

inline size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Sleeps while *word holds `expected`, for timeout_ms at most (FUTEX_WAIT).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_ms);
// Wakes every waiter sleeping on `word`.
void FutexWakeAll(std::atomic<uint32_t>* word);

inline constexpr char kDiedInSharedMemory[] = "its process died while in shared memory";

// Why the member of control block `c` is gone, or nullptr while its keeper thread holds its
// liveness mutex (a trylock, no system call): kDiedInSharedMemory, or that it left the group.
const char* WhyGone(Control& c);

// The mapping, the keeper thread that holds this member's liveness mutex, and the words.
struct ShmGroup::Segment {
  std::string name;
  void* base = MAP_FAILED;
  size_t bytes = 0;
  size_t members = 0;
  size_t slot_bytes = 0;
  int index = 0;

  std::thread keeper;
  std::mutex keeper_mu;
  std::condition_variable keeper_cv;
  bool keeper_locked = false;  // guarded by keeper_mu
  bool keeper_stop = false;    // guarded by keeper_mu

  static size_t ControlOffset() { return kPage; }
  static size_t DataOffset(size_t members) {
    return RoundUp(ControlOffset() + members * sizeof(Control), kPage);
  }
  static size_t TotalBytes(size_t members, size_t slot_bytes) {
    return DataOffset(members) + members * 2 * slot_bytes;
  }

  Header& header() const { return *static_cast<Header*>(base); }
  Control& control(int i) const {
    return reinterpret_cast<Control*>(static_cast<uint8_t*>(base) + ControlOffset())[i];
  }
  uint8_t* slot(int i, uint32_t step) const {
    return static_cast<uint8_t*>(base) + DataOffset(members) +
           (size_t(i) * 2 + (step & 1)) * slot_bytes;
  }

  ~Segment() {
    if (keeper.joinable()) {
      {
        std::lock_guard<std::mutex> lock(keeper_mu);
        keeper_stop = true;
      }
      keeper_cv.notify_all();
      keeper.join();
    }
    if (base != MAP_FAILED) munmap(base, bytes);
  }

  // Starts the thread that holds this member's liveness mutex for the group's lifetime (a
  // thread that ends would mark it as its owner's death).
  void StartKeeper() {
    keeper = std::thread([this] {
      pthread_mutex_t* alive = &control(index).alive;
      pthread_mutex_lock(alive);
      std::unique_lock<std::mutex> lock(keeper_mu);
      keeper_locked = true;
      keeper_cv.notify_all();
      keeper_cv.wait(lock, [this] { return keeper_stop; });
      pthread_mutex_unlock(alive);
    });
    std::unique_lock<std::mutex> lock(keeper_mu);
    keeper_cv.wait(lock, [this] { return keeper_locked; });
  }
};

}  // namespace collectives::hierarchical

#endif  // COLLECTIVES_SRC_HIERARCHICAL_SHM_LAYOUT_H_
