#include <algorithm>
#include <cstring>
#include <limits>

#include <trellis/core/wire.h>
#include <trellis/store/protocol.h>

namespace trellis::store::protocol {

using wire::WireReader;
using wire::WireWriter;

const char* opName(Op op) {
  switch (op) {
    case Op::kSet:
      return "set";
    case Op::kGet:
      return "get";
    case Op::kAdd:
      return "add";
    case Op::kCompareSet:
      return "compareSet";
    case Op::kWait:
      return "wait";
    case Op::kCheck:
      return "check";
    case Op::kDelete:
      return "deleteKey";
    case Op::kNumKeys:
      return "numKeys";
    case Op::kMultiGet:
      return "multiGet";
    case Op::kMultiSet:
      return "multiSet";
    case Op::kPing:
      return "ping";
  }
  return "unknown";
}

std::array<uint8_t, kClientHelloBytes> encodeClientHello(uint32_t version,
                                                         uint8_t flags) {
  std::array<uint8_t, kClientHelloBytes> out{};
  std::memcpy(out.data(), kMagic.data(), kMagic.size());
  for (int i = 0; i < 4; ++i) {
    out[4 + i] = static_cast<uint8_t>(version >> (8 * i));
  }
  out[8] = flags;
  return out;
}

std::array<uint8_t, kServerHelloBytes> encodeServerHello(uint8_t flags,
                                                         HelloStatus status) {
  std::array<uint8_t, kServerHelloBytes> out{};
  std::memcpy(out.data(), kMagic.data(), kMagic.size());
  for (int i = 0; i < 4; ++i) {
    out[4 + i] = static_cast<uint8_t>(kVersion >> (8 * i));
  }
  out[8] = flags;
  out[9] = static_cast<uint8_t>(status);
  return out;
}

namespace {

uint32_t fixed32At(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(p[i]) << (8 * i);
  }
  return v;
}

}  // namespace

ClientHello decodeClientHello(std::span<const uint8_t, kClientHelloBytes> b) {
  ClientHello h;
  h.magicOk = std::equal(kMagic.begin(), kMagic.end(), b.begin());
  h.version = fixed32At(b.data() + 4);
  h.hasToken = (b[8] & kClientHasToken) != 0;
  return h;
}

HelloStatus judgeClientHello(const ClientHello& hello, bool serverHasToken) {
  if (!hello.magicOk) {
    return HelloStatus::kBadMagic;
  }
  if (hello.version != kVersion) {
    return HelloStatus::kUnsupportedVersion;
  }
  if (hello.hasToken != serverHasToken) {
    return HelloStatus::kAuthMismatch;
  }
  return HelloStatus::kOk;
}

std::string describeRefusal(const ClientHello& hello, HelloStatus status) {
  switch (status) {
    case HelloStatus::kOk:
      return "";
    case HelloStatus::kBadMagic:
      return "bad magic (not a Trellis store client)";
    case HelloStatus::kUnsupportedVersion:
      return "unsupported protocol version " + std::to_string(hello.version);
    case HelloStatus::kAuthMismatch:
      return "job token mismatch (one side has a token, the other none)";
  }
  return "status " + std::to_string(static_cast<int>(status));
}

Error checkServerHello(std::span<const uint8_t, kServerHelloBytes> b,
                       bool clientHasToken, const std::string& peer) {
  if (!std::equal(kMagic.begin(), kMagic.end(), b.begin())) {
    return Error::protocol("the peer at " + peer +
                           " is not a Trellis store server (bad magic)");
  }
  const uint32_t version = fixed32At(b.data() + 4);
  const bool serverWantsToken = (b[8] & kServerRequiresToken) != 0;
  const auto status = static_cast<HelloStatus>(b[9]);
  if (status == HelloStatus::kUnsupportedVersion || version != kVersion) {
    return Error::protocol("store server " + peer +
                           " speaks protocol version " +
                           std::to_string(version) + "; this client speaks " +
                           std::to_string(kVersion));
  }
  if (status == HelloStatus::kAuthMismatch ||
      serverWantsToken != clientHasToken) {
    return Error::auth(
        serverWantsToken
            ? "store server " + peer +
                  " requires a job token but this client has none (set "
                  "TCPStoreOptions::jobToken, e.g. from TRELLIS_JOB_TOKEN)"
            : "this client has a job token but store server " + peer +
                  " was started without one; give both the same token "
                  "or neither");
  }
  if (status != HelloStatus::kOk) {
    return Error::protocol("store server " + peer +
                           " rejected the hello (status " +
                           std::to_string(b[9]) + ")");
  }
  return Error();
}

Error checkClientAnswer(const auth::JobToken& token,
                        const auth::Nonce& challenge,
                        std::span<const uint8_t, kClientAnswerBytes> answer,
                        const std::string& peer, auth::Nonce* clientNonce) {
  auth::Nonce nonce{};
  std::copy_n(answer.begin(), auth::kNonceBytes, nonce.begin());
  Error e = auth::verifyProof(token, "connector", challenge, nonce,
                              answer.subspan(auth::kNonceBytes), peer);
  if (e.ok()) {
    *clientNonce = nonce;
  }
  return e;
}

namespace {

bool hasKeyList(Op op) {
  return op == Op::kWait || op == Op::kCheck || op == Op::kMultiGet ||
         op == Op::kMultiSet;
}

bool hasSingleKey(Op op) {
  return op == Op::kSet || op == Op::kGet || op == Op::kAdd ||
         op == Op::kCompareSet || op == Op::kDelete;
}

bool hasTimeout(Op op) {
  return op == Op::kGet || op == Op::kWait || op == Op::kMultiGet;
}

}  // namespace

Bytes encodeRequest(const Request& req) {
  WireWriter w;
  size_t approx = 16;
  for (const auto& k : req.keys) {
    approx += k.size() + 5;
  }
  for (const auto& v : req.values) {
    approx += v.size() + 5;
  }
  w.reserve(approx);
  w.putU8(static_cast<uint8_t>(req.op));
  if (hasSingleKey(req.op)) {
    w.putString(req.keys.empty() ? std::string_view() : req.keys[0]);
  }
  if (hasKeyList(req.op)) {
    w.putVarint(req.keys.size());
    for (size_t i = 0; i < req.keys.size(); ++i) {
      w.putString(req.keys[i]);
      if (req.op == Op::kMultiSet) {
        w.putBytes(i < req.values.size()
                       ? std::span<const uint8_t>(req.values[i])
                       : std::span<const uint8_t>());
      }
    }
  }
  switch (req.op) {
    case Op::kSet:
      w.putBytes(req.values.at(0));
      break;
    case Op::kAdd:
      w.putSignedVarint(req.delta);
      break;
    case Op::kCompareSet:
      w.putBytes(req.values.at(0));
      w.putBytes(req.values.at(1));
      break;
    default:
      break;
  }
  if (hasTimeout(req.op)) {
    w.putVarint(req.timeoutMs);
  }
  return w.release();
}

Error decodeRequest(std::span<const uint8_t> payload, const Limits& limits,
                    Request* out) {
  WireReader r(payload, "store request");
  const uint8_t op = r.u8("op");
  if (!r.ok()) {
    return r.error();
  }
  if (op < static_cast<uint8_t>(Op::kSet) ||
      op > static_cast<uint8_t>(Op::kPing)) {
    return Error::protocol("store request: unknown op " + std::to_string(op) +
                           " at offset 0");
  }
  Request req;
  req.op = static_cast<Op>(op);
  // A length or count over `limits` in a request that is otherwise well
  // formed is not a framing error: the rest is read (it is within the frame
  // already received), and the request fails with RESOURCE_EXHAUSTED, which
  // the server answers without closing the connection. Nothing over a limit
  // is kept.
  std::string overLimit;
  // "a value of 4096 bytes exceeds the server's limit of 1024
  // (Limits::maxValueBytes)"
  auto over = [&](const std::string& what, uint64_t got, std::string_view unit,
                  size_t max, std::string_view limit) {
    if (overLimit.empty()) {
      overLimit = "store request: " + what + " of " + std::to_string(got) +
                  std::string(unit) + " exceeds the server's limit of " +
                  std::to_string(max) + " (Limits::" + std::string(limit) + ")";
    }
  };
  constexpr size_t kFrameBound = std::numeric_limits<size_t>::max();
  auto readKey = [&] {
    const std::string_view k = r.string(kFrameBound, "key");
    if (k.size() > limits.maxKeyBytes) {
      over("a key", k.size(), " bytes", limits.maxKeyBytes, "maxKeyBytes");
    } else if (overLimit.empty()) {
      req.keys.emplace_back(k);
    }
  };
  auto readValue = [&](std::string_view field) {
    auto b = r.bytes(kFrameBound, field);
    if (b.size() > limits.maxValueBytes) {
      over("a " + std::string(field), b.size(), " bytes", limits.maxValueBytes,
           "maxValueBytes");
    } else if (overLimit.empty()) {
      req.values.emplace_back(b.begin(), b.end());
    }
  };
  if (hasSingleKey(req.op)) {
    readKey();
  }
  if (hasKeyList(req.op)) {
    const uint64_t n = r.varint("key count");
    // Each key costs at least one byte: a count beyond the bytes left is a
    // lie, caught here before anything is reserved from it.
    if (r.ok() && n > r.remaining()) {
      r.fail("key count", "claims " + std::to_string(n) + " keys but only " +
                              std::to_string(r.remaining()) + " bytes remain");
    }
    if (r.ok() && n > limits.maxKeysPerOp) {
      over("a key count", n, "", limits.maxKeysPerOp, "maxKeysPerOp");
    }
    if (r.ok() && overLimit.empty()) {
      req.keys.reserve(n);
      if (req.op == Op::kMultiSet) {
        req.values.reserve(n);
      }
    }
    for (uint64_t i = 0; i < n && r.ok(); ++i) {
      readKey();
      if (req.op == Op::kMultiSet) {
        readValue("value");
      }
    }
  }
  switch (req.op) {
    case Op::kSet:
      readValue("value");
      break;
    case Op::kAdd:
      req.delta = r.signedVarint("delta");
      break;
    case Op::kCompareSet:
      readValue("expected");
      readValue("desired");
      break;
    default:
      break;
  }
  if (hasTimeout(req.op)) {
    req.timeoutMs = r.varint("timeout_ms");
  }
  r.expectEnd();
  if (!r.ok()) {
    return r.error();
  }
  if (!overLimit.empty()) {
    return Error(Code::kResourceExhausted, overLimit);
  }
  *out = std::move(req);
  return Error();
}

Bytes encodeResponse(Op op, const Response& resp) {
  WireWriter w;
  if (!resp.error.ok()) {
    w.putU8(static_cast<uint8_t>(resp.error.code()));
    const std::string& m = resp.error.message();
    w.putString(std::string_view(m).substr(
        0, std::min(m.size(), kMaxErrorMessageBytes)));
    return w.release();
  }
  w.putU8(0);
  switch (op) {
    case Op::kGet:
    case Op::kCompareSet:
      w.putBytes(resp.values.at(0));
      break;
    case Op::kAdd:
      w.putSignedVarint(resp.integer);
      break;
    case Op::kNumKeys:
      w.putVarint(static_cast<uint64_t>(resp.integer));
      break;
    case Op::kCheck:
    case Op::kDelete:
      w.putBool(resp.flag);
      break;
    case Op::kMultiGet:
      w.putVarint(resp.values.size());
      for (const auto& v : resp.values) {
        w.putBytes(v);
      }
      break;
    default:
      break;
  }
  return w.release();
}

Error decodeResponse(Op op, std::span<const uint8_t> payload,
                     const Limits& limits, Response* out) {
  WireReader r(payload, "store response");
  Response resp;
  const uint8_t status = r.u8("status");
  if (r.ok() && status != 0) {
    const auto msg = r.string(kMaxErrorMessageBytes, "message");
    r.expectEnd();
    if (!r.ok()) {
      return r.error();
    }
    if (status > static_cast<uint8_t>(Code::kUnauthenticated)) {
      return Error::protocol("store response: unknown status " +
                             std::to_string(status));
    }
    resp.error = Error(static_cast<Code>(status), std::string(msg));
    *out = std::move(resp);
    return Error();
  }
  auto readValue = [&] {
    auto b = r.bytes(limits.maxValueBytes, "value");
    resp.values.emplace_back(b.begin(), b.end());
  };
  switch (op) {
    case Op::kGet:
    case Op::kCompareSet:
      readValue();
      break;
    case Op::kAdd:
      resp.integer = r.signedVarint("value");
      break;
    case Op::kNumKeys:
      resp.integer = static_cast<int64_t>(
          r.varint(std::numeric_limits<int64_t>::max(), "count"));
      break;
    case Op::kCheck:
    case Op::kDelete:
      resp.flag = r.boolean("flag");
      break;
    case Op::kMultiGet: {
      const uint64_t n = r.varint(limits.maxKeysPerOp, "value count");
      if (r.ok() && n > r.remaining()) {
        r.fail("value count", "exceeds the bytes left");
      }
      for (uint64_t i = 0; i < n && r.ok(); ++i) {
        readValue();
      }
      break;
    }
    default:
      break;
  }
  r.expectEnd();
  if (!r.ok()) {
    return r.error();
  }
  *out = std::move(resp);
  return Error();
}

void checkRequest(const Request& req, const Limits& limits) {
  auto bad = [&](const std::string& what) {
    throw InvalidArgumentError(Error::invalidArgument(
        std::string("store ") + opName(req.op) + ": " + what));
  };
  if (req.keys.size() > limits.maxKeysPerOp) {
    bad(std::to_string(req.keys.size()) + " keys exceed the limit of " +
        std::to_string(limits.maxKeysPerOp));
  }
  size_t total = 16;
  for (const auto& k : req.keys) {
    if (k.size() > limits.maxKeyBytes) {
      bad("key of " + std::to_string(k.size()) +
          " bytes exceeds the limit of " + std::to_string(limits.maxKeyBytes));
    }
    total += k.size() + 10;
  }
  for (const auto& v : req.values) {
    if (v.size() > limits.maxValueBytes) {
      bad("value of " + std::to_string(v.size()) +
          " bytes exceeds the limit of " +
          std::to_string(limits.maxValueBytes));
    }
    total += v.size() + 10;
  }
  if (total > limits.maxFrameBytes) {
    bad("request of about " + std::to_string(total) +
        " bytes exceeds the frame limit of " +
        std::to_string(limits.maxFrameBytes));
  }
}

Bytes frame(const Bytes& payload) {
  Bytes out(kFrameHeaderBytes + payload.size());
  const auto n = static_cast<uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) {
    out[i] = static_cast<uint8_t>(n >> (8 * i));
  }
  std::memcpy(out.data() + kFrameHeaderBytes, payload.data(), payload.size());
  return out;
}

}  // namespace trellis::store::protocol
