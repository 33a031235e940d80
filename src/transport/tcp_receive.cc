// TcpConnection's receive state machine. Every function here runs on the thread driving the
// fabric, under its drive mutex; see tcp_connection.h for the class.
//
// A 40-byte header read is armed whenever the fabric is driven, so that EOF and abort frames
// are seen even when no receive is posted. A data header is held until a receive is posted,
// validated against it (tag and size), and only then is the payload placed in the caller's
// buffer: read straight into it while data is there (kReadChunk per call), asynchronously when
// the socket runs dry. Past a header it cannot place yet the connection reads at most
// kInlinePayload bytes (TCP flow control holds the sender).
//
// Small frames cost one read each: a header read armed while a small receive is posted asks for
// the payload too (kInlinePayload, copied out once the header matched), and the read that ends a
// frame asks for the next header as well, so that an abort frame already in behind a frame fails
// the call that reads the frame. When that finds nothing the connection is left kIdle, and the
// fabric's next Drive or Test arms its header read (ResumeReads): right after a frame a
// speculative recv almost always finds nothing, and there it takes the place of a poll instead
// of delaying the caller's return.
#include <algorithm>
#include <array>
#include <asio.hpp>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "src/transport/fabric_errors.h"
#include "src/transport/frame.h"
#include "src/transport/tcp_connection.h"
#include "src/transport/tcp_fabric_impl.h"

namespace collectives::transport {

uint64_t TcpConnection::PostRecv(const core::CallTag& tag, void* data, size_t bytes) {
  if (data == nullptr && bytes > 0) {
    std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
    fabric_->ThrowIfBroken();
    throw NullBufferError(fabric_->rank_, peer_, bytes, /*sending=*/false);
  }
  return Recv(RecvOp{tag, static_cast<uint8_t*>(data), bytes});
}

uint64_t TcpConnection::PostRecv(const core::CallTag& tag, const core::Runs& runs, size_t offset,
                                 size_t bytes) {
  if (auto error = RunsMisuseError(fabric_->rank_, peer_, runs, offset, bytes, /*sending=*/false)) {
    std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
    fabric_->ThrowIfBroken();
    throw *error;
  }
  return Recv(RecvOp{tag, nullptr, bytes, &runs, offset});
}

uint64_t TcpConnection::Recv(const RecvOp& op) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  const uint64_t ticket = ++recvs_posted_;
  recvs_.push_back(op);
  if (peer_closed_ && read_state_ == ReadState::kStopped) {
    // Every frame the peer sent before closing has been consumed: this one never comes.
    LosePeer(PeerLostError(fabric_->rank_, peer_, closed_reason_, &op.tag, false));
  } else if (recvs_.size() == 1) {
    TryMatch();
  }
  fabric_->ThrowIfBroken();
  return ticket;
}

void TcpConnection::CopyToPayload(const RecvOp& op, size_t at, const uint8_t* from, size_t n) {
  if (op.runs != nullptr) return op.runs->Write(op.offset + at, from, n);
  if (n > 0) std::memcpy(op.data + at, from, n);
}

size_t TcpConnection::PayloadBuffers(const RecvOp& op, size_t at, size_t& want) {
  size_t count = 0;
  size_t covered = 0;
  op.runs->ForEach(op.offset + at, want, [&](uint8_t* data, size_t bytes) {
    read_iov_[count++] = asio::mutable_buffer(data, bytes);
    covered += bytes;
    return count < kMaxReadRuns;
  });
  want = covered;
  return count;
}

void TcpConnection::ArmHeaderRead() {
  read_state_ = ReadState::kHeader;
  read_got_ = 0;
  inline_got_ = 0;
  next_got_ = 0;
  inline_want_ = InlineWant();
  IssueHeaderRead();
}

size_t TcpConnection::InlineWant() {
  if (write_failed_ || recvs_.empty() || recvs_.front().bytes > kInlinePayload) return 0;
  return recvs_.front().bytes;
}

void TcpConnection::IssueHeaderRead() {
  const asio::mutable_buffer header =
      asio::buffer(header_buffer_.data() + read_got_, kFrameHeaderBytes - read_got_);
  if (inline_want_ == 0) {
    socket_.async_read_some(header, ReadHandler{this});
  } else {
    const std::array<asio::mutable_buffer, 3> buffers{
        header, asio::buffer(inline_payload_.data(), inline_want_), asio::buffer(next_header_)};
    socket_.async_read_some(buffers, ReadHandler{this});
  }
}

void TcpConnection::CompleteReceive() {
  recvs_.pop_front();
  ++recvs_done_;
  FrameDone();
}

void TcpConnection::FrameDone() {
  if (next_got_ == 0) {
    read_state_ = ReadState::kIdle;
    fabric_->resume_reads_ = true;
    return;
  }
  std::memcpy(header_buffer_.data(), next_header_.data(), next_got_);
  read_state_ = ReadState::kHeader;
  read_got_ = next_got_;
  next_got_ = 0;
  if (read_got_ < kFrameHeaderBytes) {
    inline_want_ = InlineWant();
    IssueHeaderRead();
    return;
  }
  OnHeader(/*match=*/false);
}

void TcpConnection::IssueRead(void* data, size_t bytes) {
  socket_.async_read_some(asio::buffer(data, bytes), ReadHandler{this});
}

void TcpConnection::OnRead(const asio::error_code& ec, size_t bytes) {
  if (closed_ || fabric_->broken()) {
    // Stop: after an error nothing more is written into the callers' buffers.
    read_state_ = ReadState::kStopped;
    return;
  }
  if (ec) return OnReadError(ec);
  read_got_ += bytes;
  switch (read_state_) {
    case ReadState::kHeader: {
      if (read_got_ < kFrameHeaderBytes) {
        IssueHeaderRead();
        return;
      }
      // The header, then the inline payload, then the next header: in stream order.
      const size_t after = read_got_ - kFrameHeaderBytes;
      inline_got_ = std::min(after, inline_want_);
      next_got_ = after - inline_got_;
      OnHeader(/*match=*/true);
      return;
    }
    case ReadState::kPayload: {
      if (read_got_ < recvs_.front().bytes) {
        ReadPayload();
        return;
      }
      CompleteReceive();
      return;
    }
    case ReadState::kAbortPayload:
      ReadAbortPayload();
      return;
    case ReadState::kDiscard:
      if (read_got_ < header_.bytes) {
        IssueRead(abort_buffer_.data(),
                  std::min(header_.bytes - read_got_, uint64_t{abort_buffer_.size()}));
      } else {
        FrameDone();
      }
      return;
    case ReadState::kIdle:
    case ReadState::kHeaderReady:
    case ReadState::kStopped:
      return;
  }
}

void TcpConnection::ReadAbortPayload() {
  while (read_got_ < header_.bytes) {
    asio::error_code ec;
    const size_t got = socket_.read_some(
        asio::buffer(abort_buffer_.data() + read_got_, header_.bytes - read_got_), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      IssueRead(abort_buffer_.data() + read_got_, header_.bytes - read_got_);
      return;
    }
    if (ec) return OnReadError(ec);
    read_got_ += got;
  }
  read_state_ = ReadState::kStopped;
  std::string why;
  // A culprit outside the world is a faulty peer's: it must not be named as the rank at fault.
  auto payload = DecodeAbortPayload(abort_buffer_.data(), header_.bytes, &why, fabric_->size_);
  if (!payload) {
    fabric_->BreakLocal(MalformedFrameError("malformed abort frame", why));
    return;
  }
  // Relay it, culprit and message unchanged, to the peers it may not have reached.
  fabric_->Break(AbortReceivedError(fabric_->rank_, *payload), *payload, peer_);
}

size_t TcpConnection::CopyBytesPastHeader(uint8_t* out, size_t frame_bytes) const {
  const size_t from_inline = std::min(inline_got_, frame_bytes);
  std::memcpy(out, inline_payload_.data(), from_inline);
  const size_t from_next = std::min(next_got_, frame_bytes - from_inline);
  std::memcpy(out + from_inline, next_header_.data(), from_next);
  return from_inline + from_next;
}

void TcpConnection::DiscardPayload() {
  // Called once a write failed (write_failed_). The header read may have taken bytes past the
  // header, split for the receive it expected (CopyBytesPastHeader): the first header_.bytes of
  // them are this frame's, the rest the start of the next frame, which must end up in next_header_.
  const size_t past = inline_got_ + next_got_;
  if (past > header_.bytes) {
    const size_t over = past - header_.bytes;
    if (over > next_header_.size()) {
      // The frame was much shorter than the posted receive, and the inline read took more than
      // the next header: the stream cannot be followed to an abort frame any more.
      read_state_ = ReadState::kStopped;
      BreakWithWriteFailure();
      return;
    }
    EncodedHeader next{};
    for (size_t i = 0; i < over; ++i) {
      const size_t at = header_.bytes + i;
      next[i] = at < inline_got_ ? inline_payload_[at] : next_header_[at - inline_got_];
    }
    next_header_ = next;
    next_got_ = over;
    read_got_ = header_.bytes;
  } else {
    next_got_ = 0;
    read_got_ = past;
  }
  inline_got_ = 0;
  if (read_got_ == header_.bytes) {
    FrameDone();
    return;
  }
  read_state_ = ReadState::kDiscard;
  IssueRead(abort_buffer_.data(),
            std::min(header_.bytes - read_got_, uint64_t{abort_buffer_.size()}));
}

void TcpConnection::OnHeader(bool match) {
  std::string why;
  auto header = DecodeHeader(header_buffer_.data(), &why);
  if (!header) {
    read_state_ = ReadState::kStopped;
    fabric_->BreakLocal(MalformedFrameError("malformed frame", why));
    return;
  }
  header_ = *header;
  heard_ = true;
  if (header_.kind == FrameKind::kAbort) {
    // DecodeHeader bounded the size by kMaxAbortPayload (the buffer's size). The bytes read past
    // the header are its payload, up to its size (CopyBytesPastHeader); nothing follows an abort
    // frame, so bytes past it are dropped.
    read_state_ = ReadState::kAbortPayload;
    read_got_ = CopyBytesPastHeader(abort_buffer_.data(), header_.bytes);
    inline_got_ = 0;
    next_got_ = 0;
    ReadAbortPayload();
    return;
  }
  if (write_failed_) {
    DiscardPayload();
    return;
  }
  read_state_ = ReadState::kHeaderReady;
  CheckHeldHeader();
  if (read_state_ == ReadState::kStopped) return;
  if (match) {
    TryMatch();
  } else {
    fabric_->resume_reads_ = true;
  }
}

void TcpConnection::CheckHeldHeader() {
  if (read_state_ != ReadState::kHeaderReady || !recvs_.empty() || !fabric_->check_calls_) return;
  if (auto error =
          CallMismatchError(fabric_->rank_, peer_, fabric_->call_, header_.tag, header_.bytes)) {
    read_state_ = ReadState::kStopped;
    fabric_->BreakLocal(*error);
  }
}

void TcpConnection::TryMatch() {
  if (read_state_ != ReadState::kHeaderReady || recvs_.empty()) return;
  RecvOp& op = recvs_.front();
  // The size is always checked (it bounds the read); the call descriptor unless the measurement
  // switch below turned that off.
  if ((fabric_->check_calls_ && header_.tag != op.tag) || header_.bytes != op.bytes) {
    read_state_ = ReadState::kStopped;
    fabric_->BreakLocal(
        MismatchError(fabric_->rank_, peer_, op.tag, op.bytes, header_.tag, header_.bytes));
    return;
  }
  // What came inline was asked for this receive (the first posted when the header read was
  // armed is still the first: receives complete in order), so it fits: inline_got_ <= op.bytes.
  read_state_ = ReadState::kPayload;
  read_got_ = inline_got_;
  CopyToPayload(op, 0, inline_payload_.data(), inline_got_);
  inline_got_ = 0;
  if (read_got_ == op.bytes) {
    CompleteReceive();
    return;
  }
  ReadPayload();
}

void TcpConnection::ReadPayload() {
  // The payload usually arrives with its header, or streams in: read it at once, straight
  // into the caller's buffer, rather than through queued completions; wait (asynchronously)
  // only when the socket has been drained. The read of the last piece also asks for the next
  // header (FrameDone).
  RecvOp& op = recvs_.front();
  for (int i = 0; i < kMaxReadsInARow; ++i) {
    const size_t left = op.bytes - read_got_;
    size_t want = std::min(left, kReadChunk);
    asio::error_code ec;
    size_t got = 0;
    if (op.runs == nullptr) {
      const std::array<asio::mutable_buffer, 2> buffers{
          asio::buffer(op.data + read_got_, want),
          asio::buffer(next_header_.data(), want == left ? next_header_.size() : 0)};
      got = socket_.read_some(buffers, ec);
    } else {
      size_t n = PayloadBuffers(op, read_got_, want);
      if (want == left) read_iov_[n++] = asio::buffer(next_header_);
      got = socket_.read_some(MutableBufferSpan{read_iov_.data(), read_iov_.data() + n}, ec);
    }
    if (ec == asio::error::would_block || ec == asio::error::try_again) break;
    if (ec) return OnReadError(ec);
    if (got > want) {
      next_got_ = got - want;
      got = want;
    }
    read_got_ += got;
    if (read_got_ == op.bytes) {
      CompleteReceive();
      return;
    }
    if (got < want) break;  // drained for now
  }
  size_t want = std::min(op.bytes - read_got_, kReadChunk);
  if (op.runs == nullptr) return IssueRead(op.data + read_got_, want);
  const size_t n = PayloadBuffers(op, read_got_, want);
  socket_.async_read_some(MutableBufferSpan{read_iov_.data(), read_iov_.data() + n},
                          ReadHandler{this});
}

void TcpConnection::OnReadError(const asio::error_code& ec) {
  read_state_ = ReadState::kStopped;
  if (ec == asio::error::operation_aborted) return;
  // A peer that closed after its last frame is not an error until this rank needs it.
  peer_closed_ = true;
  closed_reason_ = ClosedReason(ec);
  if (write_failed_) {
    // The peer closed without an abort frame: the write failure was its own.
    BreakWithWriteFailure();
  } else if (!recvs_.empty()) {
    LosePeer(PeerLostError(fabric_->rank_, peer_, closed_reason_, &recvs_.front().tag, false));
  }
}

Error TcpConnection::MalformedFrameError(const char* what, const std::string& why) {
  std::string message = "rank " + std::to_string(fabric_->rank_) + ": " + what + " from rank " +
                        std::to_string(peer_) + ": " + why;
  if (!recvs_.empty()) message += " while waiting for " + recvs_.front().tag.ToString();
  return Error(ErrorCode::kSystem, message);
}

}  // namespace collectives::transport
