// Thread-safe strerror for messages built on engine and worker threads.
#pragma once

#include <string.h>

#include <string>

namespace strata::io {

inline std::string errno_text(int err) {
  char buf[128];
  // The GNU strerror_r returns the message, which may or may not be written into buf.
  return ::strerror_r(err, buf, sizeof(buf));
}

}  // namespace strata::io
