#include "core/failure.hh"

#include <fmt/format.h>

#include <new>
#include <system_error>

#include "core/log.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::core {

std::exception_ptr typed_error(const std::exception_ptr& error, const std::string& context) noexcept {
  try {
    try {
      std::rethrow_exception(error);
    } catch (const Error&) {
      return error;
    } catch (const std::bad_alloc&) {
      throw ResourceError(fmt::format("{}: out of host memory", context));
    } catch (const std::system_error& e) {
      throw ResourceError(fmt::format("{}: the system refused a resource: {}", context, e.what()));
    } catch (const std::exception& e) {
      throw Error(fmt::format("{}: {}", context, e.what()));
    } catch (...) {
      throw Error(fmt::format("{}: a non-standard exception", context));
    }
  } catch (...) {
    return std::current_exception();  // the translation (or, out of memory for it, bad_alloc)
  }
}

void thread_not_started(std::string_view what, int index, int count, const std::system_error& e) {
  const int rank = current_rank();
  throw ResourceError(fmt::format("{}{}: thread {} of {} could not be started: {}",
                                  rank >= 0 ? fmt::format("[rank {}] ", rank) : std::string(), what, index + 1, count,
                                  e.what()));
}

}  // namespace moe_ep::core
