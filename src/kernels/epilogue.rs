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

use super::MAX_FUSED_HEAD;
use super::operands::Operands;
use super::scatter::SharedMut;
use crate::cache::{CacheShape, SlotPlan};
use crate::element::Element;
use crate::formats::fp8::E4M3;
use crate::pool::Pooled;
use crate::simd::rope::{RopeRow, Round, narrow, rotate_heads_from};
use crate::simd::{GROUP, IsaToken};
use half::{bf16, f16};

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
    /// `scratch` is the calling thread's working space, reused from call to call.
    ///
    /// # Safety
    /// While this call runs, no other call may finish `row` at an overlapping column range, and
    /// no other row may write the same cache slot (the [`SlotPlan`] this destination was built
    /// from promises distinct slots).
    unsafe fn finish<S: Operands>(&self, src: &S, row: usize, c0: usize, accs: &[f32], scratch: &mut Scratch);
}

/// Values handed to [`Operands::values`] at once (a piece of a band or of a head).
const CHUNK: usize = 256;

/// A worker thread's working space for [`Dest::finish`]: the f32 values of one piece, the
/// rotation buffer of one head, and the piece rounded to its destination type (one vector per
/// element type). Kept per thread between calls (in the scheduler's thread-local) instead of as
/// stack arrays per call: zero-filling those (1.5 KiB per band, 6 KiB more per head with RoPE)
/// was ~3 % of a Llama-3-8B bf16 call at M = 512 on AMD Zen 5 (`perf`: glibc's `memset` under
/// `finish`), and made the fused RoPE cost ~4.5 % instead of ~1 %. The piece is staged, not
/// rounded straight into the destination: that was ~3 % slower on the same call (`narrow`'s
/// 16-byte stores into cold output lines, against one copy of the finished piece).
pub(crate) struct Scratch {
    f: Vec<f32>,
    stage: (Vec<f32>, Vec<bf16>, Vec<f16>, Vec<E4M3>),
}

impl Default for Scratch {
    fn default() -> Self {
        const N: usize = if CHUNK > MAX_FUSED_HEAD { CHUNK } else { MAX_FUSED_HEAD };
        Scratch {
            f: vec![0.0; CHUNK + MAX_FUSED_HEAD],
            stage: (vec![0.0; N], vec![bf16::ZERO; N], vec![f16::ZERO; N], vec![E4M3::default(); N]),
        }
    }
}

impl Scratch {
    /// The piece's f32 values (`CHUNK`), the rotation buffer (`MAX_FUSED_HEAD`), and the staging
    /// of `D` values (at least both).
    fn parts<D: Element>(&mut self) -> (&mut [f32], &mut [f32], &mut [D]) {
        use std::any::Any;
        let (f, rot) = self.f.split_at_mut(CHUNK);
        let (a, b, c, d) = &mut self.stage;
        // `D` is one of the four element types (`Element` is sealed): the one whose downcast
        // succeeds, resolved at compile time.
        let stage = [a as &mut dyn Any, b, c, d].into_iter().find_map(|v| v.downcast_mut::<Vec<D>>());
        (f, rot, stage.expect("Element is one of four types"))
    }
}

/// Rounds column `c` of `row`: the fast value, or the exact path's where the family says so.
#[inline(always)]
fn round<S: Operands, D: Element>(src: &S, row: usize, c: usize, acc: f32) -> D {
    match src.value(row, c, acc, D::DTYPE) {
        Some(v) => D::from_f32(v),
        None => D::from_f64(src.exact(row, c, D::DTYPE)),
    }
}

/// A plain row-major `[M, N]` matrix.
pub(crate) struct MatrixDest<'a, O> {
    out: SharedMut<'a, O>,
    n: usize,
    token: IsaToken,
}

impl<'a, O: Element> MatrixDest<'a, O> {
    pub fn new(out: &'a mut [O], n: usize, token: IsaToken) -> Self {
        MatrixDest { out: SharedMut::new(out), n, token }
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
    unsafe fn finish<S: Operands>(&self, src: &S, row: usize, c0: usize, accs: &[f32], scratch: &mut Scratch) {
        let c1 = (c0 + accs.len()).min(self.n);
        values::<S, O>(self.token, src, row, c0, (c0, c1), accs, None, scratch, |c, n| {
            // SAFETY: (row, c .. c + n) is in this call's range, which no concurrent call shares
            // (the function's contract), and `values` holds one piece at a time; `slice_mut`
            // checks bounds.
            unsafe { self.out.slice_mut(row * self.n + c, n) }
        });
    }
}

/// The epilogue's RoPE, as `fast` translates it from the public `QkvRope`.
#[derive(Clone, Copy)]
pub(crate) struct EpiSpec {
    pub rope_dim: usize,
    /// Q head size (K's is the cache's).
    pub q_head: usize,
    pub interleaved: bool,
    pub round: Round,
}

/// RoPE in the epilogue: per rotated row, its freqs row in the kernels' forms.
pub(crate) struct EpiRope {
    token: IsaToken,
    /// Per row: the offset of its [`RopeRow`] forms in `table` (`None`: not rotated).
    at: Pooled<Option<usize>>,
    table: Pooled<f32>,
    rope_dim: usize,
    q_head: usize,
    interleaved: bool,
    round: Round,
}

impl EpiRope {
    /// Tabulates the freqs rows of the rotated rows (`positions`, from validation) of a RoPE over
    /// `spec.rope_dim` dims of `freqs` rows.
    pub fn new<F: Element>(freqs: &[F], spec: EpiSpec, positions: &[Option<usize>], token: IsaToken) -> Self {
        let rd = spec.rope_dim;
        let mut table: Pooled<f32> = Pooled::new();
        let at = positions
            .iter()
            .map(|p| {
                p.map(|p| {
                    let o = table.len();
                    table.resize(o + RopeRow::len(rd), 0.0);
                    RopeRow::fill_with(token, &freqs[p * rd..(p + 1) * rd], &mut table[o..], spec.interleaved);
                    o
                })
            })
            .collect();
        EpiRope {
            token,
            at,
            table,
            rope_dim: rd,
            q_head: spec.q_head,
            interleaved: spec.interleaved,
            round: spec.round,
        }
    }

    /// One head (its values rounded to their destination type) from `head` into `dst`, its
    /// rotary region rotated (copied as it is for a row that is not rotated); `buf` holds at
    /// least `rope_dim` values.
    fn rotate<D: Element>(&self, row: usize, head: &[D], dst: &mut [D], buf: &mut [f32]) {
        let Some(o) = self.at[row] else { return dst.copy_from_slice(head) };
        let rd = self.rope_dim;
        let forms = RopeRow::view(&self.table[o..o + RopeRow::len(rd)], rd, self.interleaved);
        let (i, r) = (self.interleaved, self.round);
        rotate_heads_from(self.token, Some(head), dst, (1, head.len()), &forms, i, r, buf);
    }
}

/// Values of one destination's columns `a .. b` of `row` (`accs` starts at column `c0`), in pieces
/// of `head` columns (whole heads, rotated when `rope` says so) or up to [`CHUNK`]: each piece is
/// rounded into `scratch`, then copied (or rotated, in one pass) into `dst(first column, length)`,
/// the destination's elements.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn values<'d, S: Operands, D: Element>(
    token: IsaToken,
    src: &S,
    row: usize,
    c0: usize,
    (a, b): (usize, usize),
    accs: &[f32],
    rope: Option<(&EpiRope, usize)>,
    scratch: &mut Scratch,
    mut dst: impl FnMut(usize, usize) -> &'d mut [D],
) {
    let (f, rot, stage) = scratch.parts::<D>();
    let mut fill = |vals: &mut [D], c: usize| {
        // Pieces of up to CHUNK values at once where every value takes the fast path (the same
        // values and one rounding each: `narrow` is `D::from_f32` lane by lane), else column by
        // column. Measured: the per-column path was 12 % of a Qwen-shaped M = 1 NVFP4 call.
        for (p, piece) in vals.chunks_mut(CHUNK).enumerate() {
            let (n, at) = (piece.len(), c + p * CHUNK - c0);
            if src.values(row, c + p * CHUNK, &accs[at..at + n], &mut f[..n], D::DTYPE) {
                narrow(token, &f[..n], piece);
                continue;
            }
            for (j, v) in piece.iter_mut().enumerate() {
                *v = round::<S, D>(src, row, c + p * CHUNK + j, accs[at + j]);
            }
        }
    };
    let step = rope.map_or(CHUNK, |(_, head)| head);
    let mut c = a;
    while c < b {
        let vals = &mut stage[..step.min(b - c)];
        fill(vals, c);
        let out = dst(c, vals.len());
        match rope {
            Some((r, _)) => r.rotate(row, vals, out, rot),
            None => out.copy_from_slice(vals),
        }
        c += vals.len();
    }
}

/// Q to the output, K/V to the cache slots of the slot plan.
pub(crate) struct QkvDest<'a, O, C> {
    out: SharedMut<'a, O>,
    cache: SharedMut<'a, C>,
    q_dim: usize,
    n: usize,
    /// The router: column `q_dim + j` lands at `shape.kv_column_offset(j)` from the slot base
    /// (asked once per written band piece; a table per call cost 3 % of a small decode call).
    shape: CacheShape,
    /// Per row: the flat index of its slot base, or None (no K/V write).
    slot_base: Pooled<Option<usize>>,
    /// The rows with a slot, when not all rows have one.
    kv_rows: Option<Pooled<usize>>,
    /// Head sizes (Q, K/V) and `num_kv_heads · head_size`.
    heads: (usize, usize, usize),
    rope: Option<EpiRope>,
    token: IsaToken,
}

impl<'a, O: Element, C: Element> QkvDest<'a, O, C> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        output: &'a mut [O],
        cache: &'a mut [C],
        shape: CacheShape,
        layer: usize,
        plan: &SlotPlan,
        q_dim: usize,
        n: usize,
        rope: Option<EpiRope>,
        token: IsaToken,
    ) -> Self {
        let slot_base = super::rope::slot_bases(plan, &shape, layer, 0);
        let kv_rows = slot_base
            .iter()
            .any(Option::is_none)
            .then(|| slot_base.iter().enumerate().filter_map(|(r, s)| s.map(|_| r)).collect());
        let q_head = rope.as_ref().map_or(shape.head_size(), |r| r.q_head);
        QkvDest {
            out: SharedMut::new(output),
            cache: SharedMut::new(cache),
            q_dim,
            n,
            shape,
            slot_base,
            kv_rows,
            heads: (q_head, shape.head_size(), shape.kv_width()),
            rope,
            token,
        }
    }
}

impl<O: Element, C: Element> Dest for QkvDest<'_, O, C> {
    fn kv_rows(&self) -> Option<&[usize]> {
        self.kv_rows.as_ref().map(|v| v.as_slice())
    }
    fn kv_panel(&self, c0: usize) -> bool {
        c0 >= self.q_dim && self.kv_rows.is_some()
    }
    fn may_cut(&self, c: usize) -> bool {
        // With RoPE, panels hold whole heads: Q heads below q_dim, K/V heads from it.
        let (dq, dk, _) = self.heads;
        c.is_multiple_of(GROUP)
            && (self.rope.is_none()
                || (c <= self.q_dim && c.is_multiple_of(dq))
                || (c >= self.q_dim && (c - self.q_dim).is_multiple_of(dk)))
    }
    unsafe fn finish<S: Operands>(&self, src: &S, row: usize, c0: usize, accs: &[f32], scratch: &mut Scratch) {
        let c1 = (c0 + accs.len()).min(self.n);
        let qe = c1.min(self.q_dim).max(c0);
        let (dq, dk, kvw) = self.heads;
        let rot = |head: usize| self.rope.as_ref().map(|r| (r, head));
        values::<S, O>(self.token, src, row, c0, (c0, qe), accs, rot(dq), scratch, |c, n| {
            // SAFETY: (row, c .. c + n) is in this call's range, which no concurrent call shares
            // (the function's contract), and `values` holds one piece at a time; `slice_mut`
            // checks bounds.
            unsafe { self.out.slice_mut(row * self.q_dim + c, n) }
        });
        let Some(base) = self.slot_base[row] else { return };
        // K heads (rotated with RoPE), then V heads: each band is contiguous in the slot.
        let ke = c1.min(self.q_dim + kvw).max(qe);
        let bands = [((qe, ke), rot(dk)), ((ke, c1), None)];
        for ((a, b), r) in bands {
            values::<S, C>(self.token, src, row, c0, (a, b), accs, r, scratch, |c, n| {
                // SAFETY: the slot of `row` is written by no other row (the slot plan, the
                // contract), these columns of it by no other call (the contract), and `values`
                // holds one piece at a time.
                unsafe { self.cache.slice_mut(base + self.shape.kv_column_offset(c - self.q_dim), n) }
            });
        }
    }
}
