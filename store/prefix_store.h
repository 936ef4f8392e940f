#pragma once

// PrefixStore: a namespace over another store. Every key becomes
// "<prefix>/<key>", so stores sharing one backing store cannot see each
// other's keys. numKeys() reports the underlying store's count (as c10d).
// The default timeout is the PrefixStore's own (initially the underlying
// store's). Thread-safe when the underlying store is (every Store is).

#include <memory>

#include <trellis/store/store.h>

namespace trellis::store {

class PrefixStore final : public Store {
 public:
  // Throws InvalidArgumentError when `store` is null.
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);
  ~PrefixStore() override;

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& underlying() const { return store_; }

  using Store::compareSet;
  using Store::set;
  using Store::wait;
  void set(const std::string& key, std::span<const uint8_t> value) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, std::span<const uint8_t> expected,
                   std::span<const uint8_t> desired) override;
  [[nodiscard]] bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  void wait(const std::vector<std::string>& keys,
            std::chrono::milliseconds timeout) override;
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys,
                const std::vector<Bytes>& values) override;
  // The same prefix over a clone of the underlying store (nullptr when it
  // has none).
  std::unique_ptr<Store> clone(std::chrono::milliseconds timeout) override;

 protected:
  Bytes getWithTimeout(const std::string& key,
                       std::chrono::milliseconds timeout) override;

 private:
  std::string join(const std::string& key) const;
  std::vector<std::string> join(const std::vector<std::string>& keys) const;

  const std::string prefix_;
  const std::shared_ptr<Store> store_;
};

}  // namespace trellis::store
