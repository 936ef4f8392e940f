#pragma once
// Small text and file-descriptor helpers that several layers need. Not
// installed: nothing public takes or returns them.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace trellis {

// `s` as a decimal integer with an optional leading '-', and nothing else
// (no space, no '+', no trailing text); nullopt when it is not one or does
// not fit in int64_t. Callers check the range and name what was wrong.
std::optional<int64_t> parseDecimal(std::string_view s);

// Cuts `s` to at most `max` bytes when it is longer, ending it in
// " ... [N bytes, the rest cut]" so a reader knows text is missing (N:
// `originalBytes`, the length before any earlier cut, or s's length when
// 0). With `max` below the note's length, only the note's first bytes fit.
void cutWithNote(std::string& s, size_t max, size_t originalBytes = 0);

// Lowercase hexadecimal, two digits per byte.
std::string toHex(std::span<const uint8_t> bytes);

// Writes all of `bytes` to `fd`, retrying after EINTR and short writes.
// False on any other failure (errno says which); what was written stays
// written.
bool writeAll(int fd, std::string_view bytes);

// Removes `path` and, for a directory, everything under it, without
// following symbolic links (a link is removed, not what it names). True
// when nothing is left there (a path that did not exist included); else
// false, with `why` (when given) naming the first entry that stayed and
// the reason. Use it instead of std::filesystem::remove_all in anything
// that links libtorch: PyTorch's wheels export a remove_all of their own
// from libtorch.so, which the dynamic linker may bind the whole process
// to, and which crashed (a call through a null pointer; torch 2.11,
// docs/collectives_nccl.md, "Running the GPU tests").
bool removeTree(const std::string& path, std::string* why = nullptr);

}  // namespace trellis
