// The factory: from a ClusterSpec and options to a connected communicator. It is the one file of
// src/core that includes the implementations (src/ring, src/hierarchical, src/nccl,
// src/transport); the rest of core depends on none of them.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "collectives/communication.h"
#include "src/cluster/cancellable_store.h"
#include "src/cluster/host_port.h"
#include "src/cluster/job_token.h"
#include "src/cluster/store_common.h"
#include "src/core/arguments.h"
#include "src/core/fnv1a.h"
#include "src/core/text.h"
#include "src/hierarchical/planner.h"
#include "src/ring/algorithms.h"
#include "src/ring/ring_communication.h"
#if defined(COLLECTIVES_WITH_NCCL)
#include "src/nccl/nccl_communication.h"
#include "src/nccl/nccl_loader.h"
#endif
#include "src/transport/handshake.h"
#include "src/transport/tcp_fabric.h"

namespace collectives {
namespace {

using Clock = std::chrono::steady_clock;

// The host of rank `rank`'s entry in spec.addresses (Validate checked that it parses).
std::string ListedHost(const ClusterSpec& spec, int rank) {
  std::string why;
  const auto parsed = cluster::ParseHostPort(spec.addresses[size_t(rank)], &why);
  return parsed ? parsed->host : std::string();
}

// This host's address toward master_addr (transport::LocalAddressToward), for a set-up that
// must end by `deadline`: Error(kTimeout), naming `timeout`, when the name's lookup has not
// answered by then.
std::string HostTowardMaster(const ClusterSpec& spec, std::chrono::milliseconds timeout,
                             Clock::time_point deadline) {
  const std::string master_host = cluster::StripBrackets(spec.master_addr);
  std::optional<std::string> host = transport::LocalAddressToward(master_host, deadline);
  if (!host) {
    throw Error(ErrorCode::kTimeout,
                "rank " + std::to_string(spec.rank) + ": timed out after " +
                    std::to_string(timeout.count()) +
                    " ms setting up: the lookup of master_addr '" + master_host +
                    "' (for the address this rank listens on) has not answered");
  }
  return std::move(*host);
}

// The host this rank's data listener is asked to bind to, without brackets:
// options.listen_address, else $COLLECTIVES_LISTEN_ADDRESS, else "" (the spec decides). Throws
// Error(kInvalidArgument) naming the option or the variable when it is no host name or address.
std::string AskedListenHost(int rank, const CommunicationOptions& options) {
  std::string name = "CommunicationOptions::listen_address";
  std::string value = options.listen_address;
  if (value.empty()) {
    const char* env = std::getenv("COLLECTIVES_LISTEN_ADDRESS");
    if (env == nullptr || *env == '\0') return {};
    name = "environment variable COLLECTIVES_LISTEN_ADDRESS";
    value = env;
  }
  std::string why;
  std::optional<std::string> host = cluster::CheckHost(
      value, "the listener's port is picked by the system: give the host alone", &why);
  if (!host) {
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank) + ": " + name + "='" +
                                                 core::OneLine(value, 256) +
                                                 "' is not a host name or address: " + why);
  }
  return std::move(*host);
}

// Refuses, with Error(kInvalidArgument) naming the rank, a job id longer than the TCP mesh's
// handshake carries (RING and AUTO; NCCL has no such limit), before the store is touched: the
// mesh would refuse it only after the store counted this communicator.
void CheckJobIdFitsTheHandshake(const ClusterSpec& spec, const CommunicationOptions& options) {
  if (options.implementation == Implementation::kNccl) return;
  if (spec.job_id.size() > transport::kMaxJobIdBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                "rank " + std::to_string(spec.rank) + ": job id '" +
                    core::OneLine(spec.job_id, 64) + "' (" + std::to_string(spec.job_id.size()) +
                    " bytes) is longer than the " + std::to_string(transport::kMaxJobIdBytes) +
                    " bytes a connection's handshake carries");
  }
}

// The most ranks a job may have: 2^20. A RING or AUTO rank may come to hold a connection to every
// other rank (an all-to-all connects every pair; rank 0's store holds one per rank), and Linux
// lets a process hold at most 2^20 descriptors unless fs.nr_open is raised; far
// larger sizes (INT_MAX) only ran the set-up out of memory, in rank 0's store (a record per
// rank) or in the mesh's per-rank tables, with a bare "out of memory".
constexpr int kMaxWorldSize = 1 << 20;

void CheckWorldSize(const ClusterSpec& spec) {
  if (spec.world_size > kMaxWorldSize) {
    throw Error(ErrorCode::kInvalidArgument,
                "rank " + std::to_string(spec.rank) +
                    ": world_size=" + std::to_string(spec.world_size) +
                    " is more ranks than a job can have (" + std::to_string(kMaxWorldSize) +
                    ": a rank may connect to every other, and a process holds at most " +
                    std::to_string(kMaxWorldSize) + " descriptors by default)");
  }
}

// Where a communicator's ranks meet: the job, the key space in the store, and the address this
// rank listens on.
struct Rendezvous {
  std::string job_id;
  std::string token;  // the job token every connection proves
  std::string key_prefix;
  std::string bind_host = "127.0.0.1";
};

std::unique_ptr<CollectiveCommunication> ConnectSplit(int rank, int size,
                                                      std::shared_ptr<Store> store,
                                                      const Rendezvous& rendezvous,
                                                      const CommunicationOptions& options,
                                                      const std::function<bool()>& parent_aborted);

// Runs `step`, a part of rank `rank`'s set-up. A failure of the store itself
// (cluster::StoreFailure: a TCP store that could not connect, got no reply or lost its
// connection) names the store and what it did, but not the rank, which every message names: it
// is raised again as an Error with "rank N: " before its message, under its code.
template <typename Step>
auto NamingTheRank(int rank, Step&& step) -> decltype(step()) {
  try {
    return step();
  } catch (const cluster::StoreFailure& failure) {
    throw Error(failure.code(), "rank " + std::to_string(rank) + ": " + failure.message());
  }
}

// The options that pick the algorithms and cut the frames, as this rank runs them (0 read as the
// default): one "name=value" line each. Every rank must run the same.
std::vector<std::string> AgreedOptions(const CommunicationOptions& options) {
  const auto or_default = [](size_t value, size_t fallback) {
    return std::to_string(value == 0 ? fallback : value);
  };
  return {std::string("implementation=") + ToString(options.implementation),
          "algorithm='" + core::OneLine(options.algorithm) + "'",
          "chunk_bytes=" + or_default(options.chunk_bytes, ring::kDefaultChunkBytes),
          "small_message_bytes=" +
              or_default(options.small_message_bytes, ring::kDefaultSmallMessageBytes),
          "medium_message_bytes=" +
              or_default(options.medium_message_bytes, ring::kDefaultMediumMessageBytes)};
}

// Whether every rank passed the same AgreedOptions, found through the store in a few operations
// per rank whatever the world size: each adds a hash of its options to a sum, and once every
// rank has (the one whose count reaches the size says so), each compares the sum with the world
// size times rank 0's hash: the same figures on every rank, hence the same verdict (with its own
// hash, one rank could pass where the others fail: 1 + 2 + 3 = 3 x 2). Where they differ, all
// raise Error(kInvalidArgument) naming the first option that differs and the rank it differs from
// (rank 0, or for a rank that agrees with rank 0 the first that does not). Without it the ranks
// would run different algorithms and meet as a mismatch of frame sizes at the first call, or,
// under AUTO with `algorithm` forced on some ranks only, wait out the set-up for a shared-memory
// group that those ranks never join. Runs once every rank is connected (the mesh names a rank
// that never came).
void CheckOptionsAgree(int rank, int size, Store& store, const std::string& key_prefix,
                       const CommunicationOptions& options, Clock::time_point deadline) {
  const std::vector<std::string> mine = AgreedOptions(options);
  std::string record;
  for (const std::string& line : mine) record += line + "\n";
  // 32 bits, so that the store's int64 sum cannot overflow (it refuses to) below 2^31 ranks.
  const auto hash_of = [](const std::string& text) {
    uint64_t full = core::kFnv1aBasis;
    core::Fnv1a(full, text.data(), text.size());
    return int64_t((full ^ (full >> 32)) & 0xffffffffu);
  };
  const std::string key = key_prefix + "/options/";
  store.Set(key + std::to_string(rank), record);
  store.Add(key + "sum", hash_of(record));
  if (store.Add(key + "count", 1) == size) store.Set(key + "all", "1");
  const auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                    std::chrono::milliseconds(1));
  };
  try {
    store.Get(key + "all", left());
  } catch (const Error& error) {
    if (error.code() != ErrorCode::kTimeout) throw;
    throw Error(ErrorCode::kTimeout,
                "rank " + std::to_string(rank) + ": timed out after " +
                    std::to_string(options.timeout.count()) +
                    " ms setting up the communicator: not every rank published its options (" +
                    error.message() + ")");
  }
  const std::string first = rank == 0 ? record : store.Get(key + "0", left());
  if (store.Add(key + "sum", 0) == hash_of(first) * size) return;
  // Someone differs: find whom, and what.
  for (int r = rank == 0 ? 1 : 0; r < size; ++r) {
    if (r == rank) continue;
    const std::string theirs = store.Get(key + std::to_string(r), left());
    if (theirs == record) continue;
    std::string what = "the options differ";
    size_t from = 0;
    for (const std::string& line : mine) {
      const size_t end = theirs.find('\n', from);
      const std::string other = theirs.substr(from, end == std::string::npos ? end : end - from);
      if (other != line) {
        const size_t eq = line.find('=');
        what = line.substr(0, eq) + " is " + line.substr(eq + 1) + " here but " +
               core::OneLine(other.substr(std::min(other.size(), eq + 1)), 80) + " on rank " +
               std::to_string(r);
        break;
      }
      from = end == std::string::npos ? theirs.size() : end + 1;
    }
    throw Error(ErrorCode::kInvalidArgument,
                "rank " + std::to_string(rank) + ": CommunicationOptions::" + what +
                    ": every rank must pass the same implementation, algorithm, chunk_bytes, "
                    "small_message_bytes and medium_message_bytes (0 is the default)");
  }
  // Agrees with every record: another rank's differs from some other one, and it raises too.
  throw Error(ErrorCode::kInvalidArgument,
              "rank " + std::to_string(rank) +
                  ": CommunicationOptions differ across ranks (the ranks' hashes of their "
                  "implementation, algorithm, chunk_bytes, small_message_bytes and "
                  "medium_message_bytes do not add up)");
}

// The TCP mesh (and, for AUTO, the planner with this host's shared memory) under `rendezvous`;
// a Split builds its communicators the same way under a key space of their own. options.timeout
// bounds the set-up as a whole, not each step: every step ends by `deadline` (the set-up's start
// plus the timeout), so a step gets what the ones before it left, and its errors still name
// options.timeout. The communicator's calls then run under the whole options.timeout.
std::unique_ptr<CollectiveCommunication> Connect(int rank, int size, std::shared_ptr<Store> store,
                                                 const Rendezvous& rendezvous,
                                                 const CommunicationOptions& options,
                                                 Clock::time_point deadline,
                                                 const std::function<bool()>& cancelled = {}) {
  // A split's child gives up when its parent is aborted: every step polls `cancelled` (the
  // store's waits through a CancellableStore, the mesh's own), except the calibration, which
  // runs collectives on the child with every member already connected.
  const std::string abandoned = "rank " + std::to_string(rank) +
                                ": set-up abandoned: the communicator it was split from broke";
  // Every Set and Add ends by `deadline` too, where the store can say so.
  std::shared_ptr<Store> bounded = std::make_shared<cluster::DeadlineBoundStore>(store, deadline);
  std::shared_ptr<Store> setup_store =
      cancelled ? std::make_shared<cluster::CancellableStore>(bounded, cancelled, abandoned,
                                                              transport::kCancelPoll)
                : bounded;
  transport::TcpFabricOptions tcp;
  tcp.job_id = rendezvous.job_id;
  tcp.token = rendezvous.token;
  tcp.timeout = options.timeout;
  tcp.deadline = deadline;
  tcp.key_prefix = rendezvous.key_prefix;
  tcp.bind_host = rendezvous.bind_host;
  tcp.cancelled = cancelled;
  // Connections on demand: the set-up connects only what the algorithms use on every call
  // (ring::PeersAtSetUp, O(log size)), the rest connect at first use; COLLECTIVES_CONNECT=all
  // connects every pair at set-up instead. A peer that closes a connection made on demand
  // before any frame came on it gets kWriteFailureGrace (TcpConnection::LosePeer), so that the
  // abort frame of a rank that broke while that connection was being attached, relayed over the
  // set-up's connections, names the rank at fault.
  const char* connect = std::getenv("COLLECTIVES_CONNECT");
  const bool every_pair = connect != nullptr && std::string(connect) == "all";
  if (connect != nullptr && !every_pair && std::string(connect) != "on_demand") {
    std::fprintf(stderr,
                 "collectives: ignoring COLLECTIVES_CONNECT=\"%s\" (expected all or on_demand)\n",
                 connect);
  }
  if (!every_pair) {
    tcp.on_demand = true;
    tcp.peers_at_setup = ring::PeersAtSetUp(rank, size);
    tcp.address_store = store;
  }
  auto fabric = transport::ConnectTcpFabric(rank, size, *setup_store, tcp);
  std::unique_ptr<ring::Planner> planner;
  try {
    CheckOptionsAgree(rank, size, *setup_store, rendezvous.key_prefix, options, deadline);
    if (options.implementation == Implementation::kAuto) {
      planner = hierarchical::CreatePlanner(rank, size, *setup_store, rendezvous.job_id,
                                            rendezvous.key_prefix, options, deadline, store);
    }
  } catch (const Error& error) {
    // The store failing now may be a faster rank that is done with its set-up, raised an error
    // in a call and exited with the store: its abort frame, already on its way over the mesh,
    // names the rank at fault, and decides within the grace a closed connection gets.
    if (error.code() == ErrorCode::kPeerLost || error.code() == ErrorCode::kSystem) {
      if (auto aborted = fabric->ErrorWithin(transport::kWriteFailureGrace)) throw *aborted;
    }
    throw;
  }
  if (cancelled && cancelled()) throw Error(ErrorCode::kAborted, abandoned);
  ring::SplitBuilder split = [store, rendezvous, options](
                                 int new_rank, int new_size, const std::string& key_suffix,
                                 std::chrono::milliseconds timeout,
                                 const std::function<bool()>& parent_aborted) {
    Rendezvous sub = rendezvous;
    sub.key_prefix += key_suffix;
    CommunicationOptions child = options;
    child.timeout = timeout;
    return ConnectSplit(new_rank, new_size, store, sub, child, parent_aborted);
  };
  ring::Planner* const planner_view = planner.get();
  auto comm = ring::CreateRingCommunication(std::move(fabric), std::move(store), options,
                                            std::move(planner), std::move(split));
  if (planner_view != nullptr) {
    hierarchical::Calibrate(*planner_view, *comm, deadline, options.timeout);
  }
  return comm;
}

// How long a split's member waits for the store to say whether another member gave up (a check
// between its waits), and, once its own set-up failed, at most past its deadline to tell the
// others or to read another's reason: a store that does not answer would otherwise hold it
// for the store's timeout each time.
constexpr std::chrono::milliseconds kGaveUpCheckLimit{200};
constexpr std::chrono::milliseconds kNoticeLimit{500};
// How often a split's member asks the store, while it waits, whether another member gave up:
// each ask is a round trip to rank 0's store, made by every waiting member, and the waits poll
// their cancellation every transport::kCancelPoll (about 20 asks a second otherwise).
constexpr std::chrono::milliseconds kGaveUpPoll{200};

// A split's child: Connect under the child's key space, giving up when the parent is aborted or
// when another member gave up. A set-up waits for every member, and a member's Abort reaches the
// others only through the parent's connections, which nobody reads while they set up the child:
// they waited for it until their timeout, then named it as merely missing. So a member whose
// set-up fails, for whatever reason, says so in the store (its error, then a count), and the
// others, polling the count as they poll their parent, raise kAborted naming it.
std::unique_ptr<CollectiveCommunication> ConnectSplit(int rank, int size,
                                                      std::shared_ptr<Store> store,
                                                      const Rendezvous& rendezvous,
                                                      const CommunicationOptions& options,
                                                      const std::function<bool()>& parent_aborted) {
  const std::string why_key = rendezvous.key_prefix + "/gave_up/why";
  const std::string count_key = rendezvous.key_prefix + "/gave_up/count";
  const Clock::time_point deadline = Clock::now() + options.timeout;
  const auto another_gave_up = [store, count_key, deadline] {
    try {
      // A check, not a step of the set-up: a store that does not answer soon says no.
      return cluster::AddBy(*store, count_key, 0,
                            std::min(deadline, Clock::now() + kGaveUpCheckLimit)) > 0;
    } catch (const Error&) {
      return false;  // the set-up's own store operations fail, and say why
    }
  };
  // The poll between the waits asks the store once per kGaveUpPoll, and remembers a yes.
  struct Asked {
    std::mutex mu;
    Clock::time_point next{};  // guarded by mu
    bool gave_up = false;      // guarded by mu
  };
  const auto asked = std::make_shared<Asked>();
  const auto poll = [parent_aborted, another_gave_up, asked] {
    if (parent_aborted()) return true;
    std::lock_guard<std::mutex> lock(asked->mu);
    const Clock::time_point now = Clock::now();
    if (!asked->gave_up && now >= asked->next) {
      asked->next = now + kGaveUpPoll;
      asked->gave_up = another_gave_up();
    }
    return asked->gave_up;
  };
  try {
    return NamingTheRank(
        rank, [&] { return Connect(rank, size, store, rendezvous, options, deadline, poll); });
  } catch (const Error& error) {
    // Telling the others, or reading why another gave up, ends a little after the deadline.
    const Clock::time_point notice_by = std::max(deadline, Clock::now() + kNoticeLimit);
    if (!parent_aborted() && another_gave_up()) {
      std::string why;
      try {
        why = store->Get(why_key,
                         std::chrono::ceil<std::chrono::milliseconds>(notice_by - Clock::now()));
      } catch (const Error& store_error) {
        why = "(its reason could not be read: " + store_error.message() + ")";
      }
      throw Error(ErrorCode::kAborted, "rank " + std::to_string(rank) +
                                           ": split: set-up abandoned by another member: " + why);
    }
    try {
      cluster::SetBy(*store, why_key, error.message(), notice_by);
      cluster::AddBy(*store, count_key, 1, notice_by);
    } catch (const Error&) {
      // Best effort: the others then end at their own timeout.
    }
    throw;
  }
}

}  // namespace

std::string ResolveJobToken(const CommunicationOptions& options) {
  return ResolveJobToken(ClusterSpec{}, options);
}

std::string ResolveJobToken(const ClusterSpec& spec, const CommunicationOptions& options) {
  if (!options.job_token.empty()) return options.job_token;
  if (!spec.job_token.empty()) return spec.job_token;
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

namespace {

// CreateCommunication through `store`, for a set-up that began at `start` (when
// CreateCommunication began making the store, if it did): it ends by start + options.timeout.
std::unique_ptr<CollectiveCommunication> CreateThrough(const ClusterSpec& spec,
                                                       std::shared_ptr<Store> store,
                                                       const CommunicationOptions& given,
                                                       Clock::time_point start) {
  spec.Validate();
  CheckWorldSize(spec);
  if (!store) throw Error(ErrorCode::kInvalidArgument, "CreateCommunication: the store is null");
  const CommunicationOptions options = core::CheckOptions(spec.rank, given);
  const std::string listen_host = AskedListenHost(spec.rank, options);
  const Clock::time_point deadline = start + options.timeout;  // a year at most: no overflow
  // kAuto is RING's TCP fabric with the hierarchical planner (shared memory inside a host, and
  // NCCL inside a host for CUDA tensors where it loads: src/hierarchical/device_plan.h).
  if (options.implementation == Implementation::kNccl) {
#if defined(COLLECTIVES_WITH_NCCL)
    // Fails with Error(kNotSupported) before touching the store when NCCL or a GPU is missing.
    nccl::CheckNcclAlgorithm(spec.rank, options.algorithm);
    nccl::LoadNccl();
    // The generation as for RING below: one key space per communicator built on this store.
    const int64_t generation = cluster::AddBy(
        *store, spec.job_id + "/generation/" + std::to_string(spec.rank), 1, deadline);
    nccl::NcclOptions nccl_options;
    nccl_options.setup_deadline = deadline;
    return nccl::CreateNcclCommunication(spec.rank, spec.world_size, std::move(store),
                                         spec.job_id + "/nccl/" + std::to_string(generation),
                                         options, nccl_options);
#else
    throw Error(ErrorCode::kNotSupported,
                "rank " + std::to_string(spec.rank) +
                    ": the NCCL implementation is not built into this library "
                    "(configure with -DCOLLECTIVES_WITH_NCCL=ON)");
#endif
  }

  // Refused before the store is touched (CreateRingCommunication would, after connecting).
  ring::CheckRingAlgorithm(spec.rank, spec.world_size, options.algorithm);
  CheckJobIdFitsTheHandshake(spec, options);
  // Every rank counts the communicators it has built on this store; building them in the same
  // order on every rank (as collectives require anyway) gives each its own key space.
  const int64_t generation =
      cluster::AddBy(*store, spec.job_id + "/generation/" + std::to_string(spec.rank), 1, deadline);
  Rendezvous rendezvous;
  rendezvous.job_id = spec.job_id;
  rendezvous.token = ResolveJobToken(spec, options);
  // A job that sets no token proves the one its TCP store generated (rank 0) or enrolled for
  // (the other ranks), rather than the empty token every stranger knows.
  if (rendezvous.token.empty()) rendezvous.token = cluster::StoreJobToken(*store);
  rendezvous.key_prefix = spec.job_id + "/" + std::to_string(generation);
  if (!listen_host.empty()) {
    rendezvous.bind_host = listen_host;
  } else if (spec.world_size > 1) {
    rendezvous.bind_host = spec.addresses.empty()
                               ? HostTowardMaster(spec, options.timeout, deadline)
                               : ListedHost(spec, spec.rank);
    cluster::WarnIfLoopbackOnly(spec.rank, "the data listener", rendezvous.bind_host,
                                "name this host's address in TF_CONFIG or MASTER_ADDR, or set "
                                "COLLECTIVES_LISTEN_ADDRESS to it or to 0.0.0.0",
                                deadline);
  }
  return Connect(spec.rank, spec.world_size, std::move(store), rendezvous, options, deadline);
}

}  // namespace

std::unique_ptr<CollectiveCommunication> CreateCommunication(const ClusterSpec& spec,
                                                             const CommunicationOptions& options) {
  const Clock::time_point start = Clock::now();
  spec.Validate();
  CheckWorldSize(spec);  // before rank 0's store keeps a record per rank
  const CommunicationOptions checked = core::CheckOptions(spec.rank, options);
  (void)AskedListenHost(spec.rank, checked);  // refused before rank 0's store is up
  CheckJobIdFitsTheHandshake(spec, checked);
  // Connecting to the store is the set-up's first step: all of the timeout is left for it. It
  // also stays the store's limit per operation, for as long as the store is used.
  std::shared_ptr<Store> store;
  try {
    store = CreateStoreFor(spec, checked.timeout, ResolveJobToken(spec, checked));
  } catch (const Error& error) {
    // The store's words (its server cannot listen, its client could not connect or was
    // refused), which name the store but not the rank.
    throw Error(error.code(), "rank " + std::to_string(spec.rank) + ": " + error.message());
  }
  return NamingTheRank(spec.rank,
                       [&] { return CreateThrough(spec, std::move(store), checked, start); });
}

std::unique_ptr<CollectiveCommunication> CreateCommunication(const ClusterSpec& spec,
                                                             std::shared_ptr<Store> store,
                                                             const CommunicationOptions& options) {
  const Clock::time_point start = Clock::now();
  return NamingTheRank(spec.rank,
                       [&] { return CreateThrough(spec, std::move(store), options, start); });
}

std::unique_ptr<CollectiveCommunication> CollectiveCommunication::Split(int color, int key) {
  (void)color;
  (void)key;
  throw Error(ErrorCode::kNotSupported, "rank " + std::to_string(rank()) + ": " +
                                            ToString(implementation()) +
                                            " communicators cannot be split");
}

namespace {
[[noreturn]] void NotImplemented(const CollectiveCommunication& comm, const char* collective) {
  throw Error(ErrorCode::kNotSupported, "rank " + std::to_string(comm.rank()) + ": " + collective +
                                            ": not implemented by this communicator");
}
}  // namespace

std::shared_ptr<Work> CollectiveCommunication::ReduceAsync(const Tensor&, const Tensor&, ReduceOp,
                                                           int) {
  NotImplemented(*this, "reduce");
}
std::shared_ptr<Work> CollectiveCommunication::GatherAsync(const Tensor&, const Tensor&, int) {
  NotImplemented(*this, "gather");
}
std::shared_ptr<Work> CollectiveCommunication::ScatterAsync(const Tensor&, const Tensor&, int) {
  NotImplemented(*this, "scatter");
}
std::shared_ptr<Work> CollectiveCommunication::AllToAllAsync(const Tensor&, const Tensor&,
                                                             const std::vector<size_t>&,
                                                             const std::vector<size_t>&) {
  NotImplemented(*this, "all_to_all");
}
std::shared_ptr<Work> CollectiveCommunication::SendAsync(const Tensor&, int, int64_t) {
  NotImplemented(*this, "send");
}
std::shared_ptr<Work> CollectiveCommunication::RecvAsync(const Tensor&, int, int64_t) {
  NotImplemented(*this, "recv");
}

}  // namespace collectives
