// Fuzz target for the transport's wire decoders (transport/wire_format.h):
// handshake header, hello / hello reply, auth, accept, the upgrade's bind /
// upgrade failed / decision, frame header and frame layout (message,
// opaque out-of-band records, completion). Arbitrary bytes must never crash,
// read out of bounds or make a decoder accept a length beyond its limit;
// whatever decodes must re-encode and decode to the same values.
//
// Input: byte 0 selects the decoder, byte 1 tightens the limits, the rest
// is the message.
#include <cstdint>
#include <cstdlib>
#include <span>

#include <trellis/transport/wire_format.h>

namespace {

namespace wf = trellis::transport::wire_format;
using trellis::transport::Limits;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

void helloRoundTrip(std::span<const uint8_t> body, wf::HandshakeType type) {
  wf::Hello h;
  if (!wf::decodeHello(body, type, &h).ok()) {
    return;
  }
  require(h.version == wf::kProtocolVersion);
  require(h.transports.size() <= wf::kMaxNames);
  require(h.hostId.size() <= wf::kMaxHostIdBytes);
  const auto bytes = wf::encodeHello(type, h);
  size_t len = 0;
  require(wf::decodeHandshakeHeader(
              std::span<const uint8_t>(bytes.data(), wf::kHandshakeHeaderBytes),
              type, &len)
              .ok());
  wf::Hello back;
  require(wf::decodeHello(std::span<const uint8_t>(bytes).subspan(
                              wf::kHandshakeHeaderBytes),
                          type, &back)
              .ok());
  require(back.transports == h.transports && back.channels == h.channels &&
          back.hostId == h.hostId && back.pid == h.pid &&
          back.tokenConfigured == h.tokenConfigured);
  if (type == wf::HandshakeType::kHelloReply) {
    require(back.nonce == h.nonce);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) {
    return 0;
  }
  const uint8_t selector = data[0];
  Limits limits;
  if (data[1] & 1) {
    limits.maxDescriptorBytes = 1u << (data[1] >> 4);
    limits.maxPayloadBytes = 1u << ((data[1] >> 2) & 0x1f);
    limits.maxPayloadsPerMessage = data[1] >> 3;
    limits.maxTensorsPerMessage = data[1] >> 4;
    limits.maxTensorBytes = 4096;
  }
  std::span<const uint8_t> in(data + 2, size - 2);
  switch (selector % 8) {
    case 0: {
      size_t len = 0;
      if (in.size() >= wf::kHandshakeHeaderBytes &&
          wf::decodeHandshakeHeader(
              in.first(wf::kHandshakeHeaderBytes),
              static_cast<wf::HandshakeType>(1 + (selector >> 3) % 7), &len)
              .ok()) {
        require(len <= wf::kMaxHandshakeBodyBytes);
      }
      break;
    }
    case 1:
      helloRoundTrip(in, wf::HandshakeType::kHello);
      break;
    case 2:
      helloRoundTrip(in, wf::HandshakeType::kHelloReply);
      break;
    case 3: {
      wf::AuthMessage a;
      if (wf::decodeAuth(in, &a).ok()) {
        const auto bytes = wf::encodeAuth(a);
        wf::AuthMessage back;
        require(wf::decodeAuth(std::span<const uint8_t>(bytes).subspan(
                                   wf::kHandshakeHeaderBytes),
                               &back)
                    .ok());
        require(back.nonce == a.nonce && back.proof == a.proof);
      }
      wf::BindMessage b;
      if (wf::decodeBind(in, &b).ok()) {
        const auto bytes = wf::encodeBind(b);
        wf::BindMessage back;
        require(wf::decodeBind(std::span<const uint8_t>(bytes).subspan(
                                   wf::kHandshakeHeaderBytes),
                               &back)
                    .ok());
        require(back.token == b.token && back.proof == b.proof);
      }
      break;
    }
    case 4: {
      wf::AcceptMessage m;
      if (wf::decodeAccept(in, &m).ok()) {
        require(m.reason.size() <= wf::kMaxReasonBytes);
        const auto bytes = wf::encodeAccept(m);
        wf::AcceptMessage back;
        require(wf::decodeAccept(std::span<const uint8_t>(bytes).subspan(
                                     wf::kHandshakeHeaderBytes),
                                 &back)
                    .ok());
        require(back.status == m.status && back.reason == m.reason &&
                back.transport == m.transport && back.channel == m.channel &&
                back.cudaChannel == m.cudaChannel &&
                back.upgradeAddress == m.upgradeAddress &&
                back.upgradeToken == m.upgradeToken);
        require(m.upgradeAddress.size() <= wf::kMaxUpgradeAddressBytes);
        require(m.upgradeAddress.empty() != m.upgradeToken.has_value());
        if (wf::checkUpgradeAddress(m.upgradeAddress).ok()) {
          require(m.upgradeAddress.rfind("shm://", 0) == 0);
        }
      }
      break;
    }
    case 5: {
      size_t len = 0;
      if (in.size() >= wf::kFrameHeaderBytes &&
          wf::decodeFrameHeader(in.first(wf::kFrameHeaderBytes), limits, &len)
              .ok()) {
        require(len > 0 && len <= wf::maxLayoutBytes(limits));
      }
      std::string reason;
      if (wf::decodeUpgradeFailed(in, &reason).ok()) {
        require(reason.size() <= wf::kMaxReasonBytes);
      }
      wf::UpgradeDecision d;
      if (wf::decodeUpgradeDecision(in, &d).ok()) {
        require(d == wf::UpgradeDecision::kSwitch ||
                d == wf::UpgradeDecision::kStay);
      }
      break;
    }
    default: {
      wf::FrameLayout lay;
      if (!wf::decodeLayout(in, limits, &lay).ok()) {
        break;
      }
      require(lay.descriptorLength <= limits.maxDescriptorBytes);
      require(lay.payloadLengths.size() <= limits.maxPayloadsPerMessage);
      require(lay.tensors.size() <= limits.maxTensorsPerMessage);
      require(in.size() <= wf::maxLayoutBytes(limits));
      for (size_t n : lay.payloadLengths) {
        require(n <= limits.maxPayloadBytes);
      }
      for (const auto& t : lay.tensors) {
        require(t.length <= limits.maxTensorBytes);
      }
      size_t recordBytes = 0;
      if (lay.type == wf::kFrameMessageOutOfBand) {
        require(lay.outOfBand.size() == lay.tensors.size());
        for (const auto& o : lay.outOfBand) {
          require(o.present || o.record.empty());
          require(o.record.size() <= wf::kMaxOutOfBandRecordBytes);
          recordBytes += o.record.size();
        }
      } else {
        require(lay.outOfBand.empty());
      }
      require(recordBytes <= wf::kMaxOutOfBandBytesPerFrame);
      for (size_t i = 0; i < lay.tensors.size(); ++i) {
        // A non-empty CUDA tensor never travels inline.
        if (lay.tensors[i].device.type ==
                trellis::transport::DeviceType::kCuda &&
            lay.tensors[i].length > 0) {
          require(i < lay.outOfBand.size() && lay.outOfBand[i].present);
        }
      }
      // Message layouts re-encode to the same bytes (small descriptors only:
      // the round trip allocates one).
      if (lay.type != wf::kFrameCompletion && lay.descriptorLength <= 4096) {
        trellis::transport::Message m;
        m.descriptor.assign(lay.descriptorLength, 'd');
        for (size_t n : lay.payloadLengths) {
          m.payloads.push_back({nullptr, n});
        }
        for (const auto& t : lay.tensors) {
          m.tensors.push_back({nullptr, t.length, t.device});
        }
        std::vector<uint8_t> bytes;
        wf::encodeFrameHead(
            m, &bytes,
            lay.type == wf::kFrameMessageOutOfBand ? &lay.outOfBand : nullptr);
        wf::FrameLayout back;
        require(wf::decodeLayout(std::span<const uint8_t>(bytes).subspan(
                                     wf::kFrameHeaderBytes),
                                 limits, &back)
                    .ok());
        require(back.type == lay.type &&
                back.descriptorLength == lay.descriptorLength &&
                back.payloadLengths == lay.payloadLengths &&
                back.tensors.size() == lay.tensors.size() &&
                back.outOfBand.size() == lay.outOfBand.size());
        for (size_t i = 0; i < back.outOfBand.size(); ++i) {
          require(back.outOfBand[i].present == lay.outOfBand[i].present &&
                  back.outOfBand[i].record == lay.outOfBand[i].record);
        }
      }
      if (lay.type == wf::kFrameCompletion) {
        require(lay.completionReason.size() <= wf::kMaxReasonBytes);
        require(lay.tensors.empty() && lay.payloadLengths.empty());
      }
      break;
    }
  }
  return 0;
}
