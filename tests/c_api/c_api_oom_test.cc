// The C API when memory runs out: every allocation of the calling thread can be made to fail
// (this binary replaces the global operator new), the n-th one for n = 1, 2, ... until a call
// runs to its end without meeting the failure. Whichever allocation fails (parsing TF_CONFIG,
// building the error's text, recording it as the last error), the call returns a status (the
// argument's error, or COLL_SYSTEM with "out of memory") and coll_last_error names it: no
// exception crosses the API and the process does not end. And an asynchronous packed call whose
// allocation fails after part of it was queued fails every rank, naming the failure.
//
// Not covered: a TF_CONFIG that parses into a non-empty JSON object. nlohmann::json's destructor
// (noexcept) allocates a stack to free nested values, so a failure there ends any process that
// uses the library; the malformed TF_CONFIG here fails before any value is built.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "collectives/c_api.h"
#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "src/c_api/c_api_internal.h"
#include "tests/replaced_operator_new.h"

namespace {

// Allocations this thread may still make before one fails; negative: no limit.
thread_local int64_t t_allocations_left = -1;
// Whether an allocation failed since the limit was set.
thread_local bool t_failed = false;

// Every allocation's hook (replaced_operator_new.h), from the start of the binary.
void FailWhenNoneLeft() {
  if (t_allocations_left == 0) {
    t_failed = true;
    t_allocations_left = -1;  // one failure per call: what follows must still cope
    throw std::bad_alloc();
  }
  if (t_allocations_left > 0) --t_allocations_left;
}
[[maybe_unused]] const bool kHooked =
    (collectives::testing::before_allocation = FailWhenNoneLeft, true);

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Runs `call` with its n-th allocation failing, for n = 0, 1, ... until it ran out of
// allocations no more; each run must return `expected` with a message holding `expected_text`,
// or COLL_SYSTEM with "out of memory". Returns how many runs met a failure.
template <typename Call>
int FailEachAllocation(const char* function, coll_status expected, const std::string& expected_text,
                       Call&& call) {
  for (int64_t n = 0;; ++n) {
    t_failed = false;
    t_allocations_left = n;
    const coll_status status = call();
    t_allocations_left = -1;
    const std::string error = coll_last_error();
    if (status == COLL_SYSTEM) {
      EXPECT_TRUE(t_failed) << "allocation " << n << ": " << error;
      EXPECT_TRUE(Contains(error, "out of memory")) << "allocation " << n << ": " << error;
    } else {
      EXPECT_EQ(status, expected) << "allocation " << n << ": " << error;
      // The text may be cut short by the failure, never wrong: the full text, or what
      // SetLastError keeps when recording it failed.
      EXPECT_TRUE(Contains(error, std::string(function) + ": ") || error == "out of memory")
          << "allocation " << n << ": " << error;
      if (!t_failed) {
        EXPECT_TRUE(Contains(error, expected_text)) << error;
        return static_cast<int>(n);
      }
    }
    if (n > 100000) {
      ADD_FAILURE() << function << " still allocates after " << n << " allocations";
      return static_cast<int>(n);
    }
  }
}

TEST(CApiOutOfMemoryTest, AMalformedTfConfigReturnsAStatusWhateverAllocationFails) {
  coll_options options;
  ASSERT_EQ(coll_options_init(&options), COLL_OK);
  const int runs = FailEachAllocation(
      "coll_comm_create_from_tf_config", COLL_INVALID_ARGUMENT, "TF_CONFIG", [&] {
        coll_comm* comm = nullptr;
        const coll_status status = coll_comm_create_from_tf_config("not json", &options, &comm);
        EXPECT_EQ(comm, nullptr);
        return status;
      });
  EXPECT_GT(runs, 3);  // the call allocates: the failures above were met
}

TEST(CApiOutOfMemoryTest, AMalformedMasterAddressReturnsAStatusWhateverAllocationFails) {
  coll_options options;
  ASSERT_EQ(coll_options_init(&options), COLL_OK);
  const int runs =
      FailEachAllocation("coll_comm_create", COLL_INVALID_ARGUMENT, "master_addr", [&] {
        coll_comm* comm = nullptr;
        const coll_status status = coll_comm_create(1, 2, "10.0.0.1:29500", 29500, &options, &comm);
        EXPECT_EQ(comm, nullptr);
        return status;
      });
  EXPECT_GT(runs, 3);
}

// A packed broadcast refused after its list was built (a root that is no rank): whichever
// allocation fails (the list, a buffer's name, the packer's checks, the message), a status.
TEST(CApiOutOfMemoryTest, ABroadcastManyToNoRankReturnsAStatusWhateverAllocationFails) {
  coll_comm* comm = nullptr;
  ASSERT_EQ(coll_comm_create(0, 1, nullptr, 0, nullptr, &comm), COLL_OK);
  float x[3] = {1, 2, 3};
  void* buffers[3] = {&x[0], &x[1], &x[2]};
  const size_t counts[3] = {1, 1, 1};
  const int runs = FailEachAllocation("coll_broadcast_many", COLL_INVALID_ARGUMENT, "root 5", [&] {
    return coll_broadcast_many(comm, buffers, counts, 3, COLL_FLOAT32, 5, 0);
  });
  EXPECT_GT(runs, 3);
  EXPECT_EQ(coll_comm_destroy(comm), COLL_OK);
}

// Rank 1's packed call (the list check, then a fused bucket and a tensor alone in its bucket:
// three collectives) with its n-th allocation failing, for n = 0, 1, ... until it runs to its
// end; rank 0 makes the same call without failures. Rank 1's call returns COLL_SYSTEM "out of
// memory" (an asynchronous one with no handle), or COLL_OK. Then rank 1 makes the call again.
// When nothing was issued, both ranks' calls complete with the sum. When part of the call was
// issued, the communicator is aborted naming the failure: rank 0's call returns it at once (not
// a mismatch with rank 1's next call, nor a timeout), and so does rank 1's next call.
void ExpectAPartlyIssuedCallFailsEveryRankSayingSo(bool broadcast, bool async) {
  const std::string collective = broadcast ? "broadcast" : "all_reduce";
  bool met_a_partial_call = false;
  for (int64_t n = 0;; ++n) {
    const std::string what = collective + (async ? " async" : " blocking") + " with allocation " +
                             std::to_string(n) + " failing";
    auto store = collectives::CreateMemoryStore();
    coll_status first = COLL_OK;  // rank 1's call that meets the failure
    bool failed = false;          // whether it did
    coll_status status[2] = {COLL_OK, COLL_OK};
    std::string message[2];
    float sums[2] = {0, 0};
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        collectives::ClusterSpec spec;
        spec.rank = rank;
        spec.world_size = 2;
        spec.master_port = 1;  // unused: the store is given
        collectives::CommunicationOptions options;
        options.timeout = std::chrono::milliseconds(5000);
        coll_comm* comm = collectives::c_api::WrapCommunication(
            collectives::CreateCommunication(spec, store, options));
        std::vector<float> a(3, float(rank + 1)), b(5, float(rank + 1)), c(300, float(rank + 1));
        void* buffers[3] = {a.data(), b.data(), c.data()};
        const size_t counts[3] = {a.size(), b.size(), c.size()};
        coll_work* work = nullptr;
        // Issues the call; a blocking one leaves work NULL.
        auto issue = [&] {
          if (!async) {
            return broadcast
                       ? coll_broadcast_many(comm, buffers, counts, 3, COLL_FLOAT32, 0, 32)
                       : coll_all_reduce_many(comm, buffers, counts, 3, COLL_FLOAT32, COLL_SUM, 32);
          }
          return broadcast ? coll_broadcast_many_async(comm, buffers, counts, 3, COLL_FLOAT32, 0,
                                                       32, &work)
                           : coll_all_reduce_many_async(comm, buffers, counts, 3, COLL_FLOAT32,
                                                        COLL_SUM, 32, &work);
        };
        coll_status issued = COLL_OK;
        if (rank == 1) {
          t_failed = false;
          t_allocations_left = n;
          first = issue();
          t_allocations_left = -1;
          failed = t_failed;
          if (first != COLL_OK) {
            EXPECT_EQ(first, COLL_SYSTEM) << what << ": " << coll_last_error();
            EXPECT_TRUE(Contains(coll_last_error(), "out of memory"))
                << what << ": " << coll_last_error();
            EXPECT_EQ(work, nullptr) << what;
            issued = issue();  // COLL_OK, or the abort's status
          }
        } else {
          issued = issue();
        }
        status[rank] = issued;
        message[rank] = coll_last_error();
        if (work != nullptr) {
          EXPECT_EQ(issued, COLL_OK) << what << ": " << coll_last_error();
          status[rank] = coll_work_wait(work);
          message[rank] = coll_last_error();
          EXPECT_EQ(coll_work_free(work), status[rank]);
        }
        sums[rank] = c[0];
        EXPECT_EQ(coll_comm_destroy(comm), COLL_OK);
      });
    }
    for (std::thread& t : threads) t.join();
    if (first == COLL_OK && !failed) {
      EXPECT_EQ(status[0], COLL_OK) << what << ": " << message[0];
      EXPECT_EQ(status[1], COLL_OK) << what << ": " << message[1];
      break;
    }
    if (status[0] == COLL_OK && status[1] == COLL_OK) {  // nothing was issued: the retry ran
      EXPECT_EQ(sums[0], broadcast ? 1.0f : 3.0f) << what;
      EXPECT_EQ(sums[1], broadcast ? 1.0f : 3.0f) << what;
    } else {
      met_a_partial_call = true;
      for (int rank = 0; rank < 2; ++rank) {
        EXPECT_TRUE(Contains(message[rank], "rank 1: packing " + collective + ": out of memory ") &&
                    Contains(message[rank], "; the communicator is aborted"))
            << what << ": rank " << rank << ": " << coll_status_string(status[rank]) << ": "
            << message[rank];
      }
    }
    if (::testing::Test::HasFailure()) return;
    ASSERT_LT(n, 10000) << what << ": the call still allocates";
  }
  EXPECT_TRUE(met_a_partial_call) << collective << (async ? " async" : " blocking");
}

TEST(CApiOutOfMemoryTest, APackedAsyncCallThatRunsOutOfMemoryFailsEveryRankSayingSo) {
  for (bool broadcast : {false, true}) {
    ExpectAPartlyIssuedCallFailsEveryRankSayingSo(broadcast, /*async=*/true);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(CApiOutOfMemoryTest, APackedBlockingCallThatRunsOutOfMemoryFailsEveryRankSayingSo) {
  for (bool broadcast : {false, true}) {
    ExpectAPartlyIssuedCallFailsEveryRankSayingSo(broadcast, /*async=*/false);
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace
