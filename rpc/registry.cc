#include <c10/util/Exception.h>
#include <cstdlib>
#include <cxxabi.h>
#include <memory>
#include <typeinfo>
#include <unordered_map>
#include <vector>

#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/rpc/registry.h>

namespace trellis::rpc {

namespace {

// Lookups by string_view without building a std::string (every request
// looks its function up).
struct NameHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const {
    return std::hash<std::string_view>{}(s);
  }
};

}  // namespace

struct Registry::Impl {
  mutable Mutex mu;
  std::unordered_map<std::string, FunctionEntry, NameHash, std::equal_to<>>
      entries TRELLIS_GUARDED_BY(mu);
  std::string duplicates TRELLIS_GUARDED_BY(mu);
  // Flags set by a mark* call (TRELLIS_REMOTE_INLINE, _STEP_SAFE) by name,
  // also before the registration they belong to ran.
  std::unordered_map<std::string, std::vector<bool FunctionEntry::*>> marks
      TRELLIS_GUARDED_BY(mu);

  void mark(std::string_view name, bool FunctionEntry::*flag) {
    MutexLock lock(mu);
    std::string key(name);
    if (auto it = entries.find(key); it != entries.end()) {
      it->second.*flag = true;
    }
    marks[std::move(key)].push_back(flag);
  }
};

Registry& Registry::global() {
  static Registry registry;
  return registry;
}

Registry::Impl& Registry::impl() const {
  // Function-local so that registrations from any translation unit's static
  // initialisers find it constructed.
  static Impl instance;
  return instance;
}

bool Registry::add(FunctionEntry entry) {
  Impl& d = impl();
  MutexLock lock(d.mu);
  std::string name = entry.name;
  if (auto it = d.marks.find(name); it != d.marks.end()) {
    for (bool FunctionEntry::*flag : it->second) {
      entry.*flag = true;
    }
  }
  if (!d.entries.emplace(name, std::move(entry)).second) {
    d.duplicates += (d.duplicates.empty() ? "'" : ", '") + name + "'";
    return false;
  }
  return true;
}

const FunctionEntry* Registry::find(std::string_view name) const {
  Impl& d = impl();
  MutexLock lock(d.mu);
  auto it = d.entries.find(name);
  return it == d.entries.end() ? nullptr : &it->second;
}

void Registry::markInline(std::string_view name) {
  impl().mark(name, &FunctionEntry::runOnLoop);
}

void Registry::markStepSafe(std::string_view name) {
  impl().mark(name, &FunctionEntry::stepSafe);
}

Error Registry::status() const {
  Impl& d = impl();
  MutexLock lock(d.mu);
  if (d.duplicates.empty()) {
    return Error();
  }
  return Error(Code::kFailedPrecondition,
               "remote functions registered twice: " + d.duplicates);
}

size_t Registry::size() const {
  Impl& d = impl();
  MutexLock lock(d.mu);
  return d.entries.size();
}

namespace detail {

Error currentExceptionError() {
  std::string type = "unknown exception";
  if (const std::type_info* t = abi::__cxa_current_exception_type()) {
    int status = 0;
    std::unique_ptr<char, void (*)(void*)> name(
        abi::__cxa_demangle(t->name(), nullptr, nullptr, &status), std::free);
    type = status == 0 && name ? name.get() : t->name();
  }
  Error e;
  try {
    throw;
  } catch (const c10::Error& c) {
    // libtorch's what() carries a C++ backtrace: the user wants the first
    // line, not 18 frames of c10 (the backtrace stays in debug logs).
    TRELLIS_LOG_DEBUG("remote function raised {}", c.what());
    e = Error(Code::kUnknown, type + ": " + c.what_without_backtrace());
  } catch (...) {
    e = errorFromCurrentException();
  }
  if (e.remoteOrigin() != nullptr) {
    return e;  // raised by another worker further down: keep its origin
  }
  // A trellis::Exception keeps its own message; others get "type: what()"
  // from errorFromCurrentException; strip the type, it travels apart.
  std::string message = e.message();
  if (message.rfind(type + ": ", 0) == 0) {
    message = message.substr(type.size() + 2);
  }
  return Error::remote(RemoteOrigin{"", "", type}, message, e.code());
}

}  // namespace detail
}  // namespace trellis::rpc
