// elastic-run: torchrun's command line (docs/elastic.md).
//
//   elastic-run --standalone --nproc-per-node 2 ./train --epochs 3
//
// Exit status: 0 when every worker of the last attempt exited 0; 1 when
// the workers failed and the restart budget is spent; 2 for a bad command
// line or a rendezvous configuration that does not match the other nodes';
// 127 when CMD cannot be executed; 128 + N when signal N stopped the agent
// (143 for SIGTERM).

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include <trellis/core/error.h>
#include <trellis/elastic/agent.h>
#include <trellis/elastic/options.h>

namespace {

using trellis::elastic::kExitUsage;

int usageError(std::string message) {
  // parseOptions names the program in a few of its messages already.
  const std::string self = "elastic-run: ";
  if (message.rfind(self, 0) == 0) {
    message.erase(0, self.size());
  }
  std::fprintf(stderr, "elastic-run: error: %s\n", message.c_str());
  return kExitUsage;
}

// TRELLIS_ELASTIC_STOP_GRACE_S: seconds, > 0 and <= 3600.
std::chrono::milliseconds stopGrace(const trellis::elastic::Environment& env) {
  const auto it = env.find(trellis::elastic::kStopGraceEnvVar);
  if (it == env.end() || it->second.empty()) {
    return trellis::elastic::kDefaultStopGrace;
  }
  char* end = nullptr;
  const double s = std::strtod(it->second.c_str(), &end);
  if (end == it->second.c_str() || *end != '\0' || !(s > 0) || s > 3600) {
    throw trellis::InvalidArgumentError(trellis::Error::invalidArgument(
        std::string(trellis::elastic::kStopGraceEnvVar) + "='" + it->second +
        "': must be seconds in (0, 3600]"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

}  // namespace

int main(int argc, char** argv) {
  namespace el = trellis::elastic;
  el::ElasticOptions options;
  el::AgentConfig config;
  try {
    const el::ParseContext context = el::ParseContext::fromProcess();
    options = el::parseOptions(argc, argv, context);
    if (options.helpRequested) {
      std::fputs(el::usage().c_str(), stdout);
      return 0;
    }
    el::checkSupported(options);
    el::checkJobToken(options, context.env);
    config.env = context.env;
    config.stopGrace = stopGrace(context.env);
  } catch (const trellis::InvalidArgumentError& e) {
    return usageError(e.error().message());
  }
  for (const auto& w : options.warnings) {
    std::fprintf(stderr, "elastic-run: warning: %s\n", w.c_str());
  }
  try {
    el::Agent agent(std::move(options), std::move(config));
    const el::RunResult result = agent.run();
    if (!result.summary.empty()) {
      std::fprintf(stderr, "elastic-run: error: %s\n", result.summary.c_str());
    }
    return result.exitCode;
  } catch (const trellis::InvalidArgumentError& e) {
    return usageError(e.error().message());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic-run: error: %s\n", e.what());
    return el::kExitWorkerFailed;
  }
}
