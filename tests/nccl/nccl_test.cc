// Tests of the NCCL implementation. The GPU tests skip, saying why, where NCCL or a CUDA device
// is not usable (the loader's reason); the others run everywhere: asking for NCCL where it
// cannot run raises Error(kNotSupported), in a build without NCCL as in one without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "collectives/packing.h"
#include "collectives/types.h"

#if defined(COLLECTIVES_WITH_NCCL)
#include <dlfcn.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "src/nccl/nccl_communication.h"
#include "src/nccl/nccl_loader.h"
#include "tests/time_scale.h"
#endif

namespace collectives {
namespace {

CommunicationOptions NcclOptionsFor(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  CommunicationOptions options;
  options.implementation = Implementation::kNccl;
  options.timeout = timeout;
  return options;
}

// Runs without a GPU: on a machine (or a build) that cannot run NCCL, the factory raises
// Error(kNotSupported) naming NCCL, at once (no hang, no crash).
TEST(NcclUnavailableTest, CreatingAnNcclCommunicatorRaisesNotSupported) {
#if defined(COLLECTIVES_WITH_NCCL)
  std::string reason;
  if (nccl::TryLoadNccl(&reason) != nullptr) {
    GTEST_SKIP() << "NCCL and a GPU are usable here: nothing to refuse";
  }
  std::cout << "loader's reason: " << reason << "\n";
#endif
  ClusterSpec spec;  // one rank
  const auto start = std::chrono::steady_clock::now();
  try {
    CreateCommunication(spec, CreateMemoryStore(), NcclOptionsFor());
    FAIL() << "expected Error(kNotSupported)";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotSupported) << e.what();
    EXPECT_NE(e.message().find("NCCL"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, test_time::Scaled(std::chrono::seconds(30)));
  // Twice: the loader's failure is cached, and says the same.
  EXPECT_THROW(CreateCommunication(spec, CreateMemoryStore(), NcclOptionsFor()), Error);
}

#if defined(COLLECTIVES_WITH_NCCL)

// Pure mappings: no GPU needed.
TEST(NcclMappingTest, ResultCodesMapToErrorCodes) {
  EXPECT_EQ(nccl::ToErrorCode(ncclInvalidArgument), ErrorCode::kInvalidArgument);
  EXPECT_EQ(nccl::ToErrorCode(ncclInvalidUsage), ErrorCode::kInvalidUsage);
  EXPECT_EQ(nccl::ToErrorCode(ncclRemoteError), ErrorCode::kPeerLost);
  EXPECT_EQ(nccl::ToErrorCode(ncclSystemError), ErrorCode::kSystem);
  EXPECT_EQ(nccl::ToErrorCode(ncclUnhandledCudaError), ErrorCode::kSystem);
  EXPECT_EQ(nccl::ToErrorCode(ncclInternalError), ErrorCode::kInternal);
}

TEST(NcclMappingTest, DataTypesAndOpsMap) {
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kFloat32), ncclFloat32);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kFloat64), ncclFloat64);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kFloat16), ncclFloat16);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kBFloat16), ncclBfloat16);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kInt8), ncclInt8);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kUInt8), ncclUint8);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kInt32), ncclInt32);
  EXPECT_EQ(nccl::ToNcclDataType(DataType::kInt64), ncclInt64);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kSum), ncclSum);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kProd), ncclProd);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kMin), ncclMin);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kMax), ncclMax);
  EXPECT_EQ(nccl::ToNcclRedOp(ReduceOp::kAvg), ncclAvg);
}

TEST(NcclMappingTest, UniqueIdRoundTripsThroughHex) {
  ncclUniqueId id;
  for (size_t i = 0; i < sizeof(id.internal); ++i) id.internal[i] = static_cast<char>(i * 37);
  const std::string text = nccl::EncodeUniqueId(id);
  EXPECT_EQ(text.size(), 2 * sizeof(id.internal));
  const ncclUniqueId back = nccl::DecodeUniqueId(text);
  EXPECT_TRUE(
      std::equal(std::begin(id.internal), std::end(id.internal), std::begin(back.internal)));
  EXPECT_THROW(nccl::DecodeUniqueId("abc"), Error);
  EXPECT_THROW(nccl::DecodeUniqueId(std::string(text.size(), 'z')), Error);
}

// A forced algorithm is refused before the loader and the store: no GPU needed.
TEST(NcclOptionsTest, AForcedAlgorithmIsNotSupportedBeforeTheStoreIsTouched) {
  class UntouchedStore final : public Store {
   public:
    void Set(const std::string& key, const std::string&) override {
      ADD_FAILURE() << "Set " << key;
    }
    std::string Get(const std::string& key, std::chrono::milliseconds) override {
      ADD_FAILURE() << "Get " << key;
      return "";
    }
    int64_t Add(const std::string& key, int64_t) override {
      ADD_FAILURE() << "Add " << key;
      return 0;
    }
  };
  for (const char* algorithm : {"ring", "recursive_doubling", "shm", "nccl"}) {
    CommunicationOptions options = NcclOptionsFor();
    options.algorithm = algorithm;
    try {
      nccl::CreateNcclCommunication(0, 1, std::make_shared<UntouchedStore>(), "test/nccl/0",
                                    options);
      ADD_FAILURE() << algorithm << ": expected Error(kNotSupported)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotSupported) << e.what();
      EXPECT_NE(e.message().find(std::string("\"") + algorithm + "\""), std::string::npos)
          << e.what();
    }
  }
}

// The loader's reason names only the library that failed: where libcudart loads (the fake as
// libcudart.so.12, after a libcudart.so.13 that does not) and libnccl does not, it names
// libnccl's failures, not libcudart.so.13's. Runs this binary again over a folder of stand-ins.
TEST(NcclLoaderTest, TheReasonNamesOnlyTheLibraryThatFailedToLoad) {
  const std::string fake =
      std::string(COLLECTIVES_TEST_BIN_DIR) + "/fake_nccl/libfake_cuda_nccl.so";
  if (access(fake.c_str(), R_OK) != 0) GTEST_SKIP() << "needs the fake NCCL of tests/nccl/fake";
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(length, 0);
  self[length] = '\0';
  char folder[] = "/tmp/nccl_loader_test_XXXXXX";
  ASSERT_NE(mkdtemp(folder), nullptr);
  const std::string dir = folder;
  for (const char* name : {"libcudart.so.13", "libnccl.so.2", "libnccl.so"}) {
    std::ofstream(dir + "/" + name);  // empty: dlopen fails ("file too short")
  }
  ASSERT_EQ(symlink(fake.c_str(), (dir + "/libcudart.so.12").c_str()), 0);
  const std::string command =
      "LD_LIBRARY_PATH=" + dir + " '" + self + "' --gtest_filter=NcclUnavailableTest.* 2>&1";
  std::string output;
  if (FILE* pipe = popen(command.c_str(), "r")) {
    char buffer[4096];
    size_t n;
    while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
    pclose(pipe);
  }
  for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libnccl.so.2", "libnccl.so"}) {
    unlink((dir + "/" + name).c_str());
  }
  rmdir(dir.c_str());
  const size_t at = output.find("loader's reason: ");
  ASSERT_NE(at, std::string::npos) << output;
  const std::string reason = output.substr(at, output.find('\n', at) - at);
  EXPECT_NE(reason.find("libnccl.so.2"), std::string::npos) << reason;
  EXPECT_EQ(reason.find("libcudart"), std::string::npos) << reason;
}

// ---- Tests that need the CPU stand-in for CUDA and NCCL (tests/nccl/fake, ctest -L fake_nccl):
// its fault injection, found in the libnccl the loader opened. Elsewhere they skip. ----

using FakeNcclFailNext = void (*)(const char* function, ncclResult_t result, const char* message);

FakeNcclFailNext FindFakeNcclFailNext() {
  if (nccl::TryLoadNccl() == nullptr) return nullptr;
  void* handle = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) handle = dlopen("libnccl.so", RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) return nullptr;
  auto fail_next = reinterpret_cast<FakeNcclFailNext>(dlsym(handle, "collectivesFakeNcclFailNext"));
  dlclose(handle);  // the loader keeps it loaded
  return fail_next;
}

// A set-up step that fails before there is a communicator (ncclGetUniqueId, an
// ncclCommInitRankConfig refused at once) names NCCL's reason, not only NCCL's generic "run with
// NCCL_DEBUG=WARN for details".
TEST(NcclFakeTest, ASetUpFailureBeforeACommunicatorExistsNamesNcclsReason) {
  const FakeNcclFailNext fail_next = FindFakeNcclFailNext();
  if (fail_next == nullptr) GTEST_SKIP() << "needs the fake NCCL of tests/nccl/fake";
  struct Case {
    const char* function;
    ncclResult_t result;
    const char* reason;
    ErrorCode code;
  };
  for (const Case& c :
       {Case{"ncclGetUniqueId", ncclSystemError, "Bootstrap : no socket interface found",
             ErrorCode::kSystem},
        Case{"ncclCommInitRankConfig", ncclInvalidArgument,
             "Invalid config blocking attribute value -5", ErrorCode::kInvalidArgument}}) {
    fail_next(c.function, c.result, c.reason);
    try {
      nccl::CreateNcclCommunication(0, 1, CreateMemoryStore(), "test/nccl/0", NcclOptionsFor());
      ADD_FAILURE() << c.function << ": expected an Error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), c.code) << e.what();
      EXPECT_NE(e.message().find(c.function), std::string::npos) << e.what();
      EXPECT_NE(e.message().find(c.reason), std::string::npos) << e.what();
    }
  }
}

// A unique id in the store that is not one (another job's key, a corrupted store) is named as
// such, with the rank, the set-up step and the key, not only as "an NCCL unique id has ...".
TEST(NcclFakeTest, AMalformedUniqueIdInTheStoreNamesTheRankAndTheKey) {
  if (FindFakeNcclFailNext() == nullptr) GTEST_SKIP() << "needs the fake NCCL of tests/nccl/fake";
  for (const std::string& text : {std::string("not an id"), std::string(256, 'z')}) {
    auto store = CreateMemoryStore();
    store->Set("test/nccl/0/id", text);
    try {
      nccl::CreateNcclCommunication(1, 2, store, "test/nccl/0", NcclOptionsFor());
      ADD_FAILURE() << "expected Error(kInvalidArgument)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("rank 1: NCCL set-up"), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("\"test/nccl/0/id\""), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("an NCCL unique id"), std::string::npos) << e.what();
    }
  }
}

// ---- GPU tests: skipped without NCCL and a device, failed instead when
// COLLECTIVES_REQUIRE_GPU=1, so that a run on a GPU machine cannot pass by skipping; a test that
// needs more devices than the machine has skips either way (one GPU runs the one-rank tests). ----

bool GpuRequired() {
  const char* value = std::getenv("COLLECTIVES_REQUIRE_GPU");
  return value != nullptr && std::string(value) == "1";
}

#define COLLECTIVES_GPU_UNAVAILABLE(why)                                         \
  do {                                                                           \
    if (GpuRequired()) GTEST_FAIL() << "COLLECTIVES_REQUIRE_GPU=1, but " << why; \
    GTEST_SKIP() << why;                                                         \
  } while (false)

#define COLLECTIVES_REQUIRE_GPU(min_devices)                                              \
  std::string gpu_reason;                                                                 \
  const nccl::NcclApi* api_ptr = nccl::TryLoadNccl(&gpu_reason);                          \
  if (api_ptr == nullptr) COLLECTIVES_GPU_UNAVAILABLE(gpu_reason);                        \
  if (api_ptr->device_count < (min_devices)) {                                            \
    GTEST_SKIP() << "needs " << (min_devices) << " CUDA devices, " << api_ptr->device_count \
                 << " visible (NCCL does not allow two ranks on one GPU)";                \
  }                                                                                       \
  const nccl::NcclApi& api = *api_ptr

// Host stand-ins for the 16-bit floating types: their bits, converted through double. The test
// values are small integers and halves, exact in both.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

double HalfToDouble(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  double value;
  if (exponent == 0) {
    value = std::ldexp(mantissa, -24);
  } else if (exponent == 31) {
    value = mantissa != 0 ? std::numeric_limits<double>::quiet_NaN()
                          : std::numeric_limits<double>::infinity();
  } else {
    value = std::ldexp(mantissa + 1024, exponent - 25);
  }
  return (bits & 0x8000) != 0 ? -value : value;
}

// Zero and normal values only (the tests' are), rounded to nearest.
uint16_t HalfBits(double value) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  value = std::abs(value);
  if (value == 0) return sign;
  int exponent = 0;
  const double fraction = std::frexp(value, &exponent);  // in [0.5, 1)
  int mantissa = static_cast<int>(std::lround((fraction * 2 - 1) * 1024));
  int biased = exponent + 14;
  if (mantissa == 1024) {
    mantissa = 0;
    ++biased;
  }
  return static_cast<uint16_t>(sign | (biased << 10) | mantissa);
}

double BFloat16ToDouble(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

uint16_t BFloat16Bits(double value) {  // rounded to nearest even
  const float single = static_cast<float>(value);
  uint32_t word;
  std::memcpy(&word, &single, sizeof(word));
  word += 0x7fff + ((word >> 16) & 1);
  return static_cast<uint16_t>(word >> 16);
}

// The stand-ins themselves need no GPU.
TEST(NcclHostTypesTest, HalfAndBFloat16RoundTripTheTestValues) {
  EXPECT_EQ(HalfBits(1.0), 0x3c00);
  EXPECT_EQ(HalfBits(-2.5), 0xc100);
  EXPECT_EQ(HalfBits(0.0), 0x0000);
  EXPECT_EQ(BFloat16Bits(1.0), 0x3f80);
  EXPECT_EQ(BFloat16Bits(-2.5), 0xc020);
  for (int twice = 0; twice <= 2 * 625; ++twice) {
    const double value = twice / 2.0;
    EXPECT_EQ(HalfToDouble(HalfBits(value)), value);
    if (twice <= 2 * 128) {
      EXPECT_EQ(BFloat16ToDouble(BFloat16Bits(value)), value);
    }
  }
  EXPECT_EQ(HalfToDouble(0x7c00), std::numeric_limits<double>::infinity());
  EXPECT_EQ(HalfToDouble(0x0001), std::ldexp(1.0, -24));
}

// How a host element type stands for a DataType.
template <typename T>
struct Elem {
  static constexpr bool kFloating = std::is_floating_point_v<T>;
  static double ToDouble(T v) { return static_cast<double>(v); }
  static T Of(double v) { return static_cast<T>(v); }
};
template <>
struct Elem<Half> {
  static constexpr bool kFloating = true;
  static double ToDouble(Half v) { return HalfToDouble(v.bits); }
  static Half Of(double v) { return Half{HalfBits(v)}; }
};
template <>
struct Elem<BFloat16> {
  static constexpr bool kFloating = true;
  static double ToDouble(BFloat16 v) { return BFloat16ToDouble(v.bits); }
  static BFloat16 Of(double v) { return BFloat16{BFloat16Bits(v)}; }
};

template <typename T>
constexpr bool kAlwaysFalse = false;

template <typename T>
DataType DataTypeOf() {
  if constexpr (std::is_same_v<T, float>) {
    return DataType::kFloat32;
  } else if constexpr (std::is_same_v<T, double>) {
    return DataType::kFloat64;
  } else if constexpr (std::is_same_v<T, Half>) {
    return DataType::kFloat16;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return DataType::kBFloat16;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return DataType::kInt8;
  } else if constexpr (std::is_same_v<T, uint8_t>) {
    return DataType::kUInt8;
  } else if constexpr (std::is_same_v<T, int32_t>) {
    return DataType::kInt32;
  } else if constexpr (std::is_same_v<T, int64_t>) {
    return DataType::kInt64;
  } else {
    static_assert(kAlwaysFalse<T>, "no DataType for this type");
  }
}

void CheckCuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw Error(ErrorCode::kSystem, std::string(what) + " failed");
}

// A device buffer of `count` T on `device`, freed with the object.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer(const nccl::NcclApi& api, int device, size_t count)
      : api_(api), device_(device), count_(count) {
    CheckCuda(api_.cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(api_.cudaMalloc(&data_, std::max<size_t>(count_, 1) * sizeof(T)), "cudaMalloc");
  }
  ~DeviceBuffer() { api_.cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // A cudaMemcpy from pageable memory may return before the data lands. The communicator's own
  // stream is ordered after it anyway; synchronising keeps the tests independent of that.
  void Upload(const std::vector<T>& host) {
    CheckCuda(api_.cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(api_.cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              "cudaMemcpy");
    CheckCuda(api_.cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  std::vector<T> Download() const {
    std::vector<T> host(count_);
    CheckCuda(api_.cudaSetDevice(device_), "cudaSetDevice");
    CheckCuda(api_.cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost),
              "cudaMemcpy");
    return host;
  }
  Tensor tensor() const { return Tensor{data_, count_, DataTypeOf<T>(), Device::Cuda(device_)}; }

 private:
  const nccl::NcclApi& api_;
  const int device_;
  const size_t count_;
  void* data_ = nullptr;
};

// Rank r's input: small values so that products and sums stay exact in every dtype.
double InputValue(int rank, size_t i) {
  return static_cast<double>(1 + (i * 7 + static_cast<size_t>(rank) * 3) % 5);
}

template <typename T>
std::vector<T> Input(int rank, size_t count) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = Elem<T>::Of(InputValue(rank, i));
  return v;
}

// op over `values`, as T computes it: exact for the test values, the average truncated for
// integer types.
template <typename T>
double Reduce(ReduceOp op, const std::vector<double>& values) {
  double acc = values[0];
  for (size_t i = 1; i < values.size(); ++i) {
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += values[i];
        break;
      case ReduceOp::kProd:
        acc *= values[i];
        break;
      case ReduceOp::kMin:
        acc = std::min(acc, values[i]);
        break;
      case ReduceOp::kMax:
        acc = std::max(acc, values[i]);
        break;
    }
  }
  if (op == ReduceOp::kAvg) {
    acc /= static_cast<double>(values.size());
    if (!Elem<T>::kFloating) acc = std::trunc(acc);
  }
  return acc;
}

template <typename T>
void ExpectNear(double expected, T got_value, const std::string& where) {
  const double got = Elem<T>::ToDouble(got_value);
  if constexpr (Elem<T>::kFloating) {
    EXPECT_NEAR(expected, got, std::abs(expected) * 1e-5 + 1e-6) << where;
  } else {
    EXPECT_EQ(expected, got) << where;
  }
}

constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin, ReduceOp::kMax,
                             ReduceOp::kAvg};

// Runs `size` ranks as threads, rank r on device r, each with its own NCCL communicator.
void RunNcclRanks(int size, const std::function<void(CollectiveCommunication&)>& body) {
  auto store = CreateMemoryStore();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        nccl::NcclOptions nccl_options;
        nccl_options.device = rank;
        auto comm = nccl::CreateNcclCommunication(rank, size, store, "test/nccl/0",
                                                  NcclOptionsFor(), nccl_options);
        body(*comm);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

// Every collective, every op, checked element by element against a host reference.
template <typename T>
void CheckAllCollectives(const nccl::NcclApi& api, CollectiveCommunication& comm) {
  const int size = comm.size();
  const int rank = comm.rank();
  const int device = rank;
  const size_t count = 1000;
  const size_t whole_count = count * static_cast<size_t>(size);
  const std::string type = ToString(DataTypeOf<T>());
  std::vector<double> column(static_cast<size_t>(size));
  auto column_at = [&](size_t i) -> const std::vector<double>& {
    for (int r = 0; r < size; ++r) column[static_cast<size_t>(r)] = InputValue(r, i);
    return column;
  };
  for (ReduceOp op : kOps) {
    const std::string where = type + " " + ToString(op);
    // AllReduce, out of place then in place.
    DeviceBuffer<T> send(api, device, count), recv(api, device, count);
    send.Upload(Input<T>(rank, count));
    comm.AllReduce(send.tensor(), recv.tensor(), op);
    std::vector<T> got = recv.Download();
    for (size_t i = 0; i < count; ++i) {
      ExpectNear(Reduce<T>(op, column_at(i)), got[i],
                 "all_reduce " + where + " [" + std::to_string(i) + "]");
    }
    comm.AllReduce(send.tensor(), op);
    got = send.Download();
    for (size_t i = 0; i < count; ++i) {
      ExpectNear(Reduce<T>(op, column_at(i)), got[i],
                 "in-place all_reduce " + where + " [" + std::to_string(i) + "]");
    }
    // ReduceScatter: send has size * count elements.
    DeviceBuffer<T> whole(api, device, whole_count);
    whole.Upload(Input<T>(rank, whole_count));
    DeviceBuffer<T> block(api, device, count);
    comm.ReduceScatter(whole.tensor(), block.tensor(), op);
    got = block.Download();
    for (size_t i = 0; i < count; ++i) {
      ExpectNear(Reduce<T>(op, column_at(static_cast<size_t>(rank) * count + i)), got[i],
                 "reduce_scatter " + where + " [" + std::to_string(i) + "]");
    }
  }
  // Broadcast from each root.
  for (int root = 0; root < size; ++root) {
    DeviceBuffer<T> send(api, device, count), recv(api, device, count);
    send.Upload(Input<T>(rank, count));
    comm.Broadcast(send.tensor(), recv.tensor(), root);
    const std::vector<T> got = recv.Download();
    for (size_t i = 0; i < count; ++i) {
      ExpectNear(InputValue(root, i), got[i], "broadcast " + type + " [" + std::to_string(i) + "]");
    }
  }
  // AllGather.
  DeviceBuffer<T> part(api, device, count);
  part.Upload(Input<T>(rank, count));
  DeviceBuffer<T> all(api, device, whole_count);
  comm.AllGather(part.tensor(), all.tensor());
  const std::vector<T> got = all.Download();
  for (int r = 0; r < size; ++r) {
    for (size_t i = 0; i < count; ++i) {
      ExpectNear(InputValue(r, i), got[static_cast<size_t>(r) * count + i],
                 "all_gather " + type + " [" + std::to_string(r) + "][" + std::to_string(i) + "]");
    }
  }
  comm.Barrier();
}

void CheckEveryDtype(const nccl::NcclApi& api, CollectiveCommunication& comm) {
  CheckAllCollectives<float>(api, comm);
  CheckAllCollectives<double>(api, comm);
  CheckAllCollectives<Half>(api, comm);
  CheckAllCollectives<BFloat16>(api, comm);
  CheckAllCollectives<int8_t>(api, comm);
  CheckAllCollectives<uint8_t>(api, comm);
  CheckAllCollectives<int32_t>(api, comm);
  CheckAllCollectives<int64_t>(api, comm);
}

TEST(NcclGpuTest, OneRankEveryCollective) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    EXPECT_EQ(comm.implementation(), Implementation::kNccl);
    CheckEveryDtype(api, comm);
  });
}

TEST(NcclGpuTest, TwoRanksAsThreadsEveryCollective) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) { CheckEveryDtype(api, comm); });
}

// The packer stages CUDA tensors on RING and AUTO only: on NCCL its fusion buffer would be host
// memory, so a CUDA tensor is refused before anything is issued, naming where it is taken.
TEST(NcclGpuTest, ThePackerRefusesCudaTensorsByName) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    void* data = nullptr;
    ASSERT_EQ(api.cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(api.cudaMalloc(&data, 64), cudaSuccess);
    const Tensor a{data, 8, DataType::kFloat32, Device::Cuda(0)};
    const Tensor b{static_cast<float*>(data) + 8, 8, DataType::kFloat32, Device::Cuda(0)};
    try {
      packing::AllReduce(comm, {a, b}, ReduceOp::kSum);
      ADD_FAILURE() << "expected kNotSupported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotSupported) << e.what();
      EXPECT_NE(e.message().find("CUDA tensors on RING and AUTO only"), std::string::npos)
          << e.what();
    }
    api.cudaFree(data);
  });
}

TEST(NcclGpuTest, ThroughTheFactory) {
  COLLECTIVES_REQUIRE_GPU(1);
  ClusterSpec spec;
  auto comm = CreateCommunication(spec, CreateMemoryStore(), NcclOptionsFor());
  EXPECT_EQ(comm->implementation(), Implementation::kNccl);
  // Distinct values, so that a shifted, partial or stale result shows.
  const size_t count = 4099;
  std::vector<float> input(count);
  for (size_t i = 0; i < count; ++i) input[i] = static_cast<float>(i) + 0.5f;
  DeviceBuffer<float> send(api, 0, count), recv(api, 0, count);
  send.Upload(input);
  recv.Upload(std::vector<float>(count, -1.0f));
  comm->AllReduce(send.tensor(), recv.tensor(), ReduceOp::kSum);
  const std::vector<float> got = recv.Download();
  for (size_t i = 0; i < count; ++i) EXPECT_EQ(got[i], input[i]) << "[" << i << "]";
  comm->Barrier();
}

TEST(NcclGpuTest, CpuTensorIsAnInvalidArgument) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    std::vector<float> host(8, 1.0f);
    const Tensor cpu{host.data(), host.size(), DataType::kFloat32, Device::Cpu()};
    try {
      comm.AllReduce(cpu, ReduceOp::kSum);
      ADD_FAILURE() << "expected Error(kInvalidArgument)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("rank 0"), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("all_reduce"), std::string::npos) << e.what();
    }
    // The communicator still works afterwards.
    DeviceBuffer<float> buffer(api, 0, 8);
    buffer.Upload(host);
    comm.AllReduce(buffer.tensor(), ReduceOp::kSum);
    for (float v : buffer.Download()) EXPECT_EQ(v, 1.0f);
  });
}

// A tensor that claims CUDA but holds a host pointer is refused before NCCL sees it (NCCL does
// not check pointers: its kernel would fault), and the communicator still works.
TEST(NcclGpuTest, HostMemoryMarkedCudaIsAnInvalidArgument) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    std::vector<float> host(8, 1.0f);
    const Tensor lying{host.data(), host.size(), DataType::kFloat32, Device::Cuda(0)};
    DeviceBuffer<float> buffer(api, 0, 8);
    buffer.Upload(host);
    for (const bool as_send : {true, false}) {
      try {
        if (as_send) {
          comm.AllReduce(lying, buffer.tensor(), ReduceOp::kSum);
        } else {
          comm.AllReduce(buffer.tensor(), lying, ReduceOp::kSum);
        }
        ADD_FAILURE() << "expected Error(kInvalidArgument)";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_NE(e.message().find(as_send ? "send" : "recv"), std::string::npos) << e.what();
        EXPECT_NE(e.message().find("not CUDA memory"), std::string::npos) << e.what();
      }
    }
    comm.AllReduce(buffer.tensor(), ReduceOp::kSum);
    for (float v : buffer.Download()) EXPECT_EQ(v, 1.0f);
  });
}

TEST(NcclGpuTest, BadSizesAndTypesAreInvalidArguments) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> a(api, 0, 8), b(api, 0, 4);
    DeviceBuffer<int32_t> c(api, 0, 8);
    auto expect_invalid = [](const std::function<void()>& call) {
      try {
        call();
        ADD_FAILURE() << "expected Error(kInvalidArgument)";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      }
    };
    expect_invalid([&] { comm.AllReduce(a.tensor(), b.tensor(), ReduceOp::kSum); });
    expect_invalid([&] { comm.AllReduce(a.tensor(), c.tensor(), ReduceOp::kSum); });
    expect_invalid([&] { comm.AllGather(a.tensor(), b.tensor()); });
    expect_invalid([&] { comm.Broadcast(a.tensor(), 1); });
    Tensor wrong_device = a.tensor();
    wrong_device.device = Device::Cuda(7);
    expect_invalid([&] { comm.AllReduce(wrong_device, ReduceOp::kSum); });
  });
}

TEST(NcclGpuTest, AbortBreaksTheCommunicator) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, 0, 8);
    comm.Abort();
    comm.Abort();  // idempotent
    try {
      comm.AllReduce(buffer.tensor(), ReduceOp::kSum);
      ADD_FAILURE() << "expected Error(kAborted)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
      // The call it refused is named.
      EXPECT_NE(e.message().find("aborted by its caller (all_reduce #0 "), std::string::npos)
          << e.what();
      EXPECT_NE(e.message().find(" was not issued)"), std::string::npos) << e.what();
    }
  });
}

// Calls issued before an Abort and not waited on raise Error(kAborted): after ncclCommAbort
// their events complete over partial data, which is not success.
TEST(NcclGpuTest, AbortWithCallsInFlightMakesTheirWaitsRaiseAborted) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(1, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, 0, 1 << 24);
    buffer.Upload(std::vector<float>(1 << 24, 1.0f));
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 8; ++i) {
      works.push_back(comm.AllReduceAsync(buffer.tensor(), buffer.tensor(), ReduceOp::kSum));
    }
    comm.Abort();
    for (size_t i = 0; i < works.size(); ++i) {
      EXPECT_TRUE(works[i]->Done()) << i;
      try {
        works[i]->Wait();
        ADD_FAILURE() << "work " << i << ": expected Error(kAborted)";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kAborted) << "work " << i << ": " << e.what();
        // Each names its own call.
        EXPECT_NE(e.message().find("(all_reduce #" + std::to_string(i) + " "), std::string::npos)
            << "work " << i << ": " << e.what();
        EXPECT_NE(e.message().find(" was in flight)"), std::string::npos) << e.what();
      }
    }
  });
}

// The same with a call that really is running: rank 1 never joins it, and an Abort from
// another thread ends rank 0's Wait long before the timeout.
TEST(NcclGpuTest, AbortEndsAWaitOnACallAPeerNeverJoins) {
  COLLECTIVES_REQUIRE_GPU(2);
  std::atomic<bool> rank0_done{false};
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, comm.rank(), 1024);
    buffer.Upload(std::vector<float>(1024, 1.0f));
    comm.AllReduce(buffer.tensor(), ReduceOp::kSum);  // connects the ranks
    if (comm.rank() == 1) {
      while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      comm.Abort();  // its destructor then does not wait for the call rank 0 aborted
      return;
    }
    auto work = comm.AllReduceAsync(buffer.tensor(), buffer.tensor(), ReduceOp::kSum);
    std::thread aborter([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      comm.Abort();
    });
    const auto start = std::chrono::steady_clock::now();
    try {
      work->Wait();
      ADD_FAILURE() << "expected Error(kAborted)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start,
              test_time::Scaled(std::chrono::seconds(20)));
    aborter.join();
    rank0_done.store(true);
  });
}

// A call's timeout counts from when it starts running: one queued behind a call that waits
// 1.5 s for its peer does not time out at 500 ms, even waited on alone.
TEST(NcclGpuTest, AQueuedCallsTimeoutStartsWhenItRuns) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> first(api, comm.rank(), 1024), second(api, comm.rank(), 1024);
    first.Upload(std::vector<float>(1024, 1.0f));
    second.Upload(std::vector<float>(1024, 2.0f));
    comm.AllReduce(first.tensor(), ReduceOp::kMax);  // connects the ranks
    if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    auto long_one = comm.AllReduceAsync(first.tensor(), first.tensor(), ReduceOp::kMax);
    if (comm.rank() == 0) comm.SetTimeout(std::chrono::milliseconds(500));
    auto queued = comm.AllReduceAsync(second.tensor(), second.tensor(), ReduceOp::kSum);
    queued->Wait();
    EXPECT_TRUE(long_one->Done());
    long_one->Wait();
    for (float v : second.Download()) EXPECT_EQ(v, 4.0f);
  });
}

// Done checks the deadline too: a caller that only polls it (coll_work_test) sees the timeout
// of a call whose peer never comes, and Wait then raises it.
TEST(NcclGpuTest, DoneSeesTheTimeoutOfACallAPeerNeverJoins) {
  COLLECTIVES_REQUIRE_GPU(2);
  std::atomic<bool> rank0_done{false};
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, comm.rank(), 1024);
    buffer.Upload(std::vector<float>(1024, 1.0f));
    comm.AllReduce(buffer.tensor(), ReduceOp::kSum);  // connects the ranks
    if (comm.rank() == 1) {
      while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      comm.Abort();
      return;
    }
    comm.SetTimeout(std::chrono::milliseconds(300));
    auto work = comm.AllReduceAsync(buffer.tensor(), buffer.tensor(), ReduceOp::kSum);
    const auto start = std::chrono::steady_clock::now();
    while (!work->Done() && std::chrono::steady_clock::now() - start < std::chrono::seconds(20)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_TRUE(work->Done());
    try {
      work->Wait();
      ADD_FAILURE() << "expected Error(kTimeout)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    }
    rank0_done.store(true);
  });
}

// Waiting on a thread that never chose a device makes the communicator's device current there
// (rank 1's, so that the runtime's default, device 0, would show).
TEST(NcclGpuTest, WaitOnAFreshThreadUsesTheCommunicatorsDevice) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, comm.rank(), 1024);
    buffer.Upload(std::vector<float>(1024, 1.0f));
    auto work = comm.AllReduceAsync(buffer.tensor(), buffer.tensor(), ReduceOp::kSum);
    int device = -1;
    std::thread([&] {
      try {
        work->Wait();
        CheckCuda(api.cudaGetDevice(&device), "cudaGetDevice");
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
      }
    }).join();
    EXPECT_EQ(device, comm.rank());
  });
}

// A chain of out-of-place all-reduces, each reading the buffer the one before wrote: the last
// buffer holds size^steps times the first, in every element, only if they ran in issue order
// (the buffers after the first start as -1e6). Waiting on the last alone leaves every earlier
// one done.
TEST(NcclGpuTest, AsyncWorksCompleteInOrder) {
  COLLECTIVES_REQUIRE_GPU(1);
  RunNcclRanks(std::min(api.device_count, 2), [&](CollectiveCommunication& comm) {
    const size_t count = size_t{1} << 20;
    const int steps = 8;
    const int device = comm.rank();
    std::vector<std::unique_ptr<DeviceBuffer<float>>> buffers;
    for (int k = 0; k <= steps; ++k) {
      buffers.push_back(std::make_unique<DeviceBuffer<float>>(api, device, count));
    }
    auto value = [](int rank, size_t i) { return static_cast<float>(1 + (i + rank) % 7); };
    std::vector<float> input(count);
    for (size_t i = 0; i < count; ++i) input[i] = value(comm.rank(), i);
    buffers[0]->Upload(input);
    for (int k = 1; k <= steps; ++k) buffers[k]->Upload(std::vector<float>(count, -1e6f));
    std::vector<std::shared_ptr<Work>> works;
    for (int k = 0; k < steps; ++k) {
      works.push_back(
          comm.AllReduceAsync(buffers[k]->tensor(), buffers[k + 1]->tensor(), ReduceOp::kSum));
    }
    works.back()->Wait();
    for (int k = 0; k < steps; ++k) EXPECT_TRUE(works[k]->Done()) << k;
    for (auto& w : works) w->Wait();
    const std::vector<float> got = buffers[steps]->Download();
    const double scale = std::pow(comm.size(), steps - 1);
    for (size_t i = 0; i < count; ++i) {
      double sum = 0;
      for (int r = 0; r < comm.size(); ++r) sum += value(r, i);
      ASSERT_EQ(got[i], static_cast<float>(sum * scale)) << "[" << i << "]";
    }
  });
}

// A collective is on its stream when its async form returns, the first one included (which NCCL
// may accept only once every peer has issued its own): work the caller queues on the legacy
// default stream after the call, here a device-to-host copy without a Wait, runs after it (see
// NcclOptions::stream), while rank 1 issues 300 ms late. (Were the issue to return before NCCL
// had accepted the call, the copy would read none of the 1024 reduced elements, on both ranks.)
TEST(NcclGpuTest, WorkQueuedAfterAnAsyncCallRunsAfterIt) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, comm.rank(), 1024);
    buffer.Upload(std::vector<float>(1024, 1.0f));
    if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto work = comm.AllReduceAsync(buffer.tensor(), buffer.tensor(), ReduceOp::kSum);
    const std::vector<float> got = buffer.Download();  // no Wait: ordered by the streams
    work->Wait();
    EXPECT_EQ(std::count(got.begin(), got.end(), 2.0f), 1024) << "rank " << comm.rank();
  });
}

// The price of that order (see nccl_communication.h): an async call returns once NCCL has
// accepted it, which for the first call waits for every peer to issue its own. One thread that
// issues rank 0's first call before rank 1's therefore waits, but no longer than the timeout:
// the call then raises kTimeout naming it, and rank 1 is left unharmed.
TEST(NcclGpuTest, AFirstCallIssuedBeforeItsPeersWaitsForThemAtMostTheTimeout) {
  COLLECTIVES_REQUIRE_GPU(2);
  auto store = CreateMemoryStore();
  std::unique_ptr<CollectiveCommunication> comms[2];
  std::thread setups[2];
  for (int rank = 0; rank < 2; ++rank) {
    setups[rank] = std::thread([&, rank] {
      try {
        nccl::NcclOptions nccl_options;
        nccl_options.device = rank;
        comms[rank] = nccl::CreateNcclCommunication(rank, 2, store, "test/nccl/0", NcclOptionsFor(),
                                                    nccl_options);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
      }
    });
  }
  for (std::thread& t : setups) t.join();
  if (comms[0] == nullptr || comms[1] == nullptr) return;
  DeviceBuffer<float> buffer(api, 0, 1024);
  comms[0]->SetTimeout(std::chrono::milliseconds(500));
  const auto start = std::chrono::steady_clock::now();
  auto work = comms[0]->AllReduceAsync(buffer.tensor(), buffer.tensor(), ReduceOp::kSum);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(450));
  EXPECT_LT(took, test_time::Scaled(std::chrono::seconds(5)));
  try {
    work->Wait();
    ADD_FAILURE() << "expected Error(kTimeout)";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_NE(e.message().find("rank 0: all_reduce #0"), std::string::npos) << e.what();
    EXPECT_NE(e.message().find("did not accept the call within 500 ms"), std::string::npos)
        << e.what();
  }
}

// ---- Reduce, Gather, Scatter, AllToAll, Send and Recv, against plain loops on the host. ----

// What the tests put in an output buffer beforehand: no result equals it, and every dtype holds it.
constexpr double kUnwritten = 99;

// The rooted and point-to-point tests' input: small values, and for kProd values of 1 and 2, so
// that a product over four ranks stays exact in int8 and bfloat16.
double RootedValue(ReduceOp op, int rank, size_t i) {
  if (op == ReduceOp::kProd) return static_cast<double>(1 + (i * 7 + size_t(rank) * 3) % 2);
  return InputValue(rank, i);
}

template <typename T>
std::vector<T> RootedInput(ReduceOp op, int rank, size_t count) {
  std::vector<T> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = Elem<T>::Of(RootedValue(op, rank, i));
  return v;
}

// Relative tolerance of a reduced T: a few units in the last place (ncclAvg rounds 1/n to T).
template <typename T>
double Tolerance() {
  if constexpr (std::is_same_v<T, Half>) return std::ldexp(1.0, -8);
  if constexpr (std::is_same_v<T, BFloat16>) return std::ldexp(1.0, -5);
  if constexpr (std::is_same_v<T, float>) return std::ldexp(1.0, -20);
  return std::ldexp(1.0, -48);
}

// `where()` names the element; it runs only on a failure.
template <typename T, typename Where>
void ExpectReduced(double expected, T got_value, const Where& where) {
  const double got = Elem<T>::ToDouble(got_value);
  const double tolerance = Elem<T>::kFloating ? std::abs(expected) * Tolerance<T>() : 0.0;
  if (!(std::abs(got - expected) <= tolerance)) {
    ADD_FAILURE() << where() << ": got " << got << ", expected " << expected;
  }
}

// Bits of a copied T, which must arrive exactly.
template <typename T, typename Where>
void ExpectCopied(double expected, T got_value, const Where& where) {
  const double got = Elem<T>::ToDouble(got_value);
  if (got != expected) ADD_FAILURE() << where() << ": got " << got << ", expected " << expected;
}

// A tensor over `count` elements of `buffer` from element `offset` (an empty one: count 0).
template <typename T>
Tensor View(const DeviceBuffer<T>& buffer, size_t offset, size_t count) {
  Tensor t = buffer.tensor();
  t.data = static_cast<T*>(t.data) + offset;
  t.count = count;
  return t;
}

template <typename T>
Tensor Empty(int device) {
  return Tensor{nullptr, 0, DataTypeOf<T>(), Device::Cuda(device)};
}

// Elements rank `src` sends to rank `dst` in the uneven all-to-all: 0 for some pairs.
size_t UnevenCount(size_t count, int src, int dst) {
  return (count * size_t(src + 2 * dst + 1)) % (count + 3);
}

template <typename T>
void CheckRootedCollectives(const nccl::NcclApi& api, CollectiveCommunication& comm, size_t count) {
  const int size = comm.size();
  const int rank = comm.rank();
  const int device = rank;
  const size_t n = static_cast<size_t>(size);
  const std::string type =
      std::string(ToString(DataTypeOf<T>())) + " count=" + std::to_string(count);
  auto at = [](const std::string& what, size_t i) { return what + " [" + std::to_string(i) + "]"; };

  // Reduce: every op, every root, out of place (recv empty off the root) and in place.
  for (ReduceOp op : kOps) {
    for (int root = 0; root < size; ++root) {
      const std::string where =
          "reduce " + type + " " + ToString(op) + " root=" + std::to_string(root);
      std::vector<double> expected(count);
      std::vector<double> column(n);
      for (size_t i = 0; i < count; ++i) {
        for (int r = 0; r < size; ++r) column[size_t(r)] = RootedValue(op, r, i);
        expected[i] = Reduce<T>(op, column);
      }
      DeviceBuffer<T> send(api, device, count), recv(api, device, count);
      send.Upload(RootedInput<T>(op, rank, count));
      recv.Upload(std::vector<T>(count, Elem<T>::Of(kUnwritten)));
      comm.Reduce(send.tensor(), rank == root ? recv.tensor() : Empty<T>(device), op, root);
      std::vector<T> got = recv.Download();
      for (size_t i = 0; i < count; ++i) {
        if (rank == root) {
          ExpectReduced(expected[i], got[i], [&] { return at(where, i); });
        } else {
          ExpectCopied(kUnwritten, got[i],
                       [&] { return at(where + " (untouched off the root)", i); });
        }
      }
      comm.Reduce(send.tensor(), send.tensor(), op, root);  // in place on the root
      got = send.Download();
      for (size_t i = 0; i < count; ++i) {
        ExpectReduced(rank == root ? expected[i] : RootedValue(op, rank, i), got[i],
                      [&] { return at("in-place " + where, i); });
      }
    }
  }

  for (int root = 0; root < size; ++root) {
    const std::string suffix = " " + type + " root=" + std::to_string(root);
    // Gather, out of place then in place (the root's block already at its place in recv).
    DeviceBuffer<T> part(api, device, count), all(api, device, n * count);
    part.Upload(Input<T>(rank, count));
    all.Upload(std::vector<T>(n * count, Elem<T>::Of(kUnwritten)));
    comm.Gather(part.tensor(), rank == root ? all.tensor() : Empty<T>(device), root);
    std::vector<T> got = all.Download();
    for (size_t k = 0; k < n * count; ++k) {
      const double expected = rank == root ? InputValue(int(k / count), k % count) : kUnwritten;
      ExpectCopied(expected, got[k], [&] { return at("gather" + suffix, k); });
    }
    if (rank == root) {
      std::vector<T> host(n * count, Elem<T>::Of(kUnwritten));
      for (size_t i = 0; i < count; ++i)
        host[size_t(root) * count + i] = Elem<T>::Of(InputValue(rank, i));
      all.Upload(host);
      comm.Gather(View(all, size_t(root) * count, count), all.tensor(), root);
      got = all.Download();
      for (size_t k = 0; k < n * count; ++k) {
        ExpectCopied(InputValue(int(k / count), k % count), got[k],
                     [&] { return at("in-place gather" + suffix, k); });
      }
    } else {
      comm.Gather(part.tensor(), Empty<T>(device), root);
    }

    // Scatter, out of place then in place (the root's block read from its place in send).
    DeviceBuffer<T> whole(api, device, n * count), block(api, device, count);
    whole.Upload(Input<T>(rank, n * count));
    block.Upload(std::vector<T>(count, Elem<T>::Of(kUnwritten)));
    comm.Scatter(rank == root ? whole.tensor() : Empty<T>(device), block.tensor(), root);
    got = block.Download();
    for (size_t i = 0; i < count; ++i) {
      ExpectCopied(InputValue(root, size_t(rank) * count + i), got[i],
                   [&] { return at("scatter" + suffix, i); });
    }
    if (rank == root) {
      comm.Scatter(whole.tensor(), View(whole, size_t(root) * count, count), root);
      got = whole.Download();
      for (size_t k = 0; k < n * count; ++k) {
        ExpectCopied(InputValue(root, k), got[k],
                     [&] { return at("in-place scatter" + suffix, k); });
      }
    } else {
      comm.Scatter(Empty<T>(device), block.tensor(), root);
    }
  }

  // AllToAll with equal blocks: block j of recv = block `rank` of rank j's send.
  {
    DeviceBuffer<T> send(api, device, n * count), recv(api, device, n * count);
    send.Upload(Input<T>(rank, n * count));
    recv.Upload(std::vector<T>(n * count, Elem<T>::Of(kUnwritten)));
    comm.AllToAll(send.tensor(), recv.tensor());
    const std::vector<T> got = recv.Download();
    for (size_t k = 0; k < n * count; ++k) {
      const int from = int(k / count);
      ExpectCopied(InputValue(from, size_t(rank) * count + k % count), got[k],
                   [&] { return at("all_to_all " + type, k); });
    }
  }
  // AllToAll with uneven blocks, some of them empty.
  {
    std::vector<size_t> send_counts(n), recv_counts(n);
    for (int j = 0; j < size; ++j) {
      send_counts[size_t(j)] = UnevenCount(count, rank, j);
      recv_counts[size_t(j)] = UnevenCount(count, j, rank);
    }
    size_t send_total = 0, recv_total = 0;
    for (int j = 0; j < size; ++j) {
      send_total += send_counts[size_t(j)];
      recv_total += recv_counts[size_t(j)];
    }
    DeviceBuffer<T> send(api, device, send_total), recv(api, device, recv_total);
    send.Upload(Input<T>(rank, send_total));
    recv.Upload(std::vector<T>(recv_total, Elem<T>::Of(kUnwritten)));
    comm.AllToAll(send.tensor(), recv.tensor(), send_counts, recv_counts);
    const std::vector<T> got = recv.Download();
    size_t k = 0;
    for (int j = 0; j < size; ++j) {
      size_t offset_in_j = 0;  // where rank j's block for this rank starts in j's send
      for (int d = 0; d < rank; ++d) offset_in_j += UnevenCount(count, j, d);
      for (size_t t = 0; t < recv_counts[size_t(j)]; ++t, ++k) {
        ExpectCopied(InputValue(j, offset_in_j + t), got[k],
                     [&] { return at("uneven all_to_all " + type, k); });
      }
    }
  }

  // Send and Recv around the ring, twice with different tags: each receive gets the send issued
  // in the same order. Rank 0 sends first and the others receive first, so the blocking calls
  // form a chain.
  if (size > 1) {
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    DeviceBuffer<T> out1(api, device, count), out2(api, device, count);
    DeviceBuffer<T> in1(api, device, count), in2(api, device, count);
    out1.Upload(Input<T>(rank, count));
    out2.Upload(Input<T>(rank + 10, count));
    in1.Upload(std::vector<T>(count, Elem<T>::Of(kUnwritten)));
    in2.Upload(std::vector<T>(count, Elem<T>::Of(kUnwritten)));
    auto send_both = [&] {
      comm.Send(out1.tensor(), next, 7);
      comm.Send(out2.tensor(), next, 8);
    };
    auto recv_both = [&] {
      comm.Recv(in1.tensor(), prev, 7);
      comm.Recv(in2.tensor(), prev, 8);
    };
    if (rank == 0) {
      send_both();
      recv_both();
    } else {
      recv_both();
      send_both();
    }
    const std::vector<T> got1 = in1.Download(), got2 = in2.Download();
    for (size_t i = 0; i < count; ++i) {
      ExpectCopied(InputValue(prev, i), got1[i], [&] { return at("recv #1 " + type, i); });
      ExpectCopied(InputValue(prev + 10, i), got2[i], [&] { return at("recv #2 " + type, i); });
    }
    // Async: every rank issues both, in the same order as above, then waits for both.
    in1.Upload(std::vector<T>(count, Elem<T>::Of(kUnwritten)));
    std::shared_ptr<Work> first, second;
    if (rank == 0) {
      first = comm.SendAsync(out2.tensor(), next);
      second = comm.RecvAsync(in1.tensor(), prev);
    } else {
      first = comm.RecvAsync(in1.tensor(), prev);
      second = comm.SendAsync(out2.tensor(), next);
    }
    second->Wait();
    EXPECT_TRUE(first->Done());
    first->Wait();
    const std::vector<T> got3 = in1.Download();
    for (size_t i = 0; i < count; ++i) {
      ExpectCopied(InputValue(prev + 10, i), got3[i], [&] { return at("async recv " + type, i); });
    }
  }
  comm.Barrier();
}

// Every dtype at `count`; past 2^16 elements one dtype of each width (2, 4 and 8 bytes), which
// keeps the case within the fake's 60 s on a loaded machine.
void CheckEveryDtypeRooted(const nccl::NcclApi& api, CollectiveCommunication& comm, size_t count) {
  CheckRootedCollectives<float>(api, comm, count);
  CheckRootedCollectives<Half>(api, comm, count);
  CheckRootedCollectives<int64_t>(api, comm, count);
  if (count > (size_t{1} << 16)) return;
  CheckRootedCollectives<double>(api, comm, count);
  CheckRootedCollectives<BFloat16>(api, comm, count);
  CheckRootedCollectives<int8_t>(api, comm, count);
  CheckRootedCollectives<uint8_t>(api, comm, count);
  CheckRootedCollectives<int32_t>(api, comm, count);
}

// (world size, count): empty, one element, a prime, and a large one.
class NcclRootedTest : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(NcclRootedTest, ReduceGatherScatterAllToAllSendRecvMatchAHostReference) {
  const auto [size, count] = GetParam();
  COLLECTIVES_REQUIRE_GPU(size);
  RunNcclRanks(size,
               [&](CollectiveCommunication& comm) { CheckEveryDtypeRooted(api, comm, count); });
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndCounts, NcclRootedTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{1009},
                                                              (size_t{1} << 18) + 3)),
                         [](const ::testing::TestParamInfo<std::tuple<int, size_t>>& world) {
                           return std::to_string(std::get<0>(world.param)) + "Ranks" +
                                  std::to_string(std::get<1>(world.param)) + "Elements";
                         });

// Bad arguments of the rooted calls, the all-to-all and the point-to-point calls are refused on
// the caller's thread, naming the call and the argument, and the communicator still works.
TEST(NcclGpuTest, BadArgumentsOfTheRootedAndPointToPointCallsAreInvalidArguments) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    DeviceBuffer<float> a(api, rank, 8), b(api, rank, 4), c(api, rank, 16);
    DeviceBuffer<int32_t> d(api, rank, 8);
    auto expect_invalid = [&](const std::string& what, const std::function<void()>& call) {
      try {
        call();
        ADD_FAILURE() << "expected Error(kInvalidArgument) naming " << what;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_NE(e.message().find("rank " + std::to_string(rank) + ": "), std::string::npos)
            << e.what();
        EXPECT_NE(e.message().find(what), std::string::npos) << e.what();
      }
    };
    expect_invalid("root 2", [&] { comm.Reduce(a.tensor(), a.tensor(), ReduceOp::kSum, 2); });
    expect_invalid("root -1", [&] { comm.Gather(a.tensor(), c.tensor(), -1); });
    expect_invalid("root 5", [&] { comm.Scatter(c.tensor(), a.tensor(), 5); });
    // Only the root's recv (reduce, gather) and send (scatter) are checked.
    expect_invalid("reduce", [&] { comm.Reduce(a.tensor(), d.tensor(), ReduceOp::kSum, rank); });
    expect_invalid("reduce", [&] { comm.Reduce(a.tensor(), b.tensor(), ReduceOp::kSum, rank); });
    expect_invalid("gather", [&] { comm.Gather(a.tensor(), a.tensor(), rank); });
    expect_invalid("scatter", [&] { comm.Scatter(a.tensor(), a.tensor(), rank); });
    expect_invalid("all_to_all", [&] { comm.AllToAll(a.tensor(), b.tensor()); });
    expect_invalid("all_to_all", [&] { comm.AllToAll(View(c, 0, 3), View(c, 8, 3)); });
    expect_invalid("send_counts has 1 entries", [&] {
      comm.AllToAll(a.tensor(), a.tensor(), {8}, {4, 4});
    });
    expect_invalid("recv_counts sums to 7", [&] {
      comm.AllToAll(a.tensor(), c.tensor(), {4, 4}, {4, 3});
    });
    expect_invalid("overlap", [&] { comm.AllToAll(View(c, 0, 8), View(c, 4, 8)); });
    expect_invalid("peer 2", [&] { comm.Send(a.tensor(), 2, 0); });
    expect_invalid("peer " + std::to_string(rank) + " is this rank",
                   [&] { comm.Recv(a.tensor(), rank, 0); });
    // Still usable: a reduce to rank 0.
    a.Upload(std::vector<float>(8, 1.0f + rank));
    comm.Reduce(a.tensor(), a.tensor(), ReduceOp::kSum, 0);
    if (rank == 0) {
      for (float v : a.Download()) EXPECT_EQ(v, 3.0f);
    }
  });
}

// NCCL has no tags: a receive pairs with the send issued in the same order, whatever the tags
// say (see nccl_communication.h).
TEST(NcclGpuTest, SendsPairWithReceivesByOrderNotByTag) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    DeviceBuffer<int32_t> first(api, comm.rank(), 5), second(api, comm.rank(), 5);
    if (comm.rank() == 0) {
      first.Upload(std::vector<int32_t>(5, 1));
      second.Upload(std::vector<int32_t>(5, 2));
      auto w1 = comm.SendAsync(first.tensor(), 1, 1);
      auto w2 = comm.SendAsync(second.tensor(), 1, 2);
      w1->Wait();
      w2->Wait();
    } else {
      auto w1 = comm.RecvAsync(first.tensor(), 0, 2);  // tags swapped
      auto w2 = comm.RecvAsync(second.tensor(), 0, 1);
      w1->Wait();
      w2->Wait();
      for (int32_t v : first.Download()) EXPECT_EQ(v, 1);
      for (int32_t v : second.Download()) EXPECT_EQ(v, 2);
    }
  });
}

// A receive whose send never comes is not Error(kMismatch) (NCCL checks nothing) but ends at
// its timeout, naming the call, and the communicator is aborted; the peer is unharmed.
TEST(NcclGpuTest, AReceiveWithoutItsSendTimesOut) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    DeviceBuffer<float> buffer(api, comm.rank(), 16);
    if (comm.rank() == 0) return;
    comm.SetTimeout(std::chrono::milliseconds(300));
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.Recv(buffer.tensor(), 0, 3);
      ADD_FAILURE() << "expected Error(kTimeout)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      EXPECT_NE(e.message().find("rank 1: recv #0 (f32, peer=0, tag=3, count=16)"),
                std::string::npos)
          << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start,
              test_time::Scaled(std::chrono::seconds(10)));
  });
}

// Abort ends the wait of a receive whose send never comes (after a first pair connected the two
// ranks, so that the receive is on the stream): its Work raises Error(kAborted) naming it.
TEST(NcclGpuTest, AbortEndsAReceiveWhoseSendNeverComes) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    DeviceBuffer<float> buffer(api, rank, 64);
    buffer.Upload(std::vector<float>(64, 1.0f + rank));
    if (rank == 0) {
      comm.Send(buffer.tensor(), 1, 0);
      return;
    }
    comm.Recv(buffer.tensor(), 0, 0);
    for (float v : buffer.Download()) EXPECT_EQ(v, 1.0f);
    auto work = comm.RecvAsync(buffer.tensor(), 0, 5);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(work->Done());
    const auto start = std::chrono::steady_clock::now();
    comm.Abort();
    try {
      work->Wait();
      ADD_FAILURE() << "expected Error(kAborted)";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
      EXPECT_NE(e.message().find("recv #1 (f32, peer=0, tag=5, count=64) was in flight"),
                std::string::npos)
          << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, test_time::Scaled(std::chrono::seconds(5)));
  });
}

// A first send to a peer connects the two (as a first collective connects every rank): its
// async form returns once the peer has issued its receive, here 300 ms late, and the data
// arrives.
TEST(NcclGpuTest, AFirstSendWaitsForItsPeersReceive) {
  COLLECTIVES_REQUIRE_GPU(2);
  RunNcclRanks(2, [&](CollectiveCommunication& comm) {
    const int rank = comm.rank();
    DeviceBuffer<int64_t> buffer(api, rank, 1000);
    buffer.Upload(std::vector<int64_t>(1000, rank == 0 ? 42 : -1));
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      comm.Recv(buffer.tensor(), 0, 0);
      for (int64_t v : buffer.Download()) EXPECT_EQ(v, 42);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    auto work = comm.SendAsync(buffer.tensor(), 1, 0);
    EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(250));
    work->Wait();
  });
}

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace
}  // namespace collectives
