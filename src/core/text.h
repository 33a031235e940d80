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

// `text` with every byte that could move the cursor, end the line or start a terminal sequence
// as \xNN: the C0 controls (a newline, ESC), DEL, the C1 controls (U+0080..U+009F, which some
// terminals read as ESC sequences), bytes that are not well-formed UTF-8 (a lone 0x9b is CSI to
// an 8-bit terminal), and the backslash itself (so that "\x1b" in the text cannot pass for an
// escaped ESC). Printable ASCII and the rest of UTF-8 stay as they are. Cut after `max_bytes`
// bytes of `text` with "..." (a character the cut splits is escaped, being incomplete).
inline std::string OneLine(std::string_view text, size_t max_bytes = 4096) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  const size_t shown = text.size() < max_bytes ? text.size() : max_bytes;
  out.reserve(shown);
  const auto byte = [&text](size_t i) { return static_cast<unsigned char>(text[i]); };
  const auto escape = [&out](unsigned char c) {
    out += "\\x";
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  };
  for (size_t i = 0; i < shown; ++i) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f || c == '\\') {
        escape(c);
      } else {
        out.push_back(static_cast<char>(c));
      }
      continue;
    }
    // A UTF-8 sequence: its length from the lead byte, its second byte's range (which rules
    // out overlong forms, surrogates and code points past U+10FFFF), then continuation bytes.
    size_t length = 0;
    unsigned char low = 0x80, high = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) {
      length = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      length = 3;
      if (c == 0xe0) low = 0xa0;
      if (c == 0xed) high = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      length = 4;
      if (c == 0xf0) low = 0x90;
      if (c == 0xf4) high = 0x8f;
    }
    bool valid = length > 0 && i + length <= shown && byte(i + 1) >= low && byte(i + 1) <= high;
    for (size_t k = 2; valid && k < length; ++k) valid = byte(i + k) >= 0x80 && byte(i + k) <= 0xbf;
    if (valid && c == 0xc2 && byte(i + 1) <= 0x9f) valid = false;  // a C1 control
    if (!valid) {
      escape(c);  // the bytes after it are looked at on their own
      continue;
    }
    out.append(text.substr(i, length));
    i += length - 1;
  }
  if (shown < text.size()) out += "...";
  return out;
}

}  // namespace collectives::core

#endif  // COLLECTIVES_SRC_CORE_TEXT_H_
