// The file Store: one file per key in a folder every rank can see.
//
// Layout of the folder:
//   key.<k>     the value of a key, where <k> is "h" + the key's bytes in hex for keys of up to
//               100 bytes, "s" + the SHA-256 of the key in hex for longer ones (file names stay
//               under 255 bytes and never contain '/' or other special characters);
//   lock.<k>    taken with flock(LOCK_EX) around the read-modify-write of Add;
//   .tmp.*      a value being written: Set writes a temp file, fsyncs it and renames it over
//               key.<k>, so a reader sees the old value or the new one, never a torn one;
//   .job-token  the job token of a job that sets none (StoreJobToken, job_token.h): 32 random
//               bytes as 64 hex digits, mode 0600. The first rank to ask writes it to a temp
//               file (O_CREAT|O_EXCL, 0600) and links it to .job-token (link(2) fails when the
//               name exists, so one rank wins and nobody reads a half-written token); the
//               others read it. A token file that another user owns or that group or others may
//               read or write is refused with Error(kUnauthenticated): whoever can read it can
//               join the job. Created only when asked, so a job that sets a token never has one.
// Get polls for the file with a backoff from 1 ms doubling to 50 ms, and reads it once more at
// the end of its wait; a Get of a key that a Get of this store gave up on just before (a caller
// that waits in slices, as CancellableStore does) goes on at the pace that one reached rather
// than polling fast again. Add polls for its lock the same way, for 300 s at most, or until the
// deadline of a communicator's set-up (AddBy). Anything in the folder under a key's name that is
// not a regular file (a FIFO, say) is an error, not a wait. flock locks belong to the open file
// description, so Add excludes other threads of this process as well as other processes (Linux
// NFS maps flock onto POSIX byte-range locks).
//
// Thread-safety: every method may be called from any thread.
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <system_error>
#include <thread>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/job_token.h"
#include "src/cluster/store_common.h"
#include "src/core/auth.h"
#include "src/core/files.h"

namespace collectives {
namespace cluster {
namespace {

constexpr size_t kMaxHexKeyBytes = 100;
constexpr std::chrono::milliseconds kFirstPoll{1};
constexpr std::chrono::milliseconds kMaxPoll{50};
// How long Add waits for another process's lock on a key (the default communicator timeout).
constexpr std::chrono::seconds kLockWait{300};

std::string Hex(const unsigned char* data, size_t bytes) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes * 2);
  for (size_t i = 0; i < bytes; ++i) {
    out.push_back(kDigits[data[i] >> 4]);
    out.push_back(kDigits[data[i] & 15]);
  }
  return out;
}

std::string EncodeKey(const std::string& key) {
  if (key.size() <= kMaxHexKeyBytes) {
    std::string name = "h";  // built by append: GCC 12 warns (-Wrestrict) on "h" + string
    name += Hex(reinterpret_cast<const unsigned char*>(key.data()), key.size());
    return name;
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int digest_bytes = 0;
  if (EVP_Digest(key.data(), key.size(), digest, &digest_bytes, EVP_sha256(), nullptr) != 1) {
    throw Error(ErrorCode::kInternal, "file store: SHA-256 of a key failed");
  }
  std::string name = "s";
  name += Hex(digest, digest_bytes);
  return name;
}

class FileStore : public Store, public JobTokenSource, public DeadlineStore {
 public:
  explicit FileStore(std::string directory)
      : directory_(std::move(directory)), name_("file store at '" + directory_ + "'") {
    std::error_code ec;
    std::filesystem::create_directories(directory_, ec);
    if (ec) {
      throw Error(ErrorCode::kSystem,
                  name_ + ": cannot create directory '" + directory_ + "': " + ec.message());
    }
    if (!std::filesystem::is_directory(directory_, ec)) {
      throw Error(ErrorCode::kSystem, name_ + ": '" + directory_ + "' is not a directory");
    }
    std::random_device random;
    temp_prefix_ = directory_ + "/.tmp." + std::to_string(::getpid()) + "." +
                   std::to_string((static_cast<uint64_t>(random()) << 32) | random()) + ".";
  }

  void Set(const std::string& key, const std::string& value) override {
    CheckKey(name_, key);
    CheckValue(name_, key, value);
    WriteAtomically(ValuePath(key), value);
  }

  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    CheckKey(name_, key);
    Clock::time_point deadline = DeadlineAfter(timeout);
    std::string path = ValuePath(key);
    std::string value;
    Backoff backoff = TakeBackoff(key);
    for (;;) {
      Clock::time_point now = Clock::now();
      if (now >= backoff.next_read || now >= deadline) {
        if (ReadIfExists(path, &value)) return value;
        backoff.next_read = Clock::now() + backoff.poll;
        backoff.poll = std::min(backoff.poll * 2, kMaxPoll);
      }
      if (now >= deadline) {
        KeepBackoff(key, backoff);
        ThrowGetTimeout(name_, key, ClampTimeout(timeout));
      }
      std::this_thread::sleep_for(std::min(backoff.next_read, deadline) - Clock::now());
    }
  }

  int64_t Add(const std::string& key, int64_t delta) override {
    return AddBy(key, delta, Clock::time_point::max());
  }

  // A Set waits for nothing; an Add gives up on another process's lock at `deadline` when it
  // comes before kLockWait (a communicator's set-up: store_common.h).
  void SetBy(const std::string& key, const std::string& value, Clock::time_point) override {
    Set(key, value);
  }

  int64_t AddBy(const std::string& key, int64_t delta, Clock::time_point deadline) override {
    CheckKey(name_, key);
    std::string lock_path = directory_ + "/lock." + EncodeKey(key);
    core::UniqueFd lock(
        ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644));
    if (lock.get() < 0) ThrowSystem("open", lock_path);
    // Held for one read-modify-write by whoever has it; a holder that keeps it (stopped, or
    // not a rank at all) is an error after kLockWait rather than a wait without end.
    const Clock::time_point start = Clock::now();
    const Clock::time_point give_up = std::min(start + kLockWait, deadline);
    std::chrono::milliseconds poll = kFirstPoll;
    while (::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) ThrowSystem("lock", lock_path);
      const Clock::time_point now = Clock::now();
      if (now >= give_up) {
        const std::string waited =
            give_up == start + kLockWait
                ? std::to_string(kLockWait.count()) + " s"
                : std::to_string(
                      std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()) +
                      " ms";
        throw StoreFailure(ErrorCode::kTimeout,
                           name_ + ": '" + lock_path + "' has been locked by another process for " +
                               waited +
                               " (a rank stopped in Add, or a "
                               "process that is not one of this job's holding it)");
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(poll, give_up - now));
      poll = std::min(poll * 2, kMaxPoll);
    }
    // Unlocked by closing the descriptor, on every path.
    std::string path = ValuePath(key);
    std::string current;
    bool exists = ReadIfExists(path, &current);
    int64_t sum = 0;
    std::string updated = AddToCounter(name_, key, exists ? &current : nullptr, delta, &sum);
    WriteAtomically(path, updated);
    return sum;
  }

  std::string JobToken() const override {
    std::call_once(token_once_, [this] { token_ = LoadOrCreateToken(); });
    return token_;
  }

 private:
  // Where a Get's polling of a key stands: the next read and the sleep after it.
  struct Backoff {
    Clock::time_point next_read;
    std::chrono::milliseconds poll;
  };

  // The backoff a Get of `key` that gave up at most kMaxPoll ago reached, or a fresh one.
  Backoff TakeBackoff(const std::string& key) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(backoff_mu_);
    auto kept = backoffs_.find(key);
    if (kept == backoffs_.end()) return Backoff{now, kFirstPoll};
    const Backoff backoff = kept->second;
    backoffs_.erase(kept);
    if (backoff.next_read + kMaxPoll < now) return Backoff{now, kFirstPoll};
    return backoff;
  }

  // Keeps the backoff of a Get of `key` that gives up, for a Get that follows; drops those kept
  // long enough that no Get would carry them on.
  void KeepBackoff(const std::string& key, const Backoff& backoff) {
    const Clock::time_point now = Clock::now();
    std::lock_guard<std::mutex> lock(backoff_mu_);
    std::erase_if(backoffs_,
                  [now](const auto& entry) { return entry.second.next_read + kMaxPoll < now; });
    backoffs_[key] = backoff;
  }

  std::string ValuePath(const std::string& key) const {
    return directory_ + "/key." + EncodeKey(key);
  }

  [[noreturn]] void ThrowSystem(const char* what, const std::string& path) const {
    int error = errno;
    throw StoreFailure(ErrorCode::kSystem, name_ + ": cannot " + what + " '" + path +
                                               "': " + std::system_category().message(error));
  }

  // Reads the whole file at `path` into `*value`; false if it does not exist. Anything but a
  // regular file is refused (a FIFO would block the open, or the reads, for good), a symbolic
  // link included (this store renames regular files into place; a link would read whatever file
  // it points at, somebody else's secret as a peer's address).
  bool ReadIfExists(const std::string& path, std::string* value) const {
    core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW));
    if (fd.get() < 0) {
      if (errno == ENOENT) return false;
      if (errno == ELOOP) {
        throw StoreFailure(ErrorCode::kSystem,
                           name_ + ": '" + path +
                               "' is a symbolic link; it was not written by this "
                               "store");
      }
      ThrowSystem("open", path);
    }
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0) ThrowSystem("stat", path);
    if (!S_ISREG(info.st_mode)) {
      throw StoreFailure(
          ErrorCode::kSystem,
          name_ + ": '" + path + "' is not a regular file; it was not written by this store");
    }
    value->clear();
    char buffer[64 * 1024];
    for (;;) {
      ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
      if (n < 0) {
        if (errno == EINTR) continue;
        ThrowSystem("read", path);
      }
      if (n == 0) return true;
      if (value->size() + static_cast<size_t>(n) > kMaxValueBytes) {
        throw StoreFailure(ErrorCode::kSystem, name_ + ": '" + path + "' holds more than " +
                                                   std::to_string(kMaxValueBytes) +
                                                   " bytes; it was not written by this store");
      }
      value->append(buffer, static_cast<size_t>(n));
    }
  }

  // Writes `value` to a temp file in the folder, fsyncs it and renames it to `path`.
  void WriteAtomically(const std::string& path, const std::string& value) {
    std::string temp = temp_prefix_ + std::to_string(temp_counter_.fetch_add(1));
    core::UniqueFd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0) ThrowSystem("create", temp);
    try {
      if (!core::WriteAll(fd.get(), value.data(), value.size())) ThrowSystem("write", temp);
      if (::fsync(fd.get()) != 0) ThrowSystem("fsync", temp);
      if (fd.Close() != 0) ThrowSystem("close", temp);
      if (::rename(temp.c_str(), path.c_str()) != 0) ThrowSystem("rename onto", path);
    } catch (...) {
      ::unlink(temp.c_str());
      throw;
    }
  }

  // The folder's .job-token: read when it exists, else created (see the file comment).
  std::string LoadOrCreateToken() const {
    const std::string path = directory_ + "/.job-token";
    for (;;) {
      core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
      if (fd.get() >= 0) return ReadToken(fd.get(), path);
      if (errno != ENOENT) ThrowSystem("open", path);
      const core::Nonce random = core::RandomNonce();  // RAND_bytes
      const std::string token = Hex(random.data(), random.size());
      const std::string temp = temp_prefix_ + std::to_string(temp_counter_.fetch_add(1));
      core::UniqueFd out(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
      if (out.get() < 0) ThrowSystem("create", temp);
      int linked = -1;
      int link_error = 0;
      if (core::WriteAll(out.get(), token.data(), token.size()) && ::fsync(out.get()) == 0 &&
          out.Close() == 0) {
        linked = ::link(temp.c_str(), path.c_str());
        link_error = errno;
      } else {
        link_error = errno;
      }
      ::unlink(temp.c_str());
      if (linked == 0) return token;
      if (link_error != EEXIST) {
        errno = link_error;
        ThrowSystem("create", path);
      }
      // Another rank linked its token first: read that one.
    }
  }

  std::string ReadToken(int fd, const std::string& path) const {
    struct stat info {};
    if (::fstat(fd, &info) != 0) ThrowSystem("stat", path);
    const std::string refuse = name_ + ": refusing the job token in '" + path + "': ";
    if (!S_ISREG(info.st_mode)) {
      throw StoreFailure(ErrorCode::kUnauthenticated, refuse + "it is not a regular file");
    }
    if (info.st_uid != ::geteuid()) {
      throw StoreFailure(ErrorCode::kUnauthenticated,
                         refuse + "it is owned by uid " + std::to_string(info.st_uid) +
                             ", not by this process's uid " + std::to_string(::geteuid()));
    }
    if ((info.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
      char mode[8];
      std::snprintf(mode, sizeof(mode), "%04o", unsigned(info.st_mode & 07777));
      throw StoreFailure(
          ErrorCode::kUnauthenticated,
          refuse + "group or others may read or write it (mode " + mode + "; it must be 0600)");
    }
    std::string token(2 * core::kNonceBytes + 2, '\0');
    size_t got = 0;
    for (;;) {
      const ssize_t n = ::read(fd, token.data() + got, token.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) ThrowSystem("read", path);
      if (n == 0 || (got += size_t(n)) == token.size()) break;
    }
    token.resize(got);
    if (!token.empty() && token.back() == '\n') token.pop_back();  // written by hand
    const bool hex = token.size() == 2 * core::kNonceBytes &&
                     token.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos;
    if (!hex) {
      throw StoreFailure(ErrorCode::kUnauthenticated,
                         refuse + "it does not hold 64 hex digits (a token this store writes)");
    }
    return token;
  }

  const std::string directory_;
  const std::string name_;
  std::string temp_prefix_;  // "<dir>/.tmp.<pid>.<random>."; set once in the constructor
  mutable std::atomic<uint64_t> temp_counter_{0};
  mutable std::once_flag token_once_;
  mutable std::string token_;  // written once, under token_once_
  std::mutex backoff_mu_;
  std::map<std::string, Backoff> backoffs_;  // guarded by backoff_mu_
};

}  // namespace
}  // namespace cluster

std::shared_ptr<Store> CreateFileStore(const std::string& directory) {
  if (directory.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "CreateFileStore: the directory is empty");
  }
  return std::make_shared<cluster::FileStore>(directory);
}

}  // namespace collectives
