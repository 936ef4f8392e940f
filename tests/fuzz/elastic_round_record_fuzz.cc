// Fuzz target for the rendezvous round record (elastic/round_record.h, the
// codec alone): text any client of the c10d store or the etcd server could
// have written.
//
// Checked: the decoder neither crashes, throws nor reads out of bounds; a
// refusal names the store key and leaves the output untouched; a record it
// accepts keeps the limits and re-encodes to text that decodes to the same
// record.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <trellis/elastic/round_record.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace e = trellis::elastic;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  e::RoundRecord record;
  record.runId = "untouched";
  const trellis::Error error = e::decodeRoundRecord(text, &record);
  if (!error.ok()) {
    if (error.message().find(e::kRoundKey) == std::string::npos ||
        record.runId != "untouched") {
      std::abort();
    }
    return 0;
  }
  if (record.participants.size() > e::kMaxRecordNodes ||
      record.waiting.size() > e::kMaxRecordNodes ||
      record.note.size() > e::kMaxRecordField) {
    std::abort();
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
