// MirroredVariable (one float32 copy per local replica, or one central copy) and the
// initializers.
//
// GlorotUniform draws from std::mt19937_64, whose output the standard fixes, and maps each
// 64-bit draw to [0, 1) itself (top 53 bits x 2^-53), instead of using
// std::uniform_real_distribution, whose algorithm is implementation-defined: the same seed gives
// the same weights with every standard library.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <utility>

#include "collectives/errors.h"
#include "collectives/strategy.h"
#include "src/strategy/device.h"
#include "src/strategy/strategy_impl.h"

namespace collectives::strategy {
namespace {

size_t CountOf(const std::string& name, const std::vector<size_t>& shape) {
  size_t count = 1;
  for (size_t d : shape) {
    if (d != 0 && count > std::numeric_limits<size_t>::max() / sizeof(float) / d) {
      throw Error(ErrorCode::kInvalidArgument,
                  "variable '" + name + "': its shape has more elements than memory can hold");
    }
    count *= d;
  }
  return count;
}

}  // namespace

MirroredVariable::MirroredVariable(std::string name, std::vector<size_t> shape,
                                   int num_local_replicas, Placement placement)
    : name_(std::move(name)),
      shape_(std::move(shape)),
      count_(CountOf(name_, shape_)),
      num_local_replicas_(num_local_replicas),
      placement_(placement) {
  if (num_local_replicas < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "variable '" + name_ + "': " + std::to_string(num_local_replicas) +
                    " local replicas (need at least 1)");
  }
  if (placement != Placement::kMirrored && placement != Placement::kCentral) {
    throw Error(ErrorCode::kInvalidArgument, "variable '" + name_ + "': unknown placement " +
                                                 std::to_string(static_cast<int>(placement)));
  }
  const size_t copies =
      placement == Placement::kCentral ? 1 : static_cast<size_t>(num_local_replicas);
  copies_.assign(copies, std::vector<float>(count_, 0.0f));
  devices_.assign(static_cast<size_t>(num_local_replicas), Device::Cpu());
}

MirroredVariable::MirroredVariable(std::string name, std::vector<size_t> shape,
                                   std::vector<Device> devices)
    : name_(std::move(name)),
      shape_(std::move(shape)),
      count_(CountOf(name_, shape_)),
      num_local_replicas_(static_cast<int>(devices.size())),
      placement_(Placement::kMirrored),
      devices_(std::move(devices)) {
  if (devices_.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "variable '" + name_ + "': no devices");
  }
  const bool cuda = devices_[0].kind == Device::Kind::kCuda;
  for (const Device& d : devices_) {
    if ((d.kind == Device::Kind::kCuda) != cuda) {
      throw Error(ErrorCode::kInvalidArgument,
                  "variable '" + name_ +
                      "': its copies are either all on the CPU or all on "
                      "CUDA devices, got " +
                      devices_[0].ToString() + " and " + d.ToString());
    }
  }
  if (!cuda) {
    copies_.assign(devices_.size(), std::vector<float>(count_, 0.0f));
    return;
  }
  const std::vector<float> zeros(count_, 0.0f);
  for (const Device& d : devices_) {
    device_copies_.push_back(internal::AllocateOnDevice(d, count_ * sizeof(float)));
    internal::CopyToDevice(d, device_copies_.back().get(), zeros.data(), count_ * sizeof(float));
  }
}

Device MirroredVariable::device(int local_replica) const {
  if (local_replica < 0 || local_replica >= num_local_replicas()) {
    throw Error(ErrorCode::kInvalidArgument, "variable '" + name_ + "': no local replica " +
                                                 std::to_string(local_replica) + " (there are " +
                                                 std::to_string(num_local_replicas()) + ")");
  }
  return devices_[static_cast<size_t>(local_replica)];
}

std::vector<float> MirroredVariable::Read(int local_replica) const {
  const Device d = device(local_replica);
  if (!on_device()) {
    const std::span<const float> v = value(local_replica);
    return {v.begin(), v.end()};
  }
  std::vector<float> out(count_);
  internal::CopyToHost(d, out.data(), device_copies_[static_cast<size_t>(local_replica)].get(),
                       count_ * sizeof(float));
  return out;
}

void MirroredVariable::Write(int local_replica, std::span<const float> value) {
  const Device d = device(local_replica);
  if (value.size() != count_) {
    throw Error(ErrorCode::kInvalidArgument, "variable '" + name_ + "': Write of " +
                                                 std::to_string(value.size()) + " values to " +
                                                 std::to_string(count_) + " elements");
  }
  if (!on_device()) {
    std::copy(value.begin(), value.end(), this->value(local_replica).begin());
    return;
  }
  internal::CopyToDevice(d, device_copies_[static_cast<size_t>(local_replica)].get(), value.data(),
                         count_ * sizeof(float));
}

std::span<float> MirroredVariable::value(int local_replica) {
  if (local_replica < 0 || local_replica >= num_local_replicas()) {
    throw Error(ErrorCode::kInvalidArgument,
                "variable '" + name_ + "': no local replica " + std::to_string(local_replica) +
                    " (there are " + std::to_string(num_local_replicas()) + ")");
  }
  if (on_device()) {
    throw Error(ErrorCode::kInvalidUsage,
                "variable '" + name_ + "': replica " + std::to_string(local_replica) +
                    "'s copy is in the memory of " +
                    devices_[static_cast<size_t>(local_replica)].ToString() +
                    ", which host code cannot read: use tensor(), Read() or Write()");
  }
  return copies_[placement_ == Placement::kCentral ? 0 : static_cast<size_t>(local_replica)];
}

std::span<const float> MirroredVariable::value(int local_replica) const {
  return const_cast<MirroredVariable*>(this)->value(local_replica);
}

Tensor MirroredVariable::tensor(int local_replica) {
  if (on_device()) {
    const Device d = device(local_replica);
    return Tensor{device_copies_[static_cast<size_t>(local_replica)].get(), count_,
                  DataType::kFloat32, d};
  }
  return Tensor{data(local_replica), count_, DataType::kFloat32, Device::Cpu()};
}

void MirroredVariable::Assign(std::span<const float> value) {
  if (strategy_ != nullptr) strategy_->CheckCrossReplica("MirroredVariable::Assign");
  if (value.size() != count_) {
    throw Error(ErrorCode::kInvalidArgument, "variable '" + name_ + "': Assign of " +
                                                 std::to_string(value.size()) +
                                                 " values to " + std::to_string(count_) +
                                                 " elements");
  }
  for (std::vector<float>& copy : copies_) std::copy(value.begin(), value.end(), copy.begin());
  for (int r = 0; r < static_cast<int>(device_copies_.size()); ++r) Write(r, value);
}

Initializer Zeros() {
  return [](std::span<float> value) { std::fill(value.begin(), value.end(), 0.0f); };
}

Initializer Constant(float c) {
  return [c](std::span<float> value) { std::fill(value.begin(), value.end(), c); };
}

Initializer GlorotUniform(size_t fan_in, size_t fan_out, uint64_t seed) {
  if (fan_in + fan_out == 0) {
    throw Error(ErrorCode::kInvalidArgument, "GlorotUniform: fan_in + fan_out must be > 0");
  }
  const double limit = std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  return [limit, seed](std::span<float> value) {
    std::mt19937_64 rng(seed);
    for (float& v : value) {
      const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;  // [0, 1)
      v = static_cast<float>((2.0 * u - 1.0) * limit);
    }
  };
}

}  // namespace collectives::strategy
