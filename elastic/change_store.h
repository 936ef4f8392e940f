#pragma once

// A store handle whose writes can be waited for (internal to elastic/).
//
// The c10d rendezvous runs on a Trellis TCPStore, which can wait for a key
// to *exist* but not for a value to *change*; the rendezvous's waits are
// of the second kind (the round record moved on, a counter went up). So
// every agent writes through a ChangeStore: after each write to a key it
// bumps the key's change count (`<key>/.changes`) and creates the tick key
// of that count (`<key>/.tick/<n>`), and waitForChange waits, bounded, for
// the tick after the count it read before the value. A waiter is then
// woken by the write itself, where it used to sleep a fixed 50 ms between
// looks (docs/elastic.md, "Several nodes: the c10d rendezvous").
//
// Why no race: the waiter reads the count n, then the value. A write that
// lands after the count was read publishes a tick above n, which the wait
// for tick n+1 sees (counts only go up by one); a write before it changed
// the value the waiter then reads. A writer that does not tick (an agent
// of an older release) only costs the waiter its bound.
//
// Ticks older than kKeptTicks are deleted by the writer that passes them,
// so a long job's store holds a bounded number per key. A change count
// that is not a counter (another client wrote over it) turns the ticks of
// that key off: writes still succeed and waiters sleep their bound. Ticks
// are best effort: a write that succeeded never fails for its tick (the
// store may be gone by then: the exit barrier's last write lets the host
// stop it).
//
// Thread safety: as the wrapped store (one handle per thread or a store
// that is thread-safe).

#include <chrono>
#include <memory>
#include <string>

#include <trellis/store/store.h>

namespace trellis::elastic {

class ChangeStore final : public store::Store {
 public:
  static constexpr int64_t kKeptTicks = 64;

  explicit ChangeStore(std::unique_ptr<store::Store> inner);

  using store::Store::compareSet;
  using store::Store::set;
  using store::Store::wait;

  void set(const std::string& key, std::span<const uint8_t> value) override;
  int64_t add(const std::string& key, int64_t delta) override;
  store::Bytes compareSet(const std::string& key,
                          std::span<const uint8_t> expected,
                          std::span<const uint8_t> desired) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  void wait(const std::vector<std::string>& keys,
            std::chrono::milliseconds timeout) override;
  std::vector<store::Bytes> multiGet(
      const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys,
                const std::vector<store::Bytes>& values) override;
  // A ChangeStore over a clone of the wrapped store (nullptr when that has
  // none).
  std::unique_ptr<store::Store> clone(
      std::chrono::milliseconds timeout) override;

  // Returns once `key`'s value is no longer `seen` (empty `seen`: the key
  // is absent), at once if it already is not, or after `bound`. True when
  // it changed; false at the bound. Throws what the store throws.
  bool waitForChange(const std::string& key, const std::string& seen,
                     std::chrono::milliseconds bound);

  static std::string changesKey(const std::string& key);
  static std::string tickKey(const std::string& key, int64_t n);

 protected:
  store::Bytes getWithTimeout(const std::string& key,
                              std::chrono::milliseconds timeout) override;

 private:
  void ticked(const std::string& key);

  std::unique_ptr<store::Store> inner_;
};

}  // namespace trellis::elastic
