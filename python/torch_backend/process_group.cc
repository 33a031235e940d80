// collectives._torch: the torch.distributed backend "collectives", a c10d::ProcessGroup whose
// collectives run on a CollectiveCommunication (RING, AUTO or NCCL), and its pybind11 glue.
//
// Shape of a call: each ProcessGroup method checks its tensors (one helper, View: CPU, strided,
// contiguous, a supported dtype), turns them into non-owning collectives::Tensor views of the
// tensors' own memory, issues the library's async collective and returns a Work that keeps the
// tensors alive. Only list forms whose tensors do not lie back to back in memory go through a
// buffer of the call's own (packed before the call, unpacked when it completes). Nothing is
// written before every argument has been checked, here and by the library.
//
// Completion: the library's Work has Wait and Done only. CollectivesWork::Finish waits for it,
// unpacks, and marks the torch Future if one was asked for. Work.wait() calls Finish on the
// caller's thread (torch's binding releases the GIL); a future (getFuture, as DDP's reducer and
// comm hooks use) is completed by the group's completion thread, started at the first
// getFuture of a call still running, which finishes its works in the order they were handed
// over. A plain blocking call (allreduce then wait) therefore never touches that thread. Small
// calls may also run on the caller's thread as the library's blocking forms (inline_bytes_).
//
// Thread-safety: a process group may be called from any thread (DDP's reducer calls it from
// autograd threads); the library orders the calls. A Work may be waited on from any thread.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "collectives/packing.h"
#include "collectives/types.h"

#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_communication.h"
#include "src/nccl/nccl_loader.h"
#endif
#ifdef COLLECTIVES_TORCH_CUDA_STREAMS
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace collectives_torch {
namespace {

namespace py = pybind11;
using collectives::CommunicationOptions;
using collectives::DataType;
using collectives::ErrorCode;
using collectives::ReduceOp;

constexpr const char* kBackendName = "collectives";

// ---- The rendezvous: torch's store as the library's Store. ----

// Forwards to the c10d::Store torch gives the creator (a PrefixStore over the job's TCPStore,
// FileStore or HashStore). Thread-safety: as c10d::Store, callable from any thread.
class TorchStore final : public collectives::Store {
 public:
  explicit TorchStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void Set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }

  std::string Get(const std::string& key, std::chrono::milliseconds timeout) override {
    try {
      store_->wait({key}, timeout);
      const std::vector<uint8_t> value = store_->get(key);
      return std::string(value.begin(), value.end());
    } catch (const collectives::Error&) {
      throw;
    } catch (const std::exception& error) {
      // c10d's stores say "Timeout" or "timed out" when the key did not appear in time.
      const std::string what = error.what();
      const bool timed_out =
          what.find("imeout") != std::string::npos || what.find("timed out") != std::string::npos;
      throw collectives::Error(timed_out ? ErrorCode::kTimeout : ErrorCode::kSystem,
                               "torch store: waiting " + std::to_string(timeout.count()) +
                                   " ms for key '" + key + "': " + FirstLine(what));
    }
  }

  int64_t Add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }

 private:
  static std::string FirstLine(const std::string& text) { return text.substr(0, text.find('\n')); }

  c10::intrusive_ptr<c10d::Store> store_;
};

// `bytes` random bytes in hex.
std::string RandomHex(size_t bytes) {
  std::random_device device;  // /dev/urandom (or the CPU's generator) on Linux
  static const char kDigits[] = "0123456789abcdef";
  std::string text;
  for (size_t i = 0; i < bytes; ++i) {
    const unsigned byte = device() & 0xff;
    text += kDigits[byte >> 4];
    text += kDigits[byte & 0xf];
  }
  return text;
}

// ---- Argument checks: one helper for every tensor. ----

std::string Where(int rank, const char* op) {
  return std::string(kBackendName) + " backend: rank " + std::to_string(rank) + ": " + op;
}

DataType ToDataType(const at::Tensor& tensor, int rank, const char* op, const char* what) {
  switch (tensor.scalar_type()) {
    case at::kFloat:
      return DataType::kFloat32;
    case at::kDouble:
      return DataType::kFloat64;
    case at::kHalf:
      return DataType::kFloat16;
    case at::kBFloat16:
      return DataType::kBFloat16;
    case at::kInt:
      return DataType::kInt32;
    case at::kLong:
      return DataType::kInt64;
    case at::kByte:
      return DataType::kUInt8;
    case at::kChar:
      return DataType::kInt8;
    default:
      TORCH_CHECK(false, Where(rank, op), ": ", what, " has dtype ", tensor.scalar_type(),
                  ", which is not supported (float32, float64, float16, bfloat16, int32, int64, "
                  "uint8, int8)");
  }
}

collectives::Tensor CudaView(const at::Tensor& tensor, int rank, const char* op, const char* what);

// The library's view of `tensor`: its own memory, no copy. Refuses what the library cannot
// take, naming the op and the argument.
collectives::Tensor View(const at::Tensor& tensor, int rank, const char* op, const char* what) {
  TORCH_CHECK(tensor.defined(), Where(rank, op), ": ", what, " is an undefined tensor");
  if (!tensor.device().is_cpu()) return CudaView(tensor, rank, op, what);
  TORCH_CHECK(tensor.layout() == at::kStrided, Where(rank, op), ": ", what, " has layout ",
              tensor.layout(), "; only dense (strided) tensors are supported");
  TORCH_CHECK(tensor.is_contiguous(), Where(rank, op), ": ", what,
              " is not contiguous; call .contiguous() first");
  const DataType dtype = ToDataType(tensor, rank, op, what);
  return collectives::Tensor{tensor.data_ptr(), static_cast<size_t>(tensor.numel()), dtype};
}

// An empty view of `like`'s dtype, for the buffers a rank does not use (recv off the root).
collectives::Tensor Empty(const collectives::Tensor& like) {
  return collectives::Tensor{nullptr, 0, like.dtype, like.device};
}

// ---- CUDA tensors. ----
//
// A CUDA tensor becomes a cuda:N view of its memory and goes to an NCCL communicator of the
// group's own, made at the group's first CUDA call (every rank makes its first CUDA call
// alike, as with torch's NCCL backend), on the tensor's device; where NCCL or a device is not
// usable, to the group's communicator, whose RING and AUTO stage every collective and send/recv
// through pinned host memory. A group made with implementation="nccl" sends everything to its
// own communicator. Only list forms whose tensors do not lie back to back run torch kernels
// (Pack, GatherInto); every other call hands the tensors' memory to the library as it is.
//
// Streams, as torch's NCCL backend: a collective runs after the work queued on the tensor's
// current stream. The library's streams (NCCL's, the staging copies') are blocking streams,
// which CUDA orders after the work queued before them on the legacy default stream; a tensor
// whose current stream is another one has an event recorded there that the legacy default
// stream waits for (OrderAfterCurrentStream). Where torch is built without CUDA
// (COLLECTIVES_TORCH_CUDA_STREAMS unset) there is no current stream to ask: the collective
// follows the legacy default stream only, torch's default current stream; work on other
// streams must be synchronised by the caller. Work.wait() returns once the result is on the
// device, for every stream (the library's Wait blocks until the device work is done): a
// stronger guarantee than torch's NCCL backend, whose wait() only makes the current stream
// wait.

#ifdef COLLECTIVES_WITH_NCCL
// Makes the legacy default stream wait for the work queued so far on `tensor`'s current
// stream; nothing when that is the legacy default stream itself.
void OrderAfterCurrentStream(const at::Tensor& tensor, int rank, const char* op) {
#ifdef COLLECTIVES_TORCH_CUDA_STREAMS
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(tensor.device().index());
  cudaStream_t stream = current.stream();
  if (stream == nullptr) return;
  const collectives::nccl::NcclApi& api = collectives::nccl::LoadCudart();
  c10::cuda::CUDAGuard guard(tensor.device());
  cudaEvent_t event = nullptr;
  cudaError_t status = api.cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (status == cudaSuccess) status = api.cudaEventRecord(event, stream);
  if (status == cudaSuccess) status = api.cudaStreamWaitEvent(nullptr, event, 0);
  if (event != nullptr) api.cudaEventDestroy(event);  // released once the wait has passed it
  TORCH_CHECK(status == cudaSuccess, Where(rank, op),
              ": ordering after the current CUDA stream: ", api.cudaGetErrorString(status));
#else
  (void)tensor;
  (void)rank;
  (void)op;
#endif
}
#endif

// The library's view of a CUDA `tensor`, ordered after its current stream (above).
collectives::Tensor CudaView(const at::Tensor& tensor, int rank, const char* op, const char* what) {
#ifdef COLLECTIVES_WITH_NCCL
  TORCH_CHECK(tensor.is_cuda(), Where(rank, op), ": ", what, " is on ", tensor.device(),
              "; this backend takes CPU and CUDA tensors");
  TORCH_CHECK(tensor.layout() == at::kStrided, Where(rank, op), ": ", what, " has layout ",
              tensor.layout(), "; only dense (strided) tensors are supported");
  TORCH_CHECK(tensor.is_contiguous(), Where(rank, op), ": ", what,
              " is not contiguous; call .contiguous() first");
  const DataType dtype = ToDataType(tensor, rank, op, what);
  OrderAfterCurrentStream(tensor, rank, op);
  return collectives::Tensor{tensor.data_ptr(), static_cast<size_t>(tensor.numel()), dtype,
                             collectives::Device::Cuda(tensor.device().index())};
#else
  TORCH_CHECK(false, Where(rank, op), ": ", what, " is on ", tensor.device(),
              "; this backend is built without CUDA and takes CPU tensors only (configure with "
              "-DCOLLECTIVES_WITH_NCCL=ON)");
#endif
}

#ifdef COLLECTIVES_WITH_NCCL
// The group's communicator with CUDA tensors sent to an NCCL communicator where NCCL and a
// device are usable (see above). CPU calls go straight to the group's communicator.
// Thread-safety: as CollectiveCommunication; the NCCL communicator is made once, under mutex_.
class CudaRouting final : public collectives::CollectiveCommunication {
 public:
  using Comm = collectives::CollectiveCommunication;
  using Tensor = collectives::Tensor;
  using WorkPtr = std::shared_ptr<collectives::Work>;

  CudaRouting(std::unique_ptr<Comm> host, std::shared_ptr<collectives::Store> store,
              std::string key_prefix, CommunicationOptions options)
      : host_(std::move(host)),
        store_(std::move(store)),
        key_prefix_(std::move(key_prefix)),
        options_(std::move(options)) {}

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  collectives::Implementation implementation() const override { return host_->implementation(); }

  WorkPtr AllReduceAsync(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    return For(send, recv).AllReduceAsync(send, recv, op);
  }
  WorkPtr BroadcastAsync(const Tensor& send, const Tensor& recv, int root) override {
    return For(send, recv).BroadcastAsync(send, recv, root);
  }
  WorkPtr AllGatherAsync(const Tensor& send, const Tensor& recv) override {
    return For(send, recv).AllGatherAsync(send, recv);
  }
  WorkPtr ReduceScatterAsync(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    return For(send, recv).ReduceScatterAsync(send, recv, op);
  }
  WorkPtr BarrierAsync() override { return host_->BarrierAsync(); }
  WorkPtr ReduceAsync(const Tensor& send, const Tensor& recv, ReduceOp op, int root) override {
    return For(send, recv).ReduceAsync(send, recv, op, root);
  }
  WorkPtr GatherAsync(const Tensor& send, const Tensor& recv, int root) override {
    return For(send, recv).GatherAsync(send, recv, root);
  }
  WorkPtr ScatterAsync(const Tensor& send, const Tensor& recv, int root) override {
    return For(send, recv).ScatterAsync(send, recv, root);
  }
  WorkPtr AllToAllAsync(const Tensor& send, const Tensor& recv,
                        const std::vector<size_t>& send_counts,
                        const std::vector<size_t>& recv_counts) override {
    return For(send, recv).AllToAllAsync(send, recv, send_counts, recv_counts);
  }
  WorkPtr SendAsync(const Tensor& tensor, int peer, int64_t tag) override {
    return For(tensor, tensor).SendAsync(tensor, peer, tag);
  }
  WorkPtr RecvAsync(const Tensor& tensor, int peer, int64_t tag) override {
    return For(tensor, tensor).RecvAsync(tensor, peer, tag);
  }

  void AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    For(send, recv).AllReduce(send, recv, op);
  }
  void Broadcast(const Tensor& send, const Tensor& recv, int root) override {
    For(send, recv).Broadcast(send, recv, root);
  }
  void AllGather(const Tensor& send, const Tensor& recv) override {
    For(send, recv).AllGather(send, recv);
  }
  void ReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    For(send, recv).ReduceScatter(send, recv, op);
  }
  void Barrier() override { host_->Barrier(); }

  std::string AllReduceAlgorithm(size_t bytes) const override {
    return host_->AllReduceAlgorithm(bytes);
  }
  std::unique_ptr<Comm> Split(int color, int key) override { return host_->Split(color, key); }

  // Does not wait for an NCCL set-up in progress (For holds mutex_ through it).
  void Abort() override {
    host_->Abort();
    if (Comm* device = device_ptr_.load(std::memory_order_acquire)) device->Abort();
  }
  void SetTimeout(std::chrono::milliseconds timeout) override {
    host_->SetTimeout(timeout);
    std::lock_guard<std::mutex> lock(mutex_);
    options_.timeout = timeout;
    if (device_) device_->SetTimeout(timeout);
  }

 private:
  using ReduceOp = collectives::ReduceOp;

  // The communicator for a call on `a` and `b`: the group's for CPU tensors.
  Comm& For(const Tensor& a, const Tensor& b) {
    using Kind = collectives::Device::Kind;
    if (a.device.kind == Kind::kCpu && b.device.kind == Kind::kCpu) return *host_;
    if (host_->implementation() == collectives::Implementation::kNccl) return *host_;
    if (Comm* made = device_ptr_.load(std::memory_order_acquire)) return *made;
    const int device = a.device.kind == Kind::kCuda ? a.device.index : b.device.index;
    std::lock_guard<std::mutex> lock(mutex_);
    if (device_) return *device_;
    if (!nccl_checked_) {
      nccl_checked_ = true;
      nccl_usable_ = collectives::nccl::TryLoadNccl() != nullptr;
    }
    if (!nccl_usable_) return *host_;  // RING and AUTO stage CUDA tensors
    CommunicationOptions options;
    options.implementation = collectives::Implementation::kNccl;
    options.timeout = options_.timeout;
    options.job_token = options_.job_token;
    collectives::nccl::NcclOptions nccl_options;
    nccl_options.device = device;
    device_ = collectives::nccl::CreateNcclCommunication(host_->rank(), host_->size(), store_,
                                                         key_prefix_, options, nccl_options);
    device_ptr_.store(device_.get(), std::memory_order_release);
    return *device_;
  }

  const std::unique_ptr<Comm> host_;
  const std::shared_ptr<collectives::Store> store_;
  const std::string key_prefix_;
  std::mutex mutex_;
  CommunicationOptions options_;            // GUARDED_BY(mutex_)
  std::unique_ptr<Comm> device_;            // GUARDED_BY(mutex_); set once, never reset
  std::atomic<Comm*> device_ptr_{nullptr};  // device_.get() once set, read without mutex_
  bool nccl_checked_ = false;               // GUARDED_BY(mutex_)
  bool nccl_usable_ = false;                // GUARDED_BY(mutex_)
};
#endif

ReduceOp ToReduceOp(const c10d::ReduceOp& op, int rank, const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      return ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return ReduceOp::kProd;
    case c10d::ReduceOp::MIN:
      return ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return ReduceOp::kMax;
    case c10d::ReduceOp::BAND:
      TORCH_CHECK(false, Where(rank, name),
                  ": ReduceOp.BAND is not supported (SUM, AVG, PRODUCT, MIN, MAX)");
    case c10d::ReduceOp::BOR:
      TORCH_CHECK(false, Where(rank, name),
                  ": ReduceOp.BOR is not supported (SUM, AVG, PRODUCT, MIN, MAX)");
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK(false, Where(rank, name),
                  ": ReduceOp.BXOR is not supported (SUM, AVG, PRODUCT, MIN, MAX)");
    case c10d::ReduceOp::PREMUL_SUM:
      TORCH_CHECK(false, Where(rank, name),
                  ": ReduceOp.PREMUL_SUM is not supported (SUM, AVG, PRODUCT, MIN, MAX)");
    default:
      TORCH_CHECK(false, Where(rank, name), ": unknown ReduceOp ", int(op.op_));
  }
}

void CheckOne(size_t got, int rank, const char* op, const char* what) {
  TORCH_CHECK(got == 1, Where(rank, op), ": takes one ", what, " per process, got ", got,
              " (multi-tensor lists are not supported)");
}

void CheckSameAs(const at::Tensor& tensor, const at::Tensor& like, int64_t numel, int rank,
                 const char* op, const std::string& what) {
  TORCH_CHECK(tensor.scalar_type() == like.scalar_type(), Where(rank, op), ": ", what,
              " has dtype ", tensor.scalar_type(), ", the input ", like.scalar_type());
  TORCH_CHECK(tensor.numel() == numel, Where(rank, op), ": ", what, " has ", tensor.numel(),
              " elements, expected ", numel);
}

// Whether the contiguous tensors `tensors`, all on one device (CPU or one CUDA device), lie back
// to back in memory in list order, so that the list can go to the library as one view without a
// copy.
bool BackToBack(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return false;
  const char* next = static_cast<const char*>(tensors[0].data_ptr());
  for (const at::Tensor& tensor : tensors) {
    if (tensor.device() != tensors[0].device() || tensor.layout() != at::kStrided ||
        !tensor.is_contiguous() || tensor.scalar_type() != tensors[0].scalar_type())
      return false;
    if (tensor.numel() > 0 && static_cast<const char*>(tensor.data_ptr()) != next) return false;
    next += tensor.nbytes();
  }
  return true;
}

// ---- Work. ----

class Completer;

// One torch Work over one or more library Works issued by one ProcessGroup call, in order.
// `finish` (may be empty) runs once they all succeeded: it unpacks a call's own buffer into the
// caller's tensors. Thread-safety: every method may be called from any thread.
class CollectivesWork final : public c10d::Work {
 public:
  CollectivesWork(int rank, c10d::OpType type,
                  std::vector<std::shared_ptr<collectives::Work>> works,
                  std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep_alive,
                  std::function<void()> finish, std::shared_ptr<Completer> completer,
                  std::exception_ptr ran_inline_error = nullptr)
      : c10d::Work(rank, type),
        ran_inline_error_(std::move(ran_inline_error)),
        works_(std::move(works)),
        outputs_(std::move(outputs)),
        keep_alive_(std::move(keep_alive)),
        finish_(std::move(finish)),
        completer_(std::move(completer)) {}

  // Waits for the library's Works, unpacks, records the outcome and completes the future; once.
  // The future's callbacks run after finish_mutex_ is released: a Python callback takes the GIL,
  // which a thread blocked in Finish (is_completed keeps the GIL) may hold.
  // Tensors are released after finish_mutex_ too: releasing a tensor that Python has seen
  // takes the GIL.
  void Finish() {
    std::vector<at::Tensor> released;
    std::function<void()> released_finish;
    std::unique_lock<std::mutex> finishing(finish_mutex_);
    if (finished_.load(std::memory_order_acquire)) return;
    std::exception_ptr error = ran_inline_error_;
    try {
      for (const auto& work : works_) work->Wait();
      if (finish_) finish_();
    } catch (...) {
      error = std::current_exception();
    }
    released_finish = std::move(finish_);
    finish_ = nullptr;
    released = std::move(keep_alive_);
    keep_alive_.clear();
    c10::intrusive_ptr<c10::ivalue::Future> future;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      completed_ = true;
      exception_ = error;
      future = future_;
      finished_.store(true, std::memory_order_release);
    }
    finishing.unlock();
    cv_.notify_all();
    if (future) Complete(*future, error);
  }

  bool isCompleted() override {
    if (finished_.load(std::memory_order_acquire)) return true;
    for (const auto& work : works_) {
      if (!work->Done()) return false;
    }
    Finish();
    return true;
  }

  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ && !exception_;
  }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return exception_;
  }

  std::vector<at::Tensor> result() override { return outputs_; }

  // Nothing to do: once Finish has returned, the results are in the tensors, CUDA ones included
  // (the library's Wait returns once the device work is done).
  void synchronize() override {}

  // Blocks until the call completed and rethrows its error. A positive `timeout` bounds the
  // wait: past it, raises RuntimeError (the call itself goes on, bounded by the group's timeout).
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout > std::chrono::milliseconds(0) && !finished_.load(std::memory_order_acquire)) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!isCompleted()) {
        TORCH_CHECK(std::chrono::steady_clock::now() < deadline, kBackendName, " backend: rank ",
                    rank_, ": ", c10d::opTypeToString(opType_),
                    " did not complete within wait(timeout=", timeout.count(), " ms)");
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    Finish();
    std::lock_guard<std::mutex> lock(mutex_);
    if (exception_) std::rethrow_exception(exception_);
    return true;
  }

  void abort() override {
    TORCH_CHECK(false, kBackendName,
                " backend: Work.abort is not supported; "
                "destroy the process group instead");
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void Complete(c10::ivalue::Future& future, const std::exception_ptr& error) {
    if (error) {
      future.setError(error);
    } else {
      future.markCompleted(c10::IValue(outputs_));
    }
  }

  const std::exception_ptr ran_inline_error_;  // the error of a call run on the caller's thread
  const std::vector<std::shared_ptr<collectives::Work>> works_;
  const std::vector<at::Tensor> outputs_;
  std::mutex finish_mutex_;  // serialises Finish; held while waiting, so never under mutex_
  std::vector<at::Tensor> keep_alive_;              // GUARDED_BY(finish_mutex_)
  std::function<void()> finish_;                    // GUARDED_BY(finish_mutex_)
  std::atomic<bool> finished_{false};               // set under mutex_ once the outcome is recorded
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // GUARDED_BY(mutex_)
  std::shared_ptr<Completer> completer_;
};

// The thread that finishes the Works whose futures were asked for, one after another in the
// order they arrive (calls complete in issue order, so none waits behind a later one). Started
// by the first Add; Stop finishes what is queued and joins. Thread-safety: Add and Stop may be
// called from any thread; Stop is called once, by the owning process group.
class Completer {
 public:
  void Add(c10::intrusive_ptr<CollectivesWork> work) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!stopped_) {
        if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
        queue_.push_back(std::move(work));
        cv_.notify_one();
        return;
      }
    }
    work->Finish();  // the group is gone: finish on the caller's thread
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      cv_.wait(lock, [this] { return stopped_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopped and drained
      c10::intrusive_ptr<CollectivesWork> work = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      work->Finish();  // records any error in the Work and its future
      work.reset();
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<CollectivesWork>> queue_;  // GUARDED_BY(mutex_)
  bool stopped_ = false;                                   // GUARDED_BY(mutex_)
  std::thread thread_;
};

c10::intrusive_ptr<c10::ivalue::Future> CollectivesWork::getFuture() {
  c10::intrusive_ptr<c10::ivalue::Future> future;
  bool finished = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (future_) return future_;
    future_ =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future = future_;
    finished = finished_.load(std::memory_order_acquire);
  }
  if (!finished) {
    // A call that has already completed needs no thread.
    bool done = true;
    for (const auto& work : works_) done = done && work->Done();
    if (done) {
      Finish();  // completes future_ unless another thread's Finish recorded the outcome first
      return future;
    }
  }
  if (finished) {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error = exception_;
    }
    Complete(*future, error);
  } else {
    completer_->Add(c10::intrusive_ptr<CollectivesWork>::reclaim_copy(this));
  }
  return future;
}

// ---- The process group. ----

class ProcessGroupCollectives final : public c10d::ProcessGroup {
 public:
  // Rendezvouses through `store` (every rank of the group calls this, with the same store
  // prefix) and connects. `master_addr` and `master_port` fill the ClusterSpec: the data
  // listener binds to the local address that routes toward master_addr unless
  // options.listen_address or $COLLECTIVES_LISTEN_ADDRESS names one; the port only has to be
  // non-zero, the store being given. Rank 0 picks the job id (unique per group, so shared-memory
  // segments of two groups or two jobs never meet) and, when neither options.job_token nor
  // $COLLECTIVES_JOB_TOKEN sets one, the job token; both travel through the store.
  ProcessGroupCollectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                          CommunicationOptions options, const std::string& master_addr,
                          int master_port, size_t inline_bytes)
      : c10d::ProcessGroup(rank, size),
        options_(std::move(options)),
        // Alone, a rank waits for no one: every call may run on the caller's thread.
        inline_bytes_(size == 1 ? SIZE_MAX : inline_bytes) {
    auto torch_store = std::make_shared<TorchStore>(store);
    const std::string key = "collectives/job";
    const bool own_token = collectives::ResolveJobToken(options_).empty();
    std::string job;
    if (rank == 0) {
      job = "torch-" + RandomHex(8) + "\n" + (own_token ? RandomHex(32) : std::string());
      torch_store->Set(key, job);
    } else {
      job = torch_store->Get(key, options_.timeout);
    }
    const size_t newline = job.find('\n');
    collectives::ClusterSpec spec;
    spec.rank = rank;
    spec.world_size = size;
    spec.master_addr = master_addr.empty() ? "127.0.0.1" : master_addr;
    spec.master_port =
        size > 1
            ? static_cast<uint16_t>(master_port > 0 && master_port < 65536 ? master_port : 29500)
            : 0;
    spec.job_id = job.substr(0, newline);
    if (own_token && newline != std::string::npos) options_.job_token = job.substr(newline + 1);
    comm_ = collectives::CreateCommunication(spec, torch_store, options_);
#ifdef COLLECTIVES_WITH_NCCL
    comm_ = std::make_unique<CudaRouting>(std::move(comm_), torch_store, spec.job_id + "/cuda",
                                          options_);
#endif
    init();
  }

  // Joins the completion thread and closes the communicator. Python destroys a group with the
  // GIL held, and the completion thread takes it to release the tensors of the Works it
  // finishes: both steps run with the GIL released.
  ~ProcessGroupCollectives() override {
    if (Py_IsInitialized() && PyGILState_Check()) {
      pybind11::gil_scoped_release released;
      completer_->Stop();
      comm_.reset();
    } else {
      completer_->Stop();
      comm_.reset();
    }
  }

  const std::string getBackendName() const override { return kBackendName; }

  collectives::CollectiveCommunication& comm() { return *comm_; }
  const CommunicationOptions& options() const { return options_; }
  size_t inline_bytes() const { return inline_bytes_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const char* op = "broadcast";
    CheckOne(tensors.size(), rank_, op, "tensor");
    CheckRoot(opts.rootRank, op);
    const collectives::Tensor view = View(tensors[0], rank_, op, "tensor");
    const int root = int(opts.rootRank);
    if (view.bytes() <= inline_bytes_) {
      return Inline(
          c10d::OpType::BROADCAST, [&] { comm_->Broadcast(view, view, root); }, tensors);
    }
    return Make(c10d::OpType::BROADCAST, {comm_->BroadcastAsync(view, view, root)}, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const char* op = "all_reduce";
    CheckOne(tensors.size(), rank_, op, "tensor");
    const ReduceOp reduce = ToReduceOp(opts.reduceOp, rank_, op);
    const collectives::Tensor view = View(tensors[0], rank_, op, "tensor");
    if (view.bytes() <= inline_bytes_) {
      return Inline(
          c10d::OpType::ALLREDUCE, [&] { comm_->AllReduce(view, view, reduce); }, tensors);
    }
    return Make(c10d::OpType::ALLREDUCE, {comm_->AllReduceAsync(view, view, reduce)}, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    const char* op = "all_reduce_coalesced";
    const ReduceOp reduce = ToReduceOp(opts.reduceOp, rank_, op);
    std::vector<collectives::Tensor> views;
    for (const at::Tensor& tensor : tensors) views.push_back(View(tensor, rank_, op, "a tensor"));
    return Make(c10d::OpType::ALLREDUCE_COALESCED,
                {collectives::packing::AllReduceAsync(*comm_, views, reduce)}, tensors);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    const char* op = "reduce";
    CheckOne(tensors.size(), rank_, op, "tensor");
    CheckRoot(opts.rootRank, op);
    const ReduceOp reduce = ToReduceOp(opts.reduceOp, rank_, op);
    const collectives::Tensor view = View(tensors[0], rank_, op, "tensor");
    const int root = int(opts.rootRank);
    return Make(c10d::OpType::REDUCE,
                {comm_->ReduceAsync(view, rank_ == root ? view : Empty(view), reduce, root)},
                tensors);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    const char* op = "all_gather";
    CheckOne(inputs.size(), rank_, op, "input tensor");
    CheckOne(outputs.size(), rank_, op, "output list");
    const collectives::Tensor send = View(inputs[0], rank_, op, "the input");
    CheckList(outputs[0], inputs[0], op, "output");
    Gathered recv = GatherInto(outputs[0], inputs[0], send);
    return Make(c10d::OpType::ALLGATHER, {comm_->AllGatherAsync(send, recv.view)}, outputs[0],
                {inputs[0], recv.buffer}, recv.unpack);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    const char* op = "all_gather_into_tensor";
    const collectives::Tensor send = View(input, rank_, op, "the input");
    const collectives::Tensor recv = View(output, rank_, op, "the output");
    CheckSameAs(output, input, input.numel() * size_, rank_, op, "the output");
    return Make(c10d::OpType::_ALLGATHER_BASE, {comm_->AllGatherAsync(send, recv)}, {output},
                {input});
  }

  // outputs[r][i] = rank r's inputs[i]: one all-gather per input.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions&) override {
    const char* op = "all_gather_coalesced";
    TORCH_CHECK(outputs.size() == size_t(size_), Where(rank_, op), ": expects ", size_,
                " output lists (one per rank), got ", outputs.size());
    std::vector<collectives::Tensor> sends;
    std::vector<std::vector<at::Tensor>> per_input(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      sends.push_back(View(inputs[i], rank_, op, "an input"));
      for (int r = 0; r < size_; ++r) {
        TORCH_CHECK(outputs[r].size() == inputs.size(), Where(rank_, op), ": output list ", r,
                    " has ", outputs[r].size(), " tensors, expected ", inputs.size());
        per_input[i].push_back(outputs[r][i]);
      }
      CheckList(per_input[i], inputs[i], op, "output");
    }
    std::vector<std::shared_ptr<collectives::Work>> works;
    std::vector<at::Tensor> keep(inputs.begin(), inputs.end());
    std::vector<std::function<void()>> unpacks;
    for (size_t i = 0; i < inputs.size(); ++i) {
      Gathered recv = GatherInto(per_input[i], inputs[i], sends[i]);
      works.push_back(comm_->AllGatherAsync(sends[i], recv.view));
      keep.push_back(recv.buffer);
      if (recv.unpack) unpacks.push_back(std::move(recv.unpack));
    }
    std::vector<at::Tensor> flat_outputs;
    for (const auto& list : outputs)
      flat_outputs.insert(flat_outputs.end(), list.begin(), list.end());
    return Make(c10d::OpType::ALLGATHER_COALESCED, std::move(works), flat_outputs, keep,
                [unpacks = std::move(unpacks)] {
                  for (const auto& unpack : unpacks) unpack();
                });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    const char* op = "gather";
    CheckOne(inputs.size(), rank_, op, "input tensor");
    CheckRoot(opts.rootRank, op);
    const int root = int(opts.rootRank);
    const collectives::Tensor send = View(inputs[0], rank_, op, "the input");
    if (rank_ != root) {
      TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), Where(rank_, op),
                  ": output tensors are given on rank ", rank_, ", which is not the root (", root,
                  ")");
      return Make(c10d::OpType::GATHER, {comm_->GatherAsync(send, Empty(send), root)}, {},
                  {inputs[0]});
    }
    CheckOne(outputs.size(), rank_, op, "output list");
    CheckList(outputs[0], inputs[0], op, "output");
    Gathered recv = GatherInto(outputs[0], inputs[0], send);
    return Make(c10d::OpType::GATHER, {comm_->GatherAsync(send, recv.view, root)}, outputs[0],
                {inputs[0], recv.buffer}, recv.unpack);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    const char* op = "scatter";
    CheckOne(outputs.size(), rank_, op, "output tensor");
    CheckRoot(opts.rootRank, op);
    const int root = int(opts.rootRank);
    const collectives::Tensor recv = View(outputs[0], rank_, op, "the output");
    if (rank_ != root) {
      TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), Where(rank_, op),
                  ": input tensors are given on rank ", rank_, ", which is not the root (", root,
                  ")");
      return Make(c10d::OpType::SCATTER, {comm_->ScatterAsync(Empty(recv), recv, root)}, outputs);
    }
    CheckOne(inputs.size(), rank_, op, "input list");
    CheckList(inputs[0], outputs[0], op, "input");
    at::Tensor packed = Pack(inputs[0]);
    const collectives::Tensor send = View(packed, rank_, op, "the inputs");
    std::vector<at::Tensor> keep(inputs[0].begin(), inputs[0].end());
    keep.push_back(packed);
    return Make(c10d::OpType::SCATTER, {comm_->ScatterAsync(send, recv, root)}, outputs, keep);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    const char* op = "reduce_scatter";
    CheckOne(outputs.size(), rank_, op, "output tensor");
    CheckOne(inputs.size(), rank_, op, "input list");
    const ReduceOp reduce = ToReduceOp(opts.reduceOp, rank_, op);
    const collectives::Tensor recv = View(outputs[0], rank_, op, "the output");
    CheckList(inputs[0], outputs[0], op, "input");
    at::Tensor packed = Pack(inputs[0]);
    const collectives::Tensor send = View(packed, rank_, op, "the inputs");
    std::vector<at::Tensor> keep(inputs[0].begin(), inputs[0].end());
    keep.push_back(packed);
    return Make(c10d::OpType::REDUCE_SCATTER, {comm_->ReduceScatterAsync(send, recv, reduce)},
                outputs, keep);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    const char* op = "reduce_scatter_tensor";
    const ReduceOp reduce = ToReduceOp(opts.reduceOp, rank_, op);
    const collectives::Tensor send = View(input, rank_, op, "the input");
    const collectives::Tensor recv = View(output, rank_, op, "the output");
    CheckSameAs(input, output, output.numel() * size_, rank_, op, "the input");
    return Make(c10d::OpType::_REDUCE_SCATTER_BASE, {comm_->ReduceScatterAsync(send, recv, reduce)},
                {output}, {input});
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions&) override {
    const char* op = "all_to_all_single";
    const collectives::Tensor send = View(input, rank_, op, "the input");
    const collectives::Tensor recv = View(output, rank_, op, "the output");
    TORCH_CHECK(input.scalar_type() == output.scalar_type(), Where(rank_, op),
                ": the output has dtype ", output.scalar_type(), ", the input ",
                input.scalar_type());
    if (output_splits.empty() && input_splits.empty()) {
      TORCH_CHECK(input.numel() == output.numel() && input.numel() % size_ == 0, Where(rank_, op),
                  ": without split sizes the input and the output must have the same number "
                  "of elements, a multiple of the world size (",
                  size_, "); got ", input.numel(), " and ", output.numel());
      return Make(c10d::OpType::ALLTOALL_BASE, {comm_->AllToAllAsync(send, recv)}, {output},
                  {input});
    }
    std::vector<size_t> send_counts = Counts(input, input_splits, op, "input");
    std::vector<size_t> recv_counts = Counts(output, output_splits, op, "output");
    return Make(c10d::OpType::ALLTOALL_BASE,
                {comm_->AllToAllAsync(send, recv, send_counts, recv_counts)}, {output}, {input});
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override {
    const char* op = "all_to_all";
    TORCH_CHECK(inputs.size() == size_t(size_) && outputs.size() == size_t(size_), Where(rank_, op),
                ": expects ", size_, " input and output tensors (one per rank), got ",
                inputs.size(), " and ", outputs.size());
    std::vector<size_t> send_counts, recv_counts;
    for (int r = 0; r < size_; ++r) {
      View(inputs[r], rank_, op, "an input");
      View(outputs[r], rank_, op, "an output");
      TORCH_CHECK(inputs[r].scalar_type() == inputs[0].scalar_type() &&
                      outputs[r].scalar_type() == inputs[0].scalar_type(),
                  Where(rank_, op), ": every input and output must have one dtype");
      send_counts.push_back(size_t(inputs[r].numel()));
      recv_counts.push_back(size_t(outputs[r].numel()));
    }
    at::Tensor packed = Pack(inputs);
    const collectives::Tensor send = View(packed, rank_, op, "the inputs");
    Gathered recv = GatherInto(outputs, outputs[0], send);
    std::vector<at::Tensor> keep(inputs.begin(), inputs.end());
    keep.push_back(packed);
    keep.push_back(recv.buffer);
    return Make(c10d::OpType::ALLTOALL,
                {comm_->AllToAllAsync(send, recv.view, send_counts, recv_counts)}, outputs, keep,
                recv.unpack);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    const char* op = "send";
    CheckOne(tensors.size(), rank_, op, "tensor");
    CheckPeer(dst, op);
    const collectives::Tensor view = View(tensors[0], rank_, op, "tensor");
    return Make(c10d::OpType::SEND, {comm_->SendAsync(view, dst, tag)}, tensors);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    const char* op = "recv";
    CheckOne(tensors.size(), rank_, op, "tensor");
    CheckPeer(src, op);
    const collectives::Tensor view = View(tensors[0], rank_, op, "tensor");
    return Make(c10d::OpType::RECV, {comm_->RecvAsync(view, src, tag)}, tensors);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>&, int) override {
    TORCH_CHECK(false, Where(rank_, "recv"),
                ": receiving from any source (src=None) is not supported; name the source rank");
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    if (inline_bytes_ > 0) return Inline(c10d::OpType::BARRIER, [&] { comm_->Barrier(); }, {});
    return Make(c10d::OpType::BARRIER, {comm_->BarrierAsync()}, {});
  }

 private:
  // The receive side of a gather-like call: the caller's tensors themselves when they lie back to
  // back, else a buffer of the call's own (at::empty) and the unpacking into them (copy_: torch's
  // kernels, on the current stream for CUDA tensors).
  struct Gathered {
    collectives::Tensor view;
    at::Tensor buffer;
    std::function<void()> unpack;
  };

  Gathered GatherInto(const std::vector<at::Tensor>& outputs, const at::Tensor& like,
                      const collectives::Tensor& send) {
    Gathered gathered;
    int64_t total = 0;
    for (const at::Tensor& output : outputs) total += output.numel();
    if (BackToBack(outputs)) {
      gathered.view = {outputs[0].data_ptr(), size_t(total), send.dtype, send.device};
      return gathered;
    }
    gathered.buffer = at::empty({total}, like.options());
    gathered.view = {gathered.buffer.data_ptr(), size_t(total), send.dtype, send.device};
    gathered.unpack = [outputs, buffer = gathered.buffer] {
      int64_t offset = 0;
      for (const at::Tensor& output : outputs) {
        const int64_t n = output.numel();
        output.copy_(buffer.narrow(0, offset, n).view(output.sizes()));
        offset += n;
      }
    };
    return gathered;
  }

  // `tensors` as one contiguous tensor: a view of their memory when they lie back to back (it
  // does not own it: the Work keeps `tensors` alive), else a copy (at::cat: torch's kernels, on
  // the current stream for CUDA tensors). The view names its device, so that torch does not ask
  // the CUDA runtime where a CUDA pointer lives.
  static at::Tensor Pack(const std::vector<at::Tensor>& tensors) {
    if (BackToBack(tensors)) {
      int64_t total = 0;
      for (const at::Tensor& tensor : tensors) total += tensor.numel();
      return at::for_blob(tensors[0].data_ptr(), {total})
          .options(tensors[0].options())
          .target_device(tensors[0].device())
          .make_tensor();
    }
    std::vector<at::Tensor> flat;
    for (const at::Tensor& tensor : tensors) flat.push_back(tensor.reshape({-1}));
    return at::cat(flat);
  }

  // Checks a rank-indexed list (one tensor per rank, each like `like`).
  void CheckList(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* op,
                 const char* what) {
    TORCH_CHECK(list.size() == size_t(size_), Where(rank_, op), ": expects ", size_, " ", what,
                " tensors (one per rank), got ", list.size());
    for (size_t r = 0; r < list.size(); ++r) {
      TORCH_CHECK(list[r].defined() && list[r].device() == like.device() &&
                      list[r].layout() == at::kStrided,
                  Where(rank_, op), ": ", what, " tensor ", r, " is not a dense tensor on ",
                  like.device());
      CheckSameAs(list[r], like, like.numel(), rank_, op,
                  std::string(what) + " tensor " + std::to_string(r));
    }
  }

  // Element counts per rank from split sizes along dimension 0 (empty: equal splits).
  std::vector<size_t> Counts(const at::Tensor& tensor, const std::vector<int64_t>& splits,
                             const char* op, const char* what) {
    const int64_t rows = tensor.dim() == 0 ? 1 : tensor.size(0);
    const int64_t row = rows == 0 ? 0 : tensor.numel() / rows;
    std::vector<size_t> counts;
    if (splits.empty()) {
      TORCH_CHECK(rows % size_ == 0, Where(rank_, op), ": the ", what, "'s first dimension (", rows,
                  ") does not split evenly over ", size_, " ranks");
      counts.assign(size_t(size_), size_t(rows / size_ * row));
      return counts;
    }
    TORCH_CHECK(splits.size() == size_t(size_), Where(rank_, op), ": ", what, "_split_sizes has ",
                splits.size(), " entries, expected ", size_);
    int64_t sum = 0;
    for (int64_t split : splits) {
      TORCH_CHECK(split >= 0, Where(rank_, op), ": ", what, "_split_sizes has a negative entry");
      sum += split;
      counts.push_back(size_t(split * row));
    }
    TORCH_CHECK(sum == rows, Where(rank_, op), ": ", what, "_split_sizes sum to ", sum, ", the ",
                what, "'s first dimension is ", rows);
    return counts;
  }

  void CheckRoot(int64_t root, const char* op) {
    TORCH_CHECK(root >= 0 && root < size_, Where(rank_, op), ": root ", root,
                " is not a rank of this group (size ", size_, ")");
  }

  void CheckPeer(int peer, const char* op) {
    TORCH_CHECK(peer >= 0 && peer < size_ && peer != rank_, Where(rank_, op), ": peer ", peer,
                " is not another rank of this group (size ", size_, ")");
  }

  c10::intrusive_ptr<c10d::Work> Make(c10d::OpType type,
                                      std::vector<std::shared_ptr<collectives::Work>> works,
                                      std::vector<at::Tensor> outputs,
                                      std::vector<at::Tensor> keep_alive = {},
                                      std::function<void()> finish = nullptr) {
    return c10::make_intrusive<CollectivesWork>(rank_, type, std::move(works), std::move(outputs),
                                                std::move(keep_alive), std::move(finish),
                                                completer_);
  }

  // Runs `call` (a blocking collective) on the caller's thread and returns its completed Work,
  // which raises the call's error, if any, from wait().
  c10::intrusive_ptr<c10d::Work> Inline(c10d::OpType type, const std::function<void()>& call,
                                        std::vector<at::Tensor> outputs) {
    std::exception_ptr error;
    try {
      call();
    } catch (...) {
      error = std::current_exception();
    }
    auto work = c10::make_intrusive<CollectivesWork>(
        rank_, type, std::vector<std::shared_ptr<collectives::Work>>{}, std::move(outputs),
        std::vector<at::Tensor>{}, nullptr, completer_, error);
    work->Finish();
    return work;
  }

  CommunicationOptions options_;
  // All-reduces and broadcasts of at most this many bytes, and barriers when it is positive,
  // run on the caller's thread and return completed (see Options.inline_bytes in
  // python/collectives/torch.py). Default 0: every call is asynchronous; every call of a group
  // of one rank runs inline.
  size_t inline_bytes_ = 0;
  std::unique_ptr<collectives::CollectiveCommunication> comm_;
  std::shared_ptr<Completer> completer_ = std::make_shared<Completer>();
};

}  // namespace
}  // namespace collectives_torch

PYBIND11_MODULE(_torch, m) {
  namespace py = pybind11;
  using collectives::CommunicationOptions;
  using collectives_torch::ProcessGroupCollectives;
  m.doc() = "The torch.distributed backend 'collectives' (import collectives.torch to register it)";
  py::module_::import("torch.distributed");

  py::class_<CommunicationOptions>(m, "CommunicationOptions")
      .def(py::init<>())
      .def_property(
          "implementation",
          [](const CommunicationOptions& o) {
            return std::string(collectives::ToString(o.implementation));
          },
          [](CommunicationOptions& o, const std::string& name) {
            o.implementation = collectives::ParseImplementation(name);
          })
      .def_readwrite("timeout", &CommunicationOptions::timeout)
      .def_readwrite("chunk_bytes", &CommunicationOptions::chunk_bytes)
      .def_readwrite("small_message_bytes", &CommunicationOptions::small_message_bytes)
      .def_readwrite("medium_message_bytes", &CommunicationOptions::medium_message_bytes)
      .def_readwrite("bytes_per_pack", &CommunicationOptions::bytes_per_pack)
      .def_readwrite("algorithm", &CommunicationOptions::algorithm)
      .def_readwrite("spin_us", &CommunicationOptions::spin_us)
      .def_readwrite("yield_us", &CommunicationOptions::yield_us)
      .def_readwrite("job_token", &CommunicationOptions::job_token)
      .def_readwrite("listen_address", &CommunicationOptions::listen_address);

  py::class_<ProcessGroupCollectives, c10d::ProcessGroup,
             c10::intrusive_ptr<ProcessGroupCollectives>>(m, "ProcessGroupCollectives")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       const CommunicationOptions& options, const std::string& master_addr,
                       int master_port, size_t inline_bytes) {
             return c10::make_intrusive<ProcessGroupCollectives>(
                 store, rank, size, options, master_addr, master_port, inline_bytes);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"),
           py::arg("master_addr") = "127.0.0.1", py::arg("master_port") = 29500,
           py::arg("inline_bytes") = 0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly(
          "implementation",
          [](ProcessGroupCollectives& pg) {
            return std::string(collectives::ToString(pg.comm().implementation()));
          })
      .def_property_readonly("options", &ProcessGroupCollectives::options)
      .def_property_readonly("inline_bytes", &ProcessGroupCollectives::inline_bytes)
      .def(
          "all_reduce_algorithm",
          [](ProcessGroupCollectives& pg, size_t bytes) {
            return pg.comm().AllReduceAlgorithm(bytes);
          },
          py::arg("bytes"));

  // For tests against the CPU stand-in for libcudart (tests/nccl/fake), with a torch built
  // without CUDA: a tensor on cuda:`device` over `pointer`, memory the caller owns and keeps
  // alive. Torch is told the device, so it does not ask a CUDA runtime it lacks where the pointer
  // lives; torch's own kernels (copies, arithmetic, printing) cannot run on such a tensor.
  m.def(
      "_cuda_tensor_for_tests",
      [](uintptr_t pointer, std::vector<int64_t> sizes, const py::object& dtype, int device) {
        TORCH_CHECK(THPDtype_Check(dtype.ptr()), "dtype must be a torch.dtype");
        TORCH_CHECK(device >= 0, "device must be a CUDA device index");
        const at::Device cuda(at::kCUDA, static_cast<c10::DeviceIndex>(device));
        const at::ScalarType type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
        return at::for_blob(reinterpret_cast<void*>(pointer), sizes)
            .options(at::TensorOptions().dtype(type).device(cuda))
            .target_device(cuda)
            .make_tensor();
      },
      py::arg("pointer"), py::arg("sizes"), py::arg("dtype"), py::arg("device"));
}
