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
//! One deliberate difference from MAX's GPU quantizer: a scale that overflows E4M3 saturates to 448
//! (MAX's plain cast gives NaN, quirk K17).

use super::fp4::{E2M1_MAX, e2m1_from_f32, pack_e2m1};
use super::fp8::{E4M3_MAX, e4m3_from_f32, e4m3_to_f32, e8m0_from_f32_roundup, e8m0_to_f32};
use super::scale_layout::ScaleLayout;
use super::{BlockFormat, QuantizedMatrix, QuantizedRef, check_len_2d};
use crate::element::Element;
use crate::error::{Error, Result};

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
    if let Some(index) = x.iter().position(|v| !v.to_f32().is_finite()) {
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
    let mut codes = vec![0u8; rows * k];
    for r in 0..rows {
        let row = &x[r * k..(r + 1) * k];
        for kb in 0..kb_count {
            let block = &row[kb * v..((kb + 1) * v).min(k)];
            let amax = amax(block);
            let (sf, inv) = match format {
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
            };
            plain_scales[r * kb_count + kb] = sf;
            for (i, e) in block.iter().enumerate() {
                let y = e.to_f32() * inv;
                codes[r * k + kb * v + i] = if format.is_fp4() { e2m1_from_f32(y) } else { e4m3_from_f32(y) };
            }
        }
    }
    let data = if format.is_fp4() { pack_e2m1(&codes) } else { codes };
    let scales = layout.interleave(&plain_scales)?;
    QuantizedMatrix::from_parts(format, rows, k, data, scales, 1.0 / g)
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
