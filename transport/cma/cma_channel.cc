#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <trellis/core/logging.h>
#include <trellis/transport/cma/factory.h>
#include <trellis/transport/connection.h>

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

class CmaChannel : public Channel {
 public:
  explicit CmaChannel(Options options) : options_(options) {}

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

  Error readOutOfBand(uint64_t pid, uint64_t address, void* dst, size_t length,
                      const std::string& who) const override {
    size_t done = 0;
    while (done < length) {
      iovec local{static_cast<char*>(dst) + done, length - done};
      iovec remote{
          reinterpret_cast<void*>(static_cast<uintptr_t>(address) + done),
          length - done};
      const ssize_t n =
          process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n <= 0) {
        const int err = n < 0 ? errno : EFAULT;
        std::string what =
            "cma: process_vm_readv of " + std::to_string(length) +
            " bytes at 0x" + hex(address) + " of pid " + std::to_string(pid) +
            " (" + who + ") failed after " + std::to_string(done) + " bytes";
        // ESRCH: the peer is gone; that is a lost connection, not a bug.
        if (err == ESRCH) {
          return Error(Code::kUnavailable, what + ": no such process");
        }
        if (err == EFAULT) {
          return Error(Code::kDataLoss,
                       what +
                           ": the peer's record names memory it does not "
                           "have (" +
                           std::string(std::strerror(err)) + ")");
        }
        return Error::fromErrno(err, what);
      }
      done += static_cast<size_t>(n);
    }
    return Error();
  }

 private:
  static std::string hex(uint64_t v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%llx", static_cast<unsigned long long>(v));
    return buf;
  }

  const Options options_;
  mutable std::once_flag once_;
  mutable Error viable_;
};

}  // namespace

std::shared_ptr<Channel> create(Options options) {
  return std::make_shared<CmaChannel>(options);
}

}  // namespace trellis::transport::cma
