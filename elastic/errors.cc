#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <mutex>
#include <cxxabi.h>
#include <execinfo.h>
#include <fcntl.h>
#include <filesystem>
#include <limits>
#include <memory>
#include <sys/stat.h>
#include <typeinfo>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <trellis/core/text.h>
#include <trellis/elastic/errors.h>

namespace trellis::elastic {

namespace {

using Json = nlohmann::json;

// Deeper than any error file; keeps a hostile file from costing much.
constexpr int kMaxDepth = 16;

Error malformed(std::string_view why) {
  return Error(Code::kDataLoss, "malformed error file: " + std::string(why));
}

// Bracket depth outside strings, checked before the JSON parser sees it.
bool nestingWithin(std::string_view text, int limit) {
  int depth = 0;
  bool inString = false;
  bool escaped = false;
  for (char c : text) {
    if (inString) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        inString = false;
      }
      continue;
    }
    if (c == '"') {
      inString = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) {
        return false;
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

// An integer given as a JSON number or as a decimal string (torchrun
// writes the timestamp as a string).
std::optional<int64_t> intField(const Json& j) {
  if (j.is_number_integer()) {
    if (j.is_number_unsigned() &&
        j.get<uint64_t>() >
            static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return std::nullopt;
    }
    return j.get<int64_t>();
  }
  if (j.is_string()) {
    return parseDecimal(j.get_ref<const std::string&>());
  }
  return std::nullopt;
}

std::optional<int32_t> int32Field(const Json& j) {
  const auto v = intField(j);
  if (!v || *v < std::numeric_limits<int32_t>::min() ||
      *v > std::numeric_limits<int32_t>::max()) {
    return std::nullopt;
  }
  return static_cast<int32_t>(*v);
}

Error decode(const Json& root, ErrorRecord* out) {
  if (!root.is_object()) {
    return malformed("the top level is not a JSON object");
  }
  const auto m = root.find("message");
  if (m == root.end()) {
    return malformed("no \"message\"");
  }
  ErrorRecord r;
  if (m->is_string()) {
    r.message = m->get<std::string>();
    *out = std::move(r);
    return Error();
  }
  if (!m->is_object()) {
    return malformed("\"message\" is neither a string nor an object");
  }
  const auto text = m->find("message");
  if (text == m->end() || !text->is_string()) {
    return malformed("\"message.message\" is missing or not a string");
  }
  r.message = text->get<std::string>();
  if (const auto code = m->find("errorCode"); code != m->end()) {
    r.errorCode = int32Field(*code);
    if (!r.errorCode) {
      return malformed("\"message.errorCode\" is not a 32-bit integer");
    }
  }
  const auto extra = m->find("extraInfo");
  if (extra == m->end()) {
    *out = std::move(r);
    return Error();
  }
  if (!extra->is_object()) {
    return malformed("\"message.extraInfo\" is not an object");
  }
  if (const auto s = extra->find("py_callstack"); s != extra->end()) {
    if (!s->is_string()) {
      return malformed("\"extraInfo.py_callstack\" is not a string");
    }
    r.callstack = s->get<std::string>();
  }
  if (const auto t = extra->find("timestamp"); t != extra->end()) {
    const auto v = intField(*t);
    if (!v) {
      return malformed("\"extraInfo.timestamp\" is not an integer");
    }
    r.timestamp = *v;
  }
  if (const auto t = extra->find("exception_type"); t != extra->end()) {
    if (!t->is_string()) {
      return malformed("\"extraInfo.exception_type\" is not a string");
    }
    r.exceptionType = t->get<std::string>();
  }
  if (const auto k = extra->find("rank"); k != extra->end()) {
    r.rank = int32Field(*k);
    if (!r.rank) {
      return malformed("\"extraInfo.rank\" is not a 32-bit integer");
    }
  }
  *out = std::move(r);
  return Error();
}

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

std::string stackHere() {
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  std::unique_ptr<char*, void (*)(void*)> symbols(
      ::backtrace_symbols(frames, n), std::free);
  std::string s =
      "C++ exception; the stack where it was recorded (C++ keeps none of "
      "the throw):\n";
  for (int i = 0; i < n && symbols; ++i) {
    s += "  ";
    s += symbols.get()[i];
    s += '\n';
  }
  return s;
}

// The exception in flight, as a record (inside a catch block).
ErrorRecord recordOfCurrentException() {
  ErrorRecord r;
  try {
    throw;
  } catch (const std::exception& e) {
    r.exceptionType = demangle(typeid(e).name());
    r.message = r.exceptionType + ": " + e.what();
  } catch (...) {
    const std::type_info* t = abi::__cxa_current_exception_type();
    r.exceptionType = t != nullptr ? demangle(t->name()) : "unknown";
    r.message = r.exceptionType + ": (not derived from std::exception)";
  }
  r.timestamp = static_cast<int64_t>(std::time(nullptr));
  if (const char* rank = std::getenv("RANK"); rank != nullptr) {
    const auto v = parseDecimal(rank);
    if (v && *v >= 0 && *v <= std::numeric_limits<int32_t>::max()) {
      r.rank = static_cast<int32_t>(*v);
    }
  }
  r.callstack = stackHere();
  return r;
}

// The JSON text of `record`, whatever its size.
std::string encodeWhole(const ErrorRecord& record) {
  Json extra = {{"py_callstack", record.callstack},
                {"timestamp", std::to_string(record.timestamp)}};
  if (!record.exceptionType.empty()) {
    extra["exception_type"] = record.exceptionType;
  }
  if (record.rank) {
    extra["rank"] = std::to_string(*record.rank);
  }
  Json message = {{"message", record.message}, {"extraInfo", extra}};
  if (record.errorCode) {
    message["errorCode"] = *record.errorCode;
  }
  // An exception's what() need not be UTF-8; replace what is not.
  return Json{{"message", message}}.dump(-1, ' ', false,
                                         Json::error_handler_t::replace);
}

}  // namespace

std::string encodeErrorFile(const ErrorRecord& record) {
  std::string text = encodeWhole(record);
  if (text.size() <= kMaxErrorFileBytes) {
    return text;
  }
  // The reader refuses a larger file, and the message would be lost: the
  // longer of the message and the stack is halved until it fits (JSON
  // escapes make the text up to six times the bytes).
  ErrorRecord fitted = record;
  if (fitted.exceptionType.size() > 1024) {  // a type name, not a message
    fitted.exceptionType.resize(1024);
  }
  while ((text = encodeWhole(fitted)).size() > kMaxErrorFileBytes) {
    if (fitted.message.size() >= fitted.callstack.size()) {
      cutWithNote(fitted.message, fitted.message.size() / 2,
                  record.message.size());
    } else {
      cutWithNote(fitted.callstack, fitted.callstack.size() / 2,
                  record.callstack.size());
    }
  }
  return text;
}

Error parseErrorFile(std::string_view text, ErrorRecord* out) noexcept {
  try {
    if (text.size() > kMaxErrorFileBytes) {
      return malformed("larger than " + std::to_string(kMaxErrorFileBytes) +
                       " bytes");
    }
    if (!nestingWithin(text, kMaxDepth)) {
      return malformed("nested deeper than " + std::to_string(kMaxDepth));
    }
    const Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded()) {
      return malformed("not JSON");
    }
    return decode(root, out);
  } catch (const std::exception& e) {
    return malformed(e.what());
  }
}

Error readErrorFile(const std::string& path, ErrorRecord* out) noexcept {
  try {
    // O_NONBLOCK: a FIFO in the error file's place must not hang the agent.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == ENOENT) {
        return Error::notFound("no error file at " + path);
      }
      return Error::fromErrno(err, "open error file " + path);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return Error(Code::kDataLoss,
                   "error file " + path + " is not a regular file");
    }
    std::string text;
    char buf[64 * 1024];
    while (text.size() <= kMaxErrorFileBytes) {
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n < 0) {
        const int err = errno;
        ::close(fd);
        return Error::fromErrno(err, "read error file " + path);
      }
      if (n == 0) {
        break;
      }
      text.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    return parseErrorFile(text, out).withContext(path);
  } catch (const std::exception& e) {
    return Error::internal("read error file " + path + ": " + e.what());
  }
}

Error writeErrorFile(const std::string& path,
                     const ErrorRecord& record) noexcept {
  try {
    const std::filesystem::path p(path);
    std::error_code ec;
    if (p.has_parent_path()) {
      std::filesystem::create_directories(p.parent_path(), ec);
    }
    const std::string text = encodeErrorFile(record);
    const std::string tmp = path + ".tmp." + std::to_string(::getpid());
    const int fd =
        ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      return Error::fromErrno(errno, "create error file " + tmp);
    }
    size_t off = 0;
    while (off < text.size()) {
      const ssize_t n = ::write(fd, text.data() + off, text.size() - off);
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n < 0) {
        const int err = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        return Error::fromErrno(err, "write error file " + tmp);
      }
      off += static_cast<size_t>(n);
    }
    if (::close(fd) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      return Error::fromErrno(err, "close error file " + tmp);
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp.c_str());
      return Error::fromErrno(err, "rename error file to " + path);
    }
    return Error();
  } catch (const std::exception& e) {
    return Error::internal("write error file " + path + ": " + e.what());
  }
}

Error recordCurrentException(std::optional<std::string> path) noexcept {
  try {
    if (!path) {
      const char* env = std::getenv(kErrorFileEnvVar);
      if (env == nullptr || *env == '\0') {
        return Error();
      }
      path = env;
    }
    return writeErrorFile(*path, recordOfCurrentException());
  } catch (...) {
    return Error::internal("could not record the exception");
  }
}

namespace {

// Inside a catch block: records the exception in flight and says so on
// stderr.
void reportCurrentException() {
  std::string message = "unknown exception";
  try {
    message = recordOfCurrentException().message;
  } catch (...) {
  }
  const Error e = recordCurrentException();
  std::fprintf(stderr, "%s\n", message.c_str());
  if (!e.ok()) {
    std::fprintf(stderr, "(could not write the error file: %s)\n",
                 e.what().c_str());
  }
}

std::atomic<std::terminate_handler> gPreviousTerminate{nullptr};
std::once_flag gInstallOnce;

[[noreturn]] void onTerminate() {
  if (std::current_exception() != nullptr) {
    try {
      throw;
    } catch (...) {
      reportCurrentException();
    }
    std::fflush(nullptr);
    std::_Exit(1);
  }
  if (const std::terminate_handler previous = gPreviousTerminate.load();
      previous != nullptr) {
    previous();
  }
  std::abort();
}

}  // namespace

int runAndRecordErrors(const std::function<int()>& body) {
  try {
    return body();
  } catch (...) {
    reportCurrentException();
    return 1;
  }
}

void installErrorFileHandler() noexcept {
  std::call_once(gInstallOnce, [] {
    gPreviousTerminate.store(std::set_terminate(&onTerminate));
  });
}

}  // namespace trellis::elastic
