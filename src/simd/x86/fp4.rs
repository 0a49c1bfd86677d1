//! AVX2 and AVX-512 VNNI FP4 group kernels (see the parent module for the arithmetic they share).
//!
//! Weights arrive as `w + 12 ∈ [0, 24]` after a `vpshufb` of the nibbles, so they are the unsigned
//! operand of `vpmaddubsw` / `vpdpbusd`; activations (doubled E2M1, |a| ≤ 12) are the signed one,
//! and `12 · Σa` per (row, block) is subtracted once. |a| ≤ 12 also means no activation is −128,
//! so no sign trick is needed, and i16 partial sums stay below 8 · 2 · 24 · 12 = 4608.

use crate::simd::fp4::{Fp4Group, Fp4Rows, ScaleKind};
use crate::simd::{DECODE_ROWS, GROUP, MR, ROW_GROUPS};
use std::arch::x86_64::*;

/// `w + 12` for each E2M1 code (codes 8..15 are the negatives).
const LUT: [i8; 16] = [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0];

/// Four activation bytes as one little-endian i32 (broadcast by the caller: the load folds into
/// `vpdpbusd`'s `{1to16}` operand). Unchecked: a bounds check per load put two compare-and-branch
/// uops per `vpdpbusd` on the ports the dot products need.
///
/// # Safety
/// `i + 4 <= p.len()`.
#[inline(always)]
unsafe fn read_u32(p: &[i8], i: usize) -> i32 {
    debug_assert!(i + 4 <= p.len());
    // SAFETY: the caller guarantees i + 4 ≤ p.len(); read_unaligned has no alignment need.
    unsafe { p.as_ptr().add(i).cast::<i32>().read_unaligned() }
}

/// `s[i]` without a bounds check: the per-block correction and scale of a row, read per row and
/// block (checked, they cost two compare-and-branch pairs each, with the slice lengths spilled).
///
/// # Safety
/// `i < s.len()` (`Fp4Group::check` proves it for `corr` and `sc` with `i < kb`).
#[inline(always)]
unsafe fn get<T: Copy>(s: &[T], i: usize) -> T {
    debug_assert!(i < s.len());
    // SAFETY: the caller guarantees i < s.len().
    unsafe { *s.get_unchecked(i) }
}

/// 32 bytes of packed E2M1 pairs → their low and high nibbles' values plus 12 (`vpshufb` on
/// [`LUT`]), for `vpmaddubsw` against the activations: the one weight decode of the AVX2 FP4
/// kernels.
#[target_feature(enable = "avx2")]
#[inline]
fn nibbles256(lut: __m256i, w: __m256i) -> (__m256i, __m256i) {
    let mask = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(w, mask);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), mask);
    (_mm256_shuffle_epi8(lut, lo), _mm256_shuffle_epi8(lut, hi))
}

/// `s16 + Σ (w + 12)·a` for one pair of activation i32s (`a.0` against the low nibbles, `a.1`
/// against the high ones), in i16 (`vpmaddubsw`): the one dot step of the AVX2 FP4 kernels.
#[target_feature(enable = "avx2")]
#[inline]
fn dot256(s16: __m256i, (wl, wh): (__m256i, __m256i), (a0, a1): (__m256i, __m256i)) -> __m256i {
    _mm256_add_epi16(s16, _mm256_add_epi16(_mm256_maddubs_epi16(wl, a0), _mm256_maddubs_epi16(wh, a1)))
}

/// The i16 sums a block of one row starts from: `−corr` (`corr = 12 · Σa`, the offset
/// correction) in the low half of each i32 lane and 0 in the high half, so that the block end's
/// `vpmaddwd` by ones subtracts it (no `vpsubd` per row and half). Exact: |corr| ≤ 12 · 12 · 32
/// = 4608 and the block's sums per i16 lane stay below 4608 in magnitude (16 products of at most
/// 24 · 12), so no lane leaves i16.
#[target_feature(enable = "avx2")]
#[inline]
fn start16(corr: i32) -> __m256i {
    _mm256_set1_epi32(i32::from((-corr) as i16 as u16))
}

/// The end of a block for 8 columns of one row: `fma(Σ (w + 12)·a − corr, s, acc)`, from the
/// block's i16 sums `s16` (started at [`start16`]), with `s` the columns' weight scale bytes `sb`
/// (widened to i32) times the row's scale `sc` (E5M3: `sb << 20` as f32 bits times the f32 bits
/// `sc`; E8M0: the exponent `sb + sc` clamped to 0..=255). The one block end of the AVX2 FP4
/// kernels.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn end256(kind: ScaleKind, s16: __m256i, sb: __m256i, sc: u32, acc: __m256) -> __m256 {
    let isum = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    let s = match kind {
        ScaleKind::E5m3 => {
            _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32::<20>(sb)), _mm256_set1_ps(f32::from_bits(sc)))
        }
        ScaleKind::E8m0 => {
            let e = _mm256_add_epi32(sb, _mm256_set1_epi32(sc as i32));
            let e = _mm256_min_epi32(_mm256_max_epi32(e, _mm256_setzero_si256()), _mm256_set1_epi32(255));
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e))
        }
    };
    _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc)
}

/// One block `kb` of one half (8 columns) of [`fp4_group_avx2`] for R rows:
/// `acc[r] = fma(Σ (w + 12)·a − 12·Σa, s, acc[r])`.
///
/// # Safety
/// AVX2 and FMA must be available; `g.check(rows)` must have passed and `kb < g.kb`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn fp4_block_avx2<const R: usize>(
    g: &Fp4Group<'_>,
    rows: &Fp4Rows<'_>,
    kb: usize,
    half: usize,
    pf: bool,
    acc: &mut [__m256; R],
) {
    let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128_safe(&LUT));
    let v = g.pairs * 8;
    // SAFETY: `check` proved corr[r] holds kb_total > kb values.
    let mut s16: [__m256i; R] = std::array::from_fn(|r| start16(unsafe { get(rows.corr[r], kb) }));
    for p in 0..g.pairs {
        let off = (kb * g.pairs + p) * 64 + half * 32;
        if pf {
            prefetch(g.w, off + PREFETCH);
        }
        // SAFETY: `check` proved w.len() ≥ kb_total · pairs · 64, so off + 32 is in bounds.
        let w = unsafe { _mm256_loadu_si256(g.w.as_ptr().add(off).cast()) };
        let (wl, wh) = nibbles256(lut, w);
        for r in 0..R {
            let a = rows.a[r];
            // SAFETY: `check` proved a.len() ≥ kb_total · v ≥ kb · v + p · 8 + 8.
            let (a0, a1) = unsafe { (read_u32(a, kb * v + p * 8), read_u32(a, kb * v + p * 8 + 4)) };
            s16[r] = dot256(s16[r], (wl, wh), (_mm256_set1_epi32(a0), _mm256_set1_epi32(a1)));
        }
    }
    // SAFETY: `check` proved ws.len() ≥ kb_total · 16.
    let sb = unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(g.ws.as_ptr().add(kb * GROUP + half * 8).cast())) };
    for r in 0..R {
        // SAFETY: `check` proved sc[r] holds kb_total > kb values.
        let sc = unsafe { get(rows.sc[r], kb) };
        acc[r] = end256(g.kind, s16[r], sb, sc, acc[r]);
    }
}

/// # Safety
/// AVX2 and FMA must be available; `g.check(rows)` must have passed.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn fp4_group_avx2<const R: usize>(
    g: &Fp4Group<'_>,
    rows: &Fp4Rows<'_>,
    out: &mut [[f32; GROUP]; MR],
) {
    debug_assert_eq!(rows.count(), R);
    // Many rows reuse the weight from L1: the prefetch helps there on every CPU (AMD Zen 4, NVFP4
    // M = 512: 7-12 % slower without, two alternating runs); a decode follows `prefetch_weights`.
    let pf = R > DECODE_ROWS || crate::simd::prefetch_weights();
    if R <= DECODE_ROWS {
        // Decode: both halves of each block in turn, so each 64-byte line of the weight is used
        // whole while it is in L1 (the halves' accumulators fit the registers for ≤ 2 rows).
        // Measured on AMD Zen 3, one row, paired against the half-by-half order: Llama-3-8B
        // from DRAM 0.81–0.82× the time, from L3 0.87–0.92×, Qwen2.5-0.5B over 24 layers (L3)
        // 0.91, from DRAM 0.90–0.91; one Qwen layer back to back (L2) 1.06–1.07×.
        let mut acc = [[_mm256_setzero_ps(); R]; 2];
        for kb in 0..g.kb {
            for (half, a) in acc.iter_mut().enumerate() {
                // SAFETY: the caller's obligations; kb < g.kb.
                unsafe { fp4_block_avx2(g, rows, kb, half, pf, a) };
            }
        }
        for (half, a) in acc.iter().enumerate() {
            store8(a, out, half);
        }
    } else {
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            for kb in 0..g.kb {
                // SAFETY: the caller's obligations; kb < g.kb.
                unsafe { fp4_block_avx2(g, rows, kb, half, pf, &mut acc) };
            }
            store8(&acc, out, half);
        }
    }
}

/// R activation rows against [`ROW_GROUPS`] adjacent 16-column groups (the decode shape), P groups
/// at a time (one row: two groups; a decode step's 2–4 rows: one): the same arithmetic per column
/// as [`fp4_group_avx2`] (so the same bits: the i16 sums of a block are exact in any order, and the
/// rest is the same operations per block in the same order), with each pair's activations broadcast
/// and each block's row correction and scale read once for two groups and both halves instead of
/// once per half, and four integer and four f32 chains instead of two each. Two groups, not four:
/// sixteen ymm registers hold two groups' eight accumulators beside the table, the mask and the
/// activations. Past a group's end the weight and scale prefetches go to the next pass's groups
/// (`RunOn`: one group at a time, the single stream ran on into its next group by itself; two side
/// by side without it were 1.07–1.10× the one-group kernel's time from DRAM). Measured on AMD Zen
/// 3, one row, paired call by call against the one-group kernel (docs/performance.md): NVFP4
/// Llama-3-8B from DRAM 0.82× the time (one thread), 0.86× (two); Qwen2.5-0.5B from DRAM
/// 0.91–0.93×, one layer back to back (L2/L3) 0.73–0.87×; MXFP4 0.80× (Llama, DRAM) and 0.79×
/// (Qwen, hot).
///
/// A decode step's 2–4 rows ([`crate::simd::fp4_few`]) take one group per pass: each weight
/// vector decoded once for the rows, each 64-byte line used whole (both halves in turn), the
/// block sums kept in `out` between blocks. Measured on AMD Zen 3 against the group kernel (which
/// reads a group half by half), Llama-3-8B decode steps of 2–8 rows at 0.81–0.94× the time
/// (MXFP4 with 2 rows unchanged), and the kernel alone on four L2-resident groups at 0.85–0.95×
/// (docs/performance.md).
///
/// # Safety
/// AVX2 and FMA must be available; `rows.count() == R`; every group has the same `pairs`, `kb`
/// and `kind`, `check_group` passed for every group and `check(rows)` for one (so the rows'
/// lengths hold for all); P divides [`ROW_GROUPS`].
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn fp4_row_avx2<const R: usize, const P: usize>(
    gs: &[Fp4Group<'_>; ROW_GROUPS],
    rows: &Fp4Rows<'_>,
    mut out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) {
    debug_assert!(rows.count() == R && ROW_GROUPS.is_multiple_of(P));
    let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128_safe(&LUT));
    let (pairs, kbs, kind) = (gs[0].pairs, gs[0].kb, gs[0].kind);
    let v = pairs * 8;
    let pf = crate::simd::prefetch_weights();
    for pass in 0..ROW_GROUPS / P {
        let g: [&Fp4Group<'_>; P] = std::array::from_fn(|i| &gs[pass * P + i]);
        // Past a group's end the prefetch goes to the next pass's (or the next call's) group of
        // the same stream (`RunOn`): groups lie end to end, so the one-group kernel's single
        // stream ran on into its next group by itself, which two side by side do not.
        let (run, srun) = (super::RunOn::new(g.map(|g| g.w)), super::RunOn::new(g.map(|g| g.ws)));
        if pf && pass == 0 {
            super::prefetch_starts(g.map(|g| g.w));
            super::prefetch_heads(g.map(|g| g.ws), super::SCALES_AHEAD);
        }
        // [row][group][half]
        // One group per pass (2–4 rows): the block accumulators live in `out` (read and written
        // once per block), so that the rows' i16 sums, the table, the mask, the weight and its
        // decode fit the sixteen ymm registers (measured on AMD Zen 3: kept in registers, the
        // compiler spilled the i16 sums inside the pair loop). Two groups (one row): registers.
        // (Either way for any R and P: the same sums, only where they are kept differs.)
        let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
        if P == 1 {
            for o in out.iter_mut() {
                o[pass] = [0.0; GROUP];
            }
        }
        for kb in 0..kbs {
            // Per row, group and half, Σ (w + 12)·a − 12·Σa over the block in i16: exact
            // ([`start16`]).
            // SAFETY: `check` proved corr[r] holds kb_total > kb values.
            let mut s16: [[[__m256i; 2]; P]; R] =
                std::array::from_fn(|r| [[start16(unsafe { get(rows.corr[r], kb) }); 2]; P]);
            if pf && kb % 4 == 0 {
                for g in g {
                    srun.prefetch(g.ws.as_ptr(), kb * GROUP + super::SCALES_AHEAD);
                }
            }
            for p in 0..pairs {
                let off = (kb * pairs + p) * 64;
                // SAFETY: `check` proved a.len() ≥ kb_total · v ≥ kb · v + p · 8 + 8.
                let act = |r: usize| unsafe {
                    let a = rows.a[r];
                    (_mm256_set1_epi32(read_u32(a, kb * v + p * 8)), _mm256_set1_epi32(read_u32(a, kb * v + p * 8 + 4)))
                };
                // SAFETY: `check` proved g.w.len() ≥ kb_total · pairs · 64 for every group.
                let load = |gi: usize, half: usize| unsafe {
                    _mm256_loadu_si256(g[gi].w.as_ptr().add(off + half * 32).cast())
                };
                if P == 1 {
                    if pf {
                        run.prefetch(g[0].w.as_ptr(), off + PREFETCH);
                    }
                    // Both halves decoded, then each row's broadcasts loaded and used for both:
                    // with the halves in turn, 2–4 rows' eight broadcasts (loaded once for both)
                    // pushed the i16 sums out of the registers (AMD Zen 3).
                    let wd = [0, 1].map(|half| nibbles256(lut, load(0, half)));
                    for r in 0..R {
                        let a = act(r);
                        for (half, &w) in wd.iter().enumerate() {
                            s16[r][0][half] = dot256(s16[r][0][half], w, a);
                        }
                    }
                } else {
                    // One row: its broadcasts shared by the groups, the halves in turn (both halves
                    // decoded first measured 1.1× the time on AMD Zen 3).
                    let av: [(__m256i, __m256i); R] = std::array::from_fn(act);
                    for gi in 0..P {
                        if pf {
                            run.prefetch(g[gi].w.as_ptr(), off + PREFETCH);
                        }
                        for half in 0..2 {
                            let w = nibbles256(lut, load(gi, half));
                            for r in 0..R {
                                s16[r][gi][half] = dot256(s16[r][gi][half], w, av[r]);
                            }
                        }
                    }
                }
            }
            // The block's weight scale bytes, once for the rows.
            let sb: [[__m256i; 2]; P] = std::array::from_fn(|gi| {
                // SAFETY: `check` proved ws.len() ≥ kb_total · 16 for every group.
                std::array::from_fn(|half| unsafe {
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(g[gi].ws.as_ptr().add(kb * GROUP + half * 8).cast()))
                })
            });
            for r in 0..R {
                // SAFETY: `check` proved sc[r] holds kb_total > kb values.
                let sc = unsafe { get(rows.sc[r], kb) };
                for gi in 0..P {
                    for half in 0..2 {
                        if P == 1 {
                            let o = out[r][pass][half * 8..half * 8 + 8].as_mut_ptr();
                            // SAFETY: `o` points to 8 f32 of the output.
                            unsafe {
                                _mm256_storeu_ps(o, end256(kind, s16[r][0][half], sb[0][half], sc, _mm256_loadu_ps(o)))
                            };
                        } else {
                            acc[r][gi][half] = end256(kind, s16[r][gi][half], sb[gi][half], sc, acc[r][gi][half]);
                        }
                    }
                }
            }
        }
        if P == 1 {
            continue; // the sums are in `out`
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            for (gi, acc) in acc.iter().enumerate() {
                for (half, a) in acc.iter().enumerate() {
                    // SAFETY: the destination holds 8 f32.
                    unsafe { _mm256_storeu_ps(o[pass * P + gi][half * 8..half * 8 + 8].as_mut_ptr(), *a) };
                }
            }
        }
    }
}

/// `out[r][half·8 .. half·8 + 8] = acc[r]` for R rows.
#[target_feature(enable = "avx")]
#[inline]
fn store8<const R: usize>(acc: &[__m256; R], out: &mut [[f32; GROUP]; MR], half: usize) {
    for r in 0..R {
        // SAFETY: the destination holds 8 f32.
        unsafe { _mm256_storeu_ps(out[r][half * 8..half * 8 + 8].as_mut_ptr(), acc[r]) };
    }
}

/// Software prefetch distance in bytes (on Intel the hardware prefetcher alone left DRAM decode
/// ~1.5× a plain read; on AMD Zen 4 the prefetch made it worse, NVFP4 1.4× instead of 1.2×; on
/// Zen 5 better, 1.18× instead of 1.24–1.32×: [`crate::simd::prefetch_weights`]). 2 KiB and 4 KiB
/// measured no better on Zen 5 (NVFP4 from DRAM, one thread: 0.78–0.85 and 0.74 of a plain
/// read's rate, against 0.84–0.85 at 1 KiB).
pub(super) const PREFETCH: usize = 1024;

#[inline(always)]
fn prefetch(w: &[u8], off: usize) {
    // wrapping_add: the address may lie past the slice; a prefetch never faults and the pointer
    // is never dereferenced.
    super::prefetch_t0(w.as_ptr().wrapping_add(off));
}

#[inline(always)]
fn _mm_loadu_si128_safe(x: &[i8; 16]) -> __m128i {
    // SAFETY: reads exactly the 16 bytes of `x`; SSE2 is part of x86-64.
    unsafe { _mm_loadu_si128(x.as_ptr().cast()) }
}

/// `w + 12` of the low and high nibbles of 64 weight bytes (`lut`: [`LUT`] in each 128-bit lane):
/// `vpshufb` on the masked nibbles.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn nibbles_shuffle(w: __m512i, lut: __m512i) -> (__m512i, __m512i) {
    let mask = _mm512_set1_epi8(0x0F);
    let lo = _mm512_and_si512(w, mask);
    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), mask);
    (_mm512_shuffle_epi8(lut, lo), _mm512_shuffle_epi8(lut, hi))
}

/// The same bytes with AVX-512 VBMI: `vpermb` indexes by the low 6 bits into `lut` (the 16-byte
/// table repeated four times), so the nibbles need no mask — 3 operations per 64 weight bytes
/// instead of 5, on the ports the dot products use (measured: see docs/performance.md, Qwen decode).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
#[inline]
fn nibbles_vbmi(w: __m512i, lut: __m512i) -> (__m512i, __m512i) {
    (_mm512_permutexvar_epi8(w, lut), _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(w), lut))
}

/// The AVX-512 group and row kernels, once per nibble decode (a macro: a function's target
/// features cannot depend on a const parameter, and `vpermb` must inline into the loop).
macro_rules! avx512_fp4_kernels {
    ($group:ident, $row:ident, $features:literal, $nib:ident) => {
        /// # Safety
        /// AVX-512 F, BW and VNNI (and VBMI for the `vbmi` kernels) must be available; `g.check(rows)`
        /// must have passed.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $group<const R: usize>(
            g: &Fp4Group<'_>,
            rows: &Fp4Rows<'_>,
            out: &mut [[f32; GROUP]; MR],
        ) {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128_safe(&LUT));
            debug_assert_eq!(rows.count(), R);
            let v = g.pairs * 8;
            // As in `fp4_group_avx2`.
            let pf = R > DECODE_ROWS || crate::simd::prefetch_weights();
            let mut acc = [_mm512_setzero_ps(); R];
            for kb in 0..g.kb {
                // Each chain starts at −12·Σa (the offset correction), saving a subtraction per row.
                let mut i32acc: [__m512i; R] = std::array::from_fn(|r| {
                    // SAFETY: `check` proved corr[r] holds kb_total > kb values.
                    _mm512_set1_epi32(-unsafe { get(rows.corr[r], kb) })
                });
                for p in 0..g.pairs {
                    let off = (kb * g.pairs + p) * 64;
                    if pf {
                        prefetch(g.w, off + PREFETCH);
                    }
                    // SAFETY: `check` proved w.len() ≥ kb_total · pairs · 64.
                    let w = unsafe { _mm512_loadu_si512(g.w.as_ptr().add(off).cast()) };
                    let (wl, wh) = $nib(w, lut);
                    for r in 0..R {
                        let a = rows.a[r];
                        // SAFETY: `check` proved a.len() ≥ kb_total · v ≥ kb · v + p · 8 + 8.
                        let (a0, a1) = unsafe { (read_u32(a, kb * v + p * 8), read_u32(a, kb * v + p * 8 + 4)) };
                        let (a0, a1) = (_mm512_set1_epi32(a0), _mm512_set1_epi32(a1));
                        i32acc[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i32acc[r], wl, a0), wh, a1);
                    }
                }
                // SAFETY: `check` proved ws.len() ≥ kb_total · 16.
                let sb = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(g.ws.as_ptr().add(kb * GROUP).cast())) };
                // E8m0: the weight scales 2^(sb − 127) once per block (2^-127 exactly for sb = 0),
                // then per row `s = scalef(2^(sb − 127), offset)`: the scalar kernel's
                // `clamp(sb + offset, 0, 255) << 23` wherever that product is used (a sum in
                // 1 ..= 254 is the same power of two, ≥ 255 is +∞ in both; a sum ≤ 0 or a NaN
                // scale sends the element to the exact path: `may_underflow`, `nan_col`,
                // `nan_row`). One operation per row instead of four.
                let ws = match g.kind {
                    ScaleKind::E5m3 => _mm512_castsi512_ps(_mm512_slli_epi32::<20>(sb)),
                    ScaleKind::E8m0 => {
                        let e = _mm512_sub_ps(_mm512_cvtepi32_ps(sb), _mm512_set1_ps(127.0));
                        _mm512_scalef_ps(_mm512_set1_ps(1.0), e)
                    }
                };
                for r in 0..R {
                    let isum = i32acc[r];
                    let s = match g.kind {
                        ScaleKind::E5m3 => {
                            // SAFETY: `check` proved sc[r] holds kb_total > kb values.
                            let sc = unsafe { get(rows.sc[r], kb) };
                            _mm512_mul_ps(ws, _mm512_set1_ps(f32::from_bits(sc)))
                        }
                        ScaleKind::E8m0 => {
                            // SAFETY: `check` proved scf[r] holds kb_total > kb values (E8m0).
                            let sc = unsafe { get(rows.scf[r], kb) };
                            _mm512_scalef_ps(ws, _mm512_set1_ps(sc))
                        }
                    };
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[r]);
                }
            }
            for r in 0..R {
                // SAFETY: out[r] holds 16 f32.
                unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
            }
        }

        /// R (1 or 2) activation rows against [`ROW_GROUPS`] adjacent 16-column groups (the decode
        /// shape): the same arithmetic per column as the group kernel (so the same bits), with
        /// independent integer and f32 chains per row and group where the one-group kernel has one
        /// per row (with one or two rows those chains' latency, not the weight bytes, bounded it),
        /// and each weight vector's nibbles decoded once for the R rows.
        ///
        /// # Safety
        /// AVX-512 F, BW and VNNI (and VBMI for the `vbmi` kernels) must be available;
        /// `rows.count() == R`; every group has the same `pairs`, `kb` and `kind`, `check_group`
        /// passed for every group and `check(rows)` for one (so the rows' lengths hold for all).
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $row<const R: usize>(
            gs: &[Fp4Group<'_>; ROW_GROUPS],
            rows: &Fp4Rows<'_>,
            out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
        ) {
            const G: usize = ROW_GROUPS;
            debug_assert_eq!(rows.count(), R);
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128_safe(&LUT));
            let (pairs, kbs, kind) = (gs[0].pairs, gs[0].kb, gs[0].kind);
            let v = pairs * 8;
            let pf = crate::simd::prefetch_weights();
            if pf {
                super::prefetch_starts(gs.each_ref().map(|g| g.w));
            }
            let mut acc = [[_mm512_setzero_ps(); G]; R];
            for kb in 0..kbs {
                let (corr, sc): ([i32; R], [u32; R]) = (
                    // SAFETY: `check` proved corr[r] holds kb_total > kb values.
                    std::array::from_fn(|r| unsafe { get(rows.corr[r], kb) }),
                    // SAFETY: `check` proved sc[r] holds kb_total > kb values.
                    std::array::from_fn(|r| unsafe { get(rows.sc[r], kb) }),
                );
                let mut i32acc: [[__m512i; G]; R] = std::array::from_fn(|r| [_mm512_set1_epi32(-corr[r]); G]);
                for p in 0..pairs {
                    let off = (kb * pairs + p) * 64;
                    // SAFETY: `check` proved a.len() ≥ kb_total · v ≥ kb · v + p · 8 + 8.
                    let av: [(__m512i, __m512i); R] = std::array::from_fn(|r| unsafe {
                        let a = rows.a[r];
                        (
                            _mm512_set1_epi32(read_u32(a, kb * v + p * 8)),
                            _mm512_set1_epi32(read_u32(a, kb * v + p * 8 + 4)),
                        )
                    });
                    for (gi, g) in gs.iter().enumerate() {
                        if pf {
                            prefetch(g.w, off + PREFETCH);
                        }
                        // SAFETY: `check` proved g.w.len() ≥ kb_total · pairs · 64 for every group.
                        let w = unsafe { _mm512_loadu_si512(g.w.as_ptr().add(off).cast()) };
                        let (wl, wh) = $nib(w, lut);
                        for r in 0..R {
                            let (a0, a1) = av[r];
                            i32acc[r][gi] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i32acc[r][gi], wl, a0), wh, a1);
                        }
                    }
                }
                for (gi, g) in gs.iter().enumerate() {
                    // SAFETY: `check` proved g.ws.len() ≥ kb_total · 16.
                    let sb = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(g.ws.as_ptr().add(kb * GROUP).cast())) };
                    for r in 0..R {
                        let s = match kind {
                            ScaleKind::E5m3 => _mm512_mul_ps(
                                _mm512_castsi512_ps(_mm512_slli_epi32::<20>(sb)),
                                _mm512_set1_ps(f32::from_bits(sc[r])),
                            ),
                            ScaleKind::E8m0 => {
                                let e = _mm512_add_epi32(sb, _mm512_set1_epi32(sc[r] as i32));
                                let e = _mm512_min_epi32(
                                    _mm512_max_epi32(e, _mm512_setzero_si512()),
                                    _mm512_set1_epi32(255),
                                );
                                _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
                            }
                        };
                        acc[r][gi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32acc[r][gi]), s, acc[r][gi]);
                    }
                }
            }
            for (o, ac) in out.into_iter().zip(acc) {
                for (og, a) in o.iter_mut().zip(ac) {
                    // SAFETY: og holds 16 f32.
                    unsafe { _mm512_storeu_ps(og.as_mut_ptr(), a) };
                }
            }
        }
    };
}

avx512_fp4_kernels!(fp4_group_avx512, fp4_row_avx512, "avx512f,avx512bw,avx512vnni", nibbles_shuffle);
avx512_fp4_kernels!(fp4_group_avx512vbmi, fp4_row_avx512vbmi, "avx512f,avx512bw,avx512vnni,avx512vbmi", nibbles_vbmi);
