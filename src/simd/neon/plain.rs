//! bf16/f16/f32 NEON micro-kernel: 4 rows × 16 columns over the packed groups of
//! [`crate::simd::plain`], f32 `fmla` in the canonical order (odd element of a pair, then even).
//! bf16 widens by a mask or a shift; f16 by integer arithmetic (exact for every finite value and
//! ∞; a NaN stays a NaN), since Rust's `float16x4_t` conversions are not stable.

use crate::simd::GROUP;
use crate::simd::plain::{PackedRows, PlainKind, PlainPanel};
use std::arch::aarch64::*;

const BF16: u8 = 0;
const F16: u8 = 1;
const F32: u8 = 2;

/// Rows per micro-tile.
pub(crate) const MRN: usize = 4;

/// Four f16 (the low halves of the lanes) to f32.
#[target_feature(enable = "neon")]
#[inline]
fn f16x4_to_f32(h: uint32x4_t) -> float32x4_t {
    let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
    let mag = vandq_u32(h, vdupq_n_u32(0x7FFF));
    let shifted = vshlq_n_u32::<13>(mag);
    // Finite values: the f16 bits shifted into an f32 are `value · 2^-112` (subnormal f16 becomes a
    // subnormal f32), and the multiply by 2^112 is exact.
    let finite = vmulq_f32(vreinterpretq_f32_u32(shifted), vdupq_n_f32(f32::from_bits((112 + 127) << 23)));
    let special = vcgeq_u32(mag, vdupq_n_u32(0x7C00));
    let bits = vbslq_u32(special, vorrq_u32(shifted, vdupq_n_u32(0x7F80_0000)), vreinterpretq_u32_f32(finite));
    vreinterpretq_f32_u32(vorrq_u32(bits, sign))
}

/// The four 4-column vectors of one k of a pair: `half = 0` the odd element, 1 the even one.
///
/// # Safety
/// `q` points at a whole k-pair of a group of kind `K`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn load<const K: u8>(q: *const u32, half: usize) -> [float32x4_t; 4] {
    // SAFETY: the words read lie inside the k-pair (16 words for bf16/f16, 32 for f32).
    unsafe {
        match K {
            BF16 => std::array::from_fn(|j| {
                let w = vld1q_u32(q.add(4 * j));
                if half == 0 {
                    vreinterpretq_f32_u32(vandq_u32(w, vdupq_n_u32(0xFFFF_0000)))
                } else {
                    vreinterpretq_f32_u32(vshlq_n_u32::<16>(w))
                }
            }),
            F16 => {
                let h = q.add(half * GROUP / 2).cast::<u16>();
                let (a, b) = (vld1q_u16(h), vld1q_u16(h.add(8)));
                [
                    f16x4_to_f32(vmovl_u16(vget_low_u16(a))),
                    f16x4_to_f32(vmovl_u16(vget_high_u16(a))),
                    f16x4_to_f32(vmovl_u16(vget_low_u16(b))),
                    f16x4_to_f32(vmovl_u16(vget_high_u16(b))),
                ]
            }
            _ => std::array::from_fn(|j| vld1q_f32(q.add(half * GROUP + 4 * j).cast())),
        }
    }
}

/// # Safety
/// NEON must be available; `w.check(a, p0, n, out.len(), ld)` must have passed with `a` in f32
/// form, MR 4.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn panel_neon(
    w: &PlainPanel<'_>,
    a: &PackedRows<'_>,
    p0: usize,
    n: usize,
    out: &mut [f32],
    ld: usize,
    acc_in: bool,
) {
    let pairs = w.pairs;
    for g in 0..w.groups {
        let q = w.data.as_ptr().wrapping_add(g * w.stride);
        for (b, i) in (0..n).step_by(MRN).enumerate() {
            let rows = (n - i).min(MRN);
            let ab = a.f.as_ptr().wrapping_add(b * a.block_len() + p0 * 2 * MRN);
            let dst = out.as_mut_ptr().wrapping_add(i * ld + g * GROUP);
            // SAFETY: `check` proved every group holds `pairs` k-pairs and `out` every (row,
            // column) of the panel at stride `ld`; ab is a whole packed block.
            unsafe {
                match (w.kind, rows) {
                    (PlainKind::Bf16, 1) => micro::<1, BF16>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::Bf16, 2) => micro::<2, BF16>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::Bf16, 3) => micro::<3, BF16>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::Bf16, _) => micro::<4, BF16>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::F16, 1) => micro::<1, F16>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::F16, 2) => micro::<2, F16>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::F16, 3) => micro::<3, F16>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::F16, _) => micro::<4, F16>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::F32, 1) => micro::<1, F32>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::F32, 2) => micro::<2, F32>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::F32, 3) => micro::<3, F32>(q, pairs, ab, dst, ld, acc_in),
                    (PlainKind::F32, _) => micro::<4, F32>(q, pairs, ab, dst, ld, acc_in),
                }
            }
        }
    }
}

/// # Safety
/// NEON; `g` holds `pairs` k-pairs of kind `K`, `a` a packed block of `pairs · 8` f32, `dst` R rows
/// of 16 f32 at stride `ld` (read first when `acc_in`).
#[target_feature(enable = "neon")]
unsafe fn micro<const R: usize, const K: u8>(
    g: *const u32,
    pairs: usize,
    a: *const f32,
    dst: *mut f32,
    ld: usize,
    acc_in: bool,
) {
    let mut acc = [[vdupq_n_f32(0.0); 4]; R];
    if acc_in {
        for r in 0..R {
            for j in 0..4 {
                // SAFETY: dst row r holds 16 f32 by the contract (read first when `acc_in`).
                acc[r][j] = unsafe { vld1q_f32(dst.add(r * ld + 4 * j)) };
            }
        }
    }
    let wpp = if K == F32 { 2 * GROUP } else { GROUP };
    for p in 0..pairs {
        let q = g.wrapping_add(p * wpp);
        let ap = a.wrapping_add(p * 2 * MRN);
        for half in 0..2 {
            // SAFETY: q points at pair p of the group, ap at pair p of the packed block.
            unsafe {
                let wv = load::<K>(q, half);
                for r in 0..R {
                    let x = vdupq_n_f32(*ap.add(half * MRN + r));
                    for j in 0..4 {
                        acc[r][j] = vfmaq_f32(acc[r][j], x, wv[j]);
                    }
                }
            }
        }
    }
    for r in 0..R {
        for j in 0..4 {
            // SAFETY: dst row r holds 16 f32 by the contract.
            unsafe { vst1q_f32(dst.add(r * ld + 4 * j), acc[r][j]) };
        }
    }
}
