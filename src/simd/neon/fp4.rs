//! NEON FP4 group kernel (see the parent module for the arithmetic). Weights decode to signed
//! doubled E2M1 with `tbl`, so no offset correction is needed; `smull` + i16 adds + pairwise
//! widening adds give one exact i32 block sum per column. i16 partial sums stay ≤ 8 · 144.

use crate::formats::fp4::E2M1_DOUBLED;
use crate::simd::fp4::{Fp4Group, Fp4Rows, ScaleKind};
use crate::simd::{GROUP, MR};
use std::arch::aarch64::*;

#[inline(always)]
fn read_u32(p: &[i8], i: usize) -> u32 {
    let b: [i8; 4] = p[i..i + 4].try_into().unwrap_or([0; 4]); // one bounds check, one load
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

/// # Safety
/// NEON must be available; `g.check(rows)` must have passed.
#[target_feature(enable = "neon")]
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
                    let a0 = vreinterpretq_s8_u32(vdupq_n_u32(read_u32(a, kb * v + p * 8)));
                    let a1 = vreinterpretq_s8_u32(vdupq_n_u32(read_u32(a, kb * v + p * 8 + 4)));
                    let l = vaddq_s16(
                        vmull_s8(vget_low_s8(wl), vget_low_s8(a0)),
                        vmull_s8(vget_low_s8(wh), vget_low_s8(a1)),
                    );
                    let h = vaddq_s16(vmull_high_s8(wl, a0), vmull_high_s8(wh, a1));
                    lo16[r] = vaddq_s16(lo16[r], l);
                    hi16[r] = vaddq_s16(hi16[r], h);
                }
            }
            let sbytes = &g.ws[kb * GROUP + quad * 4..kb * GROUP + quad * 4 + 4];
            let sb = [sbytes[0] as u32, sbytes[1] as u32, sbytes[2] as u32, sbytes[3] as u32];
            // SAFETY: sb holds 4 u32.
            let sb = unsafe { vld1q_u32(sb.as_ptr()) };
            for r in 0..R {
                let isum = vpaddq_s32(vpaddlq_s16(lo16[r]), vpaddlq_s16(hi16[r]));
                let s = match g.kind {
                    ScaleKind::E5m3 => vmulq_f32(
                        vreinterpretq_f32_u32(vshlq_n_u32::<20>(sb)),
                        vdupq_n_f32(f32::from_bits(rows.sc[r][kb])),
                    ),
                    ScaleKind::E8m0 => {
                        let e = vaddq_s32(vreinterpretq_s32_u32(sb), vdupq_n_s32(rows.sc[r][kb] as i32));
                        let e = vminq_s32(vmaxq_s32(e, vdupq_n_s32(0)), vdupq_n_s32(255));
                        vreinterpretq_f32_s32(vshlq_n_s32::<23>(e))
                    }
                };
                acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(isum), s);
            }
        }
        for r in 0..R {
            let mut tmp = [0f32; 4];
            // SAFETY: tmp holds 4 f32.
            unsafe { vst1q_f32(tmp.as_mut_ptr(), acc[r]) };
            out[r][quad * 4..quad * 4 + 4].copy_from_slice(&tmp);
        }
    }
}
