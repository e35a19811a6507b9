// Failures as moe-ep errors: one idiom for every path that captures an error.
//
// attempt(context, fn) runs fn and returns what it threw, or null. moe-ep errors pass unchanged;
// anything else is translated, so no foreign exception reaches a caller: std::bad_alloc becomes a
// ResourceError ("[rank 2] dispatch: out of host memory"), std::system_error (threads could not be
// started) a ResourceError with the system's text, any other exception an Error with its text,
// each prefixed with `context`.
//
// start_thread(what, index, count, fn) starts a std::thread running fn; a thread the system does
// not start (std::system_error from the constructor: no memory for its stack, a thread limit) is
// a ResourceError "[rank r] <what>: thread <index + 1> of <count> could not be started: <the
// system's text>". The caller still owns the threads it started before: it releases and joins them
// before the error leaves it (a std::thread destroyed while joinable ends the process).
#pragma once

#include <exception>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

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

// The ResourceError of start_thread.
[[noreturn]] void thread_not_started(std::string_view what, int index, int count, const std::system_error& e);

template <class Fn>
std::thread start_thread(std::string_view what, int index, int count, Fn&& fn) {
  try {
    return std::thread(std::forward<Fn>(fn));
  } catch (const std::system_error& e) {
    thread_not_started(what, index, count, e);
  }
}

}  // namespace moe_ep::core
