// Optimizers on mirrored variables: the shared machinery (gradient all-reduce, lazily created
// slots per variable per local replica, iterations, checkpoint support) and Keras' SGD and Adam.
//
// State is kept per local replica: replica r's slots and iteration count are touched only by
// replica r's thread inside Run (so replicas calling ApplyGradients at once need no lock), and
// by the owner's thread outside Run (SaveSlots, RestoreSlots, iterations(), which refuse to be
// called inside Run); inside Run a replica reads its own count (iterations(ctx)). Every replica
// applies the same update to the same summed gradient (bit-identical on every replica of every
// worker, see strategy_impl.cc), so the copies of variables and slots stay bit-identical.
//
// With central variables (CentralStorageStrategy) there is one state, used by local replica 0:
// ApplyGradients meets the other replicas in StrategyImpl::UpdateOnce, and replica 0 alone
// updates the central copies and the one set of slots and increments the count while the others
// wait inside that call; the others read the count (iterations(ctx)) only outside it, after the
// barrier that ends it.
#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>

#include "collectives/errors.h"
#include "collectives/strategy.h"
#include "src/strategy/device.h"
#include "src/strategy/strategy_impl.h"

namespace collectives::strategy {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

}  // namespace

struct Optimizer::State {
  struct alignas(64) Replica {  // one cache line apart: replicas update them at once
    int64_t iterations = 0;
    // variable -> its slots (in slot_names order), each of variable->count() floats.
    std::unordered_map<const MirroredVariable*, std::vector<std::vector<float>>> slots;
    // GPU replicas, whose update runs on the host: the summed gradients and the variable being
    // updated, copied over from the device into buffers kept from step to step.
    std::vector<std::vector<float>> gradient_copies;
    std::vector<float> value_copy;
  };
  // One per local replica; one in all with central variables.
  std::vector<Replica> replicas;
  Replica& Of(int local_replica) {
    return replicas.size() == 1 ? replicas[0] : replicas[static_cast<size_t>(local_replica)];
  }
};

Optimizer::Optimizer(Strategy& strategy, std::string name, std::vector<std::string> slot_names)
    : strategy_(strategy),
      name_(std::move(name)),
      slot_names_(std::move(slot_names)),
      state_(std::make_unique<State>()) {
  state_->replicas.resize(
      strategy.impl().central() ? 1 : static_cast<size_t>(strategy.num_local_replicas()));
}

Optimizer::~Optimizer() = default;

int64_t Optimizer::iterations() const {
  // Inside Run, replica 0's thread may be incrementing this very counter.
  strategy_.impl().CheckCrossReplica((name_ + ".iterations()").c_str());
  return state_->replicas[0].iterations;
}

int64_t Optimizer::iterations(const ReplicaContext& ctx) const {
  const int r = ctx.local_replica_id();
  if (&ctx.strategy() != &strategy_ || r < 0 || r >= strategy_.num_local_replicas()) {
    Invalid(strategy_.impl().who() + name_ +
            ".iterations(ctx): the context is not of a replica of this optimizer's strategy");
  }
  // Written only by this thread, or (central) by replica 0 while this one waits in ApplyGradients.
  return state_->Of(r).iterations;
}

void Optimizer::ApplyGradients(ReplicaContext& ctx, const std::vector<MirroredVariable*>& variables,
                               const std::vector<std::span<float>>& gradients) {
  const int r = ctx.local_replica_id();
  if (variables.size() != gradients.size()) {
    Invalid(strategy_.impl().who() + "replica " + std::to_string(r) + ": " + name_ +
            ".ApplyGradients got " + std::to_string(gradients.size()) + " gradients for " +
            std::to_string(variables.size()) + " variables");
  }
  std::vector<Tensor> tensors;
  tensors.reserve(gradients.size());
  for (size_t i = 0; i < gradients.size(); ++i) {
    tensors.push_back(Tensor{gradients[i].data(), gradients[i].size(), DataType::kFloat32});
  }
  const std::vector<std::span<const float>> summed(gradients.begin(), gradients.end());
  if (strategy_.impl().central()) {
    // Checked before the replicas meet, so that a bad list fails this replica alone, at once.
    CheckUpdate(r, variables, summed);
    strategy_.impl().UpdateOnce(r, tensors, [&] { Apply(0, variables, summed); });
    return;
  }
  ctx.AllReduce(ReduceOp::kSum, tensors);
  ApplyReducedGradients(r, variables, summed);
}

void Optimizer::ApplyGradients(ReplicaContext& ctx, const std::vector<MirroredVariable*>& variables,
                               const std::vector<Tensor>& gradients) {
  const int r = ctx.local_replica_id();
  const std::string where =
      strategy_.impl().who() + "replica " + std::to_string(r) + ": " + name_ + ".ApplyGradients: ";
  if (variables.size() != gradients.size()) {
    Invalid(where + std::to_string(gradients.size()) + " gradients for " +
            std::to_string(variables.size()) + " variables");
  }
  bool all_host = true;
  for (size_t i = 0; i < gradients.size(); ++i) {
    if (gradients[i].dtype != DataType::kFloat32) {
      Invalid(where + "gradient " + std::to_string(i) + " is " + ToString(gradients[i].dtype) +
              ", not float32");
    }
    all_host = all_host && gradients[i].device.kind == Device::Kind::kCpu;
  }
  if (all_host) {
    std::vector<std::span<float>> spans;
    for (const Tensor& t : gradients) spans.emplace_back(static_cast<float*>(t.data), t.count);
    ApplyGradients(ctx, variables, spans);
    return;
  }
  if (strategy_.impl().central()) {
    Invalid(where + "central variables take host gradients");
  }
  ctx.AllReduce(ReduceOp::kSum, gradients);
  // The update runs on the host: bring the summed device gradients over.
  std::vector<std::vector<float>>& host = state_->Of(r).gradient_copies;
  host.resize(std::max(host.size(), gradients.size()));
  std::vector<std::span<const float>> summed(gradients.size());
  for (size_t i = 0; i < gradients.size(); ++i) {
    const Tensor& t = gradients[i];
    if (t.device.kind == Device::Kind::kCpu) {
      summed[i] = std::span<const float>(static_cast<const float*>(t.data), t.count);
      continue;
    }
    host[i].resize(t.count);
    internal::CopyToHost(t.device, host[i].data(), t.data, t.bytes());
    summed[i] = std::span<const float>(host[i].data(), t.count);
  }
  ApplyReducedGradients(r, variables, summed);
}

void Optimizer::ApplyReducedGradients(int local_replica,
                                      const std::vector<MirroredVariable*>& variables,
                                      const std::vector<std::span<const float>>& gradients) {
  CheckUpdate(local_replica, variables, gradients);
  if (!strategy_.impl().central()) {
    Apply(local_replica, variables, gradients);
    return;
  }
  const auto apply = [&] {
    if (local_replica == 0) Apply(0, variables, gradients);
  };
  if (strategy_.impl().in_run()) {
    strategy_.impl().UpdateOnce(local_replica, {}, apply);
  } else {
    apply();
  }
}

void Optimizer::CheckUpdate(int local_replica, const std::vector<MirroredVariable*>& variables,
                            const std::vector<std::span<const float>>& gradients) const {
  const std::string where = strategy_.impl().who() + "replica " + std::to_string(local_replica) +
                            ": " + name_ + " update: ";
  if (local_replica < 0 || local_replica >= strategy_.num_local_replicas()) {
    Invalid(where + "no such local replica (there are " +
            std::to_string(strategy_.num_local_replicas()) + ")");
  }
  if (variables.size() != gradients.size()) {
    Invalid(where + std::to_string(gradients.size()) + " gradients for " +
            std::to_string(variables.size()) + " variables");
  }
  for (size_t i = 0; i < variables.size(); ++i) {
    const MirroredVariable* v = variables[i];
    if (v == nullptr || strategy_.FindVariable(v->name()) != v) {
      Invalid(where + "variable " + std::to_string(i) +
              " is not a variable of this optimizer's strategy");
    }
    if (gradients[i].size() != v->count()) {
      Invalid(where + "the gradient of '" + v->name() + "' has " +
              std::to_string(gradients[i].size()) + " elements, the variable " +
              std::to_string(v->count()));
    }
  }
}

void Optimizer::Apply(int local_replica, const std::vector<MirroredVariable*>& variables,
                      const std::vector<std::span<const float>>& gradients) {
  State::Replica& mine = state_->Of(local_replica);
  const int64_t step = ++mine.iterations;
  std::vector<std::span<float>> slot_views(slot_names_.size());
  for (size_t i = 0; i < variables.size(); ++i) {
    MirroredVariable& v = *variables[i];
    auto [it, created] = mine.slots.try_emplace(&v);
    if (created) it->second.assign(slot_names_.size(), std::vector<float>(v.count(), 0.0f));
    for (size_t s = 0; s < slot_names_.size(); ++s) slot_views[s] = it->second[s];
    if (v.on_device()) {  // no kernels: update a host copy, then copy it back
      const Tensor t = v.tensor(local_replica);
      std::vector<float>& value = mine.value_copy;
      value.resize(v.count());
      internal::CopyToHost(t.device, value.data(), t.data, t.bytes());
      Update(value, gradients[i], slot_views, step);
      v.Write(local_replica, value);
      continue;
    }
    Update(v.value(local_replica), gradients[i], slot_views, step);
  }
}

std::vector<Optimizer::Slot> Optimizer::SaveSlots() const {
  strategy_.impl().CheckCrossReplica((name_ + ".SaveSlots").c_str());
  std::vector<Slot> out;
  const State::Replica& first = state_->replicas[0];
  for (MirroredVariable* v : strategy_.variables()) {
    auto it = first.slots.find(v);
    if (it == first.slots.end()) continue;  // never updated: no slots yet (created lazily)
    for (size_t s = 0; s < slot_names_.size(); ++s) {
      out.push_back(Slot{v->name() + "/" + slot_names_[s], it->second[s]});
    }
  }
  return out;
}

namespace {

// Each variable's slots, in slot_names order.
using ResolvedSlots = std::map<const MirroredVariable*, std::vector<const Optimizer::Slot*>>;

// RestoreSlots' checks: resolves every slot to its variable, or throws kInvalidArgument after
// `where`. Changes nothing.
ResolvedSlots ResolveSlots(const Strategy& strategy, const std::vector<std::string>& slot_names,
                           const std::vector<Optimizer::Slot>& slots, int64_t iterations,
                           const std::string& where) {
  if (iterations < 0) Invalid(where + "negative iterations " + std::to_string(iterations));
  std::map<std::string, std::pair<const MirroredVariable*, size_t>> expected;
  for (MirroredVariable* v : strategy.variables()) {
    for (size_t s = 0; s < slot_names.size(); ++s) {
      expected.emplace(v->name() + "/" + slot_names[s], std::make_pair(v, s));
    }
  }
  ResolvedSlots found;
  for (const Optimizer::Slot& slot : slots) {
    auto it = expected.find(slot.name);
    if (it == expected.end()) {
      Invalid(where + "slot '" + slot.name + "' is not a slot of a variable of the strategy");
    }
    const auto [variable, index] = it->second;
    if (slot.value.size() != variable->count()) {
      Invalid(where + "slot '" + slot.name + "' has " + std::to_string(slot.value.size()) +
              " values, variable '" + variable->name() + "' " + std::to_string(variable->count()));
    }
    std::vector<const Optimizer::Slot*>& of_variable = found[variable];
    of_variable.resize(slot_names.size(), nullptr);
    if (of_variable[index] != nullptr) Invalid(where + "slot '" + slot.name + "' appears twice");
    of_variable[index] = &slot;
  }
  for (const auto& [variable, of_variable] : found) {
    for (size_t s = 0; s < slot_names.size(); ++s) {
      if (of_variable[s] == nullptr) {
        Invalid(where + "variable '" + variable->name() + "' has some slots but not '" +
                slot_names[s] + "'");
      }
    }
  }
  return found;
}

}  // namespace

void Optimizer::CheckSlots(const std::vector<Slot>& slots, int64_t iterations) const {
  strategy_.impl().CheckCrossReplica((name_ + ".CheckSlots").c_str());
  ResolveSlots(strategy_, slot_names_, slots, iterations,
               strategy_.impl().who() + name_ + ".RestoreSlots: ");
}

void Optimizer::RestoreSlots(const std::vector<Slot>& slots, int64_t iterations) {
  strategy_.impl().CheckCrossReplica((name_ + ".RestoreSlots").c_str());
  // Resolve every slot before changing anything.
  const ResolvedSlots found = ResolveSlots(strategy_, slot_names_, slots, iterations,
                                           strategy_.impl().who() + name_ + ".RestoreSlots: ");
  for (State::Replica& replica : state_->replicas) {
    replica.iterations = iterations;
    replica.slots.clear();
    for (const auto& [variable, of_variable] : found) {
      std::vector<std::vector<float>>& values = replica.slots[variable];
      for (const Slot* slot : of_variable) values.push_back(slot->value);
    }
  }
}

// ---- SGD ---------------------------------------------------------------------------------------

namespace {
std::vector<std::string> SgdSlots(const SgdOptions& options) {
  if (!(options.momentum >= 0.0f && options.momentum <= 1.0f)) {
    Invalid("SGD: momentum must be in [0, 1], got " + std::to_string(options.momentum));
  }
  if (options.momentum == 0.0f) return {};
  return {"momentum"};
}
}  // namespace

Sgd::Sgd(Strategy& strategy, SgdOptions options)
    : Optimizer(strategy, "SGD", SgdSlots(options)), options_(options) {}

void Sgd::Update(std::span<float> variable, std::span<const float> gradient,
                 std::span<std::span<float>> slots, int64_t /*step*/) {
  const size_t n = variable.size();
  float* __restrict w = variable.data();
  const float* __restrict g = gradient.data();
  const float lr = options_.learning_rate;
  if (slots.empty()) {  // no momentum: w -= lr * g
    for (size_t i = 0; i < n; ++i) w[i] -= lr * g[i];
    return;
  }
  float* __restrict v = slots[0].data();
  const float mu = options_.momentum;
  if (options_.nesterov) {  // v = mu v - lr g; w += mu v - lr g
    for (size_t i = 0; i < n; ++i) {
      v[i] = mu * v[i] - lr * g[i];
      w[i] += mu * v[i] - lr * g[i];
    }
  } else {  // v = mu v - lr g; w += v
    for (size_t i = 0; i < n; ++i) {
      v[i] = mu * v[i] - lr * g[i];
      w[i] += v[i];
    }
  }
}

// ---- Adam --------------------------------------------------------------------------------------

Adam::Adam(Strategy& strategy, AdamOptions options)
    : Optimizer(strategy, "Adam", {"m", "v"}), options_(options) {
  if (!(options.beta_1 >= 0.0f && options.beta_1 < 1.0f) ||
      !(options.beta_2 >= 0.0f && options.beta_2 < 1.0f)) {
    Invalid("Adam: beta_1 and beta_2 must be in [0, 1), got " + std::to_string(options.beta_1) +
            " and " + std::to_string(options.beta_2));
  }
}

void Adam::Update(std::span<float> variable, std::span<const float> gradient,
                  std::span<std::span<float>> slots, int64_t step) {
  // Keras: lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t), computed once per step in double;
  // m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= lr_t * m / (sqrt(v) + eps).
  const double t = static_cast<double>(step);
  const double rate = options_.learning_rate_schedule ? options_.learning_rate_schedule(step - 1)
                                                      : static_cast<double>(options_.learning_rate);
  const float lr_t = static_cast<float>(
      rate * std::sqrt(1.0 - std::pow(static_cast<double>(options_.beta_2), t)) /
      (1.0 - std::pow(static_cast<double>(options_.beta_1), t)));
  const float b1 = options_.beta_1;
  const float b2 = options_.beta_2;
  const float one_minus_b1 = 1.0f - b1;
  const float one_minus_b2 = 1.0f - b2;
  const float eps = options_.epsilon;
  const size_t n = variable.size();
  float* __restrict w = variable.data();
  const float* __restrict g = gradient.data();
  float* __restrict m = slots[0].data();
  float* __restrict v = slots[1].data();
  for (size_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + one_minus_b1 * g[i];
    v[i] = b2 * v[i] + one_minus_b2 * g[i] * g[i];
    w[i] -= lr_t * m[i] / (std::sqrt(v[i]) + eps);
  }
}

}  // namespace collectives::strategy
