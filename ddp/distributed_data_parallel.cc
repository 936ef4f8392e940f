#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cstdint>
#include <map>
#include <sstream>
#include <unordered_set>

#include <trellis/core/error.h>
#include <trellis/ddp/distributed_data_parallel.h>
#include <trellis/ddp/reducer.h>

namespace trellis::ddp {

namespace {

// Bound on one coalesced broadcast's buffer: large models are sent in
// pieces rather than doubled in memory at once.
constexpr size_t kBroadcastChunkBytes = size_t{64} << 20;

std::string dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kBool:
      return "bool";
    default:
      return c10::toString(t);
  }
}

// What must agree across ranks, one entry per parameter and buffer:
// "parameter fc1.weight float32[4, 8]".
std::vector<std::string> describe(const torch::nn::Module& module) {
  std::vector<std::string> out;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    std::ostringstream s;
    s << "parameter " << item.key() << " "
      << dtypeName(item.value().scalar_type()) << item.value().sizes()
      << (item.value().requires_grad() ? "" : " (requires_grad=false)");
    out.push_back(s.str());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    std::ostringstream s;
    s << "buffer " << item.key() << " " << dtypeName(item.value().scalar_type())
      << item.value().sizes();
    out.push_back(s.str());
  }
  return out;
}

// FNV-1a: the same on every rank and build, unlike std::hash.
int64_t fingerprint(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) {
    h = (h ^ c) * 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

at::Tensor int64s(const std::vector<int64_t>& v, const at::Device& device) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())},
                           at::TensorOptions().dtype(at::kLong));
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t.to(device);
}

// Every rank's `value` (same length everywhere), on the CPU.
std::vector<std::vector<int64_t>> allgatherInt64(
    collectives::ProcessGroup& group, const std::vector<int64_t>& value,
    const at::Device& device) {
  at::Tensor in = int64s(value, device);
  std::vector<at::Tensor> outs;
  for (int r = 0; r < group.size(); ++r) {
    outs.push_back(at::empty_like(in));
  }
  group.allgather(outs, in).wait();
  std::vector<std::vector<int64_t>> result;
  for (auto& o : outs) {
    at::Tensor c = o.cpu();
    result.emplace_back(c.data_ptr<int64_t>(),
                        c.data_ptr<int64_t>() + c.numel());
  }
  return result;
}

// "ranks 0, 2" / "rank 1".
std::string rankList(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t k = 0; k < ranks.size(); ++k) {
    s += (k ? ", " : "") + std::to_string(ranks[k]);
  }
  return s;
}

// Collective: every rank learns whether all have the same entries, and on a
// difference every rank throws the same error, naming the first differing
// entry and what each rank has there. Every rank issues the same ops
// whatever it finds, so none is left waiting.
void checkSameModel(collectives::ProcessGroup& group,
                    const std::vector<std::string>& entries,
                    const at::Device& device) {
  int64_t whole = fingerprint(std::to_string(entries.size()));
  std::vector<int64_t> each;
  for (const auto& e : entries) {
    each.push_back(fingerprint(e));
    whole = fingerprint(e, static_cast<uint64_t>(whole));
  }
  const auto summaries = allgatherInt64(
      group, {static_cast<int64_t>(entries.size()), whole}, device);
  const bool same =
      std::all_of(summaries.begin(), summaries.end(),
                  [&](const auto& s) { return s == summaries[0]; });
  if (same) {
    return;
  }
  // Which entry differs first: every rank's per-entry fingerprints, padded
  // to the longest list (0 stands for "no such entry").
  int64_t longest = 0;
  for (const auto& s : summaries) {
    longest = std::max(longest, s[0]);
  }
  std::vector<int64_t> padded(static_cast<size_t>(longest), 0);
  std::copy(each.begin(), each.end(), padded.begin());
  const auto all = allgatherInt64(group, padded, device);
  size_t first = 0;
  while (first < static_cast<size_t>(longest)) {
    bool agree = true;
    for (const auto& v : all) {
      agree = agree && v[first] == all[0][first];
    }
    if (!agree) {
      break;
    }
    ++first;
  }
  // What each rank has there, as text (bytes carried in int64s).
  const std::string mine = first < entries.size() ? entries[first] : "";
  const auto lengths =
      allgatherInt64(group, {static_cast<int64_t>(mine.size())}, device);
  size_t maxLen = 0;
  for (const auto& l : lengths) {
    maxLen = std::max(maxLen, static_cast<size_t>(l[0]));
  }
  std::vector<int64_t> bytes(std::max<size_t>(maxLen, 1), 0);
  for (size_t k = 0; k < mine.size(); ++k) {
    bytes[k] = static_cast<unsigned char>(mine[k]);
  }
  const auto texts = allgatherInt64(group, bytes, device);
  std::map<std::string, std::vector<int>> byText;
  std::vector<std::string> order;
  for (int r = 0; r < group.size(); ++r) {
    std::string t;
    for (size_t k = 0; k < static_cast<size_t>(lengths[r][0]); ++k) {
      t.push_back(static_cast<char>(texts[r][k]));
    }
    if (t.empty()) {
      t = "nothing (fewer parameters and buffers)";
    }
    if (!byText.count(t)) {
      order.push_back(t);
    }
    byText[t].push_back(r);
  }
  std::ostringstream msg;
  msg << "DistributedDataParallel: the ranks' modules differ at entry #"
      << first << " of their parameters and buffers: ";
  for (size_t k = 0; k < order.size(); ++k) {
    msg << (k ? "; " : "") << rankList(byText[order[k]]) << " "
        << (byText[order[k]].size() == 1 ? "has " : "have ") << order[k];
  }
  throwError(Error::invalidArgument(msg.str()));
}

// Rank `root`'s values into `tensors` on every rank: one broadcast per dtype
// and device and per kBroadcastChunkBytes, not one per tensor.
void broadcastCoalesced(collectives::ProcessGroup& group,
                        const std::vector<at::Tensor>& tensors, int root = 0) {
  if (group.size() == 1 || tensors.empty()) {
    return;
  }
  at::NoGradGuard noGrad;
  struct Chunk {
    std::vector<at::Tensor> members;
    size_t bytes = 0;
    at::Tensor flat;
    std::optional<collectives::Work> work;
  };
  std::vector<Chunk> chunks;
  std::vector<Chunk> open;  // one being filled per dtype and device
  auto flush = [&](Chunk& c) {
    std::vector<at::Tensor> flat;
    for (const auto& t : c.members) {
      flat.push_back(t.reshape({-1}));
    }
    c.flat = at::cat(flat);
    c.work = group.broadcast(c.flat, root);
    chunks.push_back(std::move(c));
    c = Chunk{};
  };
  for (const auto& t : tensors) {
    if (t.numel() == 0) {
      continue;
    }
    auto it = std::find_if(open.begin(), open.end(), [&](const Chunk& c) {
      return !c.members.empty() &&
             c.members[0].scalar_type() == t.scalar_type() &&
             c.members[0].device() == t.device();
    });
    if (it == open.end()) {
      open.emplace_back();
      it = open.end() - 1;
    }
    it->members.push_back(t);
    it->bytes += static_cast<size_t>(t.numel()) * t.element_size();
    if (it->bytes >= kBroadcastChunkBytes) {
      flush(*it);
      open.erase(it);
    }
  }
  for (auto& c : open) {
    flush(c);
  }
  for (auto& c : chunks) {
    c.work->wait();  // bounded by the group's timeout
    if (group.rank() != root) {
      int64_t offset = 0;
      for (auto& t : c.members) {
        t.copy_(c.flat.narrow(0, offset, t.numel()).view_as(t));
        offset += t.numel();
      }
    }
  }
}

std::vector<at::Tensor> buffersOf(const torch::nn::Module& module) {
  return module.buffers(/*recurse=*/true);
}

}  // namespace

namespace hooks {

CommHook allreduce() {
  return [](GradBucket& bucket) {
    at::Tensor buffer = bucket.buffer;
    return bucket.processGroup->allreduce(buffer, collectives::ReduceOp::kAvg)
        .future()
        .then([buffer](const std::vector<at::Tensor>& /*out*/) {
          return buffer;
        });
  };
}

namespace {

CommHook compress(at::ScalarType dtype) {
  return [dtype](GradBucket& bucket) {
    at::Tensor buffer = bucket.buffer;
    // Divided before the sum: the sum of the ranks' values could overflow
    // float16 where their average does not.
    at::Tensor wire;
    {
      at::NoGradGuard noGrad;
      wire = buffer.to(dtype, /*non_blocking=*/false, /*copy=*/true);
      wire.div_(bucket.processGroup->size());
    }
    return bucket.processGroup->allreduce(wire, collectives::ReduceOp::kSum)
        .future()
        .then([buffer, wire](const std::vector<at::Tensor>& /*out*/) {
          at::NoGradGuard noGrad;
          buffer.copy_(wire);
          return buffer;
        });
  };
}

}  // namespace

CommHook fp16Compress() { return compress(at::kHalf); }
CommHook bf16Compress() { return compress(at::kBFloat16); }

}  // namespace hooks

NoSyncGuard::NoSyncGuard(std::shared_ptr<detail::Reducer> reducer)
    : reducer_(std::move(reducer)) {
  reducer_->enterNoSync();
}

NoSyncGuard::~NoSyncGuard() {
  if (reducer_) {
    reducer_->exitNoSync();
  }
}

DistributedDataParallelBase::DistributedDataParallelBase(
    std::shared_ptr<torch::nn::Module> module,
    std::shared_ptr<collectives::ProcessGroup> group, Options options)
    : options_(options), group_(std::move(group)), module_(std::move(module)) {
  if (!module_) {
    throwError(
        Error::invalidArgument("DistributedDataParallel: the module is null"));
  }
  if (!group_) {
    throwError(Error::invalidArgument(
        "DistributedDataParallel: the process group is null"));
  }
  if (!(options_.bucketCapMb >= 0) || !(options_.firstBucketCapMb >= 0)) {
    throwError(Error::invalidArgument(
        "DistributedDataParallel: bucketCapMb and firstBucketCapMb must be "
        ">= 0"));
  }
  // Parameters that appear twice (shared between submodules) are reduced
  // once, under their first name.
  std::vector<detail::Reducer::Param> params;
  std::vector<at::Tensor> state;
  std::unordered_set<const void*> seen;
  std::optional<at::Device> device;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    if (!device) {
      device = p.device();
    }
    state.push_back(p);
    if (p.requires_grad()) {
      params.push_back({item.key(), p});
    }
  }
  for (const auto& b : buffersOf(*module_)) {
    state.push_back(b);
    if (!device) {
      device = b.device();
    }
  }
  device_ = device.value_or(at::kCPU);
  checkSameModel(*group_, describe(*module_), device_);
  broadcastCoalesced(*group_, state);
  reducer_ =
      std::make_shared<detail::Reducer>(group_, options_, std::move(params));
  reducer_->install();
}

DistributedDataParallelBase::~DistributedDataParallelBase() = default;

void DistributedDataParallelBase::registerCommHook(CommHook hook) {
  reducer_->setCommHook(std::move(hook));
}

NoSyncGuard DistributedDataParallelBase::noSync() {
  return NoSyncGuard(reducer_);
}

std::vector<std::vector<std::string>>
DistributedDataParallelBase::bucketParameterNames() const {
  return reducer_->bucketNames();
}

void DistributedDataParallelBase::beforeForward() {
  const bool armed = reducer_->syncing() && at::GradMode::is_enabled();
  double gradScale = 1.0;
  const Join* join = this->join();
  if (join != nullptr && join->options().enable) {
    if (!armed) {
      // Checked before any collective: the ranks still training all take
      // this path, and a joined rank would shadow a reduction never issued.
      throwError(Error(Code::kFailedPrecondition,
                       "DistributedDataParallel: a forward under an enabled "
                       "Join must be a synchronized training step (gradients "
                       "enabled, outside noSync()): a joined rank shadows "
                       "every iteration's gradient reduction"));
    }
    const int active = Join::notify(*this);
    if (!join->options().divideByInitialWorldSize && active > 0) {
      gradScale = static_cast<double>(group_->size()) / active;
    }
  }
  if (options_.broadcastBuffers) {
    broadcastCoalesced(*group_, buffersOf(*module_));
  }
  reducer_->beginIteration(armed, gradScale);
}

JoinHook DistributedDataParallelBase::joinHook(const JoinOptions& /*options*/) {
  JoinHook hook;
  // One iteration of the ranks still training: forward's buffer broadcast
  // (this rank's buffers are overwritten by rank 0's, as theirs are), then
  // what their backward issues. divideByInitialWorldSize needs nothing
  // here: this rank contributes zeros either way, the others scale.
  hook.mainHook = [this] {
    if (options_.broadcastBuffers) {
      broadcastCoalesced(*group_, buffersOf(*module_));
    }
    reducer_->shadowIteration();
  };
  // The last rank to join (the highest such rank) has taken every step:
  // its parameters and buffers go to every rank.
  hook.postHook = [this](bool isLastJoiner) {
    at::Tensor candidate =
        at::full({1}, isLastJoiner ? int64_t{group_->rank()} : int64_t{-1},
                 at::TensorOptions().dtype(at::kLong))
            .to(device_);
    group_->allreduce(candidate, collectives::ReduceOp::kMax).wait();
    const auto root = static_cast<int>(candidate.cpu().item<int64_t>());
    if (root < 0 || root >= group_->size()) {
      throwError(Error::internal(
          "DistributedDataParallel: Join found no last rank to join"));
    }
    std::vector<at::Tensor> state;
    std::unordered_set<const void*> seen;
    for (const auto& p : module_->parameters(/*recurse=*/true)) {
      if (seen.insert(p.unsafeGetTensorImpl()).second) {
        state.push_back(p);
      }
    }
    for (const auto& b : buffersOf(*module_)) {
      state.push_back(b);
    }
    broadcastCoalesced(*group_, state, root);
  };
  return hook;
}

void DistributedDataParallelBase::afterForward(
    const std::optional<std::vector<at::Tensor>>& outputs) {
  if (outputs && walkNeeded()) {
    reducer_->findUnused(*outputs);
  }
}

bool DistributedDataParallelBase::walkNeeded() const {
  return options_.findUnusedParameters && reducer_->walkNeeded();
}

}  // namespace trellis::ddp
