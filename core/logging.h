#pragma once

// Logging on spdlog. Internal to Trellis (not an installed header).
//
// The level comes from TRELLIS_LOG_LEVEL (trace, debug, info, warn, error,
// critical, off; default warn) read once at first use. An unknown value is
// reported on stderr, naming the variable and the accepted values, and the
// default is kept. Messages begin with the hierarchical id of the object that
// logs them ("agent.w3.pipe7: ...").

#include <optional>
#include <string_view>

#include <spdlog/spdlog.h>

namespace trellis::log {

spdlog::logger& logger();

// Parses a level name; nullopt when it is not one.
std::optional<spdlog::level::level_enum> parseLevel(std::string_view name);

}  // namespace trellis::log

#define TRELLIS_LOG_TRACE(...) \
  SPDLOG_LOGGER_TRACE(&::trellis::log::logger(), __VA_ARGS__)
#define TRELLIS_LOG_DEBUG(...) \
  SPDLOG_LOGGER_DEBUG(&::trellis::log::logger(), __VA_ARGS__)
#define TRELLIS_LOG_INFO(...) \
  SPDLOG_LOGGER_INFO(&::trellis::log::logger(), __VA_ARGS__)
#define TRELLIS_LOG_WARN(...) \
  SPDLOG_LOGGER_WARN(&::trellis::log::logger(), __VA_ARGS__)
#define TRELLIS_LOG_ERROR(...) \
  SPDLOG_LOGGER_ERROR(&::trellis::log::logger(), __VA_ARGS__)
