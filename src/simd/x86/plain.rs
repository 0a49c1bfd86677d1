//! bf16/f16/f32 micro-kernels: AVX2 (6 rows × 16 columns), AVX-512 F (12 × 32) and AVX-512 BF16
//! (12 × 32 on `vdpbf16ps`), over the packed weight groups of [`crate::simd::plain`] and
//! activations packed once per call in blocks of MR rows ([`PackedRows`]), so one pointer walks a
//! micro-tile's activations. A decode (one or two rows: [`DECODE_ROWS`]) has its own tiles of four
//! (one row) or two groups: four weight streams and at least four independent chains, where the
//! general tiles at one row left one or two chains whose latency limited how far the loads ran
//! ahead (Zen 4, Llama-3-8B bf16 from DRAM, one thread: AVX2 2.0–2.3× → 1.14–1.16× a plain read
//! of the bytes, AVX-512 F 1.7–1.9× → 1.2–1.3×, docs/performance.md).
//!
//! Weights are widened in registers: bf16 by a mask (odd element, the high half of a word) or a
//! shift (even element), f16 by `vcvtph2ps`, f32 as loaded — except on AVX2 when more than one
//! row block uses a group's k-block: it is then widened once into an f32 buffer (the same
//! values) and the f32 micro-kernel runs on it. Activations are broadcast from memory
//! one element at a time (f32) or one bf16 pair at a time (`vdpbf16ps`). Each accumulator is one
//! output column vector of one row, updated in the canonical order: odd element of a pair, then
//! even.

use crate::simd::DECODE_ROWS;
use crate::simd::GROUP;
use crate::simd::plain::{PackedRows, PlainKind, PlainPanel};
use std::arch::x86_64::*;

/// Rows per AVX-512 micro-tile (24 accumulators of 32 columns).
pub(crate) const MR512: usize = 12;
/// Rows per AVX2 micro-tile (12 accumulators of 16 columns).
pub(crate) const MR256: usize = 6;

const BF16: u8 = 0;
const F16: u8 = 1;
const F32: u8 = 2;

fn kind_id(k: PlainKind) -> u8 {
    match k {
        PlainKind::Bf16 => BF16,
        PlainKind::F16 => F16,
        PlainKind::F32 => F32,
    }
}

/// u32 words per k-pair of a group.
const fn wpp(kind: u8) -> usize {
    if kind == F32 { 2 * GROUP } else { GROUP }
}

/// Software prefetch distance in bytes along a weight group: decode streams the weight once, and
/// on Intel a prefetch this far ahead hides more of DRAM's latency than the hardware prefetcher
/// alone (on AMD Zen 4 it hurt, on Zen 5 it helps: [`crate::simd::prefetch_weights`]).
const PREFETCH: usize = 1024;

#[inline(always)]
fn prefetch(p: *const u32) {
    // wrapping_add: the address may lie past the group (a prefetch never faults).
    hint(p.cast::<u8>().wrapping_add(PREFETCH).cast());
}

/// u32 words per 64-byte cache line.
const LINE_WORDS: usize = 16;

/// Prefetches the line at `p` into L1.
#[inline(always)]
fn hint(p: *const u32) {
    super::prefetch_t0(p.cast());
}

/// Rows at which a micro-tile stops streaming (and prefetching) the weight: beyond it the weight
/// block is reused from L1 and a prefetch only evicts.
const STREAM_ROWS: usize = DECODE_ROWS;

/// The prefill tiles' prefetch of the weight lines that the next pair of groups will read: while
/// the row blocks of a task run over one pair of groups (the block reused from L1), row block `b`
/// of `nb` prefetches the lines of pairs `b, b + nb, …` of the next two groups (the next pair of
/// this block, else the first of [`PlainPanel::next`]), so the next block arrives spread over the
/// current one instead of as one burst of misses at its first row block, which the hardware
/// prefetcher alone serves from DRAM at the micro-kernel's full demand rate. Measured on Zen 5
/// (Llama-3-8B bf16 M = 512, one thread, `vdpbf16ps`, alternated runs of a driver): 332–349 →
/// 382–406 GFLOP/s with `prefetcht0`; `prefetcht1`/`t2` were no better. One row block (n ≤ MR)
/// streams each block once: no prefetch.
#[derive(Clone, Copy)]
struct Ahead {
    next: [*const u32; 2],
    /// The next pair at which this tile prefetches (`usize::MAX`: none), and the step.
    at: usize,
    step: usize,
}

impl Ahead {
    /// For the tile of row block `b` of `nb` over groups `g` and `g + 1` of `w`.
    fn new(w: &PlainPanel<'_>, g: usize, b: usize, nb: usize) -> Ahead {
        let base = w.data.as_ptr();
        // wrapping_add: hint addresses only (a prefetch never faults, nothing is dereferenced).
        let next = if g + 2 < w.groups {
            Some([base.wrapping_add((g + 2) * w.stride), base.wrapping_add((g + 3).min(w.groups - 1) * w.stride)])
        } else if !w.next.is_empty() {
            Some([w.next.as_ptr(), w.next.as_ptr().wrapping_add(w.stride)])
        } else {
            None
        };
        match next {
            Some(next) if nb >= 2 => Ahead { next, at: b, step: nb },
            _ => Ahead { next: [base; 2], at: usize::MAX, step: 0 },
        }
    }

    /// At pair `p` of a tile whose groups hold `wpp` words per pair: prefetches pair `p`'s lines
    /// of both next groups when it is this tile's turn.
    #[inline(always)]
    fn step(&mut self, p: usize, wpp: usize) {
        if p == self.at {
            for next in self.next {
                for l in (0..wpp).step_by(LINE_WORDS) {
                    hint(next.wrapping_add(p * wpp + l));
                }
            }
            self.at += self.step;
        }
    }
}

macro_rules! by_rows {
    ($count:expr, $f:ident :: <_ $(, $k:ident)?> ($($arg:expr),*)) => {
        match $count {
            1 => $f::<1 $(, $k)?>($($arg),*),
            2 => $f::<2 $(, $k)?>($($arg),*),
            3 => $f::<3 $(, $k)?>($($arg),*),
            4 => $f::<4 $(, $k)?>($($arg),*),
            5 => $f::<5 $(, $k)?>($($arg),*),
            6 => $f::<6 $(, $k)?>($($arg),*),
            7 => $f::<7 $(, $k)?>($($arg),*),
            8 => $f::<8 $(, $k)?>($($arg),*),
            9 => $f::<9 $(, $k)?>($($arg),*),
            10 => $f::<10 $(, $k)?>($($arg),*),
            11 => $f::<11 $(, $k)?>($($arg),*),
            _ => $f::<12 $(, $k)?>($($arg),*),
        }
    };
}

// The decode kernels have one- and two-row forms (4 / n groups per pass).
const _: () = assert!(DECODE_ROWS == 2);

/// A decode's passes over a panel, `step` (≤ 4) groups at a time: (first group, groups in the
/// pass, their pointers). Pointers past the panel repeat its last group: read and computed by the
/// kernel, never stored.
fn decode_passes<'a>(w: &'a PlainPanel<'_>, step: usize) -> impl Iterator<Item = (usize, usize, [*const u32; 4])> + 'a {
    let base = w.data.as_ptr();
    (0..w.groups).step_by(step).map(move |g| {
        let live = (w.groups - g).min(step);
        (g, live, std::array::from_fn(|j| base.wrapping_add((g + j.min(live - 1)) * w.stride)))
    })
}

/// The accumulators of an R × 32 tile: read from `dst` (a later k-block) or zero.
///
/// # Safety
/// AVX-512 F; when `acc_in`, `dst` holds R rows of 16 (32 when `two`) f32 at stride `ld`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_acc512<const R: usize>(
    dst: *const f32,
    ld: usize,
    two: bool,
    acc_in: bool,
) -> ([__m512; R], [__m512; R]) {
    let mut acc0 = [_mm512_setzero_ps(); R];
    let mut acc1 = [_mm512_setzero_ps(); R];
    if acc_in {
        for r in 0..R {
            // SAFETY: the contract.
            unsafe {
                acc0[r] = _mm512_loadu_ps(dst.add(r * ld));
                if two {
                    acc1[r] = _mm512_loadu_ps(dst.add(r * ld + GROUP));
                }
            }
        }
    }
    (acc0, acc1)
}

/// Stores an R × 32 (16 unless `two`) tile.
///
/// # Safety
/// AVX-512 F; `dst` holds R rows of 16 (32 when `two`) f32 at stride `ld`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_acc512<const R: usize>(dst: *mut f32, ld: usize, two: bool, acc0: &[__m512; R], acc1: &[__m512; R]) {
    for r in 0..R {
        // SAFETY: the contract.
        unsafe {
            _mm512_storeu_ps(dst.add(r * ld), acc0[r]);
            if two {
                _mm512_storeu_ps(dst.add(r * ld + GROUP), acc1[r]);
            }
        }
    }
}

/// # Safety
/// AVX-512 F must be available; `w.check(a, p0, n, out.len(), ld)` must have passed with `a` in
/// f32 form, MR 12.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn panel_avx512(
    w: &PlainPanel<'_>,
    a: &PackedRows<'_>,
    p0: usize,
    n: usize,
    out: &mut [f32],
    ld: usize,
    acc_in: bool,
) {
    let pairs = w.pairs;
    let base = w.data.as_ptr();
    let pf = crate::simd::prefetch_weights();
    if (1..=DECODE_ROWS).contains(&n) {
        // Decode: G groups per pass (G = 4 / n), G weight streams and G·n independent chains.
        let ab = a.f.as_ptr().wrapping_add(p0 * 2 * MR512);
        let step = 4 / n;
        for (g, live, gs) in decode_passes(w, step) {
            let dst = out.as_mut_ptr().wrapping_add(g * GROUP);
            // SAFETY: as in `panel_avx512bf16`'s decode, with packed blocks of `pairs · 24` f32.
            unsafe {
                match (kind_id(w.kind), n) {
                    (BF16, 1) => decode512::<1, 4, BF16>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (BF16, _) => decode512::<2, 2, BF16>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (F16, 1) => decode512::<1, 4, F16>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (F16, _) => decode512::<2, 2, F16>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (_, 1) => decode512::<1, 4, F32>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (_, _) => decode512::<2, 2, F32>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                }
            }
        }
        return;
    }
    let nb = n.div_ceil(MR512);
    for g in (0..w.groups).step_by(2) {
        let two = g + 1 < w.groups;
        let g0 = base.wrapping_add(g * w.stride);
        let g1 = if two { base.wrapping_add((g + 1) * w.stride) } else { g0 };
        for (b, i) in (0..n).step_by(MR512).enumerate() {
            let rows = (n - i).min(MR512);
            let ab = a.f.as_ptr().wrapping_add(b * a.block_len() + p0 * 2 * MR512);
            let dst = out.as_mut_ptr().wrapping_add(i * ld + g * GROUP);
            let ah = Ahead::new(w, g, b, nb);
            // SAFETY: g0/g1 hold `pairs` k-pairs (check), ab a whole packed block, dst `rows`
            // rows of the panel at stride `ld` (check).
            unsafe {
                match kind_id(w.kind) {
                    BF16 => by_rows!(rows, micro512::<_, BF16>(g0, g1, pairs, ab, dst, ld, two, acc_in, pf, ah)),
                    F16 => by_rows!(rows, micro512::<_, F16>(g0, g1, pairs, ab, dst, ld, two, acc_in, pf, ah)),
                    _ => by_rows!(rows, micro512::<_, F32>(g0, g1, pairs, ab, dst, ld, two, acc_in, pf, ah)),
                }
            }
        }
    }
}

/// # Safety
/// AVX-512 F; `g0`/`g1` hold `pairs` k-pairs of a group of kind `K`, `a` a packed block of
/// `pairs · 24` f32, `dst` R rows of 16 (or 32 when `two`) f32 at stride `ld` (read first when
/// `acc_in`).
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro512<const R: usize, const K: u8>(
    g0: *const u32,
    g1: *const u32,
    pairs: usize,
    a: *const f32,
    dst: *mut f32,
    ld: usize,
    two: bool,
    acc_in: bool,
    pf: bool,
    mut ahead: Ahead,
) {
    // SAFETY: dst holds the tile by the contract.
    let (mut acc0, mut acc1) = unsafe { load_acc512::<R>(dst, ld, two, acc_in) };
    let hi = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    for p in 0..pairs {
        let (q0, q1) = (g0.wrapping_add(p * wpp(K)), g1.wrapping_add(p * wpp(K)));
        let ap = a.wrapping_add(p * 2 * MR512);
        if R <= STREAM_ROWS && pf {
            prefetch(q0);
            prefetch(q1);
        }
        ahead.step(p, wpp(K));
        // SAFETY: (the whole block) q0/q1 point at pair p of their groups, ap at pair p of the packed
        // block (the contract).
        unsafe {
            let (o0, o1, e0, e1) = match K {
                BF16 => {
                    let (w0, w1) = (_mm512_loadu_si512(q0.cast()), _mm512_loadu_si512(q1.cast()));
                    (
                        _mm512_castsi512_ps(_mm512_and_si512(w0, hi)),
                        _mm512_castsi512_ps(_mm512_and_si512(w1, hi)),
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w0)),
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w1)),
                    )
                }
                F16 => (
                    _mm512_cvtph_ps(_mm256_loadu_si256(q0.cast())),
                    _mm512_cvtph_ps(_mm256_loadu_si256(q1.cast())),
                    _mm512_cvtph_ps(_mm256_loadu_si256(q0.add(GROUP / 2).cast())),
                    _mm512_cvtph_ps(_mm256_loadu_si256(q1.add(GROUP / 2).cast())),
                ),
                _ => (
                    _mm512_loadu_ps(q0.cast()),
                    _mm512_loadu_ps(q1.cast()),
                    _mm512_loadu_ps(q0.add(GROUP).cast()),
                    _mm512_loadu_ps(q1.add(GROUP).cast()),
                ),
            };
            for r in 0..R {
                let x = _mm512_set1_ps(*ap.add(r));
                acc0[r] = _mm512_fmadd_ps(x, o0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(x, o1, acc1[r]);
            }
            for r in 0..R {
                let x = _mm512_set1_ps(*ap.add(MR512 + r));
                acc0[r] = _mm512_fmadd_ps(x, e0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(x, e1, acc1[r]);
            }
        }
    }
    // SAFETY: dst holds the tile by the contract.
    unsafe { store_acc512::<R>(dst, ld, two, &acc0, &acc1) };
}

/// # Safety
/// AVX-512 F and BF16 must be available; `w.check(a, p0, n, out.len(), ld)` must have passed with
/// `a` in bf16-pair form (which proves the weight is bf16), MR 12.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn panel_avx512bf16(
    w: &PlainPanel<'_>,
    a: &PackedRows<'_>,
    p0: usize,
    n: usize,
    out: &mut [f32],
    ld: usize,
    acc_in: bool,
) {
    let pairs = w.pairs;
    let base = w.data.as_ptr();
    let pf = crate::simd::prefetch_weights();
    if (1..=DECODE_ROWS).contains(&n) {
        // Decode: four groups per pass, four weight streams and four independent chains per row
        // (two left bf16 decode from DRAM ~5 % slower on Zen 4: the chains' latency limits how
        // far the loads run ahead).
        let ab = a.p.as_ptr().wrapping_add(p0 * MR512);
        for (g, live, gs) in decode_passes(w, 4) {
            let dst = out.as_mut_ptr().wrapping_add(g * GROUP);
            // SAFETY: the four pointers are groups < w.groups, each holding `pairs` k-pairs
            // (check); ab is the first packed block's pair p0 (check: n ≥ 1 rows, block 0); dst
            // holds n rows of `live` groups' columns at stride ld (check).
            unsafe {
                if n == 1 {
                    decode_bf16::<1>(gs, live, pairs, ab, dst, ld, acc_in, pf)
                } else {
                    decode_bf16::<2>(gs, live, pairs, ab, dst, ld, acc_in, pf)
                }
            }
        }
        return;
    }
    let nb = n.div_ceil(MR512);
    for g in (0..w.groups).step_by(2) {
        let two = g + 1 < w.groups;
        let g0 = base.wrapping_add(g * w.stride);
        let g1 = if two { base.wrapping_add((g + 1) * w.stride) } else { g0 };
        for (b, i) in (0..n).step_by(MR512).enumerate() {
            let rows = (n - i).min(MR512);
            let ab = a.p.as_ptr().wrapping_add(b * a.block_len() + p0 * MR512);
            let dst = out.as_mut_ptr().wrapping_add(i * ld + g * GROUP);
            let ah = Ahead::new(w, g, b, nb);
            // SAFETY: as in `panel_avx512`, with packed blocks of `pairs · 12` words.
            unsafe { by_rows!(rows, micro_bf16::<_>(g0, g1, pairs, ab, dst, ld, two, acc_in, pf, ah)) }
        }
    }
}

/// # Safety
/// AVX-512 F + BF16; `g0`/`g1` hold `pairs` bf16 k-pairs, `a` a packed block of `pairs · 12`
/// words, `dst` as in [`micro512`].
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_bf16<const R: usize>(
    g0: *const u32,
    g1: *const u32,
    pairs: usize,
    a: *const u32,
    dst: *mut f32,
    ld: usize,
    two: bool,
    acc_in: bool,
    pf: bool,
    mut ahead: Ahead,
) {
    // SAFETY: dst holds the tile by the contract.
    let (mut acc0, mut acc1) = unsafe { load_acc512::<R>(dst, ld, two, acc_in) };
    for p in 0..pairs {
        let (q0, q1) = (g0.wrapping_add(p * GROUP), g1.wrapping_add(p * GROUP));
        let ap = a.wrapping_add(p * MR512);
        if R <= STREAM_ROWS && pf {
            prefetch(q0);
            prefetch(q1);
        }
        ahead.step(p, GROUP);
        // SAFETY: q0/q1 point at pair p of their groups and ap at pair p of the packed block (the
        // contract); __m512i and __m512bh are both 64 plain bytes.
        unsafe {
            let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(q0.cast()));
            let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(q1.cast()));
            for r in 0..R {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(r) as i32));
                acc0[r] = _mm512_dpbf16_ps(acc0[r], x, w0);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], x, w1);
            }
        }
    }
    // SAFETY: dst holds the tile by the contract.
    unsafe { store_acc512::<R>(dst, ld, two, &acc0, &acc1) };
}

/// The decode tile on `vdpbf16ps`: R (1 or 2) rows × four groups, the same chain per column as
/// [`micro_bf16`].
///
/// # Safety
/// AVX-512 F + BF16; each of `gs` holds `pairs` bf16 k-pairs, `a` a packed block of `pairs · 12`
/// words, `dst` R rows of `live · 16` f32 at stride `ld` (read first when `acc_in`); `live` ≤ 4.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn decode_bf16<const R: usize>(
    gs: [*const u32; 4],
    live: usize,
    pairs: usize,
    a: *const u32,
    dst: *mut f32,
    ld: usize,
    acc_in: bool,
    pf: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    if acc_in {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (j, acc) in acc.iter_mut().enumerate().take(live) {
                // SAFETY: dst row r holds `live` groups' columns by the contract.
                *acc = unsafe { _mm512_loadu_ps(dst.add(r * ld + j * GROUP)) };
            }
        }
    }
    for p in 0..pairs {
        let ap = a.wrapping_add(p * MR512);
        // SAFETY: each gs[j] + p·16 is pair p of its group and ap pair p of the packed block (the
        // contract); __m512i and __m512bh are both 64 plain bytes.
        unsafe {
            let w: [__m512bh; 4] = std::array::from_fn(|j| {
                let q = gs[j].wrapping_add(p * GROUP);
                if pf {
                    prefetch(q);
                }
                std::mem::transmute(_mm512_loadu_si512(q.cast()))
            });
            for (r, acc) in acc.iter_mut().enumerate() {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(r) as i32));
                for (acc, &w) in acc.iter_mut().zip(&w) {
                    *acc = _mm512_dpbf16_ps(*acc, x, w);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (j, &acc) in acc.iter().enumerate().take(live) {
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(dst.add(r * ld + j * GROUP), acc) };
        }
    }
}

/// # Safety
/// AVX2, FMA and F16C must be available; `w.check(a, p0, n, out.len(), ld)` must have passed with
/// `a` in f32 form, MR 6.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn panel_avx2(
    w: &PlainPanel<'_>,
    a: &PackedRows<'_>,
    p0: usize,
    n: usize,
    out: &mut [f32],
    ld: usize,
    acc_in: bool,
) {
    let pairs = w.pairs;
    let pf = crate::simd::prefetch_weights();
    if (1..=DECODE_ROWS).contains(&n) {
        // Decode: G groups per pass (G = 4 / n: eight accumulators), G weight streams and 2·G·n
        // independent chains.
        let ab = a.f.as_ptr().wrapping_add(p0 * 2 * MR256);
        let step = 4 / n;
        for (g, live, gs) in decode_passes(w, step) {
            let dst = out.as_mut_ptr().wrapping_add(g * GROUP);
            // SAFETY: the first `step` pointers are groups < w.groups, each holding `pairs`
            // k-pairs (check); ab is the first packed block's pair p0 (check: n ≥ 1 rows); dst
            // holds n rows of `live` groups' columns at stride ld (check).
            unsafe {
                match (kind_id(w.kind), n) {
                    (BF16, 1) => decode256::<1, 4, BF16>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (BF16, _) => decode256::<2, 2, BF16>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (F16, 1) => decode256::<1, 4, F16>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (F16, _) => decode256::<2, 2, F16>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (_, 1) => decode256::<1, 4, F32>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                    (_, _) => decode256::<2, 2, F32>(gs, live, pairs, ab, dst, ld, acc_in, pf),
                }
            }
        }
        return;
    }
    // While one group's k-block is multiplied with every row block, the weight's next block (the
    // next group's, after the last group the first of `w.next`) is prefetched, a share
    // of its lines before each row block: it lies a whole group (the weight's K) away, where the
    // hardware prefetcher does not look, so each block's first micro-tile waited on DRAM. Zen 3,
    // Llama-3-8B M = 512, one thread, interleaved runs of one driver: medians +1-4 % (f32,
    // bf16), bests +4-5 % (docs/performance.md). Software prefetch of the *current* stream hurt
    // decode on AMD Zen 4 ([`crate::simd::prefetch_weights`]); this one is of a stream the
    // hardware cannot predict.
    //
    // A panel of whole groups (`crate::simd::plain_stream_rows`: a few rows) is one sequential
    // stream instead, the groups end to end: the first row block streams each group with the
    // decode's prefetch ahead (which runs on into the next group), the second reads it from L2,
    // and nothing is prefetched a group ahead.
    let whole = w.stride == w.group_len();
    let wp = wpp(kind_id(w.kind));
    let lines = if whole { 0 } else { pairs * wp / LINE_WORDS };
    let per = lines.div_ceil(n.div_ceil(MR256));
    let base = w.data.as_ptr();
    // bf16 and f16 weights reused by more than one row block are widened once per group and
    // k-block into the f32 layout (exact: the same values the micro-kernel makes by its mask and
    // shift or `vcvtph2ps`, in the same order, so the same bits), and the f32 micro-kernel runs
    // on them: the widening per pair and row block, on the vector pipes the FMAs need, is done
    // once instead of once per row block (Zen 3, Llama-3-8B M = 512 bf16, one thread,
    // alternating runs: best 60–74 → 80 GFLOP/s, docs/performance.md).
    let widen = w.kind != PlainKind::F32 && n > MR256 && pairs <= WIDE_PAIRS;
    let mut wide = std::mem::MaybeUninit::<[u32; WIDE_PAIRS * 2 * GROUP]>::uninit();
    let kind = if widen { F32 } else { kind_id(w.kind) };
    for g in 0..w.groups {
        let mut q = base.wrapping_add(g * w.stride);
        if widen {
            let to = wide.as_mut_ptr().cast::<u32>();
            // SAFETY: q holds `pairs` bf16 or f16 k-pairs of 16 words (check); `wide` holds
            // WIDE_PAIRS ≥ pairs pairs of 32 words.
            unsafe {
                if w.kind == PlainKind::Bf16 {
                    widen_group256::<BF16>(q, pairs, to)
                } else {
                    widen_group256::<F16>(q, pairs, to)
                }
            };
            q = to.cast_const();
        }
        // After the last group: the first of [`PlainPanel::next`] (nothing when it is empty).
        let (next, lines) = match (g + 1 < w.groups, w.next.is_empty()) {
            (true, _) => (base.wrapping_add((g + 1) * w.stride), lines),
            (false, false) => (w.next.as_ptr(), lines),
            (false, true) => (base, 0),
        };
        for (b, i) in (0..n).step_by(MR256).enumerate() {
            let rows = (n - i).min(MR256);
            let ab = a.f.as_ptr().wrapping_add(b * a.block_len() + p0 * 2 * MR256);
            let dst = out.as_mut_ptr().wrapping_add(i * ld + g * GROUP);
            for l in b * per..((b + 1) * per).min(lines) {
                hint(next.wrapping_add(l * LINE_WORDS));
            }
            // Prefetch along the weight: a whole group's first row block from DRAM (not a
            // widened copy), else a k-block's tile of at most STREAM_ROWS rows (as before).
            let pf = pf && if whole { b == 0 && !widen } else { rows <= STREAM_ROWS };
            // SAFETY: as in `panel_avx512`, one group at a time, 6-row blocks; when widened, q is
            // the `pairs` f32 k-pairs `widen_group256` wrote.
            unsafe {
                match (kind, rows) {
                    (BF16, 1) => micro256::<1, BF16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (BF16, 2) => micro256::<2, BF16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (BF16, 3) => micro256::<3, BF16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (BF16, 4) => micro256::<4, BF16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (BF16, 5) => micro256::<5, BF16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (BF16, _) => micro256::<6, BF16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (F16, 1) => micro256::<1, F16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (F16, 2) => micro256::<2, F16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (F16, 3) => micro256::<3, F16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (F16, 4) => micro256::<4, F16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (F16, 5) => micro256::<5, F16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (F16, _) => micro256::<6, F16>(q, pairs, ab, dst, ld, acc_in, pf),
                    (_, 1) => micro256::<1, F32>(q, pairs, ab, dst, ld, acc_in, pf),
                    (_, 2) => micro256::<2, F32>(q, pairs, ab, dst, ld, acc_in, pf),
                    (_, 3) => micro256::<3, F32>(q, pairs, ab, dst, ld, acc_in, pf),
                    (_, 4) => micro256::<4, F32>(q, pairs, ab, dst, ld, acc_in, pf),
                    (_, 5) => micro256::<5, F32>(q, pairs, ab, dst, ld, acc_in, pf),
                    (_, _) => micro256::<6, F32>(q, pairs, ab, dst, ld, acc_in, pf),
                }
            }
        }
    }
}

/// k-pairs per k-block on AVX2 ([`crate::simd::plain_kc`]), and the most `panel_avx2` widens
/// from bf16 at once.
pub(crate) const KC256: usize = 128;
const WIDE_PAIRS: usize = KC256;

/// Writes `pairs` k-pairs of a group of kind `K` (bf16 or f16: 16 words each) at `q` to `to` in
/// the f32 layout (32 words each: the odd elements, then the even ones), widened exactly as
/// [`micro256`] widens them ([`widen256`]).
///
/// # Safety
/// AVX2 and F16C must be available; `q` holds `pairs · 16` words and `to` has room for
/// `pairs · 32`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_group256<const K: u8>(q: *const u32, pairs: usize, to: *mut u32) {
    for p in 0..pairs {
        // SAFETY: pair p of both buffers (the contract).
        unsafe {
            let (o0, o1) = widen256::<K, true>(q.add(wpp(K) * p));
            let (e0, e1) = widen256::<K, false>(q.add(wpp(K) * p));
            let d = to.add(32 * p).cast::<f32>();
            _mm256_storeu_ps(d, o0);
            _mm256_storeu_ps(d.add(8), o1);
            _mm256_storeu_ps(d.add(16), e0);
            _mm256_storeu_ps(d.add(24), e1);
        }
    }
}

/// # Safety
/// AVX2 + FMA + F16C; `g` holds `pairs` k-pairs of kind `K`, `a` a packed block of `pairs · 12`
/// f32, `dst` R rows of 16 f32 at stride `ld` (read first when `acc_in`). With `pf` each pair
/// prefetches the weight [`PREFETCH`] bytes ahead (the caller decides when that pays).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn micro256<const R: usize, const K: u8>(
    g: *const u32,
    pairs: usize,
    a: *const f32,
    dst: *mut f32,
    ld: usize,
    acc_in: bool,
    pf: bool,
) {
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    if acc_in {
        for r in 0..R {
            // SAFETY: dst row r holds 16 f32 by the contract.
            unsafe {
                lo[r] = _mm256_loadu_ps(dst.add(r * ld));
                hi[r] = _mm256_loadu_ps(dst.add(r * ld + 8));
            }
        }
    }
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    for p in 0..pairs {
        let q = g.wrapping_add(p * wpp(K));
        let ap = a.wrapping_add(p * 2 * MR256);
        if pf {
            prefetch(q);
        }
        // SAFETY: (the whole block) q points at pair p of the group, ap at pair p of the packed block.
        unsafe {
            // The odd element of the pair, then the even one (loaded again: 12 accumulators leave
            // room for only two live weight vectors).
            let (wl, wh) = match K {
                BF16 => (
                    _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(q.cast()), mask)),
                    _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(q.add(8).cast()), mask)),
                ),
                F16 => (_mm256_cvtph_ps(_mm_loadu_si128(q.cast())), _mm256_cvtph_ps(_mm_loadu_si128(q.add(4).cast()))),
                _ => (_mm256_loadu_ps(q.cast()), _mm256_loadu_ps(q.add(8).cast())),
            };
            for r in 0..R {
                let x = _mm256_set1_ps(*ap.add(r));
                lo[r] = _mm256_fmadd_ps(x, wl, lo[r]);
                hi[r] = _mm256_fmadd_ps(x, wh, hi[r]);
            }
            let (wl, wh) = match K {
                BF16 => (
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_loadu_si256(q.cast()))),
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_loadu_si256(q.add(8).cast()))),
                ),
                F16 => (
                    _mm256_cvtph_ps(_mm_loadu_si128(q.add(8).cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(q.add(12).cast())),
                ),
                _ => (_mm256_loadu_ps(q.add(16).cast()), _mm256_loadu_ps(q.add(24).cast())),
            };
            for r in 0..R {
                let x = _mm256_set1_ps(*ap.add(MR256 + r));
                lo[r] = _mm256_fmadd_ps(x, wl, lo[r]);
                hi[r] = _mm256_fmadd_ps(x, wh, hi[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: dst row r holds 16 f32 by the contract.
        unsafe {
            _mm256_storeu_ps(dst.add(r * ld), lo[r]);
            _mm256_storeu_ps(dst.add(r * ld + 8), hi[r]);
        }
    }
}

/// The odd (`ODD`) or even elements of pair `p` of a group of kind `K` as f32: columns 0–7 and
/// 8–15.
///
/// # Safety
/// AVX2 + F16C; `q` points at a whole k-pair of a group of kind `K`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn widen256<const K: u8, const ODD: bool>(q: *const u32) -> (__m256, __m256) {
    // SAFETY: the contract: a pair is 16 words (bf16, f16) or 32 (f32).
    unsafe {
        match K {
            BF16 => {
                let (l, h) = (_mm256_loadu_si256(q.cast()), _mm256_loadu_si256(q.add(8).cast()));
                if ODD {
                    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
                    (_mm256_castsi256_ps(_mm256_and_si256(l, mask)), _mm256_castsi256_ps(_mm256_and_si256(h, mask)))
                } else {
                    (_mm256_castsi256_ps(_mm256_slli_epi32::<16>(l)), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)))
                }
            }
            F16 => {
                let o = if ODD { 0 } else { 8 };
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(q.add(o).cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(q.add(o + 4).cast())),
                )
            }
            _ => {
                let o = if ODD { 0 } else { 16 };
                (_mm256_loadu_ps(q.add(o).cast()), _mm256_loadu_ps(q.add(o + 8).cast()))
            }
        }
    }
}

/// The decode tile: R rows × G groups (2·G·R ≤ 8 accumulators), the same chain per column as
/// [`micro256`].
///
/// # Safety
/// AVX2 + FMA + F16C; each of the first G of `gs` holds `pairs` k-pairs of kind `K`, `a` a packed
/// block of `pairs · 12` f32, `dst` R rows of `live · 16` f32 at stride `ld` (read first when
/// `acc_in`); `live` ≤ G.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn decode256<const R: usize, const G: usize, const K: u8>(
    gs: [*const u32; 4],
    live: usize,
    pairs: usize,
    a: *const f32,
    dst: *mut f32,
    ld: usize,
    acc_in: bool,
    pf: bool,
) {
    let mut acc = [[[_mm256_setzero_ps(); 2]; G]; R];
    if acc_in {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (j, acc) in acc.iter_mut().enumerate().take(live) {
                // SAFETY: dst row r holds `live` groups' columns by the contract.
                unsafe {
                    acc[0] = _mm256_loadu_ps(dst.add(r * ld + j * GROUP));
                    acc[1] = _mm256_loadu_ps(dst.add(r * ld + j * GROUP + 8));
                }
            }
        }
    }
    for p in 0..pairs {
        let ap = a.wrapping_add(p * 2 * MR256);
        for j in 0..G {
            let q = gs[j].wrapping_add(p * wpp(K));
            if pf {
                prefetch(q);
            }
            // SAFETY: q is pair p of group j and ap pair p of the packed block (the contract).
            unsafe {
                let (wl, wh) = widen256::<K, true>(q);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_set1_ps(*ap.add(r));
                    acc[j][0] = _mm256_fmadd_ps(x, wl, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(x, wh, acc[j][1]);
                }
                let (wl, wh) = widen256::<K, false>(q);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = _mm256_set1_ps(*ap.add(MR256 + r));
                    acc[j][0] = _mm256_fmadd_ps(x, wl, acc[j][0]);
                    acc[j][1] = _mm256_fmadd_ps(x, wh, acc[j][1]);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (j, acc) in acc.iter().enumerate().take(live) {
            // SAFETY: as above.
            unsafe {
                _mm256_storeu_ps(dst.add(r * ld + j * GROUP), acc[0]);
                _mm256_storeu_ps(dst.add(r * ld + j * GROUP + 8), acc[1]);
            }
        }
    }
}

/// The odd (`ODD`) or even elements of pair `p` of a group of kind `K` as 16 f32.
///
/// # Safety
/// AVX-512 F; `q` points at a whole k-pair of a group of kind `K`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn widen512<const K: u8, const ODD: bool>(q: *const u32) -> __m512 {
    // SAFETY: the contract: a pair is 16 words (bf16, f16) or 32 (f32).
    unsafe {
        match K {
            BF16 => {
                let w = _mm512_loadu_si512(q.cast());
                if ODD {
                    _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xFFFF_0000u32 as i32)))
                } else {
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
                }
            }
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(q.add(if ODD { 0 } else { GROUP / 2 }).cast())),
            _ => _mm512_loadu_ps(q.add(if ODD { 0 } else { GROUP }).cast()),
        }
    }
}

/// The decode tile: R rows × G groups (G·R ≤ 4 accumulators), the same chain per column as
/// [`micro512`].
///
/// # Safety
/// AVX-512 F; each of the first G of `gs` holds `pairs` k-pairs of kind `K`, `a` a packed block of
/// `pairs · 24` f32, `dst` R rows of `live · 16` f32 at stride `ld` (read first when `acc_in`);
/// `live` ≤ G.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn decode512<const R: usize, const G: usize, const K: u8>(
    gs: [*const u32; 4],
    live: usize,
    pairs: usize,
    a: *const f32,
    dst: *mut f32,
    ld: usize,
    acc_in: bool,
    pf: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    if acc_in {
        for (r, acc) in acc.iter_mut().enumerate() {
            for (j, acc) in acc.iter_mut().enumerate().take(live) {
                // SAFETY: dst row r holds `live` groups' columns by the contract.
                *acc = unsafe { _mm512_loadu_ps(dst.add(r * ld + j * GROUP)) };
            }
        }
    }
    for p in 0..pairs {
        let ap = a.wrapping_add(p * 2 * MR512);
        for j in 0..G {
            let q = gs[j].wrapping_add(p * wpp(K));
            if pf {
                prefetch(q);
            }
            // SAFETY: q is pair p of group j and ap pair p of the packed block (the contract).
            unsafe {
                let w = widen512::<K, true>(q);
                for (r, acc) in acc.iter_mut().enumerate() {
                    acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(*ap.add(r)), w, acc[j]);
                }
                let w = widen512::<K, false>(q);
                for (r, acc) in acc.iter_mut().enumerate() {
                    acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(*ap.add(MR512 + r)), w, acc[j]);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (j, &acc) in acc.iter().enumerate().take(live) {
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(dst.add(r * ld + j * GROUP), acc) };
        }
    }
}
