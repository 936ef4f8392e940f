// Fuzz target for the RPC layer's own protocol messages, which any worker
// of the group can send: the RRef protocol's fork, delete, accept and
// fetch arguments, an RRef travelling as an argument, and the RRef
// extension's payload of remote() and method calls (rref/protocol.h),
// and distributed autograd's gradient and release messages with their
// checks (dist_autograd/messages.h). Arbitrary bytes must never crash,
// throw, read outside the message or accept an id outside the group; what
// decodes must re-encode to the same values.
//
// Input: byte 0 selects the message (% 4, or 4 for the RRef call payload
// when byte 0 % 8 is 4; / 8, a world size of 1-32);
// for gradients, byte 1 is the number of received buffers (mod 4) and one
// u16 length per buffer follows; the rest is the message's argument bytes.
#include <ATen/core/Tensor.h>
// Not <ATen/ops/empty.h>: with libtorch 1.13 it does not compile under
// clang 14 in C++20 mode (the fuzz preset's compiler).
#include <ATen/EmptyTensor.h>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include <trellis/dist_autograd/messages.h>
#include <trellis/rpc/codec.h>
#include <trellis/rref/protocol.h>

namespace {

namespace rd = trellis::rpc::detail;
namespace dd = trellis::dist_autograd::detail;
using trellis::Code;
using trellis::rpc::Decoder;
using trellis::rpc::Encoder;

void require(bool cond) {
  if (!cond) {
    std::abort();
  }
}

bool inGroup(const rd::ProtocolRRefId& id, int32_t world) {
  return id.worker < static_cast<uint32_t>(world);
}

void twoIds(std::span<const uint8_t> args, int32_t world) {
  Decoder d(args, {});
  rd::ProtocolRRefId a, b;
  const auto e = rd::decodeTwoIds(d, world, &a, &b);
  if (!e.ok()) {
    require(e.code() == Code::kDataLoss);
    return;
  }
  require(inGroup(a, world) && inGroup(b, world));
  Encoder enc;
  trellis::rpc::encodeArgs(enc, a.worker, a.local, b.worker, b.local);
  Decoder again(enc.wire().bytes(), {});
  rd::ProtocolRRefId a2, b2;
  require(rd::decodeTwoIds(again, world, &a2, &b2).ok());
  require(a2.worker == a.worker && a2.local == a.local &&
          b2.worker == b.worker && b2.local == b.local);
}

void fetch(std::span<const uint8_t> args, int32_t world) {
  Decoder d(args, {});
  rd::ProtocolRRefId id;
  std::string type;
  const auto e = rd::decodeFetch(d, world, &id, &type);
  if (!e.ok()) {
    require(e.code() == Code::kDataLoss);
    return;
  }
  require(inGroup(id, world) && type.size() <= rd::kMaxRRefTypeBytes);
}

void rrefWire(std::span<const uint8_t> args, int32_t world) {
  static const std::string kType = "N7counter7CounterE";
  Decoder d(args, {});
  rd::RRefWire w;
  if (!rd::decodeRRefWire(d, world, kType, &w)) {
    require(!d.ok() && d.error().code() == Code::kDataLoss);
    return;
  }
  require(inGroup(w.id, world) && inGroup(w.child, world) && w.owner >= 0 &&
          w.owner < world);
  Encoder enc;
  rd::encodeRRefWire(enc, w, kType);
  Decoder again(enc.wire().bytes(), {});
  rd::RRefWire back;
  require(rd::decodeRRefWire(again, world, kType, &back));
  require(back.id.worker == w.id.worker && back.id.local == w.id.local &&
          back.owner == w.owner && back.child.worker == w.child.worker &&
          back.child.local == w.child.local);
  // Another type is refused.
  Decoder other(enc.wire().bytes(), {});
  require(!rd::decodeRRefWire(other, world, "i", &back));
}

// The payload rref/'s extension reads from Envelope.extension_payload.
void rrefCall(std::span<const uint8_t> args, int32_t world) {
  const std::string_view bytes(reinterpret_cast<const char*>(args.data()),
                               args.size());
  rd::RRefCall call;
  const auto e = rd::decodeRRefCall(bytes, world, &call);
  if (!e.ok()) {
    require(e.code() == Code::kDataLoss);
    return;
  }
  require(call.storeResult || call.method);
  require(!call.valueInReply || call.storeResult);
  require(!call.storeResult ||
          (inGroup(call.rref, world) && inGroup(call.fork, world)));
  require(!call.method || inGroup(call.target, world));
  // What decodes re-encodes to the same bytes (the encoding is canonical
  // but for overlong varints, which re-encode shorter).
  const std::string again = rd::encodeRRefCall(call);
  rd::RRefCall back;
  require(rd::decodeRRefCall(again, world, &back).ok());
  require(back.storeResult == call.storeResult && back.method == call.method &&
          back.valueInReply == call.valueInReply);
  require(!call.storeResult || (back.rref.worker == call.rref.worker &&
                                back.rref.local == call.rref.local &&
                                back.fork.worker == call.fork.worker &&
                                back.fork.local == call.fork.local));
  require(!call.method || (back.target.worker == call.target.worker &&
                           back.target.local == call.target.local));
}

// propagateGradients(contextId, messageId, retainGraph, gradients), its
// arguments decoded as the registry does, then checked against a message
// that sent a float [2, 3] and a double [4] tensor.
void gradients(std::span<const uint8_t> in, int32_t world) {
  if (in.empty()) {
    return;
  }
  const size_t n = in[0] % 4;
  size_t pos = 1;
  if (in.size() < pos + 2 * n) {
    return;
  }
  std::vector<at::Tensor> spans;
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = (in[pos] | (in[pos + 1] << 8)) % 257;
    pos += 2;
    spans.push_back(
        at::detail::empty_cpu({len}, at::kByte, false, c10::nullopt));
  }
  const auto args = in.subspan(pos);
  trellis::rpc::DecodeLimits limits;
  limits.maxElements = 1 << 12;
  limits.maxDims = 8;
  Decoder d(args, spans, nullptr, limits);
  auto [contextId, messageId, retain, grads] =
      trellis::rpc::decodeArgs<uint64_t, uint64_t, bool,
                               std::vector<at::Tensor>>(d);
  const auto e = d.finish();
  if (!e.ok()) {
    require(e.code() == Code::kDataLoss);
    return;
  }
  (void)messageId;
  (void)retain;
  const auto idCheck = dd::checkContextId(contextId, world);
  require(idCheck.ok() ==
          ((contextId >> dd::kCounterBits) < static_cast<uint64_t>(world)));
  require(!dd::contextName(contextId).empty());
  dd::SentTensors sent;
  sent.sizes = {{2, 3}, {4}};
  sent.dtypes = {at::kFloat, at::kDouble};
  const auto g = dd::checkGradients(sent, grads);
  if (g.ok()) {
    require(grads.size() == 2);
    for (size_t i = 0; i < 2; ++i) {
      require(!grads[i].defined() ||
              (grads[i].sizes() == at::IntArrayRef(sent.sizes[i]) &&
               grads[i].scalar_type() == sent.dtypes[i]));
    }
  } else {
    require(g.code() == Code::kInvalidArgument);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) {
    return 0;
  }
  const int32_t world = 1 + (data[0] / 8) % 32;
  const std::span<const uint8_t> rest(data + 1, size - 1);
  if (data[0] % 8 == 4) {
    rrefCall(rest, world);
    return 0;
  }
  switch (data[0] % 4) {
    case 0:
      twoIds(rest, world);
      break;
    case 1:
      fetch(rest, world);
      break;
    case 2:
      rrefWire(rest, world);
      break;
    default:
      gradients(rest, world);
      break;
  }
  return 0;
}
