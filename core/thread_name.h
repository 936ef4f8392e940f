#pragma once

// Thread names for ps, top, perf and gdb.

#include <string>

namespace trellis {

// Names the calling thread (Linux keeps the first 15 characters). Every
// thread Trellis starts names itself; docs/threads.md lists them.
void setThreadName(const std::string& name);

}  // namespace trellis
