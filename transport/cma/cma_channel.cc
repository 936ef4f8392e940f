#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <string>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/core/thread_annotations.h>
#include <trellis/core/thread_name.h>
#include <trellis/transport/channel.h>
#include <trellis/transport/cma/factory.h>
#include <trellis/transport/cma/record.h>
#include <trellis/transport/process_gone.h>

namespace trellis::transport::cma {

namespace {

// Reads Yama's ptrace_scope; -1 when Yama is absent.
int ptraceScope() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  int v = -1;
  if (f && (f >> v)) {
    return v;
  }
  return -1;
}

Error probe() {
  const int scope = ptraceScope();
  if (scope >= 2) {
    return Error(Code::kFailedPrecondition,
                 "cma not viable: /proc/sys/kernel/yama/ptrace_scope is " +
                     std::to_string(scope) +
                     " (only 0 or 1 let a peer process read this one)");
  }
  if (scope == 1) {
    // Peers are siblings, not ancestors: let any process of this user attach.
    if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) {
      return Error::fromErrno(errno, "cma not viable: prctl(PR_SET_PTRACER)");
    }
  }
  char src[64];
  char dst[64];
  std::memset(src, 0x5a, sizeof(src));
  std::memset(dst, 0, sizeof(dst));
  iovec local{dst, sizeof(dst)};
  iovec remote{src, sizeof(src)};
  const ssize_t n = process_vm_readv(getpid(), &local, 1, &remote, 1, 0);
  if (n < 0) {
    return Error::fromErrno(errno, "cma not viable: process_vm_readv");
  }
  if (n != static_cast<ssize_t>(sizeof(src)) ||
      std::memcmp(src, dst, sizeof(src)) != 0) {
    return Error(Code::kFailedPrecondition,
                 "cma not viable: process_vm_readv probe copied wrong bytes");
  }
  return Error();
}

// Worker threads for the copies. Started on first use, so contexts that
// never read by cma cost no threads. Tasks run to the end: the destructor
// drains the queue, so every posted copy calls back.
class CopyPool final {
 public:
  explicit CopyPool(size_t threads) : threads_(std::max<size_t>(threads, 1)) {}
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  ~CopyPool() {
    std::vector<std::thread> workers;
    {
      MutexLock lock(state_->mu);
      state_->stop = true;
      workers.swap(workers_);
    }
    state_->cv.notifyAll();
    for (auto& t : workers) {
      // The last reference to the channel may be dropped by a copy's
      // callback: that worker cannot join itself, and owns the state too.
      if (t.get_id() == std::this_thread::get_id()) {
        t.detach();
      } else {
        t.join();
      }
    }
  }

  size_t threads() const { return threads_; }

  void post(std::function<void()> task) {
    {
      MutexLock lock(state_->mu);
      state_->tasks.push_back(std::move(task));
      if (workers_.size() < threads_ &&
          workers_.size() < state_->tasks.size() + state_->busy) {
        workers_.emplace_back([state = state_] {
          setThreadName("cma-copy");
          work(*state);
        });
      }
    }
    state_->cv.notifyOne();
  }

 private:
  struct State {
    Mutex mu;
    CondVar cv;
    std::deque<std::function<void()>> tasks TRELLIS_GUARDED_BY(mu);
    size_t busy TRELLIS_GUARDED_BY(mu) = 0;
    bool stop TRELLIS_GUARDED_BY(mu) = false;
  };

  static void work(State& s) TRELLIS_EXCLUDES(s.mu) {
    s.mu.lock();
    while (true) {
      // Bounded only by the owner: stop is set in the destructor.
      while (!s.stop && s.tasks.empty()) {
        s.cv.wait(s.mu);
      }
      if (s.tasks.empty()) {
        s.mu.unlock();
        return;
      }
      auto task = std::move(s.tasks.front());
      s.tasks.pop_front();
      ++s.busy;
      s.mu.unlock();
      task();
      task = nullptr;
      s.mu.lock();
      --s.busy;
    }
  }

  const size_t threads_;
  const std::shared_ptr<State> state_ = std::make_shared<State>();
  std::vector<std::thread> workers_ TRELLIS_GUARDED_BY(state_->mu);
};

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Copies [offset, offset + length) of the record's range into dst + offset.
Error copyRange(const Record& rec, uint8_t* dst, size_t offset, size_t length,
                const std::string& who) {
  size_t done = 0;
  while (done < length) {
    const size_t at = offset + done;
    iovec local{dst + at, length - done};
    iovec remote{
        reinterpret_cast<void*>(static_cast<uintptr_t>(rec.address) + at),
        length - done};
    const ssize_t n =
        process_vm_readv(static_cast<pid_t>(rec.pid), &local, 1, &remote, 1, 0);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      const int err = n < 0 ? errno : EFAULT;
      const std::string what =
          "process_vm_readv of " + std::to_string(rec.length) + " bytes at 0x" +
          hex(rec.address) + " of pid " + std::to_string(rec.pid) + " (" + who +
          ") failed after " + std::to_string(at) + " bytes";
      // ESRCH: no such process, or one without memory (a zombie). Memory
      // that is not there (EFAULT, a short read, ENOMEM) is the peer's
      // departure too if its process is gone or going: it took its memory
      // with it. From a peer that lives on, it is a record naming memory
      // the peer does not have.
      if (err == ESRCH ||
          ((err == EFAULT || err == ENOMEM) && processGone(rec.pid))) {
        return Error(Code::kUnavailable,
                     "cma: the peer process is gone: " + what + " (" +
                         std::strerror(err) + ")");
      }
      if (err == EFAULT) {
        return Error(Code::kDataLoss,
                     "cma: " + what +
                         ": the peer's record names memory it does not "
                         "have (" +
                         std::string(std::strerror(err)) + ")");
      }
      return Error::fromErrno(err, "cma: " + what);
    }
    done += static_cast<size_t>(n);
  }
  return Error();
}

// One readOutOfBand split into pieces: the first error wins, `done` fires
// after the last piece.
struct Job {
  Job(size_t pieces, Channel::OutOfBandCallback cb)
      : left(pieces), done(std::move(cb)) {}
  void finish(const Error& e) TRELLIS_EXCLUDES(mu) {
    {
      MutexLock lock(mu);
      if (!e.ok() && first.ok()) {
        first = e;
      }
    }
    if (left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // No other piece touches the job any more; the lock costs nothing
      // uncontended and keeps `first` plainly GUARDED_BY.
      Error error;
      {
        MutexLock lock(mu);
        error = std::move(first);
      }
      auto cb = std::move(done);
      done = nullptr;
      cb(error);
    }
  }
  std::atomic<size_t> left;
  Mutex mu;
  Error first TRELLIS_GUARDED_BY(mu);  // the first piece's error
  Channel::OutOfBandCallback done;
};

class CmaChannel final : public Channel {
 public:
  explicit CmaChannel(Options options)
      : options_(options), pool_(options.copyThreads) {}

  std::string name() const override { return "cma"; }
  Error viable() const override {
    std::call_once(once_, [this] {
      viable_ = probe();
      if (!viable_.ok()) {
        TRELLIS_LOG_INFO("{}", viable_.what());
      }
    });
    return viable_;
  }
  bool sameHostOnly() const override { return true; }
  bool supportsDevice(const Device& d) const override {
    return d.type == DeviceType::kCpu;
  }
  bool inlineThroughConnection() const override { return false; }
  bool drivesOutOfBand() const override { return true; }
  bool sendsOutOfBand(const Message::Tensor& t) const override {
    return t.device.type == DeviceType::kCpu && t.length > 0 &&
           t.length >= options_.thresholdBytes;
  }

  Error describeOutOfBand(const Message::Tensor& t,
                          std::string* record) const override {
    if (t.device.type != DeviceType::kCpu) {
      return Error::invalidArgument("cma carries CPU tensors only, not " +
                                    t.device.toString());
    }
    *record = encodeRecord({static_cast<uint64_t>(::getpid()),
                            reinterpret_cast<uintptr_t>(t.data), t.length});
    return Error();
  }

  Error checkOutOfBandRecord(const std::string& record,
                             const Descriptor::TensorInfo& tensor,
                             uint64_t peerPid) const override {
    Record rec;
    Error e = decodeRecord(record, &rec);
    if (e.ok()) {
      e = checkRecord(rec, tensor.length, tensor.device);
    }
    if (e.ok() && rec.pid != peerPid) {
      e = Error::protocol("cma record names pid " + std::to_string(rec.pid) +
                          " but the peer's hello said " +
                          std::to_string(peerPid));
    }
    return e;
  }

  void readOutOfBand(const std::string& record, const Allocation::Buffer& dst,
                     const Device& device, const std::string& who,
                     OutOfBandCallback done) const override {
    Record rec;
    Error e = decodeRecord(record, &rec);
    if (e.ok()) {
      e = checkRecord(rec, dst.length, device);
    }
    if (!e.ok() || rec.length == 0) {
      done(e.ok() ? e : e.withContext(who));
      return;
    }
    if (dst.length <= options_.inlineCopyBytes) {
      done(copyRange(rec, static_cast<uint8_t*>(dst.data), 0, dst.length, who));
      return;
    }
    // Off the loop thread; a large copy in page-aligned pieces, one per
    // worker, since one process_vm_readv runs on one core at well under
    // memcpy speed (docs/transport.md, "cma channel").
    const size_t length = dst.length;
    size_t pieces = 1;
    if (options_.splitBytes > 0 && length >= options_.splitBytes) {
      pieces = pool_.threads();
    }
    const size_t page = 4096;
    size_t step = (length + pieces - 1) / pieces;
    step = (step + page - 1) / page * page;
    pieces = (length + step - 1) / step;
    auto job = std::make_shared<Job>(pieces, std::move(done));
    auto* out = static_cast<uint8_t*>(dst.data);
    for (size_t off = 0; off < length; off += step) {
      const size_t n = std::min(step, length - off);
      pool_.post([job, rec, out, off, n, who] {
        job->finish(copyRange(rec, out, off, n, who));
      });
    }
  }

 private:
  // What a record must say of the tensor it stands for.
  static Error checkRecord(const Record& rec, size_t length,
                           const Device& device) {
    if (device.type != DeviceType::kCpu) {
      return Error::protocol("cma record for a " + device.toString() +
                             " tensor (cma carries CPU memory only)");
    }
    if (rec.length != length) {
      return Error::protocol("cma length " + std::to_string(rec.length) +
                             " differs from the tensor length " +
                             std::to_string(length));
    }
    return Error();
  }

  const Options options_;
  mutable CopyPool pool_;
  mutable std::once_flag once_;
  mutable Error viable_;
};

}  // namespace

std::shared_ptr<Channel> create(Options options) {
  return std::make_shared<CmaChannel>(options);
}

}  // namespace trellis::transport::cma
