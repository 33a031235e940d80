// TcpConnection's send side (posting, gathered writes, write failures, the abort frame of a
// shutdown) and its close; see tcp_connection.h for the scheme. Every function here runs on
// the thread driving the fabric, under its drive mutex.
#include "src/transport/tcp_connection.h"

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <cstdint>
#include <mutex>
#include <string>

#include "src/transport/fabric_errors.h"
#include "src/transport/tcp_fabric_impl.h"

namespace collectives::transport {

bool IsClosedByPeer(const asio::error_code& ec) {
  return ec == asio::error::eof || ec == asio::error::connection_reset ||
         ec == asio::error::broken_pipe || ec == asio::error::connection_aborted;
}

std::string ClosedReason(const asio::error_code& ec) {
  if (ec == asio::error::eof) return "connection closed by peer";
  return ec.message();
}

// ---- TcpConnection: send side. ----

uint64_t TcpConnection::PostSend(const core::CallTag& tag, const void* data, size_t bytes) {
  if (data == nullptr && bytes > 0) {
    std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
    fabric_->ThrowIfBroken();
    throw NullBufferError(fabric_->rank_, peer_, bytes, /*sending=*/true);
  }
  return Send(SendOp{tag, static_cast<const uint8_t*>(data), bytes});
}

uint64_t TcpConnection::PostSend(const core::CallTag& tag, const core::Runs& runs, size_t offset,
                                 size_t bytes) {
  if (auto error = RunsMisuseError(fabric_->rank_, peer_, runs, offset, bytes, /*sending=*/true)) {
    std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
    fabric_->ThrowIfBroken();
    throw *error;
  }
  return Send(SendOp{tag, nullptr, bytes, &runs, offset});
}

uint64_t TcpConnection::Send(const SendOp& op) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  const uint64_t ticket = ++sends_posted_;
  sends_.push_back(op);
  if (peer_closed_) {
    LosePeer(PeerLostError(fabric_->rank_, peer_, closed_reason_, &op.tag, true));
    fabric_->ThrowIfBroken();
  }
  StartWrite();
  return ticket;
}

void TcpConnection::StartWrite() {
  while (!pending_ && !write_in_flight_ && !write_failed_ && !sends_.empty() &&
         !fabric_->broken()) {
    size_t frames = std::min(sends_.size(), kMaxBatch);
    size_t n = 0;
    for (size_t k = 0; k < frames; ++k) {
      const SendOp& op = sends_[k];
      // The header, then a buffer per run part (one buffer: one part, none if empty); the first
      // frame of a batch takes as many as it has.
      size_t parts = op.bytes > 0 ? 1 : 0;
      if (op.runs != nullptr) {
        parts = 0;
        op.runs->ForEach(op.offset, op.bytes, [&](const uint8_t*, size_t) { ++parts; });
      }
      if (k > 0 && n + 1 + parts > kMaxIov) {
        frames = k;
        break;
      }
      if (iov_.size() < n + 1 + parts) iov_.resize(n + 1 + parts);
      FrameHeader header;
      header.kind = FrameKind::kData;
      header.tag = op.tag;
      header.bytes = op.bytes;
      batch_headers_[k] = EncodeHeader(header);
      iov_[n++] = asio::const_buffer(batch_headers_[k].data(), kFrameHeaderBytes);
      if (op.runs != nullptr) {
        op.runs->ForEach(op.offset, op.bytes, [&](const uint8_t* data, size_t bytes) {
          iov_[n++] = asio::const_buffer(data, bytes);
        });
      } else if (op.bytes > 0) {
        iov_[n++] = asio::const_buffer(op.data, op.bytes);
      }
      frame_end_[k] = n;
      frame_bytes_[k] = kFrameHeaderBytes + op.bytes;
    }
    batch_frames_ = frames;
    batch_done_ = 0;
    frame_written_ = 0;
    iov_pos_ = 0;
    iov_end_ = n;
    // Write at once: a frame that fits in the socket buffer then completes here, without a
    // completion handler to queue and run. Whatever is left goes to an asynchronous write.
    asio::error_code ec;
    const size_t written = socket_.write_some(BufferSpan{iov_.data(), iov_.data() + iov_end_}, ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again) {
      IssueWrite();
      return;
    }
    if (ec) {
      WriteFailed(ec);
      return;
    }
    AccountWritten(written);
    if (iov_pos_ < iov_end_) {
      IssueWrite();
      return;
    }
  }
}

void TcpConnection::IssueWrite() {
  write_in_flight_ = true;
  socket_.async_write_some(BufferSpan{iov_.data() + iov_pos_, iov_.data() + iov_end_},
                           WriteHandler{this});
}

void TcpConnection::ConsumeWritten(size_t bytes) {
  size_t left = bytes;
  while (left > 0 && iov_pos_ < iov_end_) {
    const size_t size = iov_[iov_pos_].size();
    if (left >= size) {
      left -= size;
      ++iov_pos_;
    } else {
      iov_[iov_pos_] += left;
      left = 0;
    }
  }
}

void TcpConnection::AccountWritten(size_t bytes) {
  ConsumeWritten(bytes);
  // Complete the frames whose last byte was written.
  size_t left = bytes;
  while (left > 0 && batch_done_ < batch_frames_) {
    const size_t need = frame_bytes_[batch_done_] - frame_written_;
    if (left < need) {
      frame_written_ += left;
      left = 0;
    } else {
      left -= need;
      frame_written_ = 0;
      ++batch_done_;
      sends_.pop_front();
      ++sends_done_;
    }
  }
}

void TcpConnection::WriteFailed(const asio::error_code& ec) {
  write_failed_ = true;
  write_failure_ = ClosedReason(ec);
  if (!sends_.empty()) write_failure_tag_ = sends_.front().tag;
  if (!IsClosedByPeer(ec)) {
    fabric_->BreakLocal(WriteFailureError());
    return;
  }
  // The read side must be moving toward the next header for the grace to help: armed, or in the
  // middle of a payload that has a posted buffer. Stopped, it saw the peer close with no abort
  // frame (LosePeer decides).
  if (read_state_ == ReadState::kStopped) {
    peer_closed_ = true;
    BreakWithWriteFailure();
    return;
  }
  // A held data header would stop the read side: skip its payload instead.
  if (read_state_ == ReadState::kHeaderReady) DiscardPayload();
  if (read_state_ == ReadState::kIdle) ArmHeaderRead();
  if (grace_running_) return;
  grace_running_ = true;
  write_failure_timer_.expires_after(kWriteFailureGrace);
  write_failure_timer_.async_wait([this](const asio::error_code& timer_ec) {
    if (timer_ec || closed_) return;
    peer_closed_ = true;
    fabric_->BreakLocal(WriteFailureError());
  });
}

Error TcpConnection::WriteFailureError() const {
  return PeerLostError(fabric_->rank_, peer_, write_failure_,
                       write_failure_tag_ ? &*write_failure_tag_ : nullptr, true);
}

void TcpConnection::BreakWithWriteFailure() { LosePeer(WriteFailureError()); }

void TcpConnection::LosePeer(const Error& error) {
  if (!made_on_demand_ || heard_) {
    write_failure_timer_.cancel();
    fabric_->BreakLocal(error);
    return;
  }
  // A grace already running (a write failure's, or an earlier loss's) ends with its own error,
  // which names the same peer.
  if (grace_running_ || fabric_->broken()) return;
  grace_running_ = true;
  write_failure_timer_.expires_after(kWriteFailureGrace);
  write_failure_timer_.async_wait([this, error](const asio::error_code& timer_ec) {
    if (timer_ec || closed_) return;
    fabric_->BreakLocal(error);
  });
}

void TcpConnection::OnWrite(const asio::error_code& ec, size_t bytes) {
  write_in_flight_ = false;
  if (closed_ || ec == asio::error::operation_aborted) return;
  if (abort_write_ == AbortWrite::kWriting) {
    if (ec) {
      abort_write_ = AbortWrite::kDone;
      return;
    }
    ConsumeWritten(bytes);
    if (iov_pos_ < iov_end_) {
      IssueWrite();
    } else {
      abort_write_ = AbortWrite::kDone;
    }
    return;
  }
  if (ec) {
    if (abort_write_ == AbortWrite::kPending) {
      abort_write_ = AbortWrite::kDone;
      return;
    }
    WriteFailed(ec);
    return;
  }
  AccountWritten(bytes);
  if (abort_write_ == AbortWrite::kPending) {
    // Shutting down: finish the frame cut in the middle (the stream must stay parseable), drop
    // the rest of the batch, then send the abort frame.
    if (frame_written_ > 0 && batch_done_ < batch_frames_) {
      iov_end_ = frame_end_[batch_done_];
      IssueWrite();
    } else {
      WriteAbortFrame();
    }
    return;
  }
  if (iov_pos_ < iov_end_) {
    IssueWrite();
  } else {
    StartWrite();
  }
}

void TcpConnection::StartAbortWrite(const asio::const_buffer& header,
                                    const asio::const_buffer& payload) {
  if (closed_ || peer_closed_ || pending_) {
    abort_write_ = AbortWrite::kDone;
    return;
  }
  abort_header_ = header;
  abort_payload_ = payload;
  abort_write_ = AbortWrite::kPending;
  if (!write_in_flight_) WriteAbortFrame();
}

void TcpConnection::WriteAbortFrame() {
  abort_write_ = AbortWrite::kWriting;
  iov_[0] = abort_header_;
  iov_[1] = abort_payload_;
  iov_pos_ = 0;
  iov_end_ = 2;
  IssueWrite();
}

// ---- TcpConnection: close. ----

void TcpConnection::Close() {
  if (closed_) return;
  closed_ = true;
  write_failure_timer_.cancel();
  asio::error_code ec;
  if (pending_) {
    socket_.close(ec);
    return;
  }
  fabric_->CountClosed();
  // Closing a socket with unread bytes makes the kernel send a reset, which discards what this
  // side has queued but not sent yet (such as the abort frame). Discard what has arrived first
  // (bounded: this is a shutdown, not the data path).
  if (!peer_closed_) {
    socket_.non_blocking(true, ec);
    std::array<uint8_t, 16384> scratch;
    for (int i = 0; i < 64 && !ec; ++i) {
      if (socket_.read_some(asio::buffer(scratch), ec) == 0) break;
    }
  }
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
}

void TcpConnection::Attach(tcp::socket socket) {
  socket_ = std::move(socket);
  pending_ = false;
  fabric_->CountOpened();
  read_state_ = ReadState::kIdle;
  ArmHeaderRead();
  StartWrite();
}

}  // namespace collectives::transport
