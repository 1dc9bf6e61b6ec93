#include "src/text/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "strata/core/check.h"

namespace strata::text {

char32_t next_char(std::string_view s, std::size_t* pos) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + *pos;
  const unsigned char lead = p[0];
  if (lead < 0x80) {
    *pos += 1;
    return lead;
  }
  if (*pos + utf8_length(lead) > s.size()) {  // a sequence cut short by the end: never read past
    *pos = s.size();
    return 0xFFFD;
  }
  if (lead < 0xE0) {
    *pos += 2;
    return (char32_t{lead & 0x1Fu} << 6) | (p[1] & 0x3Fu);
  }
  if (lead < 0xF0) {
    *pos += 3;
    return (char32_t{lead & 0x0Fu} << 12) | (char32_t{p[1] & 0x3Fu} << 6) | (p[2] & 0x3Fu);
  }
  *pos += 4;
  return (char32_t{lead & 0x07u} << 18) | (char32_t{p[1] & 0x3Fu} << 12) |
         (char32_t{p[2] & 0x3Fu} << 6) | (p[3] & 0x3Fu);
}

void append_utf8(std::string* out, char32_t c) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::size_t find_invalid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    utf8proc_int32_t c = 0;
    const utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(&s[i]),
                                                static_cast<utf8proc_ssize_t>(s.size() - i), &c);
    if (n <= 0) return i;
    i += static_cast<std::size_t>(n);
  }
  return std::string_view::npos;
}

std::string replace_invalid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  std::size_t i = 0;
  while (i < s.size()) {
    const auto lead = static_cast<unsigned char>(s[i]);
    if (lead < 0x80) {
      out += s[i++];
      continue;
    }
    // Table 3-7: the length of the sequence a lead byte starts and the range its second byte
    // must fall in (the others are 80..BF); 0: not a lead byte.
    std::size_t length = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      length = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      length = 3;
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      length = 4;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    }
    std::size_t n = 1;  // bytes of the sequence that fit so far
    while (n < length && i + n < s.size()) {
      const auto b = static_cast<unsigned char>(s[i + n]);
      if (n == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
      ++n;
    }
    if (length != 0 && n == length) {
      out.append(s.substr(i, n));
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
    }
    i += n;
  }
  return out;
}

namespace {

utf8proc_category_t category(char32_t c) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(c));
}

}  // namespace

bool is_whitespace(char32_t c) {
  switch (c) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

bool is_punctuation(char32_t c) {
  switch (category(c)) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

bool is_mark(char32_t c) {
  const auto cat = category(c);
  return cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME;
}

bool is_bert_control(char32_t c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  const auto cat = category(c);
  return cat == UTF8PROC_CATEGORY_CC || cat == UTF8PROC_CATEGORY_CF ||
         cat == UTF8PROC_CATEGORY_CN || cat == UTF8PROC_CATEGORY_CO;
}

bool is_nonspacing_mark(char32_t c) { return category(c) == UTF8PROC_CATEGORY_MN; }

bool is_word(char32_t c) {
  const auto cat = category(c);
  switch (cat) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

std::string normalize(std::string_view s, NormalForm form) {
  if (s.empty()) return {};
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(options));
  STRATA_CHECK(n >= 0, "utf8proc_map failed on valid UTF-8");
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  return std::string(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
}

std::string lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  std::size_t pos = 0;
  while (pos < s.size()) {
    const char32_t c = next_char(s, &pos);
    if (c == 0x130) {  // the one unconditional multi-character lowercase mapping
      out += "i\xCC\x87";
      continue;
    }
    append_utf8(&out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
  }
  return out;
}

const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

int char_to_byte(char32_t c) {
  static const std::array<std::int16_t, 512> table = [] {
    std::array<std::int16_t, 512> t{};
    t.fill(-1);
    for (int b = 0; b < 256; ++b)
      t[byte_to_char()[static_cast<std::size_t>(b)]] = static_cast<std::int16_t>(b);
    return t;
  }();
  return c < 512 ? table[c] : -1;
}

}  // namespace strata::text
