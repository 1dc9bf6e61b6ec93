// Leveled logging to stderr.
#include "strata/core/logging.h"

#include <atomic>
#include <cstdio>
#include <mutex>

namespace strata {
namespace {
std::atomic<LogLevel> g_level{LogLevel::kInfo};  // process-wide verbosity, set once by the CLI
std::mutex g_log_mutex;
}  // namespace

void set_log_level(LogLevel level) { g_level.store(level); }
LogLevel log_level() { return g_level.load(); }

void log(LogLevel level, std::string_view message) {
  if (level < g_level.load()) return;
  const char* tag = level == LogLevel::kDebug     ? "debug"
                    : level == LogLevel::kInfo    ? "info"
                    : level == LogLevel::kWarning ? "warning"
                                                  : "error";
  std::lock_guard lock(g_log_mutex);
  std::fprintf(stderr, "strata %s: %.*s\n", tag, static_cast<int>(message.size()), message.data());
}

}  // namespace strata
