// Text that came from elsewhere (a peer's abort message, a store value, a server's reply) made
// fit for one line of an error message or a log.
//
// Thread-safety: plain functions.
#ifndef COLLECTIVES_SRC_CORE_TEXT_H_
#define COLLECTIVES_SRC_CORE_TEXT_H_

#include <cstddef>
#include <string>
#include <string_view>

namespace collectives::core {

// `text` with its control bytes (a newline, a terminal escape, DEL) as \xNN, the rest (UTF-8
// included) as it is, cut after `max_bytes` bytes of `text` with "..." (the cut may split a UTF-8
// character).
inline std::string OneLine(std::string_view text, size_t max_bytes = 4096) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  const size_t shown = text.size() < max_bytes ? text.size() : max_bytes;
  out.reserve(shown);
  for (size_t i = 0; i < shown; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c != 0x7f) {
      out.push_back(text[i]);
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (shown < text.size()) out += "...";
  return out;
}

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_TEXT_H_
