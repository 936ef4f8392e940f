#include <unordered_map>

#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/store/hash_store.h>

namespace trellis::store {

struct HashStore::Impl {
  Mutex mu;
  CondVar cv;
  std::unordered_map<std::string, Bytes> data TRELLIS_GUARDED_BY(mu);

  bool allPresent(const std::vector<std::string>& keys) const
      TRELLIS_REQUIRES(mu) {
    for (const auto& k : keys) {
      if (!data.contains(k)) {
        return false;
      }
    }
    return true;
  }

  // Waits with `mu` held until every key exists or the deadline passes.
  void waitLocked(const std::vector<std::string>& keys,
                  std::chrono::milliseconds timeout, std::string_view op)
      TRELLIS_REQUIRES(mu) {
    const Deadline deadline = Deadline::fromTimeout(timeout);
    while (!allPresent(keys)) {
      if (deadline.isNever()) {
        cv.wait(mu);
      } else if (!cv.waitUntil(mu, deadline.timePoint()) && !allPresent(keys)) {
        throw TimeoutError(
            Error::timeout(detail::timeoutMessage(op, keys, timeout)));
      }
    }
  }
};

HashStore::HashStore(std::chrono::milliseconds timeout)
    : Store(timeout), impl_(std::make_unique<Impl>()) {}

HashStore::~HashStore() = default;

void HashStore::set(const std::string& key, std::span<const uint8_t> value) {
  {
    MutexLock lock(impl_->mu);
    impl_->data[key].assign(value.begin(), value.end());
  }
  impl_->cv.notifyAll();
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t result = 0;
  {
    MutexLock lock(impl_->mu);
    auto it = impl_->data.find(key);
    result = detail::addToCounter(
        key, it == impl_->data.end() ? nullptr : &it->second, delta);
    impl_->data[key] = detail::toBytes(std::to_string(result));
  }
  impl_->cv.notifyAll();
  return result;
}

Bytes HashStore::compareSet(const std::string& key,
                            std::span<const uint8_t> expected,
                            std::span<const uint8_t> desired) {
  Bytes current;
  bool changed = false;
  {
    MutexLock lock(impl_->mu);
    auto it = impl_->data.find(key);
    if (it == impl_->data.end()) {
      if (expected.empty()) {
        impl_->data[key].assign(desired.begin(), desired.end());
        changed = true;
        current.assign(desired.begin(), desired.end());
      } else {
        current.assign(expected.begin(), expected.end());
      }
    } else if (std::equal(it->second.begin(), it->second.end(),
                          expected.begin(), expected.end())) {
      it->second.assign(desired.begin(), desired.end());
      changed = true;
      current = it->second;
    } else {
      current = it->second;
    }
  }
  if (changed) {
    impl_->cv.notifyAll();
  }
  return current;
}

bool HashStore::check(const std::vector<std::string>& keys) {
  MutexLock lock(impl_->mu);
  for (const auto& k : keys) {
    if (!impl_->data.contains(k)) {
      return false;
    }
  }
  return true;
}

bool HashStore::deleteKey(const std::string& key) {
  MutexLock lock(impl_->mu);
  return impl_->data.erase(key) > 0;
}

int64_t HashStore::numKeys() {
  MutexLock lock(impl_->mu);
  return static_cast<int64_t>(impl_->data.size());
}

void HashStore::wait(const std::vector<std::string>& keys,
                     std::chrono::milliseconds timeout) {
  detail::checkTimeout(timeout);
  MutexLock lock(impl_->mu);
  impl_->waitLocked(keys, timeout, "wait");
}

Bytes HashStore::getWithTimeout(const std::string& key,
                                std::chrono::milliseconds timeout) {
  detail::checkTimeout(timeout);
  MutexLock lock(impl_->mu);
  impl_->waitLocked({key}, timeout, "get");
  return impl_->data.at(key);
}

std::vector<Bytes> HashStore::multiGet(const std::vector<std::string>& keys) {
  MutexLock lock(impl_->mu);
  impl_->waitLocked(keys, timeout(), "multiGet");
  std::vector<Bytes> out;
  out.reserve(keys.size());
  for (const auto& k : keys) {
    out.push_back(impl_->data.at(k));
  }
  return out;
}

void HashStore::multiSet(const std::vector<std::string>& keys,
                         const std::vector<Bytes>& values) {
  if (keys.size() != values.size()) {
    throw InvalidArgumentError(Error::invalidArgument(
        "store multiSet: " + std::to_string(keys.size()) + " keys but " +
        std::to_string(values.size()) + " values"));
  }
  {
    MutexLock lock(impl_->mu);
    for (size_t i = 0; i < keys.size(); ++i) {
      impl_->data[keys[i]] = values[i];
    }
  }
  impl_->cv.notifyAll();
}

}  // namespace trellis::store
