// Tests of the names and sizes of dtypes, ops and devices (include/collectives/types.h) and of
// collectives::Error (include/collectives/errors.h).
#include "collectives/types.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "collectives/errors.h"

namespace collectives {
namespace {

TEST(DataTypeTest, SizeOf) {
  EXPECT_EQ(SizeOf(DataType::kFloat32), 4u);
  EXPECT_EQ(SizeOf(DataType::kFloat64), 8u);
  EXPECT_EQ(SizeOf(DataType::kFloat16), 2u);
  EXPECT_EQ(SizeOf(DataType::kBFloat16), 2u);
  EXPECT_EQ(SizeOf(DataType::kInt8), 1u);
  EXPECT_EQ(SizeOf(DataType::kUInt8), 1u);
  EXPECT_EQ(SizeOf(DataType::kInt32), 4u);
  EXPECT_EQ(SizeOf(DataType::kInt64), 8u);
}

TEST(DataTypeTest, WireValuesAreStable) {
  // These numbers travel in frame headers; a change breaks mixed-version jobs.
  EXPECT_EQ(static_cast<int>(DataType::kFloat32), 0);
  EXPECT_EQ(static_cast<int>(DataType::kBFloat16), 3);
  EXPECT_EQ(static_cast<int>(DataType::kInt64), 7);
  EXPECT_EQ(kNumDataTypes, 8);
  EXPECT_EQ(static_cast<int>(ReduceOp::kSum), 0);
  EXPECT_EQ(static_cast<int>(ReduceOp::kAvg), 4);
  EXPECT_EQ(kNumReduceOps, 5);
}

TEST(DataTypeTest, ToStringAndParseRoundTrip) {
  const char* const kNames[] = {"f32", "f64", "f16", "bf16", "i8", "u8", "i32", "i64"};
  for (int i = 0; i < kNumDataTypes; ++i) {
    const DataType dtype = static_cast<DataType>(i);
    EXPECT_STREQ(ToString(dtype), kNames[i]);
    EXPECT_EQ(ParseDataType(ToString(dtype)), dtype);
  }
}

TEST(DataTypeTest, ParseAcceptsAliases) {
  EXPECT_EQ(ParseDataType("float32"), DataType::kFloat32);
  EXPECT_EQ(ParseDataType("float"), DataType::kFloat32);
  EXPECT_EQ(ParseDataType("float64"), DataType::kFloat64);
  EXPECT_EQ(ParseDataType("double"), DataType::kFloat64);
  EXPECT_EQ(ParseDataType("float16"), DataType::kFloat16);
  EXPECT_EQ(ParseDataType("half"), DataType::kFloat16);
  EXPECT_EQ(ParseDataType("bfloat16"), DataType::kBFloat16);
  EXPECT_EQ(ParseDataType("int8"), DataType::kInt8);
  EXPECT_EQ(ParseDataType("uint8"), DataType::kUInt8);
  EXPECT_EQ(ParseDataType("int32"), DataType::kInt32);
  EXPECT_EQ(ParseDataType("int"), DataType::kInt32);
  EXPECT_EQ(ParseDataType("int64"), DataType::kInt64);
}

// Expects `parse(text)` to throw Error(kInvalidArgument) whose message quotes the text.
template <typename Parse>
void ExpectRejected(Parse parse, std::string_view text) {
  SCOPED_TRACE("text '" + std::string(text) + "'");
  try {
    parse(text);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find("'" + std::string(text) + "'"), std::string::npos) << e.message();
  }
}

TEST(DataTypeTest, ParseRejectsUnknownNames) {
  for (std::string_view text : {"", "f8", "F32", "fp32", " f32", "f32 ", "float128", "u32"}) {
    ExpectRejected(ParseDataType, text);
  }
}

TEST(ReduceOpTest, ToStringAndParseRoundTrip) {
  const char* const kNames[] = {"sum", "prod", "min", "max", "avg"};
  for (int i = 0; i < kNumReduceOps; ++i) {
    const ReduceOp op = static_cast<ReduceOp>(i);
    EXPECT_STREQ(ToString(op), kNames[i]);
    EXPECT_EQ(ParseReduceOp(ToString(op)), op);
  }
  EXPECT_EQ(ParseReduceOp("mean"), ReduceOp::kAvg);
}

TEST(ReduceOpTest, ParseRejectsUnknownNames) {
  for (std::string_view text : {"", "add", "SUM", "product", "average", "sum "}) {
    ExpectRejected(ParseReduceOp, text);
  }
}

TEST(ToStringTest, OutOfRangeValuesDoNotCrash) {
  EXPECT_STREQ(ToString(static_cast<DataType>(200)), "?");
  EXPECT_STREQ(ToString(static_cast<ReduceOp>(200)), "?");
  EXPECT_EQ(SizeOf(static_cast<DataType>(200)), 0u);
}

TEST(DeviceTest, ToStringAndEquality) {
  EXPECT_EQ(Device::Cpu().ToString(), "cpu");
  EXPECT_EQ(Device{}.ToString(), "cpu");
  EXPECT_EQ(Device::Cuda(0).ToString(), "cuda:0");
  EXPECT_EQ(Device::Cuda(3).ToString(), "cuda:3");
  EXPECT_EQ(Device::Cuda(1), Device::Cuda(1));
  EXPECT_NE(Device::Cuda(1), Device::Cuda(2));
  EXPECT_NE(Device::Cpu(), Device::Cuda(0));
}

TEST(TensorTest, Bytes) {
  Tensor tensor;
  EXPECT_EQ(tensor.bytes(), 0u);
  tensor.count = 1000;
  tensor.dtype = DataType::kBFloat16;
  EXPECT_EQ(tensor.bytes(), 2000u);
  tensor.dtype = DataType::kInt64;
  EXPECT_EQ(tensor.bytes(), 8000u);
  EXPECT_EQ(tensor.device, Device::Cpu());
}

TEST(ErrorTest, CarriesCodeAndMessage) {
  const Error error(ErrorCode::kPeerLost, "rank 1: peer 2 closed during #7 all_reduce");
  EXPECT_EQ(error.code(), ErrorCode::kPeerLost);
  EXPECT_EQ(error.message(), "rank 1: peer 2 closed during #7 all_reduce");
  const std::string what = error.what();
  EXPECT_NE(what.find("peer lost"), std::string::npos) << what;
  EXPECT_NE(what.find(error.message()), std::string::npos) << what;
  EXPECT_EQ(what, "[peer lost] rank 1: peer 2 closed during #7 all_reduce");
}

TEST(ErrorTest, IsARuntimeError) {
  try {
    throw Error(ErrorCode::kTimeout, "waited 30 s");
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("timeout"), std::string::npos);
  }
}

// A failure is stored once and thrown to every waiter: copying it must not allocate (a
// bad_alloc there would leave the call without its completion), and a moved-from Error keeps
// its text.
TEST(ErrorTest, CopiesShareTheTextAndAMoveLeavesItInPlace) {
  static_assert(std::is_nothrow_copy_constructible_v<Error>);
  static_assert(std::is_nothrow_copy_assignable_v<Error>);
  const std::string long_text(1000, 'x');
  Error error(ErrorCode::kAborted, long_text);
  const Error copy = error;
  EXPECT_EQ(&copy.message(), &error.message());
  EXPECT_STREQ(copy.what(), error.what());
  Error moved = std::move(error);
  EXPECT_EQ(moved.message(), long_text);
  EXPECT_EQ(error.message(), long_text);  // NOLINT(bugprone-use-after-move): what is tested
  EXPECT_EQ(error.code(), ErrorCode::kAborted);
}

TEST(ErrorTest, EveryCodeHasADistinctName) {
  std::set<std::string> names;
  for (int value = 1; value <= 10; ++value) {
    const ErrorCode code = static_cast<ErrorCode>(value);
    const std::string name = ToString(code);
    EXPECT_FALSE(name.empty());
    EXPECT_NE(name, "unknown error") << value;
    names.insert(name);
    const Error error(code, "m");
    EXPECT_EQ(error.code(), code);
    EXPECT_NE(std::string(error.what()).find(name), std::string::npos) << error.what();
  }
  EXPECT_EQ(names.size(), 10u);
  EXPECT_STREQ(ToString(ErrorCode::kInvalidArgument), "invalid argument");
  EXPECT_STREQ(ToString(static_cast<ErrorCode>(0)), "unknown error");
}

}  // namespace
}  // namespace collectives
