#include <utility>

#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/rpc/extension.h>

namespace trellis::rpc {

namespace {

thread_local uint64_t tlsAutogradContext = 0;

struct Factories {
  // Guards `list`: registrations (static-init time) against Agent::start().
  Mutex mu;
  std::vector<std::pair<std::type_index, detail::ExtensionFactory>> list
      TRELLIS_GUARDED_BY(mu);
};

Factories& factories() {
  static auto* f = new Factories;  // leaked: used during static init/exit
  return *f;
}

}  // namespace

uint64_t currentAutogradContext() { return tlsAutogradContext; }

AutogradContextScope::AutogradContextScope(uint64_t contextId)
    : previous_(tlsAutogradContext) {
  tlsAutogradContext = contextId;
}

AutogradContextScope::~AutogradContextScope() {
  tlsAutogradContext = previous_;
}

namespace detail {

Future<AnyValue> AgentExtension::onRequest(ExtensionRequest& request) {
  return makeErrorFuture<AnyValue>(
      Error(Code::kFailedPrecondition,
            "'" + request.entry->name + "' named extension " +
                std::string(name()) + ", which takes no requests"));
}

void registerExtension(std::type_index type, ExtensionFactory factory) {
  Factories& f = factories();
  MutexLock lock(f.mu);
  for (auto& [t, fn] : f.list) {
    if (t == type) {
      fn = factory;
      return;
    }
  }
  f.list.emplace_back(type, factory);
}

Extensions Extensions::create(Agent& agent) {
  std::vector<std::pair<std::type_index, ExtensionFactory>> list;
  {
    Factories& f = factories();
    MutexLock lock(f.mu);
    list = f.list;
  }
  Extensions out;
  for (const auto& [type, factory] : list) {
    out.list_.push_back(Entry{type, factory(agent)});
  }
  return out;
}

AgentExtension* Extensions::find(std::type_index type) const {
  for (const auto& e : list_) {
    if (e.type == type) {
      return e.extension.get();
    }
  }
  return nullptr;
}

AgentExtension* Extensions::findWire(uint32_t wireId) const {
  if (wireId == kNoExtension) {
    return nullptr;
  }
  for (const auto& e : list_) {
    if (e.extension->wireId() == wireId) {
      return e.extension.get();
    }
  }
  return nullptr;
}

std::shared_ptr<CodecContext> Extensions::codecContext(int32_t peer) const {
  for (const auto& e : list_) {
    if (auto c = e.extension->codecContext(peer)) {
      return c;
    }
  }
  return nullptr;
}

bool Extensions::recordSend(OutgoingMessage& message) const {
  for (const auto& e : list_) {
    e.extension->onSend(message);
    if (message.autogradRecorded) {
      return true;
    }
  }
  return false;
}

Future<void> AgentExtension::admitRequest(uint64_t /*contextId*/,
                                          int32_t /*peer*/,
                                          Deadline /*deadline*/) {
  static const Future<void> admitted = makeReadyFuture();
  return admitted;
}

bool Extensions::recordRecv(IncomingMessage& message) const {
  for (const auto& e : list_) {
    e.extension->onReceive(message);
    if (message.autogradRecorded) {
      message.recordedBy = e.extension.get();
      return true;
    }
  }
  return false;
}

void Extensions::beforeQuiescence() const {
  for (const auto& e : list_) {
    e.extension->beforeQuiescence();
  }
}

void Extensions::reportLeaks(const std::string& agentName) const {
  for (const auto& e : list_) {
    auto leaks = e.extension->leaks();
    if (leaks.empty()) {
      continue;
    }
    std::string list;
    for (size_t i = 0; i < leaks.size() && i < 10; ++i) {
      list += (i ? "; " : "") + leaks[i];
    }
    TRELLIS_LOG_WARN("rpc agent {}: {} {} value(s) still held at shutdown: {}",
                     agentName, leaks.size(), e.extension->name(), list);
  }
}

}  // namespace detail
}  // namespace trellis::rpc
