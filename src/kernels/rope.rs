//! The standalone RoPE and KV-store fast paths: per row, the token's Q heads are rotated from
//! `q_proj` into `output` and its K heads rotated in place in its cache slot (or its K/V values
//! stored there), in parallel over rows. Each row reaches its own slot through
//! [`SharedMut::slice_mut`] (the validated slot plan gives distinct rows distinct slots), so a
//! call allocates nothing in steady state: the earlier safe version carved the cache into a vector
//! of slices per call.
//!
//! The rotation itself is `crate::simd::rope`: the oracle's operations lane by lane.
#![allow(unsafe_code)] // `SharedMut::slice_mut` per row, under the slot plan's disjointness

use super::scatter::SharedMut;
use crate::cache::{CacheShape, SlotPlan};
use crate::element::Element;
use crate::ops::RopeMath;
use crate::pool::Pooled;
use crate::simd::IsaToken;
use crate::simd::rope::{HalfRows, RopeRow, Round, narrow, rotate_token, widen};
use rayon::prelude::*;

/// The first element of each row's slot in layer `layer`, plus `offset` (the V part, or 0).
pub(crate) fn slot_bases(plan: &SlotPlan, shape: &CacheShape, layer: usize, offset: usize) -> Pooled<Option<usize>> {
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
        bufs: &mut (Pooled<f32>, Pooled<f32>),
    ) {
        let rd = self.rope_dim;
        bufs.0.resize(RopeRow::len(rd), 0.0);
        bufs.1.resize(rd, 0.0);
        RopeRow::fill_with(token, &self.freqs[p * rd..(p + 1) * rd], &mut bufs.0, self.interleaved);
        let row = RopeRow::view(&bufs.0, rd, self.interleaved);
        // Every element type in one pass from q into out. f32 used to copy the Q row and rotate
        // it in place (an Intel Xeon had measured that faster: 0.96 vs 1.17 ms for 512 Llama
        // tokens, cause not found), but glibc's `memcpy` of a row that size (`rep movsb`) runs
        // 5–20× slower on AMD Zen 3 when the output lies 1–31 bytes past `q` modulo 4 KiB, and
        // away from that distance the one pass measured faster on Zen 3 too (one core, best of
        // 300–5000 calls, alternating binaries: 64 Llama tokens 67–68 → 44–54 µs, 64 Qwen tokens
        // 15.8–16.1 → 11.5–11.7 µs, 512 Qwen tokens 131–182 → 93–121 µs; criterion, README).
        let (i, r) = (self.interleaved, self.round());
        rotate_token(token, q, out, self.q_heads, k, self.k_heads, &row, i, r, &mut bufs.1);
    }
}

/// Rows below which a call runs on the calling thread (a decode step's few tokens), and the
/// fewest rows a parallel task takes.
const PAR_ROWS: usize = 8;

/// Runs `job(row, buffers, output row)` for every row (`output` in rows of `width`), on rayon
/// when `parallel` and there are enough rows; each task's buffers come from its thread's pool.
fn for_rows<T: Send>(
    parallel: bool,
    output: &mut [T],
    width: usize,
    job: impl Fn(usize, &mut (Pooled<f32>, Pooled<f32>), &mut [T]) + Sync,
) {
    let rows = output.len() / width;
    if parallel && rows >= PAR_ROWS {
        output
            .par_chunks_mut(width)
            .enumerate()
            .with_min_len(PAR_ROWS / 2)
            .for_each_init(|| (Pooled::new(), Pooled::new()), |bufs, (r, o)| job(r, bufs, o));
    } else {
        let mut bufs = (Pooled::new(), Pooled::new());
        for (r, o) in output.chunks_mut(width).enumerate() {
            job(r, &mut bufs, o);
        }
    }
}

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
    let (qw, kw) = (hq * dq, hk * dk);
    assert!(qw > 0 && output.len() == bases.len() * qw && positions.len() == bases.len());
    let cache = SharedMut::new(cache);
    let rd = spec.rope_dim;
    // The commonest case (half-split, `F32` math, whole heads of whole vectors) decided once for
    // the call rather than per token in `RopeSpec::row`: the same kernels and bits.
    if let Some(half) = HalfRows::<T, C>::new(token, spec.interleaved, spec.round(), rd, spec.q_heads, spec.k_heads) {
        for_rows(parallel, output, qw, |r, bufs, o| {
            let (Some(base), Some(p)) = (bases[r], positions[r]) else { return };
            // SAFETY: as in the general loop below: distinct rows have distinct slots (the
            // validated plan), each row is visited by one task, nothing else touches `cache`.
            let k = unsafe { cache.slice_mut(base, kw) };
            bufs.0.resize(half.buf_len(), 0.0);
            half.row(&spec.freqs[p * rd..(p + 1) * rd], &q_proj[r * qw..(r + 1) * qw], o, k, &mut bufs.0);
        });
        return;
    }
    for_rows(parallel, output, qw, |r, bufs, o| {
        let (Some(base), Some(p)) = (bases[r], positions[r]) else { return };
        // SAFETY: the validated slot plan gives every row its own slot, so the ranges
        // `base .. base + kw` of distinct rows are disjoint (a slot holds the row's kw K values),
        // and each row is visited by one task; nothing else touches `cache` during the call.
        let k = unsafe { cache.slice_mut(base, kw) };
        spec.row(token, p, &q_proj[r * qw..(r + 1) * qw], o, k, bufs)
    });
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
    if width == 0 {
        return;
    }
    assert_eq!(values.len(), bases.len() * width);
    let cache = SharedMut::new(cache);
    // The rows of `values` are read-only: `for_rows` walks a slice of units, one per row (a
    // `Vec<()>` never allocates).
    let mut rows = vec![(); bases.len()];
    for_rows(parallel, &mut rows, 1, |r, bufs, _| {
        let Some(base) = bases[r] else { return };
        // SAFETY: as in `rope_rows`: distinct rows have distinct slots, `width` values each.
        let dst = unsafe { cache.slice_mut(base, width) };
        // Through f32 also for equal types: the oracle's `C::from_f32(v.to_f32())`, NaNs included.
        bufs.0.resize(width, 0.0);
        widen(token, &values[r * width..(r + 1) * width], &mut bufs.0);
        narrow(token, &bufs.0, dst);
    });
}
