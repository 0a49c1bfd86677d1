//! bf16/f16/f32 micro-kernels: AVX2 (6 rows × 16 columns), AVX-512 F (12 × 32) and AVX-512 BF16
//! (12 × 32 on `vdpbf16ps`), over the packed groups of [`crate::simd::plain`].
//!
//! Weights are widened in registers: bf16 by a mask (odd element, the high half of a word) or a
//! shift (even element), f16 by `vcvtph2ps`, f32 as loaded. Activations are broadcast one element
//! at a time (f32) or one bf16 pair at a time (`vdpbf16ps`). Each accumulator is one output column
//! vector of one row, updated in the canonical order: odd element of a pair, then even.

use crate::simd::GROUP;
use crate::simd::plain::{PlainKind, PlainPanel};
use std::arch::x86_64::*;

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

/// Software prefetch distance in bytes along a weight group (the stream of a decode call).
const PREFETCH: usize = 1024;

#[inline(always)]
fn prefetch(p: *const u32, words: usize) {
    // wrapping_add: the address may lie past the group; a prefetch never faults and the pointer
    // is never dereferenced.
    let q = p.wrapping_add(words).cast::<u8>().wrapping_add(PREFETCH);
    // SAFETY: `_mm_prefetch` is a hint with no memory access semantics; SSE is part of x86-64.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(q.cast()) }
}

/// Rows of one micro-tile: pointers to the first element of each (entries past the count repeat
/// the last row and are never stored).
type RowPtrs<T> = [*const T; 12];

fn row_ptrs<T>(rows: &[&[T]], i0: usize, count: usize) -> RowPtrs<T> {
    std::array::from_fn(|r| rows[i0 + r.min(count - 1)].as_ptr())
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

/// Calls `$micro` on every (2-group, MR-row) tile of the panel; a last odd group is paired with
/// itself and stored once.
macro_rules! tiles {
    ($w:ident, $rows:ident, $out:ident, $ld:ident, $mr:expr, |$g0:ident, $g1:ident, $i:ident, $n:ident, $ptrs:ident, $dst:ident, $two:ident| $body:expr) => {{
        let glen = $w.group_len();
        let base = $w.data.as_ptr();
        for g in (0..$w.groups).step_by(2) {
            let $two = g + 1 < $w.groups;
            let $g0 = base.wrapping_add(g * glen);
            let $g1 = if $two { base.wrapping_add((g + 1) * glen) } else { $g0 };
            for $i in (0..$rows.len()).step_by($mr) {
                let $n = ($rows.len() - $i).min($mr);
                let $ptrs = row_ptrs($rows, $i, $n);
                let $dst = $out.as_mut_ptr().wrapping_add($i * $ld + g * GROUP);
                $body;
            }
        }
    }};
}

/// # Safety
/// AVX-512 F must be available; `w.check(rows, out.len(), ld)` must have passed.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn panel_avx512(w: &PlainPanel<'_>, rows: &[&[f32]], out: &mut [f32], ld: usize) {
    let pairs = w.pairs;
    tiles!(w, rows, out, ld, 12, |g0, g1, i, n, ptrs, dst, two| {
        // SAFETY: `check` proved every group holds `pairs` k-pairs, every row 2·pairs elements and
        // `out` every (row, column) of the panel at stride `ld`; the pointers are derived from them.
        unsafe {
            match kind_id(w.kind) {
                BF16 => by_rows!(n, micro512::<_, BF16>(g0, g1, pairs, &ptrs, dst, ld, two)),
                F16 => by_rows!(n, micro512::<_, F16>(g0, g1, pairs, &ptrs, dst, ld, two)),
                _ => by_rows!(n, micro512::<_, F32>(g0, g1, pairs, &ptrs, dst, ld, two)),
            }
        }
    });
}

/// # Safety
/// AVX-512 F; `g0`/`g1` hold `pairs` k-pairs of a group of kind `K`, each `a[r]` `2·pairs`
/// elements, `dst` R rows of 16 (or 32 when `two`) f32 at stride `ld`.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn micro512<const R: usize, const K: u8>(
    g0: *const u32,
    g1: *const u32,
    pairs: usize,
    a: &RowPtrs<f32>,
    dst: *mut f32,
    ld: usize,
    two: bool,
) {
    let mut acc0 = [_mm512_setzero_ps(); R];
    let mut acc1 = [_mm512_setzero_ps(); R];
    let hi = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    for p in 0..pairs {
        let (q0, q1) = (g0.wrapping_add(p * wpp(K)), g1.wrapping_add(p * wpp(K)));
        prefetch(q0, 0);
        prefetch(q1, 0);
        // SAFETY (whole block): q0/q1 point at pair p of their groups, in bounds by the contract;
        // a[r] + 2p + 1 < 2·pairs.
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
                let x = _mm512_set1_ps(*a[r].add(2 * p + 1));
                acc0[r] = _mm512_fmadd_ps(x, o0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(x, o1, acc1[r]);
            }
            for r in 0..R {
                let x = _mm512_set1_ps(*a[r].add(2 * p));
                acc0[r] = _mm512_fmadd_ps(x, e0, acc0[r]);
                acc1[r] = _mm512_fmadd_ps(x, e1, acc1[r]);
            }
        }
    }
    for r in 0..R {
        // SAFETY: dst row r holds 16 (32 when `two`) f32 by the contract.
        unsafe {
            _mm512_storeu_ps(dst.add(r * ld), acc0[r]);
            if two {
                _mm512_storeu_ps(dst.add(r * ld + GROUP), acc1[r]);
            }
        }
    }
}

/// # Safety
/// AVX-512 F and BF16 must be available; `w.check(rows, out.len(), ld)` must have passed with
/// bf16 pair rows (which also proves the weight is bf16).
#[target_feature(enable = "avx512f,avx512bf16")]
pub(crate) unsafe fn panel_avx512bf16(w: &PlainPanel<'_>, rows: &[&[u32]], out: &mut [f32], ld: usize) {
    let pairs = w.pairs;
    tiles!(w, rows, out, ld, 12, |g0, g1, i, n, ptrs, dst, two| {
        // SAFETY: as in `panel_avx512`, with rows of `pairs` words.
        unsafe { by_rows!(n, micro_bf16::<_>(g0, g1, pairs, &ptrs, dst, ld, two)) }
    });
}

/// # Safety
/// AVX-512 F + BF16; `g0`/`g1` hold `pairs` bf16 k-pairs, each `a[r]` `pairs` words, `dst` as in
/// [`micro512`].
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro_bf16<const R: usize>(
    g0: *const u32,
    g1: *const u32,
    pairs: usize,
    a: &RowPtrs<u32>,
    dst: *mut f32,
    ld: usize,
    two: bool,
) {
    let mut acc0 = [_mm512_setzero_ps(); R];
    let mut acc1 = [_mm512_setzero_ps(); R];
    for p in 0..pairs {
        let (q0, q1) = (g0.wrapping_add(p * GROUP), g1.wrapping_add(p * GROUP));
        prefetch(q0, 0);
        prefetch(q1, 0);
        // SAFETY: q0/q1 point at pair p of their groups and a[r] + p < pairs (the contract);
        // __m512i and __m512bh are both 64 plain bytes.
        unsafe {
            let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(q0.cast()));
            let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(q1.cast()));
            for r in 0..R {
                let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a[r].add(p) as i32));
                acc0[r] = _mm512_dpbf16_ps(acc0[r], x, w0);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], x, w1);
            }
        }
    }
    for r in 0..R {
        // SAFETY: dst row r holds 16 (32 when `two`) f32 by the contract.
        unsafe {
            _mm512_storeu_ps(dst.add(r * ld), acc0[r]);
            if two {
                _mm512_storeu_ps(dst.add(r * ld + GROUP), acc1[r]);
            }
        }
    }
}

/// # Safety
/// AVX2, FMA and F16C must be available; `w.check(rows, out.len(), ld)` must have passed.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn panel_avx2(w: &PlainPanel<'_>, rows: &[&[f32]], out: &mut [f32], ld: usize) {
    let pairs = w.pairs;
    let glen = w.group_len();
    for g in 0..w.groups {
        let q = w.data.as_ptr().wrapping_add(g * glen);
        for i in (0..rows.len()).step_by(6) {
            let n = (rows.len() - i).min(6);
            let ptrs = row_ptrs(rows, i, n);
            let dst = out.as_mut_ptr().wrapping_add(i * ld + g * GROUP);
            // SAFETY: as in `panel_avx512`, one group at a time.
            unsafe {
                match (kind_id(w.kind), n) {
                    (BF16, 1) => micro256::<1, BF16>(q, pairs, &ptrs, dst, ld),
                    (BF16, 2) => micro256::<2, BF16>(q, pairs, &ptrs, dst, ld),
                    (BF16, 3) => micro256::<3, BF16>(q, pairs, &ptrs, dst, ld),
                    (BF16, 4) => micro256::<4, BF16>(q, pairs, &ptrs, dst, ld),
                    (BF16, 5) => micro256::<5, BF16>(q, pairs, &ptrs, dst, ld),
                    (BF16, _) => micro256::<6, BF16>(q, pairs, &ptrs, dst, ld),
                    (F16, 1) => micro256::<1, F16>(q, pairs, &ptrs, dst, ld),
                    (F16, 2) => micro256::<2, F16>(q, pairs, &ptrs, dst, ld),
                    (F16, 3) => micro256::<3, F16>(q, pairs, &ptrs, dst, ld),
                    (F16, 4) => micro256::<4, F16>(q, pairs, &ptrs, dst, ld),
                    (F16, 5) => micro256::<5, F16>(q, pairs, &ptrs, dst, ld),
                    (F16, _) => micro256::<6, F16>(q, pairs, &ptrs, dst, ld),
                    (_, 1) => micro256::<1, F32>(q, pairs, &ptrs, dst, ld),
                    (_, 2) => micro256::<2, F32>(q, pairs, &ptrs, dst, ld),
                    (_, 3) => micro256::<3, F32>(q, pairs, &ptrs, dst, ld),
                    (_, 4) => micro256::<4, F32>(q, pairs, &ptrs, dst, ld),
                    (_, 5) => micro256::<5, F32>(q, pairs, &ptrs, dst, ld),
                    (_, _) => micro256::<6, F32>(q, pairs, &ptrs, dst, ld),
                }
            }
        }
    }
}

/// # Safety
/// AVX2 + FMA + F16C; `g` holds `pairs` k-pairs of kind `K`, each `a[r]` `2·pairs` elements, `dst`
/// R rows of 16 f32 at stride `ld`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn micro256<const R: usize, const K: u8>(
    g: *const u32,
    pairs: usize,
    a: &RowPtrs<f32>,
    dst: *mut f32,
    ld: usize,
) {
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    for p in 0..pairs {
        let q = g.wrapping_add(p * wpp(K));
        prefetch(q, 0);
        // SAFETY (whole block): q points at pair p of the group, a[r] + 2p + 1 < 2·pairs.
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
                let x = _mm256_set1_ps(*a[r].add(2 * p + 1));
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
                let x = _mm256_set1_ps(*a[r].add(2 * p));
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
