// Replaces the global allocation functions with malloc/free plus a hook the test sets, for the
// binaries that count allocations or make one fail. Include it from exactly one source file of a
// test binary (it defines the replacements), and only in binaries of their own.
#ifndef COLLECTIVES_TESTS_REPLACED_OPERATOR_NEW_H_
#define COLLECTIVES_TESTS_REPLACED_OPERATOR_NEW_H_

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace collectives::testing {

// Called by every operator new before it allocates (it may throw std::bad_alloc); null: none.
inline std::atomic<void (*)()> before_allocation{nullptr};

}  // namespace collectives::testing

// GCC pairs these replacements with malloc/free and warns about the mix; they are consistent.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(size_t bytes) {
  if (auto hook = collectives::testing::before_allocation.load(std::memory_order_relaxed)) hook();
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t bytes) { return operator new(bytes); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

#endif  // COLLECTIVES_TESTS_REPLACED_OPERATOR_NEW_H_
