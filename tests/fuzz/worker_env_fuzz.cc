// Fuzz target for the worker environment (core/worker_env.h): variables a
// launcher, a batch script or a user set, as "NAME=value" lines.
//
// Checked: parsing neither crashes nor reads out of bounds, and refuses
// only with InvalidArgumentError whose message names what was wrong; what
// it accepts satisfies the documented invariants (TORCHELASTIC_USE_AGENT_STORE
// among them: a key prefix exactly when the launcher serves the store).
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>

#include <trellis/core/error.h>
#include <trellis/core/worker_env.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, std::string> vars;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    const std::string_view line = text.substr(0, nl);
    const size_t eq = line.find('=');
    if (eq != std::string_view::npos) {
      vars[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
    }
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
  }
  try {
    const trellis::WorkerEnv env = trellis::WorkerEnv::fromVariables(
        [&](const char* name) -> std::optional<std::string> {
          auto it = vars.find(name);
          if (it == vars.end()) {
            return std::nullopt;
          }
          return it->second;
        });
    if (env.rank < 0 || env.rank >= env.worldSize || env.localRank < 0 ||
        env.localRank >= env.localWorldSize ||
        env.localWorldSize > env.worldSize || env.launcher.empty() ||
        env.master.addr.size() > 255) {
      std::abort();
    }
    // The launcher's store: a key prefix of torch's shape, else none.
    if (env.master.agentStore !=
        (env.master.keyPrefix.rfind("/worker/attempt_", 0) == 0)) {
      std::abort();
    }
  } catch (const trellis::InvalidArgumentError& e) {
    if (e.error().message().empty()) {
      std::abort();
    }
  }
  return 0;
}
