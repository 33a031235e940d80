// Names and sizes of dtypes, ops and devices.
#include "collectives/types.h"

#include <string>

#include "collectives/errors.h"

namespace collectives {

size_t SizeOf(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kUInt8: return 1;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
  }
  return 0;
}

const char* ToString(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return "f32";
    case DataType::kFloat64: return "f64";
    case DataType::kFloat16: return "f16";
    case DataType::kBFloat16: return "bf16";
    case DataType::kInt8: return "i8";
    case DataType::kUInt8: return "u8";
    case DataType::kInt32: return "i32";
    case DataType::kInt64: return "i64";
  }
  return "?";
}

const char* ToString(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kAvg: return "avg";
  }
  return "?";
}

DataType ParseDataType(std::string_view name) {
  struct Alias {
    std::string_view name;
    DataType dtype;
  };
  static constexpr Alias kAliases[] = {
      {"f32", DataType::kFloat32},   {"float32", DataType::kFloat32}, {"float", DataType::kFloat32},
      {"f64", DataType::kFloat64},   {"float64", DataType::kFloat64}, {"double", DataType::kFloat64},
      {"f16", DataType::kFloat16},   {"float16", DataType::kFloat16}, {"half", DataType::kFloat16},
      {"bf16", DataType::kBFloat16}, {"bfloat16", DataType::kBFloat16},
      {"i8", DataType::kInt8},       {"int8", DataType::kInt8},
      {"u8", DataType::kUInt8},      {"uint8", DataType::kUInt8},
      {"i32", DataType::kInt32},     {"int32", DataType::kInt32},     {"int", DataType::kInt32},
      {"i64", DataType::kInt64},     {"int64", DataType::kInt64},
  };
  for (const Alias& alias : kAliases) {
    if (alias.name == name) return alias.dtype;
  }
  throw Error(ErrorCode::kInvalidArgument,
              "unknown dtype '" + std::string(name) + "' (expected f32, f64, f16, bf16, i8, u8, i32 or i64)");
}

ReduceOp ParseReduceOp(std::string_view name) {
  for (int i = 0; i < kNumReduceOps; ++i) {
    ReduceOp op = static_cast<ReduceOp>(i);
    if (name == ToString(op)) return op;
  }
  if (name == "mean") return ReduceOp::kAvg;
  throw Error(ErrorCode::kInvalidArgument,
              "unknown reduce op '" + std::string(name) + "' (expected sum, prod, min, max or avg)");
}

std::string Device::ToString() const {
  return kind == Kind::kCpu ? "cpu" : "cuda:" + std::to_string(index);
}

}  // namespace collectives
