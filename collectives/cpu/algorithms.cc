#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <trellis/collectives/cpu/algorithms.h>
#include <trellis/collectives/reduce_kernels.h>
#include <trellis/core/check.h>
#include <trellis/core/mutex.h>

namespace trellis::collectives::detail {

namespace {

// Bound on the wait for callbacks after the mesh was aborted: closing the
// pipes ends every read and write, so this only guards against a bug.
constexpr auto kDrainTime = std::chrono::seconds(30);

int mod(int a, int n) { return ((a % n) + n) % n; }

// One round of sends and receives, waited for together.
class Exchange {
 public:
  explicit Exchange(AlgoContext& c) : c_(c), st_(std::make_shared<State>()) {}
  ~Exchange() {
    TRELLIS_DCHECK(idle(), "an Exchange was destroyed with operations posted");
  }
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  // `peer`: an index into the context's team.
  void send(int peer, uint32_t step, const void* data, size_t bytes) {
    const int to = c_.meshRank(peer);
    add(to, false);
    c_.mesh.sendCollective(to, c_.fp, step, data, bytes, done(to, false));
  }
  // Returns the receive's number, for waitReceived().
  size_t recv(int peer, uint32_t step, void* data, size_t bytes) {
    const int from = c_.meshRank(peer);
    size_t id = 0;
    {
      MutexLock lock(st_->mu);
      id = st_->received.size();
      st_->received.push_back(false);
    }
    add(from, true);
    c_.mesh.recvCollective(from, c_.fp, step, data, bytes,
                           done(from, true, id));
    return id;
  }

  // Waits until receive `id` arrived, so its data can be used while the
  // rest is still in flight. Once anything failed, or at the deadline,
  // this is wait(): the error, after every callback fired.
  Error waitReceived(size_t id) {
    {
      MutexLock lock(st_->mu);
      while (!st_->received[id] && st_->first.ok()) {
        if (!st_->cv.waitUntil(st_->mu, c_.deadline.timePoint())) {
          break;
        }
      }
      if (st_->received[id] && st_->first.ok()) {
        return Error();
      }
    }
    Error e = wait();
    return e.ok() ? Error::internal("a receive ended without its callback") : e;
  }

  // Waits for everything posted. At the deadline the group is aborted with
  // a TimeoutError naming what this rank still waited for; the buffers are
  // released only once every callback has fired.
  Error wait() {
    MutexLock lock(st_->mu);
    while (st_->pending > 0) {
      if (!st_->cv.waitUntil(st_->mu, c_.deadline.timePoint())) {
        break;
      }
    }
    if (st_->pending == 0) {
      return st_->first;
    }
    const std::string waiting = describeWaiting();
    st_->mu.unlock();
    c_.mesh.abort(Error::timeout(
        c_.mesh.description() + ": rank " + std::to_string(c_.mesh.rank()) +
        " timed out in " + c_.fp.toString() + " waiting for " + waiting));
    st_->mu.lock();
    const auto until = Clock::now() + kDrainTime;
    while (st_->pending > 0 && st_->cv.waitUntil(st_->mu, until)) {
    }
    TRELLIS_CHECK(st_->pending == 0,
                  "collective buffers still borrowed by the transport 30 s "
                  "after the group was aborted");
    return st_->first.ok() ? c_.mesh.error() : st_->first;
  }

 private:
  struct State {
    Mutex mu;
    CondVar cv;
    int pending TRELLIS_GUARDED_BY(mu) = 0;
    Error first TRELLIS_GUARDED_BY(mu);
    // (peer, is receive) of every operation not yet called back.
    std::vector<std::pair<int, bool>> open TRELLIS_GUARDED_BY(mu);
    // Per receive, in posting order: its callback fired without error.
    std::vector<bool> received TRELLIS_GUARDED_BY(mu);
  };

  bool idle() {
    MutexLock lock(st_->mu);
    return st_->pending == 0;
  }

  void add(int peer, bool isRecv) {
    MutexLock lock(st_->mu);
    ++st_->pending;
    st_->open.emplace_back(peer, isRecv);
  }

  Mesh::Callback done(int peer, bool isRecv, size_t id = 0) {
    return [st = st_, peer, isRecv, id](const Error& e) {
      MutexLock lock(st->mu);
      if (!e.ok() && st->first.ok()) {
        st->first = e;
      }
      if (isRecv && e.ok()) {
        st->received[id] = true;
        st->cv.notifyAll();
      }
      for (auto it = st->open.begin(); it != st->open.end(); ++it) {
        if (*it == std::make_pair(peer, isRecv)) {
          st->open.erase(it);
          break;
        }
      }
      if (--st->pending == 0) {
        st->cv.notifyAll();
      }
    };
  }

  std::string describeWaiting() TRELLIS_REQUIRES(st_->mu) {
    std::string recvs, sends;
    for (const auto& [peer, isRecv] : st_->open) {
      std::string& s = isRecv ? recvs : sends;
      s += (s.empty() ? "" : ", ") + std::to_string(peer);
    }
    std::string out;
    if (!recvs.empty()) {
      out = "data from rank(s) " + recvs;
    }
    if (!sends.empty()) {
      out += (out.empty() ? "" : " and ") + std::string("rank(s) ") + sends +
             " to take its data";
    }
    return out;
  }

  AlgoContext& c_;
  std::shared_ptr<State> st_;
};

size_t chunkCount(size_t count, int n, int c) {
  const size_t base = count / static_cast<size_t>(n);
  const size_t rem = count % static_cast<size_t>(n);
  return base + (static_cast<size_t>(c) < rem ? 1 : 0);
}
size_t chunkOffset(size_t count, int n, int c) {
  const size_t base = count / static_cast<size_t>(n);
  const size_t rem = count % static_cast<size_t>(n);
  const size_t uc = static_cast<size_t>(c);
  return uc * base + std::min(uc, rem);
}

// A ring step's chunk travels in pieces of about kPieceBytes, so that the
// receiver reduces each piece while the next ones are still on the wire.
// Both ends split a chunk the same way: by its element count alone.
constexpr size_t kPieceBytes = 2 * 1024 * 1024;

size_t pieceCount(size_t count, size_t elementBytes) {
  const size_t perPiece = std::max<size_t>(1, kPieceBytes / elementBytes);
  return std::max<size_t>(1, (count + perPiece - 1) / perPiece);
}

// Reduce-scatter around the ring over `count` elements at `data` in place,
// split into size() chunks: rank r ends holding chunk r reduced over every
// rank. Steps 0..n-2.
Error ringReduceScatter(AlgoContext& c, uint8_t* data, size_t count,
                        uint8_t* tmp) {
  const int n = c.size();
  const int r = c.rank();
  const size_t es = elementSize(c.fp.dtype);
  const int right = mod(r + 1, n);
  const int left = mod(r - 1, n);
  for (int s = 0; s < n - 1; ++s) {
    const auto step = static_cast<uint32_t>(s);
    const int sendC = mod(r - s - 1, n);
    const int recvC = mod(r - s - 2, n);
    const size_t sendCount = chunkCount(count, n, sendC);
    const size_t recvCount = chunkCount(count, n, recvC);
    uint8_t* sendAt = data + chunkOffset(count, n, sendC) * es;
    uint8_t* recvAt = data + chunkOffset(count, n, recvC) * es;
    Exchange ex(c);
    const size_t sendPieces = pieceCount(sendCount, es);
    for (size_t p = 0; p < sendPieces; ++p) {
      const size_t off = chunkOffset(sendCount, static_cast<int>(sendPieces),
                                     static_cast<int>(p));
      ex.send(right, step, sendAt + off * es,
              chunkCount(sendCount, static_cast<int>(sendPieces),
                         static_cast<int>(p)) *
                  es);
    }
    const size_t recvPieces = pieceCount(recvCount, es);
    std::vector<size_t> ids;
    for (size_t p = 0; p < recvPieces; ++p) {
      const size_t off = chunkOffset(recvCount, static_cast<int>(recvPieces),
                                     static_cast<int>(p));
      ids.push_back(ex.recv(left, step, tmp + off * es,
                            chunkCount(recvCount, static_cast<int>(recvPieces),
                                       static_cast<int>(p)) *
                                es));
    }
    for (size_t p = 0; p < recvPieces; ++p) {
      if (Error e = ex.waitReceived(ids[p]); !e.ok()) {
        return e;
      }
      const size_t off = chunkOffset(recvCount, static_cast<int>(recvPieces),
                                     static_cast<int>(p));
      reduceInto(recvAt + off * es, tmp + off * es,
                 chunkCount(recvCount, static_cast<int>(recvPieces),
                            static_cast<int>(p)),
                 c.fp.dtype, c.fp.reduceOp);
    }
    if (Error e = ex.wait(); !e.ok()) {
      return e;
    }
  }
  return Error();
}

Error ringAllreduce(AlgoContext& c, uint8_t* data, size_t count) {
  const int n = c.size();
  const int r = c.rank();
  const size_t es = elementSize(c.fp.dtype);
  uint8_t* tmp = c.scratch.get(chunkCount(count, n, 0) * es);
  if (Error e = ringReduceScatter(c, data, count, tmp); !e.ok()) {
    return e;
  }
  const int right = mod(r + 1, n);
  const int left = mod(r - 1, n);
  for (int s = 0; s < n - 1; ++s) {
    const int sendC = mod(r - s, n);
    const int recvC = mod(r - s - 1, n);
    Exchange ex(c);
    ex.send(right, static_cast<uint32_t>(n - 1 + s),
            data + chunkOffset(count, n, sendC) * es,
            chunkCount(count, n, sendC) * es);
    ex.recv(left, static_cast<uint32_t>(n - 1 + s),
            data + chunkOffset(count, n, recvC) * es,
            chunkCount(count, n, recvC) * es);
    if (Error e = ex.wait(); !e.ok()) {
      return e;
    }
  }
  return Error();
}

// Recursive doubling among the largest power of two p2 <= n; ranks p2..n-1
// first fold their data into rank - p2 and get the result back at the end.
Error recursiveDoubling(AlgoContext& c, uint8_t* data, size_t count) {
  const int n = c.size();
  const int r = c.rank();
  const size_t bytes = count * elementSize(c.fp.dtype);
  int p2 = 1;
  while (p2 * 2 <= n) {
    p2 *= 2;
  }
  const int extra = n - p2;
  const uint32_t lastStep = 1000;
  uint8_t* tmp = c.scratch.get(bytes);
  if (r >= p2) {
    Exchange ex(c);
    ex.send(r - p2, 0, data, bytes);
    ex.recv(r - p2, lastStep, data, bytes);
    return ex.wait();
  }
  if (r < extra) {
    Exchange ex(c);
    ex.recv(r + p2, 0, tmp, bytes);
    if (Error e = ex.wait(); !e.ok()) {
      return e;
    }
    reduceInto(data, tmp, count, c.fp.dtype, c.fp.reduceOp);
  }
  uint32_t step = 1;
  for (int mask = 1; mask < p2; mask <<= 1, ++step) {
    const int partner = r ^ mask;
    Exchange ex(c);
    ex.send(partner, step, data, bytes);
    ex.recv(partner, step, tmp, bytes);
    if (Error e = ex.wait(); !e.ok()) {
      return e;
    }
    reduceInto(data, tmp, count, c.fp.dtype, c.fp.reduceOp);
  }
  if (r < extra) {
    Exchange ex(c);
    ex.send(r + p2, lastStep, data, bytes);
    return ex.wait();
  }
  return Error();
}

// Ring or recursive doubling among the team, by size unless forced.
Error flatAllreduce(AlgoContext& c, uint8_t* p, size_t count) {
  const size_t bytes = count * elementSize(c.fp.dtype);
  bool ring = bytes > kSmallAllreduceBytes;
  if (c.algo == AllreduceAlgo::kRing ||
      c.algo == AllreduceAlgo::kRecursiveDoubling) {
    ring = c.algo == AllreduceAlgo::kRing;
  }
  return ring ? ringAllreduce(c, p, count) : recursiveDoubling(c, p, count);
}

// Reduce on each host in shared memory, allreduce among one leader per
// host over the mesh, broadcast on each host. One host: shared memory only.
Error hierarchicalAllreduce(AlgoContext& c, uint8_t* p, size_t count) {
  const HostLayout& hosts = *c.hosts;
  if (hosts.hostCount() == 1) {
    return c.shm->allreduce(c.mesh, c.fp, c.deadline, p, count);
  }
  if (c.shm != nullptr) {
    if (Error e = c.shm->reduceToLeader(c.mesh, c.fp, c.deadline, p, count);
        !e.ok()) {
      return e;
    }
  }
  if (c.shm == nullptr || c.shm->localIndex() == 0) {
    AlgoContext leaders = c;
    leaders.setTeam(hosts.leaders());
    if (Error e = flatAllreduce(leaders, p, count); !e.ok()) {
      return e;
    }
  }
  if (c.shm != nullptr) {
    return c.shm->broadcastFromLeader(c.mesh, c.fp, c.deadline, p,
                                      count * elementSize(c.fp.dtype));
  }
  return Error();
}

}  // namespace

int AlgoContext::size() const {
  return team.empty() ? mesh.size() : static_cast<int>(team.size());
}

int AlgoContext::rank() const { return team.empty() ? mesh.rank() : teamIndex; }

int AlgoContext::meshRank(int index) const {
  return team.empty() ? index : team[static_cast<size_t>(index)];
}

void AlgoContext::setTeam(std::vector<int> ranks) {
  team = std::move(ranks);
  const auto it = std::find(team.begin(), team.end(), mesh.rank());
  TRELLIS_CHECK(it != team.end(), "a team without this rank");
  teamIndex = static_cast<int>(it - team.begin());
}

uint8_t* Scratch::get(size_t bytes) {
  if (buf_.size() < bytes) {
    buf_.resize(bytes);
  }
  return buf_.data();
}

AllreduceAlgo allreduceAlgoFromEnvironment() {
  const char* v = std::getenv("TRELLIS_COLLECTIVES_ALGO");
  if (v == nullptr || *v == '\0' || std::string_view(v) == "auto") {
    return AllreduceAlgo::kAuto;
  }
  if (std::string_view(v) == "ring") {
    return AllreduceAlgo::kRing;
  }
  if (std::string_view(v) == "rd") {
    return AllreduceAlgo::kRecursiveDoubling;
  }
  if (std::string_view(v) == "hier") {
    return AllreduceAlgo::kHierarchical;
  }
  throwError(Error::invalidArgument("TRELLIS_COLLECTIVES_ALGO='" +
                                    std::string(v) +
                                    "' is not one of auto, ring, rd, hier"));
}

namespace {
bool forcedFlat(const AlgoContext& c) {
  return c.algo == AllreduceAlgo::kRing ||
         c.algo == AllreduceAlgo::kRecursiveDoubling;
}
// The whole group on this host, reducing in its segment: the rank that
// reduces a part of each block also divides it (kAvg) while it is in
// cache, rather than every rank dividing the whole buffer once more after.
bool wholeGroupInSegment(const AlgoContext& c) {
  return c.size() > 1 && !forcedFlat(c) && c.hosts != nullptr &&
         c.hosts->hostCount() == 1 && c.team.empty();
}
int64_t segmentDivisor(const AlgoContext& c) {
  return c.fp.reduceOp == ReduceOp::kAvg ? c.size() : 1;
}
}  // namespace

Error allreduce(AlgoContext& c, void* data, size_t count) {
  const int n = c.size();
  auto* p = static_cast<uint8_t*>(data);
  if (wholeGroupInSegment(c)) {
    return c.shm->allreduce(c.mesh, c.fp, c.deadline, p, count,
                            segmentDivisor(c));
  }
  if (n > 1) {
    Error e = c.hosts != nullptr && !forcedFlat(c)
                  ? hierarchicalAllreduce(c, p, count)
                  : flatAllreduce(c, p, count);
    if (!e.ok()) {
      return e;
    }
  }
  if (c.fp.reduceOp == ReduceOp::kAvg) {
    divideBy(p, count, c.fp.dtype, n);
  }
  return Error();
}

Error allreduce(AlgoContext& c, const Pieces& tensors,
                std::vector<uint8_t>& packed) {
  if (wholeGroupInSegment(c)) {
    return c.shm->allreduce(c.mesh, c.fp, c.deadline, tensors,
                            segmentDivisor(c));
  }
  const size_t total = tensors.count();
  const size_t es = tensors.elementSize;
  if (packed.size() < total * es) {
    packed.resize(total * es);
  }
  tensors.copyOut(0, total, packed.data());
  if (Error e = allreduce(c, packed.data(), total); !e.ok()) {
    return e;
  }
  tensors.copyIn(0, total, packed.data());
  return Error();
}

Error broadcast(AlgoContext& c, void* data, size_t bytes) {
  const int n = c.size();
  const int root = c.fp.root;
  const int vr = mod(c.rank() - root, n);
  int mask = 1;
  while (mask < n) {
    if (vr & mask) {
      Exchange ex(c);
      ex.recv(mod(vr - mask + root, n), 0, data, bytes);
      if (Error e = ex.wait(); !e.ok()) {
        return e;
      }
      break;
    }
    mask <<= 1;
  }
  Exchange ex(c);
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (vr + mask < n) {
      ex.send(mod(vr + mask + root, n), 0, data, bytes);
    }
  }
  return ex.wait();
}

Error reduce(AlgoContext& c, void* data, size_t count) {
  const int n = c.size();
  const int root = c.fp.root;
  const int vr = mod(c.rank() - root, n);
  const size_t bytes = count * elementSize(c.fp.dtype);
  // Non-roots keep their input: they accumulate in scratch.
  uint8_t* region = c.scratch.get(2 * bytes);
  uint8_t* tmp = region;
  uint8_t* acc = vr == 0 ? static_cast<uint8_t*>(data) : region + bytes;
  if (vr != 0 && bytes > 0) {
    std::memcpy(acc, data, bytes);
  }
  for (int mask = 1; mask < n; mask <<= 1) {
    if (vr & mask) {
      Exchange ex(c);
      ex.send(mod(vr - mask + root, n), 0, acc, bytes);
      return ex.wait();
    }
    if (vr + mask < n) {
      Exchange ex(c);
      ex.recv(mod(vr + mask + root, n), 0, tmp, bytes);
      if (Error e = ex.wait(); !e.ok()) {
        return e;
      }
      reduceInto(acc, tmp, count, c.fp.dtype, c.fp.reduceOp);
    }
  }
  if (c.fp.reduceOp == ReduceOp::kAvg) {
    divideBy(acc, count, c.fp.dtype, n);
  }
  return Error();
}

Error allgather(AlgoContext& c, const void* input, size_t bytes,
                std::span<void* const> outputs) {
  const int n = c.size();
  const int r = c.rank();
  auto* own = outputs[static_cast<size_t>(r)];
  if (own != input && bytes > 0) {
    std::memcpy(own, input, bytes);
  }
  const int right = mod(r + 1, n);
  const int left = mod(r - 1, n);
  for (int s = 0; s < n - 1; ++s) {
    Exchange ex(c);
    ex.send(right, static_cast<uint32_t>(s),
            outputs[static_cast<size_t>(mod(r - s, n))], bytes);
    ex.recv(left, static_cast<uint32_t>(s),
            outputs[static_cast<size_t>(mod(r - s - 1, n))], bytes);
    if (Error e = ex.wait(); !e.ok()) {
      return e;
    }
  }
  return Error();
}

Error gather(AlgoContext& c, const void* input, size_t bytes,
             std::span<void* const> outputs) {
  const int n = c.size();
  const int r = c.rank();
  Exchange ex(c);
  if (r != c.fp.root) {
    ex.send(c.fp.root, 0, input, bytes);
    return ex.wait();
  }
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) {
      if (outputs[static_cast<size_t>(r)] != input && bytes > 0) {
        std::memcpy(outputs[static_cast<size_t>(r)], input, bytes);
      }
    } else {
      ex.recv(peer, 0, outputs[static_cast<size_t>(peer)], bytes);
    }
  }
  return ex.wait();
}

Error scatter(AlgoContext& c, std::span<const void* const> inputs, void* output,
              size_t bytes) {
  const int n = c.size();
  const int r = c.rank();
  Exchange ex(c);
  if (r != c.fp.root) {
    ex.recv(c.fp.root, 0, output, bytes);
    return ex.wait();
  }
  for (int peer = 0; peer < n; ++peer) {
    if (peer == r) {
      if (inputs[static_cast<size_t>(r)] != output && bytes > 0) {
        std::memcpy(output, inputs[static_cast<size_t>(r)], bytes);
      }
    } else {
      ex.send(peer, 0, inputs[static_cast<size_t>(peer)], bytes);
    }
  }
  return ex.wait();
}

Error reduceScatter(AlgoContext& c, std::span<const void* const> inputs,
                    void* output, size_t count) {
  const int n = c.size();
  const int r = c.rank();
  const size_t bytes = count * elementSize(c.fp.dtype);
  const size_t total = bytes * static_cast<size_t>(n);
  uint8_t* work = c.scratch.get(total + bytes);
  uint8_t* tmp = work + total;
  for (int i = 0; i < n; ++i) {
    if (bytes > 0) {
      std::memcpy(work + bytes * static_cast<size_t>(i),
                  inputs[static_cast<size_t>(i)], bytes);
    }
  }
  if (Error e = ringReduceScatter(c, work, count * static_cast<size_t>(n), tmp);
      !e.ok()) {
    return e;
  }
  uint8_t* mine = work + bytes * static_cast<size_t>(r);
  if (c.fp.reduceOp == ReduceOp::kAvg) {
    divideBy(mine, count, c.fp.dtype, n);
  }
  if (bytes > 0) {
    std::memcpy(output, mine, bytes);
  }
  return Error();
}

Error alltoall(AlgoContext& c, const uint8_t* input,
               std::span<const size_t> inOffsets,
               std::span<const size_t> inLengths, uint8_t* output,
               std::span<const size_t> outOffsets,
               std::span<const size_t> outLengths) {
  const int n = c.size();
  const int r = c.rank();
  const auto ur = static_cast<size_t>(r);
  TRELLIS_DCHECK(inLengths[ur] == outLengths[ur],
                 "alltoall: own block sizes checked by the caller");
  if (inLengths[ur] > 0) {
    std::memmove(output + outOffsets[ur], input + inOffsets[ur], inLengths[ur]);
  }
  Exchange ex(c);
  for (int s = 1; s < n; ++s) {
    const auto to = static_cast<size_t>(mod(r + s, n));
    const auto from = static_cast<size_t>(mod(r - s, n));
    ex.send(static_cast<int>(to), 0, input + inOffsets[to], inLengths[to]);
    ex.recv(static_cast<int>(from), 0, output + outOffsets[from],
            outLengths[from]);
  }
  return ex.wait();
}

Error barrier(AlgoContext& c) {
  const int n = c.size();
  const int r = c.rank();
  uint32_t step = 0;
  for (int dist = 1; dist < n; dist <<= 1, ++step) {
    Exchange ex(c);
    ex.send(mod(r + dist, n), step, nullptr, 0);
    ex.recv(mod(r - dist, n), step, nullptr, 0);
    if (Error e = ex.wait(); !e.ok()) {
      return e;
    }
  }
  return Error();
}

}  // namespace trellis::collectives::detail
