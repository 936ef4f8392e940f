#pragma once

// EtcdStore: a store::Store over etcd's v3 API (gRPC), so the etcd
// rendezvous runs the same RoundJoin state machine as c10d
// (docs/elastic.md, "The etcd rendezvous"). Internal to elastic/: not
// installed, and no gRPC or protobuf type appears here.
//
// Keys: every key lives under `prefix` ("/trellis/rdzv/<run id>/"); a key
// that begins with `strip` loses it first, so the rendezvous's
// "trellis/rdzv/round" is "/trellis/rdzv/<run id>/round" in etcd.
//
// Semantics are store.h's (the Store contract suite runs against it):
//  - set / multiSet: Put / one Txn of Puts.
//  - compareSet: one Txn comparing the value (or CREATE revision 0 for an
//    absent key when `expected` is empty).
//  - add: a compare-and-swap loop on the key's MOD revision, bounded by the
//    store's timeout.
//  - get / wait: a Range, then a Watch from the next revision (no polling)
//    until the key is Put or the deadline passes (TimeoutError).
//  - numKeys: the keys under `prefix` only (this run's), not all of etcd.
// Every call carries a gRPC deadline: the store's timeout (zero: none).
//
// Leases (liveness): grantLease + setWithLease attach a key to a lease;
// keepAlive refreshes it; when the holder stops refreshing, etcd deletes
// the key after the TTL.
//
// Errors: etcd's gRPC status maps one-to-one onto Trellis codes
// (core/error.h follows gRPC's canonical codes): UNAVAILABLE ->
// ConnectionError, DEADLINE_EXCEEDED -> TimeoutError, ... Messages name
// the endpoint, the operation and the key: "etcd 127.0.0.1:2379: Txn on
// /trellis/rdzv/job/round: UNAVAILABLE: ...".
//
// Thread safety: every method may be called from any thread (gRPC stubs
// are thread-safe; the store holds no other mutable state).

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <trellis/store/store.h>

namespace trellis::elastic {

struct EtcdStoreOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 2379;
  std::string prefix = "/trellis/";
  std::string strip;
  // The store's default timeout (store.h), also every call's deadline.
  std::chrono::milliseconds timeout = store::Store::kDefaultTimeout;
  // How long the constructor waits for a connection; zero: it does not
  // (the first call fails fast with UNAVAILABLE when etcd is down).
  std::chrono::milliseconds connectTimeout{0};
};

class EtcdStore final : public store::Store {
 public:
  // Throws ConnectionError naming the endpoint when connectTimeout is set
  // and etcd cannot be reached within it.
  explicit EtcdStore(EtcdStoreOptions options);
  ~EtcdStore() override;

  void set(const std::string& key, std::span<const uint8_t> value) override;
  using Store::set;
  int64_t add(const std::string& key, int64_t delta) override;
  store::Bytes compareSet(const std::string& key,
                          std::span<const uint8_t> expected,
                          std::span<const uint8_t> desired) override;
  using Store::compareSet;
  [[nodiscard]] bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  int64_t numKeys() override;
  using Store::wait;
  void wait(const std::vector<std::string>& keys,
            std::chrono::milliseconds timeout) override;
  std::vector<store::Bytes> multiGet(
      const std::vector<std::string>& keys) override;
  void multiSet(const std::vector<std::string>& keys,
                const std::vector<store::Bytes>& values) override;
  // Shares this store's channel (gRPC multiplexes calls on it).
  std::unique_ptr<Store> clone(std::chrono::milliseconds timeout) override;

  // A new lease of `ttl` (etcd may round it up); its id.
  int64_t grantLease(std::chrono::seconds ttl);
  // Refreshes `lease`; the TTL etcd granted again, <= 0 when the lease has
  // already expired (its keys are gone).
  int64_t keepAlive(int64_t lease);
  void revokeLease(int64_t lease);
  // set(), with the key attached to `lease`.
  void setWithLease(const std::string& key, std::string_view value,
                    int64_t lease);

  // Waits up to `timeout` until `key`'s value is no longer `seen` (empty:
  // absent): true at once when it already is not, else on a Watch event
  // (a Put or a delete) after the Range; false at the timeout.
  bool waitForChange(const std::string& key, std::string_view seen,
                     std::chrono::milliseconds timeout);

  // "host:port".
  const std::string& endpoint() const;
  // The etcd key that `key` maps to.
  std::string etcdKey(const std::string& key) const;

 protected:
  store::Bytes getWithTimeout(const std::string& key,
                              std::chrono::milliseconds timeout) override;

 private:
  struct Impl;
  EtcdStore(std::shared_ptr<Impl> impl, std::chrono::milliseconds timeout);
  std::shared_ptr<Impl> impl_;
};

}  // namespace trellis::elastic
