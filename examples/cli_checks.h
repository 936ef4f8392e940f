#pragma once
// Flag checks for the examples that state the rule in the flag's own terms:
// CLI11's PositiveNumber answers `--steps 0` with "Value 0 not in range
// 0.000000 to 1.79769e+308". These say "--steps: must be a whole number of
// at least 1 (got '0')".
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

#include <CLI/CLI.hpp>

#include <trellis/core/text.h>

namespace trellis::examples {

// A whole number of at least `min` (decimal, nothing around it).
inline CLI::Validator wholeNumberFrom(int64_t min) {
  return CLI::Validator(
      [min](std::string& text) -> std::string {
        const auto n = parseDecimal(text);
        if (n && *n >= min) {
          return "";
        }
        return "must be a whole number of at least " + std::to_string(min) +
               " (got '" + text + "')";
      },
      "INT>=" + std::to_string(min));
}

// A finite number above 0.
inline CLI::Validator positiveReal() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(text.c_str(), &end);
        if (!text.empty() && end == text.c_str() + text.size() && errno == 0 &&
            std::isfinite(v) && v > 0) {
          return "";
        }
        return "must be a number above 0 (got '" + text + "')";
      },
      "NUMBER>0");
}

}  // namespace trellis::examples
