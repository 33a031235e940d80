// The file Store: one file per key in a folder every rank can see.
//
// Layout of the folder:
//   key.<k>     the value of a key, where <k> is "h" + the key's bytes in hex for keys of up to
//               100 bytes, "s" + the SHA-256 of the key in hex for longer ones (file names stay
//               under 255 bytes and never contain '/' or other special characters);
//   lock.<k>    taken with flock(LOCK_EX) around the read-modify-write of Add;
//   .tmp.*      a value being written: Set writes a temp file, fsyncs it and renames it over
//               key.<k>, so a reader sees the old value or the new one, never a torn one.
// Get polls for the file with a backoff from 1 ms doubling to 50 ms. flock locks belong to the
// open file description, so Add excludes other threads of this process as well as other
// processes (Linux NFS maps flock onto POSIX byte-range locks).
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
#include <filesystem>
#include <random>
#include <string>
#include <system_error>
#include <thread>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/store_common.h"
#include "src/core/files.h"

namespace collectives {
namespace cluster {
namespace {

constexpr size_t kMaxHexKeyBytes = 100;
constexpr std::chrono::milliseconds kFirstPoll{1};
constexpr std::chrono::milliseconds kMaxPoll{50};

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

class FileStore : public Store {
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
    std::chrono::milliseconds poll = kFirstPoll;
    for (;;) {
      if (ReadIfExists(path, &value)) return value;
      Clock::time_point now = Clock::now();
      if (now >= deadline) ThrowGetTimeout(name_, key, ClampTimeout(timeout));
      std::this_thread::sleep_for(std::min<Clock::duration>(poll, deadline - now));
      poll = std::min(poll * 2, kMaxPoll);
    }
  }

  int64_t Add(const std::string& key, int64_t delta) override {
    CheckKey(name_, key);
    std::string lock_path = directory_ + "/lock." + EncodeKey(key);
    core::UniqueFd lock(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (lock.get() < 0) ThrowSystem("open", lock_path);
    while (::flock(lock.get(), LOCK_EX) != 0) {
      if (errno != EINTR) ThrowSystem("lock", lock_path);
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

 private:
  std::string ValuePath(const std::string& key) const {
    return directory_ + "/key." + EncodeKey(key);
  }

  [[noreturn]] void ThrowSystem(const char* what, const std::string& path) const {
    int error = errno;
    throw Error(ErrorCode::kSystem, name_ + ": cannot " + what + " '" + path +
                                        "': " + std::system_category().message(error));
  }

  // Reads the whole file at `path` into `*value`; false if it does not exist.
  bool ReadIfExists(const std::string& path, std::string* value) const {
    core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) {
      if (errno == ENOENT) return false;
      ThrowSystem("open", path);
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
        throw Error(ErrorCode::kSystem, name_ + ": '" + path + "' holds more than " +
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

  const std::string directory_;
  const std::string name_;
  std::string temp_prefix_;  // "<dir>/.tmp.<pid>.<random>."; set once in the constructor
  std::atomic<uint64_t> temp_counter_{0};
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
