// Checkpoints of a strategy's variables and an optimizer's state, and BackupAndRestore.
//
// The file `<directory>/checkpoint` (all integers little-endian):
//
//   magic      8 bytes "COLLCKPT"
//   version    u32 (1)
//   reserved   u32 (0)
//   file_bytes u64: the size of the whole file, so that truncation is named as such
//   epoch, step               i64, i64 (TrainingState)
//   optimizer name            u32 length + bytes ("" when saved without an optimizer)
//   optimizer iterations      i64
//   entries                   u64 count, then per entry:
//     kind u8 (0 variable, 1 optimizer slot), name (u32 length + bytes),
//     rank u32, dims u64 x rank, count u64 (= product of dims), count x f32
//   checksum   u32: CRC-32 (IEEE, as zlib's crc32) of every byte before it
//
// Saving (a collective): the workers first agree on the training state and the optimizer (given
// or not, its name, its slot names); then every worker serialises (the variables are identical
// everywhere, so the bytes are too). The chief writes
// `checkpoint.tmp-<host>-<pid>.<n>.<random>` in the directory (a name no other save uses, even
// one of another thread of the process; opened with O_EXCL), fsyncs it, renames it over
// `checkpoint` and fsyncs the directory: a crash leaves the old file or the new one, never a
// torn one. Directories it had to create are made durable by fsyncing
// their parents. Other workers write the same bytes to a name of the same kind,
// `.worker-<index>.tmp-<host>-<pid>.<n>.<random>` (another job's worker of the same index may
// save into the same directory), and delete it, also when the write fails. A worker that dies
// while it writes leaves its temporary behind; its next save on the same host removes those whose
// process is gone. Only the chief's file is the checkpoint: another worker's failure (to write
// or delete its temporary) is a line on its stderr, not an error, since the chief may have
// renamed the new checkpoint into place already. Then the workers all-reduce whether the chief
// failed; if so it broadcasts its error code and message, so that every worker throws, saying
// why.
//
// Restoring (a collective): the workers first agree on the optimizer (given or not, its name,
// its slot names). The chief reads and verifies the file, then broadcasts a small header
// {status, error code, size} and the bytes (or its error message), so other workers need no
// shared file system and fail with the chief's error instead of hanging. Every worker parses the
// bytes and checks them against its variables and the optimizer (names, shapes, slots) without
// changing anything; the workers agree on the outcome as when saving; only when every worker
// passed does every worker assign every local copy. So a restore succeeds on every worker or on
// none.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "collectives/errors.h"
#include "collectives/evaluator.h"
#include "collectives/strategy.h"
#include "src/core/environment.h"
#include "src/core/files.h"
#include "src/strategy/strategy_impl.h"

namespace collectives::strategy {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint writer copies integers and floats as they lie in memory");

constexpr char kMagic[8] = {'C', 'O', 'L', 'L', 'C', 'K', 'P', 'T'};
constexpr uint32_t kVersion = 1;
constexpr char kFileName[] = "checkpoint";
constexpr char kFinalMarkName[] = "checkpoint.final";
constexpr size_t kHeaderBytes = 8 + 4 + 4 + 8;  // magic, version, reserved, file_bytes
constexpr size_t kChecksumBytes = 4;

// ---- CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), one table lookup per byte. ----

std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}

uint32_t Crc32(const unsigned char* data, size_t bytes) {
  static const std::array<uint32_t, 256> kTable = MakeCrcTable();
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < bytes; ++i) c = kTable[(c ^ data[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// ---- What a checkpoint holds. ----

struct Entry {
  enum Kind : uint8_t { kVariable = 0, kSlot = 1 };
  Kind kind = kVariable;
  std::string name;
  std::vector<size_t> shape;
  std::vector<float> values;
};

struct Contents {
  TrainingState state;
  std::string optimizer;
  int64_t iterations = 0;
  std::vector<Entry> entries;
};

// ---- Serialisation. ----

class Writer {
 public:
  void Raw(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    bytes_.insert(bytes_.end(), b, b + n);
  }
  template <typename T>
  void Put(T value) {
    Raw(&value, sizeof value);
  }
  void String(const std::string& s) {
    Put(static_cast<uint32_t>(s.size()));
    Raw(s.data(), s.size());
  }
  std::vector<unsigned char>& bytes() { return bytes_; }

 private:
  std::vector<unsigned char> bytes_;
};

std::vector<unsigned char> Serialize(const Contents& c) {
  Writer w;
  w.Raw(kMagic, sizeof kMagic);
  w.Put<uint32_t>(kVersion);
  w.Put<uint32_t>(0);
  w.Put<uint64_t>(0);  // file_bytes, patched below
  w.Put<int64_t>(c.state.epoch);
  w.Put<int64_t>(c.state.step);
  w.String(c.optimizer);
  w.Put<int64_t>(c.iterations);
  w.Put<uint64_t>(c.entries.size());
  for (const Entry& e : c.entries) {
    w.Put<uint8_t>(e.kind);
    w.String(e.name);
    w.Put<uint32_t>(static_cast<uint32_t>(e.shape.size()));
    for (size_t d : e.shape) w.Put<uint64_t>(d);
    w.Put<uint64_t>(e.values.size());
    w.Raw(e.values.data(), e.values.size() * sizeof(float));
  }
  std::vector<unsigned char>& bytes = w.bytes();
  const uint64_t total = bytes.size() + kChecksumBytes;
  std::memcpy(bytes.data() + 16, &total, sizeof total);
  const uint32_t crc = Crc32(bytes.data(), bytes.size());
  w.Put<uint32_t>(crc);
  return std::move(w.bytes());
}

[[noreturn]] void ThrowCorrupt(const std::string& path, const std::string& why) {
  throw Error(ErrorCode::kInvalidArgument, "checkpoint " + path + " is corrupt: " + why);
}

// Reads a verified byte string; every read is bounds-checked and names what it was reading.
class Reader {
 public:
  Reader(const std::vector<unsigned char>& bytes, size_t end, std::string path)
      : bytes_(bytes), end_(end), path_(std::move(path)) {}

  void Raw(void* out, size_t n, const char* what) {
    if (n > end_ - pos_) {
      Corrupt("truncated record: " + std::string(what) + " needs " + std::to_string(n) +
              " bytes at offset " + std::to_string(pos_) + ", " + std::to_string(end_ - pos_) +
              " remain");
    }
    if (n > 0) std::memcpy(out, bytes_.data() + pos_, n);
    pos_ += n;
  }
  template <typename T>
  T Get(const char* what) {
    T value;
    Raw(&value, sizeof value, what);
    return value;
  }
  std::string String(const char* what) {
    const uint32_t n = Get<uint32_t>(what);
    if (n > end_ - pos_) {
      Corrupt(std::string(what) + " claims " + std::to_string(n) + " bytes at offset " +
              std::to_string(pos_) + ", " + std::to_string(end_ - pos_) + " remain");
    }
    std::string s(n, '\0');
    Raw(s.data(), n, what);
    return s;
  }
  size_t remaining() const { return end_ - pos_; }
  [[noreturn]] void Corrupt(const std::string& why) const { ThrowCorrupt(path_, why); }

 private:
  const std::vector<unsigned char>& bytes_;
  size_t end_;
  size_t pos_ = 0;
  std::string path_;
};

// Verifies and parses; throws kInvalidArgument naming `path` and what is wrong.
Contents Parse(const std::vector<unsigned char>& bytes, const std::string& path) {
  const auto corrupt = [&](const std::string& why) { ThrowCorrupt(path, why); };
  // A file too short to hold the magic is a truncated one (a copy cut short), not a stranger's.
  if (bytes.size() >= sizeof kMagic && std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    corrupt("bad magic (not a checkpoint of this library)");
  }
  if (bytes.size() < kHeaderBytes + kChecksumBytes) {
    corrupt("truncated: " + std::to_string(bytes.size()) + " bytes, shorter than the header");
  }
  // The checksum first: until it matches, no field of the header can be believed (one flipped
  // bit in the version must not read as a file of another format, nor one in file_bytes as a
  // truncation).
  uint64_t file_bytes;
  std::memcpy(&file_bytes, bytes.data() + 16, 8);
  const std::string sizes = "the file has " + std::to_string(bytes.size()) +
                            " bytes, its header says " + std::to_string(file_bytes);
  const size_t body_end = bytes.size() - kChecksumBytes;
  uint32_t stored;
  std::memcpy(&stored, bytes.data() + body_end, 4);
  const uint32_t computed = Crc32(bytes.data(), body_end);
  if (stored != computed) {
    if (file_bytes != bytes.size()) {
      // A file cut short (or appended to) has no checksum at its end; a whole file whose size
      // field alone is damaged has, and it matches once the field holds the real size.
      std::vector<unsigned char> patched(bytes.begin(), bytes.begin() + body_end);
      const uint64_t real = bytes.size();
      std::memcpy(patched.data() + 16, &real, sizeof real);
      if (Crc32(patched.data(), patched.size()) != stored) {
        corrupt((file_bytes > bytes.size() ? "truncated: " : "trailing bytes: ") + sizes);
      }
    }
    char text[64];
    std::snprintf(text, sizeof text, "checksum mismatch (stored %08x, computed %08x)", stored,
                  computed);
    corrupt(text);
  }
  // The checksum matches: these are what a writer wrote.
  uint32_t version;
  std::memcpy(&version, bytes.data() + 8, 4);
  if (version != kVersion) {
    corrupt("format version " + std::to_string(version) + ", this library reads version " +
            std::to_string(kVersion));
  }
  uint32_t reserved;
  std::memcpy(&reserved, bytes.data() + 12, 4);
  if (reserved != 0) corrupt("the reserved field holds " + std::to_string(reserved) + ", not 0");
  if (file_bytes != bytes.size()) corrupt("wrong size field: " + sizes);

  Reader in(bytes, body_end, path);
  std::array<unsigned char, kHeaderBytes> header;
  in.Raw(header.data(), header.size(), "header");
  Contents c;
  c.state.epoch = in.Get<int64_t>("epoch");
  c.state.step = in.Get<int64_t>("step");
  c.optimizer = in.String("optimizer name");
  c.iterations = in.Get<int64_t>("optimizer iterations");
  if (c.state.epoch < 0 || c.state.step < 0 || c.iterations < 0) {
    in.Corrupt("negative epoch, step or iterations (" + std::to_string(c.state.epoch) + ", " +
               std::to_string(c.state.step) + ", " + std::to_string(c.iterations) + ")");
  }
  const uint64_t count = in.Get<uint64_t>("entry count");
  for (uint64_t i = 0; i < count; ++i) {
    Entry e;
    const uint8_t kind = in.Get<uint8_t>("entry kind");
    if (kind > Entry::kSlot) in.Corrupt("entry " + std::to_string(i) + " has kind " + std::to_string(kind));
    e.kind = static_cast<Entry::Kind>(kind);
    e.name = in.String("entry name");
    const uint32_t rank = in.Get<uint32_t>("entry rank");
    if (rank > in.remaining() / 8) in.Corrupt("entry '" + e.name + "' has rank " + std::to_string(rank));
    size_t product = 1;
    for (uint32_t d = 0; d < rank; ++d) {
      const uint64_t dim = in.Get<uint64_t>("entry dimension");
      if (dim != 0 && product > std::numeric_limits<size_t>::max() / dim) {
        in.Corrupt("entry '" + e.name + "' has too many elements");
      }
      product *= dim;
      e.shape.push_back(dim);
    }
    const uint64_t values = in.Get<uint64_t>("entry count");
    if (values != product) {
      in.Corrupt("entry '" + e.name + "' has " + std::to_string(values) +
                 " values for a shape of " + std::to_string(product) + " elements");
    }
    if (values > in.remaining() / sizeof(float)) {
      in.Corrupt("entry '" + e.name + "' claims " + std::to_string(values) + " values, only " +
                 std::to_string(in.remaining()) + " bytes remain");
    }
    e.values.resize(values);
    in.Raw(e.values.data(), values * sizeof(float), "entry values");
    c.entries.push_back(std::move(e));
  }
  if (in.remaining() != 0) {
    in.Corrupt(std::to_string(in.remaining()) + " unexpected bytes after the last entry");
  }
  return c;
}

// ---- Files. ----
//
// Every message starts with `who` (StrategyImpl::who(): "worker 1 ", or "" with one worker).

[[noreturn]] void ThrowSystem(const std::string& who, const std::string& what,
                              const std::string& path, int error) {
  throw Error(ErrorCode::kSystem, who + what + " " + path + ": " + std::strerror(error));
}

void SyncDirectory(const std::string& who, const std::string& directory) {
  core::UniqueFd fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) ThrowSystem(who, "cannot open directory", directory, errno);
  if (::fsync(fd.get()) != 0) ThrowSystem(who, "cannot fsync directory", directory, errno);
}

// Creates `directory` and its missing parents, and fsyncs the parent of each one it created, so
// that a crash cannot take the new directories (and the checkpoints written in them) away.
void CreateDirectory(const std::string& who, const std::string& directory) {
  namespace fs = std::filesystem;
  fs::path path(directory);
  if (!path.empty() && !path.has_filename()) path = path.parent_path();  // "a/b/" is "a/b"
  // The components that do not exist yet, deepest first.
  std::vector<fs::path> missing;
  std::error_code probe;
  for (fs::path p = path; !p.empty() && !fs::exists(p, probe) && !probe; p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  std::error_code ec;
  if (!fs::create_directories(directory, ec) && ec) {
    throw Error(ErrorCode::kSystem,
                who + "cannot create directory " + directory + ": " + ec.message());
  }
  for (const fs::path& created : missing) {
    const fs::path parent = created.parent_path();
    SyncDirectory(who, parent.empty() ? "." : parent.string());
  }
}

// Writes `bytes` to a new file at `path`; with `sync`, fsyncs it before closing. With
// `exclusive`, the file must not exist (EEXIST is returned instead of throwing); else it is
// truncated. Returns 0, or EEXIST.
int WriteFile(const std::string& who, const std::string& path,
              const std::vector<unsigned char>& bytes, bool sync, bool exclusive) {
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (exclusive ? O_EXCL : O_TRUNC);
  core::UniqueFd fd(::open(path.c_str(), flags, 0644));
  if (fd.get() < 0) {
    if (exclusive && errno == EEXIST) return EEXIST;
    ThrowSystem(who, "cannot create", path, errno);
  }
  if (!core::WriteAll(fd.get(), bytes.data(), bytes.size())) {
    ThrowSystem(who, "cannot write", path, errno);
  }
  if (sync && ::fsync(fd.get()) != 0) ThrowSystem(who, "cannot fsync", path, errno);
  if (fd.Close() != 0) ThrowSystem(who, "cannot close", path, errno);
  return 0;
}

// nullopt when the file does not exist. Anything but a regular file is refused before it is
// read: a FIFO would block the open or the reads forever, /dev/zero would never end.
std::optional<std::vector<unsigned char>> ReadFile(const std::string& who,
                                                   const std::string& path) {
  const auto refuse_unless_regular = [&](mode_t mode) {
    if (S_ISREG(mode)) return;
    const char* kind = S_ISDIR(mode)    ? "a directory"
                       : S_ISFIFO(mode) ? "a FIFO"
                       : S_ISCHR(mode)  ? "a character device"
                       : S_ISBLK(mode)  ? "a block device"
                       : S_ISSOCK(mode) ? "a socket"
                                        : "not a file";
    throw Error(ErrorCode::kInvalidArgument,
                who + "checkpoint " + path + " is " + kind + ", not a regular file");
  };
  core::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  struct stat status;
  if (fd.get() < 0) {
    const int error = errno;
    if (error == ENOENT) return std::nullopt;
    // A socket cannot be opened at all (ENXIO), nor a device without its driver (ENXIO,
    // ENODEV): named as what it is, as the files that can be opened are.
    if (::stat(path.c_str(), &status) == 0) refuse_unless_regular(status.st_mode);
    ThrowSystem(who, "cannot open", path, error);
  }
  if (::fstat(fd.get(), &status) != 0) ThrowSystem(who, "cannot stat", path, errno);
  refuse_unless_regular(status.st_mode);
  // O_NONBLOCK kept the open of a FIFO from waiting for a writer; a regular file's reads wait
  // as they should (a file under a lease or a mandatory lock would fail them with EAGAIN).
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    ThrowSystem(who, "cannot read", path, errno);
  }
  std::vector<unsigned char> bytes;
  unsigned char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n < 0) {
      if (errno == EINTR) continue;
      ThrowSystem(who, "cannot read", path, errno);
    }
    if (n == 0) break;
    bytes.insert(bytes.end(), buffer, buffer + n);
  }
  return bytes;
}

std::string PathOf(const std::string& directory) { return directory + "/" + kFileName; }

// The start of the names of this host's temporaries: the chief's (worker < 0)
// "checkpoint.tmp-<host>-", another worker's ".worker-<index>.tmp-<host>-" (hidden: it is
// deleted once written).
std::string TemporaryPrefix(int worker) {
  const std::string start =
      worker < 0 ? std::string(kFileName) : ".worker-" + std::to_string(worker);
  return start + ".tmp-" + core::HostName() + "-";
}

// A name no other save uses: "<prefix><pid>.<n>.<random>", n counting this process's saves (two
// savers in one process, threads, get different n), the random part guarding against another
// host or container with the same name and pid on a shared file system. Opened with O_EXCL all
// the same.
std::string TemporaryName(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 random(std::random_device{}());
  char suffix[17];
  std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(random()));
  return prefix + std::to_string(::getpid()) + "." + std::to_string(counter++) + "." + suffix;
}

// Removes the temporaries that workers on this host left in `directory` when they died while
// saving: the pid in the name ("<prefix><pid>" or "<prefix><pid>.<anything>") names no live
// process. Others (a save in progress, a temporary of another host on a shared file system) are
// left alone, and so are failures to remove one.
void RemoveStaleTemporaries(const std::string& directory, const std::string& prefix) {
  std::error_code ec;
  std::filesystem::directory_iterator it(directory, ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const std::string digits = rest.substr(0, rest.find('.'));
    if (digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos) {
      continue;
    }
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid > 0 && pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) {
      std::error_code ignored;
      std::filesystem::remove(it->path(), ignored);
    }
  }
}

// Removes this host's stale temporaries of `prefix` from `directory`, then writes `bytes` to a
// new temporary of that prefix there (O_EXCL; fsynced with `sync`). Returns its path. A
// temporary that cannot be written whole is deleted.
std::string WriteTemporary(const std::string& who, const std::string& directory,
                           const std::string& prefix, const std::vector<unsigned char>& bytes,
                           bool sync) {
  RemoveStaleTemporaries(directory, prefix);
  for (int attempt = 1;; ++attempt) {
    const std::string temp = directory + "/" + TemporaryName(prefix);
    try {
      if (WriteFile(who, temp, bytes, sync, /*exclusive=*/true) == 0) return temp;
    } catch (...) {
      ::unlink(temp.c_str());  // a partial file would only fill the disk further
      throw;
    }
    if (attempt == 8) ThrowSystem(who, "cannot create", temp, EEXIST);  // not ours: kept
  }
}

// Renames the (fsynced) temporary `temp` over `path` in `directory` and fsyncs the directory:
// a crash leaves the old file or the new one. On failure the temporary is deleted.
void RenameIntoPlace(const std::string& who, const std::string& directory,
                     const std::string& temp, const std::string& path) {
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    ThrowSystem(who, "cannot rename " + temp + " to", path, error);
  }
  SyncDirectory(who, directory);
}

std::string ShapeText(const std::vector<size_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Contents Collect(Strategy& strategy, const Optimizer* optimizer, TrainingState state) {
  Contents c;
  c.state = state;
  for (MirroredVariable* v : strategy.variables()) {
    c.entries.push_back(Entry{Entry::kVariable, v->name(), v->shape(), v->Read(0)});
  }
  if (optimizer != nullptr) {
    c.optimizer = optimizer->name();
    c.iterations = optimizer->iterations();
    for (Optimizer::Slot& slot : optimizer->SaveSlots()) {
      const size_t n = slot.value.size();
      c.entries.push_back(Entry{Entry::kSlot, std::move(slot.name), {n}, std::move(slot.value)});
    }
  }
  return c;
}

// What Check found, for Commit: each variable with its saved entry, and the optimizer's slots.
struct Plan {
  std::vector<std::pair<MirroredVariable*, const Entry*>> variables;
  std::vector<Optimizer::Slot> slots;
};

// Checks `c` against the strategy's variables and the optimizer; changes nothing. Throws
// kInvalidArgument naming this worker and what does not match.
Plan Check(Strategy& strategy, const Optimizer* optimizer, const Contents& c,
           const std::string& path) {
  const auto mismatch = [&](const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument, strategy.impl().who() + "checkpoint " + path +
                                                 " does not match the strategy: " + why);
  };
  Plan plan;
  std::map<std::string, const Entry*> saved;
  for (const Entry& e : c.entries) {
    if (e.kind == Entry::kVariable) {
      if (!saved.emplace(e.name, &e).second) mismatch("variable '" + e.name + "' appears twice");
    } else if (optimizer != nullptr) {
      plan.slots.push_back(Optimizer::Slot{e.name, e.values});
    }
  }
  const std::vector<MirroredVariable*> variables = strategy.variables();
  for (MirroredVariable* v : variables) {
    auto it = saved.find(v->name());
    if (it == saved.end()) mismatch("variable '" + v->name() + "' is not in the checkpoint");
    if (it->second->shape != v->shape()) {
      mismatch("variable '" + v->name() + "' has shape " + ShapeText(it->second->shape) +
               " in the checkpoint, " + ShapeText(v->shape()) + " in the strategy");
    }
    plan.variables.emplace_back(v, it->second);
  }
  if (saved.size() != variables.size()) {
    for (const auto& [name, entry] : saved) {
      if (strategy.FindVariable(name) == nullptr) {
        mismatch("the checkpoint has variable '" + name + "', which the strategy has not");
      }
    }
  }
  if (optimizer != nullptr && c.optimizer != optimizer->name()) {
    mismatch(c.optimizer.empty()
                 ? "it holds no optimizer state, and optimizer " + optimizer->name() + " was given"
                 : "it holds the state of optimizer " + c.optimizer + ", not of " +
                       optimizer->name());
  }
  if (optimizer != nullptr) {
    try {
      optimizer->CheckSlots(plan.slots, c.iterations);
    } catch (const Error& e) {
      mismatch(e.message());
    }
  }
  return plan;
}

// Assigns what Check found. Fails only when memory runs out.
void Commit(Optimizer* optimizer, const Contents& c, const Plan& plan) {
  if (optimizer != nullptr) optimizer->RestoreSlots(plan.slots, c.iterations);
  for (const auto& [variable, entry] : plan.variables) variable->Assign(entry->values);
}

// The code and message of `failure`, the message starting with `who` ("worker 1 "); an exception
// that is not an Error is kInternal, saying that `what` failed.
std::pair<ErrorCode, std::string> CodeAndMessage(const std::exception_ptr& failure,
                                                 const std::string& who, const std::string& what) {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  try {
    std::rethrow_exception(failure);
  } catch (const Error& e) {
    code = e.code();
    message = e.message();
  } catch (const std::exception& e) {  // std::bad_alloc, say
    message = what + ": " + e.what();
  } catch (...) {
    message = what + ": an exception that is not a std::exception";
  }
  if (message.compare(0, who.size(), who) != 0) message = who + message;
  return {code, message};
}

// Collective: every worker passes its own outcome (`failure` null when it succeeded). Returns
// when every worker succeeded; else every worker throws the lowest failing worker's error: that
// worker throws it (an Error whose message starts with its name), the others an Error of the
// same code saying that `what` failed on that worker, with its message, which it broadcasts (so
// that every worker's log says why). With one worker, rethrows `failure`.
void AgreeOnFailure(Strategy& strategy, const std::string& what, std::exception_ptr failure) {
  CollectiveCommunication* comm = strategy.communication();
  if (comm == nullptr) {
    if (failure) std::rethrow_exception(failure);
    return;
  }
  const std::string& who = strategy.impl().who();
  const int self = strategy.worker_index();
  // The lowest failing rank, or world size when none failed.
  int64_t failed = failure ? self : strategy.num_workers();
  comm->AllReduce(Tensor{&failed, 1, DataType::kInt64}, ReduceOp::kMin);
  if (failed >= strategy.num_workers()) return;
  const int root = static_cast<int>(failed);
  std::array<int64_t, 2> header = {0, 0};  // error code, message bytes
  std::string message;
  if (root == self) {
    ErrorCode code;
    std::tie(code, message) = CodeAndMessage(failure, who, what);
    constexpr size_t kMaxBytes = 64 << 10;
    if (message.size() > kMaxBytes) message.resize(kMaxBytes);
    header = {static_cast<int64_t>(code), static_cast<int64_t>(message.size())};
  }
  comm->Broadcast(Tensor{header.data(), header.size(), DataType::kInt64}, root);
  message.resize(static_cast<size_t>(header[1]));
  if (!message.empty()) {
    comm->Broadcast(Tensor{message.data(), message.size(), DataType::kUInt8}, root);
  }
  const ErrorCode code = static_cast<ErrorCode>(header[0]);
  if (root == self) throw Error(code, message);
  throw Error(code, who + what + " failed on worker " + std::to_string(root) + ": " + message);
}

// "[m, v]": the slot names, for AgreeAcrossWorkers.
std::string SlotNamesText(const std::vector<std::string>& names) {
  std::string s = "[";
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s + "]";
}

enum class Status : int64_t { kOk = 0, kMissing = 1, kFailed = 2 };

}  // namespace

void SaveCheckpoint(Strategy& strategy, const Optimizer* optimizer, const std::string& directory,
                    TrainingState state) {
  StrategyImpl& impl = strategy.impl();
  impl.CheckCrossReplica("SaveCheckpoint");
  // First, before anything is written: the chief's arguments alone make the file, so a worker
  // that saves another state, or an optimizer where the chief passes none, would be overruled
  // in silence (and a backup without the optimizer's state cannot be restored with it).
  impl.AgreeAcrossWorkers(
      "SaveCheckpoint", {{"the training state", "epoch " + std::to_string(state.epoch) + ", step " +
                                                    std::to_string(state.step)},
                         {"whether an optimizer is given", optimizer != nullptr ? "yes" : "no"},
                         {"the optimizer", optimizer != nullptr ? optimizer->name() : ""},
                         {"the optimizer's slots",
                          optimizer != nullptr ? SlotNamesText(optimizer->slot_names()) : ""}});
  const std::string& who = impl.who();
  std::exception_ptr failure;
  try {
    // Inside the try: whatever fails here, the other workers learn of it below instead of
    // waiting for this one in the all-reduce until their timeout.
    const std::vector<unsigned char> bytes = Serialize(Collect(strategy, optimizer, state));
    CreateDirectory(who, directory);
    // Every worker writes a temporary of its own (another job's worker of the same index may be
    // saving into the same directory); the chief's becomes the checkpoint, the others' go.
    const bool chief = strategy.IsChief();
    const std::string prefix = TemporaryPrefix(chief ? -1 : strategy.worker_index());
    const std::string temp = WriteTemporary(who, directory, prefix, bytes, /*sync=*/chief);
    if (!chief) {
      if (::unlink(temp.c_str()) != 0) ThrowSystem(who, "cannot delete", temp, errno);
    } else {
      RenameIntoPlace(who, directory, temp, PathOf(directory));
    }
  } catch (...) {
    failure = std::current_exception();
  }
  const std::string what = "SaveCheckpoint to " + directory;
  std::string warning;
  if (failure && !strategy.IsChief()) {
    // Only the chief's file is the checkpoint (the others write to temporary places, as the
    // guide advises): this worker's failure changes nothing a restore reads, and the chief may
    // have renamed the new checkpoint into place already. So it is a warning, not an error.
    warning = "collectives: " + CodeAndMessage(failure, who, what).second +
              " (the chief's save stands: only its file is the checkpoint)\n";
    failure = nullptr;
  }
  AgreeOnFailure(strategy, what, failure);
  // Only once the chief's save is known to stand: when it failed, every worker raises that.
  std::fwrite(warning.data(), 1, warning.size(), stderr);  // one write: workers' lines do not mix
}

std::optional<TrainingState> RestoreCheckpoint(Strategy& strategy, Optimizer* optimizer,
                                               const std::string& directory) {
  StrategyImpl& impl = strategy.impl();
  impl.CheckCrossReplica("RestoreCheckpoint");
  // First, before anything is read: a worker restoring another optimizer's state (or none)
  // while the others restore theirs would leave the workers with different states.
  impl.AgreeAcrossWorkers("RestoreCheckpoint",
                          {{"whether an optimizer is given", optimizer != nullptr ? "yes" : "no"},
                           {"the optimizer", optimizer != nullptr ? optimizer->name() : ""},
                           {"the optimizer's slots",
                            optimizer != nullptr ? SlotNamesText(optimizer->slot_names()) : ""}});
  const std::string path = PathOf(directory);
  // On the chief: the file, or the error to give every worker.
  std::array<int64_t, 3> header = {static_cast<int64_t>(Status::kMissing), 0, 0};
  std::vector<unsigned char> payload;
  if (strategy.IsChief()) {
    try {
      std::optional<std::vector<unsigned char>> file = ReadFile(impl.who(), path);
      if (file) {
        Parse(*file, path);  // verify before telling the others it is good
        payload = std::move(*file);
        header[0] = static_cast<int64_t>(Status::kOk);
      }
    } catch (...) {  // std::bad_alloc of a huge file too: still told
      const auto [code, message] =
          CodeAndMessage(std::current_exception(), impl.who(), "RestoreCheckpoint of " + path);
      header[0] = static_cast<int64_t>(Status::kFailed);
      header[1] = static_cast<int64_t>(code);
      payload.assign(message.begin(), message.end());
    }
    header[2] = static_cast<int64_t>(payload.size());
  }
  if (CollectiveCommunication* comm = strategy.communication()) {
    comm->Broadcast(Tensor{header.data(), header.size(), DataType::kInt64}, 0);
    if (!strategy.IsChief()) payload.resize(static_cast<size_t>(header[2]));
    if (!payload.empty()) {
      comm->Broadcast(Tensor{payload.data(), payload.size(), DataType::kUInt8}, 0);
    }
  }
  switch (static_cast<Status>(header[0])) {
    case Status::kMissing: return std::nullopt;
    case Status::kFailed: {
      std::string message(payload.begin(), payload.end());
      if (!strategy.IsChief()) {
        message = impl.who() + "RestoreCheckpoint of " + path +
                  " failed on worker 0 (the chief, which reads the file): " + message;
      }
      throw Error(static_cast<ErrorCode>(header[1]), message);
    }
    case Status::kOk: break;
  }
  // Every worker checks, then they agree, then every worker assigns: all or none restore.
  std::optional<Contents> contents;
  Plan plan;
  std::exception_ptr failure;
  try {
    contents = Parse(payload, path);
    plan = Check(strategy, optimizer, *contents, path);
  } catch (...) {
    failure = std::current_exception();
  }
  AgreeOnFailure(strategy, "RestoreCheckpoint of " + path, failure);
  try {
    Commit(optimizer, *contents, plan);
  } catch (...) {
    // Out of memory half-way: this worker's state is neither the old one nor the checkpoint's.
    impl.Break(std::current_exception());
    throw;
  }
  return contents->state;
}

// ---- Checkpoint files without a strategy ---------------------------------------------------

const CheckpointData::Tensor* CheckpointData::FindVariable(const std::string& name) const {
  for (const Tensor& t : variables) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::optional<CheckpointData> ReadCheckpointFile(const std::string& directory) {
  const std::string path = PathOf(directory);
  std::optional<std::vector<unsigned char>> bytes = ReadFile("", path);
  if (!bytes) return std::nullopt;
  Contents c = Parse(*bytes, path);
  CheckpointData data;
  data.state = c.state;
  data.optimizer = std::move(c.optimizer);
  data.iterations = c.iterations;
  for (Entry& e : c.entries) {
    CheckpointData::Tensor t{std::move(e.name), std::move(e.shape), std::move(e.values)};
    (e.kind == Entry::kVariable ? data.variables : data.slots).push_back(std::move(t));
  }
  return data;
}

void WriteCheckpointFile(const std::string& directory, const CheckpointData& data) {
  const auto refuse = [&](const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument,
                "WriteCheckpointFile to " + directory + ": " + why + "; nothing written");
  };
  if (data.state.epoch < 0 || data.state.step < 0 || data.iterations < 0) {
    refuse("negative epoch, step or iterations (" + std::to_string(data.state.epoch) + ", " +
           std::to_string(data.state.step) + ", " + std::to_string(data.iterations) + ")");
  }
  Contents c;
  c.state = data.state;
  c.optimizer = data.optimizer;
  c.iterations = data.iterations;
  for (const auto* list : {&data.variables, &data.slots}) {
    const Entry::Kind kind = list == &data.variables ? Entry::kVariable : Entry::kSlot;
    for (const CheckpointData::Tensor& t : *list) {
      size_t product = 1;
      bool overflow = false;
      for (size_t d : t.shape) {
        overflow = overflow || (d != 0 && product > std::numeric_limits<size_t>::max() / d);
        product *= d;
      }
      if (overflow || product != t.values.size()) {
        refuse(std::string(kind == Entry::kVariable ? "variable" : "slot") + " '" + t.name +
               "' has " + std::to_string(t.values.size()) + " values for shape " +
               ShapeText(t.shape));
      }
      c.entries.push_back(Entry{kind, t.name, t.shape, t.values});
    }
  }
  const std::vector<unsigned char> bytes = Serialize(c);
  CreateDirectory("", directory);
  const std::string temp = WriteTemporary("", directory, TemporaryPrefix(-1), bytes, /*sync=*/true);
  RenameIntoPlace("", directory, temp, PathOf(directory));
}

// ---- The final mark ------------------------------------------------------------------------
//
// `<directory>/checkpoint.final` is one line of text, "step <iterations> epoch <e> epoch_step
// <s>\n", naming the checkpoint that ends the training; written as checkpoints are.

void MarkFinalCheckpoint(const std::string& directory, const FinalCheckpointMark& mark) {
  if (mark.iterations < 0 || mark.state.epoch < 0 || mark.state.step < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "MarkFinalCheckpoint: negative step, epoch or epoch step (" +
                    std::to_string(mark.iterations) + ", " + std::to_string(mark.state.epoch) +
                    ", " + std::to_string(mark.state.step) + ")");
  }
  const std::string line = "step " + std::to_string(mark.iterations) + " epoch " +
                           std::to_string(mark.state.epoch) + " epoch_step " +
                           std::to_string(mark.state.step) + "\n";
  const std::vector<unsigned char> bytes(line.begin(), line.end());
  CreateDirectory("", directory);
  const std::string prefix = std::string(kFinalMarkName) + ".tmp-" + core::HostName() + "-";
  const std::string temp = WriteTemporary("", directory, prefix, bytes, /*sync=*/true);
  RenameIntoPlace("", directory, temp, directory + "/" + kFinalMarkName);
}

std::optional<FinalCheckpointMark> ReadFinalCheckpointMark(const std::string& directory) {
  const std::string path = directory + "/" + kFinalMarkName;
  std::optional<std::vector<unsigned char>> bytes = ReadFile("", path);
  if (!bytes) return std::nullopt;
  const std::string text(bytes->begin(), bytes->end());
  long long step = -1, epoch = -1, epoch_step = -1;
  int consumed = 0;
  if (text.size() > 200 ||
      std::sscanf(text.c_str(), "step %lld epoch %lld epoch_step %lld\n%n", &step, &epoch,
                  &epoch_step, &consumed) != 3 ||
      static_cast<size_t>(consumed) != text.size() || step < 0 || epoch < 0 || epoch_step < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "final checkpoint mark " + path +
                    " is not one line \"step <n> epoch <n> epoch_step <n>\"");
  }
  return FinalCheckpointMark{{.epoch = epoch, .step = epoch_step}, step};
}

void AssignVariables(Strategy& strategy, const CheckpointData& data) {
  strategy.impl().CheckCrossReplica("AssignVariables");
  Contents c;
  for (const CheckpointData::Tensor& t : data.variables) {
    size_t product = 1;
    for (size_t d : t.shape) product *= d;
    if (product != t.values.size()) {
      throw Error(ErrorCode::kInvalidArgument,
                  "AssignVariables: variable '" + t.name + "' has " +
                      std::to_string(t.values.size()) + " values for shape " + ShapeText(t.shape));
    }
    c.entries.push_back(Entry{Entry::kVariable, t.name, t.shape, t.values});
  }
  const Plan plan = Check(strategy, nullptr, c, "data (step " + std::to_string(data.iterations) + ")");
  Commit(nullptr, c, plan);
}

// ---- BackupAndRestore ----------------------------------------------------------------------

BackupAndRestore::BackupAndRestore(Strategy& strategy, Optimizer* optimizer,
                                   std::string directory, Options options)
    : strategy_(strategy),
      optimizer_(optimizer),
      directory_(std::move(directory)),
      options_(options) {
  if (directory_.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "BackupAndRestore: the directory is empty");
  }
  if (options_.save_every_steps < 0) {
    throw Error(ErrorCode::kInvalidArgument, "BackupAndRestore: save_every_steps must be >= 0");
  }
}

TrainingState BackupAndRestore::OnTrainBegin() {
  return RestoreCheckpoint(strategy_, optimizer_, directory_).value_or(TrainingState{});
}

void BackupAndRestore::OnStepEnd(int64_t epoch, int64_t step) {
  if (options_.save_every_steps > 0 && (step + 1) % options_.save_every_steps == 0) {
    SaveCheckpoint(strategy_, optimizer_, directory_, TrainingState{epoch, step + 1});
  }
}

void BackupAndRestore::OnEpochEnd(int64_t epoch) {
  SaveCheckpoint(strategy_, optimizer_, directory_, TrainingState{epoch + 1, 0});
}

void BackupAndRestore::OnTrainEnd() {
  strategy_.Barrier();  // every worker has finished with the backup
  const std::string& who = strategy_.impl().who();
  const std::string path = PathOf(directory_);
  std::exception_ptr failure;
  if (options_.delete_on_train_end && strategy_.IsChief()) {
    try {
      if (::unlink(path.c_str()) == 0) {
        SyncDirectory(who, directory_);  // the deletion survives a crash: no stale restore
      } else if (errno != ENOENT) {
        ThrowSystem(who, "cannot delete", path, errno);
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  // A backup left behind would be restored by the next run with this directory, which would
  // skip the training: every worker throws, not the chief alone.
  AgreeOnFailure(strategy_, "BackupAndRestore::OnTrainEnd deleting " + path, failure);
}

}  // namespace collectives::strategy
