//! AVX2 and AVX-512 MXFP8 group kernels (the canonical order is in `crate::simd::fp8`): E4M3
//! weight bytes become IEEE half bits `(b << 9) >> 2 | (b << 8) & 0x8000` (= value · 2⁻⁸) in
//! 16-bit lanes, `vcvtph2ps` widens them, and each row's block sum is a chain of f32 FMAs with the
//! activation broadcast from memory. The decode (one- and two-row) kernels run four groups at
//! once for independent chains; on CPUs that take f32 subnormal operands at full speed (AMD Zen 3,
//! Zen 5 and later) they decode E4M3 straight into f32 bits instead, by `vpermb` on AVX-512 VBMI
//! ([`fp8_row_avx512vbmi`]) and `vpshufb` on AVX2 ([`fp8_row_avx2`]).

use super::{RunOn, SCALES_AHEAD};
use crate::simd::fp8::{Fp8Group, Fp8Rows, Outer};
use crate::simd::{GROUP, MR, ROW_GROUPS};
use std::arch::x86_64::*;

/// # Safety
/// `i < a.len()`.
#[inline(always)]
unsafe fn at(a: &[f32], i: usize) -> f32 {
    debug_assert!(i < a.len());
    // SAFETY: the caller guarantees i < a.len().
    unsafe { *a.get_unchecked(i) }
}

/// Weights `w · 2⁻⁸` of k-pair `kk` of a group (32 bytes: k then k + 1, 16 columns each) as two
/// f32 vectors: the bytes as IEEE half bits `(b << 9) >> 2 | (b << 8) & 0x8000`, then `vcvtph2ps`.
/// The one E4M3 decode of the AVX-512 kernels.
///
/// # Safety
/// AVX-512 F and BW must be available; `(kk + 2) · 16 ≤ g.w.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn decode_pair(g: &Fp8Group<'_>, kk: usize) -> (__m512, __m512) {
    debug_assert!((kk + 2) * GROUP <= g.w.len());
    // SAFETY: the caller guarantees 32 bytes at kk · 16.
    let x = unsafe { _mm512_cvtepu8_epi16(_mm256_loadu_si256(g.w.as_ptr().add(kk * GROUP).cast())) };
    let mag = _mm512_srli_epi16::<2>(_mm512_slli_epi16::<9>(x));
    // sign ? (x << 8) : mag, bit by bit (0xD8: C ? B : A).
    let h = _mm512_ternarylogic_epi32::<0xD8>(mag, _mm512_slli_epi16::<8>(x), _mm512_set1_epi16(0x8000u16 as i16));
    (_mm512_cvtph_ps(_mm512_castsi512_si256(h)), _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h)))
}

/// The E8M0 block-scale products `s · 2⁸` of 8 or 16 columns (scale bytes widened to i32 in
/// `sb`) for a row's exponent offset `sc`: `clamp(sb + sc, 0, 255) << 23` as f32 bits.
macro_rules! scale {
    ($add:ident, $min:ident, $max:ident, $set1:ident, $zero:ident, $sll:ident, $cast:ident, $sb:expr, $sc:expr) => {{
        let e = $add($sb, $set1($sc as i32));
        $cast($sll::<23>($min($max(e, $zero()), $set1(255))))
    }};
}

/// [`scale!`] on 16 columns (AVX-512).
#[target_feature(enable = "avx512f")]
#[inline]
fn scale512(sb: __m512i, sc: u32) -> __m512 {
    scale!(
        _mm512_add_epi32,
        _mm512_min_epi32,
        _mm512_max_epi32,
        _mm512_set1_epi32,
        _mm512_setzero_si512,
        _mm512_slli_epi32,
        _mm512_castsi512_ps,
        sb,
        sc
    )
}

/// [`scale!`] on 8 columns (AVX2).
#[target_feature(enable = "avx2")]
#[inline]
fn scale256(sb: __m256i, sc: u32) -> __m256 {
    scale!(
        _mm256_add_epi32,
        _mm256_min_epi32,
        _mm256_max_epi32,
        _mm256_set1_epi32,
        _mm256_setzero_si256,
        _mm256_slli_epi32,
        _mm256_castsi256_ps,
        sb,
        sc
    )
}

/// Block `b`'s weight-scale bytes of columns `half · 8 .. half · 8 + 8`, widened to i32 (the `sb`
/// of [`scale256`]).
///
/// # Safety
/// AVX2 must be available; `half < 2` and `(b + 1) · 16 ≤ g.ws.len()` (`check` proves it for
/// every b < kb).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn scale_bytes256(g: &Fp8Group<'_>, b: usize, half: usize) -> __m256i {
    debug_assert!(half < 2 && (b + 1) * GROUP <= g.ws.len());
    // SAFETY: the caller guarantees block b's 16 scale bytes; half · 8 + 8 ≤ 16.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(g.ws.as_ptr().add(b * GROUP + half * 8).cast())) }
}

/// Both halves of block `b`'s weight-scale bytes ([`scale_bytes256`]).
///
/// # Safety
/// As [`scale_bytes256`].
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn scale_bytes256x2(g: &Fp8Group<'_>, b: usize) -> [__m256i; 2] {
    // SAFETY: the caller's obligation, for both halves.
    unsafe { [scale_bytes256(g, b, 0), scale_bytes256(g, b, 1)] }
}

/// The end of a block for one row of an AVX2 kernel on one group (16 columns, two halves):
/// `acc[half · 8 + c] = fma(bs[half][c], s, acc[half · 8 + c])`, `s` the E8M0 block-scale
/// product of the group's scale bytes `sb` ([`scale_bytes256x2`]) and the row's offset `sc`
/// ([`scale256`]); `acc` is taken as 0 where `first`.
///
/// # Safety
/// AVX2 and FMA must be available; `acc` is valid for reads and writes of 16 f32.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn block_end256(sb: &[__m256i; 2], sc: u32, bs: &[__m256; 2], acc: *mut f32, first: bool) {
    for (half, (h, sb)) in bs.iter().zip(sb).enumerate() {
        // SAFETY: the caller guarantees 16 f32 at `acc`.
        unsafe {
            let s = scale256(*sb, sc);
            let p = acc.add(half * 8);
            let a = if first { _mm256_setzero_ps() } else { _mm256_loadu_ps(p) };
            _mm256_storeu_ps(p, _mm256_fmadd_ps(*h, s, a));
        }
    }
}

/// Prefetches into L2 the weight bytes of the slice after blocks `b0 .. b1` of `g` (as many
/// blocks again, up to the group's end), for the tiled kernels' decode: the next slice's bytes
/// arrive while the row chunks run on this one.
#[inline(always)]
fn prefetch_next_slice(g: &Fp8Group<'_>, b0: usize, b1: usize) {
    let (from, to) = (b1 * g.v * GROUP, ((2 * b1 - b0) * g.v * GROUP).min(g.w.len()));
    for off in (from..to).step_by(64) {
        // SAFETY: `off < g.w.len()`: the address is inside the group's bytes (a prefetch never
        // faults anyway); SSE is part of x86_64.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(g.w.as_ptr().add(off).cast()) };
    }
}

/// # Safety
/// AVX-512 F and BW must be available; `g.check(rows)` must have passed.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn fp8_group_avx512<const R: usize>(
    g: &Fp8Group<'_>,
    rows: &Fp8Rows<'_>,
    out: &mut [[f32; GROUP]; MR],
) {
    debug_assert_eq!(rows.count, R);
    let v = g.v;
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..g.kb {
        let mut bs = [_mm512_setzero_ps(); R];
        // Two k per step: 32 bytes → 32 halves in one zmm.
        for kk in (b * v..(b + 1) * v).step_by(2) {
            // SAFETY: `check` proved w.len() ≥ kb · V · 16 ≥ (kk + 2) · 16.
            let (w0, w1) = unsafe { decode_pair(g, kk) };
            for r in 0..R {
                // SAFETY: `check` proved a.len() ≥ kb · V > kk + 1.
                let (a0, a1) = unsafe { (at(rows.a[r], kk), at(rows.a[r], kk + 1)) };
                bs[r] = _mm512_fmadd_ps(_mm512_set1_ps(a1), w1, _mm512_fmadd_ps(_mm512_set1_ps(a0), w0, bs[r]));
            }
        }
        // SAFETY: `check` proved ws.len() ≥ kb · 16.
        let sb = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(g.ws.as_ptr().add(b * GROUP).cast())) };
        for r in 0..R {
            let s = scale512(sb, rows.sc[r][b]);
            acc[r] = _mm512_fmadd_ps(bs[r], s, acc[r]);
        }
    }
    for r in 0..R {
        // SAFETY: out[r] holds 16 f32.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
    }
}

/// Sixteen E4M3 bytes zero-extended to 16-bit lanes → the f32 `w · 2⁻⁸` of lanes 0..8 and 8..16:
/// the bytes as IEEE half bits `(b << 9) >> 2 | (b << 8) & 0x8000`, then `vcvtph2ps`. The one
/// E4M3 decode of the AVX2 kernels.
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn halves256(x: __m256i) -> (__m256, __m256) {
    let mag = _mm256_srli_epi16::<2>(_mm256_slli_epi16::<9>(x));
    let h = _mm256_or_si256(mag, _mm256_and_si256(_mm256_slli_epi16::<8>(x), _mm256_set1_epi16(0x8000u16 as i16)));
    (_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)))
}

/// # Safety
/// AVX2, FMA and F16C must be available; `g.check(rows)` must have passed.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fp8_group_avx2<const R: usize>(
    g: &Fp8Group<'_>,
    rows: &Fp8Rows<'_>,
    out: &mut [[f32; GROUP]; MR],
) {
    debug_assert_eq!(rows.count, R);
    let v = g.v;
    for half in 0..2 {
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..g.kb {
            let mut bs = [_mm256_setzero_ps(); R];
            // Two k per step: 2 × 8 bytes → 16 halves in one ymm.
            for kk in (b * v..(b + 1) * v).step_by(2) {
                // SAFETY: `check` proved w.len() ≥ kb · V · 16 ≥ (kk + 1) · 16 + 16.
                let x = unsafe {
                    let lo = _mm_loadl_epi64(g.w.as_ptr().add(kk * GROUP + half * 8).cast());
                    let hi = _mm_loadl_epi64(g.w.as_ptr().add((kk + 1) * GROUP + half * 8).cast());
                    _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(lo, hi))
                };
                let (w0, w1) = halves256(x);
                for r in 0..R {
                    // SAFETY: `check` proved a.len() ≥ kb · V > kk + 1.
                    let (a0, a1) = unsafe { (at(rows.a[r], kk), at(rows.a[r], kk + 1)) };
                    bs[r] = _mm256_fmadd_ps(_mm256_set1_ps(a1), w1, _mm256_fmadd_ps(_mm256_set1_ps(a0), w0, bs[r]));
                }
            }
            // SAFETY: `check` proved ws.len() ≥ kb · 16 > b · 16 + 15.
            let sb = unsafe { scale_bytes256(g, b, half) };
            for r in 0..R {
                let s = scale256(sb, rows.sc[r][b]);
                acc[r] = _mm256_fmadd_ps(bs[r], s, acc[r]);
            }
        }
        for r in 0..R {
            let mut tmp = [0f32; 8];
            // SAFETY: tmp holds 8 f32.
            unsafe { _mm256_storeu_ps(tmp.as_mut_ptr(), acc[r]) };
            out[r][half * 8..half * 8 + 8].copy_from_slice(&tmp);
        }
    }
}

/// [`fp8_decode_avx512`] on AVX2: blocks `b0 .. b1` of the groups `gs` (1 or 2, same `v`) into
/// `dst[(kk − b0·V)·16·G + g·16 + c]` as f32 `w · 2⁻⁸`, by [`fp8_group_avx2`]'s half decode (so
/// the same values; NaN bytes give some value: their columns are computed exactly).
///
/// # Safety
/// AVX2 and F16C must be available; `g.check(..)` must have passed for every group, `b1 ≤ kb`,
/// and `dst.len() ≥ (b1 − b0) · V · 16 · gs.len()`.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn fp8_decode_avx2(gs: &[Fp8Group<'_>], b0: usize, b1: usize, dst: &mut [f32]) {
    let (v, gn) = (gs[0].v, gs.len());
    let d = dst.as_mut_ptr();
    for (gi, g) in gs.iter().enumerate() {
        for kk in b0 * v..b1 * v {
            // SAFETY: the 16 weight bytes of k are in w (`check`: w.len() ≥ kb · V · 16 and
            // kk < b1 · V); row kk − b0·V of dst exists (dst.len() above).
            unsafe {
                let (lo, hi) = halves256(_mm256_cvtepu8_epi16(_mm_loadu_si128(g.w.as_ptr().add(kk * GROUP).cast())));
                let row = d.add(((kk - b0 * v) * gn + gi) * GROUP);
                _mm256_storeu_ps(row, lo);
                _mm256_storeu_ps(row.add(8), hi);
            }
        }
        // As on AVX-512.
        prefetch_next_slice(g, b0, b1);
    }
}

/// [`fp8_decoded_avx512`] on AVX2, one group (16 columns, two ymm) × R ≤ 4 rows from weights
/// decoded by [`fp8_decode_avx2`]: per block the chain `bs = fma(a_k, w_k, bs)` in k order, then
/// `acc = fma(bs, s, acc)` with the accumulator read from and written to `out[r·ld + c]` (0
/// before block 0) and `s` [`fp8_group_avx2`]'s scale product — the canonical order, so its bits.
/// Eight independent chains, two FMAs per activation broadcast and no decode in the loop: the
/// group kernel decodes each weight again for every chunk of four rows.
///
/// # Safety
/// AVX2 and FMA must be available; `gs[0].check(rows)` must have passed, `b1 ≤ kb`, `wd` as
/// [`fp8_decode_avx2`] fills it for (`gs[..1]`, `b0`, `b1`), and `out.len() ≥ (R − 1) · ld + 16`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn fp8_decoded_avx2<const R: usize>(
    wd: &[f32],
    gs: &[Fp8Group<'_>],
    b0: usize,
    b1: usize,
    rows: &Fp8Rows<'_>,
    out: &mut [f32],
    ld: usize,
) {
    debug_assert!(rows.count == R && R <= 4 && wd.len() >= (b1 - b0) * gs[0].v * GROUP);
    debug_assert!(out.len() >= (R - 1) * ld + GROUP);
    let (g, v) = (&gs[0], gs[0].v);
    let (wp, op) = (wd.as_ptr(), out.as_mut_ptr());
    for b in b0..b1 {
        let mut bs = [[_mm256_setzero_ps(); 2]; R];
        let wb = (b - b0) * v * GROUP;
        for kk in 0..v {
            // SAFETY: row kk of block b's decoded weights is in wd (length above).
            let (w0, w1) =
                unsafe { (_mm256_loadu_ps(wp.add(wb + kk * GROUP)), _mm256_loadu_ps(wp.add(wb + kk * GROUP + 8))) };
            for r in 0..R {
                // SAFETY: `check` proved a.len() ≥ kb · V > b · V + kk.
                let a = _mm256_set1_ps(unsafe { at(rows.a[r], b * v + kk) });
                bs[r][0] = _mm256_fmadd_ps(a, w0, bs[r][0]);
                bs[r][1] = _mm256_fmadd_ps(a, w1, bs[r][1]);
            }
        }
        // SAFETY: `check` proved ws.len() ≥ kb · 16 > b · 16 + 15.
        let sb = unsafe { scale_bytes256x2(g, b) };
        for (r, br) in bs.iter().enumerate() {
            // SAFETY: r · ld + 16 ≤ out.len() (above).
            unsafe { block_end256(&sb, rows.sc[r][b], br, op.add(r * ld), b == 0) };
        }
    }
}

/// The end of block `b` in the AVX-512 decode kernels: `acc[r][g] = fma(bs[r][g], s, acc[r][g])`
/// with `s` the E8M0 block-scale product of group g's scale bytes and row r's offset.
///
/// # Safety
/// `g.check(rows)` must have passed for every group, and `b < kb`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn rows_block_end<const R: usize>(
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    b: usize,
    bs: &[[__m512; ROW_GROUPS]; R],
    acc: &mut [[__m512; ROW_GROUPS]; R],
) {
    for (gi, g) in gs.iter().enumerate() {
        // SAFETY: `check` proved g.ws.len() ≥ kb · 16 > b · 16 + 15.
        let sb = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(g.ws.as_ptr().add(b * GROUP).cast())) };
        for r in 0..R {
            let sc = scale512(sb, rows.sc[r][b]);
            acc[r][gi] = _mm512_fmadd_ps(bs[r][gi], sc, acc[r][gi]);
        }
    }
}

/// Stores the AVX-512 decode kernels' accumulators: `out[r][g] = acc[r][g]`.
#[target_feature(enable = "avx512f")]
#[inline]
fn rows_store<const R: usize>(out: [&mut [[f32; GROUP]; ROW_GROUPS]; R], acc: &[[__m512; ROW_GROUPS]; R]) {
    for (o, ac) in out.into_iter().zip(acc) {
        for (og, a) in o.iter_mut().zip(ac) {
            // SAFETY: og holds 16 f32.
            unsafe { _mm512_storeu_ps(og.as_mut_ptr(), *a) };
        }
    }
}

/// The end of block `b` of `kb` with [`Outer`] scales: where it ends a span,
/// `total += acc · (sa · sw)` per row and group (multiply, then add) and `acc = 0`.
#[target_feature(enable = "avx512f")]
#[inline]
fn outer_end<const R: usize>(
    outer: Option<&Outer<'_>>,
    b: usize,
    kb: usize,
    acc: &mut [[__m512; ROW_GROUPS]; R],
    total: &mut [[__m512; ROW_GROUPS]; R],
) {
    let Some(o) = outer else { return };
    let Some(j) = o.at_end(b, kb) else { return };
    for r in 0..R {
        for gi in 0..ROW_GROUPS {
            let s = _mm512_set1_ps(o.sa[r][j] * o.sw[gi][j]);
            total[r][gi] = _mm512_add_ps(total[r][gi], _mm512_mul_ps(acc[r][gi], s));
            acc[r][gi] = _mm512_setzero_ps();
        }
    }
}

/// R (1 or 2) activation rows against [`ROW_GROUPS`] adjacent groups (decode): per column the
/// arithmetic of [`fp8_group_avx512`] (so the same bits), with one FMA chain per row and group
/// where a single group has one per row: those chains' latency, not the weight bytes, bounded the
/// group kernel's one- and two-row loops. Each weight vector is decoded once for the R rows.
///
/// # Safety
/// AVX-512 F and BW must be available; `rows.count == R`; `g.check(rows)` must have passed for
/// every group, all with the same `v` and `kb`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn fp8_row_avx512<const R: usize>(
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    outer: Option<&Outer<'_>>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) {
    const G: usize = ROW_GROUPS;
    debug_assert_eq!(rows.count, R);
    let (v, kbs) = (gs[0].v, gs[0].kb);
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    let mut total = acc;
    for b in 0..kbs {
        let mut bs = [[_mm512_setzero_ps(); G]; R];
        for kk in (b * v..(b + 1) * v).step_by(2) {
            // SAFETY: `check` proved a.len() ≥ kb · V > kk + 1 for every row.
            let av: [(__m512, __m512); R] = std::array::from_fn(|r| unsafe {
                (_mm512_set1_ps(at(rows.a[r], kk)), _mm512_set1_ps(at(rows.a[r], kk + 1)))
            });
            for (gi, g) in gs.iter().enumerate() {
                // SAFETY: `check` proved g.w.len() ≥ kb · V · 16 ≥ (kk + 2) · 16.
                let (w0, w1) = unsafe { decode_pair(g, kk) };
                for r in 0..R {
                    let (a0, a1) = av[r];
                    bs[r][gi] = _mm512_fmadd_ps(a1, w1, _mm512_fmadd_ps(a0, w0, bs[r][gi]));
                }
            }
        }
        // SAFETY: `check` passed for every group (the caller's obligation) and b < kb.
        unsafe { rows_block_end(gs, rows, b, &bs, &mut acc) };
        outer_end(outer, b, kbs, &mut acc, &mut total);
    }
    rows_store(out, if outer.is_some() { &total } else { &acc });
}

/// The f32-bits E4M3 decode of one k's 16 weight bytes (columns 0..8 and 8..16), shared by
/// [`fp8_row_avx2`] and [`fp8_rows_avx2`]: each byte moved to the top of its f32 lane (zeros
/// below) and shifted right arithmetically by 4 has the sign in bits 31..27 and the magnitude in
/// 26..20; the AND clears 30..27: `(b & 0x80) << 24 | (b & 0x7F) << 20`, w · 2⁻¹²⁰. (`vpmovsxbd`
/// then a left shift by 20 gives the same bits; measured a little slower on Zen 3.)
#[derive(Clone, Copy)]
struct BitsDecode {
    ix0: __m256i,
    ix1: __m256i,
    keep: __m256i,
}

impl BitsDecode {
    /// The constants (in-lane `vpshufb` indices putting byte o + i in the top byte of lane i and
    /// zeros below: the high lane indexes its own copy of the 16 bytes).
    #[target_feature(enable = "avx2")]
    fn new() -> Self {
        let top = |o: i32| {
            let l = |i: i32| ((o + i) << 24) | 0x80_8080;
            _mm256_setr_epi32(l(0), l(1), l(2), l(3), l(4), l(5), l(6), l(7))
        };
        BitsDecode { ix0: top(0), ix1: top(8), keep: _mm256_set1_epi32(0x87F0_0000u32 as i32) }
    }

    /// Weight k's 16 bytes at `p`, decoded.
    ///
    /// # Safety
    /// `p` must point to 16 readable bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn k(&self, p: *const u8) -> (__m256, __m256) {
        // SAFETY: the caller's obligation: 16 readable bytes at `p`.
        let x = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p.cast()) });
        let w0 = _mm256_and_si256(_mm256_srai_epi32::<4>(_mm256_shuffle_epi8(x, self.ix0)), self.keep);
        let w1 = _mm256_and_si256(_mm256_srai_epi32::<4>(_mm256_shuffle_epi8(x, self.ix1)), self.keep);
        (_mm256_castsi256_ps(w0), _mm256_castsi256_ps(w1))
    }
}

/// A span's end in the AVX2 row kernels: row `r`'s span sums `part` of the groups `gi`, times the
/// span scales `sa[r][j] · sw[g][j]`, added to `total` and cleared for the next span.
#[inline(always)]
fn span_end(
    o: &Outer<'_>,
    j: usize,
    r: usize,
    gi: core::ops::Range<usize>,
    total: &mut [[f32; GROUP]; ROW_GROUPS],
    part: &mut [[f32; GROUP]; ROW_GROUPS],
) {
    for g in gi {
        let s = o.sa[r][j] * o.sw[g][j];
        for (x, p) in total[g].iter_mut().zip(part[g].iter_mut()) {
            *x += *p * s;
            *p = 0.0;
        }
    }
}

/// The AVX2 one-row kernel: [`fp8_group_avx2`]'s decode and arithmetic (so the same bits) on
/// [`ROW_GROUPS`] groups at once, both halves of each, for eight independent FMA chains: the
/// group kernel's one row has a single chain, whose latency (two dependent FMAs per k-pair)
/// bounded it to ~2 weight bytes per cycle. The block accumulators live in `out` (read and
/// written once per block), so that the eight chains, the two activations and the decode fit in
/// the sixteen ymm registers.
///
/// With `BITS` the weights are decoded straight into f32 bits, `w · 2⁻¹²⁰` (`vpshufb`, shift,
/// AND: three operations per 8 weights instead of the half decode's widening, five bit operations
/// and a `vcvtph2ps`), against activations taken as `a · 2¹¹²`: the products and FMA chains of
/// [`fp8_row_avx512vbmi`], so the same bits, for CPUs that take f32 subnormal operands at full
/// speed (E4M3 subnormal weights become f32 subnormals; [`crate::simd::fp8_row`] chooses).
/// Measured on AMD Zen 3, one row of Qwen2.5-0.5B's MXFP8 weight: docs/performance.md.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `g.check(rows)` must have passed for every group, all
/// with the same `v` and `kb`; with `BITS`, `v ≤ 32`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fp8_row_avx2<const BITS: bool>(
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    outer: Option<&Outer<'_>>,
    out: &mut [[f32; GROUP]; ROW_GROUPS],
) {
    const G: usize = ROW_GROUPS;
    let (v, kbs) = (gs[0].v, gs[0].kb);
    debug_assert!(!BITS || v <= 32);
    let a = rows.a[0];
    let pf = crate::simd::prefetch_weights();
    if pf {
        super::prefetch_starts(gs.each_ref().map(|g| g.w));
    }
    for o in out.iter_mut() {
        *o = [0.0; GROUP];
    }
    // With outer scales the blocks accumulate in `part`, which each span's end adds to `out`.
    let mut part = [[0f32; GROUP]; G];
    let (acc, mut total) = match outer {
        Some(_) => (&mut part, Some(out)),
        None => (out, None),
    };
    let dec = BitsDecode::new();
    // Past a group's end the weight and scale prefetches go to the next call's groups
    // (`RunOn`); the scales are streams of their own (16 bytes a block), which the loop
    // prefetches a line at a time, the first lines here. Measured, Qwen2.5-0.5B FP8 M = 1 from
    // DRAM on AMD Zen 3 (paired call by call): 0.92–0.94× the time at one and two threads
    // (the half decode: 0.96×), Llama-3-8B 0.99×, an L2/L3-hot weight 1.01×
    // (docs/performance.md).
    let (wrun, srun) = (RunOn::new(gs.each_ref().map(|g| g.w)), RunOn::new(gs.each_ref().map(|g| g.ws)));
    if pf {
        super::prefetch_heads(gs.each_ref().map(|g| g.ws), SCALES_AHEAD);
    }
    let mut up = [0f32; 32];
    for b in 0..kbs {
        let mut bs = [[_mm256_setzero_ps(); 2]; G];
        if pf && b % 4 == 0 {
            for g in gs {
                srun.prefetch(g.ws.as_ptr(), b * GROUP + SCALES_AHEAD);
            }
        }
        if BITS {
            // This block's activations times 2¹¹², where the FMAs broadcast them from.
            for (u, kk) in up.iter_mut().zip(b * v..(b + 1) * v) {
                // SAFETY: `check` proved a.len() ≥ kb · V > kk.
                *u = unsafe { at(a, kk) } * ACT_UP;
            }
            for (i, kk) in (b * v..(b + 1) * v).enumerate() {
                let a0 = _mm256_set1_ps(up[i]);
                for (g, s) in gs.iter().zip(bs.iter_mut()) {
                    let p = g.w.as_ptr().wrapping_add(kk * GROUP);
                    if pf && kk % 4 == 0 {
                        wrun.prefetch(g.w.as_ptr(), kk * GROUP + super::fp4::PREFETCH);
                    }
                    // Weight k, columns 0..8 and 8..16 ([`BitsDecode`]).
                    // SAFETY: `check` proved g.w.len() ≥ kb · V · 16 ≥ (kk + 1) · 16.
                    let (w0, w1) = unsafe { dec.k(p) };
                    s[0] = _mm256_fmadd_ps(a0, w0, s[0]);
                    s[1] = _mm256_fmadd_ps(a0, w1, s[1]);
                }
            }
        } else {
            for kk in (b * v..(b + 1) * v).step_by(2) {
                // SAFETY: `check` proved a.len() ≥ kb · V > kk + 1.
                let (a0, a1) = unsafe { (_mm256_set1_ps(at(a, kk)), _mm256_set1_ps(at(a, kk + 1))) };
                for (g, s) in gs.iter().zip(bs.iter_mut()) {
                    let p = g.w.as_ptr().wrapping_add(kk * GROUP);
                    if pf && kk % 4 == 0 {
                        wrun.prefetch(g.w.as_ptr(), kk * GROUP + super::fp4::PREFETCH);
                    }
                    // Weights k and k + 1, 16 columns each.
                    // SAFETY: `check` proved g.w.len() ≥ kb · V · 16 ≥ (kk + 2) · 16: both rows are
                    // in bounds.
                    let (x0, x1) = unsafe { (_mm_loadu_si128(p.cast()), _mm_loadu_si128(p.add(GROUP).cast())) };
                    let (w0l, w0h) = halves256(_mm256_cvtepu8_epi16(x0));
                    let (w1l, w1h) = halves256(_mm256_cvtepu8_epi16(x1));
                    s[0] = _mm256_fmadd_ps(a1, w1l, _mm256_fmadd_ps(a0, w0l, s[0]));
                    s[1] = _mm256_fmadd_ps(a1, w1h, _mm256_fmadd_ps(a0, w0h, s[1]));
                }
            }
        }
        for (g, (s, o)) in gs.iter().zip(bs.iter().zip(acc.iter_mut())) {
            // SAFETY: `check` proved ws.len() ≥ kb · 16 > b · 16 + 15; o holds 16 f32 (zeroed
            // before block 0).
            unsafe { block_end256(&scale_bytes256x2(g, b), rows.sc[0][b], s, o.as_mut_ptr(), false) };
        }
        if let (Some(o), Some(t)) = (outer, total.as_deref_mut())
            && let Some(j) = o.at_end(b, kbs)
        {
            span_end(o, j, 0, 0..G, t, acc);
        }
    }
}

/// The AVX2 kernel of a few rows (R = 2–4, a decode step's small batch): [`fp8_row_avx2`]'s
/// decodes and arithmetic (so the same bits) on the call's [`ROW_GROUPS`] groups in passes of G
/// (R · G ≤ 4: eight FMA chains, R · G · 2 accumulators beside the decode in the sixteen ymm
/// registers), each weight vector decoded once for the R rows. The group kernel it replaces had
/// one chain per row and half, two dependent FMAs per k-pair, and decoded its weights per group
/// again in every call: Llama-3-8B MXFP8 with two rows ran at 3.4× a plain read of the weight on
/// AMD Zen 3 (docs/performance.md). One k per step, the weights prefetched along each pass's
/// streams (`RunOn`: past a pass's end into the next pass's groups), the block scales too.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `rows.count == R`; `g.check(rows)` must have passed for
/// every group, all with the same `v` and `kb`; `v ≤ 32`; R · G ≤ 4 and G divides
/// [`ROW_GROUPS`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fp8_rows_avx2<const R: usize, const G: usize, const BITS: bool>(
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    outer: Option<&Outer<'_>>,
    mut out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) {
    debug_assert!(rows.count == R && R * G <= 4 && ROW_GROUPS.is_multiple_of(G));
    let (v, kbs) = (gs[0].v, gs[0].kb);
    debug_assert!(v <= 32);
    let pf = crate::simd::prefetch_weights();
    for o in out.iter_mut() {
        **o = [[0.0; GROUP]; ROW_GROUPS];
    }
    // With outer scales each span's sums start from zero in `part`; its end adds them to `out`.
    let mut part = [[[0f32; GROUP]; ROW_GROUPS]; R];
    let dec = BitsDecode::new();
    let mul = if BITS { ACT_UP } else { 1.0 };
    let mut up = [[0f32; 32]; R];
    for p0 in (0..ROW_GROUPS).step_by(G) {
        let pass: &[Fp8Group<'_>; G] = gs[p0..p0 + G].try_into().expect("G groups");
        let (wrun, srun) = (RunOn::new(pass.each_ref().map(|g| g.w)), RunOn::new(pass.each_ref().map(|g| g.ws)));
        if pf {
            super::prefetch_starts(pass.each_ref().map(|g| g.w));
            super::prefetch_heads(pass.each_ref().map(|g| g.ws), SCALES_AHEAD);
        }
        for b in 0..kbs {
            let mut bs = [[[_mm256_setzero_ps(); 2]; G]; R];
            if pf && b % 4 == 0 {
                for g in pass {
                    srun.prefetch(g.ws.as_ptr(), b * GROUP + SCALES_AHEAD);
                }
            }
            // The block's activations (times 2¹¹² for the f32-bits decode), where the FMAs
            // broadcast them from.
            for (u, a) in up.iter_mut().zip(rows.a) {
                for (x, kk) in u.iter_mut().zip(b * v..(b + 1) * v) {
                    // SAFETY: `check` proved a.len() ≥ kb · V > kk.
                    *x = unsafe { at(a, kk) } * mul;
                }
            }
            for (i, kk) in (b * v..(b + 1) * v).enumerate() {
                for (g, gb) in pass.iter().zip(0..G) {
                    let p = g.w.as_ptr().wrapping_add(kk * GROUP);
                    if pf && kk % 4 == 0 {
                        wrun.prefetch(g.w.as_ptr(), kk * GROUP + super::fp4::PREFETCH);
                    }
                    // Weight k, columns 0..8 and 8..16 (the decodes of `fp8_row_avx2`).
                    // SAFETY: `check` proved g.w.len() ≥ kb · V · 16 ≥ (kk + 1) · 16.
                    let (w0, w1) = unsafe {
                        if BITS { dec.k(p) } else { halves256(_mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast()))) }
                    };
                    for (s, u) in bs.iter_mut().zip(&up) {
                        let a = _mm256_set1_ps(u[i]);
                        s[gb][0] = _mm256_fmadd_ps(a, w0, s[gb][0]);
                        s[gb][1] = _mm256_fmadd_ps(a, w1, s[gb][1]);
                    }
                }
            }
            for (r, (sr, o)) in bs.iter().zip(out.iter_mut()).enumerate() {
                let acc: &mut [[f32; GROUP]; ROW_GROUPS] = if outer.is_some() { &mut part[r] } else { o };
                for (gb, (g, s)) in pass.iter().zip(sr).enumerate() {
                    // SAFETY: `check` proved ws.len() ≥ kb · 16 > b · 16 + 15; the group's 16
                    // accumulators are an array of 16 f32 (zeroed before block 0).
                    unsafe {
                        block_end256(&scale_bytes256x2(g, b), rows.sc[r][b], s, acc[p0 + gb].as_mut_ptr(), false)
                    };
                }
            }
            if let Some(o) = outer
                && let Some(j) = o.at_end(b, kbs)
            {
                for (r, (t, pr)) in out.iter_mut().zip(part.iter_mut()).enumerate() {
                    span_end(o, j, r, p0..p0 + G, t, pr);
                }
            }
        }
    }
}

/// `2¹¹²`: what [`fp8_row_avx512vbmi`] multiplies the activations by, since its decode leaves the
/// weights at `w · 2⁻¹²⁰` instead of `w · 2⁻⁸`.
const ACT_UP: f32 = f32::from_bits((127 + 112) << 23);

/// [`fp8_row_avx512`]'s arithmetic with a cheaper E4M3 decode, for CPUs with VBMI that take f32
/// subnormal operands at full speed ([`crate::simd::fp8_row`] chooses). `vpermb` puts weight byte
/// `b` in the top byte of an f32 lane, `vpsrad` by 4 moves its magnitude bits to 26..20 (exponent
/// 26..23, mantissa 22..20) with the sign still at 31, and an AND clears bits 30..27 and 19..0:
/// the f32 whose bits are `(b & 0x80) << 24 | (b & 0x7F) << 20`, exactly `w · 2⁻¹²⁰` (E4M3
/// subnormals become f32 subnormals `m · 2⁻¹²⁹`, which is why the CPU matters). Three integer
/// operations per 16 weights instead of the half decode's seven, two of which are `vcvtph2ps`,
/// the slowest.
///
/// The activations are taken as `a · 2¹¹²` (exact: E4M3 values as f32, |a| ≤ 448), so each
/// product `(a · 2¹¹²) · (w · 2⁻¹²⁰)` is the real number `a · (w · 2⁻⁸)` the half kernels form,
/// and every FMA rounds the same sum: the same bits as [`fp8_row_avx512`] in the canonical order
/// (NaN bytes give some finite value; their columns are computed exactly). The weights' next
/// kilobyte is prefetched where [`crate::simd::prefetch_weights`] says so.
///
/// # Safety
/// AVX-512 F, BW and VBMI must be available; `rows.count == R`; `g.check(rows)` must have passed
/// for every group, all with the same `v` and `kb`; `v` must be a multiple of 4 and at most 32.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(crate) unsafe fn fp8_row_avx512vbmi<const R: usize>(
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    outer: Option<&Outer<'_>>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) {
    const G: usize = ROW_GROUPS;
    debug_assert_eq!(rows.count, R);
    let (v, kbs) = (gs[0].v, gs[0].kb);
    debug_assert!(v.is_multiple_of(4) && v <= 32);
    let pf = crate::simd::prefetch_weights();
    if pf {
        super::prefetch_starts(gs.each_ref().map(|g| g.w));
    }
    // idx[i]: the top byte of f32 lane c takes byte 16i + c (weight k + i, column c); the lower
    // three bytes take byte 0, which the shift and the AND discard.
    let idx: [__m512i; 4] = std::array::from_fn(|i| {
        let mut b = [0u8; 64];
        for c in 0..GROUP {
            b[4 * c + 3] = (16 * i + c) as u8;
        }
        // SAFETY: `b` holds 64 bytes.
        unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
    });
    let keep = _mm512_set1_epi32(0x87F0_0000u32 as i32);
    let mut up = [[0f32; 32]; R];
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    let mut total = acc;
    for b in 0..kbs {
        // This block's activations times 2¹¹², where the FMAs broadcast them from.
        for (u, a) in up.iter_mut().zip(rows.a) {
            for (u, &x) in u.iter_mut().zip(&a[b * v..(b + 1) * v]) {
                *u = x * ACT_UP;
            }
        }
        let mut bs = [[_mm512_setzero_ps(); G]; R];
        for kq in (0..v).step_by(4) {
            let k0 = b * v + kq;
            for (gi, g) in gs.iter().enumerate() {
                if pf {
                    super::prefetch_t0(g.w.as_ptr().wrapping_add(k0 * GROUP + super::fp4::PREFETCH));
                }
                // SAFETY: `check` proved g.w.len() ≥ kb · V · 16 ≥ (k0 + 4) · 16.
                let x = unsafe { _mm512_loadu_si512(g.w.as_ptr().add(k0 * GROUP).cast()) };
                for (i, ix) in idx.iter().enumerate() {
                    let top = _mm512_permutexvar_epi8(*ix, x);
                    let w = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srai_epi32::<4>(top), keep));
                    for r in 0..R {
                        bs[r][gi] = _mm512_fmadd_ps(_mm512_set1_ps(up[r][kq + i]), w, bs[r][gi]);
                    }
                }
            }
        }
        // SAFETY: `check` passed for every group (the caller's obligation) and b < kb.
        unsafe { rows_block_end(gs, rows, b, &bs, &mut acc) };
        outer_end(outer, b, kbs, &mut acc, &mut total);
    }
    rows_store(out, if outer.is_some() { &total } else { &acc });
}

/// Decodes blocks `b0 .. b1` of the groups `gs` (1 or 2, same `v`) into `dst[(kk − b0·V)·16·G +
/// g·16 + c]` as f32 `w · 2⁻⁸`: the instructions of [`fp8_group_avx512`], so the same values it
/// forms in registers (NaN bytes give some value: their columns are computed exactly).
///
/// # Safety
/// AVX-512 F and BW must be available; `g.check(..)` must have passed for every group, `b1 ≤ kb`,
/// and `dst.len() ≥ (b1 − b0) · V · 16 · gs.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn fp8_decode_avx512(gs: &[Fp8Group<'_>], b0: usize, b1: usize, dst: &mut [f32]) {
    let (v, gn) = (gs[0].v, gs.len());
    let d = dst.as_mut_ptr();
    for (gi, g) in gs.iter().enumerate() {
        for kk in (b0 * v..b1 * v).step_by(2) {
            // SAFETY: the weight bytes of k-pair kk are in w (`check`: w.len() ≥ kb · V · 16 and
            // kk + 2 ≤ b1 · V); rows kk − b0·V and kk + 1 − b0·V of dst exist (dst.len() above).
            unsafe {
                let (w0, w1) = decode_pair(g, kk);
                let row = d.add(((kk - b0 * v) * gn + gi) * GROUP);
                _mm512_storeu_ps(row, w0);
                _mm512_storeu_ps(row.add(gn * GROUP), w1);
            }
        }
        // The loads above waited on L3 without this: measured, this decode was 17 % of the tile
        // kernel's time.
        prefetch_next_slice(g, b0, b1);
    }
}

/// Blocks `b0 .. b1` of R rows × G groups (1 or 2) from weights decoded by [`fp8_decode_avx512`]:
/// per block the chain `bs = fma(a_k, w_k, bs)` in k order, then `acc = fma(bs, s, acc)` with the
/// accumulator read from and written to `out[r·ld + g·16 + c]` (0 before block 0) — the
/// canonical order, so the bits of [`fp8_group_avx512`]. The weights are decoded once per tile
/// and read from L1 by every row chunk (the group kernel decodes them again for each chunk:
/// 10 of its 26 vector operations per k-pair).
///
/// # Safety
/// AVX-512 F must be available; `g.check(rows)` must have passed for every group in `gs` (G of
/// them, same `v`, `kb`), `b1 ≤ kb`, `wd` as [`fp8_decode_avx512`] fills it for (`gs`, `b0`,
/// `b1`), and `out.len() ≥ (R − 1) · ld + 16 · G`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn fp8_decoded_avx512<const R: usize, const G: usize>(
    wd: &[f32],
    gs: &[Fp8Group<'_>],
    b0: usize,
    b1: usize,
    rows: &Fp8Rows<'_>,
    out: &mut [f32],
    ld: usize,
) {
    debug_assert!(rows.count == R && gs.len() == G && wd.len() >= (b1 - b0) * gs[0].v * GROUP * G);
    debug_assert!(out.len() >= (R - 1) * ld + GROUP * G);
    let v = gs[0].v;
    let (wp, op) = (wd.as_ptr(), out.as_mut_ptr());
    for b in b0..b1 {
        let mut bs = [[_mm512_setzero_ps(); G]; R];
        let wb = (b - b0) * v * GROUP * G;
        for kk in 0..v {
            // SAFETY: row kk of block b's decoded weights is in wd (length above).
            let w: [__m512; G] = std::array::from_fn(|g| unsafe { _mm512_loadu_ps(wp.add(wb + (kk * G + g) * GROUP)) });
            for r in 0..R {
                // SAFETY: `check` proved a.len() ≥ kb · V > b · V + kk.
                let a = _mm512_set1_ps(unsafe { at(rows.a[r], b * v + kk) });
                for g in 0..G {
                    bs[r][g] = _mm512_fmadd_ps(a, w[g], bs[r][g]);
                }
            }
        }
        for g in 0..G {
            // The weight scales 2^(sb − 127) (sb = 0 gives the subnormal 2^-127, exactly), then
            // per row `s = scalef(2^(sb − 127), e − 119)`: the group kernel's
            // `clamp(sb + e − 119, 0, 255) << 23` wherever that product is used — an exponent sum
            // in 1 ..= 254 gives the same power of two, ≥ 255 gives +∞ in both, and a sum ≤ 0 or a
            // NaN scale (sb = 255) sends the element to the exact path (`may_underflow`,
            // `nan_col`). With the accumulation: two operations per row and group instead of five.
            // SAFETY: `check` proved ws.len() ≥ kb · 16 > b · 16 + 15.
            let sb = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(gs[g].ws.as_ptr().add(b * GROUP).cast())) };
            let e = _mm512_sub_ps(_mm512_cvtepi32_ps(sb), _mm512_set1_ps(127.0));
            let ws = _mm512_scalef_ps(_mm512_set1_ps(1.0), e);
            for r in 0..R {
                // SAFETY: `check` proved scf.len() ≥ kb > b.
                let s = _mm512_scalef_ps(ws, _mm512_set1_ps(unsafe { at(rows.scf[r], b) }));
                // SAFETY: r · ld + g · 16 + 16 ≤ out.len() (above).
                unsafe {
                    let p = op.add(r * ld + g * GROUP);
                    let acc = if b == 0 { _mm512_setzero_ps() } else { _mm512_loadu_ps(p) };
                    _mm512_storeu_ps(p, _mm512_fmadd_ps(bs[r][g], s, acc));
                }
            }
        }
    }
}
