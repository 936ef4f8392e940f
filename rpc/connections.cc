#include "connections.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <algorithm>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "rendezvous.h"
#include <trellis/core/logging.h>
#include <trellis/core/net.h>
#include <trellis/core/worker_env.h>
#include <trellis/transport/context.h>
#include <trellis/transport/listener.h>
#include <trellis/transport/pipe.h>

namespace trellis::rpc::detail {

namespace tp = trellis::transport;

namespace {

// A receive buffer for a CPU tensor of `length` bytes: from the pool from
// 1 MiB on (core/buffer_pool.h says why), else from libtorch.
at::Tensor receiveBuffer(BufferPool& pool, size_t length) {
  if (length < BufferPool::kMinPooledBytes) {
    return emptyBytes(length);
  }
  const auto options = at::TensorOptions().dtype(at::kByte);
  auto buffer = pool.take(length);
  void* data = buffer.get();
  // The tensor's deleter holds the buffer: it goes back to the pool when
  // the last tensor viewing it dies.
  return at::from_blob(
      data, {static_cast<int64_t>(length)},
      [buffer = std::move(buffer)](void*) mutable { buffer.reset(); }, options);
}

// The cuda_ipc channel orders its copy after the writer's legacy default
// stream only (docs/transport.md, "cuda_ipc channel"). A tensor the sending
// thread made on another current stream (a side stream of torch's pool)
// may still be being written there: make the default stream wait for the
// current one, once per device of the message. An event and a wait on the
// GPU; the host does not block.
void joinCurrentStreams(const std::vector<at::Tensor>& tensors) {
  std::vector<c10::Device> joined;  // stays empty without CUDA tensors
  for (const auto& t : tensors) {
    if (!t.is_cuda()) {
      continue;
    }
    const c10::Device device = t.device();
    if (std::find(joined.begin(), joined.end(), device) != joined.end()) {
      continue;
    }
    joined.push_back(device);
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    const c10::Stream current = impl->getStream(device);
    const c10::Stream legacy = impl->getDefaultStream(device);
    if (current == legacy) {
      continue;
    }
    void* event = nullptr;
    impl->record(&event, current, device.index(),
                 c10::EventFlag::PYTORCH_DEFAULT);
    impl->block(event, legacy);
    impl->destroyEvent(event, device.index());  // freed once it fired
  }
}

tp::Limits transportLimits(const RpcOptions& options) {
  tp::Limits limits;
  // maxMessageBytes is below 2^63 (rendezvous.cc): the sum cannot wrap.
  limits.maxPayloadBytes =
      std::max(limits.maxPayloadBytes,
               options.maxMessageBytes + Encoder::kInlineBytesPerMessage);
  return limits;
}

}  // namespace

Connections::Connections(const WorkerInfo& self, int32_t worldSize,
                         const RpcOptions& options,
                         const std::vector<WorkerInfo>& workers,
                         OnMessage onMessage, OnFailed onFailed)
    : self_(self),
      worldSize_(worldSize),
      options_(options),
      limits_(transportLimits(options)),
      workers_(workers),
      onMessage_(std::move(onMessage)),
      onFailed_(std::move(onFailed)) {}

Connections::~Connections() {
  closeTransport();
  forget();
}

std::string Connections::listen() {
  const std::string host = net::chooseLocalAddress(
      options_.localAddress, masterFromEnvironment().addr);
  tp::ContextOptions co;
  co.name = "rpc." + self_.name;
  co.token = options_.token;
  co.tokenFromEnvironment = false;
  co.transports = options_.transports;
  co.channels = options_.channels;
  co.limits = limits_;
  ctx_ = tp::Context::create(co);
  listener_ = ctx_->listen({"uv://" + net::bracketIfIpv6(host) + ":0"});
  std::string address = listener_->address("uv");
  accept();
  return address;
}

void Connections::beginExpectedWork() { ctx_->beginExpectedWork(); }
void Connections::endExpectedWork() { ctx_->endExpectedWork(); }
bool Connections::inLoop() const { return ctx_ != nullptr && ctx_->inLoop(); }

void Connections::closeTransport() {
  if (ctx_ != nullptr) {
    ctx_->close();
    if (!ctx_->join(std::chrono::seconds(30))) {
      TRELLIS_LOG_ERROR("rpc agent {}: transport loop did not stop in 30 s",
                        self_.name);
    }
  }
  // Only late callbacks (connections.h) can be running now, and they never
  // block: this waits for microseconds, if at all.
  if (!lifeline_->cut(Deadline::after(std::chrono::seconds(10)))) {
    TRELLIS_LOG_ERROR(
        "rpc agent {}: a transport callback still runs 10 s "
        "after the transport closed",
        self_.name);
  }
}

void Connections::forget() {
  MutexLock lock(mu_);
  forgotten_ = true;
  outPipes_.clear();
  inPipes_.clear();
  notServed_.clear();
}

bool Connections::forgotten() const {
  MutexLock lock(mu_);
  return forgotten_;
}

size_t Connections::openPipes() const {
  MutexLock lock(mu_);
  return outPipes_.size() + inPipes_.size();
}

std::string Connections::describePeer(const PipeState& ps) const {
  const int32_t peer = ps.peer;
  return peer >= 0 ? describeWorker(workers_[peer])
                   : "peer " + ps.pipe->peerAddress();
}

// ---- sending ---------------------------------------------------------------

std::shared_ptr<PipeState> Connections::outPipe(int32_t to) {
  MutexLock lock(mu_);
  auto it = outPipes_.find(to);
  if (it != outPipes_.end()) {
    return it->second;
  }
  auto ps = std::make_shared<PipeState>();
  ps->outgoing = true;
  ps->peer = to;
  ps->pipe = ctx_->connect(workers_[to].address);
  outPipes_.emplace(to, ps);
  armRead(ps);
  return ps;
}

void Connections::send(const std::shared_ptr<PipeState>& ps,
                       const wire::Envelope& env, Encoder&& body,
                       std::shared_ptr<CodecContext> context,
                       std::function<void(const Error&)> done) {
  if (lifeline_->isCut()) {
    return;  // its callback would run on the transport's late thread
  }
  body.sent();
  struct Held {
    std::vector<uint8_t> bytes;
    std::vector<at::Tensor> tensors;
    std::shared_ptr<CodecContext> context;
  };
  Held held;
  held.bytes = body.wire().release();
  held.tensors = body.outgoing();
  held.context = std::move(context);
  joinCurrentStreams(held.tensors);
  tp::Message m;
  m.descriptor = env.SerializeAsString();
  m.payloads.push_back({held.bytes.data(), held.bytes.size()});
  for (const auto& t : held.tensors) {
    tp::Message::Tensor mt;
    mt.data = t.data_ptr();
    mt.length = t.nbytes();
    if (t.is_cuda()) {
      mt.device = tp::Device::cuda(t.get_device());
    }
    m.tensors.push_back(mt);
  }
  sent_.fetch_add(1, std::memory_order_relaxed);
  // Over shm, off the loop: straight into the ring from this thread, which
  // saves waking the loop to write it (docs/rpc.md, "Threads").
  if (ps->pipe->tryWriteNow(m)) {
    held = Held();  // buffers may go now
    lifeline_->run([&] { done(Error()); });
    return;
  }
  // The buffers stay where they are: moving a vector or a tensor keeps its
  // storage.
  auto kept = std::make_shared<Held>(std::move(held));
  ps->pipe->write(
      std::move(m),
      [line = lifeline_, kept, done = std::move(done)](const Error& e) mutable {
        kept.reset();  // buffers may go now
        line->run([&] { done(e); });
      });
}

Error Connections::checkFits(int32_t to, const Encoder& body) const {
  const tp::Limits& limits = limits_;
  const WorkerInfo& peer = workers_[to];
  auto tooMuch = [](const std::string& what) {
    return Error(Code::kResourceExhausted, what);
  };
  if (body.wireBytes() > peer.maxMessageBytes) {
    return tooMuch("the encoding is " + std::to_string(body.wireBytes()) +
                   " bytes, more than the " +
                   std::to_string(peer.maxMessageBytes) + " that " +
                   describeWorker(peer) +
                   " accepts (its RpcOptions::maxMessageBytes)");
  }
  const size_t payload = body.payloadBytes();
  if (payload > limits.maxPayloadBytes) {
    return tooMuch("the encoding is " + std::to_string(payload) +
                   " bytes, more than one message carries (" +
                   std::to_string(limits.maxPayloadBytes) + ")");
  }
  if (body.outgoing().size() > limits.maxTensorsPerMessage) {
    return tooMuch(std::to_string(body.outgoing().size()) +
                   " tensors, more than one message carries (" +
                   std::to_string(limits.maxTensorsPerMessage) + ")");
  }
  for (size_t i = 0; i < body.outgoing().size(); ++i) {
    const size_t bytes = body.outgoing()[i].nbytes();
    if (bytes > limits.maxTensorBytes) {
      return tooMuch("tensor " + std::to_string(i) + " is " +
                     std::to_string(bytes) +
                     " bytes, more than one message carries (" +
                     std::to_string(limits.maxTensorBytes) + ")");
    }
  }
  return Error();
}

// ---- receiving -------------------------------------------------------------

void Connections::accept() {
  listener_->accept(Lifeline::guard(
      lifeline_, [this](const Error& e, std::shared_ptr<tp::Pipe> pipe) {
        if (!e.ok()) {
          if (e.code() != Code::kCancelled) {
            TRELLIS_LOG_WARN("rpc agent {}: listener stopped: {}", self_.name,
                             e.what());
          }
          return;
        }
        auto ps = std::make_shared<PipeState>();
        ps->pipe = std::move(pipe);
        bool serving;
        {
          MutexLock lock(mu_);
          if (forgotten_) {
            ps->pipe->close();
            return;
          }
          inPipes_.insert(ps);
          serving = serving_;
          if (!serving) {
            notServed_.push_back(ps);
          }
        }
        if (serving) {
          armRead(ps);
        }
        accept();
      }));
}

void Connections::startServing() {
  std::vector<std::shared_ptr<PipeState>> pipes;
  {
    MutexLock lock(mu_);
    if (serving_ || forgotten_) {
      return;
    }
    serving_ = true;
    pipes.swap(notServed_);
  }
  for (const auto& ps : pipes) {
    armRead(ps);
  }
}

void Connections::armRead(const std::shared_ptr<PipeState>& ps) {
  ps->pipe->readDescriptor(Lifeline::guard(
      lifeline_, [this, ps](const Error& e, tp::Descriptor desc) {
        if (!e.ok()) {
          fail(ps, e);
          return;
        }
        onDescriptor(ps, std::move(desc));
      }));
}

void Connections::onDescriptor(const std::shared_ptr<PipeState>& ps,
                               tp::Descriptor desc) {
  // The envelope and the body in one allocation; the envelope handed on
  // shares it.
  struct Inbound {
    wire::Envelope env;
    Reply body;
  };
  auto in = std::make_shared<Inbound>();
  wire::Envelope* env = &in->env;
  auto bad = [&](const std::string& what) {
    fail(ps, Error::protocol("rpc agent '" + self_.name + "': message from " +
                             ps->pipe->peerAddress() + ": " + what));
  };
  if (Error e = parseEnvelope(desc.descriptor, worldSize_, !ps->outgoing, env);
      !e.ok()) {
    return bad(e.message());
  }
  const auto from = static_cast<int32_t>(env->from_worker());
  int32_t known = -1;
  if (!ps->peer.compare_exchange_strong(known, from) && known != from) {
    return bad("from_worker " + std::to_string(from) + " on a pipe of rank " +
               std::to_string(known));
  }
  if (desc.payloadLengths.size() != 1) {
    return bad("expected 1 payload, got " +
               std::to_string(desc.payloadLengths.size()));
  }
  // The encoding, and the data of the small tensors that travel inside it
  // (Encoder::kInlineBytesPerMessage at most), which maxMessageBytes does
  // not count.
  if (desc.payloadLengths[0] >
      options_.maxMessageBytes + Encoder::kInlineBytesPerMessage) {
    return bad("payload of " + std::to_string(desc.payloadLengths[0]) +
               " bytes exceeds maxMessageBytes (" +
               std::to_string(options_.maxMessageBytes) + ") plus " +
               std::to_string(Encoder::kInlineBytesPerMessage) +
               " of inlined tensor data");
  }
  Reply* body = &in->body;
  body->from = from;
  tp::Allocation alloc;
  try {
    body->bytes.resize(desc.payloadLengths[0]);
    alloc.payloads.push_back({body->bytes.data(), body->bytes.size()});
    for (const auto& t : desc.tensors) {
      at::TensorOptions o = at::TensorOptions().dtype(at::kByte);
      if (t.device.type == tp::DeviceType::kCuda) {
        o = o.device(at::Device(at::kCUDA,
                                static_cast<c10::DeviceIndex>(t.device.index)));
      }
      at::Tensor buf = t.device.type == tp::DeviceType::kCpu
                           ? receiveBuffer(receiveBuffers_, t.length)
                           : at::empty({static_cast<int64_t>(t.length)}, o);
      alloc.tensors.push_back({buf.data_ptr(), t.length});
      body->tensors.push_back(std::move(buf));
    }
  } catch (...) {
    return bad("cannot allocate the receive buffers: " +
               errorFromCurrentException().message());
  }
  const auto arrived = Clock::now();
  ps->pipe->read(
      std::move(alloc),
      Lifeline::guard(lifeline_, [this, ps, in, arrived](const Error& e) {
        if (!e.ok()) {
          fail(ps, e);
          return;
        }
        received_.fetch_add(1, std::memory_order_relaxed);
        Reply body = std::move(in->body);
        onMessage_(ps, std::shared_ptr<wire::Envelope>(in, &in->env),
                   std::move(body), arrived);
      }));
  armRead(ps);
}

void Connections::fail(const std::shared_ptr<PipeState>& ps,
                       const Error& error) {
  if (ps->failed.exchange(true)) {
    return;
  }
  ps->pipe->close();
  {
    MutexLock lock(mu_);
    if (ps->outgoing) {
      auto it = outPipes_.find(ps->peer);
      if (it != outPipes_.end() && it->second == ps) {
        outPipes_.erase(it);
      }
    } else {
      inPipes_.erase(ps);
    }
  }
  onFailed_(ps, error);
}

}  // namespace trellis::rpc::detail
