#pragma once

// AgentExtension: how the layers above rpc/ take part in an agent's
// messages (internal: not installed; docs/rpc.md, "Extensions").
//
// rpc/ sits below rref/ and dist_autograd/ and knows neither. Each of them
// implements one AgentExtension and registers a factory for it at
// static-init time (registerExtension<T>()). Agent::start() makes one
// instance of every registered extension for the new agent before its
// transport starts, so a worker that only serves (a parameter server that
// never calls into rref/ itself) still keeps the results of remote() and
// takes part in a distributed backward. The list is fixed for the agent's
// life, which is why the agent calls the hooks without a lock.
//
// A layer finds its own instance by type: agent.extension<RRefContext>()
// (null when that layer was not linked into the program).
//
// What each hook is for:
//  - codecContext(peer): the context encoders and decoders of messages to
//    and from `peer` carry (RRefs need it to make forks), called once per
//    message: shared, so that an extension may hand out one per peer
//    instead of allocating one each time. At most one extension supplies
//    one; the agent takes the first non-null.
//  - onSend / onReceive: a request or response goes to / came from a peer
//    inside a distributed-autograd context (the envelope's context and
//    message ids; docs/dist_autograd.md). The extension that knows the
//    context sets `autogradRecorded`; if none does, the call fails with
//    FailedPreconditionError ("no dist_autograd support linked in").
//  - onRequest: a request whose envelope names this extension's wireId()
//    (Envelope.extension) with its payload (Envelope.extension_payload):
//    the extension decides how the function runs (on which target object)
//    and what becomes of its result (kept as an RRef's owner value). A
//    payload that does not decode is a ProtocolError for that request
//    only: the caller gets it as a RemoteError, the pipe stays open.
//  - admitRequest / requestDone: a user request inside a
//    distributed-autograd context, on the extension that recorded its
//    receive, before its function runs / once its result is encoded
//    (dist_autograd/ holds requests behind an optimizer step; contract
//    below).
//  - beforeQuiescence: graceful shutdown, before the group's idleness
//    check: release this worker's references (the messages are sent, not
//    acknowledged, when it returns).
//  - leaks: after the group was idle, what is still held (logged).
//
// Threads: hooks run on the callers' threads, the transport loop, the
// worker and the completion threads of the agent. Implementations are
// thread-safe, do not block, and report failures by throwing (onSend: the
// message is not sent; onReceive, onRequest: the request fails with that
// error) or through the returned future.

#include <ATen/core/Tensor.h>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <typeindex>
#include <vector>

#include <trellis/core/deadline.h>
#include <trellis/core/future.h>
#include <trellis/rpc/autograd_hooks.h>
#include <trellis/rpc/codec.h>
#include <trellis/rpc/registry.h>

namespace trellis::rpc {
class Agent;
}

namespace trellis::rpc::detail {

// Wire ids of extensions whose requests carry a payload
// (Envelope.extension; docs/rpc_wire.md). Never reuse a number.
inline constexpr uint32_t kNoExtension = 0;
inline constexpr uint32_t kRRefExtension = 1;
// A payload is at most 1 KiB (rpc/envelope.h checks it on arrival).

class AgentExtension;

// A request or response this worker is about to send.
struct OutgoingMessage {
  int32_t peer = -1;
  // The distributed-autograd context the message belongs to (never 0 when
  // onSend is called) and the tensors it carries that require grad, in
  // encoding order (maybe none).
  uint64_t autogradContextId = 0;
  const std::vector<at::Tensor>* gradTensors = nullptr;
  // A reply of a step-safe function (FunctionEntry::stepSafe): the graph
  // behind its tensors needs no parameter value of this worker, so the step
  // gate does not wait for their gradient.
  bool stepSafe = false;
  // Set by the extension that knows the context: the message id for the
  // envelope (0 when no tensor requires grad).
  bool autogradRecorded = false;
  uint64_t autogradMessageId = 0;
};

// A request or reply this worker received inside a distributed-autograd
// context.
struct IncomingMessage {
  int32_t peer = -1;
  uint64_t autogradContextId = 0;
  uint64_t autogradMessageId = 0;  // 0: no tensor requires grad
  // Set by the extension that knows the context; `gradReceiver` connects
  // the message's tensors to the sender's graph (null when the message id
  // is 0).
  bool autogradRecorded = false;
  std::unique_ptr<GradReceiver> gradReceiver;
  // The extension that recorded it (set by Extensions::recordRecv).
  AgentExtension* recordedBy = nullptr;
};

// A request naming an extension, on the callee. The function is registered
// and its signature matches the caller's.
struct ExtensionRequest {
  const FunctionEntry* entry = nullptr;
  int32_t caller = -1;
  uint64_t requestId = 0;
  // Whether the reply carries only the result: the request is neither
  // profiled (whose reply carries events) nor part of a distributed-autograd
  // context; only then may another reply answer it (AnyValue::noReply).
  bool plainReply = false;
  std::string_view payload;
  // Decodes the arguments and runs the function on `target` (null for a
  // free function; a method's object otherwise, kept alive by the caller
  // of run until the returned future completes).
  std::function<Future<AnyValue>(void* target)> run;
};

class AgentExtension {
 public:
  virtual ~AgentExtension() = default;
  // For logs and errors ("RRef", "dist_autograd").
  virtual std::string_view name() const = 0;
  // The Envelope.extension id of requests this extension handles; 0: none.
  virtual uint32_t wireId() const { return kNoExtension; }

  virtual std::shared_ptr<CodecContext> codecContext(int32_t /*peer*/) {
    return nullptr;
  }
  virtual void onSend(OutgoingMessage& /*message*/) {}
  virtual void onReceive(IncomingMessage& /*message*/) {}
  // Admission of a user request whose envelope carries `contextId` (!= 0),
  // after this extension's onReceive recorded it and before its function
  // runs. Protocol messages (backward, release, RRef bookkeeping, optimizer
  // steps) carry no context and never come here.
  //  - Returns a completed future when the request may run now (the usual
  //    case; it should allocate nothing). Otherwise a pending one that
  //    completes when it may run, or fails with DEADLINE_EXCEEDED at
  //    `deadline` (the request's own timeout; never() for none),
  //    FAILED_PRECONDITION when the context is released meanwhile, or
  //    CANCELLED when the extension is destroyed. The agent holds no worker
  //    thread while it is pending; its callback may run on any thread.
  //  - Once it has succeeded, the request counts as running in the context
  //    until requestDone(contextId), which the agent calls exactly once,
  //    after the result has been encoded (onSend for the reply included)
  //    or has failed. A failed admission is not followed by requestDone.
  //  - Never throws; a refusal is the future's error.
  virtual Future<void> admitRequest(uint64_t contextId, int32_t peer,
                                    Deadline deadline);
  virtual void requestDone(uint64_t /*contextId*/) {}
  // Returns the result the agent answers with.
  virtual Future<AnyValue> onRequest(ExtensionRequest& request);

  virtual void beforeQuiescence() {}
  virtual std::vector<std::string> leaks() { return {}; }
};

using ExtensionFactory = std::shared_ptr<AgentExtension> (*)(Agent& agent);
// Adds `factory` for extensions of `type` (static-init time; a second
// registration of one type replaces the first). Agents started afterwards
// get one instance each.
void registerExtension(std::type_index type, ExtensionFactory factory);

template <typename T>
bool registerExtension() {
  registerExtension(typeid(T), [](Agent& agent) {
    return std::shared_ptr<AgentExtension>(std::make_shared<T>(agent));
  });
  return true;
}

// One agent's extensions, made in Agent::start() and fixed after; the
// agent's pieces call them through this. Thread-safe (read only).
class Extensions {
 public:
  Extensions() = default;
  // Instantiates every registered extension for `agent`.
  static Extensions create(Agent& agent);

  AgentExtension* find(std::type_index type) const;
  AgentExtension* findWire(uint32_t wireId) const;

  std::shared_ptr<CodecContext> codecContext(int32_t peer) const;
  // Offers the message to each extension until one records it; false when
  // none knows distributed autograd. Throws what the extension threw.
  bool recordSend(OutgoingMessage& message) const;
  bool recordRecv(IncomingMessage& message) const;
  void beforeQuiescence() const;
  // Logs what each extension still holds.
  void reportLeaks(const std::string& agentName) const;

 private:
  struct Entry {
    std::type_index type;
    std::shared_ptr<AgentExtension> extension;
  };
  std::vector<Entry> list_;
};

}  // namespace trellis::rpc::detail
