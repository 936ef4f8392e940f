#include <ATen/EmptyTensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/TensorOptions.h>
#include <cstring>
#include <exception>
#include <utility>

#include <trellis/rpc/autograd_hooks.h>
#include <trellis/rpc/codec.h>

namespace trellis::rpc {
namespace {

// Wire codes of the dtypes that may travel. They are ATen's ScalarType
// numbers, written out so that the wire does not move if ATen renumbers.
struct DtypeCode {
  uint8_t code;
  at::ScalarType type;
};
constexpr DtypeCode kDtypes[] = {
    {0, at::ScalarType::Byte},         {1, at::ScalarType::Char},
    {2, at::ScalarType::Short},        {3, at::ScalarType::Int},
    {4, at::ScalarType::Long},         {5, at::ScalarType::Half},
    {6, at::ScalarType::Float},        {7, at::ScalarType::Double},
    {9, at::ScalarType::ComplexFloat}, {10, at::ScalarType::ComplexDouble},
    {11, at::ScalarType::Bool},        {15, at::ScalarType::BFloat16},
};

std::optional<uint8_t> dtypeToCode(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) {
      return d.code;
    }
  }
  return std::nullopt;
}

std::optional<at::ScalarType> codeToDtype(uint8_t code) {
  for (const auto& d : kDtypes) {
    if (d.code == code) {
      return d.type;
    }
  }
  return std::nullopt;
}

// How a tensor travels (docs/rpc_wire.md, "Tensors"): the first byte of
// its description.
constexpr uint8_t kTensorUndefined = 0;
constexpr uint8_t kTensorSpan = 1;    // a transport tensor of its own
constexpr uint8_t kTensorInline = 2;  // its bytes inside the description

constexpr uint8_t kDeviceCpu = 0;
constexpr uint8_t kDeviceCuda = 1;
constexpr int64_t kMaxDeviceIndex = 255;

[[noreturn]] void encodeMisuse(std::string message) {
  throwError(Error::invalidArgument("rpc encode: " + std::move(message)));
}

// The tensor as it will be sent: its own layout when that is a dense block
// of memory, a contiguous copy otherwise. Autograd history, conjugate and
// negative bits do not travel (they are resolved into the values).
at::Tensor sendable(const at::Tensor& t) {
  if (!t.defined()) {
    encodeMisuse("undefined tensor given to addTensor");
  }
  if (t.layout() != at::kStrided) {
    encodeMisuse("only strided tensors can be sent");
  }
  if (!dtypeToCode(t.scalar_type())) {
    encodeMisuse(std::string("dtype ") + c10::toString(t.scalar_type()) +
                 " cannot be sent");
  }
  const auto dev = t.device().type();
  if (dev != c10::DeviceType::CPU && dev != c10::DeviceType::CUDA) {
    encodeMisuse("tensors on " + t.device().str() + " cannot be sent");
  }
  if (!t.is_conj() && !t.is_neg() && t.is_non_overlapping_and_dense()) {
    return t;  // its memory is sent as it is (spanOf takes no history)
  }
  at::Tensor p = t.detach();
  if (p.is_conj()) {
    p = p.resolve_conj();
  }
  if (p.is_neg()) {
    p = p.resolve_neg();
  }
  if (!p.is_non_overlapping_and_dense()) {
    p = p.contiguous();
  }
  return p;
}

// A tensor of `dtype` with the given layout over `storage`, built directly
// rather than by ATen view ops: slice, view and as_strided each go through
// the dispatcher and autograd's view tracking, which cost several µs per
// tensor here, a third of a small call. The result shares the memory but
// is no autograd view of anything (it has no history and its own version
// counter): fine for a message's tensors, which nothing else refers to.
at::Tensor onStorage(const c10::Storage& storage, c10::Device device,
                     at::ScalarType dtype, at::IntArrayRef sizes,
                     at::IntArrayRef strides, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(storage),
      c10::DispatchKeySet(c10::computeDispatchKey(dtype, at::kStrided, device)),
      c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(sizes, strides);
  impl->set_storage_offset(offset);
  return at::Tensor(std::move(impl));
}

// The bytes of a dense tensor as a 1-D uint8 tensor on its storage. Strides
// are never negative in ATen, so a dense tensor's first element is its
// lowest address and its numel elements follow without gaps.
at::Tensor spanOf(const at::Tensor& dense) {
  const int64_t itemsize = static_cast<int64_t>(dense.element_size());
  const int64_t bytes = dense.numel() * itemsize;
  return onStorage(dense.storage(), dense.device(), at::ScalarType::Byte,
                   {bytes}, {1}, dense.storage_offset() * itemsize);
}

bool mulOverflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_mul_overflow(a, b, out);
}
bool addOverflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_add_overflow(a, b, out);
}

// Whether every byte of a bool tensor's data is 0 or 1 (any other byte
// makes a bool that is neither).
bool validBoolBytes(const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (p[i] > 1) {
      return false;
    }
  }
  return true;
}

// Only floating and complex tensors can require grad (autograd's rule).
bool canRequireGrad(at::ScalarType dtype) {
  return c10::isFloatingType(dtype) || c10::isComplexType(dtype);
}

// A received tensor that requires grad goes to distributed autograd's
// receiver when there is one, else becomes a leaf that requires grad.
void requireGrad(at::Tensor& t, GradReceiver* receiver) {
  if (receiver != nullptr) {
    receiver->attach(t);
  } else {
    t.set_requires_grad(true);
  }
}

}  // namespace

Encoder::Encoder(Encoder&& other) noexcept
    : wire_(std::move(other.wire_)),
      tensors_(std::move(other.tensors_)),
      gradTensors_(std::move(other.gradTensors_)),
      inlineBytes_(std::exchange(other.inlineBytes_, 0)),
      tensorsApart_(other.tensorsApart_),
      context_(other.context_),
      unsent_(std::exchange(other.unsent_, {})) {}

Encoder& Encoder::operator=(Encoder&& other) noexcept {
  if (this != &other) {
    undoUnsent();  // this message is replaced: it never goes
    wire_ = std::move(other.wire_);
    tensors_ = std::move(other.tensors_);
    gradTensors_ = std::move(other.gradTensors_);
    inlineBytes_ = std::exchange(other.inlineBytes_, 0);
    tensorsApart_ = other.tensorsApart_;
    context_ = other.context_;
    unsent_ = std::exchange(other.unsent_, {});
  }
  return *this;
}

void Encoder::undoUnsent() noexcept {
  // Last registered first, as a destructor would.
  for (auto it = unsent_.rbegin(); it != unsent_.rend(); ++it) {
    (*it)();
  }
  unsent_.clear();
}

uint32_t Encoder::addTensor(const at::Tensor& t) {
  // Kept as it is: a byte view of it (spanOf) would cost a tensor object
  // made and freed per tensor sent, and the transport needs only its
  // address and length.
  tensors_.push_back(sendable(t));
  return static_cast<uint32_t>(tensors_.size() - 1);
}

std::vector<at::Tensor> Encoder::tensors() const {
  std::vector<at::Tensor> spans;
  spans.reserve(tensors_.size());
  for (const auto& t : tensors_) {
    spans.push_back(spanOf(t));
  }
  return spans;
}

Decoder::Decoder(std::span<const uint8_t> bytes,
                 std::vector<at::Tensor> tensors, CodecContext* context,
                 DecodeLimits limits)
    : wire_(bytes, "rpc payload"),
      tensors_(std::move(tensors)),
      used_(tensors_.size(), false),
      context_(context),
      limits_(limits) {}

size_t Decoder::count(size_t minBytesEach, std::string_view field) {
  const uint64_t n = wire_.varint(limits_.maxElements, field);
  if (!ok()) {
    return 0;
  }
  if (minBytesEach > 0 && n > wire_.remaining() / minBytesEach) {
    fail(field, "count " + std::to_string(n) + " needs at least " +
                    std::to_string(minBytesEach) + " bytes each, " +
                    std::to_string(wire_.remaining()) + " left");
    return 0;
  }
  return static_cast<size_t>(n);
}

Error Decoder::finish() {
  wire_.expectEnd();
  for (size_t i = 0; i < used_.size() && ok(); ++i) {
    if (!used_[i]) {
      fail("tensors", "tensor " + std::to_string(i) + " of " +
                          std::to_string(used_.size()) +
                          " was received but not used");
    }
  }
  return error();
}

at::Tensor Decoder::tensor(uint32_t index, const TensorMeta& meta) {
  if (!ok()) {
    return {};
  }
  if (index >= tensors_.size()) {
    fail("Tensor.index", "index " + std::to_string(index) + " out of range, " +
                             std::to_string(tensors_.size()) + " received");
    return {};
  }
  if (used_[index]) {
    fail("Tensor.index", "tensor " + std::to_string(index) + " used twice");
    return {};
  }
  used_[index] = true;
  at::Tensor span = tensors_[index];
  if (!span.defined() || span.dim() != 1 ||
      span.scalar_type() != at::ScalarType::Byte ||
      (span.size(0) > 1 && span.stride(0) != 1)) {
    fail("Tensor.index", "received span " + std::to_string(index) +
                             " is not a 1-D uint8 dense tensor");
    return {};
  }
  if (!dtypeToCode(meta.dtype)) {
    fail("Tensor.dtype", "dtype not allowed");
    return {};
  }
  if (meta.sizes.size() != meta.strides.size() ||
      meta.sizes.size() > limits_.maxDims) {
    fail("Tensor.dims", "bad rank " + std::to_string(meta.sizes.size()));
    return {};
  }
  const auto itemsize = static_cast<int64_t>(c10::elementSize(meta.dtype));
  const int64_t spanBytes = span.size(0);
  if (meta.offset < 0) {
    fail("Tensor.offset", "negative offset");
    return {};
  }
  int64_t numel = 1;
  int64_t last = meta.offset;  // highest element index reached
  for (size_t i = 0; i < meta.sizes.size(); ++i) {
    const int64_t size = meta.sizes[i];
    const int64_t stride = meta.strides[i];
    if (size < 0 || stride < 0) {
      fail("Tensor.sizes",
           "negative size or stride in dim " + std::to_string(i));
      return {};
    }
    if (mulOverflows(numel, size, &numel)) {
      fail("Tensor.sizes", "element count overflows");
      return {};
    }
    int64_t reach = 0;
    if (size > 0 && (mulOverflows(size - 1, stride, &reach) ||
                     addOverflows(last, reach, &last))) {
      fail("Tensor.strides", "extent overflows in dim " + std::to_string(i));
      return {};
    }
  }
  int64_t numelBytes = 0;
  if (mulOverflows(numel, itemsize, &numelBytes)) {
    fail("Tensor.sizes", "byte count overflows");
    return {};
  }
  // First byte past the last element reached (or the offset alone when the
  // tensor is empty: nothing is read then, but it must still be in range).
  int64_t end = 0;
  int64_t endElements = meta.offset;
  if ((numel > 0 && addOverflows(last, 1, &endElements)) ||
      mulOverflows(endElements, itemsize, &end) || end > spanBytes ||
      numelBytes > spanBytes) {
    fail("Tensor.strides", "sizes/strides/offset reach outside the " +
                               std::to_string(spanBytes) + "-byte span");
    return {};
  }
  try {
    const auto addr = reinterpret_cast<uintptr_t>(span.data_ptr());
    if (addr % static_cast<uintptr_t>(itemsize) != 0 ||
        span.storage_offset() % itemsize != 0) {
      span = span.clone();  // ATen wants elements aligned to their size
    }
    // Within the span (checked above), on its storage.
    at::Tensor out =
        onStorage(span.storage(), span.device(), meta.dtype, meta.sizes,
                  meta.strides, span.storage_offset() / itemsize + meta.offset);
    if (!out.is_non_overlapping_and_dense()) {
      fail("Tensor.strides", "layout overlaps or has gaps");
      return {};
    }
    if (meta.dtype == at::ScalarType::Bool && span.is_cpu() &&
        !validBoolBytes(static_cast<const uint8_t*>(span.data_ptr()),
                        static_cast<size_t>(spanBytes))) {
      fail("Tensor.data", "bool tensor holds a byte other than 0 or 1");
      return {};
    }
    if (meta.requiresGrad) {
      if (!canRequireGrad(meta.dtype)) {
        fail("Tensor.requires_grad", "set on a non-floating dtype");
        return {};
      }
      requireGrad(out, gradReceiver_);
    }
    return out;
  } catch (const std::exception& e) {
    fail("Tensor", std::string("cannot build tensor: ") + e.what());
    return {};
  }
}

at::Tensor Decoder::inlineTensor(const TensorMeta& meta,
                                 std::span<const uint8_t> data) {
  if (!ok()) {
    return {};
  }
  if (!dtypeToCode(meta.dtype)) {
    fail("Tensor.dtype", "dtype not allowed");
    return {};
  }
  if (meta.deviceType != c10::DeviceType::CPU) {
    fail("Tensor.device", "a tensor inside the argument bytes is on CPU");
    return {};
  }
  if (meta.sizes.size() > limits_.maxDims) {
    fail("Tensor.dims", "bad rank " + std::to_string(meta.sizes.size()));
    return {};
  }
  const auto itemsize = static_cast<int64_t>(c10::elementSize(meta.dtype));
  int64_t numel = 1;
  for (size_t i = 0; i < meta.sizes.size(); ++i) {
    if (meta.sizes[i] < 0) {
      fail("Tensor.sizes", "negative size in dim " + std::to_string(i));
      return {};
    }
    if (mulOverflows(numel, meta.sizes[i], &numel)) {
      fail("Tensor.sizes", "element count overflows");
      return {};
    }
  }
  int64_t bytes = 0;
  if (mulOverflows(numel, itemsize, &bytes) ||
      static_cast<uint64_t>(bytes) != data.size()) {
    fail("Tensor.data", std::to_string(data.size()) +
                            " bytes of data for a tensor of " +
                            std::to_string(numel) + " elements of " +
                            std::to_string(itemsize) + " bytes");
    return {};
  }
  if (meta.dtype == at::ScalarType::Bool &&
      !validBoolBytes(data.data(), data.size())) {
    fail("Tensor.data", "bool tensor holds a byte other than 0 or 1");
    return {};
  }
  if (meta.requiresGrad && !canRequireGrad(meta.dtype)) {
    fail("Tensor.requires_grad", "set on a non-floating dtype");
    return {};
  }
  try {
    // Made inside libtorch, as emptyBytes() says why.
    at::Tensor out = at::detail::empty_cpu(meta.sizes, meta.dtype);
    if (!data.empty()) {
      std::memcpy(out.data_ptr(), data.data(), data.size());
    }
    if (meta.requiresGrad) {
      requireGrad(out, gradReceiver_);
    }
    return out;
  } catch (const std::exception& e) {
    fail("Tensor", std::string("cannot build tensor: ") + e.what());
    return {};
  }
}

void encodeTensor(Encoder& e, const at::Tensor& t) {
  auto& w = e.wire();
  if (!t.defined()) {
    w.putU8(kTensorUndefined);
    return;
  }
  const at::Tensor p = sendable(t);
  const size_t bytes = p.nbytes();
  const bool inlined =
      p.is_cpu() && p.is_contiguous() && e.takeInlineRoom(bytes);
  uint32_t index = 0;
  if (!inlined) {
    index = e.addTensor(p);
  }
  w.putU8(inlined ? kTensorInline : kTensorSpan);
  w.putU8(*dtypeToCode(p.scalar_type()));
  w.putU8(p.is_cuda() ? kDeviceCuda : kDeviceCpu);
  w.putSignedVarint(p.is_cuda() ? t.device().index() : -1);
  w.putBool(t.requires_grad());
  if (t.requires_grad()) {
    e.noteGradTensor(t);
  }
  w.putVarint(static_cast<uint64_t>(p.dim()));
  for (int64_t s : p.sizes()) {
    w.putVarint(static_cast<uint64_t>(s));
  }
  if (inlined) {
    w.putBytes({static_cast<const uint8_t*>(p.data_ptr()), bytes});
    return;
  }
  for (int64_t s : p.strides()) {
    w.putVarint(static_cast<uint64_t>(s));
  }
  w.putVarint(0);  // the span starts at the first element
  w.putVarint(index);
}

at::Tensor emptyBytes(size_t length) {
  // at::detail::empty_cpu is what at::empty calls for a CPU tensor once the
  // dispatcher has picked the kernel; calling it directly skips the
  // dispatcher and keeps the tensor's storage made, and so freed, inside
  // libtorch (tests/tsan_suppressions.cc: a storage made here and freed
  // after its last, libtorch-side reference dropped would look racy to
  // TSan). Its size parameter takes int64_t in 1.13 and 2.x.
  const int64_t n = static_cast<int64_t>(length);
  return at::detail::empty_cpu({n}, at::ScalarType::Byte);
}

at::Tensor decodeTensor(Decoder& d) {
  auto& r = d.wire();
  const uint8_t form = r.u8("Tensor.form");
  if (!r.ok() || form == kTensorUndefined) {
    return {};
  }
  if (form != kTensorSpan && form != kTensorInline) {
    d.fail("Tensor.form", "unknown form " + std::to_string(form));
    return {};
  }
  TensorMeta m;
  const uint8_t code = r.u8("Tensor.dtype");
  const auto dtype = codeToDtype(code);
  if (r.ok() && !dtype) {
    d.fail("Tensor.dtype",
           "dtype code " + std::to_string(code) + " not in the allow-list");
    return {};
  }
  m.dtype = dtype.value_or(at::ScalarType::Undefined);
  const uint8_t dev = r.u8("Tensor.device");
  const int64_t devIndex = r.signedVarint("Tensor.device_index");
  if (r.ok() &&
      (dev > kDeviceCuda || devIndex < -1 || devIndex > kMaxDeviceIndex)) {
    d.fail("Tensor.device", "unknown device " + std::to_string(dev) + ":" +
                                std::to_string(devIndex));
    return {};
  }
  m.deviceType =
      dev == kDeviceCuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
  m.deviceIndex = static_cast<int32_t>(devIndex);
  m.requiresGrad = r.boolean("Tensor.requires_grad");
  const auto ndim = r.varint(d.limits().maxDims, "Tensor.dims");
  // Each size (and stride) takes at least one byte.
  if (r.ok() && ndim * (form == kTensorSpan ? 2 : 1) > r.remaining()) {
    d.fail("Tensor.dims", "truncated sizes/strides");
    return {};
  }
  constexpr auto kMax =
      static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  m.sizes.resize(ndim);
  for (auto& s : m.sizes) {
    s = static_cast<int64_t>(r.varint(kMax, "Tensor.sizes"));
  }
  if (form == kTensorInline) {
    const auto data = r.bytes(Encoder::kInlineTensorBytes, "Tensor.data");
    if (!r.ok()) {
      return {};
    }
    return d.inlineTensor(m, data);
  }
  m.strides.resize(ndim);
  for (auto& s : m.strides) {
    s = static_cast<int64_t>(r.varint(kMax, "Tensor.strides"));
  }
  m.offset = static_cast<int64_t>(r.varint(kMax, "Tensor.offset"));
  const uint64_t index =
      r.varint(std::numeric_limits<uint32_t>::max(), "Tensor.index");
  if (!r.ok()) {
    return {};
  }
  return d.tensor(static_cast<uint32_t>(index), m);
}

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

}  // namespace trellis::rpc
