// The in-process fabric: every rank owns an inbox (one mutex, one condition variable, one
// queue of frames per source rank). A send copies the payload into the destination's inbox and
// completes at once; a receive is matched, in posted order, against the frames of its source
// when it is waited on or tested, with the same tag and size checks (and messages) as TCP; a
// frame first in its queue that names another call of the running call's number (SetCall)
// breaks the fabric then too.
//
// Failure is modelled after TCP: destroying a fabric marks it gone in every peer's inbox (a
// closed socket: the frames it already sent stay readable, a receive beyond them raises
// kPeerLost); breaking a fabric (Abort, or an error found here) puts an abort into every
// peer's inbox, which breaks that peer at its next call, or wakes it if it waits.
//
// Locking: a thread holds at most one inbox mutex at a time.
#include "src/transport/inproc_fabric.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "src/transport/fabric_errors.h"
#include "src/transport/frame.h"

namespace collectives::transport {
namespace {

struct InboxFrame {
  core::CallTag tag;
  std::vector<uint8_t> payload;
};

// What other ranks deliver to one rank.
struct Inbox {
  explicit Inbox(int size) : queues(size), source_gone(size, false) {}

  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::deque<InboxFrame>> queues;  // by source rank
  std::vector<bool> source_gone;               // by source rank: its fabric was destroyed
  std::optional<AbortPayload> abort;           // the first abort a peer delivered
  bool owner_gone = false;                     // this inbox's rank destroyed its fabric
  // The owner's fabric state, guarded by mu as well (Abort may come from any thread).
  std::optional<Error> error;
  bool aborts_delivered = false;
};

struct Group {
  explicit Group(int size) {
    for (int i = 0; i < size; ++i) inboxes.push_back(std::make_unique<Inbox>(size));
  }
  std::vector<std::unique_ptr<Inbox>> inboxes;
};

class InProcFabric;

// Thread-safety: used by the thread driving its fabric.
class InProcConnection final : public Connection {
 public:
  InProcConnection(InProcFabric* fabric, int peer) : fabric_(fabric), peer_(peer) {}

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

 private:
  friend class InProcFabric;
  struct RecvOp {
    core::CallTag tag;
    uint8_t* data = nullptr;
    size_t bytes = 0;
    const core::Runs* runs = nullptr;  // with `offset`: where the payload goes, if not `data`
    size_t offset = 0;
  };
  // Throws the fabric's error if it is broken.
  void ThrowIfBroken();
  // Puts a frame into the peer's inbox.
  uint64_t Send(const core::CallTag& tag, std::vector<uint8_t> payload);
  uint64_t Recv(RecvOp op);

  InProcFabric* const fabric_;
  const int peer_;
  uint64_t sends_posted_ = 0;
  uint64_t recvs_posted_ = 0;
  uint64_t recvs_done_ = 0;
  std::deque<RecvOp> recvs_;  // posted, not completed
};

// Thread-safety: see connection.h; the fabric's state is guarded by its inbox's mutex.
class InProcFabric final : public Fabric {
 public:
  InProcFabric(std::shared_ptr<Group> group, int rank, int size)
      : group_(std::move(group)), rank_(rank), size_(size), inbox_(*group_->inboxes[rank]) {
    connections_.resize(size);
    for (int peer = 0; peer < size; ++peer) {
      if (peer != rank) connections_[peer] = std::make_unique<InProcConnection>(this, peer);
    }
  }

  ~InProcFabric() override {
    DeliverAbortsIfBroken();
    // A fabric broken by an abort it received passes that abort on as it goes, so that a peer
    // waiting on it learns the real cause rather than "destroyed" (as a TCP rank's abort frame
    // arrives before its EOF). The relay goes out before this inbox is marked gone: a peer that
    // finds it gone (a send to it) then reads its own inbox, and must find the abort there (the
    // rank that aborted may still be delivering to the others, and a peer that read "destroyed"
    // first would name the wrong cause).
    std::optional<AbortPayload> relay;
    {
      std::lock_guard<std::mutex> lock(inbox_.mu);
      if (inbox_.error && inbox_.abort) relay = inbox_.abort;
    }
    if (relay) GiveAbortToPeers(*relay);
    {
      std::lock_guard<std::mutex> lock(inbox_.mu);
      inbox_.owner_gone = true;
    }
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      Inbox& inbox = *group_->inboxes[peer];
      std::lock_guard<std::mutex> lock(inbox.mu);
      inbox.source_gone[rank_] = true;
      inbox.cv.notify_all();
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Connection& connection(int peer) override {
    if (peer < 0 || peer >= size_ || peer == rank_) {
      throw Error(ErrorCode::kInvalidArgument,
                  "rank " + std::to_string(rank_) + ": no connection to rank " +
                      std::to_string(peer) + " in a fabric of " + std::to_string(size_));
    }
    return *connections_[peer];
  }

  void SetDeadline(Clock::time_point deadline) override {
    std::lock_guard<std::mutex> lock(inbox_.mu);
    deadline_ = deadline;
  }

  void SetCall(const core::CallTag& call) override {
    std::unique_lock<std::mutex> lock(inbox_.mu);
    call_ = call;
    if (BrokenLocked()) return;  // raised by the call's first wait
    CheckHeldLocked();
    if (BrokenLocked()) Throw(lock);  // as TcpFabric::SetCall
  }

  void SetSpin(std::chrono::microseconds, std::chrono::microseconds) override {
  }  // nothing to poll: waits sleep at once

  void Abort(const Error& error) override {
    {
      std::lock_guard<std::mutex> lock(inbox_.mu);
      if (!inbox_.error) inbox_.error.emplace(error);
      inbox_.cv.notify_all();
    }
    DeliverAbortsIfBroken();
  }

 private:
  friend class InProcConnection;

  // Under inbox_.mu: whether the fabric is broken, adopting a delivered abort as its error.
  bool BrokenLocked() {
    if (!inbox_.error && inbox_.abort) {
      inbox_.error.emplace(AbortReceivedError(rank_, *inbox_.abort));
      inbox_.aborts_delivered = true;  // the culprit told every rank itself
    }
    return inbox_.error.has_value();
  }

  // Records `error` (first wins). Under inbox_.mu.
  void BreakLocked(const Error& error) {
    if (!inbox_.error) inbox_.error.emplace(error);
  }

  // Throws the fabric's error after telling the peers. Takes and releases `lock`.
  [[noreturn]] void Throw(std::unique_lock<std::mutex>& lock) {
    Error error = *inbox_.error;
    lock.unlock();
    DeliverAbortsIfBroken();
    throw error;
  }

  // Puts an abort into every peer's inbox, once, if this fabric is broken by its own error.
  void DeliverAbortsIfBroken() {
    AbortPayload payload;
    {
      std::lock_guard<std::mutex> lock(inbox_.mu);
      if (!inbox_.error || inbox_.aborts_delivered) return;
      inbox_.aborts_delivered = true;
      payload = AbortPayloadFor(rank_, *inbox_.error);
    }
    GiveAbortToPeers(payload);
  }

  // Puts `payload` into every peer's inbox that holds no abort yet, and wakes its waiters.
  void GiveAbortToPeers(const AbortPayload& payload) {
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      Inbox& inbox = *group_->inboxes[peer];
      std::lock_guard<std::mutex> lock(inbox.mu);
      if (!inbox.abort) inbox.abort = payload;
      inbox.cv.notify_all();
    }
  }

  // Under inbox_.mu: the frame first in a source's queue, with no receive posted on its
  // connection, of the running call's number but another call breaks the fabric (SetCall), as
  // its header does over TCP.
  void CheckHeldLocked() {
    if (BrokenLocked()) return;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_ || !connections_[peer]->recvs_.empty()) continue;
      const std::deque<InboxFrame>& queue = inbox_.queues[peer];
      if (queue.empty()) continue;
      if (auto error = CallMismatchError(rank_, peer, call_, queue.front().tag,
                                         queue.front().payload.size())) {
        BreakLocked(*error);
        return;
      }
    }
  }

  // Under inbox_.mu: completes the receives of `connection` that can be completed; may break.
  // Nothing is matched once the fabric is broken (an Abort from another thread, say), so a frame
  // that arrives after that is not written into the caller's buffer, as over TCP.
  void MatchLocked(InProcConnection& connection) {
    if (BrokenLocked()) return;
    auto& queue = inbox_.queues[connection.peer_];
    while (!connection.recvs_.empty() && !queue.empty()) {
      const InProcConnection::RecvOp& op = connection.recvs_.front();
      InboxFrame& frame = queue.front();
      if (frame.tag != op.tag || frame.payload.size() != op.bytes) {
        BreakLocked(MismatchError(rank_, connection.peer_, op.tag, op.bytes, frame.tag,
                                  frame.payload.size()));
        return;
      }
      if (op.runs != nullptr) {
        op.runs->Write(op.offset, frame.payload.data(), op.bytes);
      } else if (op.bytes > 0) {
        std::memcpy(op.data, frame.payload.data(), op.bytes);
      }
      queue.pop_front();
      connection.recvs_.pop_front();
      ++connection.recvs_done_;
    }
    if (!connection.recvs_.empty() && queue.empty() && inbox_.source_gone[connection.peer_] &&
        !BrokenLocked()) {
      BreakLocked(PeerLostError(rank_, connection.peer_, "its fabric was destroyed",
                                &connection.recvs_.front().tag, false));
    }
  }

  std::shared_ptr<Group> group_;
  const int rank_;
  const int size_;
  Inbox& inbox_;
  std::vector<std::unique_ptr<InProcConnection>> connections_;
  Clock::time_point deadline_ = Clock::time_point::max();  // guarded by inbox_.mu
  std::optional<core::CallTag> call_;                      // guarded by inbox_.mu
};

void InProcConnection::ThrowIfBroken() {
  std::unique_lock<std::mutex> lock(fabric_->inbox_.mu);
  if (fabric_->BrokenLocked()) fabric_->Throw(lock);
}

uint64_t InProcConnection::PostSend(const core::CallTag& tag, const void* data, size_t bytes) {
  ThrowIfBroken();
  if (data == nullptr && bytes > 0) {
    throw NullBufferError(fabric_->rank_, peer_, bytes, /*sending=*/true);
  }
  const auto* begin = static_cast<const uint8_t*>(data);
  std::vector<uint8_t> payload;
  if (bytes > 0) payload.assign(begin, begin + bytes);
  return Send(tag, std::move(payload));
}

uint64_t InProcConnection::PostSend(const core::CallTag& tag, const core::Runs& runs, size_t offset,
                                    size_t bytes) {
  ThrowIfBroken();
  if (auto error = RunsMisuseError(fabric_->rank_, peer_, runs, offset, bytes, /*sending=*/true)) {
    throw *error;
  }
  std::vector<uint8_t> payload(bytes);
  runs.Read(offset, bytes, payload.data());
  return Send(tag, std::move(payload));
}

uint64_t InProcConnection::Send(const core::CallTag& tag, std::vector<uint8_t> payload) {
  InProcFabric& fabric = *fabric_;
  InboxFrame frame;
  frame.tag = tag;
  frame.payload = std::move(payload);
  bool delivered = false;
  {
    Inbox& inbox = *fabric.group_->inboxes[peer_];
    std::lock_guard<std::mutex> lock(inbox.mu);
    if (!inbox.owner_gone) {
      inbox.queues[fabric.rank_].push_back(std::move(frame));
      inbox.cv.notify_all();
      delivered = true;
    }
  }
  const uint64_t ticket = ++sends_posted_;
  if (!delivered) {
    std::unique_lock<std::mutex> lock(fabric.inbox_.mu);
    if (!fabric.BrokenLocked()) {
      fabric.BreakLocked(
          PeerLostError(fabric.rank_, peer_, "its fabric was destroyed", &tag, true));
    }
    fabric.Throw(lock);
  }
  return ticket;
}

uint64_t InProcConnection::PostRecv(const core::CallTag& tag, void* data, size_t bytes) {
  if (data == nullptr && bytes > 0) {
    ThrowIfBroken();
    throw NullBufferError(fabric_->rank_, peer_, bytes, /*sending=*/false);
  }
  return Recv(RecvOp{tag, static_cast<uint8_t*>(data), bytes});
}

uint64_t InProcConnection::PostRecv(const core::CallTag& tag, const core::Runs& runs, size_t offset,
                                    size_t bytes) {
  if (auto error = RunsMisuseError(fabric_->rank_, peer_, runs, offset, bytes, /*sending=*/false)) {
    ThrowIfBroken();
    throw *error;
  }
  return Recv(RecvOp{tag, nullptr, bytes, &runs, offset});
}

uint64_t InProcConnection::Recv(RecvOp op) {
  InProcFabric& fabric = *fabric_;
  std::unique_lock<std::mutex> lock(fabric.inbox_.mu);
  if (fabric.BrokenLocked()) fabric.Throw(lock);
  recvs_.push_back(op);
  return ++recvs_posted_;
}

void InProcConnection::WaitSend(uint64_t ticket) {
  InProcFabric& fabric = *fabric_;
  std::unique_lock<std::mutex> lock(fabric.inbox_.mu);
  if (fabric.BrokenLocked()) fabric.Throw(lock);
  if (ticket > sends_posted_) {
    throw Error(ErrorCode::kInvalidUsage, "rank " + std::to_string(fabric.rank_) + ": WaitSend(" +
                                              std::to_string(ticket) + ") to rank " +
                                              std::to_string(peer_) + ", but only " +
                                              std::to_string(sends_posted_) + " sends were posted");
  }
  // Sends complete when posted.
}

bool InProcConnection::TestSend(uint64_t ticket) {
  WaitSend(ticket);
  return true;
}

void InProcConnection::WaitRecv(uint64_t ticket) {
  InProcFabric& fabric = *fabric_;
  std::unique_lock<std::mutex> lock(fabric.inbox_.mu);
  if (fabric.BrokenLocked()) fabric.Throw(lock);
  if (ticket > recvs_posted_) {
    throw Error(ErrorCode::kInvalidUsage,
                "rank " + std::to_string(fabric.rank_) + ": WaitRecv(" + std::to_string(ticket) +
                    ") from rank " + std::to_string(peer_) + ", but only " +
                    std::to_string(recvs_posted_) + " receives were posted");
  }
  for (;;) {
    fabric.MatchLocked(*this);
    fabric.CheckHeldLocked();
    if (fabric.BrokenLocked()) fabric.Throw(lock);
    if (recvs_done_ >= ticket) return;
    if (Clock::now() >= fabric.deadline_) {
      const RecvOp& op = recvs_.front();
      fabric.BreakLocked(TimeoutError(fabric.rank_, peer_, op.tag, op.bytes, false));
      fabric.Throw(lock);
    }
    fabric.inbox_.cv.wait_until(lock, fabric.deadline_);
  }
}

bool InProcConnection::TestRecv(uint64_t ticket) {
  InProcFabric& fabric = *fabric_;
  std::unique_lock<std::mutex> lock(fabric.inbox_.mu);
  if (fabric.BrokenLocked()) fabric.Throw(lock);
  if (ticket > recvs_posted_) {
    throw Error(ErrorCode::kInvalidUsage,
                "rank " + std::to_string(fabric.rank_) + ": TestRecv(" + std::to_string(ticket) +
                    ") from rank " + std::to_string(peer_) + ", but only " +
                    std::to_string(recvs_posted_) + " receives were posted");
  }
  fabric.MatchLocked(*this);
  fabric.CheckHeldLocked();
  if (fabric.BrokenLocked()) fabric.Throw(lock);
  if (recvs_done_ >= ticket) return true;
  if (Clock::now() >= fabric.deadline_) {
    const RecvOp& op = recvs_.front();
    fabric.BreakLocked(TimeoutError(fabric.rank_, peer_, op.tag, op.bytes, false));
    fabric.Throw(lock);
  }
  return false;
}

}  // namespace

std::vector<std::unique_ptr<Fabric>> CreateInProcessFabrics(int size) {
  if (size < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                "an in-process fabric needs at least one rank, not " + std::to_string(size));
  }
  auto group = std::make_shared<Group>(size);
  std::vector<std::unique_ptr<Fabric>> fabrics;
  for (int rank = 0; rank < size; ++rank) {
    fabrics.push_back(std::make_unique<InProcFabric>(group, rank, size));
  }
  return fabrics;
}

}  // namespace collectives::transport
