#include "quiescence.h"

#include <algorithm>
#include <charconv>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include <trellis/core/error.h>
#include <trellis/store/store.h>

namespace trellis::rpc::detail {

namespace {

std::chrono::milliseconds atLeastOneMs(Duration d) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(d),
                  std::chrono::milliseconds(1));
}

std::string encodeCounts(const QuiescenceCounts& c) {
  return std::to_string(c.active) + " " + std::to_string(c.sent) + " " +
         std::to_string(c.received);
}

// "active sent received": three decimal numbers, single spaces.
std::optional<QuiescenceCounts> decodeCounts(std::string_view s) {
  QuiescenceCounts c;
  uint64_t* fields[] = {&c.active, &c.sent, &c.received};
  const char* p = s.data();
  const char* end = s.data() + s.size();
  for (size_t i = 0; i < 3; ++i) {
    if (i > 0) {
      if (p == end || *p != ' ') {
        return std::nullopt;
      }
      ++p;
    }
    auto [next, ec] = std::from_chars(p, end, *fields[i]);
    if (ec != std::errc() || next == p) {
      return std::nullopt;
    }
    p = next;
  }
  if (p != end) {
    return std::nullopt;
  }
  return c;
}

class Protocol {
 public:
  Protocol(store::Store& store, QuiescenceParticipant& self,
           const QuiescenceOptions& o)
      : store_(store), self_(self), o_(o) {}

  void run() {
    try {
      arrive();
    } catch (const Exception&) {
      markSeen();
      if (verdict_) {
        shareVerdict();
      }
      throw;
    }
    // Everyone arrived: no verdict about arrivals can come any more.
    rounds();
    leave();
  }

 private:
  std::string key(int round, int32_t rank) const {
    return o_.keyPrefix + std::to_string(round) + "/" + std::to_string(rank);
  }

  std::string prefix() const { return "rpc shutdown of '" + o_.name + "': "; }

  // A worker that found another one gone (or not answering) while waiting
  // for arrivals: what it found, for the others.
  struct Verdict {
    Code code;
    std::string text;  // "worker 'w2' (rank 2) has not entered shutdown ..."
    int32_t culprit;
  };

  std::string verdictKey() const { return o_.keyPrefix + "verdict"; }
  std::string seenKey(int32_t rank) const {
    return o_.keyPrefix + "seen/" + std::to_string(rank);
  }

  // This worker will not need a verdict from the host any more.
  void markSeen() {
    try {
      store_.set(seenKey(o_.rank), std::string_view("seen"));
    } catch (const std::exception&) {
    }
  }

  // Publishes verdict_ so that the others fail with the same finding
  // instead of a closed store's error, and, on the worker that hosts the
  // store, keeps it up (briefly) until the live workers have read it. Best
  // effort: the verdict stands whatever the store does.
  void shareVerdict() {
    try {
      store_.set(verdictKey(),
                 std::to_string(static_cast<int>(verdict_->code)) + " " +
                     std::to_string(verdict_->culprit) + " " + o_.name + "\n" +
                     verdict_->text);
      if (!o_.hostsStore) {
        return;
      }
      std::vector<std::string> live;
      for (int32_t r = 0; r < o_.worldSize; ++r) {
        if (r != o_.rank && r != verdict_->culprit) {
          live.push_back(seenKey(r));
        }
      }
      // The others look for it between two waits (at most probeInterval).
      if (!live.empty()) {
        store_.wait(
            live, atLeastOneMs(o_.probeInterval * 2 + std::chrono::seconds(1)));
      }
    } catch (const std::exception&) {
    }
  }

  // Throws the verdict another worker published, if there is one.
  void throwIfVerdict() {
    if (!store_.check({verdictKey()})) {
      return;
    }
    const auto bytes = store_.get(verdictKey());
    const std::string v(bytes.begin(), bytes.end());
    store_.set(seenKey(o_.rank), std::string_view("seen"));
    // "<code> <culprit> <finder>\n<text>", written by shareVerdict().
    const size_t nl = v.find('\n');
    int code = 0;
    const std::string head = v.substr(0, nl == std::string::npos ? 0 : nl);
    const size_t sp = head.find(' ');
    const size_t sp2 =
        sp == std::string::npos ? std::string::npos : head.find(' ', sp + 1);
    auto [end, ec] = std::from_chars(head.data(), head.data() + sp, code);
    if (nl == std::string::npos || sp2 == std::string::npos ||
        ec != std::errc() || code < 1 ||
        code > static_cast<int>(Code::kUnauthenticated)) {
      throwError(Error::protocol(prefix() + "malformed shutdown verdict"));
    }
    throwError(Error(static_cast<Code>(code), prefix() + v.substr(nl + 1) +
                                                  " (found by worker '" +
                                                  head.substr(sp2 + 1) + "')"));
  }

  // The workers from `from` on whose key of `round` is missing.
  std::vector<int32_t> missing(int round, int32_t from = 0) {
    std::vector<int32_t> out;
    for (int32_t r = from; r < o_.worldSize; ++r) {
      bool present = false;
      try {
        present = store_.check({key(round, r)});
      } catch (const std::exception&) {
        // Naming them is best effort; the caller's error stands.
      }
      if (!present) {
        out.push_back(r);
      }
    }
    return out;
  }

  // At most ten names, then a count; `extra` adds to each name.
  std::string names(
      const std::vector<int32_t>& ranks,
      const std::function<std::string(int32_t)>& extra = nullptr) {
    std::string out;
    for (size_t i = 0; i < ranks.size() && i < 10; ++i) {
      out += (i ? ", " : "") + self_.describe(ranks[i]) +
             (extra ? extra(ranks[i]) : std::string());
    }
    if (ranks.size() > 10) {
      out += " and " + std::to_string(ranks.size() - 10) + " more";
    }
    return out;
  }

  void arrive() {
    store_.set(key(0, o_.rank), std::string_view("arrived"));
    const Deadline arrival = Deadline::fromTimeout(o_.arrivalTimeout);
    // The first wait for a worker is short and probes nothing: most arrive
    // within it, and a probe may open a connection. Later waits double up to
    // the probe interval while a probe is out.
    constexpr Duration kFirstWait = std::chrono::milliseconds(20);
    std::optional<Future<void>> probe;
    Duration slice = kFirstWait;
    for (int32_t r = 0; r < o_.worldSize;) {
      if (r == o_.rank) {
        ++r;
        continue;
      }
      try {
        store_.wait({key(0, r)},
                    atLeastOneMs(std::min(slice, arrival.remaining())));
        ++r;
        probe.reset();
        slice = kFirstWait;
        continue;
      } catch (const TimeoutError&) {
        // Not there yet: is it still alive? Or has another worker already
        // found one that is not?
        throwIfVerdict();
      }
      if (arrival.expired()) {
        throwError(Error::timeout(prefix() +
                                  "not every worker entered shutdown within " +
                                  formatDuration(o_.arrivalTimeout) +
                                  "; missing: " + names(missing(0, r))));
      }
      if (probe && probe->completed()) {
        if (probe->hasError() && !store_.check({key(0, r)})) {
          const Error& e = probe->error();
          verdict_ = Verdict{
              e.code(),
              self_.describe(r) +
                  (e.code() == Code::kDeadlineExceeded
                       ? " has not entered shutdown and does not answer: "
                       : " has not entered shutdown and is gone: ") +
                  e.message(),
              r};
          throwError(Error(e.code(), prefix() + verdict_->text));
        }
        probe.reset();  // it answered: ask again next time
      }
      if (!probe) {
        probe = self_.probe(r);
      }
      slice = std::min(slice * 2, o_.probeInterval);
    }
  }

  void rounds() {
    const Deadline deadline = Deadline::fromTimeout(o_.quiesceTimeout);
    std::optional<QuiescenceCounts> previous;  // of a quiet round
    // Each worker's calls in flight in the last round read.
    std::vector<uint64_t> active(static_cast<size_t>(o_.worldSize), 0);
    std::vector<std::string> keys(static_cast<size_t>(o_.worldSize));
    auto inFlight = [&](int32_t r) {
      return " (" + std::to_string(active[static_cast<size_t>(r)]) + ")";
    };
    auto notIdle = [&](const std::vector<int32_t>& busy,
                       const std::vector<int32_t>& gone) {
      std::string msg = prefix() + "the group did not become idle within " +
                        formatDuration(o_.quiesceTimeout);
      if (!busy.empty()) {
        msg += "; calls still in flight on " + names(busy, inFlight);
      }
      if (!gone.empty()) {
        msg += "; no longer taking part: " + names(gone);
      }
      return Error::timeout(msg);
    };
    for (int round = 1;; ++round) {
      if (round > 1) {
        // Publishing again before this worker's own calls are done would
        // only show the same activity: wait for it, not on the store.
        self_.waitIdle(deadline);
      }
      if (deadline.expired()) {
        std::vector<int32_t> busy;
        for (int32_t r = 0; r < o_.worldSize; ++r) {
          if (active[static_cast<size_t>(r)] != 0) {
            busy.push_back(r);
          }
        }
        throwError(notIdle(busy, {}));
      }
      store_.set(key(round, o_.rank), encodeCounts(self_.counts()));
      if (round >= 2) {
        // Everyone read it before publishing round - 1, which we have read.
        store_.deleteKey(key(round - 2, o_.rank));
      }
      for (int32_t r = 0; r < o_.worldSize; ++r) {
        keys[static_cast<size_t>(r)] = key(round, r);
      }
      try {
        store_.wait(keys, atLeastOneMs(deadline.remaining()));
      } catch (const TimeoutError&) {
        // A worker still busy when the time ran out, or one that stopped
        // taking part (it died, or hangs): name each as what it is.
        std::vector<int32_t> busy, gone;
        for (int32_t r : missing(round)) {
          (active[static_cast<size_t>(r)] != 0 ? busy : gone).push_back(r);
        }
        throwError(notIdle(busy, gone));
      }
      QuiescenceCounts total;
      const auto entries = store_.multiGet(keys);
      for (size_t r = 0; r < entries.size(); ++r) {
        const std::string_view s(
            reinterpret_cast<const char*>(entries[r].data()),
            entries[r].size());
        const auto c = decodeCounts(s);
        if (!c) {
          throwError(Error::protocol(prefix() + "malformed round entry of " +
                                     self_.describe(static_cast<int32_t>(r))));
        }
        active[r] = c->active;
        total.active += c->active;
        total.sent += c->sent;
        total.received += c->received;
      }
      const bool quiet = total.active == 0 && total.sent == total.received;
      if (quiet && previous && previous->sent == total.sent &&
          previous->received == total.received) {
        return;
      }
      previous = quiet ? std::optional<QuiescenceCounts>(total) : std::nullopt;
    }
  }

  void leave() {
    const std::string done = o_.keyPrefix + "exit/done";
    if (store_.add(o_.keyPrefix + "exit", 1) == o_.worldSize) {
      store_.set(done, std::string_view("done"));
    }
    if (!o_.hostsStore) {
      return;
    }
    // Every worker has the rounds' verdict already; this only keeps the
    // store up until they have counted themselves out, so a worker that
    // never does is not an error.
    try {
      store_.wait({done}, atLeastOneMs(o_.quiesceTimeout.count() > 0
                                           ? o_.quiesceTimeout
                                           : std::chrono::seconds(60)));
    } catch (const TimeoutError&) {
    }
  }

  store::Store& store_;
  QuiescenceParticipant& self_;
  const QuiescenceOptions& o_;
  std::optional<Verdict> verdict_;
};

}  // namespace

void runQuiescence(store::Store& store, QuiescenceParticipant& self,
                   const QuiescenceOptions& options) {
  Protocol(store, self, options).run();
}

}  // namespace trellis::rpc::detail
