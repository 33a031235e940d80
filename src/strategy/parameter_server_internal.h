// What the coordinator and the servers of parameter-server training share: the cluster's
// addresses, the optimizer's configuration as the parameter servers receive it, and the
// variables' layout as the workers receive it with every request.
//
// Thread-safety: plain values and pure functions.
#ifndef COLLECTIVES_SRC_STRATEGY_PARAMETER_SERVER_INTERNAL_H_
#define COLLECTIVES_SRC_STRATEGY_PARAMETER_SERVER_INTERNAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/errors.h"
#include "collectives/parameter_server.h"
#include "src/strategy/parameter_server_wire.h"

namespace collectives::strategy::ps {

struct ResolvedCluster {
  std::vector<std::string> ps_addresses;
  std::vector<std::string> worker_addresses;
  std::string token;
  std::string task_type;
  int task_index = 0;
};

// The addresses (the options' lists, else the cluster spec's), the token (the options', the
// spec's, $COLLECTIVES_JOB_TOKEN) and this task's role. `server`: the caller is a ps or worker.
// Throws kInvalidArgument naming what is missing.
ResolvedCluster ResolveCluster(const ParameterServerOptions& options, bool server);

// "ps 1 at 127.0.0.1:2223".
std::string PsName(int index, const std::string& address);
// The name a shard has on its parameter server: the variable's name when it has one shard,
// else "<name>/part_<k>".
std::string ShardKey(const PsVariable& variable, const PsShard& shard);

// The optimizer as it travels to the parameter servers with each shard.
struct OptimizerConfig {
  enum Type : uint8_t { kSgd = 0, kAdam = 1 };
  Type kind = kSgd;
  float learning_rate = 0.01f;
  float momentum = 0.0f;
  bool nesterov = false;
  float beta_1 = 0.9f;
  float beta_2 = 0.999f;
  float epsilon = 1e-7f;
  enum Decay : uint8_t { kConstant = 0, kCosine = 1 };
  Decay decay = kConstant;
  int64_t decay_steps = 0;

  // Checks the name and the hyperparameters (kInvalidArgument).
  static OptimizerConfig From(const PsOptimizer& optimizer);
  size_t num_slots() const { return kind == kAdam ? 2 : momentum > 0.0f ? 1 : 0; }
  // As strategy.h's optimizers name themselves and their slots in checkpoints.
  std::string name() const { return kind == kAdam ? "Adam" : "SGD"; }
  std::vector<std::string> slot_names() const;
  // The learning rate of the update that follows `updates` updates (PsLearningRateSchedule).
  double LearningRate(int64_t updates) const;

  void Write(Out& out) const {
    out.U8(kind);
    out.F32(learning_rate);
    out.F32(momentum);
    out.U8(nesterov ? 1 : 0);
    out.F32(beta_1);
    out.F32(beta_2);
    out.F32(epsilon);
    out.U8(decay);
    out.I64(decay_steps);
  }
  static OptimizerConfig Read(In& in) {
    OptimizerConfig c;
    const uint8_t kind = in.U8();
    if (kind > kAdam) throw Error(ErrorCode::kInvalidArgument, "unknown optimizer kind");
    c.kind = static_cast<Type>(kind);
    c.learning_rate = in.F32();
    c.momentum = in.F32();
    c.nesterov = in.U8() != 0;
    c.beta_1 = in.F32();
    c.beta_2 = in.F32();
    c.epsilon = in.F32();
    const uint8_t decay = in.U8();
    if (decay > kCosine) throw Error(ErrorCode::kInvalidArgument, "unknown learning-rate decay");
    c.decay = static_cast<Decay>(decay);
    c.decay_steps = in.I64();
    return c;
  }
};

// Where the variables live, as a worker needs it for a step.
struct Layout {
  std::vector<std::string> ps_addresses;
  std::vector<std::string> worker_addresses;
  std::vector<PsVariable> variables;

  void Write(Out& out) const {
    out.U32(static_cast<uint32_t>(ps_addresses.size()));
    for (const std::string& a : ps_addresses) out.Str(a);
    out.U32(static_cast<uint32_t>(worker_addresses.size()));
    for (const std::string& a : worker_addresses) out.Str(a);
    out.U32(static_cast<uint32_t>(variables.size()));
    for (const PsVariable& v : variables) {
      out.Str(v.name);
      out.U32(static_cast<uint32_t>(v.shape.size()));
      for (size_t d : v.shape) out.U64(d);
      out.U64(v.count);
      out.U32(static_cast<uint32_t>(v.shards.size()));
      for (const PsShard& s : v.shards) {
        out.I32(s.ps_index);
        out.U64(s.offset);
        out.U64(s.count);
      }
    }
  }
  static Layout Read(In& in) {
    Layout l;
    const auto bounded = [&](uint32_t n) {
      if (n > in.remaining()) throw Error(ErrorCode::kPeerLost, "malformed layout");
      return n;
    };
    for (uint32_t i = 0, n = bounded(in.U32()); i < n; ++i) l.ps_addresses.push_back(in.Str());
    for (uint32_t i = 0, n = bounded(in.U32()); i < n; ++i) {
      l.worker_addresses.push_back(in.Str());
    }
    for (uint32_t i = 0, n = bounded(in.U32()); i < n; ++i) {
      PsVariable v;
      v.name = in.Str();
      for (uint32_t d = 0, rank = bounded(in.U32()); d < rank; ++d) v.shape.push_back(in.U64());
      v.count = in.U64();
      size_t end = 0;
      for (uint32_t k = 0, shards = bounded(in.U32()); k < shards; ++k) {
        PsShard s;
        s.ps_index = in.I32();
        s.offset = in.U64();
        s.count = in.U64();
        if (s.offset != end || s.count > v.count - s.offset) {
          throw Error(ErrorCode::kPeerLost, "malformed layout of variable '" + v.name + "'");
        }
        end += s.count;
        v.shards.push_back(s);
      }
      if (end != v.count) {
        throw Error(ErrorCode::kPeerLost, "malformed layout of variable '" + v.name + "'");
      }
      l.variables.push_back(std::move(v));
    }
    return l;
  }
};

}  // namespace collectives::strategy::ps

#endif  // COLLECTIVES_SRC_STRATEGY_PARAMETER_SERVER_INTERNAL_H_
