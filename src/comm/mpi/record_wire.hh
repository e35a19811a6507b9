// The messenger's wire format: the tags of its messages and the limits of a record message.
// Internal to src/comm/mpi (messenger.cc receives, messenger_send.cc sends).
#pragma once

#include <cstddef>

namespace moe_ep::comm::mpi::wire {

constexpr int kTagData = 13;     // [number][count][pieces][data]: copied into place on arrival
constexpr int kTagSignal = 14;   // [number of record messages sent before it]
constexpr int kTagHeader = 15;   // [number][count][pieces]: the data follows
constexpr int kTagPayload = 16;  // the pieces' bytes back to back, received in place
constexpr int kTagAbandon = 17;  // [culprit count][culprits][reason]: the sender gave up on the channel
constexpr int kTagWaiting = 18;  // [rank count][ranks]: the sender waits for these ranks (none: for nobody)
constexpr int kTagQuery = 19;    // (empty) whom do you wait for? Answered with kTagWaiting
constexpr double kChainSecs = 0.5;  // how long an expired wait waits for those answers
constexpr std::size_t kPrefix = 16;                          // the message number and the piece count
constexpr std::size_t kDirectBytes = std::size_t{16} << 10;  // messages with this much data go in place
constexpr std::size_t kMaxPieces = 1024;                     // per message
constexpr std::size_t kSpareBuffers = 64;                    // record message buffers kept for reuse

}  // namespace moe_ep::comm::mpi::wire
