// The TCP fabric's connection to one peer: its socket, the frames it sends and the frames it
// receives (tcp_connection.cc holds the send side, tcp_receive.cc the receive state machine).
//
// Send: a queue of posted frames, written as a gathered list of (header, payload) buffers of up
// to kMaxBatch queued frames. The first attempt is a direct non-blocking write, so a frame that
// fits in the socket buffer completes inside PostSend with no handler to run; the rest goes to
// one async_write_some in flight at a time. A ticket completes when the last byte of its frame
// went to the kernel. Receive: see tcp_receive.cc.
#ifndef COLLECTIVES_SRC_TRANSPORT_TCP_CONNECTION_H_
#define COLLECTIVES_SRC_TRANSPORT_TCP_CONNECTION_H_

#include <array>
#include <asio.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "collectives/errors.h"
#include "src/core/call.h"
#include "src/transport/connection.h"
#include "src/transport/frame.h"
#include "src/transport/handler_memory.h"
#include "src/transport/tcp_fabric.h"

namespace collectives::transport {

constexpr size_t kMaxBatch = 32;  // frames per gathered write (2 buffers each, <= IOV 64)
// Buffers a gathered write takes (asio passes at most 64 to one sendmsg): a batch takes no frame
// past the first that would make it more. A frame in runs (Runs) needs one buffer per run.
constexpr size_t kMaxIov = 64;
// Runs of a receive in runs filled by one read.
constexpr size_t kMaxReadRuns = 32;
// Payloads are read at most this much per call. One large read keeps the socket locked while
// it copies, so the kernel cannot take the sender's next segments or reopen its window (see
// docs/tuning.md).
constexpr size_t kReadChunk = 64 << 10;
// A header read armed while a receive of at most this many bytes is posted reads the payload in
// the same system call, into a buffer of the connection; the payload is copied to the caller's
// buffer only once the header matched the receive. A frame of another size is a mismatch that
// breaks the fabric, so reading up to the posted size never takes bytes of a frame that will
// still be parsed (DiscardPayload, the one reader that skips frames, handles the exception).
constexpr size_t kInlinePayload = 4096;
// Synchronous reads per call of ReadPayload before the rest goes through the io_context (so
// that one busy connection does not starve the others).
constexpr int kMaxReadsInARow = 64;

// A view of consecutive buffers, cheap to copy into an operation.
template <typename Buffer>
struct Span {
  using value_type = Buffer;
  using const_iterator = const Buffer*;
  const Buffer* first;
  const Buffer* last;
  const_iterator begin() const { return first; }
  const_iterator end() const { return last; }
};
using BufferSpan = Span<asio::const_buffer>;
using MutableBufferSpan = Span<asio::mutable_buffer>;

// A FIFO of pending operations over a power-of-two ring; grows by doubling and never shrinks,
// so the steady state does not allocate.
template <typename T>
class OpQueue {
 public:
  OpQueue() : items_(16) {}
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  T& front() { return items_[head_]; }
  T& operator[](size_t i) { return items_[(head_ + i) & (items_.size() - 1)]; }
  void push_back(const T& item) {
    if (size_ == items_.size()) Grow();
    items_[(head_ + size_) & (items_.size() - 1)] = item;
    ++size_;
  }
  void pop_front() {
    head_ = (head_ + 1) & (items_.size() - 1);
    --size_;
  }
  void clear() { head_ = size_ = 0; }

 private:
  void Grow() {
    std::vector<T> bigger(items_.size() * 2);
    for (size_t i = 0; i < size_; ++i) bigger[i] = (*this)[i];
    items_.swap(bigger);
    head_ = 0;
  }
  std::vector<T> items_;
  size_t head_ = 0;
  size_t size_ = 0;
};

// Whether `ec` says the peer closed or reset the connection.
bool IsClosedByPeer(const asio::error_code& ec);
// The reason a lost peer's error gives for `ec`.
std::string ClosedReason(const asio::error_code& ec);

class TcpFabric;

// One peer's socket and the frames in flight on it. Post*/Wait*/Test* are called by the thread
// driving the fabric and take the fabric's drive mutex; the rest runs under that mutex, on that
// thread (the handlers too, from the fabric's io_context). The fabric owns its connections.
class TcpConnection final : public Connection {
  using tcp = asio::ip::tcp;

 public:
  TcpConnection(TcpFabric* fabric, int peer, tcp::socket socket)
      : fabric_(fabric),
        peer_(peer),
        socket_(std::move(socket)),
        write_failure_timer_(socket_.get_executor()) {}
  // A connection made on demand, before its socket is there (Attach): sends and receives queue
  // meanwhile; nothing is written or read.
  TcpConnection(TcpFabric* fabric, int peer, asio::io_context& io)
      : fabric_(fabric),
        peer_(peer),
        socket_(io),
        write_failure_timer_(io),
        made_on_demand_(true),
        pending_(true) {}

  int peer() const override { return peer_; }
  uint64_t PostSend(const core::CallTag& tag, const void* data, size_t bytes) override;
  uint64_t PostRecv(const core::CallTag& tag, void* data, size_t bytes) override;
  uint64_t PostSend(const core::CallTag& tag, const core::Runs& runs, size_t offset,
                    size_t bytes) override;
  uint64_t PostRecv(const core::CallTag& tag, const core::Runs& runs, size_t offset,
                    size_t bytes) override;
  void WaitSend(uint64_t ticket) override;
  void WaitRecv(uint64_t ticket) override;
  bool TestSend(uint64_t ticket) override;
  bool TestRecv(uint64_t ticket) override;
  // Throws kInvalidUsage, without breaking the fabric, for a ticket that was not posted.
  void CheckTicket(const char* call, uint64_t ticket, bool send) const;

 private:
  friend class TcpFabric;

  // A frame's payload: `bytes` at `data`, or at message offset `offset` of `runs`.
  struct SendOp {
    core::CallTag tag;
    const uint8_t* data = nullptr;
    size_t bytes = 0;
    const core::Runs* runs = nullptr;
    size_t offset = 0;
  };
  struct RecvOp {
    core::CallTag tag;
    uint8_t* data = nullptr;
    size_t bytes = 0;
    const core::Runs* runs = nullptr;
    size_t offset = 0;
  };

  uint64_t Send(const SendOp& op);
  uint64_t Recv(const RecvOp& op);
  // Copies `n` bytes to payload byte `at` of `op`'s destination.
  static void CopyToPayload(const RecvOp& op, size_t at, const uint8_t* from, size_t n);
  // Fills read_iov_ with up to kMaxReadRuns buffers for payload bytes [at, at + want) of `op`;
  // returns how many buffers, and sets `want` to the bytes they hold.
  size_t PayloadBuffers(const RecvOp& op, size_t at, size_t& want);

  struct WriteHandler {
    TcpConnection* connection;
    using allocator_type = HandlerAllocator<void>;
    allocator_type get_allocator() const noexcept {
      return allocator_type(&connection->write_memory_);
    }
    void operator()(const asio::error_code& ec, size_t bytes) const {
      connection->OnWrite(ec, bytes);
    }
  };
  struct ReadHandler {
    TcpConnection* connection;
    using allocator_type = HandlerAllocator<void>;
    allocator_type get_allocator() const noexcept {
      return allocator_type(&connection->read_memory_);
    }
    void operator()(const asio::error_code& ec, size_t bytes) const {
      connection->OnRead(ec, bytes);
    }
  };

  // kDiscard: a write failed and the fabric is about to break (kWriteFailureGrace); payloads
  // are skipped, not placed, so that an abort frame behind them is still read.
  // kIdle: between frames, no read armed yet (see TcpFabric::ResumeReads).
  enum class ReadState {
    kIdle,
    kHeader,
    kHeaderReady,
    kPayload,
    kAbortPayload,
    kDiscard,
    kStopped
  };
  enum class AbortWrite { kNone, kPending, kWriting, kDone };

  // Send side.
  void StartWrite();
  void IssueWrite();
  void OnWrite(const asio::error_code& ec, size_t bytes);
  // Advances the gathered buffers past `bytes` written.
  void ConsumeWritten(size_t bytes);
  // ConsumeWritten, then completes the frames written in full.
  void AccountWritten(size_t bytes);
  void WriteFailed(const asio::error_code& ec);
  // The peer-lost error for the write error recorded by WriteFailed.
  Error WriteFailureError() const;
  // Breaks the fabric with WriteFailureError, through LosePeer.
  void BreakWithWriteFailure();
  // The peer closed this connection with no abort frame on it, and this rank needs the peer:
  // breaks the fabric with `error`. On a connection made on demand that has brought no frame
  // yet, after kWriteFailureGrace: the peer may have broken while the connection was still
  // being attached on its side, so that its abort frame (naming the rank at fault) went only
  // over its other connections and reaches this rank relayed. Within the grace that frame
  // decides; after it, `error` does. A connection the peer has written on is attached there,
  // and so is every set-up connection before any call: a peer that breaks writes its abort
  // frame on them, so their close breaks the fabric at once, and a rank that dies is named as
  // fast as its peers see it close.
  void LosePeer(const Error& error);
  // Shutdown: finishes the frame being written, then writes `header` + `payload` (the fabric's
  // abort frame). `abort_write_` tracks it.
  void StartAbortWrite(const asio::const_buffer& header, const asio::const_buffer& payload);
  void WriteAbortFrame();

  // Receive side.
  // Reads the next header, and with it the payload of the first posted receive if it is small
  // (kInlinePayload) and then the header after it.
  void ArmHeaderRead();
  // What to read inline with the next header: the first posted receive's size if small, else 0.
  size_t InlineWant();
  // (Re)issues the header read for what is missing of header_buffer_; with inline_want_ > 0,
  // also that much payload and the next header (next_header_).
  void IssueHeaderRead();
  // The first posted receive has its whole payload: completes it, then FrameDone.
  void CompleteReceive();
  // A frame was read in full. The read that ended it may have taken (part of) the next header
  // too: a whole one is decoded at once (an abort frame breaks the fabric now), a part is read
  // on; with none, kIdle until the fabric next arms the header read (ResumeReads).
  void FrameDone();
  void IssueRead(void* data, size_t bytes);
  void OnRead(const asio::error_code& ec, size_t bytes);
  // Decodes header_buffer_. A data header is matched with the first posted receive at once
  // (`match`), or by the fabric's next ResumeReads (so that reading a run of frames that each
  // came with the one before does not recurse).
  void OnHeader(bool match);
  // A held header (kHeaderReady, no receive posted) of the running call's number that names
  // another call (TcpFabric::SetCall) breaks the fabric with kMismatch now: no receive may ever
  // be posted for it. A header a receive is posted for is checked by TryMatch, against it.
  void CheckHeldHeader();
  void TryMatch();
  // Reads what is missing of an abort frame's payload, then breaks the fabric with it.
  void ReadAbortPayload();
  // Reads what has arrived of the payload of the first posted receive (read_state_ kPayload).
  void ReadPayload();
  void OnReadError(const asio::error_code& ec);
  // "rank 1: <what> from rank 0: <why> while waiting for #5 all_reduce(...)" (kSystem); the call
  // is the first posted receive's, left out when none is posted.
  Error MalformedFrameError(const char* what, const std::string& why);
  // Enters kDiscard for the held header's payload (or arms the next header read if it is empty).
  void DiscardPayload();
  // A header read with inline_want_ > 0 splits the bytes past the header as the first posted
  // receive expects: inline_got_ of payload (inline_payload_), then next_got_ of the next header
  // (next_header_). For a frame of another size (an abort frame, a skipped frame) the first
  // `frame_bytes` of them, in stream order, are its payload: copies those into `out` and
  // returns how many there were.
  size_t CopyBytesPastHeader(uint8_t* out, size_t frame_bytes) const;

  // Drops what has arrived (bounded), then shuts the socket down and closes it. The fabric
  // calls it at its shutdown and in its destructor.
  void Close();
  // Gives a pending connection its socket (connected, handshake done, on the fabric's
  // io_context): starts the queued writes and the header reads.
  void Attach(tcp::socket socket);

  TcpFabric* const fabric_;
  const int peer_;
  tcp::socket socket_;
  bool closed_ = false;
  // EOF or reset seen: no frame will come any more, and the peer reads nothing.
  bool peer_closed_ = false;
  std::string closed_reason_;
  // A write failed (see kWriteFailureGrace); nothing more is written.
  bool write_failed_ = false;
  std::string write_failure_;
  std::optional<core::CallTag> write_failure_tag_;
  asio::steady_timer write_failure_timer_;
  // The write failure's or LosePeer's grace is running on write_failure_timer_.
  bool grace_running_ = false;
  // Made on demand (see LosePeer), and still without its socket (see Attach).
  const bool made_on_demand_ = false;
  bool pending_ = false;
  // A frame header came in on this connection: the peer attached it (see LosePeer).
  bool heard_ = false;

  OpQueue<SendOp> sends_;  // posted, not completed; the first batch_frames_ are being written
  uint64_t sends_posted_ = 0;
  uint64_t sends_done_ = 0;
  bool write_in_flight_ = false;
  size_t batch_frames_ = 0;   // frames in the current write batch
  size_t batch_done_ = 0;     // of which completed
  size_t frame_written_ = 0;  // bytes of frame batch_done_ already written
  std::array<size_t, kMaxBatch> frame_bytes_{};
  std::array<size_t, kMaxBatch> frame_end_{};  // iov index past each frame's last buffer
  std::array<EncodedHeader, kMaxBatch> batch_headers_{};
  std::vector<asio::const_buffer> iov_ = std::vector<asio::const_buffer>(2 * kMaxBatch);
  size_t iov_pos_ = 0;
  size_t iov_end_ = 0;
  AbortWrite abort_write_ = AbortWrite::kNone;
  asio::const_buffer abort_header_;
  asio::const_buffer abort_payload_;
  HandlerMemory write_memory_;

  OpQueue<RecvOp> recvs_;  // posted, not completed
  uint64_t recvs_posted_ = 0;
  uint64_t recvs_done_ = 0;
  ReadState read_state_ = ReadState::kStopped;
  size_t read_got_ = 0;
  FrameHeader header_;
  EncodedHeader header_buffer_{};
  // Payload bytes asked for with the header read (kInlinePayload), and of them those that came.
  size_t inline_want_ = 0;
  size_t inline_got_ = 0;
  std::array<uint8_t, kInlinePayload> inline_payload_{};
  // The next frame's header, read with the end of the current frame: next_got_ bytes of it.
  EncodedHeader next_header_{};
  size_t next_got_ = 0;
  std::array<uint8_t, kMaxAbortPayload> abort_buffer_{};
  // A payload read into runs: the runs' buffers, then the next header.
  std::array<asio::mutable_buffer, kMaxReadRuns + 1> read_iov_{};
  HandlerMemory read_memory_;
};

}  // namespace collectives::transport

#endif  // COLLECTIVES_SRC_TRANSPORT_TCP_CONNECTION_H_
