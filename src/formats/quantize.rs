//! Quantizers (f32/bf16/f16 → NVFP4, MXFP4, MXFP8 with 5-D scales) and dequantizers, following
//! the producer formulas of [semantics §2](crate::semantics).
//!
//! For each block of `V` consecutive elements of a row (the last block of a row may be partial):
//! * NVFP4: `amax = max|x|`; `sf = e4m3(global_scale · amax / 6)`;
//!   `inv = 1 / (f32(sf) · (1 / global_scale))` (0 when `amax == 0` or `sf` decodes to 0);
//!   `q = e2m1(x · inv)`. The element then stands for `dec(q) · dec(sf) / global_scale`.
//! * MXFP4: `sf = e8m0_roundup(amax / 6)`, `q = e2m1(x / dec(sf))` (no saturation: the scale is
//!   rounded up).
//! * MXFP8: `sf = e8m0_roundup(amax / 448)`, `q = e4m3(x / dec(sf))`.
//!
//! * FP8 W8A8 ([`quantize_fp8_input`], [`quantize_fp8_weight`]): per tensor, per row or per
//!   128-block, MAX's dynamic FP8 quantizer (`quantize_dynamic_scaled_fp8` with f32 scales,
//!   without its `scale_ub` cap): `scale = amax / 448`, `q = e4m3(x · (1 / scale))` (saturating;
//!   an all-zero group has scale 0 and codes 0); the f32 scales laid out as
//!   [`Fp8Granularity::scale_shapes`] says.
//!
//! One deliberate difference from MAX's GPU quantizer: a scale that overflows E4M3 saturates to 448
//! (MAX's plain cast gives NaN, quirk K17).

use super::fp4::E2M1_MAX;
use super::fp8::E4M3_MAX;
#[cfg(test)]
use super::fp8::{e4m3_from_f32, e4m3_to_f32, e8m0_from_f32_roundup, e8m0_to_f32};
use super::scale_layout::ScaleLayout;
use super::{BlockFormat, QuantizedMatrix, QuantizedRef, check_len_2d};
use crate::element::Element;
use crate::error::{Error, Result};
use crate::ops::{FP8_BLOCK, Fp8Granularity};

/// NVIDIA's recipe for the NVFP4 global (encode) scale of a tensor whose largest magnitude is
/// `amax`: `448 · 6 / amax`, so the largest block scale lands on E4M3's maximum. 1 when `amax`
/// is 0 or not finite.
pub fn nvfp4_global_scale(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() { E4M3_MAX * E2M1_MAX / amax } else { 1.0 }
}

/// Largest magnitude of a slice (0 for an empty one; NaN is ignored).
pub fn amax<T: Element>(x: &[T]) -> f32 {
    x.iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max)
}

/// Quantizes a row-major `[rows, k]` matrix.
///
/// `global_scale` is NVFP4's encode scale (MAX's `tensor_sf_q`, NVIDIA's "global scale"): block
/// scales are computed from `global_scale · amax / 6`, and the result's
/// [`tensor_scale`](QuantizedMatrix::tensor_scale) is `1 / global_scale`. [`nvfp4_global_scale`]
/// gives the usual choice. The MX formats ignore it (their `tensor_scale` is 1).
///
/// Errors: `x.len() != rows · k`, odd `k` for the FP4 formats, a non-finite element, or (NVFP4) a
/// `global_scale` that is not finite and positive.
pub fn quantize<T: Element>(
    format: BlockFormat,
    x: &[T],
    rows: usize,
    k: usize,
    global_scale: f32,
) -> Result<QuantizedMatrix> {
    check_len_2d("x", x.len(), rows, k)?;
    if k == 0 || (format.is_fp4() && !k.is_multiple_of(2)) {
        return Err(Error::dim("k", format!("must be at least 1 (even for packed FP4), found {k}")));
    }
    // A pass that vectorises first; the index only when there is one to report.
    if x.iter().fold(false, |bad, v| bad | !v.to_f32().is_finite())
        && let Some(index) = x.iter().position(|v| !v.to_f32().is_finite())
    {
        return Err(Error::NonFinite { arg: "x", index });
    }
    let g = if format == BlockFormat::Nvfp4 {
        if !(global_scale.is_finite() && global_scale > 0.0) {
            return Err(Error::dim("global_scale", format!("must be finite and > 0, found {global_scale}")));
        }
        global_scale
    } else {
        1.0
    };
    let v = format.vector_size();
    let layout = ScaleLayout::for_operand(rows, k, v);
    let kb_count = layout.k_blocks();
    let mut plain_scales = vec![0u8; rows * kb_count];
    let row_bytes = format.row_bytes(k);
    let mut data = vec![0u8; rows * row_bytes];
    let mut wide = Vec::new();
    for r in 0..rows {
        let row = &x[r * k..(r + 1) * k];
        let row = match crate::simd::rope::same_type::<T, f32>(row) {
            Some(r) => r,
            None => {
                wide.clear();
                wide.extend(row.iter().map(|e| e.to_f32()));
                &wide[..]
            }
        };
        quantize_row(
            format,
            row,
            g,
            &mut data[r * row_bytes..(r + 1) * row_bytes],
            &mut plain_scales[r * kb_count..(r + 1) * kb_count],
        );
    }
    let scales = layout.interleave(&plain_scales)?;
    QuantizedMatrix::from_parts(format, rows, k, data, scales, 1.0 / g)
}

/// The scale byte of a block whose largest magnitude is `amax`, and the factor its elements are
/// multiplied by before encoding (the formulas of the module docs; `g` is NVFP4's global scale).
/// The quantizer computes it as [`block_scale_fast`] (the same bits, tested against this).
#[cfg(test)]
fn block_scale(format: BlockFormat, amax: f32, g: f32) -> (u8, f32) {
    match format {
        BlockFormat::Nvfp4 => {
            let sf = e4m3_from_f32(g * amax / E2M1_MAX);
            let dec = e4m3_to_f32(sf);
            let inv = if amax == 0.0 || dec == 0.0 { 0.0 } else { 1.0 / (dec * (1.0 / g)) };
            (sf, inv)
        }
        BlockFormat::Mxfp4 => {
            let sf = e8m0_from_f32_roundup(amax / E2M1_MAX);
            (sf, 1.0 / e8m0_to_f32(sf))
        }
        BlockFormat::Mxfp8 => {
            let sf = e8m0_from_f32_roundup(amax / E4M3_MAX);
            (sf, 1.0 / e8m0_to_f32(sf))
        }
    }
}

/// Quantizes one row of finite values: its codes into `data` (`format.row_bytes(k)` bytes) and
/// its plain (row-major) block scales into `scales`, on the best ISA (see
/// `crate::simd::quant::quantize_row_body`).
fn quantize_row(format: BlockFormat, row: &[f32], g: f32, data: &mut [u8], scales: &mut [u8]) {
    crate::simd::quantize_row(crate::simd::IsaToken::best(), format, row, g, data, scales)
}

/// Dequantizes to a row-major `[rows, k]` f32 matrix: `tensor_scale · dec(code) · dec(scale)`,
/// computed in f32 in that order (`dec(code) · dec(scale)` is exact).
pub fn dequantize(q: QuantizedRef<'_>, tensor_scale: f32) -> Vec<f32> {
    let v = q.format().vector_size();
    let mut out = Vec::with_capacity(q.rows() * q.k());
    for r in 0..q.rows() {
        let row = q.row(r);
        for k in 0..q.k() {
            let s = q.scale(r, k / v);
            out.push(tensor_scale * (q.format().element_to_f32(row, k) * s));
        }
    }
    out
}

/// The scale `amax / 448` and the reciprocal the elements are multiplied by, as MAX's
/// `compute_dynamic_fp8_scale` forms them (`fp8_quantization.mojo`, without its `scale_ub` cap):
/// the reciprocal is 0 where the scale is 0 or its reciprocal is not finite.
pub(crate) fn fp8_scale(amax: f32) -> (f32, f32) {
    let s = amax / E4M3_MAX;
    let r = if s == 0.0 { 0.0 } else { 1.0 / s };
    (s, if r.is_finite() { r } else { 0.0 })
}

/// Quantizes FP8 W8A8 activations `[m, k]` (row-major) at granularity `g`: the E4M3 bytes and
/// the f32 `input_scale` (`[1, 1]`, `[1, m]` or `[ceil(k/128), m]`), each scale `amax / 448` of
/// its tensor, token or 1×128 block, as MAX's dynamic quantizer forms it (module docs).
pub fn quantize_fp8_input<T: Element>(x: &[T], m: usize, k: usize, g: Fp8Granularity) -> Result<(Vec<u8>, Vec<f32>)> {
    check_len_2d("x", x.len(), m, k)?;
    let kb = k.div_ceil(FP8_BLOCK);
    let scale_of = |r: usize, kk: usize| -> usize {
        match g {
            Fp8Granularity::Tensor => 0,
            Fp8Granularity::Channel => r,
            Fp8Granularity::Block => kk / FP8_BLOCK * m + r,
        }
    };
    let len = match g {
        Fp8Granularity::Tensor => 1,
        Fp8Granularity::Channel => m,
        Fp8Granularity::Block => kb * m,
    };
    fp8_quantize(x, m, k, len, scale_of)
}

/// Quantizes an FP8 W8A8 weight `[n, k]` at granularity `g`: the E4M3 bytes and the f32
/// `weight_scale` (`[1, 1]`, `[n, 1]` or `[ceil(n/128), ceil(k/128)]`), each scale `amax / 448`
/// of its tensor, row or 128×128 block.
pub fn quantize_fp8_weight<T: Element>(w: &[T], n: usize, k: usize, g: Fp8Granularity) -> Result<(Vec<u8>, Vec<f32>)> {
    check_len_2d("w", w.len(), n, k)?;
    let kb = k.div_ceil(FP8_BLOCK);
    let len = match g {
        Fp8Granularity::Tensor => 1,
        Fp8Granularity::Channel => n,
        Fp8Granularity::Block => n.div_ceil(FP8_BLOCK) * kb,
    };
    fp8_quantize(w, n, k, len, |r, kk| match g {
        Fp8Granularity::Tensor => 0,
        Fp8Granularity::Channel => r,
        Fp8Granularity::Block => r / FP8_BLOCK * kb + kk / FP8_BLOCK,
    })
}

/// `[rows, k]` to E4M3 with `len` scales, element (r, k) under scale `scale_of(r, k)`.
fn fp8_quantize<T: Element>(
    x: &[T],
    rows: usize,
    k: usize,
    len: usize,
    scale_of: impl Fn(usize, usize) -> usize,
) -> Result<(Vec<u8>, Vec<f32>)> {
    let mut amaxes = vec![0f32; len];
    for r in 0..rows {
        for (kk, v) in x[r * k..(r + 1) * k].iter().enumerate() {
            let a = &mut amaxes[scale_of(r, kk)];
            *a = a.max(v.to_f32().abs());
        }
    }
    let (scales, recips): (Vec<f32>, Vec<f32>) = amaxes.into_iter().map(fp8_scale).unzip();
    let mut q = vec![0u8; rows * k];
    for r in 0..rows {
        for kk in 0..k {
            q[r * k + kk] = super::fp8::e4m3_from_f32(x[r * k + kk].to_f32() * recips[scale_of(r, kk)]);
        }
    }
    Ok((q, scales))
}

#[cfg(test)]
mod tests {
    use super::quantize;
    use crate::formats::BlockFormat;
    use crate::formats::fp4::{e2m1_from_f32, pack_e2m1};
    use crate::formats::fp8::e4m3_from_f32;
    use crate::simd::quant::{block_scale_fast, e2m1_fast, e4m3_fast};
    use crate::{bf16, f16};

    /// f32 bit patterns that reach every rounding decision of both encoders: every sign, exponent
    /// and top three mantissa bits, with the 20 discarded bits at and around each tie (and a few
    /// others), plus pseudo-random patterns (subnormal E4M3 rounding falls elsewhere in the bits).
    fn patterns() -> impl Iterator<Item = u32> {
        const LOW: [u32; 12] =
            [0, 1, 2, 0x3FFFF, 0x40000, 0x7FFFE, 0x7FFFF, 0x80000, 0x80001, 0xC0000, 0xFFFFE, 0xFFFFF];
        let grid = (0..1u32 << 12).flat_map(|top| LOW.iter().map(move |&low| (top << 20) | low));
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let random = (0..1 << 20).map(move |_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u32
        });
        grid.chain(random)
    }

    /// The branch-free encoders give the scalar encoders' codes for every pattern, NaN and ±∞
    /// included, and around every threshold of E2M1 (one ulp either side).
    #[test]
    fn fast_encoders_equal_the_scalar_ones() {
        let thresholds = [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 448.0, 464.0, 1.0 / 64.0, 1.0 / 1024.0];
        let near = thresholds.iter().flat_map(|t| {
            let b = t.to_bits();
            [b - 1, b, b + 1].into_iter().flat_map(|b| [b, b | 0x8000_0000])
        });
        for b in patterns().chain(near).chain([0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0xFFC0_0001]) {
            let x = f32::from_bits(b);
            assert_eq!(e2m1_fast(x), e2m1_from_f32(x), "E2M1 of {x:e} ({b:#010x})");
            assert_eq!(e4m3_fast(x), e4m3_from_f32(x), "E4M3 of {x:e} ({b:#010x})");
        }
    }

    /// The branch-free block scales equal the formulas for every format, over magnitudes from 0
    /// and subnormals to f32's largest, at NVFP4 global scales from tiny to huge.
    #[test]
    fn fast_block_scales_equal_the_formulas() {
        for b in super::tests::patterns().filter(|b| b >> 31 == 0 && *b <= f32::MAX.to_bits()).step_by(7) {
            let amax = f32::from_bits(b);
            for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8] {
                for g in [1.0f32, 2688.0, 3.0e-30, 1.7e30] {
                    let (sf, inv) = super::block_scale(format, amax, g);
                    let (sf2, inv2) = block_scale_fast(format, amax, g);
                    assert_eq!((sf, inv.to_bits()), (sf2, inv2.to_bits()), "{format:?} amax {amax:e} g {g:e}");
                }
            }
        }
    }

    /// The quantizer as the module docs write it, one element at a time with the scalar encoders:
    /// what `quantize` must equal.
    fn by_the_formulas(format: BlockFormat, x: &[f32], rows: usize, k: usize, g: f32) -> (Vec<u8>, Vec<u8>) {
        let v = format.vector_size();
        let kb = k.div_ceil(v);
        let (mut scales, mut codes) = (vec![0u8; rows * kb], vec![0u8; rows * k]);
        for r in 0..rows {
            for b in 0..kb {
                let block = &x[r * k + b * v..r * k + ((b + 1) * v).min(k)];
                let (sf, inv) = super::block_scale(format, super::amax(block), g);
                scales[r * kb + b] = sf;
                for (i, e) in block.iter().enumerate() {
                    let y = e * inv;
                    codes[r * k + b * v + i] = if format.is_fp4() { e2m1_from_f32(y) } else { e4m3_from_f32(y) };
                }
            }
        }
        (if format.is_fp4() { pack_e2m1(&codes) } else { codes }, scales)
    }

    /// `quantize` equals the formulas for every format and input type, partial last blocks, zero
    /// blocks and magnitudes from tiny to huge.
    #[test]
    fn quantize_equals_the_formulas() {
        let mut state = 7u64;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8] {
            for (rows, k) in [(1, 2), (3, 16), (2, 34), (5, 96), (4, 100)] {
                for scale in [1e-30f32, 1e-3, 1.0, 300.0, 1e30] {
                    let mut x: Vec<f32> = (0..rows * k).map(|_| next() * scale).collect();
                    x[..k.min(16)].fill(0.0); // a zero block
                    let g = if format == BlockFormat::Nvfp4 { super::nvfp4_global_scale(super::amax(&x)) } else { 1.0 };
                    let want = by_the_formulas(format, &x, rows, k, g);
                    let lay = crate::formats::scale_layout::ScaleLayout::for_operand(rows, k, format.vector_size());
                    let got = quantize(format, &x, rows, k, g).unwrap();
                    let at = format!("{format:?} {rows}x{k} scale {scale:e}");
                    assert_eq!(got.data(), &want.0[..], "{at}: codes");
                    assert_eq!(lay.deinterleave(got.scales()).unwrap(), want.1, "{at}: scales");
                    // Every ISA's build of the row body (forced), row by row.
                    for isa in crate::Isa::available() {
                        let token = crate::simd::IsaToken::new(Some(isa)).unwrap();
                        let (rb, kb) = (format.row_bytes(k), k.div_ceil(format.vector_size()));
                        for r in 0..rows {
                            let (mut data, mut sc) = (vec![0u8; rb], vec![0u8; kb]);
                            crate::simd::quantize_row(token, format, &x[r * k..(r + 1) * k], g, &mut data, &mut sc);
                            assert_eq!(data, want.0[r * rb..(r + 1) * rb], "{at}: {isa:?} row {r} codes");
                            assert_eq!(sc, want.1[r * kb..(r + 1) * kb], "{at}: {isa:?} row {r} scales");
                        }
                    }
                    let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                    let xbf: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
                    assert_eq!(
                        quantize(format, &xb, rows, k, g).unwrap(),
                        quantize(format, &xbf, rows, k, g).unwrap(),
                        "{at}: bf16"
                    );
                    if scale > 1.0 {
                        continue; // past f16's range
                    }
                    let xh: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
                    let xhf: Vec<f32> = xh.iter().map(|v| v.to_f32()).collect();
                    assert_eq!(
                        quantize(format, &xh, rows, k, g).unwrap(),
                        quantize(format, &xhf, rows, k, g).unwrap(),
                        "{at}: f16"
                    );
                }
            }
        }
    }
}
