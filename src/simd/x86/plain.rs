//! bf16/f16/f32 micro-kernels: AVX2 (6 rows × 16 columns), AVX-512 F (12 × 32) and AVX-512 BF16
//! (12 × 32 on `vdpbf16ps`; decode 1–2 rows × 64), over the packed weight groups of
//! [`crate::simd::plain`] and activations packed once per call in blocks of MR rows
//! ([`PackedRows`]), so one pointer walks a micro-tile's activations.
//!
//! Weights are widened in registers: bf16 by a mask (odd element, the high half of a word) or a
//! shift (even element), f16 by `vcvtph2ps`, f32 as loaded. Activations are broadcast from memory
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
/// alone (on AMD it hurts: [`crate::simd::prefetch_weights`]).
const PREFETCH: usize = 1024;

#[inline(always)]
fn prefetch(p: *const u32) {
    // wrapping_add: the address may lie past the group; a prefetch never faults and the pointer
    // is never dereferenced.
    let q = p.cast::<u8>().wrapping_add(PREFETCH);
    // SAFETY: `_mm_prefetch` is a hint with no memory access semantics; SSE is part of x86-64.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(q.cast()) }
}

/// Rows at which a micro-tile stops streaming (and prefetching) the weight: beyond it the weight
/// block is reused from L1 and a prefetch only evicts.
const STREAM_ROWS: usize = DECODE_ROWS;

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
    for g in (0..w.groups).step_by(2) {
        let two = g + 1 < w.groups;
        let g0 = base.wrapping_add(g * w.stride);
        let g1 = if two { base.wrapping_add((g + 1) * w.stride) } else { g0 };
        for (b, i) in (0..n).step_by(MR512).enumerate() {
            let rows = (n - i).min(MR512);
            let ab = a.f.as_ptr().wrapping_add(b * a.block_len() + p0 * 2 * MR512);
            let dst = out.as_mut_ptr().wrapping_add(i * ld + g * GROUP);
            // SAFETY: g0/g1 hold `pairs` k-pairs (check), ab a whole packed block, dst `rows`
            // rows of the panel at stride `ld` (check).
            unsafe {
                match kind_id(w.kind) {
                    BF16 => by_rows!(rows, micro512::<_, BF16>(g0, g1, pairs, ab, dst, ld, two, acc_in, pf)),
                    F16 => by_rows!(rows, micro512::<_, F16>(g0, g1, pairs, ab, dst, ld, two, acc_in, pf)),
                    _ => by_rows!(rows, micro512::<_, F32>(g0, g1, pairs, ab, dst, ld, two, acc_in, pf)),
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
        // SAFETY (whole block): q0/q1 point at pair p of their groups, ap at pair p of the packed
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
        for g in (0..w.groups).step_by(4) {
            let live = (w.groups - g).min(4);
            // Groups past the panel repeat its last one: read, computed, never stored.
            let gs: [*const u32; 4] = std::array::from_fn(|j| base.wrapping_add((g + j.min(live - 1)) * w.stride));
            let dst = out.as_mut_ptr().wrapping_add(g * GROUP);
            // SAFETY: the four pointers are groups < w.groups, each holding `pairs` k-pairs
            // (check); ab is the first packed block's pair p0 (check: n ≥ 1 rows, block 0); dst
            // holds n rows of `live` groups' columns at stride ld (check).
            unsafe {
                if n == 1 {
                    micro_bf16_x4::<1>(gs, live, pairs, ab, dst, ld, acc_in, pf)
                } else {
                    micro_bf16_x4::<2>(gs, live, pairs, ab, dst, ld, acc_in, pf)
                }
            }
        }
        return;
    }
    for g in (0..w.groups).step_by(2) {
        let two = g + 1 < w.groups;
        let g0 = base.wrapping_add(g * w.stride);
        let g1 = if two { base.wrapping_add((g + 1) * w.stride) } else { g0 };
        for (b, i) in (0..n).step_by(MR512).enumerate() {
            let rows = (n - i).min(MR512);
            let ab = a.p.as_ptr().wrapping_add(b * a.block_len() + p0 * MR512);
            let dst = out.as_mut_ptr().wrapping_add(i * ld + g * GROUP);
            // SAFETY: as in `panel_avx512`, with packed blocks of `pairs · 12` words.
            unsafe { by_rows!(rows, micro_bf16::<_>(g0, g1, pairs, ab, dst, ld, two, acc_in, pf)) }
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

/// The decode tile: R (1 or 2) rows × four groups, the same chain per column as [`micro_bf16`].
///
/// # Safety
/// AVX-512 F + BF16; each of `gs` holds `pairs` bf16 k-pairs, `a` a packed block of `pairs · 12`
/// words, `dst` R rows of `live · 16` f32 at stride `ld` (read first when `acc_in`); `live` ≤ 4.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_bf16_x4<const R: usize>(
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
    for g in 0..w.groups {
        let q = w.data.as_ptr().wrapping_add(g * w.stride);
        for (b, i) in (0..n).step_by(MR256).enumerate() {
            let rows = (n - i).min(MR256);
            let ab = a.f.as_ptr().wrapping_add(b * a.block_len() + p0 * 2 * MR256);
            let dst = out.as_mut_ptr().wrapping_add(i * ld + g * GROUP);
            // SAFETY: as in `panel_avx512`, one group at a time, 6-row blocks.
            unsafe {
                match (kind_id(w.kind), rows) {
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

/// # Safety
/// AVX2 + FMA + F16C; `g` holds `pairs` k-pairs of kind `K`, `a` a packed block of `pairs · 12`
/// f32, `dst` R rows of 16 f32 at stride `ld` (read first when `acc_in`).
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
        if R <= STREAM_ROWS && pf {
            prefetch(q);
        }
        // SAFETY (whole block): q points at pair p of the group, ap at pair p of the packed block.
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
