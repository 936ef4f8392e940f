#pragma once

// Internal: the object behind Pipe. Not installed. Its code is split by
// concern: pipe.cc (lifecycle and handshake), pipe_reader.cc (frames in,
// out-of-band reads), pipe_writer.cc (the write queue), upgrade.cc (the
// same-host upgrade's I/O).

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/transport/channel.h>
#include <trellis/transport/connection.h>
#include <trellis/transport/context_impl.h>
#include <trellis/transport/handshake.h>
#include <trellis/transport/lifecycle.h>
#include <trellis/transport/pipe.h>
#include <trellis/transport/wire_format.h>

namespace trellis::transport {

class PipeImpl final : public std::enable_shared_from_this<PipeImpl>,
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
  bool tryWriteNow(const Message& message) TRELLIS_EXCLUDES(nowMu_);
  void readDescriptor(Pipe::ReadDescriptorCallback cb);
  void read(Allocation allocation, Pipe::ReadCallback cb);
  void close();

  const std::string& id() const { return id_; }
  std::string peerAddress() const TRELLIS_EXCLUDES(infoMu_);
  std::string transportName() const TRELLIS_EXCLUDES(infoMu_);
  std::string channelName() const TRELLIS_EXCLUDES(infoMu_);
  std::string channelName(DeviceType type) const TRELLIS_EXCLUDES(infoMu_);

 private:
  enum class State {
    kConnecting,
    kHandshake,  // handshake_ reads the first connection
    kEstablished,
  };
  // Bytes read ahead of the consumer; also bounds per-pipe memory at rest.
  static constexpr size_t kStageBytes = 32 << 10;
  // The stage of a pipe still in its handshake: enough for the header and a
  // typical hello (needBytes grows it for a larger message, within the
  // limits). A peer that connects and never proves the token costs this,
  // not kStageBytes: 1000 such connections held 32 MiB, which glibc kept
  // after they closed (a hostile-client probe grew a job's RSS by 39 MB).
  static constexpr size_t kHandshakeStageBytes = 512;
  // A segment at least this long is read straight into its destination.
  static constexpr size_t kDirectThreshold = 16 << 10;

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
  // Over a connection whose reads are cheap: the most bytes the current
  // step wants staged (kNoLimit: any), 0 while a large body waits for the
  // reader's buffers (reading then pauses).
  static constexpr size_t kNoLimit = ~size_t{0};
  size_t stageWant() const;
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
  // Ends the current read once its copies are done: `error` is the first
  // copy's failure as the channel gave it (docs/transport.md, "Errors").
  void finishOutOfBand(const Error& error);
  // A copy found the peer's memory unreadable (DATA_LOSS) while the peer
  // was still connected: the read waits, at most kPeerEndWait, for the
  // peer's end of the connection, which tells a peer that left (and may
  // have let go of its buffers) from a live one whose record lied.
  void holdForPeerEnd(const Error& error);
  void releaseHeldRead();
  // The peer's end of the connection is gone (EOF, or writes refused).
  bool peerLeft() const { return readEnd_ || !writeError_.ok(); }
  // The peer closed its end: the end of the stream was read, or the
  // kernel already knows of it (Connection::peerHasClosed). Its writes
  // failed when it closed, so it lends no buffer any more.
  bool writerClosed() const;
  // The UNAVAILABLE a read fails with when writerClosed(): before its copy
  // started, or while it ran (`copied`); names the peer's pid, its address
  // and whether its process has ended.
  Error writerGone(bool copied) const;
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
  // Where tryWriteNow() may write: the connection once the pipe is
  // established over one that writes from any thread, until the pipe
  // stops writing (an error, the peer's end, close()).
  void openWriteNow() TRELLIS_EXCLUDES(nowMu_);
  void closeWriteNow() TRELLIS_EXCLUDES(nowMu_);

  std::shared_ptr<ContextImpl> ctx_;
  const std::string id_;
  const bool connector_;
  Lifecycle life_;

  // What the public getters read from any thread.
  mutable Mutex infoMu_;
  std::string peer_ TRELLIS_GUARDED_BY(infoMu_);
  Negotiated negotiated_ TRELLIS_GUARDED_BY(infoMu_);

  // tryWriteNow()'s state. nowConn_ is set by the loop thread, after
  // channel_ (which tryWriteNow then reads); closing_ by close(), on the
  // calling thread, so that no write after close() returns gets through.
  // unsubmitted_ counts write() calls whose message the loop has not yet
  // handed to the connection (or failed): a write on the calling thread
  // may not overtake them.
  mutable Mutex nowMu_;
  std::shared_ptr<Connection> nowConn_ TRELLIS_GUARDED_BY(nowMu_);
  bool closing_ TRELLIS_GUARDED_BY(nowMu_) = false;
  std::atomic<size_t> unsubmitted_{0};

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
  size_t outOfBandErrorTensor_ = 0;       // whose copy it was
  Error heldError_;  // holdForPeerEnd's, until the peer's end or the timer
  LoopTimer* peerEndTimer_ = nullptr;
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
  // Write callbacks of a failed pipe whose connection stays open for its
  // own copies (teardownFromLoop): they fire once it has closed.
  std::vector<Pipe::WriteCallback> heldWriteCbs_;
  size_t pendingOps_ = 0;
};

}  // namespace trellis::transport
