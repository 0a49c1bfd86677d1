#![allow(unsafe_code)] // calls `Dest::finish` (one place) under its contract
//! Tiling and tasks: the output is cut into (row tile × column panel) tasks, each computed by one
//! thread in the canonical order and finished by the destination. No split-K: every element is
//! computed by one task in a fixed k order, so results do not depend on the thread count, the
//! tiling or the other rows of the batch.

use super::epilogue::Dest;
use super::operands::{Operands, Tile};
use crate::pool::Pooled;
use crate::simd::{GROUP, IsaToken};
use rayon::prelude::*;
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
    /// Each worker's tile buffer, kept between calls (no allocation per task in steady state).
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs all tasks of a call: `m` rows of `src` into `dest`, on the current rayon pool when
/// `parallel`. Row tiles of `src.mc(token)` rows (decode and small prefill stream each weight panel once);
/// panels that compute only the destination's K/V rows tile those rows instead.
pub(crate) fn run<S: Operands, D: Dest>(src: &S, dest: &D, m: usize, token: IsaToken, parallel: bool, panels: &Panels) {
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
        TILE.with_borrow_mut(|buf| {
            if buf.len() < count * width {
                buf.resize(count * width, 0.0);
            }
            src.tile(token, &Tile { rows, kv, i0, c0, c1 }, buf);
            for (i, &r) in rows.iter().enumerate() {
                // SAFETY: this task alone finishes (r, c0..c1): tasks own disjoint (row tile ×
                // panel) ranges, and the destination was built from a validated slot plan, which
                // gives every row its own cache slot.
                unsafe { dest.finish(src, r, c0, &buf[i * width..(i + 1) * width]) };
            }
        });
    };
    let tasks = row_tiles * np;
    if parallel && tasks > 1 {
        // Jobs of at most 1/8 of a thread's share: rayon's default splitting leaves 2 jobs per
        // thread, each run to its end once started, so tasks of unequal cost (the K/V panels of
        // padded BSHD rows are empty, a shared vCPU pauses) could leave one thread idle while the
        // other finished a job of a quarter of the tasks (2 threads). Finer jobs cost one `join`
        // each (tens of ns; a task takes microseconds).
        let per_job = (tasks / (8 * rayon::current_num_threads())).max(1);
        (0..tasks).into_par_iter().with_max_len(per_job).for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}
