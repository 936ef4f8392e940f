// Fuzz target for the error files elastic-run's agent reads from its
// workers (elastic/errors.h): text a crashed or hostile worker wrote.
//
// Checked: the decoder neither crashes, throws nor reads out of bounds; a
// refusal says why; a file it accepts re-encodes to one that decodes to the
// same record.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <trellis/elastic/errors.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace e = trellis::elastic;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  e::ErrorRecord record;
  const trellis::Error error = e::parseErrorFile(text, &record);
  if (!error.ok()) {
    if (error.message().empty()) {
      std::abort();
    }
    return 0;
  }
  e::ErrorRecord again;
  if (!e::parseErrorFile(e::encodeErrorFile(record), &again).ok()) {
    std::abort();
  }
  // Invalid UTF-8 cannot survive parsing, so the re-encoding is exact.
  if (!(again == record)) {
    std::abort();
  }
  return 0;
}
