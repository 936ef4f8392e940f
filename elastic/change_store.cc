#include <algorithm>
#include <optional>
#include <thread>

#include <trellis/core/error.h>
#include <trellis/elastic/change_store.h>

namespace trellis::elastic {

ChangeStore::ChangeStore(std::unique_ptr<store::Store> inner)
    : Store(inner ? inner->timeout() : kDefaultTimeout),
      inner_(std::move(inner)) {
  if (!inner_) {
    throw InvalidArgumentError(
        Error::invalidArgument("ChangeStore: the wrapped store is null"));
  }
}

std::string ChangeStore::changesKey(const std::string& key) {
  return key + "/.changes";
}

std::string ChangeStore::tickKey(const std::string& key, int64_t n) {
  return key + "/.tick/" + std::to_string(n);
}

void ChangeStore::ticked(const std::string& key) {
  // Best effort: the write itself has happened, whatever befalls its tick.
  // A value that is no counter at the change count (another client wrote
  // it) turns this key's ticks off, and waiters fall back to their bound.
  // A store that went away meanwhile is not this write's failure: the
  // rendezvous's last write (leaving the exit barrier) lets the hosting
  // agent stop its server at once, before the tick lands.
  try {
    const int64_t n = inner_->add(changesKey(key), 1);
    inner_->set(tickKey(key, n), std::string_view());
    if (n > kKeptTicks) {
      (void)inner_->deleteKey(tickKey(key, n - kKeptTicks));
    }
  } catch (const Exception&) {
  }
}

void ChangeStore::set(const std::string& key, std::span<const uint8_t> value) {
  inner_->set(key, value);
  ticked(key);
}

int64_t ChangeStore::add(const std::string& key, int64_t delta) {
  const int64_t v = inner_->add(key, delta);
  if (delta != 0) {
    ticked(key);
  }
  return v;
}

store::Bytes ChangeStore::compareSet(const std::string& key,
                                     std::span<const uint8_t> expected,
                                     std::span<const uint8_t> desired) {
  store::Bytes now = inner_->compareSet(key, expected, desired);
  // The value is now `desired`: swapped, a change unless `expected` equals
  // it. (It may also have been `desired` already, the swap failing; the
  // reply cannot tell the two apart, and a spurious tick only wakes the
  // waiters once for nothing.)
  const bool same = std::equal(expected.begin(), expected.end(),
                               desired.begin(), desired.end());
  if (!same &&
      std::equal(now.begin(), now.end(), desired.begin(), desired.end())) {
    ticked(key);
  }
  return now;
}

bool ChangeStore::check(const std::vector<std::string>& keys) {
  return inner_->check(keys);
}

bool ChangeStore::deleteKey(const std::string& key) {
  const bool existed = inner_->deleteKey(key);
  if (existed) {
    ticked(key);
  }
  return existed;
}

int64_t ChangeStore::numKeys() { return inner_->numKeys(); }

void ChangeStore::wait(const std::vector<std::string>& keys,
                       std::chrono::milliseconds timeout) {
  inner_->wait(keys, timeout);
}

std::vector<store::Bytes> ChangeStore::multiGet(
    const std::vector<std::string>& keys) {
  return inner_->multiGet(keys);
}

void ChangeStore::multiSet(const std::vector<std::string>& keys,
                           const std::vector<store::Bytes>& values) {
  inner_->multiSet(keys, values);
  for (const auto& k : keys) {
    ticked(k);
  }
}

std::unique_ptr<store::Store> ChangeStore::clone(
    std::chrono::milliseconds timeout) {
  auto c = inner_->clone(timeout);
  if (!c) {
    return nullptr;
  }
  return std::make_unique<ChangeStore>(std::move(c));
}

store::Bytes ChangeStore::getWithTimeout(const std::string& key,
                                         std::chrono::milliseconds timeout) {
  inner_->wait({key}, timeout);
  return inner_->multiGet({key}).front();
}

bool ChangeStore::waitForChange(const std::string& key, const std::string& seen,
                                std::chrono::milliseconds bound) {
  // The count first, then the value (change_store.h says why).
  std::optional<int64_t> n;
  try {
    n = inner_->add(changesKey(key), 0);
  } catch (const InvalidArgumentError&) {
    // Not a counter (written by another client): no ticks to wait for.
  }
  const bool present = inner_->check({key});
  if (present != !seen.empty()) {
    return true;
  }
  if (present) {
    const store::Bytes now = inner_->multiGet({key}).front();
    if (!std::equal(now.begin(), now.end(), seen.begin(), seen.end())) {
      return true;
    }
  }
  if (!n) {
    std::this_thread::sleep_for(bound);
    return false;
  }
  try {
    inner_->wait({tickKey(key, *n + 1)}, bound);
    return true;
  } catch (const TimeoutError&) {
    return false;
  }
}

}  // namespace trellis::elastic
