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

/// A quantized cache's values ([semantics §3.1](crate::semantics)): `out[i] = value(codes[i]) ·
/// scales[i / g]`, the E4M3 value built from its bits (the code's magnitude bits moved to an f32's
/// exponent and mantissa, times 2^120: exact for normals and subnormals; the NaN codes give NaN),
/// so each element is the oracle's `code.to_f32() * scale`, one rounding. Branch-free, compiled
/// once per ISA ([`crate::simd::kv_dequant`]).
#[inline(always)]
pub(crate) fn kv_dequant_body(codes: &[E4M3], g: usize, scales: &[f32], out: &mut [f32]) {
    const TWO_120: f32 = 1.329_228e36; // 2^120
    for ((c, o), &s) in codes.chunks(g).zip(out.chunks_mut(g)).zip(scales) {
        for (o, c) in o.iter_mut().zip(c) {
            let b = c.0 as u32;
            let v = f32::from_bits(((b & 0x80) << 24) | ((b & 0x7F) << 20)) * TWO_120;
            *o = if b & 0x7F == 0x7F { f32::NAN } else { v } * s;
        }
    }
}

/// The `>` fold of `|x|` from 0 (NaN ignored, as `f32::max`): the largest non-NaN magnitude, or 0.
/// That maximum does not depend on the order of the fold (every candidate is a non-negative float
/// or +0, compared exactly), so it runs as 16 independent lanes that a vector `max` folds at once,
/// merged at the end: a single chain of dependent compares is what LLVM leaves scalar (a float
/// reduction it may not reorder), ~4 cycles an element.
#[inline(always)]
pub(crate) fn amax_body(x: &[f32]) -> f32 {
    const L: usize = 16;
    let step = |m: f32, e: &f32| if e.abs() > m { e.abs() } else { m };
    let mut lanes = [0.0f32; L];
    let mut chunks = x.chunks_exact(L);
    for c in &mut chunks {
        for (m, e) in lanes.iter_mut().zip(c) {
            *m = step(*m, e);
        }
    }
    let tail = chunks.remainder().iter().fold(0.0f32, step);
    lanes.iter().fold(tail, step)
}

/// A quantized cache's groups ([semantics §3.1](crate::semantics)): for each `g`-element group of
/// `x`, `amax` (the `>` fold: NaN ignored, as `f32::max`), the scale and factor of
/// [`fp8_scale`](crate::formats::quantize::fp8_scale), and the codes through [`e4m3_fast`] (the
/// codes of `E4M3::from_f32` for every f32). Compiled once per ISA ([`crate::simd::kv_groups`]).
#[inline(always)]
pub(crate) fn kv_groups_body(x: &[f32], g: usize, codes: &mut [E4M3], scales: &mut [f32]) {
    for ((group, out), s) in x.chunks(g).zip(codes.chunks_mut(g)).zip(scales.iter_mut()) {
        let amax = amax_body(group);
        let (scale, inv) = crate::formats::quantize::fp8_scale(amax);
        for (o, &e) in out.iter_mut().zip(group) {
            *o = E4M3(e4m3_fast(e * inv));
        }
        *s = scale;
    }
}

#[cfg(test)]
mod tests {
    use crate::Isa;
    use crate::dtype::E4M3;
    use crate::simd::{IsaToken, kv_dequant, kv_groups};

    /// Every code, at scales from zero and subnormals to ±∞ and NaN, on every ISA: the value of
    /// the code times its group's scale, bit for bit (a NaN as a NaN).
    #[test]
    fn kv_dequant_is_code_value_times_scale() {
        let codes: Vec<E4M3> = (0..=255u8).map(E4M3).collect();
        let g = 8;
        let some =
            [0.0f32, -0.0, 1.0, 1e-3, -2.5, f32::MIN_POSITIVE, 1e-45, 3.4e38, f32::INFINITY, f32::NAN, 1.0 / 448.0];
        let scales: Vec<f32> = (0..codes.len() / g).map(|i| some[i % some.len()]).collect();
        for isa in Isa::available() {
            let mut out = vec![0f32; codes.len()];
            kv_dequant(IsaToken::new(Some(isa)).unwrap(), &codes, g, &scales, &mut out);
            for (i, (c, o)) in codes.iter().zip(&out).enumerate() {
                let want = c.to_f32() * scales[i / g];
                let same = if want.is_nan() { o.is_nan() } else { o.to_bits() == want.to_bits() };
                assert!(same, "{isa:?}: code {:#04x} × {:e} gave {o:e}, not {want:e}", c.0, scales[i / g]);
            }
        }
    }

    /// Groups of every length up to 40 and 128 (the lane fold's tails), holding NaNs, ±∞, ±0,
    /// subnormals and values past 448 at every place, quantized on every ISA: the codes and scales of
    /// the oracle's element-wise rule (`amax` the `f32::max` fold from 0, `E4M3::from_f32(x · inv)`).
    #[test]
    fn kv_groups_match_the_elementwise_rule() {
        let special = [f32::NAN, f32::INFINITY, -f32::INFINITY, 0.0, -0.0, 1e-40, -3e-39, 1000.0, -460.0, 7.5];
        let mut seed = 0x9E37_79B9u32;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed
        };
        for g in (2..=40).chain([64, 128]) {
            for trial in 0..24 {
                let groups = 3;
                let x: Vec<f32> = (0..g * groups)
                    .map(|_| match next() % 8 {
                        0 if trial % 2 == 1 => special[next() as usize % special.len()],
                        _ => (next() as i32 as f32) * 2f32.powi(-((next() % 40) as i32)),
                    })
                    .collect();
                for isa in Isa::available() {
                    let mut codes = vec![E4M3(0); x.len()];
                    let mut scales = vec![0f32; groups];
                    kv_groups(IsaToken::new(Some(isa)).unwrap(), &x, g, &mut codes, &mut scales);
                    for (q, group) in x.chunks(g).enumerate() {
                        let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let (scale, inv) = crate::formats::quantize::fp8_scale(amax);
                        assert_eq!(scales[q].to_bits(), scale.to_bits(), "{isa:?} g {g}: scale of {group:?}");
                        for (j, v) in group.iter().enumerate() {
                            let want = E4M3::from_f32(v * inv);
                            assert_eq!(codes[q * g + j].0, want.0, "{isa:?} g {g}: {v:e} × {inv:e}");
                        }
                    }
                }
            }
        }
    }
}
