// The C API when memory runs out: every allocation of the calling thread can be made to fail
// (this binary replaces the global operator new), the n-th one for n = 1, 2, ... until a call
// runs to its end without meeting the failure. Whichever allocation fails (parsing TF_CONFIG,
// building the error's text, recording it as the last error), the call returns a status (the
// argument's error, or COLL_SYSTEM with "out of memory") and coll_last_error names it: no
// exception crosses the API and the process does not end.
//
// Not covered: a TF_CONFIG that parses into a non-empty JSON object. nlohmann::json's destructor
// (noexcept) allocates a stack to free nested values, so a failure there ends any process that
// uses the library; the malformed TF_CONFIG here fails before any value is built.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>

#include "collectives/c_api.h"

namespace {

// Allocations this thread may still make before one fails; negative: no limit.
thread_local int64_t t_allocations_left = -1;
// Whether an allocation failed since the limit was set.
thread_local bool t_failed = false;

}  // namespace

void* operator new(std::size_t size) {
  if (t_allocations_left == 0) {
    t_failed = true;
    t_allocations_left = -1;  // one failure per call: what follows must still cope
    throw std::bad_alloc();
  }
  if (t_allocations_left > 0) --t_allocations_left;
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

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

}  // namespace
