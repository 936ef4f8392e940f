#include <cstdio>
#include <cstdlib>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>

#include <trellis/core/logging.h>

namespace trellis::log {

std::optional<spdlog::level::level_enum> parseLevel(std::string_view name) {
  using spdlog::level::level_enum;
  static constexpr std::pair<std::string_view, level_enum> kLevels[] = {
      {"trace", level_enum::trace},       {"debug", level_enum::debug},
      {"info", level_enum::info},         {"warn", level_enum::warn},
      {"warning", level_enum::warn},      {"error", level_enum::err},
      {"critical", level_enum::critical}, {"off", level_enum::off},
  };
  std::string lower(name);
  for (auto& c : lower) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  for (const auto& [text, level] : kLevels) {
    if (lower == text) {
      return level;
    }
  }
  return std::nullopt;
}

namespace {

std::shared_ptr<spdlog::logger> makeLogger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("trellis", sink);
  logger->set_pattern(
      "[%Y-%m-%d %H:%M:%S.%e] [trellis] [%^%l%$] [pid %P tid %t] %v");
  auto level = spdlog::level::warn;
  if (const char* env = std::getenv("TRELLIS_LOG_LEVEL");
      env != nullptr && *env) {
    if (auto parsed = parseLevel(env)) {
      level = *parsed;
    } else {
      std::fprintf(
          stderr,
          "trellis: ignoring TRELLIS_LOG_LEVEL='%.64s': expected one of "
          "trace, debug, info, warn, error, critical, off; using warn\n",
          env);
    }
  }
  logger->set_level(level);
  logger->flush_on(spdlog::level::warn);
  return logger;
}

}  // namespace

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = makeLogger();
  return *instance;
}

}  // namespace trellis::log
