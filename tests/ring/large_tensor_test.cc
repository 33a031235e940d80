// Tensors past 2 GiB and past INT_MAX elements, where a byte count or an element count kept in
// an int (or an int32 on the wire) would wrap: an all-reduce of 2^31 + 5 int8 elements, an
// all-gather whose result is 2^31 + 6 bytes, and a broadcast of 2^31 + 5 bytes, between two
// ranks as threads, over TCP (RING) and through shared memory (AUTO), checked element by element
// on both ranks. About 4-6 GiB of memory at a time and a few seconds per collective; skipped
// under the sanitizers (their shadow memory and speed) and where the memory is not there.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <new>
#include <string>

#include "collectives/communication.h"
#include "tests/ring/run_ranks.h"

namespace collectives {
namespace {

using testing::RunRanks;
using testing::Transport;

constexpr size_t kTwoGiB = size_t{1} << 31;

// The number in a one-line file such as /sys/fs/cgroup/memory.max; SIZE_MAX for "max" or a file
// that cannot be read.
size_t ReadLimit(const std::string& path) {
  std::ifstream file(path);
  size_t value = 0;
  return file >> value ? value : SIZE_MAX;
}

// What this process may still take, in bytes: MemAvailable from /proc/meminfo, or less where
// the cgroup (v2) it runs in has a lower limit left (0 when neither can be read).
size_t AvailableMemory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string name;
  size_t kib = 0;
  std::string unit;
  size_t available = 0;
  while (meminfo >> name >> kib >> unit) {
    if (name == "MemAvailable:") available = kib * 1024;
  }
  const size_t limit = ReadLimit("/sys/fs/cgroup/memory.max");
  const size_t used = ReadLimit("/sys/fs/cgroup/memory.current");
  if (limit != SIZE_MAX && used != SIZE_MAX)
    available = std::min(available, limit - std::min(limit, used));
  return available;
}

// Rank r's element i: six bits of a hash of i (no period a misplaced chunk could hide in), so
// that two ranks' sum stays an int8; i and i + 2^31 hash apart too (a wrapped offset).
int8_t Value(int rank, size_t i) {
  const uint32_t h = (uint32_t(i) ^ uint32_t(i >> 31) * 5u) * 0x9E3779B1u;  // 32 bits: vectorizes
  return static_cast<int8_t>(((h >> 26) + uint32_t(rank) * 3) & 63);
}

// Anonymous memory in huge pages where the kernel has them: a 2 GiB std::vector faults in and
// zeroes half a million 4 KiB pages first, which would take most of the test's time.
class Buffer {
 public:
  explicit Buffer(size_t count) : count_(count) {
    void* p = ::mmap(nullptr, count, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    ::madvise(p, count, MADV_HUGEPAGE);  // a hint: without huge pages, slower, still right
    data_ = static_cast<int8_t*>(p);
  }
  ~Buffer() { ::munmap(data_, count_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  int8_t* data() { return data_; }
  size_t size() const { return count_; }
  int8_t& operator[](size_t i) { return data_[i]; }
  Tensor tensor() { return Tensor{data_, count_, DataType::kInt8}; }

 private:
  size_t count_;
  int8_t* data_;
};

// The first index in [begin, end) (all of `data` by default) where `data` differs from
// `expected(i)`, or `end`.
template <typename Expected>
size_t FirstWrong(Buffer& data, Expected expected, size_t begin = 0, size_t end = SIZE_MAX) {
  end = std::min(end, data.size());
  for (size_t i = begin; i < end; ++i) {
    if (data[i] != expected(i)) return i;
  }
  return end;
}

class LargeTensorTest : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    GTEST_SKIP() << "2 GiB tensors under a sanitizer: too slow, and its shadow memory on top";
#endif
    const size_t needed = size_t{7} << 30;
    if (AvailableMemory() < needed) {
      GTEST_SKIP() << "needs " << (needed >> 30) << " GiB of available memory, "
                   << (AvailableMemory() >> 20) << " MiB available";
    }
  }
};

TEST_P(LargeTensorTest, AllReducePastTwoGiBAndIntMaxElements) {
  const size_t count = kTwoGiB + 5;  // elements and bytes both past INT_MAX
  RunRanks(GetParam(), 2, {}, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    Buffer data(count);
    for (size_t i = 0; i < count; ++i) data[i] = Value(rank, i);
    comm.AllReduce(data.tensor(), ReduceOp::kSum);
    const size_t wrong =
        FirstWrong(data, [](size_t i) { return static_cast<int8_t>(Value(0, i) + Value(1, i)); });
    EXPECT_EQ(wrong, count) << "rank " << rank << ": element " << wrong << " of " << count << " is "
                            << int(data[wrong < count ? wrong : 0]);
  });
}

TEST_P(LargeTensorTest, AllGatherOfAResultPastTwoGiB) {
  const size_t count = kTwoGiB / 2 + 3;  // per rank: the result is 2^31 + 6 bytes
  RunRanks(GetParam(), 2, {}, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    Buffer all(2 * count);
    {
      Buffer mine(count);
      for (size_t i = 0; i < count; ++i) mine[i] = Value(rank, i);
      comm.AllGather(mine.tensor(), all.tensor());
    }
    size_t wrong = FirstWrong(
        all, [&](size_t i) { return Value(0, i); }, 0, count);
    if (wrong == count) {
      wrong = FirstWrong(
          all, [&](size_t i) { return Value(1, i - count); }, count, all.size());
    }
    EXPECT_EQ(wrong, all.size()) << "rank " << rank << ": element " << wrong << " of "
                                 << all.size();
  });
}

TEST_P(LargeTensorTest, BroadcastPastTwoGiB) {
  const size_t count = kTwoGiB + 5;
  RunRanks(GetParam(), 2, {}, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    Buffer data(count);
    for (size_t i = 0; i < count; ++i) data[i] = rank == 1 ? Value(1, i) : int8_t{-1};
    comm.Broadcast(data.tensor(), /*root=*/1);
    const size_t wrong = FirstWrong(data, [](size_t i) { return Value(1, i); });
    EXPECT_EQ(wrong, count) << "rank " << rank << ": element " << wrong << " of " << count;
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, LargeTensorTest,
                         ::testing::Values(Transport::kTcp, Transport::kAuto),
                         [](const ::testing::TestParamInfo<Transport>& param) {
                           return std::string(testing::TransportName(param.param));
                         });

}  // namespace
}  // namespace collectives
