// The C API: every collective checked element by element against a locally computed reference,
// for world sizes 1 to 4 (ranks are threads, over real loopback TCP), through communicators made
// both from a memory-store rendezvous (WrapCommunication) and by coll_comm_create /
// coll_comm_create_from_tf_config on a real TCP store; packed lists (coll_all_reduce_many,
// coll_broadcast_many) of odd sizes, and lists that differ across ranks; the asynchronous forms
// (every collective in flight at once, waited on, polled, or freed unwaited; handles that
// outlive their communicator); coll_comm_split and coll_comm_set_timeout; reduce, gather,
// scatter, the all-to-all (equal and uneven blocks) and send/recv, blocking and asynchronous;
// the error paths (NULL pointers, enum values out of range, bad options, counts that differ
// across ranks, malformed TF_CONFIG, abort) return the documented status with a message naming
// the argument, never an exception; status names; the last error is per thread.
//
// One file: the suites share the status checks (EXPECT_STATUS, Contains) and TestOptions, and all
// but the create suite run their ranks as threads through RunRanks.
#include "collectives/c_api.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/c_api/c_api_internal.h"
#include "tests/c_api/c_api_ranks.h"
#include "tests/free_port.h"
#include "tests/ring/collective_checks.h"
#include "tests/time_scale.h"
#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#endif

namespace {

using collectives::DataType;
using collectives::ReduceOp;
using collectives::SizeOf;
using collectives::testing::Expected;
using collectives::testing::FreePort;
using collectives::testing::InputValue;
using collectives::testing::Load;
using collectives::testing::Store;

constexpr int64_t kTimeoutMs = 10'000;  // every failure here is seen in well under a second

coll_dtype C(DataType d) { return static_cast<coll_dtype>(d); }
coll_op C(ReduceOp o) { return static_cast<coll_op>(o); }

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A status compared with the message that came with it, for readable failures.
#define EXPECT_STATUS(expected, call)                                                    \
  do {                                                                                   \
    const coll_status status_ = (call);                                                  \
    EXPECT_EQ(status_, expected) << #call << ": " << coll_status_string(status_) << ": " \
                                 << coll_last_error();                                   \
  } while (0)
#define EXPECT_OK(call) EXPECT_STATUS(COLL_OK, call)

// Runs `size` ranks as threads, each with its own coll_comm over loopback TCP (rendezvous
// through a memory store), and `body` on each in parallel; destroys the communicators.
void RunRanks(int size, const std::function<void(coll_comm*, int)>& body,
              size_t bytes_per_pack = 0) {
  collectives::CommunicationOptions options;
  options.timeout = std::chrono::milliseconds(kTimeoutMs);
  collectives::testing::RunCApiRanks(size, options, body, bytes_per_pack);
}

coll_options TestOptions() {
  coll_options options;
  EXPECT_OK(coll_options_init(&options));
  options.timeout_ms = kTimeoutMs;
  return options;
}

// `count` elements of `dtype` and one guard byte.
std::vector<uint8_t> Buffer(DataType dtype, size_t count) {
  return std::vector<uint8_t>(count * SizeOf(dtype) + 1, 0xA5);
}

// Rank `rank`'s input for `op`: element i holds InputValue(op, dtype, rank, first + i).
void Fill(DataType dtype, ReduceOp op, int rank, void* data, size_t count, size_t first = 0) {
  for (size_t i = 0; i < count; ++i) Store(dtype, data, i, InputValue(op, dtype, rank, first + i));
}

// `value` as stored in `dtype` (what a buffer can hold of it).
double Stored(DataType dtype, double value) {
  uint64_t cell = 0;
  Store(dtype, &cell, 0, value);
  return Load(dtype, &cell, 0);
}

// The first wrong element of `got` against `want(i)`, if any, and the guard byte.
template <typename Want>
void ExpectElements(const std::string& what, DataType dtype, const std::vector<uint8_t>& got,
                    size_t count, Want&& want) {
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    const double expected = want(i), value = Load(dtype, got.data(), i);
    if (value != expected && wrong++ == 0) {
      ADD_FAILURE() << what << ": element " << i << " is " << value << ", expected " << expected;
    }
  }
  EXPECT_EQ(wrong, 0u) << what;
  EXPECT_EQ(got.back(), 0xA5) << what << ": guard byte overwritten";
}

std::string Describe(const char* collective, int rank, DataType dtype, ReduceOp op, size_t count,
                     bool in_place) {
  return std::string("rank ") + std::to_string(rank) + " " + collective + " " +
         collectives::ToString(dtype) + " " + collectives::ToString(op) +
         " count=" + std::to_string(count) + (in_place ? " in-place" : "");
}

// ---------------------------------------------------------------------------------------------
// Collectives, per world size.
// ---------------------------------------------------------------------------------------------

class CApiCollectiveTest : public ::testing::TestWithParam<int> {};

TEST_P(CApiCollectiveTest, AllReduceEveryDtypeAndOp) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    int got_rank = -1, got_size = -1;
    EXPECT_OK(coll_comm_rank(comm, &got_rank));
    EXPECT_OK(coll_comm_size(comm, &got_size));
    EXPECT_EQ(got_rank, rank);
    EXPECT_EQ(got_size, size);
    // 17000 elements: past the small-message size for 4-byte types, so the ring (and, with 4
    // ranks, halving-doubling) run as well as recursive doubling.
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{17000}}) {
      for (int d = 0; d < collectives::kNumDataTypes; ++d) {
        for (int o = 0; o < collectives::kNumReduceOps; ++o) {
          for (bool in_place : {false, true}) {
            const auto dtype = static_cast<DataType>(d);
            const auto op = static_cast<ReduceOp>(o);
            std::vector<uint8_t> send = Buffer(dtype, count), recv = Buffer(dtype, count);
            std::vector<uint8_t>& input = in_place ? recv : send;
            Fill(dtype, op, rank, input.data(), count);
            EXPECT_OK(coll_all_reduce(comm, input.data(), recv.data(), count, C(dtype), C(op)));
            ExpectElements(Describe("all_reduce", rank, dtype, op, count, in_place), dtype, recv,
                           count, [&](size_t i) { return Expected(op, dtype, size, i); });
          }
        }
      }
    }
  });
}

TEST_P(CApiCollectiveTest, BroadcastFromEveryRoot) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    for (int root = 0; root < size; ++root) {
      for (DataType dtype : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32,
                             DataType::kInt64, DataType::kUInt8}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{13}, size_t{40000}}) {
          for (bool in_place : {false, true}) {
            std::vector<uint8_t> send = Buffer(dtype, count), recv = Buffer(dtype, count);
            std::vector<uint8_t>& input = in_place ? recv : send;
            if (rank == root) Fill(dtype, ReduceOp::kSum, root, input.data(), count);
            // Off the root, sendbuff is not read: NULL is allowed.
            const void* sendbuff = rank == root ? input.data() : nullptr;
            EXPECT_OK(coll_broadcast(comm, sendbuff, recv.data(), count, C(dtype), root));
            ExpectElements(Describe("broadcast", rank, dtype, ReduceOp::kSum, count, in_place) +
                               " root=" + std::to_string(root),
                           dtype, recv, count, [&](size_t i) {
                             return Stored(dtype, InputValue(ReduceOp::kSum, dtype, root, i));
                           });
          }
        }
      }
    }
  });
}

TEST_P(CApiCollectiveTest, AllGather) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    for (DataType dtype : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32,
                           DataType::kInt64, DataType::kInt8, DataType::kBFloat16}) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{10007}}) {
        for (bool in_place : {false, true}) {
          const size_t total = count * size_t(size);
          std::vector<uint8_t> send = Buffer(dtype, count), recv = Buffer(dtype, total);
          // In place: this rank's block of recv is the input.
          uint8_t* input =
              in_place ? recv.data() + size_t(rank) * count * SizeOf(dtype) : send.data();
          Fill(dtype, ReduceOp::kSum, rank, input, count);
          EXPECT_OK(coll_all_gather(comm, input, recv.data(), count, C(dtype)));
          ExpectElements(Describe("all_gather", rank, dtype, ReduceOp::kSum, count, in_place),
                         dtype, recv, total, [&](size_t i) {
                           return Stored(
                               dtype, InputValue(ReduceOp::kSum, dtype, int(i / count), i % count));
                         });
        }
      }
    }
  });
}

TEST_P(CApiCollectiveTest, ReduceScatter) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    for (DataType dtype :
         {DataType::kFloat32, DataType::kFloat64, DataType::kInt32, DataType::kInt64}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg, ReduceOp::kProd}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{3}, size_t{10007}}) {
          for (bool in_place : {false, true}) {
            const size_t total = count * size_t(size);
            std::vector<uint8_t> send = Buffer(dtype, total), recv = Buffer(dtype, count);
            Fill(dtype, op, rank, send.data(), total);
            // In place: the result lands in this rank's block of sendbuff.
            uint8_t* output =
                in_place ? send.data() + size_t(rank) * count * SizeOf(dtype) : recv.data();
            EXPECT_OK(coll_reduce_scatter(comm, send.data(), output, count, C(dtype), C(op)));
            std::vector<uint8_t> result(output, output + count * SizeOf(dtype));
            result.push_back(in_place ? 0xA5 : recv.back());
            ExpectElements(
                Describe("reduce_scatter", rank, dtype, op, count, in_place), dtype, result, count,
                [&](size_t i) { return Expected(op, dtype, size, size_t(rank) * count + i); });
          }
        }
      }
    }
  });
}

TEST_P(CApiCollectiveTest, BarrierWaitsForEveryRank) {
  const int size = GetParam();
  std::atomic<int> arrived{0};
  RunRanks(size, [&](coll_comm* comm, int rank) {
    for (int round = 1; round <= 3; ++round) {
      // The last rank is late; nobody leaves the barrier before it arrived.
      if (rank == size - 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      arrived.fetch_add(1);
      EXPECT_OK(coll_barrier(comm));
      EXPECT_GE(arrived.load(), round * size) << "rank " << rank << " round " << round;
      EXPECT_OK(coll_barrier(comm));  // nobody starts the next round before everyone checked
    }
  });
}

TEST_P(CApiCollectiveTest, AllReduceManyOddSizesEqualsOneAllReducePerBuffer) {
  const int size = GetParam();
  const std::vector<std::vector<size_t>> lists = {
      {}, {0}, {1}, {0, 1, 2, 3, 5, 7, 11, 13, 0, 17}, {1009, 0, 3, 4099, 1, 65537}};
  RunRanks(size, [&](coll_comm* comm, int rank) {
    int calls = 0;
    for (const std::vector<size_t>& counts : lists) {
      for (size_t bytes_per_pack : {size_t{0}, size_t{16}, size_t{4096}}) {
        for (DataType dtype :
             {DataType::kFloat32, DataType::kFloat64, DataType::kInt32, DataType::kInt64}) {
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
            std::vector<std::vector<uint8_t>> storage;
            std::vector<void*> buffers;
            size_t first = 0;
            for (size_t count : counts) {
              storage.push_back(Buffer(dtype, count));
              Fill(dtype, op, rank, storage.back().data(), count, first);
              first += count;
            }
            for (size_t k = 0; k < counts.size(); ++k) {
              // An empty buffer may be NULL.
              buffers.push_back(counts[k] == 0 ? nullptr : storage[k].data());
            }
            void* const* list = counts.empty() ? nullptr : buffers.data();
            const size_t* sizes = counts.empty() ? nullptr : counts.data();
            const bool async = ++calls % 2 == 0;  // the asynchronous form every other call
            if (async) {
              coll_work* work = nullptr;
              EXPECT_OK(coll_all_reduce_many_async(comm, list, sizes, counts.size(), C(dtype),
                                                   C(op), bytes_per_pack, &work));
              EXPECT_OK(coll_work_free(work));
            } else {
              EXPECT_OK(coll_all_reduce_many(comm, list, sizes, counts.size(), C(dtype), C(op),
                                             bytes_per_pack));
            }
            first = 0;
            for (size_t k = 0; k < counts.size(); ++k) {
              ExpectElements(Describe(async ? "all_reduce_many_async" : "all_reduce_many", rank,
                                      dtype, op, counts[k], true) +
                                 " buffer " + std::to_string(k) + " of " +
                                 std::to_string(counts.size()) +
                                 " bytes_per_pack=" + std::to_string(bytes_per_pack),
                             dtype, storage[k], counts[k],
                             [&](size_t i) { return Expected(op, dtype, size, first + i); });
              first += counts[k];
            }
          }
        }
      }
    }
  });
}

// coll_broadcast_many from every root, lists of odd sizes (empty, 0, 1, primes; caps that fuse
// none, some and all of them), several dtypes: every rank's buffers end up holding the root's
// element by element. Every other call is the asynchronous form, waited on or polled with
// coll_work_test until done.
TEST_P(CApiCollectiveTest, BroadcastManyOddSizesFromEveryRoot) {
  const int size = GetParam();
  const std::vector<std::vector<size_t>> lists = {
      {}, {0}, {1}, {0, 1, 2, 3, 5, 7, 11, 13, 0, 17}, {1009, 0, 3, 4099, 1, 65537}};
  RunRanks(size, [&](coll_comm* comm, int rank) {
    int calls = 0;
    for (int root = 0; root < size; ++root) {
      for (const std::vector<size_t>& counts : lists) {
        for (size_t bytes_per_pack : {size_t{0}, size_t{16}, size_t{4096}}) {
          for (DataType dtype : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                                 DataType::kInt8, DataType::kInt64}) {
            // Every rank's input differs (InputValue of its own rank): only the root's survives.
            std::vector<std::vector<uint8_t>> storage;
            std::vector<void*> buffers;
            size_t first = 0;
            for (size_t count : counts) {
              storage.push_back(Buffer(dtype, count));
              Fill(dtype, ReduceOp::kSum, rank, storage.back().data(), count, first);
              first += count;
              buffers.push_back(count == 0 ? nullptr : storage.back().data());
            }
            void* const* list = counts.empty() ? nullptr : buffers.data();
            const size_t* sizes = counts.empty() ? nullptr : counts.data();
            const int call = ++calls;
            if (call % 2 == 0) {
              coll_work* work = nullptr;
              EXPECT_OK(coll_broadcast_many_async(comm, list, sizes, counts.size(), C(dtype), root,
                                                  bytes_per_pack, &work));
              if (call % 4 == 0) {
                int done = 0;
                while (done == 0) {
                  EXPECT_OK(coll_work_test(work, &done));
                  std::this_thread::yield();  // four ranks share two cores
                }
              } else {
                EXPECT_OK(coll_work_wait(work));
              }
              EXPECT_OK(coll_work_free(work));
            } else {
              EXPECT_OK(coll_broadcast_many(comm, list, sizes, counts.size(), C(dtype), root,
                                            bytes_per_pack));
            }
            first = 0;
            for (size_t k = 0; k < counts.size(); ++k) {
              ExpectElements(Describe(call % 2 == 0 ? "broadcast_many_async" : "broadcast_many",
                                      rank, dtype, ReduceOp::kSum, counts[k], true) +
                                 " root=" + std::to_string(root) + " buffer " + std::to_string(k) +
                                 " of " + std::to_string(counts.size()) +
                                 " bytes_per_pack=" + std::to_string(bytes_per_pack),
                             dtype, storage[k], counts[k], [&](size_t i) {
                               return Stored(dtype,
                                             InputValue(ReduceOp::kSum, dtype, root, first + i));
                             });
              first += counts[k];
            }
          }
        }
      }
    }
  });
}

// Every asynchronous collective issued before any is waited on: several all-reduces (0, 1, 7
// and 17000 elements, one in place), a broadcast from the last rank, an all-gather, a
// reduce-scatter and a barrier, all in flight together; then waited on in reverse order, or
// polled with coll_work_test, and every result checked element by element. A blocking call
// after them sees the communicator in order.
TEST_P(CApiCollectiveTest, AsyncCollectivesInFlightTogether) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    const int root = size - 1;
    struct Pending {
      coll_work* work = nullptr;
      std::function<void()> check;
    };
    std::vector<Pending> pending;
    std::deque<std::vector<uint8_t>> keep;  // buffers borrowed until done; they never move
    auto buffer = [&](DataType dtype, size_t count) {
      return &keep.emplace_back(Buffer(dtype, count));
    };
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{17000}}) {
      for (bool in_place : {false, true}) {
        const DataType dtype = count == 7 ? DataType::kInt64 : DataType::kFloat32;
        const ReduceOp op = count == 1 ? ReduceOp::kMax : ReduceOp::kSum;
        std::vector<uint8_t>* recv = buffer(dtype, count);
        std::vector<uint8_t>* send = in_place ? recv : buffer(dtype, count);
        Fill(dtype, op, rank, send->data(), count);
        Pending p;
        EXPECT_OK(coll_all_reduce_async(comm, send->data(), recv->data(), count, C(dtype), C(op),
                                        &p.work));
        p.check = [=] {
          ExpectElements(Describe("all_reduce_async", rank, dtype, op, count, in_place), dtype,
                         *recv, count, [&](size_t i) { return Expected(op, dtype, size, i); });
        };
        pending.push_back(std::move(p));
      }
    }
    {
      const size_t count = 40000;
      std::vector<uint8_t>* data = buffer(DataType::kFloat64, count);
      if (rank == root) Fill(DataType::kFloat64, ReduceOp::kSum, root, data->data(), count);
      Pending p;
      EXPECT_OK(coll_broadcast_async(comm, data->data(), data->data(), count, COLL_FLOAT64, root,
                                     &p.work));
      p.check = [=] {
        ExpectElements(
            Describe("broadcast_async", rank, DataType::kFloat64, ReduceOp::kSum, count, true),
            DataType::kFloat64, *data, count,
            [&](size_t i) { return InputValue(ReduceOp::kSum, DataType::kFloat64, root, i); });
      };
      pending.push_back(std::move(p));
    }
    {
      const size_t count = 10007;
      const size_t total = count * size_t(size);
      std::vector<uint8_t>* send = buffer(DataType::kInt32, count);
      std::vector<uint8_t>* recv = buffer(DataType::kInt32, total);
      Fill(DataType::kInt32, ReduceOp::kSum, rank, send->data(), count);
      Pending p;
      EXPECT_OK(
          coll_all_gather_async(comm, send->data(), recv->data(), count, COLL_INT32, &p.work));
      p.check = [=] {
        ExpectElements(
            Describe("all_gather_async", rank, DataType::kInt32, ReduceOp::kSum, count, false),
            DataType::kInt32, *recv, total, [&](size_t i) {
              return Stored(DataType::kInt32, InputValue(ReduceOp::kSum, DataType::kInt32,
                                                         int(i / count), i % count));
            });
      };
      pending.push_back(std::move(p));
    }
    {
      const size_t count = 3;
      std::vector<uint8_t>* send = buffer(DataType::kFloat64, count * size_t(size));
      std::vector<uint8_t>* recv = buffer(DataType::kFloat64, count);
      Fill(DataType::kFloat64, ReduceOp::kMax, rank, send->data(), count * size_t(size));
      Pending p;
      EXPECT_OK(coll_reduce_scatter_async(comm, send->data(), recv->data(), count, COLL_FLOAT64,
                                          COLL_MAX, &p.work));
      p.check = [=] {
        ExpectElements(Describe("reduce_scatter_async", rank, DataType::kFloat64, ReduceOp::kMax,
                                count, false),
                       DataType::kFloat64, *recv, count, [&](size_t i) {
                         return Expected(ReduceOp::kMax, DataType::kFloat64, size,
                                         size_t(rank) * count + i);
                       });
      };
      pending.push_back(std::move(p));
    }
    {
      Pending p;
      EXPECT_OK(coll_barrier_async(comm, &p.work));
      p.check = [] {};
      pending.push_back(std::move(p));
    }
    for (const Pending& p : pending) ASSERT_NE(p.work, nullptr);
    // Odd positions polled, even ones waited on from the last: completion is in issue order,
    // whatever order the handles are asked in.
    for (size_t k = 1; k < pending.size(); k += 2) {
      int done = 0;
      while (done == 0) EXPECT_OK(coll_work_test(pending[k].work, &done));
      EXPECT_OK(coll_work_test(pending[k].work, &done));  // asked again: the same answer
      EXPECT_EQ(done, 1);
    }
    for (size_t k = pending.size(); k-- > 0;) {
      if (k % 2 == 0) EXPECT_OK(coll_work_wait(pending[k].work));
      EXPECT_OK(coll_work_wait(pending[k].work));  // any number of times
    }
    for (const Pending& p : pending) {
      p.check();
      EXPECT_OK(coll_work_free(p.work));
    }
    int64_t value = rank + 1;
    EXPECT_OK(coll_all_reduce(comm, &value, &value, 1, COLL_INT64, COLL_SUM));
    EXPECT_EQ(value, int64_t{size} * (size + 1) / 2);
  });
}

// coll_work_free on a handle nobody waited on waits for the collective: once it returned the
// result is there and the buffers are the caller's again.
TEST_P(CApiCollectiveTest, FreeingAnUnwaitedHandleWaitsForTheCollective) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    std::vector<float> data(1 << 20, float(rank + 1));
    coll_work* work = nullptr;
    EXPECT_OK(coll_all_reduce_async(comm, data.data(), data.data(), data.size(), COLL_FLOAT32,
                                    COLL_SUM, &work));
    EXPECT_OK(coll_work_free(work));
    const float want = float(size * (size + 1) / 2);
    EXPECT_EQ(std::count(data.begin(), data.end(), want), std::ptrdiff_t(data.size()));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CApiCollectiveTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return "world" + std::to_string(param_info.param);
                         });

// ---------------------------------------------------------------------------------------------
// Creation over a real TCP store.
// ---------------------------------------------------------------------------------------------

// Every rank all-reduces its rank + 1; the sum is size (size + 1) / 2.
void ExpectRankSum(coll_comm* comm, int rank, int size) {
  int got_rank = -1, got_size = -1;
  EXPECT_OK(coll_comm_rank(comm, &got_rank));
  EXPECT_OK(coll_comm_size(comm, &got_size));
  EXPECT_EQ(got_rank, rank);
  EXPECT_EQ(got_size, size);
  int64_t value = rank + 1;
  EXPECT_OK(coll_all_reduce(comm, &value, &value, 1, COLL_INT64, COLL_SUM));
  EXPECT_EQ(value, int64_t{size} * (size + 1) / 2);
}

TEST(CApiCreateTest, CreateRendezvousesThroughRankZerosTcpStore) {
  for (int size : {1, 2, 3}) {
    const uint16_t port = size == 1 ? 0 : FreePort();
    const coll_options options = TestOptions();
    std::vector<std::thread> threads;
    for (int rank = 0; rank < size; ++rank) {
      threads.emplace_back([&, rank] {
        coll_comm* comm = nullptr;
        EXPECT_OK(coll_comm_create(rank, size, "127.0.0.1", port, &options, &comm));
        if (comm == nullptr) return;
        ExpectRankSum(comm, rank, size);
        EXPECT_OK(coll_comm_destroy(comm));
      });
    }
    for (std::thread& t : threads) t.join();
  }
}

TEST(CApiCreateTest, NullOptionsAndNullAddressMeanDefaults) {
  coll_comm* comm = nullptr;
  EXPECT_OK(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm));
  ASSERT_NE(comm, nullptr);
  ExpectRankSum(comm, 0, 1);
  EXPECT_OK(coll_comm_destroy(comm));
}

TEST(CApiCreateTest, CreateFromTfConfig) {
  const uint16_t port = FreePort();
  const coll_options options = TestOptions();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      // The chief is rank 0 and hosts the store at its address; the worker is rank 1.
      const std::string json = R"({"cluster": {"chief": ["127.0.0.1:)" + std::to_string(port) +
                               R"("], "worker": ["127.0.0.1:1"]}, "task": {"type": ")" +
                               (rank == 0 ? "chief" : "worker") + R"(", "index": 0}})";
      coll_comm* comm = nullptr;
      EXPECT_OK(coll_comm_create_from_tf_config(json.c_str(), &options, &comm));
      if (comm == nullptr) return;
      ExpectRankSum(comm, rank, 2);
      EXPECT_OK(coll_comm_destroy(comm));
    });
  }
  for (std::thread& t : threads) t.join();
}

// Sets environment variables for one test and restores them after.
class ScopedEnvironment {
 public:
  explicit ScopedEnvironment(const std::map<std::string, std::optional<std::string>>& values) {
    for (const auto& [name, value] : values) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      Set(name, value);
    }
  }
  ~ScopedEnvironment() {
    for (const auto& [name, value] : saved_) Set(name, value);
  }

 private:
  static void Set(const std::string& name, const std::optional<std::string>& value) {
    if (value) {
      setenv(name.c_str(), value->c_str(), 1);
    } else {
      unsetenv(name.c_str());
    }
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

const std::map<std::string, std::optional<std::string>> kNoLauncher = {
    {"TF_CONFIG", std::nullopt},
    {"RANK", std::nullopt},
    {"WORLD_SIZE", std::nullopt},
    {"OMPI_COMM_WORLD_RANK", std::nullopt},
    {"OMPI_COMM_WORLD_SIZE", std::nullopt},
    {"COLLECTIVES_JOB_ID", std::nullopt}};

TEST(CApiCreateTest, CreateFromAnEmptyEnvironmentIsOneRank) {
  ScopedEnvironment env(kNoLauncher);
  coll_comm* comm = nullptr;
  EXPECT_OK(coll_comm_create_from_env(nullptr, &comm));
  ASSERT_NE(comm, nullptr);
  ExpectRankSum(comm, 0, 1);
  EXPECT_OK(coll_comm_destroy(comm));
}

TEST(CApiCreateTest, CreateFromAMalformedEnvironmentNamesTheVariable) {
  std::map<std::string, std::optional<std::string>> values = kNoLauncher;
  values["RANK"] = "one";
  values["WORLD_SIZE"] = "2";
  ScopedEnvironment env(values);
  coll_comm* comm = reinterpret_cast<coll_comm*>(&values);  // must be cleared
  EXPECT_EQ(coll_comm_create_from_env(nullptr, &comm), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(comm, nullptr);
  EXPECT_TRUE(Contains(coll_last_error(), "coll_comm_create_from_env")) << coll_last_error();
  EXPECT_TRUE(Contains(coll_last_error(), "RANK")) << coll_last_error();
}

// A port in MASTER_ADDR is refused at once, not taken as a host name (every rank but 0 would
// retry resolving "127.0.0.1:29500" until its timeout and return COLL_TIMEOUT).
TEST(CApiCreateTest, MasterAddrWithAPortIsAnInvalidArgumentAtOnce) {
  std::map<std::string, std::optional<std::string>> values = kNoLauncher;
  values["RANK"] = "1";
  values["WORLD_SIZE"] = "2";
  values["MASTER_ADDR"] = "127.0.0.1:29500";
  values["MASTER_PORT"] = "29500";
  values["COLLECTIVES_STORE_LISTEN_ADDRESS"] = std::nullopt;
  ScopedEnvironment env(values);
  coll_options options = TestOptions();
  options.timeout_ms = 20000;
  coll_comm* comm = reinterpret_cast<coll_comm*>(&values);  // must be cleared
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(coll_comm_create_from_env(&options, &comm), COLL_INVALID_ARGUMENT) << coll_last_error();
  EXPECT_LT(std::chrono::steady_clock::now() - start,
            collectives::test_time::Scaled(std::chrono::seconds(2)));
  EXPECT_EQ(comm, nullptr);
  EXPECT_TRUE(Contains(coll_last_error(), "MASTER_ADDR='127.0.0.1:29500'")) << coll_last_error();
  EXPECT_TRUE(Contains(coll_last_error(), "MASTER_PORT")) << coll_last_error();
}

TEST(CApiCreateTest, AMasterAddrThatIsNoHostIsAnInvalidArgument) {
  coll_options options = TestOptions();
  options.timeout_ms = 20000;
  for (const char* addr : {"127.0.0.1:29500", "[::1", "a/b", "a b"}) {
    coll_comm* comm = nullptr;
    const auto start = std::chrono::steady_clock::now();
    EXPECT_EQ(coll_comm_create(1, 2, addr, 29500, &options, &comm), COLL_INVALID_ARGUMENT)
        << addr << ": " << coll_last_error();
    EXPECT_LT(std::chrono::steady_clock::now() - start,
              collectives::test_time::Scaled(std::chrono::seconds(2)))
        << addr;
    EXPECT_TRUE(Contains(coll_last_error(), "master_addr='" + std::string(addr) + "'"))
        << coll_last_error();
    EXPECT_EQ(comm, nullptr);
  }
}

TEST(CApiCreateTest, MalformedTfConfigIsAnInvalidArgument) {
  const coll_options options = TestOptions();
  for (const char* json :
       {"not json", "{}", R"({"cluster": {"worker": ["127.0.0.1:1"]}})",
        R"({"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 4}})",
        R"({"cluster": {"worker": ["no port"]}, "task": {"type": "worker", "index": 0}})",
        R"({"cluster": {"ps": ["h:1"]}, "task": {"type": "ps", "index": 0}})"}) {
    coll_comm* comm = nullptr;
    EXPECT_EQ(coll_comm_create_from_tf_config(json, &options, &comm), COLL_INVALID_ARGUMENT)
        << json;
    EXPECT_EQ(comm, nullptr);
    EXPECT_TRUE(Contains(coll_last_error(), "coll_comm_create_from_tf_config: "))
        << coll_last_error();
    EXPECT_TRUE(Contains(coll_last_error(), "TF_CONFIG")) << json << ": " << coll_last_error();
  }
  coll_comm* comm = nullptr;
  EXPECT_EQ(coll_comm_create_from_tf_config(nullptr, &options, &comm), COLL_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(coll_last_error(), "tf_config_json is NULL")) << coll_last_error();
}

TEST(CApiCreateTest, BadRankSizeOrPortIsAnInvalidArgument) {
  coll_comm* comm = nullptr;
  EXPECT_EQ(coll_comm_create(0, 2, "127.0.0.1", 0, nullptr, &comm), COLL_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(coll_last_error(), "master_port")) << coll_last_error();
  EXPECT_EQ(coll_comm_create(2, 2, "127.0.0.1", 1, nullptr, &comm), COLL_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(coll_last_error(), "rank=2")) << coll_last_error();
  EXPECT_EQ(coll_comm_create(0, 0, "127.0.0.1", 1, nullptr, &comm), COLL_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(coll_last_error(), "world_size=0")) << coll_last_error();
  EXPECT_EQ(comm, nullptr);
}

// A world size no job can have is the caller's invalid argument, named, at once on every rank:
// not COLL_SYSTEM "coll_comm_create: out of memory" on rank 0 from a store sized for that many
// ranks, with the others waiting for the store until their timeout.
TEST(CApiCreateTest, AWorldSizeNoJobCanHaveIsAnInvalidArgument) {
  coll_options options = TestOptions();
  options.timeout_ms = 1000;  // what rank 1 waited for the store without the check
  const uint16_t port = FreePort();
  for (int rank : {0, 1}) {
    for (int world_size : {INT32_MAX, (1 << 20) + 1}) {
      coll_comm* comm = reinterpret_cast<coll_comm*>(uintptr_t{0x1});
      EXPECT_STATUS(COLL_INVALID_ARGUMENT,
                    coll_comm_create(rank, world_size, "127.0.0.1", port, &options, &comm));
      EXPECT_TRUE(Contains(coll_last_error(), "coll_comm_create: rank " + std::to_string(rank) +
                                                  ": world_size=" + std::to_string(world_size) +
                                                  " is more ranks than a job can have"))
          << coll_last_error();
      EXPECT_EQ(comm, nullptr);
    }
  }
}

TEST(CApiCreateTest, OptionsAreChecked) {
  coll_options defaults;
  ASSERT_EQ(coll_options_init(&defaults), COLL_OK);
  EXPECT_EQ(defaults.struct_size, sizeof(coll_options));
  EXPECT_EQ(defaults.implementation, COLL_IMPLEMENTATION_AUTO);
  EXPECT_EQ(defaults.timeout_ms, 300'000);
  EXPECT_EQ(defaults.bytes_per_pack, 0u);
  EXPECT_EQ(defaults.job_token, nullptr);
  EXPECT_EQ(coll_options_init(nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(coll_last_error(), "coll_options_init_sized: options is NULL"))
      << coll_last_error();

  struct Case {
    const char* expect;
    std::function<void(coll_options&)> change;
  };
  const Case cases[] = {
      {"struct_size is 0", [](coll_options& o) { o.struct_size = 0; }},
      {"newer c_api.h", [](coll_options& o) { o.struct_size = sizeof(coll_options) + 8; }},
      {"implementation 7", [](coll_options& o) { o.implementation = coll_implementation(7); }},
      {"timeout_ms is 0", [](coll_options& o) { o.timeout_ms = 0; }},
      {"timeout_ms is -5", [](coll_options& o) { o.timeout_ms = -5; }},
  };
  for (const Case& c : cases) {
    coll_options options = defaults;
    c.change(options);
    coll_comm* comm = nullptr;
    EXPECT_EQ(coll_comm_create(0, 1, nullptr, 0, &options, &comm), COLL_INVALID_ARGUMENT)
        << c.expect;
    EXPECT_EQ(comm, nullptr);
    EXPECT_TRUE(Contains(coll_last_error(), c.expect)) << coll_last_error();
  }
}

// coll_options_init passes sizeof(coll_options) as the caller's header sees it, and the library
// writes only that many bytes: a program built against an older, smaller header keeps what lies
// past its struct when a newer library's coll_options has grown. Sizes it cannot take are
// refused naming them, nothing written.
TEST(CApiCreateTest, OptionsInitWritesOnlyTheCallersStruct) {
  constexpr unsigned char kCanary = 0xA5;
  // The first version of coll_options ends with job_token.
  constexpr size_t kFirstSize = offsetof(coll_options, job_token) + sizeof(const char*);
  alignas(coll_options) unsigned char buffer[sizeof(coll_options) + 32];
  auto* options = reinterpret_cast<coll_options*>(buffer);
  const auto canaries_from = [&](size_t offset) {
    return std::all_of(buffer + offset, std::end(buffer),
                       [](unsigned char b) { return b == kCanary; });
  };

  std::fill(std::begin(buffer), std::end(buffer), kCanary);
  ASSERT_EQ(coll_options_init(options), COLL_OK) << coll_last_error();
  EXPECT_EQ(options->struct_size, sizeof(coll_options));
  EXPECT_TRUE(canaries_from(sizeof(coll_options)));

  // A struct of the first version's size (an older header's, once coll_options has grown): the
  // defaults, nothing past it written, and coll_comm_create takes it.
  std::fill(std::begin(buffer), std::end(buffer), kCanary);
  ASSERT_EQ(coll_options_init_sized(options, kFirstSize), COLL_OK) << coll_last_error();
  EXPECT_EQ(options->struct_size, kFirstSize);
  EXPECT_EQ(options->implementation, COLL_IMPLEMENTATION_AUTO);
  EXPECT_EQ(options->timeout_ms, 300'000);
  EXPECT_EQ(options->bytes_per_pack, 0u);
  EXPECT_EQ(options->job_token, nullptr);
  EXPECT_TRUE(canaries_from(kFirstSize));
  options->timeout_ms = kTimeoutMs;
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, options, &comm), COLL_OK) << coll_last_error();
  EXPECT_OK(coll_comm_destroy(comm));

  const std::string first = std::to_string(kFirstSize);
  const std::string known = std::to_string(sizeof(coll_options));
  struct Case {
    size_t struct_size;
    std::string expect;
  };
  const Case cases[] = {
      {0, "struct_size is 0, less than any coll_options (" + first + " bytes)"},
      {sizeof(size_t), "struct_size is " + std::to_string(sizeof(size_t)) +
                           ", less than any coll_options (" + first + " bytes)"},
      {kFirstSize - 1, "struct_size is " + std::to_string(kFirstSize - 1) +
                           ", less than any coll_options (" + first + " bytes)"},
      {sizeof(coll_options) + 8, "struct_size is " + std::to_string(sizeof(coll_options) + 8) +
                                     " but this library knows a coll_options of " + known +
                                     " bytes: the program was built against a newer c_api.h"},
  };
  for (const Case& c : cases) {
    std::fill(std::begin(buffer), std::end(buffer), kCanary);
    EXPECT_EQ(coll_options_init_sized(options, c.struct_size), COLL_INVALID_ARGUMENT)
        << c.struct_size;
    EXPECT_TRUE(Contains(coll_last_error(), "coll_options_init_sized: " + c.expect))
        << coll_last_error();
    EXPECT_TRUE(canaries_from(0)) << c.struct_size << ": written though refused";
  }
  EXPECT_EQ(coll_options_init_sized(nullptr, sizeof(coll_options)), COLL_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(coll_last_error(), "coll_options_init_sized: options is NULL"))
      << coll_last_error();
}

// Where NCCL is not usable (not built, no libnccl, no GPU), COLL_IMPLEMENTATION_NCCL is refused
// at once, before any rendezvous (rank 0 of 2 would otherwise wait for rank 1 until the
// timeout), naming why. Where it is usable, tests/c_api/c_api_cuda_test.cc runs it.
TEST(CApiCreateTest, NcclIsNotSupportedWhereNcclIsNotUsable) {
#ifdef COLLECTIVES_WITH_NCCL
  if (collectives::nccl::TryLoadNccl() != nullptr) GTEST_SKIP() << "NCCL is usable here";
#endif
  coll_options options = TestOptions();
  options.implementation = COLL_IMPLEMENTATION_NCCL;
  options.timeout_ms = 5'000;
  coll_comm* comm = nullptr;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(coll_comm_create(0, 2, "127.0.0.1", FreePort(), &options, &comm), COLL_NOT_SUPPORTED);
  EXPECT_LT(std::chrono::steady_clock::now() - start,
            collectives::test_time::Scaled(std::chrono::seconds(2)));
  EXPECT_EQ(comm, nullptr);
  EXPECT_TRUE(Contains(coll_last_error(), "coll_comm_create: ")) << coll_last_error();
  EXPECT_TRUE(Contains(coll_last_error(), "COLL_IMPLEMENTATION_NCCL")) << coll_last_error();
  EXPECT_TRUE(Contains(coll_last_error(), "NCCL")) << coll_last_error();
}

// ---------------------------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------------------------

TEST(CApiErrorTest, NullCommIsAnInvalidArgumentNamingTheFunction) {
  float x = 0;
  int value = 0;
  void* buffers[1] = {&x};
  const size_t counts[1] = {1};
  const std::vector<std::pair<std::string, std::function<coll_status()>>> calls = {
      {"coll_comm_abort", [] { return coll_comm_abort(nullptr); }},
      {"coll_comm_rank", [&] { return coll_comm_rank(nullptr, &value); }},
      {"coll_comm_size", [&] { return coll_comm_size(nullptr, &value); }},
      {"coll_all_reduce",
       [&] { return coll_all_reduce(nullptr, &x, &x, 1, COLL_FLOAT32, COLL_SUM); }},
      {"coll_broadcast", [&] { return coll_broadcast(nullptr, &x, &x, 1, COLL_FLOAT32, 0); }},
      {"coll_all_gather", [&] { return coll_all_gather(nullptr, &x, &x, 1, COLL_FLOAT32); }},
      {"coll_reduce_scatter",
       [&] { return coll_reduce_scatter(nullptr, &x, &x, 1, COLL_FLOAT32, COLL_SUM); }},
      {"coll_barrier", [] { return coll_barrier(nullptr); }},
      {"coll_all_reduce_many",
       [&] {
         return coll_all_reduce_many(nullptr, buffers, counts, 1, COLL_FLOAT32, COLL_SUM, 0);
       }},
      {"coll_broadcast_many",
       [&] { return coll_broadcast_many(nullptr, buffers, counts, 1, COLL_FLOAT32, 0, 0); }},
  };
  for (const auto& [name, call] : calls) {
    EXPECT_EQ(call(), COLL_INVALID_ARGUMENT) << name;
    EXPECT_EQ(std::string(coll_last_error()), name + ": comm is NULL");
  }
  EXPECT_EQ(coll_comm_destroy(nullptr), COLL_OK);
}

TEST(CApiErrorTest, NullOutPointersAreInvalidArguments) {
  EXPECT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_comm_create: out is NULL");
  EXPECT_EQ(coll_comm_create_from_env(nullptr, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_comm_create_from_env: out is NULL");
  EXPECT_EQ(coll_comm_create_from_tf_config("{}", nullptr, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_comm_create_from_tf_config: out is NULL");

  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  EXPECT_EQ(coll_comm_rank(comm, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_comm_rank: rank is NULL");
  EXPECT_EQ(coll_comm_size(comm, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_comm_size: size is NULL");
  EXPECT_OK(coll_comm_destroy(comm));
}

TEST(CApiErrorTest, BadArgumentsAreInvalidArgumentsNamingThem) {
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  float x[4] = {1, 2, 3, 4};
  void* buffers[2] = {x, nullptr};
  const size_t counts[2] = {4, 3};
  const coll_dtype bad_dtype = static_cast<coll_dtype>(99);
  const coll_op bad_op = static_cast<coll_op>(42);
  struct Case {
    std::function<coll_status()> call;
    std::string expect;
  };
  const Case cases[] = {
      {[&] { return coll_all_reduce(comm, x, x, 4, bad_dtype, COLL_SUM); }, "dtype 99"},
      {[&] { return coll_all_reduce(comm, x, x, 4, COLL_FLOAT32, bad_op); }, "op 42"},
      {[&] { return coll_broadcast(comm, x, x, 4, bad_dtype, 0); }, "dtype 99"},
      {[&] { return coll_broadcast(comm, x, x, 4, COLL_FLOAT32, 1); }, "root 1"},
      {[&] { return coll_all_gather(comm, x, x, 4, bad_dtype); }, "dtype 99"},
      {[&] { return coll_reduce_scatter(comm, x, x, 4, bad_dtype, COLL_SUM); }, "dtype 99"},
      {[&] { return coll_reduce_scatter(comm, x, x, 4, COLL_FLOAT32, bad_op); }, "op 42"},
      {[&] { return coll_all_reduce_many(comm, buffers, counts, 1, bad_dtype, COLL_SUM, 0); },
       "dtype 99"},
      {[&] { return coll_all_reduce_many(comm, buffers, counts, 1, COLL_FLOAT32, bad_op, 0); },
       "op 42"},
      // NULL buffers with elements.
      {[&] { return coll_all_reduce(comm, nullptr, x, 4, COLL_FLOAT32, COLL_SUM); }, "null"},
      {[&] { return coll_all_reduce(comm, x, nullptr, 4, COLL_FLOAT32, COLL_SUM); }, "null"},
      {[&] { return coll_all_gather(comm, x, nullptr, 4, COLL_FLOAT32); }, "null"},
      {[&] { return coll_all_reduce_many(comm, nullptr, counts, 1, COLL_FLOAT32, COLL_SUM, 0); },
       "buffers is NULL"},
      {[&] { return coll_all_reduce_many(comm, buffers, nullptr, 1, COLL_FLOAT32, COLL_SUM, 0); },
       "counts is NULL"},
      {[&] { return coll_all_reduce_many(comm, buffers, counts, 2, COLL_FLOAT32, COLL_SUM, 0); },
       "buffers[1] is NULL but counts[1] is 3"},
      {[&] { return coll_broadcast_many(comm, buffers, counts, 1, bad_dtype, 0, 0); },
       "coll_broadcast_many: rank 0: dtype 99"},
      {[&] { return coll_broadcast_many(comm, nullptr, counts, 1, COLL_FLOAT32, 0, 0); },
       "coll_broadcast_many: rank 0: buffers is NULL"},
      {[&] { return coll_broadcast_many(comm, buffers, nullptr, 1, COLL_FLOAT32, 0, 0); },
       "coll_broadcast_many: rank 0: counts is NULL"},
      {[&] { return coll_broadcast_many(comm, buffers, counts, 2, COLL_FLOAT32, 0, 0); },
       "coll_broadcast_many: rank 0: buffers[1] is NULL but counts[1] is 3"},
      // A root that is no rank (this communicator has one), also with nothing to move.
      {[&] { return coll_broadcast_many(comm, buffers, counts, 1, COLL_FLOAT32, 1, 0); },
       "root 1 is not a rank"},
      {[&] { return coll_broadcast_many(comm, buffers, counts, 1, COLL_FLOAT32, -1, 0); },
       "root -1 is not a rank"},
      {[&] { return coll_broadcast_many(comm, nullptr, nullptr, 0, COLL_FLOAT32, 1, 0); },
       "root 1 is not a rank"},
      // Buffers that share memory; one not aligned to its element size.
      {[&] {
         void* overlapping[2] = {x, x + 1};
         const size_t twos[2] = {2, 2};
         return coll_broadcast_many(comm, overlapping, twos, 2, COLL_FLOAT32, 0, 0);
       },
       "tensor 1 shares memory with tensor 0"},
      {[&] {
         void* misaligned[1] = {reinterpret_cast<char*>(x) + 1};
         const size_t one[1] = {1};
         return coll_broadcast_many(comm, misaligned, one, 1, COLL_FLOAT32, 0, 0);
       },
       "is not aligned"},
      // Sizes whose bytes overflow size_t.
      {[&] { return coll_all_reduce(comm, x, x, SIZE_MAX / 2, COLL_FLOAT32, COLL_SUM); },
       "more bytes than size_t holds"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.call(), COLL_INVALID_ARGUMENT) << c.expect;
    EXPECT_TRUE(Contains(coll_last_error(), c.expect)) << c.expect << " / " << coll_last_error();
    // The communicator is known: the message names its rank, whichever layer found the error.
    EXPECT_TRUE(Contains(coll_last_error(), ": rank 0: ")) << coll_last_error();
  }
  // None of them ran: the communicator still works.
  EXPECT_OK(coll_all_reduce(comm, x, x, 4, COLL_FLOAT32, COLL_SUM));
  EXPECT_EQ(x[3], 4.0f);
  EXPECT_OK(coll_comm_destroy(comm));
}

TEST(CApiAsyncTest, BadArgumentsAreReturnedAtIssueWithNoHandle) {
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  float x[4] = {1, 2, 3, 4};
  void* buffers[2] = {x, nullptr};
  const size_t counts[2] = {4, 3};
  const coll_dtype bad_dtype = static_cast<coll_dtype>(99);
  const coll_op bad_op = static_cast<coll_op>(42);
  coll_work* junk = reinterpret_cast<coll_work*>(uintptr_t{0x1});
  struct Case {
    std::function<coll_status(coll_work**)> call;
    std::string expect;
  };
  const Case cases[] = {
      {[&](coll_work** w) { return coll_all_reduce_async(comm, x, x, 4, bad_dtype, COLL_SUM, w); },
       "coll_all_reduce_async: rank 0: dtype 99"},
      {[&](coll_work** w) { return coll_all_reduce_async(comm, x, x, 4, COLL_FLOAT32, bad_op, w); },
       "coll_all_reduce_async: rank 0: op 42"},
      {[&](coll_work** w) {
         return coll_all_reduce_async(comm, x, nullptr, 4, COLL_FLOAT32, COLL_SUM, w);
       },
       "null"},
      {[&](coll_work** w) { return coll_broadcast_async(comm, x, x, 4, COLL_FLOAT32, 1, w); },
       "root 1"},
      {[&](coll_work** w) { return coll_all_gather_async(comm, x, x, 4, bad_dtype, w); },
       "coll_all_gather_async: rank 0: dtype 99"},
      {[&](coll_work** w) {
         return coll_reduce_scatter_async(comm, x, x, 4, COLL_FLOAT32, bad_op, w);
       },
       "coll_reduce_scatter_async: rank 0: op 42"},
      {[&](coll_work** w) {
         return coll_all_reduce_async(nullptr, x, x, 4, COLL_FLOAT32, COLL_SUM, w);
       },
       "coll_all_reduce_async: comm is NULL"},
      {[&](coll_work** w) { return coll_barrier_async(nullptr, w); },
       "coll_barrier_async: comm is NULL"},
      {[&](coll_work** w) {
         return coll_all_reduce_many_async(comm, buffers, counts, 2, COLL_FLOAT32, COLL_SUM, 0, w);
       },
       "coll_all_reduce_many_async: rank 0: buffers[1] is NULL but counts[1] is 3"},
      {[&](coll_work** w) {
         return coll_all_reduce_many_async(comm, buffers, counts, 1, COLL_FLOAT32, bad_op, 0, w);
       },
       "coll_all_reduce_many_async: rank 0: op 42"},
      {[&](coll_work** w) {
         return coll_broadcast_many_async(comm, buffers, counts, 2, COLL_FLOAT32, 0, 0, w);
       },
       "coll_broadcast_many_async: rank 0: buffers[1] is NULL but counts[1] is 3"},
      {[&](coll_work** w) {
         return coll_broadcast_many_async(comm, nullptr, counts, 1, COLL_FLOAT32, 0, 0, w);
       },
       "coll_broadcast_many_async: rank 0: buffers is NULL"},
      {[&](coll_work** w) {
         return coll_broadcast_many_async(comm, buffers, counts, 1, bad_dtype, 0, 0, w);
       },
       "coll_broadcast_many_async: rank 0: dtype 99"},
      {[&](coll_work** w) {
         return coll_broadcast_many_async(comm, buffers, counts, 1, COLL_FLOAT32, 1, 0, w);
       },
       "root 1 is not a rank"},
      {[&](coll_work** w) {
         return coll_broadcast_many_async(nullptr, buffers, counts, 1, COLL_FLOAT32, 0, 0, w);
       },
       "coll_broadcast_many_async: comm is NULL"},
  };
  for (const Case& c : cases) {
    coll_work* work = junk;
    EXPECT_EQ(c.call(&work), COLL_INVALID_ARGUMENT) << c.expect;
    EXPECT_TRUE(Contains(coll_last_error(), c.expect)) << c.expect << " / " << coll_last_error();
    EXPECT_EQ(work, nullptr) << c.expect;
  }
  // No place for the handle.
  EXPECT_EQ(coll_all_reduce_async(comm, x, x, 4, COLL_FLOAT32, COLL_SUM, nullptr),
            COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_all_reduce_async: work is NULL");
  EXPECT_EQ(coll_barrier_async(comm, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_barrier_async: work is NULL");
  EXPECT_EQ(coll_broadcast_many_async(comm, buffers, counts, 1, COLL_FLOAT32, 0, 0, nullptr),
            COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_broadcast_many_async: work is NULL");
  // NULL handles.
  int done = 7;
  EXPECT_EQ(coll_work_wait(nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_work_wait: work is NULL");
  EXPECT_EQ(coll_work_test(nullptr, &done), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_work_test: work is NULL");
  EXPECT_EQ(coll_work_free(nullptr), COLL_OK);
  // None of them was queued: the communicator still works, and a handle's test needs *done.
  coll_work* work = nullptr;
  EXPECT_OK(coll_all_reduce_async(comm, x, x, 4, COLL_FLOAT32, COLL_SUM, &work));
  EXPECT_EQ(coll_work_test(work, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_work_test: done is NULL");
  EXPECT_OK(coll_work_wait(work));
  EXPECT_OK(coll_work_free(work));
  EXPECT_EQ(x[3], 4.0f);
  EXPECT_OK(coll_comm_destroy(comm));
}

// Counts that differ across ranks, issued asynchronously: the calls themselves return COLL_OK
// (the arguments are fine on each rank) and the handles report the failure: COLL_MISMATCH on a
// rank that saw it, the same status from wait, test and free, and every later call fails too.
TEST(CApiAsyncTest, AMismatchIsReportedByTheHandleOnEveryRank) {
  std::atomic<int> mismatches{0};
  RunRanks(2, [&](coll_comm* comm, int rank) {
    std::vector<float> data(rank == 0 ? 10 : 12, 1.0f);
    coll_work* work = nullptr;
    EXPECT_OK(coll_all_reduce_async(comm, data.data(), data.data(), data.size(), COLL_FLOAT32,
                                    COLL_SUM, &work));
    int done = 0;
    coll_status status = COLL_OK;
    while (done == 0) status = coll_work_test(work, &done);
    const std::string message = coll_last_error();
    EXPECT_NE(status, COLL_OK) << "rank " << rank;
    if (status == COLL_MISMATCH) {
      ++mismatches;
      EXPECT_TRUE(Contains(message, "coll_work_test: ")) << message;
      EXPECT_TRUE(Contains(message, "does not match")) << message;
    } else {
      EXPECT_TRUE(status == COLL_ABORTED || status == COLL_PEER_LOST)
          << coll_status_string(status) << ": " << message;
    }
    EXPECT_EQ(std::count(data.begin(), data.end(), 1.0f), std::ptrdiff_t(data.size()));
    EXPECT_EQ(coll_work_wait(work), status);
    EXPECT_TRUE(Contains(coll_last_error(), "coll_work_wait: ")) << coll_last_error();
    EXPECT_EQ(coll_work_free(work), status);
    // Broken: a later asynchronous call is queued nowhere; its handle reports the same status.
    EXPECT_OK(coll_barrier_async(comm, &work));
    EXPECT_EQ(coll_work_wait(work), status) << coll_last_error();
    EXPECT_EQ(coll_work_free(work), status);
  });
  EXPECT_GE(mismatches.load(), 1);
}

// coll_broadcast_many with a list that differs on one rank (rank 2 has 6 elements where the
// others have 5): COLL_MISMATCH naming the list on every rank, nothing written off the root.
// Blocking, the check comes before any bucket: the communicator still works. Asynchronous, the
// bucket was issued before the check's answer came, the same status from wait and free.
TEST(CApiAsyncTest, BroadcastManyListsThatDifferAreAMismatchOnEveryRank) {
  RunRanks(3, [&](coll_comm* comm, int rank) {
    for (bool async : {false, true}) {
      std::vector<int32_t> a(3, rank + 10), b(rank == 2 ? 3 : 2, rank + 10);
      void* buffers[2] = {a.data(), b.data()};
      const size_t counts[2] = {a.size(), b.size()};
      coll_status status = COLL_OK;
      std::string message;
      if (async) {
        coll_work* work = nullptr;
        EXPECT_OK(coll_broadcast_many_async(comm, buffers, counts, 2, COLL_INT32, 0, 0, &work));
        status = coll_work_wait(work);
        message = coll_last_error();
        EXPECT_EQ(coll_work_free(work), status);
      } else {
        status = coll_broadcast_many(comm, buffers, counts, 2, COLL_INT32, 0, 0);
        message = coll_last_error();
      }
      EXPECT_EQ(status, COLL_MISMATCH) << "rank " << rank << " async=" << async << ": " << message;
      EXPECT_TRUE(Contains(message, async ? "coll_work_wait: " : "coll_broadcast_many: "))
          << message;
      EXPECT_TRUE(Contains(message, "rank " + std::to_string(rank) +
                                        ": packing broadcast: the list of 2 tensors differs"))
          << message;
      if (!async) {
        EXPECT_TRUE(Contains(message, "no tensor was broadcast or written")) << message;
      }
      EXPECT_EQ(std::count(a.begin(), a.end(), rank + 10), 3) << "rank " << rank;
      EXPECT_EQ(std::count(b.begin(), b.end(), rank + 10), std::ptrdiff_t(b.size()))
          << "rank " << rank;
      if (!async) {
        std::vector<int32_t> c(3, rank + 10);
        void* list[1] = {c.data()};
        const size_t sizes[1] = {c.size()};
        EXPECT_OK(coll_broadcast_many(comm, list, sizes, 1, COLL_INT32, 1, 0));
        EXPECT_EQ(std::count(c.begin(), c.end(), 11), 3) << "rank " << rank;
      }
    }
  });
}

// A watchdog's coll_comm_abort ends a wait on a handle whose collective cannot complete (the
// peer never issues it).
TEST(CApiAsyncTest, AbortFromAnotherThreadEndsAWait) {
  std::atomic<bool> rank0_done{false};
  RunRanks(2, [&](coll_comm* comm, int rank) {
    coll_work* work = nullptr;
    if (rank == 0) {
      EXPECT_OK(coll_barrier_async(comm, &work));
      std::thread watchdog([comm] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        EXPECT_OK(coll_comm_abort(comm));
      });
      EXPECT_EQ(coll_work_wait(work), COLL_ABORTED) << coll_last_error();
      watchdog.join();
      EXPECT_EQ(coll_work_free(work), COLL_ABORTED);
      rank0_done = true;
    } else {
      while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      EXPECT_OK(coll_barrier_async(comm, &work));
      const coll_status status = coll_work_wait(work);
      EXPECT_TRUE(status == COLL_ABORTED || status == COLL_PEER_LOST)
          << coll_status_string(status) << ": " << coll_last_error();
      EXPECT_EQ(coll_work_free(work), status);
    }
  });
}

// coll_comm_destroy right after an asynchronous all-reduce finishes it first; the handle,
// still valid, then reports it done and the result is in the buffer.
TEST(CApiAsyncTest, HandlesOutliveTheirCommunicator) {
  constexpr int kSize = 2;
  const uint16_t port = FreePort();
  const coll_options options = TestOptions();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kSize; ++rank) {
    threads.emplace_back([&, rank] {
      coll_comm* comm = nullptr;
      EXPECT_OK(coll_comm_create(rank, kSize, "127.0.0.1", port, &options, &comm));
      if (comm == nullptr) return;
      std::vector<float> data(1 << 20, float(rank + 1));
      coll_work* work = nullptr;
      EXPECT_OK(coll_all_reduce_async(comm, data.data(), data.data(), data.size(), COLL_FLOAT32,
                                      COLL_SUM, &work));
      EXPECT_OK(coll_comm_destroy(comm));
      int done = 0;
      EXPECT_OK(coll_work_test(work, &done));
      EXPECT_EQ(done, 1);
      EXPECT_OK(coll_work_free(work));
      EXPECT_EQ(std::count(data.begin(), data.end(), 3.0f), std::ptrdiff_t(data.size()));
    });
  }
  for (std::thread& t : threads) t.join();
}

// ---------------------------------------------------------------------------------------------
// Split and timeouts.
// ---------------------------------------------------------------------------------------------

// Four ranks split into even and odd ones, ranked by -rank (so in reverse); rank 2 of a second
// split passes a negative color and gets NULL. Each part all-reduces among its own ranks only,
// and the parent still works.
TEST(CApiSplitTest, EvenAndOddRanksRankedByKeyAndANegativeColorGetsNull) {
  constexpr int kSize = 4;
  RunRanks(kSize, [&](coll_comm* comm, int rank) {
    coll_comm* part = reinterpret_cast<coll_comm*>(uintptr_t{0x1});
    EXPECT_OK(coll_comm_split(comm, rank % 2, -rank, &part));
    ASSERT_NE(part, nullptr);
    int part_rank = -1, part_size = -1;
    EXPECT_OK(coll_comm_rank(part, &part_rank));
    EXPECT_OK(coll_comm_size(part, &part_size));
    EXPECT_EQ(part_size, 2);
    EXPECT_EQ(part_rank, rank < 2 ? 1 : 0);  // the higher rank of each parity comes first
    int64_t value = rank;
    EXPECT_OK(coll_all_reduce(part, &value, &value, 1, COLL_INT64, COLL_SUM));
    EXPECT_EQ(value, rank % 2 == 0 ? 0 + 2 : 1 + 3);

    coll_comm* other = reinterpret_cast<coll_comm*>(uintptr_t{0x1});
    EXPECT_OK(coll_comm_split(comm, rank == 2 ? -1 : 5, rank, &other));
    if (rank == 2) {
      EXPECT_EQ(other, nullptr);
    } else {
      ASSERT_NE(other, nullptr);
      int other_size = -1;
      EXPECT_OK(coll_comm_size(other, &other_size));
      EXPECT_EQ(other_size, 3);
      value = 1;
      EXPECT_OK(coll_all_reduce(other, &value, &value, 1, COLL_INT64, COLL_SUM));
      EXPECT_EQ(value, 3);
      EXPECT_OK(coll_comm_destroy(other));
    }
    value = 1;
    EXPECT_OK(coll_all_reduce(comm, &value, &value, 1, COLL_INT64, COLL_SUM));
    EXPECT_EQ(value, kSize);
    EXPECT_OK(coll_comm_destroy(part));
  });
}

TEST(CApiSplitTest, ArgumentsAreChecked) {
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  coll_comm* out = nullptr;
  EXPECT_EQ(coll_comm_split(nullptr, 0, 0, &out), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_comm_split: comm is NULL");
  EXPECT_EQ(coll_comm_split(comm, 0, 0, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_comm_split: out is NULL");
  EXPECT_OK(coll_comm_split(comm, 0, 0, &out));  // one rank: a communicator of one
  ASSERT_NE(out, nullptr);
  int size = 0;
  EXPECT_OK(coll_comm_size(out, &size));
  EXPECT_EQ(size, 1);
  EXPECT_OK(coll_comm_destroy(out));
  EXPECT_OK(coll_comm_destroy(comm));
}

// A shorter timeout set on rank 0 makes the barrier that rank 1 never joins fail well before the
// communicator's 10 s; bad values are refused and change nothing.
TEST(CApiTimeoutTest, SetTimeoutAppliesToTheNextCollectives) {
  std::atomic<bool> rank0_done{false};
  RunRanks(2, [&](coll_comm* comm, int rank) {
    if (rank == 0) {
      EXPECT_EQ(coll_comm_set_timeout(comm, 0), COLL_INVALID_ARGUMENT);
      EXPECT_EQ(std::string(coll_last_error()),
                "coll_comm_set_timeout: rank 0: timeout_ms is 0; it must be positive");
      EXPECT_EQ(coll_comm_set_timeout(comm, -5), COLL_INVALID_ARGUMENT);
      EXPECT_EQ(coll_comm_set_timeout(nullptr, 100), COLL_INVALID_ARGUMENT);
      EXPECT_OK(coll_comm_set_timeout(comm, 200));
      const auto start = std::chrono::steady_clock::now();
      EXPECT_EQ(coll_barrier(comm), COLL_TIMEOUT) << coll_last_error();
      EXPECT_LT(std::chrono::steady_clock::now() - start,
                collectives::test_time::Scaled(std::chrono::seconds(3)));
      rank0_done = true;
    } else {
      while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      const coll_status status = coll_barrier(comm);
      EXPECT_TRUE(status == COLL_TIMEOUT || status == COLL_ABORTED || status == COLL_PEER_LOST)
          << coll_status_string(status) << ": " << coll_last_error();
    }
  });
}

// INT64_MAX for "never" is read as a year, not overflowed into a deadline in the past (the next
// collective would time out at once and break the communicator).
TEST(CApiTimeoutTest, Int64MaxMeansAYear) {
  RunRanks(3, [&](coll_comm* comm, int rank) {
    EXPECT_OK(coll_comm_set_timeout(comm, INT64_MAX));
    std::vector<int64_t> data(777, rank + 1);
    EXPECT_OK(coll_all_reduce(comm, data.data(), data.data(), data.size(), COLL_INT64, COLL_SUM));
    EXPECT_EQ(std::count(data.begin(), data.end(), int64_t{6}), 777);
    EXPECT_OK(coll_barrier(comm));
  });
}

// A bad argument names the rank that passed it, as every message of the library does: in a job
// whose ranks log to one place, "dtype 99" alone does not say which rank to look at. Each rank
// fails alone (nothing is issued), so no rank waits for another.
TEST(CApiErrorTest, ArgumentErrorsNameTheRank) {
  RunRanks(3, [&](coll_comm* comm, int rank) {
    const std::string who = ": rank " + std::to_string(rank) + ": ";
    float x = 0;
    coll_work* work = nullptr;
    EXPECT_EQ(coll_all_reduce(comm, &x, &x, 1, static_cast<coll_dtype>(99), COLL_SUM),
              COLL_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(coll_last_error()),
              "coll_all_reduce" + who + "dtype 99 is not a coll_dtype (valid: 0..7)");
    EXPECT_EQ(
        coll_reduce_scatter_async(comm, &x, &x, 1, COLL_FLOAT32, static_cast<coll_op>(42), &work),
        COLL_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(coll_last_error()),
              "coll_reduce_scatter_async" + who + "op 42 is not a coll_op (valid: 0..4)");
    EXPECT_EQ(coll_all_gather(comm, &x, &x, SIZE_MAX / 2, COLL_FLOAT32), COLL_INVALID_ARGUMENT);
    EXPECT_TRUE(Contains(coll_last_error(), "coll_all_gather" + who + "count_per_rank = "))
        << coll_last_error();
    EXPECT_EQ(coll_all_reduce_many(comm, nullptr, nullptr, 1, COLL_FLOAT32, COLL_SUM, 0),
              COLL_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(coll_last_error()), "coll_all_reduce_many" + who + "buffers is NULL");
    EXPECT_EQ(coll_comm_set_timeout(comm, -1), COLL_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(coll_last_error()),
              "coll_comm_set_timeout" + who + "timeout_ms is -1; it must be positive");
    // Found by the C++ layer: named there already, and once.
    EXPECT_EQ(coll_broadcast(comm, &x, &x, 1, COLL_FLOAT32, 7), COLL_INVALID_ARGUMENT);
    EXPECT_TRUE(Contains(coll_last_error(), "coll_broadcast" + who)) << coll_last_error();
    EXPECT_FALSE(Contains(coll_last_error(), who + "rank ")) << coll_last_error();
    EXPECT_OK(coll_barrier(comm));  // nothing was issued before: the ranks still agree
  });
}

TEST(CApiErrorTest, CountsThatDifferAcrossRanksAreAMismatchThatSticks) {
  std::atomic<int> mismatches{0};
  RunRanks(2, [&](coll_comm* comm, int rank) {
    std::vector<float> data(rank == 0 ? 10 : 12, 1.0f);
    const coll_status status =
        coll_all_reduce(comm, data.data(), data.data(), data.size(), COLL_FLOAT32, COLL_SUM);
    const std::string message = coll_last_error();
    EXPECT_NE(status, COLL_OK) << "rank " << rank;
    if (status == COLL_MISMATCH) {
      ++mismatches;
      EXPECT_TRUE(Contains(message, "coll_all_reduce: ")) << message;
      EXPECT_TRUE(Contains(message, "does not match")) << message;
      EXPECT_TRUE(Contains(message, "all_reduce(f32, sum, count=1")) << message;
    } else {
      // The rank that did not see the mismatch first learns of it from its peer.
      EXPECT_TRUE(status == COLL_ABORTED || status == COLL_PEER_LOST)
          << coll_status_string(status) << ": " << message;
    }
    // The communicator is broken: later calls return the same status.
    EXPECT_EQ(coll_barrier(comm), status) << coll_last_error();
  });
  EXPECT_GE(mismatches.load(), 1);
}

TEST(CApiErrorTest, AbortFromAnotherThreadEndsABlockedCollective) {
  std::atomic<bool> rank0_done{false};
  RunRanks(2, [&](coll_comm* comm, int rank) {
    if (rank == 0) {
      // Rank 1 never enters this barrier; a watchdog aborts it.
      std::thread watchdog([comm] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        EXPECT_OK(coll_comm_abort(comm));
      });
      EXPECT_EQ(coll_barrier(comm), COLL_ABORTED) << coll_last_error();
      watchdog.join();
      EXPECT_OK(coll_comm_abort(comm));  // idempotent
      EXPECT_EQ(coll_barrier(comm), COLL_ABORTED);
      rank0_done = true;
    } else {
      while (!rank0_done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      const coll_status status = coll_barrier(comm);
      EXPECT_TRUE(status == COLL_ABORTED || status == COLL_PEER_LOST)
          << coll_status_string(status) << ": " << coll_last_error();
    }
  });
}

TEST(CApiErrorTest, OutOfMemoryIsASystemStatusNotAnException) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizer allocators abort on a huge allocation instead of throwing";
#else
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  float x = 0;
  void* buffers[1] = {&x};
  const size_t counts[1] = {1};
  // 2^40 list entries: the list of tensors cannot be allocated (no buffer is read before).
  EXPECT_EQ(coll_all_reduce_many(comm, buffers, counts, size_t{1} << 40, COLL_FLOAT32, COLL_SUM, 0),
            COLL_SYSTEM);
  EXPECT_TRUE(Contains(coll_last_error(), "out of memory")) << coll_last_error();
  EXPECT_OK(coll_comm_destroy(comm));
#endif
}

// A count of tensors no list can hold (an uninitialised n, say) is the caller's invalid
// argument, not "a bug in this library" (std::length_error from the list's reserve).
TEST(CApiErrorTest, ACountOfTensorsNoListCanHoldIsAnInvalidArgument) {
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  float x = 0;
  void* buffers[1] = {&x};
  const size_t counts[1] = {1};
  EXPECT_EQ(coll_all_reduce_many(comm, buffers, counts, SIZE_MAX, COLL_FLOAT32, COLL_SUM, 0),
            COLL_INVALID_ARGUMENT);
  EXPECT_TRUE(Contains(coll_last_error(), "n is " + std::to_string(SIZE_MAX))) << coll_last_error();
  EXPECT_OK(coll_comm_destroy(comm));
}

TEST(CApiErrorTest, StatusStringsNameEveryStatus) {
  const std::map<coll_status, std::string> names = {
      {COLL_OK, "ok"},
      {COLL_INVALID_ARGUMENT, "invalid argument"},
      {COLL_INVALID_USAGE, "invalid usage"},
      {COLL_SYSTEM, "system error"},
      {COLL_PEER_LOST, "peer lost"},
      {COLL_MISMATCH, "mismatch"},
      {COLL_TIMEOUT, "timeout"},
      {COLL_UNAUTHENTICATED, "unauthenticated"},
      {COLL_ABORTED, "aborted"},
      {COLL_NOT_SUPPORTED, "not supported"},
      {COLL_INTERNAL, "internal error"},
  };
  for (int value = COLL_OK; value <= COLL_INTERNAL; ++value) {
    const auto status = static_cast<coll_status>(value);
    ASSERT_EQ(names.count(status), 1u) << value;
    EXPECT_EQ(std::string(coll_status_string(status)), names.at(status)) << value;
  }
  EXPECT_EQ(std::string(coll_status_string(static_cast<coll_status>(11))), "unknown status");
  EXPECT_EQ(std::string(coll_status_string(static_cast<coll_status>(1000))), "unknown status");
}

TEST(CApiErrorTest, LastErrorIsPerThreadAndKeptOverSuccesses) {
  std::string other_before, other_after;
  std::thread([] { EXPECT_EQ(coll_options_init(nullptr), COLL_INVALID_ARGUMENT); }).join();
  // A new thread has no error yet, whatever other threads did.
  std::thread([&] {
    other_before = coll_last_error();
    EXPECT_EQ(coll_barrier(nullptr), COLL_INVALID_ARGUMENT);
    other_after = coll_last_error();
  }).join();
  EXPECT_EQ(other_before, "");
  EXPECT_EQ(other_after, "coll_barrier: comm is NULL");

  EXPECT_EQ(coll_comm_rank(nullptr, nullptr), COLL_INVALID_ARGUMENT);
  const std::string mine = coll_last_error();
  EXPECT_TRUE(Contains(mine, "coll_comm_rank: ")) << mine;
  std::thread([] { EXPECT_EQ(coll_barrier(nullptr), COLL_INVALID_ARGUMENT); }).join();
  EXPECT_EQ(std::string(coll_last_error()), mine);  // another thread's failure is not mine
  coll_options options;
  EXPECT_OK(coll_options_init(&options));
  EXPECT_EQ(std::string(coll_last_error()), mine);  // a success does not clear it
}

// ---------------------------------------------------------------------------------------------
// Rooted collectives, all-to-all, and point to point, per world size.
// ---------------------------------------------------------------------------------------------

class CApiRootedTest : public ::testing::TestWithParam<int> {};

// What an output buffer holds beforehand where the call must not write: no result equals it.
constexpr double kUntouched = 99;

void FillWith(DataType dtype, std::vector<uint8_t>& buffer, size_t count, double value) {
  for (size_t i = 0; i < count; ++i) Store(dtype, buffer.data(), i, value);
}

TEST_P(CApiRootedTest, ReduceEveryDtypeAndOpToTheFirstAndLastRoot) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    for (int root : {0, size - 1}) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{17000}}) {
        for (int d = 0; d < collectives::kNumDataTypes; ++d) {
          for (int o = 0; o < collectives::kNumReduceOps; ++o) {
            for (bool in_place : {false, true}) {
              const auto dtype = static_cast<DataType>(d);
              const auto op = static_cast<ReduceOp>(o);
              std::vector<uint8_t> send = Buffer(dtype, count), recv = Buffer(dtype, count);
              std::vector<uint8_t>& input = in_place ? recv : send;
              Fill(dtype, op, rank, input.data(), count);
              // Off the root recvbuff is not used: NULL there when out of place.
              void* recvbuff = in_place || rank == root ? recv.data() : nullptr;
              EXPECT_OK(coll_reduce(comm, input.data(), recvbuff, count, C(dtype), C(op), root));
              const std::string what = Describe("reduce", rank, dtype, op, count, in_place) +
                                       " root=" + std::to_string(root);
              if (rank == root) {
                ExpectElements(what, dtype, recv, count,
                               [&](size_t i) { return Expected(op, dtype, size, i); });
              } else {
                ExpectElements(what + " (input unchanged)", dtype, input, count, [&](size_t i) {
                  return Stored(dtype, InputValue(op, dtype, rank, i));
                });
              }
            }
          }
        }
      }
    }
  });
}

TEST_P(CApiRootedTest, GatherToEveryRoot) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    for (int root = 0; root < size; ++root) {
      for (DataType dtype : {DataType::kFloat32, DataType::kFloat64, DataType::kInt8,
                             DataType::kInt64, DataType::kFloat16}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{10007}}) {
          for (bool in_place : {false, true}) {
            const size_t total = count * size_t(size);
            std::vector<uint8_t> send = Buffer(dtype, count), recv = Buffer(dtype, total);
            FillWith(dtype, recv, total, kUntouched);
            // In place on the root: its block of recvbuff is the input.
            uint8_t* input = in_place && rank == root
                                 ? recv.data() + size_t(rank) * count * SizeOf(dtype)
                                 : send.data();
            Fill(dtype, ReduceOp::kSum, rank, input, count);
            void* recvbuff = rank == root ? recv.data() : nullptr;
            EXPECT_OK(coll_gather(comm, input, recvbuff, count, C(dtype), root));
            ExpectElements(Describe("gather", rank, dtype, ReduceOp::kSum, count, in_place) +
                               " root=" + std::to_string(root),
                           dtype, recv, total, [&](size_t i) {
                             if (rank != root) return Stored(dtype, kUntouched);
                             return Stored(dtype, InputValue(ReduceOp::kSum, dtype, int(i / count),
                                                             i % count));
                           });
          }
        }
      }
    }
  });
}

TEST_P(CApiRootedTest, ScatterFromEveryRoot) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    for (int root = 0; root < size; ++root) {
      for (DataType dtype : {DataType::kFloat32, DataType::kFloat64, DataType::kUInt8,
                             DataType::kInt32, DataType::kBFloat16}) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{10007}}) {
          for (bool in_place : {false, true}) {
            const size_t total = count * size_t(size);
            std::vector<uint8_t> send = Buffer(dtype, total), recv = Buffer(dtype, count);
            FillWith(dtype, recv, count, kUntouched);
            // The root's send holds block r = InputValue(root, r * count + i).
            if (rank == root) Fill(dtype, ReduceOp::kSum, root, send.data(), total);
            // In place on the root: the result is its own block of sendbuff, left as it is.
            uint8_t* output = in_place && rank == root
                                  ? send.data() + size_t(rank) * count * SizeOf(dtype)
                                  : recv.data();
            const void* sendbuff = rank == root ? send.data() : nullptr;
            EXPECT_OK(coll_scatter(comm, sendbuff, output, count, C(dtype), root));
            std::vector<uint8_t> result(output, output + count * SizeOf(dtype));
            result.push_back(recv.back());
            ExpectElements(Describe("scatter", rank, dtype, ReduceOp::kSum, count, in_place) +
                               " root=" + std::to_string(root),
                           dtype, result, count, [&](size_t i) {
                             return Stored(dtype, InputValue(ReduceOp::kSum, dtype, root,
                                                             size_t(rank) * count + i));
                           });
          }
        }
      }
    }
  });
}

// Elements rank `src` sends to rank `dst` in the uneven all-to-all: 0 for some pairs.
size_t UnevenCount(size_t count, int src, int dst) {
  return (count * size_t(src + 2 * dst + 1)) % (count + 3);
}

TEST_P(CApiRootedTest, AllToAllEqualAndUnevenBlocks) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    const size_t n = size_t(size);
    for (DataType dtype : {DataType::kFloat32, DataType::kFloat64, DataType::kInt8,
                           DataType::kInt64, DataType::kFloat16}) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{10007}}) {
        const std::string what = Describe("all_to_all", rank, dtype, ReduceOp::kSum, count, false);
        // Equal blocks: element k of rank j's send is InputValue(j, k).
        std::vector<uint8_t> send = Buffer(dtype, n * count), recv = Buffer(dtype, n * count);
        Fill(dtype, ReduceOp::kSum, rank, send.data(), n * count);
        EXPECT_OK(
            coll_all_to_all(comm, send.data(), recv.data(), count, nullptr, nullptr, C(dtype)));
        ExpectElements(what, dtype, recv, n * count, [&](size_t k) {
          return Stored(dtype, InputValue(ReduceOp::kSum, dtype, int(k / count),
                                          size_t(rank) * count + k % count));
        });
        // Uneven blocks, some empty.
        std::vector<size_t> send_counts(n), recv_counts(n), want;
        size_t send_total = 0, recv_total = 0;
        for (int j = 0; j < size; ++j) {
          send_counts[size_t(j)] = UnevenCount(count, rank, j);
          recv_counts[size_t(j)] = UnevenCount(count, j, rank);
          send_total += send_counts[size_t(j)];
          recv_total += recv_counts[size_t(j)];
          size_t offset_in_j = 0;  // where rank j's block for this rank starts in j's send
          for (int d = 0; d < rank; ++d) offset_in_j += UnevenCount(count, j, d);
          for (size_t t = 0; t < recv_counts[size_t(j)]; ++t) {
            want.push_back(size_t(j) << 32 | (offset_in_j + t));
          }
        }
        std::vector<uint8_t> usend = Buffer(dtype, send_total), urecv = Buffer(dtype, recv_total);
        Fill(dtype, ReduceOp::kSum, rank, usend.data(), send_total);
        EXPECT_OK(coll_all_to_all(comm, usend.data(), urecv.data(), 0, send_counts.data(),
                                  recv_counts.data(), C(dtype)));
        ExpectElements("uneven " + what, dtype, urecv, recv_total, [&](size_t k) {
          return Stored(
              dtype, InputValue(ReduceOp::kSum, dtype, int(want[k] >> 32), want[k] & 0xffffffffu));
        });
      }
    }
  });
}

// Around the ring, twice with two tags: rank 0 sends first and the others receive first, so the
// blocking calls form a chain; then the same with the asynchronous forms, all issued before any
// is waited on.
TEST_P(CApiRootedTest, SendAndRecvAroundTheRing) {
  const int size = GetParam();
  if (size == 1) GTEST_SKIP() << "point to point needs two ranks";
  RunRanks(size, [size](coll_comm* comm, int rank) {
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    for (DataType dtype : {DataType::kFloat32, DataType::kInt64, DataType::kBFloat16}) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{100003}}) {
        std::vector<uint8_t> out1 = Buffer(dtype, count), out2 = Buffer(dtype, count);
        std::vector<uint8_t> in1 = Buffer(dtype, count), in2 = Buffer(dtype, count);
        Fill(dtype, ReduceOp::kSum, rank, out1.data(), count);
        Fill(dtype, ReduceOp::kSum, rank + 10, out2.data(), count);
        auto sends = [&] {
          EXPECT_OK(coll_send(comm, out1.data(), count, C(dtype), next, 1));
          EXPECT_OK(coll_send(comm, out2.data(), count, C(dtype), next, 2));
        };
        auto recvs = [&] {
          EXPECT_OK(coll_recv(comm, in1.data(), count, C(dtype), prev, 1));
          EXPECT_OK(coll_recv(comm, in2.data(), count, C(dtype), prev, 2));
        };
        if (rank == 0) {
          sends();
          recvs();
        } else {
          recvs();
          sends();
        }
        const std::string what = Describe("recv", rank, dtype, ReduceOp::kSum, count, false);
        auto from = [&](int sender) {
          return
              [=](size_t i) { return Stored(dtype, InputValue(ReduceOp::kSum, dtype, sender, i)); };
        };
        ExpectElements(what + " #1", dtype, in1, count, from(prev));
        ExpectElements(what + " #2", dtype, in2, count, from(prev + 10));

        std::vector<uint8_t> in3 = Buffer(dtype, count);
        coll_work* first = nullptr;
        coll_work* second = nullptr;
        if (rank == 0) {
          EXPECT_OK(coll_send_async(comm, out2.data(), count, C(dtype), next, 3, &first));
          EXPECT_OK(coll_recv_async(comm, in3.data(), count, C(dtype), prev, 3, &second));
        } else {
          EXPECT_OK(coll_recv_async(comm, in3.data(), count, C(dtype), prev, 3, &first));
          EXPECT_OK(coll_send_async(comm, out2.data(), count, C(dtype), next, 3, &second));
        }
        EXPECT_OK(coll_work_wait(second));
        EXPECT_OK(coll_work_free(second));
        EXPECT_OK(coll_work_free(first));
        ExpectElements(what + " async", dtype, in3, count, from(prev + 10));
      }
    }
  });
}

// The asynchronous forms of the rooted collectives and the all-to-all, all in flight at once,
// then waited on in reverse order.
TEST_P(CApiRootedTest, AsyncRootedCollectivesInFlightTogether) {
  const int size = GetParam();
  RunRanks(size, [size](coll_comm* comm, int rank) {
    const size_t n = size_t(size), count = 1001;
    const int root = size - 1;
    const DataType dtype = DataType::kInt32;
    std::vector<uint8_t> reduce_in = Buffer(dtype, count), reduce_out = Buffer(dtype, count);
    std::vector<uint8_t> gather_in = Buffer(dtype, count), gather_out = Buffer(dtype, n * count);
    std::vector<uint8_t> scatter_in = Buffer(dtype, n * count), scatter_out = Buffer(dtype, count);
    std::vector<uint8_t> a2a_in = Buffer(dtype, n * count), a2a_out = Buffer(dtype, n * count);
    Fill(dtype, ReduceOp::kMax, rank, reduce_in.data(), count);
    Fill(dtype, ReduceOp::kSum, rank, gather_in.data(), count);
    Fill(dtype, ReduceOp::kSum, rank, scatter_in.data(), n * count);
    Fill(dtype, ReduceOp::kSum, rank, a2a_in.data(), n * count);
    coll_work* works[4] = {};
    EXPECT_OK(coll_reduce_async(comm, reduce_in.data(), reduce_out.data(), count, COLL_INT32,
                                COLL_MAX, root, &works[0]));
    EXPECT_OK(coll_gather_async(comm, gather_in.data(), gather_out.data(), count, COLL_INT32, root,
                                &works[1]));
    EXPECT_OK(coll_scatter_async(comm, scatter_in.data(), scatter_out.data(), count, COLL_INT32,
                                 root, &works[2]));
    EXPECT_OK(coll_all_to_all_async(comm, a2a_in.data(), a2a_out.data(), count, nullptr, nullptr,
                                    COLL_INT32, &works[3]));
    for (int k = 3; k >= 0; --k) {
      EXPECT_OK(coll_work_wait(works[k]));
      EXPECT_OK(coll_work_free(works[k]));
    }
    auto input = [&](int r, size_t i) { return InputValue(ReduceOp::kSum, dtype, r, i); };
    if (rank == root) {
      ExpectElements("reduce_async", dtype, reduce_out, count,
                     [&](size_t i) { return Expected(ReduceOp::kMax, dtype, size, i); });
      ExpectElements("gather_async", dtype, gather_out, n * count,
                     [&](size_t k) { return input(int(k / count), k % count); });
    }
    ExpectElements("scatter_async", dtype, scatter_out, count,
                   [&](size_t i) { return input(root, size_t(rank) * count + i); });
    ExpectElements("all_to_all_async", dtype, a2a_out, n * count, [&](size_t k) {
      return input(int(k / count), size_t(rank) * count + k % count);
    });
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CApiRootedTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& param_info) {
                           return "world" + std::to_string(param_info.param);
                         });

// The arguments the C API itself checks (NULL comm, enum values, the all-to-all's count arrays,
// sizes that overflow) and those the communicator checks (roots, peers, NULL buffers with
// elements) return COLL_INVALID_ARGUMENT naming them, the rank once the communicator is known,
// with no handle and nothing queued.
TEST(CApiRootedErrorTest, BadArgumentsAreInvalidArgumentsNamingThem) {
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  float x[4] = {1, 2, 3, 4};
  float y[4] = {0, 0, 0, 0};
  const size_t one[1] = {4};
  const size_t huge[1] = {SIZE_MAX / 2};
  const coll_dtype bad_dtype = static_cast<coll_dtype>(99);
  const coll_op bad_op = static_cast<coll_op>(42);
  struct Case {
    std::function<coll_status()> call;
    std::string expect;
  };
  const Case cases[] = {
      {[&] { return coll_reduce(nullptr, x, y, 4, COLL_FLOAT32, COLL_SUM, 0); },
       "coll_reduce: comm is NULL"},
      {[&] { return coll_gather(nullptr, x, y, 4, COLL_FLOAT32, 0); }, "coll_gather: comm is NULL"},
      {[&] { return coll_scatter(nullptr, x, y, 4, COLL_FLOAT32, 0); },
       "coll_scatter: comm is NULL"},
      {[&] { return coll_all_to_all(nullptr, x, y, 4, nullptr, nullptr, COLL_FLOAT32); },
       "coll_all_to_all: comm is NULL"},
      {[&] { return coll_send(nullptr, x, 4, COLL_FLOAT32, 0, 0); }, "coll_send: comm is NULL"},
      {[&] { return coll_recv(nullptr, y, 4, COLL_FLOAT32, 0, 0); }, "coll_recv: comm is NULL"},
      {[&] { return coll_reduce(comm, x, y, 4, bad_dtype, COLL_SUM, 0); },
       "coll_reduce: rank 0: dtype 99"},
      {[&] { return coll_reduce(comm, x, y, 4, COLL_FLOAT32, bad_op, 0); },
       "coll_reduce: rank 0: op 42"},
      {[&] { return coll_gather(comm, x, y, 4, bad_dtype, 0); }, "coll_gather: rank 0: dtype 99"},
      {[&] { return coll_scatter(comm, x, y, 4, bad_dtype, 0); }, "coll_scatter: rank 0: dtype 99"},
      {[&] { return coll_all_to_all(comm, x, y, 4, nullptr, nullptr, bad_dtype); },
       "coll_all_to_all: rank 0: dtype 99"},
      {[&] { return coll_send(comm, x, 4, bad_dtype, 0, 0); }, "coll_send: rank 0: dtype 99"},
      {[&] { return coll_recv(comm, y, 4, bad_dtype, 0, 0); }, "coll_recv: rank 0: dtype 99"},
      // The all-to-all's count arrays: both or neither, count_per_rank 0 with them, sums that fit.
      {[&] { return coll_all_to_all(comm, x, y, 0, one, nullptr, COLL_FLOAT32); },
       "coll_all_to_all: rank 0: recv_counts is NULL but send_counts is not"},
      {[&] { return coll_all_to_all(comm, x, y, 0, nullptr, one, COLL_FLOAT32); },
       "coll_all_to_all: rank 0: send_counts is NULL but recv_counts is not"},
      {[&] { return coll_all_to_all(comm, x, y, 4, one, one, COLL_FLOAT32); },
       "coll_all_to_all: rank 0: count_per_rank is 4, not 0"},
      {[&] { return coll_all_to_all(comm, x, y, 0, huge, one, COLL_FLOAT32); },
       "coll_all_to_all: rank 0: sendbuff has"},
      // Sizes whose bytes overflow size_t.
      {[&] { return coll_reduce(comm, x, y, SIZE_MAX / 2, COLL_FLOAT32, COLL_SUM, 0); },
       "more bytes than size_t holds"},
      {[&] { return coll_gather(comm, x, y, SIZE_MAX / 2, COLL_FLOAT32, 0); },
       "more bytes than size_t holds"},
      {[&] { return coll_send(comm, x, SIZE_MAX / 2, COLL_FLOAT32, 0, 0); },
       "more bytes than size_t holds"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.call(), COLL_INVALID_ARGUMENT) << c.expect;
    EXPECT_TRUE(Contains(coll_last_error(), c.expect)) << c.expect << " / " << coll_last_error();
  }
  // The same through the asynchronous forms: no handle.
  coll_work* junk = reinterpret_cast<coll_work*>(uintptr_t{0x1});
  const std::vector<std::pair<std::string, std::function<coll_status(coll_work**)>>> async = {
      {"coll_reduce_async: rank 0: dtype 99",
       [&](coll_work** w) { return coll_reduce_async(comm, x, y, 4, bad_dtype, COLL_SUM, 0, w); }},
      {"coll_gather_async: rank 0: dtype 99",
       [&](coll_work** w) { return coll_gather_async(comm, x, y, 4, bad_dtype, 0, w); }},
      {"coll_scatter_async: rank 0: dtype 99",
       [&](coll_work** w) { return coll_scatter_async(comm, x, y, 4, bad_dtype, 0, w); }},
      {"coll_all_to_all_async: rank 0: recv_counts is NULL",
       [&](coll_work** w) {
         return coll_all_to_all_async(comm, x, y, 0, one, nullptr, COLL_FLOAT32, w);
       }},
      {"coll_send_async: rank 0: dtype 99",
       [&](coll_work** w) { return coll_send_async(comm, x, 4, bad_dtype, 0, 0, w); }},
      {"coll_recv_async: rank 0: dtype 99",
       [&](coll_work** w) { return coll_recv_async(comm, y, 4, bad_dtype, 0, 0, w); }},
  };
  for (const auto& [expect, call] : async) {
    coll_work* work = junk;
    EXPECT_EQ(call(&work), COLL_INVALID_ARGUMENT) << expect;
    EXPECT_TRUE(Contains(coll_last_error(), expect)) << expect << " / " << coll_last_error();
    EXPECT_EQ(work, nullptr) << expect;
  }
  EXPECT_EQ(coll_send_async(comm, x, 4, COLL_FLOAT32, 0, 0, nullptr), COLL_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(coll_last_error()), "coll_send_async: work is NULL");
  EXPECT_EQ(y[0], 0.0f);  // nothing written
  EXPECT_OK(coll_comm_destroy(comm));
}

// Checks the communicator makes (the rank's own implementation): a root or a peer that is no
// rank, a NULL buffer with elements. The message names the rank and the argument.
TEST(CApiRootedErrorTest, RootsPeersAndNullBuffersAreCheckedByTheCommunicator) {
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  float x[4] = {1, 2, 3, 4};
  float y[4] = {0, 0, 0, 0};
  struct Case {
    std::function<coll_status()> call;
    std::string expect;
  };
  const Case cases[] = {
      {[&] { return coll_reduce(comm, x, y, 4, COLL_FLOAT32, COLL_SUM, 1); }, "root 1"},
      {[&] { return coll_gather(comm, x, y, 4, COLL_FLOAT32, -1); }, "root -1"},
      {[&] { return coll_scatter(comm, x, y, 4, COLL_FLOAT32, 2); }, "root 2"},
      {[&] { return coll_send(comm, x, 4, COLL_FLOAT32, 1, 0); }, "peer 1"},
      {[&] { return coll_recv(comm, y, 4, COLL_FLOAT32, -3, 0); }, "peer -3"},
      {[&] { return coll_send(comm, x, 4, COLL_FLOAT32, 0, 0); }, "peer 0 is this rank"},
      {[&] { return coll_reduce(comm, nullptr, y, 4, COLL_FLOAT32, COLL_SUM, 0); }, "null"},
      {[&] { return coll_all_to_all(comm, x, nullptr, 4, nullptr, nullptr, COLL_FLOAT32); },
       "null"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.call(), COLL_INVALID_ARGUMENT) << c.expect;
    EXPECT_TRUE(Contains(coll_last_error(), c.expect)) << c.expect << " / " << coll_last_error();
    EXPECT_TRUE(Contains(coll_last_error(), ": rank 0: ")) << coll_last_error();
  }
  EXPECT_EQ(y[0], 0.0f);  // nothing written
  // None of them ran: the communicator still works.
  EXPECT_OK(coll_reduce(comm, x, y, 4, COLL_FLOAT32, COLL_SUM, 0));
  EXPECT_EQ(y[3], 4.0f);
  EXPECT_OK(coll_comm_destroy(comm));
}

// Arguments that differ across ranks: a receive whose tag differs from its send's, and
// all-to-all count arrays that disagree, return COLL_MISMATCH, with nothing written; the
// communicator is then broken on every rank.
TEST(CApiRootedErrorTest, TagsAndCountArraysThatDisagreeAreAMismatch) {
  RunRanks(2, [](coll_comm* comm, int rank) {
    float x[4] = {1, 2, 3, 4};
    float y[4] = {0, 0, 0, 0};
    if (rank == 0) {
      const coll_status sent = coll_send(comm, x, 4, COLL_FLOAT32, 1, 1);
      // The send may complete before the receiver compares; the barrier after it fails then.
      if (sent == COLL_OK) {
        EXPECT_STATUS(COLL_MISMATCH, coll_barrier(comm));
      } else {
        EXPECT_EQ(sent, COLL_MISMATCH) << coll_last_error();
      }
    } else {
      EXPECT_STATUS(COLL_MISMATCH, coll_recv(comm, y, 4, COLL_FLOAT32, 0, 2));
      EXPECT_TRUE(Contains(coll_last_error(), "coll_recv: rank 1")) << coll_last_error();
      EXPECT_EQ(y[0], 0.0f);
    }
  });
  RunRanks(2, [](coll_comm* comm, int rank) {
    int32_t send[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int32_t recv[8] = {};
    // Rank 0 expects 3 elements from rank 1, which sends it 2; the rest agrees.
    const size_t send_counts[2][2] = {{1, 3}, {2, 2}};
    const size_t recv_counts[2][2] = {{1, 3}, {3, 2}};
    EXPECT_STATUS(COLL_MISMATCH, coll_all_to_all(comm, send, recv, 0, send_counts[rank],
                                                 recv_counts[rank], COLL_INT32));
    for (int32_t v : recv) EXPECT_EQ(v, 0) << "rank " << rank;
  });
}

}  // namespace
