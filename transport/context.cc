#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <set>
#include <unistd.h>

#include <trellis/core/check.h>
#include <trellis/core/future.h>
#include <trellis/core/logging.h>
#include <trellis/transport/basic/factory.h>
#include <trellis/transport/cma/factory.h>
#include <trellis/transport/context.h>
#include <trellis/transport/context_impl.h>
#include <trellis/transport/listener_impl.h>
#include <trellis/transport/pipe_impl.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/uv/factory.h>
#ifdef TRELLIS_HAVE_CUDA
#include <trellis/transport/cuda_ipc/factory.h>
#endif

namespace trellis::transport {

namespace {

constexpr const char* kTransportsEnv = "TRELLIS_TRANSPORTS";
constexpr const char* kChannelsEnv = "TRELLIS_CHANNELS";
constexpr const char* kCmaThresholdEnv = "TRELLIS_CMA_THRESHOLD";

// Names accepted in the filters even before their backend is registered
// (shm, cma and cuda_ipc arrive later or only in some builds).
const std::vector<std::string> kKnownTransports = {"uv", "shm"};
const std::vector<std::string> kKnownChannels = {"basic", "cma", "cuda_ipc"};
constexpr auto kListenTimeout = std::chrono::seconds(30);
constexpr auto kDestructorJoin = std::chrono::seconds(60);

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  const auto e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    out += (out.empty() ? "" : ", ") + s;
  }
  return out;
}

std::optional<std::set<std::string>> combineFilters(
    const std::vector<std::string>& option, const char* env,
    const std::vector<std::string>& known) {
  std::optional<std::set<std::string>> allowed;
  if (!option.empty()) {
    std::string joined;
    for (const auto& o : option) {
      joined += (joined.empty() ? "" : ",") + o;
    }
    auto parsed =
        parseNameList(std::string("ContextOptions::") +
                          (env == kTransportsEnv ? "transports" : "channels"),
                      joined, known);
    allowed = std::set<std::string>(parsed->begin(), parsed->end());
  }
  const char* v = std::getenv(env);
  if (v != nullptr && *v != '\0') {
    auto parsed = parseNameList(env, v, known);
    std::set<std::string> fromEnv(parsed->begin(), parsed->end());
    if (allowed) {
      std::set<std::string> both;
      std::set_intersection(allowed->begin(), allowed->end(), fromEnv.begin(),
                            fromEnv.end(), std::inserter(both, both.end()));
      allowed = both;
    } else {
      allowed = fromEnv;
    }
  }
  return allowed;
}

// The built-in cma channel's options: TRELLIS_CMA_THRESHOLD (a decimal
// number of bytes; 0 = every non-empty CPU tensor) overrides the default
// threshold. Anything else in it throws, as the name lists do.
cma::Options builtinCmaOptions() {
  cma::Options o;
  const char* v = std::getenv(kCmaThresholdEnv);
  if (v == nullptr || trim(v).empty()) {
    return o;
  }
  const std::string s = trim(v);
  size_t bytes = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), bytes);
  if (ec != std::errc() || end != s.data() + s.size()) {
    throw InvalidArgumentError(Error::invalidArgument(
        std::string(kCmaThresholdEnv) + "='" + v +
        "': expected a number of bytes (0: every CPU tensor by cma)"));
  }
  o.thresholdBytes = bytes;
  return o;
}

}  // namespace

std::string Device::toString() const {
  return type == DeviceType::kCpu ? "cpu" : "cuda:" + std::to_string(index);
}

std::optional<std::vector<std::string>> parseNameList(
    const std::string& variable, const std::string& value,
    const std::vector<std::string>& known) {
  if (trim(value).empty()) {
    return std::nullopt;
  }
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    const size_t comma = value.find(',', pos);
    std::string entry = trim(value.substr(
        pos, comma == std::string::npos ? std::string::npos : comma - pos));
    if (entry.empty()) {
      throw InvalidArgumentError(Error::invalidArgument(
          variable + "='" + value +
          "': empty entry (expected a comma list of " + join(known) + ")"));
    }
    if (std::find(known.begin(), known.end(), entry) == known.end()) {
      throw InvalidArgumentError(
          Error::invalidArgument(variable + ": unknown entry '" + entry +
                                 "' (known: " + join(known) + ")"));
    }
    if (std::find(out.begin(), out.end(), entry) == out.end()) {
      out.push_back(entry);
    }
    if (comma == std::string::npos) {
      break;
    }
    pos = comma + 1;
  }
  return out;
}

void logDestructorException(const std::string& who,
                            std::exception_ptr e) noexcept {
  try {
    try {
      std::rethrow_exception(std::move(e));
    } catch (const std::exception& ex) {
      TRELLIS_LOG_ERROR("{}: destructor: {}", who, ex.what());
    } catch (...) {
      TRELLIS_LOG_ERROR("{}: destructor: unknown exception", who);
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch): logging failed too
  }
}

std::string localHostId() {
  std::string id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::getline(boot, id);
  // IPC namespace: shm segments; PID namespace: cma reads a peer by pid,
  // which must name the same process on both sides.
  for (const char* link : {"/proc/self/ns/ipc", "/proc/self/ns/pid"}) {
    char ns[128] = {0};
    const ssize_t n = ::readlink(link, ns, sizeof(ns) - 1);
    if (n > 0) {
      id += "/" + std::string(ns, static_cast<size_t>(n));
    }
  }
  if (id.empty()) {
    char host[256] = {0};
    ::gethostname(host, sizeof(host) - 1);
    id = std::string("host:") + host;
  }
  return id.substr(0, wire_format::kMaxHostIdBytes);
}

// ---- ContextImpl -----------------------------------------------------------

ContextImpl::ContextImpl(ContextOptions options)
    : options_(std::move(options)),
      token_(options_.token),
      hostId_(localHostId()),
      ids_(rootIds().next(options_.name)),
      loop_(Loop::create(ids_.parentId())) {
  if (!token_ && options_.tokenFromEnvironment) {
    token_ = auth::JobToken::fromEnvironment();
  }
}

ContextImpl::~ContextImpl() = default;

void ContextImpl::registerTransport(int priority,
                                    std::shared_ptr<Transport> t) {
  TRELLIS_CHECK(t != nullptr, "registerTransport(nullptr)");
  MutexLock lock(mu_);
  if (frozen_) {
    throw FailedPreconditionError(Error(
        Code::kFailedPrecondition,
        "registerTransport after the context's first listen()/connect()"));
  }
  const std::string name = t->name();
  transports_.erase(
      std::remove_if(transports_.begin(), transports_.end(),
                     [&](const Entry& e) { return e.name == name; }),
      transports_.end());
  transports_.push_back(Entry{priority, name, std::move(t), nullptr});
  std::stable_sort(
      transports_.begin(), transports_.end(),
      [](const Entry& a, const Entry& b) { return a.priority > b.priority; });
}

void ContextImpl::registerChannel(int priority, std::shared_ptr<Channel> c) {
  TRELLIS_CHECK(c != nullptr, "registerChannel(nullptr)");
  MutexLock lock(mu_);
  if (frozen_) {
    throw FailedPreconditionError(
        Error(Code::kFailedPrecondition,
              "registerChannel after the context's first listen()/connect()"));
  }
  const std::string name = c->name();
  channels_.erase(
      std::remove_if(channels_.begin(), channels_.end(),
                     [&](const Entry& e) { return e.name == name; }),
      channels_.end());
  channels_.push_back(Entry{priority, name, nullptr, std::move(c)});
  std::stable_sort(
      channels_.begin(), channels_.end(),
      [](const Entry& a, const Entry& b) { return a.priority > b.priority; });
}

void ContextImpl::applyFilters() {
  std::vector<std::string> knownT = kKnownTransports;
  std::vector<std::string> knownC = kKnownChannels;
  {
    MutexLock lock(mu_);
    for (const auto& e : transports_) {
      if (std::find(knownT.begin(), knownT.end(), e.name) == knownT.end()) {
        knownT.push_back(e.name);
      }
    }
    for (const auto& e : channels_) {
      if (std::find(knownC.begin(), knownC.end(), e.name) == knownC.end()) {
        knownC.push_back(e.name);
      }
    }
  }
  auto t = combineFilters(options_.transports, kTransportsEnv, knownT);
  auto c = combineFilters(options_.channels, kChannelsEnv, knownC);
  MutexLock lock(mu_);
  allowedTransports_ = std::move(t);
  allowedChannels_ = std::move(c);
}

void ContextImpl::freeze() {
  MutexLock lock(mu_);
  frozen_ = true;
}

std::shared_ptr<Transport> ContextImpl::transport(
    const std::string& name) const {
  for (const auto& o : transportOffers()) {
    if (o.name == name) {
      MutexLock lock(mu_);
      for (const auto& e : transports_) {
        if (e.name == name) {
          return e.transport;
        }
      }
    }
  }
  return nullptr;
}

std::shared_ptr<Channel> ContextImpl::channel(const std::string& name) const {
  MutexLock lock(mu_);
  for (const auto& e : channels_) {
    if (e.name == name) {
      return e.channel;
    }
  }
  return nullptr;
}

std::vector<Offer> ContextImpl::transportOffers() const {
  MutexLock lock(mu_);
  std::vector<Offer> out;
  for (const auto& e : transports_) {
    if ((!allowedTransports_ || allowedTransports_->count(e.name)) &&
        e.transport->viable().ok()) {
      out.push_back(Offer{e.name, e.transport->sameHostOnly(), true});
    }
  }
  return out;
}

std::vector<Offer> ContextImpl::channelOffers() const {
  MutexLock lock(mu_);
  std::vector<Offer> out;
  for (const auto& e : channels_) {
    if ((!allowedChannels_ || allowedChannels_->count(e.name)) &&
        e.channel->viable().ok()) {
      out.push_back(Offer{
          e.name, e.channel->sameHostOnly(),
          e.channel->inlineThroughConnection() || e.channel->drivesOutOfBand(),
          e.channel->supportsDevice(Device::cpu()),
          e.channel->supportsDevice(Device::cuda(0)),
          e.channel->drivesOutOfBand()});
    }
  }
  return out;
}

wire_format::Hello ContextImpl::localHello() const {
  wire_format::Hello h;
  for (const auto& o : transportOffers()) {
    h.transports.push_back(o.name);
  }
  for (const auto& o : channelOffers()) {
    h.channels.push_back(o.name);
  }
  h.hostId = hostId_;
  h.pid = static_cast<uint64_t>(::getpid());
  h.tokenConfigured = token_.has_value();
  return h;
}

std::shared_ptr<ListenerImpl> ContextImpl::listen(
    const std::vector<std::string>& addrs) {
  freeze();
  auto l =
      std::make_shared<ListenerImpl>(shared_from_this(), ids_.next("listener"));
  if (addrs.empty()) {
    throw InvalidArgumentError(
        Error::invalidArgument("listen() needs at least one address"));
  }
  Promise<void> done;
  auto self = shared_from_this();
  loop_->run([self, l, addrs, done]() mutable {
    if (self->closedFromLoop_) {
      done.setError(Error::cancelled(self->ids_.parentId() + " is closed"));
      return;
    }
    Error e = l->listenFromLoop(addrs);
    if (!e.ok()) {
      l->failFromLoop(e);
      done.setError(e);
      return;
    }
    self->listeners_[l.get()] = l;
    done.setValue();
  });
  if (!loop_->inLoop()) {
    done.getFuture().wait(kListenTimeout);
  } else {
    throwIfError(done.getFuture().error());
  }
  return l;
}

std::shared_ptr<PipeImpl> ContextImpl::connect(const std::string& address) {
  freeze();
  auto p =
      std::make_shared<PipeImpl>(shared_from_this(), ids_.next("pipe"), true);
  loop_->run([p, address] { p->connectFromLoop(address); });
  return p;
}

void ContextImpl::addPipeFromLoop(const std::shared_ptr<PipeImpl>& p) {
  TRELLIS_DCHECK(loop_->mayTouchState(), "off the loop thread");
  pipes_[p.get()] = p;
}

void ContextImpl::removePipeFromLoop(PipeImpl* p) {
  TRELLIS_DCHECK(loop_->mayTouchState(), "off the loop thread");
  pipes_.erase(p);
}

void ContextImpl::removeListenerFromLoop(ListenerImpl* l) {
  TRELLIS_DCHECK(loop_->mayTouchState(), "off the loop thread");
  listeners_.erase(l);
}

void ContextImpl::close() {
  if (closing_.exchange(true)) {
    return;
  }
  auto self = shared_from_this();
  loop_->defer([self] { self->closeFromLoop(); });
}

void ContextImpl::closeFromLoop() {
  TRELLIS_DCHECK(loop_->mayTouchState(), "off the loop thread");
  if (closedFromLoop_) {
    return;
  }
  closedFromLoop_ = true;
  const Error e = Error::cancelled(ids_.parentId() + " closed");
  auto listeners = listeners_;
  for (auto& [raw, l] : listeners) {
    l->failFromLoop(e);
  }
  auto pipes = pipes_;
  for (auto& [raw, p] : pipes) {
    p->failFromLoop(e);
  }
  listeners_.clear();
  pipes_.clear();
  loop_->stopFromLoop();
}

bool ContextImpl::join(Deadline deadline) { return loop_->join(deadline); }

void ContextImpl::registerUpgrade(const auth::Nonce& token,
                                  const std::shared_ptr<PipeImpl>& p) {
  upgrades_[token] = p;
}

std::shared_ptr<PipeImpl> ContextImpl::takeUpgrade(const auth::Nonce& token) {
  auto it = upgrades_.find(token);
  if (it == upgrades_.end()) {
    return nullptr;
  }
  auto p = it->second.lock();
  upgrades_.erase(it);
  return p;
}

void ContextImpl::dropUpgrade(const auth::Nonce& token) {
  upgrades_.erase(token);
}

// ---- public handles --------------------------------------------------------

std::shared_ptr<Context> Context::create(ContextOptions options) {
  const cma::Options cmaOptions = builtinCmaOptions();
  auto impl = std::make_shared<ContextImpl>(std::move(options));
  impl->registerTransport(100, uv::create());
  impl->registerTransport(200, shm::create());
  impl->registerChannel(100, basic::create());
  impl->registerChannel(150, cma::create(cmaOptions));
#ifdef TRELLIS_HAVE_CUDA
  // CUDA tensors only: negotiated beside the CPU channel, not instead of it.
  impl->registerChannel(200, cuda_ipc::create());
#endif
  try {
    impl->applyFilters();
  } catch (...) {
    impl->close();
    // Cannot fail: no deadline, and this is not the loop thread.
    (void)impl->join(Deadline::never());
    throw;
  }
  return std::shared_ptr<Context>(new Context(std::move(impl)));
}

Context::Context(std::shared_ptr<ContextImpl> impl) : impl_(std::move(impl)) {}

Context::~Context() {
  destructorNoThrow(impl_->ids().parentId(), [this] {
    impl_->close();
    if (!impl_->loop().inLoop() &&
        !impl_->join(Deadline::after(kDestructorJoin))) {
      TRELLIS_LOG_ERROR("{}: loop thread still running {} after close",
                        impl_->ids().parentId(),
                        formatDuration(kDestructorJoin));
    }
  });
}

void Context::registerTransport(int priority,
                                std::shared_ptr<Transport> transport) {
  impl_->registerTransport(priority, std::move(transport));
  impl_->applyFilters();
}

void Context::registerChannel(int priority, std::shared_ptr<Channel> channel) {
  impl_->registerChannel(priority, std::move(channel));
  impl_->applyFilters();
}

std::shared_ptr<Listener> Context::listen(
    const std::vector<std::string>& addresses) {
  return std::make_shared<Listener>(Listener::Passkey(),
                                    impl_->listen(addresses));
}

std::shared_ptr<Pipe> Context::connect(const std::string& address) {
  return std::make_shared<Pipe>(Pipe::Passkey(), impl_->connect(address));
}

void Context::close() { impl_->close(); }
bool Context::inLoop() const { return impl_->loop().inLoop(); }
void Context::beginExpectedWork() { impl_->loop().beginExpectedWork(); }
void Context::endExpectedWork() { impl_->loop().endExpectedWork(); }

bool Context::join(Duration timeout) {
  return impl_->join(Deadline::fromTimeout(timeout));
}

const std::string& Context::name() const { return impl_->ids().parentId(); }

std::vector<std::string> Context::transportNames() const {
  std::vector<std::string> out;
  for (const auto& o : impl_->transportOffers()) {
    out.push_back(o.name);
  }
  return out;
}

std::vector<std::string> Context::channelNames() const {
  std::vector<std::string> out;
  for (const auto& o : impl_->channelOffers()) {
    out.push_back(o.name);
  }
  return out;
}

}  // namespace trellis::transport
