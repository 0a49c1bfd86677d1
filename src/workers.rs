//! A long-lived team of worker threads for short calls: [`Workers`].
//!
//! A decode step calls each layer's QKV with one to a few dozen rows: a few µs to a ms of work.
//! Handing such a call to rayon's pool costs a wake-up of its sleeping threads (rayon parks an
//! idle thread after a few dozen yields), and measured on a 2-vCPU AMD Zen 5 VM a call that
//! followed other work on another pool gained nothing from a second rayon thread, even at 64
//! rows (docs/performance.md, "Per-call cost"). A [`Workers`] team keeps its threads spinning for a
//! while after each call (`spin`, 200 µs by default) and parks them after that, so calls that come
//! back to back, as a server's layers do, start on every thread within a fraction of a µs; each
//! thread also takes the same share of a call's tasks every time (the same weight panels stay in
//! its caches).
//!
//! The unsafe code here is the lifetime erasure of the job each call hands its helpers (a borrowed
//! closure, as in `std::thread::scope`): the call does not return, or unwind, before every helper
//! has finished with it.
#![allow(unsafe_code)] // the job hand-off below (one `unsafe impl`, two blocks)

use std::cell::UnsafeCell;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The job of one call: `f(thread index)` on every thread of the team.
type Job = &'static (dyn Fn(usize) + Sync);

/// How long helpers spin after a call by default before they park.
const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// A team of threads that runs the fast paths' calls with a small per-call cost: the calling
/// thread plus `threads − 1` helpers that, after each call, spin for a while (a server's next
/// layer comes within µs) and then park (an idle server costs no CPU).
///
/// Pass it through [`Exec::on`](crate::Exec::on) (or `Par::Workers`). A call on a team that is
/// busy with another thread's call runs on its own calling thread instead of waiting, so several
/// threads may share one team; results are the same bits whatever runs them. A team lives as long
/// as the process (calls need a `&'static` one): build it once with [`Workers::shared`], or keep
/// your own in a `static OnceLock`.
///
/// ```
/// use paged_qkv::{Exec, Workers};
/// let exec: Exec = Exec::on(Workers::shared(2)?);
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct Workers {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
}

/// What the caller and the helpers share.
struct Shared {
    /// Bumped once per call (and once to stop); helpers run the job of each new value.
    generation: AtomicU64,
    /// The current call's job; see [`JobSlot`].
    job: JobSlot,
    /// Helpers still running the current job.
    pending: AtomicUsize,
    /// Set while a call owns the team.
    busy: AtomicBool,
    /// A helper's job panicked.
    panicked: AtomicBool,
    stop: AtomicBool,
    /// Helpers parked or about to park (they wait on `wake`).
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    spin: Duration,
}

/// The job slot: written only by the call that owns the team (`busy`), while no helper runs a
/// job (`pending == 0`), before it publishes a new generation (Release); read by helpers only
/// after they observed that generation (Acquire) and before they decrement `pending`.
struct JobSlot(UnsafeCell<Option<Job>>);

// SAFETY: access to the cell follows the protocol above: one writer at a time (the owner of
// `busy`), never concurrent with a reader (helpers read between the generation's publication and
// their `pending` decrement, and the writer waits for `pending == 0` before the next write); the
// job itself is `Sync`.
unsafe impl Sync for JobSlot {}

impl Workers {
    /// A team of `threads` threads (the caller and `threads − 1` helpers; 0 counts as 1), whose
    /// helpers spin 200 µs after each call before parking.
    pub fn new(threads: usize) -> std::io::Result<Workers> {
        Workers::with_spin(threads, DEFAULT_SPIN)
    }

    /// The same, spinning `spin` after each call (zero: park at once; a call then costs a
    /// wake-up per helper, as rayon's does).
    pub fn with_spin(threads: usize, spin: Duration) -> std::io::Result<Workers> {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: JobSlot(UnsafeCell::new(None)),
            pending: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            spin,
        });
        let mut workers = Workers { shared, handles: Vec::new() };
        for index in 1..threads.max(1) {
            let shared = workers.shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("paged-qkv-{}-{index}", threads))
                .spawn(move || helper(&shared, index))?;
            workers.handles.push(h);
        }
        Ok(workers)
    }

    /// The process-wide team of `threads` threads (one per thread count, built at the first call
    /// and never dropped): what the CLI and the Python package use.
    pub fn shared(threads: usize) -> std::io::Result<&'static Workers> {
        static TEAMS: OnceLock<Mutex<Vec<&'static Workers>>> = OnceLock::new();
        let threads = threads.max(1);
        let mut teams = TEAMS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = teams.iter().find(|w| w.threads() == threads) {
            return Ok(w);
        }
        let w: &'static Workers = Box::leak(Box::new(Workers::new(threads)?));
        teams.push(w);
        Ok(w)
    }

    /// Threads of the team, the caller's included.
    pub fn threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// Runs `f(i)` once on each thread of the team, `i` in `0 .. threads()` (the caller runs
    /// `f(0)`), and returns when all have returned. When another call owns the team (or the team
    /// has one thread), runs `f(0), f(1), …` on the calling thread in turn. A panic in any `f` is
    /// raised here once all have finished.
    pub(crate) fn each_thread(&self, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        if self.handles.is_empty() || s.busy.compare_exchange(false, true, Acquire, Relaxed).is_err() {
            (0..self.threads()).for_each(f);
            return;
        }
        // SAFETY: only the lifetime is erased. The job is cleared and every helper has finished
        // with it before this function returns or unwinds: `Finish` (dropped on both paths)
        // waits for `pending == 0`.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: this call owns `busy` and no helper runs a job (`pending` is 0 whenever `busy`
        // is free), so nothing reads the slot now (the `JobSlot` protocol).
        unsafe { *s.job.0.get() = Some(job) };
        s.pending.store(self.handles.len(), Relaxed);
        s.generation.fetch_add(1, SeqCst);
        s.wake_sleepers();
        let finish = Finish(s);
        f(0);
        if finish.complete() {
            panic!("a paged-qkv worker thread panicked");
        }
    }
}

/// Waits for the helpers, clears the job and frees the team (also when the caller's part panics:
/// then on drop).
struct Finish<'a>(&'a Shared);

impl Finish<'_> {
    /// Finishes the call; whether a helper's part panicked.
    fn complete(self) -> bool {
        self.wait();
        let panicked = self.0.panicked.swap(false, Relaxed);
        drop(self); // frees the team
        panicked
    }

    fn wait(&self) {
        let s = self.0;
        let t = Instant::now();
        let mut n = 0u32;
        while s.pending.load(Acquire) != 0 {
            std::hint::spin_loop();
            n = n.wrapping_add(1);
            if n.is_multiple_of(1024) && t.elapsed() > Duration::from_millis(1) {
                std::thread::yield_now();
            }
        }
    }
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        self.wait();
        let s = self.0;
        // SAFETY: `pending` is 0: no helper reads the slot until the next generation, which only
        // the next owner of `busy` publishes.
        unsafe { *s.job.0.get() = None };
        s.panicked.store(false, Relaxed); // read by `complete` already, or moot while unwinding
        s.busy.store(false, Release);
    }
}

impl Shared {
    /// Wakes parked helpers after a new generation (SeqCst on both sides: a helper that counted
    /// itself a sleeper before this read is notified, one that counts itself after it sees the
    /// new generation under the lock and does not wait).
    fn wake_sleepers(&self) {
        if self.sleepers.load(SeqCst) > 0 {
            drop(self.lock.lock().unwrap_or_else(|e| e.into_inner()));
            self.wake.notify_all();
        }
    }
}

/// A helper's life: wait for a generation (spinning, then parked), run its part, repeat.
fn helper(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let t = Instant::now();
        let mut n = 0u32;
        let mut g = s.generation.load(Acquire);
        while g == seen {
            std::hint::spin_loop();
            n = n.wrapping_add(1);
            if n.is_multiple_of(64) && t.elapsed() >= s.spin {
                s.sleepers.fetch_add(1, SeqCst);
                let mut guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                while s.generation.load(SeqCst) == seen {
                    guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                drop(guard);
                s.sleepers.fetch_sub(1, SeqCst);
            }
            g = s.generation.load(Acquire);
        }
        seen = g;
        if s.stop.load(Acquire) {
            return;
        }
        // SAFETY: a new generation was published (Acquire above) by the owner of `busy` after it
        // wrote the slot, and it will not write it again before this helper decrements `pending`.
        let job = unsafe { *s.job.0.get() };
        if let Some(job) = job
            && catch_unwind(AssertUnwindSafe(|| job(index))).is_err()
        {
            s.panicked.store(true, Relaxed);
        }
        s.pending.fetch_sub(1, Release);
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.stop.store(true, Release);
        s.generation.fetch_add(1, SeqCst);
        s.wake_sleepers();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl fmt::Debug for Workers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Workers").field("threads", &self.threads()).field("spin", &self.shared.spin).finish()
    }
}

/// Teams compare by identity (an [`Exec`](crate::Exec) names the team it runs on).
impl PartialEq for Workers {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for Workers {}

impl Hash for Workers {
    fn hash<H: Hasher>(&self, state: &mut H) {
        std::ptr::hash(self, state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Every thread index runs once per call, calls after parking still run, and a busy team
    /// runs a second caller's call on that caller's thread.
    #[test]
    fn each_thread_runs_every_index_once() {
        for spin in [Duration::ZERO, Duration::from_micros(50)] {
            let w = Workers::with_spin(3, spin).unwrap();
            for round in 0..50 {
                let hits: [AtomicUsize; 3] = Default::default();
                w.each_thread(&|i| _ = hits[i].fetch_add(1, Relaxed));
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "round {round}");
                if round % 10 == 0 {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        }
        let w = Workers::new(2).unwrap();
        let inner = AtomicUsize::new(0);
        w.each_thread(&|_| w.each_thread(&|_| _ = inner.fetch_add(1, Relaxed)));
        assert_eq!(inner.load(Relaxed), 4);
    }

    /// A panic in a helper's part reaches the caller, and the team still works afterwards.
    #[test]
    fn a_helper_panic_is_raised_by_the_call() {
        let w = Workers::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| w.each_thread(&|i| assert!(i != 1, "planted"))));
        assert!(r.is_err());
        let hits = AtomicUsize::new(0);
        w.each_thread(&|_| _ = hits.fetch_add(1, Relaxed));
        assert_eq!(hits.load(Relaxed), 2);
        assert!(std::ptr::eq(Workers::shared(2).unwrap(), Workers::shared(2).unwrap()));
    }
}
