// The factory: from a ClusterSpec and options to a connected communicator. It is the one place
// where core reaches up to the implementations (DESIGN.md puts the factory in core).
#include <cstdlib>
#include <string>

#include "collectives/communication.h"
#include "src/hierarchical/planner.h"
#include "src/ring/ring_communication.h"
#if defined(COLLECTIVES_WITH_NCCL)
#include "src/nccl/nccl_communication.h"
#include "src/nccl/nccl_loader.h"
#endif
#include "src/transport/tcp_fabric.h"

namespace collectives {
namespace {

// "host:port" or "[v6]:port" -> host.
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

std::string ResolveJobToken(const CommunicationOptions& options) {
  if (!options.job_token.empty()) return options.job_token;
  if (const char* env = std::getenv("COLLECTIVES_JOB_TOKEN")) return env;
  return {};
}

const char* ToString(Implementation impl) {
  switch (impl) {
    case Implementation::kRing: return "ring";
    case Implementation::kNccl: return "nccl";
    case Implementation::kAuto: return "auto";
  }
  return "?";
}

Implementation ParseImplementation(const std::string& name) {
  if (name == "ring" || name == "RING") return Implementation::kRing;
  if (name == "nccl" || name == "NCCL") return Implementation::kNccl;
  if (name == "auto" || name == "AUTO") return Implementation::kAuto;
  throw Error(ErrorCode::kInvalidArgument,
              "unknown implementation '" + name + "' (expected ring, nccl or auto)");
}

std::unique_ptr<CollectiveCommunication> CreateCommunication(
    const ClusterSpec& spec, const CommunicationOptions& options) {
  spec.Validate();
  return CreateCommunication(spec, CreateStoreFor(spec, options.timeout, ResolveJobToken(options)),
                             options);
}

std::unique_ptr<CollectiveCommunication> CreateCommunication(
    const ClusterSpec& spec, std::shared_ptr<Store> store, const CommunicationOptions& options) {
  spec.Validate();
  if (!store) throw Error(ErrorCode::kInvalidArgument, "CreateCommunication: the store is null");
  // kAuto is RING's TCP fabric with the hierarchical planner (shared memory inside a host);
  // choosing NCCL for CUDA tensors per call, across devices, is future work.
  if (options.implementation == Implementation::kNccl) {
#if defined(COLLECTIVES_WITH_NCCL)
    // Fails with Error(kNotSupported) before touching the store when NCCL or a GPU is missing.
    nccl::LoadNccl();
    // The generation as for RING below: one key space per communicator built on this store.
    const int64_t generation =
        store->Add(spec.job_id + "/generation/" + std::to_string(spec.rank), 1);
    return nccl::CreateNcclCommunication(spec.rank, spec.world_size, std::move(store),
                                         spec.job_id + "/nccl/" + std::to_string(generation),
                                         options);
#else
    throw Error(ErrorCode::kNotSupported,
                "rank " + std::to_string(spec.rank) +
                    ": the NCCL implementation is not built into this library "
                    "(configure with -DCOLLECTIVES_WITH_NCCL=ON)");
#endif
  }

  transport::TcpFabricOptions tcp;
  tcp.job_id = spec.job_id;
  tcp.token = ResolveJobToken(options);
  tcp.timeout = options.timeout;
  // Every rank counts the communicators it has built on this store; building them in the same
  // order on every rank (as collectives require anyway) gives each its own key space.
  const int64_t generation =
      store->Add(spec.job_id + "/generation/" + std::to_string(spec.rank), 1);
  tcp.key_prefix = spec.job_id + "/" + std::to_string(generation);
  if (!spec.addresses.empty()) {
    tcp.bind_host = HostOf(spec.addresses[spec.rank]);
  } else if (spec.world_size > 1) {
    tcp.bind_host = transport::LocalAddressToward(spec.master_addr);
  }
  auto fabric = transport::ConnectTcpFabric(spec.rank, spec.world_size, *store, tcp);
  std::unique_ptr<ring::Planner> planner;
  if (options.implementation == Implementation::kAuto) {
    planner = hierarchical::CreatePlanner(spec.rank, spec.world_size, *store, spec.job_id,
                                          tcp.key_prefix, options);
  }
  return ring::CreateRingCommunication(std::move(fabric), std::move(store), options,
                                       std::move(planner));
}

}  // namespace collectives
