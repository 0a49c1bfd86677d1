//! Destinations: where the finished values of a tile go, each rounded once.
//!
//! * [`MatrixDest`]: a plain row-major `[M, N]` matrix.
//! * [`QkvDest`]: the fused QKV routing: columns `< q_dim` to the output row, the rest through
//!   the cache router ([`CacheShape::kv_column`]) to the token's K/V slot, for rows the slot plan
//!   gives one (padded BSHD rows write Q only).
//!
//! Panels are head-aligned where heads are multiples of 16 columns, so `finish` receives whole
//! heads: the place for a per-head transform such as RoPE.

#![allow(unsafe_code)] // writes through `SharedMut` under `Dest::finish`'s contract

use super::operands::Operands;
use super::scatter::SharedMut;
use crate::cache::{CacheShape, SlotPlan};
use crate::element::Element;
use crate::simd::GROUP;

/// A destination of finished accumulators.
pub(crate) trait Dest: Sync {
    /// The rows that write K/V, when not all rows do (padded BSHD rows write Q only).
    fn kv_rows(&self) -> Option<&[usize]>;
    /// Whether the panel starting at column `c0` computes only the [`kv_rows`](Self::kv_rows).
    fn kv_panel(&self, c0: usize) -> bool;
    /// Whether a panel may start at column `c` (a multiple of 16).
    fn may_cut(&self, c: usize) -> bool;
    /// Finishes columns `c0 .. c0 + accs.len()` (clipped to `cols()`) of `row`: value, rounding,
    /// routing, writes.
    ///
    /// # Safety
    /// While this call runs, no other call may finish `row` at an overlapping column range, and
    /// no other row may write the same cache slot (the [`SlotPlan`] this destination was built
    /// from promises distinct slots).
    unsafe fn finish<S: Operands>(&self, src: &S, row: usize, c0: usize, accs: &[f32]);
}

/// Rounds column `c` of `row`: the fast value, or the exact path's where the family says so.
#[inline(always)]
fn round<S: Operands, D: Element>(src: &S, row: usize, c: usize, acc: f32) -> D {
    match src.value(row, c, acc) {
        Some(v) => D::from_f32(v),
        None => D::from_f64(src.exact(row, c)),
    }
}

/// A plain row-major `[M, N]` matrix.
pub(crate) struct MatrixDest<'a, O> {
    out: SharedMut<'a, O>,
    n: usize,
}

impl<'a, O: Element> MatrixDest<'a, O> {
    pub fn new(out: &'a mut [O], n: usize) -> Self {
        MatrixDest { out: SharedMut::new(out), n }
    }
}

impl<O: Element> Dest for MatrixDest<'_, O> {
    fn kv_rows(&self) -> Option<&[usize]> {
        None
    }
    fn kv_panel(&self, _c0: usize) -> bool {
        false
    }
    fn may_cut(&self, _c: usize) -> bool {
        true
    }
    unsafe fn finish<S: Operands>(&self, src: &S, row: usize, c0: usize, accs: &[f32]) {
        let c1 = (c0 + accs.len()).min(self.n);
        for (c, &acc) in (c0..c1).zip(accs) {
            // SAFETY: (row, c) is in this call's range, which no concurrent call shares (the
            // function's contract); `write` checks bounds.
            unsafe { self.out.write(row * self.n + c, round::<S, O>(src, row, c, acc)) };
        }
    }
}

/// Q to the output, K/V to the cache slots of the slot plan.
pub(crate) struct QkvDest<'a, O, C> {
    out: SharedMut<'a, O>,
    cache: SharedMut<'a, C>,
    q_dim: usize,
    n: usize,
    /// For column `q_dim + j`: its offset from the slot base (the router, tabulated).
    col_off: Vec<usize>,
    /// Per row: the flat index of its slot base, or None (no K/V write).
    slot_base: Vec<Option<usize>>,
    /// The rows with a slot, when not all rows have one.
    kv_rows: Option<Vec<usize>>,
}

impl<'a, O: Element, C: Element> QkvDest<'a, O, C> {
    pub fn new(
        output: &'a mut [O],
        cache: &'a mut [C],
        shape: CacheShape,
        layer: usize,
        plan: &SlotPlan,
        q_dim: usize,
        n: usize,
    ) -> Self {
        let col_off = (0..n - q_dim).map(|j| shape.kv_column_offset(j)).collect();
        let slot_base: Vec<Option<usize>> =
            plan.rows.iter().map(|s| s.map(|s| shape.slot_base(s.block, layer, s.offset))).collect();
        let kv_rows = slot_base
            .iter()
            .any(Option::is_none)
            .then(|| slot_base.iter().enumerate().filter_map(|(r, s)| s.map(|_| r)).collect());
        QkvDest { out: SharedMut::new(output), cache: SharedMut::new(cache), q_dim, n, col_off, slot_base, kv_rows }
    }
}

impl<O: Element, C: Element> Dest for QkvDest<'_, O, C> {
    fn kv_rows(&self) -> Option<&[usize]> {
        self.kv_rows.as_deref()
    }
    fn kv_panel(&self, c0: usize) -> bool {
        c0 >= self.q_dim && self.kv_rows.is_some()
    }
    fn may_cut(&self, c: usize) -> bool {
        c.is_multiple_of(GROUP)
    }
    unsafe fn finish<S: Operands>(&self, src: &S, row: usize, c0: usize, accs: &[f32]) {
        let c1 = (c0 + accs.len()).min(self.n);
        let qe = c1.min(self.q_dim).max(c0);
        for (c, &acc) in (c0..qe).zip(accs) {
            // SAFETY: (row, c) is in this call's range, which no concurrent call shares (the
            // function's contract); `write` checks bounds.
            unsafe { self.out.write(row * self.q_dim + c, round::<S, O>(src, row, c, acc)) };
        }
        let Some(base) = self.slot_base[row] else { return };
        for (c, &acc) in (qe..c1).zip(&accs[qe - c0..]) {
            // SAFETY: the slot of `row` is written by no other row (the slot plan, the
            // contract), and this column of it by no other call (the contract).
            unsafe { self.cache.write(base + self.col_off[c - self.q_dim], round::<S, C>(src, row, c, acc)) };
        }
    }
}
