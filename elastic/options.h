#pragma once

// elastic-run's command line (docs/elastic.md, "Flags and environment").
//
//   elastic-run [flags] CMD [ARGS...]
//
// The flags are torchrun's, each spelled with `-` or `_`
// (`--nproc-per-node` and `--nproc_per_node`), and each can also come from
// its `PET_*` variable (`PET_NPROC_PER_NODE`); the command line wins over
// the environment. Everything from CMD on belongs to the worker, including
// words that look like flags.
//
// `parseOptions` is a pure function: the environment, the host's CPU and
// GPU counts and the source of fresh run ids come in through a
// `ParseContext`, so tests need neither setenv nor a GPU. A bad or
// contradictory flag throws `trellis::InvalidArgumentError` whose message
// names the flag (or the PET_ variable it came from) and the value.
//
// Thread safety: everything here is a value or a pure function.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace trellis::elastic {

// An environment: variable name -> value (the agent's own, or a worker's).
using Environment = std::map<std::string, std::string>;

enum class RdzvBackend : uint8_t { kC10d, kEtcd, kEtcdV2, kStatic };

// "c10d", "etcd", "etcd-v2", "static".
std::string_view backendName(RdzvBackend backend);

// A rendezvous or master endpoint. `host` never carries IPv6 brackets;
// toString() puts them back ("[::1]:29400").
struct Endpoint {
  std::string host;
  uint16_t port = 0;  // 0: any free port (only --standalone makes it)
  std::string toString() const;
  friend bool operator==(const Endpoint&, const Endpoint&) = default;
};

// Where a worker's stdout/stderr go (--redirects, --tee): torchrun's
// 0 none, 1 stdout, 2 stderr, 3 both.
enum class Streams : uint8_t { kNone = 0, kOut = 1, kErr = 2, kAll = 3 };

// "3" (every local rank) or "0:1,1:2" (per local rank; unnamed ranks: 0).
struct StreamsSpec {
  Streams all = Streams::kNone;
  std::map<int32_t, Streams> perRank;
  Streams forRank(int32_t localRank) const;
  friend bool operator==(const StreamsSpec&, const StreamsSpec&) = default;
};

// --rdzv-conf. Unset means the backend's default (the constants below).
struct RdzvConf {
  std::optional<std::chrono::seconds> joinTimeout;
  std::optional<std::chrono::seconds> lastCallTimeout;
  std::optional<std::chrono::seconds> closeTimeout;
  std::optional<std::chrono::seconds> readTimeout;
  std::optional<std::chrono::seconds> timeout;
  // c10d keep-alive: a heartbeat every interval; a node whose heartbeat has
  // not moved for interval * max_attempt is dead (torch's names).
  std::optional<std::chrono::seconds> keepAliveInterval;
  std::optional<int32_t> keepAliveMaxAttempt;
  // Trellis's own: how long a node that finished waits for the others
  // (torchrun's exit_barrier_timeout, an agent argument there).
  std::optional<std::chrono::seconds> exitBarrierTimeout;
  std::optional<bool> isHost;
  friend bool operator==(const RdzvConf&, const RdzvConf&) = default;
};

// torchrun's defaults for the keys above (docs/elastic.md).
inline constexpr std::chrono::seconds kDefaultJoinTimeout{600};
inline constexpr std::chrono::seconds kDefaultLastCallTimeout{30};
inline constexpr std::chrono::seconds kDefaultCloseTimeout{30};
inline constexpr std::chrono::seconds kDefaultReadTimeout{60};
inline constexpr std::chrono::seconds kDefaultStaticTimeout{600};
inline constexpr std::chrono::seconds kDefaultKeepAliveInterval{5};
inline constexpr int32_t kDefaultKeepAliveMaxAttempt = 3;
inline constexpr std::chrono::seconds kDefaultExitBarrierTimeout{300};
inline constexpr uint16_t kDefaultC10dPort = 29400;
inline constexpr uint16_t kDefaultEtcdPort = 2379;

struct ElasticOptions {
  // -h/--help was given: nothing else was checked; print usage().
  bool helpRequested = false;

  int32_t minNodes = 1;  // --nnodes MIN[:MAX]
  int32_t maxNodes = 1;
  std::string nprocPerNodeSpec = "1";  // as given: N, auto, cpu or gpu
  int32_t nprocPerNode = 1;            // resolved
  int32_t nodeRank = 0;
  bool nodeRankGiven = false;
  RdzvBackend rdzvBackend = RdzvBackend::kStatic;
  std::string rdzvEndpointSpec;  // as given; empty when not
  Endpoint rdzvEndpoint;         // resolved with the backend's default port
  std::string rdzvId = "none";
  RdzvConf rdzvConf;
  bool standalone = false;
  int32_t maxRestarts = 0;
  std::chrono::microseconds monitorInterval{100'000};
  std::string role = "default";
  std::optional<std::string> logDir;
  StreamsSpec redirects;
  StreamsSpec tee;
  std::set<int32_t> localRanksFilter;  // empty: every local rank
  std::string masterAddr = "127.0.0.1";
  uint16_t masterPort = 29500;
  std::optional<std::string> localAddr;
  std::string startMethod = "spawn";  // accepted, ignored: always exec
  bool noPython = false;

  // What the agent executes for each worker: argv[0] first. A `.py` CMD
  // (without --no-python) becomes `python3 -u CMD ARGS...` ($PYTHON_EXEC
  // instead of python3 when set, as torchrun).
  std::vector<std::string> workerArgv;

  // Things worth a line on stderr that are not errors (a flag that has no
  // effect with the chosen backend).
  std::vector<std::string> warnings;
};

struct ParseContext {
  Environment env;
  // Online CPUs (torchrun: os.cpu_count()).
  std::function<int32_t()> cpuCount;
  // GPUs this process may use; 0 when none.
  std::function<int32_t()> gpuCount;
  // A fresh run id for --standalone (torchrun: a random UUID).
  std::function<std::string()> newRunId;

  // The process's environment, sysconf's CPU count, /dev/nvidiaN limited by
  // CUDA_VISIBLE_DEVICES, and a random UUID-shaped id.
  static ParseContext fromProcess();
};

// `args` excludes the program name. Throws InvalidArgumentError.
ElasticOptions parseOptions(std::span<const std::string> args,
                            const ParseContext& context);
ElasticOptions parseOptions(int argc, const char* const* argv,
                            const ParseContext& context);

// The --help text.
std::string usage();

}  // namespace trellis::elastic
