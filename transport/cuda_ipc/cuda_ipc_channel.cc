// The cuda_ipc channel in one file, over the ~600 lines the rest of
// transport/ keeps to: its pieces (the driver probe, the per-process
// registries of exported handles and writer events, the copy thread's State
// with its caches, the Channel) share file-local state that a split would
// have to publish in a header, and it can only be exercised on a GPU
// machine, which the regroup of issue 15 did not have. Split it when it
// next changes on one.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <unistd.h>
#include <utility>
#include <vector>

#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/core/thread_name.h>
#include <trellis/transport/channel.h>
#include <trellis/transport/cuda_ipc/factory.h>
#include <trellis/transport/cuda_ipc/record.h>
#include <trellis/transport/process_gone.h>

namespace trellis::transport::cuda_ipc {

namespace {

using Handle = std::array<uint8_t, kHandleBytes>;
using Clock = std::chrono::steady_clock;

// Events the writer keeps per device and records in turn. A reader that has
// not yet waited when its event is recorded again waits for later work of
// the same stream, a superset: slower, never wrong. Neither side ever
// destroys an event a peer may still hold.
constexpr size_t kEventsPerDevice = 64;

Error cudaError(cudaError_t e, const std::string& what,
                Code code = Code::kInternal) {
  return Error(code, what + ": " + cudaGetErrorName(e) + " (" +
                         cudaGetErrorString(e) + ")");
}

// A handle of the writer that does not open: the writer's departure if its
// process is gone (its allocations went with it), else a lying record.
Error openFailed(cudaError_t e, const std::string& what, uint64_t writerPid) {
  if (processGone(writerPid)) {
    return cudaError(e,
                     "cuda_ipc: the peer process is gone (pid " +
                         std::to_string(writerPid) + "): " + what,
                     Code::kUnavailable);
  }
  return cudaError(e, "cuda_ipc: " + what, Code::kDataLoss);
}

std::string deviceName(int index) { return "cuda:" + std::to_string(index); }

// Sets the calling thread's current device for a scope and restores the
// previous one, so that calls from a user's thread leave it as it was.
// Always calls cudaSetDevice, even for the current device: on a thread that
// has made no runtime call yet (the loop thread, the copy thread) that is
// what makes the device's primary context current for the driver calls.
class DeviceScope final {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      previous_ = -1;
    }
    result_ = cudaSetDevice(device);
    device_ = device;
  }
  ~DeviceScope() {
    if (previous_ >= 0 && result_ == cudaSuccess && previous_ != device_) {
      cudaSetDevice(previous_);
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t result() const { return result_; }

 private:
  int previous_ = -1;
  int device_ = -1;
  cudaError_t result_ = cudaSuccess;
};

// The driver's cuMemGetAddressRange (the runtime has no equivalent), found
// through the runtime so that nothing links libcuda directly: a build
// without a driver still loads.
struct Driver {
  PFN_cuMemGetAddressRange_v3020 getAddressRange = nullptr;
  PFN_cuPointerGetAttribute_v4000 getAttribute = nullptr;
};

// Probed once per process: the device count and the driver entry point.
struct Probe {
  Error error;
  int deviceCount = 0;
  Driver driver;
};

const Probe& probe() {
  static const Probe p = [] {
    Probe r;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      r.error = cudaError(e, "cuda_ipc not viable: cudaGetDeviceCount",
                          Code::kFailedPrecondition);
      return r;
    }
    if (n <= 0) {
      r.error = Error(Code::kFailedPrecondition,
                      "cuda_ipc not viable: no CUDA device");
      return r;
    }
    auto entry = [&r](const char* name) -> void* {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult q{};
      const cudaError_t e = cudaGetDriverEntryPointByVersion(
          name, &fn, 12000, cudaEnableDefault, &q);
      if (e != cudaSuccess || fn == nullptr ||
          q != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        r.error = Error(
            Code::kFailedPrecondition,
            std::string("cuda_ipc not viable: the driver has no ") + name);
        return nullptr;
      }
      return fn;
    };
    r.driver.getAddressRange = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(
        entry("cuMemGetAddressRange"));
    r.driver.getAttribute = reinterpret_cast<PFN_cuPointerGetAttribute_v4000>(
        entry("cuPointerGetAttribute"));
    if (r.error.ok()) {
      r.deviceCount = n;
    }
    return r;
  }();
  return p;
}

// The allocation holding `ptr`: base and size; false when `ptr` is not
// device memory the driver knows.
bool addressRange(const void* ptr, uintptr_t* base, size_t* size) {
  CUdeviceptr b = 0;
  size_t s = 0;
  const CUresult r = probe().driver.getAddressRange(
      &b, &s, static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr)));
  if (r != CUDA_SUCCESS) {
    return false;
  }
  *base = static_cast<uintptr_t>(b);
  *size = s;
  return true;
}

// The driver's process-wide unique id of the allocation at `base`.
bool bufferIdOf(uintptr_t base, uint64_t* id) {
  unsigned long long v = 0;
  if (probe().driver.getAttribute(&v, CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                  static_cast<CUdeviceptr>(base)) !=
      CUDA_SUCCESS) {
    return false;
  }
  *id = v;
  return true;
}

// Handles exported by cuda_ipc writers of this process, by buffer id, so
// that every write of one allocation sends the same handle (a reader then
// opens it once), and a reader in this process can check a record naming
// one of them. Bounded: a handle dropped here is exported again if needed.
constexpr size_t kMaxExported = 4096;
Mutex gExportedMutex;
std::map<uint64_t, Handle>& exported() TRELLIS_REQUIRES(gExportedMutex) {
  static auto* m = new std::map<uint64_t, Handle>();
  return *m;
}
std::deque<uint64_t>& exportOrder() TRELLIS_REQUIRES(gExportedMutex) {
  static auto* d = new std::deque<uint64_t>();
  return *d;
}

// Events created by cuda_ipc writers of this process, by IPC handle: a
// reader in the same process cannot open its own process's handles and
// finds the event here instead (records are untrusted: only handles listed
// here are ever used as events).
Mutex gOwnEventsMutex;
std::map<Handle, cudaEvent_t>& ownEvents() TRELLIS_REQUIRES(gOwnEventsMutex) {
  static auto* m = new std::map<Handle, cudaEvent_t>();
  return *m;
}

template <typename H>
Handle toBytes(const H& h) {
  static_assert(sizeof(H) == kHandleBytes);
  Handle b;
  std::memcpy(b.data(), &h, kHandleBytes);
  return b;
}

template <typename H>
H fromBytes(const Handle& b) {
  static_assert(sizeof(H) == kHandleBytes);
  H h;
  std::memcpy(&h, b.data(), kHandleBytes);
  return h;
}

struct Job {
  Clock::time_point enqueued;
  Record record;
  void* dst = nullptr;
  size_t length = 0;
  int device = 0;
  std::string who;
  Channel::OutOfBandCallback done;
};

// TRELLIS_CUDA_IPC_TRACE=1: where a read's time goes, in stages, logged
// (info) every 1,000 reads and when the channel ends; read once per
// process. Off by default: it costs a clock read per stage.
bool traceEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("TRELLIS_CUDA_IPC_TRACE");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

struct StageTimes {
  uint64_t reads = 0;
  uint64_t describes = 0;
  double describeUs = 0;  // the writer's record: range, handle, event
  double queueUs = 0;     // enqueued on the pipe's thread to taken here
  double openUs = 0;      // memory and event handles (cached after once)
  double issueUs = 0;     // the stream's wait on the event, the copy's issue
  double waitUs = 0;      // polling until the copy is done
  double doneUs = 0;      // the callback (hands back to the pipe's loop)

  void log() const {
    if (reads == 0 && describes == 0) {
      return;
    }
    const double n = reads == 0 ? 1 : static_cast<double>(reads);
    const double d = describes == 0 ? 1 : static_cast<double>(describes);
    TRELLIS_LOG_INFO(
        "cuda_ipc trace: {} reads, mean us: queue {:.1f} open {:.1f} issue "
        "{:.1f} wait {:.1f} done {:.1f}; {} records, mean us: describe {:.1f}",
        reads, queueUs / n, openUs / n, issueUs / n, waitUs / n, doneUs / n,
        describes, describeUs / d);
  }
};

double microsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// Everything the channel owns, shared with its copy thread so that the
// channel may be dropped on any thread, that one included.
class State final : public std::enable_shared_from_this<State> {
 public:
  explicit State(Options options) : options_(options) {}
  ~State();

  Error describe(const Message::Tensor& t, std::string* record)
      TRELLIS_EXCLUDES(mu_);
  void enqueue(Job job) TRELLIS_EXCLUDES(mu_);
  // Ends the copy thread (joined, or detached when called on it) and fails
  // the copies still queued with CANCELLED.
  void stop() TRELLIS_EXCLUDES(mu_);

 private:
  struct Opened {
    uintptr_t base = 0;
    size_t size = 0;
    uint64_t lastUse = 0;
  };
  struct EventSlot {
    cudaEvent_t event = nullptr;
    Handle handle{};
  };
  struct WriterDevice {
    std::vector<EventSlot> events;
    size_t next = 0;
  };

  void run() TRELLIS_EXCLUDES(mu_);
  Error copy(Job& job);
  Error openMemory(const Record& r, int device, const std::string& who,
                   uintptr_t* base, size_t* size);
  Error openEvent(const Record& r, int device, const std::string& who,
                  cudaEvent_t* event);
  Error waitFor(cudaStream_t stream, const Job& job);
  template <typename Cache, typename Close>
  void evict(Cache& cache, Close close);

  const Options options_;

  Mutex mu_;  // the queue, the thread and the writer's events
  CondVar cv_;
  std::deque<Job> jobs_ TRELLIS_GUARDED_BY(mu_);
  bool stopping_ TRELLIS_GUARDED_BY(mu_) = false;
  std::thread thread_ TRELLIS_GUARDED_BY(mu_);
  std::map<int, WriterDevice> writers_ TRELLIS_GUARDED_BY(mu_);

  // Copy thread only (and the destructor, after it has ended).
  using MemoryKey = std::tuple<uint64_t, uint64_t, Handle, int>;
  std::map<MemoryKey, Opened> memory_;
  std::map<std::pair<Handle, int>, std::pair<cudaEvent_t, uint64_t>> events_;
  std::map<int, cudaStream_t> streams_;
  uint64_t uses_ = 0;
  bool stuck_ = false;
  StageTimes copyTimes_;  // copy thread only (and the destructor)
  Mutex traceMu_;         // describe() runs on any pipe's loop
  StageTimes describeTimes_ TRELLIS_GUARDED_BY(traceMu_);
};

State::~State() {
  if (traceEnabled()) {
    copyTimes_.log();
    MutexLock l(traceMu_);
    describeTimes_.log();
  }
  // The copy thread has ended (or this is its last act); CUDA may already
  // be torn down at process exit, so results are ignored.
  for (auto& [key, m] : memory_) {
    DeviceScope d(std::get<3>(key));
    cudaIpcCloseMemHandle(reinterpret_cast<void*>(m.base));
  }
  for (auto& [key, e] : events_) {
    cudaEventDestroy(e.first);
  }
  for (auto& [device, s] : streams_) {
    DeviceScope d(device);
    cudaStreamDestroy(s);
  }
  for (auto& [device, w] : writers_) {
    for (auto& slot : w.events) {
      {
        MutexLock l(gOwnEventsMutex);
        ownEvents().erase(slot.handle);
      }
      cudaEventDestroy(slot.event);
    }
  }
}

Error State::describe(const Message::Tensor& t, std::string* out) {
  const auto started = traceEnabled() ? Clock::now() : Clock::time_point();
  const Probe& p = probe();
  if (!p.error.ok()) {
    return p.error;
  }
  const int device = t.device.index;
  if (t.device.type != DeviceType::kCuda || device < 0 ||
      device >= p.deviceCount) {
    return Error::invalidArgument(
        "cuda_ipc: tensor on " +
        (t.device.type == DeviceType::kCuda ? deviceName(device)
                                            : std::string("cpu")) +
        " but this process has " + std::to_string(p.deviceCount) +
        " CUDA device(s)");
  }
  DeviceScope scope(device);
  if (scope.result() != cudaSuccess) {
    return cudaError(scope.result(), "cuda_ipc: cudaSetDevice");
  }
  uintptr_t base = 0;
  size_t size = 0;
  const auto ptr = reinterpret_cast<uintptr_t>(t.data);
  if (!addressRange(t.data, &base, &size) || ptr < base ||
      t.length > size - (ptr - base)) {
    return Error::invalidArgument(
        "cuda_ipc: a tensor of " + std::to_string(t.length) + " bytes on " +
        deviceName(device) + " is not inside one CUDA device allocation");
  }
  uint64_t id = 0;
  if (!bufferIdOf(base, &id)) {
    return Error(Code::kInternal, "cuda_ipc: no buffer id for an allocation");
  }
  Record r;
  cudaError_t e = cudaSuccess;
  {
    MutexLock l(gExportedMutex);
    auto it = exported().find(id);
    if (it != exported().end()) {
      r.memHandle = it->second;
    } else {
      cudaIpcMemHandle_t mem;
      e = cudaIpcGetMemHandle(&mem, reinterpret_cast<void*>(base));
      if (e != cudaSuccess) {
        cudaGetLastError();
        return cudaError(e,
                         "cuda_ipc: cudaIpcGetMemHandle (only cudaMalloc "
                         "memory can be shared)",
                         Code::kInvalidArgument);
      }
      r.memHandle = toBytes(mem);
      exported()[id] = r.memHandle;
      exportOrder().push_back(id);
      if (exportOrder().size() > kMaxExported) {
        exported().erase(exportOrder().front());
        exportOrder().pop_front();
      }
    }
  }
  r.deviceIndex = static_cast<uint32_t>(device);
  r.offset = ptr - base;
  r.length = t.length;
  r.allocationSize = size;
  r.writerPid = static_cast<uint64_t>(::getpid());
  r.bufferId = id;
  r.baseAddress = base;
  {
    MutexLock l(mu_);
    WriterDevice& w = writers_[device];
    if (w.events.size() < kEventsPerDevice) {
      EventSlot slot;
      e = cudaEventCreateWithFlags(
          &slot.event, cudaEventInterprocess | cudaEventDisableTiming);
      if (e != cudaSuccess) {
        return cudaError(e, "cuda_ipc: cudaEventCreateWithFlags");
      }
      cudaIpcEventHandle_t h;
      e = cudaIpcGetEventHandle(&h, slot.event);
      if (e != cudaSuccess) {
        cudaEventDestroy(slot.event);
        return cudaError(e, "cuda_ipc: cudaIpcGetEventHandle");
      }
      slot.handle = toBytes(h);
      {
        MutexLock g(gOwnEventsMutex);
        ownEvents()[slot.handle] = slot.event;
      }
      w.events.push_back(slot);
    }
    const EventSlot& slot = w.events[w.next % w.events.size()];
    ++w.next;
    // The legacy default stream by name: "0" would mean the per-thread
    // stream in a build with --default-stream per-thread.
    e = cudaEventRecord(slot.event, cudaStreamLegacy);
    if (e != cudaSuccess) {
      return cudaError(e, "cuda_ipc: cudaEventRecord");
    }
    r.eventHandle = slot.handle;
  }
  *out = encodeRecord(r);
  if (traceEnabled()) {
    MutexLock l(traceMu_);
    ++describeTimes_.describes;
    describeTimes_.describeUs += microsBetween(started, Clock::now());
    if (describeTimes_.describes % 1000 == 0) {
      describeTimes_.log();
    }
  }
  return Error();
}

void State::enqueue(Job job) {
  Channel::OutOfBandCallback refused;
  {
    MutexLock l(mu_);
    if (stopping_) {
      refused = std::move(job.done);
    } else {
      if (traceEnabled()) {
        job.enqueued = Clock::now();
      }
      jobs_.push_back(std::move(job));
      if (!thread_.joinable()) {
        // Holds the state, so it outlives a channel dropped by a callback
        // running on this very thread.
        thread_ = std::thread([self = shared_from_this()] {
          setThreadName("cuda-ipc");
          self->run();
        });
      }
    }
  }
  if (refused) {
    refused(Error::cancelled("cuda_ipc: channel closed"));
  }
  cv_.notifyOne();
}

void State::stop() {
  std::deque<Job> left;
  std::thread t;
  {
    MutexLock l(mu_);
    stopping_ = true;
    left.swap(jobs_);
    t = std::move(thread_);
  }
  cv_.notifyAll();
  if (t.joinable()) {
    if (t.get_id() != std::this_thread::get_id()) {
      t.join();  // bounded: a copy gives up after copyTimeout
    } else {
      t.detach();
    }
  }
  for (auto& job : left) {
    job.done(Error::cancelled("cuda_ipc: channel closed before reading from " +
                              job.who));
  }
}

void State::run() {
  for (;;) {
    Job job;
    {
      MutexLock l(mu_);
      while (!stopping_ && jobs_.empty()) {
        (void)cv_.waitUntil(
            mu_, std::chrono::steady_clock::now() + std::chrono::seconds(1));
      }
      if (stopping_) {
        return;
      }
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    const bool trace = traceEnabled();
    const auto taken = trace ? Clock::now() : Clock::time_point();
    const Error e = copy(job);
    auto done = std::move(job.done);
    const auto copied = trace ? Clock::now() : Clock::time_point();
    done(e);
    if (trace && e.ok()) {
      // copy() added its own stages; the queue and the hand-back here.
      copyTimes_.queueUs += microsBetween(job.enqueued, taken);
      copyTimes_.doneUs += microsBetween(copied, Clock::now());
      if (++copyTimes_.reads % 1000 == 0) {
        copyTimes_.log();
      }
    }
  }
}

template <typename Cache, typename Close>
void State::evict(Cache& cache, Close close) {
  while (cache.size() > options_.maxOpenHandles) {
    auto oldest = cache.begin();
    for (auto it = cache.begin(); it != cache.end(); ++it) {
      if (close.lastUse(it->second) < close.lastUse(oldest->second)) {
        oldest = it;
      }
    }
    close(oldest->first, oldest->second);
    cache.erase(oldest);
  }
}

Error State::openMemory(const Record& r, int device, const std::string& who,
                        uintptr_t* base, size_t* size) {
  if (r.writerPid == static_cast<uint64_t>(::getpid())) {
    // Our own allocation: trust the address only if it is the base of
    // the allocation with the record's buffer id, exported by a writer of
    // this process under the record's very handle.
    uintptr_t b = 0;
    size_t s = 0;
    uint64_t id = 0;
    bool exportedHere = false;
    {
      MutexLock l(gExportedMutex);
      auto it = exported().find(r.bufferId);
      exportedHere = it != exported().end() && it->second == r.memHandle;
    }
    const void* p = reinterpret_cast<const void*>(r.baseAddress);
    if (!exportedHere || !addressRange(p, &b, &s) || b != r.baseAddress ||
        !bufferIdOf(b, &id) || id != r.bufferId) {
      return Error(Code::kDataLoss,
                   "cuda_ipc: the record from " + who +
                       " names an allocation this process does not have "
                       "(or no longer exports)");
    }
    *base = b;
    *size = s;
    return Error();
  }
  const auto key =
      std::make_tuple(r.writerPid, r.bufferId, r.memHandle, device);
  auto it = memory_.find(key);
  if (it == memory_.end()) {
    void* p = nullptr;
    const cudaError_t e =
        cudaIpcOpenMemHandle(&p, fromBytes<cudaIpcMemHandle_t>(r.memHandle),
                             cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return openFailed(e, "cannot open the memory handle from " + who,
                        r.writerPid);
    }
    Opened o;
    o.base = reinterpret_cast<uintptr_t>(p);
    uintptr_t b = 0;
    if (!addressRange(p, &b, &o.size) || b != o.base) {
      cudaIpcCloseMemHandle(p);
      return Error(Code::kInternal,
                   "cuda_ipc: the driver does not know the mapping of the "
                   "memory handle from " +
                       who);
    }
    it = memory_.emplace(key, o).first;
  }
  it->second.lastUse = ++uses_;
  *base = it->second.base;
  *size = it->second.size;
  return Error();
}

Error State::openEvent(const Record& r, int device, const std::string& who,
                       cudaEvent_t* event) {
  if (r.writerPid == static_cast<uint64_t>(::getpid())) {
    MutexLock l(gOwnEventsMutex);
    auto it = ownEvents().find(r.eventHandle);
    if (it == ownEvents().end()) {
      return Error(Code::kDataLoss, "cuda_ipc: the record from " + who +
                                        " names an event this process does "
                                        "not have");
    }
    *event = it->second;
    return Error();
  }
  const auto key = std::make_pair(r.eventHandle, device);
  auto it = events_.find(key);
  if (it == events_.end()) {
    cudaEvent_t ev = nullptr;
    const cudaError_t e = cudaIpcOpenEventHandle(
        &ev, fromBytes<cudaIpcEventHandle_t>(r.eventHandle));
    if (e != cudaSuccess) {
      cudaGetLastError();
      return openFailed(e, "cannot open the event handle from " + who,
                        r.writerPid);
    }
    it = events_.emplace(key, std::make_pair(ev, uint64_t{0})).first;
  }
  it->second.second = ++uses_;
  *event = it->second.first;
  return Error();
}

Error State::waitFor(cudaStream_t stream, const Job& job) {
  // Polled rather than cudaStreamSynchronize, so that the wait is bounded.
  const auto deadline = Clock::now() + options_.copyTimeout;
  for (int spins = 0;; ++spins) {
    const cudaError_t e = cudaStreamQuery(stream);
    if (e == cudaSuccess) {
      return Error();
    }
    if (e != cudaErrorNotReady) {
      return cudaError(e, "cuda_ipc: copy of " + std::to_string(job.length) +
                              " bytes from " + job.who);
    }
    if (Clock::now() >= deadline) {
      stuck_ = true;
      return Error::timeout("cuda_ipc: copy of " + std::to_string(job.length) +
                            " bytes from " + job.who + " not finished after " +
                            std::to_string(options_.copyTimeout.count()) +
                            " ms (waiting for the writer's stream?)");
    }
    if (spins < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

Error State::copy(Job& job) {
  const bool trace = traceEnabled();
  const auto started = trace ? Clock::now() : Clock::time_point();
  if (stuck_) {
    return Error(Code::kFailedPrecondition,
                 "cuda_ipc: an earlier copy timed out; this channel reads "
                 "no more");
  }
  DeviceScope scope(job.device);
  if (scope.result() != cudaSuccess) {
    return cudaError(scope.result(), "cuda_ipc: cudaSetDevice");
  }
  uintptr_t base = 0;
  size_t size = 0;
  Error err = openMemory(job.record, job.device, job.who, &base, &size);
  if (!err.ok()) {
    return err;
  }
  const Record& r = job.record;
  if (r.offset > size || r.length > size - r.offset) {
    return Error(Code::kDataLoss,
                 "cuda_ipc: the record from " + job.who + " names bytes [" +
                     std::to_string(r.offset) + ", +" +
                     std::to_string(r.length) + ") of an allocation of " +
                     std::to_string(size) + " bytes");
  }
  cudaEvent_t event = nullptr;
  err = openEvent(r, job.device, job.who, &event);
  if (!err.ok()) {
    return err;
  }
  auto s = streams_.find(job.device);
  if (s == streams_.end()) {
    // A blocking stream: the copy also waits for what this process queued
    // on its legacy default stream, e.g. earlier work on the destination.
    cudaStream_t stream = nullptr;
    const cudaError_t e = cudaStreamCreate(&stream);
    if (e != cudaSuccess) {
      return cudaError(e, "cuda_ipc: cudaStreamCreate");
    }
    s = streams_.emplace(job.device, stream).first;
  }
  const auto opened = trace ? Clock::now() : Clock::time_point();
  cudaError_t e = cudaStreamWaitEvent(s->second, event, 0);
  if (e != cudaSuccess) {
    return cudaError(e, "cuda_ipc: cudaStreamWaitEvent");
  }
  e = cudaMemcpyAsync(job.dst, reinterpret_cast<const void*>(base + r.offset),
                      r.length, cudaMemcpyDeviceToDevice, s->second);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cudaError(e, "cuda_ipc: cudaMemcpyAsync of " +
                            std::to_string(r.length) + " bytes from " +
                            job.who);
  }
  const auto issued = trace ? Clock::now() : Clock::time_point();
  err = waitFor(s->second, job);
  if (trace && err.ok()) {
    const auto waited = Clock::now();
    copyTimes_.openUs += microsBetween(started, opened);
    copyTimes_.issueUs += microsBetween(opened, issued);
    copyTimes_.waitUs += microsBetween(issued, waited);
  }
  struct MemoryLru {
    uint64_t lastUse(const Opened& o) const { return o.lastUse; }
    void operator()(const MemoryKey& key, const Opened& o) const {
      DeviceScope d(std::get<3>(key));
      cudaIpcCloseMemHandle(reinterpret_cast<void*>(o.base));
    }
  };
  struct EventLru {
    uint64_t lastUse(const std::pair<cudaEvent_t, uint64_t>& e) const {
      return e.second;
    }
    void operator()(const std::pair<Handle, int>& /*key*/,
                    const std::pair<cudaEvent_t, uint64_t>& e) const {
      cudaEventDestroy(e.first);
    }
  };
  if (!stuck_) {
    // Between copies nothing is in flight, so any entry may go.
    evict(memory_, MemoryLru{});
    evict(events_, EventLru{});
  }
  return err;
}

class CudaIpcChannel final : public Channel {
 public:
  explicit CudaIpcChannel(Options options)
      : state_(std::make_shared<State>(options)) {}
  ~CudaIpcChannel() override { state_->stop(); }

  std::string name() const override { return "cuda_ipc"; }
  Error viable() const override {
    std::call_once(once_, [] {
      if (!probe().error.ok()) {
        TRELLIS_LOG_DEBUG("{}", probe().error.what());
      }
    });
    return probe().error;
  }
  bool sameHostOnly() const override { return true; }
  bool supportsDevice(const Device& d) const override {
    return d.type == DeviceType::kCuda;
  }
  bool inlineThroughConnection() const override { return false; }
  bool drivesOutOfBand() const override { return true; }
  bool sendsOutOfBand(const Message::Tensor& t) const override {
    return t.device.type == DeviceType::kCuda && t.length > 0;
  }

  Error describeOutOfBand(const Message::Tensor& t,
                          std::string* record) const override {
    return state_->describe(t, record);
  }

  // The pipe's check before any copy: the record must name the pid in the
  // peer's hello (a record naming another process, this one in particular,
  // is refused) and have the tensor's length. The devices are checked by
  // readOutOfBand, against this host's device count.
  Error checkOutOfBandRecord(const std::string& record,
                             const Descriptor::TensorInfo& tensor,
                             uint64_t peerPid) const override {
    Record r;
    const Error e = decodeRecord(record, &r);
    if (!e.ok()) {
      return e;
    }
    if (r.writerPid != peerPid) {
      return Error(Code::kDataLoss, "cuda_ipc: the record names pid " +
                                        std::to_string(r.writerPid) +
                                        ", the peer is pid " +
                                        std::to_string(peerPid));
    }
    if (r.length != tensor.length) {
      return Error(Code::kDataLoss, "cuda_ipc: the record has " +
                                        std::to_string(r.length) +
                                        " bytes for a tensor of " +
                                        std::to_string(tensor.length));
    }
    return Error();
  }

  void readOutOfBand(const std::string& record, const Allocation::Buffer& dst,
                     const Device& device, const std::string& who,
                     OutOfBandCallback done) const override {
    Job job;
    Error e = decodeRecord(record, &job.record);
    if (!e.ok()) {
      done(e.withContext("cuda_ipc: from " + who));
      return;
    }
    e = check(job.record, dst, device, who);
    if (!e.ok()) {
      done(e);
      return;
    }
    if (dst.length == 0) {
      done(Error());
      return;
    }
    job.dst = dst.data;
    job.length = dst.length;
    job.device = device.index;
    job.who = who;
    job.done = std::move(done);
    state_->enqueue(std::move(job));
  }

 private:
  Error check(const Record& r, const Allocation::Buffer& dst,
              const Device& device, const std::string& who) const {
    const Probe& p = probe();
    if (!p.error.ok()) {
      return p.error;
    }
    if (device.type != DeviceType::kCuda || device.index < 0 ||
        device.index >= p.deviceCount) {
      return Error::invalidArgument(
          "cuda_ipc: cannot read into " +
          (device.type == DeviceType::kCuda ? deviceName(device.index)
                                            : std::string("cpu")) +
          " (" + std::to_string(p.deviceCount) + " CUDA device(s))");
    }
    if (r.length != dst.length) {
      return Error(Code::kDataLoss, "cuda_ipc: the record from " + who +
                                        " has " + std::to_string(r.length) +
                                        " bytes for a tensor of " +
                                        std::to_string(dst.length));
    }
    if (r.deviceIndex >= static_cast<uint32_t>(p.deviceCount)) {
      return Error(Code::kDataLoss,
                   "cuda_ipc: the record from " + who + " names " +
                       deviceName(static_cast<int>(r.deviceIndex)) +
                       " but this host has " + std::to_string(p.deviceCount) +
                       " CUDA device(s)");
    }
    if (dst.data == nullptr && dst.length > 0) {
      return Error::invalidArgument("cuda_ipc: null destination");
    }
    return Error();
  }

  std::shared_ptr<State> state_;
  mutable std::once_flag once_;
};

}  // namespace

std::shared_ptr<Channel> create(Options options) {
  return std::make_shared<CudaIpcChannel>(options);
}

}  // namespace trellis::transport::cuda_ipc
