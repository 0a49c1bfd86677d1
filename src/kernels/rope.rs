//! The standalone RoPE and KV-store fast paths: per row, the token's Q heads are rotated from
//! `q_proj` into `output` and its K heads rotated in place in its cache slot (or its K/V values
//! stored there), in parallel over rows. Each row's slot is carved out of the cache as its own
//! `&mut` slice (the validated slot plan gives distinct slots), so this needs no `unsafe`.
//!
//! The rotation itself is `crate::simd::rope`: the oracle's operations lane by lane.

use crate::cache::{CacheShape, SlotPlan};
use crate::element::Element;
use crate::ops::RopeMath;
use crate::simd::IsaToken;
use crate::simd::rope::{RopeRow, Round, narrow, rotate_heads, rotate_heads_from, widen};
use rayon::prelude::*;

/// Splits `cache` into the disjoint slices `[bases[r], bases[r] + len)` (`None` where a row has no
/// slot). The ranges must not overlap, which the slot plan guarantees (a bug panics, never aliases).
pub(crate) fn carve<'a, C>(cache: &'a mut [C], bases: &[Option<usize>], len: usize) -> Vec<Option<&'a mut [C]>> {
    let mut order: Vec<(usize, usize)> = bases.iter().enumerate().filter_map(|(r, b)| b.map(|b| (b, r))).collect();
    order.sort_unstable();
    let mut out: Vec<Option<&'a mut [C]>> = (0..bases.len()).map(|_| None).collect();
    let mut rest = cache;
    let mut consumed = 0;
    for (base, r) in order {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(base - consumed);
        let (mine, tail) = tail.split_at_mut(len);
        out[r] = Some(mine);
        rest = tail;
        consumed = base + len;
    }
    out
}

/// The first element of each row's slot in layer `layer`, plus `offset` (the V part, or 0).
pub(crate) fn slot_bases(plan: &SlotPlan, shape: &CacheShape, layer: usize, offset: usize) -> Vec<Option<usize>> {
    plan.rows.iter().map(|s| s.map(|s| shape.slot_base(s.block, layer, s.offset) + offset)).collect()
}

/// What one RoPE call rotates.
pub(crate) struct RopeSpec<'a, F> {
    pub freqs: &'a [F],
    pub rope_dim: usize,
    pub interleaved: bool,
    pub math: RopeMath,
    /// Q heads and their size; K heads (the cache's) and their size.
    pub q_heads: (usize, usize),
    pub k_heads: (usize, usize),
}

impl<F: Element> RopeSpec<'_, F> {
    pub fn round(&self) -> Round {
        match self.math {
            RopeMath::F32 => Round::None,
            RopeMath::MaxCompat => Round::of::<F>(),
        }
    }

    /// One token: Q heads from `q` into `out`, K heads of its slot `k` in place.
    fn row<T: Element, C: Element>(
        &self,
        token: IsaToken,
        p: usize,
        q: &[T],
        out: &mut [T],
        k: &mut [C],
        bufs: &mut (Vec<f32>, Vec<f32>),
    ) {
        let rd = self.rope_dim;
        bufs.0.resize(RopeRow::len(rd), 0.0);
        bufs.1.resize(rd, 0.0);
        RopeRow::fill(&self.freqs[p * rd..(p + 1) * rd], &mut bufs.0);
        let row = RopeRow::view(&bufs.0, rd);
        if size_of::<T>() == 2 {
            // bf16/f16: one pass from q into out (measured: 0.57 vs 0.82 ms for 512 Llama tokens).
            rotate_heads_from(token, Some(q), out, self.q_heads, &row, self.interleaved, self.round(), &mut bufs.1);
        } else {
            // f32: a copy then the rotation in place measured faster than the one pass (0.96 vs
            // 1.17 ms for 512 Llama tokens, Intel Xeon; the cause was not found).
            out.copy_from_slice(q);
            rotate_heads(token, out, self.q_heads, &row, self.interleaved, self.round(), &mut bufs.1);
        }
        rotate_heads(token, k, self.k_heads, &row, self.interleaved, self.round(), &mut bufs.1);
    }
}

/// Rows below which a call runs on the calling thread (a decode step's few tokens).
const PAR_ROWS: usize = 8;

/// Runs a validated RoPE call: for every row with a slot and a position, rotate its Q heads
/// (`q_proj` row → `output` row) and its K heads in `cache`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_rows<T: Element, F: Element, C: Element>(
    token: IsaToken,
    parallel: bool,
    spec: &RopeSpec<'_, F>,
    q_proj: &[T],
    output: &mut [T],
    cache: &mut [C],
    bases: &[Option<usize>],
    positions: &[Option<usize>],
) {
    let (hq, dq) = spec.q_heads;
    let (hk, dk) = spec.k_heads;
    let qw = hq * dq;
    let slots = carve(cache, bases, hk * dk);
    let work =
        output.chunks_mut(qw).zip(slots).zip(positions).enumerate().filter_map(|(r, ((o, k), p))| match (k, p) {
            (Some(k), Some(p)) => Some((r, o, k, *p)),
            _ => None,
        });
    let job = |bufs: &mut (Vec<f32>, Vec<f32>), (r, o, k, p): (usize, &mut [T], &mut [C], usize)| {
        spec.row(token, p, &q_proj[r * qw..(r + 1) * qw], o, k, bufs)
    };
    if parallel && positions.len() >= PAR_ROWS {
        let jobs: Vec<_> = work.collect();
        jobs.into_par_iter().for_each_init(|| (Vec::new(), Vec::new()), job);
    } else {
        let mut bufs = (Vec::new(), Vec::new());
        work.for_each(|j| job(&mut bufs, j));
    }
}

/// Runs a validated KV store: every row with a slot writes its `width` values, rounded once to
/// the cache dtype.
pub(crate) fn store_rows<T: Element, C: Element>(
    token: IsaToken,
    parallel: bool,
    values: &[T],
    cache: &mut [C],
    bases: &[Option<usize>],
    width: usize,
) {
    let slots = carve(cache, bases, width);
    let job = |buf: &mut Vec<f32>, (r, dst): (usize, &mut [C])| {
        // Through f32 also for equal types: the oracle's `C::from_f32(v.to_f32())`, NaNs included.
        buf.resize(width, 0.0);
        widen(token, &values[r * width..(r + 1) * width], buf);
        narrow(token, buf, dst);
    };
    let work = slots.into_iter().enumerate().filter_map(|(r, s)| s.map(|s| (r, s)));
    if parallel && bases.len() >= PAR_ROWS {
        let jobs: Vec<_> = work.collect();
        jobs.into_par_iter().for_each_init(Vec::new, job);
    } else {
        let mut buf = Vec::new();
        work.for_each(|j| job(&mut buf, j));
    }
}
