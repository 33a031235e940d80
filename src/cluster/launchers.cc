// PMIx rendezvous for mpirun and Slurm's host lists (launchers.h).
//
// PMIx is loaded at run time, as NCCL is: the library is compiled against Debian's pmix.h
// (libpmix-dev) and dlopens libpmix.so.2 (libpmix2, which Open MPI itself depends on) only when a
// job started by mpirun has no MASTER_PORT. A build or a machine without it still runs every
// other launcher. The structures are filled by hand rather than with PMIx's macros, several of
// which call into the library.
#include "src/cluster/launchers.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "collectives/errors.h"
#include "src/core/auth.h"
#include "src/core/text.h"

#ifdef COLLECTIVES_WITH_PMIX
#include <pmix.h>
#endif

namespace collectives::cluster {
namespace {

[[noreturn]] void Invalid(const std::string& message) {
  throw Error(ErrorCode::kInvalidArgument, message);
}

std::string HexOf(const uint8_t* data, size_t bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * bytes);
  for (size_t i = 0; i < bytes; ++i) {
    out += kDigits[data[i] >> 4];
    out += kDigits[data[i] & 15];
  }
  return out;
}

// The first IPv4 address of an interface that is up and not loopback, or "".
std::string FirstOutwardIpv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string found;
  for (ifaddrs* entry = list; entry != nullptr && found.empty(); entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    if ((entry->ifa_flags & IFF_UP) == 0 || (entry->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* address = reinterpret_cast<const sockaddr_in*>(entry->ifa_addr);
    if (::inet_ntop(AF_INET, &address->sin_addr, text, sizeof text) != nullptr) found = text;
  }
  ::freeifaddrs(list);
  return found;
}

// A port no socket of this host holds now (bound on every interface, then released). The store
// binds it moments later; a process that takes it in between makes that bind fail with a clear
// error, as for any MASTER_PORT in use.
uint16_t FreePort(int rank) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    throw Error(ErrorCode::kSystem, "rank " + std::to_string(rank) +
                                        ": no socket to find a free store port: " +
                                        std::strerror(errno));
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t length = sizeof address;
  uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  const int error = errno;
  ::close(fd);
  if (port == 0) {
    throw Error(ErrorCode::kSystem, "rank " + std::to_string(rank) +
                                        ": could not find a free store port: " +
                                        std::strerror(error));
  }
  return port;
}

#ifdef COLLECTIVES_WITH_PMIX

// The PMIx client functions used, looked up in libpmix.so.2.
struct Pmix {
  decltype(&::PMIx_Init) init = nullptr;
  decltype(&::PMIx_Finalize) finalize = nullptr;
  decltype(&::PMIx_Put) put = nullptr;
  decltype(&::PMIx_Commit) commit = nullptr;
  decltype(&::PMIx_Fence) fence = nullptr;
  decltype(&::PMIx_Get) get = nullptr;
  decltype(&::PMIx_Error_string) error_string = nullptr;
  decltype(&::PMIx_Value_destruct) value_destruct = nullptr;
};

// The table, or why there is none. Loaded once; never unloaded.
const Pmix& LoadPmix() {
  static const std::pair<Pmix, std::string> loaded = []() -> std::pair<Pmix, std::string> {
    void* handle = ::dlopen("libpmix.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr) {
      const char* why = ::dlerror();
      return {Pmix{}, std::string("libpmix.so.2 could not be loaded (Debian: libpmix2): ") +
                          (why != nullptr ? why : "?")};
    }
    Pmix table;
    std::string missing;
    auto look_up = [&](auto& slot, const char* name) {
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(handle, name));
      if (slot == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    look_up(table.init, "PMIx_Init");
    look_up(table.finalize, "PMIx_Finalize");
    look_up(table.put, "PMIx_Put");
    look_up(table.commit, "PMIx_Commit");
    look_up(table.fence, "PMIx_Fence");
    look_up(table.get, "PMIx_Get");
    look_up(table.error_string, "PMIx_Error_string");
    look_up(table.value_destruct, "PMIx_Value_destruct");
    if (!missing.empty()) return {Pmix{}, "libpmix.so.2 lacks " + missing};
    return {table, std::string()};
  }();
  if (loaded.first.init == nullptr) {
    throw Error(ErrorCode::kNotSupported,
                "mpirun started this process without MASTER_PORT, and the ranks cannot meet "
                "through PMIx: " + loaded.second + "; export MASTER_ADDR and MASTER_PORT (mpirun "
                "-x) instead");
  }
  return loaded.first;
}

// Copies `key` into a PMIx key or namespace field of `capacity` characters and a NUL.
void SetKey(char* out, size_t capacity, const char* key) {
  const size_t length = ::strnlen(key, capacity);
  std::memcpy(out, key, length);
  out[length] = '\0';
}

// One exchange: init, publish (rank 0), fence, read, finalize. Finalize always runs once init
// succeeded: mpirun reports a process that inits and exits without it as a failure.
PmixStore Exchange(int rank, int world_size, const std::string& master_addr,
                   std::chrono::seconds timeout) {
  const Pmix& pmix = LoadPmix();
  const std::string who = "rank " + std::to_string(rank) + ": ";
  auto fail = [&](const char* call, pmix_status_t status) {
    throw Error(status == PMIX_ERR_TIMEOUT ? ErrorCode::kTimeout : ErrorCode::kSystem,
                who + call + " failed: " + pmix.error_string(status) +
                    (status == PMIX_ERR_TIMEOUT
                         ? " after " + std::to_string(timeout.count()) +
                               " s (a rank of the job never asked for the store's address)"
                         : std::string()));
  };
  pmix_proc_t me;
  std::memset(&me, 0, sizeof me);
  if (pmix_status_t status = pmix.init(&me, nullptr, 0); status != PMIX_SUCCESS) {
    fail("PMIx_Init", status);
  }
  struct Finalize {
    const Pmix& pmix;
    ~Finalize() { pmix.finalize(nullptr, 0); }
  } finalize{pmix};

  if (static_cast<int>(me.rank) != rank) {
    throw Error(ErrorCode::kInvalidArgument,
                who + "PMIx says this process is rank " + std::to_string(me.rank) +
                    " of namespace '" + core::OneLine(me.nspace, 64) +
                    "'; the launcher's variables and its PMIx server disagree");
  }
  pmix_proc_t job;
  std::memset(&job, 0, sizeof job);
  SetKey(job.nspace, PMIX_MAX_NSLEN, me.nspace);
  job.rank = PMIX_RANK_WILDCARD;

  constexpr char kKey[] = "collectives.store";
  if (rank == 0) {
    PmixStore store;
    store.master_addr = master_addr;
    if (store.master_addr.empty()) {
      pmix_value_t* local = nullptr;
      bool all_local = false;
      if (pmix.get(&job, PMIX_LOCAL_SIZE, nullptr, 0, &local) == PMIX_SUCCESS &&
          local != nullptr) {
        all_local = local->type == PMIX_UINT32 &&
                    static_cast<int64_t>(local->data.uint32) == world_size;
        pmix.value_destruct(local);
        std::free(local);
      }
      store.master_addr = all_local ? "127.0.0.1" : FirstOutwardIpv4();
      if (store.master_addr.empty()) {
        throw Error(ErrorCode::kSystem,
                    who + "the job spans hosts but this host has no IPv4 address outside "
                          "loopback for the store; export MASTER_ADDR");
      }
    }
    store.master_port = FreePort(rank);
    const core::Nonce random = core::RandomNonce();
    store.job_token = HexOf(random.data(), random.size());
    const std::string text =
        store.master_addr + "\n" + std::to_string(store.master_port) + "\n" + store.job_token;
    pmix_value_t value;
    std::memset(&value, 0, sizeof value);
    value.type = PMIX_STRING;
    value.data.string = const_cast<char*>(text.c_str());  // PMIx_Put copies it
    if (pmix_status_t status = pmix.put(PMIX_GLOBAL, kKey, &value); status != PMIX_SUCCESS) {
      fail("PMIx_Put", status);
    }
  }
  if (pmix_status_t status = pmix.commit(); status != PMIX_SUCCESS) fail("PMIx_Commit", status);
  pmix_info_t info[2];
  std::memset(info, 0, sizeof info);
  SetKey(info[0].key, PMIX_MAX_KEYLEN, PMIX_COLLECT_DATA);
  info[0].value.type = PMIX_BOOL;
  info[0].value.data.flag = true;
  SetKey(info[1].key, PMIX_MAX_KEYLEN, PMIX_TIMEOUT);
  info[1].value.type = PMIX_INT;
  info[1].value.data.integer = static_cast<int>(timeout.count());
  if (pmix_status_t status = pmix.fence(&job, 1, info, 2); status != PMIX_SUCCESS) {
    fail("PMIx_Fence", status);
  }
  pmix_proc_t root;
  std::memset(&root, 0, sizeof root);
  SetKey(root.nspace, PMIX_MAX_NSLEN, me.nspace);
  root.rank = 0;
  pmix_value_t* value = nullptr;
  if (pmix_status_t status = pmix.get(&root, kKey, nullptr, 0, &value); status != PMIX_SUCCESS) {
    fail("PMIx_Get of rank 0's store address", status);
  }
  std::string text = value != nullptr && value->type == PMIX_STRING && value->data.string != nullptr
                         ? value->data.string
                         : std::string();
  if (value != nullptr) {
    pmix.value_destruct(value);
    std::free(value);
  }
  PmixStore store;
  store.nspace = me.nspace;
  const size_t first = text.find('\n');
  const size_t second = first == std::string::npos ? first : text.find('\n', first + 1);
  if (second != std::string::npos) {
    store.master_addr = text.substr(0, first);
    const int port = std::atoi(text.substr(first + 1, second - first - 1).c_str());
    store.master_port = port > 0 && port < 65536 ? static_cast<uint16_t>(port) : 0;
    store.job_token = text.substr(second + 1);
  }
  if (store.master_addr.empty() || store.master_port == 0) {
    throw Error(ErrorCode::kSystem,
                who + "rank 0's store address from PMIx is malformed: '" +
                    core::OneLine(text, 128) + "'");
  }
  return store;
}

#endif  // COLLECTIVES_WITH_PMIX

}  // namespace

bool StartedByPmix(const std::map<std::string, std::string>& env) {
  return env.count("PMIX_NAMESPACE") != 0 && env.count("PMIX_RANK") != 0;
}

PmixStore ExchangeThroughPmix(int rank, int world_size, const std::string& master_addr,
                              std::chrono::seconds timeout) {
#ifdef COLLECTIVES_WITH_PMIX
  static std::mutex mutex;
  static std::optional<PmixStore> done;
  std::lock_guard<std::mutex> lock(mutex);
  if (!done) done = Exchange(rank, world_size, master_addr, timeout);
  return *done;
#else
  (void)world_size;
  (void)master_addr;
  (void)timeout;
  throw Error(ErrorCode::kNotSupported,
              "rank " + std::to_string(rank) +
                  ": mpirun started this process without MASTER_PORT, and this build has no "
                  "PMIx support (Debian: libpmix-dev) to meet the other ranks; export "
                  "MASTER_ADDR and MASTER_PORT (mpirun -x) instead");
#endif
}

// ---- Slurm host lists ----

namespace {

// One bracket's content "01-03,7" -> {"01", "02", "03", "7"}.
std::vector<std::string> ExpandBracket(std::string_view body, std::string_view what,
                                       std::string_view list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= body.size()) {
    size_t end = body.find(',', start);
    if (end == std::string_view::npos) end = body.size();
    const std::string_view item = body.substr(start, end - start);
    const size_t dash = item.find('-');
    const std::string_view low = item.substr(0, dash);
    const std::string_view high = dash == std::string_view::npos ? low : item.substr(dash + 1);
    auto digits = [](std::string_view text) {
      if (text.empty() || text.size() > 18) return false;
      for (char c : text) {
        if (c < '0' || c > '9') return false;
      }
      return true;
    };
    if (!digits(low) || !digits(high)) {
      Invalid(std::string(what) + "='" + core::OneLine(list, 256) + "': '[" +
              core::OneLine(body, 64) + "]' holds '" + core::OneLine(item, 64) +
              "', which is no number or range of numbers");
    }
    const uint64_t from = std::stoull(std::string(low));
    const uint64_t to = std::stoull(std::string(high));
    if (to < from) {
      Invalid(std::string(what) + "='" + core::OneLine(list, 256) + "': the range '" +
              std::string(item) + "' runs backwards");
    }
    for (uint64_t n = from; n <= to; ++n) {
      std::string number = std::to_string(n);
      if (number.size() < low.size()) number.insert(0, low.size() - number.size(), '0');
      out.push_back(std::move(number));
      if (out.size() > (1u << 20)) break;  // the caller's limit names it
    }
    start = end + 1;
  }
  return out;
}

}  // namespace

std::vector<std::string> ExpandSlurmHostList(std::string_view list, std::string_view what,
                                             size_t limit) {
  std::vector<std::string> hosts;
  // Split at commas outside brackets.
  std::vector<std::string_view> entries;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    const char c = i < list.size() ? list[i] : ',';
    if (c == '[') {
      if (++depth > 1) {
        Invalid(std::string(what) + "='" + core::OneLine(list, 256) + "': nested '['");
      }
    } else if (c == ']') {
      if (--depth < 0) {
        Invalid(std::string(what) + "='" + core::OneLine(list, 256) + "': ']' without '['");
      }
    } else if (c == ',' && depth == 0) {
      entries.push_back(list.substr(start, i - start));
      start = i + 1;
    }
  }
  if (depth != 0) {
    Invalid(std::string(what) + "='" + core::OneLine(list, 256) + "': '[' without ']'");
  }
  for (std::string_view entry : entries) {
    if (entry.empty()) {
      Invalid(std::string(what) + "='" + core::OneLine(list, 256) + "' has an empty entry");
    }
    std::vector<std::string> partial = {std::string()};
    size_t at = 0;
    while (at < entry.size()) {
      const size_t open = entry.find('[', at);
      const std::string_view text = entry.substr(at, open - at);
      for (std::string& host : partial) host += text;
      if (open == std::string_view::npos) break;
      const size_t close = entry.find(']', open);
      const std::vector<std::string> numbers =
          ExpandBracket(entry.substr(open + 1, close - open - 1), what, list);
      std::vector<std::string> next;
      for (const std::string& host : partial) {
        for (const std::string& number : numbers) {
          next.push_back(host + number);
          if (hosts.size() + next.size() > limit) {
            Invalid(std::string(what) + "='" + core::OneLine(list, 256) + "' names more than " +
                    std::to_string(limit) + " hosts");
          }
        }
      }
      partial = std::move(next);
      at = close + 1;
    }
    for (std::string& host : partial) {
      hosts.push_back(std::move(host));
      if (hosts.size() > limit) {
        Invalid(std::string(what) + "='" + core::OneLine(list, 256) + "' names more than " +
                std::to_string(limit) + " hosts");
      }
    }
  }
  return hosts;
}

uint16_t SlurmDefaultPort(uint64_t job_id, uint64_t step_id) {
  return static_cast<uint16_t>(20000 + 4 * (job_id % 10000) + step_id % 4);
}

}  // namespace collectives::cluster
