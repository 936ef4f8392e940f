#include <trellis/core/check.h>
#include <trellis/core/logging.h>
#include <trellis/transport/listener_impl.h>
#include <trellis/transport/pipe_impl.h>

namespace trellis::transport {

// ---- public handle ---------------------------------------------------------

Listener::Listener(Passkey, std::shared_ptr<ListenerImpl> impl)
    : impl_(std::move(impl)) {}
Listener::~Listener() {
  destructorNoThrow(impl_->id(), [this] { impl_->close(); });
}
void Listener::accept(AcceptCallback cb) { impl_->accept(std::move(cb)); }
void Listener::close() { impl_->close(); }
const std::map<std::string, std::string>& Listener::addresses() const {
  return impl_->addresses();
}
const std::string& Listener::address(const std::string& transport) const {
  auto it = impl_->addresses().find(transport);
  if (it == impl_->addresses().end()) {
    throw NotFoundError(Error::notFound(
        impl_->id() + " does not listen on transport '" + transport + "'"));
  }
  return it->second;
}

// ---- ListenerImpl ----------------------------------------------------------

ListenerImpl::ListenerImpl(std::shared_ptr<ContextImpl> ctx, std::string id)
    : ctx_(std::move(ctx)), id_(std::move(id)), life_(ctx_->loop()) {}

Error ListenerImpl::listenFromLoop(const std::vector<std::string>& addrs) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  std::weak_ptr<ListenerImpl> weak = shared_from_this();
  for (const auto& address : addrs) {
    const size_t sep = address.find("://");
    const std::string name =
        sep == std::string::npos ? std::string() : address.substr(0, sep);
    auto transport = ctx_->transport(name);
    if (transport == nullptr) {
      return Error::invalidArgument(id_ + ": address '" + address +
                                    "' names no transport enabled in this "
                                    "context");
    }
    if (addresses_.count(name) != 0) {
      return Error::invalidArgument(id_ + ": two addresses for transport '" +
                                    name + "' (one per transport)");
    }
    std::unique_ptr<ConnectionListener> cl;
    Error e = transport->listen(
        ctx_->loop(), address,
        [weak, name](const Error& err, std::shared_ptr<Connection> conn) {
          if (auto self = weak.lock()) {
            self->onConnection(name, err, std::move(conn));
          } else if (conn) {
            conn->close();
          }
        },
        &cl);
    if (!e.ok()) {
      return e.withContext(id_);
    }
    addresses_[name] = cl->address();
    listeners_.push_back(std::move(cl));
  }
  listenForUpgrades();
  return Error();
}

void ListenerImpl::onConnection(const std::string& transport,
                                const Error& error,
                                std::shared_ptr<Connection> conn) {
  if (life_.failed()) {
    if (conn) {
      conn->close();
    }
    return;
  }
  if (!error.ok()) {
    TRELLIS_LOG_WARN("{}: {}", id_, error.what());
    return;
  }
  auto p = std::make_shared<PipeImpl>(ctx_, ctx_->ids().next("pipe"), false);
  if (transport != "shm") {
    p->setUpgradeAddress(upgradeAddress_);
  }
  p->acceptFromLoop(std::move(conn), transport);
  if (ready_.size() >= ctx_->limits().maxPendingOperations) {
    p->failFromLoop(Error(Code::kResourceExhausted,
                          id_ + ": too many connections waiting for accept()"));
    return;
  }
  ready_.push_back(std::move(p));
  serveFromLoop();
}

void ListenerImpl::serveFromLoop() {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  while (!accepts_.empty() && !ready_.empty()) {
    auto cb = accepts_.pop();
    auto p = std::move(ready_.front());
    ready_.pop_front();
    auto handle = std::make_shared<Pipe>(Pipe::Passkey(), std::move(p));
    ctx_->loop().deliver([cb = std::move(cb), handle = std::move(handle)] {
      cb(Error(), handle);
    });
  }
}

void ListenerImpl::accept(Listener::AcceptCallback cb) {
  TRELLIS_CHECK(cb != nullptr, "Listener::accept needs a callback");
  auto self = shared_from_this();
  ctx_->loop().run([self, cb = std::move(cb)]() mutable {
    if (self->life_.refuse(cb, std::shared_ptr<Pipe>())) {
      return;
    }
    self->accepts_.push(std::move(cb));
    self->serveFromLoop();
  });
}

void ListenerImpl::close() {
  auto self = shared_from_this();
  ctx_->loop().run(
      [self] { self->failFromLoop(Error::cancelled(self->id_ + " closed")); });
}

void ListenerImpl::failFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  auto self = shared_from_this();
  life_.fail(error, [&] { teardownFromLoop(error); });
}

void ListenerImpl::teardownFromLoop(const Error& error) {
  TRELLIS_DCHECK(ctx_->loop().mayTouchState(), "off the loop thread");
  for (auto& l : listeners_) {
    l->close();
  }
  listeners_.clear();
  closeUpgradesFromLoop();
  auto ready = std::move(ready_);
  ready_.clear();
  for (auto& p : ready) {
    p->failFromLoop(error);
  }
  accepts_.failAll(ctx_->loop(), error);
  ctx_->removeListenerFromLoop(this);
}

}  // namespace trellis::transport
