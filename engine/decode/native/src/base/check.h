// Argument checks at the library's entry points: a failed one throws, and the C ABI (abi.cpp)
// turns the message into the error the Python side raises. Nothing inside a parallel region checks.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moescope {

template <class... Parts>
[[noreturn]] inline void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

}  // namespace moescope

#define MOESCOPE_CHECK(condition, ...)      \
  do {                                      \
    if (!(condition)) ::moescope::fail(__VA_ARGS__); \
  } while (0)
