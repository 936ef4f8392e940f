#include <trellis/core/error.h>
#include <trellis/store/prefix_store.h>

namespace trellis::store {

namespace {
std::chrono::milliseconds timeoutOf(const std::shared_ptr<Store>& s) {
  if (!s) {
    throw InvalidArgumentError(
        Error::invalidArgument("PrefixStore needs a non-null store"));
  }
  return s->timeout();
}
}  // namespace

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : Store(timeoutOf(store)),
      prefix_(std::move(prefix)),
      store_(std::move(store)) {}

PrefixStore::~PrefixStore() = default;

std::string PrefixStore::join(const std::string& key) const {
  std::string out;
  out.reserve(prefix_.size() + 1 + key.size());
  out += prefix_;
  out += '/';
  out += key;
  return out;
}

std::vector<std::string> PrefixStore::join(
    const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) {
    out.push_back(join(k));
  }
  return out;
}

void PrefixStore::set(const std::string& key, std::span<const uint8_t> value) {
  store_->set(join(key), value);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return store_->add(join(key), delta);
}

Bytes PrefixStore::compareSet(const std::string& key,
                              std::span<const uint8_t> expected,
                              std::span<const uint8_t> desired) {
  return store_->compareSet(join(key), expected, desired);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  return store_->check(join(keys));
}

bool PrefixStore::deleteKey(const std::string& key) {
  return store_->deleteKey(join(key));
}

int64_t PrefixStore::numKeys() { return store_->numKeys(); }

void PrefixStore::wait(const std::vector<std::string>& keys,
                       std::chrono::milliseconds timeout) {
  store_->wait(join(keys), timeout);
}

std::vector<Bytes> PrefixStore::multiGet(const std::vector<std::string>& keys) {
  // Honour this store's default timeout, not the underlying one: wait first
  // (with ours), then read what is now there.
  const auto full = join(keys);
  store_->wait(full, timeout());
  return store_->multiGet(full);
}

void PrefixStore::multiSet(const std::vector<std::string>& keys,
                           const std::vector<Bytes>& values) {
  store_->multiSet(join(keys), values);
}

std::unique_ptr<Store> PrefixStore::clone(std::chrono::milliseconds timeout) {
  std::unique_ptr<Store> base = store_->clone(timeout);
  if (!base) {
    return nullptr;
  }
  auto out = std::make_unique<PrefixStore>(prefix_, std::move(base));
  out->setTimeout(timeout);
  return out;
}

Bytes PrefixStore::getWithTimeout(const std::string& key,
                                  std::chrono::milliseconds timeout) {
  return store_->getWithTimeout(join(key), timeout);
}

}  // namespace trellis::store
