// Allocation-free Asio handlers: a slot of memory per kind of operation of a connection, and
// the allocator that hands it to Asio, so that the data path's steady state allocates nothing
// per frame (tcp_alloc_test checks it).
#ifndef COLLECTIVES_SRC_TRANSPORT_HANDLER_MEMORY_H_
#define COLLECTIVES_SRC_TRANSPORT_HANDLER_MEMORY_H_

#include <cstddef>
#include <new>

namespace collectives::transport {

// Storage for the handler of one kind of operation of one connection. At most one such
// operation is outstanding, so one slot suffices; a larger or concurrent request falls back to
// the heap. Not thread-safe: used only by the thread that runs the connection's io_context.
class HandlerMemory {
 public:
  HandlerMemory() = default;
  HandlerMemory(const HandlerMemory&) = delete;
  HandlerMemory& operator=(const HandlerMemory&) = delete;

  void* Allocate(size_t bytes) {
    if (!in_use_ && bytes <= sizeof(storage_)) {
      in_use_ = true;
      return storage_;
    }
    return ::operator new(bytes);
  }

  void Deallocate(void* pointer) {
    if (pointer == storage_) {
      in_use_ = false;
    } else {
      ::operator delete(pointer);
    }
  }

 private:
  alignas(std::max_align_t) unsigned char storage_[1024];
  bool in_use_ = false;
};

// The allocator a handler names as its allocator_type, so that Asio puts the operation in the
// handler's HandlerMemory. Used by the same thread as the memory it points to.
template <typename T>
class HandlerAllocator {
 public:
  using value_type = T;

  explicit HandlerAllocator(HandlerMemory* memory) : memory_(memory) {}
  template <typename U>
  HandlerAllocator(const HandlerAllocator<U>& other) noexcept : memory_(other.memory_) {}

  T* allocate(size_t n) { return static_cast<T*>(memory_->Allocate(sizeof(T) * n)); }
  void deallocate(T* pointer, size_t) { memory_->Deallocate(pointer); }

  template <typename U>
  bool operator==(const HandlerAllocator<U>& other) const noexcept {
    return memory_ == other.memory_;
  }
  template <typename U>
  bool operator!=(const HandlerAllocator<U>& other) const noexcept {
    return memory_ != other.memory_;
  }

 private:
  template <typename>
  friend class HandlerAllocator;
  HandlerMemory* memory_;
};

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_HANDLER_MEMORY_H_
