// Tests of core::OneLine (src/core/text.h): what a peer, a store or a server sends reaches an
// error message or the log on one line, with nothing a terminal would act on.
#include "src/core/text.h"

#include <gtest/gtest.h>

#include <string>

namespace collectives::core {
namespace {

TEST(OneLineTest, PrintableAsciiAndWellFormedUtf8StayAsTheyAre) {
  EXPECT_EQ(OneLine("rank 3: out of memory (42 MiB)"), "rank 3: out of memory (42 MiB)");
  const std::string utf8 = "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xc2\xa0";  // é € 😀 nbsp
  EXPECT_EQ(OneLine(utf8), utf8);
  EXPECT_EQ(OneLine(""), "");
}

TEST(OneLineTest, ControlsDelAndTheBackslashAreEscaped) {
  EXPECT_EQ(OneLine("two\nlines\r\t"), "two\\x0alines\\x0d\\x09");
  EXPECT_EQ(OneLine("\x1b[31mred\x7f"), "\\x1b[31mred\\x7f");
  EXPECT_EQ(OneLine(std::string("nul\0byte", 8)), "nul\\x00byte");
  // A peer writing "\x1b" as four characters cannot pass for an escaped ESC.
  EXPECT_EQ(OneLine("\\x1b"), "\\x5cx1b");
}

// The C1 controls, U+0080..U+009F, encoded (0xc2 0x80..0x9f) or as lone bytes (an 8-bit
// terminal reads 0x9b as CSI), and every byte that is not well-formed UTF-8.
TEST(OneLineTest, C1ControlsAndMalformedUtf8AreEscaped) {
  EXPECT_EQ(OneLine("a\xc2\x9b"
                    "31mb"),
            "a\\xc2\\x9b31mb");
  EXPECT_EQ(OneLine("a\x9b"
                    "31mb"),
            "a\\x9b31mb");
  EXPECT_EQ(OneLine("\xc0\xaf"), "\\xc0\\xaf");                    // overlong '/'
  EXPECT_EQ(OneLine("\xed\xa0\x80"), "\\xed\\xa0\\x80");           // a surrogate
  EXPECT_EQ(OneLine("\xf4\x90\x80\x80"), "\\xf4\\x90\\x80\\x80");  // past U+10FFFF
  EXPECT_EQ(OneLine("\xff\xfe"), "\\xff\\xfe");
  EXPECT_EQ(OneLine("\xe2\x82"), "\\xe2\\x82");  // cut short
}

TEST(OneLineTest, LongTextIsCutAndACharacterTheCutSplitsIsEscaped) {
  EXPECT_EQ(OneLine(std::string(10, 'x'), 4), "xxxx...");
  EXPECT_EQ(OneLine("ab\xe2\x82\xac", 4), "ab\\xe2\\x82...");
  EXPECT_EQ(OneLine("abcd", 4), "abcd");
}

}  // namespace
}  // namespace collectives::core
