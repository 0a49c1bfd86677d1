#![allow(unsafe_code)] // calls `Dest::finish` (one place) under its contract
//! Tiling and tasks: the output is cut into (row tile × column panel) tasks, each computed by one
//! thread in the canonical order and finished by the destination. No split-K: every element is
//! computed by one task in a fixed k order, so results do not depend on the thread count, the
//! tiling or the other rows of the batch.

use super::epilogue::{Dest, Scratch};
use super::operands::{Operands, Tile};
use super::team::Team;
use crate::pool::Pooled;
use crate::simd::{GROUP, IsaToken};
use std::cell::RefCell;

/// Column panel boundaries (multiples of 16, the last one the padded width).
#[derive(Debug, Clone)]
pub(crate) struct Panels(Pooled<usize>);

impl Panels {
    /// Cuts `[0, n)` (padded to whole 16-column groups) into panels of at least `target` columns,
    /// at the first column the destination allows after each (a head boundary when RoPE is
    /// fused). Heads that are multiples of 16 columns give head-wide panels: measured on the
    /// Llama-3-8B shape (README), 128-column panels beat 64-column ones at M = 1 and 8.
    pub fn new(n: usize, target: usize, may_cut: impl Fn(usize) -> bool) -> Panels {
        let np = n.div_ceil(GROUP) * GROUP;
        let mut b: Pooled<usize> = Pooled::new();
        b.push(0);
        let mut c = GROUP;
        while c < np {
            if c - b[b.len() - 1] >= target && may_cut(c) {
                b.push(c);
            }
            c += GROUP;
        }
        b.push(np);
        Panels(b)
    }

    /// The usual target: one head when heads are a multiple of 16 columns (≤ 256), else 128.
    pub fn target(head_size: usize) -> usize {
        if head_size.is_multiple_of(GROUP) && (GROUP..=256).contains(&head_size) { head_size } else { 128 }
    }

    fn count(&self) -> usize {
        self.0.len() - 1
    }

    fn get(&self, i: usize) -> (usize, usize) {
        (self.0[i], self.0[i + 1])
    }
}

/// Most rows of one task tile (every family's `MC` is at most this).
const MAX_MC: usize = 128;

thread_local! {
    /// Each worker's tile buffer and epilogue scratch, kept between calls (no allocation per
    /// task in steady state).
    static TILE: RefCell<(Vec<f32>, Option<Scratch>)> = const { RefCell::new((Vec::new(), None)) };
}

/// Runs all tasks of a call: `m` rows of `src` into `dest`, on `team`. Row tiles of `src.mc(token)` rows (decode and small prefill stream each weight panel once);
/// panels that compute only the destination's K/V rows tile those rows instead.
pub(crate) fn run<S: Operands, D: Dest>(src: &S, dest: &D, m: usize, token: IsaToken, team: Team, panels: &Panels) {
    let mc = src.mc(token);
    assert!(mc <= MAX_MC);
    let row_tiles = m.div_ceil(mc);
    let np = panels.count();
    let kv_rows = dest.kv_rows();
    let task = |t: usize| {
        let (rt, pc) = (t / np, t % np);
        let (c0, c1) = panels.get(pc);
        let width = c1 - c0;
        let kv = dest.kv_panel(c0);
        let n_set = match (kv, kv_rows) {
            (true, Some(rows)) => rows.len(),
            _ => m,
        };
        let i0 = rt * mc;
        if i0 >= n_set {
            return;
        }
        let count = (i0 + mc).min(n_set) - i0;
        let mut rows = [0usize; MAX_MC];
        for (i, r) in rows.iter_mut().enumerate().take(count) {
            *r = match (kv, kv_rows) {
                (true, Some(list)) => list[i0 + i],
                _ => i0 + i,
            };
        }
        let rows = &rows[..count];
        TILE.with_borrow_mut(|(buf, scratch)| {
            if buf.len() < count * width {
                buf.resize(count * width, 0.0);
            }
            let scratch = scratch.get_or_insert_with(Scratch::default);
            src.tile(token, &Tile { rows, kv, i0, c0, c1 }, buf);
            for (i, &r) in rows.iter().enumerate() {
                // SAFETY: this task alone finishes (r, c0..c1): tasks own disjoint (row tile ×
                // panel) ranges, and the destination was built from a validated slot plan, which
                // gives every row its own cache slot.
                unsafe { dest.finish(src, r, c0, &buf[i * width..(i + 1) * width], scratch) };
            }
        });
    };
    let tasks = row_tiles * np;
    if tasks > 1 && team.threads() > 1 {
        run_affine(team, tasks, &task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// Most chunks `run_affine` cuts a call into (threads beyond it share chunks).
const MAX_CHUNKS: usize = 64;

/// Runs tasks `0..tasks` on `team` with thread affinity: chunk `c` (the `c`-th contiguous
/// `1/threads` of the tasks) is taken first by the team's thread `c`, then each thread helps the
/// others' chunks one task at a time, so no thread idles while tasks remain.
///
/// Why not plain `par_iter`: its work stealing hands a call's tasks to whichever thread comes
/// first, so from one call to the next a column panel's weights change cores; a layer small
/// enough to stay in the private caches (Qwen2.5-0.5B's QKV is 0.5 MB in NVFP4) then moves
/// between the two cores' L2s at every call. Measured on the Xeon of docs/performance.md (2 threads, Qwen
/// M = 1 NVFP4, four alternating runs of a driver): median 13.7–14.1 µs → 12.8–13.4 µs; M = 64
/// and 512 unchanged. Tasks of unequal cost (the empty K/V panels of padded BSHD rows) stay
/// balanced by the helping, as they were with the finer rayon jobs this replaces.
fn run_affine(team: Team, tasks: usize, task: &(impl Fn(usize) + Sync)) {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let nt = team.threads().clamp(1, MAX_CHUNKS).min(tasks);
    let bound = |c: usize| tasks * c / nt;
    let next: [AtomicUsize; MAX_CHUNKS] = std::array::from_fn(|c| AtomicUsize::new(bound(c.min(nt))));
    let drain = |c: usize| {
        let end = bound(c + 1);
        // Relaxed suffices: the counter only hands out indices; the tasks' writes are published by
        // the team's join at the end of `spread`.
        while next[c].load(Relaxed) < end {
            let t = next[c].fetch_add(1, Relaxed);
            if t >= end {
                break;
            }
            task(t);
        }
    };
    // Each thread drains its own chunk first, then helps; a job run by a thread that already
    // finished its chunk goes straight to helping.
    team.spread(nt, &|me| {
        for j in 0..nt {
            drain((me + j) % nt);
        }
    });
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    use super::Team;

    /// Every task runs exactly once, whatever the team, the thread and task counts (more threads
    /// than tasks, more than `MAX_CHUNKS`, uneven chunks).
    #[test]
    fn run_affine_runs_each_task_once() {
        for threads in [1, 2, 3, 8, 70] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let workers = crate::Workers::shared(threads).unwrap();
            for tasks in [2, 3, 7, 64, 65, 200] {
                for team in [Team::Rayon, Team::Workers(workers)] {
                    let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                    pool.install(|| super::run_affine(team, tasks, &|t| _ = hits[t].fetch_add(1, Relaxed)));
                    let counts: Vec<usize> = hits.iter().map(|h| h.load(Relaxed)).collect();
                    assert!(counts.iter().all(|&c| c == 1), "{team:?}, {threads} threads, {tasks} tasks: {counts:?}");
                }
            }
        }
    }
}
