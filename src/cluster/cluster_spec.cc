// ClusterSpec: parsing TF_CONFIG and the launcher environment variables, and validation.
//
// TF_CONFIG is TensorFlow's JSON. Besides "cluster" and "task" we read one optional top-level
// field of our own, "job_id" (a non-empty string): every rank of a job must agree on it; it is
// this library's extension, TensorFlow ignores unknown top-level fields ("environment",
// "rpc_layer", ...) and so do we.
//
// The environment is read in this order, the first source present winning:
//   1. TF_CONFIG (an empty or blank TF_CONFIG counts as unset);
//   2. RANK and WORLD_SIZE (torchrun), with MASTER_ADDR (default 127.0.0.1) and MASTER_PORT
//      (required when WORLD_SIZE > 1);
//   3. OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (mpirun), with MASTER_* as above; without
//      MASTER_PORT, rank 0 publishes its store's address and a job token through mpirun's PMIx
//      server (src/cluster/launchers.h);
//   4. SLURM_PROCID with SLURM_STEP_ID (srun), SLURM_STEP_NUM_TASKS or SLURM_NTASKS, the store
//      on the first host of the node list at a port derived from the job and step ids, unless
//      MASTER_ADDR / MASTER_PORT say otherwise;
//   5. nothing: a single rank.
// TF_CONFIG beside RANK / WORLD_SIZE that disagree with it is refused as ambiguous.
// COLLECTIVES_JOB_ID, when set, gives job_id; if TF_CONFIG also names one, they must agree.
#include <cctype>
#include <chrono>
#include <cstdint>
#include <climits>
#include <cstdlib>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/launchers.h"
#include "src/core/text.h"

namespace collectives {
namespace {

using Json = nlohmann::json;
using cluster::FormatHostPort;
using cluster::HostPort;
using cluster::ParseHostPort;

constexpr char kChief[] = "chief";
constexpr char kWorker[] = "worker";
constexpr char kPs[] = "ps";
constexpr char kEvaluator[] = "evaluator";
constexpr const char* kRoles[] = {kChief, kWorker, kPs, kEvaluator};

bool IsRole(std::string_view name) {
  for (const char* role : kRoles) {
    if (name == role) return true;
  }
  return false;
}

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

// `text` quoted, its control bytes and ill-formed UTF-8 escaped and cut after 256 bytes
// (core::OneLine): a value, a role or a host from TF_CONFIG or a variable may hold any byte.
std::string Quote(std::string_view text) {
  std::string out = "'";  // built by append: GCC 12 warns (-Wrestrict) on "'" + string
  out.append(core::OneLine(text, 256));
  out += '\'';
  return out;
}

// `value` checked as a host by CheckHost and returned without brackets; `name` ("environment
// variable MASTER_ADDR", "ClusterSpec: master_addr") heads the message of a refusal.
std::string CheckedHost(const std::string& name, std::string_view value,
                        std::string_view port_remedy) {
  std::string why;
  std::optional<std::string> host = cluster::CheckHost(value, port_remedy, &why);
  if (!host) {
    Invalid(name + "=" + Quote(value) + " is not a host name or address: " + why);
  }
  return std::move(*host);
}

constexpr char kStorePort[] = "the store listens on master_port (MASTER_PORT)";

// One "host:port" entry of cluster.<role>.
struct TaskAddress {
  std::string field;  // "cluster.worker[2]"
  std::string text;   // as written
  HostPort parsed;
};

// Reads cluster.<role> (absent: empty list).
std::vector<TaskAddress> ReadRole(const Json& cluster, const char* role) {
  std::vector<TaskAddress> out;
  auto it = cluster.find(role);
  if (it == cluster.end()) return out;
  std::string field = std::string("cluster.") + role;
  if (!it->is_array()) {
    Invalid("TF_CONFIG field " + Quote(field) + " must be an array of \"host:port\" strings, got " +
            it->type_name());
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& entry = (*it)[i];
    std::string entry_field = field + "[" + std::to_string(i) + "]";
    if (!entry.is_string()) {
      Invalid("TF_CONFIG field " + Quote(entry_field) + " must be a \"host:port\" string, got " +
              entry.type_name());
    }
    std::string text = entry.get<std::string>();
    std::string why;
    std::optional<HostPort> parsed = ParseHostPort(text, &why);
    if (!parsed) {
      Invalid("TF_CONFIG field " + Quote(entry_field) + " = " + Quote(text) +
              " is not a valid host:port: " + why);
    }
    out.push_back(TaskAddress{entry_field, std::move(text), std::move(*parsed)});
  }
  return out;
}

// Host names compare case-insensitively; addresses are otherwise compared as written.
std::string AddressKey(const HostPort& address) {
  std::string host = address.host;
  for (char& c : host) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return FormatHostPort(host, address.port);
}

bool IsBlank(const std::string& text) {
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// A decimal integer in [0, INT_MAX], digits only.
int ParseNonNegativeInt(const std::string& name, const std::string& value) {
  bool ok = !value.empty() && value.size() <= 10;
  long long parsed = 0;
  // Only up to 10 digits are read: 20 would overflow a long long.
  for (size_t i = 0; ok && i < value.size(); ++i) {
    const char c = value[i];
    if (c < '0' || c > '9') {
      ok = false;
      break;
    }
    parsed = parsed * 10 + (c - '0');
  }
  if (!ok || parsed > INT_MAX) {
    Invalid("environment variable " + name + "=" + Quote(value) + " is not a non-negative integer");
  }
  return static_cast<int>(parsed);
}

const std::string* Find(const std::map<std::string, std::string>& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

// RANK/WORLD_SIZE or OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE, with MASTER_ADDR/MASTER_PORT.
// How long the ranks of an mpirun job wait for each other in the PMIx fence that tells them rank
// 0's store: as long as a communicator's default set-up.
constexpr std::chrono::seconds kPmixTimeout{300};

// `pmix`: a job of mpirun's, which may meet through its PMIx server when MASTER_PORT is unset.
ClusterSpec FromRankVariables(const std::map<std::string, std::string>& env, const char* rank_name,
                              const char* size_name, bool pmix) {
  const std::string* rank_value = Find(env, rank_name);
  const std::string* size_value = Find(env, size_name);
  if (rank_value == nullptr) {
    Invalid(std::string("environment variable ") + size_name + " is set but " + rank_name +
            " is not");
  }
  if (size_value == nullptr) {
    Invalid(std::string("environment variable ") + rank_name + " is set but " + size_name +
            " is not");
  }
  ClusterSpec spec;
  spec.rank = ParseNonNegativeInt(rank_name, *rank_value);
  spec.world_size = ParseNonNegativeInt(size_name, *size_value);
  if (spec.world_size < 1) {
    Invalid(std::string("environment variable ") + size_name + "=" + Quote(*size_value) +
            " must be at least 1");
  }
  if (spec.rank >= spec.world_size) {
    Invalid(std::string("environment variable ") + rank_name + "=" + Quote(*rank_value) +
            " is out of range for " + size_name + "=" + *size_value + " (valid ranks are 0.." +
            std::to_string(spec.world_size - 1) + ")");
  }
  spec.task_type = kWorker;
  spec.task_index = spec.rank;

  if (const std::string* addr = Find(env, "MASTER_ADDR")) {
    spec.master_addr =
        CheckedHost("environment variable MASTER_ADDR", *addr, "put the port in MASTER_PORT");
  }
  if (const std::string* port = Find(env, "MASTER_PORT")) {
    // "0" is a port here: a single rank needs none. More ranks need rank 0's store port.
    std::optional<uint16_t> parsed =
        *port == "0" ? std::optional<uint16_t>(0) : cluster::ParsePort(*port);
    if (!parsed) {
      Invalid("environment variable MASTER_PORT=" + Quote(*port) +
              " is not a port number in 1..65535 (or 0 when " + size_name + "=1)");
    }
    if (*parsed == 0 && spec.world_size > 1) {
      Invalid(std::string("environment variable MASTER_PORT='0' is valid only when ") + size_name +
              "=1; " + size_name + "=" + *size_value + " needs the port of rank 0's store");
    }
    spec.master_port = *parsed;
  } else if (spec.world_size > 1 && pmix && cluster::StartedByPmix(env)) {
    // mpirun with nothing exported: rank 0 publishes its store's address through PMIx.
    const std::string* addr = Find(env, "MASTER_ADDR");
    cluster::PmixStore store = cluster::ExchangeThroughPmix(
        spec.rank, spec.world_size, addr != nullptr ? spec.master_addr : std::string(),
        kPmixTimeout);
    spec.master_addr = store.master_addr;
    spec.master_port = store.master_port;
    spec.job_token = store.job_token;
    spec.job_id = "mpirun-" + store.nspace;
  } else if (spec.world_size > 1) {
    Invalid(std::string("environment variable MASTER_PORT is required when ") + size_name + "=" +
            *size_value + " > 1 (rank 0 hosts the rendezvous store on it)" +
            (pmix ? "; mpirun started this process without a PMIx server (PMIX_NAMESPACE, "
                    "PMIX_RANK) through which the ranks could meet instead"
                  : ""));
  }
  return spec;
}

// A decimal id of Slurm's (job or step), digits only.
uint64_t ParseSlurmId(const char* name, const std::string& value) {
  if (value.empty() || value.size() > 18 ||
      value.find_first_not_of("0123456789") != std::string::npos) {
    Invalid(std::string("environment variable ") + name + "=" + Quote(value) +
            " is not a Slurm id (digits)");
  }
  return std::stoull(value);
}

// srun: SLURM_PROCID of SLURM_STEP_NUM_TASKS (else SLURM_NTASKS); the store on the first host of
// the step's node list, at a port derived from the job and step ids, unless MASTER_ADDR and
// MASTER_PORT say otherwise.
ClusterSpec FromSlurm(const std::map<std::string, std::string>& env) {
  const char* size_name =
      Find(env, "SLURM_STEP_NUM_TASKS") != nullptr ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  if (Find(env, size_name) == nullptr) {
    Invalid("environment variable SLURM_PROCID is set (an srun job step) but neither "
            "SLURM_STEP_NUM_TASKS nor SLURM_NTASKS says how many tasks it has");
  }
  std::map<std::string, std::string> ranks = {{"SLURM_PROCID", env.at("SLURM_PROCID")},
                                              {size_name, env.at(size_name)}};
  for (const char* name : {"MASTER_ADDR", "MASTER_PORT"}) {
    if (const std::string* value = Find(env, name)) ranks.emplace(name, *value);
  }
  const std::string* job = Find(env, "SLURM_JOB_ID");
  if (job == nullptr) job = Find(env, "SLURM_JOBID");
  const std::string* step = Find(env, "SLURM_STEP_ID");
  if (Find(env, "MASTER_ADDR") == nullptr) {
    const char* list_name = nullptr;
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (Find(env, name) != nullptr) {
        list_name = name;
        break;
      }
    }
    if (list_name != nullptr) {
      const std::vector<std::string> hosts = cluster::ExpandSlurmHostList(
          env.at(list_name), std::string("environment variable ") + list_name);
      ranks["MASTER_ADDR"] = hosts.front();
    } else if (ParseNonNegativeInt(size_name, env.at(size_name)) > 1) {
      Invalid("an srun job step of several tasks needs the store's host: none of "
              "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST and MASTER_ADDR is set");
    }
  }
  if (Find(env, "MASTER_PORT") == nullptr) {
    if (job != nullptr) {
      const uint64_t step_id = ParseSlurmId("SLURM_STEP_ID", *step);
      ranks["MASTER_PORT"] = std::to_string(
          cluster::SlurmDefaultPort(ParseSlurmId("SLURM_JOB_ID", *job), step_id));
    } else if (ParseNonNegativeInt(size_name, env.at(size_name)) > 1) {
      Invalid("an srun job step of several tasks needs the store's port: neither SLURM_JOB_ID "
              "(from which it is derived) nor MASTER_PORT is set");
    }
  }
  ClusterSpec spec = FromRankVariables(ranks, "SLURM_PROCID", size_name, /*pmix=*/false);
  if (job != nullptr) spec.job_id = "slurm-" + *job + "." + *step;
  return spec;
}

}  // namespace

ClusterSpec ClusterSpec::FromTfConfig(std::string_view json) {
  // The parser takes a NUL byte for the end of the text: "{...}\0junk" would pass, the rest unread.
  if (const size_t nul = json.find('\0'); nul != std::string_view::npos) {
    Invalid("TF_CONFIG is not valid JSON (error at byte " + std::to_string(nul + 1) +
            "): a NUL byte, which JSON text holds nowhere");
  }
  Json root;
  try {
    root = Json::parse(json.begin(), json.end());
  } catch (const Json::parse_error& e) {
    // Its "last read" is the token as written: all of an unterminated string, any byte.
    Invalid("TF_CONFIG is not valid JSON (error at byte " + std::to_string(e.byte) +
            "): " + core::OneLine(e.what(), 512));
  } catch (const Json::exception& e) {
    // A number out of range ("1e999") is not a parse_error (tests/fuzz/tf_config).
    Invalid(std::string("TF_CONFIG is not valid JSON: ") + core::OneLine(e.what(), 512));
  }
  if (!root.is_object()) {
    Invalid(std::string("TF_CONFIG must be a JSON object, got ") + root.type_name());
  }

  // cluster
  auto cluster_it = root.find("cluster");
  if (cluster_it == root.end()) Invalid("TF_CONFIG is missing the field 'cluster'");
  if (!cluster_it->is_object()) {
    Invalid(std::string("TF_CONFIG field 'cluster' must be an object, got ") +
            cluster_it->type_name());
  }
  for (const auto& [role, unused] : cluster_it->items()) {
    if (!IsRole(role)) {
      Invalid("TF_CONFIG field " + Quote("cluster." + role) + ": role " + Quote(role) +
              " is not supported; the roles are 'chief', 'worker', 'ps' and 'evaluator'");
    }
  }
  std::vector<TaskAddress> chiefs = ReadRole(*cluster_it, kChief);
  std::vector<TaskAddress> workers = ReadRole(*cluster_it, kWorker);
  std::vector<TaskAddress> servers = ReadRole(*cluster_it, kPs);
  std::vector<TaskAddress> evaluators = ReadRole(*cluster_it, kEvaluator);
  if (chiefs.size() > 1) {
    Invalid("TF_CONFIG field 'cluster.chief' lists " + std::to_string(chiefs.size()) +
            " tasks; at most one chief is allowed");
  }
  if (evaluators.size() > 1) {
    Invalid("TF_CONFIG field 'cluster.evaluator' lists " + std::to_string(evaluators.size()) +
            " tasks; at most one evaluator is allowed");
  }
  std::vector<TaskAddress> ranks = chiefs;  // rank order: the chief, then the workers
  ranks.insert(ranks.end(), workers.begin(), workers.end());
  std::vector<const TaskAddress*> tasks;  // every task of every role
  for (const std::vector<TaskAddress>* list : {&ranks, &servers, &evaluators}) {
    for (const TaskAddress& task : *list) tasks.push_back(&task);
  }
  std::map<std::string, const TaskAddress*> seen;  // address -> its first task
  for (const TaskAddress* task : tasks) {
    auto [it, inserted] = seen.emplace(AddressKey(task->parsed), task);
    if (!inserted) {
      Invalid("TF_CONFIG fields " + Quote(it->second->field) + " and " + Quote(task->field) +
              " have the same address " + Quote(task->text));
    }
  }

  // task
  auto task_it = root.find("task");
  if (task_it == root.end()) Invalid("TF_CONFIG is missing the field 'task'");
  if (!task_it->is_object()) {
    Invalid(std::string("TF_CONFIG field 'task' must be an object, got ") + task_it->type_name());
  }
  auto type_it = task_it->find("type");
  if (type_it == task_it->end()) Invalid("TF_CONFIG is missing the field 'task.type'");
  if (!type_it->is_string()) {
    Invalid(std::string("TF_CONFIG field 'task.type' must be a string, got ") +
            type_it->type_name());
  }
  std::string type = type_it->get<std::string>();
  if (!IsRole(type)) {
    Invalid("TF_CONFIG field 'task.type': role " + Quote(type) +
            " is not supported; the roles are 'chief', 'worker', 'ps' and 'evaluator'");
  }
  // An evaluator's TF_CONFIG may list only itself; every other task belongs to a training job.
  if (type != kEvaluator && ranks.empty()) {
    Invalid(
        "TF_CONFIG field 'cluster' lists no chief or worker: 'cluster.worker' is empty or "
        "missing and there is no 'cluster.chief'");
  }
  auto index_it = task_it->find("index");
  if (index_it == task_it->end()) Invalid("TF_CONFIG is missing the field 'task.index'");
  if (!index_it->is_number_integer()) {
    // An array or object is named by its type alone: dump() walks it recursively (deep nesting
    // overflows the stack) and would copy all of it into the message.
    Invalid(std::string("TF_CONFIG field 'task.index' must be an integer, got ") +
            index_it->type_name() +
            (index_it->is_structured() ? "" : " " + core::OneLine(index_it->dump(), 64)));
  }
  const std::vector<TaskAddress>& role_list = type == kChief    ? chiefs
                                              : type == kWorker ? workers
                                              : type == kPs     ? servers
                                                                : evaluators;
  bool in_range = index_it->is_number_unsigned()
                      ? index_it->get<uint64_t>() < role_list.size()
                      : index_it->get<int64_t>() >= 0 &&
                            static_cast<uint64_t>(index_it->get<int64_t>()) < role_list.size();
  if (!in_range) {
    if (role_list.empty()) {
      Invalid("TF_CONFIG field 'task.index' = " + index_it->dump() + " is out of range: 'cluster." +
              type + "' lists no tasks");
    }
    Invalid("TF_CONFIG field 'task.index' = " + index_it->dump() + " is out of range for " +
            Quote(type) + ": valid indices are 0.." + std::to_string(role_list.size() - 1));
  }
  int index = static_cast<int>(index_it->get<int64_t>());

  ClusterSpec spec;
  spec.task_type = type;
  spec.task_index = index;
  if (type == kChief || type == kWorker) {
    spec.world_size = static_cast<int>(ranks.size());
    spec.rank = type == kChief ? 0 : static_cast<int>(chiefs.size()) + index;
    spec.master_addr = ranks[0].parsed.host;
    spec.master_port = ranks[0].parsed.port;
    for (const TaskAddress& address : ranks) spec.addresses.push_back(address.text);
  }  // else a job of one rank of its own: see InTrainingCollective
  for (const auto& [role, list] : {std::pair{kChief, &chiefs}, std::pair{kWorker, &workers},
                                   std::pair{kPs, &servers}, std::pair{kEvaluator, &evaluators}}) {
    if (list->empty()) continue;
    std::vector<std::string>& out = spec.cluster[role];
    for (const TaskAddress& task : *list) out.push_back(task.text);
  }

  if (auto job_it = root.find("job_id"); job_it != root.end()) {
    if (!job_it->is_string()) {
      Invalid(std::string("TF_CONFIG field 'job_id' must be a string, got ") + job_it->type_name());
    }
    spec.job_id = job_it->get<std::string>();
    if (spec.job_id.empty()) Invalid("TF_CONFIG field 'job_id' must not be empty");
  }
  spec.Validate();
  return spec;
}

ClusterSpec ClusterSpec::FromEnvironment() {
  static const char* const kNames[] = {"TF_CONFIG",
                                       "RANK",
                                       "WORLD_SIZE",
                                       "OMPI_COMM_WORLD_RANK",
                                       "OMPI_COMM_WORLD_SIZE",
                                       "SLURM_PROCID",
                                       "SLURM_NTASKS",
                                       "SLURM_STEP_NUM_TASKS",
                                       "SLURM_STEP_ID",
                                       "SLURM_JOB_ID",
                                       "SLURM_JOBID",
                                       "SLURM_STEP_NODELIST",
                                       "SLURM_JOB_NODELIST",
                                       "SLURM_NODELIST",
                                       "PMIX_NAMESPACE",
                                       "PMIX_RANK",
                                       "MASTER_ADDR",
                                       "MASTER_PORT",
                                       "COLLECTIVES_JOB_ID",
                                       "COLLECTIVES_JOB_TOKEN",
                                       "COLLECTIVES_STORE_LISTEN_ADDRESS"};
  std::map<std::string, std::string> env;
  for (const char* name : kNames) {
    if (const char* value = std::getenv(name)) env.emplace(name, value);
  }
  return FromEnvironment(env);
}

namespace {

// TF_CONFIG beside RANK / WORLD_SIZE that name another rank or size: two launchers' variables,
// and no way to know which is meant.
void CheckAgainstRankVariables(const ClusterSpec& spec, const std::map<std::string, std::string>& env) {
  const std::string* rank = Find(env, "RANK");
  const std::string* size = Find(env, "WORLD_SIZE");
  if (rank == nullptr && size == nullptr) return;
  const bool differs = (rank != nullptr && *rank != std::to_string(spec.rank)) ||
                       (size != nullptr && *size != std::to_string(spec.world_size));
  if (differs) {
    Invalid("TF_CONFIG makes this process rank " + std::to_string(spec.rank) + " of " +
            std::to_string(spec.world_size) + ", but RANK=" + Quote(rank ? *rank : "") +
            " WORLD_SIZE=" + Quote(size ? *size : "") +
            " say otherwise: two launchers' variables; unset one of them");
  }
}

}  // namespace

ClusterSpec ClusterSpec::FromEnvironment(const std::map<std::string, std::string>& env) {
  ClusterSpec spec;
  bool job_id_from_tf_config = false;
  const std::string* tf_config = Find(env, "TF_CONFIG");
  if (tf_config != nullptr && !IsBlank(*tf_config)) {
    spec = FromTfConfig(*tf_config);
    job_id_from_tf_config = spec.job_id != ClusterSpec().job_id;
  } else if (Find(env, "RANK") != nullptr || Find(env, "WORLD_SIZE") != nullptr) {
    spec = FromRankVariables(env, "RANK", "WORLD_SIZE", /*pmix=*/false);
  } else if (Find(env, "OMPI_COMM_WORLD_RANK") != nullptr ||
             Find(env, "OMPI_COMM_WORLD_SIZE") != nullptr) {
    spec = FromRankVariables(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", /*pmix=*/true);
  } else if (Find(env, "SLURM_PROCID") != nullptr && Find(env, "SLURM_STEP_ID") != nullptr) {
    // An srun job step; a batch script (SLURM_PROCID without a step) is a single rank.
    spec = FromSlurm(env);
  }
  if (tf_config != nullptr && !IsBlank(*tf_config)) CheckAgainstRankVariables(spec, env);
  if (const std::string* token = Find(env, "COLLECTIVES_JOB_TOKEN")) spec.job_token = *token;
  const std::string* listen = Find(env, "COLLECTIVES_STORE_LISTEN_ADDRESS");
  if (listen != nullptr && !listen->empty()) {  // empty: unset, as for COLLECTIVES_LISTEN_ADDRESS
    spec.store_listen_address =
        CheckedHost("environment variable COLLECTIVES_STORE_LISTEN_ADDRESS", *listen, kStorePort);
  }
  if (const std::string* job_id = Find(env, "COLLECTIVES_JOB_ID")) {
    if (job_id->empty()) Invalid("environment variable COLLECTIVES_JOB_ID is set but empty");
    if (job_id_from_tf_config && *job_id != spec.job_id) {
      Invalid("environment variable COLLECTIVES_JOB_ID=" + Quote(*job_id) +
              " disagrees with TF_CONFIG field 'job_id' = " + Quote(spec.job_id));
    }
    spec.job_id = *job_id;
  }
  spec.Validate();
  return spec;
}

void ClusterSpec::Validate() const {
  if (world_size < 1) {
    Invalid("ClusterSpec: world_size=" + std::to_string(world_size) + " must be at least 1");
  }
  if (rank < 0 || rank >= world_size) {
    Invalid("ClusterSpec: rank=" + std::to_string(rank) +
            " is out of range for world_size=" + std::to_string(world_size) +
            " (valid ranks are 0.." + std::to_string(world_size - 1) + ")");
  }
  if (world_size > 1 && master_port == 0) {
    Invalid("ClusterSpec: master_port is 0 but world_size=" + std::to_string(world_size) +
            " > 1 needs the port of rank 0's store");
  }
  if (world_size > 1 && master_addr.empty()) {
    Invalid("ClusterSpec: master_addr is empty but world_size=" + std::to_string(world_size) +
            " > 1 needs the address of rank 0's store");
  }
  if (!master_addr.empty()) {
    (void)CheckedHost("ClusterSpec: master_addr", master_addr, "put the port in master_port");
  }
  if (!store_listen_address.empty()) {
    (void)CheckedHost("ClusterSpec: store_listen_address", store_listen_address, kStorePort);
  }
  if (!addresses.empty()) {
    if (addresses.size() != static_cast<size_t>(world_size)) {
      Invalid("ClusterSpec: addresses lists " + std::to_string(addresses.size()) +
              " entries but world_size=" + std::to_string(world_size));
    }
    for (size_t i = 0; i < addresses.size(); ++i) {
      std::string why;
      if (!ParseHostPort(addresses[i], &why)) {
        Invalid("ClusterSpec: addresses[" + std::to_string(i) + "] = " + Quote(addresses[i]) +
                " is not a valid host:port: " + why);
      }
    }
  }
  if (task_index < 0) {
    Invalid("ClusterSpec: task_index=" + std::to_string(task_index) + " is negative");
  }
  if (!IsRole(task_type)) {
    Invalid("ClusterSpec: task_type=" + Quote(task_type) +
            " is not a role; the roles are 'chief', 'worker', 'ps' and 'evaluator'");
  }
  if (!InTrainingCollective() && world_size != 1) {
    Invalid("ClusterSpec: a " + Quote(task_type) + " task is not part of the training " +
            "collective, so its world_size must be 1, not " + std::to_string(world_size));
  }
  for (const auto& [role, list] : cluster) {
    if (!IsRole(role)) {
      Invalid("ClusterSpec: cluster has role " + Quote(role) +
              "; the roles are 'chief', 'worker', 'ps' and 'evaluator'");
    }
    for (size_t i = 0; i < list.size(); ++i) {
      std::string why;
      if (!ParseHostPort(list[i], &why)) {
        Invalid("ClusterSpec: cluster." + role + "[" + std::to_string(i) + "] = " +
                Quote(list[i]) + " is not a valid host:port: " + why);
      }
    }
  }
  if (job_id.empty()) Invalid("ClusterSpec: job_id is empty");
}

bool ClusterSpec::InTrainingCollective() const {
  return task_type == kChief || task_type == kWorker;
}

}  // namespace collectives
