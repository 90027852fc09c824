// The compute pool and its governor (pool.h says how a job runs and why), and their torch ops:
// set_threads, pool_stats, set_governor, and two for tests (pool_cover: a job's chunks each run once
// with a worker held back; governor_replay: the governor's answers to synthetic timings).
#include "pool.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace kvl {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// A worker spins this long for the next job (a decode step's jobs come microseconds apart; the gap
// between steps, Python's, is longer), then yields for as long again, then sleeps.
constexpr int64_t kSpinNs = 50'000;
// The caller spins this long for claimed chunks, then yields the core (to a worker that shares it).
constexpr int64_t kWaitSpinNs = 20'000;

void futex_wait(std::atomic<uint32_t>* a, uint32_t seen) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
#else
  while (a->load(std::memory_order_acquire) == seen) std::this_thread::yield();
#endif
}

void futex_wake_all(std::atomic<uint32_t>* a) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(a), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#else
  (void)a;
#endif
}

int affinity_cores() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

thread_local bool tl_in_job = false;  // this thread is running a chunk: a nested job runs here
thread_local int tl_index = 0;        // 0: a caller; 1..: the pool's workers (pool_cover reads it)

// state_: generation (32 bits) | next chunk to claim (16) | chunks (16). Claims are compare-and-swaps
// on the whole word, so a worker still holding an old generation can never claim from a newer job.
constexpr int64_t kMaxChunks = 0xffff;
inline uint64_t pack(uint64_t gen, uint64_t next, uint64_t n) { return (gen << 32) | (next << 16) | n; }

class Pool {
 public:
  Pool() { start(affinity_cores()); }
  ~Pool() { stop(); }

  int threads() const { return active_.load(std::memory_order_relaxed); }
  int configured() const { return configured_.load(std::memory_order_relaxed); }

  void resize(int n) {
    std::lock_guard<std::mutex> g(call_mu_);
    stop();
    start(std::max(1, n));
  }

  void set_governor(bool on) {
    std::lock_guard<std::mutex> g(call_mu_);
    governed_ = on;
    gov_.reset(size_);
    active_.store(size_, std::memory_order_relaxed);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> g(call_mu_);
    return {size_, active_.load(), jobs_, gov_.drops, gov_.restores, gov_.waited_ns, static_cast<int64_t>(governed_)};
  }

  void run(int64_t chunks, void* ctx, void (*fn)(void*, int64_t)) {
    std::unique_lock<std::mutex> lk(call_mu_, std::try_to_lock);
    if (tl_in_job || !lk.owns_lock()) {  // nested, or another caller has the pool: all chunks here
      serial(chunks, ctx, fn);
      return;
    }
    if (active_.load(std::memory_order_relaxed) <= 1) {
      // One thread (or the governor dropped the rest): here, and the governor still sees the job,
      // or it could never probe for the core's return.
      const int64_t t0 = governed_ ? now_ns() : 0;
      serial(chunks, ctx, fn);
      ++jobs_;
      if (governed_ && size_ > 1) {
        const int64_t t1 = now_ns();
        active_.store(gov_.observe(t1, t1 - t0, 0), std::memory_order_relaxed);
      }
      return;
    }
    chunks = std::min(chunks, kMaxChunks);
    const int64_t t0 = now_ns();
    ctx_ = ctx;
    fn_ = fn;
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    ++gen_;
    state_.store(pack(gen_ & 0xffffffffu, 0, static_cast<uint64_t>(chunks)), std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&wake_);
    tl_in_job = true;
    const int64_t own_chunk_ns = work(true);  // catches the chunks' exceptions: never leaves early
    tl_in_job = false;
    // Only claimed chunks are waited for; wait_ns is what the governor judges.
    int64_t wait_ns = 0;
    if (done_.load(std::memory_order_acquire) != chunks) {
      const int64_t w0 = now_ns();
      int64_t spins = 0;
      while (done_.load(std::memory_order_acquire) != chunks) {
        if ((++spins & 63) == 0 && now_ns() - w0 > kWaitSpinNs) {
          std::this_thread::yield();
        } else {
          cpu_relax();
        }
      }
      wait_ns = now_ns() - w0;
      // A worker on its core finishes its last chunk at most about one chunk after the caller's
      // last: a wait up to twice the caller's longest chunk is the chunks' own length (a big job's
      // chunks run for milliseconds: the LM head at 32 rows), not a lost core, and is not judged.
      if (wait_ns < 2 * own_chunk_ns) wait_ns = 0;
    }
    ++jobs_;
    if (governed_) {
      const int64_t t1 = now_ns();
      active_.store(gov_.observe(t1, t1 - t0, wait_ns), std::memory_order_relaxed);
    }
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  static void serial(int64_t chunks, void* ctx, void (*fn)(void*, int64_t)) {
    const bool was = tl_in_job;
    tl_in_job = true;
    struct Restore {
      bool was;
      ~Restore() { tl_in_job = was; }
    } restore{was};
    for (int64_t c = 0; c < chunks; ++c) fn(ctx, c);
  }

  // Claims and runs chunks of the current job until none are left to claim. timed (the caller):
  // returns the longest chunk it ran, in ns (0 if none).
  int64_t work(bool timed = false) {
    int64_t longest = 0;
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = (s >> 16) & 0xffff, n = s & 0xffff;
      if (next >= n) break;
      if (!state_.compare_exchange_weak(s, (s & ~(uint64_t{0xffff} << 16)) | ((next + 1) << 16),
                                        std::memory_order_acq_rel, std::memory_order_acquire)) {
        continue;  // s reloaded: another thread claimed, or a new job began
      }
      const int64_t c0 = timed ? now_ns() : 0;
      try {
        fn_(ctx_, static_cast<int64_t>(next));
      } catch (...) {
        std::lock_guard<std::mutex> g(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      if (timed) longest = std::max(longest, now_ns() - c0);
      done_.fetch_add(1, std::memory_order_release);
      s = state_.load(std::memory_order_acquire);
    }
    return longest;
  }

  // seen: the wake count when the pool started it (a thread that starts late still sees a job
  // published meanwhile).
  void worker(int index, uint32_t seen) {
    tl_index = index;
    for (;;) {
      // Wait for the next job: spin, then yield, then sleep (a dropped worker sleeps at once).
      if (index < active_.load(std::memory_order_relaxed)) {
        const int64_t t0 = now_ns();
        int64_t spins = 0;
        while (wake_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed)) {
          if ((++spins & 63) != 0) {
            cpu_relax();
            continue;
          }
          const int64_t t = now_ns() - t0;
          if (t > 2 * kSpinNs) break;
          if (t > kSpinNs) std::this_thread::yield();
        }
      }
      while (wake_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed)) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        futex_wait(&wake_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      if (stop_.load(std::memory_order_relaxed)) return;
      seen = wake_.load(std::memory_order_acquire);
      if (index >= active_.load(std::memory_order_relaxed)) continue;  // dropped by the governor
      tl_in_job = true;
      work();
      tl_in_job = false;
    }
  }

  void start(int n) {
    size_ = n;
    configured_.store(n, std::memory_order_relaxed);
    gov_.reset(n);
    active_.store(n, std::memory_order_relaxed);
    stop_.store(false);
    const uint32_t seen = wake_.load(std::memory_order_acquire);
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i, seen] { worker(i, seen); });
  }

  void stop() {
    stop_.store(true);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&wake_);
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::mutex call_mu_;  // one caller at a time; also guards size_, gov_, jobs_
  int size_ = 1;
  bool governed_ = true;
  Governor gov_;
  int64_t jobs_ = 0;
  uint64_t gen_ = 0;
  std::atomic<int> active_{1};
  std::atomic<int> configured_{1};  // size_, read without the lock
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  void* ctx_ = nullptr;
  void (*fn_)(void*, int64_t) = nullptr;
  std::mutex error_mu_;
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
};

Pool& pool() {
  // Process-wide, as torch's own pool is: the cores are the process's, whichever engine computes.
  static Pool* p = new Pool();  // never destroyed: workers must not be joined during static teardown
  return *p;
}

}  // namespace

void Governor::reset(int threads) {
  size = std::max(1, threads);
  active = size;
  win_busy_ = win_long_ = 0;
  late_run_ = 0;
  probe_at_ = 0;
  backoff_ = probe_min_ns;
  probing_ = false;
}

int Governor::observe(int64_t now, int64_t job_ns, int64_t wait_ns) {
  win_busy_ += job_ns;
  if (wait_ns >= long_wait_ns) {
    win_long_ += wait_ns;
    waited_ns += wait_ns;
  }
  if (active < size && !probing_ && now >= probe_at_) {  // time to see whether a core came back
    ++active;
    probing_ = true;
    win_busy_ = win_long_ = 0;
    return active;
  }
  if (win_busy_ < window_ns) return active;
  const bool late = static_cast<double>(win_long_) > drop_share * static_cast<double>(win_busy_);
  win_busy_ = win_long_ = 0;
  if (probing_) {
    probing_ = false;
    if (late) {
      --active;
      backoff_ = std::min(probe_max_ns, 2 * backoff_);
    } else {
      ++restores;
      backoff_ = probe_min_ns;
    }
    probe_at_ = now + backoff_;
  } else if (late && active > 1 && ++late_run_ >= late_windows) {
    late_run_ = 0;
    --active;
    ++drops;
    probe_at_ = now + backoff_;
  } else if (!late) {
    late_run_ = 0;
  }
  return active;
}

int pool_threads() { return pool().threads(); }

void pool_run(int64_t chunks, void* ctx, void (*fn)(void*, int64_t)) { pool().run(chunks, ctx, fn); }

int64_t pool_chunks(int64_t n, int64_t grain) {
  // Cut for the configured size even while the governor runs fewer threads (pool_run then runs
  // the chunks here and the governor still sees the job).
  const int64_t t = pool().configured();
  if (t <= 1 || tl_in_job) return 1;
  const int64_t most = (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1);
  return std::max<int64_t>(1, std::min({most, kChunksPerThread * t, kMaxChunks}));
}

namespace {

void set_threads(int64_t n) {
  TORCH_CHECK(n >= 0, "threads must be >= 0 (0: the cores this process may run on)");
  pool().resize(n == 0 ? affinity_cores() : static_cast<int>(n));
}

// [size, active, jobs, drops, restores, long-wait ns, governed]
std::vector<int64_t> pool_stats() { return pool().stats(); }

void set_governor(bool on) { pool().set_governor(on); }

// For tests: a job over [0, n) with at least `grain` a chunk; every item adds 1 to its count, every
// chunk busy-waits `chunk_us` (work to share), and a worker sleeps `worker_delay_us` before each chunk
// it runs (a thread that lost its core). The counts must all be 1 whatever the delay: returns them
// and, last, how many chunks the workers ran.
at::Tensor pool_cover(int64_t n, int64_t grain, int64_t chunk_us, int64_t worker_delay_us) {
  auto counts = at::zeros({n + 1}, at::kLong);
  int64_t* c = counts.data_ptr<int64_t>();
  std::atomic<int64_t> by_workers{0};
  parallel_for(0, n, grain, [&](int64_t a, int64_t b) {
    if (tl_index > 0) {
      by_workers.fetch_add(1);
      if (worker_delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(worker_delay_us));
    }
    const int64_t t0 = now_ns();
    while (now_ns() - t0 < chunk_us * 1000) cpu_relax();
    for (int64_t i = a; i < b; ++i) reinterpret_cast<std::atomic<int64_t>*>(c + i)->fetch_add(1);
  });
  c[n] = by_workers.load();
  return counts;
}

// For tests: the governor of `threads` threads fed jobs (end time, duration, caller's wait, all ns);
// returns the threads it allows after each.
std::vector<int64_t> governor_replay(int64_t threads, at::IntArrayRef ends, at::IntArrayRef jobs,
                                     at::IntArrayRef waits) {
  TORCH_CHECK(ends.size() == jobs.size() && jobs.size() == waits.size(), "one end, duration and wait a job");
  Governor g;
  g.reset(static_cast<int>(threads));
  std::vector<int64_t> out;
  out.reserve(ends.size());
  for (size_t i = 0; i < ends.size(); ++i) out.push_back(g.observe(ends[i], jobs[i], waits[i]));
  return out;
}

}  // namespace
}  // namespace kvl

TORCH_LIBRARY_FRAGMENT(kvledger_cpu, m) {
  m.def("set_threads(int n) -> ()", &kvl::set_threads);
  m.def("pool_stats() -> int[]", &kvl::pool_stats);
  m.def("set_governor(bool on) -> ()", &kvl::set_governor);
  m.def("pool_cover(int n, int grain, int chunk_us, int worker_delay_us) -> Tensor", &kvl::pool_cover);
  m.def("governor_replay(int threads, int[] ends, int[] jobs, int[] waits) -> int[]", &kvl::governor_replay);
}
