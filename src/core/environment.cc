#include "src/core/environment.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <iostream>
#include <thread>
#include <utility>

namespace collectives::core {

std::optional<uint64_t> CountFromText(const char* name, const char* text, const char* expected) {
  if (text == nullptr) return std::nullopt;
  bool digits = *text != '\0';
  for (const char* c = text; *c != '\0'; ++c) digits = digits && *c >= '0' && *c <= '9';
  if (digits) {
    errno = 0;
    const unsigned long long value = std::strtoull(text, nullptr, 10);
    if (errno == 0) return static_cast<uint64_t>(value);
  }
  std::cerr << "collectives: ignoring " << name << "=\"" << text << "\" (expected " << expected
            << ")\n";
  return std::nullopt;
}

std::optional<uint64_t> EnvCount(const char* name, const char* expected) {
  return CountFromText(name, std::getenv(name), expected);
}

int LocalRanksFrom(const char* local_world_size, const char* ompi_local_size, int world_size) {
  const std::pair<const char*, const char*> variables[] = {
      {"LOCAL_WORLD_SIZE", local_world_size}, {"OMPI_COMM_WORLD_LOCAL_SIZE", ompi_local_size}};
  for (const auto& [name, text] : variables) {
    const std::optional<uint64_t> n = CountFromText(name, text, "a count of ranks");
    if (n && *n > 0 && *n <= uint64_t{INT_MAX}) return static_cast<int>(*n);
  }
  return world_size;
}

int LocalRanks(int world_size) {
  static const int from_environment =
      LocalRanksFrom(std::getenv("LOCAL_WORLD_SIZE"), std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"), 0);
  return from_environment > 0 ? from_environment : world_size;
}

std::string HostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || host[0] == '\0') return "unknown";
  return host;
}

bool CoresFor(int ranks, int threads_per_rank) {
  const uint64_t cores = std::thread::hardware_concurrency();
  return cores >= uint64_t(std::max(ranks, 0)) * uint64_t(std::max(threads_per_rank, 0));
}

}  // namespace collectives::core
