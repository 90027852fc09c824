// kvledger's compute thread pool: the one pool every CPU kernel splits its work over (ops.cpp), in
// place of at::parallel_for (OpenMP's fork/join, whose closing barrier waits for every thread to
// arrive, so one thread the OS has descheduled stalls the whole step for a time slice; on a box shared
// with any other busy process that happened at every one of the ~10 parallel regions a layer runs).
//
// How a job runs (pool.cpp):
//  - The work is cut into more chunks than threads (kChunksPerThread a thread, each at least `grain`
//    items) and the chunks are claimed one at a time from a shared counter by whoever comes: the
//    calling thread and any worker awake. A worker that arrives late takes fewer chunks, or none.
//  - The caller waits only for chunks that were claimed and are still running, never for a thread to
//    turn up: a worker that is not on a core when a job starts costs that job nothing.
//  - Workers spin a bounded time (kSpinNs) for the next job, then yield, then sleep on a futex; the
//    caller spins, then yields, for claimed chunks to finish.
//  - A job inside a job (a kernel calling a kernel) runs on the thread it is on; two callers at once
//    (two engines in one process) do not share: the second runs its job on its own thread.
//  - The governor (Governor below) watches how long the caller waits for claimed chunks. A thread
//    that keeps being descheduled in the middle of a chunk (another process wants its core) shows as
//    long waits; past a share of the compute time the pool works with one thread fewer, and probes
//    now and then (with backoff) whether the core has come back.
#pragma once

#include <cstdint>

namespace kvl {

// Chunks a thread, at most: enough that a thread late by a fraction of a job leaves its share to the
// others, few enough that claiming one (an atomic compare-and-swap) stays noise.
constexpr int64_t kChunksPerThread = 4;

// The threads a job may use now: the configured size less what the governor has dropped.
int pool_threads();

// Runs fn(ctx, c) for every c in [0, chunks) exactly once, over the pool (pool.cpp).
void pool_run(int64_t chunks, void* ctx, void (*fn)(void*, int64_t));

// How many chunks a range of n items with at least `grain` a chunk is cut into (1: run it here).
int64_t pool_chunks(int64_t n, int64_t grain);

// at::parallel_for's contract on the pool: f(b0, b1) over contiguous sub-ranges of [begin, end) that
// cover it exactly once, each of at least `grain` items (but the last), in any order, on any thread.
template <typename F> void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t chunks = pool_chunks(n, grain);
  if (chunks <= 1) {
    f(begin, end);
    return;
  }
  struct Ctx {
    const F* f;
    int64_t begin, n, chunks;
  } ctx{&f, begin, n, chunks};
  pool_run(chunks, &ctx, [](void* p, int64_t c) {
    const auto* x = static_cast<const Ctx*>(p);
    (*x->f)(x->begin + x->n * c / x->chunks, x->begin + x->n * (c + 1) / x->chunks);
  });
}

// The governor's rule, apart from the pool so that tests can replay synthetic timings through it.
// All times in nanoseconds of a monotonic clock.
struct Governor {
  int size = 1;    // threads configured
  int active = 1;  // threads a job uses now
  // A wait this long for a claimed chunk is a thread that lost its core, not uneven chunks (those
  // are microseconds; a Linux time slice lost is milliseconds).
  int64_t long_wait_ns = 200'000;
  // Judged over windows of this much compute (time inside jobs), so a lightly loaded engine is not
  // judged on a handful of jobs.
  int64_t window_ns = 50'000'000;
  // Long waits above this share of a window's compute, in late_windows windows in a row: one thread
  // fewer. One late window is not enough: a virtual machine's host takes a vCPU for a few ms now and
  // then (steal) and a first touch of fresh memory can stall a thread as long; dropping a thread for
  // that cost half the machine for the half second before the probe (quiet, 1 stream: 0.8x with a
  // drop a run, measured on this 2-vCPU VM). A neighbour that keeps a core busy is late in every window.
  double drop_share = 0.10;
  int late_windows = 3;
  // After a drop, the first probe (one thread more for a window) comes this late; each failed probe
  // doubles it up to probe_max_ns, a good one resets it.
  int64_t probe_min_ns = 500'000'000;
  int64_t probe_max_ns = 8'000'000'000;

  int64_t drops = 0, restores = 0;  // counts, for stats and logs
  int64_t waited_ns = 0;            // all long waits seen

  void reset(int threads);
  // One job's figures: when it ended, how long it took, how long its caller waited for claimed
  // chunks. Returns the threads the next job may use.
  int observe(int64_t now_ns, int64_t job_ns, int64_t wait_ns);

 private:
  int64_t win_busy_ = 0, win_long_ = 0;
  int late_run_ = 0;  // windows in a row found late
  int64_t probe_at_ = 0, backoff_ = 0;
  bool probing_ = false;
};

}  // namespace kvl
