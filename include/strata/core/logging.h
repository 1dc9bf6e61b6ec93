// Minimal leveled logging to stderr; the CLI decides the level.
#pragma once

#include <string_view>

namespace strata {

enum class LogLevel { kDebug, kInfo, kWarning, kError };

void set_log_level(LogLevel level);
LogLevel log_level();
void log(LogLevel level, std::string_view message);
inline void log_info(std::string_view m) { log(LogLevel::kInfo, m); }
inline void log_warning(std::string_view m) { log(LogLevel::kWarning, m); }
inline void log_debug(std::string_view m) { log(LogLevel::kDebug, m); }

}  // namespace strata
