// What the library reads from the process environment and the machine for its tuning choices:
// counts from environment variables, parsed one strict way, and whether the machine has a core
// for each of this host's ranks.
//
// Several waits and buffers are tuned differently when every rank on the machine can have a core
// of its own (poll rather than sleep; a fixed socket receive buffer; packing overlapped with the
// transfer): with more ranks than cores, a thread that polls takes the core a peer needs. The
// rule is one comparison, made here, over the ranks that share this machine: a multi-host job
// counts its local ranks, not the world.
#ifndef COLLECTIVES_SRC_CORE_ENVIRONMENT_H_
#define COLLECTIVES_SRC_CORE_ENVIRONMENT_H_

#include <cstdint>
#include <optional>
#include <string>

namespace collectives::core {

// `text` (the value of variable `name`) as a count: nullopt when `text` is null (unset); the
// number when it is all decimal digits and fits in 64 bits; otherwise nullopt, after a line on
// stderr naming the variable, its value and `expected`. strtoull alone would take " 12", "+12"
// and "12abc", and turn "-5" into a huge count.
std::optional<uint64_t> CountFromText(const char* name, const char* text, const char* expected);

// CountFromText of environment variable `name`.
std::optional<uint64_t> EnvCount(const char* name, const char* expected);

// The ranks of this job on this machine: LOCAL_WORLD_SIZE (torchrun, our launcher) or else
// OMPI_COMM_WORLD_LOCAL_SIZE (mpirun) when set to a positive count, else `world_size` (every
// rank, the cautious guess). The launchers set them once, so they are read once per process.
int LocalRanks(int world_size);

// LocalRanks from the two variables' values (null: unset).
int LocalRanksFrom(const char* local_world_size, const char* ompi_local_size, int world_size);

// This machine's host name ("unknown" if it has none to give).
std::string HostName();

// Whether the machine has at least `ranks` x `threads_per_rank` hardware threads (false when it
// cannot tell).
bool CoresFor(int ranks, int threads_per_rank = 1);

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_ENVIRONMENT_H_
