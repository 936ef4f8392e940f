#include <charconv>
#include <limits>

#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/store/store.h>

namespace trellis::store {

Store::Store(std::chrono::milliseconds timeout) : timeoutMs_(0) {
  setTimeout(timeout);
}

Store::~Store() = default;

void Store::set(const std::string& key, std::string_view value) {
  set(key, std::span<const uint8_t>(
               reinterpret_cast<const uint8_t*>(value.data()), value.size()));
}

Bytes Store::get(const std::string& key) {
  return getWithTimeout(key, timeout());
}

std::string Store::getString(const std::string& key) {
  Bytes b = get(key);
  return std::string(b.begin(), b.end());
}

std::string Store::compareSet(const std::string& key, std::string_view expected,
                              std::string_view desired) {
  auto asSpan = [](std::string_view s) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()),
                                    s.size());
  };
  Bytes b = compareSet(key, asSpan(expected), asSpan(desired));
  return std::string(b.begin(), b.end());
}

void Store::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout());
}

std::unique_ptr<Store> Store::clone(std::chrono::milliseconds) {
  return nullptr;
}

std::chrono::milliseconds Store::timeout() const {
  return std::chrono::milliseconds(timeoutMs_.load(std::memory_order_relaxed));
}

void Store::setTimeout(std::chrono::milliseconds timeout) {
  detail::checkTimeout(timeout);
  timeoutMs_.store(timeout.count(), std::memory_order_relaxed);
}

namespace detail {

namespace {
constexpr size_t kMaxKeysShown = 8;
constexpr size_t kMaxKeyCharsShown = 64;
}  // namespace

std::string formatKeys(const std::vector<std::string>& keys) {
  std::string out = "[";
  for (size_t i = 0; i < keys.size() && i < kMaxKeysShown; ++i) {
    if (i > 0) {
      out += ", ";
    }
    const std::string& k = keys[i];
    if (k.size() > kMaxKeyCharsShown) {
      out.append(k, 0, kMaxKeyCharsShown);
      out += "...";
    } else {
      out += k;
    }
  }
  if (keys.size() > kMaxKeysShown) {
    out += ", ... (" + std::to_string(keys.size()) + " keys)";
  }
  out += "]";
  return out;
}

std::string timeoutMessage(std::string_view op,
                           const std::vector<std::string>& keys,
                           std::chrono::milliseconds timeout) {
  std::string msg = "store ";
  msg += op;
  msg += " for keys ";
  msg += formatKeys(keys);
  msg += " timed out after ";
  msg += formatDuration(timeout);
  return msg;
}

int64_t addToCounter(const std::string& key, const Bytes* current,
                     int64_t delta) {
  int64_t value = 0;
  if (current != nullptr) {
    const char* first = reinterpret_cast<const char*>(current->data());
    const char* last = first + current->size();
    auto [ptr, ec] = std::from_chars(first, last, value);
    if (current->empty() || ec != std::errc() || ptr != last) {
      throw InvalidArgumentError(Error::invalidArgument(
          "store add(" + formatKeys({key}) +
          "): the current value is not a decimal integer"));
    }
  }
  int64_t result = 0;
  if (__builtin_add_overflow(value, delta, &result)) {
    throw InvalidArgumentError(Error::invalidArgument(
        "store add(" + formatKeys({key}) + "): " + std::to_string(value) +
        " + " + std::to_string(delta) + " overflows int64"));
  }
  return result;
}

Bytes toBytes(std::string_view s) { return Bytes(s.begin(), s.end()); }

void checkTimeout(std::chrono::milliseconds timeout) {
  if (timeout.count() < 0) {
    throw InvalidArgumentError(Error::invalidArgument(
        "store timeout must be >= 0 (0 means none), got " +
        std::to_string(timeout.count()) + "ms"));
  }
}

}  // namespace detail
}  // namespace trellis::store
