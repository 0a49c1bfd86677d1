//! The activation quantizer's row body (`crate::formats::quantize::quantize` calls it through
//! [`crate::simd::quantize_row`], which compiles it for each ISA): portable, branch-free code
//! that the compiler vectorises at each width. Its formulas are those of `formats::quantize`'s
//! module docs, tested there against the element-wise encoders.

use crate::dtype::{BlockFormat, E2M1_MAX, E4M3, E4M3_MAX};

/// Most blocks of a row quantized in one batch of [`quantize_row_body`]'s passes.
const BATCH: usize = 64;

/// The quantizer's row body, compiled once per ISA (`crate::simd` calls it from a
/// `#[target_feature]` function). Three passes over batches of blocks, each a loop the compiler
/// vectorises: the blocks' largest magnitudes; their scales and factors (the formulas of the
/// `formats::quantize` docs, through [`e4m3_fast`] and bit-built decodes); the element codes through the
/// branch-free encoders ([`e2m1_fast`], [`e4m3_fast`]: the scalar encoders' codes for every f32,
/// tested). The same bytes as encoding element by element (tested against the formulas):
/// measured in docs/performance.md ("Quantizing activations").
#[inline(always)]
pub(crate) fn quantize_row_body(format: BlockFormat, row: &[f32], g: f32, data: &mut [u8], scales: &mut [u8]) {
    let v = format.vector_size();
    let (mut amax, mut inv) = ([0f32; BATCH], [0f32; BATCH]);
    for (batch, (chunk, sc)) in row.chunks(BATCH * v).zip(scales.chunks_mut(BATCH)).enumerate() {
        let nb = sc.len();
        for (a, block) in amax.iter_mut().zip(chunk.chunks(v)) {
            // `>` as `maxps` computes it: the input is finite, so this is `f32::max`.
            *a = block.iter().fold(0.0f32, |m, e| if e.abs() > m { e.abs() } else { m });
        }
        for ((a, s), i) in amax[..nb].iter().zip(sc.iter_mut()).zip(&mut inv) {
            (*s, *i) = block_scale_fast(format, *a, g);
        }
        let first = batch * BATCH * v;
        if format.is_fp4() {
            // Two codes per byte, the even element in the low nibble (blocks and K are even).
            let out = &mut data[first / 2..(first + chunk.len()) / 2];
            for ((o, block), &i) in out.chunks_mut(v / 2).zip(chunk.chunks(v)).zip(&inv) {
                // The block's codes first (a clean u32 → u8 vector loop), then the nibble pairs.
                let mut codes = [0u8; 32];
                for (c, &e) in codes.iter_mut().zip(block) {
                    *c = e2m1_fast(e * i);
                }
                for (o, pair) in o.iter_mut().zip(codes.as_chunks::<2>().0) {
                    *o = pair[0] | (pair[1] << 4);
                }
            }
        } else {
            let out = &mut data[first..first + chunk.len()];
            for ((o, block), &i) in out.chunks_mut(v).zip(chunk.chunks(v)).zip(&inv) {
                for (o, &e) in o.iter_mut().zip(block) {
                    *o = e4m3_fast(e * i);
                }
            }
        }
    }
}

/// The block scale of `formats::quantize`'s formulas without branches on the value: the same scale byte and factor for every
/// `amax ≥ 0` (tested).
#[inline(always)]
pub(crate) fn block_scale_fast(format: BlockFormat, amax: f32, g: f32) -> (u8, f32) {
    match format {
        BlockFormat::Nvfp4 => {
            let sf = e4m3_fast(g * amax / E2M1_MAX);
            let dec = e4m3_decode_fast(sf);
            let d = dec * (1.0 / g);
            let inv = if amax == 0.0 || dec == 0.0 { 0.0 } else { 1.0 / d };
            (sf, inv)
        }
        BlockFormat::Mxfp4 => {
            let sf = e8m0_roundup_fast(amax / E2M1_MAX);
            (sf, 1.0 / e8m0_decode_fast(sf))
        }
        BlockFormat::Mxfp8 => {
            let sf = e8m0_roundup_fast(amax / E4M3_MAX);
            (sf, 1.0 / e8m0_decode_fast(sf))
        }
    }
}

/// [`e4m3_to_f32`](crate::formats::fp8::e4m3_to_f32) of a non-negative, non-NaN code (a block scale from [`e4m3_fast`] of a
/// finite `amax ≥ 0`): normals from their bits, subnormals as `m · 2^-9`.
#[inline(always)]
fn e4m3_decode_fast(code: u8) -> f32 {
    let (e, m) = (u32::from(code >> 3), u32::from(code & 7));
    let normal = f32::from_bits(((e + 120) << 23) | (m << 20));
    let sub = m as f32 * (1.0 / 512.0);
    if e == 0 { sub } else { normal }
}

/// [`e8m0_from_f32_roundup`](crate::formats::fp8::e8m0_from_f32_roundup) of a finite `x ≥ 0` (what a block's `amax / max` is).
#[inline(always)]
fn e8m0_roundup_fast(x: f32) -> u8 {
    let bits = x.to_bits();
    let (exp, mant) = (bits >> 23, bits & 0x7F_FFFF);
    let bump = (mant != 0) & (exp != 0xFE) & !(exp == 0 && mant <= 0x40_0000);
    (exp + u32::from(bump)) as u8
}

/// [`e8m0_to_f32`](crate::formats::fp8::e8m0_to_f32) of a byte other than `0xFF` (one [`e8m0_roundup_fast`] gives for a finite
/// value): `0x00` is 2^-127.
#[inline(always)]
fn e8m0_decode_fast(byte: u8) -> f32 {
    let bits = u32::from(byte) << 23;
    f32::from_bits(if byte == 0 { 0x0040_0000 } else { bits })
}

/// [`e2m1_from_f32`](crate::formats::fp4::e2m1_from_f32) without branches: the magnitude code is the
/// number of rounding thresholds `|x|` passes (ties to even: the even codes' thresholds are
/// inclusive), compared as bits (for non-negative floats the integer order is the float order),
/// so it vectorises.
#[inline(always)]
pub(crate) fn e2m1_fast(x: f32) -> u8 {
    let bits = x.to_bits();
    let b = bits & 0x7FFF_FFFF;
    let t = |v: f32| v.to_bits();
    let mag = u32::from(b > t(0.25))
        + u32::from(b >= t(0.75))
        + u32::from(b > t(1.25))
        + u32::from(b >= t(1.75))
        + u32::from(b > t(2.5))
        + u32::from(b >= t(3.5))
        + u32::from(b > t(5.0));
    // NaN (above +∞'s bits) encodes as 0, sign dropped.
    let code = ((bits >> 28) & 8) | mag;
    (if b > 0x7F80_0000 { 0 } else { code }) as u8
}

/// [`e4m3_from_f32`](crate::formats::fp8::e4m3_from_f32) without branches on the value (selects, integer operations on the bits):
/// round to nearest even on the f32 bits for normals (adding half an E4M3 step minus one, plus
/// the kept lsb, carries into the exponent exactly when the f64 form's mantissa rounds to 8), the
/// code then `(bits >> 20) − (120 << 3)`; `round(|x| · 512)` for subnormals through the 2^23
/// trick (exact below 2^22, read back from the bits); saturation to ±448, NaN to `0x7F`.
#[inline(always)]
pub(crate) fn e4m3_fast(x: f32) -> u8 {
    const BIG: f32 = 8_388_608.0; // 2^23
    let bits = x.to_bits();
    let b = bits & 0x7FFF_FFFF;
    let r = b.wrapping_add(0x7FFFF + ((b >> 20) & 1));
    let normal = (r >> 20).wrapping_sub(120 << 3).min(0x7E);
    let sub = (f32::from_bits(b) * 512.0 + BIG).to_bits().wrapping_sub(BIG.to_bits());
    let mag = if b < (1.0f32 / 64.0).to_bits() { sub } else { normal };
    let mag = if b >= E4M3_MAX.to_bits() { 0x7E } else { mag };
    (if b > 0x7F80_0000 { 0x7F } else { ((bits >> 24) & 0x80) | mag }) as u8
}

/// A quantized cache's groups ([semantics §3.1](crate::semantics)): for each `g`-element group of
/// `x`, `amax` (the `>` fold: NaN ignored, as `f32::max`), the scale and factor of
/// [`fp8_scale`](crate::formats::quantize::fp8_scale), and the codes through [`e4m3_fast`] (the
/// codes of `E4M3::from_f32` for every f32). Compiled once per ISA ([`crate::simd::kv_groups`]).
#[inline(always)]
pub(crate) fn kv_groups_body(x: &[f32], g: usize, codes: &mut [E4M3], scales: &mut [f32]) {
    for ((group, out), s) in x.chunks(g).zip(codes.chunks_mut(g)).zip(scales.iter_mut()) {
        let amax = group.iter().fold(0.0f32, |m, e| if e.abs() > m { e.abs() } else { m });
        let (scale, inv) = crate::formats::quantize::fp8_scale(amax);
        for (o, &e) in out.iter_mut().zip(group) {
            *o = E4M3(e4m3_fast(e * inv));
        }
        *s = scale;
    }
}
