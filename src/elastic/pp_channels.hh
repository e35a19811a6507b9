// PpChannels: pipeline-parallel send/receive between ring neighbours of an ElasticBuffer
// (docs/engram-pp.md). Rank r talks to prev = (r - 1 + R) % R and next = (r + 1) % R; every
// ordered pair (sender, receiver) is one FIFO of depth D whose messages hold at most B bytes.
//
// Guarantees:
//  - set_config() is collective (an engine operation, elastic/collective_call.hh): the arguments
//    and their agreement across ranks are checked on every rank, and so is that no message is
//    in flight (every message sent has been received); then every rank gets fresh channels and
//    receive slots. Message counts are kept across configurations.
//  - send() copies the tensor into the receiver's next slot (header with the byte count and the
//    message number, then the bytes) and signals it on a channel of its own; when D messages to
//    that receiver are unreceived it first waits for a credit, which the receiver returns on a
//    second channel when it has copied a message out. recv() waits for the next message from its
//    source, checks its byte count against the tensor (InvalidArgument, the message stays), copies
//    it and returns the credit. So a sender never overwrites an unread slot, a receiver never reads
//    an incomplete one, and messages arrive in the order they were sent on each pair.
//  - Every wait has the buffer's timeout: TimeoutError names the peer and which buffer was full
//    or empty; PeerError names a peer that left. Such a failure closes this rank's PP channels
//    (later calls raise StateError until pp_set_config sets them up again) and its peers' waits on
//    them fail at once.
//  - A rank's calls come from one thread at a time. A group of one rank sends to itself without
//    the transport.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "comm/transport.hh"
#include "engine/engine.hh"
#include "moe_ep/tensor.hpp"

namespace moe_ep::elastic {

class PpChannels {
 public:
  explicit PpChannels(engine::Engine& engine) : engine_(engine) {}
  ~PpChannels();
  PpChannels(const PpChannels&) = delete;
  PpChannels& operator=(const PpChannels&) = delete;

  // DeepEP's size of the send and receive areas: a(a(bytes, 32) * inflight * 4, 2 MiB).
  static std::int64_t size_hint(std::int64_t num_max_tensor_bytes, std::int64_t num_max_inflight_tensors);

  // Collective. `buffer_bytes`: the buffer's num_bytes (the limit of bytes * inflight * 4).
  void set_config(std::int64_t num_max_tensor_bytes, std::int64_t num_max_inflight_tensors,
                  std::int64_t buffer_bytes, const std::string& rejection);
  void send(const TensorView& t, int dst, int num_sms);
  void recv(const TensorView& t, int src, int num_sms);

  bool holds_memory() const { return slots_ != nullptr; }
  // Keeps the receive slots mapped until the process exits (peers may still write them).
  void retire();

 private:
  // Per neighbour (0: prev, 1: next; one when prev == next): messages sent to it, received from
  // it, and the credits it returned that this rank has seen (all counted since construction).
  struct Counts {
    std::array<std::uint64_t, 2> sent{}, received{}, credited{};
  };
  struct Config {
    std::int64_t message_bytes = 0;  // B: num_max_tensor_bytes rounded up to 32
    std::int64_t depth = 0;          // D
    int prev = 0, next = 0;
  };
  // The neighbour index of `peer`, or InvalidArgument naming it, prev and next.
  int neighbour(const std::string& context, const char* argument, int peer) const;
  void check_tensor(const std::string& context, const TensorView& t, int num_sms) const;
  void check_open(const std::string& context) const;
  void rebuild(const Config& config);
  std::size_t slot_bytes() const;
  // Offset of slot `count mod D` of the area where `receiver` keeps the messages of `sender`.
  std::size_t slot_offset(int sender, int receiver, std::uint64_t count) const;
  std::byte* slot_memory(int peer_index, std::uint64_t count);
  // Runs a wait on a PP channel: a failure closes both channels (see above) and rethrows.
  template <class Fn>
  void guarded_wait(Fn fn);

  engine::Engine& engine_;
  Config config_;
  bool configured_ = false;
  std::string closed_;  // why the channels were closed, or empty
  Counts counts_;
  std::array<std::uint64_t, 2> base_received_{}, base_credited_{};  // counts when the channels were made
  std::unique_ptr<comm::Transport> data_, credits_;
  std::unique_ptr<comm::SymmetricMemory> slots_;  // on data_ (with one rank: its own region)
  Tensor self_slots_;                              // one rank: the slots of its messages to itself
};

}  // namespace moe_ep::elastic
