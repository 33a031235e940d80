// Borrowed views of Python objects as collectives::Tensor: anything with the buffer protocol
// (numpy arrays, bytearray, memoryview, array.array), a DLPack producer (an object with
// __dlpack__: torch tensors, jax arrays, numpy arrays, CuPy arrays) on the CPU or a CUDA
// device, or a CUDA array (__cuda_array_interface__: Numba, CuPy). CUDA device memory becomes a
// cuda:N tensor; pinned and managed memory is host memory (buffers.cc says how streams are
// synchronised).
//
// Thread-safety: Acquire and ~BorrowedBuffer run with the GIL held; the Tensor inside may be
// used without it for as long as the BorrowedBuffer lives.
#ifndef COLLECTIVES_PYTHON_MODULE_BUFFERS_H_
#define COLLECTIVES_PYTHON_MODULE_BUFFERS_H_

#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <string>

#include "collectives/types.h"

namespace collectives::python {

struct DLManagedTensor;

// One object's memory, held (a Py_buffer, or a consumed DLPack capsule's tensor) until this is
// destroyed. Not copyable.
class BorrowedBuffer {
 public:
  BorrowedBuffer() = default;
  BorrowedBuffer(const BorrowedBuffer&) = delete;
  BorrowedBuffer& operator=(const BorrowedBuffer&) = delete;
  ~BorrowedBuffer();

  Tensor tensor;

 private:
  friend std::unique_ptr<BorrowedBuffer> Acquire(pybind11::handle, int, const char*, const char*,
                                                 bool, std::optional<DataType>);
  Py_buffer view_{};
  bool has_view_ = false;
  DLManagedTensor* dl_ = nullptr;
};

// Borrows `obj`'s memory as a C-contiguous CPU or CUDA tensor. Messages start with
// "rank <rank>: <collective>: <name>" (name is the argument: "out"). With `writable`, a read-only
// buffer is refused. `dtype` overrides the element type that the object's format names; its element
// size must equal the object's (dtype="bf16" on a uint16 array). Throws TypeError for an object
// that is neither a buffer nor a DLPack producer and for an element type no collective takes, and
// Error(kInvalidArgument) (the package's InvalidArgumentError, a ValueError) for a read-only or
// non-contiguous one or one on another device, and Error(kNotSupported) for CUDA memory where
// the CUDA runtime is not usable (naming the device and why), before anything is issued.
std::unique_ptr<BorrowedBuffer> Acquire(pybind11::handle obj, int rank, const char* collective,
                                        const char* name, bool writable,
                                        std::optional<DataType> dtype);

}  // namespace collectives::python

#endif  // COLLECTIVES_PYTHON_MODULE_BUFFERS_H_
