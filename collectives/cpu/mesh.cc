#include <algorithm>
#include <cstring>
#include <deque>
#include <list>
#include <thread>
#include <vector>

#include <trellis/collectives/cpu/mesh.h>
#include <trellis/core/logging.h>
#include <trellis/core/mutex.h>
#include <trellis/core/net.h>
#include <trellis/core/pending_count.h>
#include <trellis/core/thread_name.h>
#include <trellis/core/worker_env.h>
#include <trellis/store/store.h>
#include <trellis/transport/context.h>

namespace trellis::collectives::detail {

namespace tp = trellis::transport;

namespace {

// How long a failing mesh waits for its abort messages to be written before
// it closes the pipes (which also ends reads into abandoned buffers).
constexpr auto kAbortFlushTime = std::chrono::seconds(1);
// How often connect() looks up from a store wait for a peer's refusal.
constexpr auto kStoreWaitSlice = std::chrono::milliseconds(250);

std::string addressKey(int rank) { return "addr/" + std::to_string(rank); }

// The descriptor must announce exactly the data the header says: one CPU
// tensor of `bytes` (none when empty), no payloads.
Error checkShape(const Header& h, const tp::Descriptor& d) {
  if (!d.payloadLengths.empty()) {
    return Error::protocol("carries " +
                           std::to_string(d.payloadLengths.size()) +
                           " payloads, expected none");
  }
  const bool data =
      h.kind == Header::Kind::kCollective || h.kind == Header::Kind::kP2P;
  const size_t want = data && h.bytes > 0 ? 1 : 0;
  if (d.tensors.size() != want) {
    return Error::protocol("carries " + std::to_string(d.tensors.size()) +
                           " tensors, expected " + std::to_string(want));
  }
  if (want == 1 && (d.tensors[0].length != h.bytes ||
                    d.tensors[0].device.type != tp::DeviceType::kCpu)) {
    return Error::protocol("announces " + std::to_string(h.bytes) +
                           " bytes but carries " +
                           std::to_string(d.tensors[0].length) + " on " +
                           d.tensors[0].device.toString());
  }
  return Error();
}

}  // namespace

class Mesh::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(int rank, int worldSize, MeshOptions options)
      : rank_(rank),
        size_(worldSize),
        options_(std::move(options)),
        links_(static_cast<size_t>(worldSize)) {}

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& description() const { return options_.description; }

  void start(store::Store& store) {
    tp::ContextOptions co;
    co.name = "pg" + std::to_string(rank_);
    co.token = options_.token;
    co.tokenFromEnvironment = !options_.token.has_value();
    co.handshakeTimeout = options_.initTimeout;
    ctx_ = tp::Context::create(co);
    const std::string host = net::chooseLocalAddress(
        options_.localAddress, masterFromEnvironment().addr);
    if (rank_ > 0) {
      listener_ = ctx_->listen({"uv://" + net::bracketIfIpv6(host) + ":0"});
      store.set(addressKey(rank_), listener_->address("uv"));
      acceptNext();
    } else {
      // Rank 0 connects to everyone and is connected to by nobody.
      store.set(addressKey(rank_), std::string_view("none"));
    }
    std::vector<std::string> keys;
    for (int peer = rank_ + 1; peer < size_; ++peer) {
      keys.push_back(addressKey(peer));
    }
    if (!keys.empty()) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
          options_.initTimeout);
      // In slices, so that a peer that already refused this rank (a world
      // size that disagrees) ends the wait with its reason.
      waitForKeys(
          store, keys, Deadline::fromTimeout(options_.initTimeout),
          [this] { return error(); },
          [&] {
            return Error::timeout(description() + ": " +
                                  missingPublishers(store, keys) + " within " +
                                  formatDuration(ms));
          });
      const auto addresses = store.multiGet(keys);
      for (int peer = rank_ + 1; peer < size_; ++peer) {
        const auto& a = addresses[static_cast<size_t>(peer - rank_ - 1)];
        auto pipe = ctx_->connect(std::string(a.begin(), a.end()));
        {
          MutexLock lock(mu_);
          links_[static_cast<size_t>(peer)].pipe = pipe;
        }
        sendHello(pipe);
        readNext(peer);
      }
    }
  }

  // Blocks until every peer said hello, the mesh failed, or the deadline.
  void waitConnected(Deadline deadline) {
    MutexLock lock(mu_);
    while (error_.ok() && hellos_ < size_ - 1) {
      if (!cv_.waitUntil(mu_, deadline.timePoint())) {
        break;
      }
    }
    if (!error_.ok()) {
      throwError(error_);
    }
    if (hellos_ < size_ - 1) {
      std::string missing;
      for (int peer = 0; peer < size_; ++peer) {
        if (peer != rank_ && !links_[static_cast<size_t>(peer)].helloDone) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(peer);
        }
      }
      throwError(
          Error::timeout(description() + ": rank " + std::to_string(rank_) +
                         " heard nothing from ranks " + missing + " within " +
                         formatDuration(options_.initTimeout)));
    }
  }

  void sendCollective(int peer, const Fingerprint& fp, uint32_t step,
                      const void* data, size_t bytes, Callback cb) {
    Header h;
    h.kind = Header::Kind::kCollective;
    h.fp = fp;
    h.step = step;
    h.bytes = bytes;
    write(peer, h, data, bytes, std::move(cb));
  }

  void sendTagged(int peer, int64_t tag, DType dtype, const void* data,
                  size_t bytes, Callback cb) {
    Header h;
    h.kind = Header::Kind::kP2P;
    h.tag = tag;
    h.fp.dtype = dtype;
    h.bytes = bytes;
    write(peer, h, data, bytes, std::move(cb));
  }

  void recvCollective(int peer, const Fingerprint& fp, uint32_t step,
                      void* data, size_t bytes, Callback cb) {
    PostedRecv p{fp, step, data, bytes, std::move(cb)};
    Error result;
    {
      MutexLock lock(mu_);
      if (!error_.ok()) {
        result = error_;
      } else {
        Link& link = links_[static_cast<size_t>(peer)];
        if (link.staged.empty() && !link.closed.ok()) {
          result = link.closed;
        } else if (link.staged.empty() || link.posted.size() > 0) {
          link.posted.push_back(std::move(p));
          return;
        }
      }
      if (result.ok()) {
        Link& link = links_[static_cast<size_t>(peer)];
        Staged s = std::move(link.staged.front());
        link.staged.pop_front();
        result = match(peer, p, s.header);
        if (result.ok() && s.header.bytes > 0) {
          std::memcpy(p.data, s.data.data(), s.header.bytes);
        }
        giveBackStaging(std::move(s.data));
      }
    }
    if (!result.ok()) {
      // A desync found in a staged message fails the group (no-op when the
      // error is the group's own).
      fail(result);
      result = error();
    }
    p.cb(result);
  }

  void recvTagged(int peer, int64_t tag, DType dtype, void* data, size_t bytes,
                  SourceCallback cb) {
    PostedTagged p{peer, tag, dtype, data, bytes, std::move(cb)};
    Error result;
    int source = -1;
    {
      MutexLock lock(mu_);
      auto it = stagedTagged_.begin();
      for (; it != stagedTagged_.end(); ++it) {
        if ((peer < 0 || it->source == peer) && it->header.tag == tag) {
          break;
        }
      }
      if (!error_.ok()) {
        result = error_;
      } else if (it == stagedTagged_.end() && peer >= 0 &&
                 !links_[static_cast<size_t>(peer)].closed.ok()) {
        result = links_[static_cast<size_t>(peer)].closed;
        source = peer;
      } else if (it == stagedTagged_.end()) {
        postedTagged_.push_back(std::move(p));
        return;
      } else {
        source = it->source;
        result = matchTagged(p, it->source, it->header);
        if (result.ok() && bytes > 0) {
          std::memcpy(data, it->data.data(), bytes);
        }
        stagedTagged_.erase(it);
      }
    }
    // A size or dtype mismatch fails this receive only: the message was
    // whole, so the stream is still in step.
    p.cb(result, source);
  }

  void abort(Error reason) { fail(std::move(reason), /*tellPeers=*/true); }

  void noteStarted(const Fingerprint& fp) {
    Error mismatch;
    {
      MutexLock lock(mu_);
      history_.push_back(fp);
      if (history_.size() > kHistory) {
        history_.pop_front();
      }
      // A peer's message for this sequence number that arrived before this
      // rank started it was staged unchecked; an algorithm that posts no
      // receive from that peer (the shared-memory path posts none) would
      // never look at it, so it is checked now.
      for (size_t peer = 0; peer < links_.size(); ++peer) {
        const Link& link = links_[peer];
        auto differs = [&](const Header& h) {
          return h.fp.seq == fp.seq && !(h.fp == fp);
        };
        const Header* h = nullptr;
        for (const Staged& st : link.staged) {
          if (differs(st.header)) {
            h = &st.header;
            break;
          }
        }
        if (h == nullptr && link.reading.into == Reading::Into::kStaged &&
            differs(link.reading.staged.header)) {
          h = &link.reading.staged.header;
        }
        if (h != nullptr) {
          mismatch =
              Error(Code::kAborted,
                    description() + ": desync: rank " + std::to_string(rank_) +
                        " runs " + fp.toString() + " but rank " +
                        std::to_string(peer) + " runs " + h->fp.toString());
          break;
        }
      }
    }
    if (!mismatch.ok()) {
      fail(std::move(mismatch));
    }
  }

  Error error() const {
    MutexLock lock(mu_);
    return error_;
  }

  Error linkError(int peer) const {
    MutexLock lock(mu_);
    return links_[static_cast<size_t>(peer)].closed;
  }

  bool inLoop() const { return ctx_ && ctx_->inLoop(); }

  // Fails everything, closes the context and waits for its loop (whose
  // callbacks are then all done).
  void shutdown() {
    // Peers still using the group then fail naming this rank, not with a
    // bare "connection closed".
    fail(Error::cancelled(description() + " was destroyed on rank " +
                          std::to_string(rank_)));
    if (closer_.joinable()) {
      closer_.join();
    }
    if (ctx_) {
      ctx_->close();
      if (!ctx_->join(std::chrono::seconds(30))) {
        TRELLIS_LOG_ERROR("{}: transport loop did not stop within 30 s",
                          description());
      }
    }
  }

 private:
  struct PostedRecv {
    Fingerprint fp;
    uint32_t step;
    void* data;
    size_t bytes;
    Callback cb;
  };
  struct Staged {
    Header header;
    // At least header.bytes (a reused buffer may be larger).
    std::vector<uint8_t> data;
  };
  struct PostedTagged {
    int peer;
    int64_t tag;
    DType dtype;
    void* data;
    size_t bytes;
    SourceCallback cb;
  };
  struct StagedTagged {
    int source;
    Header header;
    std::vector<uint8_t> data;
  };
  // What the read in flight on a link is filling.
  struct Reading {
    enum class Into {
      kNothing,
      kPosted,
      kStaged,
      kPostedTagged,
      kStagedTagged
    };
    Into into = Into::kNothing;
    PostedRecv posted;
    Staged staged;
    PostedTagged postedTagged;
    StagedTagged stagedTagged;
  };
  struct Link {
    std::shared_ptr<tp::Pipe> pipe;
    bool helloDone = false;
    // Set when the peer's stream ended or it destroyed its group.
    Error closed;
    std::deque<PostedRecv> posted;
    std::deque<Staged> staged;
    Reading reading;
  };

  static std::string formatDuration(Duration d) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d);
    if (ms.count() % 1000 == 0) {
      return std::to_string(ms.count() / 1000) + " s";
    }
    return std::to_string(ms.count()) + " ms";
  }

  std::string missingPublishers(store::Store& store,
                                const std::vector<std::string>& keys) {
    std::string out;
    int missing = 0;
    for (int peer = rank_ + 1; peer < size_; ++peer) {
      if (!store.check({addressKey(peer)})) {
        out += (out.empty() ? "" : ", ") + std::to_string(peer);
        ++missing;
      }
    }
    if (missing == 0) {
      return "the higher ranks (none missing now) did not publish their "
             "addresses";
    }
    return missing == 1 ? "rank " + out + " did not publish its address"
                        : "ranks " + out + " did not publish their addresses";
  }

  Header hello() const {
    Header h;
    h.kind = Header::Kind::kHello;
    h.rank = rank_;
    h.worldSize = size_;
    h.groupId = options_.groupId;
    return h;
  }

  void sendHello(const std::shared_ptr<tp::Pipe>& pipe) {
    tp::Message m;
    m.descriptor = encode(hello());
    auto self = shared_from_this();
    pipe->write(std::move(m), [self](const Error& e) {
      if (!e.ok()) {
        self->fail(e.withContext(self->description() + ": hello"));
      }
    });
  }

  Error checkHello(const Header& h, int expectedPeer) const {
    std::string what;
    if (h.kind != Header::Kind::kHello) {
      what = "its first message is not a hello";
    } else if (h.worldSize != size_) {
      return Error::invalidArgument(
          description() + ": world sizes disagree: rank " +
          std::to_string(rank_) + " has " + std::to_string(size_) + ", rank " +
          std::to_string(h.rank) + " has " + std::to_string(h.worldSize));
    } else if (h.groupId != options_.groupId) {
      return Error::invalidArgument(
          description() + ": rank " + std::to_string(h.rank) +
          " belongs to group '" + h.groupId + "', rank " +
          std::to_string(rank_) + " to '" + options_.groupId +
          "' (different ranks lists, or groups created in a different order)");
    } else if (expectedPeer >= 0 && h.rank != expectedPeer) {
      what = "it says it is rank " + std::to_string(h.rank) +
             " but was published as rank " + std::to_string(expectedPeer);
    } else if (expectedPeer < 0 && (h.rank < 0 || h.rank >= rank_)) {
      what = "rank " + std::to_string(h.rank) +
             " connected, but only ranks below " + std::to_string(rank_) +
             " connect to it";
    }
    if (what.empty()) {
      return Error();
    }
    return Error::protocol(description() + ": bad hello: " + what);
  }

  void acceptNext() {
    auto self = shared_from_this();
    listener_->accept([self](const Error& e, std::shared_ptr<tp::Pipe> pipe) {
      if (!e.ok()) {
        if (e.code() != Code::kCancelled) {
          self->fail(e.withContext(self->description() + ": accept"));
        }
        return;
      }
      pipe->readDescriptor([self, pipe](const Error& e, tp::Descriptor d) {
        self->onAcceptedHello(pipe, e, std::move(d));
      });
      self->acceptNext();
    });
  }

  void onAcceptedHello(const std::shared_ptr<tp::Pipe>& pipe, const Error& e,
                       tp::Descriptor d) {
    Header h;
    Error err = e;
    if (err.ok()) {
      err = decode(d.descriptor, &h);
    }
    if (err.ok()) {
      err = checkShape(h, d);
    }
    if (err.ok()) {
      err = checkHello(h, -1);
    }
    if (err.ok()) {
      MutexLock lock(mu_);
      Link& link = links_[static_cast<size_t>(h.rank)];
      if (link.pipe) {
        err = Error::protocol(description() + ": rank " +
                              std::to_string(h.rank) + " connected twice");
      } else {
        link.pipe = pipe;
        link.helloDone = true;
        ++hellos_;
        if (hellos_ == size_ - 1 || allLowerIn()) {
          listener_->close();
        }
      }
    }
    if (!err.ok()) {
      // A stranger's or a broken pipe: refuse it; the group goes on unless
      // the peer it claims to be never arrives (then connect times out).
      TRELLIS_LOG_WARN("{}: refused a connection from {}: {}", description(),
                       pipe->peerAddress(), err.what());
      if (err.code() == Code::kInvalidArgument) {
        // A member of the job that disagrees on the group: answer with this
        // rank's hello so it names the difference from its side too.
        sendHello(pipe);
        MutexLock lock(mu_);
        strays_.push_back(pipe);
      } else {
        pipe->close();
      }
      if (err.code() == Code::kInvalidArgument) {
        fail(err);
      }
      return;
    }
    cv_.notifyAll();
    sendHello(pipe);
    auto self = shared_from_this();
    const int peer = h.rank;
    pipe->read(tp::Allocation{}, [self, peer](const Error& e) {
      if (!e.ok()) {
        self->fail(self->peerError(peer, e));
        return;
      }
      self->readNext(peer);
    });
  }

  bool allLowerIn() const TRELLIS_REQUIRES(mu_) {
    for (int peer = 0; peer < rank_; ++peer) {
      if (!links_[static_cast<size_t>(peer)].pipe) {
        return false;
      }
    }
    return true;
  }

  std::shared_ptr<tp::Pipe> pipeOf(int peer) const {
    MutexLock lock(mu_);
    return links_[static_cast<size_t>(peer)].pipe;
  }

  void write(int peer, const Header& h, const void* data, size_t bytes,
             Callback cb) {
    Error e = error();
    std::shared_ptr<tp::Pipe> pipe;
    if (e.ok()) {
      pipe = pipeOf(peer);
      if (!pipe) {
        e = Error::internal(description() + ": no pipe to rank " +
                            std::to_string(peer));
      }
    }
    if (!e.ok()) {
      cb(e);
      return;
    }
    tp::Message m;
    m.descriptor = encode(h);
    if (bytes > 0) {
      m.tensors.push_back({data, bytes, tp::Device::cpu()});
    }
    auto self = shared_from_this();
    pipe->write(std::move(m), [self, peer, cb = std::move(cb)](const Error& e) {
      if (e.ok()) {
        cb(e);
        return;
      }
      self->fail(self->peerError(peer, e));
      cb(self->error());
    });
  }

  // Buffers for collective messages that arrive before their receive is
  // posted (common: a ring's next step from a peer that reduced faster),
  // kept for reuse: a fresh buffer faults in fresh pages, which this VM
  // does at a fraction of memcpy speed (DESIGN.md), and a ring stages
  // every step's chunk. The smallest that fits; a new one only when none
  // does. At most kSpareStaging are kept.
  std::vector<uint8_t> takeStaging(size_t bytes) TRELLIS_REQUIRES(mu_) {
    auto best = spareStaging_.end();
    for (auto it = spareStaging_.begin(); it != spareStaging_.end(); ++it) {
      if (it->size() >= bytes &&
          (best == spareStaging_.end() || it->size() < best->size())) {
        best = it;
      }
    }
    if (best == spareStaging_.end()) {
      return std::vector<uint8_t>(bytes);
    }
    std::vector<uint8_t> out = std::move(*best);
    spareStaging_.erase(best);
    return out;
  }

  void giveBackStaging(std::vector<uint8_t> buf) TRELLIS_REQUIRES(mu_) {
    if (buf.empty()) {
      return;
    }
    spareStaging_.push_back(std::move(buf));
    if (spareStaging_.size() > kSpareStaging) {
      // Drop the smallest: the large ones are the costly ones to fault in.
      auto smallest = std::min_element(
          spareStaging_.begin(), spareStaging_.end(),
          [](const auto& a, const auto& b) { return a.size() < b.size(); });
      spareStaging_.erase(smallest);
    }
  }

  void readNext(int peer) {
    auto pipe = pipeOf(peer);
    auto self = shared_from_this();
    pipe->readDescriptor([self, peer](const Error& e, tp::Descriptor d) {
      self->onDescriptor(peer, e, std::move(d));
    });
  }

  Error peerError(int peer, const Error& e) const {
    if (e.code() == Code::kUnavailable) {
      return Error::connection(
          description() + ": lost rank " + std::to_string(peer) +
          " (its process exited or closed the group): " + e.message());
    }
    return e.withContext(description() + ": pipe to rank " +
                         std::to_string(peer));
  }

  // The peer's stream ended between messages, or it destroyed its group:
  // what it sent before still counts (staged messages stay consumable), and
  // the group fails only when a receive from it can no longer be met.
  void closeLink(int peer, const Error& reason) {
    bool waiting = false;
    std::vector<SourceCallback> tagged;
    {
      MutexLock lock(mu_);
      Link& link = links_[static_cast<size_t>(peer)];
      if (!error_.ok() || !link.closed.ok()) {
        return;
      }
      link.closed = reason;
      waiting = !link.posted.empty();
      for (auto it = postedTagged_.begin(); it != postedTagged_.end();) {
        if (it->peer == peer) {
          tagged.push_back(std::move(it->cb));
          it = postedTagged_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& cb : tagged) {
      cb(reason, peer);
    }
    if (waiting) {
      fail(reason);
    }
  }

  void onDescriptor(int peer, const Error& e, tp::Descriptor d) {
    if (!e.ok()) {
      closeLink(peer, peerError(peer, e));
      return;
    }
    Header h;
    Error err = decode(d.descriptor, &h);
    if (err.ok()) {
      err = checkShape(h, d);
    }
    if (!err.ok()) {
      fail(Error::protocol(description() + ": rank " + std::to_string(peer) +
                           " sent a malformed message: " + err.message()));
      return;
    }
    auto pipe = pipeOf(peer);
    tp::Allocation alloc;
    std::vector<std::pair<Callback, Error>> toRun;
    switch (h.kind) {
      case Header::Kind::kHello: {
        Error he = checkHello(h, peer);
        bool again = false;
        {
          MutexLock lock(mu_);
          Link& link = links_[static_cast<size_t>(peer)];
          again = link.helloDone;
          if (he.ok() && !again) {
            link.helloDone = true;
            ++hellos_;
          }
        }
        if (he.ok() && again) {
          he = Error::protocol(description() + ": rank " +
                               std::to_string(peer) + " said hello twice");
        }
        if (!he.ok()) {
          fail(he);
          return;
        }
        cv_.notifyAll();
        break;
      }
      case Header::Kind::kAbort: {
        // `rank` is who gave up: the peer, or the rank whose abort the peer
        // relays.
        const int origin = h.rank >= 0 && h.rank < size_ ? h.rank : peer;
        std::string who = "rank " + std::to_string(origin) + " gave up";
        if (origin != peer) {
          who += " (relayed by rank " + std::to_string(peer) + ")";
        }
        Error reason(h.code,
                     description() + ": " + who + " on the group: " + h.reason);
        if (h.code == Code::kCancelled) {
          // It destroyed its group after its last op: not a failure yet.
          closeLink(peer, reason);
        } else {
          // Relayed to every other peer: one that waits on this rank (in
          // a segment, a ring) could otherwise see this rank leave before
          // the originator's own abort reaches it, and name this rank.
          const AbortNote relay{origin, h.code, h.reason};
          fail(reason, /*tellPeers=*/true, &relay);
        }
        return;
      }
      case Header::Kind::kCollective: {
        Error mismatch;
        {
          MutexLock lock(mu_);
          if (!error_.ok()) {
            return;
          }
          Link& link = links_[static_cast<size_t>(peer)];
          if (!link.posted.empty() && link.staged.empty()) {
            mismatch = match(peer, link.posted.front(), h);
            if (mismatch.ok()) {
              // From here a read into the receive's memory is under way:
              // fail() leaves the receive to onRead.
              link.reading.into = Reading::Into::kPosted;
              link.reading.posted = std::move(link.posted.front());
              link.posted.pop_front();
              alloc.tensors.push_back({link.reading.posted.data, h.bytes});
            }
            // Else the receive stays posted, and fail() fails it.
          } else {
            link.reading.into = Reading::Into::kStaged;
            link.reading.staged.header = h;
            // A message for a collective this rank already started (or
            // ran) as a different one is a desync now, before its data is
            // read: the sender may be gone by the time a receive from it
            // would be posted (recursive doubling's fold, say, posts none).
            for (const Fingerprint& f : history_) {
              if (f.seq == h.fp.seq && !(f == h.fp)) {
                mismatch = Error(
                    Code::kAborted,
                    description() + ": desync: rank " + std::to_string(rank_) +
                        " runs " + f.toString() + " but rank " +
                        std::to_string(peer) + " runs " + h.fp.toString());
              }
            }
            link.reading.staged.data = takeStaging(h.bytes);
            alloc.tensors.push_back({link.reading.staged.data.data(), h.bytes});
          }
        }
        if (!mismatch.ok()) {
          {
            MutexLock lock(mu_);
            links_[static_cast<size_t>(peer)].reading = Reading{};
          }
          fail(mismatch);
          return;
        }
        if (h.bytes == 0) {
          alloc.tensors.clear();
        }
        break;
      }
      case Header::Kind::kP2P: {
        MutexLock lock(mu_);
        if (!error_.ok()) {
          return;
        }
        Link& link = links_[static_cast<size_t>(peer)];
        auto it = postedTagged_.begin();
        for (; it != postedTagged_.end(); ++it) {
          if ((it->peer < 0 || it->peer == peer) && it->tag == h.tag) {
            break;
          }
        }
        Error bad;
        if (it != postedTagged_.end()) {
          bad = matchTagged(*it, peer, h);
        }
        if (it != postedTagged_.end() && bad.ok()) {
          link.reading.into = Reading::Into::kPostedTagged;
          link.reading.postedTagged = std::move(*it);
          postedTagged_.erase(it);
          if (h.bytes > 0) {
            alloc.tensors.push_back({link.reading.postedTagged.data, h.bytes});
          }
        } else {
          // No receive yet, or one that does not fit: stage it, so the
          // mismatching receive fails alone once the data is in.
          link.reading.into = Reading::Into::kStagedTagged;
          link.reading.stagedTagged.source = peer;
          link.reading.stagedTagged.header = h;
          link.reading.stagedTagged.data.resize(h.bytes);
          if (h.bytes > 0) {
            alloc.tensors.push_back(
                {link.reading.stagedTagged.data.data(), h.bytes});
          }
        }
        break;
      }
    }
    auto self = shared_from_this();
    pipe->read(std::move(alloc),
               [self, peer](const Error& e) { self->onRead(peer, e); });
  }

  void onRead(int peer, const Error& e) {
    if (!e.ok()) {
      fail(peerError(peer, e));
    }
    Callback done;
    SourceCallback doneTagged;
    Error result;
    {
      MutexLock lock(mu_);
      Link& link = links_[static_cast<size_t>(peer)];
      Reading& r = link.reading;
      if (!error_.ok()) {
        // Failed before or while this read ran: the receive it filled (if
        // any) fails now that the transport let go of its memory.
        result = error_;
        if (r.into == Reading::Into::kPosted) {
          done = std::move(r.posted.cb);
        } else if (r.into == Reading::Into::kPostedTagged) {
          doneTagged = std::move(r.postedTagged.cb);
        }
        r.into = Reading::Into::kNothing;
      }
    }
    if (!result.ok()) {
      if (done) {
        done(result);
      }
      if (doneTagged) {
        doneTagged(result, -1);
      }
      return;
    }
    {
      MutexLock lock(mu_);
      Link& link = links_[static_cast<size_t>(peer)];
      Reading& r = link.reading;
      switch (r.into) {
        case Reading::Into::kNothing:
          break;
        case Reading::Into::kPosted:
          done = std::move(r.posted.cb);
          break;
        case Reading::Into::kStaged:
          if (!link.posted.empty() && link.staged.empty()) {
            PostedRecv p = std::move(link.posted.front());
            link.posted.pop_front();
            result = match(peer, p, r.staged.header);
            if (result.ok() && p.bytes > 0) {
              std::memcpy(p.data, r.staged.data.data(), p.bytes);
            }
            giveBackStaging(std::move(r.staged.data));
            done = std::move(p.cb);
          } else {
            link.staged.push_back(std::move(r.staged));
          }
          r.staged = Staged{};
          break;
        case Reading::Into::kPostedTagged:
          doneTagged = std::move(r.postedTagged.cb);
          break;
        case Reading::Into::kStagedTagged: {
          StagedTagged s = std::move(r.stagedTagged);
          r.stagedTagged = StagedTagged{};
          auto it = postedTagged_.begin();
          for (; it != postedTagged_.end(); ++it) {
            if ((it->peer < 0 || it->peer == peer) && it->tag == s.header.tag) {
              break;
            }
          }
          if (it == postedTagged_.end()) {
            stagedTagged_.push_back(std::move(s));
            break;
          }
          PostedTagged p = std::move(*it);
          postedTagged_.erase(it);
          result = matchTagged(p, peer, s.header);
          if (result.ok() && p.bytes > 0) {
            std::memcpy(p.data, s.data.data(), p.bytes);
          }
          doneTagged = std::move(p.cb);
          break;
        }
      }
      r.into = Reading::Into::kNothing;
    }
    if (!result.ok() && !doneTagged) {
      fail(result);
      result = error();
    }
    if (done) {
      done(result);
    }
    if (doneTagged) {
      doneTagged(result, peer);
    }
    readNext(peer);
  }

  // A posted collective receive against the message that arrived for it.
  Error match(int peer, const PostedRecv& p, const Header& h) const
      TRELLIS_REQUIRES(mu_) {
    if (!(h.fp == p.fp)) {
      std::string msg = description() + ": desync: rank " +
                        std::to_string(rank_) + " runs " + p.fp.toString() +
                        " but rank " + std::to_string(peer) + " runs " +
                        h.fp.toString();
      // Ranks at different sequence numbers: say what this rank ran at the
      // peer's, so both calls of that number are in the error.
      if (h.fp.seq != p.fp.seq) {
        for (const Fingerprint& f : history_) {
          if (f.seq == h.fp.seq) {
            msg += "; rank " + std::to_string(rank_) + " ran " + f.toString();
          }
        }
      }
      return Error(Code::kAborted, std::move(msg));
    }
    if (h.step != p.step) {
      return Error::protocol(description() + ": rank " + std::to_string(peer) +
                             " sent step " + std::to_string(h.step) + " of " +
                             p.fp.toString() + ", expected step " +
                             std::to_string(p.step));
    }
    if (h.bytes != p.bytes) {
      return Error(Code::kAborted,
                   description() + ": rank " + std::to_string(peer) + " sent " +
                       std::to_string(h.bytes) + " bytes in " +
                       p.fp.toString() + " step " + std::to_string(p.step) +
                       ", rank " + std::to_string(rank_) + " expected " +
                       std::to_string(p.bytes) +
                       " (do the ranks' sizes or splits agree?)");
    }
    return Error();
  }

  Error matchTagged(const PostedTagged& p, int source, const Header& h) const {
    if (h.fp.dtype != p.dtype || h.bytes != p.bytes) {
      return Error::invalidArgument(
          description() + ": recv(tag " + std::to_string(p.tag) +
          ") from rank " + std::to_string(source) + " expected " +
          std::to_string(p.bytes) + " bytes of " +
          std::string(toString(p.dtype)) + " but rank " +
          std::to_string(source) + " sent " + std::to_string(h.bytes) +
          " bytes of " + std::string(toString(h.fp.dtype)));
    }
    return Error();
  }

  // The first error wins; every pending receive fails with it. A receive
  // whose data is being read into the caller's memory fails only when that
  // read ends (onRead), which closing the pipes (after the abort messages
  // had a moment to leave) guarantees: its caller must not free or reuse
  // the memory while the transport still writes into it.
  // What an abort message tells the peers: who gave up, and why.
  struct AbortNote {
    int rank;
    Code code;
    std::string reason;
  };

  // `relay`: the abort of another rank that caused this failure, told to
  // the peers instead of this rank's own wording of it.
  void fail(Error e, bool tellPeers = true, const AbortNote* relay = nullptr) {
    std::vector<Callback> cbs;
    std::vector<SourceCallback> tagged;
    std::vector<std::shared_ptr<tp::Pipe>> pipes;
    {
      MutexLock lock(mu_);
      if (!error_.ok()) {
        return;
      }
      error_ = e;
      for (Link& link : links_) {
        for (auto& p : link.posted) {
          cbs.push_back(std::move(p.cb));
        }
        link.posted.clear();
        link.staged.clear();
        // A read into staging memory keeps it until the pipe closes and
        // then completes into nothing; one into a posted receive's memory
        // fails that receive when it ends (onRead).
        if (link.reading.into != Reading::Into::kPosted &&
            link.reading.into != Reading::Into::kPostedTagged) {
          link.reading.into = Reading::Into::kNothing;
        }
        if (link.pipe) {
          pipes.push_back(link.pipe);
        }
      }
      pipes.insert(pipes.end(), strays_.begin(), strays_.end());
      for (auto& p : postedTagged_) {
        tagged.push_back(std::move(p.cb));
      }
      postedTagged_.clear();
      stagedTagged_.clear();
      std::optional<AbortNote> note;
      if (tellPeers) {
        note =
            relay != nullptr ? *relay : AbortNote{rank_, e.code(), e.message()};
      }
      startCloser(pipes, note);
    }
    cv_.notifyAll();
    for (auto& cb : cbs) {
      cb(e);
    }
    for (auto& cb : tagged) {
      cb(e, -1);
    }
  }

  // Writes the abort message to every peer, then closes every pipe once the
  // writes are out or kAbortFlushTime has passed, on a thread of its own so
  // that no caller (the loop included) waits for it.
  void startCloser(std::vector<std::shared_ptr<tp::Pipe>> pipes,
                   const std::optional<AbortNote>& note) TRELLIS_REQUIRES(mu_) {
    struct Flush {
      Mutex mu;
      CondVar cv;
      size_t left TRELLIS_GUARDED_BY(mu) = 0;
    };
    auto flush = std::make_shared<Flush>();
    if (note.has_value()) {
      Header h;
      h.kind = Header::Kind::kAbort;
      h.rank = note->rank;
      h.code = note->code;
      h.reason = note->reason;
      const std::string descriptor = encode(h);
      {
        MutexLock lock(flush->mu);
        flush->left = pipes.size();
      }
      for (auto& pipe : pipes) {
        tp::Message m;
        m.descriptor = descriptor;
        pipe->write(std::move(m), [flush](const Error&) {
          MutexLock lock(flush->mu);
          if (--flush->left == 0) {
            flush->cv.notifyAll();
          }
        });
      }
    }
    closer_ = std::thread([flush, pipes = std::move(pipes)] {
      setThreadName("pg-mesh-closer");
      const auto until = Clock::now() + kAbortFlushTime;
      {
        MutexLock lock(flush->mu);
        while (flush->left > 0 && flush->cv.waitUntil(flush->mu, until)) {
        }
      }
      for (auto& pipe : pipes) {
        pipe->close();
      }
    });
  }

  const int rank_;
  const int size_;
  const MeshOptions options_;
  std::shared_ptr<tp::Context> ctx_;
  std::shared_ptr<tp::Listener> listener_;
  std::thread closer_;

  mutable Mutex mu_;
  CondVar cv_;
  Error error_ TRELLIS_GUARDED_BY(mu_);
  std::vector<Link> links_ TRELLIS_GUARDED_BY(mu_);
  int hellos_ TRELLIS_GUARDED_BY(mu_) = 0;
  std::list<PostedTagged> postedTagged_ TRELLIS_GUARDED_BY(mu_);
  std::list<StagedTagged> stagedTagged_ TRELLIS_GUARDED_BY(mu_);
  static constexpr size_t kSpareStaging = 4;
  std::vector<std::vector<uint8_t>> spareStaging_ TRELLIS_GUARDED_BY(mu_);
  // The last kHistory collectives this rank started, for desync errors.
  static constexpr size_t kHistory = 64;
  std::deque<Fingerprint> history_ TRELLIS_GUARDED_BY(mu_);
  // Pipes of peers refused at hello, closed with the others.
  std::vector<std::shared_ptr<tp::Pipe>> strays_ TRELLIS_GUARDED_BY(mu_);
};

void waitForKeys(store::Store& store, const std::vector<std::string>& keys,
                 const Deadline& deadline, const std::function<Error()>& check,
                 const std::function<Error()>& timedOut) {
  for (;;) {
    if (Error e = check(); !e.ok()) {
      throwError(e);
    }
    const auto slice = std::min<std::chrono::milliseconds>(
        std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline.remaining()),
        kStoreWaitSlice);
    if (slice <= std::chrono::milliseconds::zero()) {
      throwError(timedOut());
    }
    try {
      store.wait(keys, slice);
      return;
    } catch (const TimeoutError&) {
    }
  }
}

std::unique_ptr<Mesh> Mesh::connect(store::Store& store, int rank,
                                    int worldSize, MeshOptions options) {
  const Deadline deadline = Deadline::fromTimeout(options.initTimeout);
  auto impl = std::make_shared<Impl>(rank, worldSize, std::move(options));
  std::unique_ptr<Mesh> mesh(new Mesh(impl));
  impl->start(store);
  impl->waitConnected(deadline);
  return mesh;
}

Mesh::Mesh(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

namespace {

// Teardowns moved off a loop thread and not finished yet (~Mesh). Leaked
// on purpose: a mesh may be released during static destruction.
PendingCount& detachedTeardowns() {
  static auto* pending = new PendingCount();
  return *pending;
}

}  // namespace

bool awaitDetachedMeshTeardowns(Duration timeout) {
  return detachedTeardowns().await(timeout);
}

Mesh::~Mesh() {
  if (impl_->inLoop()) {
    // Destroyed from a callback on the transport's own loop thread: that
    // thread cannot join itself, so the teardown moves to a thread of its
    // own (DESIGN.md, "no object destroyed on a thread it owns").
    PendingCount& pending = detachedTeardowns();
    pending.add();
    std::thread([impl = std::move(impl_), &pending]() mutable {
      setThreadName("pg-teardown");
      impl->shutdown();
      impl.reset();
      pending.done();
    }).detach();
    return;
  }
  impl_->shutdown();
}

int Mesh::rank() const { return impl_->rank(); }
int Mesh::size() const { return impl_->size(); }
const std::string& Mesh::description() const { return impl_->description(); }

void Mesh::sendCollective(int peer, const Fingerprint& fp, uint32_t step,
                          const void* data, size_t bytes, Callback cb) {
  impl_->sendCollective(peer, fp, step, data, bytes, std::move(cb));
}
void Mesh::recvCollective(int peer, const Fingerprint& fp, uint32_t step,
                          void* data, size_t bytes, Callback cb) {
  impl_->recvCollective(peer, fp, step, data, bytes, std::move(cb));
}
void Mesh::sendTagged(int peer, int64_t tag, DType dtype, const void* data,
                      size_t bytes, Callback cb) {
  impl_->sendTagged(peer, tag, dtype, data, bytes, std::move(cb));
}
void Mesh::recvTagged(int peer, int64_t tag, DType dtype, void* data,
                      size_t bytes, SourceCallback cb) {
  impl_->recvTagged(peer, tag, dtype, data, bytes, std::move(cb));
}
void Mesh::abort(Error reason) { impl_->abort(std::move(reason)); }
void Mesh::noteStarted(const Fingerprint& fp) { impl_->noteStarted(fp); }
Error Mesh::error() const { return impl_->error(); }
Error Mesh::linkError(int peer) const { return impl_->linkError(peer); }

}  // namespace trellis::collectives::detail
