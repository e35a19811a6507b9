// The sending side of the messenger's scale-out records: filling a peer's message (copied and
// retained puts), sending it (packed, as bare data, or gathered from the sources), and waiting for
// the sends that read retained sources.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <set>

#include "comm/mpi/messenger.hh"
#include "comm/mpi/record_wire.hh"
#include "moe_ep/error.hpp"

namespace moe_ep::comm::mpi {
using namespace wire;

Bytes Messenger::take_buffer() {
  if (spare_.empty()) {
    Bytes buffer;
    buffer.reserve(chunk_bytes_);
    return buffer;
  }
  Bytes buffer = std::move(spare_.back());
  spare_.pop_back();
  return buffer;
}

void Messenger::recycle(Bytes buffer) {
  if (spare_.size() >= kSpareBuffers || buffer.capacity() < chunk_bytes_) return;
  buffer.clear();
  spare_.push_back(std::move(buffer));
}

void Messenger::send(int peer, int tag, Bytes buffer, bool record, std::size_t from, std::size_t bytes) {
  if (bytes == SIZE_MAX) bytes = buffer.size() - from;
  if (bytes > static_cast<std::size_t>(INT_MAX))
    throw StateError(fmt::format("[rank {}] message of {} bytes to rank {} is too large", rank_, bytes, peer));
  pending_.push_back({MPI_REQUEST_NULL, std::move(buffer), peer, record});
  Pending& p = pending_.back();
  check_mpi(MPI_Isend(p.buffer.data() + from, static_cast<int>(bytes), MPI_BYTE, peer, tag, comm_, &p.request),
            "MPI_Isend", rank_);
  if (record) ++inflight_[static_cast<size_t>(peer)];
}

void Messenger::flush(int peer) {
  Chunk& chunk = chunks_[static_cast<size_t>(peer)];
  if (chunk.bytes == 0) return;
  if (inflight_[static_cast<size_t>(peer)] >= inflight_limit_) {
    mpi_mutex().unlock();
    try {
      wait_until(
          send_wait_, [&] { return inflight_[static_cast<size_t>(peer)] < inflight_limit_; },
          [&] { return std::vector<int>{peer}; });
    } catch (...) {
      mpi_mutex().lock();
      throw;
    }
    mpi_mutex().lock();
    if (chunk.bytes == 0) return;  // another thread sent it meanwhile
  }
  const std::uint64_t number = sent_records_[static_cast<size_t>(peer)]++;
  const std::uint64_t count = chunk.pieces.size();
  Bytes message(kPrefix + count * sizeof(Piece));
  std::memcpy(message.data(), &number, sizeof number);
  std::memcpy(message.data() + sizeof number, &count, sizeof count);
  std::memcpy(message.data() + kPrefix, chunk.pieces.data(), count * sizeof(Piece));
  chunk.pieces.clear();
  Bytes data;
  data.swap(chunk.data);
  std::vector<Segment> segments;
  segments.swap(chunk.segments);
  const std::size_t total = chunk.bytes;
  chunk.bytes = 0;
  if (total < kDirectBytes) {
    if (segments.empty()) {
      message.insert(message.end(), data.begin(), data.end());
    } else {
      std::size_t at = message.size();
      message.resize(at + total);
      for (const Segment& g : segments) {
        std::memcpy(message.data() + at, g.source ? g.source : data.data() + g.at, g.bytes);
        at += g.bytes;
      }
    }
    recycle(std::move(data));
    send(peer, kTagData, std::move(message), true);
    return;
  }
  // The piece list now; the data from its own buffer (or from where it lies), received straight
  // into place.
  send(peer, kTagHeader, std::move(message), false);
  if (segments.empty()) {
    send(peer, kTagPayload, std::move(data), true);
  } else {
    send_gathered(peer, std::move(data), segments);
  }
  // The caller goes on forming records: let MPI move what is in flight meanwhile (a transfer over a
  // network needs its sender's progress calls, and the peers' messages to this rank need its own).
  progress();
}

void Messenger::send_gathered(int peer, Bytes data, std::span<const Segment> segments) {
  std::vector<int> lengths;
  std::vector<MPI_Aint> addresses;
  lengths.reserve(segments.size());
  addresses.reserve(segments.size());
  for (const Segment& g : segments) {
    const std::byte* from = g.source ? g.source : data.data() + g.at;
    MPI_Aint address = 0;
    check_mpi(MPI_Get_address(from, &address), "MPI_Get_address", rank_);
    if (!addresses.empty() && addresses.back() + lengths.back() == address) {
      lengths.back() += static_cast<int>(g.bytes);  // continues the previous segment in memory
      continue;
    }
    lengths.push_back(static_cast<int>(g.bytes));
    addresses.push_back(address);
  }
  MPI_Datatype gathered = MPI_DATATYPE_NULL;
  check_mpi(MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(), addresses.data(), MPI_BYTE,
                                     &gathered),
            "MPI_Type_create_hindexed", rank_);
  pending_.push_back({MPI_REQUEST_NULL, std::move(data), peer, true, true});
  Pending& p = pending_.back();
  int rc = MPI_Type_commit(&gathered);
  if (rc == MPI_SUCCESS) rc = MPI_Isend(MPI_BOTTOM, 1, gathered, peer, kTagPayload, comm_, &p.request);
  MPI_Type_free(&gathered);  // released by MPI once the send is done
  if (rc != MPI_SUCCESS) pending_.pop_back();
  check_mpi(rc, "MPI_Isend", rank_);
  ++inflight_[static_cast<size_t>(peer)];
}

void Messenger::finish_retained(const Wait& wait) {
  {
    std::lock_guard lock(mpi_mutex());
    for (int peer = 0; peer < size_; ++peer)
      if (!chunks_[static_cast<size_t>(peer)].segments.empty() && !out_of_channel(peer)) flush(peer);
  }
  auto awaited = [&](const Pending& p) { return p.retained && !out_of_channel(p.peer); };
  wait_until(
      wait, [&] { return std::none_of(pending_.begin(), pending_.end(), awaited); },
      [&] {
        std::set<int> peers;
        for (const Pending& p : pending_)
          if (awaited(p)) peers.insert(p.peer);
        return std::vector<int>(peers.begin(), peers.end());
      },
      false);
}

namespace {
constexpr std::size_t kMaxPiece = std::size_t{UINT32_MAX} / 2;
}  // namespace

void Messenger::add_piece(Chunk& chunk, std::uint32_t memory, std::size_t offset, std::size_t n) {
  Piece* last = chunk.pieces.empty() ? nullptr : &chunk.pieces.back();
  if (last != nullptr && last->memory == memory && last->offset + last->bytes == offset && last->bytes + n <= kMaxPiece) {
    last->bytes += static_cast<std::uint32_t>(n);  // continues the last piece
  } else {
    chunk.pieces.push_back({memory, static_cast<std::uint32_t>(n), offset});
  }
}

std::byte* Messenger::append_copied(Chunk& chunk, std::size_t n) {
  const std::size_t at = chunk.data.size();
  chunk.data.resize(at + n);
  if (!chunk.segments.empty()) {
    Segment& back = chunk.segments.back();
    if (back.source == nullptr && back.at + back.bytes == at) {
      back.bytes += n;
    } else {
      chunk.segments.push_back({nullptr, at, n});
    }
  }
  chunk.bytes += n;
  return chunk.data.data() + at;
}

void Messenger::put(int peer, std::uint32_t memory, std::size_t offset, const void* src, std::size_t bytes,
                    bool retain) {
  std::lock_guard lock(mpi_mutex());
  const auto* from = static_cast<const std::byte*>(src);
  Chunk& chunk = chunks_[static_cast<size_t>(peer)];
  retain = retain && send_from_source_;
  while (bytes > 0) {
    if (chunk.bytes >= chunk_bytes_ || chunk.pieces.size() >= kMaxPieces) {
      flush(peer);
      continue;
    }
    if (chunk.bytes == 0 && chunk.data.capacity() < chunk_bytes_) chunk.data = take_buffer();
    std::size_t n = std::min({bytes, chunk_bytes_ - chunk.bytes, kMaxPiece});
    const Piece* last = chunk.pieces.empty() ? nullptr : &chunk.pieces.back();
    if (last != nullptr && last->memory == memory && last->offset + last->bytes == offset)
      n = std::min<std::size_t>(n, kMaxPiece - last->bytes);  // the last piece may grow to kMaxPiece
    if (n == 0) {  // the last piece is full: a new one
      chunk.pieces.push_back({memory, 0, offset});
      continue;
    }
    add_piece(chunk, memory, offset, n);
    if (retain) {
      if (chunk.segments.empty() && chunk.bytes > 0) chunk.segments.push_back({nullptr, 0, chunk.bytes});  // earlier copies
      chunk.segments.push_back({from, 0, n});
      chunk.bytes += n;
    } else {
      std::memcpy(append_copied(chunk, n), from, n);
    }
    from += n;
    offset += n;
    bytes -= n;
  }
}

void Messenger::put_formed(int peer, std::uint32_t memory, std::size_t offset, std::size_t bytes,
                           const std::function<void(std::byte*)>& form) {
  if (bytes > chunk_bytes_) {  // does not fit in one message: formed aside
    std::vector<std::byte> formed(bytes);
    form(formed.data());
    put(peer, memory, offset, formed.data(), bytes);
    return;
  }
  std::lock_guard lock(mpi_mutex());
  Chunk& chunk = chunks_[static_cast<size_t>(peer)];
  if (chunk.bytes + bytes > chunk_bytes_ || chunk.pieces.size() >= kMaxPieces) flush(peer);
  if (chunk.bytes == 0 && chunk.data.capacity() < chunk_bytes_) chunk.data = take_buffer();
  add_piece(chunk, memory, offset, bytes);
  form(append_copied(chunk, bytes));
}

}  // namespace moe_ep::comm::mpi
