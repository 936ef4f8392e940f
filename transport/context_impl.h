#pragma once

// Internal: the object behind Context, which owns the loop, the registered
// transports and channels, and every live pipe and listener. Not installed.
// The ones behind Listener and Pipe: listener_impl.h, pipe_impl.h.

#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <trellis/core/auth.h>
#include <trellis/core/ids.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/transport/channel.h>
#include <trellis/transport/context.h>
#include <trellis/transport/handshake.h>
#include <trellis/transport/lifecycle.h>
#include <trellis/transport/loop.h>
#include <trellis/transport/transport.h>
#include <trellis/transport/wire_format.h>

namespace trellis::transport {

class PipeImpl;
class ListenerImpl;

// Logs what escaped a destructor's body; never throws.
void logDestructorException(const std::string& who,
                            std::exception_ptr e) noexcept;

// Runs `fn` for a destructor: an exception (bad_alloc deep in close())
// is logged and swallowed, since destructors must not throw.
template <typename Fn>
void destructorNoThrow(const std::string& who, Fn&& fn) noexcept {
  try {
    fn();
  } catch (...) {
    logDestructorException(who, std::current_exception());
  }
}

// "boot_id/ipc-namespace": equal only for processes that can share memory.
std::string localHostId();

class ContextImpl final : public std::enable_shared_from_this<ContextImpl> {
 public:
  explicit ContextImpl(ContextOptions options);
  ~ContextImpl();

  Loop& loop() { return *loop_; }
  const Loop& loop() const { return *loop_; }
  // For callbacks from other threads (channel copies) that must hop back.
  std::shared_ptr<Loop> sharedLoop() const { return loop_; }
  const ContextOptions& options() const { return options_; }
  const Limits& limits() const { return options_.limits; }
  const std::optional<auth::JobToken>& token() const { return token_; }
  const std::string& hostId() const { return hostId_; }
  IdAllocator& ids() { return ids_; }

  void registerTransport(int priority, std::shared_ptr<Transport> t)
      TRELLIS_EXCLUDES(mu_);
  void registerChannel(int priority, std::shared_ptr<Channel> c)
      TRELLIS_EXCLUDES(mu_);
  // Applies the option/environment filters; called once, at create().
  void applyFilters() TRELLIS_EXCLUDES(mu_);

  std::shared_ptr<Transport> transport(const std::string& name) const
      TRELLIS_EXCLUDES(mu_);
  std::shared_ptr<Channel> channel(const std::string& name) const
      TRELLIS_EXCLUDES(mu_);
  std::vector<Offer> transportOffers() const TRELLIS_EXCLUDES(mu_);
  std::vector<Offer> channelOffers() const TRELLIS_EXCLUDES(mu_);
  wire_format::Hello localHello() const;

  std::shared_ptr<ListenerImpl> listen(const std::vector<std::string>& addrs);
  std::shared_ptr<PipeImpl> connect(const std::string& address);

  // Loop thread: bookkeeping of live objects, so close() reaches them all.
  void addPipeFromLoop(const std::shared_ptr<PipeImpl>& p);
  void removePipeFromLoop(PipeImpl* p);
  void removeListenerFromLoop(ListenerImpl* l);
  bool closedFromLoop() const {
    TRELLIS_DCHECK(loop_->mayTouchState(), "off the loop thread");
    return closedFromLoop_;
  }
  // Loop thread: pipes waiting for their same-host upgrade connection, by
  // the secret token sent in their accept message.
  void registerUpgrade(const auth::Nonce& token,
                       const std::shared_ptr<PipeImpl>& p);
  std::shared_ptr<PipeImpl> takeUpgrade(const auth::Nonce& token);
  void dropUpgrade(const auth::Nonce& token);

  void close();
  [[nodiscard]] bool join(Deadline deadline);

 private:
  struct Entry {
    int priority;
    std::string name;
    std::shared_ptr<Transport> transport;
    std::shared_ptr<Channel> channel;
  };
  void freeze() TRELLIS_EXCLUDES(mu_);
  void closeFromLoop();

  ContextOptions options_;
  std::optional<auth::JobToken> token_;
  std::string hostId_;
  IdAllocator ids_;
  std::shared_ptr<Loop> loop_;

  // Registration and filters: written until the first listen()/connect()
  // (frozen_), read by every handshake; always under mu_.
  mutable Mutex mu_;
  std::vector<Entry> transports_ TRELLIS_GUARDED_BY(mu_);
  std::vector<Entry> channels_ TRELLIS_GUARDED_BY(mu_);
  bool frozen_ TRELLIS_GUARDED_BY(mu_) = false;
  std::optional<std::set<std::string>> allowedTransports_
      TRELLIS_GUARDED_BY(mu_);
  std::optional<std::set<std::string>> allowedChannels_ TRELLIS_GUARDED_BY(mu_);
  std::atomic<bool> closing_{false};

  // Loop thread only.
  std::unordered_map<PipeImpl*, std::shared_ptr<PipeImpl>> pipes_;
  std::unordered_map<ListenerImpl*, std::shared_ptr<ListenerImpl>> listeners_;
  bool closedFromLoop_ = false;
  std::map<auth::Nonce, std::weak_ptr<PipeImpl>> upgrades_;
};

}  // namespace trellis::transport
