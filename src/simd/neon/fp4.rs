//! NEON FP4 group kernels (see the parent module for the arithmetic). Weights decode to signed
//! doubled E2M1 with `tbl`, so no offset correction is needed. Three ways to form the exact i32
//! block sum per column, one per ISA level: `smull` + i16 adds + pairwise widening adds (ARMv8.0;
//! i16 partial sums stay ≤ 8 · 144), `sdot` (FEAT_DotProd: 4 products per lane per instruction)
//! and `smmla` (FEAT_I8MM: a 2 × 8 by 8 × 2 block, two rows × two columns per instruction).
//! Integer sums are exact, so all three give the same bits; the f32 part is shared.
//!
//! `sdot` and `smmla` are emitted with `asm!`: their intrinsics (`vdotq_s32`, `vmmlaq_s32`) are
//! not stable in the crate's MSRV (1.89).

use crate::dtype::E2M1_DOUBLED;
use crate::simd::fp4::{Fp4Group, Fp4Rows, ScaleKind};
use crate::simd::{GROUP, MR};
use std::arch::aarch64::*;
use std::arch::asm;

/// Four activation bytes as one u32 (to be replicated: `ld1r`). Unchecked, as on x86: a bounds
/// check per load would add two scalar instructions per dot product.
///
/// # Safety
/// `i + 4 <= p.len()`.
#[inline(always)]
unsafe fn read_u32(p: &[i8], i: usize) -> u32 {
    debug_assert!(i + 4 <= p.len());
    // SAFETY: the caller guarantees i + 4 ≤ p.len(); read_unaligned has no alignment need.
    unsafe { p.as_ptr().add(i).cast::<u32>().read_unaligned() }
}

/// The block-scale product `s` of 4 columns (scale bytes `sb`) and a row's activation scale `sc`
/// (see `scale_product`): exact, as in every kernel.
#[inline(always)]
fn block_scale(kind: ScaleKind, sb: uint32x4_t, sc: u32) -> float32x4_t {
    // SAFETY: (each intrinsic) NEON is part of the aarch64 baseline.
    unsafe {
        match kind {
            ScaleKind::E5m3 => vmulq_f32(vreinterpretq_f32_u32(vshlq_n_u32::<20>(sb)), vdupq_n_f32(f32::from_bits(sc))),
            ScaleKind::E8m0 => {
                let e = vaddq_s32(vreinterpretq_s32_u32(sb), vdupq_n_s32(sc as i32));
                let e = vminq_s32(vmaxq_s32(e, vdupq_n_s32(0)), vdupq_n_s32(255));
                vreinterpretq_f32_s32(vshlq_n_s32::<23>(e))
            }
        }
    }
}

/// The 4 scale bytes of columns `quad·4 ..` of block `kb`, widened.
#[inline(always)]
fn quad_scales(g: &Fp4Group<'_>, kb: usize, quad: usize) -> uint32x4_t {
    let b = &g.ws[kb * GROUP + quad * 4..kb * GROUP + quad * 4 + 4];
    let sb = [b[0] as u32, b[1] as u32, b[2] as u32, b[3] as u32];
    // SAFETY: sb holds 4 u32; NEON is part of the aarch64 baseline.
    unsafe { vld1q_u32(sb.as_ptr()) }
}

/// `acc[i] += Σ_j w[4i + j] · a[4L + j]` (`sdot` by element: lane `L` of `a`, four activation
/// bytes, against every column of `w`, with no separate broadcast).
///
/// # Safety
/// The CPU must have FEAT_DotProd.
#[inline(always)]
unsafe fn sdot_lane<const L: i32>(mut acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    // SAFETY: the caller guarantees FEAT_DotProd; the instruction reads and writes only the three
    // registers named (L is 0..=3, checked by the assembler).
    unsafe {
        asm!(
            ".arch_extension dotprod",
            "sdot {acc:v}.4s, {w:v}.16b, {a:v}.4b[{lane}]",
            acc = inout(vreg) acc,
            w = in(vreg) w,
            a = in(vreg) a,
            lane = const L,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// `acc += A · Bᵀ` for A = 2 rows × 8 (`a`) and B = 2 columns × 8 (`b`): lanes
/// `[r0·c0, r0·c1, r1·c0, r1·c1]` (`smmla`).
///
/// # Safety
/// The CPU must have FEAT_I8MM.
#[inline(always)]
unsafe fn smmla(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: the caller guarantees FEAT_I8MM; the instruction reads and writes only the three
    // registers named.
    unsafe {
        asm!(
            ".arch_extension i8mm",
            "smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// # Safety
/// NEON must be available; `g.check(rows)` must have passed.
#[target_feature(enable = "neon")]
#[inline(never)] // like the other levels' kernels (their features keep them out of line)
pub(crate) unsafe fn fp4_group_neon<const R: usize>(
    g: &Fp4Group<'_>,
    rows: &Fp4Rows<'_>,
    out: &mut [[f32; GROUP]; MR],
) {
    // SAFETY: E2M1_DOUBLED holds 16 bytes.
    let lut = unsafe { vld1q_s8(E2M1_DOUBLED.as_ptr()) };
    let mask = vdupq_n_u8(0x0F);
    debug_assert_eq!(rows.count(), R);
    let v = g.pairs * 8;
    for quad in 0..4 {
        let mut acc = [vdupq_n_f32(0.0); R];
        for kb in 0..g.kb {
            let mut lo16 = [vdupq_n_s16(0); R];
            let mut hi16 = [vdupq_n_s16(0); R];
            for p in 0..g.pairs {
                let off = (kb * g.pairs + p) * 64 + quad * 16;
                // SAFETY: `check` proved w.len() ≥ kb_total · pairs · 64.
                let w = unsafe { vld1q_u8(g.w.as_ptr().add(off)) };
                let wl = vqtbl1q_s8(lut, vandq_u8(w, mask));
                let wh = vqtbl1q_s8(lut, vshrq_n_u8::<4>(w));
                for r in 0..R {
                    let a = rows.a[r];
                    // SAFETY: `check` proved a.len() ≥ kb_total · v ≥ kb · v + p · 8 + 8.
                    let (x0, x1) = unsafe { (read_u32(a, kb * v + p * 8), read_u32(a, kb * v + p * 8 + 4)) };
                    let a0 = vreinterpretq_s8_u32(vdupq_n_u32(x0));
                    let a1 = vreinterpretq_s8_u32(vdupq_n_u32(x1));
                    let l = vaddq_s16(
                        vmull_s8(vget_low_s8(wl), vget_low_s8(a0)),
                        vmull_s8(vget_low_s8(wh), vget_low_s8(a1)),
                    );
                    let h = vaddq_s16(vmull_high_s8(wl, a0), vmull_high_s8(wh, a1));
                    lo16[r] = vaddq_s16(lo16[r], l);
                    hi16[r] = vaddq_s16(hi16[r], h);
                }
            }
            let sb = quad_scales(g, kb, quad);
            for r in 0..R {
                let isum = vpaddq_s32(vpaddlq_s16(lo16[r]), vpaddlq_s16(hi16[r]));
                acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(isum), block_scale(g.kind, sb, rows.sc[r][kb]));
            }
        }
        store_quad(&acc, quad, out);
    }
}

/// Stores the 4-column accumulators of quad `quad`.
#[inline(always)]
fn store_quad<const R: usize>(acc: &[float32x4_t; R], quad: usize, out: &mut [[f32; GROUP]; MR]) {
    for r in 0..R {
        let mut tmp = [0f32; 4];
        // SAFETY: tmp holds 4 f32; NEON is part of the aarch64 baseline.
        unsafe { vst1q_f32(tmp.as_mut_ptr(), acc[r]) };
        out[r][quad * 4..quad * 4 + 4].copy_from_slice(&tmp);
    }
}

/// The `sdot` kernel (FEAT_DotProd): per row and 4-column quad, one i32 chain; each `sdot`
/// adds 4 columns × 4 products.
///
/// # Safety
/// NEON and FEAT_DotProd must be available; `g.check(rows)` must have passed.
#[target_feature(enable = "neon,dotprod")]
pub(crate) unsafe fn fp4_group_sdot<const R: usize>(
    g: &Fp4Group<'_>,
    rows: &Fp4Rows<'_>,
    out: &mut [[f32; GROUP]; MR],
) {
    // SAFETY: E2M1_DOUBLED holds 16 bytes.
    let lut = unsafe { vld1q_s8(E2M1_DOUBLED.as_ptr()) };
    let mask = vdupq_n_u8(0x0F);
    debug_assert_eq!(rows.count(), R);
    let v = g.pairs * 8;
    for quad in 0..4 {
        let mut acc = [vdupq_n_f32(0.0); R];
        for kb in 0..g.kb {
            // Two chains per row (even and odd pairs), added at the end of the block: the
            // `sdot` latency, not its throughput, bounded a single chain.
            let mut isum = [[vdupq_n_s32(0); 2]; R];
            // Two pairs (16 k) at a time: one 16-byte activation load per row, whose four 32-bit
            // lanes are the low and high nibbles' k of each pair (`check`: pairs is even).
            for p in (0..g.pairs).step_by(2) {
                let off = (kb * g.pairs + p) * 64 + quad * 16;
                // SAFETY: `check` proved w.len() ≥ kb_total · pairs · 64 ≥ off + 64 + 16.
                let (w0, w1) = unsafe { (vld1q_u8(g.w.as_ptr().add(off)), vld1q_u8(g.w.as_ptr().add(off + 64))) };
                let (wl0, wh0) = (vqtbl1q_s8(lut, vandq_u8(w0, mask)), vqtbl1q_s8(lut, vshrq_n_u8::<4>(w0)));
                let (wl1, wh1) = (vqtbl1q_s8(lut, vandq_u8(w1, mask)), vqtbl1q_s8(lut, vshrq_n_u8::<4>(w1)));
                for r in 0..R {
                    // SAFETY: `check` proved a.len() ≥ kb_total · v ≥ kb · v + p · 8 + 16.
                    let a = unsafe { vld1q_s8(rows.a[r].as_ptr().add(kb * v + p * 8)) };
                    // SAFETY: this function runs only where FEAT_DotProd was detected.
                    unsafe {
                        isum[r][0] = sdot_lane::<1>(sdot_lane::<0>(isum[r][0], wl0, a), wh0, a);
                        isum[r][1] = sdot_lane::<3>(sdot_lane::<2>(isum[r][1], wl1, a), wh1, a);
                    }
                }
            }
            let sb = quad_scales(g, kb, quad);
            for r in 0..R {
                let i = vaddq_s32(isum[r][0], isum[r][1]);
                acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(i), block_scale(g.kind, sb, rows.sc[r][kb]));
            }
        }
        store_quad(&acc, quad, out);
    }
}

/// The `smmla` kernel (FEAT_I8MM): rows in pairs (an odd last row is paired with the repeat
/// `Fp4Rows` provides; its results are dropped), each `smmla` adds 2 rows × 2 columns × 8
/// products. The low and high nibbles of a 4-column quad interleave (`zip1`/`zip2` of 32-bit
/// lanes) into columns × 8 consecutive k; the activations of a row pair are `[r0: 8 k][r1: 8 k]`.
///
/// # Safety
/// NEON, FEAT_DotProd and FEAT_I8MM must be available; `g.check(rows)` must have passed.
#[target_feature(enable = "neon,dotprod,i8mm")]
pub(crate) unsafe fn fp4_group_smmla<const R: usize>(
    g: &Fp4Group<'_>,
    rows: &Fp4Rows<'_>,
    out: &mut [[f32; GROUP]; MR],
) {
    // SAFETY: E2M1_DOUBLED holds 16 bytes.
    let lut = unsafe { vld1q_s8(E2M1_DOUBLED.as_ptr()) };
    let mask = vdupq_n_u8(0x0F);
    debug_assert_eq!(rows.count(), R);
    debug_assert!(R <= 4);
    let v = g.pairs * 8;
    for quad in 0..4 {
        let mut acc = [vdupq_n_f32(0.0); R];
        for kb in 0..g.kb {
            // [pair of rows][pair parity · 2 + (columns 0-1 | 2-3)]: two chains per output, added
            // at the end of the block.
            let mut mm = [[vdupq_n_s32(0); 4]; 2];
            // Two pairs at a time (`check`: pairs is even): one 16-byte activation load per row.
            for p in (0..g.pairs).step_by(2) {
                let mut b = [[vdupq_n_s8(0); 2]; 2]; // [pair][columns 0-1 | 2-3]
                for (i, bp) in b.iter_mut().enumerate() {
                    let off = (kb * g.pairs + p + i) * 64 + quad * 16;
                    // SAFETY: `check` proved w.len() ≥ kb_total · pairs · 64 ≥ off + 16.
                    let w = unsafe { vld1q_u8(g.w.as_ptr().add(off)) };
                    let wl = vreinterpretq_s32_s8(vqtbl1q_s8(lut, vandq_u8(w, mask)));
                    let wh = vreinterpretq_s32_s8(vqtbl1q_s8(lut, vshrq_n_u8::<4>(w)));
                    *bp = [vreinterpretq_s8_s32(vzip1q_s32(wl, wh)), vreinterpretq_s8_s32(vzip2q_s32(wl, wh))];
                }
                for (rp, m) in mm.iter_mut().enumerate().take(R.div_ceil(2)) {
                    let k = kb * v + p * 8;
                    // SAFETY: `check` proved every row's a.len() ≥ kb_total · v ≥ k + 16.
                    let (x0, x1) = unsafe {
                        (
                            vreinterpretq_s64_s8(vld1q_s8(rows.a[2 * rp].as_ptr().add(k))),
                            vreinterpretq_s64_s8(vld1q_s8(rows.a[2 * rp + 1].as_ptr().add(k))),
                        )
                    };
                    // [r0: 8 k of pair p][r1: the same], then pair p + 1.
                    let a = [vreinterpretq_s8_s64(vzip1q_s64(x0, x1)), vreinterpretq_s8_s64(vzip2q_s64(x0, x1))];
                    for (i, (ai, bp)) in a.iter().zip(&b).enumerate() {
                        // SAFETY: this function runs only where FEAT_I8MM was detected.
                        unsafe {
                            m[2 * i] = smmla(m[2 * i], *ai, bp[0]);
                            m[2 * i + 1] = smmla(m[2 * i + 1], *ai, bp[1]);
                        }
                    }
                }
            }
            let sb = quad_scales(g, kb, quad);
            for r in 0..R {
                let m = &mm[r / 2];
                let (m01, m23) =
                    (vreinterpretq_s64_s32(vaddq_s32(m[0], m[2])), vreinterpretq_s64_s32(vaddq_s32(m[1], m[3])));
                let isum = vreinterpretq_s32_s64(if r % 2 == 0 { vzip1q_s64(m01, m23) } else { vzip2q_s64(m01, m23) });
                acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(isum), block_scale(g.kind, sb, rows.sc[r][kb]));
            }
        }
        store_quad(&acc, quad, out);
    }
}
