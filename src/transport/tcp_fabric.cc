// The TCP fabric: mesh set-up through a Store (listener, address exchange, connects with
// retry, handshakes) and the data path on one io_context per fabric.
//
// Data path, per connection (sockets in non-blocking mode, touched only by the driving thread):
//   send: a queue of posted frames, written as a gathered list of (header, payload) buffers of
//     up to kMaxBatch queued frames. The first attempt is a direct non-blocking write, so a
//     frame that fits in the socket buffer completes inside PostSend with no handler to run;
//     the rest goes to one async_write_some in flight at a time. A ticket completes when the
//     last byte of its frame went to the kernel.
//   receive: a 40-byte header read is armed whenever the fabric is driven, so that EOF and abort
//     frames are seen even when no receive is posted. A data header is held until a receive is
//     posted, validated against it (tag and size), and only then is the payload placed in the
//     caller's buffer: read straight into it while data is there (kReadChunk per call),
//     asynchronously when the socket runs dry. Small frames cost one read each: a header read
//     armed while a small receive is posted asks for the payload too (into a buffer of the
//     connection, copied out once the header matched; kInlinePayload), and the read that ends a
//     frame asks for the next header as well (so an abort frame already in behind a frame fails the
//     call that reads the frame, as before). Only when that finds nothing is the connection left
//     idle, and its next header read is armed by the next Drive or Test (ResumeReads), not at
//     once: arming starts with a speculative recv, which right after a frame almost always finds
//     nothing, and at once it would sit between the frame's arrival and the caller's return (an
//     8-byte all-reduce is a few system calls long); in the next wait it takes the place of a
//     poll. Past a header it cannot place yet the connection reads at most kInlinePayload bytes
//     (TCP flow control holds the sender).
// Handlers are small structs holding the connection pointer, with memory reused from a slot in
// the connection (HandlerMemory), so the steady state allocates nothing per frame
// (tcp_alloc_test checks it).
//
// Waiting: Wait* poll the io_context for the spin budget, then poll with a sched_yield between
// polls for the yield budget, then sleep in run_one_until up to the deadline. Abort from another
// thread records the error; if the fabric is idle, that thread sends the abort frames and closes at
// once; if a thread is driving it, Abort posts a no-op that wakes it, and the driving thread does
// the shutdown before it throws.
#include "src/transport/tcp_fabric.h"

#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <system_error>
#include <thread>
#include <vector>

#include "src/cluster/listener_guard.h"
#include "src/cluster/name_lookups.h"
#include "src/cluster/store_common.h"
#include "src/core/environment.h"
#include "src/transport/fabric_errors.h"
#include "src/transport/frame.h"
#include "src/transport/handshake.h"

namespace collectives::transport {
namespace {

using asio::ip::tcp;

constexpr size_t kMaxBatch = 32;  // frames per gathered write (2 buffers each, <= IOV 64)
// Buffers a gathered write takes (asio passes at most 64 to one sendmsg): a batch takes no frame
// past the first that would make it more. A frame in runs (Runs) needs one buffer per run.
constexpr size_t kMaxIov = 64;
// Runs of a receive in runs filled by one read.
constexpr size_t kMaxReadRuns = 32;
constexpr std::chrono::microseconds kDefaultSpin{50};
constexpr std::chrono::milliseconds kAbortBudget{100};
// After its abort frames, a shutdown half-closes every connection and reads (and drops) what the
// peers still send until each closes its side too (it breaks on the abort frame and shuts down
// in turn), for at most this long. Closing with unread bytes, or with bytes still on their way,
// makes the kernel reset the connection, and a reset can overtake the abort frame: the peer
// would report this rank as lost instead of the error that broke the job.
constexpr std::chrono::milliseconds kLingerBudget{200};
// How long an Abort from another thread waits for the driving thread to run the shutdown: its
// two budgets and time for the driving thread to reach its next wait.
constexpr std::chrono::milliseconds kAbortWaitLimit =
    kAbortBudget + kLingerBudget + std::chrono::milliseconds(700);
// A write that fails because the peer closed or reset does not break the fabric at once when the
// connection's header read is armed: the peer may have closed because it failed itself, and its
// abort frame (naming the rank at fault) is then already on its way in on the same connection.
// Within this grace the abort frame or the EOF behind it decides; after it, the write error does.
constexpr std::chrono::milliseconds kWriteFailureGrace{200};
// Payloads are read at most this much per call. One large read keeps the socket locked while
// it copies, so the kernel cannot take the sender's next segments or reopen its window;
// 64 KiB reads doubled loopback throughput (2.4 -> 4.8 GB/s for 4 MiB frames) over 4 MiB ones.
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

// ---- Allocation-free handlers. ----

// Storage for the handler of one kind of operation of one connection. At most one such
// operation is outstanding, so one slot suffices; a larger or concurrent request falls back to
// the heap.
class HandlerMemory {
 public:
  HandlerMemory() = default;
  HandlerMemory(const HandlerMemory&) = delete;
  HandlerMemory& operator=(const HandlerMemory&) = delete;

  void* Allocate(size_t bytes) {
    if (!in_use_ && bytes <= sizeof(storage_)) {
      in_use_ = true;
      return storage_;
    }
    return ::operator new(bytes);
  }

  void Deallocate(void* pointer) {
    if (pointer == storage_) {
      in_use_ = false;
    } else {
      ::operator delete(pointer);
    }
  }

 private:
  alignas(std::max_align_t) unsigned char storage_[1024];
  bool in_use_ = false;
};

template <typename T>
class HandlerAllocator {
 public:
  using value_type = T;

  explicit HandlerAllocator(HandlerMemory* memory) : memory_(memory) {}
  template <typename U>
  HandlerAllocator(const HandlerAllocator<U>& other) noexcept : memory_(other.memory_) {}

  T* allocate(size_t n) { return static_cast<T*>(memory_->Allocate(sizeof(T) * n)); }
  void deallocate(T* pointer, size_t) { memory_->Deallocate(pointer); }

  template <typename U>
  bool operator==(const HandlerAllocator<U>& other) const noexcept {
    return memory_ == other.memory_;
  }
  template <typename U>
  bool operator!=(const HandlerAllocator<U>& other) const noexcept {
    return memory_ != other.memory_;
  }

 private:
  template <typename>
  friend class HandlerAllocator;
  HandlerMemory* memory_;
};

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

bool IsClosedByPeer(const asio::error_code& ec) {
  return ec == asio::error::eof || ec == asio::error::connection_reset ||
         ec == asio::error::broken_pipe || ec == asio::error::connection_aborted;
}

std::string ClosedReason(const asio::error_code& ec) {
  if (ec == asio::error::eof) return "connection closed by peer";
  return ec.message();
}

class TcpFabric;

// ---- Connection. ----

// One peer's socket and the frames in flight on it. Used only by the thread driving the
// fabric (which holds the fabric's drive mutex); handlers run on that thread too.
class TcpConnection final : public Connection {
 public:
  TcpConnection(TcpFabric* fabric, int peer, tcp::socket socket)
      : fabric_(fabric),
        peer_(peer),
        socket_(std::move(socket)),
        write_failure_timer_(socket_.get_executor()) {}

  int peer() const override { return peer_; }
  uint64_t PostSend(const core::CallTag& tag, const void* data, size_t bytes) override;
  uint64_t PostRecv(const core::CallTag& tag, void* data, size_t bytes) override;
  uint64_t PostSend(const core::CallTag& tag, const Runs& runs, size_t offset,
                    size_t bytes) override;
  uint64_t PostRecv(const core::CallTag& tag, const Runs& runs, size_t offset,
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
    const Runs* runs = nullptr;
    size_t offset = 0;
  };
  struct RecvOp {
    core::CallTag tag;
    uint8_t* data = nullptr;
    size_t bytes = 0;
    const Runs* runs = nullptr;
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
  // Breaks the fabric with the write error recorded by WriteFailed.
  void BreakWithWriteFailure();
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
  // A header read with inline_want_ > 0 splits what it gets past the header for
  // the frame the first posted receive expects: inline_got_ bytes of payload (inline_payload_),
  // then next_got_ bytes of the next header (next_header_). For a frame of another size (an
  // abort frame, a frame skipped after a write failure) the split is wrong: the first
  // `frame_bytes` of those bytes, in stream order, are the frame's payload. Copies them into
  // `out`; returns how many there were.
  size_t CopyBytesPastHeader(uint8_t* out, size_t frame_bytes) const;

  void Close();

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

// ---- Fabric. ----

// Thread-safety: one thread at a time drives the fabric (Post*/Wait*/Test*, connection());
// Abort may be called from any thread. drive_mu_ is held for the duration of every driving
// call, so an Abort from another thread can tell whether it may touch the sockets itself.
class TcpFabric final : public Fabric {
 public:
  TcpFabric(int rank, int size, std::vector<std::optional<tcp::socket>>& sockets_in_setup);
  ~TcpFabric() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Connection& connection(int peer) override;
  void SetDeadline(Clock::time_point deadline) override;
  void SetCall(const core::CallTag& call) override;
  void SetSpin(std::chrono::microseconds spin, std::chrono::microseconds yield) override;
  void Abort(const Error& error) override;

 private:
  friend class TcpConnection;

  // Records the fabric's first error; `payload` is what the shutdown sends to every peer but
  // `skip_peer` (nullopt: send nothing). Later errors are ignored.
  void Break(const Error& error, std::optional<AbortPayload> payload, int skip_peer);
  void BreakLocal(const Error& error) { Break(error, AbortPayloadFor(rank_, error), -1); }
  bool broken() const { return broken_.load(std::memory_order_acquire); }
  // If broken: runs the shutdown (driving thread only) and throws the first error.
  void ThrowIfBroken();
  // Sends the abort frames (bounded by kAbortBudget) and closes every socket. Driving thread.
  void RunShutdown();
  // Half-closes every open connection and drops what arrives until each peer closes its side
  // (bounded by kLingerBudget). Driving thread, during the shutdown.
  void Linger();
  // Drives the io_context until `done()` (throwing on error or past the deadline); `head`
  // names the operation reported on timeout.
  template <typename Done>
  void Drive(Done done, TcpConnection& connection, bool sending);
  // Arms the header read of every connection in kIdle (TcpConnection::FrameDone), and matches
  // the headers OnHeader left to it. Drive and Test call it before they poll (and after they
  // checked for completion: right after a frame, an armed read would find nothing), so that a
  // frame, an EOF or an abort from any peer is read while the fabric is driven. Returns whether
  // it matched a header (which may have completed receives).
  bool ResumeReads();
  template <typename Done>
  bool Test(Done done, TcpConnection& connection, bool sending);
  [[noreturn]] void ThrowTimeout(TcpConnection& connection, bool sending);

  // Declared first: destroyed after the sockets that belong to it.
  asio::io_context io_{1};
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  const int rank_;
  const int size_;
  std::vector<std::unique_ptr<TcpConnection>> connections_;
  Clock::time_point deadline_ = Clock::time_point::max();
  std::optional<core::CallTag> call_;  // SetCall (driving thread)
  std::chrono::microseconds spin_ = kDefaultSpin;
  std::chrono::microseconds yield_{0};

  std::mutex drive_mu_;
  bool shut_down_ = false;
  // Set when the shutdown has run, for an Abort that left it to the driving thread.
  std::mutex shutdown_mu_;
  std::condition_variable shutdown_cv_;
  bool shutdown_finished_ = false;  // guarded by shutdown_mu_
  // Some connection may be in kIdle, or hold a header to match (driving thread).
  bool resume_reads_ = false;

  mutable std::mutex error_mu_;
  std::optional<Error> error_;                 // guarded by error_mu_
  std::optional<AbortPayload> abort_to_send_;  // guarded by error_mu_
  int abort_skip_peer_ = -1;                   // guarded by error_mu_
  std::atomic<bool> broken_{false};
  // Whether a data frame's call descriptor (sequence number, collective, dtype, op, count, root)
  // is compared with the receive's. Always, unless COLLECTIVES_UNSAFE_SKIP_CALL_CHECK=1 is set:
  // that exists only to measure what the check costs (README, "When something goes wrong").
  const bool check_calls_ = [] {
    const char* skip = std::getenv("COLLECTIVES_UNSAFE_SKIP_CALL_CHECK");
    return skip == nullptr || std::string(skip) != "1";
  }();

  // The abort frame being sent during shutdown.
  EncodedHeader abort_header_{};
  std::string abort_payload_;
};

// ---- TcpConnection: send side. ----

uint64_t TcpConnection::PostSend(const core::CallTag& tag, const void* data, size_t bytes) {
  if (data == nullptr && bytes > 0) {
    std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
    fabric_->ThrowIfBroken();
    throw NullBufferError(fabric_->rank_, peer_, bytes, /*sending=*/true);
  }
  return Send(SendOp{tag, static_cast<const uint8_t*>(data), bytes});
}

uint64_t TcpConnection::PostSend(const core::CallTag& tag, const Runs& runs, size_t offset,
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
    fabric_->BreakLocal(PeerLostError(fabric_->rank_, peer_, closed_reason_, &op.tag, true));
    fabric_->ThrowIfBroken();
  }
  StartWrite();
  return ticket;
}

void TcpConnection::StartWrite() {
  while (!write_in_flight_ && !write_failed_ && !sends_.empty() && !fabric_->broken()) {
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
  // The read side must be moving toward the next header for the grace to help: armed, or in the
  // middle of a payload that has a posted buffer.
  if (!IsClosedByPeer(ec) || read_state_ == ReadState::kStopped) {
    peer_closed_ = peer_closed_ || IsClosedByPeer(ec);
    BreakWithWriteFailure();
    return;
  }
  // A held data header would stop the read side: skip its payload instead.
  if (read_state_ == ReadState::kHeaderReady) DiscardPayload();
  if (read_state_ == ReadState::kIdle) ArmHeaderRead();
  write_failure_timer_.expires_after(kWriteFailureGrace);
  write_failure_timer_.async_wait([this](const asio::error_code& timer_ec) {
    if (timer_ec || closed_) return;
    peer_closed_ = true;
    BreakWithWriteFailure();
  });
}

void TcpConnection::BreakWithWriteFailure() {
  fabric_->BreakLocal(PeerLostError(fabric_->rank_, peer_, write_failure_,
                                    write_failure_tag_ ? &*write_failure_tag_ : nullptr, true));
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
  if (closed_ || peer_closed_) {
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

// ---- TcpConnection: receive side. ----

uint64_t TcpConnection::PostRecv(const core::CallTag& tag, void* data, size_t bytes) {
  if (data == nullptr && bytes > 0) {
    std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
    fabric_->ThrowIfBroken();
    throw NullBufferError(fabric_->rank_, peer_, bytes, /*sending=*/false);
  }
  return Recv(RecvOp{tag, static_cast<uint8_t*>(data), bytes});
}

uint64_t TcpConnection::PostRecv(const core::CallTag& tag, const Runs& runs, size_t offset,
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
    fabric_->BreakLocal(PeerLostError(fabric_->rank_, peer_, closed_reason_, &op.tag, false));
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
    write_failure_timer_.cancel();
    BreakWithWriteFailure();
  } else if (!recvs_.empty()) {
    fabric_->BreakLocal(
        PeerLostError(fabric_->rank_, peer_, closed_reason_, &recvs_.front().tag, false));
  }
}

Error TcpConnection::MalformedFrameError(const char* what, const std::string& why) {
  std::string message = "rank " + std::to_string(fabric_->rank_) + ": " + what + " from rank " +
                        std::to_string(peer_) + ": " + why;
  if (!recvs_.empty()) message += " while waiting for " + recvs_.front().tag.ToString();
  return Error(ErrorCode::kSystem, message);
}

void TcpConnection::Close() {
  if (closed_) return;
  closed_ = true;
  write_failure_timer_.cancel();
  asio::error_code ec;
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

// ---- TcpConnection: waiting. ----

void TcpConnection::CheckTicket(const char* call, uint64_t ticket, bool send) const {
  const uint64_t posted = send ? sends_posted_ : recvs_posted_;
  if (ticket <= posted) return;
  throw Error(ErrorCode::kInvalidUsage,
              "rank " + std::to_string(fabric_->rank_) + ": " + call + "(" +
                  std::to_string(ticket) + ") " + (send ? "to" : "from") + " rank " +
                  std::to_string(peer_) + ", but only " + std::to_string(posted) +
                  (send ? " sends" : " receives") + " were posted");
}

void TcpConnection::WaitSend(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  CheckTicket("WaitSend", ticket, true);
  fabric_->Drive([this, ticket] { return sends_done_ >= ticket; }, *this, true);
}

void TcpConnection::WaitRecv(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  CheckTicket("WaitRecv", ticket, false);
  fabric_->Drive([this, ticket] { return recvs_done_ >= ticket; }, *this, false);
}

bool TcpConnection::TestSend(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  CheckTicket("TestSend", ticket, true);
  return fabric_->Test([this, ticket] { return sends_done_ >= ticket; }, *this, true);
}

bool TcpConnection::TestRecv(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(fabric_->drive_mu_);
  fabric_->ThrowIfBroken();
  CheckTicket("TestRecv", ticket, false);
  return fabric_->Test([this, ticket] { return recvs_done_ >= ticket; }, *this, false);
}

// ---- TcpFabric. ----

TcpFabric::TcpFabric(int rank, int size, std::vector<std::optional<tcp::socket>>& sockets_in_setup)
    : work_(asio::make_work_guard(io_)), rank_(rank), size_(size) {
  connections_.resize(size);
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    tcp::socket& setup_socket = *sockets_in_setup[peer];
    asio::error_code ec;
    const auto local = setup_socket.local_endpoint(ec);
    const tcp protocol = ec ? tcp::v4() : local.protocol();
    // Move the descriptor from the set-up io_context to this fabric's.
    tcp::socket socket(io_, protocol, setup_socket.release(ec));
    if (!ec) socket.non_blocking(true, ec);  // the synchronous first attempts must never block
    if (ec) {
      throw Error(ErrorCode::kSystem, "rank " + std::to_string(rank) +
                                          ": cannot make the socket to rank " +
                                          std::to_string(peer) + " non-blocking: " + ec.message());
    }
    connections_[peer] = std::make_unique<TcpConnection>(this, peer, std::move(socket));
  }
  for (auto& connection : connections_) {
    if (connection) connection->ArmHeaderRead();
  }
}

TcpFabric::~TcpFabric() {
  std::lock_guard<std::mutex> lock(drive_mu_);
  if (broken()) {
    RunShutdown();
  } else {
    for (auto& connection : connections_) {
      if (connection) connection->Close();
    }
    // Run the cancelled operations now: their handler memory lives in the connections.
    io_.poll();
  }
  connections_.clear();
  work_.reset();
}

Connection& TcpFabric::connection(int peer) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank_) +
                                                 ": no connection to rank " + std::to_string(peer) +
                                                 " in a fabric of " + std::to_string(size_));
  }
  return *connections_[peer];
}

void TcpFabric::SetDeadline(Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(drive_mu_);
  deadline_ = deadline;
}

void TcpFabric::SetCall(const core::CallTag& call) {
  std::lock_guard<std::mutex> lock(drive_mu_);
  call_ = call;
  if (broken()) return;                    // raised by the call's first wait, as before
  for (auto& connection : connections_) {  // headers read during the call before
    if (connection && !connection->closed_) connection->CheckHeldHeader();
  }
  // Now, not at the call's first wait: a call that never drives the fabric (a member of a
  // two-level plan that stays in shared memory) would return, and its peers hear of it late.
  ThrowIfBroken();
}

void TcpFabric::SetSpin(std::chrono::microseconds spin, std::chrono::microseconds yield) {
  std::lock_guard<std::mutex> lock(drive_mu_);
  spin_ = std::max(spin, std::chrono::microseconds(0));
  yield_ = std::max(yield, std::chrono::microseconds(0));
}

void TcpFabric::Break(const Error& error, std::optional<AbortPayload> payload, int skip_peer) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (error_) return;
  error_.emplace(error);
  abort_to_send_ = std::move(payload);
  abort_skip_peer_ = skip_peer;
  broken_.store(true, std::memory_order_release);
}

void TcpFabric::Abort(const Error& error) {
  Break(error, AbortPayloadFor(rank_, error), -1);
  {
    std::unique_lock<std::mutex> lock(drive_mu_, std::try_to_lock);
    if (lock.owns_lock()) {
      RunShutdown();
      return;
    }
  }
  // The driving thread is inside a call: wake it; its next wait runs the shutdown (a call that
  // was already returning does not wait again: the owner calls Abort again once it ended, see
  // Fabric::Abort). Return once it has, so that the peers have been told when Abort returns
  // (a process may exit right after), but not later than kAbortWaitLimit: the driving thread
  // may be busy between waits.
  asio::post(io_, [] {});
  std::unique_lock<std::mutex> lock(shutdown_mu_);
  shutdown_cv_.wait_for(lock, kAbortWaitLimit, [this] { return shutdown_finished_; });
}

void TcpFabric::ThrowIfBroken() {
  if (!broken()) return;
  RunShutdown();
  std::lock_guard<std::mutex> lock(error_mu_);
  throw *error_;
}

void TcpFabric::RunShutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  // However the shutdown ends (a bad_alloc encoding the payload included), an Abort waiting
  // for it is let go.
  struct Finished {
    TcpFabric* fabric;
    ~Finished() {
      {
        std::lock_guard<std::mutex> lock(fabric->shutdown_mu_);
        fabric->shutdown_finished_ = true;
      }
      fabric->shutdown_cv_.notify_all();
    }
  } finished{this};
  std::optional<AbortPayload> payload;
  int skip = -1;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    payload = abort_to_send_;
    skip = abort_skip_peer_;
  }
  if (payload) {
    abort_payload_ = EncodeAbortPayload(*payload);
    FrameHeader header;
    header.kind = FrameKind::kAbort;
    header.bytes = abort_payload_.size();
    abort_header_ = EncodeHeader(header);
    for (auto& connection : connections_) {
      if (!connection || connection->peer_ == skip) continue;
      connection->StartAbortWrite(asio::buffer(abort_header_),
                                  asio::buffer(abort_payload_.data(), abort_payload_.size()));
    }
    const auto until = Clock::now() + kAbortBudget;
    auto pending = [this] {
      for (auto& connection : connections_) {
        if (connection && (connection->abort_write_ == TcpConnection::AbortWrite::kPending ||
                           connection->abort_write_ == TcpConnection::AbortWrite::kWriting)) {
          return true;
        }
      }
      return false;
    };
    while (pending() && Clock::now() < until) io_.run_one_until(until);
  }
  Linger();
  for (auto& connection : connections_) {
    if (connection) connection->Close();
  }
  // Let the cancelled operations finish now, so none runs later on freed user buffers.
  io_.poll();
}

void TcpFabric::Linger() {
  std::vector<pollfd> open;
  for (auto& connection : connections_) {
    if (!connection || connection->closed_ || connection->peer_closed_) continue;
    asio::error_code ec;
    // Not in the middle of a frame: a cut frame would be a malformed stream to the peer.
    if (connection->abort_write_ != TcpConnection::AbortWrite::kPending &&
        connection->abort_write_ != TcpConnection::AbortWrite::kWriting &&
        !connection->write_in_flight_) {
      connection->socket_.shutdown(tcp::socket::shutdown_send, ec);
    }
    open.push_back(pollfd{connection->socket_.native_handle(), POLLIN, 0});
  }
  const auto until = Clock::now() + kLingerBudget;
  std::array<uint8_t, 64 << 10> scratch;
  while (!open.empty()) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now());
    if (left.count() <= 0) break;
    const int ready = ::poll(open.data(), open.size(), static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    std::erase_if(open, [&](const pollfd& fd) {
      if (fd.revents == 0) return false;
      for (;;) {
        const ssize_t got = ::recv(fd.fd, scratch.data(), scratch.size(), MSG_DONTWAIT);
        if (got > 0) continue;
        if (got < 0 && errno == EINTR) continue;
        // 0: the peer closed its side. EAGAIN: nothing more for now. Anything else: gone.
        return got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
      }
    });
  }
}

bool TcpFabric::ResumeReads() {
  bool matched = false;
  // A match may complete a frame whose read took the next header, which may be matched in turn
  // (or leave the connection idle): loop until no connection is left waiting for this.
  while (resume_reads_ && !broken()) {
    resume_reads_ = false;
    for (auto& connection : connections_) {
      if (!connection || connection->closed_) continue;
      if (connection->read_state_ == TcpConnection::ReadState::kIdle) {
        connection->ArmHeaderRead();
      } else if (connection->read_state_ == TcpConnection::ReadState::kHeaderReady &&
                 !connection->recvs_.empty()) {
        connection->TryMatch();
        matched = true;
      }
    }
  }
  return matched;
}

template <typename Done>
void TcpFabric::Drive(Done done, TcpConnection& connection, bool sending) {
  if (done()) return;
  const auto spin_end = Clock::now() + spin_;
  const auto yield_end = spin_end + yield_;
  for (;;) {
    ThrowIfBroken();
    if (done()) return;
    if (ResumeReads()) continue;  // a receive may have completed: check before polling
    const auto now = Clock::now();
    if (now >= deadline_) ThrowTimeout(connection, sending);
    if (now < spin_end) {
      io_.poll();
    } else if (now < yield_end) {
      // Still runnable, so data that arrives needs no wake-up; the yield lets any thread with
      // work (a peer rank on this core, the kernel's softirq thread) run first.
      if (io_.poll() == 0) sched_yield();
    } else {
      io_.run_one_until(deadline_);
    }
  }
}

template <typename Done>
bool TcpFabric::Test(Done done, TcpConnection& connection, bool sending) {
  ThrowIfBroken();
  if (done()) return true;
  if (ResumeReads()) {
    ThrowIfBroken();
    if (done()) return true;
  }
  io_.poll();
  ThrowIfBroken();
  if (done()) return true;
  if (Clock::now() >= deadline_) ThrowTimeout(connection, sending);
  return false;
}

void TcpFabric::ThrowTimeout(TcpConnection& connection, bool sending) {
  // Report the oldest incomplete operation: it is the one that holds the rest up.
  if (sending) {
    const auto& op = connection.sends_.front();
    BreakLocal(TimeoutError(rank_, connection.peer_, op.tag, op.bytes, true));
  } else {
    const auto& op = connection.recvs_.front();
    BreakLocal(TimeoutError(rank_, connection.peer_, op.tag, op.bytes, false));
  }
  ThrowIfBroken();
  throw Error(ErrorCode::kInternal, "unreachable: broken fabric did not throw");
}

// ---- Set-up. ----

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

std::optional<HostPort> ParseHostPort(const std::string& text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) return std::nullopt;
  HostPort out;
  out.host = text.substr(0, colon);
  if (out.host.size() >= 2 && out.host.front() == '[' && out.host.back() == ']') {
    out.host = out.host.substr(1, out.host.size() - 2);
  }
  unsigned long port = 0;
  for (size_t i = colon + 1; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return std::nullopt;
    port = port * 10 + static_cast<unsigned long>(text[i] - '0');
    if (port > 65535) return std::nullopt;
  }
  if (port == 0) return std::nullopt;
  out.port = static_cast<uint16_t>(port);
  return out;
}

std::string FormatHostPort(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

std::string JoinRanks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}

// The data connections' receive buffer. Linux sizes it by autotuning unless a process sets
// SO_RCVBUF, and where autotuning settles differs from one connection to the next: across runs
// of a 2-rank all-gather of 16 MiB on the development VM (2 cores, net.core.rmem_max 4 MiB,
// tcp_rmem max 32 MiB), `ss -tmi` showed receive buffers from 2.8 to 33 MB, and the runs with
// the small ones were the slow ones. A fixed 4 MiB (the kernel doubles it for its bookkeeping)
// gave, in five alternating runs of 200 calls each: 2611-2991 us, against 3175-3843 left to
// autotuning and 3650-4008 / 3329-3572 with 1 / 2 MiB; 2-rank all-reduce of 16 MiB 5.4-6.0 ms
// against 5.7-6.6. With 4 ranks on the 2 cores it was slower instead (1 MiB broadcast
// 352-605 us against 341-522, all-gather 324-445 against 292-377, five alternating runs; the
// 16 MiB all-gather against Open MPI went from 0.87-1.01 to 0.87-1.29): a sender that can queue
// the whole message runs ahead of a receiver waiting for a core, and the data goes cold. So the
// fixed buffer is for hosts with a core per rank (the rule the spin budget uses). Checked again
// with the send-buffer cap below (2 ranks, 10 alternating sweeps, 256 KiB-64 MiB): autotuning
// took 1.04-1.74x the time for all-gather, 0.95-1.06x for all-reduce, and 0.98-1.02x for
// broadcast from 1 MiB (0.77x at 256 KiB), so the rule stands. Where
// rmem_max is below 4 MiB (Debian's default is 208 KiB), asking would get a clamped buffer with
// autotuning off, so we leave it alone.
size_t ConfiguredReceiveBuffer(int world_size) {
  static const size_t rmem_max = ReceiveBufferCap();
  return ReceiveBufferBytes(std::getenv("COLLECTIVES_SOCKET_RCVBUF"), rmem_max,
                            core::CoresFor(core::LocalRanks(world_size)));
}

// Whether a connected socket's peer is on this host: the kernel routes a connection to any of
// the host's own addresses through loopback and gives it that address as its source too.
bool PeerOnThisHost(const tcp::socket& socket) {
  asio::error_code local_error;
  asio::error_code remote_error;
  const auto local = socket.local_endpoint(local_error);
  const auto remote = socket.remote_endpoint(remote_error);
  if (local_error || remote_error) return false;
  return remote.address().is_loopback() || remote.address() == local.address();
}

// How long the listener gives one handshake: what the store gives a connection to prove the
// token (tcp_store.h). A stranger that connects and says nothing is closed after it rather than
// at the set-up deadline; a rank's handshake takes a few round trips.
constexpr std::chrono::seconds kServerHandshakeLimit{10};

using cluster::AfterAcceptFailure;
using cluster::NameLookups;
using cluster::RateLimitedLog;
using cluster::SpareDescriptor;

// Builds the mesh on its own io_context; the finished sockets are then moved to the fabric's.
// Used by one thread.
class MeshBuilder {
 public:
  MeshBuilder(int rank, int size, const TcpFabricOptions& options)
      : rank_(rank),
        size_(size),
        options_(options),
        start_(Clock::now()),
        // Capped (a year), so that a timeout of milliseconds::max() ("never") cannot overflow
        // the clock into a deadline already past.
        deadline_(std::min(start_ + cluster::ClampTimeout(options.timeout), options.deadline)),
        receive_buffer_(ConfiguredReceiveBuffer(size)),
        send_buffers_(SendBufferBytes(std::getenv("COLLECTIVES_SOCKET_SNDBUF"))),
        acceptor_(io_),
        sockets_(size),
        status_(size),
        addresses_(size),
        attempts_(size, 0) {
    config_.job_id = options.job_id;
    config_.token = options.token;
    config_.rank = rank;
    config_.world_size = size;
  }

  std::vector<std::optional<tcp::socket>>& Build(Store& store);

 private:
  std::string Prefix() const { return "rank " + std::to_string(rank_) + ": "; }
  // Binds the listener to options_.bind_host, looking a name up first.
  void Listen();
  // Runs the set-up's event loop until `done`, a failure, the deadline or the caller's
  // cancellation (which becomes failure_).
  void RunUntil(const std::function<bool()>& done);
  void ReadAddresses(Store& store);
  void AcceptNext();
  // On a failed accept: makes room (EvictOldestStranger, or the spare descriptor) and accepts
  // again, waits for the next connection, or retries shortly.
  void OnAcceptError(const asio::error_code& ec);
  // Cancels the server handshake that has waited longest, of those whose client has not proved
  // the token; false if none is in progress.
  bool EvictOldestStranger(const char* why);
  // Looks the peer's host up (unless it is an address) and connects to it (ConnectTo).
  void Connect(int peer);
  void ConnectTo(int peer, const tcp::endpoint& endpoint);
  void RetryConnect(int peer);
  void Admit(int peer, tcp::socket socket);
  [[noreturn]] void ThrowTimeout();

  const int rank_;
  const int size_;
  const TcpFabricOptions options_;
  const Clock::time_point start_;
  const Clock::time_point deadline_;
  HandshakeConfig config_;
  const size_t receive_buffer_;  // SO_RCVBUF of the data connections; 0: autotuning
  const SendBuffers send_buffers_;  // SO_SNDBUF of the data connections; 0: autotuning

  asio::io_context io_{1};  // declared before every socket and timer
  NameLookups lookups_{io_};
  tcp::acceptor acceptor_;
  std::vector<std::optional<tcp::socket>> sockets_;  // admitted, by peer rank
  std::vector<std::string> status_;                  // last news of each missing peer
  std::vector<HostPort> addresses_;
  std::vector<int> attempts_;
  std::vector<std::weak_ptr<HandshakeSession>> sessions_;
  std::vector<std::unique_ptr<asio::steady_timer>> timers_;
  size_t prune_sessions_at_ = 64;  // sessions_' size at which the finished ones are dropped
  // The server handshakes in progress, oldest first (and finished ones not yet dropped). At
  // most MaxServerHandshakes(): a new connection past it cancels the oldest, so that strangers
  // who connect and say nothing cannot hold every descriptor of the process while a rank waits
  // in the backlog; a rank whose handshake is cancelled sees a close and connects again.
  std::deque<std::weak_ptr<HandshakeSession>> server_handshakes_;
  // Two per rank that connects here (a retry may overlap a stale attempt) and 16 for strangers:
  // to cancel a rank's handshake, a stranger must open 16 connections within its round trips.
  size_t MaxServerHandshakes() const { return 2 * static_cast<size_t>(rank_) + 16; }
  SpareDescriptor spare_;
  std::string last_accept_error_;  // for ThrowTimeout
  RateLimitedLog accept_log_;
  RateLimitedLog eviction_log_;
  // Refused handshakes (strangers, a wrong token or job): a line a second at most, so that a
  // stranger who hammers the port cannot flood the log; Build ends with how many were left out.
  RateLimitedLog refusal_log_{[this](const std::string& text) {
    ++refusals_logged_;
    std::fwrite(text.data(), 1, text.size(), stderr);
  }};
  long refusals_ = 0;
  long refusals_logged_ = 0;
  std::optional<Error> failure_;
  int missing_ = 0;
};

void MeshBuilder::Listen() {
  asio::error_code ec;
  asio::ip::address address = asio::ip::make_address(options_.bind_host, ec);
  if (ec) {
    // A name, looked up as the peers' are (NameLookups): by the deadline, and cancellable.
    std::optional<asio::error_code> answer;
    lookups_.Resolve(options_.bind_host,
                     [&answer, &address](const asio::error_code& error,
                                         const tcp::resolver::results_type& found) {
                       answer = !error && found.empty() ? asio::error::host_not_found : error;
                       if (!*answer) address = found.begin()->endpoint().address();
                     });
    RunUntil([&answer] { return answer.has_value(); });  // past it, ~NameLookups drops the answer
    if (failure_) throw *failure_;
    if (!answer) {
      throw Error(ErrorCode::kTimeout, Prefix() + "timed out after " +
                                           std::to_string(options_.timeout.count()) +
                                           " ms setting up connections: the lookup of bind host '" +
                                           options_.bind_host + "' has not answered");
    }
    if (*answer) {
      throw Error(ErrorCode::kSystem, Prefix() + "cannot resolve bind host '" + options_.bind_host +
                                          "': " + answer->message());
    }
  }
  const tcp::endpoint endpoint(address, 0);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) cluster::SetCloseOnExec(acceptor_.native_handle());
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw Error(ErrorCode::kSystem,
                Prefix() + "cannot listen on " + options_.bind_host + ": " + ec.message());
  }
}

void MeshBuilder::RunUntil(const std::function<bool()>& done) {
  io_.restart();  // a run that ran out of work stopped the io_context
  while (!done() && !failure_ && Clock::now() < deadline_) {
    if (!options_.cancelled) {
      io_.run_one_until(deadline_);
    } else if (options_.cancelled()) {
      failure_.emplace(ErrorCode::kAborted, Prefix() + "set-up abandoned: its caller cancelled it");
    } else {
      io_.run_one_until(std::min(deadline_, Clock::now() + kCancelPoll));
    }
  }
}

void MeshBuilder::ReadAddresses(Store& store) {
  std::vector<int> unpublished;
  for (int peer = rank_ + 1; peer < size_; ++peer) {
    const std::string key = options_.key_prefix + "/addr/" + std::to_string(peer);
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    std::string value;
    try {
      value = store.Get(key, std::max(left, std::chrono::milliseconds(0)));
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kTimeout) throw;
      // Only the key's absence says the peer never published; any other timeout is the store's
      // own (a TCP store that did not answer), which the next peer's Get would meet again.
      if (!cluster::IsNotSet(error)) {
        throw Error(ErrorCode::kTimeout,
                    Prefix() + "timed out after " + std::to_string(options_.timeout.count()) +
                        " ms setting up connections: reading rank " + std::to_string(peer) +
                        "'s address from the store: " + error.message());
      }
      unpublished.push_back(peer);
      continue;
    }
    auto parsed = ParseHostPort(value);
    if (!parsed) {
      throw Error(ErrorCode::kInvalidArgument,
                  Prefix() + "rank " + std::to_string(peer) + " published a malformed address " +
                      cluster::QuoteKey(value) + " under '" + key + "'");
    }
    addresses_[peer] = *parsed;
  }
  if (!unpublished.empty()) {
    throw Error(ErrorCode::kTimeout,
                Prefix() + "timed out after " + std::to_string(options_.timeout.count()) +
                    " ms setting up connections: rank(s) " + JoinRanks(unpublished) +
                    " never published an address under '" + options_.key_prefix + "/addr/'");
  }
}

void MeshBuilder::AcceptNext() {
  acceptor_.async_accept([this](const asio::error_code& ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) return OnAcceptError(ec);
    cluster::SetCloseOnExec(socket.native_handle());
    asio::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    std::erase_if(server_handshakes_, [](const std::weak_ptr<HandshakeSession>& weak) {
      const auto session = weak.lock();
      return !session || session->finished();
    });
    if (server_handshakes_.size() >= MaxServerHandshakes()) {
      EvictOldestStranger("to make room for a new connection");
    }
    if (sessions_.size() >= prune_sessions_at_) {
      std::erase_if(sessions_,
                    [](const std::weak_ptr<HandshakeSession>& weak) { return weak.expired(); });
      prune_sessions_at_ = 2 * sessions_.size() + 64;
    }
    auto accept_rank = [this](int client) {
      return client < rank_ && client >= 0 && !sockets_[client].has_value();
    };
    auto session = HandshakeSession::StartServer(
        std::move(socket), config_, accept_rank,
        std::min(deadline_, Clock::now() + kServerHandshakeLimit),
        [this](const HandshakeResult& result, tcp::socket admitted) {
          if (result.ok) {
            return Admit(result.peer_rank, std::move(admitted));
          }
          if (result.code != ErrorCode::kAborted) {
            ++refusals_;
            refusal_log_.Write("rank " + std::to_string(rank_) + " refused a connection from " +
                               result.remote + ": " + result.why);
          }
          // keep accepting
        });
    server_handshakes_.push_back(session);
    sessions_.push_back(std::move(session));
    AcceptNext();
  });
}

void MeshBuilder::OnAcceptError(const asio::error_code& ec) {
  last_accept_error_ = ec.message();
  accept_log_.Write(Prefix() + "accepting a connection failed: " + ec.message());
  switch (cluster::DecideAfterAcceptFailure(
      ec, acceptor_.native_handle(), [this] { return EvictOldestStranger("out of descriptors"); },
      spare_)) {
    case AfterAcceptFailure::kAcceptAgain:
      return AcceptNext();
    case AfterAcceptFailure::kWaitForConnection:
      acceptor_.async_wait(tcp::acceptor::wait_read, [this](const asio::error_code& wait_ec) {
        if (!wait_ec && acceptor_.is_open()) AcceptNext();
      });
      return;
    case AfterAcceptFailure::kRetryShortly: {
      auto timer = std::make_unique<asio::steady_timer>(io_, cluster::kAcceptRetryDelay);
      timer->async_wait([this](const asio::error_code& timer_ec) {
        if (!timer_ec) AcceptNext();
      });
      timers_.push_back(std::move(timer));
      return;
    }
  }
}

bool MeshBuilder::EvictOldestStranger(const char* why) {
  for (auto it = server_handshakes_.begin(); it != server_handshakes_.end();) {
    const auto session = it->lock();
    if (!session || session->finished()) {
      it = server_handshakes_.erase(it);
      continue;
    }
    // A client that proved the token is a rank, whose handshake ends with its next message. It
    // is not cancelled: it would take the connection for made (its side of the handshake is
    // over), and the mesh would lose it.
    if (session->proven()) {
      ++it;
      continue;
    }
    server_handshakes_.erase(it);
    session->Cancel();  // closes its socket now; its `done` runs later with kAborted
    eviction_log_.Write(Prefix() + "closed the oldest of the connections still in their " +
                        "handshake (" + why + ")");
    return true;
  }
  return false;
}

void MeshBuilder::Connect(int peer) {
  ++attempts_[peer];
  const HostPort& address = addresses_[peer];
  asio::error_code ec;
  const auto numeric = asio::ip::make_address(address.host, ec);
  if (!ec) return ConnectTo(peer, tcp::endpoint(numeric, address.port));
  status_[peer] = "the lookup of host " + address.host + " has not answered";
  lookups_.Resolve(address.host, [this, peer](const asio::error_code& error,
                                              const tcp::resolver::results_type& results) {
    const HostPort& looked_up = addresses_[peer];
    if (error || results.empty()) {
      status_[peer] = "cannot resolve " + looked_up.host + ": " + error.message();
      RetryConnect(peer);
      return;
    }
    // A name may resolve to several addresses, of which the listener may take only some (a rank
    // that listens on "0.0.0.0" gives its host name, whose first address may be an IPv6 one):
    // each attempt takes the next address, so that every one is tried.
    auto entry = results.begin();
    std::advance(entry, static_cast<size_t>(attempts_[peer] - 1) % results.size());
    ConnectTo(peer, tcp::endpoint(entry->endpoint().address(), looked_up.port));
  });
}

void MeshBuilder::ConnectTo(int peer, const tcp::endpoint& endpoint) {
  asio::error_code ec;
  // Opened close-on-exec (async_connect would open it without): a process this one spawns must
  // not hold the connection open, or the peer would not see this rank die (a timeout where a
  // lost peer should be raised at once).
  auto socket = std::make_shared<tcp::socket>(io_);
  const int fd = ::socket(endpoint.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
  if (fd < 0) {
    status_[peer] = std::string("socket: ") + std::strerror(errno);
    RetryConnect(peer);
    return;
  }
  socket->assign(endpoint.protocol(), fd, ec);
  if (ec) {
    ::close(fd);
    status_[peer] = "socket: " + ec.message();
    RetryConnect(peer);
    return;
  }
  socket->async_connect(endpoint, [this, peer, socket, endpoint](const asio::error_code& error) {
    const std::string where = FormatHostPort(endpoint.address().to_string(), endpoint.port());
    if (error) {
      status_[peer] = "connect to " + where + ": " + error.message();
      RetryConnect(peer);
      return;
    }
    asio::error_code ignored;
    socket->set_option(tcp::no_delay(true), ignored);
    status_[peer] = "handshake with " + where + " not finished";
    sessions_.push_back(HandshakeSession::StartClient(
        std::move(*socket), config_, peer, deadline_,
        [this, peer, where](const HandshakeResult& result, tcp::socket connected) {
          if (result.ok) return Admit(peer, std::move(connected));
          if (result.code == ErrorCode::kTimeout || result.code == ErrorCode::kAborted) {
            status_[peer] = "handshake with " + where + ": " + result.why;
            return;
          }
          if (result.code == ErrorCode::kPeerLost) {
            // Closed without a refusal: the peer stopped, gave up, or cancelled this handshake
            // to make room. Like a refused connect: try again until the deadline.
            status_[peer] = "handshake with " + where + ": " + result.why;
            RetryConnect(peer);
            return;
          }
          if (!failure_) {
            failure_.emplace(result.code, Prefix() + "handshake with rank " + std::to_string(peer) +
                                              " at " + where + " failed: " + result.why);
          }
        }));
  });
}

void MeshBuilder::RetryConnect(int peer) {
  // Back off 2, 4, 8 ... ms, at most 128 ms, never past the deadline.
  const auto delay = std::chrono::milliseconds(1 << std::min(attempts_[peer], 7));
  const auto when = std::min(Clock::now() + delay, deadline_);
  if (when >= deadline_) return;
  auto timer = std::make_unique<asio::steady_timer>(io_, when);
  timer->async_wait([this, peer](const asio::error_code& ec) {
    if (!ec) Connect(peer);
  });
  timers_.push_back(std::move(timer));
}

void MeshBuilder::Admit(int peer, tcp::socket socket) {
  if (sockets_[peer].has_value()) {
    std::cerr << "collectives: rank " + std::to_string(rank_) +
                     " dropped a second connection claiming rank " + std::to_string(peer) + "\n";
    return;
  }
  if (receive_buffer_ > 0) {
    asio::error_code ignored;  // a refused size leaves autotuning on, which still works
    socket.set_option(asio::socket_base::receive_buffer_size(static_cast<int>(receive_buffer_)),
                      ignored);
  }
  if (const size_t send_buffer =
          PeerOnThisHost(socket) ? send_buffers_.same_host : send_buffers_.other_host;
      send_buffer > 0) {
    asio::error_code ignored;  // likewise
    socket.set_option(asio::socket_base::send_buffer_size(static_cast<int>(send_buffer)), ignored);
  }
  sockets_[peer].emplace(std::move(socket));
  --missing_;
}

void MeshBuilder::ThrowTimeout() {
  std::string message = Prefix() + "timed out after " + std::to_string(options_.timeout.count()) +
                        " ms setting up connections: still missing ";
  bool first = true;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_ || sockets_[peer].has_value()) continue;
    if (!first) message += ", ";
    first = false;
    message += "rank " + std::to_string(peer) + " (";
    if (!status_[peer].empty()) {
      message += status_[peer];
    } else if (peer < rank_) {
      message += "it never completed a connection to this rank";
    } else {
      message += "no attempt finished";
    }
    message += ")";
  }
  if (!last_accept_error_.empty()) {
    message +=
        "; this rank's listener last failed to accept a connection with: " + last_accept_error_;
  }
  throw Error(ErrorCode::kTimeout, message);
}

std::vector<std::optional<tcp::socket>>& MeshBuilder::Build(Store& store) {
  Listen();
  const auto port = acceptor_.local_endpoint().port();
  std::string host = options_.bind_host;
  asio::error_code ec;
  const auto bind_address = asio::ip::make_address(host, ec);
  if (!ec && bind_address.is_unspecified()) host = asio::ip::host_name();
  store.Set(options_.key_prefix + "/addr/" + std::to_string(rank_), FormatHostPort(host, port));
  ReadAddresses(store);

  missing_ = size_ - 1;
  if (rank_ > 0) AcceptNext();
  for (int peer = rank_ + 1; peer < size_; ++peer) Connect(peer);
  RunUntil([this] { return missing_ == 0; });

  // Stop what is still going on (strangers' handshakes, retries, lookups) before leaving.
  lookups_.Close();
  acceptor_.close(ec);
  for (auto& weak : sessions_) {
    if (auto session = weak.lock()) session->Cancel();
  }
  for (auto& timer : timers_) timer->cancel();
  io_.restart();
  io_.poll();
  if (refusals_ > refusals_logged_) {
    const std::string line = "collectives: rank " + std::to_string(rank_) + " refused " +
                             std::to_string(refusals_) + " connections in its set-up, " +
                             std::to_string(refusals_ - refusals_logged_) +
                             " of them not logged above\n";
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
  if (failure_) throw *failure_;
  if (missing_ > 0) ThrowTimeout();
  return sockets_;
}

}  // namespace

std::unique_ptr<Fabric> ConnectTcpFabric(int rank, int size, Store& store,
                                         const TcpFabricOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw Error(
        ErrorCode::kInvalidArgument,
        "rank " + std::to_string(rank) + " is not in a world of size " + std::to_string(size));
  }
  if (options.job_id.size() > kMaxJobIdBytes) {
    throw Error(ErrorCode::kInvalidArgument, "job id '" + options.job_id + "' is longer than " +
                                                 std::to_string(kMaxJobIdBytes) + " bytes");
  }
  std::vector<std::optional<tcp::socket>> none;
  if (size == 1) {
    return std::make_unique<TcpFabric>(rank, size, none);
  }
  MeshBuilder builder(rank, size, options);
  return std::make_unique<TcpFabric>(rank, size, builder.Build(store));
}

std::optional<std::string> LocalAddressToward(const std::string& remote_host,
                                              Clock::time_point deadline) {
  asio::io_context io;
  asio::error_code ec;
  std::vector<asio::ip::address> addresses;
  if (const auto address = asio::ip::make_address(remote_host, ec); !ec) {
    addresses.push_back(address);
  } else {
    // A name server that does not answer cannot hold the caller past its deadline.
    const auto results = cluster::LookUpBy(remote_host, deadline);
    if (!results) return std::nullopt;
    for (const auto& entry : *results) addresses.push_back(entry.endpoint().address());
  }
  for (const auto& address : addresses) {
    if (address.is_loopback()) return remote_host;
    const asio::ip::udp::endpoint endpoint(address, 9);
    asio::ip::udp::socket socket(io);
    socket.open(endpoint.protocol(), ec);
    if (ec) continue;
    socket.connect(endpoint, ec);  // no packet is sent: only the route is chosen
    if (ec) continue;
    const auto local = socket.local_endpoint(ec);
    if (ec) continue;
    if (local.address() == address) return remote_host;  // the remote host is this host
    return local.address().to_string();
  }
  return "127.0.0.1";
}

namespace {

// A byte count from a file under /proc/sys; 0 when it cannot be read.
size_t ProcSysBytes(const char* path) {
  size_t value = 0;
  if (FILE* file = std::fopen(path, "r")) {
    unsigned long long read = 0;
    if (std::fscanf(file, "%llu", &read) == 1) value = static_cast<size_t>(read);
    std::fclose(file);
  }
  return value;
}

}  // namespace

size_t ReceiveBufferCap() { return ProcSysBytes("/proc/sys/net/core/rmem_max"); }

size_t SendBufferCap() { return ProcSysBytes("/proc/sys/net/core/wmem_max"); }

size_t ReceiveBufferBytes(const char* env, size_t rmem_max, bool core_per_rank) {
  if (const auto bytes = core::CountFromText("COLLECTIVES_SOCKET_RCVBUF", env,
                                             "a byte count, 0 for the kernel's autotuning")) {
    return static_cast<size_t>(std::min<uint64_t>(*bytes, INT_MAX));
  }
  return core_per_rank && rmem_max >= kDefaultReceiveBuffer ? kDefaultReceiveBuffer : 0;
}

// The data connections' send buffer. A connection to a peer on this host goes through loopback,
// where a segment is handed to the receiving socket by reference: the pages the sender's
// sendmsg copied into stay in use until the receiver has read them. Left to autotuning, the
// send buffer grows to net.ipv4.tcp_wmem's maximum (4 MiB here), so a sender runs megabytes
// ahead, every copy goes into a fresh page, and the receiver reads them after they have left
// the cache. Capped, the sender stays a few hundred KiB ahead and the pages come back while
// they are still warm. On the development VM (2 cores), `perf record -a` over 300 2-rank
// all-gathers of 16 MiB with a 256 KiB cap: 25% fewer samples in the send copy, 40% fewer in
// the receive copy and 80% fewer in the wake-up path, 3.68 -> 2.31 ms per call.
// The size: the kernel doubles what is asked, and the buffer should hold one whole frame of the
// default 512 KiB chunk, or every such frame goes out in two sendmsg calls with a wait for room
// between them: with 256 KiB, `strace -c` counted 4077 sendmsg and 4573 epoll_wait on a rank
// over 2000 2-rank all-gathers of 1 MiB, against 2009 and 3114 uncapped; 288 KiB and up, 2009
// and about 3100. Our time with the cap over our time without, medians of 6 alternating sweeps
// of `collectives_perf --inplace -r 3` (all-reduce, broadcast, all-gather, 256 KiB-64 MiB):
//   320 KiB: 4-64 MiB, 2 ranks: all-gather 0.70-0.79, all-reduce 0.70-0.94, broadcast
//            0.94-1.17; 4 ranks: 0.63-0.80. 1 MiB and below: 0.55-1.19.
//   256 KiB: the same or worse (2-rank all-gather of 256 KiB-4 MiB 1.03-1.37); in three more
//            sets of 6-8 sweeps, 4-64 MiB took 0.57-1.13 (2 ranks) and 0.61-0.82 (4 ranks).
//   128, 384, 512, 768 KiB and 1 MiB (sets of 6): none better overall; 384 and 512 KiB within
//            the noise of 256 KiB, 128 KiB slower at 1-4 MiB, 768 KiB and 1 MiB gave up most
//            of the gain at 16-64 MiB.
// Between hosts the buffer must hold the link's bandwidth-delay product, which autotuning
// follows, so those connections keep it. Where net.core.wmem_max is lower (Debian's default
// is 208 KiB) the kernel clamps the request to it: still a cap, and a 512 KiB frame then takes
// two sendmsg calls, but asking for 208 KiB here (what the clamp leaves) was within the noise
// of 320 KiB (6 alternating sweeps, 1-16 MiB, 2 and 4 ranks: 0.89-1.28 both ways).
// The cap is not sized to chunk_bytes: with 2 MiB chunks, a buffer that holds a whole frame
// (1088 KiB asked) took 1.02-1.44x the time of 320 KiB for 2-rank all-reduces and all-gathers
// (broadcasts 0.96-1.10x) and 1.18-1.69x for everything at 4 ranks, about as slow as
// autotuning (3 alternating sweeps, 4-64 MiB): staying close behind the receiver matters more
// than one sendmsg per frame.
SendBuffers SendBufferBytes(const char* env) {
  if (const auto bytes = core::CountFromText("COLLECTIVES_SOCKET_SNDBUF", env,
                                             "a byte count, 0 for the kernel's autotuning")) {
    const size_t value = static_cast<size_t>(std::min<uint64_t>(*bytes, INT_MAX));
    return SendBuffers{value, value};
  }
  return SendBuffers{kDefaultLocalSendBuffer, 0};
}

}  // namespace collectives::transport
