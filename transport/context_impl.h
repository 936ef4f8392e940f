#pragma once

// Internal: the objects behind Context, Listener and Pipe. Not installed.

#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <trellis/core/auth.h>
#include <trellis/core/ids.h>
#include <trellis/transport/connection.h>
#include <trellis/transport/context.h>
#include <trellis/transport/handshake.h>
#include <trellis/transport/lifecycle.h>
#include <trellis/transport/loop.h>
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

class ContextImpl : public std::enable_shared_from_this<ContextImpl> {
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

  void registerTransport(int priority, std::shared_ptr<Transport> t);
  void registerChannel(int priority, std::shared_ptr<Channel> c);
  // Applies the option/environment filters; called once, at create().
  void applyFilters();

  std::shared_ptr<Transport> transport(const std::string& name) const;
  std::shared_ptr<Channel> channel(const std::string& name) const;
  std::vector<Offer> transportOffers() const;
  std::vector<Offer> channelOffers() const;
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
  bool join(Deadline deadline);

 private:
  struct Entry {
    int priority;
    std::string name;
    std::shared_ptr<Transport> transport;
    std::shared_ptr<Channel> channel;
  };
  void freeze();
  void closeFromLoop();

  ContextOptions options_;
  std::optional<auth::JobToken> token_;
  std::string hostId_;
  IdAllocator ids_;
  std::shared_ptr<Loop> loop_;

  mutable std::mutex mu_;
  std::vector<Entry> transports_;  // guarded by mu_ until frozen_
  std::vector<Entry> channels_;    // guarded by mu_ until frozen_
  bool frozen_ = false;            // guarded by mu_
  std::optional<std::set<std::string>> allowedTransports_;  // guarded by mu_
  std::optional<std::set<std::string>> allowedChannels_;    // guarded by mu_
  std::atomic<bool> closing_{false};

  // Loop thread only.
  std::unordered_map<PipeImpl*, std::shared_ptr<PipeImpl>> pipes_;
  std::unordered_map<ListenerImpl*, std::shared_ptr<ListenerImpl>> listeners_;
  bool closedFromLoop_ = false;
  std::map<auth::Nonce, std::weak_ptr<PipeImpl>> upgrades_;
};

class UpgradeBinder;

class ListenerImpl : public std::enable_shared_from_this<ListenerImpl> {
 public:
  ListenerImpl(std::shared_ptr<ContextImpl> ctx, std::string id);
  // Loop thread.
  Error listenFromLoop(const std::vector<std::string>& addresses);
  void accept(Listener::AcceptCallback cb);
  void close();
  // The first error fails the listener for good (Lifecycle).
  void failFromLoop(const Error& error);
  const std::map<std::string, std::string>& addresses() const {
    return addresses_;
  }
  const std::string& id() const { return id_; }

 private:
  void onConnection(const std::string& transport, const Error& error,
                    std::shared_ptr<Connection> conn);
  void onUpgradeConnection(const Error& error,
                           std::shared_ptr<Connection> conn);
  void listenForUpgrades();
  void serveFromLoop();
  void teardownFromLoop(const Error& error);

  std::shared_ptr<ContextImpl> ctx_;
  const std::string id_;
  std::map<std::string, std::string> addresses_;  // written before returned
  // Loop thread only.
  Lifecycle life_;
  std::vector<std::unique_ptr<ConnectionListener>> listeners_;
  PendingCallbacks<std::shared_ptr<Pipe>> accepts_;
  std::deque<std::shared_ptr<PipeImpl>> ready_;
  // The automatic shm:// listener for same-host upgrades ("" when none).
  std::unique_ptr<ConnectionListener> upgradeListener_;
  std::string upgradeAddress_;
  std::set<std::shared_ptr<UpgradeBinder>> binders_;

  friend class UpgradeBinder;
};

class PipeImpl : public std::enable_shared_from_this<PipeImpl>,
                 private ReadSink {
 public:
  PipeImpl(std::shared_ptr<ContextImpl> ctx, std::string id, bool connector);
  ~PipeImpl() override;

  // Loop thread: starts the handshake timer and connects / takes `conn`.
  void connectFromLoop(const std::string& address);
  void acceptFromLoop(std::shared_ptr<Connection> conn,
                      const std::string& transport);
  // The first error fails the pipe for good (Lifecycle).
  void failFromLoop(const Error& error);
  // Acceptor, before acceptFromLoop: the listener's upgrade address.
  void setUpgradeAddress(std::string address) {
    upgradeAddress_ = std::move(address);
  }
  // Acceptor, loop thread: a connection to the upgrade listener presented
  // this pipe's token.
  void bindUpgrade(std::shared_ptr<Connection> conn,
                   const wire_format::BindMessage& bind);

  void write(Message message, Pipe::WriteCallback cb);
  void readDescriptor(Pipe::ReadDescriptorCallback cb);
  void read(Allocation allocation, Pipe::ReadCallback cb);
  void close();

  const std::string& id() const { return id_; }
  std::string peerAddress() const;
  std::string transportName() const;
  std::string channelName() const;
  std::string channelName(DeviceType type) const;

 private:
  enum class State {
    kConnecting,
    kHandshake,  // handshake_ reads the first connection
    kEstablished,
  };
  enum class Rx {
    kHeader,
    kLayout,
    kDescriptor,
    kDescriptorReady,
    kAwaitRead,
    kBody,
    kOutOfBand,  // inline bytes done; the channels' copies are running
  };

  struct WriteOp {
    Message message;
    Pipe::WriteCallback cb;
    std::vector<uint8_t> head;
    bool done = false;
    // Out-of-band tensors: the callback waits for the wire write and for the
    // reader's completion frame (peerError is what the reader reported).
    bool awaitsPeer = false;
    bool wireDone = false;
    bool peerDone = false;
    Error peerError;
  };
  struct Segment {
    uint8_t* data;
    size_t length;
  };
  struct OutOfBandRead {
    size_t tensor;
    Allocation::Buffer dst;
    Device device;
    std::string record;
  };

  // ReadSink.
  void readBuffer(char** base, size_t* length) override;
  void onRead(size_t n) override;
  void onReadError(const Error& error) override;

  void attach(std::shared_ptr<Connection> conn, const std::string& transport);
  void process();
  bool step();
  // The handshake (handshake_): started once the first connection is up;
  // handshakeMoved() sends what it queued and acts on where it got to.
  void startHandshake();
  bool stepHandshake();
  void handshakeMoved(Handshake::State before);
  bool stepFrame();
  void updateReading();
  size_t buffered() const { return stageEnd_ - stageBegin_; }
  const uint8_t* stageData() const { return stage_.data() + stageBegin_; }
  void consume(size_t n) { stageBegin_ += n; }
  bool needBytes(size_t n);
  void established();
  // The same-host upgrade's I/O around the handshake's decisions.
  void offerUpgrade();
  void stayedOnBootstrap();
  void tryUpgrade();
  void upgradeFailed(const std::string& why);
  void followDecision();
  void moveTo(std::shared_ptr<Connection> conn);
  void sendRaw(std::vector<uint8_t> bytes);
  void submitWrite(const std::shared_ptr<WriteOp>& op);
  void completeWrite(const std::shared_ptr<WriteOp>& op, const Error& error);
  void finishWrite(const std::shared_ptr<WriteOp>& op, const Error& error);
  void onCompletion(const wire_format::FrameLayout& completion);
  Channel* channelFor(const Device& device) const;
  Error describeTensors(const Message& m,
                        std::vector<wire_format::OutOfBand>* records) const;
  void startOutOfBand();
  void onOutOfBandDone(size_t tensor, const Error& error);
  void finishRead(const Error& error);
  void sendCompletion(const Error& error);
  // The peer closed (EOF): fails every write now and later with `error`
  // and closes the connection; what was already received stays readable.
  void peerClosedFromLoop(const Error& error);
  // The connection refused a write because the peer is gone: fails every
  // write not held by the connection, and every later one, with `error`;
  // reading goes on until the end of the stream.
  void stopWritesFromLoop(const Error& error);
  // After the end of the stream: fails the pipe once the next step needs
  // bytes that will never come.
  void checkEndOfStream();
  void serveDescriptor();
  bool fillSegments();
  void finishBody();
  // Runs once, from failFromLoop: releases the connections and timers and
  // fails every pending operation.
  void teardownFromLoop(const Error& error);

  std::shared_ptr<ContextImpl> ctx_;
  const std::string id_;
  const bool connector_;
  Lifecycle life_;

  mutable std::mutex infoMu_;
  std::string peer_;       // guarded by infoMu_
  Negotiated negotiated_;  // guarded by infoMu_

  // Loop thread only from here on.
  std::shared_ptr<Connection> conn_;
  std::string bootstrap_;
  State state_ = State::kConnecting;
  LoopTimer* timer_ = nullptr;
  std::unique_ptr<Handshake> handshake_;
  uint64_t peerPid_ = 0;  // from the peer's hello

  std::vector<uint8_t> stage_;
  size_t stageBegin_ = 0;
  size_t stageEnd_ = 0;
  bool reading_ = false;
  bool processing_ = false;
  bool again_ = false;
  // A direct read into the current segment is in progress.
  bool direct_ = false;

  Rx rx_ = Rx::kHeader;
  size_t layoutLength_ = 0;
  wire_format::FrameLayout layout_;
  std::string descriptor_;
  size_t descriptorFilled_ = 0;
  std::vector<Segment> segments_;
  std::vector<OutOfBandRead> outOfBand_;  // the current read's records
  size_t outOfBandPending_ = 0;           // copies not yet called back
  Error outOfBandError_;                  // the first copy error
  // End of the stream seen (readEnd_) / writes impossible (writeError_).
  bool readEnd_ = false;
  Error readEndError_;
  Error writeError_;
  size_t segIndex_ = 0;
  size_t segOffset_ = 0;

  std::deque<std::shared_ptr<WriteOp>> queuedWrites_;    // before handshake
  std::deque<std::shared_ptr<WriteOp>> inflightWrites_;  // submitted
  // Submitted writes with out-of-band tensors, in order, until the reader's
  // completion frame for each arrives.
  std::deque<std::shared_ptr<WriteOp>> awaitingPeer_;
  std::shared_ptr<Channel> channel_;      // negotiated for CPU tensors
  std::shared_ptr<Channel> cudaChannel_;  // for CUDA tensors; may be null

  // Same-host upgrade.
  std::string upgradeAddress_;               // acceptor: listener's shm://
  std::shared_ptr<Connection> upgradeConn_;  // connector: bound shm conn
  LoopTimer* upgradeTimer_ = nullptr;        // acceptor: bind bound
  PendingCallbacks<Descriptor> descriptorCbs_;
  Pipe::ReadCallback readCb_;
  size_t pendingOps_ = 0;
};

}  // namespace trellis::transport
