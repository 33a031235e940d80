// Checks of reduce, gather, scatter, all-to-all and send/recv against a reference computed here
// in double / int64 from the inputs (collective_checks.h only converts values to and from the
// dtypes): shared by the thread-per-rank tests (rooted_test.cc) and the process-per-rank worker
// (ring_worker.cc).
#ifndef COLLECTIVES_TESTS_RING_ROOTED_CHECKS_H_
#define COLLECTIVES_TESTS_RING_ROOTED_CHECKS_H_

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "collectives/communication.h"
#include "tests/ring/collective_checks.h"

namespace collectives::testing {

inline bool IsFloat(DataType d) {
  return d == DataType::kFloat32 || d == DataType::kFloat64 || d == DataType::kFloat16 ||
         d == DataType::kBFloat16;
}

// `v` as stored in `dtype` and read back (integers wrap, floats round).
inline double AsStored(DataType dtype, double v) {
  uint64_t cell = 0;
  Store(dtype, &cell, 0, v);
  return Load(dtype, &cell, 0);
}

// Element i of op over `size` ranks' InputValue, computed in double (float types) or int64
// (integer types, wrapped into the dtype at the end, as two's complement arithmetic does), with
// kAvg as the sum divided by size: for floats in float (the dtype's precision or float for the
// 16-bit ones), for integers truncated towards zero.
inline double Reference(ReduceOp op, DataType dtype, int size, size_t i) {
  if (IsFloat(dtype)) {
    double acc = InputValue(op, dtype, 0, i);
    for (int r = 1; r < size; ++r) {
      const double v = InputValue(op, dtype, r, i);
      if (op == ReduceOp::kSum || op == ReduceOp::kAvg) acc += v;
      if (op == ReduceOp::kProd) acc *= v;
      if (op == ReduceOp::kMin) acc = std::min(acc, v);
      if (op == ReduceOp::kMax) acc = std::max(acc, v);
    }
    if (op == ReduceOp::kAvg) {
      acc = dtype == DataType::kFloat64 ? acc / size : double(float(acc) / float(size));
    }
    return AsStored(dtype, acc);
  }
  int64_t acc = int64_t(InputValue(op, dtype, 0, i));
  for (int r = 1; r < size; ++r) {
    const int64_t v = int64_t(InputValue(op, dtype, r, i));
    if (op == ReduceOp::kSum || op == ReduceOp::kAvg) acc += v;
    if (op == ReduceOp::kProd) acc *= v;
    if (op == ReduceOp::kMin) acc = std::min(acc, v);
    if (op == ReduceOp::kMax) acc = std::max(acc, v);
  }
  // Wrapped into the dtype first (the sum is reduced in the dtype), then divided.
  const double wrapped = AsStored(dtype, double(acc));
  if (op == ReduceOp::kAvg) return std::trunc(wrapped / size);
  return wrapped;
}

// The value rank r holds at element i of an input that is not reduced (gather, scatter,
// all-to-all): distinct per rank and element, exact in every dtype (0..100).
inline double Plain(int r, size_t i) { return double((size_t(r) * 37 + i * 11) % 101); }

struct Failures {
  size_t wrong = 0;
  std::string first;
  void Check(const std::string& what, size_t i, double got, double want) {
    if (got == want) return;
    if (wrong++ == 0) {
      first = what + ": element " + std::to_string(i) + " is " + std::to_string(got) +
              ", expected " + std::to_string(want);
    }
  }
};

inline std::string Describe(const CollectiveCommunication& comm, const char* collective, DataType d,
                            size_t count, bool in_place, int root) {
  return "rank " + std::to_string(comm.rank()) + " " + collective + " " + ToString(d) +
         " count=" + std::to_string(count) + (in_place ? " in-place" : "") +
         " root=" + std::to_string(root);
}

// One reduce of `count` elements to `root`, checked on the root; off the root, recv (a guard
// buffer) must stay untouched.
inline void CheckReduce(CollectiveCommunication& comm, DataType d, ReduceOp op, size_t count,
                        bool in_place, int root, Failures& f) {
  const int rank = comm.rank();
  Buffer send(d, count), recv(d, count);
  Buffer& input = in_place && rank == root ? recv : send;
  for (size_t i = 0; i < count; ++i) Store(d, input.bytes.data(), i, InputValue(op, d, rank, i));
  const std::vector<uint8_t> recv_before = recv.bytes;
  comm.Reduce(input.tensor(), recv.tensor(), op, root);
  const std::string what = Describe(comm, "reduce", d, count, in_place, root) + " " + ToString(op);
  if (rank == root) {
    for (size_t i = 0; i < count; ++i) {
      f.Check(what, i, Load(d, recv.bytes.data(), i), Reference(op, d, comm.size(), i));
    }
    f.Check(what + " (guard byte)", count, recv.bytes.back(), 0xA5);
  } else if (recv.bytes != recv_before) {
    f.Check(what + " (recv off the root written)", 0, 1, 0);
  }
}

inline void CheckGather(CollectiveCommunication& comm, DataType d, size_t count, bool in_place,
                        int root, Failures& f) {
  const int rank = comm.rank();
  const size_t n = size_t(comm.size());
  Buffer send(d, count), recv(d, n * count);
  Tensor input =
      in_place && rank == root ? recv.tensor(size_t(rank) * count, count) : send.tensor();
  for (size_t i = 0; i < count; ++i) Store(d, input.data, i, Plain(rank, i));
  const std::vector<uint8_t> recv_before = recv.bytes;
  comm.Gather(input, rank == root ? recv.tensor() : Tensor{nullptr, 0, d}, root);
  const std::string what = Describe(comm, "gather", d, count, in_place, root);
  if (rank == root) {
    for (size_t r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) {
        f.Check(what, r * count + i, Load(d, recv.bytes.data(), r * count + i),
                AsStored(d, Plain(int(r), i)));
      }
    }
    f.Check(what + " (guard byte)", n * count, recv.bytes.back(), 0xA5);
  } else if (recv.bytes != recv_before) {
    f.Check(what + " (recv off the root written)", 0, 1, 0);
  }
}

inline void CheckScatter(CollectiveCommunication& comm, DataType d, size_t count, bool in_place,
                         int root, Failures& f) {
  const int rank = comm.rank();
  const size_t n = size_t(comm.size());
  Buffer send(d, n * count), recv(d, count);
  if (rank == root) {
    for (size_t i = 0; i < n * count; ++i) Store(d, send.bytes.data(), i, Plain(root, i));
  }
  const std::vector<uint8_t> send_before = send.bytes;
  Tensor output =
      in_place && rank == root ? send.tensor(size_t(rank) * count, count) : recv.tensor();
  comm.Scatter(rank == root ? send.tensor() : Tensor{nullptr, 0, d}, output, root);
  const std::string what = Describe(comm, "scatter", d, count, in_place, root);
  for (size_t i = 0; i < count; ++i) {
    f.Check(what, i, Load(d, output.data, i), AsStored(d, Plain(root, size_t(rank) * count + i)));
  }
  if (!(in_place && rank == root)) {
    f.Check(what + " (guard byte)", count, recv.bytes.back(), 0xA5);
    if (send.bytes != send_before) f.Check(what + " (send written)", 0, 1, 0);
  }
}

// counts[i][j]: elements rank i sends to rank j. Empty: equal blocks of `block` (no count
// vectors passed).
inline void CheckAllToAll(CollectiveCommunication& comm, DataType d, size_t block,
                          const std::vector<std::vector<size_t>>& counts, Failures& f) {
  const int rank = comm.rank();
  const size_t n = size_t(comm.size());
  std::vector<size_t> send_counts, recv_counts;
  if (counts.empty()) {
    send_counts.assign(n, block);
    recv_counts.assign(n, block);
  } else {
    for (size_t j = 0; j < n; ++j) {
      send_counts.push_back(counts[size_t(rank)][j]);
      recv_counts.push_back(counts[j][size_t(rank)]);
    }
  }
  size_t send_total = 0, recv_total = 0;
  for (size_t j = 0; j < n; ++j) send_total += send_counts[j], recv_total += recv_counts[j];
  Buffer send(d, send_total), recv(d, recv_total);
  // Element e of the block for rank j: Plain(rank, j * 1000 + e).
  size_t at = 0;
  for (size_t j = 0; j < n; ++j) {
    for (size_t e = 0; e < send_counts[j]; ++e) {
      Store(d, send.bytes.data(), at++, Plain(rank, j * 1000 + e));
    }
  }
  const std::vector<uint8_t> send_before = send.bytes;
  if (counts.empty()) {
    comm.AllToAll(send.tensor(), recv.tensor());
  } else {
    comm.AllToAll(send.tensor(), recv.tensor(), send_counts, recv_counts);
  }
  std::string what = "rank " + std::to_string(rank) + " all_to_all " + ToString(d) +
                     (counts.empty() ? " block=" + std::to_string(block) : " uneven");
  at = 0;
  for (size_t j = 0; j < n; ++j) {
    for (size_t e = 0; e < recv_counts[j]; ++e, ++at) {
      f.Check(what, at, Load(d, recv.bytes.data(), at),
              AsStored(d, Plain(int(j), size_t(rank) * 1000 + e)));
    }
  }
  f.Check(what + " (guard byte)", recv_total, recv.bytes.back(), 0xA5);
  if (send.bytes != send_before) f.Check(what + " (send written)", 0, 1, 0);
}

// Uneven splits with zeros: rank i sends (i + 2 j) % 4 elements to rank j, none where that is
// 0, and `extra` more to the next rank.
inline std::vector<std::vector<size_t>> UnevenCounts(size_t n, size_t extra) {
  std::vector<std::vector<size_t>> counts(n, std::vector<size_t>(n));
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) counts[i][j] = (i + 2 * j) % 4;
    counts[i][(i + 1) % n] += extra;
  }
  return counts;
}

// The matrix of one communicator: every dtype x op x count x in-place, the root turning with
// the parameters; `large`: one call of each collective past the small-message sizes (0: none).
inline void CheckRootedMatrix(CollectiveCommunication& comm, size_t large, Failures& f) {
  const size_t n = size_t(comm.size());
  const std::vector<size_t> counts = {0, 1, 7, n + 1};
  int turn = 0;
  for (DataType d : AllDataTypes()) {
    for (size_t count : counts) {
      for (bool in_place : {false, true}) {
        for (ReduceOp op : AllReduceOps()) {
          CheckReduce(comm, d, op, count, in_place, turn++ % int(n), f);
        }
        CheckGather(comm, d, count, in_place, turn++ % int(n), f);
        CheckScatter(comm, d, count, in_place, turn++ % int(n), f);
      }
      CheckAllToAll(comm, d, count, {}, f);
    }
    CheckAllToAll(comm, d, 0, UnevenCounts(n, 0), f);
  }
  if (large == 0) return;
  CheckReduce(comm, DataType::kFloat32, ReduceOp::kSum, large, false, int(n - 1), f);
  CheckReduce(comm, DataType::kInt32, ReduceOp::kMax, large, true, 0, f);
  CheckReduce(comm, DataType::kFloat16, ReduceOp::kAvg, large + 2, false, int(n / 2), f);
  CheckGather(comm, DataType::kBFloat16, large / n + 1, false, int(n - 1), f);
  CheckGather(comm, DataType::kInt64, large / n + 3, true, 0, f);
  CheckScatter(comm, DataType::kFloat32, large / n + 1, false, int(n / 2), f);
  CheckScatter(comm, DataType::kInt8, large / n + 5, true, int(n - 1), f);
  CheckAllToAll(comm, DataType::kFloat32, large / n + 1, {}, f);
  CheckAllToAll(comm, DataType::kUInt8, 0, UnevenCounts(n, large / n), f);
}

// Every rank sends `count` elements of each dtype (tagged with tags of every width) to the
// next rank and receives them from the previous one: even ranks send first, odd ranks receive
// first, so that no cycle of sends waits for receives (a large send waits for its receive).
inline void CheckPointToPointRing(CollectiveCommunication& comm, size_t count, Failures& f) {
  const int n = comm.size();
  const int rank = comm.rank();
  if (n == 1) return;
  const int next = (rank + 1) % n;
  const int prev = (rank + n - 1) % n;
  const int64_t tags[] = {0, -3, int64_t{1} << 40, INT32_MIN};
  int m = 0;
  for (DataType d : AllDataTypes()) {
    const int64_t tag = tags[m % 4];
    Buffer out(d, count), in(d, count);
    for (size_t i = 0; i < count; ++i) Store(d, out.bytes.data(), i, Plain(rank + m, i));
    if (rank % 2 == 0) {
      comm.Send(out.tensor(), next, tag);
      comm.Recv(in.tensor(), prev, tag);
    } else {
      comm.Recv(in.tensor(), prev, tag);
      comm.Send(out.tensor(), next, tag);
    }
    const std::string what = "rank " + std::to_string(rank) + " recv " + ToString(d) +
                             " count=" + std::to_string(count) + " from rank " +
                             std::to_string(prev);
    for (size_t i = 0; i < count; ++i) {
      f.Check(what, i, Load(d, in.bytes.data(), i), AsStored(d, Plain(prev + m, i)));
    }
    f.Check(what + " (guard byte)", count, in.bytes.back(), 0xA5);
    ++m;
  }
}

}  // namespace collectives::testing

#endif  // COLLECTIVES_TESTS_RING_ROOTED_CHECKS_H_
