// Checks every collective, element by element, against a reference computed locally: shared by
// the thread-per-rank tests (ring_test.cc) and the process-per-rank worker (ring_worker.cc).
//
// Inputs are small integers chosen so that every dtype holds every partial result exactly
// (sums of at most 8 values in 0..4, products of 1, 2 and -1, which wrap identically in any order
// for the 8-bit types), so results must match the reference bit for bit whatever the order of
// reduction.
#ifndef COLLECTIVES_TESTS_RING_COLLECTIVE_CHECKS_H_
#define COLLECTIVES_TESTS_RING_COLLECTIVE_CHECKS_H_

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "collectives/communication.h"
#include "collectives/packing.h"
#include "src/core/kernels.h"

namespace collectives::testing {

inline bool IsSigned(DataType d) { return d != DataType::kUInt8; }

// The value rank `rank` contributes at element `i` for `op`.
inline double InputValue(ReduceOp op, DataType dtype, int rank, size_t i) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return double((size_t(rank) * 3 + i * 7) % 5);
    case ReduceOp::kProd:
      if (IsSigned(dtype) && (size_t(rank) * 5 + i) % 7 == 0) return -1;
      return (size_t(rank) + i) % 3 == 0 ? 2 : 1;
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      return double((size_t(rank) * 31 + i * 17) % 11) - (IsSigned(dtype) ? 5 : 0);
  }
  return 0;
}

// Stores `v` as element i of a `dtype` buffer (integers wrap as the kernels do).
inline void Store(DataType dtype, void* data, size_t i, double v) {
  switch (dtype) {
    case DataType::kFloat32: static_cast<float*>(data)[i] = float(v); break;
    case DataType::kFloat64: static_cast<double*>(data)[i] = v; break;
    case DataType::kFloat16: static_cast<uint16_t*>(data)[i] = core::FloatToHalf(float(v)); break;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(data)[i] = core::FloatToBFloat16(float(v));
      break;
    case DataType::kInt8: static_cast<int8_t*>(data)[i] = int8_t(uint8_t(int64_t(v))); break;
    case DataType::kUInt8: static_cast<uint8_t*>(data)[i] = uint8_t(int64_t(v)); break;
    case DataType::kInt32: static_cast<int32_t*>(data)[i] = int32_t(int64_t(v)); break;
    case DataType::kInt64: static_cast<int64_t*>(data)[i] = int64_t(v); break;
  }
}

inline double Load(DataType dtype, const void* data, size_t i) {
  switch (dtype) {
    case DataType::kFloat32: return static_cast<const float*>(data)[i];
    case DataType::kFloat64: return static_cast<const double*>(data)[i];
    case DataType::kFloat16: return core::HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DataType::kBFloat16:
      return core::BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DataType::kInt8: return static_cast<const int8_t*>(data)[i];
    case DataType::kUInt8: return static_cast<const uint8_t*>(data)[i];
    case DataType::kInt32: return static_cast<const int32_t*>(data)[i];
    case DataType::kInt64: return double(static_cast<const int64_t*>(data)[i]);
  }
  return 0;
}

// `v` as a buffer of `dtype` holds it (rounded, wrapped).
inline double Stored(DataType dtype, double v) {
  uint64_t cell = 0;
  Store(dtype, &cell, 0, v);
  return Load(dtype, &cell, 0);
}

// The reduced value of element i over `size` ranks, as stored in `dtype`.
inline double Expected(ReduceOp op, DataType dtype, int size, size_t i) {
  double acc = InputValue(op, dtype, 0, i);
  for (int r = 1; r < size; ++r) {
    const double v = InputValue(op, dtype, r, i);
    switch (op) {
      case ReduceOp::kSum: case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProd: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  uint64_t cell = 0;
  Store(dtype, &cell, 0, acc);  // wraps integers, rounds floats, as the buffers would
  if (op == ReduceOp::kAvg) core::DivideInPlace(dtype, &cell, 1, size_t(size));
  return Load(dtype, &cell, 0);
}

// A byte buffer of `count` elements of `dtype`, filled with a guard pattern.
struct Buffer {
  Buffer(DataType d, size_t n) : dtype(d), count(n), bytes(n * SizeOf(d) + 1, 0xA5) {}
  Tensor tensor(size_t offset = 0, size_t elements = SIZE_MAX) {
    const size_t n = elements == SIZE_MAX ? count - offset : elements;
    return Tensor{bytes.data() + offset * SizeOf(dtype), n, dtype};
  }
  DataType dtype;
  size_t count;
  std::vector<uint8_t> bytes;
};

struct CheckResult {
  size_t wrong = 0;
  std::string first;  // the first wrong element, described
  void Note(const std::string& what, size_t i, double got, double want) {
    if (wrong++ == 0) {
      std::ostringstream out;
      out << what << ": element " << i << " is " << got << ", expected " << want;
      first = out.str();
    }
  }
};

// Runs one collective on `comm` with inputs as above and checks the result of this rank.
// `in_place` uses one buffer for send and recv (at the offsets the API defines).
inline CheckResult CheckCollective(CollectiveCommunication& comm, const std::string& collective,
                                   DataType dtype, ReduceOp op, size_t count, bool in_place,
                                   int root = 0) {
  const int n = comm.size();
  const int rank = comm.rank();
  std::ostringstream what;
  what << "rank " << rank << " " << collective << " " << ToString(dtype) << " "
       << ToString(op) << " count=" << count << (in_place ? " in-place" : "");
  CheckResult result;
  if (collective == "all_reduce") {
    Buffer send(dtype, count), recv(dtype, count);
    Buffer& input = in_place ? recv : send;
    for (size_t i = 0; i < count; ++i) Store(dtype, input.bytes.data(), i, InputValue(op, dtype, rank, i));
    comm.AllReduce(input.tensor(), recv.tensor(), op);
    for (size_t i = 0; i < count; ++i) {
      const double want = Expected(op, dtype, n, i), got = Load(dtype, recv.bytes.data(), i);
      if (got != want) result.Note(what.str(), i, got, want);
    }
    if (recv.bytes.back() != 0xA5) result.Note(what.str() + " (guard byte overwritten)", count, 0, 0);
  } else if (collective == "broadcast") {
    Buffer send(dtype, count), recv(dtype, count);
    Buffer& input = in_place ? recv : send;
    if (rank == root) {
      for (size_t i = 0; i < count; ++i) Store(dtype, input.bytes.data(), i, InputValue(op, dtype, root, i));
    }
    comm.Broadcast(rank == root ? input.tensor() : Tensor{}, recv.tensor(), root);
    for (size_t i = 0; i < count; ++i) {
      const double want = InputValue(op, dtype, root, i);
      uint64_t cell = 0;
      Store(dtype, &cell, 0, want);
      const double stored = Load(dtype, &cell, 0), got = Load(dtype, recv.bytes.data(), i);
      if (got != stored) result.Note(what.str(), i, got, stored);
    }
    if (recv.bytes.back() != 0xA5) result.Note(what.str() + " (guard byte overwritten)", count, 0, 0);
  } else if (collective == "all_gather") {
    Buffer send(dtype, count), recv(dtype, count * size_t(n));
    Tensor input = in_place ? recv.tensor(size_t(rank) * count, count) : send.tensor();
    for (size_t i = 0; i < count; ++i) Store(dtype, input.data, i, InputValue(op, dtype, rank, i));
    comm.AllGather(input, recv.tensor());
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) {
        uint64_t cell = 0;
        Store(dtype, &cell, 0, InputValue(op, dtype, r, i));
        const double want = Load(dtype, &cell, 0);
        const double got = Load(dtype, recv.bytes.data(), size_t(r) * count + i);
        if (got != want) result.Note(what.str(), size_t(r) * count + i, got, want);
      }
    }
    if (recv.bytes.back() != 0xA5) result.Note(what.str() + " (guard byte overwritten)", count, 0, 0);
  } else if (collective == "reduce_scatter") {
    Buffer send(dtype, count * size_t(n)), recv(dtype, count);
    for (size_t i = 0; i < count * size_t(n); ++i) {
      Store(dtype, send.bytes.data(), i, InputValue(op, dtype, rank, i));
    }
    Tensor output = in_place ? send.tensor(size_t(rank) * count, count) : recv.tensor();
    comm.ReduceScatter(send.tensor(), output, op);
    for (size_t i = 0; i < count; ++i) {
      const size_t global = size_t(rank) * count + i;
      const double want = Expected(op, dtype, n, global), got = Load(dtype, output.data, i);
      if (got != want) result.Note(what.str(), i, got, want);
    }
    if (!in_place && recv.bytes.back() != 0xA5) {
      result.Note(what.str() + " (guard byte overwritten)", count, 0, 0);
    }
  }
  return result;
}

inline const std::vector<std::string>& AllCollectives() {
  static const std::vector<std::string> kAll = {"all_reduce", "broadcast", "all_gather",
                                                "reduce_scatter"};
  return kAll;
}

inline std::vector<DataType> AllDataTypes() {
  std::vector<DataType> all;
  for (int d = 0; d < kNumDataTypes; ++d) all.push_back(static_cast<DataType>(d));
  return all;
}

inline std::vector<ReduceOp> AllReduceOps() {
  std::vector<ReduceOp> all;
  for (int o = 0; o < kNumReduceOps; ++o) all.push_back(static_cast<ReduceOp>(o));
  return all;
}

// Runs the whole matrix (every collective x dtype x op x count x in-place) on this rank and
// returns the total number of wrong elements; `failures` gets the first few descriptions.
// Counts: 0, 1, 7, n-1, n+1 for every combination, plus `large` for a few.
inline size_t CheckMatrix(CollectiveCommunication& comm, size_t large,
                          std::vector<std::string>* failures) {
  const size_t n = size_t(comm.size());
  size_t wrong = 0;
  auto run = [&](const std::string& c, DataType d, ReduceOp o, size_t count, bool in_place,
                 int root) {
    CheckResult r = CheckCollective(comm, c, d, o, count, in_place, root);
    wrong += r.wrong;
    if (r.wrong > 0 && failures->size() < 10) failures->push_back(r.first);
  };
  const std::vector<size_t> counts = {0, 1, 7, n - 1 > 0 ? n - 1 : 2, n + 1};
  for (const std::string& c : AllCollectives()) {
    const bool reduces = c == "all_reduce" || c == "reduce_scatter";
    for (DataType d : AllDataTypes()) {
      for (ReduceOp o : AllReduceOps()) {
        if (!reduces && o != ReduceOp::kSum) continue;
        for (size_t count : counts) {
          for (bool in_place : {false, true}) {
            const int root = c == "broadcast" ? int((count + size_t(in_place)) % n) : 0;
            run(c, d, o, count, in_place, root);
          }
        }
      }
    }
  }
  if (large > 0) {
    run("all_reduce", DataType::kFloat32, ReduceOp::kSum, large, false, 0);
    run("all_reduce", DataType::kFloat16, ReduceOp::kAvg, large, true, 0);
    run("all_reduce", DataType::kInt64, ReduceOp::kMax, large, false, 0);
    run("broadcast", DataType::kInt32, ReduceOp::kSum, large, false, int(n - 1));
    run("all_gather", DataType::kBFloat16, ReduceOp::kSum, large / n + 1, false, 0);
    run("reduce_scatter", DataType::kFloat32, ReduceOp::kSum, large / n + 1, false, 0);
    run("reduce_scatter", DataType::kInt8, ReduceOp::kProd, large / n + 1, true, 0);
  }
  return wrong;
}

// Packed all-reduces and broadcasts of a list (odd counts, mixed dtypes, a zero-size tensor, one
// tensor larger than the cap, alone in its bucket), blocking and asynchronous, for a few ops and
// two caps; every element of every tensor checked. Returns the number of wrong elements.
inline size_t CheckPacked(CollectiveCommunication& comm, std::vector<std::string>* failures) {
  const std::vector<std::pair<DataType, size_t>> specs = {
      {DataType::kFloat32, 7},  {DataType::kFloat64, 0}, {DataType::kInt32, 1009},
      {DataType::kFloat16, 13}, {DataType::kInt8, 3},    {DataType::kFloat32, 20011},
      {DataType::kBFloat16, 1}};
  const int n = comm.size();
  const int rank = comm.rank();
  const int root = n - 1;
  size_t wrong = 0;
  for (const char* collective : {"all_reduce", "broadcast"}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
      const bool reduces = std::string(collective) == "all_reduce";
      if (!reduces && op != ReduceOp::kSum) continue;
      for (size_t cap : {size_t{4096}, size_t{0}}) {
        for (bool async : {false, true}) {
          std::vector<Buffer> buffers;
          std::vector<Tensor> tensors;
          buffers.reserve(specs.size());
          for (size_t t = 0; t < specs.size(); ++t) {
            buffers.emplace_back(specs[t].first, specs[t].second);
            // A broadcast's other ranks keep the fill bytes (0xA5: negative, never an input).
            for (size_t i = 0; i < specs[t].second && (reduces || rank == root); ++i) {
              Store(specs[t].first, buffers[t].bytes.data(), i,
                    InputValue(op, specs[t].first, rank, t * 7919 + i));
            }
            tensors.push_back(buffers[t].tensor());
          }
          if (reduces && async) {
            packing::AllReduceAsync(comm, tensors, op, cap)->Wait();
          } else if (reduces) {
            packing::AllReduce(comm, tensors, op, cap);
          } else if (async) {
            packing::BroadcastAsync(comm, tensors, root, cap)->Wait();
          } else {
            packing::Broadcast(comm, tensors, root, cap);
          }
          for (size_t t = 0; t < specs.size(); ++t) {
            std::ostringstream what;
            what << "rank " << rank << " packed " << collective << (async ? " async " : " ")
                 << ToString(op) << " cap=" << cap << " tensor " << t << " ("
                 << ToString(specs[t].first) << " x" << specs[t].second << ")";
            CheckResult result;
            for (size_t i = 0; i < specs[t].second; ++i) {
              const size_t index = t * 7919 + i;
              const double want = reduces ? Expected(op, specs[t].first, n, index)
                                          : InputValue(op, specs[t].first, root, index);
              const double got = Load(specs[t].first, buffers[t].bytes.data(), i);
              if (got != want) result.Note(what.str(), i, got, want);
            }
            wrong += result.wrong;
            if (result.wrong > 0 && failures->size() < 10) failures->push_back(result.first);
          }
        }
      }
    }
  }
  return wrong;
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_RING_COLLECTIVE_CHECKS_H_
