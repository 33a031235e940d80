// ShmGroup's segment: creating and attaching the POSIX shared-memory segment through the store
// (with every way the set-up fails), the host's identity, and breaking and aborting the group.
// The layout is in shm_layout.h, the protocol in shm_group.h, the collectives in shm_group.cc.
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
#include <cstddef>
#include <cstdio>
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
#include <utility>

#include "src/cluster/store_common.h"
#include "src/core/environment.h"
#include "src/core/text.h"
#include "src/hierarchical/shm_group.h"
#include "src/hierarchical/shm_layout.h"
#include "src/transport/fabric_errors.h"

namespace collectives::hierarchical {
namespace {

// ShmGroup::SetAttachingHookForTesting's hook.
void (*attaching_hook)() = nullptr;

constexpr uint64_t kMagic = 0x316d6873'6c6c6f63ULL;  // "collshm1"
constexpr uint32_t kVersion = 3;

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
// pages). Only names this user owns, of a creator in this process's pid namespace that is gone: a
// name of a live creator, of another namespace (another container sharing /dev/shm, whose pids mean
// nothing here) or without the mark is never touched. A group being set up under a dead creator's
// name cannot complete anyway; members already attached keep their mapping.
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

}  // namespace

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int timeout_ms) {
  timespec ts{timeout_ms / 1000, long(timeout_ms % 1000) * 1'000'000};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

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

namespace {
thread_local std::string thread_host_identity;  // ScopedThreadHostIdentity's; "" when none
}  // namespace

ScopedThreadHostIdentity::ScopedThreadHostIdentity(std::string id)
    : previous_(std::exchange(thread_host_identity, std::move(id))) {}
ScopedThreadHostIdentity::~ScopedThreadHostIdentity() {
  thread_host_identity = std::move(previous_);
}

std::string HostIdentity() {
  if (!thread_host_identity.empty()) return thread_host_identity;
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
            const Error died = report(
                Error(ErrorCode::kPeerLost, prefix + "rank " + std::to_string(members[i]) +
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
  // written), rather than wait out its deadline.
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

}  // namespace collectives::hierarchical
