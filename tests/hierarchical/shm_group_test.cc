// ShmGroup, the intra-host shared-memory transport, with its members as threads of this process
// (rendezvous through a memory store): every collective is exact, for every dtype and op, member
// counts 1 to 8, empty, single-element, prime and uneven counts and counts that take many steps
// of a small slot, in place and not, and bit-identical on every member; members that call
// different collectives raise kMismatch before anything reaches a caller's buffer; Abort,
// deadlines and a member that leaves raise on every member, naming the rank concerned; the
// segment's name is gone from /dev/shm once everyone attached (or set-up gave up), and a segment
// open to other users is refused.
//
// One file: the suites share Options(), Member and the group builders RunMembers, CreateAtOnce
// and ForkMember (members in other processes, meeting through a file store).
#include "src/hierarchical/shm_group.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "collectives/types.h"
#include "src/core/call.h"
#include "tests/child_process.h"
#include "tests/ring/collective_checks.h"
#include "tests/scoped_env.h"
#include "tests/time_scale.h"

namespace collectives {
namespace {

using hierarchical::Clock;
using hierarchical::HostIdentity;
using hierarchical::MachineIdentity;
using hierarchical::ShmGroup;
using hierarchical::ShmGroupOptions;
using testing::Expected;
using testing::InputValue;
using testing::Load;
using testing::ScopedEnv;

constexpr uint8_t kGuard = 0xA5;     // bytes around every buffer
constexpr uint8_t kSentinel = 0x5A;  // a recv buffer's contents before a call that must fail
constexpr size_t kGuardBytes = 16;

// A key space of its own for every group a test builds.
std::string UniquePrefix(const std::string& what) {
  static std::atomic<int> counter{0};
  return "shm_group_test/" + std::to_string(getpid()) + "/" + what + "/" +
         std::to_string(counter.fetch_add(1));
}

ShmGroupOptions Options(const std::string& what, size_t slot_bytes, size_t small_bytes,
                        int members) {
  ShmGroupOptions options;
  options.key_prefix = UniquePrefix(what);
  options.job_id = "job-" + options.key_prefix;
  options.slot_bytes = slot_bytes;
  options.small_bytes = small_bytes;
  // Busy-poll only when every member can have a core, as the planner does.
  options.spin =
      std::chrono::microseconds(std::thread::hardware_concurrency() >= unsigned(members) ? 50 : 0);
  options.timeout = std::chrono::seconds(20);
  return options;
}

std::vector<int> Ranks(int n, int first = 0, int stride = 1) {
  std::vector<int> ranks;
  for (int i = 0; i < n; ++i) ranks.push_back(first + i * stride);
  return ranks;
}

// The /dev/shm path of a POSIX shared-memory name ("/collectives-...").
std::string DevShmPath(const std::string& name) { return "/dev/shm" + name; }

bool ShmNameExists(const std::string& name) {
  struct stat st {};
  return ::stat(DevShmPath(name).c_str(), &st) == 0;
}

// One member: its group and the sequence number of its last call.
struct Member {
  std::unique_ptr<ShmGroup> group;
  uint64_t seq = 0;

  core::CallTag Tag(core::CollectiveKind kind, DataType dtype, ReduceOp op, int root,
                    size_t count) {
    return core::CallTag{++seq, core::CallDescriptor{kind, dtype, op, root, uint64_t(count)}};
  }

  // The failure tests' call: an f32 sum of `data` in place, by `deadline`.
  void SumInPlace(std::vector<float>& data, Clock::time_point deadline) {
    group->AllReduce(
        Tag(core::CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, 0, data.size()),
        deadline, data.data(), data.data(), data.size(), DataType::kFloat32, ReduceOp::kSum);
  }
};

// A new folder under /tmp for a file store that members in several processes meet through.
std::string NewStoreDir() {
  char dir_template[] = "/tmp/shm_group_test_XXXXXX";
  if (mkdtemp(dir_template) == nullptr) {
    ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
    return "";
  }
  return dir_template;
}

// Forks a process that joins the group as `rank` through a file store in `dir`, runs `then` on
// its group and exits 0, never destroying the group (the process ends as a killed one would);
// it exits 3 if joining or `then` throws. Call it while the test runs no thread, so that the
// child may start its own. Returns the child's pid (-1 if fork failed).
pid_t ForkMember(const std::string& dir, int rank, const std::vector<int>& ranks,
                 const ShmGroupOptions& options, const std::function<void(Member&)>& then) {
  const pid_t child = fork();
  if (child != 0) return child;
  try {
    auto store = CreateFileStore(dir);
    Member m;
    m.group = ShmGroup::Create(rank, ranks, *store, options);
    then(m);
    _exit(0);
  } catch (...) {
  }
  _exit(3);
}

// Builds the group on one thread per member (Create is collective), then runs `body(member,
// index)` on those threads. An exception escaping Create or body fails the test. With `here`
// above 0, only members 0 to here - 1 run on this process's threads (the others join from
// elsewhere, e.g. ForkMember through a file store).
void RunMembers(const std::vector<int>& ranks, const ShmGroupOptions& options,
                const std::function<void(Member&, int)>& body,
                std::shared_ptr<Store> store = nullptr, size_t here = 0) {
  if (!store) store = CreateMemoryStore();
  std::vector<Member> members(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < (here > 0 ? here : ranks.size()); ++i) {
    threads.emplace_back([&, i] {
      try {
        members[i].group = ShmGroup::Create(ranks[i], ranks, *store, options);
        ASSERT_EQ(members[i].group->index(), int(i));
        ASSERT_EQ(members[i].group->size(), int(ranks.size()));
        body(members[i], int(i));
      } catch (const std::exception& e) {
        ADD_FAILURE() << "member " << i << " (rank " << ranks[i] << ") threw: " << e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

// Members 0..n-1 (n = options.size(), member i with options[i]) call Create at once on threads
// and drop what they built: what each raised (code and message), or kInternal and "attached".
std::pair<std::vector<ErrorCode>, std::vector<std::string>> CreateAtOnce(
    const std::vector<ShmGroupOptions>& options, Store& store) {
  const size_t n = options.size();
  std::vector<int> ranks(n);
  std::iota(ranks.begin(), ranks.end(), 0);
  std::vector<ErrorCode> codes(n, ErrorCode::kInternal);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (size_t me = 0; me < n; ++me) {
    threads.emplace_back([&, me] {
      try {
        auto group = ShmGroup::Create(int(me), ranks, store, options[me]);
        errors[me] = "attached";
      } catch (const Error& e) {
        codes[me] = e.code();
        errors[me] = e.message();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return {codes, errors};
}

// A buffer of `bytes` with guard bytes on both sides.
struct Guarded {
  explicit Guarded(size_t n, uint8_t fill = 0) : bytes(n), storage(n + 2 * kGuardBytes, kGuard) {
    std::memset(data(), fill, n);
  }
  uint8_t* data() { return storage.data() + kGuardBytes; }
  bool GuardsIntact() const {
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (storage[i] != kGuard || storage[kGuardBytes + bytes + i] != kGuard) return false;
    }
    return true;
  }
  bool AllEqual(uint8_t v) {
    for (size_t i = 0; i < bytes; ++i) {
      if (data()[i] != v) return false;
    }
    return true;
  }
  size_t bytes;
  std::vector<uint8_t> storage;
};

uint64_t Fnv(const uint8_t* data, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ data[i]) * 1099511628211ULL;
  return h;
}

// Element i of a buffer of `dtype` as stored (so that the reference rounds like the data does).
double Stored(DataType dtype, double v) {
  uint64_t cell = 0;
  testing::Store(dtype, &cell, 0, v);
  return Load(dtype, &cell, 0);
}

// The result of one call on one member: wrong elements (first described) and a hash of the
// result, which must be the same on every member for all-reduce, broadcast and all-gather.
struct Outcome {
  size_t wrong = 0;
  std::string first;
  uint64_t hash = 0;
  void Note(const std::string& what) {
    if (wrong++ == 0) first = what;
  }
};

// Runs one collective on `m` (member `me` of `n`) with the inputs of collective_checks.h (member
// index as the rank) and checks it element by element.
Outcome RunAndCheck(Member& m, int me, int n, const std::string& collective, DataType dtype,
                    ReduceOp op, size_t count, bool in_place, int root = 0) {
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  const size_t es = SizeOf(dtype);
  const std::string what = collective + " " + ToString(dtype) + " " + ToString(op) +
                           " count=" + std::to_string(count) + (in_place ? " in-place" : "") +
                           " on member " + std::to_string(me) + " of " + std::to_string(n);
  Outcome out;
  auto element_check = [&](const uint8_t* data, size_t i, double want) {
    const double got = Load(dtype, data, i);
    if (!(got == want)) {
      out.Note(what + ": element " + std::to_string(i) + " is " + std::to_string(got) +
               ", expected " + std::to_string(want));
    }
  };
  if (collective == "all_reduce") {
    Guarded send(count * es), recv(count * es, kSentinel);
    Guarded& input = in_place ? recv : send;
    for (size_t i = 0; i < count; ++i) {
      testing::Store(dtype, input.data(), i, InputValue(op, dtype, me, i));
    }
    m.group->AllReduce(m.Tag(core::CollectiveKind::kAllReduce, dtype, op, 0, count), deadline,
                       input.data(), recv.data(), count, dtype, op);
    for (size_t i = 0; i < count; ++i) element_check(recv.data(), i, Expected(op, dtype, n, i));
    if (!recv.GuardsIntact() || !send.GuardsIntact()) out.Note(what + ": guard overwritten");
    out.hash = Fnv(recv.data(), recv.bytes);
  } else if (collective == "broadcast") {
    Guarded send(count * es), recv(count * es, kSentinel);
    Guarded& input = in_place ? recv : send;
    if (me == root) {
      for (size_t i = 0; i < count; ++i) {
        testing::Store(dtype, input.data(), i, InputValue(op, dtype, root, i));
      }
    }
    m.group->Broadcast(m.Tag(core::CollectiveKind::kBroadcast, dtype, ReduceOp::kSum, root, count),
                       deadline, me == root ? input.data() : nullptr, recv.data(), count * es,
                       root);
    for (size_t i = 0; i < count; ++i) {
      element_check(recv.data(), i, Stored(dtype, InputValue(op, dtype, root, i)));
    }
    if (!recv.GuardsIntact() || !send.GuardsIntact()) out.Note(what + ": guard overwritten");
    out.hash = Fnv(recv.data(), recv.bytes);
  } else if (collective == "all_gather") {
    Guarded send(count * es), recv(count * es * size_t(n), kSentinel);
    uint8_t* input = in_place ? recv.data() + size_t(me) * count * es : send.data();
    for (size_t i = 0; i < count; ++i) {
      testing::Store(dtype, input, i, InputValue(op, dtype, me, i));
    }
    m.group->AllGather(m.Tag(core::CollectiveKind::kAllGather, dtype, ReduceOp::kSum, 0, count),
                       deadline, input, recv.data(), count * es);
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) {
        element_check(recv.data(), size_t(r) * count + i,
                      Stored(dtype, InputValue(op, dtype, r, i)));
      }
    }
    if (!recv.GuardsIntact() || !send.GuardsIntact()) out.Note(what + ": guard overwritten");
    out.hash = Fnv(recv.data(), recv.bytes);
  } else if (collective == "reduce_scatter") {
    Guarded send(count * es * size_t(n)), recv(count * es, kSentinel);
    for (size_t i = 0; i < count * size_t(n); ++i) {
      testing::Store(dtype, send.data(), i, InputValue(op, dtype, me, i));
    }
    uint8_t* output = in_place ? send.data() + size_t(me) * count * es : recv.data();
    m.group->ReduceScatter(m.Tag(core::CollectiveKind::kReduceScatter, dtype, op, 0, count),
                           deadline, send.data(), output, count, dtype, op);
    for (size_t i = 0; i < count; ++i) {
      element_check(output, i, Expected(op, dtype, n, size_t(me) * count + i));
    }
    if (!recv.GuardsIntact() || !send.GuardsIntact()) out.Note(what + ": guard overwritten");
    out.hash = 0;  // each member holds its own block
  } else if (collective == "barrier") {
    m.group->Barrier(m.Tag(core::CollectiveKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0),
                     deadline);
  }
  return out;
}

std::vector<DataType> AllDataTypes() { return testing::AllDataTypes(); }
std::vector<ReduceOp> AllReduceOps() { return testing::AllReduceOps(); }

struct GroupConfig {
  const char* name;
  size_t slot_bytes;
  size_t small_bytes;
};

// Every collective x dtype x op x count x in-place on `n` members, then the per-member hashes
// compared: the results of all-reduce, broadcast and all-gather are the same bytes everywhere.
void RunMatrix(int n, const GroupConfig& config) {
  const std::vector<int> ranks = Ranks(n, 3, 2);  // global ranks 3, 5, 7, ...: not the indices
  const ShmGroupOptions options = Options(config.name, config.slot_bytes, config.small_bytes, n);
  std::vector<std::vector<uint64_t>> hashes(static_cast<size_t>(n));
  std::vector<size_t> wrong(size_t(n), 0);
  std::vector<std::vector<std::string>> failures(static_cast<size_t>(n));
  RunMembers(ranks, options, [&](Member& m, int me) {
    const size_t slot = m.group->slot_bytes();
    auto run = [&](const std::string& c, DataType d, ReduceOp o, size_t count, bool in_place,
                   int root) {
      Outcome out = RunAndCheck(m, me, n, c, d, o, count, in_place, root);
      wrong[size_t(me)] += out.wrong;
      if (out.wrong > 0 && failures[size_t(me)].size() < 5)
        failures[size_t(me)].push_back(out.first);
      hashes[size_t(me)].push_back(out.hash);
    };
    for (const std::string c : {"all_reduce", "reduce_scatter", "broadcast", "all_gather"}) {
      const bool reduces = c == "all_reduce" || c == "reduce_scatter";
      for (DataType d : AllDataTypes()) {
        const size_t es = SizeOf(d);
        // More than two slots' worth (several steps, both buffers reused), and not a multiple
        // of the member count or of the elements per slot.
        const size_t many = (c == "all_gather" ? 2 * slot : 5 * slot / 2) / es + 2 * size_t(n) + 1;
        const std::vector<size_t> counts = {0, 1, 13, size_t(n) * 5 + 1, many};
        for (ReduceOp o : AllReduceOps()) {
          if (!reduces && o != ReduceOp::kSum) continue;
          for (size_t count : counts) {
            for (bool in_place : {false, true}) {
              const int root = c == "broadcast" ? int((count + size_t(in_place)) % size_t(n)) : 0;
              run(c, d, o, count, in_place, root);
            }
          }
        }
      }
    }
    run("barrier", DataType::kUInt8, ReduceOp::kSum, 0, false, 0);
    // Calls after the barrier still line up.
    run("all_reduce", DataType::kInt32, ReduceOp::kSum, 3 * slot / 4 + 1, true, 0);
  });
  for (int i = 0; i < n; ++i) {
    EXPECT_EQ(wrong[size_t(i)], 0u)
        << config.name << ", " << n
        << " members: " << (failures[size_t(i)].empty() ? "" : failures[size_t(i)][0]);
  }
  for (int i = 1; i < n; ++i) {
    ASSERT_EQ(hashes[size_t(i)].size(), hashes[0].size());
    for (size_t k = 0; k < hashes[0].size(); ++k) {
      EXPECT_EQ(hashes[size_t(i)][k], hashes[0][k])
          << config.name << ", " << n << " members: call " << k << " differs on member " << i;
    }
  }
}

class ShmGroupMatrixTest : public ::testing::TestWithParam<int> {};

// Slot of 4 KiB, small all-reduces up to the slot: counts up to 4 KiB take the one-sync path,
// larger ones are cut into many steps of the two-sync path.
TEST_P(ShmGroupMatrixTest, EveryCollectiveIsExactWithSmallAllReducesAndManySteps) {
  RunMatrix(GetParam(), {"small_and_steps", 4096, 4096});
}

// small_bytes 0: every non-empty all-reduce takes the two-sync path (each member reduces its
// slice), even a single element, with members whose slices are empty.
TEST_P(ShmGroupMatrixTest, EveryCollectiveIsExactWithTheLargeAllReduceAtEverySize) {
  RunMatrix(GetParam(), {"large_only", 4096, 0});
}

INSTANTIATE_TEST_SUITE_P(Members, ShmGroupMatrixTest, ::testing::Range(1, 9),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return std::to_string(param.param) + "Members";
                         });

// With the default slot (1 MiB): a 2.5 MiB all-reduce, broadcast and all-gather, and random
// floats, so that the order of reduction matters: every member must still hold the same bits.
TEST(ShmGroupTest, DefaultSlotAndRandomFloatsAreBitIdenticalOnEveryMember) {
  constexpr int n = 3;
  ShmGroupOptions options = Options("default_slot", hierarchical::kDefaultSlotBytes,
                                    hierarchical::kDefaultShmSmallBytes, n);
  std::vector<std::vector<uint64_t>> hashes(n);
  std::vector<size_t> wrong(n, 0);
  RunMembers(Ranks(n), options, [&](Member& m, int me) {
    EXPECT_EQ(m.group->slot_bytes(), hierarchical::kDefaultSlotBytes);
    EXPECT_EQ(m.group->small_bytes(), hierarchical::kDefaultShmSmallBytes);
    const size_t big = 5 * hierarchical::kDefaultSlotBytes / 2 / sizeof(float) + 3;
    Outcome o = RunAndCheck(m, me, n, "all_reduce", DataType::kFloat32, ReduceOp::kSum, big, false);
    wrong[size_t(me)] += o.wrong;
    hashes[size_t(me)].push_back(o.hash);
    o = RunAndCheck(m, me, n, "broadcast", DataType::kInt64, ReduceOp::kSum, big / 2, true, 2);
    wrong[size_t(me)] += o.wrong;
    hashes[size_t(me)].push_back(o.hash);
    o = RunAndCheck(m, me, n, "all_gather", DataType::kFloat16, ReduceOp::kSum, big / 3, false);
    wrong[size_t(me)] += o.wrong;
    hashes[size_t(me)].push_back(o.hash);
    o = RunAndCheck(m, me, n, "reduce_scatter", DataType::kFloat32, ReduceOp::kMax, big / 3, true);
    wrong[size_t(me)] += o.wrong;
    // Random inputs of every float type, small and large, sum, prod and avg.
    std::mt19937 random(1234 + unsigned(me));
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    for (DataType d :
         {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kAvg}) {
        for (size_t count : {size_t(777), size_t(300'001)}) {
          std::vector<uint8_t> buf(count * SizeOf(d));
          for (size_t i = 0; i < count; ++i) testing::Store(d, buf.data(), i, uniform(random));
          m.group->AllReduce(m.Tag(core::CollectiveKind::kAllReduce, d, op, 0, count),
                             Clock::now() + std::chrono::seconds(30), buf.data(), buf.data(), count,
                             d, op);
          hashes[size_t(me)].push_back(Fnv(buf.data(), buf.size()));
        }
      }
    }
  });
  for (int i = 0; i < n; ++i) EXPECT_EQ(wrong[size_t(i)], 0u) << "member " << i;
  for (int i = 1; i < n; ++i) EXPECT_EQ(hashes[size_t(i)], hashes[0]) << "member " << i;
}

// An all-reduce in place on runs (the packer's fused bucket without its fusion buffer) ends with
// the bits of the same all-reduce on one buffer holding the pieces back to back: random values of
// every dtype and op (floats, so that the order of reduction shows), pieces of random lengths
// (empty ones among them) that straddle the members' slices and the steps, on the one-sync and
// the two-sync paths, 1 to 5 members.
TEST(ShmGroupRunsTest, AnAllReduceInRunsHasTheBitsOfOneBuffer) {
  for (int n : {1, 2, 3, 5}) {
    for (size_t small : {size_t{4096}, size_t{0}}) {
      const ShmGroupOptions options = Options("pieces", 4096, small, n);
      std::vector<size_t> differ(size_t(n), 0);
      std::vector<std::string> first(static_cast<size_t>(n));
      RunMembers(Ranks(n, 1, 3), options, [&](Member& m, int me) {
        std::mt19937 random(99);  // the same cuts on every member
        std::mt19937 values(7 + unsigned(me));
        std::uniform_real_distribution<double> uniform(-1.0, 1.0);
        for (DataType d : AllDataTypes()) {
          const size_t es = SizeOf(d);
          for (ReduceOp op : AllReduceOps()) {
            for (size_t count : {size_t{0}, size_t{1}, size_t{13}, 3 * 4096 / es + 7}) {
              std::vector<uint8_t> whole(count * es);
              for (size_t i = 0; i < count; ++i) {
                const bool floating = d == DataType::kFloat32 || d == DataType::kFloat64 ||
                                      d == DataType::kFloat16 || d == DataType::kBFloat16;
                const double v = floating ? uniform(values) : double(values() % 5 + 1);
                testing::Store(d, whole.data(), i, v);
              }
              // Cut into pieces of 0 to count / 3 + 1 elements, each its own allocation.
              std::vector<std::vector<uint8_t>> pieces;
              core::Runs message;
              for (size_t at = 0; at < count || pieces.empty();) {
                const size_t length = std::min<size_t>(random() % (count / 3 + 2), count - at);
                pieces.emplace_back(whole.begin() + std::ptrdiff_t(at * es),
                                    whole.begin() + std::ptrdiff_t((at + length) * es));
                at += length;
              }
              for (auto& piece : pieces) {
                message.Add(piece.data(), piece.size());
              }
              const auto deadline = Clock::now() + std::chrono::seconds(30);
              m.group->AllReduce(m.Tag(core::CollectiveKind::kAllReduce, d, op, 0, count), deadline,
                                 whole.data(), whole.data(), count, d, op);
              m.group->AllReduce(m.Tag(core::CollectiveKind::kAllReduce, d, op, 0, count), deadline,
                                 message, message, d, op);
              std::vector<uint8_t> joined;
              for (const auto& piece : pieces)
                joined.insert(joined.end(), piece.begin(), piece.end());
              if (joined != whole && differ[size_t(me)]++ == 0) {
                first[size_t(me)] =
                    std::string(ToString(d)) + " " + ToString(op) + " x" + std::to_string(count);
              }
            }
          }
        }
      });
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(differ[size_t(i)], 0u) << n << " members, small_bytes " << small << ", member "
                                         << i << ": first differing call " << first[size_t(i)];
      }
    }
  }
}

// A broadcast in place on runs: every member's pieces end with the root's bytes, from each root,
// for messages of one to several steps cut at random (empty pieces among them), 1 to 5 members.
TEST(ShmGroupRunsTest, ABroadcastInRunsDeliversTheRootsBytes) {
  for (int n : {1, 2, 3, 5}) {
    const ShmGroupOptions options = Options("pieces_broadcast", 4096, 4096, n);
    std::vector<size_t> wrong(size_t(n), 0);
    RunMembers(Ranks(n), options, [&](Member& m, int me) {
      std::mt19937 random(5);  // the same cuts and root bytes on every member
      for (size_t bytes : {size_t{0}, size_t{1}, size_t{4095}, size_t{3 * 4096 + 77}}) {
        for (int root = 0; root < n; ++root) {
          std::vector<uint8_t> want(bytes);
          for (uint8_t& b : want) b = uint8_t(random());
          std::vector<std::vector<uint8_t>> pieces;
          for (size_t at = 0; at < bytes || pieces.empty();) {
            const size_t length = std::min<size_t>(random() % (bytes / 3 + 2), bytes - at);
            pieces.emplace_back(length, uint8_t(0xEE));
            if (me == root) {
              std::copy(want.begin() + std::ptrdiff_t(at),
                        want.begin() + std::ptrdiff_t(at + length), pieces.back().begin());
            }
            at += length;
          }
          core::Runs message;
          for (auto& piece : pieces) message.Add(piece.data(), piece.size());
          m.group->Broadcast(m.Tag(core::CollectiveKind::kBroadcast, DataType::kUInt8,
                                   ReduceOp::kSum, root, bytes),
                             Clock::now() + std::chrono::seconds(30), message, message, root);
          std::vector<uint8_t> joined;
          for (const auto& piece : pieces) joined.insert(joined.end(), piece.begin(), piece.end());
          if (joined != want) ++wrong[size_t(me)];
        }
      }
    });
    for (int i = 0; i < n; ++i) EXPECT_EQ(wrong[size_t(i)], 0u) << n << " members, member " << i;
  }
}

// A piece that is not a whole number of elements is refused before the group is touched, and
// an all-reduce in runs and one on one buffer of another count are a mismatch on both
// members, nothing written.
TEST(ShmGroupRunsTest, BadRunsAreRefusedAndADifferentCallIsAMismatch) {
  const ShmGroupOptions options = Options("pieces_bad", 4096, 4096, 2);
  RunMembers(Ranks(2), options, [&](Member& m, int me) {
    std::vector<float> a(10, 1.0f), b(7, 2.0f);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    core::Runs odd;
    odd.Add(a.data(), 6);
    try {
      m.group->AllReduce(
          m.Tag(core::CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, 0, 1),
          deadline, odd, odd, DataType::kFloat32, ReduceOp::kSum);
      ADD_FAILURE() << "member " << me << ": a piece of 6 bytes of f32 was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    }
    --m.seq;  // the refused call took no step
    core::Runs message;
    message.Add(a.data(), a.size() * sizeof(float));
    message.Add(b.data(), b.size() * sizeof(float));
    try {
      if (me == 0) {
        m.group->AllReduce(
            m.Tag(core::CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, 0, 17),
            deadline, message, message, DataType::kFloat32, ReduceOp::kSum);
      } else {
        m.group->AllReduce(
            m.Tag(core::CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, 0, 10),
            deadline, a.data(), a.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
      }
      ADD_FAILURE() << "member " << me << ": the mismatch went through";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMismatch) << "member " << me << ": " << e.what();
    }
    for (float v : a) EXPECT_EQ(v, 1.0f) << "member " << me;
    for (float v : b) EXPECT_EQ(v, 2.0f) << "member " << me;
  });
}

// ---- Mismatches: every member raises kMismatch, and no caller's recv buffer was touched. ----

struct MismatchCase {
  std::string name;
  // Runs member `me`'s (mismatched) call into `recv` (kRecvBytes, filled with the sentinel).
  std::function<void(Member&, int me, uint8_t* recv)> call;
};

constexpr size_t kRecvBytes = 64 * 1024;

void ExpectMismatch(const MismatchCase& c, size_t slot_bytes, size_t small_bytes) {
  constexpr int n = 3;
  const std::vector<int> ranks = {2, 4, 6};
  ShmGroupOptions options = Options("mismatch_" + c.name, slot_bytes, small_bytes, n);
  RunMembers(ranks, options, [&](Member& m, int me) {
    // One good call first: the mismatch comes on a later step with both buffers in use.
    Outcome warmup =
        RunAndCheck(m, me, n, "all_reduce", DataType::kFloat32, ReduceOp::kSum, 1000, false);
    EXPECT_EQ(warmup.wrong, 0u) << warmup.first;
    Guarded recv(kRecvBytes, kSentinel);
    const auto start = Clock::now();
    try {
      c.call(m, me, recv.data());
      ADD_FAILURE() << c.name << ": member " << me << "'s mismatched call succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMismatch) << c.name << ", member " << me << ": " << e.what();
      EXPECT_NE(e.message().find("does not match"), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::seconds(5))) << c.name;
    EXPECT_TRUE(recv.AllEqual(kSentinel))
        << c.name << ": member " << me << "'s recv buffer was written before the mismatch";
    EXPECT_TRUE(recv.GuardsIntact()) << c.name;
    // The group stays broken.
    try {
      m.group->Barrier(
          m.Tag(core::CollectiveKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0),
          Clock::now() + std::chrono::seconds(5));
      ADD_FAILURE() << c.name << ": a broken group ran a barrier";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kMismatch) << e.what();
    }
  });
}

std::vector<MismatchCase> MismatchCases() {
  using core::CollectiveKind;
  const auto deadline = [] { return Clock::now() + std::chrono::seconds(10); };
  std::vector<MismatchCase> cases;
  // Counts differ (member 1: one more element); f32 with a 4 KiB slot and small_bytes 4096:
  // 1024 elements take the small path and 1025 the large one, 3000 take several steps.
  for (size_t base : {size_t(10), size_t(1024), size_t(3000)}) {
    cases.push_back({"all_reduce_count_" + std::to_string(base),
                     [base, deadline](Member& m, int me, uint8_t* recv) {
                       const size_t count = base + (me == 1 ? 1 : 0);
                       std::vector<float> send(count, 1.0f);
                       m.group->AllReduce(m.Tag(CollectiveKind::kAllReduce, DataType::kFloat32,
                                                ReduceOp::kSum, 0, count),
                                          deadline(), send.data(), recv, count, DataType::kFloat32,
                                          ReduceOp::kSum);
                     }});
  }
  // Member 2 reduces with another op; member 0 with another dtype (the same bytes).
  cases.push_back({"all_reduce_op_and_dtype", [deadline](Member& m, int me, uint8_t* recv) {
                     const size_t count = 500;
                     const DataType d = me == 0 ? DataType::kInt32 : DataType::kFloat32;
                     const ReduceOp op = me == 2 ? ReduceOp::kMax : ReduceOp::kSum;
                     std::vector<float> send(count, 1.0f);
                     m.group->AllReduce(m.Tag(CollectiveKind::kAllReduce, d, op, 0, count),
                                        deadline(), send.data(), recv, count, d, op);
                   }});
  // Different kinds: member 1 broadcasts (as a non-root) while the others all-reduce.
  cases.push_back(
      {"all_reduce_vs_broadcast", [deadline](Member& m, int me, uint8_t* recv) {
         const size_t count = 200;
         std::vector<float> send(count, 1.0f);
         if (me == 1) {
           m.group->Broadcast(
               m.Tag(CollectiveKind::kBroadcast, DataType::kFloat32, ReduceOp::kSum, 0, count),
               deadline(), nullptr, recv, count * 4, 0);
         } else {
           m.group->AllReduce(
               m.Tag(CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp::kSum, 0, count),
               deadline(), send.data(), recv, count, DataType::kFloat32, ReduceOp::kSum);
         }
       }});
  // Member 0 all-gathers, the others reduce-scatter (same count, same bytes in the slot).
  cases.push_back(
      {"all_gather_vs_reduce_scatter", [deadline](Member& m, int me, uint8_t* recv) {
         const size_t count = 100;
         std::vector<float> send(3 * count, 1.0f);
         if (me == 0) {
           m.group->AllGather(
               m.Tag(CollectiveKind::kAllGather, DataType::kFloat32, ReduceOp::kSum, 0, count),
               deadline(), send.data(), recv, count * 4);
         } else {
           m.group->ReduceScatter(
               m.Tag(CollectiveKind::kReduceScatter, DataType::kFloat32, ReduceOp::kSum, 0, count),
               deadline(), send.data(), recv, count, DataType::kFloat32, ReduceOp::kSum);
         }
       }});
  // Member 2 enters a barrier while the others broadcast from member 0.
  cases.push_back(
      {"broadcast_vs_barrier", [deadline](Member& m, int me, uint8_t* recv) {
         const size_t bytes = 4000;
         std::vector<uint8_t> send(bytes, 7);
         if (me == 2) {
           m.group->Barrier(m.Tag(CollectiveKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0),
                            deadline());
         } else {
           m.group->Broadcast(
               m.Tag(CollectiveKind::kBroadcast, DataType::kUInt8, ReduceOp::kSum, 0, bytes),
               deadline(), send.data(), recv, bytes, 0);
         }
       }});
  // Roots differ: member 0 says root 0, members 1 and 2 say root 1 (more than a slot).
  cases.push_back({"broadcast_root", [deadline](Member& m, int me, uint8_t* recv) {
                     const size_t bytes = 10'000;
                     std::vector<uint8_t> send(bytes, 7);
                     const int root = me == 0 ? 0 : 1;
                     m.group->Broadcast(m.Tag(CollectiveKind::kBroadcast, DataType::kUInt8,
                                              ReduceOp::kSum, root, bytes),
                                        deadline(), send.data(), recv, bytes, root);
                   }});
  // Roots differ so that every member thinks another one is the root: 0 -> 1, 1 -> 2, 2 -> 0.
  cases.push_back({"broadcast_root_cycle", [deadline](Member& m, int me, uint8_t* recv) {
                     const size_t bytes = 100;
                     const int root = (me + 1) % 3;
                     m.group->Broadcast(m.Tag(CollectiveKind::kBroadcast, DataType::kUInt8,
                                              ReduceOp::kSum, root, bytes),
                                        deadline(), nullptr, recv, bytes, root);
                   }});
  // Broadcast counts differ: the root sends more than the others expect.
  cases.push_back({"broadcast_count", [deadline](Member& m, int me, uint8_t* recv) {
                     const size_t bytes = me == 0 ? 9000 : 8000;
                     std::vector<uint8_t> send(bytes, 7);
                     m.group->Broadcast(m.Tag(CollectiveKind::kBroadcast, DataType::kUInt8,
                                              ReduceOp::kSum, 0, bytes),
                                        deadline(), send.data(), recv, bytes, 0);
                   }});
  // All-gather counts differ.
  cases.push_back({"all_gather_count", [deadline](Member& m, int me, uint8_t* recv) {
                     const size_t count = me == 2 ? 1500 : 1400;
                     std::vector<float> send(count, 1.0f);
                     m.group->AllGather(m.Tag(CollectiveKind::kAllGather, DataType::kFloat32,
                                              ReduceOp::kSum, 0, count),
                                        deadline(), send.data(), recv, count * 4);
                   }});
  // Reduce-scatter counts differ.
  cases.push_back({"reduce_scatter_count", [deadline](Member& m, int me, uint8_t* recv) {
                     const size_t count = me == 1 ? 2000 : 1999;
                     std::vector<float> send(3 * count, 1.0f);
                     m.group->ReduceScatter(m.Tag(CollectiveKind::kReduceScatter,
                                                  DataType::kFloat32, ReduceOp::kSum, 0, count),
                                            deadline(), send.data(), recv, count,
                                            DataType::kFloat32, ReduceOp::kSum);
                   }});
  // Sequence numbers differ (member 0 skipped a call number).
  cases.push_back({"sequence", [deadline](Member& m, int me, uint8_t* recv) {
                     if (me == 0) ++m.seq;
                     const size_t count = 64;
                     std::vector<float> send(count, 1.0f);
                     m.group->AllReduce(m.Tag(CollectiveKind::kAllReduce, DataType::kFloat32,
                                              ReduceOp::kSum, 0, count),
                                        deadline(), send.data(), recv, count, DataType::kFloat32,
                                        ReduceOp::kSum);
                   }});
  return cases;
}

TEST(ShmGroupMismatchTest, DifferentCallsRaiseMismatchEverywhereWithoutWritingRecv) {
  for (const MismatchCase& c : MismatchCases()) {
    SCOPED_TRACE(c.name);
    ExpectMismatch(c, 4096, 4096);
  }
}

TEST(ShmGroupMismatchTest, DifferentCallsRaiseMismatchOnTheLargeAllReducePath) {
  for (const MismatchCase& c : MismatchCases()) {
    SCOPED_TRACE(c.name);
    ExpectMismatch(c, 4096, 0);
  }
}

// ---- Abort, deadlines, a member that leaves. ----

// Members 0 and 1 wait in an all-reduce member 2 never joins; another thread aborts member 0's
// group: member 0 raises the abort's own error, member 1 the same code naming member 0's rank,
// and member 2's later call raises too.
TEST(ShmGroupFailureTest, AbortFromAnotherThreadRaisesOnEveryMember) {
  for (ErrorCode code : {ErrorCode::kAborted, ErrorCode::kInvalidUsage}) {
    const std::vector<int> ranks = {1, 4, 8};
    ShmGroupOptions options = Options("abort", 4096, 4096, 3);
    std::atomic<ShmGroup*> aborted_group{nullptr};
    std::atomic<bool> abort_done{false};
    std::thread aborter;
    RunMembers(ranks, options, [&](Member& m, int me) {
      if (me == 0) {
        aborted_group = m.group.get();
        aborter = std::thread([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          aborted_group.load()->Abort(Error(code, "stopped by the test"));
          abort_done = true;
        });
      }
      if (me == 2) {
        while (!abort_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      std::vector<float> data(5000, 1.0f);
      const auto start = Clock::now();
      try {
        m.SumInPlace(data, Clock::now() + std::chrono::seconds(20));
        ADD_FAILURE() << "member " << me << ": an aborted all-reduce succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), code) << "member " << me << ": " << e.what();
        EXPECT_NE(e.message().find("stopped by the test"), std::string::npos) << e.what();
        if (me == 0) {
          EXPECT_EQ(e.message(), "stopped by the test");
        } else {
          EXPECT_NE(e.message().find("rank 1 aborted"), std::string::npos) << e.what();
          EXPECT_NE(e.message().find("rank " + std::to_string(ranks[size_t(me)])),
                    std::string::npos)
              << e.what();
        }
      }
      if (me != 2) {  // far below the 20 s deadline
        EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::seconds(5)))
            << "member " << me;
      }
      for (float v : data) ASSERT_EQ(v, 1.0f) << "member " << me << ": data written";
    });
    aborter.join();
  }
}

// Member 2 never calls: the others raise kTimeout after the deadline (not much later), naming
// the rank they waited for.
TEST(ShmGroupFailureTest, MissingMemberRaisesTimeoutNamingIt) {
  const std::vector<int> ranks = {3, 5, 9};
  ShmGroupOptions options = Options("timeout", 4096, 4096, 3);
  std::atomic<int> finished{0};
  std::array<Clock::duration, 2> small_elapsed{};
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 2) {  // keeps its group (alive, attached) until the others gave up
      while (finished < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    for (size_t count : {size_t(10), size_t(5000)}) {  // the small path, then (broken) the large
      std::vector<float> data(count, 1.0f);
      const auto start = Clock::now();
      const auto timeout = std::chrono::milliseconds(400);
      try {
        m.SumInPlace(data, start + timeout);
        ADD_FAILURE() << "member " << me << ": an all-reduce without member 2 succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
        EXPECT_NE(e.message().find("from rank 9"), std::string::npos) << e.what();
      }
      const auto elapsed = Clock::now() - start;
      if (count == 10) small_elapsed[size_t(me)] = elapsed;
      EXPECT_LT(elapsed, timeout + test_time::Scaled(std::chrono::seconds(5))) << "member " << me;
    }
    ++finished;
  });
  // No one raises before the deadline: the member that broke the group waited its whole
  // timeout. (The other raises at once then, and may have started its clock later, when the
  // scheduler held it back, so only the longer wait is bound from below.)
  EXPECT_GE(std::max(small_elapsed[0], small_elapsed[1]), std::chrono::milliseconds(400));
}

// Member 2 (rank 9) runs its call outside the group (the flat ring of a two-level plan) and
// announces it. Member 0 raises kMismatch at once (well before its deadline) for an
// announcement of its own call's number with another call, naming both; an announcement of the
// same call, or of an earlier call, is no mismatch: member 0 waits until its deadline (kTimeout).
// Member 1 is in none of these calls (it only waits): the check covers every member.
TEST(ShmGroupFailureTest, ACallAnnouncedOutsideTheGroupIsChecked) {
  const std::vector<int> ranks = {3, 5, 9};
  const core::CallDescriptor barrier{core::CollectiveKind::kBarrier, DataType::kUInt8,
                                     ReduceOp::kSum, 0, 0};
  const core::CallDescriptor gather{core::CollectiveKind::kAllGather, DataType::kInt32,
                                    ReduceOp::kSum, 0, 7};
  struct Case {
    uint64_t seq;  // of member 2's announcement; member 0's barrier is #3
    core::CallDescriptor call;
    ErrorCode expected;
  };
  const std::vector<Case> cases = {{3, barrier, ErrorCode::kTimeout},
                                   {2, gather, ErrorCode::kTimeout},
                                   {3, gather, ErrorCode::kMismatch}};
  for (size_t c = 0; c < cases.size(); ++c) {
    ShmGroupOptions options = Options("outside" + std::to_string(c), 4096, 4096, 3);
    options.spin = std::chrono::microseconds(0);
    std::atomic<bool> announced{false};
    std::atomic<bool> finished{false};
    RunMembers(ranks, options, [&](Member& m, int me) {
      if (me == 2) {
        m.group->AnnounceOutside(core::CallTag{cases[c].seq, cases[c].call});
        announced = true;
      }
      if (me != 0) {  // keeps its group (alive, attached) until member 0 is done
        while (!finished) std::this_thread::sleep_for(std::chrono::milliseconds(2));
        return;
      }
      while (!announced) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const auto start = Clock::now();
      try {
        m.group->Barrier(core::CallTag{3, barrier}, start + std::chrono::milliseconds(300));
        ADD_FAILURE() << "case " << c << ": a barrier without members 1 and 2 succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), cases[c].expected) << "case " << c << ": " << e.what();
        if (cases[c].expected == ErrorCode::kMismatch) {
          EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::milliseconds(250)))
              << e.what();
          EXPECT_NE(e.message().find("rank 3: rank 9 runs another call outside shared memory: "
                                     "expected #3 barrier(), got #3 all_gather(i32, count=7)"),
                    std::string::npos)
              << e.what();
        }
      }
      finished = true;
    });
  }
}

// A broadcast whose root (rank 3) is there and whose member 2 (rank 9) never calls: member 1
// (rank 5), whose deadline comes first, waits for the root, which waits for member 2. Both raise
// kTimeout naming rank 9, the one missing, not the root.
TEST(ShmGroupFailureTest, ABroadcastTimeoutNamesTheMissingMemberNotTheRoot) {
  const std::vector<int> ranks = {3, 5, 9};
  ShmGroupOptions options = Options("broadcast_timeout", 4096, 4096, 3);
  std::atomic<int> finished{0};
  std::array<std::string, 2> errors;
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 2) {  // keeps its group (alive, attached) until the others gave up
      while (finished < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    std::vector<float> data(10, 1.0f);
    const auto timeout = me == 1 ? std::chrono::milliseconds(300) : std::chrono::seconds(20);
    try {
      m.group->Broadcast(
          m.Tag(core::CollectiveKind::kBroadcast, DataType::kFloat32, ReduceOp::kSum, 0, 10),
          Clock::now() + timeout, me == 0 ? data.data() : nullptr, data.data(), 10 * sizeof(float),
          0);
      ADD_FAILURE() << "member " << me << ": a broadcast without member 2 succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      errors[size_t(me)] = e.message();
    }
    ++finished;
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("from rank 9"), std::string::npos) << e;
    EXPECT_EQ(e.find("from rank 3"), std::string::npos) << e;
  }
}

// Member 1 (rank 9) leaves the group before member 0 calls; member 0, which does not spin,
// sleeps waiting for it with a deadline 90 ms away. Every slice of its sleep (20 ms, shm_group.h)
// checks that the member it waits for is there, so it raises kPeerLost naming rank 9 before the
// deadline, not kTimeout.
TEST(ShmGroupFailureTest, ASleepingWaiterChecksLivenessEverySlice) {
  const std::vector<int> ranks = {3, 9};
  ShmGroupOptions options = Options("liveness_slice", 4096, 4096, 2);
  options.spin = std::chrono::microseconds(0);
  std::atomic<bool> left{false};
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 1) {
      m.group.reset();
      left = true;
      return;
    }
    while (!left) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::vector<float> data(10, 1.0f);
    try {
      m.SumInPlace(data, Clock::now() + std::chrono::milliseconds(90));
      ADD_FAILURE() << "an all-reduce without member 1 succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
      EXPECT_NE(e.message().find("lost rank 9"), std::string::npos) << e.what();
    }
  });
}

// A spin budget longer than the call's timeout (1 s against 100 ms) ends at the deadline: the
// member raises kTimeout about 100 ms after it called, not after spinning the whole second.
TEST(ShmGroupFailureTest, ASpinLongerThanTheTimeoutEndsByTheDeadline) {
  const std::vector<int> ranks = {3, 9};
  ShmGroupOptions options = Options("spin_deadline", 4096, 4096, 2);
  options.spin = std::chrono::seconds(1);
  std::atomic<bool> finished{false};
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 1) {  // keeps its group (alive, attached) until member 0 gave up
      while (!finished) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    std::vector<float> data(10, 1.0f);
    const auto start = Clock::now();
    try {
      m.SumInPlace(data, start + std::chrono::milliseconds(100));
      ADD_FAILURE() << "an all-reduce without member 1 succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      EXPECT_NE(e.message().find("from rank 9"), std::string::npos) << e.what();
    }
    EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::milliseconds(600)));
    finished = true;
  });
}

// An all-reduce among members one of which is gone: raises kPeerLost with a message that holds
// `lost` (and `reason`, when not empty), and leaves the data untouched.
void ExpectAllReduceLosesPeer(Member& m, int me, const std::string& lost,
                              const std::string& reason) {
  std::vector<float> data(3000, 1.0f);
  try {
    m.SumInPlace(data, Clock::now() + std::chrono::seconds(20));
    ADD_FAILURE() << "member " << me << ": an all-reduce with a member gone succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
    EXPECT_NE(e.message().find(lost), std::string::npos) << e.what();
    if (!reason.empty()) {
      EXPECT_NE(e.message().find(reason), std::string::npos) << e.what();
    }
  }
  for (float v : data) ASSERT_EQ(v, 1.0f) << "member " << me << ": data written";
}

// Member 2's group is destroyed (its communicator went away) while the others wait for it: they
// raise kPeerLost within about a second, naming its rank.
TEST(ShmGroupFailureTest, DestroyedMemberRaisesPeerLostNamingIt) {
  const std::vector<int> ranks = {3, 5, 9};
  ShmGroupOptions options = Options("peer_lost", 4096, 4096, 3);
  std::atomic<bool> destroying{false};
  std::atomic<int64_t> destroying_at{0};
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      destroying_at = Clock::now().time_since_epoch().count();
      destroying = true;
      m.group.reset();
      return;
    }
    ExpectAllReduceLosesPeer(m, me, "lost rank 9", "");
    ASSERT_TRUE(destroying) << "member " << me << " raised before member 2 left";
    const auto since = Clock::now() - Clock::time_point(Clock::duration(destroying_at.load()));
    EXPECT_LT(since, test_time::Scaled(std::chrono::seconds(5)))
        << "member " << me;  // not the 20 s deadline
  });
}

// Member 2 is another process that attaches and then exits without leaving the group (its
// keeper thread dies with it, holding the liveness mutex): the others, waiting for it, raise
// kPeerLost naming it within about a second. The members rendezvous through a file store.
TEST(ShmGroupFailureTest, MemberProcessThatDiesRaisesPeerLost) {
  const std::string dir = NewStoreDir();
  ASSERT_FALSE(dir.empty());
  const std::vector<int> ranks = {0, 1, 2};
  ShmGroupOptions options = Options("process_died", 4096, 4096, 3);
  options.timeout = std::chrono::seconds(10);
  const pid_t child = ForkMember(dir, 2, ranks, options, [](Member&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  ASSERT_GE(child, 0);
  RunMembers(
      ranks, options,
      [&](Member& m, int me) {
        const auto start = Clock::now();
        ExpectAllReduceLosesPeer(m, me, "lost rank 2", "died");
        // The child exits about 300 ms after everyone attached.
        EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::seconds(5)))
            << "member " << me;
      },
      CreateFileStore(dir), /*here=*/2);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  std::filesystem::remove_all(dir);
}

// Member 2 is another process that runs large all-reduces (64 steps of a 64 KiB slot each)
// with the others until it is killed with SIGKILL, 0 to 40 ms into them: before it arrives at a
// step, while it copies in or out, after it reduced its slice. Every time, both other members
// raise kPeerLost naming rank 2 within a second of the kill (the liveness check runs every
// 20 ms slice), and their next call raises at once.
TEST(ShmGroupFailureTest, AMemberKilledAtAnyPointOfAnAllReduceIsLostOnEveryMember) {
  const std::vector<int> ranks = {0, 1, 2};
  constexpr size_t kCount = 1 << 20;  // 4 MiB of floats
  for (int delay_ms : {0, 1, 2, 5, 10, 20, 40}) {
    SCOPED_TRACE("killed " + std::to_string(delay_ms) + " ms into the all-reduces");
    const std::string dir = NewStoreDir();
    ASSERT_FALSE(dir.empty());
    ShmGroupOptions options = Options("killed", 64 * 1024, 4096, 3);
    options.timeout = std::chrono::seconds(10);
    const pid_t child = ForkMember(dir, 2, ranks, options, [](Member& m) {
      std::vector<float> data(kCount, 1.0f);
      for (;;) {
        m.SumInPlace(data, Clock::now() + std::chrono::seconds(20));
      }
    });
    ASSERT_GE(child, 0);
    auto store = CreateFileStore(dir);
    std::atomic<int> attached{0};
    std::atomic<int64_t> killed_at{0};
    std::vector<std::thread> threads;
    for (int me = 0; me < 2; ++me) {
      threads.emplace_back([&, me] {
        Member m;
        try {
          m.group = ShmGroup::Create(ranks[size_t(me)], ranks, *store, options);
        } catch (const std::exception& e) {
          ADD_FAILURE() << "member " << me << ": " << e.what();
          ++attached;
          return;
        }
        ++attached;
        std::vector<float> data(kCount, 1.0f);
        const auto call = [&] { m.SumInPlace(data, Clock::now() + std::chrono::seconds(20)); };
        try {
          for (;;) call();
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << "member " << me << ": " << e.what();
          EXPECT_NE(e.message().find("lost rank 2"), std::string::npos) << e.what();
          ASSERT_NE(killed_at.load(), 0) << "member " << me << " raised before the kill";
          const auto since = Clock::now() - Clock::time_point(Clock::duration(killed_at.load()));
          EXPECT_LT(since, test_time::Scaled(std::chrono::seconds(1))) << "member " << me;
        }
        const auto start = Clock::now();
        try {
          call();
          ADD_FAILURE() << "member " << me << ": a call after the loss succeeded";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
        }
        EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::milliseconds(500)))
            << "member " << me;
      });
    }
    while (attached < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    killed_at = Clock::now().time_since_epoch().count();
    kill(child, SIGKILL);
    for (std::thread& t : threads) t.join();
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child status " << status;
    std::filesystem::remove_all(dir);
  }
}

// A long random sequence of every kind of call (the same on every member: one seed), with
// counts on both sides of the small path and of the slot, so that steps of different shapes
// (broadcasts whose non-roots do not wait for the slots' release, barriers, one- and two-sync
// all-reduces) follow each other through the two buffers: every result exact.
TEST(ShmGroupTest, RandomSequenceOfMixedCallsIsExact) {
  for (int n : {2, 3, 5, 8}) {
    for (bool spin : {false, true}) {
      SCOPED_TRACE(std::to_string(n) + " members, spin " + (spin ? "on" : "off"));
      ShmGroupOptions options = Options("random", 4096, 2048, n);
      options.spin = std::chrono::microseconds(spin ? 50 : 0);
      std::vector<size_t> wrong(size_t(n), 0);
      std::vector<std::string> first(static_cast<size_t>(n));
      std::vector<std::vector<uint64_t>> hashes(static_cast<size_t>(n));
      RunMembers(Ranks(n), options, [&](Member& m, int me) {
        std::mt19937 random(777 + unsigned(n));  // the same sequence on every member
        const std::vector<std::string> kinds = {"all_reduce", "broadcast", "all_gather",
                                                "reduce_scatter", "barrier"};
        for (int call = 0; call < 300; ++call) {
          const std::string& c = kinds[random() % kinds.size()];
          const DataType d = DataType(random() % kNumDataTypes);
          const ReduceOp o = c == "all_reduce" || c == "reduce_scatter"
                                 ? ReduceOp(random() % kNumReduceOps)
                                 : ReduceOp::kSum;
          const size_t count = random() % 4 == 0 ? random() % 3000 : random() % 300;
          const bool in_place = random() % 2 == 0;
          const int root = int(random() % unsigned(n));
          Outcome out = RunAndCheck(m, me, n, c, d, o, count, in_place, root);
          wrong[size_t(me)] += out.wrong;
          if (out.wrong > 0 && first[size_t(me)].empty()) first[size_t(me)] = out.first;
          hashes[size_t(me)].push_back(out.hash);
        }
      });
      for (int i = 0; i < n; ++i) EXPECT_EQ(wrong[size_t(i)], 0u) << first[size_t(i)];
      for (int i = 1; i < n; ++i) EXPECT_EQ(hashes[size_t(i)], hashes[0]) << "member " << i;
    }
  }
}

// ---- The segment: its name, its mode, set-up that fails. ----

// Once Create returned everywhere, the name in the store is gone from /dev/shm; the group
// still works through the mappings.
TEST(ShmGroupSegmentTest, NameIsUnlinkedOnceEveryMemberAttached) {
  for (int n : {1, 2, 4}) {
    const std::vector<int> ranks = Ranks(n, 7, 3);
    ShmGroupOptions options = Options("unlinked", 4096, 4096, n);
    auto store = CreateMemoryStore();
    std::atomic<int> created{0};
    RunMembers(
        ranks, options,
        [&](Member& m, int me) {
          ++created;
          // Past a barrier every member has returned from Create, the last to attach included.
          m.group->Barrier(
              m.Tag(core::CollectiveKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0),
              Clock::now() + std::chrono::seconds(10));
          if (me == 0) {
            const std::string name = store->Get(
                options.key_prefix + "/shm/" + std::to_string(ranks[0]), std::chrono::seconds(1));
            EXPECT_EQ(name.rfind("/collectives-", 0), 0u) << name;
            EXPECT_FALSE(ShmNameExists(name)) << DevShmPath(name) << " is still there";
          }
          Outcome o =
              RunAndCheck(m, me, n, "all_reduce", DataType::kInt32, ReduceOp::kSum, 3001, false);
          EXPECT_EQ(o.wrong, 0u) << o.first;
        },
        store);
    EXPECT_EQ(created, n);
  }
}

// A segment another user could read, published under the group's key, is refused by a member
// that attaches (kUnauthenticated), even when it is otherwise a faithful copy of the group's
// real segment (so the mode is the only fault); so are a copy without the group's layout and
// one of the wrong size. The same copy with mode 0600 is accepted: the control.
TEST(ShmGroupSegmentTest, ForeignSegmentOpenToOthersOrNotOursIsRefused) {
  ShmGroupOptions options = Options("foreign", 4096, 4096, 2);
  options.timeout = std::chrono::seconds(10);
  auto store = CreateMemoryStore();
  // Member 0 creates the real segment and waits for member 1, which attaches at the end.
  std::unique_ptr<ShmGroup> first;
  std::thread creator([&] {
    try {
      first = ShmGroup::Create(0, {0, 1}, *store, options);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "member 0: " << e.what();
    }
  });
  const std::string real = store->Get(options.key_prefix + "/shm/0", std::chrono::seconds(5));
  std::vector<uint8_t> image;
  {
    const int fd = shm_open(real.c_str(), O_RDONLY, 0);
    ASSERT_GE(fd, 0) << "shm_open " << real << ": " << std::strerror(errno);
    struct stat st {};
    ASSERT_EQ(fstat(fd, &st), 0);
    image.resize(size_t(st.st_size));
    void* map = mmap(nullptr, image.size(), PROT_READ, MAP_SHARED, fd, 0);
    ASSERT_NE(map, MAP_FAILED);
    // Member 0 publishes the name before it counts itself attached: wait for its count (the
    // header's `attached`, after magic, version, members and slot_bytes) so that the copy holds
    // it and a member attaching to the copy completes the pair.
    const auto* attached =
        reinterpret_cast<const std::atomic<uint32_t>*>(static_cast<const uint8_t*>(map) + 24);
    for (int i = 0; i < 5000 && attached->load() != 1; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_EQ(attached->load(), 1u) << "the header layout changed: update this test";
    std::memcpy(image.data(), map, image.size());
    munmap(map, image.size());
    close(fd);
  }

  struct Case {
    const char* what;
    mode_t mode;
    bool accepted;
    bool scramble_header;
    size_t bytes;  // 0: the real size
  };
  const Case cases[] = {
      {"mode 0644", 0644, false, false, 0},
      {"mode 0604", 0604, false, false, 0},
      {"mode 0640", 0640, false, false, 0},
      {"another layout", 0600, false, true, 0},
      {"the wrong size", 0600, false, false, image.size() + 4096},
      {"a faithful copy, mode 0600", 0600, true, false, 0},
  };
  int k = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ShmGroupOptions fake_options = options;
    fake_options.key_prefix += "/fake" + std::to_string(k);
    const std::string name =
        "/collectives-test-foreign-" + std::to_string(getpid()) + "-" + std::to_string(k++);
    shm_unlink(name.c_str());
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, c.mode);
    ASSERT_GE(fd, 0) << "shm_open " << name << ": " << std::strerror(errno);
    ASSERT_EQ(fchmod(fd, c.mode), 0);  // whatever the umask
    std::vector<uint8_t> bytes = image;
    if (c.scramble_header) bytes[0] ^= 0xFF;  // the magic number
    bytes.resize(c.bytes != 0 ? c.bytes : image.size(), 0);
    ASSERT_EQ(write(fd, bytes.data(), bytes.size()), ssize_t(bytes.size()));
    close(fd);
    store->Set(fake_options.key_prefix + "/shm/0", name);
    try {
      auto group = ShmGroup::Create(1, {0, 1}, *store, fake_options);
      EXPECT_TRUE(c.accepted) << "a segment with " << c.what << " was accepted";
      EXPECT_FALSE(ShmNameExists(name)) << "the last member to attach unlinks the name";
    } catch (const Error& e) {
      EXPECT_FALSE(c.accepted) << e.what();
      EXPECT_EQ(e.code(), ErrorCode::kUnauthenticated) << e.what();
      EXPECT_NE(e.message().find(name), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("rank 1"), std::string::npos) << e.what();
      EXPECT_EQ(shm_unlink(name.c_str()), 0) << name;
    }
  }
  // The real member 1 completes the real group.
  auto second = ShmGroup::Create(1, {0, 1}, *store, options);
  creator.join();
  EXPECT_TRUE(first && second);
  EXPECT_FALSE(ShmNameExists(real));
}

// The first member creates its segment with mode 0600 whatever the umask; checked on a group
// whose second member has not attached yet (the name still exists then).
TEST(ShmGroupSegmentTest, SegmentIsCreatedWithMode0600) {
  const mode_t old_umask = umask(0);  // the most permissive umask: the library must not rely on it
  ShmGroupOptions options = Options("mode", 4096, 4096, 2);
  auto store = CreateMemoryStore();
  std::unique_ptr<ShmGroup> first;
  std::thread creator([&] { first = ShmGroup::Create(0, {0, 1}, *store, options); });
  const std::string name = store->Get(options.key_prefix + "/shm/0", std::chrono::seconds(5));
  struct stat st {};
  ASSERT_EQ(::stat(DevShmPath(name).c_str(), &st), 0) << DevShmPath(name);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << std::oct << (st.st_mode & 0777);
  EXPECT_EQ(st.st_uid, geteuid());
  umask(old_umask);
  auto second = ShmGroup::Create(1, {0, 1}, *store, options);
  creator.join();
  ASSERT_TRUE(first && second);
  EXPECT_FALSE(ShmNameExists(name));
}

// Members {0, 1}, only member 0 calls Create: kTimeout naming member 1 after the set-up timeout,
// and the segment's name is removed.
TEST(ShmGroupSegmentTest, SetUpTimeoutRemovesTheSegment) {
  ShmGroupOptions options = Options("setup_timeout", 4096, 4096, 2);
  options.timeout = std::chrono::milliseconds(300);
  auto store = CreateMemoryStore();
  const auto start = Clock::now();
  try {
    auto group = ShmGroup::Create(0, {0, 1}, *store, options);
    ADD_FAILURE() << "a group of two was built by one member";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("ranks 1 did not attach"), std::string::npos) << e.what();
  }
  const auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, options.timeout);
  EXPECT_LT(elapsed, options.timeout + test_time::Scaled(std::chrono::seconds(5)));
  const std::string name = store->Get(options.key_prefix + "/shm/0", std::chrono::seconds(1));
  EXPECT_FALSE(ShmNameExists(name)) << DevShmPath(name) << " was left behind";
}

// The set-up's timeout bounds all of it: a member that learns the segment's name late (the
// creator came 2.7 s into its 3 s) waits for the member that never comes only for what is left,
// not for another 3 s.
TEST(ShmGroupSegmentTest, TheTimeoutBoundsTheNameLookupAndTheAttachTogether) {
  ShmGroupOptions options = Options("one_deadline", 4096, 4096, 3);
  options.timeout = std::chrono::milliseconds(3000);
  const auto late = std::chrono::milliseconds(2700);
  auto store = CreateMemoryStore();
  std::thread creator([&] {
    std::this_thread::sleep_for(late);
    ShmGroupOptions own = options;
    own.timeout = std::chrono::milliseconds(500);
    try {
      auto group = ShmGroup::Create(0, {0, 1, 2}, *store, own);
      ADD_FAILURE() << "a group of three was built by two members";
    } catch (const Error&) {
      // Rank 2 never comes: the creator times out too.
    }
  });
  const auto start = Clock::now();
  try {
    auto group = ShmGroup::Create(1, {0, 1, 2}, *store, options);
    ADD_FAILURE() << "a group of three was built by two members";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("ranks 2 did not attach"), std::string::npos) << e.what();
  }
  // With the attach given a timeout of its own: 2.7 s + 3 s.
  EXPECT_LT(Clock::now() - start,
            options.timeout + test_time::Scaled(std::chrono::milliseconds(2000)));
  creator.join();
}

// The creator cannot publish the name (the store is gone): its error, and the segment it
// created is removed, since no other member can ever learn the name to remove it.
TEST(ShmGroupSegmentTest, ACreatorThatCannotPublishTheNameRemovesTheSegment) {
  class LostStore : public Store {
   public:
    void Set(const std::string& key, const std::string& value) override {
      (void)key;
      published = value;
      throw Error(ErrorCode::kPeerLost, "test store: the store's host is gone");
    }
    std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
      (void)timeout;
      throw Error(ErrorCode::kPeerLost, "test store: no " + key);
    }
    int64_t Add(const std::string& key, int64_t delta) override {
      (void)key;
      return delta;
    }
    std::string published;
  } store;
  ShmGroupOptions options = Options("lost_store", 4096, 4096, 2);
  try {
    auto group = ShmGroup::Create(0, {0, 1}, store, options);
    ADD_FAILURE() << "a group was built without its store";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
    EXPECT_EQ(e.message(), "test store: the store's host is gone");
  }
  ASSERT_FALSE(store.published.empty());
  EXPECT_FALSE(ShmNameExists(store.published)) << DevShmPath(store.published) << " was left";
}

// Members {0, 1}, only member 1 calls Create: the name never appears in the store; kTimeout
// naming rank 0, the member that did not come (it creates the segment).
TEST(ShmGroupSegmentTest, SetUpTimeoutOfAnAttachingMember) {
  ShmGroupOptions options = Options("attach_timeout", 4096, 4096, 2);
  options.timeout = std::chrono::milliseconds(300);
  auto store = CreateMemoryStore();
  const auto start = Clock::now();
  try {
    auto group = ShmGroup::Create(1, {0, 1}, *store, options);
    ADD_FAILURE() << "a group of two was built by one member";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_EQ(e.message().rfind("rank 1: shared memory: rank 0, which creates this host's "
                                "segment, did not publish its name within 300 ms",
                                0),
              0u)
        << e.what();
  }
  EXPECT_LT(Clock::now() - start, options.timeout + test_time::Scaled(std::chrono::seconds(5)));
}

// A slot above kMaxSlotBytes is refused before anything is made (the segment's size, two slots
// per member, could wrap past 2^64 to a few KiB that every check would agree with).
TEST(ShmGroupSegmentTest, ASlotAboveTheLimitIsRefused) {
  ShmGroupOptions options = Options("huge_slot", size_t{1} << 62, 4096, 1);
  auto store = CreateMemoryStore();
  try {
    ShmGroup::Create(0, {0, 1}, *store, options);
    ADD_FAILURE() << "a slot of 2^62 bytes was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("a shared-memory slot of 4611686018427387904 bytes is "
                                         "more than the 1073741824 a slot may have"),
              std::string::npos)
        << e.what();
  }
}

// A member whose segment has another size (its COLLECTIVES_SHM_SLOT_BYTES differs) cannot attach,
// says why, and the others raise its error at once rather than wait for it until their timeout.
TEST(ShmGroupSegmentTest, AMemberThatCannotAttachStopsTheOthersAtOnce) {
  ShmGroupOptions options = Options("cannot_attach", 4096, 4096, 3);
  options.timeout = std::chrono::seconds(20);
  ShmGroupOptions other_slot = options;
  other_slot.slot_bytes = 8192;
  auto store = CreateMemoryStore();
  const auto start = Clock::now();
  const auto [codes, errors] = CreateAtOnce({options, options, other_slot}, *store);
  EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::seconds(5)));
  EXPECT_EQ(codes[2], ErrorCode::kUnauthenticated) << errors[2];
  EXPECT_NE(errors[2].find("where this rank expects"), std::string::npos) << errors[2];
  EXPECT_NE(errors[2].find("COLLECTIVES_SHM_SLOT_BYTES"), std::string::npos) << errors[2];
  for (int me = 0; me < 2; ++me) {
    EXPECT_EQ(codes[size_t(me)], ErrorCode::kUnauthenticated) << errors[size_t(me)];
    EXPECT_NE(errors[size_t(me)].find("rank " + std::to_string(me) +
                                      ": shared memory: a member of this host's group failed "
                                      "to set up: rank 2: shared memory: segment"),
              std::string::npos)
        << errors[size_t(me)];
  }
  const std::string name = store->Get(options.key_prefix + "/shm/0", std::chrono::seconds(1));
  EXPECT_FALSE(ShmNameExists(name)) << DevShmPath(name) << " was left behind";
}

// Two containers that share a machine's network (its host name and boot id) but not its /dev/shm
// cannot share a segment: their host identities differ, so AUTO does not put them in one group.
// The second "container" is a child process with a /dev/shm of its own (skipped as below).
TEST(ShmGroupSegmentTest, AnotherDevShmIsAnotherHost) {
  ScopedEnv host("COLLECTIVES_HOST_ID", nullptr);
  const std::string here = HostIdentity();
  EXPECT_EQ(here.rfind(MachineIdentity() + "/shm:", 0), 0u) << here;
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pipe_fds[0]);
    if (!testing::EnterAPrivateMountNamespace() ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=256k") != 0) {
      _exit(77);
    }
    const std::string there = HostIdentity();
    _exit(write(pipe_fds[1], there.data(), there.size()) == ssize_t(there.size()) ? 0 : 1);
  }
  close(pipe_fds[1]);
  const std::string there = testing::ReadToEndAndClose(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "cannot mount a /dev/shm in a mount namespace of its own (needs root)";
  }
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(there.rfind(MachineIdentity() + "/shm:", 0), 0u) << there;
  EXPECT_NE(there, here);
}

// A /dev/shm too small for the segment (a container's default is 64 MiB) is an error that names
// it and the way out, on every member, instead of a SIGBUS when the slots are first touched.
// Run in a child process with a mount namespace of its own and a 256 KiB /dev/shm there; skipped
// where mount namespaces cannot be made (not root, or no CAP_SYS_ADMIN).
TEST(ShmGroupSegmentTest, ASmallDevShmIsAnErrorOnEveryMemberNotABusError) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (!testing::EnterAPrivateMountNamespace() ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=256k") != 0) {
      _exit(77);
    }
    ShmGroupOptions options = Options("small_dev_shm", size_t{1} << 20, 4096, 2);
    options.timeout = std::chrono::seconds(20);
    auto store = CreateMemoryStore();
    const auto start = Clock::now();
    const auto [codes, errors] = CreateAtOnce({options, options}, *store);
    std::string wrong;
    if (Clock::now() - start > std::chrono::seconds(5)) wrong += "took longer than 5 s; ";
    for (int me = 0; me < 2; ++me) {
      const std::string& e = errors[size_t(me)];
      if (codes[size_t(me)] != ErrorCode::kSystem ||
          e.find("/dev/shm is too small") == std::string::npos ||
          e.find("COLLECTIVES_SHM=0") == std::string::npos ||
          (me == 1 &&
           e.find("rank 0, which creates this host's segment, failed") == std::string::npos)) {
        wrong += "member " + std::to_string(me) + ": " + e + "; ";
      }
    }
    if (!wrong.empty()) {
      std::fprintf(stderr, "%s\n", wrong.c_str());
      _exit(1);
    }
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "cannot mount a small /dev/shm in a mount namespace of its own (needs root)";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << (WIFSIGNALED(status) ? "killed by signal " + std::to_string(WTERMSIG(status))
                              : "exit status " + std::to_string(WEXITSTATUS(status)) +
                                    " (its stderr says what was wrong)");
}

// Members must be ascending and include the caller.
// A creator killed after creating the segment but before every member attached leaves its
// name in /dev/shm (nothing of a killed process runs); the next creator on the host removes it.
// Names of a live creator, of another pid namespace, or without a creator's mark stay.
TEST(ShmGroupSegmentTest, ANameLeftByAKilledCreatorIsRemovedByTheNextCreator) {
  const std::string dir = NewStoreDir();
  ASSERT_FALSE(dir.empty());
  ShmGroupOptions options = Options("killed_creator", 4096, 4096, 2);
  options.timeout = std::chrono::seconds(60);
  // Its Create waits for member 1, which never comes.
  const pid_t child = ForkMember(dir, 0, {0, 1}, options, [](Member&) {});
  ASSERT_GE(child, 0);
  auto store = CreateFileStore(dir);
  // The creator publishes the name once the segment exists.
  const std::string left = store->Get(options.key_prefix + "/shm/0", std::chrono::seconds(30));
  EXPECT_TRUE(ShmNameExists(left)) << left;
  kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "child status " << status;
  ASSERT_TRUE(ShmNameExists(left)) << "the killed creator's name should still be there";

  struct stat ns {};
  ASSERT_EQ(::stat("/proc/self/ns/pid", &ns), 0);
  const std::string mark = "-c" + std::to_string(ns.st_ino) + ".";
  const std::string other_mark = "-c" + std::to_string(ns.st_ino + 1) + ".";
  const std::string tail = "-" + std::to_string(getpid());
  const std::vector<std::string> kept = {
      "/collectives-test-live" + mark + std::to_string(getppid()) + tail,
      "/collectives-test-other-namespace" + other_mark + std::to_string(child) + tail,
      "/collectives-test-unmarked-" + std::to_string(child) + tail,
  };
  for (const std::string& name : kept) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0) << "shm_open " << name << ": " << std::strerror(errno);
    close(fd);
  }
  ShmGroupOptions next = Options("after_killed_creator", 4096, 4096, 2);
  auto memory = CreateMemoryStore();
  const auto [codes, errors] = CreateAtOnce({next, next}, *memory);
  EXPECT_EQ(errors, (std::vector<std::string>{"attached", "attached"}));
  EXPECT_FALSE(ShmNameExists(left)) << DevShmPath(left) << " was left behind";
  for (const std::string& name : kept) {
    EXPECT_TRUE(ShmNameExists(name)) << DevShmPath(name) << " was removed";
    shm_unlink(name.c_str());
  }
  shm_unlink(left.c_str());
  std::filesystem::remove_all(dir);
}

// A member that cannot start its keeper thread (a container's pids limit, no room for the
// thread's stack) raises Error(kSystem) naming shared memory, as every other failure of the
// set-up does (the planner publishes those to the other ranks), and removes the segment it
// created. Run in a child process whose address space is capped a few MiB above what it uses,
// with a default thread stack larger than that; skipped under sanitizers, whose shadow memory
// the cap forbids.
TEST(ShmGroupSegmentTest, AKeeperThreadThatCannotStartIsAnError) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "an address-space cap breaks the sanitizers' shadow memory";
#endif
  ShmGroupOptions options = Options("no_keeper", 4096, 4096, 1);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  // Forked before this test starts any thread.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pipe_fds[0]);
    std::string outcome;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, size_t{256} << 20);
    pthread_setattr_default_np(&attr);
    auto store = CreateMemoryStore();
    long pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    const rlim_t cap = rlim_t(pages) * rlim_t(sysconf(_SC_PAGESIZE)) + (rlim_t{16} << 20);
    const rlimit limit{cap, cap};
    if (pages <= 0 || setrlimit(RLIMIT_AS, &limit) != 0) _exit(77);
    try {
      auto group = ShmGroup::Create(4, {4}, *store, options);
      outcome = "attached";
    } catch (const Error& e) {
      outcome = std::to_string(int(e.code())) + " " + e.message();
    } catch (const std::exception& e) {
      outcome = std::string("not a collectives::Error: ") + e.what();
    }
    const std::string name = store->Get(options.key_prefix + "/shm/4", std::chrono::seconds(1));
    if (ShmNameExists(name)) outcome += "; " + name + " was left behind";
    _exit(write(pipe_fds[1], outcome.data(), outcome.size()) == ssize_t(outcome.size()) ? 0 : 1);
  }
  close(pipe_fds[1]);
  const std::string outcome = testing::ReadToEndAndClose(pipe_fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "cannot cap the address space";
  }
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << ": " << outcome;
  EXPECT_EQ(outcome.rfind(std::to_string(int(ErrorCode::kSystem)) +
                              " rank 4: shared memory: cannot start the thread that holds "
                              "this member's liveness mutex: ",
                          0),
            0u)
      << outcome;
}

TEST(ShmGroupSegmentTest, BadMemberListsAreRefused) {
  ShmGroupOptions options = Options("bad_members", 4096, 4096, 2);
  auto store = CreateMemoryStore();
  for (const auto& [rank, members] :
       std::vector<std::pair<int, std::vector<int>>>{{2, {0, 1}}, {1, {1, 0}}}) {
    try {
      auto group = ShmGroup::Create(rank, members, *store, options);
      ADD_FAILURE() << "rank " << rank << " built a group it is not properly part of";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInternal) << e.what();
    }
  }
}

// Member 2, another process, begins to break the group and exits before writing why
// (BreakHalfwayForTesting and _exit stand in for a kill in the middle of Abort). Every other
// member's next call, and its Abort, raise kPeerLost saying so and naming member 2 once its
// liveness mutex says it is gone, long before their 60 s deadline, and write nothing.
TEST(ShmGroupFailureTest, AMemberKilledWhileBreakingTheGroupDoesNotHangTheOthers) {
  const std::string dir = NewStoreDir();
  ASSERT_FALSE(dir.empty());
  const std::vector<int> ranks = {0, 1, 2};
  ShmGroupOptions options = Options("half_broken", 4096, 4096, 3);
  options.timeout = std::chrono::seconds(10);
  const pid_t child = ForkMember(dir, 2, ranks, options, [](Member& m) {
    m.group->BreakHalfwayForTesting();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  });
  ASSERT_GE(child, 0);
  RunMembers(
      ranks, options,
      [&](Member& m, int me) {
        std::vector<float> data(100, 1.0f);
        const auto start = Clock::now();
        try {
          m.SumInPlace(data, Clock::now() + std::chrono::seconds(60));
          ADD_FAILURE() << "member " << me << ": an all-reduce of a broken group succeeded";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
          EXPECT_NE(e.message().find("stopped before writing why"), std::string::npos) << e.what();
          EXPECT_NE(e.message().find("rank 2 broke"), std::string::npos) << e.what();
          EXPECT_NE(e.message().find("died"), std::string::npos) << e.what();
        }
        m.group->Abort(Error(ErrorCode::kAborted, "stopped by the test"));
        EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::seconds(1)))
            << "member " << me;
        for (float v : data) ASSERT_EQ(v, 1.0f) << "member " << me << ": data written";
      },
      CreateFileStore(dir), /*here=*/2);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  std::filesystem::remove_all(dir);
}

// The write end of the pipe through which StopWhileAttaching says where it stopped.
int attaching_pipe = -1;

// ShmGroup's attaching hook in a member process: says so through `attaching_pipe`, then waits
// to be killed.
void StopWhileAttaching() {
  const char byte = 1;
  if (write(attaching_pipe, &byte, 1) != 1) _exit(4);
  for (;;) pause();
}

// Member 1 is another process, killed (SIGKILL) while it attaches: after it took its liveness
// mutex and touched its first 64 MiB slot, before it counts itself attached (the attaching hook
// stops it there and says so through a pipe). The creator, waiting for it, raises kPeerLost
// naming rank 1 within a second of the kill, not a kTimeout at the set-up's end naming no one.
TEST(ShmGroupSegmentTest, AMemberKilledWhileAttachingIsNamedAtOnce) {
  const std::string dir = NewStoreDir();
  ASSERT_FALSE(dir.empty());
  const std::vector<int> ranks = {0, 1};
  ShmGroupOptions options = Options("killed_attaching", size_t(64) << 20, 4096, 2);
  options.timeout = std::chrono::seconds(10);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(pipe_fds[0]);
    attaching_pipe = pipe_fds[1];
    ShmGroup::SetAttachingHookForTesting(StopWhileAttaching);
    try {
      auto store = CreateFileStore(dir);
      ShmGroup::Create(1, ranks, *store, options);
    } catch (...) {
    }
    _exit(3);
  }
  close(pipe_fds[1]);
  ASSERT_GE(child, 0);
  auto store = CreateFileStore(dir);
  std::optional<Error> error;
  std::thread creator([&] {
    try {
      auto group = ShmGroup::Create(0, ranks, *store, options);
    } catch (const Error& e) {
      error = e;
    }
  });
  // The member's byte, or the end of the pipe if it exited first (it failed to attach); 30 s
  // at most, should it hang before.
  char byte = 0;
  pollfd ready{pipe_fds[0], POLLIN, 0};
  const ssize_t got = poll(&ready, 1, 30'000) == 1 ? read(pipe_fds[0], &byte, 1) : -1;
  close(pipe_fds[0]);
  const auto killed_at = Clock::now();
  kill(child, SIGKILL);
  creator.join();
  const auto since = Clock::now() - killed_at;
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  std::filesystem::remove_all(dir);
  ASSERT_EQ(got, 1) << "the member exited before it attached (status " << status << ")";
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  ASSERT_TRUE(error.has_value()) << "the creator attached without member 1";
  EXPECT_EQ(error->code(), ErrorCode::kPeerLost) << error->what();
  EXPECT_NE(error->message().find("rank 1 died while attaching"), std::string::npos)
      << error->what();
  EXPECT_LT(since, test_time::Scaled(std::chrono::seconds(1))) << error->what();
}

// An all-reduce of 100 floats on `m` that must fail: the error it raised.
Error FailingAllReduce(Member& m, int me, Clock::duration timeout) {
  std::vector<float> data(100, 1.0f);
  try {
    m.SumInPlace(data, Clock::now() + timeout);
    ADD_FAILURE() << "member " << me << ": an all-reduce of a broken group succeeded";
  } catch (const Error& e) {
    for (float v : data) EXPECT_EQ(v, 1.0f) << "member " << me << ": data written";
    return e;
  }
  return Error(ErrorCode::kInternal, "no error");
}

// Once a member gave up waiting for why the group broke (its breaker, alive, did not write it
// by the call's 300 ms deadline), its later calls and its Abort raise the same error at once:
// they do not wait again for an error that may not come.
TEST(ShmGroupFailureTest, AHalfBrokenGroupFailsLaterCallsAtOnceWithTheSameError) {
  const std::vector<int> ranks = {0, 1};
  ShmGroupOptions options = Options("half_broken_later", 4096, 4096, 2);
  std::atomic<bool> broken{false};
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 0) {
      m.group->BreakHalfwayForTesting();
      broken = true;
    }
    while (!broken) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const Error first = FailingAllReduce(m, me, std::chrono::milliseconds(300));
    EXPECT_EQ(first.code(), ErrorCode::kPeerLost) << first.what();
    EXPECT_NE(first.message().find("rank 0 broke"), std::string::npos) << first.what();
    const auto start = Clock::now();
    const Error later = FailingAllReduce(m, me, std::chrono::seconds(60));
    EXPECT_EQ(later.code(), ErrorCode::kPeerLost);
    EXPECT_EQ(later.message(), first.message());
    m.group->Abort(Error(ErrorCode::kAborted, "stopped by the test"));
    EXPECT_LT(Clock::now() - start, test_time::Scaled(std::chrono::seconds(1))) << "member " << me;
  });
}

// Member 0 begins to break the group and never writes why (stalled: stopped, in a debugger).
// Member 1's call would wait for why until its deadline, 20 s away; its own Abort, from another
// thread, ends that wait at once with the Abort's error.
TEST(ShmGroupFailureTest, AnAbortEndsTheWaitForAStalledBreaker) {
  const std::vector<int> ranks = {0, 1};
  ShmGroupOptions options = Options("stalled_breaker", 4096, 4096, 2);
  std::atomic<bool> broken{false};
  std::atomic<bool> done{false};
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 0) {
      m.group->BreakHalfwayForTesting();
      broken = true;
      while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // alive
      return;
    }
    while (!broken) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      m.group->Abort(Error(ErrorCode::kAborted, "rank 1: aborted by the test"));
    });
    const auto start = Clock::now();
    const Error e = FailingAllReduce(m, me, std::chrono::seconds(20));
    const auto took = Clock::now() - start;
    aborter.join();
    done = true;
    EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    EXPECT_NE(e.message().find("aborted by the test"), std::string::npos) << e.what();
    EXPECT_LT(took, test_time::Scaled(std::chrono::seconds(2))) << e.what();
  });
}

// Member 0 begins to break the group and writes why only 2.2 s later (a breaker descheduled or
// stopped in between). The others, whose deadline is 20 s away, raise its error (kAborted, its
// message), not a guess such as kPeerLost "stopped before writing why".
TEST(ShmGroupFailureTest, ABreakerThatWritesWhyLateIsHeardWithinTheDeadline) {
  const std::vector<int> ranks = {0, 1, 2};
  ShmGroupOptions options = Options("slow_breaker", 4096, 4096, 3);
  std::atomic<bool> broken{false};
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 0) {
      m.group->BreakHalfwayForTesting();
      broken = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2200));
      m.group->FinishBreakingForTesting(Error(ErrorCode::kAborted, "rank 0: the breaker's reason"));
      return;
    }
    while (!broken) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const Error e = FailingAllReduce(m, me, std::chrono::seconds(20));
    EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    EXPECT_NE(e.message().find("the breaker's reason"), std::string::npos) << e.what();
    EXPECT_NE(e.message().find("rank " + std::to_string(me)), std::string::npos) << e.what();
  });
}

// A member that gave up waiting for why the group broke (300 ms deadline) raises the breaker's
// error in its later calls once it is written, not kPeerLost "stopped before writing why" for
// good.
TEST(ShmGroupFailureTest, TheBreakersErrorReplacesTheGuessOnceWritten) {
  const std::vector<int> ranks = {0, 1};
  ShmGroupOptions options = Options("late_reason", 4096, 4096, 2);
  std::atomic<int> stage{0};
  RunMembers(ranks, options, [&](Member& m, int me) {
    if (me == 0) {
      m.group->BreakHalfwayForTesting();
      stage = 1;
      while (stage != 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      m.group->FinishBreakingForTesting(Error(ErrorCode::kAborted, "rank 0: the breaker's reason"));
      stage = 3;
      return;
    }
    while (stage != 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const Error guess = FailingAllReduce(m, me, std::chrono::milliseconds(300));
    EXPECT_EQ(guess.code(), ErrorCode::kPeerLost) << guess.what();
    EXPECT_NE(guess.message().find("rank 0 broke this host's group and stopped before writing why"),
              std::string::npos)
        << guess.what();
    stage = 2;
    while (stage != 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const Error e = FailingAllReduce(m, me, std::chrono::seconds(20));
    EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    EXPECT_NE(e.message().find("the breaker's reason"), std::string::npos) << e.what();
  });
}

}  // namespace
}  // namespace collectives
