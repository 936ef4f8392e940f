#pragma once

// The agent's pipes (internal; docs/rpc.md, "Starting and stopping"): the
// transport context and its listener, the pipes to and from peers (opened
// lazily, on the first call), writing envelopes with their payload and
// tensors, and reading them into buffers allocated after the descriptor
// (large CPU tensors from a BufferPool). Malformed envelopes close the
// pipe they came on and nothing else.
//
// Callbacks and closing: every callback this class hands the transport
// (accept, read, write) runs its body through a Lifeline (core/lifeline.h)
// that closeTransport() cuts once the loop has exited. An operation issued
// after that (a reply a worker thread writes while the agent closes)
// completes on the transport's late thread (transport/loop.h), perhaps once
// the agent is freed; such a callback finds the line cut and touches
// nothing. So OnMessage, OnFailed and send()'s `done` never run after
// closeTransport() has returned.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "envelope.h"
#include <trellis/core/buffer_pool.h>
#include <trellis/core/deadline.h>
#include <trellis/core/lifeline.h>
#include <trellis/core/mutex.h>
#include <trellis/rpc/agent.h>
#include <trellis/transport/context.h>

namespace trellis::transport {
class Context;
class Listener;
class Pipe;
struct Descriptor;
}  // namespace trellis::transport

namespace trellis::rpc::detail {

// One pipe and what the agent knows about it. Outgoing pipes carry this
// worker's requests and their replies; incoming ones the peer's requests.
struct PipeState {
  std::shared_ptr<transport::Pipe> pipe;
  bool outgoing = false;
  std::atomic<int32_t> peer{-1};  // incoming: learned from the first message
  std::atomic<bool> failed{false};
};

class Connections {
 public:
  // A whole message (envelope checked, buffers filled), on the loop.
  using OnMessage = std::function<void(const std::shared_ptr<PipeState>&,
                                       std::shared_ptr<wire::Envelope>,
                                       Reply body, Clock::time_point arrived)>;
  // A pipe failed (once per pipe; it is closed and forgotten already).
  using OnFailed =
      std::function<void(const std::shared_ptr<PipeState>&, const Error&)>;

  // `self` and `workers` are the agent's (workers filled by the rendezvous
  // before any pipe is opened to them).
  Connections(const WorkerInfo& self, int32_t worldSize,
              const RpcOptions& options, const std::vector<WorkerInfo>& workers,
              OnMessage onMessage, OnFailed onFailed);
  ~Connections();
  Connections(const Connections&) = delete;
  Connections& operator=(const Connections&) = delete;

  // Creates the transport context, listens on the chosen local address and
  // starts accepting. Returns the address to advertise. Accepted pipes are
  // not read until startServing(): a peer that finished the rendezvous
  // first may call before this worker knows the group (its requests wait
  // in the transport meanwhile; reading them would look up workers that
  // are not filled in yet).
  std::string listen();
  // The group is known: reads the pipes accepted so far and every later
  // one. Idempotent.
  void startServing();

  // The pipe to `to`, opened on first use.
  std::shared_ptr<PipeState> outPipe(int32_t to);
  // Writes `env` with `body` on `ps`; `context` lives until written.
  // `done` gets the write's error, exactly once, unless closeTransport()
  // has returned by then: then `done` is dropped, and a send() after it
  // writes nothing (a closing agent drops its replies, docs/rpc.md).
  void send(const std::shared_ptr<PipeState>& ps, const wire::Envelope& env,
            Encoder&& body, std::shared_ptr<CodecContext> context,
            std::function<void(const Error&)> done);
  // Whether `body` fits one message to worker `to`: its encoding within
  // that worker's maxMessageBytes, its tensors within the transport's
  // count and size limits. RESOURCE_EXHAUSTED saying what is too big, for
  // the caller to put the call's name in front; nothing is written.
  Error checkFits(int32_t to, const Encoder& body) const;
  // Closes `ps` and reports it once to OnFailed.
  void fail(const std::shared_ptr<PipeState>& ps, const Error& error);
  // "worker 'w1' (rank 1)", or the address of a peer not known yet.
  std::string describePeer(const PipeState& ps) const;

  // The transport loop expects work (docs/threads.md, "Spinning").
  void beginExpectedWork();
  void endExpectedWork();
  bool inLoop() const;

  // Closing: closeTransport() closes and joins the transport loop, then
  // cuts the callbacks' lifeline: every pipe callback has run or will do
  // nothing. forget() drops the pipes and refuses pipes accepted later.
  // Both idempotent.
  void closeTransport();
  void forget();
  bool forgotten() const;

  uint64_t sent() const { return sent_.load(); }
  uint64_t received() const { return received_.load(); }
  size_t openPipes() const;

 private:
  void accept();
  void armRead(const std::shared_ptr<PipeState>& ps);
  void onDescriptor(const std::shared_ptr<PipeState>& ps,
                    transport::Descriptor desc);

  const WorkerInfo& self_;
  const int32_t worldSize_;
  const RpcOptions& options_;
  // The transport context's limits: its defaults, except that a payload
  // may be as large as this worker accepts. What a peer sends here is held
  // to this worker's maxMessageBytes in onDescriptor, before anything is
  // allocated; what this worker sends, to the peer's (checkFits).
  const transport::Limits limits_;
  const std::vector<WorkerInfo>& workers_;
  const OnMessage onMessage_;
  const OnFailed onFailed_;

  // Shared with every callback handed to the transport, which may outlive
  // this object.
  const std::shared_ptr<Lifeline> lifeline_ = std::make_shared<Lifeline>();
  std::shared_ptr<transport::Context> ctx_;
  std::shared_ptr<transport::Listener> listener_;
  BufferPool receiveBuffers_;

  // Guards the pipe maps and `forgotten_`. Never held while a pipe is
  // written or read.
  mutable Mutex mu_;
  std::map<int32_t, std::shared_ptr<PipeState>> outPipes_
      TRELLIS_GUARDED_BY(mu_);
  std::set<std::shared_ptr<PipeState>> inPipes_ TRELLIS_GUARDED_BY(mu_);
  bool forgotten_ TRELLIS_GUARDED_BY(mu_) = false;
  bool serving_ TRELLIS_GUARDED_BY(mu_) = false;
  // Accepted before startServing(), not read yet.
  std::vector<std::shared_ptr<PipeState>> notServed_ TRELLIS_GUARDED_BY(mu_);

  std::atomic<uint64_t> sent_{0};
  std::atomic<uint64_t> received_{0};
};

}  // namespace trellis::rpc::detail
