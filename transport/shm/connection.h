#pragma once

// Internal: one shm connection (docs/transport.md, "shm transport"). Set
// up by a descriptor exchange over a UNIX socket that leaves both sides a
// Segment (segment.h); then a byte stream over its two rings, polled after
// activity and woken through eventfds when idle, with the socket kept open
// only so that either side sees the other go. Not installed.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <uv.h>

#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/transport/lifecycle.h>
#include <trellis/transport/loop.h>
#include <trellis/transport/shm/factory.h>
#include <trellis/transport/shm/ring.h>
#include <trellis/transport/shm/segment.h>
#include <trellis/transport/transport.h>

namespace trellis::transport::shm {

class ShmConnection final : public Connection,
                            public std::enable_shared_from_this<ShmConnection> {
 public:
  using SetupCallback = Transport::ConnectCallback;

  ShmConnection(Loop& loop, const Options& opts, bool connector,
                std::string peer);
  ~ShmConnection() override { releaseResources(); }

  // Keeps the connection alive until its uv handles have closed.
  void retain() { self_ = shared_from_this(); }

  // Loop thread. The descriptor exchange, bounded by Options::setupTimeout:
  // as connector to the listener named `name`, or as acceptor on the
  // accepted socket `fd`. `cb` fires once, with this connection open or the
  // setup's error.
  void startConnect(const std::string& name, SetupCallback cb);
  void startAccept(int fd, SetupCallback cb);

  // ---- Connection ---------------------------------------------------------

  void startReading(ReadSink* sink) override;
  void stopReading() override { reading_ = false; }

  void write(const IoBuf* bufs, size_t n, WriteCallback cb) override;
  // Any thread: the ring's producer end is shared with the loop under
  // txMu_, and the ring's doorbell wakes a sleeping peer from any thread.
  bool writeNow(const IoBuf* bufs, size_t n) override;
  bool writesNow() const override { return true; }
  void close() override;
  std::string peerAddress() const override { return peer_; }
  bool peerHasClosed() const override {
    return state_ == State::kOpen && socketPeerHasClosed(sock_);
  }
  bool readsAreCheap() const override { return true; }

 private:
  enum class State { kConnecting, kAwaitReply, kAwaitSetup, kOpen, kClosed };

  struct WriteOp {
    std::vector<IoBuf> bufs;
    size_t index = 0;
    size_t offset = 0;
    WriteCallback cb;
  };

  // ---- setup --------------------------------------------------------------

  void startSetupTimer();
  void cancelTimers();
  void tryConnect();
  void startSocketPoll();
  void closeReceivedFds();
  void onSocket(int status, int events);
  Error finishAccept();
  Error finishConnect();
  void failSetup(const Error& e);
  void open();

  // ---- data path ------------------------------------------------------------

  Error writeError() const;
  Error push(const IoBuf* bufs, size_t n, size_t* index, size_t* offset)
      TRELLIS_REQUIRES(txMu_);
  void flushWrites();
  void drainReads();
  void fail(const Error& e);
  void failWrites(const Error& e);
  void wake();
  // Clears the write ring's "wake me when there is room" if this side set
  // it.
  void clearTxWaiting();
  void startIdle();
  void stopIdle();
  void onDoorbell();
  void onSocketOpen(int status, int events);
  void pump();

  // ---- teardown ---------------------------------------------------------

  void handleClosed();
  void releaseResources();

  Loop& loop_;
  const Options opts_;
  const bool connector_;
  std::string peer_;
  std::string name_;
  uint64_t spinNs_ = 0;
  State state_ = State::kConnecting;
  SetupCallback setupCb_;
  LoopTimer* setupTimer_ = nullptr;
  LoopTimer* retryTimer_ = nullptr;

  int sock_ = -1;
  Segment seg_;
  uint8_t setupBuf_[kSetupBytes] = {0};
  size_t setupGot_ = 0;
  std::vector<int> rxFds_;

  uv_idle_t idle_;
  uv_poll_t sockPoll_;
  uv_poll_t efdPoll_;
  bool sockPollInit_ = false;
  bool efdPollInit_ = false;
  int openHandles_ = 0;
  bool idleActive_ = false;

  // The write side, which writeNow() reaches from other threads: the
  // ring's producer end, the writes waiting for room in it, and whether
  // writing is still allowed (cleared with the first failure, the peer's
  // end or close(); the segment is unmapped only after that).
  Mutex txMu_;
  RingWriter tx_ TRELLIS_GUARDED_BY(txMu_);
  std::deque<WriteOp> writes_ TRELLIS_GUARDED_BY(txMu_);
  bool txOpen_ TRELLIS_GUARDED_BY(txMu_) = false;
  // Loop thread only, so that its polling needs no lock: writes_.size()
  // (the loop is the only thread that changes writes_), and whether it
  // asked the write ring's consumer to wake it.
  size_t queuedWrites_ = 0;
  bool txWaiting_ = false;
  RingReader rx_;
  ReadSink* sink_ = nullptr;
  bool reading_ = false;
  bool peerGone_ = false;
  bool readErrorDelivered_ = false;
  Lifecycle life_;
  bool pumping_ = false;
  bool progress_ = false;
  uint64_t hotUntil_ = 0;
  std::shared_ptr<ShmConnection> self_;
};

}  // namespace trellis::transport::shm
