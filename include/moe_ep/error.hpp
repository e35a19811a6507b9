// Typed errors raised by moe-ep.
//
// Every failure the library detects is reported as one of these exceptions, never as a crash,
// an out-of-bounds write or a hang. Messages name the argument, the value and the limit, and
// start with "[rank r]" when the failure is tied to a rank of a group. Collective calls report
// consistently: when one rank rejects its input, every other rank of the same call raises a
// PeerError naming it, so no rank is left waiting.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace moe_ep {

// Base class of everything moe-ep throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An argument has a wrong value, shape, dtype or stride. Nothing was sent or written.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The call needs more memory than the buffer holds. required_bytes() says how much.
class CapacityError : public InvalidArgument {
 public:
  CapacityError(const std::string& what, long long required_bytes, long long available_bytes)
      : InvalidArgument(what), required_(required_bytes), available_(available_bytes) {}
  long long required_bytes() const { return required_; }
  long long available_bytes() const { return available_; }

 private:
  long long required_;
  long long available_;
};

// The object is in a state that does not allow the call (destroyed buffer, stale handle...).
class StateError : public Error {
 public:
  using Error::Error;
};

// The system refused a resource the call needed (host memory, threads). The message names the
// rank, the call, what could not be had and how much.
class ResourceError : public Error {
 public:
  using Error::Error;
};

// Other ranks of the group failed, disagreed, or left: ranks() lists them (the root cause where
// it is known: a rank that gave up because a third one died names that one).
class PeerError : public Error {
 public:
  PeerError(const std::string& what, std::vector<int> ranks) : Error(what), ranks_(std::move(ranks)) {}
  const std::vector<int>& ranks() const { return ranks_; }

 private:
  std::vector<int> ranks_;
};

// A wait expired: ranks() did not arrive in time at the phase named in the message, or, where those
// ranks were themselves waiting for others, the ranks at the ends of those chains (the message
// shows the chain).
class TimeoutError : public PeerError {
 public:
  using PeerError::PeerError;
};

}  // namespace moe_ep
