#pragma once

// Error files: how a failed worker tells elastic-run why it failed
// (docs/elastic.md, "Error files").
//
// The agent gives every worker a path in TORCHELASTIC_ERROR_FILE. A worker
// that dies of an uncaught exception writes it there as JSON, in the format
// of torch.distributed.elastic's error handler, so files written by PyTorch
// workers and by Trellis workers read the same:
//
//   {"message": {"message": "<type>: <what>",
//                "extraInfo": {"py_callstack": "<stack or note>",
//                              "timestamp": "<unix seconds>"}}}
//
// Trellis adds "exception_type" and "rank" to extraInfo (readers ignore
// keys they do not know). The reader also takes torchrun's other shapes:
// "message" as a plain string, and an "errorCode" beside it.
//
// In a worker:
//
//   int main(int argc, char** argv) {
//     return trellis::elastic::runAndRecordErrors([&] { return train(); });
//   }
//
// Thread safety: the functions share no state; two threads must not record
// into the same file at once (the later rename wins).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include <trellis/core/error.h>

namespace trellis::elastic {

inline constexpr const char* kErrorFileEnvVar = "TORCHELASTIC_ERROR_FILE";
// The reader refuses larger files (a worker's message and stack fit well
// within it).
inline constexpr size_t kMaxErrorFileBytes = 1 << 20;

struct ErrorRecord {
  std::string message;    // "std::runtime_error: out of memory"
  std::string callstack;  // "py_callstack"; may be empty
  int64_t timestamp = 0;  // seconds since the epoch; 0 when not recorded
  std::optional<int32_t> errorCode;  // set by an agent, never by a worker
  std::string exceptionType;         // Trellis's addition; may be empty
  std::optional<int32_t> rank;       // Trellis's addition
  friend bool operator==(const ErrorRecord&, const ErrorRecord&) = default;
};

// The JSON text of `record` (the shape above).
std::string encodeErrorFile(const ErrorRecord& record);

// Decodes untrusted text: at most kMaxErrorFileBytes, nesting bounded. A
// DATA_LOSS Error saying what is wrong when the text is not an error file;
// never throws, never crashes.
Error parseErrorFile(std::string_view text, ErrorRecord* out) noexcept;

// Reads and decodes `path`. NOT_FOUND when it does not exist, DATA_LOSS as
// above, and the errno's Error when it cannot be read; each names the path.
Error readErrorFile(const std::string& path, ErrorRecord* out) noexcept;

// Writes `record` to `path` atomically (a temporary file beside it, then a
// rename), so a reader never sees half a file. Never throws.
Error writeErrorFile(const std::string& path,
                     const ErrorRecord& record) noexcept;

// Call inside a catch block: records the exception in flight, with the
// time, RANK when set, and the stack of the recording site (C++ keeps no
// stack of the throw), in $TORCHELASTIC_ERROR_FILE, or in `path` when
// given. With neither, does nothing and returns OK. Never throws.
Error recordCurrentException(
    std::optional<std::string> path = std::nullopt) noexcept;

// Runs `body`; an exception that escapes it is recorded as above, printed
// to stderr, and turned into exit status 1 (what an uncaught Python
// exception gives). Returns body's result otherwise.
int runAndRecordErrors(const std::function<int()>& body);

// Makes every uncaught exception, on any thread, do what runAndRecordErrors
// does: std::terminate's handler records the exception in flight (as
// recordCurrentException), prints its message to stderr and exits the
// process with status 1. std::terminate without an exception in flight
// goes on to the handler that was installed before. trellis::init installs
// it; idempotent, any thread.
void installErrorFileHandler() noexcept;

}  // namespace trellis::elastic
