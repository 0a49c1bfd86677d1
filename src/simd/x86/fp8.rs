//! AVX2 and AVX-512 MXFP8 group kernels (the canonical order is in `crate::simd::fp8`): E4M3
//! weight bytes become IEEE half bits `(b << 9) >> 2 | (b << 8) & 0x8000` (= value · 2⁻⁸) in
//! 16-bit lanes, `vcvtph2ps` widens them, and each row's block sum is a chain of f32 FMAs with the
//! activation broadcast from memory.

use crate::simd::fp8::{Fp8Group, Fp8Rows};
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

/// The E8M0 block-scale products `s · 2⁸` of 8 or 16 columns (scale bytes widened to i32 in
/// `sb`) for a row's exponent offset `sc`: `clamp(sb + sc, 0, 255) << 23` as f32 bits.
macro_rules! scale {
    ($add:ident, $min:ident, $max:ident, $set1:ident, $zero:ident, $sll:ident, $cast:ident, $sb:expr, $sc:expr) => {{
        let e = $add($sb, $set1($sc as i32));
        $cast($sll::<23>($min($max(e, $zero()), $set1(255))))
    }};
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
    let sign = _mm512_set1_epi16(0x8000u16 as i16);
    let v = g.v;
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..g.kb {
        let mut bs = [_mm512_setzero_ps(); R];
        // Two k per step: 32 bytes → 32 halves in one zmm.
        for kk in (b * v..(b + 1) * v).step_by(2) {
            // SAFETY: `check` proved w.len() ≥ kb · V · 16 ≥ (kk + 2) · 16.
            let x = unsafe { _mm512_cvtepu8_epi16(_mm256_loadu_si256(g.w.as_ptr().add(kk * GROUP).cast())) };
            let mag = _mm512_srli_epi16::<2>(_mm512_slli_epi16::<9>(x));
            // sign ? (x << 8) : mag, bit by bit (0xD8: C ? B : A).
            let h = _mm512_ternarylogic_epi32::<0xD8>(mag, _mm512_slli_epi16::<8>(x), sign);
            let w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
            let w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h));
            for r in 0..R {
                // SAFETY: `check` proved a.len() ≥ kb · V > kk + 1.
                let (a0, a1) = unsafe { (at(rows.a[r], kk), at(rows.a[r], kk + 1)) };
                bs[r] = _mm512_fmadd_ps(_mm512_set1_ps(a1), w1, _mm512_fmadd_ps(_mm512_set1_ps(a0), w0, bs[r]));
            }
        }
        // SAFETY: `check` proved ws.len() ≥ kb · 16.
        let sb = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(g.ws.as_ptr().add(b * GROUP).cast())) };
        for r in 0..R {
            let s = scale!(
                _mm512_add_epi32,
                _mm512_min_epi32,
                _mm512_max_epi32,
                _mm512_set1_epi32,
                _mm512_setzero_si512,
                _mm512_slli_epi32,
                _mm512_castsi512_ps,
                sb,
                rows.sc[r][b]
            );
            acc[r] = _mm512_fmadd_ps(bs[r], s, acc[r]);
        }
    }
    for r in 0..R {
        // SAFETY: out[r] holds 16 f32.
        unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
    }
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
    let sign = _mm256_set1_epi16(0x8000u16 as i16);
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
                let mag = _mm256_srli_epi16::<2>(_mm256_slli_epi16::<9>(x));
                let h = _mm256_or_si256(mag, _mm256_and_si256(_mm256_slli_epi16::<8>(x), sign));
                let w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
                let w1 = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h));
                for r in 0..R {
                    // SAFETY: `check` proved a.len() ≥ kb · V > kk + 1.
                    let (a0, a1) = unsafe { (at(rows.a[r], kk), at(rows.a[r], kk + 1)) };
                    bs[r] = _mm256_fmadd_ps(_mm256_set1_ps(a1), w1, _mm256_fmadd_ps(_mm256_set1_ps(a0), w0, bs[r]));
                }
            }
            // SAFETY: `check` proved ws.len() ≥ kb · 16.
            let sb = unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(g.ws.as_ptr().add(b * GROUP + half * 8).cast())) };
            for r in 0..R {
                let s = scale!(
                    _mm256_add_epi32,
                    _mm256_min_epi32,
                    _mm256_max_epi32,
                    _mm256_set1_epi32,
                    _mm256_setzero_si256,
                    _mm256_slli_epi32,
                    _mm256_castsi256_ps,
                    sb,
                    rows.sc[r][b]
                );
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

/// One activation row against [`ROW_GROUPS`] adjacent groups (decode, M = 1): per column the
/// arithmetic of [`fp8_group_avx512`] (so the same bits), with one FMA chain per group where a
/// single group has one: that chain's latency, not the weight bytes, bounded the one-row loop.
///
/// # Safety
/// AVX-512 F and BW must be available; `g.check(rows)` must have passed for every group, all
/// with the same `v` and `kb`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn fp8_row_avx512(
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    out: &mut [[f32; GROUP]; ROW_GROUPS],
) {
    const G: usize = ROW_GROUPS;
    let sign = _mm512_set1_epi16(0x8000u16 as i16);
    let (v, kbs) = (gs[0].v, gs[0].kb);
    let a = rows.a[0];
    let mut acc = [_mm512_setzero_ps(); G];
    for b in 0..kbs {
        let mut bs = [_mm512_setzero_ps(); G];
        for kk in (b * v..(b + 1) * v).step_by(2) {
            // SAFETY: `check` proved a.len() ≥ kb · V > kk + 1.
            let (a0, a1) = unsafe { (_mm512_set1_ps(at(a, kk)), _mm512_set1_ps(at(a, kk + 1))) };
            for (g, s) in gs.iter().zip(bs.iter_mut()) {
                // SAFETY: `check` proved g.w.len() ≥ kb · V · 16 ≥ (kk + 2) · 16.
                let x = unsafe { _mm512_cvtepu8_epi16(_mm256_loadu_si256(g.w.as_ptr().add(kk * GROUP).cast())) };
                let mag = _mm512_srli_epi16::<2>(_mm512_slli_epi16::<9>(x));
                let h = _mm512_ternarylogic_epi32::<0xD8>(mag, _mm512_slli_epi16::<8>(x), sign);
                let w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
                let w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h));
                *s = _mm512_fmadd_ps(a1, w1, _mm512_fmadd_ps(a0, w0, *s));
            }
        }
        for (g, (s, ac)) in gs.iter().zip(bs.iter().zip(acc.iter_mut())) {
            // SAFETY: `check` proved g.ws.len() ≥ kb · 16.
            let sb = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(g.ws.as_ptr().add(b * GROUP).cast())) };
            let sc = scale!(
                _mm512_add_epi32,
                _mm512_min_epi32,
                _mm512_max_epi32,
                _mm512_set1_epi32,
                _mm512_setzero_si512,
                _mm512_slli_epi32,
                _mm512_castsi512_ps,
                sb,
                rows.sc[0][b]
            );
            *ac = _mm512_fmadd_ps(*s, sc, *ac);
        }
    }
    for (o, ac) in out.iter_mut().zip(acc) {
        // SAFETY: o holds 16 f32.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), ac) };
    }
}
