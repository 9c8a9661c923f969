#include "staging_reduce.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

namespace fthsdp {
namespace {

uint64_t load_acquire(const volatile uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
uint32_t load_acquire(const volatile uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store_release(volatile uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
void store_release(volatile uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

constexpr size_t kSlotAlign = 256;

}  // namespace

HostBlock::HostBlock(const FthsdpAllocator& alloc, size_t bytes, const char* what) : alloc_(alloc), n_(bytes) {
  p_ = static_cast<char*>(alloc_.alloc(bytes, alloc_.user));
  if (!p_) {
    throw std::runtime_error("ftar staging: could not allocate " + std::to_string(bytes) + " bytes of " + what);
  }
}

HostBlock::~HostBlock() { reset(); }

HostBlock::HostBlock(HostBlock&& o) noexcept : alloc_(o.alloc_), p_(o.p_), n_(o.n_) {
  o.p_ = nullptr;
  o.n_ = 0;
}

HostBlock& HostBlock::operator=(HostBlock&& o) noexcept {
  if (this != &o) {
    reset();
    alloc_ = o.alloc_;
    p_ = o.p_;
    n_ = o.n_;
    o.p_ = nullptr;
    o.n_ = 0;
  }
  return *this;
}

void HostBlock::reset() {
  if (p_) alloc_.release(p_, alloc_.user);
  p_ = nullptr;
  n_ = 0;
}

uint64_t reduce_job_key(uint32_t seq, int64_t job) {
  return (static_cast<uint64_t>(seq) << 32) | static_cast<uint64_t>(static_cast<uint32_t>(job + 1));
}

int32_t reduce_slots_for(int32_t chunks) {
  return std::clamp<int32_t>(2 * std::max<int32_t>(1, chunks), 2, FTHSDP_REDUCE_SLOTS);
}

void ReduceSlots::reset(int32_t slots) {
  state_.assign(static_cast<size_t>(std::clamp<int32_t>(slots, 1, FTHSDP_REDUCE_SLOTS)), Slot::kFree);
  jobs_.clear();
  next_job_ = 0;
}

int32_t ReduceSlots::acquire() {
  for (size_t i = 0; i < state_.size(); ++i) {
    if (state_[i] == Slot::kFree) {
      state_[i] = Slot::kAcquired;
      return static_cast<int32_t>(i);
    }
  }
  return -1;
}

int64_t ReduceSlots::post(int32_t slot, int32_t lane) {
  if (slot < 0 || slot >= slots() || state_[slot] != Slot::kAcquired) return -1;
  state_[slot] = Slot::kPosted;
  jobs_.push_back(Job{slot, lane});
  return next_job_++;
}

int32_t ReduceSlots::finish_oldest() {
  const Job j = jobs_.front();
  jobs_.pop_front();
  state_[j.slot] = Slot::kFree;
  return j.lane;
}

int32_t ReduceSlots::slot_of(int64_t job) const {
  return jobs_[static_cast<size_t>(job - oldest())].slot;
}

DeviceReducer::DeviceReducer(FthsdpStagingControl* control, const FthsdpAllocator& alloc)
    : c_(control), alloc_(alloc) {
  slots_.reset(1);
  watcher_ = std::thread([this] { watch(); });
}

DeviceReducer::~DeviceReducer() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  watcher_.join();
}

void DeviceReducer::begin(uint32_t seq, int32_t slots, size_t slot_bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  slot_bytes = (std::max<size_t>(slot_bytes, 1) + kSlotAlign - 1) & ~(kSlotAlign - 1);
  slots = std::clamp<int32_t>(slots, 1, FTHSDP_REDUCE_SLOTS);
  const size_t need = slot_bytes * static_cast<size_t>(slots);
  if (need > arena_.size()) {
    // No worker of an earlier op runs any more (the stream passed its end
    // before this op's args were raised), so the old slots can go.
    arena_ = HostBlock();
    arena_ = HostBlock(alloc_, need, "pinned receive slots");
  }
  slot_bytes_ = slot_bytes;
  slots_.reset(slots);
  seq_ = seq;
  ++generation_;
  watched_ = 0;
  wake_ = nullptr;
}

void DeviceReducer::target(char* host, uint64_t device_in, DType dtype) {
  std::lock_guard<std::mutex> lk(mu_);
  host_ = host;
  device_in_ = device_in;
  dtype_ = dtype;
}

void DeviceReducer::stop(uint32_t seq) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++generation_;  // the watcher stops waiting for jobs a stopped worker leaves undone
    watched_ = slots_.posted();
    wake_ = nullptr;
  }
  store_release(&c_->reduce_stop, seq);
}

void DeviceReducer::set_waker(std::function<void()> wake) {
  std::lock_guard<std::mutex> lk(mu_);
  wake_ = std::move(wake);
}

char* DeviceReducer::acquire(size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (bytes > slot_bytes_) return nullptr;  // cannot happen: slots are one chunk each
  const int32_t s = slots_.acquire();
  return s < 0 ? nullptr : arena_.get() + static_cast<size_t>(s) * slot_bytes_;
}

void DeviceReducer::post(char* slot, int32_t lane, int64_t offset, int64_t count) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    const int32_t s = static_cast<int32_t>((slot - arena_.get()) / static_cast<ptrdiff_t>(slot_bytes_));
    const int64_t job = slots_.post(s, lane);
    if (job < 0) return;  // not a slot of ours: drain() would never report it; the deadline fails the op
    const size_t elem = dtype_size(dtype_);
    FthsdpReduceJob& j = c_->jobs[job % FTHSDP_REDUCE_SLOTS];
    j.a = device_in_ + static_cast<uint64_t>(offset) * elem;
    j.b = reinterpret_cast<uint64_t>(slot);
    j.out = reinterpret_cast<uint64_t>(host_ + static_cast<size_t>(offset) * elem);
    j.count = count;
    j.dtype = static_cast<int32_t>(dtype_);
    store_release(&j.key, reduce_job_key(seq_, job));  // the fields above are visible first
  }
  cv_.notify_all();
}

bool DeviceReducer::consumed(int64_t job) {
  const uint64_t key = reduce_job_key(seq_, job);
  const auto& flags = c_->consumed[job % FTHSDP_REDUCE_SLOTS];
  for (int b = 0; b < FTHSDP_REDUCE_BLOCKS; ++b) {
    if (load_acquire(&flags[b]) != key) return false;
  }
  return true;
}

bool DeviceReducer::drain(std::vector<int32_t>* lanes, std::string* reason) {
  std::lock_guard<std::mutex> lk(mu_);
  for (int64_t j = slots_.oldest(); j >= 0 && consumed(j); j = slots_.oldest()) {
    lanes->push_back(slots_.finish_oldest());
  }
  if (load_acquire(&c_->device_timeout) == seq_ && seq_ != 0) {
    *reason = "the GPU reduce worker gave up waiting for a job (device backstop)";
    return false;
  }
  return true;
}

int64_t DeviceReducer::jobs_posted() {
  std::lock_guard<std::mutex> lk(mu_);
  return slots_.posted();
}

void DeviceReducer::watch() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    // Bounded wait: re-checks stop_ even if a notification was missed.
    cv_.wait_for(lk, std::chrono::milliseconds(200), [&] { return stop_ || slots_.posted() > watched_; });
    if (stop_) return;
    if (slots_.posted() <= watched_) continue;
    const uint64_t gen = generation_;
    const int64_t job = watched_;
    bool done = false;
    for (uint32_t spins = 0; !stop_ && gen == generation_; ++spins) {
      if ((done = consumed(job))) break;
      lk.unlock();
      if (spins >= 64) std::this_thread::sleep_for(std::chrono::microseconds(spins < 4096 ? 5 : 100));
      lk.lock();
    }
    if (!done || gen != generation_) continue;
    watched_ = job + 1;
    if (wake_) wake_();  // the control thread drains and moves the lane on
  }
}

}  // namespace fthsdp
