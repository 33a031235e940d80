// The coordinator of parameter-server training (parameter_server.h): ParameterServerStrategy
// (variables on the parameter servers, their health, checkpoints) and ClusterCoordinator (the
// queue of scheduled steps and one dispatching thread per worker).
//
// Dispatch: Schedule appends a closure (function name, arguments, its RemoteValue) to one queue.
// Each worker has a thread on the coordinator that connects to it (again and again while it is
// unreachable), makes the per-worker datasets it lacks, then takes the next closure and runs it
// there, waiting for the reply up to step_timeout. A connection that breaks or a step that
// times out puts the closure back at the head of the queue, where the next free worker takes it,
// and the thread goes back to connecting: a restarted worker gets its datasets again and steps.
// A step that fails on the worker (the function threw) fails its RemoteValue; it is not run again.
//
// Health: a thread pings every parameter server each heartbeat_interval. A ps that has not
// answered for ps_timeout, or that answers with another incarnation (it was restarted and lost
// its variables), breaks the cluster: every waiting and later call throws Error(kPeerLost) naming
// it. A worker that reports a lost ps makes the coordinator check that ps at once.
#include "collectives/parameter_server.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "collectives/errors.h"
#include "src/strategy/parameter_server_internal.h"
#include "src/strategy/parameter_server_wire.h"

namespace collectives::strategy {
namespace ps {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

// ---- Checkpoints, in the format of strategy.h's SaveCheckpoint ----

struct CheckpointValues {
  std::vector<PsVariable> variables;                    // names and shapes
  std::vector<std::vector<float>> values;               // per variable
  std::vector<std::vector<std::vector<float>>> slots;   // per variable, per slot
  std::string optimizer;
  std::vector<std::string> slot_names;
  int64_t iterations = 0;
  TrainingState state;
};

// Writes with WriteCheckpointFile: the file SaveCheckpoint writes, slots named
// "<variable>/<slot>".
void WriteCheckpoint(const std::string& directory, const CheckpointValues& c) {
  CheckpointData data;
  data.state = c.state;
  data.optimizer = c.optimizer;
  data.iterations = c.iterations;
  for (size_t i = 0; i < c.variables.size(); ++i) {
    data.variables.push_back({c.variables[i].name, c.variables[i].shape, c.values[i]});
    for (size_t s = 0; s < c.slot_names.size(); ++s) {
      data.slots.push_back({c.variables[i].name + "/" + c.slot_names[s],
                            {c.variables[i].count}, c.slots[i][s]});
    }
  }
  WriteCheckpointFile(directory, data);
}

// Reads into `c` (whose variables, optimizer and slot_names say what is expected), checking the
// file against them as RestoreCheckpoint does (kInvalidArgument naming the difference). False
// when there is no checkpoint.
bool ReadCheckpoint(const std::string& directory, CheckpointValues* c) {
  std::optional<CheckpointData> data = ReadCheckpointFile(directory);
  if (!data) return false;
  const std::string where = "checkpoint " + directory + "/checkpoint: ";
  if (data->optimizer != c->optimizer) {
    Invalid(where + "saved with optimizer '" + data->optimizer + "', the strategy's is '" +
            c->optimizer + "'");
  }
  if (data->variables.size() != c->variables.size()) {
    Invalid(where + "holds " + std::to_string(data->variables.size()) + " variables, the strategy " +
            std::to_string(c->variables.size()));
  }
  std::map<std::string, const CheckpointData::Tensor*> slots;
  for (const CheckpointData::Tensor& t : data->slots) slots[t.name] = &t;
  c->values.clear();
  c->slots.clear();
  for (const PsVariable& v : c->variables) {
    const CheckpointData::Tensor* t = data->FindVariable(v.name);
    if (t == nullptr) Invalid(where + "holds no variable '" + v.name + "'");
    if (t->shape != v.shape || t->values.size() != v.count) {
      Invalid(where + "variable '" + v.name + "' has another shape than the strategy's");
    }
    c->values.push_back(t->values);
    std::vector<std::vector<float>> of_variable;
    for (const std::string& name : c->slot_names) {
      auto it = slots.find(v.name + "/" + name);
      if (it == slots.end()) {
        of_variable.emplace_back(v.count, 0.0f);  // never updated when saved
      } else if (it->second->values.size() != v.count) {
        Invalid(where + "slot '" + it->first + "' has " +
                std::to_string(it->second->values.size()) + " values for " +
                std::to_string(v.count));
      } else {
        of_variable.push_back(it->second->values);
      }
    }
    c->slots.push_back(std::move(of_variable));
  }
  c->state = data->state;
  c->iterations = data->iterations;
  return true;
}

std::string Joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : ", ") + s;
  return out;
}

}  // namespace

ResolvedCluster ResolveCluster(const ParameterServerOptions& options, bool server) {
  ResolvedCluster out;
  out.ps_addresses = options.ps_addresses;
  out.worker_addresses = options.worker_addresses;
  std::optional<ClusterSpec> spec = options.cluster;
  const bool need_spec = !spec && (server || out.ps_addresses.empty() ||
                                   out.worker_addresses.empty());
  if (need_spec) spec = ClusterSpec::FromEnvironment();
  if (spec) {
    out.task_type = spec->task_type;
    out.task_index = spec->task_index;
    out.token = spec->job_token;
    // The lists TF_CONFIG gives, unless the options name them.
    const bool from_spec = out.ps_addresses.empty() || out.worker_addresses.empty();
    if (from_spec && !spec->cluster.empty()) CheckClusterLayout(*spec, "parameter_server");
    const auto role = [&](const char* name) {
      auto it = spec->cluster.find(name);
      return it == spec->cluster.end() ? std::vector<std::string>{} : it->second;
    };
    if (out.ps_addresses.empty()) out.ps_addresses = role("ps");
    if (out.worker_addresses.empty()) out.worker_addresses = role("worker");
  }
  if (!options.job_token.empty()) out.token = options.job_token;
  if (out.token.empty()) {
    if (const char* env = std::getenv("COLLECTIVES_JOB_TOKEN")) out.token = env;
  }
  if (out.ps_addresses.empty()) {
    Invalid("ParameterServerStrategy: no parameter server: the cluster lists no \"ps\" task");
  }
  if (!server && out.worker_addresses.empty()) {
    Invalid("ParameterServerStrategy: no worker: the cluster lists no \"worker\" task");
  }
  return out;
}

OptimizerConfig OptimizerConfig::From(const PsOptimizer& optimizer) {
  OptimizerConfig c;
  if (optimizer.name == "sgd" || optimizer.name == "SGD") {
    c.kind = kSgd;
    c.learning_rate = optimizer.sgd.learning_rate;
    c.momentum = optimizer.sgd.momentum;
    c.nesterov = optimizer.sgd.nesterov;
    if (!(c.momentum >= 0.0f && c.momentum < 1.0f)) {
      Invalid("PsOptimizer: SGD momentum must be in [0, 1), got " + std::to_string(c.momentum));
    }
  } else if (optimizer.name == "adam" || optimizer.name == "Adam") {
    c.kind = kAdam;
    c.learning_rate = optimizer.adam.learning_rate;
    c.beta_1 = optimizer.adam.beta_1;
    c.beta_2 = optimizer.adam.beta_2;
    c.epsilon = optimizer.adam.epsilon;
    if (!(c.beta_1 >= 0.0f && c.beta_1 < 1.0f) || !(c.beta_2 >= 0.0f && c.beta_2 < 1.0f)) {
      Invalid("PsOptimizer: Adam's beta_1 and beta_2 must be in [0, 1)");
    }
  } else {
    Invalid("PsOptimizer: unknown optimizer '" + optimizer.name + "' (\"sgd\" or \"adam\")");
  }
  const PsLearningRateSchedule& schedule = optimizer.schedule;
  if (schedule.decay == "none" || schedule.decay == "constant") {
    c.decay = kConstant;
  } else if (schedule.decay == "cosine") {
    if (schedule.decay_steps <= 0) {
      Invalid("PsOptimizer: cosine decay needs decay_steps > 0, got " +
              std::to_string(schedule.decay_steps));
    }
    c.decay = kCosine;
    c.decay_steps = schedule.decay_steps;
  } else {
    Invalid("PsOptimizer: unknown learning-rate decay '" + schedule.decay +
            "' (\"none\" or \"cosine\")");
  }
  return c;
}

double OptimizerConfig::LearningRate(int64_t updates) const {
  const double rate = static_cast<double>(learning_rate);
  if (decay == kConstant) return rate;
  const double progress = static_cast<double>(std::min(updates, decay_steps)) /
                          static_cast<double>(decay_steps);
  return rate * 0.5 * (1.0 + std::cos(M_PI * progress));
}

std::vector<std::string> OptimizerConfig::slot_names() const {
  if (kind == kAdam) return {"m", "v"};
  if (momentum > 0.0f) return {"momentum"};
  return {};
}

}  // namespace ps

using ps::Clock;

// ---- ParameterServerStrategy ----

class ParameterServerStrategy::Impl {
 public:
  explicit Impl(ParameterServerOptions options)
      : options_(std::move(options)),
        cluster_(ps::ResolveCluster(options_, false)),
        optimizer_(ps::OptimizerConfig::From(options_.optimizer)) {
    if (options_.partitioner.fixed_shards < 0) {
      ps::Invalid("Partitioner: fixed_shards must be >= 0");
    }
    layout_.ps_addresses = cluster_.ps_addresses;
    layout_.worker_addresses = cluster_.worker_addresses;
    const size_t n = cluster_.ps_addresses.size();
    for (size_t i = 0; i < n; ++i) {
      const std::string name = ps::PsName(int(i), cluster_.ps_addresses[i]);
      calls_.push_back(std::make_unique<ps::Client>(cluster_.ps_addresses[i], name, ps::Kind::kPs,
                                                    cluster_.token, options_.request_timeout));
      pings_.push_back(std::make_unique<ps::Client>(cluster_.ps_addresses[i], name, ps::Kind::kPs,
                                                    cluster_.token, options_.ps_timeout));
    }
    incarnations_.assign(n, 0);
    last_answer_.assign(n, Clock::now());
    // Every ps must answer once; they may start after the coordinator.
    const Clock::time_point deadline = Clock::now() + options_.connect_timeout;
    for (size_t i = 0; i < n; ++i) {
      std::string why;
      for (;;) {
        const Clock::time_point attempt = std::min(deadline, Clock::now() + options_.ps_timeout);
        if (pings_[i]->EnsureConnected(attempt, &why)) {
          try {
            Ping(i, attempt);
            break;
          } catch (const ps::RemoteError&) {
            throw;
          } catch (const Error& e) {
            why = e.message();
          }
        }
        if (Clock::now() >= deadline) {
          throw Error(ErrorCode::kTimeout,
                      "ParameterServerStrategy: parameter server " + pings_[i]->name() +
                          " did not answer within " +
                          std::to_string(options_.connect_timeout.count()) + " ms: " + why);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      last_answer_[i] = Clock::now();
    }
    watcher_ = std::thread([this] { Watch(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& p : pings_) p->Interrupt();
    if (watcher_.joinable()) watcher_.join();
  }

  const ParameterServerOptions& options() const { return options_; }
  const ps::ResolvedCluster& cluster() const { return cluster_; }
  const ps::OptimizerConfig& optimizer() const { return optimizer_; }

  // The layout workers need (a copy: variables may be created while steps run).
  ps::Layout layout() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return layout_;
  }
  std::vector<PsVariable> variables() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return layout_.variables;
  }

  void CheckHealth() const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_) throw *broken_;
  }
  std::optional<Error> broken() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return broken_;
  }

  // Called with the error when the cluster breaks (at most once), from the breaking thread.
  void OnBroken(std::function<void(const Error&)> listener) {
    std::lock_guard<std::mutex> lock(mutex_);
    listeners_.push_back(std::move(listener));
  }
  // Returns once no listener runs; none is called after.
  void ClearListeners() {
    std::lock_guard<std::mutex> calling(listeners_mutex_);
    std::lock_guard<std::mutex> lock(mutex_);
    listeners_.clear();
  }

  // A worker could not reach ps `index`: check it now.
  void CheckPs(int index, const std::string& report) {
    if (index < 0 || size_t(index) >= pings_.size()) return;
    std::lock_guard<std::mutex> ping_lock(ping_mutex_);
    if (broken()) return;
    try {
      Ping(size_t(index), Clock::now() + options_.ps_timeout);
    } catch (const Error& e) {
      MarkLost(size_t(index), e.message() + " (and a worker reported: " + report + ")");
    }
  }

  // One request to ps `index` from the coordinator.
  std::vector<uint8_t> Call(size_t index, ps::Op op, const std::vector<uint8_t>& body) {
    CheckHealth();
    try {
      return calls_[index]->Call(op, body);
    } catch (const ps::RemoteError&) {
      throw;
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kUnauthenticated) throw;
      CheckPs(int(index), e.message());
      CheckHealth();
      return calls_[index]->Call(op, body);  // the ps answers pings: one more try
    }
  }

  PsVariable CreateVariable(const std::string& name, std::vector<size_t> shape,
                            const Initializer& init) {
    std::lock_guard<std::mutex> create_lock(create_mutex_);  // one creation at a time
    CheckHealth();
    if (name.empty()) ps::Invalid("CreateVariable: an empty name");
    if (!init) ps::Invalid("CreateVariable('" + name + "'): no initializer");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const PsVariable& v : layout_.variables) {
        if (v.name == name) ps::Invalid("CreateVariable: a variable '" + name + "' exists");
      }
    }
    PsVariable v;
    v.name = name;
    v.shape = shape;
    v.count = 1;
    for (size_t d : shape) v.count *= d;
    std::vector<float> value(v.count, 0.0f);
    init(value);
    // Rows along the first dimension; a scalar is one row.
    const size_t rows = shape.empty() ? 1 : shape[0];
    const size_t row_count = rows == 0 ? 0 : v.count / rows;
    size_t shards = 1;
    const Partitioner& p = options_.partitioner;
    if (p.fixed_shards > 1) shards = std::max(shards, size_t(p.fixed_shards));
    if (p.max_shard_bytes > 0) {
      const size_t row_bytes = std::max<size_t>(row_count * sizeof(float), 1);
      const size_t rows_per_shard = std::max<size_t>(p.max_shard_bytes / row_bytes, 1);
      shards = std::max(shards, (rows + rows_per_shard - 1) / rows_per_shard);
    }
    shards = std::max<size_t>(1, std::min(shards, rows));
    const size_t num_ps = calls_.size();
    size_t row = 0;
    for (size_t k = 0; k < shards; ++k) {
      const size_t these = rows / shards + (k < rows % shards ? 1 : 0);
      PsShard s;
      s.ps_index = static_cast<int>((next_ps_ + k) % num_ps);
      s.offset = row * row_count;
      s.count = these * row_count;
      row += these;
      v.shards.push_back(s);
    }
    if (rows == 0) v.shards[0].count = 0;
    next_ps_ = (next_ps_ + shards) % num_ps;
    for (const PsShard& s : v.shards) {
      ps::Out out;
      out.Str(ps::ShardKey(v, s));
      optimizer_.Write(out);
      out.Floats(value.data() + s.offset, s.count);
      Call(size_t(s.ps_index), ps::Op::kCreateShard, out.bytes());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    layout_.variables.push_back(std::move(v));
    return layout_.variables.back();
  }

  PsVariable Find(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const PsVariable& v : layout_.variables) {
      if (v.name == name) return v;
    }
    ps::Invalid("ParameterServerStrategy: no variable '" + name + "'");
  }

  // Every shard's value, slots and update count, variable by variable.
  struct VariableState {
    std::vector<float> value;
    std::vector<std::vector<float>> slots;
    int64_t updates = 0;
  };
  VariableState GetState(const PsVariable& v) {
    VariableState out;
    out.value.resize(v.count);
    out.slots.assign(optimizer_.num_slots(), std::vector<float>(v.count, 0.0f));
    for (const PsShard& s : v.shards) {
      ps::Out request;
      request.U32(1);
      request.Str(ps::ShardKey(v, s));
      const std::vector<uint8_t> reply = Call(size_t(s.ps_index), ps::Op::kGetShards,
                                              request.bytes());
      ps::In in(reply);
      in.FloatsInto(out.value.data() + s.offset, s.count);
      const uint32_t slots = in.U32();
      if (slots != out.slots.size()) {
        throw Error(ErrorCode::kInternal, "shard '" + ps::ShardKey(v, s) + "' has " +
                                              std::to_string(slots) + " slots");
      }
      for (auto& slot : out.slots) in.FloatsInto(slot.data() + s.offset, s.count);
      out.updates = std::max(out.updates, in.I64());
    }
    return out;
  }

  // The value alone: one request per shard, no slots.
  std::vector<float> ReadValue(const PsVariable& v) {
    std::vector<float> value(v.count);
    for (const PsShard& s : v.shards) {
      ps::Out request;
      request.U32(1);
      request.Str(ps::ShardKey(v, s));
      const std::vector<uint8_t> reply =
          Call(size_t(s.ps_index), ps::Op::kReadShards, request.bytes());
      ps::In in(reply);
      in.FloatsInto(value.data() + s.offset, s.count);
    }
    return value;
  }

  void SetState(const PsVariable& v, const VariableState& state) {
    for (const PsShard& s : v.shards) {
      ps::Out request;
      request.U32(1);
      request.Str(ps::ShardKey(v, s));
      request.Floats(state.value.data() + s.offset, s.count);
      request.U32(static_cast<uint32_t>(state.slots.size()));
      for (const auto& slot : state.slots) request.Floats(slot.data() + s.offset, s.count);
      request.I64(state.updates);
      Call(size_t(s.ps_index), ps::Op::kSetShards, request.bytes());
    }
  }

  int64_t Iterations() {
    CheckHealth();
    int64_t most = 0;
    std::lock_guard<std::mutex> ping_lock(ping_mutex_);
    for (size_t i = 0; i < pings_.size(); ++i) {
      try {
        Ping(i, Clock::now() + options_.ps_timeout);
      } catch (const ps::RemoteError&) {
        throw;
      } catch (const Error& e) {
        MarkLost(i, e.message());
        CheckHealth();
      }
      most = std::max(most, last_updates_[i]);
    }
    return most;
  }

  void StopServers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (watcher_.joinable()) watcher_.join();
    for (size_t i = 0; i < calls_.size(); ++i) {
      ps::Client stopper(cluster_.ps_addresses[i], calls_[i]->name(), ps::Kind::kPs,
                         cluster_.token, std::chrono::milliseconds(2000));
      try {
        stopper.Call(ps::Op::kStop, {});
      } catch (const Error&) {
      }
    }
  }

 private:
  // Pings ps `index` by `deadline`; records its answer. Throws on failure.
  std::vector<uint8_t> Ping(size_t index, Clock::time_point deadline) {
    std::vector<uint8_t> reply = pings_[index]->Call(ps::Op::kPing, {}, deadline);
    ps::In in(reply);
    const uint64_t incarnation = in.U64();
    const int64_t updates = in.I64();
    if (last_updates_.size() != pings_.size()) last_updates_.assign(pings_.size(), 0);
    if (incarnations_[index] == 0) {
      incarnations_[index] = incarnation;
    } else if (incarnations_[index] != incarnation) {
      MarkLost(index, "it was restarted, and its variables with it");
      CheckHealth();
    }
    last_updates_[index] = updates;
    last_answer_[index] = Clock::now();
    return reply;
  }

  void MarkLost(size_t index, const std::string& why) {
    std::lock_guard<std::mutex> calling(listeners_mutex_);
    std::vector<std::function<void(const Error&)>> listeners;
    Error error(ErrorCode::kPeerLost, "");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_ || stopping_) return;
      broken_.emplace(ErrorCode::kPeerLost,
                      "parameter server " + pings_[index]->name() + " was lost: " + why +
                          ". Restart it, then start the coordinator again: it resumes from the "
                          "last checkpoint");
      error = *broken_;
      listeners = listeners_;
    }
    std::fprintf(stderr, "collectives: coordinator: %s\n", error.message().c_str());
    cv_.notify_all();
    for (auto& listener : listeners) listener(error);
  }

  void Watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_ && !broken_) {
      cv_.wait_for(lock, options_.heartbeat_interval);
      if (stopping_ || broken_) break;
      lock.unlock();
      {
        std::lock_guard<std::mutex> ping_lock(ping_mutex_);
        for (size_t i = 0; i < pings_.size(); ++i) {
          const Clock::time_point deadline =
              std::max(last_answer_[i] + options_.ps_timeout,
                       Clock::now() + std::chrono::milliseconds(50));
          try {
            Ping(i, deadline);
          } catch (const ps::RemoteError& e) {
            MarkLost(i, e.message());
          } catch (const Error& e) {
            if (e.code() == ErrorCode::kUnauthenticated ||
                Clock::now() >= last_answer_[i] + options_.ps_timeout) {
              MarkLost(i, "no answer for " + std::to_string(options_.ps_timeout.count()) +
                              " ms: " + e.message());
            }
          }
        }
      }
      lock.lock();
    }
  }

  const ParameterServerOptions options_;
  const ps::ResolvedCluster cluster_;
  const ps::OptimizerConfig optimizer_;
  std::vector<std::unique_ptr<ps::Client>> calls_;  // the coordinator's requests
  std::vector<std::unique_ptr<ps::Client>> pings_;  // the heartbeat's (under ping_mutex_)
  std::mutex ping_mutex_;
  std::vector<uint64_t> incarnations_;
  std::vector<int64_t> last_updates_;
  std::vector<Clock::time_point> last_answer_;
  std::mutex create_mutex_;
  size_t next_ps_ = 0;  // under create_mutex_
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  ps::Layout layout_;
  std::optional<Error> broken_;
  std::vector<std::function<void(const Error&)>> listeners_;
  std::mutex listeners_mutex_;  // held while listeners run (before mutex_)
  bool stopping_ = false;
  std::thread watcher_;
};

ParameterServerStrategy::ParameterServerStrategy(ParameterServerOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
ParameterServerStrategy::~ParameterServerStrategy() = default;

const std::string& ParameterServerStrategy::name() const {
  static const std::string kName = "parameter_server";
  return kName;
}
int ParameterServerStrategy::num_ps() const {
  return static_cast<int>(impl_->cluster().ps_addresses.size());
}
int ParameterServerStrategy::num_workers() const {
  return static_cast<int>(impl_->cluster().worker_addresses.size());
}
const ParameterServerOptions& ParameterServerStrategy::options() const {
  return impl_->options();
}
PsVariable ParameterServerStrategy::CreateVariable(const std::string& name,
                                                   std::vector<size_t> shape,
                                                   const Initializer& init) {
  return impl_->CreateVariable(name, std::move(shape), init);
}
std::vector<PsVariable> ParameterServerStrategy::variables() const {
  return impl_->variables();
}
std::vector<float> ParameterServerStrategy::Read(const std::string& name) {
  impl_->CheckHealth();
  return impl_->ReadValue(impl_->Find(name));
}
void ParameterServerStrategy::Assign(const std::string& name, std::span<const float> value) {
  impl_->CheckHealth();
  const PsVariable v = impl_->Find(name);
  if (value.size() != v.count) {
    ps::Invalid("Assign('" + name + "'): " + std::to_string(value.size()) + " values for " +
                std::to_string(v.count));
  }
  Impl::VariableState state = impl_->GetState(v);
  state.value.assign(value.begin(), value.end());
  impl_->SetState(v, state);
}
int64_t ParameterServerStrategy::iterations() { return impl_->Iterations(); }

void ParameterServerStrategy::SaveCheckpoint(const std::string& directory, TrainingState state) {
  impl_->CheckHealth();
  ps::CheckpointValues c;
  c.variables = impl_->variables();
  c.optimizer = impl_->optimizer().name();
  c.slot_names = impl_->optimizer().slot_names();
  c.state = state;
  for (const PsVariable& v : c.variables) {
    Impl::VariableState s = impl_->GetState(v);
    c.values.push_back(std::move(s.value));
    c.slots.push_back(std::move(s.slots));
    c.iterations = std::max(c.iterations, s.updates);
  }
  ps::WriteCheckpoint(directory, c);
}

std::optional<TrainingState> ParameterServerStrategy::RestoreCheckpoint(
    const std::string& directory) {
  impl_->CheckHealth();
  ps::CheckpointValues c;
  c.variables = impl_->variables();
  c.optimizer = impl_->optimizer().name();
  c.slot_names = impl_->optimizer().slot_names();
  if (!ps::ReadCheckpoint(directory, &c)) return std::nullopt;
  for (size_t i = 0; i < c.variables.size(); ++i) {
    Impl::VariableState s{std::move(c.values[i]), std::move(c.slots[i]), c.iterations};
    impl_->SetState(c.variables[i], s);
  }
  return c.state;
}

void ParameterServerStrategy::CheckHealth() const { impl_->CheckHealth(); }

// ---- RemoteValue ----

struct RemoteValue::State {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::string result;
  std::optional<Error> error;

  bool IsDone() {
    std::lock_guard<std::mutex> lock(mutex);
    return done;
  }
  // False when it was done already.
  bool Finish(std::string value, std::optional<Error> failure) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (done) return false;
      done = true;
      result = std::move(value);
      error = std::move(failure);
    }
    cv.notify_all();
    return true;
  }
};

RemoteValue::RemoteValue() = default;

std::string RemoteValue::Fetch(std::chrono::milliseconds timeout) const {
  if (!state_) throw Error(ErrorCode::kInvalidUsage, "RemoteValue::Fetch on an empty value");
  std::unique_lock<std::mutex> lock(state_->mutex);
  const auto done = [this] { return state_->done; };
  if (timeout == std::chrono::milliseconds::max()) {
    state_->cv.wait(lock, done);
  } else if (!state_->cv.wait_for(lock, timeout, done)) {
    throw Error(ErrorCode::kTimeout, "RemoteValue::Fetch: the step did not finish within " +
                                         std::to_string(timeout.count()) + " ms");
  }
  if (state_->error) throw *state_->error;
  return state_->result;
}

bool RemoteValue::Done() const {
  if (!state_) return false;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

// ---- ClusterCoordinator ----

class ClusterCoordinator::Impl {
 public:
  explicit Impl(ParameterServerStrategy& strategy)
      : strategy_(strategy), s_(strategy.impl()), options_(s_.options()) {
    const ps::ResolvedCluster& cluster = s_.cluster();
    const size_t n = cluster.worker_addresses.size();
    workers_.resize(n);
    for (size_t w = 0; w < n; ++w) {
      workers_[w].client = std::make_unique<ps::Client>(
          cluster.worker_addresses[w],
          "worker " + std::to_string(w) + " at " + cluster.worker_addresses[w],
          ps::Kind::kWorker, cluster.token, options_.request_timeout);
    }
    no_worker_since_ = Clock::now();
    s_.OnBroken([this](const Error& e) { FailAll(e); });
    for (size_t w = 0; w < n; ++w) workers_[w].thread = std::thread([this, w] { Dispatch(w); });
  }

  ~Impl() {
    s_.ClearListeners();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (Worker& w : workers_) w.client->Interrupt();
    for (Worker& w : workers_) {
      if (w.thread.joinable()) w.thread.join();
    }
    FailAll(Error(ErrorCode::kAborted, "the coordinator was destroyed before the step ran"));
  }

  ParameterServerStrategy& strategy() const { return strategy_; }

  RemoteValue Schedule(const std::string& function, std::string args) {
    s_.CheckHealth();
    if (function.empty()) ps::Invalid("Schedule: an empty function name");
    auto closure = std::make_shared<Closure>();
    closure->function = function;
    closure->args = std::move(args);
    closure->value = std::make_shared<RemoteValue::State>();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) throw Error(ErrorCode::kInvalidUsage, "Schedule after StopServers");
      queue_.push_back(closure);
      ++outstanding_;
    }
    cv_.notify_all();
    return RemoteValue(closure->value);
  }

  void Join(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto done = [this] { return outstanding_ == 0 || broken_.has_value(); };
    if (timeout == std::chrono::milliseconds::max()) {
      cv_.wait(lock, done);
    } else if (!cv_.wait_for(lock, timeout, done)) {
      throw Error(ErrorCode::kTimeout, "ClusterCoordinator::Join: " +
                                           std::to_string(outstanding_) +
                                           " steps had not finished within " +
                                           std::to_string(timeout.count()) + " ms");
    }
    if (broken_) throw *broken_;
    if (first_error_) {
      Error e = *first_error_;
      first_error_.reset();
      throw e;
    }
  }

  bool Done() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return outstanding_ == 0;
  }

  PerWorkerDataset CreatePerWorkerDataset(const std::string& function, std::string args,
                                          std::string name) {
    s_.CheckHealth();
    if (name.empty()) name = function;
    size_t count;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      datasets_.push_back(Dataset{name, function, std::move(args)});
      count = datasets_.size();
      dataset_error_.reset();
    }
    cv_.notify_all();
    std::unique_lock<std::mutex> lock(mutex_);
    const auto made = [&] {
      if (broken_ || dataset_error_) return true;
      for (const Worker& w : workers_) {
        if (w.connected && w.datasets_made < count) return false;
      }
      return true;
    };
    if (!cv_.wait_for(lock, options_.connect_timeout, made)) {
      throw Error(ErrorCode::kTimeout, "CreatePerWorkerDataset('" + name +
                                           "'): not every worker made it within " +
                                           std::to_string(options_.connect_timeout.count()) +
                                           " ms");
    }
    if (broken_) throw *broken_;
    if (dataset_error_) throw *dataset_error_;
    return PerWorkerDataset(name);
  }

  int num_available_workers() const {
    std::lock_guard<std::mutex> lock(mutex_);
    int n = 0;
    for (const Worker& w : workers_) n += w.connected ? 1 : 0;
    return n;
  }

  int64_t rescheduled_steps() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return rescheduled_;
  }

  void StopServers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (Worker& w : workers_) w.client->Interrupt();
    for (Worker& w : workers_) {
      if (w.thread.joinable()) w.thread.join();
    }
    const ps::ResolvedCluster& cluster = s_.cluster();
    for (size_t w = 0; w < workers_.size(); ++w) {
      ps::Client stopper(cluster.worker_addresses[w], workers_[w].client->name(),
                         ps::Kind::kWorker, cluster.token, std::chrono::milliseconds(2000));
      try {
        stopper.Call(ps::Op::kStop, {});
      } catch (const Error&) {
      }
    }
    s_.StopServers();
  }

 private:
  struct Closure {
    std::string function;
    std::string args;
    std::shared_ptr<RemoteValue::State> value;
    int ps_retries = 0;
    int attempts = 0;  // workers lost while running it
  };
  struct Dataset {
    std::string name;
    std::string function;
    std::string args;
  };
  struct Worker {
    std::unique_ptr<ps::Client> client;
    std::thread thread;
    bool connected = false;     // under mutex_
    size_t datasets_made = 0;   // under mutex_
    std::shared_ptr<Closure> running;  // under mutex_
  };

  void Finish(const std::shared_ptr<Closure>& c, std::string result, std::optional<Error> error) {
    if (!c->value->Finish(std::move(result), error)) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --outstanding_;
      if (error && !first_error_) first_error_ = error;
    }
    cv_.notify_all();
  }

  // Fails every closure not finished yet (queued or running) with `e`.
  void FailAll(const Error& e) {
    std::vector<std::shared_ptr<Closure>> victims;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (e.code() == ErrorCode::kPeerLost && !broken_) broken_ = e;
      victims.assign(queue_.begin(), queue_.end());
      queue_.clear();
      for (Worker& w : workers_) {
        if (w.running) victims.push_back(w.running);
      }
    }
    for (auto& c : victims) {
      if (c->value->Finish("", e)) {
        std::lock_guard<std::mutex> lock(mutex_);
        --outstanding_;
      }
    }
    cv_.notify_all();
  }

  void SetConnected(size_t w, bool connected) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      workers_[w].connected = connected;
      if (connected) workers_[w].datasets_made = 0;
      bool any = false;
      for (const Worker& x : workers_) any = any || x.connected;
      if (!any && connected == false) no_worker_since_ = Clock::now();
    }
    cv_.notify_all();
  }

  // No worker for no_worker_timeout: fail what waits.
  void CheckNoWorker() {
    std::vector<std::shared_ptr<Closure>> victims;
    std::string message;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Worker& x : workers_) {
        if (x.connected) return;
      }
      if (queue_.empty() || Clock::now() - no_worker_since_ < options_.no_worker_timeout) return;
      victims.assign(queue_.begin(), queue_.end());
      queue_.clear();
      message = "no worker has been reachable for " +
                std::to_string(options_.no_worker_timeout.count()) + " ms (" +
                ps::Joined(s_.cluster().worker_addresses) + ")";
    }
    for (auto& c : victims) Finish(c, "", Error(ErrorCode::kPeerLost, message));
  }

  void Dispatch(size_t w) {
    Worker& worker = workers_[w];
    bool logged_unreachable = false;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) return;
      }
      if (!worker.connected) {
        std::string why;
        bool ok = false;
        try {
          ok = worker.client->EnsureConnected(
              Clock::now() + std::max(options_.reconnect_interval, std::chrono::milliseconds(1000)),
              &why);
        } catch (const Error& e) {
          why = e.message();
        }
        if (!ok) {
          if (!logged_unreachable && was_connected_once(w)) {
            std::fprintf(stderr, "collectives: coordinator: %s is unreachable (%s); retrying\n",
                         worker.client->name().c_str(), why.c_str());
            logged_unreachable = true;
          }
          CheckNoWorker();
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait_for(lock, options_.reconnect_interval, [this] { return stopping_; });
          continue;
        }
        logged_unreachable = false;
        MarkConnectedOnce(w);
        SetConnected(w, true);
      }
      // The per-worker datasets it lacks.
      std::optional<Dataset> dataset;
      std::shared_ptr<Closure> closure;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait_for(lock, std::chrono::milliseconds(200), [&] {
          return stopping_ || worker.datasets_made < datasets_.size() || !queue_.empty();
        });
        if (stopping_) return;
        if (worker.datasets_made < datasets_.size()) {
          dataset = datasets_[worker.datasets_made];
        } else if (!queue_.empty() && !broken_) {
          closure = queue_.front();
          queue_.pop_front();
          worker.running = closure;
        } else {
          continue;
        }
      }
      if (dataset) {
        MakeDataset(w, *dataset);
        continue;
      }
      RunStep(w, closure);
    }
  }

  void MakeDataset(size_t w, const Dataset& d) {
    Worker& worker = workers_[w];
    ps::Out body;
    s_.layout().Write(body);
    body.Str(d.name);
    body.Str(d.function);
    body.Str(d.args);
    try {
      worker.client->Call(ps::Op::kCreateDataset, body.bytes(),
                          Clock::now() + options_.connect_timeout);
    } catch (const ps::RemoteError& e) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!dataset_error_) dataset_error_ = Error(e.code(), e.message());
    } catch (const Error& e) {
      Lost(w, e);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++worker.datasets_made;
    }
    cv_.notify_all();
  }

  void RunStep(size_t w, const std::shared_ptr<Closure>& c) {
    Worker& worker = workers_[w];
    ps::Out body;
    s_.layout().Write(body);
    body.Str(c->function);
    body.Str(c->args);
    const auto done_running = [&] {
      std::lock_guard<std::mutex> lock(mutex_);
      worker.running.reset();
    };
    try {
      std::vector<uint8_t> reply = worker.client->Call(ps::Op::kRunFunction, body.bytes(),
                                                       Clock::now() + options_.step_timeout);
      done_running();
      ps::In in(reply);
      Finish(c, in.Str(), std::nullopt);
    } catch (const ps::RemoteError& e) {
      done_running();
      if (e.lost_ps() >= 0) {
        s_.CheckPs(e.lost_ps(), e.message());
        if (std::optional<Error> broken = s_.broken()) {
          Finish(c, "", *broken);
          return;
        }
        if (++c->ps_retries < 3) {
          Requeue(c, false);
          return;
        }
      }
      Finish(c, "", Error(e.code(), e.message()));
    } catch (const Error& e) {
      done_running();
      Lost(w, e);
      if (c->value->IsDone()) return;  // failed by FailAll meanwhile
      if (++c->attempts >= std::max(options_.max_step_attempts, 1)) {
        Finish(c, "",
               Error(ErrorCode::kPeerLost,
                     "step '" + c->function + "' was given to " + std::to_string(c->attempts) +
                         " workers and each was lost while running it; the last: " +
                         e.message()));
        return;
      }
      Requeue(c, true);
    }
  }

  void Requeue(const std::shared_ptr<Closure>& c, bool counted) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) {
        // The destructor fails it.
      }
      queue_.push_front(c);
      if (counted) ++rescheduled_;
    }
    cv_.notify_all();
  }

  void Lost(size_t w, const Error& e) {
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping = stopping_;
    }
    if (!stopping) {
      std::fprintf(stderr,
                   "collectives: coordinator: lost %s (%s); its step runs again on another "
                   "worker, and it gets steps again once it is back\n",
                   workers_[w].client->name().c_str(), e.message().c_str());
    }
    SetConnected(w, false);
  }

  bool was_connected_once(size_t w) {
    std::lock_guard<std::mutex> lock(mutex_);
    return connected_once_.count(w) > 0;
  }
  void MarkConnectedOnce(size_t w) {
    std::lock_guard<std::mutex> lock(mutex_);
    connected_once_.insert(w);
  }

  ParameterServerStrategy& strategy_;
  ParameterServerStrategy::Impl& s_;
  const ParameterServerOptions& options_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Worker> workers_;
  std::deque<std::shared_ptr<Closure>> queue_;
  std::vector<Dataset> datasets_;
  std::optional<Error> dataset_error_;
  std::optional<Error> first_error_;
  std::optional<Error> broken_;
  std::set<size_t> connected_once_;
  int64_t outstanding_ = 0;
  int64_t rescheduled_ = 0;
  Clock::time_point no_worker_since_;
  bool stopping_ = false;
};

ClusterCoordinator::ClusterCoordinator(ParameterServerStrategy& strategy)
    : impl_(std::make_unique<Impl>(strategy)) {}
ClusterCoordinator::~ClusterCoordinator() = default;
ParameterServerStrategy& ClusterCoordinator::strategy() const { return impl_->strategy(); }
RemoteValue ClusterCoordinator::Schedule(const std::string& function, std::string args) {
  return impl_->Schedule(function, std::move(args));
}
void ClusterCoordinator::Join(std::chrono::milliseconds timeout) { impl_->Join(timeout); }
bool ClusterCoordinator::Done() const { return impl_->Done(); }
PerWorkerDataset ClusterCoordinator::CreatePerWorkerDataset(const std::string& function,
                                                            std::string args, std::string name) {
  return impl_->CreatePerWorkerDataset(function, std::move(args), std::move(name));
}
int ClusterCoordinator::num_available_workers() const { return impl_->num_available_workers(); }
int64_t ClusterCoordinator::rescheduled_steps() const { return impl_->rescheduled_steps(); }
void ClusterCoordinator::StopServers() { impl_->StopServers(); }

}  // namespace collectives::strategy
