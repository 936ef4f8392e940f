#include <algorithm>

#include <grpcpp/grpcpp.h>

#include "etcd/rpc.grpc.pb.h"
#include <trellis/core/deadline.h>
#include <trellis/core/error.h>
#include <trellis/elastic/etcd_store.h>
#include <trellis/elastic/options.h>

namespace trellis::elastic {

namespace pb = etcdserverpb;

namespace {

// Far more than a rendezvous record; a value read from etcd is checked by
// its own decoder after this.
constexpr int kMaxMessageBytes = 8 << 20;
// add()'s compare-and-swap loop, when the store has no timeout.
constexpr int kMaxAddAttempts = 10'000;

std::string str(std::span<const uint8_t> b) {
  return std::string(b.begin(), b.end());
}

store::Bytes bytes(const std::string& s) {
  return store::Bytes(s.begin(), s.end());
}

std::string grpcCodeName(grpc::StatusCode code) {
  return std::string(codeName(static_cast<Code>(code)));
}

// The first key after every key that begins with `prefix` (etcd's
// range_end for a prefix).
std::string prefixEnd(std::string prefix) {
  while (!prefix.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(prefix.back());
    if (c < 0xff) {
      ++c;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

void setDeadline(grpc::ClientContext& ctx, const Deadline& deadline) {
  if (!deadline.isNever()) {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::duration_cast<std::chrono::microseconds>(
                         deadline.remaining()));
  }
}

}  // namespace

struct EtcdStore::Impl {
  EtcdStoreOptions options;
  std::string endpoint;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::KV::Stub> kv;
  std::unique_ptr<pb::Watch::Stub> watch;
  std::unique_ptr<pb::Lease::Stub> lease;

  std::string key(const std::string& k) const {
    const std::string& strip = options.strip;
    if (!strip.empty() && k.compare(0, strip.size(), strip) == 0) {
      return options.prefix + k.substr(strip.size());
    }
    return options.prefix + k;
  }

  [[noreturn]] void fail(std::string_view op, const std::string& etcdKey,
                         const grpc::Status& s) const {
    std::string msg = "etcd " + endpoint + ": " + std::string(op);
    if (!etcdKey.empty()) {
      msg += " on " + etcdKey;
    }
    msg += ": " + grpcCodeName(s.error_code()) + ": " + s.error_message();
    const auto code = static_cast<int>(s.error_code());
    throwError(
        Error(code >= 0 && code <= static_cast<int>(Code::kUnauthenticated)
                  ? static_cast<Code>(code)
                  : Code::kUnknown,
              std::move(msg)));
  }

  // A context for one call that ends by `deadline`.
  static void prepare(grpc::ClientContext& ctx, const Deadline& deadline) {
    setDeadline(ctx, deadline);
  }

  // The key's value and revisions; the store revision in `*revision`.
  bool range(const std::string& k, const Deadline& deadline,
             mvccpb::KeyValue* out, int64_t* revision) {
    grpc::ClientContext ctx;
    prepare(ctx, deadline);
    pb::RangeRequest req;
    req.set_key(k);
    pb::RangeResponse resp;
    const grpc::Status s = kv->Range(&ctx, req, &resp);
    if (!s.ok()) {
      fail("Range", k, s);
    }
    if (revision != nullptr) {
      *revision = resp.header().revision();
    }
    if (resp.kvs_size() == 0) {
      return false;
    }
    if (out != nullptr) {
      *out = resp.kvs(0);
    }
    return true;
  }

  pb::TxnResponse txn(const std::string& k, const pb::TxnRequest& req,
                      const Deadline& deadline) {
    grpc::ClientContext ctx;
    prepare(ctx, deadline);
    pb::TxnResponse resp;
    const grpc::Status s = kv->Txn(&ctx, req, &resp);
    if (!s.ok()) {
      fail("Txn", k, s);
    }
    return resp;
  }

  // Waits for a Put of `k` (any event: `anyEvent`) after `revision`: true
  // when one came, false at the deadline (or when etcd cancelled the
  // watch: the caller reads again).
  bool watchPut(const std::string& k, int64_t revision,
                const Deadline& deadline, bool anyEvent = false) {
    grpc::ClientContext ctx;
    prepare(ctx, deadline);
    auto stream = watch->Watch(&ctx);
    pb::WatchRequest req;
    auto* create = req.mutable_create_request();
    create->set_key(k);
    create->set_start_revision(revision + 1);
    if (!anyEvent) {
      create->add_filters(pb::WatchCreateRequest::NODELETE);
    }
    bool put = false;
    bool cancelled = false;
    if (stream->Write(req)) {
      pb::WatchResponse resp;
      while (!put && !cancelled && stream->Read(&resp)) {
        cancelled = resp.canceled();
        for (const auto& ev : resp.events()) {
          put = put || anyEvent || ev.type() == mvccpb::Event::PUT;
        }
      }
    }
    if (put || cancelled) {
      ctx.TryCancel();
    }
    const grpc::Status s = stream->Finish();
    if (put || cancelled) {
      return put;
    }
    // Our deadline passed: nothing changed. etcd's server sometimes ends the
    // stream first, as UNKNOWN "context deadline exceeded" (the deadline
    // travels with the call), racing the client's own DEADLINE_EXCEEDED.
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        (s.error_code() == grpc::StatusCode::UNKNOWN && deadline.expired())) {
      return false;
    }
    fail("Watch", k, s);
  }
};

EtcdStore::EtcdStore(EtcdStoreOptions options)
    : Store(options.timeout), impl_(std::make_shared<Impl>()) {
  Impl& m = *impl_;
  m.options = std::move(options);
  m.endpoint = Endpoint{m.options.host, m.options.port}.toString();
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  m.channel = grpc::CreateCustomChannel(
      m.endpoint, grpc::InsecureChannelCredentials(), args);
  m.kv = pb::KV::NewStub(m.channel);
  m.watch = pb::Watch::NewStub(m.channel);
  m.lease = pb::Lease::NewStub(m.channel);
  if (m.options.connectTimeout.count() > 0 &&
      !m.channel->WaitForConnected(std::chrono::system_clock::now() +
                                   m.options.connectTimeout)) {
    throw ConnectionError(
        Error::connection("etcd " + m.endpoint + ": cannot connect within " +
                          formatDuration(m.options.connectTimeout)));
  }
}

EtcdStore::EtcdStore(std::shared_ptr<Impl> impl,
                     std::chrono::milliseconds timeout)
    : Store(timeout), impl_(std::move(impl)) {}

EtcdStore::~EtcdStore() = default;

const std::string& EtcdStore::endpoint() const { return impl_->endpoint; }

std::string EtcdStore::etcdKey(const std::string& key) const {
  return impl_->key(key);
}

void EtcdStore::set(const std::string& key, std::span<const uint8_t> value) {
  setWithLease(key, str(value), 0);
}

void EtcdStore::setWithLease(const std::string& key, std::string_view value,
                             int64_t lease) {
  const std::string k = impl_->key(key);
  grpc::ClientContext ctx;
  Impl::prepare(ctx, Deadline::fromTimeout(timeout()));
  pb::PutRequest req;
  req.set_key(k);
  req.set_value(std::string(value));
  req.set_lease(lease);
  pb::PutResponse resp;
  const grpc::Status s = impl_->kv->Put(&ctx, req, &resp);
  if (!s.ok()) {
    impl_->fail("Put", k, s);
  }
}

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  const std::string k = impl_->key(key);
  const Deadline deadline = Deadline::fromTimeout(timeout());
  for (int attempt = 0;
       deadline.isNever() ? attempt < kMaxAddAttempts
                          : !deadline.expired() || attempt == 0;
       ++attempt) {
    mvccpb::KeyValue kv;
    const bool present = impl_->range(k, deadline, &kv, nullptr);
    store::Bytes current;
    if (present) {
      current = bytes(kv.value());
    }
    const int64_t next =
        store::detail::addToCounter(key, present ? &current : nullptr, delta);
    if (present && delta == 0) {
      return next;  // a read: nothing to write
    }
    pb::TxnRequest req;
    auto* cmp = req.add_compare();
    cmp->set_key(k);
    cmp->set_result(pb::Compare::EQUAL);
    if (present) {
      cmp->set_target(pb::Compare::MOD);
      cmp->set_mod_revision(kv.mod_revision());
    } else {
      cmp->set_target(pb::Compare::CREATE);
      cmp->set_create_revision(0);
    }
    auto* put = req.add_success()->mutable_request_put();
    put->set_key(k);
    put->set_value(std::to_string(next));
    if (impl_->txn(k, req, deadline).succeeded()) {
      return next;
    }
  }
  throw TimeoutError(Error::timeout(
      "etcd " + impl_->endpoint + ": add on " + k +
      ": the compare-and-swap kept losing to other writers until " +
      (deadline.isNever() ? std::to_string(kMaxAddAttempts) + " attempts"
                          : "the timeout " + formatDuration(timeout()))));
}

store::Bytes EtcdStore::compareSet(const std::string& key,
                                   std::span<const uint8_t> expected,
                                   std::span<const uint8_t> desired) {
  const std::string k = impl_->key(key);
  const Deadline deadline = Deadline::fromTimeout(timeout());
  // c10d: an absent key with empty `expected` is set; so is a present key
  // whose value equals `expected` (empty included): two compares at most.
  for (int pass = 0; pass < 2; ++pass) {
    pb::TxnRequest req;
    auto* cmp = req.add_compare();
    cmp->set_key(k);
    cmp->set_result(pb::Compare::EQUAL);
    if (expected.empty() && pass == 0) {
      cmp->set_target(pb::Compare::CREATE);
      cmp->set_create_revision(0);
    } else {
      cmp->set_target(pb::Compare::VALUE);
      cmp->set_value(str(expected));
    }
    auto* put = req.add_success()->mutable_request_put();
    put->set_key(k);
    put->set_value(str(desired));
    req.add_failure()->mutable_request_range()->set_key(k);
    const pb::TxnResponse resp = impl_->txn(k, req, deadline);
    if (resp.succeeded()) {
      return store::Bytes(desired.begin(), desired.end());
    }
    const pb::RangeResponse* range =
        resp.responses_size() == 1 && resp.responses(0).has_response_range()
            ? &resp.responses(0).response_range()
            : nullptr;
    if (range == nullptr) {
      throwError(Error::protocol("etcd " + impl_->endpoint + ": Txn on " + k +
                                 ": the failure branch returned no Range"));
    }
    if (range->kvs_size() == 0) {
      if (expected.empty()) {
        continue;  // deleted meanwhile: try the absent case again
      }
      return store::Bytes(expected.begin(), expected.end());
    }
    if (!(expected.empty() && range->kvs(0).value().empty())) {
      return bytes(range->kvs(0).value());
    }
  }
  // Still racing with deletes and writes: report what is there now.
  mvccpb::KeyValue kv;
  if (impl_->range(k, deadline, &kv, nullptr)) {
    return bytes(kv.value());
  }
  return store::Bytes(expected.begin(), expected.end());
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  const Deadline deadline = Deadline::fromTimeout(timeout());
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) {
    return impl_->range(impl_->key(key), deadline, nullptr, nullptr);
  });
}

bool EtcdStore::deleteKey(const std::string& key) {
  const std::string k = impl_->key(key);
  grpc::ClientContext ctx;
  Impl::prepare(ctx, Deadline::fromTimeout(timeout()));
  pb::DeleteRangeRequest req;
  req.set_key(k);
  pb::DeleteRangeResponse resp;
  const grpc::Status s = impl_->kv->DeleteRange(&ctx, req, &resp);
  if (!s.ok()) {
    impl_->fail("DeleteRange", k, s);
  }
  return resp.deleted() > 0;
}

int64_t EtcdStore::numKeys() {
  const std::string& p = impl_->options.prefix;
  grpc::ClientContext ctx;
  Impl::prepare(ctx, Deadline::fromTimeout(timeout()));
  pb::RangeRequest req;
  req.set_key(p);
  req.set_range_end(prefixEnd(p));
  req.set_count_only(true);
  pb::RangeResponse resp;
  const grpc::Status s = impl_->kv->Range(&ctx, req, &resp);
  if (!s.ok()) {
    impl_->fail("Range", p + "*", s);
  }
  return resp.count();
}

void EtcdStore::wait(const std::vector<std::string>& keys,
                     std::chrono::milliseconds timeout) {
  store::detail::checkTimeout(timeout);
  const Deadline deadline = Deadline::fromTimeout(timeout);
  for (const auto& key : keys) {
    const std::string k = impl_->key(key);
    for (;;) {
      int64_t revision = 0;
      // The Range itself may not outlive the wait's deadline.
      if (impl_->range(
              k, earliest(deadline, Deadline::fromTimeout(this->timeout())),
              nullptr, &revision)) {
        break;
      }
      if (deadline.expired() || !impl_->watchPut(k, revision, deadline)) {
        if (deadline.expired()) {
          throw TimeoutError(Error::timeout(
              store::detail::timeoutMessage("wait", keys, timeout)));
        }
      }
    }
  }
}

store::Bytes EtcdStore::getWithTimeout(const std::string& key,
                                       std::chrono::milliseconds timeout) {
  store::detail::checkTimeout(timeout);
  const std::string k = impl_->key(key);
  const Deadline deadline = Deadline::fromTimeout(timeout);
  for (;;) {
    mvccpb::KeyValue kv;
    int64_t revision = 0;
    if (impl_->range(k,
                     earliest(deadline, Deadline::fromTimeout(this->timeout())),
                     &kv, &revision)) {
      return bytes(kv.value());
    }
    if (deadline.expired() || !impl_->watchPut(k, revision, deadline)) {
      if (deadline.expired()) {
        throw TimeoutError(Error::timeout(
            store::detail::timeoutMessage("get", {key}, timeout)));
      }
    }
  }
}

std::vector<store::Bytes> EtcdStore::multiGet(
    const std::vector<std::string>& keys) {
  const auto t = timeout();
  const Deadline deadline = Deadline::fromTimeout(t);
  std::vector<store::Bytes> out;
  out.reserve(keys.size());
  for (const auto& key : keys) {
    try {
      out.push_back(getWithTimeout(
          key,
          deadline.isNever()
              ? std::chrono::milliseconds(0)
              : std::max(std::chrono::milliseconds(1),
                         std::chrono::duration_cast<std::chrono::milliseconds>(
                             deadline.remaining()))));
    } catch (const TimeoutError&) {
      throw TimeoutError(
          Error::timeout(store::detail::timeoutMessage("get", keys, t)));
    }
  }
  return out;
}

void EtcdStore::multiSet(const std::vector<std::string>& keys,
                         const std::vector<store::Bytes>& values) {
  if (keys.size() != values.size()) {
    throw InvalidArgumentError(Error::invalidArgument(
        "multiSet: " + std::to_string(keys.size()) + " keys but " +
        std::to_string(values.size()) + " values"));
  }
  pb::TxnRequest req;
  for (size_t i = 0; i < keys.size(); ++i) {
    auto* put = req.add_success()->mutable_request_put();
    put->set_key(impl_->key(keys[i]));
    put->set_value(str(values[i]));
  }
  (void)impl_->txn(keys.empty() ? "" : impl_->key(keys.front()), req,
                   Deadline::fromTimeout(timeout()));
}

bool EtcdStore::waitForChange(const std::string& key, std::string_view seen,
                              std::chrono::milliseconds timeout) {
  store::detail::checkTimeout(timeout);
  const std::string k = impl_->key(key);
  const Deadline deadline = Deadline::fromTimeout(timeout);
  mvccpb::KeyValue kv;
  int64_t revision = 0;
  const bool present = impl_->range(
      k, earliest(deadline, Deadline::fromTimeout(this->timeout())), &kv,
      &revision);
  if ((present ? kv.value() : std::string()) != seen ||
      (present && seen.empty())) {
    return true;
  }
  return impl_->watchPut(k, revision, deadline, /*anyEvent=*/true);
}

std::unique_ptr<store::Store> EtcdStore::clone(
    std::chrono::milliseconds timeout) {
  store::detail::checkTimeout(timeout);
  return std::unique_ptr<Store>(new EtcdStore(impl_, timeout));
}

int64_t EtcdStore::grantLease(std::chrono::seconds ttl) {
  grpc::ClientContext ctx;
  Impl::prepare(ctx, Deadline::fromTimeout(timeout()));
  pb::LeaseGrantRequest req;
  req.set_ttl(ttl.count());
  pb::LeaseGrantResponse resp;
  const grpc::Status s = impl_->lease->LeaseGrant(&ctx, req, &resp);
  if (!s.ok()) {
    impl_->fail("LeaseGrant", "", s);
  }
  if (!resp.error().empty() || resp.id() == 0) {
    throwError(Error::internal("etcd " + impl_->endpoint +
                               ": LeaseGrant: " + resp.error()));
  }
  return resp.id();
}

int64_t EtcdStore::keepAlive(int64_t lease) {
  grpc::ClientContext ctx;
  Impl::prepare(ctx, Deadline::fromTimeout(timeout()));
  auto stream = impl_->lease->LeaseKeepAlive(&ctx);
  pb::LeaseKeepAliveRequest req;
  req.set_id(lease);
  pb::LeaseKeepAliveResponse resp;
  const bool ok = stream->Write(req) && stream->Read(&resp);
  stream->WritesDone();
  if (ok) {
    // The answer is all we need; end the stream without waiting for etcd.
    ctx.TryCancel();
  }
  const grpc::Status s = stream->Finish();
  if (!ok) {
    impl_->fail("LeaseKeepAlive", "lease " + std::to_string(lease),
                s.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                      "the stream ended without an answer")
                       : s);
  }
  return resp.ttl();
}

void EtcdStore::revokeLease(int64_t lease) {
  grpc::ClientContext ctx;
  Impl::prepare(ctx, Deadline::fromTimeout(timeout()));
  pb::LeaseRevokeRequest req;
  req.set_id(lease);
  pb::LeaseRevokeResponse resp;
  const grpc::Status s = impl_->lease->LeaseRevoke(&ctx, req, &resp);
  if (!s.ok()) {
    impl_->fail("LeaseRevoke", "lease " + std::to_string(lease), s);
  }
}

}  // namespace trellis::elastic
