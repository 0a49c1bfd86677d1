//! NEON MXFP8 group kernel (the canonical order is in `crate::simd::fp8`): E4M3 weight bytes
//! become IEEE half bits (= value · 2⁻⁸) in 16-bit lanes, `fcvtl`/`fcvtl2` widen them to f32, and
//! each row's block sum is a chain of `fmla`. `fcvtl` is emitted with `asm!` (the f16 vector types
//! are not stable in the crate's MSRV); it is part of base ARMv8.

use crate::simd::fp8::{Fp8Group, Fp8Rows};
use crate::simd::{GROUP, MR};
use std::arch::aarch64::*;
use std::arch::asm;

/// The f32 values of the low / high four halves of `h`.
#[inline(always)]
fn widen_halves(h: uint16x8_t) -> (float32x4_t, float32x4_t) {
    let (lo, hi): (float32x4_t, float32x4_t);
    // SAFETY: `fcvtl`/`fcvtl2` are base ARMv8 instructions; they read `h` and write `lo`/`hi`
    // (and, for a signalling NaN, FPSR.IOC: hence no `preserves_flags`).
    unsafe {
        asm!(
            "fcvtl {lo:v}.4s, {h:v}.4h",
            "fcvtl2 {hi:v}.4s, {h:v}.8h",
            h = in(vreg) h,
            lo = out(vreg) lo,
            hi = out(vreg) hi,
            options(pure, nomem, nostack)
        );
    }
    (lo, hi)
}

/// # Safety
/// NEON must be available; `g.check(rows)` must have passed.
#[target_feature(enable = "neon")]
#[inline(never)]
pub(crate) unsafe fn fp8_group_neon<const R: usize>(
    g: &Fp8Group<'_>,
    rows: &Fp8Rows<'_>,
    out: &mut [[f32; GROUP]; MR],
) {
    debug_assert_eq!(rows.count, R);
    let sign = vdupq_n_u16(0x8000);
    let v = g.v;
    for half in 0..2 {
        let mut acc = [[vdupq_n_f32(0.0); 2]; R];
        for b in 0..g.kb {
            let mut bs = [[vdupq_n_f32(0.0); 2]; R];
            for kk in b * v..(b + 1) * v {
                // SAFETY: `check` proved w.len() ≥ kb · V · 16 ≥ kk · 16 + half · 8 + 8.
                let x = vmovl_u8(unsafe { vld1_u8(g.w.as_ptr().add(kk * GROUP + half * 8)) });
                let mag = vshrq_n_u16::<2>(vshlq_n_u16::<9>(x));
                let h = vorrq_u16(mag, vandq_u16(vshlq_n_u16::<8>(x), sign));
                let (w0, w1) = widen_halves(h);
                for r in 0..R {
                    // SAFETY: `check` proved a.len() ≥ kb · V > kk.
                    let a = unsafe { *rows.a[r].get_unchecked(kk) };
                    bs[r] = [vfmaq_n_f32(bs[r][0], w0, a), vfmaq_n_f32(bs[r][1], w1, a)];
                }
            }
            for (j, quad) in [0usize, 4].into_iter().enumerate() {
                let o = b * GROUP + half * 8 + quad;
                let sb = [g.ws[o] as i32, g.ws[o + 1] as i32, g.ws[o + 2] as i32, g.ws[o + 3] as i32];
                // SAFETY: sb holds 4 i32.
                let sb = unsafe { vld1q_s32(sb.as_ptr()) };
                for r in 0..R {
                    let e = vaddq_s32(sb, vdupq_n_s32(rows.sc[r][b] as i32));
                    let e = vminq_s32(vmaxq_s32(e, vdupq_n_s32(0)), vdupq_n_s32(255));
                    let s = vreinterpretq_f32_s32(vshlq_n_s32::<23>(e));
                    acc[r][j] = vfmaq_f32(acc[r][j], bs[r][j], s);
                }
            }
        }
        for r in 0..R {
            let mut tmp = [0f32; 8];
            // SAFETY: tmp holds 8 f32.
            unsafe {
                vst1q_f32(tmp.as_mut_ptr(), acc[r][0]);
                vst1q_f32(tmp.as_mut_ptr().add(4), acc[r][1]);
            }
            out[r][half * 8..half * 8 + 8].copy_from_slice(&tmp);
        }
    }
}
