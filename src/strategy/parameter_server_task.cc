// The "ps" and "worker" servers of parameter-server training (parameter_server.h): the function
// registry, the server loop (listener, one thread per connection, the job-token handshake first),
// a parameter server's shards and optimizer, and a worker's step context.
//
// A parameter server keeps each shard (a row range of one variable) with its optimizer slots and
// update count behind a mutex of its own: a read copies a whole shard under it, a push applies
// the whole update under it, so a reader never sees half an update and two pushes to one shard
// never interleave, while pushes to different shards (from different workers) run in parallel.
// A worker runs each step on the thread of the coordinator's connection: one step at a time per
// coordinator. Its connections to the parameter servers are shared by those threads (a call
// holds one connection for its exchange).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <list>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "collectives/errors.h"
#include "collectives/parameter_server.h"
#include "src/strategy/parameter_server_internal.h"
#include "src/strategy/parameter_server_wire.h"

namespace collectives::strategy {

WorkerContext::~WorkerContext() = default;
Server::~Server() = default;

namespace ps {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, StepFunction> steps;
  std::map<std::string, DatasetFunction> datasets;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;  // never destroyed: servers may outlive statics
  return *registry;
}

uint64_t RandomIncarnation() {
  std::random_device device;
  return (uint64_t(device()) << 32) ^ device() ^ uint64_t(::getpid());
}

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

// ---- The server loop ----

using Handler = std::function<std::vector<uint8_t>(Op op, In& body)>;

// Connections a server keeps at once (each has a thread): coordinators, workers' pools, and
// peers still in the handshake, which get 10 s. Beyond it a new connection is closed at once.
constexpr size_t kMaxConnections = 512;

class TaskServer final : public Server {
 public:
  TaskServer(Kind kind, int index, const std::string& address, std::string token,
             std::chrono::milliseconds request_timeout)
      : kind_(kind),
        who_(std::string(KindName(kind)) + " " + std::to_string(index)),
        token_(std::move(token)),
        request_timeout_(request_timeout),
        listener_(Listen(address, &port_)) {}

  ~TaskServer() override { Stop(); }

  void Start(Handler handler) {
    handler_ = std::move(handler);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }

  uint16_t port() const override { return port_; }

  bool Wait(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto done = [this] { return stop_requested_; };
    if (timeout == std::chrono::milliseconds::max()) {
      cv_.wait(lock, done);
      return true;
    }
    return cv_.wait_for(lock, timeout, done);
  }

  void Stop() override {
    RequestStop();
    std::list<Connection> connections;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) return;
      stopped_ = true;
      for (Connection& c : connections_) c.socket->Shutdown();
    }
    if (acceptor_.joinable()) acceptor_.join();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (Connection& c : connections_) c.socket->Shutdown();
      connections.splice(connections.end(), connections_);
    }
    for (Connection& c : connections) c.thread.join();
    listener_.Close();
  }

  const std::string& who() const { return who_; }

 private:
  struct Connection {
    std::shared_ptr<Socket> socket;
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };

  void RequestStop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_requested_ = true;
    cv_.notify_all();
  }

  bool stopping() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stopped_ || stop_requested_;
  }

  void AcceptLoop() {
    while (!stopping()) {
      std::string ignored;
      pollfd p{listener_.fd(), POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) {
        Reap();
        continue;
      }
      const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) continue;
      const int one = 1;  // replies go out as header and body: no Nagle delay between them
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      auto socket = std::make_shared<Socket>(fd);
      auto done = std::make_shared<std::atomic<bool>>(false);
      Reap();
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopped_) break;  // `socket` closes
      if (connections_.size() >= kMaxConnections) {
        std::fprintf(stderr, "collectives: %s refused a connection from %s: %zu are open\n",
                     who_.c_str(), socket->PeerName().c_str(), connections_.size());
        continue;  // `socket` closes
      }
      connections_.push_back(Connection{socket, std::thread(), done});
      connections_.back().thread = std::thread([this, socket, done] {
        Serve(*socket);
        socket->Shutdown();
        done->store(true);
      });
    }
  }

  // Joins the threads of connections that ended.
  void Reap() {
    std::list<Connection> ended;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (it->done->load()) {
          ended.push_back(std::move(*it));
          it = connections_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Connection& c : ended) c.thread.join();
  }

  void Serve(Socket& socket) {
    std::string why;
    const std::string peer = socket.PeerName();
    // A stranger gets 10 s to prove the token, then nothing.
    if (!ServerHandshake(socket, token_, kind_, Clock::now() + std::chrono::seconds(10), &why)) {
      // A peer that hangs up during the handshake (a coordinator stopping) asked for nothing.
      if (why.find("closed") != std::string::npos || stopping()) return;
      std::fprintf(stderr, "collectives: %s refused a connection from %s: %s\n", who_.c_str(),
                   peer.c_str(), why.c_str());
      return;
    }
    for (;;) {
      uint8_t code = 0;
      std::vector<uint8_t> request;
      if (!ReceiveFrame(socket, &code, &request, Clock::time_point::max(), &why)) {
        if (why.find("closed") == std::string::npos && !stopping()) {
          std::fprintf(stderr, "collectives: %s dropped the connection from %s: %s\n",
                       who_.c_str(), peer.c_str(), why.c_str());
        }
        return;
      }
      const Op op = static_cast<Op>(code);
      uint8_t status = static_cast<uint8_t>(Status::kOk);
      std::vector<uint8_t> reply;
      try {
        In in(request);
        if (op == Op::kStop) {
          RequestStop();
        } else {
          reply = handler_(op, in);
        }
      } catch (const RemoteError& e) {
        status = static_cast<uint8_t>(Status::kError);
        reply = ErrorBody(e.code(), e.lost_ps(), e.message());
      } catch (const Error& e) {
        status = static_cast<uint8_t>(Status::kError);
        reply = ErrorBody(e.code(), -1, e.message());
      } catch (const std::exception& e) {
        status = static_cast<uint8_t>(Status::kError);
        reply = ErrorBody(ErrorCode::kInternal, -1, who_ + ": " + e.what());
      } catch (...) {
        status = static_cast<uint8_t>(Status::kError);
        reply = ErrorBody(ErrorCode::kInternal, -1, who_ + ": an exception of unknown type");
      }
      if (!SendFrame(socket, status, reply, Clock::now() + request_timeout_, &why)) return;
    }
  }

  const Kind kind_;
  const std::string who_;
  const std::string token_;
  const std::chrono::milliseconds request_timeout_;
  uint16_t port_ = 0;
  Socket listener_;
  Handler handler_;
  std::thread acceptor_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_requested_ = false;
  bool stopped_ = false;
  std::list<Connection> connections_;
};

// ---- A parameter server ----

struct Shard {
  std::mutex mutex;
  OptimizerConfig optimizer;
  std::vector<float> value;
  std::vector<std::vector<float>> slots;
  int64_t updates = 0;
};

// Keras' SGD and Adam, as Sgd::Update and Adam::Update in optimizer.cc (step counts from 1),
// at the schedule's rate for the updates before this one. The caller holds the shard's lock, so
// the count this reads and advances is the one the update is made with.
void ApplyUpdate(Shard& s, const float* g) {
  const size_t n = s.value.size();
  float* w = s.value.data();
  const OptimizerConfig& o = s.optimizer;
  const int64_t step = ++s.updates;
  const double rate = o.LearningRate(step - 1);
  if (o.kind == OptimizerConfig::kSgd) {
    const float lr = static_cast<float>(rate);
    if (s.slots.empty()) {
      for (size_t i = 0; i < n; ++i) w[i] -= lr * g[i];
      return;
    }
    float* v = s.slots[0].data();
    for (size_t i = 0; i < n; ++i) {
      v[i] = o.momentum * v[i] - lr * g[i];
      w[i] += o.nesterov ? o.momentum * v[i] - lr * g[i] : v[i];
    }
    return;
  }
  const double t = static_cast<double>(step);
  const float lr_t = static_cast<float>(rate * std::sqrt(1.0 - std::pow(double(o.beta_2), t)) /
                                        (1.0 - std::pow(double(o.beta_1), t)));
  float* m = s.slots[0].data();
  float* v = s.slots[1].data();
  const float b1 = o.beta_1, b2 = o.beta_2, eps = o.epsilon;
  for (size_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    w[i] -= lr_t * m[i] / (std::sqrt(v[i]) + eps);
  }
}

class ParameterServerState {
 public:
  explicit ParameterServerState(std::string who) : who_(std::move(who)) {}

  std::vector<uint8_t> Handle(Op op, In& in) {
    Out out;
    switch (op) {
      case Op::kPing: {
        out.U64(incarnation_);
        int64_t most = 0;
        std::lock_guard<std::mutex> lock(mutex_);
        for (auto& [key, shard] : shards_) {
          std::lock_guard<std::mutex> shard_lock(shard->mutex);
          most = std::max(most, shard->updates);
        }
        out.I64(most);
        break;
      }
      case Op::kCreateShard: {
        auto shard = std::make_shared<Shard>();
        const std::string key = in.Str();
        shard->optimizer = OptimizerConfig::Read(in);
        shard->value = in.Floats();
        shard->slots.assign(shard->optimizer.num_slots(),
                            std::vector<float>(shard->value.size(), 0.0f));
        std::lock_guard<std::mutex> lock(mutex_);
        shards_[key] = std::move(shard);
        break;
      }
      case Op::kReadShards: {
        const uint32_t n = in.U32();
        for (uint32_t i = 0; i < n; ++i) {
          std::shared_ptr<Shard> shard = Find(in.Str());
          std::lock_guard<std::mutex> lock(shard->mutex);
          out.Floats(shard->value);
        }
        break;
      }
      case Op::kPushGradients: {
        const uint32_t n = in.U32();
        for (uint32_t i = 0; i < n; ++i) {
          const std::string key = in.Str();
          std::shared_ptr<Shard> shard = Find(key);
          const uint64_t count = in.U64();
          if (count != shard->value.size() || count > in.remaining() / sizeof(float)) {
            Invalid(who_ + ": a gradient of " + std::to_string(count) + " values for shard '" +
                    key + "' of " + std::to_string(shard->value.size()));
          }
          std::vector<float> gradient(count);
          in.Raw(gradient.data(), count * sizeof(float));
          std::lock_guard<std::mutex> lock(shard->mutex);
          ApplyUpdate(*shard, gradient.data());
        }
        break;
      }
      case Op::kGetShards: {
        const uint32_t n = in.U32();
        for (uint32_t i = 0; i < n; ++i) {
          std::shared_ptr<Shard> shard = Find(in.Str());
          std::lock_guard<std::mutex> lock(shard->mutex);
          out.Floats(shard->value);
          out.U32(static_cast<uint32_t>(shard->slots.size()));
          for (const std::vector<float>& slot : shard->slots) out.Floats(slot);
          out.I64(shard->updates);
        }
        break;
      }
      case Op::kSetShards: {
        const uint32_t n = in.U32();
        for (uint32_t i = 0; i < n; ++i) {
          const std::string key = in.Str();
          std::shared_ptr<Shard> shard = Find(key);
          std::vector<float> value = in.Floats();
          const uint32_t num_slots = in.U32();
          std::vector<std::vector<float>> slots;
          for (uint32_t s = 0; s < num_slots; ++s) slots.push_back(in.Floats());
          const int64_t updates = in.I64();
          std::lock_guard<std::mutex> lock(shard->mutex);
          bool fits = value.size() == shard->value.size() && slots.size() == shard->slots.size();
          for (const auto& slot : slots) fits = fits && slot.size() == value.size();
          if (!fits) Invalid(who_ + ": new state of shard '" + key + "' does not fit it");
          shard->value = std::move(value);
          shard->slots = std::move(slots);
          shard->updates = updates;
        }
        break;
      }
      default:
        Invalid(who_ + ": request " + std::to_string(int(op)) + " is not one a ps serves");
    }
    return std::move(out.bytes());
  }

 private:
  std::shared_ptr<Shard> Find(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = shards_.find(key);
    if (it == shards_.end()) {
      Invalid(who_ + " holds no variable shard '" + key +
              "' (the coordinator creates the variables; was this ps restarted?)");
    }
    return it->second;
  }

  const std::string who_;
  const uint64_t incarnation_ = RandomIncarnation();
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<Shard>> shards_;
};

// ---- A worker ----

class WorkerState;

class WorkerContextImpl final : public WorkerContext {
 public:
  WorkerContextImpl(WorkerState& worker, Layout layout) : worker_(worker), layout_(std::move(layout)) {}
  int worker_index() const override;
  int num_workers() const override { return static_cast<int>(layout_.worker_addresses.size()); }
  const std::vector<PsVariable>& variables() const override { return layout_.variables; }
  std::vector<float> Read(const std::string& name) override { return Read(std::vector{name})[0]; }
  std::vector<std::vector<float>> Read(const std::vector<std::string>& names) override;
  void PushGradients(
      const std::vector<std::pair<std::string, std::span<const float>>>& gradients) override;
  std::shared_ptr<void> PerWorkerObject(const std::string& name) override;

 private:
  const PsVariable& Find(const std::string& name) const {
    for (const PsVariable& v : layout_.variables) {
      if (v.name == name) return v;
    }
    Invalid("worker " + std::to_string(worker_index()) + ": no variable '" + name +
            "' was created by the coordinator");
  }
  // Sends one request to parameter server `ps`; a connection that fails is that ps lost.
  std::vector<uint8_t> CallPs(int ps, Op op, const std::vector<uint8_t>& body);

  WorkerState& worker_;
  Layout layout_;
};

class WorkerState {
 public:
  WorkerState(int index, std::string token, std::chrono::milliseconds request_timeout)
      : index_(index), token_(std::move(token)), request_timeout_(request_timeout) {}

  int index() const { return index_; }

  std::vector<uint8_t> Handle(Op op, In& in) {
    Out out;
    switch (op) {
      case Op::kPing:
        out.U64(incarnation_);
        out.I64(0);
        break;
      case Op::kRunFunction: {
        Layout layout = Layout::Read(in);
        const std::string function = in.Str();
        const std::string args = in.Str();
        StepFunction fn;
        {
          Registry& registry = GetRegistry();
          std::lock_guard<std::mutex> lock(registry.mutex);
          auto it = registry.steps.find(function);
          if (it == registry.steps.end()) {
            Invalid("worker " + std::to_string(index_) + ": no function '" + function +
                    "' is registered (RegisterFunction, in every task)");
          }
          fn = it->second;
        }
        WorkerContextImpl context(*this, std::move(layout));
        out.Str(fn(context, args));
        break;
      }
      case Op::kCreateDataset: {
        Layout layout = Layout::Read(in);
        const std::string name = in.Str();
        const std::string function = in.Str();
        const std::string args = in.Str();
        DatasetFunction fn;
        {
          Registry& registry = GetRegistry();
          std::lock_guard<std::mutex> lock(registry.mutex);
          auto it = registry.datasets.find(function);
          if (it == registry.datasets.end()) {
            Invalid("worker " + std::to_string(index_) + ": no dataset function '" + function +
                    "' is registered (RegisterDatasetFunction, in every task)");
          }
          fn = it->second;
        }
        WorkerContextImpl context(*this, std::move(layout));
        std::shared_ptr<void> object = fn(context, args);
        std::lock_guard<std::mutex> lock(mutex_);
        datasets_[name] = std::move(object);
        break;
      }
      default:
        Invalid("worker " + std::to_string(index_) + ": request " + std::to_string(int(op)) +
                " is not one a worker serves");
    }
    return std::move(out.bytes());
  }

  std::shared_ptr<void> Dataset(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = datasets_.find(name);
    if (it == datasets_.end()) {
      Invalid("worker " + std::to_string(index_) + ": no per-worker dataset '" + name +
              "' (ClusterCoordinator::CreatePerWorkerDataset makes it)");
    }
    return it->second;
  }

  // The client of the parameter server at `address` (shared by every step).
  std::shared_ptr<Client> PsClient(int ps, const std::string& address) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::shared_ptr<Client>>& pool = ps_clients_[address];
    for (const std::shared_ptr<Client>& c : pool) {
      if (c.use_count() == 1) return c;  // idle: only the pool holds it
    }
    pool.push_back(std::make_shared<Client>(address, PsName(ps, address), Kind::kPs, token_,
                                            request_timeout_));
    return pool.back();
  }

 private:
  const int index_;
  const std::string token_;
  const std::chrono::milliseconds request_timeout_;
  const uint64_t incarnation_ = RandomIncarnation();
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<void>> datasets_;
  std::map<std::string, std::vector<std::shared_ptr<Client>>> ps_clients_;
};

int WorkerContextImpl::worker_index() const { return worker_.index(); }

std::shared_ptr<void> WorkerContextImpl::PerWorkerObject(const std::string& name) {
  return worker_.Dataset(name);
}

std::vector<uint8_t> WorkerContextImpl::CallPs(int ps, Op op, const std::vector<uint8_t>& body) {
  if (ps < 0 || ps >= static_cast<int>(layout_.ps_addresses.size())) {
    Invalid("a shard on ps " + std::to_string(ps) + ", which the layout does not list");
  }
  std::shared_ptr<Client> client = worker_.PsClient(ps, layout_.ps_addresses[size_t(ps)]);
  try {
    return client->Call(op, body);
  } catch (const RemoteError&) {
    throw;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kUnauthenticated) throw;
    throw RemoteError(ErrorCode::kPeerLost,
                      "worker " + std::to_string(worker_index()) + ": " + e.message(), ps);
  }
}

std::vector<std::vector<float>> WorkerContextImpl::Read(const std::vector<std::string>& names) {
  std::vector<std::vector<float>> out(names.size());
  // Per ps: the (variable, shard) pairs it holds, in request order.
  std::map<int, std::vector<std::pair<size_t, const PsShard*>>> plan;
  for (size_t i = 0; i < names.size(); ++i) {
    const PsVariable& v = Find(names[i]);
    out[i].resize(v.count);
    for (const PsShard& s : v.shards) plan[s.ps_index].emplace_back(i, &s);
  }
  for (const auto& [ps, shards] : plan) {
    Out request;
    request.U32(static_cast<uint32_t>(shards.size()));
    for (const auto& [i, s] : shards) request.Str(ShardKey(Find(names[i]), *s));
    const std::vector<uint8_t> reply = CallPs(ps, Op::kReadShards, request.bytes());
    In in(reply);
    for (const auto& [i, s] : shards) in.FloatsInto(out[i].data() + s->offset, s->count);
  }
  return out;
}

void WorkerContextImpl::PushGradients(
    const std::vector<std::pair<std::string, std::span<const float>>>& gradients) {
  std::map<int, Out> requests;
  std::map<int, uint32_t> counts;
  for (const auto& [name, gradient] : gradients) {
    const PsVariable& v = Find(name);
    if (gradient.size() != v.count) {
      Invalid("worker " + std::to_string(worker_index()) + ": a gradient of " +
              std::to_string(gradient.size()) + " values for variable '" + name + "' of " +
              std::to_string(v.count));
    }
    for (const PsShard& s : v.shards) ++counts[s.ps_index];
  }
  for (const auto& [ps, n] : counts) requests[ps].U32(n);
  for (const auto& [name, gradient] : gradients) {
    const PsVariable& v = Find(name);
    for (const PsShard& s : v.shards) {
      Out& request = requests[s.ps_index];
      request.Str(ShardKey(v, s));
      request.Floats(gradient.data() + s.offset, s.count);
    }
  }
  for (auto& [ps, request] : requests) CallPs(ps, Op::kPushGradients, request.bytes());
}

// The server object handed out: a TaskServer with its state.
class ServerWithState final : public Server {
 public:
  ServerWithState(std::unique_ptr<TaskServer> server, std::shared_ptr<void> state)
      : state_(std::move(state)), server_(std::move(server)) {}
  ~ServerWithState() override { server_->Stop(); }
  uint16_t port() const override { return server_->port(); }
  bool Wait(std::chrono::milliseconds timeout) override { return server_->Wait(timeout); }
  void Stop() override { server_->Stop(); }

 private:
  std::shared_ptr<void> state_;  // outlives the server's threads
  std::unique_ptr<TaskServer> server_;
};

}  // namespace

std::string PsName(int index, const std::string& address) {
  return "ps " + std::to_string(index) + " at " + address;
}

std::string ShardKey(const PsVariable& variable, const PsShard& shard) {
  if (variable.shards.size() <= 1) return variable.name;
  for (size_t k = 0; k < variable.shards.size(); ++k) {
    if (&variable.shards[k] == &shard) return variable.name + "/part_" + std::to_string(k);
  }
  return variable.name + "/part_?";
}

}  // namespace ps

void RegisterFunction(const std::string& name, StepFunction fn) {
  if (name.empty() || !fn) ps::Invalid("RegisterFunction: an empty name or function");
  ps::Registry& registry = ps::GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.steps[name] = std::move(fn);
}

void RegisterDatasetFunction(const std::string& name, DatasetFunction fn) {
  if (name.empty() || !fn) ps::Invalid("RegisterDatasetFunction: an empty name or function");
  ps::Registry& registry = ps::GetRegistry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  registry.datasets[name] = std::move(fn);
}

std::unique_ptr<Server> StartServer(const ParameterServerOptions& options) {
  const ps::ResolvedCluster cluster = ps::ResolveCluster(options, true);
  if (cluster.task_type == "ps") {
    if (cluster.task_index < 0 || cluster.task_index >= int(cluster.ps_addresses.size())) {
      ps::Invalid("StartServer: ps " + std::to_string(cluster.task_index) + " has no address (" +
              std::to_string(cluster.ps_addresses.size()) + " ps in the cluster)");
    }
    auto state = std::make_shared<ps::ParameterServerState>("ps " +
                                                            std::to_string(cluster.task_index));
    auto server = std::make_unique<ps::TaskServer>(
        ps::Kind::kPs, cluster.task_index, cluster.ps_addresses[size_t(cluster.task_index)],
        cluster.token, options.request_timeout);
    server->Start([state](ps::Op op, ps::In& in) { return state->Handle(op, in); });
    return std::make_unique<ps::ServerWithState>(std::move(server), state);
  }
  if (cluster.task_type == "worker") {
    if (cluster.task_index < 0 || cluster.task_index >= int(cluster.worker_addresses.size())) {
      ps::Invalid("StartServer: worker " + std::to_string(cluster.task_index) + " has no address (" +
              std::to_string(cluster.worker_addresses.size()) + " workers in the cluster)");
    }
    auto state = std::make_shared<ps::WorkerState>(cluster.task_index, cluster.token,
                                                   options.request_timeout);
    auto server = std::make_unique<ps::TaskServer>(
        ps::Kind::kWorker, cluster.task_index,
        cluster.worker_addresses[size_t(cluster.task_index)], cluster.token,
        options.request_timeout);
    server->Start([state](ps::Op op, ps::In& in) { return state->Handle(op, in); });
    return std::make_unique<ps::ServerWithState>(std::move(server), state);
  }
  ps::Invalid("StartServer: task type '" + cluster.task_type +
          "' runs no server (\"ps\" and \"worker\" do; \"chief\" is the coordinator)");
}

void RunServer(const ParameterServerOptions& options) {
  std::unique_ptr<Server> server = StartServer(options);
  server->Wait();
}

}  // namespace collectives::strategy
