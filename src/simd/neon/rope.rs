//! RoPE rotation on NEON f32 lanes, bit-identical to the portable version in
//! [`crate::simd::rope`] (the same operations lane by lane; see the x86 module for the interleaved
//! trick). `MaxCompat` with f16 freqs rounds through `half` pair by pair (Rust's NEON f16
//! conversions are not stable).

use crate::simd::rope::{RopeRow, Round, pair, rotate_scalar};
use std::arch::aarch64::*;

#[target_feature(enable = "neon")]
#[inline]
fn round_bf16(v: float32x4_t) -> float32x4_t {
    let x = vreinterpretq_u32_f32(v);
    let lsb = vandq_u32(vshrq_n_u32::<16>(x), vdupq_n_u32(1));
    let rne = vaddq_u32(vaddq_u32(x, vdupq_n_u32(0x7FFF)), lsb);
    let quiet = vorrq_u32(x, vdupq_n_u32(0x0040_0000));
    let nan = vmvnq_u32(vceqq_f32(v, v));
    vreinterpretq_f32_u32(vandq_u32(vbslq_u32(nan, quiet, rne), vdupq_n_u32(0xFFFF_0000)))
}

#[target_feature(enable = "neon")]
#[inline]
fn round(v: float32x4_t, r: Round) -> float32x4_t {
    if r == Round::Bf16 { round_bf16(v) } else { v }
}

/// # Safety
/// NEON must be available; `row` holds the forms of `x.len()` rotary dims.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn rotate_neon(x: &mut [f32], row: &RopeRow<'_>, interleaved: bool, r: Round) {
    if r == Round::F16 {
        return rotate_scalar(x, row, interleaved, r);
    }
    let rd = x.len();
    let xp = x.as_mut_ptr();
    if interleaved {
        let sign = vreinterpretq_u32_u64(vdupq_n_u64(0x8000_0000));
        let mut i = 0;
        while i + 4 <= rd {
            // SAFETY: lanes i .. i + 4 of x, f and fsw (all rd long).
            unsafe {
                let v = round(vld1q_f32(xp.add(i)), r);
                let (x0, x1) = (vtrn1q_f32(v, v), vtrn2q_f32(v, v));
                let t = round(vmulq_f32(x1, vld1q_f32(row.fsw.as_ptr().add(i))), r);
                let t = vreinterpretq_f32_u32(veorq_u32(vreinterpretq_u32_f32(t), sign));
                let y = round(vfmaq_f32(t, x0, vld1q_f32(row.f.as_ptr().add(i))), r);
                vst1q_f32(xp.add(i), y);
            }
            i += 4;
        }
        for p in i / 2..rd / 2 {
            let (y0, y1) = pair(x[2 * p], x[2 * p + 1], row.c[p], row.s[p], r);
            x[2 * p] = y0;
            x[2 * p + 1] = y1;
        }
    } else {
        let h = rd / 2;
        let mut i = 0;
        while i + 4 <= h {
            // SAFETY: lanes i .. i + 4 of the halves and of c, s (h long).
            unsafe {
                let x0 = round(vld1q_f32(xp.add(i)), r);
                let x1 = round(vld1q_f32(xp.add(h + i)), r);
                let (c, s) = (vld1q_f32(row.c.as_ptr().add(i)), vld1q_f32(row.s.as_ptr().add(i)));
                let t1 = round(vmulq_f32(x1, s), r);
                let y0 = round(vfmaq_f32(vnegq_f32(t1), x0, c), r);
                let t2 = round(vmulq_f32(x1, c), r);
                let y1 = round(vfmaq_f32(t2, x0, s), r);
                vst1q_f32(xp.add(i), y0);
                vst1q_f32(xp.add(h + i), y1);
            }
            i += 4;
        }
        for p in i..h {
            let (y0, y1) = pair(x[p], x[p + h], row.c[p], row.s[p], r);
            x[p] = y0;
            x[p + h] = y1;
        }
    }
}
