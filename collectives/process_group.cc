#include <ATen/ATen.h>

// The caller's current stream is read through c10's device-generic
// interface, so no CUDA header of libtorch is needed (Debian's is CPU-only).
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <trellis/collectives/backend.h>
#include <trellis/collectives/cpu/cpu_backend.h>
#include <trellis/collectives/cpu/mesh.h>
#include <trellis/collectives/flight_recorder.h>
#include <trellis/collectives/process_group.h>
#include <trellis/collectives/reduce_kernels.h>
#include <trellis/collectives/watchdog.h>
#ifdef TRELLIS_HAVE_NCCL
#include <trellis/collectives/nccl/nccl_backend.h>
#endif
#include <trellis/core/worker_env.h>
#include <trellis/store/prefix_store.h>
#include <trellis/store/tcp_store.h>
#include <trellis/store/worker_store.h>

namespace trellis::collectives {

using detail::DType;
using detail::Fingerprint;
using detail::OpSpec;
using detail::OpType;

// What the front end made of one call: the backend's view plus the tensors
// that must live until it is done.
struct ProcessGroup::Op {
  OpSpec spec;
  std::vector<at::Tensor> keep;     // borrowed until done
  std::vector<at::Tensor> outputs;  // the Work's value
};

struct ProcessGroup::Monitoring {
  std::shared_ptr<detail::FlightRecorder> recorder;
  std::unique_ptr<detail::Watchdog::Handle> watch;
};

namespace {

[[noreturn]] void bad(const std::string& message) {
  throwError(Error::invalidArgument(message));
}

DType dtypeOf(const at::Tensor& t, const std::string& what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kDouble:
      return DType::kFloat64;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kChar:
      return DType::kInt8;
    case at::kByte:
      return DType::kUInt8;
    case at::kInt:
      return DType::kInt32;
    case at::kLong:
      return DType::kInt64;
    case at::kBool:
      return DType::kBool;
    default:
      break;
  }
  bad(what + ": dtype " + std::string(c10::toString(t.scalar_type())) +
      " is not supported (float32, float64, float16, bfloat16, int8, uint8, "
      "int32, int64, bool)");
}

void checkRoot(int root, int size, const std::string& what) {
  if (root < 0 || root >= size) {
    bad(what + ": root " + std::to_string(root) + " is outside [0, " +
        std::to_string(size) + ")");
  }
}

void checkReduceOp(DType dtype, ReduceOp op, const std::string& what,
                   const std::string& backend) {
  if (static_cast<uint8_t>(op) > static_cast<uint8_t>(ReduceOp::kBxor)) {
    bad(what + ": unknown ReduceOp " + std::to_string(static_cast<int>(op)));
  }
  // NCCL has sum, prod, min, max and avg; no bitwise reductions.
  if (backend == "nccl" && (op == ReduceOp::kBand || op == ReduceOp::kBor ||
                            op == ReduceOp::kBxor)) {
    bad(what + ": ReduceOp " + std::string(toString(op)) +
        " is not supported by the nccl backend (sum, avg, product, min, "
        "max)");
  }
  if (!detail::supports(dtype, op)) {
    bad(what + ": ReduceOp " + std::string(toString(op)) +
        " is for integer and bool tensors, not " +
        std::string(detail::toString(dtype)));
  }
}

std::string shapeOf(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    s += (i ? ", " : "") + std::to_string(t.size(i));
  }
  return s + "]";
}

// Where one op's tensors must be, and where the first one was.
struct Devices {
  bool cuda = false;
  int device = -1;
  bool seen = false;
};

// The checks every tensor argument gets; returns its dtype.
DType checkTensor(const at::Tensor& t, const std::string& what, Devices& d) {
  if (!t.defined()) {
    bad(what + ": the tensor is undefined");
  }
  if (t.layout() != at::kStrided) {
    bad(what + ": only dense (strided) tensors are supported");
  }
  if (d.cuda && !t.device().is_cuda()) {
    bad(what + ": the tensor is on " + t.device().str() +
        "; the nccl backend takes CUDA tensors");
  }
  if (!d.cuda && !t.device().is_cpu()) {
    bad(what + ": the tensor is on " + t.device().str() +
        "; the cpu backend takes CPU tensors");
  }
  const int device = d.cuda ? t.device().index() : -1;
  if (d.seen && device != d.device) {
    bad(what + ": the tensor is on " + t.device().str() +
        ", the op's other tensors on cuda:" + std::to_string(d.device));
  }
  d.seen = true;
  d.device = device;
  if (!t.is_contiguous()) {
    bad(what + ": the tensor of shape " + shapeOf(t) +
        " is not contiguous (pass t.contiguous())");
  }
  return dtypeOf(t, what);
}

void checkSameKind(const at::Tensor& t, DType dtype, uint64_t count,
                   const std::string& what, const std::string& reference,
                   Devices& devices) {
  const DType d = checkTensor(t, what, devices);
  if (d != dtype) {
    bad(what + ": dtype " + std::string(detail::toString(d)) +
        " differs from " + reference + "'s " +
        std::string(detail::toString(dtype)));
  }
  if (static_cast<uint64_t>(t.numel()) != count) {
    bad(what + ": " + std::to_string(t.numel()) + " elements, but " +
        reference + " has " + std::to_string(count));
  }
}

// The raw handle (a cudaStream_t) of a c10::Stream. Its name changed
// between libtorch releases (native_handle(), later stream_handle()) and
// older ones have neither: then null, the legacy default stream. Only a
// libtorch with CUDA ever reaches this with a CUDA device.
template <typename S>
void* rawStream(const S& s) {
  if constexpr (requires { s.stream_handle(); }) {
    return s.stream_handle();
  } else if constexpr (requires { s.native_handle(); }) {
    return s.native_handle();
  } else {
    return nullptr;
  }
}

// The caller's current stream on CUDA device `device`, or null for the
// CPU.
void* currentStream(int device) {
  if (device < 0) {
    return nullptr;
  }
  const c10::Device d(c10::DeviceType::CUDA,
                      static_cast<c10::DeviceIndex>(device));
  return rawStream(
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(d));
}

// What a Work's wait() does instead of blocking the host (work.h): joins
// the caller's current stream on `device` to the op. Null where the
// backend gave no join (cpu; failed at issue) or blocking waits were asked
// for.
std::function<Error()> streamWaitFor(detail::Backend::StreamJoin join,
                                     int device, bool blocking) {
  if (!join || blocking) {
    return nullptr;
  }
  return
      [join = std::move(join), device] { return join(currentStream(device)); };
}

// One tensor per rank (allgather's and gather's outputs, scatter's and
// reduceScatter's inputs), each of `dtype` with `count` elements like
// `reference`; returns their memory in rank order. `who` prefixes the
// count error ("the root passed ") where only the root passes the list.
std::vector<void*> perRankTensors(const std::vector<at::Tensor>& ts, int size,
                                  DType dtype, uint64_t count,
                                  const std::string& what,
                                  const std::string& kind,
                                  const std::string& reference,
                                  const std::string& who, Devices& dv) {
  if (ts.size() != static_cast<size_t>(size)) {
    bad(what + ": " + who + std::to_string(ts.size()) + " " + kind +
        " tensors for a group of " + std::to_string(size));
  }
  std::vector<void*> data;
  for (size_t i = 0; i < ts.size(); ++i) {
    checkSameKind(ts[i], dtype, count,
                  what + ": " + kind + "s[" + std::to_string(i) + "]",
                  reference, dv);
    data.push_back(ts[i].data_ptr());
  }
  return data;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h = (h ^ c) * 1099511628211ull;
  }
  return h;
}

}  // namespace

ProcessGroup::ProcessGroup(std::string backend, std::string name, int rank,
                           int size, Duration timeout,
                           std::shared_ptr<store::Store> store,
                           std::shared_ptr<detail::Backend> impl,
                           ProcessGroupOptions options)
    : backend_(std::move(backend)),
      name_(std::move(name)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      store_(std::move(store)),
      impl_(std::move(impl)),
      options_(std::move(options)) {}

bool ProcessGroup::awaitDeferredTeardowns(Duration timeout) {
  return detail::awaitDetachedMeshTeardowns(timeout);
}

ProcessGroup::~ProcessGroup() {
  // The watchdog lets go of the group before its backend goes.
  monitoring_.reset();
  impl_.reset();
}

std::shared_ptr<ProcessGroup> ProcessGroup::create(
    const std::string& backend, std::shared_ptr<store::Store> store, int rank,
    int worldSize, ProcessGroupOptions options) {
  if (!store) {
    bad("ProcessGroup::create: the store is null");
  }
  if (worldSize < 1) {
    bad("ProcessGroup::create: world size " + std::to_string(worldSize) +
        " must be at least 1");
  }
  if (rank < 0 || rank >= worldSize) {
    bad("ProcessGroup::create: rank " + std::to_string(rank) +
        " is outside [0, " + std::to_string(worldSize) + ")");
  }
  const Duration timeout = options.timeout.value_or(kDefaultTimeout);
  if (timeout <= Duration::zero()) {
    bad("ProcessGroup::create: the timeout must be positive");
  }
  const Duration initTimeout = options.initTimeout.value_or(timeout);
  if (initTimeout <= Duration::zero()) {
    bad("ProcessGroup::create: the initTimeout must be positive");
  }
  const std::string name = options.name.empty() ? "default" : options.name;
  if (name.size() > kMaxGroupNameBytes) {
    // Checked here, on every rank: the peers would refuse its hello, and
    // the group would wait out its initTimeout.
    bad("ProcessGroup::create: a group name of " + std::to_string(name.size()) +
        " bytes (at most " + std::to_string(kMaxGroupNameBytes) + "): '" +
        name.substr(0, 40) + "...'");
  }
  bool known = backend == "cpu";
#ifdef TRELLIS_HAVE_NCCL
  known = known || backend == "nccl";
  const char* kBuilt = "cpu, nccl";
#else
  const char* kBuilt = "cpu; nccl was not compiled in";
#endif
  if (!known) {
    bad("ProcessGroup::create: unknown backend '" + backend +
        "' (this build has: " + kBuilt + ")");
  }
  // Each rank counts the groups of this name it created; they agree as long
  // as every rank creates the same groups, so a group re-created after a
  // failure meets in fresh keys.
  const int64_t generation =
      store->add("pg/" + name + "/generation/" + std::to_string(rank), 1);
  const std::string groupId = name + "#" + std::to_string(generation);
  auto groupStore =
      std::make_shared<store::PrefixStore>("pg/" + groupId, store);
  detail::MeshOptions mo;
  mo.groupId = groupId;
  mo.description = "group '" + name + "'";
  mo.token = options.token;
  mo.localAddress = options.localAddress;
  mo.timeout = timeout;
  mo.initTimeout = initTimeout;
  // Environment knobs are checked before any connection is made.
  const WatchdogMode mode =
      options.watchdogMode.value_or(detail::watchdogModeFromEnvironment());
  const std::string dumpDir = options.flightRecorderDir.value_or(
      detail::flightRecorderDirFromEnvironment());
  options.blockingWait =
      options.blockingWait.value_or(detail::blockingWaitFromEnvironment());
  auto recorder = std::make_shared<detail::FlightRecorder>(
      detail::flightRecorderEntriesFromEnvironment());
  detail::Watchdog& watchdog = detail::Watchdog::process();
  std::shared_ptr<detail::Backend> impl;
#ifdef TRELLIS_HAVE_NCCL
  if (backend == "nccl") {
    impl = detail::createNcclBackend(groupStore, rank, worldSize, mo);
  }
#endif
  if (!impl) {
    impl = detail::createCpuBackend(*groupStore, rank, worldSize, mo);
  }
  detail::WatchedGroup watched;
  watched.info = {
      name,
      groupId,
      backend,
      rank,
      worldSize,
      std::chrono::duration_cast<std::chrono::milliseconds>(timeout)};
  watched.mode = mode;
  watched.dumpDir = dumpDir;
  watched.store = groupStore;
  watched.backend = impl;
  watched.recorder = recorder;
  auto monitoring = std::make_unique<Monitoring>();
  monitoring->recorder = recorder;
  monitoring->watch = watchdog.watch(std::move(watched));
  auto pg = std::shared_ptr<ProcessGroup>(
      new ProcessGroup(backend, name, rank, worldSize, timeout,
                       std::move(store), std::move(impl), std::move(options)));
  pg->monitoring_ = std::move(monitoring);
  return pg;
}

std::shared_ptr<ProcessGroup> ProcessGroup::fromEnvironment(
    const std::string& backend, ProcessGroupOptions options) {
  const WorkerEnv env = WorkerEnv::fromEnvironment();
  if (!env.master.complete()) {
    bad("ProcessGroup::fromEnvironment needs MASTER_ADDR and MASTER_PORT");
  }
  if (!options.token) {
    options.token = env.jobToken;
  }
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
      options.timeout.value_or(kDefaultTimeout));
  const auto initTimeout =
      std::chrono::duration_cast<std::chrono::milliseconds>(
          options.initTimeout.value_or(timeout));
  // Rank 0 serves the store, or the launcher does
  // (TORCHELASTIC_USE_AGENT_STORE=True: store/worker_store.h).
  store::WorkerStoreOptions so;
  so.jobToken = options.token;
  so.timeout = timeout;
  so.connectTimeout = initTimeout;
  store::WorkerStore ws = store::connectWorkerStore(env.master, env.rank, so);
  // The group's store keeps the server (rank 0) alive as long as it lives.
  std::shared_ptr<store::Store> s(
      ws.store.get(), [client = ws.store, server = ws.server](auto*) {});
  return create(backend, std::move(s), env.rank, env.worldSize,
                std::move(options));
}

std::shared_ptr<ProcessGroup> ProcessGroup::newGroup(
    std::vector<int> ranks, ProcessGroupOptions options) {
  if (ranks.empty()) {
    bad("newGroup: the ranks list is empty");
  }
  std::vector<bool> seen(static_cast<size_t>(size_), false);
  std::string list;
  int subRank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int r = ranks[i];
    if (r < 0 || r >= size_) {
      bad("newGroup: rank " + std::to_string(r) + " is outside group '" +
          name_ + "' of size " + std::to_string(size_));
    }
    if (seen[static_cast<size_t>(r)]) {
      bad("newGroup: rank " + std::to_string(r) + " is listed twice");
    }
    seen[static_cast<size_t>(r)] = true;
    list += (i ? "," : "") + std::to_string(r);
    if (r == rank_) {
      subRank = static_cast<int>(i);
    }
  }
  int n = 0;
  {
    MutexLock lock(issueMu_);
    n = ++subgroups_;
  }
  if (subRank < 0) {
    return nullptr;
  }
  if (options.name.empty()) {
    options.name = name_ + "." + std::to_string(n);
  }
  // Ranks that pass different lists meet under different names and fail
  // at connect, naming both groups.
  char digest[17];
  std::snprintf(digest, sizeof digest, "%016llx",
                static_cast<unsigned long long>(fnv1a(list)));
  options.name += "-" + std::string(digest, 8);
  if (!options.timeout) {
    options.timeout = timeout_;
  }
  if (!options.initTimeout) {
    options.initTimeout = options_.initTimeout;
  }
  if (!options.token) {
    options.token = options_.token;
  }
  if (options.localAddress.empty()) {
    options.localAddress = options_.localAddress;
  }
  if (!options.blockingWait) {
    options.blockingWait = options_.blockingWait;
  }
  return create(backend_, store_, subRank, static_cast<int>(ranks.size()),
                std::move(options));
}

Work ProcessGroup::enqueue(Op op) {
  Promise<std::vector<at::Tensor>> promise;
  auto future = promise.getFuture();
  std::string description;
  detail::Backend::StreamJoin join;
  const int device = op.spec.device;
  const auto& first = op.outputs.empty() ? op.keep : op.outputs;
  const std::vector<int64_t> shape =
      first.empty() ? std::vector<int64_t>{} : first[0].sizes().vec();
  auto recorder = monitoring_->recorder;
  op.spec.stream = currentStream(op.spec.device);
  auto finish = [promise, keep = std::move(op.keep),
                 outputs = std::move(op.outputs)](const Error& e) mutable {
    if (e.ok()) {
      promise.setValue(std::move(outputs));
    } else {
      promise.setError(e);
    }
    keep.clear();
  };
  {
    MutexLock lock(issueMu_);
    op.spec.fp.seq = nextSeq_++;
    description = op.spec.fp.toString() + " on group '" + name_ + "'";
    const uint64_t id = recorder->scheduled(op.spec.fp, -1, 0, shape);
    join = impl_->enqueue(
        std::move(op.spec), [recorder, id] { recorder->started(id); },
        [recorder, id, finish = std::move(finish)](const Error& e) mutable {
          // Recorded first: whoever sees the Work complete also sees it in
          // the progress the watchdog publishes.
          recorder->finished(id, e);
          finish(e);
        });
  }
  return Work(std::move(future), std::move(description), nullptr,
              streamWaitFor(std::move(join), device,
                            options_.blockingWait.value_or(false)));
}

Work ProcessGroup::allreduce(at::Tensor tensor, ReduceOp op) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "allreduce";
  Op o;
  o.spec.fp = {0,
               OpType::kAllreduce,
               checkTensor(tensor, what, dv),
               op,
               -1,
               static_cast<uint64_t>(tensor.numel())};
  checkReduceOp(o.spec.fp.dtype, op, what, backend_);
  o.spec.data = tensor.data_ptr();
  o.spec.count = static_cast<size_t>(tensor.numel());
  o.outputs = {tensor};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::allreduceCoalesced(std::vector<at::Tensor> tensors,
                                      ReduceOp op) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "allreduceCoalesced";
  if (tensors.empty()) {
    bad(what + ": no tensors");
  }
  Op o;
  const DType dtype = checkTensor(tensors[0], what + ": tensors[0]", dv);
  checkReduceOp(dtype, op, what, backend_);
  uint64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string w = what + ": tensors[" + std::to_string(i) + "]";
    if (checkTensor(tensors[i], w, dv) != dtype) {
      bad(w + ": dtype " +
          std::string(c10::toString(tensors[i].scalar_type())) +
          " differs from tensors[0]'s");
    }
    o.spec.outputs.push_back(tensors[i].data_ptr());
    o.spec.counts.push_back(static_cast<size_t>(tensors[i].numel()));
    total += static_cast<uint64_t>(tensors[i].numel());
  }
  o.spec.fp = {0, OpType::kAllreduceCoalesced, dtype, op, -1, total};
  o.outputs = tensors;
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::broadcast(at::Tensor tensor, int root) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "broadcast";
  checkRoot(root, size_, what);
  Op o;
  o.spec.fp = {0,
               OpType::kBroadcast,
               checkTensor(tensor, what, dv),
               ReduceOp::kSum,
               root,
               static_cast<uint64_t>(tensor.numel())};
  o.spec.data = tensor.data_ptr();
  o.spec.count = static_cast<size_t>(tensor.numel());
  o.outputs = {tensor};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::reduce(at::Tensor tensor, int root, ReduceOp op) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "reduce";
  checkRoot(root, size_, what);
  Op o;
  o.spec.fp = {0,
               OpType::kReduce,
               checkTensor(tensor, what, dv),
               op,
               root,
               static_cast<uint64_t>(tensor.numel())};
  checkReduceOp(o.spec.fp.dtype, op, what, backend_);
  o.spec.data = tensor.data_ptr();
  o.spec.count = static_cast<size_t>(tensor.numel());
  o.outputs = {tensor};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::allgather(std::vector<at::Tensor> outputs,
                             at::Tensor input) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "allgather";
  const DType dtype = checkTensor(input, what + ": input", dv);
  const auto count = static_cast<uint64_t>(input.numel());
  Op o;
  o.spec.outputs = perRankTensors(outputs, size_, dtype, count, what, "output",
                                  "the input", "", dv);
  o.spec.fp = {0, OpType::kAllgather, dtype, ReduceOp::kSum, -1, count};
  o.spec.inputs = {input.data_ptr()};
  o.spec.bytes = count * detail::elementSize(dtype);
  o.keep = {input};
  o.outputs = outputs;
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::allgatherIntoTensor(at::Tensor output, at::Tensor input) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "allgatherIntoTensor";
  const DType dtype = checkTensor(input, what + ": input", dv);
  const auto count = static_cast<uint64_t>(input.numel());
  checkSameKind(output, dtype, count * static_cast<uint64_t>(size_),
                what + ": output", "size() x the input", dv);
  Op o;
  const size_t bytes = count * detail::elementSize(dtype);
  auto* base = static_cast<uint8_t*>(output.data_ptr());
  for (int r = 0; r < size_; ++r) {
    o.spec.outputs.push_back(base + bytes * static_cast<size_t>(r));
  }
  o.spec.fp = {0, OpType::kAllgather, dtype, ReduceOp::kSum, -1, count};
  o.spec.inputs = {input.data_ptr()};
  o.spec.bytes = bytes;
  o.keep = {input};
  o.outputs = {output};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::gather(std::vector<at::Tensor> outputs, at::Tensor input,
                          int root) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "gather";
  checkRoot(root, size_, what);
  const DType dtype = checkTensor(input, what + ": input", dv);
  const auto count = static_cast<uint64_t>(input.numel());
  Op o;
  if (rank_ == root) {
    o.spec.outputs =
        perRankTensors(outputs, size_, dtype, count, what, "output",
                       "the input", "the root passed ", dv);
  } else if (!outputs.empty()) {
    bad(what + ": only the root (rank " + std::to_string(root) +
        ") passes output tensors");
  }
  o.spec.fp = {0, OpType::kGather, dtype, ReduceOp::kSum, root, count};
  o.spec.inputs = {input.data_ptr()};
  o.spec.bytes = count * detail::elementSize(dtype);
  o.keep = {input};
  o.outputs = outputs;
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::scatter(at::Tensor output, std::vector<at::Tensor> inputs,
                           int root) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "scatter";
  checkRoot(root, size_, what);
  const DType dtype = checkTensor(output, what + ": output", dv);
  const auto count = static_cast<uint64_t>(output.numel());
  Op o;
  if (rank_ == root) {
    for (void* p : perRankTensors(inputs, size_, dtype, count, what, "input",
                                  "the output", "the root passed ", dv)) {
      o.spec.inputs.push_back(p);
    }
  } else if (!inputs.empty()) {
    bad(what + ": only the root (rank " + std::to_string(root) +
        ") passes input tensors");
  }
  o.spec.fp = {0, OpType::kScatter, dtype, ReduceOp::kSum, root, count};
  o.spec.outputs = {output.data_ptr()};
  o.spec.bytes = count * detail::elementSize(dtype);
  o.keep = inputs;
  o.outputs = {output};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::reduceScatter(at::Tensor output,
                                 std::vector<at::Tensor> inputs, ReduceOp op) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "reduceScatter";
  const DType dtype = checkTensor(output, what + ": output", dv);
  checkReduceOp(dtype, op, what, backend_);
  const auto count = static_cast<uint64_t>(output.numel());
  Op o;
  for (void* p : perRankTensors(inputs, size_, dtype, count, what, "input",
                                "the output", "", dv)) {
    o.spec.inputs.push_back(p);
  }
  o.spec.fp = {0, OpType::kReduceScatter, dtype, op, -1, count};
  o.spec.outputs = {output.data_ptr()};
  o.spec.count = count;
  o.keep = inputs;
  o.outputs = {output};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::reduceScatterTensor(at::Tensor output, at::Tensor input,
                                       ReduceOp op) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "reduceScatterTensor";
  const DType dtype = checkTensor(output, what + ": output", dv);
  checkReduceOp(dtype, op, what, backend_);
  const auto count = static_cast<uint64_t>(output.numel());
  checkSameKind(input, dtype, count * static_cast<uint64_t>(size_),
                what + ": input", "size() x the output", dv);
  Op o;
  const size_t bytes = count * detail::elementSize(dtype);
  const auto* base = static_cast<const uint8_t*>(input.data_ptr());
  for (int r = 0; r < size_; ++r) {
    o.spec.inputs.push_back(base + bytes * static_cast<size_t>(r));
  }
  o.spec.fp = {0, OpType::kReduceScatter, dtype, op, -1, count};
  o.spec.outputs = {output.data_ptr()};
  o.spec.count = count;
  o.keep = {input};
  o.outputs = {output};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

namespace {

// Byte offsets and lengths of the dim-0 blocks of `t`: equal blocks when
// `splits` is empty, else the given row counts.
void blocks(const at::Tensor& t, const std::vector<int64_t>& splits, int size,
            const std::string& what, std::vector<size_t>& offsets,
            std::vector<size_t>& lengths) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t rowBytes =
      rows == 0 ? 0
                : static_cast<size_t>(t.nbytes()) / static_cast<size_t>(rows);
  std::vector<int64_t> s = splits;
  if (s.empty()) {
    if (rows % size != 0) {
      bad(what + ": dim 0 of size " + std::to_string(rows) +
          " does not split evenly over " + std::to_string(size) +
          " ranks (pass split sizes)");
    }
    s.assign(static_cast<size_t>(size), rows / size);
  } else if (s.size() != static_cast<size_t>(size)) {
    bad(what + ": " + std::to_string(s.size()) +
        " split sizes for a group of " + std::to_string(size));
  }
  int64_t sum = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] < 0 || s[i] > rows - sum) {
      bad(what + ": split sizes do not fit dim 0 of size " +
          std::to_string(rows) + " (entry " + std::to_string(i) + " is " +
          std::to_string(s[i]) + ")");
    }
    offsets.push_back(static_cast<size_t>(sum) * rowBytes);
    lengths.push_back(static_cast<size_t>(s[i]) * rowBytes);
    sum += s[i];
  }
  if (sum != rows) {
    bad(what + ": split sizes sum to " + std::to_string(sum) + ", dim 0 has " +
        std::to_string(rows));
  }
}

}  // namespace

Work ProcessGroup::alltoall(at::Tensor output, at::Tensor input,
                            std::vector<int64_t> outputSplits,
                            std::vector<int64_t> inputSplits) {
  Devices dv{impl_->wantsCuda()};
  const std::string what = "alltoall";
  const DType dtype = checkTensor(input, what + ": input", dv);
  if (checkTensor(output, what + ": output", dv) != dtype) {
    bad(what + ": output dtype differs from the input's");
  }
  if (input.dim() > 0 && output.dim() > 0 &&
      input.numel() / std::max<int64_t>(input.size(0), 1) !=
          output.numel() / std::max<int64_t>(output.size(0), 1)) {
    bad(what + ": rows of the input " + shapeOf(input) + " and the output " +
        shapeOf(output) + " differ in size");
  }
  Op o;
  blocks(input, inputSplits, size_, what + ": input", o.spec.inOffsets,
         o.spec.inLengths);
  blocks(output, outputSplits, size_, what + ": output", o.spec.outOffsets,
         o.spec.outLengths);
  const auto self = static_cast<size_t>(rank_);
  if (o.spec.inLengths[self] != o.spec.outLengths[self]) {
    bad(what + ": this rank's own block is " +
        std::to_string(o.spec.inLengths[self]) + " bytes in the input but " +
        std::to_string(o.spec.outLengths[self]) + " in the output");
  }
  const bool even = inputSplits.empty() && outputSplits.empty();
  // Uneven splits differ between ranks by design: sizes are then checked
  // block by block, as each arrives.
  o.spec.fp = {0,     OpType::kAlltoall,
               dtype, ReduceOp::kSum,
               -1,    even ? static_cast<uint64_t>(input.numel()) : 0};
  o.spec.inputs = {input.data_ptr()};
  o.spec.outputs = {output.data_ptr()};
  o.keep = {input};
  o.outputs = {output};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

Work ProcessGroup::barrier() {
  Devices dv{impl_->wantsCuda()};
  Op o;
  o.spec.fp = {0, OpType::kBarrier, DType::kUInt8, ReduceOp::kSum, -1, 0};
  o.spec.device = dv.device;
  return enqueue(std::move(o));
}

namespace {

void checkPeer(int peer, int rank, int size, const std::string& what) {
  if (peer < 0 || peer >= size) {
    bad(what + ": rank " + std::to_string(peer) + " is outside [0, " +
        std::to_string(size) + ")");
  }
  if (peer == rank) {
    bad(what + ": rank " + std::to_string(peer) + " is this rank");
  }
}

}  // namespace

Work ProcessGroup::send(at::Tensor tensor, int dst, int64_t tag) {
  checkPeer(dst, rank_, size_, "send");
  return p2p(true, dst, tag, tensor, "send");
}

Work ProcessGroup::recv(at::Tensor tensor, int src, int64_t tag) {
  checkPeer(src, rank_, size_, "recv");
  return p2p(false, src, tag, tensor, "recv");
}

Work ProcessGroup::recvAnysource(at::Tensor tensor, int64_t tag) {
  if (backend_ == "nccl") {
    bad("recvAnysource: not supported by the nccl backend (NCCL receives "
        "only from a named rank: use recv(tensor, src, tag))");
  }
  return p2p(false, -1, tag, tensor, "recvAnysource");
}

Work ProcessGroup::p2p(bool isSend, int peer, int64_t tag,
                       const at::Tensor& tensor, const std::string& what) {
  Devices dv{impl_->wantsCuda()};
  const DType dtype = checkTensor(tensor, what, dv);
  Promise<std::vector<at::Tensor>> promise;
  auto future = promise.getFuture();
  const Fingerprint fp{0,     isSend ? OpType::kSend : OpType::kRecv,
                       dtype, ReduceOp::kSum,
                       -1,    static_cast<uint64_t>(tensor.numel())};
  auto recorder = monitoring_->recorder;
  const uint64_t id = recorder->scheduled(fp, peer, tag, tensor.sizes().vec());
  // Posted at once, outside the collectives' order: running from now on.
  recorder->started(id);
  auto source =
      isSend || peer >= 0 ? nullptr : std::make_shared<Work::Source>();
  auto done = [promise, tensor, source, recorder, id](const Error& e,
                                                      int from) mutable {
    if (source) {
      source->rank.store(from);
    }
    recorder->finished(id, e);
    if (e.ok()) {
      promise.setValue({tensor});
    } else {
      promise.setError(e);
    }
  };
  const detail::Placement where{dv.device, currentStream(dv.device)};
  detail::Backend::StreamJoin join;
  if (isSend) {
    join = impl_->send(peer, tag, dtype, tensor.data_ptr(), tensor.nbytes(),
                       where, [done](const Error& e) mutable { done(e, -1); });
  } else {
    join = impl_->recv(peer, tag, dtype, tensor.data_ptr(), tensor.nbytes(),
                       where, std::move(done));
  }
  detail::FlightEntry entry;
  entry.fp = fp;
  entry.peer = peer;
  entry.tag = tag;
  std::string description = entry.describe();
  if (what == "recvAnysource") {
    description = what + description.substr(4);  // "recv(" -> "recvAnysource("
  }
  return Work(std::move(future), description + " on group '" + name_ + "'",
              std::move(source),
              streamWaitFor(std::move(join), dv.device,
                            options_.blockingWait.value_or(false)));
}

}  // namespace trellis::collectives
