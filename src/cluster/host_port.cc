// "host:port" parsing and formatting (see host_port.h).
#include "src/cluster/host_port.h"

#include <cctype>
#include <cstdio>
// A standard header (above) comes before <asio.hpp>: see tcp_store_server.cc.
#include <asio.hpp>

#include "src/cluster/name_lookups.h"
#include "src/core/text.h"

namespace collectives::cluster {
namespace {

// False, with `*why` set, when `host` (brackets of an IPv6 address removed) holds a character
// no host name or address does. Such a host would otherwise reach the resolver, which cuts it
// at a NUL ("a\0x" resolves as "a") or retries a name that can never resolve until the timeout.
bool HasOnlyHostCharacters(std::string_view host, std::string* why) {
  for (char c : host) {
    const auto byte = static_cast<unsigned char>(c);
    if (std::isspace(byte)) {
      *why = "a whitespace character in the host";
    } else if (byte == 0) {
      *why = "a NUL byte in the host";
    } else if (byte < 0x20 || byte == 0x7f) {
      *why = "a control character in the host";
    } else if (c == '/') {
      *why = "'/' in the host (a host name or address, not a URL or a path)";
    } else if (c == '[' || c == ']') {
      *why = "a bracket in the host that does not enclose the whole of an IPv6 address, as [::1]";
    } else {
      continue;
    }
    return false;
  }
  return true;
}

bool IsIpv6Address(std::string_view host) {
  asio::error_code ec;
  (void)asio::ip::make_address_v6(std::string(host), ec);
  return !ec;
}

constexpr char kBracketsHoldIpv6[] = "brackets enclose an IPv6 address only, as [::1]";

}  // namespace

std::optional<std::string> CheckHost(std::string_view text, std::string_view port_remedy,
                                     std::string* why) {
  std::string_view host = text;
  const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
  if (bracketed) host = host.substr(1, host.size() - 2);
  if (host.empty()) {
    *why = "empty host";
    return std::nullopt;
  }
  if (!HasOnlyHostCharacters(host, why)) return std::nullopt;
  if (bracketed && !IsIpv6Address(host)) {
    *why = kBracketsHoldIpv6;
    return std::nullopt;
  }
  const size_t colon = host.find(':');
  if (colon != std::string_view::npos && !IsIpv6Address(host)) {
    if (host.find(':', colon + 1) == std::string_view::npos) {
      // The text quoted here came from the caller's input: escaped and cut as every quote of
      // it is (core::OneLine).
      *why = "it holds a port ('";
      why->append(core::OneLine(host.substr(colon), 64)).append("')");
      if (!port_remedy.empty()) why->append("; ").append(port_remedy);
    } else {
      *why = "it holds ':' but is not an IPv6 address";
    }
    return std::nullopt;
  }
  return std::string(host);
}

std::optional<uint16_t> ParsePort(std::string_view text) {
  if (text.empty() || text.size() > 5) return std::nullopt;
  uint32_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<uint32_t>(c - '0');
  }
  if (value < 1 || value > 65535) return std::nullopt;
  return static_cast<uint16_t>(value);
}

std::optional<HostPort> ParseHostPort(std::string_view text, std::string* why) {
  std::string_view host;
  std::string_view rest;  // what follows the host: ":port" or nothing
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string_view::npos) {
      *why = "unterminated '[' of an IPv6 address";
      return std::nullopt;
    }
    host = text.substr(1, close - 1);
    rest = text.substr(close + 1);
    if (!rest.empty() && rest.front() != ':') {
      *why = "expected ':' after ']'";
      return std::nullopt;
    }
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) {
      *why = "missing port (expected host:port)";
      return std::nullopt;
    }
    host = text.substr(0, colon);
    rest = text.substr(colon);
    if (host.find(':') != std::string_view::npos) {
      *why = "an IPv6 address must be written in brackets, as [::1]:port";
      return std::nullopt;
    }
  }
  if (host.empty()) {
    *why = "empty host";
    return std::nullopt;
  }
  if (!HasOnlyHostCharacters(host, why)) return std::nullopt;
  if (text.front() == '[' && !IsIpv6Address(host)) {
    *why = kBracketsHoldIpv6;
    return std::nullopt;
  }
  if (rest.empty() || rest == ":") {
    *why = "missing port (expected host:port)";
    return std::nullopt;
  }
  std::string_view port_text = rest.substr(1);
  std::optional<uint16_t> port = ParsePort(port_text);
  if (!port) {
    *why = "port '" + core::OneLine(port_text, 64) + "' is not a number in 1..65535";
    return std::nullopt;
  }
  return HostPort{std::string(host), *port};
}

std::string StripBrackets(std::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return std::string(host.substr(1, host.size() - 2));
  }
  return std::string(host);
}

std::string FormatHostPort(std::string_view host, uint16_t port) {
  std::string out;
  if (host.find(':') != std::string_view::npos) {
    out.append("[").append(host).append("]");
  } else {
    out.append(host);
  }
  out.append(":").append(std::to_string(port));
  return out;
}

std::string LoopbackOnlyAddresses(const std::string& host, Clock::time_point deadline) {
  asio::error_code ec;
  (void)asio::ip::make_address(host, ec);
  if (!ec || host == "localhost") return {};  // an address, or a name that says what it is
  const auto results = LookUpBy(host, deadline);
  if (!results || results->empty()) return {};
  std::string addresses;
  for (const auto& entry : *results) {
    const asio::ip::address address = entry.endpoint().address();
    if (!address.is_loopback()) return {};
    const std::string text = address.to_string();
    if (addresses.find(text) == std::string::npos) {
      addresses += (addresses.empty() ? "" : ", ") + text;
    }
  }
  return addresses;
}

void WarnIfLoopbackOnly(int rank, const std::string& listener, const std::string& host,
                        const std::string& remedy, Clock::time_point deadline) {
  const std::string addresses = LoopbackOnlyAddresses(StripBrackets(host), deadline);
  if (addresses.empty()) return;
  const std::string line = "collectives: rank " + std::to_string(rank) + ": " + listener +
                           " binds to '" + host + "', which is " + addresses +
                           " here, a loopback address: ranks on other hosts cannot reach it. If "
                           "the job spans hosts, " +
                           remedy + ".\n";
  std::fwrite(line.data(), 1, line.size(), stderr);  // one write: lines of ranks do not mix
}

}  // namespace collectives::cluster
