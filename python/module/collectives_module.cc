// collectives._collectives: the numpy module, a thin pybind11 layer over the public C++ API.
//
// Every collective takes its buffers through the buffer protocol or DLPack (buffers.h), without
// copies, and runs with the GIL released. A blocking call runs the library's blocking call on
// the caller's thread (no thread hand-off, whatever its size). On the main thread it stays
// interruptible: a SIGINT handler that wraps Python's own (which only flags the signal) wakes a
// watchdog thread that aborts the communicator of the call in progress, so the call returns at
// once with kAborted and the module raises the KeyboardInterrupt that Python's handler
// recorded. The set-up (the constructor) waits on a thread of its own and checks for signals.
// An async call returns a Work that holds its buffers until the collective has completed.
//
// Thread-safety: a Communication may be used from several Python threads, as the C++ one may;
// close() waits for nothing on other threads: their calls keep the communicator alive until they
// return.
#include <errno.h>
#include <pthread.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <semaphore.h>
#include <signal.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "buffers.h"
#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "collectives/packing.h"
#include "collectives/types.h"
#include "collectives/version.h"

namespace py = pybind11;

namespace collectives::python {
namespace {

using Seconds = std::chrono::duration<double>;
using CommPtr = std::shared_ptr<CollectiveCommunication>;
using Buffers = std::vector<std::unique_ptr<BorrowedBuffer>>;

// ---- Errors: collectives::Error -> the package's exception class for its code. ----

// Set by collectives/__init__.py (_set_error_classes); indexed by ErrorCode. Leaked on purpose:
// they must outlive every translation, interpreter shutdown included.
std::array<PyObject*, 11>& ErrorClasses() {
  static auto* classes = new std::array<PyObject*, 11>{};
  return *classes;
}

void SetPythonError(const Error& e) {
  const int code = static_cast<int>(e.code());
  PyObject* cls = code >= 0 && code < 11 ? ErrorClasses()[code] : nullptr;
  PyErr_SetString(cls != nullptr ? cls : PyExc_RuntimeError, e.message().c_str());
}

// ---- Ctrl-C during a blocking call. ----
//
// Python's SIGINT handler only records the signal; the main thread raises KeyboardInterrupt at
// its next bytecode, which a thread blocked in C++ never reaches. OnSigint, installed over
// Python's handler at the first blocking call of the main thread, chains to it and posts
// `g_sigint`, async-signal-safely; the watchdog thread then aborts the communicator the main
// thread's call runs on, if any, which makes the call return within about a second (Abort's
// bound), and the caller turns the kAborted into the KeyboardInterrupt. Between calls OnSigint
// is Python's handler with one extra sem_post.
//
// Installing costs system calls, so a call only re-checks, at most every 100 ms, that OnSigint
// still wraps the installed handler: after signal.signal(SIGINT, f), Python's handler is back,
// and the next check wraps it again (SIG_IGN and SIG_DFL are left alone).

sem_t g_sigint;
std::atomic<void (*)(int)> g_python_handler{nullptr};
std::mutex g_target_mu;
CommPtr g_target;  // the communicator the main thread's call runs on; GUARDED_BY(g_target_mu)
std::once_flag g_watchdog_once;
unsigned long g_main_thread = 0;                       // PyThread ident of the main thread
std::chrono::steady_clock::time_point g_next_check{};  // main thread only

void OnSigint(int sig) {
  const int saved_errno = errno;
  if (auto handler = g_python_handler.load()) handler(sig);
  sem_post(&g_sigint);
  errno = saved_errno;
}

void Watchdog() {
  for (;;) {
    while (sem_wait(&g_sigint) != 0) {
    }
    std::lock_guard<std::mutex> lock(g_target_mu);
    if (g_target) g_target->Abort();
  }
}

// Whether OnSigint wraps the installed SIGINT handler, installing it over Python's (or another
// plain C handler) when that is what is installed; as of the last check, at most 100 ms old.
// Main thread, GIL held.
bool EnsureSigintHandler() {
  const auto now = std::chrono::steady_clock::now();
  static bool installed = false;
  if (now < g_next_check) return installed;
  g_next_check = now + std::chrono::milliseconds(100);
  struct sigaction current {};
  installed = false;
  if (sigaction(SIGINT, nullptr, &current) != 0) return false;
  if (current.sa_handler == OnSigint && (current.sa_flags & SA_SIGINFO) == 0) {
    return installed = true;
  }
  if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler == SIG_DFL ||
      current.sa_handler == SIG_IGN) {
    return false;
  }
  std::call_once(g_watchdog_once, [] {
    sem_init(&g_sigint, 0, 0);
    std::thread(Watchdog).detach();
  });
  g_python_handler.store(current.sa_handler);
  struct sigaction ours = current;
  ours.sa_handler = OnSigint;
  installed = sigaction(SIGINT, &ours, nullptr) == 0;
  return installed;
}

// Names `comm` as the one a SIGINT aborts while it lives, on the main thread. Built and
// destroyed with the GIL held.
class SigintGuard {
 public:
  explicit SigintGuard(const CommPtr& comm) {
    if (!comm || PyThread_get_thread_ident() != g_main_thread || !EnsureSigintHandler()) return;
    std::lock_guard<std::mutex> lock(g_target_mu);
    g_target = comm;
    active_ = true;
  }
  ~SigintGuard() {
    if (!active_) return;
    std::lock_guard<std::mutex> lock(g_target_mu);
    g_target.reset();
  }
  SigintGuard(const SigintGuard&) = delete;
  SigintGuard& operator=(const SigintGuard&) = delete;

 private:
  bool active_ = false;
};

// Runs `call` (which takes no Python object) with the GIL released, interruptible as above.
// A pending KeyboardInterrupt wins over the call's own error.
template <typename Call>
void RunBlocking(const CommPtr& comm, Call&& call) {
  std::optional<Error> error;
  {
    SigintGuard guard(comm);
    py::gil_scoped_release release;
    try {
      call();
    } catch (const Error& e) {
      error.emplace(e);
    }
  }
  if (error) {
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    throw *error;
  }
}

// A timeout in seconds: a number, or a datetime.timedelta.
Seconds ToSeconds(const py::handle& value, const char* where) {
  double seconds = 0;
  if (py::hasattr(value, "total_seconds")) {
    seconds = value.attr("total_seconds")().cast<double>();
  } else if (PyNumber_Check(value.ptr())) {
    seconds = py::float_(py::reinterpret_borrow<py::object>(value)).cast<double>();
  } else {
    throw py::type_error(std::string(where) +
                         ": timeout must be seconds (a number) or a "
                         "datetime.timedelta, got " +
                         py::str(py::type::of(value)).cast<std::string>());
  }
  if (!(seconds > 0)) {
    throw Error(
        ErrorCode::kInvalidArgument,
        std::string(where) + ": timeout must be positive, got " + std::to_string(seconds) + " s");
  }
  return Seconds(seconds);
}

// A year at most, as the library reads any longer timeout.
std::chrono::milliseconds ToMilliseconds(Seconds s) {
  const double ms = std::min(s.count() * 1000.0, 365.0 * 24 * 3600 * 1000);
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(ms)));
}

// ---- Work ----

// An async collective: the library's Work, the buffers it borrows and the object wait() returns.
class PyWork {
 public:
  PyWork(std::shared_ptr<Work> work, std::weak_ptr<CollectiveCommunication> comm, Buffers buffers,
         py::object result)
      : work_(std::move(work)),
        comm_(std::move(comm)),
        buffers_(std::move(buffers)),
        result_(std::move(result)) {}

  // A Work dropped unfinished waits for its collective: the buffers must outlive it.
  ~PyWork() {
    if (work_ && !work_->Done()) {
      py::gil_scoped_release release;
      try {
        work_->Wait();
      } catch (...) {  // its error is for wait(), which nobody can call any more
      }
    }
  }

  py::object Wait() {
    RunBlocking(comm_.lock(), [&] { work_->Wait(); });
    buffers_.clear();
    return result_;
  }

  bool Done() {
    const bool done = work_->Done();
    if (done) buffers_.clear();
    return done;
  }

 private:
  std::shared_ptr<Work> work_;
  std::weak_ptr<CollectiveCommunication> comm_;
  Buffers buffers_;
  py::object result_;
};

// ---- Arguments ----

std::optional<DataType> ParseDtype(const py::object& dtype) {
  if (dtype.is_none()) return std::nullopt;
  if (py::isinstance<py::str>(dtype)) return ParseDataType(dtype.cast<std::string>());
  // A numpy dtype or type: its name ("float16", "uint16").
  if (py::hasattr(dtype, "name"))
    return ParseDataType(py::str(dtype.attr("name")).cast<std::string>());
  if (py::hasattr(dtype, "__name__")) {
    return ParseDataType(py::str(dtype.attr("__name__")).cast<std::string>());
  }
  return ParseDataType(py::str(dtype).cast<std::string>());
}

// The buffers of one call, acquired with the GIL held and released when it is done.
class Args {
 public:
  Args(int rank, const char* collective, const py::object& dtype)
      : rank_(rank), collective_(collective), dtype_(ParseDtype(dtype)) {}

  const Tensor& Add(py::handle obj, const char* name, bool writable) {
    buffers_.push_back(Acquire(obj, rank_, collective_, name, writable, dtype_));
    return buffers_.back()->tensor;
  }
  // An unused buffer (recv off the root of a reduce): empty, of `like`'s dtype.
  static Tensor Empty(const Tensor& like) { return Tensor{nullptr, 0, like.dtype, like.device}; }
  [[noreturn]] void Missing(const char* name, const char* why) const {
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) + ": " + collective_ +
                                                 ": " + name + " is required " + why);
  }
  Buffers Take() { return std::move(buffers_); }

 private:
  int rank_;
  const char* collective_;  // a literal
  std::optional<DataType> dtype_;
  Buffers buffers_;
};

// ---- Communication ----

// The set-up waits for every rank, up to its timeout. On the main thread it runs on a thread of
// its own while the caller checks for signals every 50 ms: Ctrl-C raises KeyboardInterrupt at
// once, and the set-up thread, which cannot be cancelled, finishes on its own by its deadline
// and destroys what it built (its peers then see this rank leave).
template <typename Create>
CommPtr CreateReleasingTheGil(const Create& create) {
  py::gil_scoped_release release;
  return create();
}

template <typename Create>
CommPtr CreateInterruptibly(const Create& create) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;  // GUARDED_BY(mu), as the three below
    CommPtr comm;
    std::optional<Error> error;
    std::exception_ptr other;
  };
  auto state = std::make_shared<State>();
  std::thread([state, create] {
    CommPtr comm;
    std::optional<Error> error;
    std::exception_ptr other;
    try {
      comm = create();
    } catch (const Error& e) {
      error.emplace(e);
    } catch (...) {
      other = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mu);
    state->comm = std::move(comm);
    state->error = std::move(error);
    state->other = other;
    state->done = true;
    state->cv.notify_all();
  }).detach();
  for (;;) {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(state->mu);
      if (state->cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return state->done; })) {
        if (state->error) throw *state->error;
        if (state->other) std::rethrow_exception(state->other);
        return std::move(state->comm);
      }
    }
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

class PyCommunication {
 public:
  explicit PyCommunication(CommPtr comm) : comm_(std::move(comm)) {
    rank_ = comm_->rank();
    size_ = comm_->size();
    implementation_ = ToString(comm_->implementation());
  }

  ~PyCommunication() {
    if (comm_) {
      py::gil_scoped_release release;
      comm_.reset();
    }
  }

  static std::unique_ptr<PyCommunication> Create(
      std::optional<ClusterSpec> spec, const std::string& implementation, py::object timeout,
      size_t chunk_bytes, size_t small_message_bytes, size_t medium_message_bytes,
      const std::string& algorithm, int spin_us, int yield_us, const std::string& job_token,
      const std::string& listen_address, size_t bytes_per_pack,
      std::optional<std::string> store_path) {
    CommunicationOptions options;
    options.implementation = ParseImplementation(implementation);
    options.timeout = ToMilliseconds(ToSeconds(timeout, "Communication"));
    options.chunk_bytes = chunk_bytes;
    options.small_message_bytes = small_message_bytes;
    options.medium_message_bytes = medium_message_bytes;
    options.algorithm = algorithm;
    options.spin_us = spin_us;
    options.yield_us = yield_us;
    options.job_token = job_token;
    options.listen_address = listen_address;
    options.bytes_per_pack = bytes_per_pack;
    const ClusterSpec resolved = spec ? *spec : ClusterSpec::FromEnvironment();
    auto create = [resolved, options, store_path]() -> CommPtr {
      if (store_path) return CreateCommunication(resolved, CreateFileStore(*store_path), options);
      return CreateCommunication(resolved, options);
    };
    CommPtr comm = PyThread_get_thread_ident() == g_main_thread ? CreateInterruptibly(create)
                                                                : CreateReleasingTheGil(create);
    return std::make_unique<PyCommunication>(std::move(comm));
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& implementation() const { return implementation_; }
  bool closed() const { return !comm_; }

  CommPtr Get(const char* collective) const {
    CommPtr comm = comm_;
    if (!comm) {
      throw Error(ErrorCode::kInvalidUsage, "rank " + std::to_string(rank_) + ": " + collective +
                                                ": the communicator is closed");
    }
    return comm;
  }

  // Runs `blocking` now, or issues `async` and returns its Work. `result` is what the call
  // returns (the output buffer).
  template <typename Blocking, typename Async>
  py::object Issue(const CommPtr& comm, Args& args, bool async_op, py::object result,
                   Blocking&& blocking, Async&& async) {
    if (!async_op) {
      RunBlocking(comm, blocking);
      return result;
    }
    std::shared_ptr<Work> work;
    {
      py::gil_scoped_release release;
      work = async();
    }
    return py::cast(
        std::make_unique<PyWork>(std::move(work), comm, args.Take(), std::move(result)));
  }

  py::object AllReduce(py::object buf, const std::string& op, py::object out, bool async_op,
                       py::object dtype) {
    CommPtr comm = Get("all_reduce");
    Args args(rank_, "all_reduce", dtype);
    const ReduceOp rop = ParseReduceOp(op);
    const Tensor send = args.Add(buf, "buf", out.is_none());
    const Tensor recv = out.is_none() ? send : args.Add(out, "out", true);
    return Issue(
        comm, args, async_op, out.is_none() ? buf : out, [&] { comm->AllReduce(send, recv, rop); },
        [&] { return comm->AllReduceAsync(send, recv, rop); });
  }

  py::object Broadcast(py::object buf, int root, py::object out, bool async_op, py::object dtype) {
    CommPtr comm = Get("broadcast");
    Args args(rank_, "broadcast", dtype);
    const Tensor send = args.Add(buf, "buf", out.is_none());
    const Tensor recv = out.is_none() ? send : args.Add(out, "out", true);
    return Issue(
        comm, args, async_op, out.is_none() ? buf : out, [&] { comm->Broadcast(send, recv, root); },
        [&] { return comm->BroadcastAsync(send, recv, root); });
  }

  py::object AllGather(py::object send_obj, py::object recv_obj, bool async_op, py::object dtype) {
    CommPtr comm = Get("all_gather");
    Args args(rank_, "all_gather", dtype);
    const Tensor send = args.Add(send_obj, "send", false);
    const Tensor recv = args.Add(recv_obj, "recv", true);
    return Issue(
        comm, args, async_op, recv_obj, [&] { comm->AllGather(send, recv); },
        [&] { return comm->AllGatherAsync(send, recv); });
  }

  py::object ReduceScatter(py::object send_obj, py::object recv_obj, const std::string& op,
                           bool async_op, py::object dtype) {
    CommPtr comm = Get("reduce_scatter");
    Args args(rank_, "reduce_scatter", dtype);
    const ReduceOp rop = ParseReduceOp(op);
    const Tensor send = args.Add(send_obj, "send", false);
    const Tensor recv = args.Add(recv_obj, "recv", true);
    return Issue(
        comm, args, async_op, recv_obj, [&] { comm->ReduceScatter(send, recv, rop); },
        [&] { return comm->ReduceScatterAsync(send, recv, rop); });
  }

  py::object Barrier(bool async_op) {
    CommPtr comm = Get("barrier");
    Args args(rank_, "barrier", py::none());
    return Issue(
        comm, args, async_op, py::none(), [&] { comm->Barrier(); },
        [&] { return comm->BarrierAsync(); });
  }

  py::object Reduce(py::object send_obj, py::object recv_obj, const std::string& op, int root,
                    bool async_op, py::object dtype) {
    CommPtr comm = Get("reduce");
    Args args(rank_, "reduce", dtype);
    const ReduceOp rop = ParseReduceOp(op);
    const bool is_root = rank_ == root;
    // Without recv, the root reduces in place into send.
    const bool in_place = is_root && recv_obj.is_none();
    const Tensor send = args.Add(send_obj, "send", in_place);
    const Tensor recv = in_place             ? send
                        : recv_obj.is_none() ? Args::Empty(send)
                                             : args.Add(recv_obj, "recv", is_root);
    py::object result = in_place ? send_obj : recv_obj;
    return Issue(
        comm, args, async_op, result, [&] { comm->Reduce(send, recv, rop, root); },
        [&] { return comm->ReduceAsync(send, recv, rop, root); });
  }

  py::object Gather(py::object send_obj, py::object recv_obj, int root, bool async_op,
                    py::object dtype) {
    CommPtr comm = Get("gather");
    Args args(rank_, "gather", dtype);
    const bool is_root = rank_ == root;
    const Tensor send = args.Add(send_obj, "send", false);
    if (is_root && recv_obj.is_none()) args.Missing("recv", "on the root");
    const Tensor recv =
        recv_obj.is_none() ? Args::Empty(send) : args.Add(recv_obj, "recv", is_root);
    return Issue(
        comm, args, async_op, recv_obj, [&] { comm->Gather(send, recv, root); },
        [&] { return comm->GatherAsync(send, recv, root); });
  }

  py::object Scatter(py::object send_obj, py::object recv_obj, int root, bool async_op,
                     py::object dtype) {
    CommPtr comm = Get("scatter");
    Args args(rank_, "scatter", dtype);
    const bool is_root = rank_ == root;
    const Tensor recv = args.Add(recv_obj, "recv", true);
    if (is_root && send_obj.is_none()) args.Missing("send", "on the root");
    const Tensor send = send_obj.is_none() ? Args::Empty(recv) : args.Add(send_obj, "send", false);
    return Issue(
        comm, args, async_op, recv_obj, [&] { comm->Scatter(send, recv, root); },
        [&] { return comm->ScatterAsync(send, recv, root); });
  }

  py::object AllToAll(py::object send_obj, py::object recv_obj,
                      std::optional<std::vector<size_t>> send_counts,
                      std::optional<std::vector<size_t>> recv_counts, bool async_op,
                      py::object dtype) {
    CommPtr comm = Get("all_to_all");
    Args args(rank_, "all_to_all", dtype);
    const Tensor send = args.Add(send_obj, "send", false);
    const Tensor recv = args.Add(recv_obj, "recv", true);
    std::vector<size_t> sc = send_counts.value_or(std::vector<size_t>{});
    std::vector<size_t> rc = recv_counts.value_or(std::vector<size_t>{});
    return Issue(
        comm, args, async_op, recv_obj, [&] { comm->AllToAll(send, recv, sc, rc); },
        [&] { return comm->AllToAllAsync(send, recv, sc, rc); });
  }

  py::object Send(py::object buf, int peer, int64_t tag, bool async_op, py::object dtype) {
    CommPtr comm = Get("send");
    Args args(rank_, "send", dtype);
    const Tensor t = args.Add(buf, "buf", false);
    return Issue(
        comm, args, async_op, py::none(), [&] { comm->Send(t, peer, tag); },
        [&] { return comm->SendAsync(t, peer, tag); });
  }

  py::object Recv(py::object buf, int peer, int64_t tag, bool async_op, py::object dtype) {
    CommPtr comm = Get("recv");
    Args args(rank_, "recv", dtype);
    const Tensor t = args.Add(buf, "buf", true);
    return Issue(
        comm, args, async_op, buf, [&] { comm->Recv(t, peer, tag); },
        [&] { return comm->RecvAsync(t, peer, tag); });
  }

  std::unique_ptr<PyCommunication> Split(int color, std::optional<int> key) {
    CommPtr comm = Get("split");
    std::unique_ptr<CollectiveCommunication> child;
    RunBlocking(comm, [&] { child = comm->Split(color, key.value_or(rank_)); });
    if (!child) return nullptr;
    return std::make_unique<PyCommunication>(CommPtr(std::move(child)));
  }

  py::object PackedAllReduce(const py::list& arrays, const std::string& op, size_t bytes_per_pack,
                             bool async_op) {
    CommPtr comm = Get("packing.all_reduce");
    Args args(rank_, "packing.all_reduce", py::none());
    const ReduceOp rop = ParseReduceOp(op);
    std::vector<Tensor> tensors;
    for (size_t i = 0; i < arrays.size(); ++i) {
      const std::string name = "tensor " + std::to_string(i);
      tensors.push_back(args.Add(arrays[i], name.c_str(), true));
    }
    return Issue(
        comm, args, async_op, arrays,
        [&] { packing::AllReduce(*comm, tensors, rop, bytes_per_pack); },
        [&] { return packing::AllReduceAsync(*comm, tensors, rop, bytes_per_pack); });
  }

  py::object PackedBroadcast(const py::list& arrays, int root, size_t bytes_per_pack,
                             bool async_op) {
    CommPtr comm = Get("packing.broadcast");
    Args args(rank_, "packing.broadcast", py::none());
    std::vector<Tensor> tensors;
    for (size_t i = 0; i < arrays.size(); ++i) {
      const std::string name = "tensor " + std::to_string(i);
      tensors.push_back(args.Add(arrays[i], name.c_str(), true));
    }
    return Issue(
        comm, args, async_op, arrays,
        [&] { packing::Broadcast(*comm, tensors, root, bytes_per_pack); },
        [&] { return packing::BroadcastAsync(*comm, tensors, root, bytes_per_pack); });
  }

  void Abort() {
    CommPtr comm = comm_;
    if (!comm) return;
    py::gil_scoped_release release;
    comm->Abort();
  }

  // Destroys the communicator: queued calls run first (each bounded by its timeout).
  void Close() {
    CommPtr comm = std::move(comm_);
    comm_.reset();
    py::gil_scoped_release release;
    comm.reset();
  }

  void SetTimeout(py::object timeout) {
    CommPtr comm = Get("set_timeout");
    comm->SetTimeout(ToMilliseconds(ToSeconds(timeout, "set_timeout")));
  }

  // Seconds per call of `iters` blocking sum all-reduces of `buf` in place, issued from C++ in a
  // loop: the library's own cost, for examples/python/numpy_allreduce_latency.py to set beside
  // the same calls made from Python, in the same processes.
  double TimeAllReduce(py::object buf, int iters) {
    CommPtr comm = Get("_time_all_reduce");
    Args args(rank_, "_time_all_reduce", py::none());
    const Tensor t = args.Add(buf, "buf", true);
    double seconds = 0;
    RunBlocking(comm, [&] {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < iters; ++i) comm->AllReduce(t, t, ReduceOp::kSum);
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    });
    return iters > 0 ? seconds / iters : 0.0;
  }

  std::string AllReduceAlgorithm(size_t bytes) {
    return Get("all_reduce_algorithm")->AllReduceAlgorithm(bytes);
  }

 private:
  CommPtr comm_;
  int rank_ = 0;
  int size_ = 1;
  std::string implementation_;
};

std::string SpecRepr(const ClusterSpec& s) {
  std::string r = "ClusterSpec(rank=" + std::to_string(s.rank) +
                  ", world_size=" + std::to_string(s.world_size) + ", master_addr='" +
                  s.master_addr + "', master_port=" + std::to_string(s.master_port) + ", job_id='" +
                  s.job_id + "'";
  if (!s.store_listen_address.empty())
    r += ", store_listen_address='" + s.store_listen_address + "'";
  if (s.task_type != "worker" || s.task_index != s.rank) {
    r += ", task_type='" + s.task_type + "', task_index=" + std::to_string(s.task_index);
  }
  if (!s.job_token.empty()) r += ", job_token=<set>";
  return r + ")";
}

}  // namespace
}  // namespace collectives::python

PYBIND11_MODULE(_collectives, m) {
  using namespace collectives;
  using namespace collectives::python;
  m.doc() = "The compiled core of the collectives package; use `import collectives`.";

  g_main_thread =
      py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  // A child of fork has no watchdog thread: it starts its own at its next check.
  pthread_atfork(nullptr, nullptr, [] {
    new (&g_watchdog_once) std::once_flag();
    g_next_check = {};
  });

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      SetPythonError(e);
    }
  });
  m.def("_set_error_classes", [](const py::dict& classes) {
    for (auto item : classes) {
      const int code = item.first.cast<int>();
      if (code <= 0 || code >= 11) throw py::value_error("error code out of range");
      PyObject* cls = item.second.ptr();
      Py_INCREF(cls);
      ErrorClasses()[code] = cls;
    }
  });

  m.def("version", &Version, "The library's version.");
  m.def("build_type", &BuildType, "The library's build type (Release, Debug, ...).");
  m.def(
      "dtype_size", [](const std::string& name) { return SizeOf(ParseDataType(name)); },
      py::arg("dtype"), "Bytes of one element of `dtype` ('f32', 'bf16', ...).");

  py::class_<ClusterSpec>(m, "ClusterSpec",
                          "Who takes part in a job: this rank, the world size and where rank 0's "
                          "rendezvous store listens (master_addr:master_port).")
      .def(py::init([](int rank, int world_size, std::string master_addr, uint16_t master_port,
                       std::string job_id, std::string job_token, std::string store_listen_address,
                       std::vector<std::string> addresses, std::optional<std::string> task_type,
                       std::optional<int> task_index) {
             ClusterSpec s;
             s.rank = rank;
             s.world_size = world_size;
             s.master_addr = std::move(master_addr);
             s.master_port = master_port;
             s.job_id = std::move(job_id);
             s.job_token = std::move(job_token);
             s.store_listen_address = std::move(store_listen_address);
             s.addresses = std::move(addresses);
             s.task_type = task_type.value_or("worker");
             s.task_index = task_index.value_or(rank);
             return s;
           }),
           py::kw_only(), py::arg("rank") = 0, py::arg("world_size") = 1,
           py::arg("master_addr") = "127.0.0.1", py::arg("master_port") = 0,
           py::arg("job_id") = "collectives", py::arg("job_token") = "",
           py::arg("store_listen_address") = "", py::arg("addresses") = std::vector<std::string>{},
           py::arg("task_type") = py::none(), py::arg("task_index") = py::none())
      .def_readwrite("rank", &ClusterSpec::rank)
      .def_readwrite("world_size", &ClusterSpec::world_size)
      .def_readwrite("master_addr", &ClusterSpec::master_addr)
      .def_readwrite("master_port", &ClusterSpec::master_port)
      .def_readwrite("store_listen_address", &ClusterSpec::store_listen_address)
      .def_readwrite("addresses", &ClusterSpec::addresses)
      .def_readwrite("task_type", &ClusterSpec::task_type)
      .def_readwrite("task_index", &ClusterSpec::task_index)
      .def_readwrite("job_id", &ClusterSpec::job_id)
      .def_readwrite("job_token", &ClusterSpec::job_token)
      .def_static(
          "from_environment",
          [](std::optional<std::map<std::string, std::string>> env) {
            return env ? ClusterSpec::FromEnvironment(*env) : ClusterSpec::FromEnvironment();
          },
          py::arg("env") = py::none(),
          "TF_CONFIG; else RANK/WORLD_SIZE (torchrun) with MASTER_ADDR and MASTER_PORT; else "
          "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (mpirun; without MASTER_PORT the ranks "
          "meet through its PMIx server); else SLURM_PROCID (srun); else a single rank. `env`: "
          "a dict to read instead of os.environ.")
      .def_static("from_tf_config", &ClusterSpec::FromTfConfig, py::arg("json"))
      .def("validate", &ClusterSpec::Validate)
      .def("__repr__", &SpecRepr);

  py::class_<PyWork>(m, "Work", "An async collective. wait() returns its output buffer.")
      .def("wait", &PyWork::Wait,
           "Blocks until the collective completed; raises its error. Returns the output.")
      .def("done", &PyWork::Done, "True once the collective completed; never blocks.")
      .def("is_completed", &PyWork::Done);

  const auto async_arg = py::arg("async_op") = false;
  const auto dtype_arg = py::arg("dtype") = py::none();
  py::class_<PyCommunication>(
      m, "Communication",
      "This rank's communicator. Communication(spec=None, **options): spec None reads the "
      "environment (ClusterSpec.from_environment()); the options are CommunicationOptions' "
      "(implementation='auto'|'ring'|'nccl', timeout in seconds or a timedelta, chunk_bytes, "
      "...); store_path rendezvouses through a file store in that folder. A context manager.")
      .def(py::init(&PyCommunication::Create), py::arg("spec") = py::none(), py::kw_only(),
           py::arg("implementation") = "auto", py::arg("timeout") = 300.0,
           py::arg("chunk_bytes") = 0, py::arg("small_message_bytes") = 0,
           py::arg("medium_message_bytes") = 0, py::arg("algorithm") = "", py::arg("spin_us") = -1,
           py::arg("yield_us") = -1, py::arg("job_token") = "", py::arg("listen_address") = "",
           py::arg("bytes_per_pack") = 0, py::arg("store_path") = py::none())
      .def_property_readonly("rank", &PyCommunication::rank)
      .def_property_readonly("size", &PyCommunication::size)
      .def_property_readonly("implementation", &PyCommunication::implementation)
      .def_property_readonly("closed", &PyCommunication::closed)
      .def("__repr__",
           [](const PyCommunication& c) {
             return "<collectives.Communication rank " + std::to_string(c.rank()) + " of " +
                    std::to_string(c.size()) + ", " + c.implementation() +
                    (c.closed() ? ", closed>" : ">");
           })
      .def("all_reduce", &PyCommunication::AllReduce, py::arg("buf"), py::arg("op") = "sum",
           py::kw_only(), py::arg("out") = py::none(), async_arg, dtype_arg,
           "out (or buf, in place) = op over ranks of buf, on every rank. op: sum, prod, min, max, "
           "avg. Returns the output (a Work with async_op=True).")
      .def("broadcast", &PyCommunication::Broadcast, py::arg("buf"), py::arg("root") = 0,
           py::kw_only(), py::arg("out") = py::none(), async_arg, dtype_arg,
           "out (or buf, in place) = root's buf, on every rank.")
      .def("all_gather", &PyCommunication::AllGather, py::arg("send"), py::arg("recv"),
           py::kw_only(), async_arg, dtype_arg,
           "recv = concatenation over ranks of send; recv.size == size * send.size. In place when "
           "send is recv[rank*n:(rank+1)*n].")
      .def("reduce_scatter", &PyCommunication::ReduceScatter, py::arg("send"), py::arg("recv"),
           py::arg("op") = "sum", py::kw_only(), async_arg, dtype_arg,
           "recv = block `rank` of (op over ranks of send); send.size == size * recv.size.")
      .def("barrier", &PyCommunication::Barrier, py::kw_only(), async_arg,
           "Returns once every rank has entered it.")
      .def("reduce", &PyCommunication::Reduce, py::arg("send"), py::arg("recv") = py::none(),
           py::arg("op") = "sum", py::arg("root") = 0, py::kw_only(), async_arg, dtype_arg,
           "On the root, recv (or send, in place, when recv is None) = op over ranks of send. recv "
           "is unused elsewhere.")
      .def("gather", &PyCommunication::Gather, py::arg("send"), py::arg("recv") = py::none(),
           py::arg("root") = 0, py::kw_only(), async_arg, dtype_arg,
           "On the root, recv = concatenation over ranks of send (recv.size == size * send.size); "
           "recv is unused elsewhere.")
      .def("scatter", &PyCommunication::Scatter, py::arg("send"), py::arg("recv"),
           py::arg("root") = 0, py::kw_only(), async_arg, dtype_arg,
           "recv = block `rank` of root's send (send.size == size * recv.size there; None "
           "elsewhere).")
      .def("all_to_all", &PyCommunication::AllToAll, py::arg("send"), py::arg("recv"),
           py::arg("send_counts") = py::none(), py::arg("recv_counts") = py::none(), py::kw_only(),
           async_arg, dtype_arg,
           "Block j of recv = block `rank` of rank j's send. Equal blocks without counts; else "
           "send_counts[j] elements go to rank j and recv_counts[j] come from it.")
      .def("send", &PyCommunication::Send, py::arg("buf"), py::arg("peer"), py::arg("tag") = 0,
           py::kw_only(), async_arg, dtype_arg,
           "Sends buf to rank `peer`, whose recv(..., this rank, tag) receives it, in issue order.")
      .def("recv", &PyCommunication::Recv, py::arg("buf"), py::arg("peer"), py::arg("tag") = 0,
           py::kw_only(), async_arg, dtype_arg,
           "Receives into buf what rank `peer` sends with the same tag, dtype and size.")
      .def("split", &PyCommunication::Split, py::arg("color"), py::arg("key") = py::none(),
           "A collective: ranks of one color >= 0 get a new Communication, ranked by key (default: "
           "this rank); a negative color gets None.")
      .def("_packed_all_reduce", &PyCommunication::PackedAllReduce)
      .def("_time_all_reduce", &PyCommunication::TimeAllReduce)
      .def("_packed_broadcast", &PyCommunication::PackedBroadcast)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](PyCommunication& c, py::object type, py::object, py::object) {
             // Leaving on an exception: abort first, so that neither this rank nor its peers
             // wait for calls that will never be matched.
             if (!type.is_none()) c.Abort();
             c.Close();
             return false;
           })
      .def("abort", &PyCommunication::Abort,
           "Breaks the communicator now: calls in flight and later ones raise AbortedError, here "
           "and on the peers.")
      .def(
          "close", &PyCommunication::Close,
          "Destroys the communicator once its queued calls have run (each bounded by its timeout).")
      .def("set_timeout", &PyCommunication::SetTimeout, py::arg("timeout"),
           "The deadline (seconds or timedelta) of every call issued after this one.")
      .def("all_reduce_algorithm", &PyCommunication::AllReduceAlgorithm, py::arg("bytes"),
           "The algorithm an all-reduce of `bytes` bytes runs here (recursive_doubling, ring, shm, "
           "...).");

  m.def("_plan_buckets",
        [](const std::vector<std::pair<std::string, size_t>>& specs, size_t bytes_per_pack) {
          std::vector<packing::TensorSpec> tensors;
          for (const auto& [dtype, count] : specs) {
            tensors.push_back(packing::TensorSpec{ParseDataType(dtype), Device::Cpu(), count});
          }
          return packing::PlanBuckets(tensors, bytes_per_pack);
        });
  m.def("_default_bytes_per_pack", [] { return packing::DefaultBytesPerPack(); });
}
