// An agent calling peers that are not agents: raw transport listeners,
// registered in the rendezvous store like workers, that answer the agent's
// requests with envelopes the test writes itself. This is how the tests
// reach the caller's side of the wire with responses a well-behaved callee
// never sends (docs/rpc_wire.md, field also_answers).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "envelope.h"
#include "envelope.pb.h"
#include <trellis/core/error.h>
#include <trellis/rpc/agent.h>
#include <trellis/rpc/rpc.h>
#include <trellis/store/hash_store.h>
#include <trellis/transport/context.h>
#include <trellis/transport/listener.h>
#include <trellis/transport/pipe.h>

namespace raw_callee_test {
void ping() {}
}  // namespace raw_callee_test
TRELLIS_REMOTE_FUNCTION(raw_callee_test::ping);

namespace {

using namespace std::chrono_literals;
namespace rpc = trellis::rpc;
namespace tp = trellis::transport;
using raw_callee_test::ping;

constexpr auto kWait = 10s;

// A request as the raw callee read it.
struct Received {
  uint64_t requestId = 0;
  std::string function;
  std::shared_ptr<tp::Pipe> pipe;  // the pipe it came on
};

// Rank `rank` of the group, played by a transport listener: it publishes a
// worker entry, accepts the agent's pipe, and queues each request it reads
// until the test answers it with answer().
class RawCallee {
 public:
  RawCallee(trellis::store::Store& store, int32_t rank) : rank_(rank) {
    tp::ContextOptions o;
    o.name = "raw" + std::to_string(rank);
    o.tokenFromEnvironment = false;
    o.transports = {"uv"};
    ctx_ = tp::Context::create(o);
    listener_ = ctx_->listen({"uv://127.0.0.1:0"});
    const std::string entry = rpc::encodeWorkerEntry(
        {"w" + std::to_string(rank), listener_->address("uv"), 1 << 20});
    store.set("trellis/rpc/worker/" + std::to_string(rank),
              std::string_view(entry));
    accept();
  }
  ~RawCallee() {
    ctx_->close();
    ctx_->join(kWait);
  }

  // The next request read, or nullopt after kWait.
  std::optional<Received> next() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, kWait, [&] { return !queue_.empty(); })) {
      return std::nullopt;
    }
    Received r = std::move(queue_.front());
    queue_.pop_front();
    return r;
  }

  // A void function's reply to `r` (an empty payload), with `alsoAnswers`
  // in its envelope. True once written.
  bool answer(const Received& r, uint64_t alsoAnswers) {
    rpc::wire::Envelope env;
    env.set_version(rpc::kEnvelopeVersion);
    env.set_kind(rpc::wire::Envelope::RESPONSE);
    env.set_request_id(r.requestId);
    env.set_from_worker(static_cast<uint32_t>(rank_));
    env.set_also_answers(alsoAnswers);
    tp::Message m;
    env.SerializeToString(&m.descriptor);
    m.payloads.push_back({nullptr, 0});
    auto written = std::make_shared<std::promise<trellis::Error>>();
    auto f = written->get_future();
    r.pipe->write(std::move(m), [written](const trellis::Error& e) {
      written->set_value(e);
    });
    return f.wait_for(kWait) == std::future_status::ready && f.get().ok();
  }

 private:
  void accept() {
    listener_->accept(
        [this](const trellis::Error& e, std::shared_ptr<tp::Pipe> pipe) {
          if (!e.ok()) {
            return;
          }
          read(std::move(pipe));
          accept();
        });
  }

  void read(std::shared_ptr<tp::Pipe> pipe) {
    pipe->readDescriptor(
        [this, pipe](const trellis::Error& e, tp::Descriptor d) {
          if (!e.ok()) {
            return;
          }
          auto env = std::make_shared<rpc::wire::Envelope>();
          if (!env->ParseFromString(d.descriptor) ||
              d.payloadLengths.size() != 1 || !d.tensors.empty()) {
            ADD_FAILURE() << "raw callee " << rank_ << ": unexpected message";
            pipe->close();
            return;
          }
          auto bytes = std::make_shared<std::string>(d.payloadLengths[0], '\0');
          tp::Allocation a;
          a.payloads.push_back({bytes->data(), bytes->size()});
          pipe->read(
              std::move(a), [this, pipe, env, bytes](const trellis::Error& e) {
                if (!e.ok()) {
                  return;
                }
                {
                  std::lock_guard<std::mutex> lock(mu_);
                  queue_.push_back({env->request_id(), env->function(), pipe});
                }
                cv_.notify_all();
                read(pipe);
              });
        });
  }

  const int32_t rank_;
  std::shared_ptr<tp::Context> ctx_;
  std::shared_ptr<tp::Listener> listener_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Received> queue_;
};

// Rank 0 is a real agent; ranks 1.. are raw callees.
struct RawGroup {
  explicit RawGroup(int raws) {
    auto store = std::make_shared<trellis::store::HashStore>();
    for (int r = 1; r <= raws; ++r) {
      callees.push_back(std::make_unique<RawCallee>(*store, r));
    }
    rpc::RpcOptions o;
    o.store = store;
    o.localAddress = "127.0.0.1";
    o.transports = {"uv"};
    o.initTimeout = 30s;
    o.defaultTimeout = 30s;
    agent = rpc::Agent::start("w0", 0, raws + 1, o);
  }
  ~RawGroup() {
    agent->shutdown({.graceful = false});
    callees.clear();
  }
  std::shared_ptr<rpc::Agent> agent;
  std::vector<std::unique_ptr<RawCallee>> callees;
};

// A ping from the agent to `name`, and the request `callee` read for it.
struct Sent {
  trellis::Future<void> call;
  Received request;
};
std::optional<Sent> sendPing(RawCallee& callee, const std::string& name) {
  auto call = rpc::rpcAsync<ping>(name);
  auto request = callee.next();
  if (!request.has_value()) {
    return std::nullopt;
  }
  return Sent{std::move(call), std::move(*request)};
}

// Waits (bounded) for `call` and says whether it succeeded.
bool succeeds(const trellis::Future<void>& call) {
  try {
    call.wait(kWait);
  } catch (const trellis::Exception& e) {
    ADD_FAILURE() << e.what();
    return false;
  }
  return true;
}

// A response whose also_answers names no call of the agent's completes its
// own call, counts one late reply, and leaves the pipe working.
TEST(RawCallee, AlsoAnswersNamingNoCallIsALateReplyAndNothingMore) {
  RawGroup g(1);
  rpc::CurrentAgentScope scope(g.agent.get());
  RawCallee& w1 = *g.callees[0];

  auto a = sendPing(w1, "w1");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->request.function, "raw_callee_test::ping");
  ASSERT_TRUE(w1.answer(a->request, a->request.requestId + 1000));
  EXPECT_TRUE(succeeds(a->call));
  EXPECT_EQ(g.agent->stats().lateReplies, 1u);

  // The pipe still carries calls.
  auto b = sendPing(w1, "w1");
  ASSERT_TRUE(b.has_value());
  ASSERT_TRUE(w1.answer(b->request, 0));
  EXPECT_TRUE(succeeds(b->call));
  EXPECT_EQ(g.agent->stats().lateReplies, 1u);
  EXPECT_EQ(g.agent->stats().pendingCalls, 0u);
}

// A response on w2's pipe whose also_answers names a call that went to w1
// completes nothing of w1's: that call waits for w1's own reply.
TEST(RawCallee, AlsoAnswersNamingAnotherPipesCallLeavesThatCallPending) {
  RawGroup g(2);
  rpc::CurrentAgentScope scope(g.agent.get());
  RawCallee& w1 = *g.callees[0];
  RawCallee& w2 = *g.callees[1];

  auto toW1 = sendPing(w1, "w1");
  ASSERT_TRUE(toW1.has_value());
  auto toW2 = sendPing(w2, "w2");
  ASSERT_TRUE(toW2.has_value());
  ASSERT_NE(toW1->request.requestId, toW2->request.requestId);

  ASSERT_TRUE(w2.answer(toW2->request, toW1->request.requestId));
  EXPECT_TRUE(succeeds(toW2->call));
  EXPECT_EQ(g.agent->stats().lateReplies, 1u);
  // w1's call is still pending: give a wrongly taken completion time to
  // show, then check.
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(toW1->call.completed());
  EXPECT_EQ(g.agent->stats().pendingCalls, 1u);

  ASSERT_TRUE(w1.answer(toW1->request, 0));
  EXPECT_TRUE(succeeds(toW1->call));
  EXPECT_EQ(g.agent->stats().lateReplies, 1u);
  EXPECT_EQ(g.agent->stats().pendingCalls, 0u);
}

// A response that also answers its own pipe's other pending call completes
// both (a callee may lie about any reply on its own pipe; it cannot reach
// another's).
TEST(RawCallee, AlsoAnswersNamingThisPipesPendingCallCompletesIt) {
  RawGroup g(1);
  rpc::CurrentAgentScope scope(g.agent.get());
  RawCallee& w1 = *g.callees[0];

  auto first = sendPing(w1, "w1");
  ASSERT_TRUE(first.has_value());
  auto second = sendPing(w1, "w1");
  ASSERT_TRUE(second.has_value());

  ASSERT_TRUE(w1.answer(second->request, first->request.requestId));
  EXPECT_TRUE(succeeds(first->call));
  EXPECT_TRUE(succeeds(second->call));
  EXPECT_EQ(g.agent->stats().lateReplies, 0u);

  // The reply that would have answered the first comes after all: late.
  ASSERT_TRUE(w1.answer(first->request, 0));
  const auto until = std::chrono::steady_clock::now() + kWait;
  while (g.agent->stats().lateReplies == 0 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(g.agent->stats().lateReplies, 1u);
  EXPECT_EQ(g.agent->stats().pendingCalls, 0u);
}

}  // namespace
