//! The activation quantizer's row body (`crate::simd::quant`) and the block-scaled
//! activations' row preparation (`crate::simd::fp4::prepare_row_body`) compiled for AVX2 and
//! AVX-512: the same source, vectorised at each width by the compiler.

use crate::dtype::BlockFormat;
use crate::dtype::E4M3;
use crate::simd::fp4::{ActRow, prepare_row_body};
use crate::simd::quant::{kv_dequant_body, kv_groups_body, quantize_row_body};

/// [`quantize_row_body`] with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(in crate::simd) fn quantize_row_avx2(format: BlockFormat, row: &[f32], g: f32, data: &mut [u8], scales: &mut [u8]) {
    quantize_row_body(format, row, g, data, scales)
}

/// [`quantize_row_body`] with AVX-512 F and BW.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
pub(in crate::simd) fn quantize_row_avx512(
    format: BlockFormat,
    row: &[f32],
    g: f32,
    data: &mut [u8],
    scales: &mut [u8],
) {
    quantize_row_body(format, row, g, data, scales)
}

/// [`prepare_row_body`] with AVX2.
#[target_feature(enable = "avx2,fma")]
pub(in crate::simd) fn prepare_row_avx2(format: BlockFormat, data: &[u8], k: usize, out: ActRow<'_>) -> (bool, u8) {
    prepare_row_body(format, data, k, out)
}

/// [`prepare_row_body`] with AVX-512 F and BW.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
pub(in crate::simd) fn prepare_row_avx512(format: BlockFormat, data: &[u8], k: usize, out: ActRow<'_>) -> (bool, u8) {
    prepare_row_body(format, data, k, out)
}

/// [`kv_groups_body`] with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(in crate::simd) fn kv_groups_avx2(x: &[f32], g: usize, codes: &mut [E4M3], scales: &mut [f32]) {
    kv_groups_body(x, g, codes, scales)
}

/// [`kv_groups_body`] with AVX-512 F and BW.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
pub(in crate::simd) fn kv_groups_avx512(x: &[f32], g: usize, codes: &mut [E4M3], scales: &mut [f32]) {
    kv_groups_body(x, g, codes, scales)
}

/// [`kv_dequant_body`] with AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(in crate::simd) fn kv_dequant_avx2(codes: &[E4M3], g: usize, scales: &[f32], out: &mut [f32]) {
    kv_dequant_body(codes, g, scales, out)
}

/// [`kv_dequant_body`] with AVX-512 F and BW.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
pub(in crate::simd) fn kv_dequant_avx512(codes: &[E4M3], g: usize, scales: &[f32], out: &mut [f32]) {
    kv_dequant_body(codes, g, scales, out)
}
