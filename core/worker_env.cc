#include <cctype>
#include <cerrno>
#include <cstdlib>

#include <trellis/core/error.h>
#include <trellis/core/text.h>
#include <trellis/core/worker_env.h>

namespace trellis {
namespace {

// Far above any real job; keeps every rank an int32_t with room to spare.
constexpr long long kMaxWorldSize = 1 << 24;

std::optional<std::string> fromProcess(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) {
    return std::nullopt;
  }
  return std::string(v);
}

std::optional<std::string> read(const WorkerEnv::Lookup& lookup,
                                const char* name) {
  auto v = lookup(name);
  if (v.has_value() && v->empty()) {
    return std::nullopt;
  }
  return v;
}

[[noreturn]] void bad(const char* name, const std::string& value,
                      const std::string& why) {
  throw InvalidArgumentError(
      Error::invalidArgument(std::string(name) + "='" + value + "' " + why));
}

// A decimal integer in [lo, hi], nothing around it.
long long parseInt(const char* name, const std::string& value, long long lo,
                   long long hi, const std::string& range) {
  const std::optional<int64_t> v = parseDecimal(value);
  if (!v) {
    bad(name, value, "is not a decimal integer");
  }
  if (*v < lo || *v > hi) {
    bad(name, value, "is out of range: " + range);
  }
  return *v;
}

}  // namespace

MasterEndpoint masterFromVariables(const WorkerEnv::Lookup& lookup) {
  MasterEndpoint m;
  if (auto addr = read(lookup, "MASTER_ADDR")) {
    // A host name or an address literal; the resolver has the last word,
    // this only keeps obvious garbage out of error messages and logs.
    if (addr->size() > 255) {
      bad("MASTER_ADDR", addr->substr(0, 32) + "...",
          "is longer than a host name can be (255)");
    }
    for (const char c : *addr) {
      if (static_cast<unsigned char>(c) <= 0x20 ||
          static_cast<unsigned char>(c) >= 0x7f) {
        bad("MASTER_ADDR", *addr,
            "is not a host name or address (it has a space or a control "
            "character)");
      }
    }
    m.addr = *addr;
  }
  if (auto port = read(lookup, "MASTER_PORT")) {
    m.port = static_cast<uint16_t>(
        parseInt("MASTER_PORT", *port, 1, 65535, "a port is 1-65535"));
  }
  return m;
}

MasterEndpoint masterFromEnvironment() {
  return masterFromVariables(&fromProcess);
}

WorkerEnv WorkerEnv::fromVariables(const Lookup& lookup) {
  auto required = [&](const char* name) {
    auto v = read(lookup, name);
    if (!v.has_value()) {
      throw InvalidArgumentError(Error::invalidArgument(
          std::string(name) +
          " is not set: start the workers with a launcher that sets RANK "
          "and WORLD_SIZE (trellis-launch, torchrun), or set them"));
    }
    return *v;
  };
  WorkerEnv env;
  const std::string world = required("WORLD_SIZE");
  env.worldSize =
      static_cast<int32_t>(parseInt("WORLD_SIZE", world, 1, kMaxWorldSize,
                                    "1-" + std::to_string(kMaxWorldSize)));
  const std::string rank = required("RANK");
  env.rank =
      static_cast<int32_t>(parseInt("RANK", rank, 0, env.worldSize - 1,
                                    "0 <= RANK < WORLD_SIZE (" + world + ")"));
  env.localWorldSize = env.worldSize;
  if (auto v = read(lookup, "LOCAL_WORLD_SIZE")) {
    env.localWorldSize = static_cast<int32_t>(
        parseInt("LOCAL_WORLD_SIZE", *v, 1, env.worldSize,
                 "1 <= LOCAL_WORLD_SIZE <= WORLD_SIZE (" + world + ")"));
  }
  env.localRank = env.rank;
  if (auto v = read(lookup, "LOCAL_RANK")) {
    env.localRank = static_cast<int32_t>(
        parseInt("LOCAL_RANK", *v, 0, env.localWorldSize - 1,
                 "0 <= LOCAL_RANK < LOCAL_WORLD_SIZE (" +
                     std::to_string(env.localWorldSize) + ")"));
  } else if (env.localRank >= env.localWorldSize) {
    throw InvalidArgumentError(
        Error::invalidArgument("LOCAL_RANK is not set and RANK (" + rank +
                               ") is not below LOCAL_WORLD_SIZE (" +
                               std::to_string(env.localWorldSize) +
                               "): set LOCAL_RANK for a job on several hosts"));
  }
  env.master = masterFromVariables(lookup);
  if (auto token = read(lookup, auth::kTokenEnvVar)) {
    try {
      env.jobToken = auth::JobToken::fromString(*token);
    } catch (const InvalidArgumentError& e) {
      throw InvalidArgumentError(e.error().withContext(auth::kTokenEnvVar));
    }
  }
  return env;
}

WorkerEnv WorkerEnv::fromEnvironment() { return fromVariables(&fromProcess); }

}  // namespace trellis
