#pragma once

// HashStore: an in-process Store (a map under one mutex; waiters sleep on a
// condition variable and wake as soon as a key they need is written).
// For tests and single-process jobs. Thread-safe; nothing blocks except
// get/multiGet/wait, and those only up to their timeout.

#include <memory>

#include <trellis/store/store.h>

namespace trellis::store {

class HashStore final : public Store {
 public:
  explicit HashStore(std::chrono::milliseconds timeout = kDefaultTimeout);
  ~HashStore() override;

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

 protected:
  Bytes getWithTimeout(const std::string& key,
                       std::chrono::milliseconds timeout) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace trellis::store
