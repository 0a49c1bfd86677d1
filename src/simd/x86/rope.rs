//! RoPE on x86: the AVX2 (8 f32 lanes) and AVX-512 (16) levels' [`Lanes`] — the vector
//! operations the kernels of [`crate::simd::rope_lanes`] are written with — and their entry
//! points; bf16/f16 ↔ f32 conversions. `MaxCompat` rounds after each operation: bf16 by integer
//! round-to-nearest-even (NaN made quiet, as `half` does), f16 by `vcvtps2ph`/`vcvtph2ps` (what
//! `half` uses on these CPUs).

use crate::simd::rope::{RopeRow, Round};
pub(crate) use crate::simd::rope_lanes::{BF16, F16, F32};
use crate::simd::rope_lanes::{Forms, Lanes, heads_any, heads_half, level_fns, rotate, token};
use std::arch::x86_64::*;

/// The levels' [`Forms`]: 32, 16 and 64 over the lanes (16 for AVX-512, 8 for AVX2) vectors.
type Forms512 = Forms<__m512, 2, 1, 4>;
type Forms256 = Forms<__m256, 4, 2, 8>;

/// `a ^ b` on the bits (`_mm512_xor_ps` needs AVX-512 DQ, which the `Avx512` level does not
/// require: without the feature the intrinsic compiled to a call per use).
#[target_feature(enable = "avx512f")]
#[inline]
fn xor512(a: __m512, b: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)))
}

// ---------------------------------------------------------------------------------------------
// AVX-512 (16 lanes)

#[target_feature(enable = "avx512f")]
#[inline]
fn round512(v: __m512, r: Round) -> __m512 {
    match r {
        Round::None => v,
        Round::Bf16 => {
            // x + 0x7FFF + lsb, the lsb tested into a mask (no shift: 512-bit shifts issue on
            // one port only, and this is the kernels' busiest step); NaN made quiet instead.
            let x = _mm512_castps_si512(v);
            let odd = _mm512_test_epi32_mask(x, _mm512_set1_epi32(0x1_0000));
            let rne = _mm512_mask_add_epi32(
                _mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)),
                odd,
                x,
                _mm512_set1_epi32(0x8000),
            );
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            let y = _mm512_mask_or_epi32(rne, nan, x, _mm512_set1_epi32(0x0040_0000));
            _mm512_castsi512_ps(_mm512_and_si512(y, _mm512_set1_epi32(0xFFFF_0000u32 as i32)))
        }
        Round::F16 => _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)),
    }
}

/// # Safety
/// AVX-512 F and BW must be available; `row` holds the forms of `x.len()` rotary dims (`c`, `s`:
/// `x.len() / 2`; `f`, `fsw`: `x.len()` when `interleaved`).
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn rotate_avx512(x: &mut [f32], row: &RopeRow<'_>, interleaved: bool, r: Round) {
    // SAFETY: the caller's contract is `rotate`'s, on this level.
    unsafe { rotate::<Avx512>(x, row, interleaved, r) }
}

/// [`RopeRow::fill`]'s half-split forms from an f32 freqs row (`c0, s0, c1, s1, …`) of whole
/// 32-pair chunks: `c`, `s`, and `cd`, `sd` de-interleaved per chunk, NaN made the default NaN —
/// the same values, by 8 two-source permutes per chunk instead of a loop per value (the loop was
/// 14 % of a Qwen-shaped bf16 RoPE call: one fill per token).
///
/// # Safety
/// AVX-512 F must be available; `c`, `s`, `cd`, `sd` have the same length h, a multiple of 32,
/// and `row.len() == 2h`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn fill_half_avx512(row: &[f32], c: &mut [f32], s: &mut [f32], cd: &mut [f32], sd: &mut [f32]) {
    let h = c.len();
    debug_assert!(h.is_multiple_of(32) && row.len() == 2 * h && s.len() == h && cd.len() == h && sd.len() == h);
    for b in (0..h).step_by(32) {
        // SAFETY: values 2b .. 2b + 64 of row (2b + 64 ≤ 2h) and b .. b + 32 of each form.
        unsafe {
            let f = chunk_forms::<F32>(row.as_ptr().add(2 * b).cast(), true);
            for (j, (v, w)) in f.c[..2].iter().zip(&f.s[..2]).enumerate() {
                _mm512_storeu_ps(c.as_mut_ptr().add(b + 16 * j), *v);
                _mm512_storeu_ps(s.as_mut_ptr().add(b + 16 * j), *w);
            }
            let [ce, co, se, so] = f.d[0];
            _mm512_storeu_ps(cd.as_mut_ptr().add(b), ce);
            _mm512_storeu_ps(cd.as_mut_ptr().add(b + 16), co);
            _mm512_storeu_ps(sd.as_mut_ptr().add(b), se);
            _mm512_storeu_ps(sd.as_mut_ptr().add(b + 16), so);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2 (8 lanes)

/// [`fill_half_avx512`] on AVX2: the same values, de-interleaved by `vshufps` + `vpermpd` (two
/// operations per 8 values) instead of the portable loop per value (which was 10 % of a
/// Qwen-shaped bf16 RoPE call on Zen 3 with the data in L1; 8 Qwen tokens, best of 20000 calls,
/// three alternating runs: 1.92–2.00 → 1.80–1.82 µs).
///
/// # Safety
/// AVX2 must be available; as [`fill_half_avx512`] otherwise.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn fill_half_avx2(row: &[f32], c: &mut [f32], s: &mut [f32], cd: &mut [f32], sd: &mut [f32]) {
    let h = c.len();
    debug_assert!(h.is_multiple_of(32) && row.len() == 2 * h && s.len() == h && cd.len() == h && sd.len() == h);
    let canon = default_nan256;
    // The even and the odd elements of the 16 values a, b, in order.
    let split = |a: __m256, b: __m256| {
        let e = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(_mm256_shuffle_ps::<0x88>(a, b))));
        let o = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(_mm256_shuffle_ps::<0xDD>(a, b))));
        (e, o)
    };
    for b in (0..h).step_by(32) {
        // SAFETY: values 2b .. 2b + 64 of row (2b + 64 ≤ 2h) and b .. b + 32 of each form.
        unsafe {
            let p = row.as_ptr().add(2 * b);
            let f: [__m256; 8] = std::array::from_fn(|i| canon(_mm256_loadu_ps(p.add(8 * i))));
            let mut cv = [_mm256_setzero_ps(); 4];
            let mut sv = [_mm256_setzero_ps(); 4];
            for j in 0..4 {
                (cv[j], sv[j]) = split(f[2 * j], f[2 * j + 1]);
                _mm256_storeu_ps(c.as_mut_ptr().add(b + 8 * j), cv[j]);
                _mm256_storeu_ps(s.as_mut_ptr().add(b + 8 * j), sv[j]);
            }
            for (v, out) in [(cv, cd.as_mut_ptr()), (sv, sd.as_mut_ptr())] {
                let (e0, o0) = split(v[0], v[1]);
                let (e1, o1) = split(v[2], v[3]);
                _mm256_storeu_ps(out.add(b), e0);
                _mm256_storeu_ps(out.add(b + 8), e1);
                _mm256_storeu_ps(out.add(b + 16), o0);
                _mm256_storeu_ps(out.add(b + 24), o1);
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn round256(v: __m256, r: Round) -> __m256 {
    match r {
        Round::None => v,
        Round::Bf16 => {
            let x = _mm256_castps_si256(v);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(x), _mm256_set1_epi32(1));
            let rne = _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb);
            let quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x0040_0000));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            let y = _mm256_blendv_epi8(rne, quiet, nan);
            _mm256_castsi256_ps(_mm256_and_si256(y, _mm256_set1_epi32(0xFFFF_0000u32 as i32)))
        }
        Round::F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)),
    }
}

/// # Safety
/// AVX2, FMA and F16C must be available; `row` as in [`rotate_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rotate_avx2(x: &mut [f32], row: &RopeRow<'_>, interleaved: bool, r: Round) {
    // SAFETY: the caller's contract is `rotate`'s, on this level.
    unsafe { rotate::<Avx2>(x, row, interleaved, r) }
}

// ---------------------------------------------------------------------------------------------
// Conversions (AVX2 + F16C: every x86 level the fast paths use)

/// `dst[i] = f32(src[i])` for bf16 (`bf16`) or f16 bits.
///
/// # Safety
/// AVX2 and F16C must be available; `src` points at `dst.len()` readable u16.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn widen16(src: *const u16, dst: &mut [f32], bf16: bool) {
    let n = dst.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 u16 at src + i and 8 f32 at dst + i are in bounds (i + 8 ≤ n).
        unsafe {
            let h = _mm_loadu_si128(src.add(i).cast());
            let v = if bf16 {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            } else {
                _mm256_cvtph_ps(h)
            };
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), v);
        }
        i += 8;
    }
    // SAFETY: the caller's contract, from element i on.
    unsafe { super::super::rope::widen16_tail(src, dst, i, bf16) }
}

/// `dst[i] = bf16/f16(src[i])`, round to nearest even, NaN made quiet (as `half`).
///
/// # Safety
/// AVX2 and F16C must be available; `dst` points at `src.len()` writable u16.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn narrow16(src: &[f32], dst: *mut u16, bf16: bool) {
    let n = src.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 f32 at src + i and 8 u16 at dst + i are in bounds (i + 8 ≤ n).
        unsafe {
            let v = _mm256_loadu_ps(src.as_ptr().add(i));
            let h = if bf16 {
                let b = _mm256_srli_epi32::<16>(_mm256_castps_si256(round256(v, Round::Bf16)));
                // Pack the 8 u32 (< 2^16) to u16 in lane order.
                let lo = _mm256_castsi256_si128(b);
                let hi = _mm256_extracti128_si256::<1>(b);
                _mm_packus_epi32(lo, hi)
            } else {
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)
            };
            _mm_storeu_si128(dst.add(i).cast(), h);
        }
        i += 8;
    }
    // SAFETY: the caller's contract, from element i on.
    unsafe { super::super::rope::narrow16_tail(src, dst, i, bf16) }
}

/// [`narrow16`] on AVX-512, 16 at a time ([`store512`]: the same rounding as [`narrow16`]'s,
/// [`round512`] being [`round256`] on 16 lanes), the rest by [`narrow16`]. A KV store of f32
/// values into a bf16 cache, 64 Llama-shaped tokens on one Zen 5 core: 2.6 µs, 5.6 forced to
/// `narrow16` (AVX2). (Widening on
/// AVX-512 measured no faster than `widen16`, 2.16–2.18 against 2.05–2.13 µs for bf16 values
/// into an f32 cache, so there is no `widen16_avx512`.)
///
/// # Safety
/// AVX-512 F and BW must be available; otherwise as [`narrow16`].
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn narrow16_avx512(src: &[f32], dst: *mut u16, bf16: bool) {
    let n = src.len();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 f32 at src + i and 16 u16 at dst + i are in bounds (i + 16 ≤ n).
        unsafe {
            let (v, p) = (_mm512_loadu_ps(src.as_ptr().add(i)), dst.add(i).cast::<u8>());
            if bf16 { store512::<BF16>(p, v) } else { store512::<F16>(p, v) }
        }
        i += 16;
    }
    // SAFETY: the caller's contract, from element i on (AVX2, FMA and F16C are part of every
    // AVX-512 level these kernels run on).
    unsafe { narrow16(&src[i..], dst.add(i), bf16) }
}

/// `dst[i] = src[i]` for bf16 (`bf16`) or f16 bits, a NaN made quiet (its quiet bit set): the
/// oracle's `from_f32(to_f32(v))` within one 16-bit type, which is exact for every other value
/// (the KV stores of a cache's own type).
///
/// # Safety
/// AVX2 must be available; `src` points at `n` readable u16 and `dst` at `n` writable u16.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn copy16(src: *const u16, dst: *mut u16, n: usize, bf16: bool) {
    let (inf, quiet) = if bf16 { (0x7F80, 0x0040) } else { (0x7C00, 0x0200) };
    let (abs, inf, quiet) = (_mm256_set1_epi16(0x7FFF), _mm256_set1_epi16(inf), _mm256_set1_epi16(quiet));
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 u16 at src + i and at dst + i are in bounds (i + 16 ≤ n).
        unsafe {
            let v = _mm256_loadu_si256(src.add(i).cast());
            // NaN: magnitude above infinity's (a signed compare: both are below 0x8000).
            let nan = _mm256_cmpgt_epi16(_mm256_and_si256(v, abs), inf);
            _mm256_storeu_si256(dst.add(i).cast(), _mm256_or_si256(v, _mm256_and_si256(nan, quiet)));
        }
        i += 16;
    }
    // SAFETY: the caller's contract, from element i on.
    unsafe { super::super::rope::copy16_tail(src, dst, n, i, bf16) }
}

/// [`copy16`] on AVX-512, 32 at a time (64-byte loads and stores: a store-bound copy).
///
/// # Safety
/// AVX-512 F and BW must be available; otherwise as [`copy16`].
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn copy16_avx512(src: *const u16, dst: *mut u16, n: usize, bf16: bool) {
    let (inf, quiet) = if bf16 { (0x7F80, 0x0040) } else { (0x7C00, 0x0200) };
    let (abs, inf, quiet) = (_mm512_set1_epi16(0x7FFF), _mm512_set1_epi16(inf), _mm512_set1_epi16(quiet));
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: 32 u16 at src + i and at dst + i are in bounds (i + 32 ≤ n).
        unsafe {
            let v = _mm512_loadu_si512(src.add(i).cast());
            let nan = _mm512_cmpgt_epu16_mask(_mm512_and_si512(v, abs), inf);
            _mm512_storeu_si512(dst.add(i).cast(), _mm512_mask_blend_epi16(nan, v, _mm512_or_si512(v, quiet)));
        }
        i += 32;
    }
    // SAFETY: the caller's contract, from element i on (AVX2 is part of every AVX-512 level
    // these kernels run on).
    unsafe { copy16(src.add(i), dst.add(i), n - i, bf16) }
}

// ---------------------------------------------------------------------------------------------
// Whole heads in place (the standalone RoPE's inner loop): load the element type, rotate, store,
// with no intermediate buffer. The levels' loads, stores and bf16 joins first, then the kernels
// written once over both (`Lanes`).

#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load512<const K: u8>(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 16 elements at p.
    unsafe {
        match K {
            BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
            _ => _mm512_loadu_ps(p.cast()),
        }
    }
}

#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store512<const K: u8>(p: *mut u8, v: __m512) {
    // SAFETY: the caller guarantees room for 16 elements at p.
    unsafe {
        match K {
            BF16 => {
                let b = _mm512_srli_epi32::<16>(_mm512_castps_si512(round512(v, Round::Bf16)));
                _mm256_storeu_si256(p.cast(), _mm512_cvtepi32_epi16(b));
            }
            F16 => {
                _mm256_storeu_si256(p.cast(), _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v))
            }
            _ => _mm512_storeu_ps(p.cast(), v),
        }
    }
}

/// The even and odd bf16 elements of 32 at `p`, widened to f32 (exact) and rounded as `r` says.
///
/// # Safety
/// AVX-512 F must be available; 64 readable bytes at `p`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn split_bf16(p: *const u8, r: Round) -> (__m512, __m512) {
    // SAFETY: the caller guarantees 64 bytes at p.
    let v = unsafe { _mm512_loadu_si512(p.cast()) };
    let e = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
    let o = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF_0000u32 as i32)));
    (round512(e, r), round512(o, r))
}

/// Stores the even (`e`) and odd (`o`) lanes as 32 bf16 at `p`, each rounded once to nearest even,
/// working on 16-bit lanes (fewer operations than rounding each half and joining, on the ports
/// this loop is bound by): `hi` holds every value's truncated bf16 in its final place and `lo` the
/// bits rounding drops. A value rounds up when `lo > 0x8000`, or `lo == 0x8000` with `hi` odd,
/// that is when `lo | (hi & 1) > 0x8000` (unsigned). Rounding up the largest finite value gives
/// infinity, as `half` does. A NaN is never rounded up, because every NaN reaching here has
/// `lo == 0`: the kernels' inputs are bf16 values (zero low bits), [`RopeRow::fill`] makes NaN
/// freqs the default NaN, and x86 arithmetic returns one of its operands' NaNs (quieted) or the
/// default NaN. So the bits equal `half`'s conversion (which would also quiet a signalling NaN:
/// none arrives here).
///
/// # Safety
/// AVX-512 F and BW must be available; 64 writable bytes at `p`; NaNs in `e`, `o` as above.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn join_bf16(p: *mut u8, e: __m512, o: __m512) {
    let (e, o) = (_mm512_castps_si512(e), _mm512_castps_si512(o));
    let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let one = _mm512_set1_epi16(1);
    // `select(a, b, m)`: bits of `a` where `m` is set, of `b` elsewhere.
    let hi = _mm512_ternarylogic_epi32::<0xE4>(o, _mm512_srli_epi32::<16>(e), high);
    let lo = _mm512_ternarylogic_epi32::<0xE4>(_mm512_slli_epi32::<16>(o), e, high);
    let t = _mm512_ternarylogic_epi32::<0xF8>(lo, hi, one); // lo | (hi & 1)
    let up = _mm512_cmpgt_epu16_mask(t, _mm512_set1_epi16(0x8000u16 as i16));
    // hi + 1 where `up`, by one masked `vpaddw`: `_mm512_mask_add_epi16(hi, up, hi, one)` compiles
    // to `vpmovm2w` + `vpsubw` (LLVM's canonical select of an increment), one operation more on
    // the two vector ports this loop is bound by (measured: the RoPE of 64 Llama-shaped bf16
    // tokens about 8 % faster, one core, Intel Xeon).
    let mut y = hi;
    // SAFETY: a register-only instruction of AVX-512 BW (enabled on this function); it reads and
    // writes no memory, the stack or the flags.
    unsafe {
        std::arch::asm!(
            "vpaddw {y}{{{k}}}, {y}, {one}",
            y = inout(zmm_reg) y,
            k = in(kreg) up,
            one = in(zmm_reg) one,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    // SAFETY: the caller guarantees 64 bytes at p.
    unsafe { _mm512_storeu_si512(p.cast(), y) }
}

/// [`join_bf16`] by `vcvtne2ps2bf16` (AVX-512 BF16): one conversion rounds both vectors to
/// nearest even (concatenated: the even lanes' 16 bf16, then the odd lanes'), one `vpermw`
/// interleaves them. The instruction flushes subnormal inputs to ±0 and otherwise equals `half`'s
/// rounding, NaN included (it quiets a NaN as `half` does; measured on every f32 class, scratch
/// test over 2·10^7 random bit patterns on Zen 5: subnormals are the only difference). A
/// subnormal therefore always shows as a ±0 word; where any word is ±0 the vectors are stored
/// again by [`join_bf16`] (a true zero is rare in activations and costs only that slower join).
/// So the bits are [`join_bf16`]'s. Zen 5: the 64-dim-head bf16 step ~17 % faster in L1 (scratch
/// micro-benchmark, 5.3–5.4 → 4.4–4.5 TSC per 32-pair step); the join was the step's largest
/// part after the multiplies.
///
/// # Safety
/// AVX-512 F, BW and BF16 must be available; otherwise as [`join_bf16`].
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn join_bf16_cvt(p: *mut u8, e: __m512, o: __m512) {
    // SAFETY: the caller guarantees AVX-512 BF16.
    let r = unsafe { cvt2_bf16(e, o) };
    if _mm512_testn_epi16_mask(r, _mm512_set1_epi16(0x7FFF)) != 0 {
        // NaNs made the default NaN first: `join_bf16` needs NaNs with zero low bits, which the
        // CVT token kernels do not guarantee (they skip that step on their freqs, see
        // `token_avx512`).
        // SAFETY: the caller's contract is join_bf16's, NaNs now the default NaN.
        unsafe { join_bf16(p, default_nan512(e), default_nan512(o)) };
        return;
    }
    // SAFETY: the caller guarantees 64 bytes at p.
    unsafe { store_interleaved(p, r) }
}

/// `vcvtne2ps2bf16`: the even lanes' 16 values `e` then the odd lanes' `o`, rounded to bf16
/// (nearest even; subnormal inputs flushed to ±0, NaNs kept NaN).
///
/// # Safety
/// AVX-512 BF16 must be available.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn cvt2_bf16(e: __m512, o: __m512) -> __m512i {
    let r: __m512i;
    // SAFETY: a register-only instruction of AVX-512 BF16 (the caller guarantees it); it reads
    // and writes no memory, the stack or the flags, and does not consult MXCSR. Issued by `asm!`
    // because LLVM scalarised a mask test of the intrinsic's `__m512bh` result (~50× slower).
    unsafe {
        std::arch::asm!(
            "vcvtne2ps2bf16 {r}, {o}, {e}",
            r = lateout(zmm_reg) r,
            o = in(zmm_reg) o,
            e = in(zmm_reg) e,
            options(pure, nomem, nostack, preserves_flags),
        );
    }
    r
}

/// Stores [`cvt2_bf16`]'s result with the even and odd values interleaved again (one `vpermw`).
///
/// # Safety
/// AVX-512 F and BW must be available; 64 writable bytes at `p`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn store_interleaved(p: *mut u8, r: __m512i) {
    // Word w of the result: the even value w / 2 (word w / 2 of the conversion) for even w, the
    // odd value (word 16 + w / 2) for odd w.
    let idx = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
        16, 0,
    );
    // SAFETY: the caller guarantees 64 bytes at p.
    unsafe { _mm512_storeu_si512(p.cast(), _mm512_permutexvar_epi16(idx, r)) }
}

/// [`join_bf16_cvt`] when `CVT`, else [`join_bf16`] (the same bits). `CVT` and `ACC`: the
/// conversion's result stored without [`join_bf16_cvt`]'s check, its ±0 words gathered into
/// `acc` instead (the lanes of `acc` that are zero after a run of joins are the lanes where one
/// of them stored a ±0 word, so possibly a flushed subnormal): the caller checks `acc` and stores
/// those values again by [`join_bf16`] where a lane is zero.
///
/// # Safety
/// As [`join_bf16`], and AVX-512 BF16 must be available when `CVT`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn join_bf16_with<const CVT: bool, const ACC: bool>(p: *mut u8, e: __m512, o: __m512, acc: &mut __m512i) {
    debug_assert!(!CVT || std::arch::is_x86_feature_detected!("avx512bf16"), "a CVT kernel without AVX-512 BF16");
    // SAFETY: the caller's contract is the chosen join's.
    unsafe {
        match (CVT, ACC) {
            (false, _) => join_bf16(p, e, o),
            (true, false) => join_bf16_cvt(p, e, o),
            (true, true) => join_bf16_cvt_acc(p, e, o, acc),
        }
    }
}

/// [`join_bf16_cvt`] without its check: the conversion stored, and `acc` lowered to zero in the
/// lanes where it holds a ±0 word (`acc = min(acc, r << 1)` on 16-bit lanes: two operations off
/// the FMA pipes, where the check's mask compare and branch per vector were ~20 % of a 64-token
/// Qwen-shaped call on AMD Zen 5).
///
/// # Safety
/// As [`join_bf16_cvt`].
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn join_bf16_cvt_acc(p: *mut u8, e: __m512, o: __m512, acc: &mut __m512i) {
    // SAFETY: the caller guarantees AVX-512 BF16.
    let r = unsafe { cvt2_bf16(e, o) };
    *acc = _mm512_min_epu16(*acc, _mm512_slli_epi16::<1>(r));
    // SAFETY: the caller guarantees 64 bytes at p.
    unsafe { store_interleaved(p, r) }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load256<const K: u8>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 8 elements at p.
    unsafe {
        match K {
            BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _ => _mm256_loadu_ps(p.cast()),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store256<const K: u8>(p: *mut u8, v: __m256) {
    // SAFETY: the caller guarantees room for 8 elements at p.
    unsafe {
        match K {
            BF16 => {
                let b = _mm256_srli_epi32::<16>(_mm256_castps_si256(round256(v, Round::Bf16)));
                let h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
                _mm_storeu_si128(p.cast(), h);
            }
            F16 => _mm_storeu_si128(p.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)),
            _ => _mm256_storeu_ps(p.cast(), v),
        }
    }
}

/// [`split_bf16`] for 16 bf16 at `p`.
///
/// # Safety
/// AVX2 must be available; 32 readable bytes at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn split_bf16_256(p: *const u8, r: Round) -> (__m256, __m256) {
    // SAFETY: the caller guarantees 32 bytes at p.
    let v = unsafe { _mm256_loadu_si256(p.cast()) };
    let e = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
    let o = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF_0000u32 as i32)));
    (round256(e, r), round256(o, r))
}

/// [`join_bf16`] for 16 bf16 at `p`, without mask registers: the words are put in place by
/// `vpblendw`, the unsigned `t > 0x8000` is the signed `t ^ 0x8000 > 0`, and the round-up adds
/// the compare's all-ones (−1) by a subtraction. The same preconditions on NaNs.
///
/// # Safety
/// AVX2 must be available; 32 writable bytes at `p`; NaNs in `e`, `o` as for [`join_bf16`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn join_bf16_256(p: *mut u8, e: __m256, o: __m256) {
    let (e, o) = (_mm256_castps_si256(e), _mm256_castps_si256(o));
    let hi = _mm256_blend_epi16::<0xAA>(_mm256_srli_epi32::<16>(e), o);
    let lo = _mm256_blend_epi16::<0xAA>(e, _mm256_slli_epi32::<16>(o));
    let t = _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi16(1)));
    let sign = _mm256_set1_epi16(0x8000u16 as i16);
    let up = _mm256_cmpgt_epi16(_mm256_xor_si256(t, sign), _mm256_setzero_si256());
    // SAFETY: the caller guarantees 32 bytes at p.
    unsafe { _mm256_storeu_si256(p.cast(), _mm256_sub_epi16(hi, up)) }
}

/// [`default_nan512`] on AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn default_nan256(v: __m256) -> __m256 {
    _mm256_blendv_ps(v, _mm256_set1_ps(f32::NAN), _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v))
}

/// Every NaN lane of `v` made the default NaN (`f32::NAN`), the others kept.
#[target_feature(enable = "avx512f")]
#[inline]
fn default_nan512(v: __m512) -> __m512 {
    _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v), _mm512_set1_ps(f32::NAN))
}

/// [`Forms`] of the 64 freqs (`c0, s0, c1, s1, …`) of kind `KF` at `p`: widened exactly,
/// NaN made the default NaN where `canon_nan` (see [`token_avx512`] for where not),
/// de-interleaved by 8 two-source permutes (what [`fill_half_avx512`] stores per chunk).
///
/// # Safety
/// AVX-512 F must be available; 64 readable elements of kind `KF` at `p`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn chunk_forms<const KF: u8>(p: *const u8, canon_nan: bool) -> Forms512 {
    let size = if KF == F32 { 4 } else { 2 };
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let canon = |v: __m512| if canon_nan { default_nan512(v) } else { v };
    // SAFETY: elements 16i .. 16i + 16 of the 64 at p.
    let f: [__m512; 4] = std::array::from_fn(|i| canon(unsafe { load512::<KF>(p.add(16 * i * size)) }));
    let (c0, c1) = (_mm512_permutex2var_ps(f[0], even, f[1]), _mm512_permutex2var_ps(f[2], even, f[3]));
    let (s0, s1) = (_mm512_permutex2var_ps(f[0], odd, f[1]), _mm512_permutex2var_ps(f[2], odd, f[3]));
    let d = [
        _mm512_permutex2var_ps(c0, even, c1),
        _mm512_permutex2var_ps(c0, odd, c1),
        _mm512_permutex2var_ps(s0, even, s1),
        _mm512_permutex2var_ps(s0, odd, s1),
    ];
    let z = _mm512_setzero_ps();
    Forms { c: [c0, c1], s: [s0, s1], d: [d], f, fsw: [z; 4] }
}

/// [`Forms`] of the 64 freqs of kind `KF` at `p` on AVX2: widened exactly, NaN made the default
/// NaN where `canon_nan`, de-interleaved as [`fill_half_avx2`] does (the same values).
///
/// # Safety
/// AVX2, FMA and F16C must be available; 64 readable elements of kind `KF` at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn chunk_forms_256<const KF: u8>(p: *const u8, canon_nan: bool) -> Forms256 {
    let size = if KF == F32 { 4 } else { 2 };
    let canon = |v: __m256| if canon_nan { default_nan256(v) } else { v };
    // The even and the odd elements of the 16 values a, b, in order.
    let split = |a: __m256, b: __m256| {
        let e = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(_mm256_shuffle_ps::<0x88>(a, b))));
        let o = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(_mm256_shuffle_ps::<0xDD>(a, b))));
        (e, o)
    };
    let z = _mm256_setzero_ps();
    let mut k = Forms { c: [z; 4], s: [z; 4], d: [[z; 4]; 2], f: [z; 8], fsw: [z; 8] };
    for i in 0..8 {
        // SAFETY: elements 8i .. 8i + 8 of the 64 at p.
        k.f[i] = canon(unsafe { load256::<KF>(p.add(8 * i * size)) });
    }
    for j in 0..4 {
        (k.c[j], k.s[j]) = split(k.f[2 * j], k.f[2 * j + 1]);
    }
    // The chunk's `cd`, `sd` (`fill_half_avx2`'s layout): the even pairs of 0–15 and of 16–31,
    // then their odd pairs; a 16-pair bf16 step takes its even and odd pairs' values.
    let (c, s) = (k.c, k.s);
    let ((ce0, co0), (ce1, co1)) = (split(c[0], c[1]), split(c[2], c[3]));
    let ((se0, so0), (se1, so1)) = (split(s[0], s[1]), split(s[2], s[3]));
    (k.d[0], k.d[1]) = ([ce0, co0, se0, so0], [ce1, co1, se1, so1]);
    k
}

/// Whether [`heads_half_avx512`] handles a call: half-split, `F32` math, a rotary half `hh` of
/// whole vectors of `kind` (32 pairs for bf16, 16 otherwise).
pub(crate) fn half_fast_path(kind: u8, interleaved: bool, r: Round, hh: usize) -> bool {
    !interleaved && r == Round::None && hh > 0 && hh.is_multiple_of(if kind == BF16 { 32 } else { 16 })
}

/// The AVX-512 level's [`Lanes`]: 16 lanes; bf16 stored by [`join_bf16_with`] (the `CVT`
/// conversion where asked); the token kernels prefetch the next Q head's output.
struct Avx512;

impl Lanes for Avx512 {
    type V = __m512;
    type Acc = __m512i;
    type Forms = Forms512;
    const L: usize = 16;
    const PREFETCH_OUT: bool = true;
    const LD2: bool = false;

    level_fns! { "avx512f,avx512bw";
        unsafe fn loadu(p: *const f32) -> __m512 {
            // SAFETY: the caller guarantees 16 f32 at p.
            unsafe { _mm512_loadu_ps(p) }
        }
        unsafe fn load<const K: u8>(p: *const u8) -> __m512 {
            // SAFETY: the caller guarantees 16 elements of kind K at p.
            unsafe { load512::<K>(p) }
        }
        unsafe fn store<const K: u8>(p: *mut u8, v: __m512) -> () {
            // SAFETY: the caller guarantees room for 16 elements of kind K at p.
            unsafe { store512::<K>(p, v) }
        }
        unsafe fn round(v: __m512, r: Round) -> __m512 { round512(v, r) }
        unsafe fn mul(a: __m512, b: __m512) -> __m512 { _mm512_mul_ps(a, b) }
        unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 { _mm512_fmadd_ps(a, b, c) }
        unsafe fn fnmadd(a: __m512, b: __m512, c: __m512) -> __m512 { _mm512_fnmadd_ps(a, b, c) }
        unsafe fn neg(v: __m512) -> __m512 { xor512(v, _mm512_set1_ps(-0.0)) }
        unsafe fn neg_even(v: __m512) -> __m512 { xor512(v, _mm512_castsi512_ps(_mm512_set1_epi64(0x8000_0000))) }
        unsafe fn dup_even(v: __m512) -> __m512 { _mm512_moveldup_ps(v) }
        unsafe fn dup_odd(v: __m512) -> __m512 { _mm512_movehdup_ps(v) }
        unsafe fn swap_pairs(v: __m512) -> __m512 { _mm512_permute_ps::<0b10_11_00_01>(v) }
        unsafe fn split_bf16(p: *const u8, r: Round) -> (__m512, __m512) {
            // SAFETY: the caller guarantees 64 bytes at p.
            unsafe { split_bf16(p, r) }
        }
        unsafe fn join_bf16<const CVT: bool, const ACC: bool>(p: *mut u8, e: __m512, o: __m512, acc: &mut __m512i) -> () {
            // SAFETY: the caller's contract is `join_bf16_with`'s.
            unsafe { join_bf16_with::<CVT, ACC>(p, e, o, acc) }
        }
        unsafe fn acc_new() -> __m512i { _mm512_set1_epi16(-1) }
        unsafe fn acc_hit(acc: __m512i) -> bool { _mm512_testn_epi16_mask(acc, acc) != 0 }
        unsafe fn forms_zero() -> Forms512 {
            let z = _mm512_setzero_ps();
            Forms { c: [z; 2], s: [z; 2], d: [[z; 4]; 1], f: [z; 4], fsw: [z; 4] }
        }
        unsafe fn forms<const KF: u8>(p: *const u8, canon: bool) -> Forms512 {
            // SAFETY: the caller guarantees 64 elements of kind KF at p.
            unsafe { chunk_forms::<KF>(p, canon) }
        }
        unsafe fn load2<const K: u8>(_p: *const u8) -> (__m512, __m512) { unreachable!("no LD2 on x86") }
        unsafe fn store2<const K: u8>(_p: *mut u8, _y0: __m512, _y1: __m512) -> () { unreachable!("no LD2 on x86") }
    }

    #[inline(always)]
    fn prefetch(p: *const u8) {
        super::prefetch_t0(p);
    }
}

/// The AVX2 level's [`Lanes`]: 8 lanes; bf16 stored by [`join_bf16_256`] (no conversion, nothing
/// recorded); no output prefetch (measured no gain: see `rope_lanes::prefetch_out`).
struct Avx2;

impl Lanes for Avx2 {
    type V = __m256;
    type Acc = ();
    type Forms = Forms256;
    const L: usize = 8;
    const PREFETCH_OUT: bool = false;
    const LD2: bool = false;

    level_fns! { "avx2,fma,f16c";
        unsafe fn loadu(p: *const f32) -> __m256 {
            // SAFETY: the caller guarantees 8 f32 at p.
            unsafe { _mm256_loadu_ps(p) }
        }
        unsafe fn load<const K: u8>(p: *const u8) -> __m256 {
            // SAFETY: the caller guarantees 8 elements of kind K at p.
            unsafe { load256::<K>(p) }
        }
        unsafe fn store<const K: u8>(p: *mut u8, v: __m256) -> () {
            // SAFETY: the caller guarantees room for 8 elements of kind K at p.
            unsafe { store256::<K>(p, v) }
        }
        unsafe fn round(v: __m256, r: Round) -> __m256 { round256(v, r) }
        unsafe fn mul(a: __m256, b: __m256) -> __m256 { _mm256_mul_ps(a, b) }
        unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 { _mm256_fmadd_ps(a, b, c) }
        unsafe fn fnmadd(a: __m256, b: __m256, c: __m256) -> __m256 { _mm256_fnmadd_ps(a, b, c) }
        unsafe fn neg(v: __m256) -> __m256 { _mm256_xor_ps(v, _mm256_set1_ps(-0.0)) }
        unsafe fn neg_even(v: __m256) -> __m256 { _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi64x(0x8000_0000))) }
        unsafe fn dup_even(v: __m256) -> __m256 { _mm256_moveldup_ps(v) }
        unsafe fn dup_odd(v: __m256) -> __m256 { _mm256_movehdup_ps(v) }
        unsafe fn swap_pairs(v: __m256) -> __m256 { _mm256_permute_ps::<0b10_11_00_01>(v) }
        unsafe fn split_bf16(p: *const u8, r: Round) -> (__m256, __m256) {
            // SAFETY: the caller guarantees 32 bytes at p.
            unsafe { split_bf16_256(p, r) }
        }
        unsafe fn join_bf16<const CVT: bool, const ACC: bool>(p: *mut u8, e: __m256, o: __m256, _acc: &mut ()) -> () {
            // SAFETY: the caller guarantees 32 bytes at p and NaNs as `join_bf16_256` needs.
            unsafe { join_bf16_256(p, e, o) }
        }
        unsafe fn acc_new() -> () {}
        unsafe fn acc_hit(_acc: ()) -> bool { false }
        unsafe fn forms_zero() -> Forms256 {
            let z = _mm256_setzero_ps();
            Forms { c: [z; 4], s: [z; 4], d: [[z; 4]; 2], f: [z; 8], fsw: [z; 8] }
        }
        unsafe fn forms<const KF: u8>(p: *const u8, canon: bool) -> Forms256 {
            // SAFETY: the caller guarantees 64 elements of kind KF at p.
            unsafe { chunk_forms_256::<KF>(p, canon) }
        }
        unsafe fn load2<const K: u8>(_p: *const u8) -> (__m256, __m256) { unreachable!("no LD2 on x86") }
        unsafe fn store2<const K: u8>(_p: *mut u8, _y0: __m256, _y1: __m256) -> () { unreachable!("no LD2 on x86") }
    }

    #[inline(always)]
    fn prefetch(p: *const u8) {
        super::prefetch_t0(p);
    }
}

// ---------------------------------------------------------------------------------------------
// The entry points: each level's instance of a kernel above.

/// [`heads_avx512`]'s commonest cases on their own: half-split pairs, `F32` math (no rounding
/// between operations), a rotary half of whole vectors (32 pairs for bf16, 16 for f16 and f32).
/// The general kernel decides its pairing and rounding at run time and keeps a dozen values per
/// head on the stack; with Qwen's 64-dim heads (one step per head) that bookkeeping cost about as
/// much as the rotation (measured: 512 Qwen-shaped bf16 tokens 10 % faster, one core, Xeon). The
/// same operations as the general kernel, so the same bits. [`half_fast_path`] says when it applies
/// (the dispatch calls it directly, before the general kernel's prologue). `CVT`: bf16 heads
/// stored by [`join_bf16_cvt`] (the same bits as [`join_bf16`]).
///
/// # Safety
/// AVX-512 F and BW (and BF16 when `CVT`) must be available; `src` and `x` each hold `heads · d` elements of kind `K`
/// and either are the same pointer or do not overlap; `2 · hh ≤ d`, `hh` a multiple of 32 (bf16)
/// or 16; `row` holds the half-split forms of `hh` pairs (`c`, `s`, `cd`, `sd`).
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn heads_half_avx512<const K: u8, const CVT: bool>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    hh: usize,
    row: &RopeRow<'_>,
) {
    // SAFETY: the caller's contract is `heads_half`'s, on this level.
    unsafe { heads_half::<Avx512, K, CVT>(src, x, heads, d, hh, row) }
}

/// [`heads_half_avx512`] on AVX2: half-split pairs in `F32` math over a rotary half of whole
/// 32-pair chunks (bf16) or 16-pair vectors ([`half_fast_path`]), without [`heads_avx2`]'s run-time
/// pairing and rounding branches and index arithmetic in the loop. The same operations, so the
/// same bits. Zen 3, one core, medians of three alternating runs of a driver: 512 Qwen-shaped
/// bf16 tokens 210–240 → 147–171 µs, 8 Llama-shaped tokens (in L1) 11.5–12.3 → 9.1–9.6 µs.
///
/// # Safety
/// AVX2, FMA and F16C must be available; otherwise as [`heads_half_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn heads_half_avx2<const K: u8>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    hh: usize,
    row: &RopeRow<'_>,
) {
    // SAFETY: the caller's contract is `heads_half`'s, on this level.
    unsafe { heads_half::<Avx2, K, false>(src, x, heads, d, hh, row) }
}

/// One token of the standalone RoPE in its commonest form (half-split, `F32` math, whole heads of
/// `2 · 32 N` dims for Q and K): the freqs row of kind `KF` read once into registers, the Q heads
/// (kind `KQ`) from `q` into `out`, the K heads (kind `KK`) in place at `k`. The same operations
/// as [`fill_half_avx512`] followed by [`heads_half_avx512`] on each, so the same bits, without
/// the forms' round trip through memory and the per-token buffer (measured: see
/// `crate::simd::rope::HalfRows`).
///
/// `INTER`: interleaved pairs instead (`rope_lanes::heads_regs`' interleaved steps: the same operations as
/// [`RopeRow::fill`] followed by [`heads_avx512`], interleaved, `F32`). `CVT`: bf16 heads stored
/// by [`join_bf16_cvt`] (the same bits as [`join_bf16`]), and the freqs' NaNs left as they are
/// rather than made the default NaN: the conversion keeps any NaN a NaN, and its fallback
/// canonicalises before the integer join (sign and payload of a NaN are not promised). That
/// step was ~3 % of a 64-token Qwen-shaped bf16 call (AMD Zen 5, one core: 2.19–2.27 →
/// 2.10–2.17 µs, binaries alternated four times). Also with `CVT`, the Q heads' conversions are
/// checked for ±0 words once per token rather than per vector ([`join_bf16_cvt_acc`]; the
/// token's Q heads are stored again by the integer join where one was found): the per-vector
/// check was ~20 % of that call (1.75–1.80 µs without any check); with the check per token the
/// call took 1.99–2.03 µs against 2.14–2.24 (three alternations; 512 tokens 19.6–19.7 →
/// 18.9–19.4 µs, 64 Llama-shaped 11.1–11.2 → 10.8–10.9 µs).
///
/// `tokens` consecutive tokens in one call (a run: consecutive freqs rows, Q and output rows,
/// and K slots `k_stride` elements apart), so that a run pays the call, the per-row bookkeeping
/// and the kernel's setup once (see `crate::simd::rope::TokenFn::run`).
///
/// # Safety
/// AVX-512 F and BW (and BF16 when `CVT`) must be available; for each token `t < tokens`:
/// `freqs` holds `64 N` elements of kind `KF` from element `64 N t`; `q` and `out` hold
/// `hq · 64 N` elements of kind `KQ` from element `hq · 64 N · t` and do not overlap; `k` holds
/// `hk · 64 N` of kind `KK` from element `k_stride · t`, and `k_stride ≥ hk · 64 N`.
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn token_avx512<
    const KQ: u8,
    const KK: u8,
    const KF: u8,
    const N: usize,
    const CVT: bool,
    const INTER: bool,
>(
    freqs: *const u8,
    q: *const u8,
    out: *mut u8,
    hq: usize,
    k: *mut u8,
    hk: usize,
    tokens: usize,
    k_stride: usize,
) {
    // SAFETY: the caller's contract is `token`'s, on this level.
    unsafe { token::<Avx512, KQ, KK, KF, N, CVT, INTER>(freqs, (q, out, hq), (k, hk), tokens, k_stride) }
}

/// [`token_avx512`] (`INTER` false) and [`token_avx512`] (`INTER` true) on AVX2: one
/// token's Q heads from `q` into `out` and K heads in place at `k`, whole heads of `64 N` dims in
/// `F32` math, the freqs row read once per token. The same operations as the forms' fill
/// followed by [`heads_half_avx2`] or [`heads_avx2`], so the same bits, without the per-token
/// buffer and the general kernel's run-time pairing and rounding (measured: see
/// `crate::simd::rope::TokenFn`).
///
/// # Safety
/// AVX2, FMA and F16C must be available; otherwise as [`token_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn token_avx2<const KQ: u8, const KK: u8, const KF: u8, const N: usize, const INTER: bool>(
    freqs: *const u8,
    q: *const u8,
    out: *mut u8,
    hq: usize,
    k: *mut u8,
    hk: usize,
    tokens: usize,
    k_stride: usize,
) {
    // SAFETY: the caller's contract is `token`'s, on this level.
    unsafe { token::<Avx2, KQ, KK, KF, N, false, INTER>(freqs, (q, out, hq), (k, hk), tokens, k_stride) }
}

/// Rotates the rotary region of `heads` heads of `d` elements of kind `K` from `src` into `x`
/// (`src == x`: in place; the other dims of `x` are not touched). Returns the number of pairs per
/// head left to the caller (a tail shorter than a vector).
///
/// # Safety
/// AVX-512 F and BW must be available; `src` and `x` each hold `heads · d` elements of kind `K` (2 bytes
/// for bf16 and f16, 4 for f32) and either are the same pointer or do not overlap; `row` holds the
/// forms of `rd` rotary dims for the pairing (`rd` even, ≤ `d`).
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn heads_avx512<const K: u8>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    rd: usize,
    row: &RopeRow<'_>,
    interleaved: bool,
    r: Round,
) -> usize {
    // SAFETY: the caller's contract is `heads_any`'s, on this level.
    unsafe { heads_any::<Avx512, K>(src, x, heads, d, rd, row, interleaved, r) }
}

/// [`heads_avx512`] on AVX2: the same contract, arithmetic and return value.
///
/// # Safety
/// AVX2, FMA and F16C must be available; otherwise as [`heads_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn heads_avx2<const K: u8>(
    src: *const u8,
    x: *mut u8,
    heads: usize,
    d: usize,
    rd: usize,
    row: &RopeRow<'_>,
    interleaved: bool,
    r: Round,
) -> usize {
    // SAFETY: the caller's contract is `heads_any`'s, on this level.
    unsafe { heads_any::<Avx2, K>(src, x, heads, d, rd, row, interleaved, r) }
}
