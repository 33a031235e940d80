// RING on CUDA tensors for the calls beyond staged_test.cc's four: reduce, gather, scatter,
// all-to-all (equal and uneven counts), send / recv with tags, and the packer's fused calls, all
// staged through pinned host memory in segments (src/ring/staged.h). Every result is checked
// element by element against a reference computed on the host from the inputs' formula
// (collective_checks.h), on 1-4 ranks, for float32, float64, int32 and float16 at counts 0, 1, a
// prime and one of many segments, in place where the API has a form for it. The copies stay
// within the staging bound, and a CUDA tensor beside a host one is refused by name.
//
// Runs as staged_test.cc does: on a GPU (label gpu) or against the CPU stand-in of
// tests/nccl/fake ("fake_nccl:" entries), with a staging slot of 4096 bytes unless
// COLLECTIVES_CUDA_STAGING_BYTES says otherwise; elsewhere it skips, saying why.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/communication.h"
#include "collectives/packing.h"
#include "src/ring/staged.h"
#include "tests/ring/collective_checks.h"
#include "tests/ring/run_ranks.h"
#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_loader.h"
#include "tests/ring/staged_device.h"
#endif

namespace collectives::testing {
namespace {

#ifdef COLLECTIVES_WITH_NCCL

CommunicationOptions SmallChunks() {
  CommunicationOptions options;
  options.chunk_bytes = 1024;  // several of the ring's chunks per staged segment
  options.timeout = std::chrono::seconds(60);
  return options;
}

// The value element i of the block that rank `from` sends to rank `to` (a block of its own per
// pair, so a block that lands in the wrong place shows).
double PairValue(int from, int to, size_t i) {
  return InputValue(ReduceOp::kSum, DataType::kUInt8, from * 5 + to, i) + double(to);
}

// Elements rank i sends rank j in the uneven all-to-all of scale `count`: some pairs none, the
// others count plus a little, so blocks differ in length and cross different numbers of segments.
size_t UnevenCount(int i, int j, size_t count) {
  if ((i * 7 + j * 3) % 4 == 0) return 0;
  return count + size_t(i + 2 * j) % 3;
}

const std::vector<DataType>& Dtypes() {
  static const std::vector<DataType> dtypes = {DataType::kFloat32, DataType::kFloat64,
                                               DataType::kInt32, DataType::kFloat16};
  return dtypes;
}

std::string Describe(const CollectiveCommunication& comm, const std::string& collective,
                     DataType dtype, size_t count, bool in_place) {
  std::ostringstream what;
  what << "rank " << comm.rank() << " of " << comm.size() << " " << collective << " "
       << ToString(dtype) << " count=" << count << (in_place ? " in-place" : "");
  return what.str();
}

// A host buffer with element i = value(i), in `dtype`.
template <typename Value>
std::vector<uint8_t> Filled(DataType dtype, size_t count, Value value) {
  std::vector<uint8_t> host(count * SizeOf(dtype));
  for (size_t i = 0; i < count; ++i) Store(dtype, host.data(), i, value(i));
  return host;
}

CheckResult CheckReduce(const nccl::NcclApi& api, CollectiveCommunication& comm, DataType dtype,
                        ReduceOp op, size_t count, bool in_place, int root) {
  const int rank = comm.rank(), n = comm.size(), device = rank % api.device_count;
  const bool is_root = rank == root;
  const std::string what =
      Describe(comm, std::string("reduce ") + ToString(op), dtype, count, in_place);
  DeviceBuffer send(api, device, dtype, count), recv(api, device, dtype, count);
  DeviceBuffer& input = in_place && is_root ? recv : send;
  input.Upload(
      Filled(dtype, count, [&](size_t i) { return InputValue(op, dtype, rank, i); }).data());
  comm.Reduce(input.tensor(), is_root ? recv.tensor() : Tensor{}, op, root);
  CheckResult result;
  if (!is_root) return result;
  const std::vector<uint8_t> got = recv.Download();
  for (size_t i = 0; i < count; ++i) {
    const double want = Expected(op, dtype, n, i), value = Load(dtype, got.data(), i);
    if (value != want) result.Note(what, i, value, want);
  }
  return result;
}

CheckResult CheckGather(const nccl::NcclApi& api, CollectiveCommunication& comm, DataType dtype,
                        size_t count, bool in_place, int root) {
  const int rank = comm.rank(), n = comm.size(), device = rank % api.device_count;
  const bool is_root = rank == root;
  const std::string what = Describe(comm, "gather", dtype, count, in_place);
  DeviceBuffer send(api, device, dtype, count), recv(api, device, dtype, count * size_t(n));
  const auto mine = [&](size_t i) { return PairValue(rank, root, i); };
  Tensor input = send.tensor();
  if (in_place && is_root) {
    input = recv.tensor(size_t(rank) * count, count);
    recv.Upload(Filled(dtype, count * size_t(n), [&](size_t i) {
                  return i / std::max<size_t>(count, 1) == size_t(rank) ? mine(i % count) : 0.0;
                }).data());
  } else {
    send.Upload(Filled(dtype, count, mine).data());
  }
  comm.Gather(input, is_root ? recv.tensor() : Tensor{}, root);
  CheckResult result;
  if (!is_root) return result;
  const std::vector<uint8_t> got = recv.Download();
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < count; ++i) {
      const size_t at = size_t(r) * count + i;
      const double want = Stored(dtype, PairValue(r, root, i)), value = Load(dtype, got.data(), at);
      if (value != want) result.Note(what, at, value, want);
    }
  }
  return result;
}

CheckResult CheckScatter(const nccl::NcclApi& api, CollectiveCommunication& comm, DataType dtype,
                         size_t count, bool in_place, int root) {
  const int rank = comm.rank(), n = comm.size(), device = rank % api.device_count;
  const bool is_root = rank == root;
  const std::string what = Describe(comm, "scatter", dtype, count, in_place);
  DeviceBuffer send(api, device, dtype, count * size_t(n)), recv(api, device, dtype, count);
  if (is_root) {
    send.Upload(Filled(dtype, count * size_t(n), [&](size_t i) {
                  return PairValue(root, int(i / count), i % count);
                }).data());
  }
  const Tensor output =
      in_place && is_root ? send.tensor(size_t(rank) * count, count) : recv.tensor();
  comm.Scatter(is_root ? send.tensor() : Tensor{}, output, root);
  const std::vector<uint8_t> all = (in_place && is_root ? send : recv).Download();
  const uint8_t* got =
      all.data() + (in_place && is_root ? size_t(rank) * count * SizeOf(dtype) : 0);
  CheckResult result;
  for (size_t i = 0; i < count; ++i) {
    const double want = Stored(dtype, PairValue(root, rank, i)), value = Load(dtype, got, i);
    if (value != want) result.Note(what, i, value, want);
  }
  return result;
}

// Equal counts (empty count vectors) or UnevenCount's.
CheckResult CheckAllToAll(const nccl::NcclApi& api, CollectiveCommunication& comm, DataType dtype,
                          size_t count, bool uneven) {
  const int rank = comm.rank(), n = comm.size(), device = rank % api.device_count;
  const std::string what =
      Describe(comm, uneven ? "all_to_all (uneven)" : "all_to_all", dtype, count, false);
  std::vector<size_t> sends(size_t(n), count), recvs(size_t(n), count);
  for (int j = 0; uneven && j < n; ++j) {
    sends[size_t(j)] = UnevenCount(rank, j, count);
    recvs[size_t(j)] = UnevenCount(j, rank, count);
  }
  size_t send_total = 0, recv_total = 0;
  std::vector<uint8_t> host;
  for (int j = 0; j < n; ++j) {
    const std::vector<uint8_t> block =
        Filled(dtype, sends[size_t(j)], [&](size_t i) { return PairValue(rank, j, i); });
    host.insert(host.end(), block.begin(), block.end());
    send_total += sends[size_t(j)];
    recv_total += recvs[size_t(j)];
  }
  DeviceBuffer send(api, device, dtype, send_total), recv(api, device, dtype, recv_total);
  send.Upload(host.data());
  comm.AllToAll(send.tensor(), recv.tensor(), uneven ? sends : std::vector<size_t>{},
                uneven ? recvs : std::vector<size_t>{});
  const std::vector<uint8_t> got = recv.Download();
  CheckResult result;
  for (int j = 0, at = 0; j < n; ++j) {
    for (size_t i = 0; i < recvs[size_t(j)]; ++i, ++at) {
      const double want = Stored(dtype, PairValue(j, rank, i)), value = Load(dtype, got.data(), at);
      if (value != want) result.Note(what + " from rank " + std::to_string(j), i, value, want);
    }
  }
  return result;
}

// A message around the ring (even ranks send first, odd ones receive first): rank r to r + 1 with
// tag `tag`. Where `host_recv`, odd ranks receive into host memory: a CUDA sender's frames are
// those of any message.
CheckResult CheckSendRecv(const nccl::NcclApi& api, CollectiveCommunication& comm, DataType dtype,
                          size_t count, int64_t tag, bool host_recv) {
  const int rank = comm.rank(), n = comm.size(), device = rank % api.device_count;
  const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  const std::string what = Describe(
      comm, "send/recv tag " + std::to_string(tag) + (host_recv ? " into host memory" : ""), dtype,
      count, false);
  DeviceBuffer out(api, device, dtype, count), in(api, device, dtype, count);
  out.Upload(Filled(dtype, count, [&](size_t i) { return PairValue(rank, next, i); }).data());
  const bool on_host = host_recv && rank % 2 == 1;
  std::vector<uint8_t> host_in(count * SizeOf(dtype) + 1, 0xA5);
  const Tensor into = on_host ? Tensor{host_in.data(), count, dtype} : in.tensor();
  if (rank % 2 == 0) {
    comm.Send(out.tensor(), next, tag);
    comm.Recv(into, prev, tag);
  } else {
    comm.Recv(into, prev, tag);
    comm.Send(out.tensor(), next, tag);
  }
  const std::vector<uint8_t> got = on_host ? host_in : in.Download();
  CheckResult result;
  for (size_t i = 0; i < count; ++i) {
    const double want = Stored(dtype, PairValue(prev, rank, i)), value = Load(dtype, got.data(), i);
    if (value != want) result.Note(what, i, value, want);
  }
  if (on_host && host_in.back() != 0xA5) result.Note(what + " (guard byte)", count, 0, 0);
  return result;
}

// The packer's all-reduce and broadcast of a list of CUDA tensors of two dtypes and a host
// tensor, with a cap that fuses several per bucket and buckets larger than a slot.
CheckResult CheckPacked(const nccl::NcclApi& api, CollectiveCommunication& comm, bool async) {
  const int rank = comm.rank(), n = comm.size(), device = rank % api.device_count;
  const std::vector<std::pair<DataType, size_t>> specs = {
      {DataType::kFloat32, 7},    {DataType::kFloat32, 0},   {DataType::kFloat32, 1009},
      {DataType::kInt32, 3},      {DataType::kFloat32, 1},   {DataType::kInt32, 2003},
      {DataType::kFloat32, 3001}, {DataType::kFloat16, 513}, {DataType::kFloat32, 5}};
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  std::vector<Tensor> tensors;
  for (const auto& [dtype, count] : specs) {
    buffers.push_back(std::make_unique<DeviceBuffer>(api, device, dtype, count));
    buffers.back()->Upload(Filled(dtype, count, [&, d = dtype](size_t i) {
                             return InputValue(ReduceOp::kSum, d, rank, i + count);
                           }).data());
    tensors.push_back(buffers.back()->tensor());
  }
  std::vector<float> host(11);
  for (size_t i = 0; i < host.size(); ++i)
    host[i] = float(InputValue(ReduceOp::kSum, DataType::kFloat32, rank, i));
  tensors.insert(tensors.begin() + 3, Tensor{host.data(), host.size(), DataType::kFloat32});
  const size_t cap = 16 * 1024;
  if (async) {
    packing::AllReduceAsync(comm, tensors, ReduceOp::kSum, cap)->Wait();
  } else {
    packing::AllReduce(comm, tensors, ReduceOp::kSum, cap);
  }
  CheckResult result;
  const std::string what = std::string("rank ") + std::to_string(rank) + " of " +
                           std::to_string(n) + " packed all_reduce" + (async ? " (async)" : "");
  for (size_t t = 0; t < specs.size(); ++t) {
    const auto [dtype, count] = specs[t];
    const std::vector<uint8_t> got = buffers[t]->Download();
    for (size_t i = 0; i < count; ++i) {
      const double want = Expected(ReduceOp::kSum, dtype, n, i + count);
      const double value = Load(dtype, got.data(), i);
      if (value != want) result.Note(what + " tensor " + std::to_string(t), i, value, want);
    }
  }
  for (size_t i = 0; i < host.size(); ++i) {
    const double want = Expected(ReduceOp::kSum, DataType::kFloat32, n, i);
    if (host[i] != want) result.Note(what + " host tensor", i, host[i], want);
  }
  // Broadcast of the same list from the last rank, after each rank wrote its rank into it.
  const int root = n - 1;
  for (size_t t = 0; t < specs.size(); ++t) {
    const auto [dtype, count] = specs[t];
    buffers[t]->Upload(
        Filled(dtype, count, [&](size_t i) { return double(rank) + double(i % 5); }).data());
  }
  if (async) {
    packing::BroadcastAsync(comm, tensors, root, cap)->Wait();
  } else {
    packing::Broadcast(comm, tensors, root, cap);
  }
  for (size_t t = 0; t < specs.size(); ++t) {
    const auto [dtype, count] = specs[t];
    const std::vector<uint8_t> got = buffers[t]->Download();
    for (size_t i = 0; i < count; ++i) {
      const double want = Stored(dtype, double(root) + double(i % 5));
      const double value = Load(dtype, got.data(), i);
      if (value != want)
        result.Note(what + " broadcast tensor " + std::to_string(t), i, value, want);
    }
  }
  return result;
}

// ---- Every newly staged call, dtype and count on 1-4 ranks ----

class StagedCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(StagedCollectivesTest, EveryCallDtypeAndCountMatchesTheHostReference) {
  COLLECTIVES_REQUIRE_CUDA();
  const int size = GetParam();
  // 0, 1, a prime, and a prime of many slots (5003 float64 is ~10 slots; a gather's segment on
  // 4 ranks is a fifth of a slot).
  const std::vector<size_t> counts = {0, 1, 1009, 5003};
  RankChecks checks{size_t(size)};
  std::vector<size_t> calls(size_t(size), 0);
  RunRanks(Transport::kInProcess, size, SmallChunks(), [&](CollectiveCommunication& comm) {
    const size_t r = size_t(comm.rank());
    const auto note = [&](const CheckResult& result) {
      ++calls[r];
      checks.Note(comm.rank(), result);
    };
    for (DataType d : Dtypes()) {
      for (size_t count : counts) {
        const int root = int(count % size_t(size));
        for (bool in_place : {false, true}) {
          note(CheckReduce(api, comm, d, ReduceOp::kSum, count, in_place, root));
          note(CheckGather(api, comm, d, count, in_place, root));
          note(CheckScatter(api, comm, d, count, in_place, size - 1 - root));
        }
        note(CheckReduce(api, comm, d, d == DataType::kInt32 ? ReduceOp::kMax : ReduceOp::kAvg,
                         count, false, size - 1));
        note(CheckAllToAll(api, comm, d, count, /*uneven=*/false));
        note(CheckAllToAll(api, comm, d, count, /*uneven=*/true));
        if (size > 1) {
          const int64_t tag = count % 2 == 0 ? int64_t{1} << 40 : -int64_t(count);
          note(CheckSendRecv(api, comm, d, count, tag, /*host_recv=*/false));
          note(CheckSendRecv(api, comm, d, count, tag + 1, /*host_recv=*/true));
        }
      }
    }
    note(CheckPacked(api, comm, /*async=*/false));
    note(CheckPacked(api, comm, /*async=*/true));
  });
  for (int r = 0; r < size; ++r) EXPECT_GT(calls[size_t(r)], 0u);
  checks.ExpectNoneWrong();
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, StagedCollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return "ranks" + std::to_string(p.param);
                         });

// Over TCP and through AUTO, which leaves CUDA tensors to the staged ring.
class StagedCollectivesTransportTest : public ::testing::TestWithParam<Transport> {};

TEST_P(StagedCollectivesTransportTest, EveryCallOnThreeRanks) {
  COLLECTIVES_REQUIRE_CUDA();
  const int size = 3;
  RankChecks checks{size_t(size)};
  RunRanks(GetParam(), size, SmallChunks(), [&](CollectiveCommunication& comm) {
    const auto note = [&](const CheckResult& result) { checks.Note(comm.rank(), result); };
    for (size_t count : {size_t(1), size_t(3001)}) {
      const DataType d = DataType::kFloat32;
      note(CheckReduce(api, comm, d, ReduceOp::kSum, count, count == 1, 1));
      note(CheckGather(api, comm, d, count, count == 1, 2));
      note(CheckScatter(api, comm, d, count, count == 1, 0));
      note(CheckAllToAll(api, comm, d, count, /*uneven=*/true));
      note(CheckSendRecv(api, comm, d, count, 5, /*host_recv=*/true));
    }
    note(CheckPacked(api, comm, /*async=*/true));
  });
  checks.ExpectNoneWrong();
}

INSTANTIATE_TEST_SUITE_P(Transports, StagedCollectivesTransportTest,
                         ::testing::Values(Transport::kTcp, Transport::kAuto),
                         [](const ::testing::TestParamInfo<Transport>& p) {
                           return std::string(TransportName(p.param));
                         });

// ---- The staging bound, as the fake counts the copies (skipped on a real GPU) ----

// No copy between host and device is larger than a slot, the bytes that cross are each input's
// and each output's once, every async copy has a pinned host side, and each communicator holds
// its two slots of pinned memory: tensors of 1 MiB per rank go through 2 x 4 KiB.
TEST(StagedCollectivesBoundTest, NoCopyIsLargerThanASlotAndThePinnedMemoryIsTwoSlots) {
  COLLECTIVES_REQUIRE_CUDA();
  const FakeCounters fake = FindFakeCounters();
  if (fake.stats == nullptr)
    GTEST_SKIP() << "needs the fake CUDA of tests/nccl/fake to count copies";
  const size_t slot = ring::CudaStagingBytes();
  ASSERT_LT(slot, size_t(1) << 18);
  const int size = 2;
  const size_t n = size_t(size), count = size_t(1) << 18, bytes = count * 4;  // f32: 1 MiB
  struct Case {
    const char* call;
    size_t crossing;  // bytes between host and device, all ranks, both ways
  };
  for (const Case& c :
       {Case{"reduce", n * bytes + bytes}, Case{"gather", n * (bytes / n) + bytes},
        Case{"scatter", bytes + n * (bytes / n)}, Case{"all_to_all", n * bytes + n * bytes},
        Case{"send_recv", bytes + bytes}}) {
    SCOPED_TRACE(c.call);
    const std::string call = c.call;
    std::vector<std::unique_ptr<DeviceBuffer>> send, recv;
    for (int r = 0; r < size; ++r) {
      const size_t in = call == "gather" ? count / n : count;
      const size_t out = call == "scatter" ? count / n : count;
      send.push_back(std::make_unique<DeviceBuffer>(api, r, DataType::kFloat32, in));
      recv.push_back(std::make_unique<DeviceBuffer>(api, r, DataType::kFloat32, out));
      send.back()->Upload(Filled(DataType::kFloat32, in, [&](size_t i) {
                            return double(i % 7 + size_t(r));
                          }).data());
    }
    ASSERT_NO_FATAL_FAILURE(ExpectStagingBound(api, fake, size, slot, c.crossing, [&] {
      RunRanks(Transport::kInProcess, size, SmallChunks(), [&](CollectiveCommunication& comm) {
        const size_t r = size_t(comm.rank());
        const Tensor s = send[r]->tensor(), o = recv[r]->tensor();
        if (call == "reduce") comm.Reduce(s, r == 0 ? o : Tensor{}, ReduceOp::kSum, 0);
        if (call == "gather") comm.Gather(s, r == 0 ? o : Tensor{}, 0);
        if (call == "scatter") comm.Scatter(r == 0 ? s : Tensor{}, o, 0);
        if (call == "all_to_all") comm.AllToAll(s, o, {}, {});
        if (call == "send_recv" && r == 0) comm.Send(s, 1, 3);
        if (call == "send_recv" && r == 1) comm.Recv(o, 0, 3);
      });
    }));
  }
}

// ---- Refusals ----

TEST(StagedCollectivesRefusalTest, ACudaTensorBesideAHostOneIsRefusedByName) {
  COLLECTIVES_REQUIRE_CUDA();
  RunRanks(Transport::kInProcess, 1, SmallChunks(), [&](CollectiveCommunication& comm) {
    DeviceBuffer device(api, 0, DataType::kFloat32, 16);
    std::vector<float> host(16, 1.0f);
    const Tensor on_host{host.data(), 16, DataType::kFloat32};
    const auto expect_refused = [&](const char* what, const std::function<void()>& call) {
      try {
        call();
        ADD_FAILURE() << what << ": expected kInvalidArgument";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << what << ": " << e.what();
        EXPECT_NE(e.message().find("one device"), std::string::npos) << e.what();
        EXPECT_NE(e.message().find("cuda:0"), std::string::npos) << e.what();
      }
    };
    expect_refused("reduce", [&] { comm.Reduce(device.tensor(), on_host, ReduceOp::kSum, 0); });
    expect_refused("gather", [&] { comm.Gather(on_host, device.tensor(), 0); });
    expect_refused("scatter", [&] { comm.Scatter(device.tensor(), on_host, 0); });
    expect_refused("all_to_all", [&] { comm.AllToAll(device.tensor(), on_host, {}, {}); });
    // Still working: the refusals are argument errors, not failures.
    comm.AllToAll(device.tensor(0, 8), device.tensor(8, 8), {}, {});
  });
}

// A message is staged in whole frames: frames (chunk_bytes) larger than the slot are refused on
// the staged side before anything moves, naming both sizes, and the communicator works on.
TEST(StagedCollectivesRefusalTest, FramesLargerThanTheSlotAreRefusedByName) {
  COLLECTIVES_REQUIRE_CUDA();
  CommunicationOptions options = SmallChunks();
  options.chunk_bytes = 4 * ring::CudaStagingBytes();
  RunRanks(Transport::kInProcess, 2, options, [&](CollectiveCommunication& comm) {
    const size_t count = 2 * ring::CudaStagingBytes();  // f32: frames of 4 slots each
    DeviceBuffer device(api, comm.rank() % api.device_count, DataType::kFloat32, count);
    try {
      if (comm.rank() == 0) comm.Send(device.tensor(), 1, 7);
      if (comm.rank() == 1) comm.Recv(device.tensor(), 0, 7);
      ADD_FAILURE() << "frames of 4 slots: expected kNotSupported";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kNotSupported) << e.what();
      EXPECT_NE(e.message().find("do not fit the staging slot of " +
                                 std::to_string(ring::CudaStagingBytes())),
                std::string::npos)
          << e.what();
    }
    // A message of one frame that fits goes.
    std::vector<float> host(16, float(comm.rank() + 1));
    DeviceBuffer small(api, comm.rank() % api.device_count, DataType::kFloat32, 16);
    small.Upload(host.data());
    if (comm.rank() == 0) comm.Send(small.tensor(), 1, 8);
    if (comm.rank() == 1) {
      comm.Recv(small.tensor(), 0, 8);
      const std::vector<uint8_t> got = small.Download();
      EXPECT_EQ(Load(DataType::kFloat32, got.data(), 15), 1.0);
    }
  });
}

#else

TEST(StagedCollectivesTest, NeedsABuildWithCuda) {
  GTEST_SKIP() << "this library is built without CUDA (-DCOLLECTIVES_WITH_NCCL=ON)";
}

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace
}  // namespace collectives::testing
