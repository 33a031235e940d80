// ShmGroup: the segment, its set-up and clean-up, the waits, and the collectives over it. The
// protocol is described in shm_group.h.
#include "src/hierarchical/shm_group.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <system_error>
#include <thread>

#include "src/cluster/store_common.h"
#include "src/core/environment.h"
#include "src/core/kernels.h"
#include "src/core/text.h"
#include "src/core/work.h"
#include "src/transport/fabric_errors.h"

namespace collectives::hierarchical {
namespace {

constexpr uint64_t kMagic = 0x316d6873'6c6c6f63ULL;  // "collshm1"
constexpr uint32_t kVersion = 3;
constexpr size_t kPage = 4096;
// Header::broken: kSound; kBrokenWritten, the error that broke the group is written; or
// kBreakingBy + i, member i has begun to break it (the index goes with the claim, so that a
// breaker killed before it wrote why can still be named).
constexpr uint32_t kSound = 0;
constexpr uint32_t kBrokenWritten = 2;
constexpr uint32_t kBreakingBy = 3;
// How long a sleeping waiter sleeps before it looks at the deadline, the broken flag and the
// liveness of the member it waits for.
constexpr int kSleepSliceMs = 20;
// ShmGroup::SetAttachingHookForTesting's hook.
void (*attaching_hook)() = nullptr;

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

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_ms) {
  timespec ts{timeout_ms / 1000, long(timeout_ms % 1000) * 1'000'000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Step counters wrap; a is at or past b when the signed distance is not negative.
bool Reached(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

std::string Hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string SystemMessage(const std::string& what) { return what + ": " + std::strerror(errno); }

// A segment's name carries its creator's process ("-c<pid namespace>.<pid>-", the namespace as
// the inode of /proc/self/ns/pid, 0 where /proc is not mounted), so that a later creator can
// tell a name whose creator is gone.
uint64_t PidNamespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? uint64_t(st.st_ino) : 0;
}

std::string CreatorMark(uint64_t pid_namespace) {
  return "-c" + std::to_string(pid_namespace) + ".";
}

// Removes the names a creator left in /dev/shm when it was killed before every member attached
// (nothing of a killed process runs to remove them, and each holds a whole segment of tmpfs
// pages). Only names this user owns, of a creator in this process's pid namespace that no longer
// exists: a name of a live creator, of another namespace (another container sharing /dev/shm,
// whose pids mean nothing here) or without the mark is never touched. A group being set up under
// a dead creator's name cannot complete anyway; members already attached keep their mapping.
void RemoveNamesOfDeadCreators() {
  const uint64_t pid_namespace = PidNamespace();
  if (pid_namespace == 0) return;
  const std::string mark = CreatorMark(pid_namespace);
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string file = entry.path().filename().string();
    const size_t at = file.find(mark);
    if (file.rfind("collectives-", 0) != 0 || at == std::string::npos) continue;
    const char* digits = file.c_str() + at + mark.size();
    char* end = nullptr;
    errno = 0;
    const long pid = std::strtol(digits, &end, 10);
    if (errno != 0 || end == digits || *end != '-' || pid <= 0 || pid == long(getpid())) continue;
    if (kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to ask
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
      continue;
    }
    shm_unlink(("/" + file).c_str());
  }
}

// The error another member published (an abort payload, see ShmGroup::Create's report), as
// this member's: the same code, its message after this member's prefix. `by_creator`: published
// in place of the segment's name by the member that creates it.
Error PublishedFailure(const std::string& text, const std::string& prefix, bool by_creator) {
  std::string why;
  const std::optional<transport::AbortPayload> payload = transport::DecodeAbortPayload(
      reinterpret_cast<const uint8_t*>(text.data()), text.size(), &why);
  if (!payload) {
    return Error(ErrorCode::kInternal,
                 prefix + "a member's published failure is malformed: " + why);
  }
  return Error(payload->code,
               prefix +
                   (by_creator ? "rank " + std::to_string(payload->culprit) +
                                     ", which creates this host's segment, failed: "
                               : "a member of this host's group failed to set up: ") +
                   core::OneLine(payload->message));
}

constexpr char kDiedInSharedMemory[] = "its process died while in shared memory";

// Why the member of control block `c` is gone, or nullptr while its keeper thread holds its
// liveness mutex (a trylock, no system call): kDiedInSharedMemory, or that it left the group.
const char* WhyGone(Control& c) {
  const int rc = pthread_mutex_trylock(&c.alive);
  if (rc == EBUSY) return nullptr;
  if (rc == 0) {
    pthread_mutex_unlock(&c.alive);
    return "it left the shared-memory group: its communicator was destroyed";
  }
  if (rc == EOWNERDEAD) pthread_mutex_unlock(&c.alive);  // left unrecoverable: still dead
  return kDiedInSharedMemory;
}

}  // namespace

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

std::string SharedMemoryUnavailable() {
  // The name carries this process's mark, so that one left by a process killed in between is
  // removed as a dead creator's is.
  static std::atomic<uint64_t> probes{0};
  const std::string name = "/collectives-probe" + CreatorMark(PidNamespace()) +
                           std::to_string(getpid()) + "-" + Hex(probes.fetch_add(1));
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd >= 0) {
    close(fd);
    shm_unlink(name.c_str());
    return {};
  }
  switch (errno) {
    case ENOENT:
    case ENOTDIR:
    case EROFS:
    case EACCES:
    case EPERM:
    case ENOSYS:
      return SystemMessage("shm_open " + name);
    default:
      return {};
  }
}

std::string HostIdentity() {
  if (const char* id = std::getenv("COLLECTIVES_HOST_ID"); id != nullptr && *id != '\0') {
    return id;
  }
  // Containers on one machine that share its network (docker --net=host, hostNetwork pods) share
  // its host name and boot id, but each may have a /dev/shm of its own, where a segment one
  // creates cannot be opened by the other: the device of /dev/shm tells them apart.
  struct stat shm {};
  const std::string device = stat("/dev/shm", &shm) == 0 ? std::to_string(shm.st_dev) : "none";
  return MachineIdentity() + "/shm:" + device;
}

std::string MachineIdentity() {
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  return core::HostName() + "/" + boot;
}

size_t EffectiveSlotBytes(size_t requested) {
  return RoundUp(std::max<size_t>(requested, kPage), 64);
}

size_t EffectiveSmallBytes(size_t requested, size_t slot_bytes) {
  return std::min(requested, slot_bytes);
}

Part PartOf(size_t count, int parts, int part) {
  const size_t base = count / size_t(parts);
  const size_t extra = count % size_t(parts);
  const size_t p = size_t(part);
  return Part{p * base + std::min(p, extra), base + (p < extra ? 1 : 0)};
}

int CrossingOwners(size_t message_bytes, size_t small_bytes, int lanes) {
  return message_bytes <= small_bytes ? 1 : lanes;
}

ShmGroup::ShmGroup(int rank, std::vector<int> members, int index, const ShmGroupOptions& options)
    : rank_(rank),
      members_(std::move(members)),
      index_(index),
      slot_bytes_(EffectiveSlotBytes(options.slot_bytes)),
      small_bytes_(EffectiveSmallBytes(options.small_bytes, slot_bytes_)),
      spin_(options.spin),
      segment_(std::make_unique<Segment>()) {}

ShmGroup::~ShmGroup() = default;

std::unique_ptr<ShmGroup> ShmGroup::Create(int rank, const std::vector<int>& members, Store& store,
                                           const ShmGroupOptions& options) {
  const auto it = std::find(members.begin(), members.end(), rank);
  if (it == members.end() || !std::is_sorted(members.begin(), members.end())) {
    throw Error(ErrorCode::kInternal, "rank " + std::to_string(rank) +
                                          ": shared-memory group members must be ascending and "
                                          "include this rank");
  }
  if (options.slot_bytes > kMaxSlotBytes) {  // also keeps the segment's size from wrapping
    throw Error(ErrorCode::kInvalidArgument,
                "rank " + std::to_string(rank) + ": a shared-memory slot of " +
                    std::to_string(options.slot_bytes) + " bytes is more than the " +
                    std::to_string(kMaxSlotBytes) + " a slot may have");
  }
  const int index = int(it - members.begin());
  // options.timeout bounds the set-up as a whole: the name's lookup and the wait for every member
  // to attach share it (each had all of it).
  const auto deadline = Clock::now() + options.timeout;
  const auto left = [&deadline] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                    std::chrono::milliseconds(1));
  };
  std::unique_ptr<ShmGroup> group(new ShmGroup(rank, members, index, options));
  Segment& seg = *group->segment_;
  seg.members = members.size();
  seg.slot_bytes = group->slot_bytes_;
  seg.index = index;
  seg.bytes = Segment::TotalBytes(seg.members, seg.slot_bytes);
  const std::string prefix = "rank " + std::to_string(rank) + ": shared memory: ";
  const std::string key = options.key_prefix + "/shm/" + std::to_string(members.front());
  // A member that fails to set up tells the others through the store, so that they raise its
  // error at once instead of waiting for it until their timeout: the creator, before it has
  // published the segment's name, in place of the name ("!" and the error as an abort payload,
  // transport/frame.h); any member, under failure_key (the first error) and failures_key (a
  // count the waiting members poll).
  const std::string failure_key = key + "/failure";
  const std::string failures_key = key + "/failures";
  bool published = index != 0;
  const auto report = [&](const Error& error) {
    const std::string text =
        transport::EncodeAbortPayload(transport::AbortPayload{error.code(), rank, error.message()});
    try {
      if (!published) store.Set(key, "!" + text);
      if (store.Add(failures_key, 1) == 1) store.Set(failure_key, text);
    } catch (const std::exception&) {
      // The store is gone too: the others find out from it, or from their timeout.
    }
    return error;
  };

  // A failure is counted before its text is set (report): a member that saw the count waits a
  // moment for the text even when the set-up's time is up.
  const auto failure_wait = [&left] { return std::max(left(), std::chrono::milliseconds(1000)); };

  const auto failure_published = [&] {
    try {
      return store.Add(failures_key, 0) > 0;
    } catch (const std::exception&) {
      return false;
    }
  };

  // Anything else that escapes the set-up (std::bad_alloc, a std::system_error of the library
  // or of a store) is reported too, so that the members waiting for this one raise it at once
  // rather than at their timeout, and raised as an Error, which the planner publishes.
  const auto set_up = [&] {
    int fd = -1;
    if (index == 0) {
      std::random_device random;
      const uint64_t nonce = (uint64_t(random()) << 32) ^ random();
      const std::string job = options.job_id + "\n" + options.key_prefix;
      seg.name = "/collectives-";
      seg.name.append(Hex(std::hash<std::string>{}(job)), 8, 8);
      seg.name.append("-").append(std::to_string(members.front()));
      seg.name.append(CreatorMark(PidNamespace())).append(std::to_string(getpid()));
      seg.name.append("-").append(Hex(nonce));
      RemoveNamesOfDeadCreators();
      fd = shm_open(seg.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) {
        throw report(Error(ErrorCode::kSystem, prefix + SystemMessage("shm_open " + seg.name)));
      }
      // ftruncate only sets the size: on a full /dev/shm (a container's is 64 MiB by default) the
      // first touch of a page that does not fit would kill the process with SIGBUS. Reserving
      // every page now turns that into an error here.
      int sized = fchmod(fd, 0600) == 0 && ftruncate(fd, off_t(seg.bytes)) == 0 ? 0 : errno;
      if (sized == 0) sized = posix_fallocate(fd, 0, off_t(seg.bytes));
      if (sized != 0) {
        std::string why = "sizing " + seg.name + " to " + std::to_string(seg.bytes) +
                          " bytes: " + std::strerror(sized);
        if (sized == ENOSPC) {
          why +=
              " (/dev/shm is too small for this host's ranks: enlarge it, e.g. docker "
              "--shm-size, or set COLLECTIVES_SHM=0 on every rank to use TCP inside the host)";
        }
        close(fd);
        shm_unlink(seg.name.c_str());
        throw report(Error(ErrorCode::kSystem, prefix + why));
      }
    } else {
      try {
        seg.name = store.Get(key, left());
      } catch (const Error& error) {
        if (!cluster::IsNotSet(error)) throw;
        // The member that did not come is the creator: name it, as the attach's timeout does.
        throw Error(ErrorCode::kTimeout,
                    prefix + "rank " + std::to_string(members.front()) +
                        ", which creates this host's segment, did not publish its name within " +
                        std::to_string(options.timeout.count()) + " ms (" + error.message() + ")");
      }
      if (!seg.name.empty() && seg.name.front() == '!') {  // the creator's failure (see report)
        throw PublishedFailure(seg.name.substr(1), prefix, true);
      }
      fd = shm_open(seg.name.c_str(), O_RDWR, 0);
      if (fd < 0) {
        const int open_errno = errno;
        // The creator removes the name when a member that attached first published its failure:
        // that failure is the cause, not the missing name.
        if (open_errno == ENOENT && failure_published()) {
          throw PublishedFailure(store.Get(failure_key, failure_wait()), prefix, false);
        }
        errno = open_errno;
        throw report(Error(ErrorCode::kSystem, prefix + SystemMessage("shm_open " + seg.name)));
      }
      struct stat st {};
      const bool stated = fstat(fd, &st) == 0;
      if (!stated || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
        close(fd);
        throw report(Error(ErrorCode::kUnauthenticated,
                           prefix + "segment " + seg.name +
                               " is not this job's (another owner, or open to others)"));
      }
      if (size_t(st.st_size) != seg.bytes) {
        close(fd);
        throw report(
            Error(ErrorCode::kUnauthenticated,
                  prefix + "segment " + seg.name + " is not this job's: it has " +
                      std::to_string(st.st_size) + " bytes where this rank expects " +
                      std::to_string(seg.bytes) +
                      " (is COLLECTIVES_SHM_SLOT_BYTES the same on every rank of this host?)"));
      }
    }
    seg.base = mmap(nullptr, seg.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    close(fd);
    if (seg.base == MAP_FAILED) {
      errno = map_errno;
      if (index == 0) shm_unlink(seg.name.c_str());
      throw report(Error(ErrorCode::kSystem, prefix + SystemMessage("mmap " + seg.name)));
    }

    // From here on, a failure of the member that created the segment (the store unreachable when
    // it publishes the name, say) removes the name: nobody else may ever learn it.
    struct UnlinkUnlessKept {
      const std::string& name;
      bool keep;
      ~UnlinkUnlessKept() {
        if (!keep) shm_unlink(name.c_str());
      }
    } created{seg.name, index != 0};

    Header& header = seg.header();
    if (index == 0) {
      header.version = kVersion;
      header.members = uint32_t(seg.members);
      header.slot_bytes = seg.slot_bytes;
      header.attached.store(0);
      header.broken.store(kSound);
      header.magic = kMagic;
      published = true;  // whether or not the Set below gets through: no "!" after it
      store.Set(key, seg.name);
    } else if (header.magic != kMagic || header.version != kVersion ||
               header.members != seg.members || header.slot_bytes != seg.slot_bytes) {
      throw report(Error(ErrorCode::kUnauthenticated,
                         prefix + "segment " + seg.name + " does not have this group's layout"));
    }

    // This member's block: counters at zero, the liveness mutex held, its slots touched once so
    // that the first collective does not pay the page faults.
    Control& own = seg.control(index);
    own.arrived.store(0);
    own.reduced.store(0);
    own.done.store(0);
    own.sleepers.store(0);
    std::memset(own.tag, 0, sizeof own.tag);
    own.outside_seq.store(0);  // no call outside the group yet
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&own.alive, &attr);
    pthread_mutexattr_destroy(&attr);
    try {
      seg.StartKeeper();
    } catch (const std::system_error& error) {  // a pids limit, no room for its stack
      const std::string why = "cannot start the thread that holds this member's liveness mutex: ";
      throw report(Error(ErrorCode::kSystem, prefix + why + error.what()));
    }
    // From here on its liveness tells: a member killed before it attached is not waited for.
    std::atomic_ref<int32_t>(own.pid).store(int32_t(getpid()), std::memory_order_release);
    std::memset(seg.slot(index, 0), 0, seg.slot_bytes);
    if (attaching_hook != nullptr) attaching_hook();
    std::memset(seg.slot(index, 1), 0, seg.slot_bytes);

    // The last member to attach removes the name: from then on only the mappings hold the
    // segment, and the kernel frees it when the last member exits, however it exits.
    if (header.attached.fetch_add(1) + 1 == seg.members) shm_unlink(seg.name.c_str());
    auto next_look = Clock::now();
    while (header.attached.load() < seg.members) {
      if (Clock::now() >= next_look) {  // a member that could not attach says so in the store
        next_look = Clock::now() + std::chrono::milliseconds(20);
        if (store.Add(failures_key, 0) > 0) {
          shm_unlink(seg.name.c_str());
          throw PublishedFailure(store.Get(failure_key, failure_wait()), prefix, false);
        }
        for (size_t i = 0; i < seg.members; ++i) {
          Control& c = seg.control(int(i));
          if (std::atomic_ref<int32_t>(c.pid).load(std::memory_order_acquire) != 0 &&
              WhyGone(c) == kDiedInSharedMemory) {
            // Published, as every failure of the set-up, before the name goes: a member that has
            // not opened it yet finds it gone, and raises this rather than its own "no such
            // file" (which it would publish first if the name went first).
            const Error died = report(Error(ErrorCode::kPeerLost,
                                            prefix + "rank " + std::to_string(members[i]) +
                                                " died while attaching to segment " + seg.name +
                                                " (" + kDiedInSharedMemory + ")"));
            shm_unlink(seg.name.c_str());
            throw died;
          }
        }
      }
      if (Clock::now() >= deadline) {
        shm_unlink(seg.name.c_str());
        std::string missing;
        for (size_t i = 0; i < seg.members; ++i) {
          if (std::atomic_ref<int32_t>(seg.control(int(i)).pid).load() == 0) {
            missing.append(" ").append(std::to_string(members[i]));
          }
        }
        throw Error(ErrorCode::kTimeout, prefix + "ranks" + missing +
                                             " did not attach to segment " + seg.name + " in " +
                                             std::to_string(options.timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    created.keep = true;  // unlinked by the last member to attach
  };
  try {
    set_up();
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw report(Error(ErrorCode::kSystem, prefix + "out of memory"));
  } catch (const std::system_error& error) {
    throw report(Error(ErrorCode::kSystem, prefix + error.what()));
  } catch (const std::exception& error) {
    throw report(Error(ErrorCode::kInternal, prefix + error.what()));
  }
  return group;
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
      // More members than cores: hand the core over a few times (to the member we wait for,
      // most likely) before paying a futex sleep and wake-up.
      const auto left =
          std::chrono::duration_cast<std::chrono::microseconds>(deadline_ - Clock::now());
      if (core::YieldUntil(left, core::kWaitYieldPolls, reached)) return;
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

Error ShmGroup::BrokenError(Clock::time_point deadline) const {
  Header& header = segment_->header();
  // The breaker writes the error between kBreakingBy + its index and kBrokenWritten: it takes
  // microseconds, unless the breaker stalls (descheduled, stopped) or is killed in between, when
  // it may never come. This member waits for it until its own deadline, or until the breaker is
  // gone; the error it then raises in place of the breaker's, its later calls raise at once,
  // until the breaker's is written.
  // A call past its deadline still waits a slice: a write under way is not missed.
  const auto until = std::max(deadline, Clock::now() + std::chrono::milliseconds(kSleepSliceMs));
  for (uint32_t state; (state = header.broken.load(std::memory_order_acquire)) >= kBreakingBy;) {
    const size_t breaker = state - kBreakingBy;
    const char* gone =
        breaker < members_.size() ? WhyGone(segment_->control(int(breaker))) : nullptr;
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(given_up_mu_);
      if (given_up_) return *given_up_;  // waited for once already
      if (gone != nullptr || now >= until) {
        // The breaker may have written why, and left, since `state` was read: raise that.
        if (header.broken.load(std::memory_order_acquire) < kBreakingBy) continue;
        given_up_ =
            Error(ErrorCode::kPeerLost,
                  "rank " + std::to_string(rank_) + ": shared memory: rank " +
                      (breaker < members_.size() ? std::to_string(members_[breaker]) : "?") +
                      " broke this host's group and stopped before writing why (" +
                      (gone != nullptr ? gone : "not written by this call's deadline") + ")");
        return *given_up_;
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now);
    FutexWait(&header.broken, state,
              int(std::clamp<int64_t>(left.count(), 1, kSleepSliceMs)));  // woken by the write
  }
  const std::string message(header.broken_message,
                            strnlen(header.broken_message, sizeof header.broken_message));
  if (header.broken_rank == rank_) return Error(ErrorCode(header.broken_code), message);
  transport::AbortPayload payload;
  payload.code = ErrorCode(header.broken_code);
  payload.culprit = header.broken_rank;
  payload.message = message;
  return transport::AbortReceivedError(rank_, payload);
}

bool ShmGroup::BeginBreaking() {
  uint32_t expected = kSound;
  return segment_->header().broken.compare_exchange_strong(expected,
                                                           kBreakingBy + uint32_t(index_));
}

void ShmGroup::WriteBroken(const Error& error) {
  Header& header = segment_->header();
  header.broken_code = int32_t(error.code());
  header.broken_rank = rank_;
  const std::string& message = error.message();
  const size_t n = std::min(message.size(), sizeof header.broken_message - 1);
  std::memcpy(header.broken_message, message.data(), n);
  header.broken_message[n] = '\0';
  header.broken.store(kBrokenWritten, std::memory_order_seq_cst);
  FutexWakeAll(&header.broken);
  for (int j = 0; j < size(); ++j) {
    Control& c = segment_->control(j);
    FutexWakeAll(&c.arrived);
    FutexWakeAll(&c.reduced);
    FutexWakeAll(&c.done);
  }
}

Error ShmGroup::BreakWith(const Error& error, Clock::time_point deadline) {
  if (!BeginBreaking()) return BrokenError(deadline);
  WriteBroken(error);
  return error;
}

void ShmGroup::Abort(const Error& error) {
  if (BeginBreaking()) return WriteBroken(error);
  // Broken already, by a member that may not have written why yet (stalled: stopped, in a
  // debugger): a call of this member waiting for it in BrokenError, until its deadline, raises
  // this error at once instead, as a given-up wait's does (the breaker's replaces it once
  // written). Before, the Abort did nothing and the call waited out its deadline.
  Header& header = segment_->header();
  {
    std::lock_guard<std::mutex> lock(given_up_mu_);
    if (!given_up_ && header.broken.load(std::memory_order_acquire) >= kBreakingBy) {
      given_up_ = error;
    }
  }
  FutexWakeAll(&header.broken);
}

void ShmGroup::BreakHalfwayForTesting() { BeginBreaking(); }

void ShmGroup::SetAttachingHookForTesting(void (*hook)()) { attaching_hook = hook; }

void ShmGroup::FinishBreakingForTesting(const Error& error) { WriteBroken(error); }

// The caller's side of an all-reduce: `send` read and `recv` written, one buffer each (which may
// be the same), or a message in place in pieces. ForEachRun(offset, bytes, fn) calls
// fn(in, out, at, run) for each stretch of the message's bytes [offset, offset + bytes) that lies
// in one buffer: `run` bytes at `in` (read) and `out` (written), `at` bytes past `offset`. One
// buffer is one call.
class ShmGroup::Message {
 public:
  Message(const void* send, void* recv)
      : in_(static_cast<const uint8_t*>(send)), out_(static_cast<uint8_t*>(recv)) {}
  explicit Message(const Pieces& pieces) : pieces_(&pieces) {}

  template <typename Fn>
  void ForEachRun(size_t offset, size_t bytes, Fn&& fn) const {
    if (bytes == 0) return;
    if (pieces_ == nullptr) {
      fn(in_ + offset, out_ + offset, size_t{0}, bytes);
      return;
    }
    size_t at = 0;
    pieces_->ForEach(offset, bytes, [&](uint8_t* data, size_t run) {
      fn(data, data, at, run);
      at += run;
    });
  }
  // Bytes [offset, offset + bytes) of the input into `to`.
  void Read(size_t offset, uint8_t* to, size_t bytes) const {
    ForEachRun(offset, bytes, [to](const uint8_t* in, uint8_t*, size_t at, size_t run) {
      std::memcpy(to + at, in, run);
    });
  }
  // `from` into bytes [offset, offset + bytes) of the output.
  void Write(size_t offset, const uint8_t* from, size_t bytes) const {
    ForEachRun(offset, bytes, [from](const uint8_t*, uint8_t* out, size_t at, size_t run) {
      std::memcpy(out, from + at, run);
    });
  }

 private:
  const uint8_t* in_ = nullptr;
  uint8_t* out_ = nullptr;
  const Pieces* pieces_ = nullptr;
};

void ShmGroup::AllReduce(const core::CallTag& tag, Clock::time_point deadline, const void* send,
                         void* recv, size_t count, DataType dtype, ReduceOp op,
                         const SliceHook& cross, size_t avg_divisor, int lanes) {
  RunAllReduce(tag, deadline, Message(send, recv), count, dtype, op, cross, avg_divisor, lanes);
}

void ShmGroup::AllReduceInPieces(const core::CallTag& tag, Clock::time_point deadline,
                                 const Pieces& pieces, DataType dtype, ReduceOp op,
                                 const SliceHook& cross, size_t avg_divisor, int lanes) {
  // Refused on this member alone, before any step (the others would wait for it until their
  // deadline): the ring's entry hands over whole elements of a known dtype only.
  const size_t es = SizeOf(dtype);
  pieces.ForEach(0, pieces.bytes(), [&](const uint8_t* data, size_t bytes) {
    if (bytes % es != 0 || data == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  "rank " + std::to_string(rank_) + ": all_reduce in pieces: a piece of " +
                      std::to_string(bytes) + " bytes is not a whole number of " + ToString(dtype) +
                      " elements, or has no data");
    }
  });
  RunAllReduce(tag, deadline, Message(pieces), pieces.bytes() / es, dtype, op, cross, avg_divisor,
               lanes);
}

void ShmGroup::RunAllReduce(const core::CallTag& tag, Clock::time_point deadline,
                            const Message& message, size_t count, DataType dtype, ReduceOp op,
                            const SliceHook& cross, size_t avg_divisor, int lanes) {
  Step step(*this, tag, deadline);
  const size_t es = SizeOf(dtype);
  const int n = size();
  const int me = index_;
  const ReduceOp kernel_op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  const size_t divisor = avg_divisor != 0 ? avg_divisor : size_t(n);

  if (count * es <= small_bytes_ && !cross) {
    // One synchronisation: everyone reduces everything, in member order, so the results are
    // identical bit for bit.
    const uint32_t s = step.Begin(true);
    message.Read(0, step.own_slot(s), count * es);
    step.Arrive(s);
    step.AwaitEveryArrival(s);
    message.ForEachRun(0, count * es, [&](const uint8_t*, uint8_t* out, size_t at, size_t run) {
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
      message.Read(step_begin, mine, c * es);
    } else {
      message.Read(step_begin, mine, own_begin);
      message.Read(step_begin + own_end, mine + own_end, c * es - own_end);
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
      message.Write(step_begin + own_begin, acc, own.length * es);
    } else if (own.length != 0) {
      message.ForEachRun(step_begin + own_begin, own.length * es,
                         [&](const uint8_t* in, uint8_t* out, size_t at, size_t run) {
                           reduce_own(out, in, at, run / es);
                           if (op == ReduceOp::kAvg)
                             core::DivideInPlace(dtype, out, run / es, divisor);
                           std::memcpy(mine + own_begin + at, out, run);
                         });
    }
    step.Reduced(s);
    for (int k = 1; k < n; ++k) {
      const int j = (me + k) % n;
      const Part part = part_of(c, j);
      if (part.length == 0) continue;
      step.AwaitReduced(j, s);
      message.Write(step_begin + part.offset * es, step.slot(j, s) + part.offset * es,
                    part.length * es);
    }
    step.Done(s);
    offset += c;
  } while (offset < count);
}

void ShmGroup::Broadcast(const core::CallTag& tag, Clock::time_point deadline, const void* send,
                         void* recv, size_t bytes, int root, const ChunkSource& fill,
                         const std::function<void()>& before_arrive) {
  RunBroadcast(tag, deadline, Message(send, recv), bytes, root, fill, before_arrive);
}

void ShmGroup::BroadcastInPieces(const core::CallTag& tag, Clock::time_point deadline,
                                 const Pieces& pieces, int root,
                                 const std::function<void(uint8_t*, size_t, size_t)>& fill,
                                 const std::function<void()>& before_arrive) {
  RunBroadcast(tag, deadline, Message(pieces), pieces.bytes(), root, fill, before_arrive);
}

void ShmGroup::RunBroadcast(const core::CallTag& tag, Clock::time_point deadline,
                            const Message& message, size_t bytes, int root, const ChunkSource& fill,
                            const std::function<void()>& before_arrive) {
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
        message.Read(offset, slot, c);
      }
      if (offset == 0 && before_arrive) before_arrive();
      step.Arrive(s);
      step.AwaitEveryArrival(s);
      step.Reduced(s);
      if (fill) {
        message.Write(offset, slot, c);
      } else {
        message.ForEachRun(offset, c, [](const uint8_t* in, uint8_t* out, size_t, size_t run) {
          if (in != out) std::memcpy(out, in, run);
        });
      }
    } else {
      if (offset == 0 && before_arrive) before_arrive();
      step.Arrive(s);
      step.AwaitArrival(root, s);
      step.AwaitReduced(root, s);
      message.Write(offset, step.slot(root, s), c);
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

void ShmGroup::AllGatherPieces(const core::CallTag& tag, Clock::time_point deadline, void* recv,
                               size_t block_bytes, int parts, const ChunkSource& fill,
                               const RankOf& rank_of) {
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
  RunReduceScatter(tag, deadline, send, recv, count, dtype, op, {}, {}, size_t(size()));
}

void ShmGroup::ReduceScatterAcross(const core::CallTag& tag, Clock::time_point deadline,
                                   const void* send, void* recv, size_t count, DataType dtype,
                                   ReduceOp op, const std::vector<int>& order,
                                   const LaneHook& cross, size_t avg_divisor) {
  const size_t es = SizeOf(dtype);
  const size_t blocks = order.size();
  if (blocks == 0 || blocks % size_t(size()) != 0 || blocks * es > slot_bytes_ || !cross) {
    throw Error(ErrorCode::kInternal,
                "rank " + std::to_string(rank_) +
                    ": reduce_scatter across hosts: " + std::to_string(blocks) + " blocks of " +
                    std::to_string(es) + "-byte elements do not fit the members' lanes and slots");
  }
  RunReduceScatter(tag, deadline, send, recv, count, dtype, op, order, cross, avg_divisor);
}

void ShmGroup::RunReduceScatter(const core::CallTag& tag, Clock::time_point deadline,
                                const void* send, void* recv, size_t count, DataType dtype,
                                ReduceOp op, const std::vector<int>& order, const LaneHook& cross,
                                size_t avg_divisor) {
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
