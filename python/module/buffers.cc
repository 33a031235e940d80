// Buffer protocol and DLPack views of Python objects (see buffers.h).
#include "buffers.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "collectives/errors.h"

#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#endif

namespace py = pybind11;

namespace collectives::python {

// The DLPack ABI (dlpack.h, version 0.x, which every producer's __dlpack__ returns by default).
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

namespace {

constexpr int32_t kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;
constexpr uint8_t kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4;

const char* DLDeviceName(int32_t type) {
  switch (type) {
    case 1:
      return "cpu";
    case 2:
      return "cuda";
    case 3:
      return "cuda_host";
    case 4:
      return "opencl";
    case 7:
      return "vulkan";
    case 8:
      return "metal";
    case 10:
      return "rocm";
    case 13:
      return "cuda_managed";
    default:
      return "a non-CPU device";
  }
}

[[noreturn]] void Invalid(const std::string& text) {
  throw Error(ErrorCode::kInvalidArgument, text);
}

std::string TypeName(py::handle obj) {
  py::handle type = reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr()));
  std::string module;
  if (py::hasattr(type, "__module__")) module = py::str(type.attr("__module__"));
  std::string name = py::str(type.attr("__qualname__"));
  return module.empty() || module == "builtins" ? name : module + "." + name;
}

// A struct-module format character with its item size as numpy names it ("int16", "bool").
std::string FormatName(const std::string& code, size_t itemsize) {
  if (code.size() == 2 && code[0] == 'Z') return "complex" + std::to_string(itemsize * 8);
  if (code.size() != 1) return "format '" + code + "'";
  const std::string bits = std::to_string(itemsize * 8);
  switch (code[0]) {
    case 'f':
    case 'd':
    case 'e':
    case 'g':
      return "float" + bits;
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q':
    case 'n':
      return "int" + bits;
    case 'B':
    case 'H':
    case 'I':
    case 'L':
    case 'Q':
    case 'N':
      return "uint" + bits;
    case '?':
      return "bool";
    default:
      return "format '" + code + "'";
  }
}

// The DataType of a buffer format, or nullopt.
std::optional<DataType> FromFormat(char code, size_t itemsize) {
  switch (code) {
    case 'f':
      if (itemsize == 4) return DataType::kFloat32;
      break;
    case 'd':
      if (itemsize == 8) return DataType::kFloat64;
      break;
    case 'e':
      if (itemsize == 2) return DataType::kFloat16;
      break;
    case 'b':
      if (itemsize == 1) return DataType::kInt8;
      break;
    case 'B':
      if (itemsize == 1) return DataType::kUInt8;
      break;
    case 'i':
    case 'l':
    case 'q':
    case 'n':
      if (itemsize == 4) return DataType::kInt32;
      if (itemsize == 8) return DataType::kInt64;
      break;
    default:
      break;
  }
  return std::nullopt;
}

std::optional<DataType> FromDLPack(DLDataType t) {
  if (t.lanes != 1) return std::nullopt;
  if (t.code == kDLFloat && t.bits == 32) return DataType::kFloat32;
  if (t.code == kDLFloat && t.bits == 64) return DataType::kFloat64;
  if (t.code == kDLFloat && t.bits == 16) return DataType::kFloat16;
  if (t.code == kDLBfloat && t.bits == 16) return DataType::kBFloat16;
  if (t.code == kDLInt && t.bits == 8) return DataType::kInt8;
  if (t.code == kDLUInt && t.bits == 8) return DataType::kUInt8;
  if (t.code == kDLInt && t.bits == 32) return DataType::kInt32;
  if (t.code == kDLInt && t.bits == 64) return DataType::kInt64;
  return std::nullopt;
}

std::string DLPackTypeName(DLDataType t) {
  const char* kind = t.code == kDLInt      ? "int"
                     : t.code == kDLUInt   ? "uint"
                     : t.code == kDLFloat  ? "float"
                     : t.code == kDLBfloat ? "bfloat"
                     : t.code == 5         ? "complex"
                     : t.code == 6         ? "bool"
                                           : "code";
  std::string name = std::string(kind) + std::to_string(t.bits);
  if (t.lanes != 1) name += "x" + std::to_string(t.lanes);
  return name;
}

constexpr const char* kAccepted =
    "float32, float64, float16, bfloat16 (DLPack, or dtype='bf16' on a 2-byte buffer), int8, "
    "uint8, int32 or int64";

// The element type: the override if any (of the same size), else the natural one. Prefix and
// NaturalName build the message text, only when it is needed.
template <typename Prefix, typename NaturalName>
DataType Resolve(std::optional<DataType> natural, std::optional<DataType> override_dtype,
                 size_t itemsize, const Prefix& prefix, const NaturalName& natural_name) {
  if (override_dtype) {
    if (SizeOf(*override_dtype) != itemsize) {
      Invalid(prefix() + "has " + std::to_string(itemsize) + "-byte elements (" + natural_name() +
              "), but dtype='" + ToString(*override_dtype) + "' has " +
              std::to_string(SizeOf(*override_dtype)) + "-byte ones");
    }
    return *override_dtype;
  }
  if (!natural) {
    throw py::type_error(prefix() + "has elements of " + natural_name() +
                         ", which no collective takes (expected " + kAccepted + ")");
  }
  return *natural;
}

// ---- CUDA memory: DLPack producers on kDLCUDA and __cuda_array_interface__ objects. ----
//
// Device memory becomes a cuda:N Tensor (RING and AUTO stage it, NCCL takes it); pinned
// (kDLCUDAHost) and managed (kDLCUDAManaged) memory is host memory, as the C API reads it.
// Streams: the library's copy streams and NCCL's stream are blocking streams, which CUDA orders
// after the work queued before them on the legacy default stream. So a DLPack producer is asked
// for stream 1 (DLPack's name for the legacy default stream: the producer makes it wait for the
// work pending on the tensor), and an interface's "stream" other than the legacy one is
// synchronised on the host before the call. Memory the host reads (pinned, managed) is
// synchronised on the host in either case.

#ifdef COLLECTIVES_WITH_NCCL
// The CUDA runtime, or Error(kNotSupported) naming where the buffer lives and why CUDA is not
// usable here. Runs before anything is issued: nothing is written.
template <typename Prefix>
const nccl::NcclApi& CudaRuntime(const Prefix& prefix, const std::string& where) {
  std::string reason;
  const nccl::NcclApi* api = nccl::TryLoadCudart(&reason);
  if (api == nullptr)
    throw Error(ErrorCode::kNotSupported, prefix() + "lives on " + where + "; " + reason);
  return *api;
}

// Waits on the host, with the GIL released, for the work queued on `stream`.
template <typename Prefix>
void SynchronizeStream(const nccl::NcclApi& api, cudaStream_t stream, const Prefix& prefix) {
  cudaError_t status;
  {
    py::gil_scoped_release release;
    status = api.cudaStreamSynchronize(stream);
  }
  if (status != cudaSuccess) {
    api.cudaGetLastError();
    throw Error(ErrorCode::kSystem, prefix() +
                                        "could not be synchronised: cudaStreamSynchronize: " +
                                        api.cudaGetErrorString(status));
  }
}
#else
template <typename Prefix>
[[noreturn]] void NoCuda(const Prefix& prefix, const std::string& where) {
  throw Error(ErrorCode::kNotSupported,
              prefix() + "lives on " + where +
                  "; CUDA is not available: this library is built without CUDA (configure with "
                  "-DCOLLECTIVES_WITH_NCCL=ON)");
}
#endif

// The DataType of an array interface typestr ("<f4", "|u1"), or nullopt.
std::optional<DataType> FromTypestr(const std::string& typestr) {
  if (typestr.size() < 3 || typestr[0] == '>') return std::nullopt;
  const char kind = typestr[1];
  const std::string size = typestr.substr(2);
  if (kind == 'f' && size == "4") return DataType::kFloat32;
  if (kind == 'f' && size == "8") return DataType::kFloat64;
  if (kind == 'f' && size == "2") return DataType::kFloat16;
  if (kind == 'i' && size == "1") return DataType::kInt8;
  if (kind == 'u' && size == "1") return DataType::kUInt8;
  if (kind == 'i' && size == "4") return DataType::kInt32;
  if (kind == 'i' && size == "8") return DataType::kInt64;
  return std::nullopt;
}

// An object with __cuda_array_interface__ (CuPy, Numba, PyTorch): its device memory as a
// cuda:N tensor, after the interface's stream has been synchronised.
template <typename Prefix>
Tensor FromCudaArrayInterface(py::handle obj, bool writable, std::optional<DataType> dtype,
                              const Prefix& prefix) {
  py::dict cai = obj.attr("__cuda_array_interface__");
  const std::string typestr = py::str(cai["typestr"]);
  if (typestr.size() >= 3 && typestr[0] == '>' && typestr.substr(2) != "1") {
    throw py::type_error(prefix() + "is big-endian (typestr '" + typestr +
                         "'); collectives take native byte order");
  }
  const size_t itemsize = typestr.size() >= 3 ? std::stoul(typestr.substr(2)) : 0;
  const DataType dt = Resolve(FromTypestr(typestr), dtype, itemsize, prefix,
                              [&] { return "typestr '" + typestr + "'"; });
  py::tuple data = cai["data"];
  const auto pointer = data[0].cast<uintptr_t>();
  if (writable && data[1].cast<bool>()) {
    Invalid(prefix() + "is read-only; the collective writes it (pass a writable array)");
  }
  if (cai.contains("mask") && !cai["mask"].is_none()) {
    Invalid(prefix() + "has a mask; collectives take plain arrays");
  }
  py::tuple shape = cai["shape"];
  size_t count = 1;
  for (auto extent : shape) count *= extent.cast<size_t>();
  if (cai.contains("strides") && !cai["strides"].is_none()) {
    py::tuple strides = cai["strides"];
    int64_t expected = static_cast<int64_t>(itemsize);
    for (ssize_t d = static_cast<ssize_t>(shape.size()) - 1; d >= 0; --d) {
      const auto extent = shape[d].cast<int64_t>();
      if (extent != 1 && strides[d].cast<int64_t>() != expected && count > 0) {
        Invalid(prefix() + "is not C-contiguous; pass a contiguous copy");
      }
      expected *= extent;
    }
  }
  void* ptr = reinterpret_cast<void*>(pointer);
#ifdef COLLECTIVES_WITH_NCCL
  const nccl::NcclApi& api = CudaRuntime(prefix, "CUDA (__cuda_array_interface__)");
  Device device = Device::Cpu();
  bool host_reads = true;
  cudaPointerAttributes attributes{};
  if (ptr == nullptr) {
    int current = 0;
    api.cudaGetDevice(&current);
    device = Device::Cuda(current);
    host_reads = false;
  } else if (api.cudaPointerGetAttributes(&attributes, ptr) != cudaSuccess) {
    api.cudaGetLastError();
  } else if (attributes.type == cudaMemoryTypeDevice) {
    device = Device::Cuda(attributes.device);
    host_reads = false;
  }
  // Version 3's "stream": absent or None, nothing to wait for; 1 the legacy default stream,
  // which the library's blocking streams follow; 2 the per-thread default stream; else a
  // cudaStream_t. Memory the host reads waits on the host for any of them.
  py::object stream = cai.contains("stream") ? py::object(cai["stream"]) : py::none();
  if (!stream.is_none()) {
    const auto value = stream.cast<uintptr_t>();
    if (value == 0) {
      Invalid(prefix() +
              "names stream 0 in __cuda_array_interface__, which the protocol "
              "disallows (1 is the legacy default stream)");
    }
    if (value != 1 || host_reads) {
      SynchronizeStream(api, value == 1 ? nullptr : reinterpret_cast<cudaStream_t>(value), prefix);
    }
  }
  return Tensor{ptr, count, dt, device};
#else
  (void)ptr;
  (void)dt;
  NoCuda(prefix, "CUDA (__cuda_array_interface__)");
#endif
}
}  // namespace

BorrowedBuffer::~BorrowedBuffer() {
  if (has_view_) PyBuffer_Release(&view_);
  if (dl_ != nullptr && dl_->deleter != nullptr) dl_->deleter(dl_);
}

std::unique_ptr<BorrowedBuffer> Acquire(py::handle obj, int rank, const char* collective,
                                        const char* name, bool writable,
                                        std::optional<DataType> dtype) {
  auto out = std::make_unique<BorrowedBuffer>();
  // Message text is built only for a refusal: this runs on every call.
  auto prefix = [&] {
    return "rank " + std::to_string(rank) + ": " + collective + ": " + name + " (" + TypeName(obj) +
           ") ";
  };

  if (PyObject_CheckBuffer(obj.ptr())) {
    // Read-only buffers are asked for too, so that the refusal can say why.
    if (PyObject_GetBuffer(obj.ptr(), &out->view_, PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
      throw py::error_already_set();
    }
    out->has_view_ = true;
    const Py_buffer& v = out->view_;
    std::string format = v.format ? v.format : "B";
    size_t pos = 0;
    bool big_endian = false;
    while (pos < format.size() && std::strchr("@=<>!", format[pos]) != nullptr) {
      if (format[pos] == '>' || format[pos] == '!') big_endian = true;
      ++pos;
    }
    const std::string code = format.substr(pos);
    const size_t itemsize = static_cast<size_t>(v.itemsize);
    // numpy names its own dtypes best ("int16", "complex64", "datetime64[s]").
    auto natural_name = [&]() -> std::string {
      if (py::hasattr(obj, "dtype")) return py::str(obj.attr("dtype"));
      return FormatName(code, itemsize);
    };
    std::optional<DataType> natural;
    if (code.size() == 1 && !big_endian) natural = FromFormat(code[0], itemsize);
    if (big_endian && itemsize > 1) {
      throw py::type_error(prefix() + "is big-endian (format '" + format +
                           "'); collectives take native byte order");
    }
    const DataType dt = Resolve(natural, dtype, itemsize, prefix, natural_name);
    if (writable && v.readonly) {
      Invalid(prefix() + "is read-only; the collective writes it (pass a writable array)");
    }
    if (!PyBuffer_IsContiguous(&v, 'C')) {
      Invalid(prefix() +
              "is not C-contiguous; pass numpy.ascontiguousarray(...) and copy the "
              "result back");
    }
    out->tensor = Tensor{v.buf, static_cast<size_t>(v.len) / itemsize, dt, Device::Cpu()};
    return out;
  }

  const bool dlpack = py::hasattr(obj, "__dlpack__");
  if (!dlpack && py::hasattr(obj, "__cuda_array_interface__")) {
    out->tensor = FromCudaArrayInterface(obj, writable, dtype, prefix);
    return out;
  }
  if (!dlpack) {
    throw py::type_error(prefix() +
                         "is neither a buffer (numpy array, bytearray, memoryview), a DLPack "
                         "producer (__dlpack__) nor a CUDA array (__cuda_array_interface__)");
  }
  // Where the producer says the tensor lives, before it is asked for the tensor: a CUDA one is
  // asked for stream 1 (the legacy default stream), and refused before anything is issued where
  // CUDA is not usable.
  int32_t producer_device = kDLCPU;
  std::string where;
  if (py::hasattr(obj, "__dlpack_device__")) {
    py::tuple device = obj.attr("__dlpack_device__")();
    producer_device = device[0].cast<int32_t>();
    where =
        std::string(DLDeviceName(producer_device)) + ":" + py::str(device[1]).cast<std::string>();
  }
  const bool cuda_memory = producer_device == kDLCUDA || producer_device == kDLCUDAHost ||
                           producer_device == kDLCUDAManaged;
  if (producer_device != kDLCPU && !cuda_memory) {
    Invalid(prefix() + "lives on " + where + "; this module takes CPU and CUDA memory only");
  }
#ifdef COLLECTIVES_WITH_NCCL
  const nccl::NcclApi* api = cuda_memory ? &CudaRuntime(prefix, where) : nullptr;
#else
  if (cuda_memory) NoCuda(prefix, where);
#endif
  py::object capsule =
      cuda_memory ? obj.attr("__dlpack__")(py::arg("stream") = 1) : obj.attr("__dlpack__")();
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    throw py::type_error(prefix() + "returned no unused 'dltensor' capsule from __dlpack__()");
  }
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) throw py::error_already_set();
  // The capsule is consumed: its tensor is released by this BorrowedBuffer, not the capsule.
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  out->dl_ = managed;
  const DLTensor& t = managed->dl_tensor;
  const int32_t type = t.device.device_type;
  if (type != kDLCPU && type != kDLCUDA && type != kDLCUDAHost && type != kDLCUDAManaged) {
    Invalid(prefix() + "lives on " + DLDeviceName(type) +
            "; this module takes CPU and CUDA memory only");
  }
  if (!where.empty() && type != producer_device) {
    Invalid(prefix() + "gave a tensor on " + DLDeviceName(type) + " from __dlpack__, but " +
            "said " + where);
  }
  Device device = Device::Cpu();
  if (type == kDLCUDA) device = Device::Cuda(t.device.device_id);
#ifdef COLLECTIVES_WITH_NCCL
  // Pinned and managed memory is read by the host: the work pending on it must be done.
  if (type == kDLCUDAHost || type == kDLCUDAManaged) SynchronizeStream(*api, nullptr, prefix);
#endif
  auto natural_name = [&] { return DLPackTypeName(t.dtype); };
  const size_t itemsize = (static_cast<size_t>(t.dtype.bits) * t.dtype.lanes + 7) / 8;
  const DataType dt = Resolve(FromDLPack(t.dtype), dtype, itemsize, prefix, natural_name);
  size_t count = 1;
  int64_t expected_stride = 1;
  bool contiguous = true;
  for (int d = t.ndim - 1; d >= 0; --d) {
    const int64_t extent = t.shape[d];
    count *= static_cast<size_t>(extent);
    if (t.strides != nullptr && extent != 1 && t.strides[d] != expected_stride) contiguous = false;
    expected_stride *= extent;
  }
  if (!contiguous && count > 0) {
    Invalid(prefix() + "is not C-contiguous; pass a contiguous copy (tensor.contiguous())");
  }
  out->tensor = Tensor{static_cast<char*>(t.data) + t.byte_offset, count, dt, device};
  return out;
}

}  // namespace collectives::python
