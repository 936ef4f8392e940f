#include "dispatch.h"

#include <functional>
#include <optional>
#include <thread>

#include <trellis/core/logging.h>
#include <trellis/core/thread_usage.h>
#include <trellis/rpc/profiler.h>

namespace trellis::rpc::detail {

Dispatcher::Dispatcher(Agent* agent, const WorkerInfo& self,
                       const Extensions& extensions, size_t threads,
                       RequestHook done)
    : agent_(agent),
      self_(self),
      extensions_(extensions),
      done_(std::move(done)),
      pool_(threads, "rpc-" + self.name) {}

Dispatcher::~Dispatcher() { close(); }

void Dispatcher::close() {
  pool_.shutdown(ThreadPool::ShutdownMode::kCancel);
  pool_.join();
  if (!lifeline_->cut(Deadline::after(std::chrono::seconds(10)))) {
    TRELLIS_LOG_ERROR(
        "rpc agent {}: a request's callback still runs 10 s "
        "after its worker pool closed",
        self_.name);
  }
}

namespace {

// How long an inline function may hold the loop before it is reported.
Duration inlineWarnThreshold() {
  static const Duration threshold =
      microsFromEnv("TRELLIS_RPC_INLINE_WARN_US", std::chrono::milliseconds(1),
                    std::chrono::seconds(60));
  return threshold;
}

}  // namespace

void Dispatcher::dispatch(Request request) {
  running_.fetch_add(1);
  const FunctionEntry* entry = Registry::global().find(request.env->function());
  if (entry != nullptr && entry->runOnLoop) {
    runInline(request, entry);
    return;
  }
  // The request lives in the task itself: one allocation.
  pool_.post([this, entry, r = std::move(request)](const Error& e) mutable {
    if (!e.ok()) {  // pool shut down (closed at once)
      running_.fetch_sub(1);
      done_(!r.env->one_way());
      return;
    }
    CurrentAgentScope scope(agent_);
    handle(r, entry);
  });
}

void Dispatcher::runInline(Request& request, const FunctionEntry* entry) {
  CurrentAgentScope scope(agent_);
  bool measure = false;
  if (suspects_.load(std::memory_order_relaxed) != 0) {
    MutexLock lock(slowMu_);
    measure = suspect_.count(entry) != 0;
  }
  const ThreadUsage before = measure ? ThreadUsage::now() : ThreadUsage{};
  const auto start = Clock::now();
  handle(request, entry);
  const Duration took = Clock::now() - start;
  const bool over = took > inlineWarnThreshold();
  if (!measure) {
    if (over) {
      // The wall clock alone also counts the time this thread was
      // preempted, which on a machine with more runnable threads than
      // cores is most of it: the next run says which it was.
      MutexLock lock(slowMu_);
      if (suspect_.insert(entry).second) {
        suspects_.fetch_add(1, std::memory_order_relaxed);
      }
    }
    return;
  }
  const ThreadUsage after = ThreadUsage::now();
  const Duration cpu = after.cpu - before.cpu;
  const long waits = after.waits - before.waits;
  if (!over) {
    MutexLock lock(slowMu_);
    if (suspect_.erase(entry) != 0) {
      suspects_.fetch_sub(1, std::memory_order_relaxed);
    }
    return;
  }
  // Over again. It held the loop itself when it computed that long, or
  // when it went to sleep (a lock, I/O, a sleep: a voluntary switch);
  // otherwise the thread was preempted, and it stays a suspect.
  if (cpu > inlineWarnThreshold() || waits > 0) {
    reportSlowInline(*entry, took, cpu, waits);
  }
}

void Dispatcher::reportSlowInline(const FunctionEntry& entry, Duration took,
                                  Duration cpu, long waits) {
  slowInlineRuns_.fetch_add(1, std::memory_order_relaxed);
  const auto now = Clock::now();
  {
    // One warning per function per 10 s: a function that is always slow
    // should not flood the log from the loop it already slows down.
    MutexLock lock(slowMu_);
    auto [it, fresh] = lastSlowWarning_.try_emplace(entry.name, now);
    if (!fresh && now - it->second < std::chrono::seconds(10)) {
      return;
    }
    it->second = now;
  }
  TRELLIS_LOG_WARN(
      "rpc agent {}: inline function '{}' held the transport loop for {} "
      "({} of CPU, {} wait{}; TRELLIS_RPC_INLINE_WARN_US: {}), twice in a "
      "row; no message of this worker moved meanwhile. Inline functions "
      "must not block: drop its TRELLIS_REMOTE_INLINE, or make it async",
      self_.name, entry.name, formatDuration(took), formatDuration(cpu), waits,
      waits == 1 ? "" : "s", formatDuration(inlineWarnThreshold()));
}

void Dispatcher::handle(Request& request, const FunctionEntry* entry) {
  const wire::Envelope& env = *request.env;
  const int64_t profileStartUs = env.profile() ? profilerNowUs() : 0;
  std::shared_ptr<NestedEvents> nested;
  if (env.profile()) {
    nested = std::make_shared<NestedEvents>();
    nested->thread = profilerThreadId();
  }
  auto fail = [&](Error e) {
    respond(request, makeErrorFuture<AnyValue>(std::move(e)), profileStartUs,
            nested);
  };
  if (env.timeout_us() > 0 &&
      Clock::now() - request.arrived >
          std::chrono::microseconds(static_cast<int64_t>(env.timeout_us()))) {
    return fail(Error::timeout("'" + env.function() + "' waited on '" +
                               self_.name +
                               "' longer than its timeout for a free worker "
                               "thread and was not run"));
  }
  if (entry == nullptr) {
    return fail(Error::notFound("function '" + env.function() +
                                "' is not registered on worker '" + self_.name +
                                "'"));
  }
  if (entry->signature != env.signature()) {
    return fail(Error(Code::kFailedPrecondition,
                      "signature mismatch for '" + env.function() +
                          "': the caller and worker '" + self_.name +
                          "' were built with different parameter or result "
                          "types"));
  }
  if (env.extension() == kNoExtension && entry->classTypeId != nullptr) {
    // A method needs its object: only rref/'s extension names one.
    return fail(Error::invalidArgument("'" + env.function() +
                                       "' is a method: call it through an "
                                       "RRef"));
  }
  const int32_t caller = request.body.from;
  const uint64_t autogradContext = env.autograd_context_id();
  std::shared_ptr<GradReceiver> receiver;
  if (autogradContext != 0) {
    IncomingMessage in;
    in.peer = caller;
    in.autogradContextId = autogradContext;
    in.autogradMessageId = env.autograd_message_id();
    try {
      if (!extensions_.recordRecv(in)) {
        return fail(Error(Code::kFailedPrecondition,
                          "'" + env.function() +
                              "' was called inside a distributed-autograd "
                              "context, but worker '" +
                              self_.name +
                              "' has no dist_autograd support linked "
                              "in"));
      }
    } catch (...) {
      return fail(errorFromCurrentException());
    }
    receiver = std::move(in.gradReceiver);
    // Admission (dist_autograd/ holds a request behind an optimizer step
    // on this worker; rpc/extension.h).
    const Deadline deadline =
        env.timeout_us() > 0
            ? Deadline::at(request.arrived +
                           std::chrono::microseconds(
                               static_cast<int64_t>(env.timeout_us())))
            : Deadline::never();
    AgentExtension* gate = in.recordedBy;
    Future<void> admitted =
        gate->admitRequest(autogradContext, caller, deadline);
    if (!admitted.completed()) {
      // Held: give the worker thread back, and stop the loop's polling for
      // a reply that is not coming soon. The outcome is handled on a
      // worker thread (it may come on the extension's timer thread, or
      // while it is destroyed at close).
      if (held_) {
        held_(!request.env->one_way());
      }
      admitted.addDoneCallback(Lifeline::guard(
          lifeline_, [this, r = std::make_shared<Request>(std::move(request)),
                      entry, receiver = std::move(receiver), profileStartUs,
                      nested, gate, autogradContext](const Future<void>& f) {
            pool_.post([this, r, entry, receiver, profileStartUs, nested, gate,
                        autogradContext, f](const Error& pe) mutable {
              if (resumed_) {
                resumed_(!r->env->one_way());
              }
              if (!pe.ok()) {  // pool shut down (closed at once)
                if (!f.hasError()) {
                  gate->requestDone(autogradContext);
                }
                running_.fetch_sub(1);
                done_(!r->env->one_way());
                return;
              }
              CurrentAgentScope scope(agent_);
              if (f.hasError()) {
                respond(*r, makeErrorFuture<AnyValue>(f.error()),
                        profileStartUs, std::move(nested));
                return;
              }
              run(*r, entry, std::move(receiver), profileStartUs,
                  std::move(nested), gate);
            });
          }));
      return;
    }
    if (admitted.hasError()) {
      return fail(admitted.error());
    }
    return run(request, entry, std::move(receiver), profileStartUs,
               std::move(nested), gate);
  }
  run(request, entry, std::move(receiver), profileStartUs, std::move(nested),
      nullptr);
}

void Dispatcher::run(Request& request, const FunctionEntry* entry,
                     std::shared_ptr<GradReceiver> receiver,
                     int64_t profileStartUs,
                     std::shared_ptr<NestedEvents> nested,
                     AgentExtension* gate) {
  const wire::Envelope& env = *request.env;
  const int32_t caller = request.body.from;
  const uint64_t autogradContext = env.autograd_context_id();
  auto fail = [&](Error e) {
    respond(request, makeErrorFuture<AnyValue>(std::move(e)), profileStartUs,
            nested, gate);
  };
  auto context = extensions_.codecContext(caller);
  auto invoke = [entry, body = std::move(request.body), autogradContext,
                 receiver = std::move(receiver), context = std::move(context),
                 nested](void* target) mutable {
    Decoder dec(body.bytes, std::move(body.tensors), context.get());
    dec.setGradReceiver(receiver.get());
    // Nested calls of the function join the caller's context, and its
    // profile when it is profiled.
    AutogradContextScope scope(autogradContext);
    std::optional<NestedProfileScope> profile;
    if (nested != nullptr) {
      profile.emplace(nested);
    }
    return entry->invoke(dec, target);
  };
  if (env.extension() == kNoExtension) {
    return respond(request, invoke(nullptr), profileStartUs, std::move(nested),
                   gate, entry->stepSafe);
  }
  AgentExtension* extension = extensions_.findWire(env.extension());
  if (extension == nullptr) {
    return fail(Error(Code::kFailedPrecondition,
                      "'" + env.function() + "' needs extension " +
                          std::to_string(env.extension()) +
                          (env.extension() == kRRefExtension ? " (RRef)" : "") +
                          ", but worker '" + self_.name +
                          "' has no support for it linked in"));
  }
  ExtensionRequest x;
  x.entry = entry;
  x.caller = caller;
  x.requestId = env.request_id();
  x.plainReply = !env.profile() && autogradContext == 0 && !env.one_way();
  x.payload = env.extension_payload();
  x.run = std::move(invoke);
  Future<AnyValue> result;
  try {
    result = extension->onRequest(x);
  } catch (...) {
    result = makeErrorFuture<AnyValue>(errorFromCurrentException());
  }
  respond(request, result, profileStartUs, std::move(nested), gate,
          entry->stepSafe);
}

void Dispatcher::respond(Request& request, const Future<AnyValue>& result,
                         int64_t profileStartUs,
                         std::shared_ptr<NestedEvents> nested,
                         AgentExtension* gate, bool stepSafe) {
  const wire::Envelope& req = *request.env;
  const uint64_t id = req.request_id();
  const int32_t peer = static_cast<int32_t>(req.from_worker());
  const uint64_t autogradContext = req.autograd_context_id();
  std::string function = req.function();
  const bool replies = !req.one_way();
  // A function's future may complete on any thread, also after close().
  auto reply = [this, respond = std::move(request.respond), id, peer, replies,
                profileStartUs, autogradContext, nested = std::move(nested),
                gate, stepSafe,
                function = std::move(function)](const Future<AnyValue>& f) {
    if (f.hasValue() && f.value().noReply) {
      // Another request's reply answered this one (AnyValue::noReply): an
      // extension only asks so of a request with a plain reply.
      if (gate != nullptr) {
        gate->requestDone(autogradContext);
      }
      running_.fetch_sub(1);
      done_(replies);
      return;
    }
    CurrentAgentScope scope(agent_);
    wire::Envelope env;
    env.set_version(kEnvelopeVersion);
    env.set_kind(wire::Envelope::RESPONSE);
    env.set_request_id(id);
    env.set_from_worker(static_cast<uint32_t>(self_.rank));
    if (profileStartUs != 0) {
      auto* ev = env.add_events();
      ev->set_name(function);
      ev->set_worker(self_.name);
      ev->set_start_us(profileStartUs);
      ev->set_duration_us(profilerNowUs() - profileStartUs);
      // The thread that started running it; the nested calls' events
      // (recorded before their futures completed) follow.
      ev->set_thread(nested != nullptr ? nested->thread : 0);
      if (nested != nullptr) {
        for (auto& e : nested->take()) {
          auto* n = env.add_events();
          n->set_name(std::move(e.name));
          n->set_worker(std::move(e.worker));
          n->set_start_us(e.startUs);
          n->set_duration_us(e.durationUs);
          n->set_thread(e.thread);
        }
      }
    }
    auto context = extensions_.codecContext(peer);
    Encoder body(context.get());
    Error error = f.error();
    if (error.ok()) {
      // Even when this reply fails below: the other request succeeded.
      env.set_also_answers(f.value().alsoAnswers);
      try {
        const AnyValue& v = f.value();
        if (v.value == nullptr) {
          encodeValue<std::monostate>(body, std::monostate{});
        } else if (v.encode == nullptr) {
          error = Error::invalidArgument(
              "the result of '" + function +
              "' has no wire encoding (declare it serializable, or return it "
              "through remote() and call methods on the RRef)");
        } else {
          v.encode(body, v.value.get());
        }
        if (replies && replyCheck_ != nullptr) {
          if (Error fit = replyCheck_(peer, body); !fit.ok()) {
            throwError(Error(fit.code(), "the result of '" + function +
                                             "' does not fit one message: " +
                                             fit.message()));
          }
        }
        if (autogradContext != 0 && !body.gradTensors().empty()) {
          // The result's gradient comes back to this worker's graph.
          OutgoingMessage out;
          out.peer = peer;
          out.autogradContextId = autogradContext;
          out.gradTensors = &body.gradTensors();
          out.stepSafe = stepSafe;
          if (!extensions_.recordSend(out)) {
            throwError(Error(Code::kFailedPrecondition,
                             "no dist_autograd support linked in"));
          }
          env.set_autograd_context_id(autogradContext);
          env.set_autograd_message_id(out.autogradMessageId);
        }
      } catch (...) {
        error = errorFromCurrentException();
      }
    }
    if (!error.ok()) {
      env.clear_autograd_context_id();
      env.clear_autograd_message_id();
      body = Encoder(context.get());
      encodeValue<std::monostate>(body, std::monostate{});
      auto* info = env.mutable_error();
      info->set_code(static_cast<uint32_t>(error.code()));
      info->set_message(error.message());
      if (const RemoteOrigin* o = error.remoteOrigin();
          o != nullptr && !o->worker.empty()) {
        info->set_worker(o->worker);  // raised further down a nested call
        info->set_function(o->function);
        info->set_exception_type(o->exceptionType);
      } else {
        info->set_worker(self_.name);
        info->set_function(function);
        if (o != nullptr) {
          info->set_exception_type(o->exceptionType);
        }
      }
    }
    if (gate != nullptr) {
      // The reply's send function (if any) is recorded: the request stops
      // counting as running in its context here.
      gate->requestDone(autogradContext);
    }
    // A long exception message fails this call, not the pipe.
    fitReplyToLimits(&env);
    respond(env, std::move(body), std::move(context));
    running_.fetch_sub(1);
    done_(replies);
  };
  result.addDoneCallback(Lifeline::guard(lifeline_, std::move(reply)));
}

}  // namespace trellis::rpc::detail
