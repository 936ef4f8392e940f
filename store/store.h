#pragma once

// The Store: a small key-value service that processes meet through
// (RPC init, process groups, elastic rendezvous), with torch.distributed's
// c10d Store semantics (docs/store.md).
//
// Values are byte strings. Keys are byte strings too (usually text).
//
// Timeouts: every store has a default timeout (`timeout()`), used by the
// operations that block (`get`, `multiGet`, `wait(keys)`) and, for network
// stores, as the deadline of every other operation. A timeout of zero means
// none (core's Deadline::fromTimeout); a negative one is an
// InvalidArgumentError. A blocking call that runs out of time throws
// TimeoutError whose message names the keys it waited for and the timeout.
//
// Thread safety: every method of every Store may be called from any thread
// at any time. Implementations serialise internally as documented on each.
//
// Errors (all thrown as typed trellis exceptions, core/error.h):
//  - TimeoutError: a blocking call ran out of time (keys named).
//  - ConnectionError: a network store lost its server (TCPStore).
//  - AuthError, ProtocolError: handshake or wire failures (TCPStore).
//  - InvalidArgumentError: a key or value breaks a limit, `add` on a value
//    that is not a decimal integer, or an overflowing counter.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace trellis::store {

using Bytes = std::vector<uint8_t>;

class Store {
 public:
  // c10d's default store timeout.
  static constexpr std::chrono::milliseconds kDefaultTimeout{300'000};

  explicit Store(std::chrono::milliseconds timeout = kDefaultTimeout);
  virtual ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Stores `value` under `key`, replacing any value; wakes its waiters.
  virtual void set(const std::string& key, std::span<const uint8_t> value) = 0;
  void set(const std::string& key, std::string_view value);

  // The value of `key`, waiting up to the default timeout for it to exist.
  Bytes get(const std::string& key);
  std::string getString(const std::string& key);

  // Atomically adds `delta` to the counter at `key` (absent = 0), stores the
  // result as decimal text (so `get` returns e.g. "3") and returns it.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;

  // Atomically: if `key` is absent and `expected` is empty, or the current
  // value equals `expected`, stores `desired`. Returns the value current
  // after the call (`desired` on success; the existing value otherwise;
  // `expected` when the key is absent and `expected` is not empty, as c10d).
  virtual Bytes compareSet(const std::string& key,
                           std::span<const uint8_t> expected,
                           std::span<const uint8_t> desired) = 0;
  std::string compareSet(const std::string& key, std::string_view expected,
                         std::string_view desired);

  // True when every key exists; never blocks.
  [[nodiscard]] virtual bool check(const std::vector<std::string>& keys) = 0;

  // Removes `key`; true when it existed.
  virtual bool deleteKey(const std::string& key) = 0;

  // The number of keys in the store (for a PrefixStore: in the underlying
  // store, as c10d).
  virtual int64_t numKeys() = 0;

  // Blocks until every key exists: the default timeout, or `timeout`.
  void wait(const std::vector<std::string>& keys);
  virtual void wait(const std::vector<std::string>& keys,
                    std::chrono::milliseconds timeout) = 0;

  // The values of `keys` in order, waiting (default timeout) for all of them.
  virtual std::vector<Bytes> multiGet(const std::vector<std::string>& keys) = 0;
  // Sets each keys[i] to values[i] atomically; sizes must match.
  virtual void multiSet(const std::vector<std::string>& keys,
                        const std::vector<Bytes>& values) = 0;

  // A second handle on the same keys with a connection of its own and
  // `timeout` as its default, for a thread that must not queue behind the
  // blocking calls of others (the collectives watchdog). nullptr for a
  // store with no connection to duplicate (HashStore, FileStore): use this
  // one. Throws what connecting throws.
  virtual std::unique_ptr<Store> clone(std::chrono::milliseconds timeout);

  std::chrono::milliseconds timeout() const;
  // Throws InvalidArgumentError for a negative timeout.
  void setTimeout(std::chrono::milliseconds timeout);

 protected:
  // `get` with an explicit timeout; PrefixStore forwards through it.
  virtual Bytes getWithTimeout(const std::string& key,
                               std::chrono::milliseconds timeout) = 0;
  friend class PrefixStore;

 private:
  std::atomic<int64_t> timeoutMs_;
};

// Helpers shared by the implementations (and the TCP server).
namespace detail {
// "[a, b, c]"; long lists and keys are shortened so messages stay readable.
std::string formatKeys(const std::vector<std::string>& keys);
// The TimeoutError message: "store wait for keys [a] timed out after 30s".
std::string timeoutMessage(std::string_view op,
                           const std::vector<std::string>& keys,
                           std::chrono::milliseconds timeout);
// Applies `delta` to a counter value; InvalidArgumentError when `current` is
// not a decimal integer or the sum overflows.
int64_t addToCounter(const std::string& key, const Bytes* current,
                     int64_t delta);
Bytes toBytes(std::string_view s);
void checkTimeout(std::chrono::milliseconds timeout);
}  // namespace detail

}  // namespace trellis::store
