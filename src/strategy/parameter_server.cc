// ParameterServerStrategy, ClusterCoordinator and the task servers (parameter_server.h).
#include "collectives/parameter_server.h"

#include "collectives/errors.h"

namespace collectives::strategy {
namespace {
[[noreturn]] void NotYet(const char* what) {
  throw Error(ErrorCode::kNotSupported, std::string(what) + " is not supported in this build");
}
}  // namespace

WorkerContext::~WorkerContext() = default;
Server::~Server() = default;

void RegisterFunction(const std::string&, StepFunction) { NotYet("RegisterFunction"); }
void RegisterDatasetFunction(const std::string&, DatasetFunction) {
  NotYet("RegisterDatasetFunction");
}
std::unique_ptr<Server> StartServer(const ParameterServerOptions&) { NotYet("StartServer"); }
void RunServer(const ParameterServerOptions&) { NotYet("RunServer"); }

class ParameterServerStrategy::Impl {};
ParameterServerStrategy::ParameterServerStrategy(ParameterServerOptions) {
  NotYet("ParameterServerStrategy");
}
ParameterServerStrategy::~ParameterServerStrategy() = default;
const std::string& ParameterServerStrategy::name() const { NotYet("name"); }
int ParameterServerStrategy::num_ps() const { NotYet("num_ps"); }
int ParameterServerStrategy::num_workers() const { NotYet("num_workers"); }
const ParameterServerOptions& ParameterServerStrategy::options() const { NotYet("options"); }
const PsVariable& ParameterServerStrategy::CreateVariable(const std::string&, std::vector<size_t>,
                                                          const Initializer&) {
  NotYet("CreateVariable");
}
const std::vector<PsVariable>& ParameterServerStrategy::variables() const { NotYet("variables"); }
std::vector<float> ParameterServerStrategy::Read(const std::string&) { NotYet("Read"); }
void ParameterServerStrategy::Assign(const std::string&, std::span<const float>) {
  NotYet("Assign");
}
int64_t ParameterServerStrategy::iterations() { NotYet("iterations"); }
void ParameterServerStrategy::SaveCheckpoint(const std::string&, TrainingState) {
  NotYet("SaveCheckpoint");
}
std::optional<TrainingState> ParameterServerStrategy::RestoreCheckpoint(const std::string&) {
  NotYet("RestoreCheckpoint");
}
void ParameterServerStrategy::CheckHealth() const { NotYet("CheckHealth"); }

struct RemoteValue::State {};
RemoteValue::RemoteValue() = default;
std::string RemoteValue::Fetch(std::chrono::milliseconds) const { NotYet("Fetch"); }
bool RemoteValue::Done() const { NotYet("Done"); }

class ClusterCoordinator::Impl {};
ClusterCoordinator::ClusterCoordinator(ParameterServerStrategy&) { NotYet("ClusterCoordinator"); }
ClusterCoordinator::~ClusterCoordinator() = default;
ParameterServerStrategy& ClusterCoordinator::strategy() const { NotYet("strategy"); }
RemoteValue ClusterCoordinator::Schedule(const std::string&, std::string) { NotYet("Schedule"); }
void ClusterCoordinator::Join(std::chrono::milliseconds) { NotYet("Join"); }
bool ClusterCoordinator::Done() const { NotYet("Done"); }
PerWorkerDataset ClusterCoordinator::CreatePerWorkerDataset(const std::string&, std::string,
                                                            std::string) {
  NotYet("CreatePerWorkerDataset");
}
int ClusterCoordinator::num_available_workers() const { NotYet("num_available_workers"); }
int64_t ClusterCoordinator::rescheduled_steps() const { NotYet("rescheduled_steps"); }
void ClusterCoordinator::StopServers() { NotYet("StopServers"); }

}  // namespace collectives::strategy
