// Starting and connecting the ranks of a benchmark: the --local launcher (fork/exec of this
// program on loopback, rank 0 reporting the store's port through a pipe) and the MPI bootstrap.
#include "bench/local_launcher.h"

#include "bench/bench_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

#ifdef COLLECTIVES_WITH_MPI
#include <mpi.h>
#endif

extern char** environ;

namespace collectives::perf {
namespace {

using Clock = std::chrono::steady_clock;
#ifdef COLLECTIVES_WITH_MPI
using bench::CheckMpi;
#endif

bool IsLauncherVariable(std::string_view entry) {
  static constexpr std::string_view kNames[] = {
      "RANK",       "WORLD_SIZE",  "LOCAL_RANK",  "LOCAL_WORLD_SIZE",
      "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "COLLECTIVES_JOB_TOKEN"};
  const std::string_view name = entry.substr(0, entry.find('='));
  for (std::string_view known : kNames) {
    if (name == known) return true;
  }
  return name.starts_with("COLLECTIVES_PERF_");
}

// Starts this program again as `rank`, with `extra` added to a copy of the environment from
// which launcher variables were removed. `keep_fd` stays open across exec.
pid_t SpawnRank(const char* program, char** argv, const std::vector<std::string>& extra,
                int keep_fd) {
  std::vector<std::string> entries;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!IsLauncherVariable(*e)) entries.emplace_back(*e);
  }
  entries.insert(entries.end(), extra.begin(), extra.end());
  std::vector<char*> envp;
  for (std::string& entry : entries) envp.push_back(entry.data());
  envp.push_back(nullptr);
  // Built before fork: the child only calls async-signal-safe functions.
  const std::string exec_failed = std::string(program) + ": cannot exec /proc/self/exe\n";

  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t launcher = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    // Die with the launcher rather than linger as an orphan rank.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != launcher) _exit(kExitError);
    if (keep_fd >= 0) fcntl(keep_fd, F_SETFD, 0);
    execve("/proc/self/exe", argv, envp.data());
    [[maybe_unused]] ssize_t ignored = write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    _exit(127);
  }
  return pid;
}

std::string DescribeStatus(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "stopped";
}

int ExitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return kExitError;
}

// Reads rank 0's "port\n" from `fd`; 0 if rank 0 closed the pipe or the timeout passed.
uint16_t ReadPort(int fd, std::chrono::milliseconds timeout) {
  std::string text;
  const Clock::time_point deadline = Clock::now() + timeout;
  while (text.find('\n') == std::string::npos) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return 0;
    pollfd descriptor{fd, POLLIN, 0};
    const int ready = poll(&descriptor, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return 0;
    char chunk[32];
    const ssize_t n = read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return 0;
    text.append(chunk, static_cast<size_t>(n));
  }
  const long port = std::strtol(text.c_str(), nullptr, 10);
  return port > 0 && port < 65536 ? static_cast<uint16_t>(port) : 0;
}

}  // namespace

bool IsLocalChild() { return std::getenv(kLocalRankEnv) != nullptr; }

bool UnderMpiLauncher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

void SayWhenSingleRankByDefault(const char* program) {
  for (const char* name : {kLocalRankEnv, "TF_CONFIG", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                           "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(name) != nullptr) return;
  }
  std::fprintf(stderr,
               "%s: no --local and no launcher (mpirun, RANK / WORLD_SIZE, TF_CONFIG): running "
               "one rank; for N ranks pass --local N, or start it with mpirun -np N\n",
               program);
}

int RankFromEnvironment() {
  for (const char* name :
       {kLocalRankEnv, "RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* value = std::getenv(name); value != nullptr) return std::atoi(value);
  }
  return 0;
}

namespace {

// A fresh job token for the ranks this launcher starts, when the environment names none: the
// launcher is the job's creator, so it shares the secret with its ranks and nobody else.
std::string FreshJobToken() {
  std::array<unsigned char, 16> bytes{};
  FILE* random = std::fopen("/dev/urandom", "rb");
  if (random == nullptr || std::fread(bytes.data(), 1, bytes.size(), random) != bytes.size()) {
    if (random != nullptr) std::fclose(random);
    throw std::runtime_error("cannot read /dev/urandom for a job token");
  }
  std::fclose(random);
  std::string hex;
  for (unsigned char b : bytes) {
    static const char kDigits[] = "0123456789abcdef";
    hex += kDigits[b >> 4];
    hex += kDigits[b & 15];
  }
  return hex;
}

// The files (sockets mostly) rank 0 of `world_size` ranks may hold open: for each of its
// `communicators` a TCP connection to every other rank, the store's connection from every other
// rank, and a margin (listeners, shared memory, pipes, the program's own). Measured with one
// communicator: 2N + 11 in rank 0, N + 11 in the others (N = 32 and 128).
size_t FilesOfRankZero(int world_size, int communicators) {
  return static_cast<size_t>(world_size) * static_cast<size_t>(communicators + 1) + 32;
}

// Raises the soft limit on open files of this process, which its ranks inherit, towards what rank
// 0 needs, up to the hard limit. Returns why `world_size` ranks cannot have the files they need
// (this limit, or the system's in all, fs.file-max), or an empty string. Without this, rank 0
// failed only at --timeout, "socket: Too many open files" deep in one line of 80.
std::string CheckFileLimits(int world_size, int communicators) {
  const size_t needed = FilesOfRankZero(world_size, communicators);
  const std::string local = "--local " + std::to_string(world_size);
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < needed) {
    limit.rlim_cur = std::min<rlim_t>(limit.rlim_max, needed);
    setrlimit(RLIMIT_NOFILE, &limit);
    if (limit.rlim_cur < needed) {
      return local + ": rank 0 may open about " + std::to_string(needed) +
             " files (a connection to every other rank, per communicator, and the store's from "
             "every rank), more than the limit of " +
             std::to_string(limit.rlim_max) + " (ulimit -n): raise it or start fewer ranks";
    }
  }
  const size_t n = static_cast<size_t>(world_size);
  const size_t in_all = n * (n * static_cast<size_t>(communicators) + 32) + n;
  size_t system_limit = 0;
  if (std::ifstream("/proc/sys/fs/file-max") >> system_limit && in_all > system_limit) {
    return local + ": the ranks may open about " + std::to_string(in_all) +
           " files in all (both ends of a TCP connection between every two ranks), more than "
           "this system's limit of " +
           std::to_string(system_limit) + " (fs.file-max): start fewer ranks";
  }
  return {};
}

}  // namespace

int RunLocalLauncher(const char* program, int world_size, char** argv,
                     std::chrono::milliseconds timeout, int communicators) {
  if (const std::string refused = CheckFileLimits(world_size, communicators); !refused.empty()) {
    std::fprintf(stderr, "%s: %s\n", program, refused.c_str());
    return kExitError;
  }
  const char* inherited_token = std::getenv("COLLECTIVES_JOB_TOKEN");
  const std::string token =
      inherited_token != nullptr && *inherited_token != 0 ? inherited_token : FreshJobToken();
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
    throw std::runtime_error("pipe: " + std::string(std::strerror(errno)));
  }
  // COLLECTIVES_PERF_PRETEND_HOSTS=H: ranks are cut into H pretend hosts of consecutive ranks
  // (COLLECTIVES_HOST_ID), so that AUTO plans as on H machines while TCP runs over loopback.
  const char* pretend = std::getenv("COLLECTIVES_PERF_PRETEND_HOSTS");
  const int hosts = pretend != nullptr ? std::max(0, std::atoi(pretend)) : 0;
  auto common = [&](int rank) {
    std::vector<std::string> env{"RANK=" + std::to_string(rank),
                                    "LOCAL_RANK=" + std::to_string(rank),
                                    "WORLD_SIZE=" + std::to_string(world_size),
                                    "LOCAL_WORLD_SIZE=" + std::to_string(world_size),
                                    "MASTER_ADDR=127.0.0.1",
                                    "COLLECTIVES_JOB_TOKEN=" + token,
                                    std::string(kLocalRankEnv) + "=" + std::to_string(rank)};
    if (hosts > 0) {
      env.push_back("COLLECTIVES_HOST_ID=pretend-" + std::to_string(rank * hosts / world_size));
    }
    return env;
  };

  std::vector<pid_t> pids(static_cast<size_t>(world_size), -1);
  std::vector<std::string> rank0_env = common(0);
  rank0_env.push_back(std::string(kPortFdEnv) + "=" + std::to_string(pipe_fds[1]));
  pids[0] = SpawnRank(program, argv, rank0_env, pipe_fds[1]);
  close(pipe_fds[1]);
  const uint16_t port = ReadPort(pipe_fds[0], timeout);
  close(pipe_fds[0]);
  if (port == 0) {
    std::fprintf(stderr, "%s: rank 0 did not report the store's port\n", program);
    kill(pids[0], SIGTERM);
    int status = 0;
    waitpid(pids[0], &status, 0);
    std::fprintf(stderr, "%s: rank 0 %s\n", program, DescribeStatus(status).c_str());
    return kExitError;
  }
  for (int rank = 1; rank < world_size; ++rank) {
    std::vector<std::string> env = common(rank);
    env.push_back("MASTER_PORT=" + std::to_string(port));
    pids[static_cast<size_t>(rank)] = SpawnRank(program, argv, env, -1);
  }

  int result = kExitOk;
  int alive = world_size;
  std::optional<Clock::time_point> terminate_at;
  std::optional<Clock::time_point> kill_at;
  auto signal_alive = [&](int sig) {
    for (pid_t pid : pids) {
      if (pid > 0) kill(pid, sig);
    }
  };
  while (alive > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR) break;
    if (pid > 0) {
      auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) continue;
      const int rank = static_cast<int>(it - pids.begin());
      *it = -1;
      --alive;
      const int code = ExitCodeOf(status);
      if (code != kExitOk && code != kExitWrong) {
        if (!kill_at) {  // not a rank we killed ourselves
          std::fprintf(stderr, "%s: rank %d %s\n", program, rank, DescribeStatus(status).c_str());
        }
        if (!terminate_at) terminate_at = Clock::now() + std::chrono::seconds(2);
      }
      if (result == kExitOk && code != kExitOk) result = code;
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (terminate_at && !kill_at && now >= *terminate_at) {
      signal_alive(SIGTERM);
      kill_at = now + std::chrono::seconds(2);
    } else if (kill_at && now >= *kill_at) {
      signal_alive(SIGKILL);
      kill_at = now + std::chrono::hours(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return result;
}

Job JoinLocalJob(const std::string& job_prefix, int world_size,
                 const CommunicationOptions& options) {
  Job job;
  job.job_token = ResolveJobToken(options);
  if (RankFromEnvironment() != 0) {
    job.spec = ClusterSpec::FromEnvironment();  // RANK, WORLD_SIZE, MASTER_*
    job.spec.job_id = job_prefix + "-" + std::to_string(job.spec.master_port);
    job.spec.Validate();
    job.store = CreateStoreFor(job.spec, options.timeout, job.job_token);
    return job;
  }
  const char* fd_text = std::getenv(kPortFdEnv);
  if (fd_text == nullptr) throw std::runtime_error(std::string(kPortFdEnv) + " is not set");
  const int fd = std::atoi(fd_text);
  job.store =
      CreateTcpStore("127.0.0.1", 0, /*is_server=*/true, options.timeout, job.job_token);
  const uint16_t port = TcpStorePort(*job.store);
  const std::string line = std::to_string(port) + "\n";
  if (write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    throw std::runtime_error("cannot report the store's port to the launcher: " +
                             std::string(std::strerror(errno)));
  }
  close(fd);
  job.spec.rank = 0;
  job.spec.world_size = world_size;
  job.spec.master_addr = "127.0.0.1";
  job.spec.master_port = port;
  job.spec.job_id = job_prefix + "-" + std::to_string(port);
  job.spec.Validate();
  return job;
}

#ifdef COLLECTIVES_WITH_MPI
Job JoinMpiJob(const std::string& job_prefix, const CommunicationOptions& given,
               std::string* launcher) {
  int rank = 0;
  int world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);

  // No token given: rank 0, the store's creator, makes one and shares it over MPI, a channel
  // only the job's ranks are on.
  CommunicationOptions options = given;
  options.job_token = ResolveJobToken(given);
  if (options.job_token.empty()) {
    std::array<char, 33> token{};
    if (rank == 0) {
      const std::string fresh = FreshJobToken();
      std::copy(fresh.begin(), fresh.end(), token.begin());
    }
    CheckMpi(MPI_Bcast(token.data(), static_cast<int>(token.size()), MPI_CHAR, 0, MPI_COMM_WORLD),
             "MPI_Bcast");
    options.job_token = token.data();
  }

  std::string address;
  if (const char* master = std::getenv("MASTER_ADDR"); master != nullptr && *master != '\0') {
    address = master;
  } else {
    MPI_Comm node;
    CheckMpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
             "MPI_Comm_split_type");
    int node_size = 0;
    MPI_Comm_size(node, &node_size);
    int single_host = node_size == world_size ? 1 : 0;
    MPI_Comm_free(&node);
    CheckMpi(MPI_Allreduce(MPI_IN_PLACE, &single_host, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD),
             "MPI_Allreduce");
    if (single_host) {
      address = "127.0.0.1";
    } else {
      std::array<char, 256> host{};
      if (rank == 0) gethostname(host.data(), host.size() - 1);
      CheckMpi(MPI_Bcast(host.data(), static_cast<int>(host.size()), MPI_CHAR, 0, MPI_COMM_WORLD),
               "MPI_Bcast");
      address = host.data();
    }
  }

  std::shared_ptr<Store> store;
  int port = 0;
  std::string failure;
  if (rank == 0) {
    try {
      store = CreateTcpStore(address, 0, /*is_server=*/true, options.timeout, options.job_token);
      port = TcpStorePort(*store);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  CheckMpi(MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Bcast");
  if (port == 0) {
    throw std::runtime_error(rank == 0
                                 ? "cannot host the rendezvous store on " + address + ": " + failure
                                 : "rank 0 could not host the rendezvous store");
  }
  if (rank != 0) {
    store = CreateTcpStore(address, static_cast<uint16_t>(port), /*is_server=*/false,
                           options.timeout, options.job_token);
  }
  Job job;
  job.spec.rank = rank;
  job.spec.world_size = world_size;
  job.spec.master_addr = address;
  job.spec.master_port = static_cast<uint16_t>(port);
  job.spec.job_id = job_prefix + "-" + std::to_string(port);
  job.spec.Validate();
  job.store = std::move(store);
  job.job_token = options.job_token;

  if (launcher != nullptr) {
    *launcher = "mpirun (MPI bootstrap, store at " + address + ":" + std::to_string(port) + ")";
  }
  return job;
}
#endif  // COLLECTIVES_WITH_MPI

}  // namespace collectives::perf
