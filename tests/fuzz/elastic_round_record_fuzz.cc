// Fuzz target for the c10d rendezvous's round record (elastic/rendezvous.h):
// text any client of the rendezvous store could have written.
//
// Checked: the decoder neither crashes, throws nor reads out of bounds; a
// refusal names the store key; a record it accepts re-encodes to text that
// decodes to the same record.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <trellis/elastic/rendezvous.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace e = trellis::elastic;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  e::RoundRecord record;
  const trellis::Error error = e::decodeRoundRecord(text, &record);
  if (!error.ok()) {
    if (error.message().find(e::kRoundKey) == std::string::npos) {
      std::abort();
    }
    return 0;
  }
  e::RoundRecord again;
  if (!e::decodeRoundRecord(e::encodeRoundRecord(record), &again).ok()) {
    std::abort();
  }
  if (!(again == record)) {
    std::abort();
  }
  return 0;
}
