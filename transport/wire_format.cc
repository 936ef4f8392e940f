#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>

#include <trellis/transport/wire_format.h>

namespace trellis::transport::wire_format {

using trellis::wire::WireReader;
using trellis::wire::WireWriter;

namespace {

std::vector<uint8_t> withHeader(HandshakeType type, const WireWriter& body) {
  // Sized up front and filled by index: GCC 12 warns (falsely) about
  // insert() into a freshly reserved vector.
  std::vector<uint8_t> out(kHandshakeHeaderBytes + body.size());
  std::memcpy(out.data(), kMagic.data(), kMagic.size());
  out[4] = static_cast<uint8_t>(type);
  const auto len = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) {
    out[5 + i] = static_cast<uint8_t>(len >> (8 * i));
  }
  if (body.size() > 0) {
    std::memcpy(out.data() + kHandshakeHeaderBytes, body.bytes().data(),
                body.size());
  }
  return out;
}

void putNames(WireWriter& w, const std::vector<std::string>& names) {
  w.putVarint(names.size());
  for (const auto& n : names) {
    w.putString(n);
  }
}

std::vector<std::string> readNames(WireReader& r, std::string_view field) {
  const uint64_t n = r.varint(kMaxNames, field);
  std::vector<std::string> out;
  for (uint64_t i = 0; i < n && r.ok(); ++i) {
    out.emplace_back(r.string(kMaxNameBytes, field));
  }
  return out;
}

template <typename T>
void readArray(WireReader& r, T* out, std::string_view field) {
  auto b = r.raw(out->size(), field);
  if (r.ok()) {
    std::memcpy(out->data(), b.data(), out->size());
  }
}

std::optional<auth::Mac> readProof(WireReader& r) {
  auto b = r.bytes(auth::kMacBytes, "proof");
  if (!r.ok() || b.empty()) {
    return std::nullopt;
  }
  if (b.size() != auth::kMacBytes) {
    r.fail("proof", "proof must be 0 or 32 bytes");
    return std::nullopt;
  }
  auth::Mac m;
  std::memcpy(m.data(), b.data(), m.size());
  return m;
}

void putProof(WireWriter& w, const std::optional<auth::Mac>& p) {
  if (p) {
    w.putBytes(*p);
  } else {
    w.putBytes(std::span<const uint8_t>());
  }
}

const char* typeName(HandshakeType t) {
  switch (t) {
    case HandshakeType::kHello:
      return "hello";
    case HandshakeType::kHelloReply:
      return "hello reply";
    case HandshakeType::kAuth:
      return "auth";
    case HandshakeType::kAccept:
      return "accept";
    case HandshakeType::kBind:
      return "bind";
    case HandshakeType::kUpgradeFailed:
      return "upgrade failed";
    case HandshakeType::kUpgradeDecision:
      return "upgrade decision";
  }
  return "?";
}

uint32_t readLe32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

}  // namespace

Error decodeHandshakeHeader(std::span<const uint8_t> header,
                            HandshakeType expected, size_t* bodyLength) {
  if (header.size() != kHandshakeHeaderBytes) {
    return Error::protocol("transport handshake: truncated header");
  }
  if (std::memcmp(header.data(), kMagic.data(), kMagic.size()) != 0) {
    return Error::protocol(
        "transport handshake: wrong magic (not a Trellis transport peer)");
  }
  if (header[4] != static_cast<uint8_t>(expected)) {
    return Error::protocol(std::string("transport handshake: expected a ") +
                           typeName(expected) + " message, got type " +
                           std::to_string(header[4]));
  }
  const uint32_t len = readLe32(header.data() + 5);
  if (len > kMaxHandshakeBodyBytes) {
    return Error::protocol(
        "transport handshake: " + std::string(typeName(expected)) +
        " body of " + std::to_string(len) + " bytes exceeds the limit of " +
        std::to_string(kMaxHandshakeBodyBytes));
  }
  *bodyLength = len;
  return Error();
}

std::vector<uint8_t> encodeHello(HandshakeType type, const Hello& hello) {
  WireWriter w;
  w.putVarint(hello.version);
  putNames(w, hello.transports);
  putNames(w, hello.channels);
  w.putString(hello.hostId);
  w.putVarint(hello.pid);
  w.putBool(hello.tokenConfigured);
  if (type == HandshakeType::kHelloReply) {
    w.putRaw(std::span<const uint8_t>(hello.nonce));
  }
  return withHeader(type, w);
}

Error decodeHello(std::span<const uint8_t> body, HandshakeType type,
                  Hello* out) {
  WireReader r(body, typeName(type));
  const uint64_t version = r.varint("version");
  out->version = static_cast<uint32_t>(
      std::min<uint64_t>(version, std::numeric_limits<uint32_t>::max()));
  if (r.ok() && version != kProtocolVersion) {
    return Error::protocol(
        "transport handshake: peer speaks protocol version " +
        std::to_string(version) + ", this build speaks " +
        std::to_string(kProtocolVersion));
  }
  out->transports = readNames(r, "transports");
  out->channels = readNames(r, "channels");
  out->hostId = std::string(r.string(kMaxHostIdBytes, "host id"));
  out->pid = r.varint("pid");
  out->tokenConfigured = r.boolean("token configured");
  if (type == HandshakeType::kHelloReply) {
    readArray(r, &out->nonce, "nonce");
  }
  r.expectEnd();
  return r.error();
}

std::vector<uint8_t> encodeAuth(const AuthMessage& m) {
  WireWriter w;
  w.putRaw(std::span<const uint8_t>(m.nonce));
  putProof(w, m.proof);
  return withHeader(HandshakeType::kAuth, w);
}

Error decodeAuth(std::span<const uint8_t> body, AuthMessage* out) {
  WireReader r(body, "auth");
  readArray(r, &out->nonce, "nonce");
  out->proof = readProof(r);
  r.expectEnd();
  return r.error();
}

std::vector<uint8_t> encodeAccept(const AcceptMessage& m) {
  WireWriter w;
  w.putU8(static_cast<uint8_t>(m.status));
  w.putString(m.reason);
  putProof(w, m.proof);
  w.putString(m.transport);
  w.putString(m.channel);
  w.putString(m.cudaChannel);
  w.putString(m.upgradeAddress);
  if (m.upgradeToken) {
    w.putBytes(std::span<const uint8_t>(*m.upgradeToken));
  } else {
    w.putBytes(std::span<const uint8_t>());
  }
  return withHeader(HandshakeType::kAccept, w);
}

std::vector<uint8_t> encodeBind(const BindMessage& m) {
  WireWriter w;
  w.putRaw(std::span<const uint8_t>(m.token));
  putProof(w, m.proof);
  return withHeader(HandshakeType::kBind, w);
}

Error decodeBind(std::span<const uint8_t> body, BindMessage* out) {
  WireReader r(body, "bind");
  readArray(r, &out->token, "token");
  out->proof = readProof(r);
  r.expectEnd();
  return r.error();
}

std::vector<uint8_t> encodeUpgradeFailed(const std::string& reason) {
  WireWriter w;
  w.putString(std::string_view(reason).substr(0, kMaxReasonBytes));
  return withHeader(HandshakeType::kUpgradeFailed, w);
}

Error decodeUpgradeFailed(std::span<const uint8_t> body, std::string* reason) {
  WireReader r(body, "upgrade failed");
  *reason = std::string(r.string(kMaxReasonBytes, "reason"));
  r.expectEnd();
  return r.error();
}

std::vector<uint8_t> encodeUpgradeDecision(UpgradeDecision d) {
  WireWriter w;
  w.putU8(static_cast<uint8_t>(d));
  return withHeader(HandshakeType::kUpgradeDecision, w);
}

Error decodeUpgradeDecision(std::span<const uint8_t> body,
                            UpgradeDecision* out) {
  WireReader r(body, "upgrade decision");
  const uint8_t d = r.u8("decision");
  if (r.ok() && d > static_cast<uint8_t>(UpgradeDecision::kStay)) {
    r.fail("decision", "unknown decision " + std::to_string(d));
  }
  *out = static_cast<UpgradeDecision>(d);
  r.expectEnd();
  return r.error();
}

Error checkUpgradeAddress(const std::string& address) {
  const std::string prefix = "shm://";
  const std::string name = address.rfind(prefix, 0) == 0
                               ? address.substr(prefix.size())
                               : std::string();
  bool ok = !name.empty() && name.size() <= 100;
  for (char c : name) {
    ok = ok && (std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '.' ||
                c == '_' || c == '-');
  }
  if (!ok) {
    return Error::protocol("upgrade address '" + address.substr(0, 140) +
                           "' is not shm://NAME with NAME of 1-100 "
                           "characters from [A-Za-z0-9._-]");
  }
  return Error();
}

Error decodeAccept(std::span<const uint8_t> body, AcceptMessage* out) {
  WireReader r(body, "accept");
  const uint8_t status = r.u8("status");
  if (r.ok() &&
      status > static_cast<uint8_t>(AcceptStatus::kNoCommonTransport)) {
    r.fail("status", "unknown status " + std::to_string(status));
  }
  out->status = static_cast<AcceptStatus>(status);
  out->reason = std::string(r.string(kMaxReasonBytes, "reason"));
  out->proof = readProof(r);
  out->transport = std::string(r.string(kMaxNameBytes, "transport"));
  out->channel = std::string(r.string(kMaxNameBytes, "channel"));
  out->cudaChannel = std::string(r.string(kMaxNameBytes, "cuda channel"));
  out->upgradeAddress =
      std::string(r.string(kMaxUpgradeAddressBytes, "upgrade address"));
  auto token = r.bytes(auth::kNonceBytes, "upgrade token");
  out->upgradeToken.reset();
  if (r.ok() &&
      token.size() != (out->upgradeAddress.empty() ? 0 : auth::kNonceBytes)) {
    r.fail("upgrade token",
           "upgrade token must be 32 bytes with an upgrade "
           "address and absent without one");
  }
  if (r.ok() && !token.empty()) {
    auth::Nonce n;
    std::memcpy(n.data(), token.data(), n.size());
    out->upgradeToken = n;
  }
  r.expectEnd();
  return r.error();
}

size_t maxLayoutBytes(const Limits& limits) {
  // u8 type + 3 varints + per payload a varint + per tensor varint+u8+varint.
  // A type-2 tensor adds a placement byte and a record length; the records
  // together are bounded per frame. A completion frame is bounded by its
  // reason.
  const size_t v = wire::kMaxVarintBytes;
  const size_t records =
      std::min(limits.maxTensorsPerMessage * kMaxOutOfBandRecordBytes,
               kMaxOutOfBandBytesPerFrame);
  const size_t message = 1 + 3 * v + limits.maxPayloadsPerMessage * v +
                         limits.maxTensorsPerMessage * (3 * v + 2) + records;
  const size_t completion = 2 + v + kMaxReasonBytes;
  return std::max(message, completion);
}

Error checkOutgoing(const Message& m, const Limits& limits) {
  auto tooBig = [](const std::string& what, size_t got, size_t max) {
    return Error::invalidArgument(what + " (" + std::to_string(got) +
                                  ") exceeds the context limit of " +
                                  std::to_string(max));
  };
  if (m.descriptor.size() > limits.maxDescriptorBytes) {
    return tooBig("descriptor size", m.descriptor.size(),
                  limits.maxDescriptorBytes);
  }
  if (m.payloads.size() > limits.maxPayloadsPerMessage) {
    return tooBig("payload count", m.payloads.size(),
                  limits.maxPayloadsPerMessage);
  }
  if (m.tensors.size() > limits.maxTensorsPerMessage) {
    return tooBig("tensor count", m.tensors.size(),
                  limits.maxTensorsPerMessage);
  }
  for (size_t i = 0; i < m.payloads.size(); ++i) {
    const auto& p = m.payloads[i];
    if (p.length > limits.maxPayloadBytes) {
      return tooBig("payload " + std::to_string(i) + " size", p.length,
                    limits.maxPayloadBytes);
    }
    if (p.length > 0 && p.data == nullptr) {
      return Error::invalidArgument("payload " + std::to_string(i) +
                                    " has a null pointer and length " +
                                    std::to_string(p.length));
    }
  }
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    if (t.length > limits.maxTensorBytes) {
      return tooBig("tensor " + std::to_string(i) + " size", t.length,
                    limits.maxTensorBytes);
    }
    if (t.length > 0 && t.data == nullptr) {
      return Error::invalidArgument("tensor " + std::to_string(i) +
                                    " has a null pointer and length " +
                                    std::to_string(t.length));
    }
    if (t.device.index < 0 ||
        static_cast<uint32_t>(t.device.index) > kMaxDeviceIndex) {
      return Error::invalidArgument("tensor " + std::to_string(i) +
                                    " has device index " +
                                    std::to_string(t.device.index));
    }
  }
  return Error();
}

void encodeFrameHead(const Message& m, std::vector<uint8_t>* out,
                     const std::vector<OutOfBand>* outOfBand) {
  // Built by hand rather than with WireWriter: this runs once per message on
  // the latency path and must not allocate beyond `out`.
  const size_t start = out->size();
  // At most 10 bytes a varint: one reservation, not a growth per byte.
  size_t bound = kFrameHeaderBytes + 1 + 3 * 10 + 10 * m.payloads.size() +
                 22 * m.tensors.size();
  if (outOfBand != nullptr) {
    for (const OutOfBand& o : *outOfBand) {
      bound += 1 + 10 + o.record.size();
    }
  }
  out->reserve(start + bound);
  out->resize(start + kFrameHeaderBytes);
  auto putVarint = [out](uint64_t v) {
    while (v >= 0x80) {
      out->push_back(static_cast<uint8_t>(v | 0x80));
      v >>= 7;
    }
    out->push_back(static_cast<uint8_t>(v));
  };
  out->push_back(outOfBand != nullptr ? kFrameMessageOutOfBand : kFrameMessage);
  putVarint(m.descriptor.size());
  putVarint(m.payloads.size());
  for (const auto& p : m.payloads) {
    putVarint(p.length);
  }
  putVarint(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const auto& t = m.tensors[i];
    putVarint(t.length);
    out->push_back(static_cast<uint8_t>(t.device.type));
    putVarint(static_cast<uint64_t>(t.device.index));
    if (outOfBand != nullptr) {
      const OutOfBand& o = (*outOfBand)[i];
      if (o.present) {
        out->push_back(kPlacementOutOfBand);
        putVarint(o.record.size());
        out->insert(out->end(), o.record.begin(), o.record.end());
      } else {
        out->push_back(kPlacementInline);
      }
    }
  }
  const auto len =
      static_cast<uint32_t>(out->size() - start - kFrameHeaderBytes);
  for (int i = 0; i < 4; ++i) {
    (*out)[start + i] = static_cast<uint8_t>(len >> (8 * i));
  }
}

std::vector<uint8_t> encodeCompletion(Code code, const std::string& reason) {
  WireWriter w;
  w.putFixed32(0);
  w.putU8(kFrameCompletion);
  w.putU8(static_cast<uint8_t>(code));
  w.putString(std::string_view(reason).substr(0, kMaxReasonBytes));
  auto out = w.release();
  const auto len = static_cast<uint32_t>(out.size() - kFrameHeaderBytes);
  for (int i = 0; i < 4; ++i) {
    out[i] = static_cast<uint8_t>(len >> (8 * i));
  }
  return out;
}

Error decodeFrameHeader(std::span<const uint8_t> header, const Limits& limits,
                        size_t* layoutLength) {
  if (header.size() != kFrameHeaderBytes) {
    return Error::protocol("message frame: truncated header");
  }
  const uint32_t len = readLe32(header.data());
  const size_t max = maxLayoutBytes(limits);
  if (len == 0 || len > max) {
    return Error::protocol("message frame: layout length " +
                           std::to_string(len) + " outside 1.." +
                           std::to_string(max));
  }
  *layoutLength = len;
  return Error();
}

Error decodeLayout(std::span<const uint8_t> layout, const Limits& limits,
                   FrameLayout* out) {
  WireReader r(layout, "message frame");
  const uint8_t type = r.u8("frame type");
  if (r.ok() && type != kFrameMessage && type != kFrameMessageOutOfBand &&
      type != kFrameCompletion) {
    r.fail("frame type", "unknown frame type " + std::to_string(type));
  }
  out->type = type;
  out->outOfBand.clear();
  out->completionCode = Code::kOk;
  out->completionReason.clear();
  if (r.ok() && type == kFrameCompletion) {
    const uint8_t status = r.u8("completion status");
    if (r.ok() && status > static_cast<uint8_t>(Code::kUnauthenticated)) {
      r.fail("completion status",
             "unknown completion status " + std::to_string(status));
    }
    out->completionCode = static_cast<Code>(status);
    out->completionReason =
        std::string(r.string(kMaxReasonBytes, "completion reason"));
    out->descriptorLength = 0;
    out->payloadLengths.clear();
    out->tensors.clear();
    r.expectEnd();
    return r.error();
  }
  out->descriptorLength =
      r.varint(limits.maxDescriptorBytes, "descriptor length");
  const uint64_t np = r.varint(limits.maxPayloadsPerMessage, "payload count");
  out->payloadLengths.clear();
  for (uint64_t i = 0; i < np && r.ok(); ++i) {
    out->payloadLengths.push_back(
        r.varint(limits.maxPayloadBytes, "payload length"));
  }
  const uint64_t nt = r.varint(limits.maxTensorsPerMessage, "tensor count");
  out->tensors.clear();
  size_t recordBytes = 0;
  for (uint64_t i = 0; i < nt && r.ok(); ++i) {
    Descriptor::TensorInfo t;
    t.length = r.varint(limits.maxTensorBytes, "tensor length");
    const uint8_t dt = r.u8("device type");
    if (r.ok() && dt > static_cast<uint8_t>(DeviceType::kCuda)) {
      r.fail("device type", "unknown device type " + std::to_string(dt));
    }
    t.device.type = static_cast<DeviceType>(dt);
    t.device.index =
        static_cast<int32_t>(r.varint(kMaxDeviceIndex, "device index"));
    bool outOfBand = false;
    if (type == kFrameMessageOutOfBand) {
      OutOfBand o;
      const uint8_t placement = r.u8("placement");
      if (r.ok() && placement > kPlacementOutOfBand) {
        r.fail("placement", "unknown placement " + std::to_string(placement));
      }
      if (r.ok() && placement == kPlacementOutOfBand) {
        // bytes() checks the length against the bound before anything is
        // copied; the frame total is checked as the records add up.
        auto rec = r.bytes(kMaxOutOfBandRecordBytes, "out-of-band record");
        recordBytes += rec.size();
        if (r.ok() && recordBytes > kMaxOutOfBandBytesPerFrame) {
          r.fail("out-of-band record",
                 "records add up to more than " +
                     std::to_string(kMaxOutOfBandBytesPerFrame) +
                     " bytes in one frame");
        }
        if (r.ok()) {
          o.present = true;
          outOfBand = true;
          o.record.assign(rec.begin(), rec.end());
        }
      }
      out->outOfBand.push_back(std::move(o));
    }
    if (r.ok() && t.device.type == DeviceType::kCuda && t.length > 0 &&
        !outOfBand) {
      r.fail("placement", "a non-empty " + t.device.toString() +
                              " tensor sent inline (CUDA tensors only "
                              "travel out of band)");
    }
    out->tensors.push_back(t);
  }
  r.expectEnd();
  return r.error();
}

}  // namespace trellis::transport::wire_format
