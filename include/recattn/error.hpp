// recattn::Error: the one exception type of the library (SPEC §5).
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace recattn {

/// Thrown for every rejected argument and every backend failure. The message names the
/// argument, what was expected and what was given.
class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument("recattn: " + what) {}
};

namespace detail {

inline std::string shape_str(const std::int64_t* s, int rank) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < rank; ++i) os << (i ? ", " : "") << s[i];
  os << ']';
  return os.str();
}

inline std::string shape_str(const std::vector<std::int64_t>& s) { return shape_str(s.data(), int(s.size())); }

template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

/// `arg: expected <expected>, got <actual>`
template <class E, class A>
[[noreturn]] void fail(const std::string& arg, const E& expected, const A& actual) {
  throw Error(cat(arg, ": expected ", expected, ", got ", actual));
}

}  // namespace detail
}  // namespace recattn
