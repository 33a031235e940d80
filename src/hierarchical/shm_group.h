// The intra-host transport: the ranks of one host share one POSIX shared-memory segment and run
// collectives through it, without TCP and without any copy through the kernel.
//
// Segment: created by the group's first member with O_EXCL and mode 0600 (never readable by
// another user; a member refuses a segment another user owns or that others may read), named
// after the job and a random nonce published through the (authenticated) store. The last
// member to attach unlinks the name, so nothing is left in /dev/shm however the job ends later;
// a member that gives up during set-up unlinks it too, and so does the creator whatever makes
// its set-up fail (publishing the name included). A creator killed before every member attached
// leaves the name behind (/dev/shm/collectives-*, after a hash of the job, its first rank and
// the creator's pid namespace and pid), as nothing of a killed process runs: the next creator on
// the host removes the names of this user whose creator, in its pid namespace, is gone.
//
// Layout: a header (the group's broken flag and the error that broke it), one control block per
// member (step counters, the call descriptor of its last steps, a liveness mutex, the call it
// runs outside the group), then two data slots of `slot_bytes` per member. A collective is cut
// into steps of at most one slot each; a step writes into the member's slot (buffer step % 2),
// publishes a counter, and reads the other members' slots once their counters say the step is
// there. Double buffering lets step s+1 be written while the others still read step s; a member
// writes its buffer for step s only once every member has finished step s - 2.
//
// All-reduce, large: each member copies its chunk into its slot, then reduces its own slice of
// the chunk straight from every member's slot (in place, in its own slot), then every member
// copies every reduced slice out. Small: each member copies its input in and reduces all of them
// itself (one synchronisation instead of two). Broadcast: the root copies in, the others out.
// All-gather: each copies its block in, and all blocks out. Reduce-scatter: each copies its
// chunk of every block in and reduces its own block from all slots. The all-reduce and the
// broadcast take their message as core::Runs (one buffer, or the packer's fused bucket, its
// tensors as they lie), copied into and out of the slots directly.
//
// Checks: every step carries the call's tag (sequence number and descriptor); a member that
// finds another member's tag different breaks the group with Error(kMismatch) naming both calls,
// before anything is written into a caller's buffer; so does a member that, between sleeps,
// finds another member's announcement of a call of the same number outside the group
// (AnnounceOutside). A waiter polls for the spin budget, then sleeps on a futex, waking every
// 20 ms to check the deadline, the broken flag, the announcements, and whether the member it
// waits for is alive (a robust mutex each member's keeper thread holds: its owner's death marks
// it, even when the process is not reaped yet).
//
// Thread-safety: the collectives are called by one thread at a time (the one running the
// communicator's call); Abort from any thread.
#ifndef COLLECTIVES_SRC_HIERARCHICAL_SHM_GROUP_H_
#define COLLECTIVES_SRC_HIERARCHICAL_SHM_GROUP_H_

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "collectives/types.h"
#include "src/core/call.h"
#include "src/core/runs.h"

namespace collectives::hierarchical {

using Clock = std::chrono::steady_clock;

// Bytes of one data slot when the options say 0: 1 MiB keeps a step's copies in the last-level
// cache of a common host while a 64 MiB call takes only 64 steps.
inline constexpr size_t kDefaultSlotBytes = 1 << 20;
// All-reduces of at most this many bytes use the one-synchronisation algorithm.
inline constexpr size_t kDefaultShmSmallBytes = 16 * 1024;

// The slot a group makes of `requested` bytes: at least a page, a multiple of 64 bytes. A step
// of a collective is one slot.
size_t EffectiveSlotBytes(size_t requested);

// The small-message bound a group of `slot_bytes` (EffectiveSlotBytes) makes of `requested`
// (ShmGroupOptions::small_bytes): small_bytes().
size_t EffectiveSmallBytes(size_t requested, size_t slot_bytes);

// Elements [offset, offset + length) of part `part` when `count` elements are cut into `parts`
// nearly equal parts (the first count % parts get one more).
struct Part {
  size_t offset;
  size_t length;
};
Part PartOf(size_t count, int parts, int part);

// The members that reduce and cross each step of an all-reduce with a crossing (AllReduce with
// `cross`), whose message is `message_bytes`, in a group of `small_bytes()` and that many
// `lanes`: the first alone for a small message, else the lanes (a step's part j, PartOf(step,
// owners, j), is member j's). A rank alone on its host cuts the same parts.
int CrossingOwners(size_t message_bytes, size_t small_bytes, int lanes);

// The largest slot a group takes: a segment holds two slots per member, and larger slots would
// only pin more of /dev/shm (steps of a few MiB already reach memcpy speed).
inline constexpr size_t kMaxSlotBytes = size_t{1} << 30;

struct ShmGroupOptions {
  // Names the segment, with `key_prefix` (the communicator's key space in the store).
  std::string job_id = "collectives";
  std::string key_prefix = "collectives";
  size_t slot_bytes = kDefaultSlotBytes;       // at most kMaxSlotBytes (Create: kInvalidArgument)
  size_t small_bytes = kDefaultShmSmallBytes;  // a group takes at most its slot_bytes
  // How long a waiter busy-polls before it sleeps.
  std::chrono::microseconds spin{50};
  // Set-up limit, for all of it together (store lookups, waiting for every member to attach).
  std::chrono::milliseconds timeout{60'000};
};

// What the two-level plan adds to a ShmGroup call: the hooks through which it crosses hosts
// and the figures that cut the work alike on every host. Each collective reads the fields
// named in its comment; a default TwoLevelHooks keeps the call inside the host. The hooks run
// on the calling thread, during the call.
struct TwoLevelHooks {
  // AllReduce: called on every slice this member reduced (in shared memory, op applied, kAvg
  // not yet divided) before the members read it; the plan all-reduces it across hosts there.
  std::function<void(void* slice, size_t count)> cross{};
  // AllReduce and ReduceScatterAcross: kAvg divides by avg_divisor (0: size()).
  size_t avg_divisor = 0;
  // AllReduce with `cross`: the first `lanes` members (0: all) reduce a slice each of every
  // step, cut alike on every host that has as many lanes (and by a rank alone on its host,
  // CrossingOwners and PartOf), the others none; the first member alone reduces a message of
  // at most small_bytes().
  int lanes = 0;
  // Broadcast (root member) and AllGatherAcross: fill(slot, offset, bytes) puts each step into
  // this member's slot instead of a copy from send (the plan receives it from another host,
  // or sends it out, there).
  std::function<void(uint8_t* slot, size_t offset, size_t bytes)> fill{};
  // Broadcast: called by every member once, before it arrives at the first step (the root
  // after its first fill): no member writes into recv before every member's hook returned
  // (the plan waits there for its check across hosts).
  std::function<void()> before_arrive{};
  // AllGatherAcross: the rank whose block part h of member j's slot holds.
  std::function<size_t(int part, int member)> rank_of{};
  // ReduceScatterAcross: the blocks of send in lane order, and cross_lane(partial, c, out),
  // which reduces a lane's partial sums across hosts into recv (see ReduceScatterAcross).
  std::span<const int> order{};
  std::function<void(uint8_t* partial, size_t count, uint8_t* out)> cross_lane{};
};

class ShmGroup {
 public:
  // Collective over `members` (the global ranks of this host, ascending; `rank` is one of them):
  // creates or attaches the segment. Throws Error(kTimeout) naming the members that did not
  // attach, Error(kPeerLost) naming one whose process died while it attached, Error(kSystem) when
  // shared memory cannot be had (a /dev/shm too small for the segment included: its pages are
  // reserved here), Error(kUnauthenticated) for a segment that is not ours alone or not of this
  // member's size. A member that fails publishes its error in the store, and the others raise it
  // (same code, its message) instead of waiting it out.
  static std::unique_ptr<ShmGroup> Create(int rank, const std::vector<int>& members, Store& store,
                                          const ShmGroupOptions& options);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int index() const { return index_; }  // this rank's position among the members
  int size() const { return int(members_.size()); }
  const std::vector<int>& members() const { return members_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t small_bytes() const { return small_bytes_; }

  // Every collective below runs to completion among the members, for the call `tag`, and
  // throws Error (kMismatch, kPeerLost, kTimeout past `deadline`, kAborted) after breaking the
  // group so that every member raises.

  // recv = op over members of send, each `dtype` elements back to back (recv.bytes() / size of
  // dtype of them; send.bytes() the same). Passing one Runs as both runs the call in place on
  // it (the packer's fused bucket): each member copies its runs into its slot and the results
  // from the slots back into them, with no buffer of its own in between, and ends with the bits
  // of the same call on one buffer. Every run is a whole number of elements with data, else
  // Error(kInvalidArgument) before any step. Reads hooks.cross, avg_divisor and lanes.
  void AllReduce(const core::CallTag& tag, Clock::time_point deadline, const core::Runs& send,
                 const core::Runs& recv, DataType dtype, ReduceOp op,
                 const TwoLevelHooks& hooks = {});
  // The same on one buffer each (a Runs of one run: no allocation).
  void AllReduce(const core::CallTag& tag, Clock::time_point deadline, const void* send, void* recv,
                 size_t count, DataType dtype, ReduceOp op, const TwoLevelHooks& hooks = {}) {
    const size_t bytes = count * SizeOf(dtype);
    AllReduce(tag, deadline, core::Runs(send, bytes), core::Runs(recv, bytes), dtype, op, hooks);
  }
  // recv = the root member's send (`root` is a member index; recv.bytes() of them, send read by
  // the root only; one Runs as both: in place). With hooks.fill the root member fills its slot
  // for every step instead of copying from send; hooks.before_arrive as described there.
  void Broadcast(const core::CallTag& tag, Clock::time_point deadline, const core::Runs& send,
                 const core::Runs& recv, int root, const TwoLevelHooks& hooks = {});
  void Broadcast(const core::CallTag& tag, Clock::time_point deadline, const void* send, void* recv,
                 size_t bytes, int root, const TwoLevelHooks& hooks = {}) {
    Broadcast(tag, deadline, core::Runs(send, bytes), core::Runs(recv, bytes), root, hooks);
  }
  // recv = the members' send blocks (bytes each) in member order.
  void AllGather(const core::CallTag& tag, Clock::time_point deadline, const void* send, void* recv,
                 size_t bytes);
  // The inside half of a two-level all-gather. Every step, hooks.fill(slot, offset, bytes) puts
  // `parts` parts of `bytes` into this member's slot (part h: bytes [offset, offset + bytes) of
  // block `rank_of(h, index())`, gathered across hosts); then every member copies every member's
  // parts out, part h of member j to recv + hooks.rank_of(h, j) * block_bytes + offset.
  void AllGatherAcross(const core::CallTag& tag, Clock::time_point deadline, void* recv,
                       size_t block_bytes, int parts, const TwoLevelHooks& hooks);
  // recv (count elements) = block index() of op over members of send (size() * count).
  void ReduceScatter(const core::CallTag& tag, Clock::time_point deadline, const void* send,
                     void* recv, size_t count, DataType dtype, ReduceOp op);
  // The inside half of a two-level reduce-scatter: send holds hooks.order.size() blocks of
  // `count` elements (one per rank of the world; a multiple of size(), at most slot_bytes() /
  // element size), and member j's lane is the blocks order[j * k, (j + 1) * k) for k =
  // order.size() / size(). Every step each member copies the step's elements of every block into
  // its slot in that order, reduces its lane's over the members (op; kAvg as kSum) and calls
  // hooks.cross_lane(partial, c, out): the lane's k parts of c elements back to back, to be
  // reduced across hosts into the c elements of this rank's block at `out` (recv + the step's
  // offset). kAvg then divides those by hooks.avg_divisor. Nothing is written into recv but by
  // cross_lane.
  void ReduceScatterAcross(const core::CallTag& tag, Clock::time_point deadline, const void* send,
                           void* recv, size_t count, DataType dtype, ReduceOp op,
                           const TwoLevelHooks& hooks);
  void Barrier(const core::CallTag& tag, Clock::time_point deadline);

  // This member runs the call `tag` outside the group (over TCP only). A member waiting in the
  // group during a call of the same number but another descriptor then breaks the group with
  // Error(kMismatch) naming both calls, instead of waiting until its deadline (the two-level plans
  // leave some collectives to the flat ring: a rank that calls one of those where the others of its
  // host call a two-level one would never arrive).
  void AnnounceOutside(const core::CallTag& tag);

  // Breaks the group with `error`: every member's pending and later call raises. Any thread.
  // A group broken already stays broken with its first error; while its breaker has not written
  // it yet, this member's calls raise `error` instead of waiting for it.
  void Abort(const Error& error);

  // A member that finds the group broken by another that has not written why yet waits for it
  // until its call's deadline (at least one 20 ms slice), or until the breaker is gone (its
  // liveness mutex): then that call raises kPeerLost naming the breaker, and its later calls at
  // once, until the breaker's error is written; from then on they raise that.
  // Begins to break the group and stops, as a member killed or stopped in the middle of Abort
  // would; FinishBreakingForTesting writes why, as that member would once it runs again.
  void BreakHalfwayForTesting();
  void FinishBreakingForTesting(const Error& error);
  // Runs `hook` in each later Create of this process once the member counts as alive and has
  // touched its first slot, before it counts itself attached (a test kills a member there);
  // nullptr for none. Before any thread calls Create.
  static void SetAttachingHookForTesting(void (*hook)());

 private:
  struct Segment;
  ShmGroup(int rank, std::vector<int> members, int index, const ShmGroupOptions& options);

  class Step;
  friend class Step;
  // ReduceScatter (no hooks) and ReduceScatterAcross.
  void RunReduceScatter(const core::CallTag& tag, Clock::time_point deadline, const void* send,
                        void* recv, size_t count, DataType dtype, ReduceOp op,
                        const TwoLevelHooks& hooks);
  // The error that broke the group, as this member raises it (waiting for it until `deadline`
  // at most, see BreakHalfwayForTesting).
  Error BrokenError(Clock::time_point deadline) const;
  // Breaks the group with `error` unless it is broken already; returns the first error.
  Error BreakWith(const Error& error, Clock::time_point deadline);
  // Claims the broken flag for this member (false: broken already), then writes why and wakes
  // every waiter.
  bool BeginBreaking();
  void WriteBroken(const Error& error);
  // The error BrokenError gave once it stopped waiting for a breaker that did not write why, or
  // this member's Abort's error while the breaker had not written why (Abort).
  mutable std::mutex given_up_mu_;
  mutable std::optional<Error> given_up_;  // guarded by given_up_mu_

  const int rank_;
  const std::vector<int> members_;
  const int index_;
  const size_t slot_bytes_;
  const size_t small_bytes_;
  const std::chrono::microseconds spin_;
  std::unique_ptr<Segment> segment_;
  uint32_t step_ = 0;  // the last step this member ran (the running thread only)
  // A step every member is known to have finished (the running thread only): a member publishes
  // its arrival at step s only after finishing step s - 1, so having seen every arrival at s
  // tells as much without reading their counters again.
  uint32_t known_done_ = 0;
};

// Why this process cannot use POSIX shared memory at all, or empty when it can: a name of its
// own cannot be created because there is no /dev/shm (ENOENT, ENOTDIR), it is mounted read-only
// (EROFS), this user may not write there (EACCES, EPERM), or the system has none (ENOSYS). Other
// failures (no room, no file descriptor left) are left to Create, which raises them.
std::string SharedMemoryUnavailable();

// This host's identity: $COLLECTIVES_HOST_ID when set (tests pretend several hosts on one
// machine with it), else MachineIdentity() and the device of /dev/shm (containers that share a
// machine's network but each have a /dev/shm of their own are different hosts here).
std::string HostIdentity();
// For tests that run ranks as threads of one process on pretend hosts: while one is alive,
// HostIdentity() on the thread that made it returns `id` (before $COLLECTIVES_HOST_ID).
class ScopedThreadHostIdentity {
 public:
  explicit ScopedThreadHostIdentity(std::string id);
  ~ScopedThreadHostIdentity();
  ScopedThreadHostIdentity(const ScopedThreadHostIdentity&) = delete;
  ScopedThreadHostIdentity& operator=(const ScopedThreadHostIdentity&) = delete;

 private:
  std::string previous_;
};
// The machine's own identity: its host name and the kernel's boot id.
std::string MachineIdentity();

}  // namespace collectives::hierarchical

#endif  // COLLECTIVES_SRC_HIERARCHICAL_SHM_GROUP_H_
