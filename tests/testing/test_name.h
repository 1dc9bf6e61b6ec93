// Names for parameterized tests: GoogleTest accepts only letters, digits and underscores.
#pragma once

#include <cctype>
#include <string>

namespace strata::testing {

// `s` with every character that is not a letter or a digit replaced by '_'.
inline std::string test_name(std::string s) {
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

}  // namespace strata::testing
