// Parsing and formatting of "host:port" addresses as TF_CONFIG and MASTER_ADDR spell them.
//
// Accepted: "name:port", "1.2.3.4:port", "[::1]:port" (IPv6 in brackets). The host is returned
// without brackets, so it can be handed to a resolver as is. Port must be 1..65535, written in
// decimal digits only. A host holds no whitespace, control character (NUL included), '/' or
// bracket other than the pair around an IPv6 address; the brackets hold an IPv6 address.
// CheckHost applies the same rules to a host given alone (MASTER_ADDR, a listen address).
//
// Thread-safety: plain functions over values (LoopbackOnlyAddresses and WarnIfLoopbackOnly ask
// the resolver, by a deadline).
#ifndef COLLECTIVES_SRC_CLUSTER_HOST_PORT_H_
#define COLLECTIVES_SRC_CLUSTER_HOST_PORT_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace collectives::cluster {

using Clock = std::chrono::steady_clock;

struct HostPort {
  std::string host;  // without IPv6 brackets
  uint16_t port = 0;
};

// Parses `text` as "host:port". On failure returns nullopt and sets `*why` to a short reason
// ("missing port", "port 0 is not in 1..65535", ...).
std::optional<HostPort> ParseHostPort(std::string_view text, std::string* why);

// Checks `text` as a host given alone: a name, an IPv4 address, or an IPv6 address bare ("::1")
// or in brackets ("[::1]"). Returns it without brackets. On failure returns nullopt and sets
// `*why` to a short reason; a text with one ':' that is no IPv6 address ("10.0.0.1:29500") is
// said to hold a port, followed by "; " and `port_remedy` when not empty (where the port goes:
// "put the port in MASTER_PORT").
std::optional<std::string> CheckHost(std::string_view text, std::string_view port_remedy,
                                     std::string* why);

// Parses a port written in decimal digits, 1..65535. Returns nullopt otherwise.
std::optional<uint16_t> ParsePort(std::string_view text);

// Removes the brackets of "[::1]"; any other host is returned as is.
std::string StripBrackets(std::string_view host);

// "host:port", with IPv6 hosts (any host containing ':') put in brackets.
std::string FormatHostPort(std::string_view host, uint16_t port);

// When `host` is a name (not an address, not "localhost") and every address it resolves to
// here is a loopback one, those addresses ("127.0.1.1"); otherwise, or when it does not
// resolve, or when its lookup (name_lookups.h) has not answered by `deadline`, "". A listener
// bound to such a name cannot be reached from another host: Debian and Ubuntu map a host's own
// name to 127.0.1.1 in /etc/hosts.
std::string LoopbackOnlyAddresses(const std::string& host,
                                  Clock::time_point deadline = Clock::time_point::max());

// Before rank `rank` binds `listener` to `host` (brackets allowed) in a job of several ranks:
// when LoopbackOnlyAddresses (by `deadline`) says no other host can reach it, writes one line on
// stderr saying so, with `remedy`.
void WarnIfLoopbackOnly(int rank, const std::string& listener, const std::string& host,
                        const std::string& remedy,
                        Clock::time_point deadline = Clock::time_point::max());

}  // namespace collectives::cluster

#endif  // COLLECTIVES_SRC_CLUSTER_HOST_PORT_H_
