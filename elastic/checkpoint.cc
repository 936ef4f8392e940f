#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <sys/stat.h>
#include <unistd.h>

#include <trellis/core/error.h>
#include <trellis/core/logging.h>
#include <trellis/core/seal.h>
#include <trellis/core/text.h>
#include <trellis/elastic/checkpoint.h>

namespace trellis::elastic {
namespace {

namespace fs = std::filesystem;

// A checkpoint is a sealed blob (core/seal.h; docs/elastic.md,
// "Checkpoints"): magic "TRLSCKP1", the step as its tag, torch's archive
// (a zip) as its payload.
constexpr char kMagic[] = "TRLSCKP1";
constexpr int kStepDigits = 12;
constexpr int64_t kMaxStep = 999'999'999'999;  // 12 digits

[[noreturn]] void ioFailed(int err, const std::string& what) {
  throwError(Error::fromErrno(err, "checkpoint: " + what));
}

// Flushes a directory's entries (the rename) to disk.
void syncDir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    ioFailed(errno, "open directory " + dir.string());
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) {
    ioFailed(err, "fsync directory " + dir.string());
  }
}

// The step in "<prefix>-<12 digits>.ckpt", or nullopt for any other name.
std::optional<int64_t> stepOf(const std::string& name,
                              const std::string& prefix) {
  const std::string head = prefix + "-";
  const std::string tail = ".ckpt";
  if (name.size() != head.size() + kStepDigits + tail.size() ||
      name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
    return std::nullopt;
  }
  const std::string digits = name.substr(head.size(), kStepDigits);
  if (digits.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  return parseDecimal(digits);
}

// The archive in `bytes` (the file named for `step`), or nullopt after
// `*why` says why it is not a whole checkpoint.
std::optional<std::string_view> payloadOf(const std::string& bytes,
                                          int64_t step, std::string* why) {
  seal::Opened opened;
  *why = seal::open(kMagic, bytes, &opened);
  if (!why->empty()) {
    return std::nullopt;
  }
  if (opened.tag != static_cast<uint64_t>(step)) {
    *why = "records step " + std::to_string(opened.tag) +
           " but is named for step " + std::to_string(step);
    return std::nullopt;
  }
  return opened.payload;
}

}  // namespace

Checkpoints::Checkpoints(CheckpointOptions options)
    : options_(std::move(options)) {
  if (options_.dir.empty()) {
    throwError(Error::invalidArgument("checkpoint: dir is empty"));
  }
  if (options_.prefix.empty() || options_.prefix[0] == '.' ||
      options_.prefix.find('/') != std::string::npos) {
    throwError(Error::invalidArgument(
        "checkpoint: prefix '" + options_.prefix +
        "' must be non-empty, without '/', and not start with '.'"));
  }
  if (options_.keepLast < 1) {
    throwError(Error::invalidArgument("checkpoint: keepLast is " +
                                      std::to_string(options_.keepLast) +
                                      "; at least 1 must be kept"));
  }
  std::error_code ec;
  fs::create_directories(options_.dir, ec);
  if (ec) {
    ioFailed(ec.value(), "create directory " + options_.dir.string());
  }
}

fs::path Checkpoints::pathOf(int64_t step) const {
  std::string digits = std::to_string(step);
  digits.insert(0, kStepDigits - digits.size(), '0');
  return options_.dir / (options_.prefix + "-" + digits + ".ckpt");
}

fs::path Checkpoints::save(
    int64_t step,
    const std::function<void(torch::serialize::OutputArchive&)>& fill) {
  if (step < 0 || step > kMaxStep) {
    throwError(Error::invalidArgument("checkpoint: step " +
                                      std::to_string(step) + " is outside 0.." +
                                      std::to_string(kMaxStep)));
  }
  torch::serialize::OutputArchive archive;
  fill(archive);
  std::string payload;
  archive.save_to([&payload](const void* data, size_t n) {
    payload.append(static_cast<const char*>(data), n);
    return n;
  });
  const std::string header =
      seal::header(kMagic, static_cast<uint64_t>(step), payload);

  const fs::path final = pathOf(step);
  // Hidden, and named for this process: never a candidate for loading.
  const fs::path tmp = options_.dir / ("." + final.filename().string() +
                                       ".tmp." + std::to_string(::getpid()));
  const int fd =
      ::open(tmp.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) {
    ioFailed(errno, "create " + tmp.string());
  }
  if (!writeAll(fd, header) || !writeAll(fd, payload) || ::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    ioFailed(err, "write " + tmp.string());
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ioFailed(err, "close " + tmp.string());
  }
  if (::rename(tmp.c_str(), final.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    ioFailed(err, "rename " + tmp.string() + " to " + final.string());
  }
  syncDir(options_.dir);
  prune();
  return final;
}

std::vector<int64_t> Checkpoints::steps() const {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(options_.dir, ec)) {
    if (auto step = stepOf(entry.path().filename().string(), options_.prefix)) {
      out.push_back(*step);
    }
  }
  if (ec) {
    ioFailed(ec.value(), "list " + options_.dir.string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void Checkpoints::prune() const {
  const std::vector<int64_t> all = steps();
  const size_t keep = static_cast<size_t>(options_.keepLast);
  for (size_t i = 0; i + keep < all.size(); ++i) {
    const fs::path old = pathOf(all[i]);
    if (::unlink(old.c_str()) != 0 && errno != ENOENT) {
      TRELLIS_LOG_WARN("checkpoint: could not remove {}: {}", old.string(),
                       std::strerror(errno));
    }
  }
}

std::optional<Checkpoints::Loaded> Checkpoints::loadLatest(
    std::optional<torch::Device> device) const {
  const std::vector<int64_t> all = steps();
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (auto loaded = load(*it, device)) {
      return loaded;
    }
  }
  return std::nullopt;
}

std::optional<Checkpoints::Loaded> Checkpoints::load(
    int64_t step, std::optional<torch::Device> device, std::string* why) const {
  std::string ignored;
  std::string& reason = why != nullptr ? *why : ignored;
  if (step < 0) {
    reason = "no checkpoint has a negative step";
    return std::nullopt;
  }
  const fs::path path = pathOf(step);
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (err == ENOENT) {
      reason = path.string() + " does not exist";
    } else {
      reason = path.string() + " cannot be opened: " + std::strerror(err);
      TRELLIS_LOG_WARN("checkpoint {}: skipped: cannot be opened: {}",
                       path.string(), std::strerror(err));
    }
    return std::nullopt;
  }
  std::string bytes((std::istreambuf_iterator<char>(in)),
                    std::istreambuf_iterator<char>());
  std::string damage;
  const std::optional<std::string_view> payload =
      payloadOf(bytes, step, &damage);
  if (!payload) {
    reason = path.string() + ": it " + damage;
    TRELLIS_LOG_WARN("checkpoint {}: skipped: it {}", path.string(), damage);
    return std::nullopt;
  }
  Loaded loaded;
  loaded.step = step;
  loaded.path = path;
  try {
    loaded.archive.load_from(
        payload->data(), payload->size(),
        device ? c10::optional<torch::Device>(*device) : c10::nullopt);
  } catch (const std::exception& e) {
    // Whole by its checksum, but not an archive torch reads (written by
    // another libtorch, say): the same as damage.
    reason = path.string() + ": torch cannot read it: " + e.what();
    TRELLIS_LOG_WARN("checkpoint {}: skipped: torch cannot read it: {}",
                     path.string(), e.what());
    return std::nullopt;
  }
  return loaded;
}

void saveModule(torch::serialize::OutputArchive& archive,
                const std::string& key, const torch::nn::Module& module) {
  torch::serialize::OutputArchive sub;
  module.save(sub);
  archive.write(key, sub);
}

void loadModule(torch::serialize::InputArchive& archive, const std::string& key,
                torch::nn::Module& module) {
  torch::serialize::InputArchive sub;
  archive.read(key, sub);
  module.load(sub);
}

void saveOptimizer(torch::serialize::OutputArchive& archive,
                   const std::string& key,
                   const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive sub;
  optimizer.save(sub);
  archive.write(key, sub);
}

void loadOptimizer(torch::serialize::InputArchive& archive,
                   const std::string& key, torch::optim::Optimizer& optimizer) {
  torch::serialize::InputArchive sub;
  archive.read(key, sub);
  optimizer.load(sub);
}

}  // namespace trellis::elastic
