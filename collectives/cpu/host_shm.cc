#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <map>
#include <new>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

#include <trellis/collectives/cpu/host_shm.h>
#include <trellis/collectives/dtype.h>
#include <trellis/collectives/reduce_kernels.h>
#include <trellis/core/auth.h>
#include <trellis/core/logging.h>
#include <trellis/core/spin.h>
#include <trellis/core/text.h>
#include <trellis/store/store.h>

namespace trellis::collectives::detail {

namespace {

constexpr uint64_t kMagic = 0x7472656c6c697331ULL;  // "trellis1"
constexpr size_t kHeaderBytes = 4096;
constexpr int kMaxRanksPerHostVar = 1 << 20;
// A slot is reused two generations later, once every rank released it;
// starting here makes "released >= g - 2" hold for the first two.
constexpr uint64_t kFirstGeneration = 3;

// One rank's progress through the phases, each a generation number that
// only grows; in its own cache lines so that ranks polling one another do
// not share a line with what they write.
constexpr size_t kStarted = 8;

// The fingerprint of the op a rank runs in one generation.
struct PublishedOp {
  uint64_t seq;
  uint64_t count;
  int32_t root;
  uint8_t op;
  uint8_t dtype;
  uint8_t reduceOp;
};

struct alignas(128) Control {
  // Its input of this generation is in its slot.
  std::atomic<uint64_t> arrived;
  // Its reduced part of this generation is in its slot.
  std::atomic<uint64_t> reduced;
  // It no longer reads anyone's slot of this generation.
  std::atomic<uint64_t> released;
  // Per generation parity, like the slots: written before `arrived`, read
  // by peers until they release that generation.
  PublishedOp ops[2];
  // The last kStarted ops it started, shm or not, at seq % kStarted. Every
  // field is an atomic of its own (no fences, no data race); a reader that
  // finds another seq in the entry after reading it drops what it read.
  // For desync errors only: what a rank ran at the other's sequence number.
  struct Started {
    std::atomic<uint64_t> seq;
    std::atomic<uint64_t> count;
    // op | dtype << 8 | reduceOp << 16 | (uint32_t)root << 32
    std::atomic<uint64_t> rest;
  };
  Started started[kStarted];
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the segment's counters are shared between processes");

struct SegmentHeader {
  uint64_t magic;
  auth::Nonce nonce;
  uint32_t ranks;
  uint64_t blockBytes;
};
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

size_t segmentBytes(int ranks) {
  return kHeaderBytes + sizeof(Control) * static_cast<size_t>(ranks) +
         2 * static_cast<size_t>(ranks) * HostShm::kBlockBytes;
}

std::string hostKeyName(int rank) { return "host/" + std::to_string(rank); }
std::string segmentKeyName(int leader) {
  return "shm/" + std::to_string(leader);
}
std::string statusKeyName(int rank) { return "shm-ok/" + std::to_string(rank); }

std::string asString(const store::Bytes& b) {
  return std::string(b.begin(), b.end());
}

// Waits for `keys`; a peer that dies meanwhile ends the wait with the
// mesh's error rather than the group's timeout.
void waitKeys(store::Store& store, Mesh& mesh,
              const std::vector<std::string>& keys, const Deadline& deadline,
              const std::string& what) {
  waitForKeys(
      store, keys, deadline, [&] { return mesh.error(); },
      [&] {
        std::string missing;
        for (const auto& k : keys) {
          if (!store.check({k})) {
            missing += (missing.empty() ? "" : ", ") + k;
          }
        }
        return Error::timeout(
            mesh.description() + ": rank " + std::to_string(mesh.rank()) +
            " timed out waiting for " + what + " (" + missing + ")");
      });
}

std::string machineKey() {
  std::string id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::getline(boot, id);
  // IPC and PID namespaces: the segment is opened through /proc/<pid>;
  // network namespace: ranks that reach each other only over a network
  // (the network-namespace tests' hosts) are on different hosts.
  for (const char* link :
       {"/proc/self/ns/ipc", "/proc/self/ns/pid", "/proc/self/ns/net"}) {
    char ns[128] = {0};
    const ssize_t n = ::readlink(link, ns, sizeof(ns) - 1);
    if (n > 0) {
      id += "/" + std::string(ns, static_cast<size_t>(n));
    }
  }
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  return id + "/" + host;
}

}  // namespace

// ---- HostLayout ------------------------------------------------------------

std::string HostLayout::hostKey(int rank) {
  const char* v = std::getenv("TRELLIS_COLLECTIVES_RANKS_PER_HOST");
  if (v == nullptr || *v == '\0') {
    return machineKey();
  }
  const std::string_view s(v);
  const std::optional<int64_t> k = parseDecimal(s);
  if (!k || *k < 1 || *k > kMaxRanksPerHostVar) {
    throwError(Error::invalidArgument(
        "TRELLIS_COLLECTIVES_RANKS_PER_HOST='" + std::string(s) +
        "' is not an integer in [1, " + std::to_string(kMaxRanksPerHostVar) +
        "] (a test aid: rank r counts as being on host r / K)"));
  }
  return machineKey() + "/test-host-" + std::to_string(rank / *k);
}

HostLayout HostLayout::fromKeys(const std::vector<std::string>& keys) {
  HostLayout layout;
  std::map<std::string, int> index;
  for (size_t r = 0; r < keys.size(); ++r) {
    auto [it, fresh] =
        index.emplace(keys[r], static_cast<int>(layout.ranks.size()));
    if (fresh) {
      layout.ranks.emplace_back();
    }
    layout.hostOf.push_back(it->second);
    layout.ranks[static_cast<size_t>(it->second)].push_back(
        static_cast<int>(r));
  }
  return layout;
}

HostLayout HostLayout::exchange(store::Store& store, Mesh& mesh,
                                const std::string& key, Duration timeout) {
  const Deadline deadline = Deadline::fromTimeout(timeout);
  store.set(hostKeyName(mesh.rank()), key);
  std::vector<std::string> names;
  for (int r = 0; r < mesh.size(); ++r) {
    names.push_back(hostKeyName(r));
  }
  waitKeys(store, mesh, names, deadline, "every rank's host");
  std::vector<std::string> keys;
  for (const auto& b : store.multiGet(names)) {
    keys.push_back(asString(b));
  }
  return fromKeys(keys);
}

std::vector<int> HostLayout::leaders() const {
  std::vector<int> out;
  for (const auto& host : ranks) {
    out.push_back(host.front());
  }
  return out;
}

bool HostLayout::anyShared() const {
  return std::any_of(ranks.begin(), ranks.end(),
                     [](const auto& host) { return host.size() > 1; });
}

// ---- HostShm::Impl ---------------------------------------------------------

class HostShm::Impl {
 public:
  Impl(std::vector<int> ranks, int index) noexcept
      : ranks_(std::move(ranks)), index_(index) {}

  ~Impl() {
    if (base_ != nullptr) {
      ::munmap(base_, bytes_);
    }
    closeDescriptor();
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }

  void noteStarted(const Fingerprint& fp) {
    Control::Started& e = control(index_)->started[fp.seq % kStarted];
    e.seq.store(0, std::memory_order_release);
    e.count.store(fp.count, std::memory_order_release);
    e.rest.store(
        static_cast<uint64_t>(fp.op) | static_cast<uint64_t>(fp.dtype) << 8 |
            static_cast<uint64_t>(fp.reduceOp) << 16 |
            static_cast<uint64_t>(static_cast<uint32_t>(fp.root)) << 32,
        std::memory_order_release);
    e.seq.store(fp.seq, std::memory_order_release);
  }
  int index() const { return index_; }

  // Leader: a fresh sealed-size memfd, mapped and touched; returns what the
  // others need to open it ("<pid>:<fd>:<nonce>").
  Error createSegment(std::string* published) {
    bytes_ = segmentBytes(size());
    fd_ = ::memfd_create("trellis-collectives", MFD_CLOEXEC);
    if (fd_ < 0) {
      return Error::fromErrno(errno, "memfd_create");
    }
    if (::ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) {
      return Error::fromErrno(errno, "ftruncate of the segment to " +
                                         std::to_string(bytes_) + " bytes");
    }
    if (Error e = mapSegment(); !e.ok()) {
      return e;
    }
    auto* h = new (base_) SegmentHeader{};
    h->magic = kMagic;
    h->nonce = auth::randomNonce();
    h->ranks = static_cast<uint32_t>(size());
    h->blockBytes = kBlockBytes;
    for (int i = 0; i < size(); ++i) {
      Control* c = new (control(i)) Control{};
      c->arrived.store(kFirstGeneration - 1);
      c->reduced.store(kFirstGeneration - 1);
      c->released.store(kFirstGeneration - 1);
    }
    *published = std::to_string(::getpid()) + ":" + std::to_string(fd_) + ":" +
                 toHex(h->nonce);
    return Error();
  }

  // The others: open the leader's memfd through /proc and check it is the
  // segment the leader published.
  Error openSegment(const std::string& published) {
    const auto colon1 = published.find(':');
    const auto colon2 = published.find(':', colon1 + 1);
    if (colon1 == std::string::npos || colon2 == std::string::npos) {
      return Error::protocol("malformed segment record '" + published + "'");
    }
    // Two decimal numbers, nothing else: the path must not leave /proc.
    auto number = [](std::string_view text, int64_t* out) {
      const std::optional<int64_t> v = parseDecimal(text);
      *out = v.value_or(-1);
      return *out >= 0;
    };
    int64_t pid = 0;
    int64_t fd = 0;
    const std::string_view record(published);
    if (!number(record.substr(0, colon1), &pid) ||
        !number(record.substr(colon1 + 1, colon2 - colon1 - 1), &fd)) {
      return Error::protocol("malformed segment record '" + published + "'");
    }
    const std::string path =
        "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
    fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd_ < 0) {
      return Error::fromErrno(errno, "open " + path);
    }
    struct stat st {};
    bytes_ = segmentBytes(size());
    if (::fstat(fd_, &st) != 0 || static_cast<size_t>(st.st_size) != bytes_) {
      return Error::protocol(path + " is not a segment of " +
                             std::to_string(bytes_) + " bytes");
    }
    if (Error e = mapSegment(); !e.ok()) {
      return e;
    }
    const auto* h = static_cast<const SegmentHeader*>(base_);
    if (h->magic != kMagic || toHex(h->nonce) != published.substr(colon2 + 1) ||
        h->ranks != static_cast<uint32_t>(size()) ||
        h->blockBytes != kBlockBytes) {
      return Error::protocol(path + " is not the segment the leader published");
    }
    closeDescriptor();
    return Error();
  }

  // Called once every rank of the host opened the segment. Every close of
  // the segment's descriptor goes through here, one frame that
  // ThreadSanitizer's suppression names (tests/tsan_suppressions.cc).
  [[gnu::noinline]] void closeDescriptor() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

  // `data` as blocks of kBlockBytes of the whole (the pieces' boundaries
  // do not matter: a block may span several).
  Error allreduce(Mesh& mesh, const Fingerprint& fp, const Deadline& deadline,
                  const Pieces& data, bool everyoneGetsIt, int64_t divisor) {
    const size_t es = elementSize(fp.dtype);
    const size_t count = data.count();
    const size_t perBlock = kBlockBytes / es;
    for (size_t at = 0; at < count || (at == 0 && count == 0); at += perBlock) {
      const size_t n = std::min(perBlock, count - at);
      Error e = n * es <= kSmallBytes && everyoneGetsIt
                    ? smallBlock(mesh, fp, deadline, data, at, n, divisor)
                    : largeBlock(mesh, fp, deadline, data, at, n,
                                 everyoneGetsIt, divisor);
      if (!e.ok()) {
        return e;
      }
      if (count == 0) {
        break;
      }
    }
    return Error();
  }

  Error broadcast(Mesh& mesh, const Fingerprint& fp, const Deadline& deadline,
                  uint8_t* data, size_t bytes) {
    for (size_t at = 0; at < bytes || (at == 0 && bytes == 0);
         at += kBlockBytes) {
      const size_t n = std::min(kBlockBytes, bytes - at);
      const uint64_t g = ++gen_;
      if (Error e = waitFor(&Control::released, g - 2, mesh, fp, deadline);
          !e.ok()) {
        return e;
      }
      if (index_ == 0) {
        copy(slot(0, g), data + at, n);
        publish(fp, g);
      } else {
        if (Error e = waitArrived(0, g, mesh, fp, deadline); !e.ok()) {
          return e;
        }
        copy(data + at, slot(0, g), n);
        publish(fp, g);
      }
      control(index_)->reduced.store(g, std::memory_order_release);
      control(index_)->released.store(g, std::memory_order_release);
      if (bytes == 0) {
        break;
      }
    }
    return Error();
  }

 private:
  static void copy(void* to, const void* from, size_t bytes) {
    if (bytes > 0) {
      std::memcpy(to, from, bytes);
    }
  }
  Error mapSegment() {
    void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_POPULATE, fd_, 0);
    if (p == MAP_FAILED) {
      return Error::fromErrno(errno, "mmap of " + std::to_string(bytes_) +
                                         " bytes of shared memory");
    }
    base_ = p;
    // Touch every page now: the hot path must not fault (DESIGN.md, "Facts
    // about these machines").
    auto* bytes = static_cast<volatile uint8_t*>(base_);
    for (size_t off = 0; off < bytes_; off += 4096) {
      bytes[off] = bytes[off];
    }
    return Error();
  }

  Control* control(int i) const {
    return reinterpret_cast<Control*>(static_cast<uint8_t*>(base_) +
                                      kHeaderBytes) +
           i;
  }
  // Rank i's slot of generation g (two slots per rank, alternating).
  uint8_t* slot(int i, uint64_t g) const {
    auto* data = reinterpret_cast<uint8_t*>(control(size()));
    return data +
           ((g % 2) * static_cast<size_t>(size()) + static_cast<size_t>(i)) *
               kBlockBytes;
  }

  static void write(PublishedOp& p, const Fingerprint& fp) {
    p.seq = fp.seq;
    p.count = fp.count;
    p.root = fp.root;
    p.op = static_cast<uint8_t>(fp.op);
    p.dtype = static_cast<uint8_t>(fp.dtype);
    p.reduceOp = static_cast<uint8_t>(fp.reduceOp);
  }

  static Fingerprint read(const PublishedOp& p) {
    Fingerprint fp;
    fp.seq = p.seq;
    fp.count = p.count;
    fp.root = p.root;
    fp.op = static_cast<OpType>(p.op);
    fp.dtype = static_cast<DType>(p.dtype);
    fp.reduceOp = static_cast<ReduceOp>(p.reduceOp);
    return fp;
  }

  void publish(const Fingerprint& fp, uint64_t g) {
    write(control(index_)->ops[g % 2], fp);
    control(index_)->arrived.store(g, std::memory_order_release);
  }

  Fingerprint published(int i, uint64_t g) const {
    return read(control(i)->ops[g % 2]);
  }

  // What rank index i started at `seq`, if still known: "; rank 1 ran ...".
  std::string startedAt(int i, uint64_t seq) const {
    const Control::Started& e = control(i)->started[seq % kStarted];
    if (e.seq.load(std::memory_order_acquire) != seq) {
      return "";
    }
    Fingerprint fp;
    fp.seq = seq;
    fp.count = e.count.load(std::memory_order_acquire);
    const uint64_t rest = e.rest.load(std::memory_order_acquire);
    if (e.seq.load(std::memory_order_acquire) != seq) {
      return "";
    }
    fp.op = static_cast<OpType>(rest & 0xff);
    fp.dtype = static_cast<DType>((rest >> 8) & 0xff);
    fp.reduceOp = static_cast<ReduceOp>((rest >> 16) & 0xff);
    fp.root = static_cast<int32_t>(static_cast<uint32_t>(rest >> 32));
    return "; rank " + std::to_string(ranks_[static_cast<size_t>(i)]) +
           " ran " + fp.toString();
  }

  // Waits for every rank's `arrived` to reach g, then compares their ops.
  Error waitArrivedAll(uint64_t g, Mesh& mesh, const Fingerprint& fp,
                       const Deadline& deadline) {
    if (Error e = waitFor(&Control::arrived, g, mesh, fp, deadline); !e.ok()) {
      return e;
    }
    for (int i = 0; i < size(); ++i) {
      if (Error e = checkSame(i, g, mesh, fp); !e.ok()) {
        return e;
      }
    }
    return Error();
  }

  Error waitArrived(int i, uint64_t g, Mesh& mesh, const Fingerprint& fp,
                    const Deadline& deadline) {
    if (Error e = waitOne(i, &Control::arrived, g, mesh, fp, deadline);
        !e.ok()) {
      return e;
    }
    return checkSame(i, g, mesh, fp);
  }

  Error checkSame(int i, uint64_t g, Mesh& mesh, const Fingerprint& fp) {
    const Fingerprint theirs = published(i, g);
    if (theirs == fp) {
      return Error();
    }
    std::string msg = mesh.description() + ": desync: rank " +
                      std::to_string(mesh.rank()) + " runs " + fp.toString() +
                      " but rank " +
                      std::to_string(ranks_[static_cast<size_t>(i)]) +
                      " runs " + theirs.toString();
    // At different sequence numbers: what each ran at the other's.
    if (theirs.seq != fp.seq) {
      msg += startedAt(i, fp.seq) + startedAt(index_, theirs.seq);
    }
    Error e(Code::kAborted, std::move(msg));
    mesh.abort(e);
    return e;
  }

  // Up to kSmallBytes: every rank copies its block in, and every rank
  // reduces all of them in rank order (the same bits everywhere). The
  // block is elements [at, at + n) of `data`.
  Error smallBlock(Mesh& mesh, const Fingerprint& fp, const Deadline& deadline,
                   const Pieces& data, size_t at, size_t n, int64_t divisor) {
    const size_t es = elementSize(fp.dtype);
    const uint64_t g = ++gen_;
    if (Error e = waitFor(&Control::released, g - 2, mesh, fp, deadline);
        !e.ok()) {
      return e;
    }
    data.copyOut(at, n, slot(index_, g));
    publish(fp, g);
    if (Error e = waitArrivedAll(g, mesh, fp, deadline); !e.ok()) {
      return e;
    }
    size_t done = 0;  // elements of the block before this piece
    data.forEach(at, n, [&](uint8_t* out, size_t k) {
      const size_t skip = done * es;
      reduceThreeWay(out, slot(0, g) + skip, slot(1, g) + skip, k, fp.dtype,
                     fp.reduceOp);
      for (int i = 2; i < size(); ++i) {
        reduceInto(out, slot(i, g) + skip, k, fp.dtype, fp.reduceOp);
      }
      if (divisor != 1) {
        divideBy(out, k, fp.dtype, divisor);
      }
      done += k;
    });
    control(index_)->reduced.store(g, std::memory_order_release);
    control(index_)->released.store(g, std::memory_order_release);
    return Error();
  }

  // Rank i reduces part i of the block (its own part from `data`, the
  // others' from their slots) and publishes it in its slot; then everyone
  // (or only the leader) copies the parts in. The block is elements
  // [at, at + n) of `data`.
  Error largeBlock(Mesh& mesh, const Fingerprint& fp, const Deadline& deadline,
                   const Pieces& data, size_t at, size_t n, bool everyoneGetsIt,
                   int64_t divisor) {
    const size_t es = elementSize(fp.dtype);
    const int L = size();
    const auto part = [&](int i) {
      const size_t base = n / static_cast<size_t>(L);
      const size_t rem = n % static_cast<size_t>(L);
      const auto ui = static_cast<size_t>(i);
      return std::make_pair(ui * base + std::min(ui, rem),
                            base + (ui < rem ? 1 : 0));
    };
    const uint64_t g = ++gen_;
    if (Error e = waitFor(&Control::released, g - 2, mesh, fp, deadline);
        !e.ok()) {
      return e;
    }
    uint8_t* mine = slot(index_, g);
    for (int i = 0; i < L; ++i) {
      if (i != index_) {
        const auto [off, len] = part(i);
        data.copyOut(at + off, len, mine + off * es);
      }
    }
    publish(fp, g);
    if (Error e = waitArrivedAll(g, mesh, fp, deadline); !e.ok()) {
      return e;
    }
    // Only this rank reduces its part, so every rank gets the same bits
    // whatever the order of the folds.
    const auto [off, len] = part(index_);
    size_t done = off;  // elements of the block before this piece
    data.forEach(at + off, len, [&](uint8_t* out, size_t k) {
      for (int i = 0; i < L; ++i) {
        if (i != index_) {
          reduceInto(out, slot(i, g) + done * es, k, fp.dtype, fp.reduceOp);
        }
      }
      if (divisor != 1) {
        divideBy(out, k, fp.dtype, divisor);
      }
      copy(mine + done * es, out, k * es);
      done += k;
    });
    control(index_)->reduced.store(g, std::memory_order_release);
    if (everyoneGetsIt || index_ == 0) {
      if (Error e = waitFor(&Control::reduced, g, mesh, fp, deadline);
          !e.ok()) {
        return e;
      }
      for (int i = 0; i < L; ++i) {
        if (i != index_) {
          const auto [o, l] = part(i);
          data.copyIn(at + o, l, slot(i, g) + o * es);
        }
      }
    }
    control(index_)->released.store(g, std::memory_order_release);
    return Error();
  }

  Error waitFor(std::atomic<uint64_t> Control::*counter, uint64_t g, Mesh& mesh,
                const Fingerprint& fp, const Deadline& deadline) {
    for (int i = 0; i < size(); ++i) {
      if (i != index_) {
        if (Error e = waitOne(i, counter, g, mesh, fp, deadline); !e.ok()) {
          return e;
        }
      }
    }
    return Error();
  }

  // Polls for the spin budget, then yields, then sleeps in short naps (a
  // rank that waits long for a late peer does not burn a core); checks
  // the mesh and the deadline between polls.
  Error waitOne(int i, std::atomic<uint64_t> Control::*counter, uint64_t g,
                Mesh& mesh, const Fingerprint& fp, const Deadline& deadline) {
    const std::atomic<uint64_t>& c = control(i)->*counter;
    if (c.load(std::memory_order_acquire) >= g) {
      return Error();
    }
    const auto start = Clock::now();
    const auto spinUntil = start + spinBudget();
    const auto yieldUntil = start + std::chrono::milliseconds(2);
    for (uint32_t round = 1;; ++round) {
      if (c.load(std::memory_order_acquire) >= g) {
        return Error();
      }
      if (round % 64 != 0) {
        continue;
      }
      const auto now = Clock::now();
      if (now < spinUntil) {
        continue;
      }
      // Each failure is checked against the counter once more: this thread
      // may have been off its core between reading the counter and reading
      // the failure, and a peer that got there and then left (its group
      // destroyed once its last op was done) is not a failure of this op.
      const auto arrived = [&] {
        return c.load(std::memory_order_acquire) >= g;
      };
      if (Error e = mesh.error(); !e.ok()) {
        return arrived() ? Error() : e;
      }
      if (Error e = mesh.linkError(ranks_[static_cast<size_t>(i)]); !e.ok()) {
        if (arrived()) {
          return Error();
        }
        mesh.abort(withOthersGone(i, counter, g, mesh, e));
        return mesh.error();
      }
      if (deadline.expired() && !arrived()) {
        Error e = Error::timeout(
            mesh.description() + ": rank " + std::to_string(mesh.rank()) +
            " timed out in " + fp.toString() + " waiting for rank " +
            std::to_string(ranks_[static_cast<size_t>(i)]) +
            " on its host (shared memory)");
        mesh.abort(e);
        return e;
      }
      if (now < yieldUntil) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }

  // A dead peer on a host rarely dies alone (a host's ranks go together; a
  // job is ended rank by rank), and the transport sees each one's pipe
  // close on its own: before failing on peer `i`, wait a moment for the
  // others of this host that have not reached generation `g` either, and
  // name each that turns out to be gone, not only the one waited for.
  Error withOthersGone(int i, std::atomic<uint64_t> Control::*counter,
                       uint64_t g, Mesh& mesh, const Error& first) {
    std::vector<int> suspects;  // indices on this host, not arrived
    for (int j = 0; j < size(); ++j) {
      if (j != index_ && j != i &&
          (control(j)->*counter).load(std::memory_order_acquire) < g) {
        suspects.push_back(j);
      }
    }
    std::string also;
    const auto until = Clock::now() + std::chrono::milliseconds(100);
    while (!suspects.empty()) {
      for (auto it = suspects.begin(); it != suspects.end();) {
        const int rank = ranks_[static_cast<size_t>(*it)];
        if (Error e = mesh.linkError(rank); !e.ok()) {
          also += "; rank " + std::to_string(rank) +
                  " of this host is gone too: " + e.message();
          it = suspects.erase(it);
        } else {
          ++it;
        }
      }
      if (suspects.empty() || Clock::now() >= until) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return also.empty() ? first : Error(first.code(), first.message() + also);
  }

  std::vector<int> ranks_;
  int index_;
  int fd_ = -1;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  // The last generation this rank started; every rank of the host runs
  // the same sequence.
  uint64_t gen_ = kFirstGeneration - 1;
};

// ---- HostShm ---------------------------------------------------------------

std::unique_ptr<HostShm> HostShm::create(store::Store& store, Mesh& mesh,
                                         const HostLayout& layout,
                                         Duration timeout, bool* everyHost) {
  *everyHost = false;
  const Deadline deadline = Deadline::fromTimeout(timeout);
  const int rank = mesh.rank();
  const auto& ranks =
      layout
          .ranks[static_cast<size_t>(layout.hostOf[static_cast<size_t>(rank)])];
  const int index = static_cast<int>(
      std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  std::unique_ptr<Impl> impl;
  Error failed;
  if (ranks.size() > 1) {
    impl = std::make_unique<Impl>(ranks, index);
    if (index == 0) {
      std::string record;
      failed = impl->createSegment(&record);
      store.set(segmentKeyName(rank), failed.ok() ? record : "none");
    } else {
      waitKeys(
          store, mesh, {segmentKeyName(ranks.front())}, deadline,
          "rank " + std::to_string(ranks.front()) + "'s shared-memory segment");
      const std::string record =
          asString(store.multiGet({segmentKeyName(ranks.front())}).front());
      failed = record == "none"
                   ? Error(Code::kUnavailable,
                           "rank " + std::to_string(ranks.front()) +
                               " could not create it")
                   : impl->openSegment(record);
    }
  }
  // Everyone agrees: shared memory on every host, or on none.
  store.set(statusKeyName(rank), failed.ok() ? "ok" : failed.message());
  std::vector<std::string> names;
  for (int r = 0; r < mesh.size(); ++r) {
    names.push_back(statusKeyName(r));
  }
  waitKeys(store, mesh, names, deadline, "every rank's shared-memory setup");
  const auto statuses = store.multiGet(names);
  for (size_t r = 0; r < statuses.size(); ++r) {
    const std::string s = asString(statuses[r]);
    if (s != "ok") {
      if (rank == 0 || static_cast<int>(r) == rank) {
        TRELLIS_LOG_WARN(
            "{}: rank {} could not set up shared memory with the ranks of "
            "its host ({}); every rank reduces over the network instead",
            mesh.description(), r, s);
      }
      return nullptr;
    }
  }
  *everyHost = true;
  if (impl == nullptr) {
    return nullptr;
  }
  impl->closeDescriptor();
  return std::unique_ptr<HostShm>(new HostShm(std::move(impl)));
}

HostShm::HostShm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostShm::~HostShm() = default;

int HostShm::localSize() const { return impl_->size(); }
void HostShm::noteStarted(const Fingerprint& fp) { impl_->noteStarted(fp); }
int HostShm::localIndex() const { return impl_->index(); }

size_t Pieces::count() const {
  size_t n = 0;
  for (const Piece& p : pieces) {
    n += p.count;
  }
  return n;
}

void Pieces::copyOut(size_t offset, size_t count, uint8_t* to) const {
  forEach(offset, count, [&](const uint8_t* p, size_t k) {
    std::memcpy(to, p, k * elementSize);
    to += k * elementSize;
  });
}

void Pieces::copyIn(size_t offset, size_t count, const uint8_t* from) const {
  forEach(offset, count, [&](uint8_t* p, size_t k) {
    std::memcpy(p, from, k * elementSize);
    from += k * elementSize;
  });
}

namespace {
Pieces onePiece(const Fingerprint& fp, uint8_t* data, size_t count) {
  return Pieces{.pieces = {{data, count}},
                .elementSize = elementSize(fp.dtype)};
}
}  // namespace

Error HostShm::allreduce(Mesh& mesh, const Fingerprint& fp,
                         const Deadline& deadline, uint8_t* data, size_t count,
                         int64_t divisor) {
  return impl_->allreduce(mesh, fp, deadline, onePiece(fp, data, count), true,
                          divisor);
}

Error HostShm::allreduce(Mesh& mesh, const Fingerprint& fp,
                         const Deadline& deadline, const Pieces& pieces,
                         int64_t divisor) {
  return impl_->allreduce(mesh, fp, deadline, pieces, true, divisor);
}

Error HostShm::reduceToLeader(Mesh& mesh, const Fingerprint& fp,
                              const Deadline& deadline, uint8_t* data,
                              size_t count) {
  return impl_->allreduce(mesh, fp, deadline, onePiece(fp, data, count), false,
                          1);
}

Error HostShm::broadcastFromLeader(Mesh& mesh, const Fingerprint& fp,
                                   const Deadline& deadline, uint8_t* data,
                                   size_t bytes) {
  return impl_->broadcast(mesh, fp, deadline, data, bytes);
}

}  // namespace trellis::collectives::detail
