#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <trellis/core/auth.h>
#include <trellis/core/error.h>
#include <trellis/core/text.h>
#include <trellis/elastic/options.h>

extern char** environ;

namespace trellis::elastic {

namespace {

// One torchrun flag: its `-` spelling (the one errors name), its `_`
// spelling if it has one, a short form, and whether it takes no value.
struct Flag {
  const char* key;        // "nproc-per-node"
  const char* shortName;  // "-r" or nullptr
  bool boolean;
};

constexpr std::array kFlags = {
    Flag{"nnodes", nullptr, false},
    Flag{"nproc-per-node", nullptr, false},
    Flag{"node-rank", nullptr, false},
    Flag{"rdzv-backend", nullptr, false},
    Flag{"rdzv-endpoint", nullptr, false},
    Flag{"rdzv-id", nullptr, false},
    Flag{"rdzv-conf", nullptr, false},
    Flag{"standalone", nullptr, true},
    Flag{"max-restarts", nullptr, false},
    Flag{"monitor-interval", nullptr, false},
    Flag{"start-method", nullptr, false},
    Flag{"role", nullptr, false},
    Flag{"module", "-m", true},
    Flag{"no-python", nullptr, true},
    Flag{"run-path", nullptr, true},
    Flag{"log-dir", nullptr, false},
    Flag{"redirects", "-r", false},
    Flag{"tee", "-t", false},
    Flag{"local-ranks-filter", nullptr, false},
    Flag{"master-addr", nullptr, false},
    Flag{"master-port", nullptr, false},
    Flag{"local-addr", nullptr, false},
};

// Stands for an empty value given as `--flag=` (readCommandLine).
constexpr const char* kEmptyValue = "\x1f<empty>";

std::string underscored(std::string_view key) {
  std::string s(key);
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

// PET_NPROC_PER_NODE for "nproc-per-node", as torchrun names them.
std::string envName(std::string_view key) {
  std::string s = "PET_" + underscored(key);
  for (char& c : s) {
    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return s;
}

// A flag's value and where it came from, for error messages.
struct Raw {
  std::string flag;    // "--nnodes"
  std::string value;   // as given
  std::string envVar;  // "PET_NNODES" when it came from there, else empty

  // "--nnodes '3:2'" or "PET_NNODES='3:2' (--nnodes)".
  std::string describe() const {
    if (envVar.empty()) {
      return flag + " '" + value + "'";
    }
    return envVar + "='" + value + "' (" + flag + ")";
  }
};

[[noreturn]] void fail(std::string message) {
  throw InvalidArgumentError(Error::invalidArgument(std::move(message)));
}

[[noreturn]] void fail(const Raw& raw, std::string_view why) {
  fail(raw.describe() + ": " + std::string(why));
}

[[noreturn]] void contradict(const Raw& a, const Raw& b, std::string_view why) {
  fail(a.describe() + " contradicts " + b.describe() + ": " + std::string(why));
}

// A decimal integer in [lo, hi]; `what` names it in the error.
int64_t intIn(const Raw& raw, std::string_view text, int64_t lo, int64_t hi,
              std::string_view what) {
  const auto v = parseDecimal(text);
  if (!v) {
    fail(raw, std::string(what) + " must be a decimal integer");
  }
  if (*v < lo || *v > hi) {
    fail(raw, std::string(what) + " must be in [" + std::to_string(lo) + ", " +
                  std::to_string(hi) + "], got " + std::to_string(*v));
  }
  return *v;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

std::optional<bool> parseBool(std::string_view s) {
  const std::string l = lower(s);
  if (l == "1" || l == "true" || l == "t" || l == "yes" || l == "y") {
    return true;
  }
  if (l == "0" || l == "false" || l == "f" || l == "no" || l == "n") {
    return false;
  }
  return std::nullopt;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) {
    s.remove_prefix(1);
  }
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) {
    s.remove_suffix(1);
  }
  return s;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    parts.push_back(s.substr(start, at - start));
    if (at == std::string_view::npos) {
      return parts;
    }
    start = at + 1;
  }
}

// HOST[:PORT], IPv6 in brackets.
Endpoint parseEndpoint(const Raw& raw, std::string_view text,
                       uint16_t defaultPort) {
  Endpoint e;
  std::string_view portText;
  bool hasPort = false;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos) {
      fail(raw, "'[' without a closing ']'");
    }
    e.host = std::string(text.substr(1, close - 1));
    const std::string_view rest = text.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') {
        fail(raw, "expected ':PORT' after ']'");
      }
      hasPort = true;
      portText = rest.substr(1);
    }
  } else {
    const size_t colons = std::count(text.begin(), text.end(), ':');
    if (colons > 1) {
      fail(raw, "an IPv6 address goes in brackets, e.g. [::1]:29400");
    }
    const size_t at = text.find(':');
    e.host = std::string(text.substr(0, at));
    if (at != std::string_view::npos) {
      hasPort = true;
      portText = text.substr(at + 1);
    }
  }
  if (e.host.empty()) {
    fail(raw, "the host is empty (expected HOST[:PORT])");
  }
  e.port =
      hasPort
          ? static_cast<uint16_t>(intIn(raw, portText, 0, 65535, "the port"))
          : defaultPort;
  return e;
}

StreamsSpec parseStreams(const Raw& raw) {
  auto value = [&](std::string_view s) {
    const auto v = parseDecimal(s);
    if (!v || *v < 0 || *v > 3) {
      fail(raw,
           "expected 0-3 (none, stdout, stderr, both) or "
           "LOCAL_RANK:0-3,... e.g. 0:1,1:2");
    }
    return static_cast<Streams>(*v);
  };
  StreamsSpec spec;
  if (raw.value.find(':') == std::string::npos) {
    spec.all = value(raw.value);
    return spec;
  }
  for (std::string_view item : split(raw.value, ',')) {
    const size_t at = item.find(':');
    if (at == std::string_view::npos) {
      fail(raw,
           "expected LOCAL_RANK:0-3 items, got '" + std::string(item) + "'");
    }
    const auto rank = parseDecimal(item.substr(0, at));
    if (!rank || *rank < 0 || *rank > std::numeric_limits<int32_t>::max()) {
      fail(raw,
           "'" + std::string(item.substr(0, at)) + "' is not a local rank");
    }
    const auto r = static_cast<int32_t>(*rank);
    if (spec.perRank.count(r) != 0) {
      fail(raw, "local rank " + std::to_string(r) + " appears twice");
    }
    spec.perRank[r] = value(item.substr(at + 1));
  }
  return spec;
}

RdzvConf parseRdzvConf(const Raw& raw) {
  RdzvConf conf;
  std::set<std::string> seen;
  for (std::string_view item : split(raw.value, ',')) {
    if (trim(item).empty()) {
      continue;  // "a=1,,b=2" and a trailing comma, as torchrun
    }
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      fail(raw, "expected KEY=VALUE items, got '" + std::string(item) + "'");
    }
    const std::string key(trim(item.substr(0, eq)));
    const std::string_view value = trim(item.substr(eq + 1));
    if (key.empty() || value.empty()) {
      fail(raw, "expected KEY=VALUE items, got '" + std::string(item) + "'");
    }
    if (!seen.insert(key).second) {
      fail(raw, "key '" + key + "' appears twice");
    }
    auto seconds = [&](std::optional<std::chrono::seconds>& out) {
      const int64_t v = intIn(raw, value, 1, 365LL * 24 * 3600, key);
      out = std::chrono::seconds(v);
    };
    if (key == "join_timeout") {
      seconds(conf.joinTimeout);
    } else if (key == "last_call_timeout") {
      seconds(conf.lastCallTimeout);
    } else if (key == "close_timeout") {
      seconds(conf.closeTimeout);
    } else if (key == "read_timeout") {
      seconds(conf.readTimeout);
    } else if (key == "timeout") {
      seconds(conf.timeout);
    } else if (key == "keep_alive_interval") {
      seconds(conf.keepAliveInterval);
    } else if (key == "keep_alive_max_attempt") {
      conf.keepAliveMaxAttempt =
          static_cast<int32_t>(intIn(raw, value, 1, 1000, key));
    } else if (key == "exit_barrier_timeout") {
      seconds(conf.exitBarrierTimeout);
    } else if (key == "is_host") {
      conf.isHost = parseBool(value);
      if (!conf.isHost) {
        fail(raw,
             "is_host must be true or false, got '" + std::string(value) + "'");
      }
    } else {
      fail(raw, "unknown key '" + key +
                    "' (known: join_timeout, last_call_timeout, "
                    "close_timeout, read_timeout, keep_alive_interval, "
                    "keep_alive_max_attempt, exit_barrier_timeout, is_host, "
                    "timeout)");
    }
  }
  return conf;
}

// A version-4 UUID string, as torchrun's --standalone run ids.
std::string randomUuid() {
  auto n = auth::randomNonce();
  n[6] = static_cast<uint8_t>((n[6] & 0x0f) | 0x40);
  n[8] = static_cast<uint8_t>((n[8] & 0x3f) | 0x80);
  const std::string h = toHex(std::span(n.data(), 16));
  return h.substr(0, 8) + "-" + h.substr(8, 4) + "-" + h.substr(12, 4) + "-" +
         h.substr(16, 4) + "-" + h.substr(20, 12);
}

// /dev/nvidia0.., as many as CUDA_VISIBLE_DEVICES lets through. An
// approximation of torch.cuda.device_count() that needs no CUDA runtime.
int32_t probeGpus(const Environment& env) {
  int32_t devices = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
        parseDecimal(std::string_view(name).substr(6))) {
      ++devices;
    }
  }
  const auto it = env.find("CUDA_VISIBLE_DEVICES");
  if (it == env.end()) {
    return devices;
  }
  // CUDA stops at the first entry that is not a device index or UUID.
  int32_t visible = 0;
  for (std::string_view item : split(it->second, ',')) {
    item = trim(item);
    const auto index = parseDecimal(item);
    const bool uuid = item.rfind("GPU-", 0) == 0 || item.rfind("MIG-", 0) == 0;
    if (!uuid && (!index || *index < 0)) {
      break;
    }
    ++visible;
  }
  return std::min(visible, devices);
}

}  // namespace

std::string_view backendName(RdzvBackend backend) {
  switch (backend) {
    case RdzvBackend::kC10d:
      return "c10d";
    case RdzvBackend::kEtcd:
      return "etcd";
    case RdzvBackend::kEtcdV2:
      return "etcd-v2";
    case RdzvBackend::kStatic:
      return "static";
  }
  return "unknown";
}

std::string Endpoint::toString() const {
  const std::string h =
      host.find(':') != std::string::npos ? "[" + host + "]" : host;
  return h + ":" + std::to_string(port);
}

Streams StreamsSpec::forRank(int32_t localRank) const {
  if (perRank.empty()) {
    return all;
  }
  const auto it = perRank.find(localRank);
  return it == perRank.end() ? Streams::kNone : it->second;
}

ParseContext ParseContext::fromProcess() {
  ParseContext c;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq != std::string_view::npos) {
      c.env.emplace(std::string(kv.substr(0, eq)),
                    std::string(kv.substr(eq + 1)));
    }
  }
  c.cpuCount = [] {
    const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
    return static_cast<int32_t>(n > 0 ? n : 1);
  };
  c.gpuCount = [env = c.env] { return probeGpus(env); };
  c.newRunId = &randomUuid;
  return c;
}

namespace {

// The command line (CLI11) and the PET_ variables, merged into one Raw per
// flag that was given; then each value is checked and converted.
class Parser {
 public:
  explicit Parser(const ParseContext& context) : context_(context) {}

  ElasticOptions parse(std::span<const std::string> args);

 private:
  const Raw* given(std::string_view key) const {
    const auto it = raw_.find(std::string(key));
    return it == raw_.end() ? nullptr : &it->second;
  }
  bool flagSet(std::string_view key) const {
    const Raw* r = given(key);
    if (r == nullptr) {
      return false;
    }
    const auto b = parseBool(r->value);
    if (!b) {
      fail(*r, "expected 0 or 1 (or true/false)");
    }
    return *b;
  }
  std::vector<std::string> readCommandLine(std::span<const std::string> args);
  void readEnvironment();
  void resolve(ElasticOptions& o);
  void resolveRendezvous(ElasticOptions& o);
  void resolveCommand(ElasticOptions& o, std::vector<std::string> rest);

  const ParseContext& context_;
  std::map<std::string, Raw> raw_;
};

std::vector<std::string> Parser::readCommandLine(
    std::span<const std::string> args) {
  CLI::App app("elastic-run: a native torchrun", "elastic-run");
  app.prefix_command();
  std::map<std::string, std::string> values;
  std::map<std::string, CLI::Option*> options;
  for (const Flag& f : kFlags) {
    std::string names = "--" + std::string(f.key);
    if (std::string(f.key).find('-') != std::string::npos) {
      names += ",--" + underscored(f.key);
    }
    if (f.shortName != nullptr) {
      names = std::string(f.shortName) + "," + names;
    }
    CLI::Option* opt =
        f.boolean ? app.add_flag(names) : app.add_option(names, values[f.key]);
    opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    options[f.key] = opt;
  }
  // CLI11 reads `--tee=` (an empty value) as `--tee` and takes the next
  // word, CMD, as its value; argparse gives the empty string. Empty values
  // of known flags before CMD travel as a placeholder instead.
  std::vector<std::string> words(args.begin(), args.end());
  for (size_t i = 0; i < words.size(); ++i) {
    const std::string& w = words[i];
    if (w == "--" || w.empty() || w.front() != '-') {
      break;  // CMD starts here
    }
    const size_t eq = w.find('=');
    const std::string name = w.substr(0, eq);
    const auto flag = std::find_if(kFlags.begin(), kFlags.end(), [&](auto& f) {
      return name == "--" + std::string(f.key) ||
             name == "--" + underscored(f.key) ||
             (f.shortName != nullptr && name == f.shortName);
    });
    if (flag == kFlags.end() || flag->boolean) {
      continue;
    }
    if (eq == std::string::npos) {
      ++i;  // its value
    } else if (eq + 1 == w.size()) {
      words[i] = name + "=" + kEmptyValue;
    }
  }
  // CLI11 parses a reversed vector of arguments.
  std::vector<std::string> reversed(words.rbegin(), words.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    throw;
  } catch (const CLI::ParseError& e) {
    fail(std::string("elastic-run: ") + e.what());
  }
  for (const Flag& f : kFlags) {
    if (options[f.key]->count() > 0) {
      const std::string& v = values[f.key];
      raw_[f.key] = Raw{"--" + std::string(f.key),
                        f.boolean ? "1" : (v == kEmptyValue ? "" : v), ""};
    }
  }
  return app.remaining();
}

void Parser::readEnvironment() {
  for (const Flag& f : kFlags) {
    if (raw_.count(f.key) != 0) {
      continue;  // the command line wins
    }
    const std::string var = envName(f.key);
    const auto it = context_.env.find(var);
    if (it != context_.env.end() && !it->second.empty()) {
      raw_[f.key] = Raw{"--" + std::string(f.key), it->second, var};
    }
  }
}

void Parser::resolve(ElasticOptions& o) {
  for (const char* refused : {"module", "run-path"}) {
    if (flagSet(refused)) {
      fail(given(refused)->describe() +
           ": elastic-run executes programs and does not run Python "
           "modules or scripts in its own interpreter; give the command "
           "instead, e.g. `elastic-run ... python3 -m your.module`");
    }
  }
  o.noPython = flagSet("no-python");
  o.standalone = flagSet("standalone");

  if (const Raw* r = given("nnodes")) {
    const auto parts = split(r->value, ':');
    if (parts.size() > 2) {
      fail(*r, "expected MIN[:MAX]");
    }
    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    o.minNodes = static_cast<int32_t>(intIn(*r, parts[0], 1, kMax, "MIN"));
    o.maxNodes = parts.size() == 2
                     ? static_cast<int32_t>(intIn(*r, parts[1], 1, kMax, "MAX"))
                     : o.minNodes;
    if (o.minNodes > o.maxNodes) {
      fail(*r, "MIN must not exceed MAX");
    }
  }

  if (const Raw* r = given("nproc-per-node")) {
    o.nprocPerNodeSpec = r->value;
    int64_t n = 0;
    if (r->value == "cpu") {
      n = context_.cpuCount ? context_.cpuCount() : 0;
    } else if (r->value == "gpu") {
      n = context_.gpuCount ? context_.gpuCount() : 0;
      if (n <= 0) {
        fail(*r, "no GPU is visible to this process");
      }
    } else if (r->value == "auto") {
      n = context_.gpuCount ? context_.gpuCount() : 0;
      if (n <= 0) {
        n = context_.cpuCount ? context_.cpuCount() : 0;
      }
    } else {
      const auto v = parseDecimal(r->value);
      if (!v) {
        fail(*r, "expected a count, auto, cpu or gpu");
      }
      n = *v;
    }
    if (n < 1 || n > 1 << 16) {
      fail(*r, "the number of workers must be in [1, 65536], got " +
                   std::to_string(n));
    }
    o.nprocPerNode = static_cast<int32_t>(n);
  }

  if (const Raw* r = given("max-restarts")) {
    o.maxRestarts = static_cast<int32_t>(intIn(
        *r, r->value, 0, std::numeric_limits<int32_t>::max(), "the count"));
  }
  if (const Raw* r = given("monitor-interval")) {
    char* end = nullptr;
    const double s = std::strtod(r->value.c_str(), &end);
    if (r->value.empty() || end != r->value.c_str() + r->value.size() ||
        !std::isfinite(s) || s <= 0 || s > 3600) {
      fail(*r, "expected seconds, more than 0 and at most 3600");
    }
    o.monitorInterval =
        std::chrono::microseconds(std::max<int64_t>(1, std::llround(s * 1e6)));
  }
  if (const Raw* r = given("start-method")) {
    if (r->value != "spawn" && r->value != "fork" && r->value != "forkserver") {
      fail(*r, "expected spawn, fork or forkserver");
    }
    o.startMethod = r->value;
  }
  for (auto [key, out] :
       {std::pair{"role", &o.role}, std::pair{"rdzv-id", &o.rdzvId},
        std::pair{"master-addr", &o.masterAddr}}) {
    if (const Raw* r = given(key)) {
      if (trim(r->value).empty()) {
        fail(*r, "must not be blank");
      }
      *out = r->value;
    }
  }
  for (auto [key, out] : {std::pair{"log-dir", &o.logDir},
                          std::pair{"local-addr", &o.localAddr}}) {
    if (const Raw* r = given(key)) {
      if (trim(r->value).empty()) {
        fail(*r, "must not be blank");
      }
      *out = r->value;
    }
  }
  if (const Raw* r = given("master-port")) {
    o.masterPort =
        static_cast<uint16_t>(intIn(*r, r->value, 1, 65535, "the port"));
  }
  if (const Raw* r = given("redirects")) {
    o.redirects = parseStreams(*r);
  }
  if (const Raw* r = given("tee")) {
    o.tee = parseStreams(*r);
  }
  if (const Raw* r = given("local-ranks-filter")) {
    for (std::string_view item : split(r->value, ',')) {
      o.localRanksFilter.insert(static_cast<int32_t>(
          intIn(*r, trim(item), 0, std::numeric_limits<int32_t>::max(),
                "each local rank")));
    }
  }
  if (const Raw* r = given("rdzv-conf")) {
    o.rdzvConf = parseRdzvConf(*r);
  }
  resolveRendezvous(o);
}

void Parser::resolveRendezvous(ElasticOptions& o) {
  if (const Raw* r = given("rdzv-backend")) {
    static constexpr std::array kBackends = {
        RdzvBackend::kC10d, RdzvBackend::kEtcd, RdzvBackend::kEtcdV2,
        RdzvBackend::kStatic};
    const auto it =
        std::find_if(kBackends.begin(), kBackends.end(),
                     [&](RdzvBackend b) { return backendName(b) == r->value; });
    if (it == kBackends.end()) {
      fail(*r, "expected c10d, etcd, etcd-v2 or static");
    }
    o.rdzvBackend = *it;
  }

  const Raw standaloneRaw{"--standalone", "1", ""};
  const Raw* nnodes = given("nnodes");
  if (o.standalone) {
    const Raw& s = given("standalone") ? *given("standalone") : standaloneRaw;
    for (const char* key : {"rdzv-backend", "rdzv-endpoint", "rdzv-id"}) {
      if (const Raw* r = given(key)) {
        contradict(s, *r,
                   "--standalone picks the rendezvous itself (c10d on a "
                   "free local port, a fresh id)");
      }
    }
    if (o.maxNodes > 1) {
      contradict(s, *nnodes, "--standalone runs a single node");
    }
    o.rdzvBackend = RdzvBackend::kC10d;
    o.rdzvId = context_.newRunId ? context_.newRunId() : randomUuid();
  }

  const Raw* nodeRank = given("node-rank");
  if (nodeRank != nullptr) {
    o.nodeRank = static_cast<int32_t>(intIn(*nodeRank, nodeRank->value, 0,
                                            std::numeric_limits<int32_t>::max(),
                                            "the node rank"));
    o.nodeRankGiven = true;
    if (o.nodeRank >= o.maxNodes) {
      const Raw dflt{"--nnodes", "1", ""};
      contradict(*nodeRank, nnodes ? *nnodes : dflt,
                 "the node rank must be below the number of nodes");
    }
  }

  if (o.rdzvBackend == RdzvBackend::kStatic) {
    const Raw dflt{"--rdzv-backend", "static", ""};
    const Raw& backend = given("rdzv-backend") ? *given("rdzv-backend") : dflt;
    if (o.minNodes != o.maxNodes) {
      contradict(backend, *nnodes,
                 "a static rendezvous has a fixed number of nodes");
    }
    if (o.maxNodes > 1 && !o.nodeRankGiven) {
      contradict(backend, *nnodes,
                 "a static rendezvous of several nodes needs --node-rank");
    }
  }

  const Raw* endpoint = given("rdzv-endpoint");
  if (o.standalone) {
    o.rdzvEndpoint = Endpoint{"localhost", 0};
  } else if (endpoint != nullptr) {
    o.rdzvEndpointSpec = endpoint->value;
    const uint16_t port = o.rdzvBackend == RdzvBackend::kEtcd ||
                                  o.rdzvBackend == RdzvBackend::kEtcdV2
                              ? kDefaultEtcdPort
                              : kDefaultC10dPort;
    o.rdzvEndpoint = parseEndpoint(*endpoint, endpoint->value, port);
  } else if (o.rdzvBackend == RdzvBackend::kStatic) {
    std::string host = o.masterAddr;
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    o.rdzvEndpoint = Endpoint{host, o.masterPort};
  } else {
    o.rdzvEndpoint = Endpoint{"localhost", o.rdzvBackend == RdzvBackend::kC10d
                                               ? kDefaultC10dPort
                                               : kDefaultEtcdPort};
  }

  const bool staticOnMaster =
      o.rdzvBackend == RdzvBackend::kStatic && endpoint == nullptr;
  for (const char* key : {"master-addr", "master-port"}) {
    if (const Raw* r = given(key); r != nullptr && !staticOnMaster) {
      o.warnings.push_back(
          r->describe() +
          " has no effect: the master address and port are only used by "
          "the static rendezvous without --rdzv-endpoint");
    }
  }
}

void Parser::resolveCommand(ElasticOptions& o, std::vector<std::string> rest) {
  if (!rest.empty() && rest.front() == "--") {
    rest.erase(rest.begin());
  } else if (!rest.empty() && rest.front().size() > 1 &&
             rest.front().front() == '-') {
    fail("elastic-run: unknown flag '" + rest.front() +
         "' (a flag the worker should get goes after CMD)");
  }
  if (rest.empty()) {
    fail(
        "elastic-run: missing CMD (usage: elastic-run [flags] CMD "
        "[ARGS...])");
  }
  const std::string& cmd = rest.front();
  const bool python = !o.noPython && cmd.size() > 3 &&
                      cmd.compare(cmd.size() - 3, 3, ".py") == 0;
  if (python) {
    const auto it = context_.env.find("PYTHON_EXEC");
    o.workerArgv.push_back(it != context_.env.end() && !it->second.empty()
                               ? it->second
                               : "python3");
    o.workerArgv.push_back("-u");
  }
  o.workerArgv.insert(o.workerArgv.end(), rest.begin(), rest.end());
}

ElasticOptions Parser::parse(std::span<const std::string> args) {
  ElasticOptions o;
  std::vector<std::string> rest;
  try {
    rest = readCommandLine(args);
  } catch (const CLI::CallForHelp&) {
    o.helpRequested = true;
    return o;
  }
  readEnvironment();
  resolve(o);
  resolveCommand(o, std::move(rest));
  return o;
}

}  // namespace

ElasticOptions parseOptions(std::span<const std::string> args,
                            const ParseContext& context) {
  return Parser(context).parse(args);
}

ElasticOptions parseOptions(int argc, const char* const* argv,
                            const ParseContext& context) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    args.emplace_back(argv[i]);
  }
  return parseOptions(args, context);
}

std::string usage() {
  std::string s =
      "usage: elastic-run [flags] CMD [ARGS...]\n"
      "\n"
      "torchrun's flags; each also as --name_with_underscores and from its\n"
      "PET_* variable (the command line wins). See docs/elastic.md.\n"
      "\n";
  static constexpr std::array<std::pair<const char*, const char*>, 22> kHelp = {
      {
          {"--nnodes MIN[:MAX]", "number of nodes, or a range (1:1)"},
          {"--nproc-per-node N|auto|cpu|gpu", "workers per node (1)"},
          {"--node-rank N", "this node's rank, static rendezvous (0)"},
          {"--rdzv-backend B", "c10d, etcd, etcd-v2 or static (static)"},
          {"--rdzv-endpoint HOST[:PORT]", "rendezvous endpoint"},
          {"--rdzv-id ID", "job id shared by all nodes (none)"},
          {"--rdzv-conf K=V,...", "rendezvous settings"},
          {"--standalone", "single node, local c10d rendezvous"},
          {"--max-restarts N", "group restarts before failing (0)"},
          {"--monitor-interval S", "seconds between worker checks (0.1)"},
          {"--start-method M", "accepted and ignored (always exec)"},
          {"--role NAME", "the workers' role (default)"},
          {"-m, --module", "refused: give `python3 -m mod` as CMD"},
          {"--no-python", "run CMD as is, even a .py"},
          {"--run-path", "refused"},
          {"--log-dir DIR", "base folder for worker logs"},
          {"-r, --redirects SPEC", "0-3 or LOCAL_RANK:0-3,... (0)"},
          {"-t, --tee SPEC", "0-3 or LOCAL_RANK:0-3,... (0)"},
          {"--local-ranks-filter R,...", "local ranks shown on the console"},
          {"--master-addr ADDR", "static rendezvous master (127.0.0.1)"},
          {"--master-port PORT", "static rendezvous port (29500)"},
          {"--local-addr ADDR", "this node's address"},
      }};
  for (const auto& [flag, text] : kHelp) {
    std::string line = "  " + std::string(flag);
    line.resize(std::max<size_t>(line.size() + 1, 34), ' ');
    s += line + text + "\n";
  }
  return s;
}

}  // namespace trellis::elastic
