// AUTO's plan for CUDA tensors: NCCL inside a host, the staged ring across hosts.
#include "src/hierarchical/device_plan.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <utility>

#include "src/hierarchical/sub_fabric.h"
#include "src/ring/algorithms.h"
#include "src/ring/staged.h"
#ifdef COLLECTIVES_WITH_NCCL
#include "src/nccl/nccl_communication.h"
#include "src/nccl/nccl_loader.h"
#endif

namespace collectives::hierarchical {
namespace {

std::atomic<uint64_t> nccl_calls{0};

// Says once per process, on stderr, that AUTO's CUDA calls run on the staged ring, and why.
void SayStaged(int rank, const std::string& why) {
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return;
  const std::string line =
      "collectives: rank " + std::to_string(rank) +
      ": AUTO runs CUDA tensors on the staged ring over TCP, without NCCL: " + why + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines of ranks do not mix
}

#ifndef COLLECTIVES_WITH_NCCL

class StagedOnly final : public DevicePlan {
 public:
  explicit StagedOnly(int rank) : rank_(rank) {}
  Body AllReduce(const Tensor&, const Tensor&, ReduceOp, Body staged) override {
    return Say(std::move(staged));
  }
  Body Broadcast(const Tensor&, const Tensor&, int, Body staged) override {
    return Say(std::move(staged));
  }
  Body AllGather(const Tensor&, const Tensor&, Body staged) override {
    return Say(std::move(staged));
  }
  Body ReduceScatter(const Tensor&, const Tensor&, ReduceOp, Body staged) override {
    return Say(std::move(staged));
  }
  void Abort(const Error&) override {}

 private:
  Body Say(Body staged) const {
    SayStaged(rank_, "this library is built without NCCL");
    return staged;
  }
  const int rank_;
};

#else  // COLLECTIVES_WITH_NCCL

using Clock = std::chrono::steady_clock;

bool Floating(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
         dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

size_t Segments(size_t count, size_t per) { return count == 0 ? 1 : (count + per - 1) / per; }

std::chrono::milliseconds Left(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                  std::chrono::milliseconds(1));
}

class NcclDevicePlan final : public DevicePlan {
 public:
  NcclDevicePlan(DevicePlanLayout layout, std::shared_ptr<Store> store, std::string key_prefix,
                 const CommunicationOptions& options)
      : layout_(std::move(layout)),
        store_(std::move(store)),
        key_prefix_(std::move(key_prefix)),
        small_(options.small_message_bytes ? options.small_message_bytes
                                           : ring::kDefaultSmallMessageBytes),
        host_(layout_.host_of[size_t(layout_.rank)]),
        local_index_(layout_.local_index[size_t(layout_.rank)]),
        members_(layout_.hosts[size_t(host_)]) {
    uniform_ = true;
    for (const auto& ranks : layout_.hosts) {
      uniform_ = uniform_ && ranks.size() == layout_.hosts[0].size();
      leaders_.push_back(ranks[0]);
    }
    if (uniform_) {
      for (const auto& ranks : layout_.hosts) lane_.push_back(ranks[size_t(local_index_)]);
    }
  }

  ~NcclDevicePlan() override {
    if (scratch_ != nullptr) {
      const nccl::NcclApi* api = nccl::TryLoadCudart();
      if (api != nullptr) {
        api->cudaSetDevice(device_);
        api->cudaFree(scratch_);
      }
    }
  }

  Body AllReduce(const Tensor& send, const Tensor& recv, ReduceOp op, Body staged) override {
    if (op == ReduceOp::kAvg && hosts() > 1 && (!uniform_ || !Floating(recv.dtype))) {
      return staged;
    }
    return [this, send, recv, op, staged = std::move(staged)](ring::Context& ctx) {
      if (!UseNccl(ctx, recv.device.index)) return staged(ctx);
      CollectiveCommunication& local = Local(ctx, recv.device.index);
      if (hosts() == 1) return Nccl(ctx, [&] { local.AllReduce(send, recv, op); });
      const size_t members = members_.size();
      if (members == 1) return CrossAllReduce(ctx, leaders_, send, recv, op);
      if (uniform_ && recv.count % members == 0) {
        // In lanes: this rank's slice of the host's reduction crosses among the ranks of its
        // local index, every lane at once.
        const size_t slice = recv.count / members;
        const Tensor mine{
            static_cast<uint8_t*>(recv.data) + size_t(local_index_) * slice * SizeOf(recv.dtype),
            slice, recv.dtype, recv.device};
        Nccl(ctx, [&] { local.ReduceScatter(send, mine, op); });
        CrossAllReduce(ctx, lane_, mine, mine, op);
        Nccl(ctx, [&] { local.AllGather(mine, recv); });
        return;
      }
      Nccl(ctx, [&] { local.Reduce(send, recv, op, 0); });
      if (local_index_ == 0) CrossAllReduce(ctx, leaders_, recv, recv, op);
      Nccl(ctx, [&] { local.Broadcast(recv, recv, 0); });
    };
  }

  Body Broadcast(const Tensor& send, const Tensor& recv, int root, Body staged) override {
    return [this, send, recv, root, staged = std::move(staged)](ring::Context& ctx) {
      if (!UseNccl(ctx, recv.device.index)) return staged(ctx);
      CollectiveCommunication& local = Local(ctx, recv.device.index);
      const bool is_root = layout_.rank == root;
      if (hosts() == 1) {
        return Nccl(ctx, [&] { local.Broadcast(is_root ? send : recv, recv, root); });
      }
      const int root_host = layout_.host_of[size_t(root)];
      std::vector<int> crossers = leaders_;
      crossers[size_t(root_host)] = root;
      const int crosser = crossers[size_t(host_)];
      if (crosser == layout_.rank) {
        CrossBroadcast(ctx, crossers, root_host, is_root ? &send : nullptr, recv);
      }
      if (members_.size() > 1) {
        const int from = layout_.local_index[size_t(crosser)];
        Nccl(ctx, [&] { local.Broadcast(recv, recv, from); });
      }
    };
  }

  Body AllGather(const Tensor& send, const Tensor& recv, Body staged) override {
    if (hosts() > 1 && !uniform_) return staged;
    return [this, send, recv, staged = std::move(staged)](ring::Context& ctx) {
      if (!UseNccl(ctx, recv.device.index)) return staged(ctx);
      CollectiveCommunication& local = Local(ctx, recv.device.index);
      if (hosts() == 1) return Nccl(ctx, [&] { local.AllGather(send, recv); });
      const size_t count = send.count;
      const size_t members = members_.size();
      const auto block = [&](int rank) {
        return Tensor{static_cast<uint8_t*>(recv.data) + size_t(rank) * send.bytes(), count,
                      recv.dtype, recv.device};
      };
      if (members > 1) {
        bool consecutive = true;
        for (size_t l = 0; l < members; ++l) {
          consecutive = consecutive && members_[l] == members_[0] + int(l);
        }
        if (consecutive) {
          Tensor host_blocks = block(members_[0]);
          host_blocks.count = count * members;
          Nccl(ctx, [&] { local.AllGather(send, host_blocks); });
        } else {
          for (size_t l = 0; l < members; ++l) {
            const Tensor into = block(members_[l]);
            Nccl(ctx, [&] { local.Broadcast(int(l) == local_index_ ? send : into, into, int(l)); });
          }
        }
      }
      if (local_index_ == 0) CrossAllGather(ctx, send, recv);
      if (members > 1) Nccl(ctx, [&] { local.Broadcast(recv, recv, 0); });
    };
  }

  Body ReduceScatter(const Tensor& send, const Tensor& recv, ReduceOp op, Body staged) override {
    if (hosts() > 1 && (!uniform_ || op == ReduceOp::kAvg)) return staged;
    return [this, send, recv, op, staged = std::move(staged)](ring::Context& ctx) {
      if (!UseNccl(ctx, recv.device.index)) return staged(ctx);
      CollectiveCommunication& local = Local(ctx, recv.device.index);
      if (hosts() == 1) return Nccl(ctx, [&] { local.ReduceScatter(send, recv, op); });
      const size_t members = members_.size();
      const size_t world = layout_.host_of.size();
      const size_t e = SizeOf(recv.dtype);
      if (members == 1) return CrossReduceScatter(ctx, send.data, recv.data, recv, op);
      // The leader's scratch: the host's reduction of send, then the host's blocks of the result.
      uint8_t* scratch = nullptr;
      if (local_index_ == 0) {
        scratch = Scratch(recv.device.index, (world + members) * recv.count * e);
      }
      const Tensor reduced{scratch, world * recv.count, recv.dtype, recv.device};
      const Tensor mine{scratch == nullptr ? nullptr : scratch + world * recv.count * e,
                        members * recv.count, recv.dtype, recv.device};
      Nccl(ctx, [&] { local.Reduce(send, local_index_ == 0 ? reduced : Tensor{}, op, 0); });
      if (local_index_ == 0) CrossReduceScatter(ctx, reduced.data, mine.data, recv, op);
      Nccl(ctx, [&] { local.Scatter(local_index_ == 0 ? mine : Tensor{}, recv, 0); });
    };
  }

  void Abort(const Error&) override {
    std::shared_ptr<CollectiveCommunication> local;
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted_ = true;
      local = local_;
    }
    if (local) local->Abort();
  }

 private:
  size_t hosts() const { return layout_.hosts.size(); }

  // Whether the ranks use NCCL, decided at the first CUDA call (on `device`) by every rank
  // alike from what each says in an all-gather: whether NCCL is usable here, and the PCI bus id
  // of its GPU. NCCL runs only if it is usable everywhere and no two ranks of a host share a GPU
  // (NCCL needs one per rank; the staged ring does not).
  bool UseNccl(ring::Context& ctx, int device) {
    if (use_nccl_) return *use_nccl_;
    constexpr size_t kRecord = 64;  // "1" or "0", then the bus id, NUL-terminated
    std::vector<char> mine(kRecord, '\0');
    std::string why;
    const char* env = std::getenv("COLLECTIVES_AUTO_NCCL");
    if (env != nullptr && std::string(env) == "0") {
      why = "COLLECTIVES_AUTO_NCCL=0";
    } else if (const nccl::NcclApi* api = nccl::TryLoadNccl(&why); api != nullptr) {
      const cudaError_t status = api->cudaDeviceGetPCIBusId(&mine[1], int(kRecord - 1), device);
      if (status == cudaSuccess) {
        mine[0] = '1';
      } else {
        why = std::string("cudaDeviceGetPCIBusId: ") + api->cudaGetErrorString(status);
      }
    }
    const size_t world = layout_.host_of.size();
    std::vector<char> all(world * kRecord);
    ring::SmallAllGather(ctx, mine.data(), all.data(), kRecord);
    std::string reason;
    for (size_t r = 0; r < world && reason.empty(); ++r) {
      if (all[r * kRecord] == '1') continue;
      reason = int(r) == layout_.rank ? why : "NCCL is not usable on rank " + std::to_string(r);
    }
    for (size_t r = 0; r < world && reason.empty(); ++r) {
      for (size_t q = r + 1; q < world && reason.empty(); ++q) {
        const char* bus = &all[r * kRecord + 1];
        if (layout_.host_of[r] != layout_.host_of[q] || std::string(bus) != &all[q * kRecord + 1]) {
          continue;
        }
        reason = "ranks " + std::to_string(r) + " and " + std::to_string(q) + " share the GPU at " +
                 bus + " (NCCL needs a GPU per rank)";
      }
    }
    use_nccl_ = reason.empty();
    if (!*use_nccl_) SayStaged(layout_.rank, reason);
    return *use_nccl_;
  }

  // The host's NCCL communicator, made at the first CUDA call on `device`.
  // Made outside mu_ (the set-up waits for the host's other ranks), so that Abort is not held.
  CollectiveCommunication& Local(ring::Context& ctx, int device) {
    const std::string own = "rank " + std::to_string(layout_.rank) + ": ";
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) throw Error(ErrorCode::kAborted, own + "the communicator was aborted");
    }
    if (local_) {
      if (device != device_) {
        throw Error(ErrorCode::kInvalidArgument,
                    own + ctx.tag.ToString() + ": a tensor on cuda:" + std::to_string(device) +
                        ", but AUTO's NCCL communicator of this rank is on cuda:" +
                        std::to_string(device_) + " (one device per rank)");
      }
      return *local_;
    }
    CommunicationOptions options;
    options.implementation = Implementation::kNccl;
    options.timeout = Left(ctx.deadline);
    nccl::NcclOptions nccl_options;
    nccl_options.device = device;
    nccl_options.setup_deadline = ctx.deadline;
    std::shared_ptr<CollectiveCommunication> made;
    try {
      made = nccl::CreateNcclCommunication(local_index_, int(members_.size()), store_,
                                           key_prefix_ + "/auto_nccl/" + std::to_string(host_),
                                           options, nccl_options);
    } catch (const Error& error) {
      std::string why = error.message();
      const std::string local_own = "rank " + std::to_string(local_index_) + ": ";
      if (why.starts_with(local_own)) why.erase(0, local_own.size());
      throw Error(error.code(), own + "AUTO's NCCL communicator of the host's " +
                                    std::to_string(members_.size()) + " ranks (as its rank " +
                                    std::to_string(local_index_) + "): " + why);
    }
    bool aborted = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      aborted = aborted_;
      local_ = made;
    }
    if (aborted) {
      made->Abort();
      throw Error(ErrorCode::kAborted, own + "the communicator was aborted");
    }
    device_ = device;
    return *local_;
  }

  template <typename F>
  void Nccl(ring::Context& ctx, F&& call) {
    local_->SetTimeout(Left(ctx.deadline));
    call();
    nccl_calls.fetch_add(1, std::memory_order_relaxed);
  }

  ring::CudaStaging& Staging() {
    if (!staging_) staging_ = ring::CudaStaging::Open(device_, ring::CudaStagingBytes());
    return *staging_;
  }

  uint8_t* Scratch(int device, size_t bytes) {
    if (bytes > scratch_bytes_ || scratch_ == nullptr) {
      const nccl::NcclApi& api = nccl::LoadCudart();
      api.cudaSetDevice(device);
      if (scratch_ != nullptr) api.cudaFree(scratch_);
      scratch_ = nullptr;
      scratch_bytes_ = 0;
      void* p = nullptr;
      const cudaError_t status = api.cudaMalloc(&p, std::max<size_t>(bytes, 1));
      if (status != cudaSuccess) {
        throw Error(ErrorCode::kSystem,
                    "rank " + std::to_string(layout_.rank) + ": AUTO's reduce-scatter scratch of " +
                        std::to_string(bytes) + " bytes on cuda:" + std::to_string(device) + ": " +
                        api.cudaGetErrorString(status));
      }
      scratch_ = static_cast<uint8_t*>(p);
      scratch_bytes_ = std::max<size_t>(bytes, 1);
    }
    return scratch_;
  }

  std::string What(const ring::Context& ctx) const {
    return "rank " + std::to_string(layout_.rank) + ": " + ctx.tag.ToString();
  }

  // The all-reduce of `from` into `into` among `ranks` (one per host, in host order), staged.
  void CrossAllReduce(ring::Context& ctx, const std::vector<int>& ranks, const Tensor& from,
                      const Tensor& into, ReduceOp op) {
    SubFabric sub(ctx.fabric, ranks, host_);
    ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
    ring::CudaStaging& staging = Staging();
    const size_t e = SizeOf(into.dtype), count = into.count;
    const size_t per = std::max<size_t>(1, staging.slot_bytes() / e);
    auto* in = static_cast<uint8_t*>(from.data);
    auto* out = static_cast<uint8_t*>(into.data);
    const auto plan = [&](size_t k, std::vector<ring::CudaStaging::Copy>* copy_in,
                          std::vector<ring::CudaStaging::Copy>* copy_out) {
      const size_t bytes = std::min(per, count - k * per) * e;
      copy_in->push_back({0, in + k * per * e, bytes});
      copy_out->push_back({0, out + k * per * e, bytes});
    };
    const auto work = [&](size_t k, uint8_t* slot) {
      const size_t n = std::min(per, count - k * per);
      if (n * e <= small_) {
        return ring::RecursiveDoublingAllReduce(cross, slot, slot, n, into.dtype, op);
      }
      ring::RingAllReduce(cross, slot, slot, n, into.dtype, op);
    };
    staging.Run(Segments(count, per), plan, work, ctx.deadline, What(ctx));
  }

  // The crossers' broadcast (one per host, the root's host's is the root) into recv.
  void CrossBroadcast(ring::Context& ctx, const std::vector<int>& crossers, int root_host,
                      const Tensor* send, const Tensor& recv) {
    SubFabric sub(ctx.fabric, crossers, host_);
    ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
    ring::CudaStaging& staging = Staging();
    const size_t e = SizeOf(recv.dtype), count = recv.count;
    const size_t per = std::max<size_t>(1, staging.slot_bytes() / e);
    auto* in = send != nullptr ? static_cast<uint8_t*>(send->data) : nullptr;
    auto* out = static_cast<uint8_t*>(recv.data);
    const auto plan = [&](size_t k, std::vector<ring::CudaStaging::Copy>* copy_in,
                          std::vector<ring::CudaStaging::Copy>* copy_out) {
      const size_t bytes = std::min(per, count - k * per) * e;
      if (in != nullptr) copy_in->push_back({0, in + k * per * e, bytes});
      copy_out->push_back({0, out + k * per * e, bytes});
    };
    const auto work = [&](size_t k, uint8_t* slot) {
      const size_t bytes = std::min(per, count - k * per) * e;
      if (bytes <= small_) {
        return ring::SmallBroadcast(cross, in != nullptr ? slot : nullptr, slot, bytes, root_host);
      }
      ring::ChainBroadcast(cross, in != nullptr ? slot : nullptr, slot, bytes, root_host);
    };
    staging.Run(Segments(count, per), plan, work, ctx.deadline, What(ctx));
  }

  // The leaders' all-gather of their hosts' blocks of recv (a lone rank's from send).
  void CrossAllGather(ring::Context& ctx, const Tensor& send, const Tensor& recv) {
    SubFabric sub(ctx.fabric, leaders_, host_);
    ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
    ring::CudaStaging& staging = Staging();
    const size_t e = SizeOf(recv.dtype), count = send.count, h_count = hosts();
    const size_t members = members_.size();
    const size_t per = std::max<size_t>(1, staging.slot_bytes() / ((h_count + 1) * members * e));
    auto* in = static_cast<uint8_t*>(send.data);
    auto* out = static_cast<uint8_t*>(recv.data);
    const auto plan = [&](size_t k, std::vector<ring::CudaStaging::Copy>* copy_in,
                          std::vector<ring::CudaStaging::Copy>* copy_out) {
      const size_t m = std::min(per, count - k * per), bytes = m * e, chunk = members * bytes;
      for (size_t l = 0; l < members; ++l) {
        uint8_t* from =
            members == 1 ? in + k * per * e : out + (size_t(members_[l]) * count + k * per) * e;
        copy_in->push_back({l * bytes, from, bytes});
      }
      for (size_t h = 0; h < h_count; ++h) {
        if (int(h) == host_ && members > 1) continue;  // already in place
        for (size_t l = 0; l < members; ++l) {
          const size_t rank = size_t(layout_.hosts[h][l]);
          copy_out->push_back(
              {chunk + h * chunk + l * bytes, out + (rank * count + k * per) * e, bytes});
        }
      }
    };
    const auto work = [&](size_t k, uint8_t* slot) {
      const size_t chunk = members * std::min(per, count - k * per) * e;
      if (h_count * chunk <= small_) return ring::SmallAllGather(cross, slot, slot + chunk, chunk);
      ring::RingAllGather(cross, slot, slot + chunk, chunk, DataType::kUInt8);
    };
    staging.Run(Segments(count, per), plan, work, ctx.deadline, What(ctx));
  }

  // The leaders' reduce-scatter of the hosts' reductions `from` (world x recv.count elements,
  // rank order) into `into` (the host's blocks, local order).
  void CrossReduceScatter(ring::Context& ctx, const void* from, void* into, const Tensor& recv,
                          ReduceOp op) {
    SubFabric sub(ctx.fabric, leaders_, host_);
    ring::Context cross{sub, ctx.tag, ctx.chunk_bytes, ctx.staging, ctx.deadline};
    ring::CudaStaging& staging = Staging();
    const size_t e = SizeOf(recv.dtype), count = recv.count, h_count = hosts();
    const size_t members = members_.size();
    const size_t per = std::max<size_t>(1, staging.slot_bytes() / ((h_count + 1) * members * e));
    auto* in = static_cast<uint8_t*>(const_cast<void*>(from));
    auto* out = static_cast<uint8_t*>(into);
    const auto plan = [&](size_t k, std::vector<ring::CudaStaging::Copy>* copy_in,
                          std::vector<ring::CudaStaging::Copy>* copy_out) {
      const size_t m = std::min(per, count - k * per), bytes = m * e;
      for (size_t h = 0; h < h_count; ++h) {
        for (size_t l = 0; l < members; ++l) {
          const size_t rank = size_t(layout_.hosts[h][l]);
          copy_in->push_back({(h * members + l) * bytes, in + (rank * count + k * per) * e, bytes});
        }
      }
      for (size_t l = 0; l < members; ++l) {
        copy_out->push_back(
            {(h_count * members + l) * bytes, out + (l * count + k * per) * e, bytes});
      }
    };
    const auto work = [&](size_t k, uint8_t* slot) {
      const size_t m = std::min(per, count - k * per), chunk = members * m * e;
      if (h_count * chunk <= small_) {
        return ring::SmallReduceScatter(cross, slot, slot + h_count * chunk, members * m,
                                        recv.dtype, op);
      }
      ring::RingReduceScatter(cross, slot, slot + h_count * chunk, members * m, recv.dtype, op);
    };
    staging.Run(Segments(count, per), plan, work, ctx.deadline, What(ctx));
  }

  const DevicePlanLayout layout_;
  const std::shared_ptr<Store> store_;
  const std::string key_prefix_;
  const size_t small_;
  const int host_;
  const int local_index_;
  const std::vector<int> members_;
  bool uniform_ = true;
  std::vector<int> leaders_;
  std::vector<int> lane_;  // the ranks of this rank's local index, one per host (uniform hosts)
  // Used by the thread running the call.
  std::optional<bool> use_nccl_;
  int device_ = -1;
  std::shared_ptr<ring::CudaStaging> staging_;
  uint8_t* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  std::mutex mu_;
  // Written under mu_ by the thread running the call, which reads it without; Abort under mu_.
  std::shared_ptr<CollectiveCommunication> local_;
  bool aborted_ = false;  // guarded by mu_
};

#endif  // COLLECTIVES_WITH_NCCL

}  // namespace

std::unique_ptr<DevicePlan> CreateDevicePlan(DevicePlanLayout layout, std::shared_ptr<Store> store,
                                             const std::string& key_prefix,
                                             const CommunicationOptions& options) {
#ifdef COLLECTIVES_WITH_NCCL
  return std::make_unique<NcclDevicePlan>(std::move(layout), std::move(store), key_prefix, options);
#else
  (void)store, (void)key_prefix, (void)options;
  return std::make_unique<StagedOnly>(layout.rank);
#endif
}

uint64_t DevicePlanNcclCalls() { return nccl_calls.load(std::memory_order_relaxed); }

}  // namespace collectives::hierarchical
