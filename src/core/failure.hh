// Failures as moe-ep errors: one idiom for every path that captures an error.
//
// attempt(context, fn) runs fn and returns what it threw, or null. moe-ep errors pass unchanged;
// anything else is translated, so no foreign exception reaches a caller: std::bad_alloc becomes a
// ResourceError ("[rank 2] dispatch: out of host memory"), std::system_error (threads could not be
// started) a ResourceError with the system's text, any other exception an Error with its text,
// each prefixed with `context`.
#pragma once

#include <exception>
#include <string>

namespace moe_ep::core {

std::exception_ptr typed_error(const std::exception_ptr& error, const std::string& context) noexcept;

// capture(fn) runs fn and returns what it threw, as thrown, or null: for code whose exceptions
// belong to the caller (hooks a user registered).
template <class Fn>
std::exception_ptr capture(Fn&& fn) noexcept {
  try {
    fn();
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

template <class Fn>
std::exception_ptr attempt(const std::string& context, Fn&& fn) noexcept {
  const std::exception_ptr error = capture(fn);
  return error ? typed_error(error, context) : nullptr;
}

}  // namespace moe_ep::core
