// Tests of the file store beyond what every store does (store_test.cc): the folder layout, key
// encoding, atomic Add across processes, and errors that name the path.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "src/cluster/cancellable_store.h"
#include "src/cluster/job_token.h"
#include "src/cluster/store_common.h"

// A seam for counting the store's reads: the store reads a key by opening its file, and this
// test binary's open() (which the library's calls reach before libc's) counts the opens of paths
// that contain g_counted_path, then opens as libc would.
namespace {
std::atomic<const char*> g_counted_path{nullptr};
std::atomic<int> g_counted_opens{0};
}  // namespace

extern "C" int open(const char* path, int flags, ...) {
  mode_t mode = 0;
  if ((flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE) {
    va_list args;
    va_start(args, flags);
    mode = va_arg(args, mode_t);
    va_end(args);
  }
  const char* counted = g_counted_path.load();
  if (counted != nullptr && std::strstr(path, counted) != nullptr) ++g_counted_opens;
  return static_cast<int>(::syscall(SYS_openat, AT_FDCWD, path, flags, mode));
}

namespace collectives {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

constexpr milliseconds kLong{5000};

// A fresh folder, removed at the end of the test. On tmpfs when there is one: the store fsyncs
// every write, and a disk makes hundreds of Adds take seconds.
class TempDir {
 public:
  TempDir() {
    fs::path root =
        access("/dev/shm", W_OK) == 0 ? fs::path("/dev/shm") : fs::temp_directory_path();
    std::string pattern = root / "file_store_test.XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::set<std::string> Names(const fs::path& directory) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(directory)) {
    names.insert(entry.path().filename().string());
  }
  return names;
}

// A job that sets no token: the first store to ask writes <dir>/.job-token, every other reads it.
TEST(FileStoreTokenTest, RanksRacingForTheTokenAllGetTheOneFile) {
  TempDir temp;
  EXPECT_FALSE(fs::exists(temp.path() / ".job-token"));  // only made when asked
  constexpr int kRanks = 8;
  std::vector<std::string> tokens(kRanks);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kRanks; ++rank) {
    ranks.emplace_back([&, rank] {
      tokens[size_t(rank)] = cluster::StoreJobToken(*CreateFileStore(temp.path().string()));
    });
  }
  for (auto& t : ranks) t.join();
  for (const std::string& token : tokens) EXPECT_EQ(token, tokens[0]);
  EXPECT_EQ(tokens[0].size(), 64u);
  EXPECT_EQ(tokens[0].find_first_not_of("0123456789abcdef"), std::string::npos) << tokens[0];
  struct stat info {};
  ASSERT_EQ(stat((temp.path() / ".job-token").c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);
  std::set<std::string> names = Names(temp.path());
  EXPECT_EQ(names, std::set<std::string>{".job-token"}) << "temp files left behind";
  // Another folder, another token.
  TempDir other;
  EXPECT_NE(cluster::StoreJobToken(*CreateFileStore(other.path().string())), tokens[0]);
}

TEST(FileStoreTokenTest, ATokenFileOthersMayReadOrAnotherUserOwnsIsRefused) {
  TempDir temp;
  const fs::path path = temp.path() / ".job-token";
  const std::string token = cluster::StoreJobToken(*CreateFileStore(temp.path().string()));
  auto refused = [&](const std::string& want) {
    try {
      cluster::StoreJobToken(*CreateFileStore(temp.path().string()));
      ADD_FAILURE() << "accepted; expected: " << want;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
      EXPECT_NE(e.message().find(want), std::string::npos) << e.message();
    }
  };
  ASSERT_EQ(chmod(path.c_str(), 0640), 0);
  refused("mode 0640");
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  EXPECT_EQ(cluster::StoreJobToken(*CreateFileStore(temp.path().string())), token);
  if (geteuid() == 0) {  // only root can give a file away
    ASSERT_EQ(chown(path.c_str(), 65534, 65534), 0);
    refused("owned by uid 65534");
    ASSERT_EQ(chown(path.c_str(), 0, 0), 0);
  }
  {
    std::ofstream out(path, std::ios::trunc);
    out << "not a token\n";
  }
  refused("64 hex digits");
  // A token written by hand (openssl rand -hex 32 > .job-token) is taken as it is.
  {
    std::ofstream out(path, std::ios::trunc);
    out << std::string(64, 'a') << "\n";
  }
  EXPECT_EQ(cluster::StoreJobToken(*CreateFileStore(temp.path().string())), std::string(64, 'a'));
}

TEST(FileStoreTest, CreatesMissingParents) {
  TempDir temp;
  fs::path nested = temp.path() / "a" / "b" / "c";
  auto store = CreateFileStore(nested.string());
  EXPECT_TRUE(fs::is_directory(nested));
  store->Set("k", "v");
  EXPECT_EQ(CreateFileStore(nested.string())->Get("k", kLong), "v");
}

TEST(FileStoreTest, KeysNeverEscapeTheFolderAndNamesStayShort) {
  TempDir temp;
  fs::path folder = temp.path() / "store";
  auto store = CreateFileStore(folder.string());
  std::string long_a(300, 'a');
  std::string long_b = long_a;
  long_b.back() = 'b';
  for (const std::string& key : {std::string("../escape"), std::string("/abs/path"),
                                 std::string("."), long_a, long_b, std::string(4096, 'z')}) {
    store->Set(key, "value of " + key.substr(0, 20));
  }
  EXPECT_EQ(store->Get(long_a, kLong), "value of " + long_a.substr(0, 20));
  EXPECT_EQ(store->Get(long_b, kLong), "value of " + long_b.substr(0, 20));
  EXPECT_EQ(store->Get("../escape", kLong), "value of ../escape");
  EXPECT_EQ(Names(temp.path()), std::set<std::string>{"store"});  // nothing escaped
  std::set<std::string> names = Names(folder);
  EXPECT_EQ(names.size(), 6u);
  for (const std::string& name : names) {
    EXPECT_LE(name.size(), 255u) << name;
    EXPECT_EQ(name.rfind("key.", 0), 0u) << name;  // no temp files left behind
  }
}

TEST(FileStoreTest, ValuesAreWholeFiles) {
  TempDir temp;
  auto store = CreateFileStore(temp.path().string());
  store->Set("k", "first");
  store->Set("k", "second, longer");
  std::set<std::string> names = Names(temp.path());
  ASSERT_EQ(names.size(), 1u);
  std::ifstream file(temp.path() / *names.begin());
  std::string contents((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  EXPECT_EQ(contents, "second, longer");
}

TEST(FileStoreTest, AddIsAtomicAcrossProcesses) {
  TempDir temp;
  constexpr int kAdds = 100;
  auto store = CreateFileStore(temp.path().string());
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child: its own store object, no gtest assertions, exit code tells the parent.
    int code = 0;
    try {
      auto child_store = CreateFileStore(temp.path().string());
      for (int i = 0; i < kAdds; ++i) child_store->Add("counter", 1);
    } catch (...) {
      code = 1;
    }
    _exit(code);
  }
  for (int i = 0; i < kAdds; ++i) store->Add("counter", 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(store->Get("counter", kLong), std::to_string(2 * kAdds));
}

TEST(FileStoreTest, FolderThatCannotBeCreatedIsASystemErrorNamingThePath) {
  TempDir temp;
  fs::path file = temp.path() / "plain_file";
  std::ofstream(file) << "x";
  std::string bad = (file / "sub").string();
  try {
    CreateFileStore(bad);
    ADD_FAILURE() << "expected kSystem";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystem) << e.what();
    EXPECT_NE(e.message().find(bad), std::string::npos) << e.message();
  }
  EXPECT_THROW(CreateFileStore(""), Error);
}

TEST(FileStoreTest, FolderRemovedUnderTheStoreIsASystemError) {
  TempDir temp;
  fs::path folder = temp.path() / "gone";
  auto store = CreateFileStore(folder.string());
  fs::remove_all(folder);
  try {
    store->Set("k", "v");
    ADD_FAILURE() << "expected kSystem";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystem) << e.what();
    EXPECT_NE(e.message().find(folder.string()), std::string::npos) << e.message();
  }
}

// A FIFO under a key's name or the token's (a stranger with write access to the folder can make
// one) is an error at once, since opening it would block until a writer came, for good, past
// Get's timeout.
TEST(FileStoreTest, AFifoInTheFolderIsAnErrorNotAWait) {
  TempDir temp;
  auto store = CreateFileStore(temp.path().string());
  ASSERT_EQ(mkfifo((temp.path() / "key.h6b").c_str(), 0600), 0);  // the key "k"
  const auto start = std::chrono::steady_clock::now();
  for (int op = 0; op < 2; ++op) {
    try {
      if (op == 0) store->Get("k", kLong);
      if (op == 1) store->Add("k", 1);
      ADD_FAILURE() << "expected kSystem";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kSystem) << e.what();
      EXPECT_NE(e.message().find("not a regular file"), std::string::npos) << e.message();
    }
  }
  ASSERT_EQ(mkfifo((temp.path() / ".job-token").c_str(), 0600), 0);
  try {
    cluster::StoreJobToken(*store);
    ADD_FAILURE() << "expected kUnauthenticated";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
    EXPECT_NE(e.message().find("not a regular file"), std::string::npos) << e.message();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, kLong);
}

// A value file planted as a symbolic link (by another user who can write the folder) is refused,
// not read through: Get would return whatever file it pointed at, another file's secret as a
// peer's value.
TEST(FileStoreTest, AValueThatIsASymbolicLinkIsRefused) {
  TempDir temp;
  auto store = CreateFileStore(temp.path().string());
  const fs::path secret = temp.path() / "secret";
  {
    std::ofstream out(secret);
    out << "secret-of-victim";
  }
  fs::create_symlink(secret, temp.path() / "key.h6b");  // the key "k"
  for (int op = 0; op < 2; ++op) {
    try {
      if (op == 0) store->Get("k", kLong);
      if (op == 1) store->Add("k", 1);
      ADD_FAILURE() << "a value behind a symbolic link was read";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kSystem) << e.what();
      EXPECT_NE(e.message().find("is a symbolic link; it was not written by this store"),
                std::string::npos)
          << e.message();
      EXPECT_EQ(e.message().find("secret-of-victim"), std::string::npos) << e.message();
    }
  }
}

// A caller that waits in slices (a split's set-up: CancellableStore, polling the parent every
// 50 ms) reads the key's file at the pace of the store's backoff, about 20 times a second once
// it has grown, as one long Get does: a slice does not start the backoff again from 1 ms, which
// would read the file several times as often.
TEST(FileStoreTest, AGetWaitingInSlicesReadsAtTheBackoffsPace) {
  TempDir temp;
  auto store = CreateFileStore(temp.path());
  cluster::CancellableStore sliced(
      store, [] { return false; }, "unused", milliseconds(50));
  const std::string counted = (temp.path() / "key.").string();
  g_counted_opens = 0;
  g_counted_path = counted.c_str();
  try {
    sliced.Get("never", milliseconds(1000));
    ADD_FAILURE() << "a Get of a key nobody sets returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("was not set within 1000 ms"), std::string::npos) << e.what();
  }
  g_counted_path = nullptr;
  EXPECT_GT(g_counted_opens.load(), 10);  // the seam counts
  EXPECT_LE(g_counted_opens.load(), 40) << "reads of the key's file in the Get's 1000 ms";
}

// A communicator's set-up Adds by its deadline (cluster::AddBy): another process that holds a
// key's lock (a rank stopped in Add) ends the Add at the deadline with an error naming the lock,
// not after the store's own 300 s (as a plain Add does): a set-up over a file store with a
// 500 ms timeout must not wait the 300 s.
TEST(FileStoreTest, AnAddByADeadlineGivesUpOnAHeldLockAtTheDeadline) {
  TempDir temp;
  auto store = CreateFileStore(temp.path());
  const std::string lock_path = (temp.path() / "lock.h6b").string();  // the key "k"
  const int holder = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(holder, 0);
  ASSERT_EQ(::flock(holder, LOCK_EX), 0);
  const auto start = std::chrono::steady_clock::now();
  auto add = std::async(std::launch::async,
                        [&] { return cluster::AddBy(*store, "k", 1, start + milliseconds(300)); });
  const bool ended = add.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  ::close(holder);  // lets an Add that still waits finish
  EXPECT_TRUE(ended) << "an Add by a 300 ms deadline still waited for the lock after 3 s";
  try {
    add.get();
    if (ended) ADD_FAILURE() << "an Add got a lock another process held";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find(lock_path + "' has been locked by another process for "),
              std::string::npos)
        << e.what();
  }
}

// A failure of the file store in a communicator's set-up is raised under its code naming the
// rank, as a TCP store's is: here the lock of the generation counter, held by another process
// past the set-up's deadline. The store's own words alone ("file store at '...': '.../lock.h...'
// has been locked by another process for 300 ms ...") would not say which rank failed.
TEST(FileStoreTest, AFailureInTheSetUpNamesTheRank) {
  TempDir temp;
  const std::string key = "collectives/generation/1";  // the spec's job id, then its rank
  std::string hex;
  for (unsigned char c : key) {
    char digits[3];
    std::snprintf(digits, sizeof(digits), "%02x", c);
    hex += digits;
  }
  const std::string lock_path = (temp.path() / ("lock.h" + hex)).string();
  const int holder = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(holder, 0);
  ASSERT_EQ(::flock(holder, LOCK_EX), 0);
  ClusterSpec spec;
  spec.rank = 1;
  spec.world_size = 2;
  spec.master_addr = "127.0.0.1";
  spec.master_port = 1;  // unused: the store is given
  CommunicationOptions options;
  options.implementation = Implementation::kRing;
  options.timeout = milliseconds(300);
  try {
    CreateCommunication(spec, CreateFileStore(temp.path().string()), options);
    ADD_FAILURE() << "a set-up got a lock another process held";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_EQ(e.message().rfind("rank 1: file store at '" + temp.path().string() + "': '" +
                                    lock_path + "' has been locked by another process for ",
                                0),
              0u)
        << e.what();
  }
  ::close(holder);
}

}  // namespace
}  // namespace collectives
