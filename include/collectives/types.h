// Element types, reduction operators, devices and the non-owning Tensor view.
//
// Thread-safety: plain values; safe to share once built.
#ifndef COLLECTIVES_TYPES_H_
#define COLLECTIVES_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace collectives {

// The element types every collective accepts. The numeric values are part of the wire format
// (they travel in frame headers): append, never renumber.
enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,   // IEEE 754 binary16; reduced in f32.
  kBFloat16 = 3,  // bfloat16; reduced in f32.
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
};
inline constexpr int kNumDataTypes = 8;

// Reduction operators. kAvg is a sum followed by one division by the number of ranks (integer
// division, truncating toward zero, for integer types). Integer kSum, kProd and kAvg's sum wrap
// modulo 2^bits (two's complement), so an integer average of large values wraps before the
// division (u8: avg(200, 200) is 72). f16's partial sums are rounded to f16 at each step, so an
// f16 kAvg is inf once a partial sum reaches 65520, which rounds past the largest f16, 65504
// (avg(65504, 15) is 32752, avg(65504, 16) is inf, avg(40000, 40000) is inf; NCCL, which
// multiplies each input by 1/n first, gives 40000); scale such values first. Every rank gets the
// same bits, with one exception: where ranks contribute different NaNs to one element, which of
// them a rank ends with may differ (x86 keeps one operand's NaN, and the compiler orders the
// operands of each loop its own way; small all-reduces compute each sum on both partners).
// Wire values as for DataType.
enum class ReduceOp : uint8_t {
  kSum = 0,
  kProd = 1,
  kMin = 2,
  kMax = 3,
  kAvg = 4,
};
inline constexpr int kNumReduceOps = 5;

// Bytes of one element.
size_t SizeOf(DataType dtype);
// Short names: "f32", "f64", "f16", "bf16", "i8", "u8", "i32", "i64".
const char* ToString(DataType dtype);
// "sum", "prod", "min", "max", "avg".
const char* ToString(ReduceOp op);
// Inverse of ToString (also accepts "float32", "float", "half", "bfloat16", "int32", ...).
// Throws Error(kInvalidArgument) naming the text when it is not a known name.
DataType ParseDataType(std::string_view name);
ReduceOp ParseReduceOp(std::string_view name);

// Where a tensor's memory lives.
struct Device {
  enum class Kind : uint8_t { kCpu = 0, kCuda = 1 };
  Kind kind = Kind::kCpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU.

  static Device Cpu() { return Device{}; }
  static Device Cuda(int ordinal) { return Device{Kind::kCuda, ordinal}; }
  bool operator==(const Device&) const = default;
  // "cpu" or "cuda:N".
  std::string ToString() const;
};

// A non-owning view of `count` elements of `dtype` at `data` on `device`. The caller owns the
// memory and keeps it alive (and untouched) until the collective using it has completed. `data`
// is aligned to the element size, as a pointer to the element type is (otherwise every
// collective raises Error(kInvalidArgument)).
struct Tensor {
  void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  Device device = Device::Cpu();

  size_t bytes() const { return count * SizeOf(dtype); }
};

}  // namespace collectives

#endif  // COLLECTIVES_TYPES_H_
