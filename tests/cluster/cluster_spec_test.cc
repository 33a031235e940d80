// Tests of ClusterSpec: TF_CONFIG parsing, the environment sources, Validate, and "host:port".
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "collectives/cluster.h"
#include "collectives/errors.h"
#include "src/cluster/host_port.h"
#include "src/cluster/launchers.h"
#include "tests/scoped_env.h"

namespace collectives {
namespace {

using Env = std::map<std::string, std::string>;
using testing::ScopedEnv;

// Runs `body`, expects Error(kInvalidArgument) whose message contains every one of `parts`.
template <typename Body>
void ExpectInvalid(Body body, std::initializer_list<std::string> parts) {
  try {
    body();
    ADD_FAILURE() << "expected Error(kInvalidArgument) mentioning '" << *parts.begin() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(e.message().find(part), std::string::npos)
          << "message '" << e.message() << "' lacks '" << part << "'";
    }
  }
}

void ExpectBadTfConfig(const std::string& json, std::initializer_list<std::string> parts) {
  SCOPED_TRACE(json);
  ExpectInvalid([&] { ClusterSpec::FromTfConfig(json); }, parts);
}

void ExpectBadEnv(const Env& env, std::initializer_list<std::string> parts) {
  ExpectInvalid([&] { ClusterSpec::FromEnvironment(env); }, parts);
}

// ---- TF_CONFIG, good ----

TEST(TfConfigTest, ChiefAndWorkersChiefIsRankZero) {
  const char* json = R"({"cluster": {"chief": ["c0:2222"], "worker": ["w0:2223", "w1:2224"]},
                         "task": {"type": "chief", "index": 0}})";
  ClusterSpec spec = ClusterSpec::FromTfConfig(json);
  EXPECT_EQ(spec.rank, 0);
  EXPECT_EQ(spec.world_size, 3);
  EXPECT_EQ(spec.master_addr, "c0");
  EXPECT_EQ(spec.master_port, 2222);
  EXPECT_EQ(spec.addresses, (std::vector<std::string>{"c0:2222", "w0:2223", "w1:2224"}));
  EXPECT_EQ(spec.task_type, "chief");
  EXPECT_EQ(spec.task_index, 0);
  EXPECT_EQ(spec.job_id, "collectives");
}

TEST(TfConfigTest, WorkersFollowTheChiefInListOrder) {
  const char* json = R"({"cluster": {"worker": ["w0:2223", "w1:2224"], "chief": ["c0:2222"]},
                         "task": {"type": "worker", "index": 1}})";
  ClusterSpec spec = ClusterSpec::FromTfConfig(json);
  EXPECT_EQ(spec.rank, 2);
  EXPECT_EQ(spec.world_size, 3);
  EXPECT_EQ(spec.task_type, "worker");
  EXPECT_EQ(spec.task_index, 1);
  EXPECT_EQ(spec.master_addr, "c0");
  EXPECT_EQ(spec.master_port, 2222);
}

TEST(TfConfigTest, WorkersOnlyWorkerZeroHostsTheStore) {
  const char* json = R"({"cluster": {"worker": ["10.0.0.1:5000", "10.0.0.2:5001", "h3:1"]},
                         "task": {"type": "worker", "index": 2},
                         "environment": "cloud", "rpc_layer": "grpc"})";
  ClusterSpec spec = ClusterSpec::FromTfConfig(json);
  EXPECT_EQ(spec.rank, 2);
  EXPECT_EQ(spec.world_size, 3);
  EXPECT_EQ(spec.master_addr, "10.0.0.1");
  EXPECT_EQ(spec.master_port, 5000);
  EXPECT_EQ(spec.addresses.size(), 3u);
}

TEST(TfConfigTest, SingleWorker) {
  ClusterSpec spec = ClusterSpec::FromTfConfig(
      R"({"cluster": {"worker": ["localhost:1"]}, "task": {"type": "worker", "index": 0}})");
  EXPECT_EQ(spec.rank, 0);
  EXPECT_EQ(spec.world_size, 1);
}

TEST(TfConfigTest, Ipv6AddressesInBrackets) {
  const char* json = R"({"cluster": {"worker": ["[::1]:7000", "[fe80::2]:7001"]},
                         "task": {"type": "worker", "index": 1}})";
  ClusterSpec spec = ClusterSpec::FromTfConfig(json);
  EXPECT_EQ(spec.master_addr, "::1");
  EXPECT_EQ(spec.master_port, 7000);
  EXPECT_EQ(spec.addresses[1], "[fe80::2]:7001");
  EXPECT_EQ(spec.rank, 1);
}

TEST(TfConfigTest, JobIdExtension) {
  ClusterSpec spec = ClusterSpec::FromTfConfig(
      R"({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0},
          "job_id": "run-42"})");
  EXPECT_EQ(spec.job_id, "run-42");
}

// ---- TF_CONFIG, bad ----

TEST(TfConfigTest, NotJsonNamesThePosition) {
  ExpectBadTfConfig(R"({"cluster": )", {"not valid JSON", "byte"});
  ExpectBadTfConfig("nonsense", {"not valid JSON", "byte 2", "line 1, column 2"});
  // A number beyond double range is nlohmann's out_of_range, not a parse_error (found by fuzzing).
  ExpectBadTfConfig("1e999", {"not valid JSON"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1e999}})",
                    {"not valid JSON"});
}

// The parser ends the text at a NUL byte, so a NUL anywhere is refused: what followed it would
// pass unread.
TEST(TfConfigTest, ANulByteIsRefusedWhereverItIs) {
  const std::string json =
      R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})";
  ExpectBadTfConfig(json + '\0' + "junk",
                    {"not valid JSON", "byte " + std::to_string(json.size() + 1), "NUL"});
  ExpectBadTfConfig(json + '\0', {"not valid JSON", "NUL"});
  ExpectBadTfConfig(std::string(1, '\0') + json, {"not valid JSON", "byte 1", "NUL"});
}

TEST(TfConfigTest, NotAnObject) {
  ExpectBadTfConfig(R"(["a:1"])", {"JSON object", "array"});
  ExpectBadTfConfig("42", {"JSON object", "number"});
}

TEST(TfConfigTest, MissingFields) {
  ExpectBadTfConfig(R"({"task": {"type": "worker", "index": 0}})", {"'cluster'"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}})", {"'task'"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}})", {"'task.type'"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}})",
                    {"'task.index'"});
}

TEST(TfConfigTest, WrongTypes) {
  ExpectBadTfConfig(R"({"cluster": ["a:1"], "task": {"type": "worker", "index": 0}})",
                    {"'cluster'", "object", "array"});
  ExpectBadTfConfig(R"({"cluster": {"worker": "a:1"}, "task": {"type": "worker", "index": 0}})",
                    {"'cluster.worker'", "array", "string"});
  ExpectBadTfConfig(
      R"({"cluster": {"worker": ["a:1", 7]}, "task": {"type": "worker", "index": 0}})",
      {"'cluster.worker[1]'", "string", "number"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": "worker"})", {"'task'", "object"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": 1, "index": 0}})",
                    {"'task.type'", "string"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": "0"}})",
                    {"'task.index'", "integer"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0.5}})",
                    {"'task.index'", "integer"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0},
                        "job_id": 3})",
                    {"'job_id'", "string"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0},
                        "job_id": ""})",
                    {"'job_id'", "empty"});
}

// An index of another type is shown cut short, an array or an object by its type alone, never
// walked: dumping 200000 nested arrays would overflow the stack (SIGSEGV), and a string of 1 MiB
// would make a message of 1 MiB.
TEST(TfConfigTest, AnIndexOfAnotherTypeIsShownShortAndNotWalked) {
  const std::string head =
      R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": )";
  const std::pair<std::string, std::string> cases[] = {
      {std::string(200000, '[') + std::string(200000, ']'), "got array"},
      {R"({"a": 1})", "got object"},
      {'"' + std::string(1 << 20, 'x') + '"', "got string \"xxx"},
  };
  for (const auto& [index, part] : cases) {
    try {
      ClusterSpec::FromTfConfig(head + index + "}}");
      ADD_FAILURE() << "an index of " << index.size() << " bytes was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("'task.index' must be an integer, " + part), std::string::npos)
          << e.message().substr(0, 200);
      EXPECT_LT(e.message().size(), 200u) << e.message().substr(0, 200);
    }
  }
}

TEST(TfConfigTest, NoTasks) {
  ExpectBadTfConfig(R"({"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}})",
                    {"'cluster.worker'", "no 'cluster.chief'"});
  ExpectBadTfConfig(R"({"cluster": {}, "task": {"type": "worker", "index": 0}})",
                    {"'cluster.worker'"});
}

TEST(TfConfigTest, MoreThanOneChief) {
  ExpectBadTfConfig(R"({"cluster": {"chief": ["a:1", "b:1"], "worker": ["c:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.chief'", "at most one chief"});
}

TEST(TfConfigTest, IndexOutOfRangeSaysTheRange) {
  ExpectBadTfConfig(
      R"({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}})",
      {"'task.index'", "0..1"});
  ExpectBadTfConfig(
      R"({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": -1}})",
      {"'task.index'", "0..1"});
  ExpectBadTfConfig(R"({"cluster": {"chief": ["a:1"]}, "task": {"type": "chief", "index": 1}})",
                    {"'task.index'", "0..0"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}})",
                    {"'task.index'", "'cluster.chief' lists no tasks"});
}

TEST(TfConfigTest, DuplicateAddressesNameBothPositions) {
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1", "b:2", "a:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.worker[0]'", "'cluster.worker[2]'", "'a:1'"});
  ExpectBadTfConfig(R"({"cluster": {"chief": ["Host:1"], "worker": ["host:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.chief[0]'", "'cluster.worker[0]'"});
}

TEST(TfConfigTest, MalformedHostPort) {
  const char* cases[][2] = {
      {"a", "missing port"},       {"a:", "missing port"},  {":80", "empty host"},
      {"a:0", "1..65535"},         {"a:65536", "1..65535"}, {"a:-1", "1..65535"},
      {"a:8x", "1..65535"},        {"::1:80", "brackets"},  {"[::1]", "missing port"},
      {"[::1:80", "unterminated"}, {"[]:80", "empty host"}, {"a b:80", "character"},
  };
  for (const auto& [address, reason] : cases) {
    std::string json = std::string(R"({"cluster": {"worker": ["ok:1", ")") + address +
                       R"("]}, "task": {"type": "worker", "index": 0}})";
    ExpectBadTfConfig(json, {"'cluster.worker[1]'", "host:port", reason});
  }
}

// A NUL or control byte, or '/', in a host is refused: "a\0x:1" and "a\0y:1" would pass the
// duplicate check, then both reach the resolver as "a". The message shows the byte escaped.
// Brackets hold an IPv6 address only.
TEST(TfConfigTest, ControlBytesSlashesAndBracketedNamesAreRefused) {
  const char* cases[][2] = {
      {"a/b:80", "'/'"},
      {"a\\u0001:80", "control character"},
      {"[node0]:80", "IPv6 address only"},
      {"[1.2.3.4]:80", "IPv6 address only"},
  };
  for (const auto& [address, reason] : cases) {
    std::string json = std::string(R"({"cluster": {"worker": ["ok:1", ")") + address +
                       R"("]}, "task": {"type": "worker", "index": 0}})";
    ExpectBadTfConfig(json, {"'cluster.worker[1]'", "host:port", reason});
  }
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a\u0000x:1", "a\u0000y:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.worker[0]'", "'a\\x00x:1'", "NUL"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["ok:1", "b\u001b[2J:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.worker[1]'", "'b\\x1b[2J:1'", "control character"});
}

TEST(TfConfigTest, UnknownRoles) {
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"], "master": ["m:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.master'", "'chief', 'worker', 'ps' and 'evaluator'"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "master", "index": 0}})",
                    {"'task.type'", "'master'", "'chief', 'worker', 'ps' and 'evaluator'"});
}

// The four roles: chief and workers form the training collective; a ps or an evaluator task is
// a job of one rank of its own, and every task sees the whole cluster by role.
TEST(TfConfigTest, EveryRoleIsReadAndOnlyChiefAndWorkersAreRanks) {
  const std::string cluster =
      R"("cluster": {"chief": ["c:1"], "worker": ["w0:2", "w1:3"], "ps": ["p0:4", "p1:5"],
                     "evaluator": ["e:6"]})";
  const std::map<std::string, std::vector<std::string>> expected = {
      {"chief", {"c:1"}}, {"worker", {"w0:2", "w1:3"}}, {"ps", {"p0:4", "p1:5"}},
      {"evaluator", {"e:6"}}};
  struct Case {
    std::string type;
    int index;
    bool in_collective;
    int rank;
    int world_size;
  };
  for (const Case& c : {Case{"chief", 0, true, 0, 3}, Case{"worker", 1, true, 2, 3},
                        Case{"ps", 1, false, 0, 1}, Case{"evaluator", 0, false, 0, 1}}) {
    SCOPED_TRACE(c.type);
    ClusterSpec spec = ClusterSpec::FromTfConfig("{" + cluster + R"(, "task": {"type": ")" +
                                                 c.type + R"(", "index": )" +
                                                 std::to_string(c.index) + "}}");
    EXPECT_EQ(spec.task_type, c.type);
    EXPECT_EQ(spec.task_index, c.index);
    EXPECT_EQ(spec.InTrainingCollective(), c.in_collective);
    EXPECT_EQ(spec.rank, c.rank);
    EXPECT_EQ(spec.world_size, c.world_size);
    EXPECT_EQ(spec.cluster, expected);
    if (c.in_collective) {
      EXPECT_EQ(spec.addresses, (std::vector<std::string>{"c:1", "w0:2", "w1:3"}));
      EXPECT_EQ(spec.master_addr, "c");
      EXPECT_EQ(spec.master_port, 1);
    } else {
      EXPECT_TRUE(spec.addresses.empty());
      EXPECT_EQ(spec.master_port, 0);
    }
  }
}

TEST(TfConfigTest, AnEvaluatorMayListOnlyItself) {
  ClusterSpec spec = ClusterSpec::FromTfConfig(
      R"({"cluster": {"evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}})");
  EXPECT_FALSE(spec.InTrainingCollective());
  EXPECT_EQ(spec.world_size, 1);
  ExpectBadTfConfig(R"({"cluster": {"ps": ["p:1"]}, "task": {"type": "ps", "index": 0}})",
                    {"'cluster'", "no chief or worker"});
}

TEST(TfConfigTest, RoleRules) {
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"], "evaluator": ["e:1", "f:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.evaluator'", "2 tasks", "at most one evaluator"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"], "ps": ["p:1"]},
                        "task": {"type": "ps", "index": 1}})",
                    {"'task.index'", "'ps'", "0..0"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"], "ps": ["a:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.worker[0]'", "'cluster.ps[0]'", "same address"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"], "ps": ["p:1"], "evaluator": ["p:1"]},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.ps[0]'", "'cluster.evaluator[0]'", "same address"});
  ExpectBadTfConfig(R"({"cluster": {"worker": ["a:1"], "ps": "p:1"},
                        "task": {"type": "worker", "index": 0}})",
                    {"'cluster.ps'", "must be an array"});
}

TEST(ValidateTest, RolesAndClusterAreChecked) {
  ClusterSpec spec;
  spec.task_type = "master";
  ExpectInvalid([&] { spec.Validate(); }, {"task_type", "'master'"});
  spec.task_type = "ps";
  spec.world_size = 2;
  spec.master_port = 1;
  ExpectInvalid([&] { spec.Validate(); }, {"'ps'", "not part of the training collective"});
  spec = ClusterSpec();
  spec.cluster["ps"] = {"nohost"};
  ExpectInvalid([&] { spec.Validate(); }, {"cluster.ps[0]", "'nohost'"});
  spec.cluster = {{"parameter", {"p:1"}}};
  ExpectInvalid([&] { spec.Validate(); }, {"'parameter'"});
}

// Text from TF_CONFIG or a variable that a message shows (a role, a key, a value, the token where
// the JSON broke) has its control bytes and ill-formed UTF-8 escaped and is cut short, as hosts
// are: an ESC in task.type or in a role never reaches the message (and the log) as is, a byte
// 0xe9 that breaks the JSON is not shown raw, and an unterminated string of 1 MiB does not make
// a message of 1 MiB.
TEST(TfConfigTest, TextFromTheEnvironmentIsEscapedAndCutInMessages) {
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "w\u001b[2J", "index": 0}})",
       {"'task.type'", "'w\\x1b[2J'"}},
      {R"({"cluster": {"worker": ["a:1"], "x\u001b[31m": ["b:1"]},
           "task": {"type": "worker", "index": 0}})",
       {"'cluster.x\\x1b[31m'", "role 'x\\x1b[31m'"}},
      {"{\"cluster\": {\"worker\": [\"caf\xe9:1\"]}}", {"not valid JSON", "\\xe9"}},
      {R"({"cluster": {"worker": ["a:1"]}, "task": {"type": ")" + std::string(1 << 20, 'z') +
           R"(", "index": 0}})",
       {"'task.type'", "'zzz", "...'"}},
      {R"({"cluster": ")" + std::string(1 << 20, 'y'), {"not valid JSON", "yyy", "..."}},
  };
  for (const auto& [json, parts] : cases) {
    SCOPED_TRACE(json.substr(0, 100));
    try {
      ClusterSpec::FromTfConfig(json);
      ADD_FAILURE() << "taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      for (const std::string& part : parts) {
        EXPECT_NE(e.message().find(part), std::string::npos)
            << "message '" << e.message().substr(0, 300) << "' lacks '" << part << "'";
      }
      EXPECT_EQ(e.message().find('\x1b'), std::string::npos) << e.message().substr(0, 300);
      EXPECT_EQ(e.message().find('\xe9'), std::string::npos) << e.message().substr(0, 300);
      EXPECT_LT(e.message().size(), 1000u) << e.message().substr(0, 300);
    }
  }
  ExpectBadEnv(Env{{"RANK", "1\x1b[2J"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}},
               {"RANK", "'1\\x1b[2J'"});
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1\n2"}},
               {"MASTER_PORT", "'1\\x0a2'"});
}

// ---- Environment ----

TEST(EnvironmentTest, NothingSetIsASingleRank) {
  ClusterSpec spec = ClusterSpec::FromEnvironment(Env{});
  EXPECT_EQ(spec.rank, 0);
  EXPECT_EQ(spec.world_size, 1);
  EXPECT_EQ(spec.job_id, "collectives");
}

TEST(EnvironmentTest, TfConfigWinsOverRankVariablesThatAgree) {
  Env env = {{"TF_CONFIG", R"({"cluster": {"worker": ["a:1", "b:2"]},
                              "task": {"type": "worker", "index": 1}})"},
             {"RANK", "1"},
             {"WORLD_SIZE", "2"},
             {"MASTER_PORT", "9"}};
  ClusterSpec spec = ClusterSpec::FromEnvironment(env);
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.world_size, 2);
  EXPECT_EQ(spec.master_addr, "a");
  EXPECT_EQ(spec.master_port, 1);
}

// Two launchers' variables that name different jobs: no way to tell which is meant.
TEST(EnvironmentTest, TfConfigBesideRankVariablesThatDisagreeIsAmbiguous) {
  const std::string tf_config = R"({"cluster": {"worker": ["a:1", "b:2"]},
                                    "task": {"type": "worker", "index": 1}})";
  ExpectBadEnv(Env{{"TF_CONFIG", tf_config}, {"RANK", "0"}, {"WORLD_SIZE", "2"}},
               {"TF_CONFIG makes this process rank 1 of 2", "RANK='0'", "unset one"});
  ExpectBadEnv(Env{{"TF_CONFIG", tf_config}, {"WORLD_SIZE", "5"}}, {"WORLD_SIZE='5'"});
}

TEST(EnvironmentTest, TheStoreListenAddressAndTheTokenComeFromTheEnvironment) {
  ClusterSpec spec =
      ClusterSpec::FromEnvironment(Env{{"RANK", "0"},
                                       {"WORLD_SIZE", "2"},
                                       {"MASTER_ADDR", "head"},
                                       {"MASTER_PORT", "29500"},
                                       {"COLLECTIVES_STORE_LISTEN_ADDRESS", "0.0.0.0"}});
  EXPECT_EQ(spec.master_addr, "head");
  EXPECT_EQ(spec.store_listen_address, "0.0.0.0");
  EXPECT_EQ(spec.job_token, "");

  // The process's own environment is read for the same variables.
  ScopedEnv tf("TF_CONFIG", nullptr);
  ScopedEnv rank("RANK", nullptr);
  ScopedEnv world("WORLD_SIZE", nullptr);
  ScopedEnv mpi_rank("OMPI_COMM_WORLD_RANK", nullptr);
  ScopedEnv mpi_world("OMPI_COMM_WORLD_SIZE", nullptr);
  ScopedEnv token("COLLECTIVES_JOB_TOKEN", "a secret");
  ScopedEnv listen("COLLECTIVES_STORE_LISTEN_ADDRESS", "::");
  ClusterSpec real = ClusterSpec::FromEnvironment();
  EXPECT_EQ(real.job_token, "a secret");
  EXPECT_EQ(real.store_listen_address, "::");
}

TEST(HostPortTest, OnlyANameThatResolvesToLoopbackAloneIsFlagged) {
  EXPECT_EQ(cluster::LoopbackOnlyAddresses("127.0.0.1"), "");  // an address says what it is
  EXPECT_EQ(cluster::LoopbackOnlyAddresses("::1"), "");
  EXPECT_EQ(cluster::LoopbackOnlyAddresses("localhost"), "");  // and so does this name
  EXPECT_EQ(cluster::LoopbackOnlyAddresses("no-such-host.invalid"), "");
}

TEST(EnvironmentTest, BlankTfConfigCountsAsUnset) {
  ClusterSpec spec = ClusterSpec::FromEnvironment(
      Env{{"TF_CONFIG", "  "}, {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.world_size, 2);
}

TEST(EnvironmentTest, BadTfConfigIsReported) {
  ExpectBadEnv(Env{{"TF_CONFIG", "{"}}, {"TF_CONFIG", "not valid JSON"});
}

TEST(EnvironmentTest, TorchrunVariables) {
  ClusterSpec spec = ClusterSpec::FromEnvironment(Env{
      {"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29500"}});
  EXPECT_EQ(spec.rank, 3);
  EXPECT_EQ(spec.world_size, 4);
  EXPECT_EQ(spec.master_addr, "10.1.2.3");
  EXPECT_EQ(spec.master_port, 29500);
  EXPECT_EQ(spec.task_type, "worker");
  EXPECT_EQ(spec.task_index, 3);
  EXPECT_TRUE(spec.addresses.empty());
}

TEST(EnvironmentTest, MasterAddrDefaultsToLoopbackAndAcceptsBrackets) {
  ClusterSpec spec = ClusterSpec::FromEnvironment(
      Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(spec.master_addr, "127.0.0.1");
  spec = ClusterSpec::FromEnvironment(
      Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "[::1]"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(spec.master_addr, "::1");
}

TEST(EnvironmentTest, SingleRankNeedsNoPort) {
  ClusterSpec spec = ClusterSpec::FromEnvironment(Env{{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(spec.world_size, 1);
  EXPECT_EQ(spec.master_port, 0);
}

TEST(EnvironmentTest, MpirunVariables) {
  ClusterSpec spec = ClusterSpec::FromEnvironment(Env{{"OMPI_COMM_WORLD_RANK", "1"},
                                                      {"OMPI_COMM_WORLD_SIZE", "2"},
                                                      {"MASTER_ADDR", "node0"},
                                                      {"MASTER_PORT", "4000"}});
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.world_size, 2);
  EXPECT_EQ(spec.master_addr, "node0");
  EXPECT_EQ(spec.master_port, 4000);
}

TEST(EnvironmentTest, RankVariablesWinOverMpirun) {
  ClusterSpec spec = ClusterSpec::FromEnvironment(Env{{"RANK", "0"},
                                                      {"WORLD_SIZE", "1"},
                                                      {"OMPI_COMM_WORLD_RANK", "1"},
                                                      {"OMPI_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(spec.world_size, 1);
}

TEST(EnvironmentTest, JobId) {
  EXPECT_EQ(ClusterSpec::FromEnvironment(Env{{"COLLECTIVES_JOB_ID", "j1"}}).job_id, "j1");
  Env env = {
      {"TF_CONFIG", R"({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0},
                              "job_id": "tf"})"}};
  EXPECT_EQ(ClusterSpec::FromEnvironment(env).job_id, "tf");
  env["COLLECTIVES_JOB_ID"] = "tf";
  EXPECT_EQ(ClusterSpec::FromEnvironment(env).job_id, "tf");
  env["COLLECTIVES_JOB_ID"] = "other";
  ExpectBadEnv(env, {"COLLECTIVES_JOB_ID", "'other'", "'job_id'", "'tf'"});
  ExpectBadEnv(Env{{"COLLECTIVES_JOB_ID", ""}}, {"COLLECTIVES_JOB_ID", "empty"});
}

TEST(EnvironmentTest, MalformedIntegersNameVariableAndValue) {
  ExpectBadEnv(Env{{"RANK", "abc"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, {"RANK", "'abc'"});
  ExpectBadEnv(Env{{"RANK", "-1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, {"RANK", "'-1'"});
  ExpectBadEnv(Env{{"RANK", ""}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, {"RANK", "''"});
  ExpectBadEnv(Env{{"RANK", " 1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, {"RANK", "' 1'"});
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}, {"MASTER_PORT", "1"}},
               {"WORLD_SIZE", "'99999999999'"});
  // 20 digits: refused without being read (they would overflow a long long, undefined
  // behaviour that only a UBSan build reports: scripts/sanitize.sh address).
  ExpectBadEnv(Env{{"RANK", "99999999999999999999"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}},
               {"RANK", "'99999999999999999999'"});
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE", "'0'", "at least 1"});
  ExpectBadEnv(Env{{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}},
               {"RANK", "'2'", "0..1"});
  ExpectBadEnv(Env{{"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
               {"OMPI_COMM_WORLD_RANK", "'x'"});
  ExpectBadEnv(
      Env{{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}},
      {"OMPI_COMM_WORLD_RANK", "'3'", "0..1"});
}

TEST(EnvironmentTest, PortRules) {
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}}, {"MASTER_PORT", "required"});
  ExpectBadEnv(Env{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
               {"MASTER_PORT", "required"});
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}},
               {"MASTER_PORT", "'70000'", "1..65535"});
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}},
               {"MASTER_PORT='0'", "only when WORLD_SIZE=1", "WORLD_SIZE=2"});
  ExpectBadEnv(
      Env{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "3"}, {"MASTER_PORT", "0"}},
      {"MASTER_PORT='0'", "only when OMPI_COMM_WORLD_SIZE=1"});
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "00"}},
               {"MASTER_PORT", "'00'"});
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}},
               {"MASTER_PORT", "'http'"});
  ExpectBadEnv(Env{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}, {"MASTER_ADDR", ""}},
               {"MASTER_ADDR"});
}

// MASTER_ADDR is a host alone, and one holding a port is refused at once. Taken as a name,
// "10.0.0.1:29500" would make rank 0 fail to bind, and every other rank retry resolving it until
// its timeout (COLL_TIMEOUT, 5 minutes).
TEST(EnvironmentTest, MalformedMasterAddrIsRefusedNamingTheVariable) {
  const std::pair<std::string, std::vector<std::string>> cases[] = {
      {"10.0.0.1:29500", {"'10.0.0.1:29500'", "holds a port (':29500')", "MASTER_PORT"}},
      {"node0:29500", {"'node0:29500'", "holds a port (':29500')", "MASTER_PORT"}},
      {"[::1]:29500", {"'[::1]:29500'", "bracket"}},
      {"[::1", {"'[::1'", "bracket"}},
      {"::1]", {"'::1]'", "bracket"}},
      {"[node0]", {"'[node0]'", "IPv6 address only"}},
      {"a/b", {"'a/b'", "'/'"}},
      {"http://node0", {"'http://node0'", "'/'"}},
      {"node 0", {"'node 0'", "whitespace"}},
      {"host\x01", {"'host\\x01'", "control character"}},
      {"host\x7f", {"'host\\x7f'", "control character"}},
      {std::string("a\0b", 3), {"'a\\x00b'", "NUL"}},
      {"a:b:c", {"'a:b:c'", "not an IPv6 address"}},
      {"", {"''", "empty host"}},
      {"[]", {"'[]'", "empty host"}},
  };
  for (const auto& [addr, parts] : cases) {
    SCOPED_TRACE(addr);
    try {
      ClusterSpec::FromEnvironment(
          Env{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", addr}, {"MASTER_PORT", "29500"}});
      ADD_FAILURE() << "MASTER_ADDR accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("environment variable MASTER_ADDR="), std::string::npos)
          << e.message();
      for (const std::string& part : parts) {
        EXPECT_NE(e.message().find(part), std::string::npos)
            << "message '" << e.message() << "' lacks '" << part << "'";
      }
    }
  }
}

TEST(EnvironmentTest, MasterAddrTakesNamesAndAddresses) {
  const std::pair<std::string, std::string> cases[] = {
      {"node0", "node0"},
      {"node-0.example.com", "node-0.example.com"},
      {"localhost", "localhost"},
      {"10.0.0.1", "10.0.0.1"},
      {"::1", "::1"},
      {"[::1]", "::1"},
      {"2001:db8::7", "2001:db8::7"},
      {"[2001:db8::7]", "2001:db8::7"},
      {"::ffff:10.0.0.1", "::ffff:10.0.0.1"},
  };
  for (const auto& [addr, host] : cases) {
    ClusterSpec spec = ClusterSpec::FromEnvironment(
        Env{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", addr}, {"MASTER_PORT", "29500"}});
    EXPECT_EQ(spec.master_addr, host) << addr;
  }
}

TEST(EnvironmentTest, MalformedStoreListenAddressIsRefusedNamingTheVariable) {
  const Env base = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}};
  Env env = base;
  env["COLLECTIVES_STORE_LISTEN_ADDRESS"] = "127.0.0.1:29500";
  ExpectBadEnv(env, {"environment variable COLLECTIVES_STORE_LISTEN_ADDRESS='127.0.0.1:29500'",
                     "holds a port", "master_port"});
  env["COLLECTIVES_STORE_LISTEN_ADDRESS"] = "not an address";
  ExpectBadEnv(env, {"COLLECTIVES_STORE_LISTEN_ADDRESS", "'not an address'", "whitespace"});
  env["COLLECTIVES_STORE_LISTEN_ADDRESS"] = "[::]";
  EXPECT_EQ(ClusterSpec::FromEnvironment(env).store_listen_address, "::");
  env["COLLECTIVES_STORE_LISTEN_ADDRESS"] = "";  // empty: unset
  EXPECT_EQ(ClusterSpec::FromEnvironment(env).store_listen_address, "");
}

// ClusterSpec and coll_comm_create take port 0 with a single rank (no store is served), rather
// than refuse the variable as "not a port number in 1..65535".
TEST(EnvironmentTest, PortZeroIsValidForASingleRank) {
  ClusterSpec spec =
      ClusterSpec::FromEnvironment(Env{{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}});
  EXPECT_EQ(spec.world_size, 1);
  EXPECT_EQ(spec.master_port, 0);
  spec = ClusterSpec::FromEnvironment(
      Env{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}});
  EXPECT_EQ(spec.master_port, 0);
}

// srun's variables: the rank of the step's tasks, the store on the first host of the step's
// node list (Slurm's compressed form), the port derived from the job and step ids.
TEST(EnvironmentTest, SlurmJobStep) {
  Env env = {{"SLURM_PROCID", "3"},         {"SLURM_NTASKS", "8"},
             {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_STEP_ID", "2"},
             {"SLURM_JOB_ID", "123456"},    {"SLURM_STEP_NODELIST", "gpu-[07-09,12]x,login1"},
             {"SLURM_JOB_NODELIST", "other[1-2]"}};
  ClusterSpec spec = ClusterSpec::FromEnvironment(env);
  EXPECT_EQ(spec.rank, 3);
  EXPECT_EQ(spec.world_size, 4);  // the step's tasks, not the allocation's
  EXPECT_EQ(spec.master_addr, "gpu-07x");
  EXPECT_EQ(spec.master_port, 20000 + 4 * 3456 + 2);
  EXPECT_EQ(spec.job_id, "slurm-123456.2");
  EXPECT_EQ(spec.task_type, "worker");
  // MASTER_ADDR and MASTER_PORT win; SLURM_NTASKS when the step's count is absent.
  env.erase("SLURM_STEP_NUM_TASKS");
  env["MASTER_ADDR"] = "10.0.0.9";
  env["MASTER_PORT"] = "4000";
  spec = ClusterSpec::FromEnvironment(env);
  EXPECT_EQ(spec.world_size, 8);
  EXPECT_EQ(spec.master_addr, "10.0.0.9");
  EXPECT_EQ(spec.master_port, 4000);
  // Two steps of one job, and two jobs, get different ports.
  EXPECT_NE(cluster::SlurmDefaultPort(7, 0), cluster::SlurmDefaultPort(7, 1));
  EXPECT_NE(cluster::SlurmDefaultPort(7, 0), cluster::SlurmDefaultPort(8, 0));
}

TEST(EnvironmentTest, SlurmBatchScriptIsASingleRankAndMpirunWinsInsideAnAllocation) {
  // sbatch's script has SLURM_PROCID but no step: a program run from it directly is alone.
  ClusterSpec spec = ClusterSpec::FromEnvironment(
      Env{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_NODELIST", "n[1-2]"}});
  EXPECT_EQ(spec.world_size, 1);
  spec = ClusterSpec::FromEnvironment(Env{{"SLURM_PROCID", "0"},
                                          {"SLURM_STEP_ID", "0"},
                                          {"SLURM_NTASKS", "8"},
                                          {"SLURM_JOB_ID", "5"},
                                          {"OMPI_COMM_WORLD_RANK", "1"},
                                          {"OMPI_COMM_WORLD_SIZE", "2"},
                                          {"MASTER_PORT", "4000"}});
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.world_size, 2);
}

TEST(EnvironmentTest, PartialSlurmEnvironmentsNameWhatIsMissing) {
  ExpectBadEnv(Env{{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}},
               {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
  ExpectBadEnv(Env{{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"},
                   {"SLURM_JOB_ID", "5"}},
               {"SLURM_STEP_NODELIST", "MASTER_ADDR"});
  ExpectBadEnv(Env{{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"},
                   {"SLURM_NODELIST", "n1"}},
               {"SLURM_JOB_ID", "MASTER_PORT"});
  ExpectBadEnv(Env{{"SLURM_PROCID", "2"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"},
                   {"SLURM_NODELIST", "n1"}, {"SLURM_JOB_ID", "5"}},
               {"SLURM_PROCID='2'", "out of range"});
  ExpectBadEnv(Env{{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "x"}, {"SLURM_NTASKS", "2"},
                   {"SLURM_NODELIST", "n1"}, {"SLURM_JOB_ID", "5"}},
               {"SLURM_STEP_ID='x'"});
  ExpectBadEnv(Env{{"SLURM_PROCID", "0"}, {"SLURM_STEP_ID", "0"}, {"SLURM_NTASKS", "2"},
                   {"SLURM_NODELIST", "n[1-"}, {"SLURM_JOB_ID", "5"}},
               {"SLURM_NODELIST", "'[' without ']'"});
}

TEST(SlurmHostListTest, ExpandsCompressedLists) {
  using cluster::ExpandSlurmHostList;
  using List = std::vector<std::string>;
  EXPECT_EQ(ExpandSlurmHostList("n1", "x"), (List{"n1"}));
  EXPECT_EQ(ExpandSlurmHostList("n[1-3]", "x"), (List{"n1", "n2", "n3"}));
  EXPECT_EQ(ExpandSlurmHostList("n[08-11,20],login", "x"),
            (List{"n08", "n09", "n10", "n11", "n20", "login"}));
  EXPECT_EQ(ExpandSlurmHostList("r[1-2]-n[1-2]", "x"), (List{"r1-n1", "r1-n2", "r2-n1", "r2-n2"}));
  EXPECT_EQ(ExpandSlurmHostList("a[7],b", "x"), (List{"a7", "b"}));
  EXPECT_EQ(ExpandSlurmHostList("10.0.0.[1-2]", "x"), (List{"10.0.0.1", "10.0.0.2"}));
  const std::pair<const char*, const char*> bad[] = {
      {"n[1-", "'[' without ']'"}, {"n1-]", "']' without '['"},  {"n[[1]]", "nested"},
      {"n[3-1]", "backwards"},     {"n[a]", "no number"},         {"n[]", "no number"},
      {"a,,b", "empty entry"},     {"n[1-2", "'[' without ']'"},  {"n[1,]", "no number"}};
  for (const auto& [list, why] : bad) {
    SCOPED_TRACE(list);
    ExpectInvalid([&] { ExpandSlurmHostList(list, "SLURM_NODELIST"); }, {"SLURM_NODELIST", why});
  }
  ExpectInvalid([] { ExpandSlurmHostList("n[1-100]", "L", 50); }, {"more than 50 hosts"});
  ExpectInvalid([] { ExpandSlurmHostList("n[1-999999999999]", "L"); }, {"more than"});
}

// Under mpirun with no MASTER_PORT and no PMIx server to meet through, the error says both.
TEST(EnvironmentTest, MpirunWithoutMasterPortOrPmixNamesBoth) {
  ExpectBadEnv(Env{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
               {"MASTER_PORT is required", "PMIx"});
}

TEST(EnvironmentTest, HalfOfAPairIsMissing) {
  ExpectBadEnv(Env{{"RANK", "0"}}, {"WORLD_SIZE"});
  ExpectBadEnv(Env{{"WORLD_SIZE", "1"}}, {"RANK"});
  ExpectBadEnv(Env{{"OMPI_COMM_WORLD_SIZE", "1"}}, {"OMPI_COMM_WORLD_RANK"});
}

TEST(EnvironmentTest, RealEnvironment) {
  ScopedEnv tf("TF_CONFIG", nullptr);
  ScopedEnv ompi_rank("OMPI_COMM_WORLD_RANK", nullptr);
  ScopedEnv ompi_size("OMPI_COMM_WORLD_SIZE", nullptr);
  ScopedEnv job("COLLECTIVES_JOB_ID", "real-env");
  ScopedEnv rank("RANK", "1");
  ScopedEnv size("WORLD_SIZE", "3");
  ScopedEnv addr("MASTER_ADDR", "host0");
  ScopedEnv port("MASTER_PORT", "12345");
  ClusterSpec spec = ClusterSpec::FromEnvironment();
  EXPECT_EQ(spec.rank, 1);
  EXPECT_EQ(spec.world_size, 3);
  EXPECT_EQ(spec.master_addr, "host0");
  EXPECT_EQ(spec.master_port, 12345);
  EXPECT_EQ(spec.job_id, "real-env");
  {
    ScopedEnv bad("WORLD_SIZE", "three");
    ExpectInvalid([] { ClusterSpec::FromEnvironment(); }, {"WORLD_SIZE", "'three'"});
  }
}

// ---- Validate ----

TEST(ValidateTest, DefaultIsValid) { EXPECT_NO_THROW(ClusterSpec().Validate()); }

TEST(ValidateTest, Inconsistencies) {
  auto expect_bad = [](ClusterSpec spec, std::initializer_list<std::string> parts) {
    ExpectInvalid([&] { spec.Validate(); }, parts);
  };
  ClusterSpec spec;
  spec.world_size = 0;
  expect_bad(spec, {"world_size=0"});
  spec = ClusterSpec{};
  spec.world_size = 2;
  spec.master_port = 1;
  spec.rank = 2;
  expect_bad(spec, {"rank=2", "0..1"});
  spec.rank = -1;
  expect_bad(spec, {"rank=-1"});
  spec.rank = 0;
  spec.master_port = 0;
  expect_bad(spec, {"master_port"});
  spec.master_port = 1;
  spec.addresses = {"a:1"};
  expect_bad(spec, {"addresses", "1 entries"});
  spec.addresses = {"a:1", "b"};
  expect_bad(spec, {"addresses[1]", "'b'"});
  spec.addresses = {"a:1", "b:2"};
  EXPECT_NO_THROW(spec.Validate());
  spec.job_id = "";
  expect_bad(spec, {"job_id"});
}

// master_addr and store_listen_address filled in by code (coll_comm_create's master_addr) get
// the checks MASTER_ADDR gets.
TEST(ValidateTest, HostsAreChecked) {
  auto expect_bad = [](ClusterSpec spec, std::initializer_list<std::string> parts) {
    ExpectInvalid([&] { spec.Validate(); }, parts);
  };
  ClusterSpec spec;
  spec.world_size = 2;
  spec.master_port = 29500;
  for (const char* good : {"node0", "localhost", "10.0.0.1", "::1", "[::1]", "fe80::1"}) {
    spec.master_addr = good;
    EXPECT_NO_THROW(spec.Validate()) << good;
    spec.store_listen_address = good;
    EXPECT_NO_THROW(spec.Validate()) << good;
    spec.store_listen_address = "";
  }
  spec.master_addr = "10.0.0.1:29500";
  expect_bad(spec, {"ClusterSpec: master_addr='10.0.0.1:29500'", "holds a port", "master_port"});
  spec.master_addr = "[::1";
  expect_bad(spec, {"master_addr='[::1'", "bracket"});
  spec.master_addr = "a\nb";
  expect_bad(spec, {"master_addr='a\\x0ab'", "whitespace"});
  spec.world_size = 1;  // a single rank's master_addr is not used, but is still checked
  spec.master_addr = "a/b";
  expect_bad(spec, {"master_addr='a/b'", "'/'"});
  spec.master_addr = "127.0.0.1";
  spec.store_listen_address = "0.0.0.0:1";
  expect_bad(spec, {"ClusterSpec: store_listen_address='0.0.0.0:1'", "holds a port"});
}

// ---- host:port ----

TEST(HostPortTest, ParseAndFormat) {
  std::string why;
  auto parsed = cluster::ParseHostPort("[::1]:80", &why);
  ASSERT_TRUE(parsed.has_value()) << why;
  EXPECT_EQ(parsed->host, "::1");
  EXPECT_EQ(parsed->port, 80);
  EXPECT_EQ(cluster::FormatHostPort(parsed->host, parsed->port), "[::1]:80");
  parsed = cluster::ParseHostPort("example.com:65535", &why);
  ASSERT_TRUE(parsed.has_value()) << why;
  EXPECT_EQ(parsed->host, "example.com");
  EXPECT_EQ(parsed->port, 65535);
  EXPECT_EQ(cluster::FormatHostPort("h", 1), "h:1");
  EXPECT_FALSE(cluster::ParsePort("+1"));
  EXPECT_FALSE(cluster::ParsePort("000000080"));
  EXPECT_EQ(cluster::ParsePort("080"), 80);
}

TEST(HostPortTest, CheckHost) {
  std::string why;
  EXPECT_EQ(cluster::CheckHost("[::1]", "", &why), "::1") << why;
  EXPECT_EQ(cluster::CheckHost("fe80::1%lo", "", &why), "fe80::1%lo") << why;
  EXPECT_EQ(cluster::CheckHost("0.0.0.0", "", &why), "0.0.0.0") << why;
  EXPECT_FALSE(cluster::CheckHost("h:1", "", &why));
  EXPECT_EQ(why, "it holds a port (':1')");
  EXPECT_FALSE(cluster::CheckHost("h:1", "put it elsewhere", &why));
  EXPECT_EQ(why, "it holds a port (':1'); put it elsewhere");
}

// The reason quotes what it refuses as every quote of the input does: control bytes escaped,
// cut after 64 bytes. The reason follows the quoted value in the message, and it carried the
// raw port: an ESC sequence reached the terminal, a megabyte of port the log.
TEST(HostPortTest, TheReasonEscapesAndCutsWhatItQuotes) {
  std::string why;
  EXPECT_FALSE(cluster::ParseHostPort("a:1\x1b[2J", &why));
  EXPECT_EQ(why, "port '1\\x1b[2J' is not a number in 1..65535");
  EXPECT_FALSE(cluster::ParseHostPort("a:" + std::string(1 << 20, '7'), &why));
  EXPECT_EQ(why, "port '" + std::string(64, '7') + "...' is not a number in 1..65535");
  EXPECT_FALSE(cluster::CheckHost("h:1\x9b", "", &why));
  EXPECT_EQ(why, "it holds a port (':1\\x9b')");
  EXPECT_FALSE(cluster::CheckHost("h:" + std::string(1 << 20, '7'), "", &why));
  EXPECT_EQ(why, "it holds a port (':" + std::string(63, '7') + "...')");
}

}  // namespace
}  // namespace collectives
