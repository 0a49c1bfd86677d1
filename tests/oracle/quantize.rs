//! Quantizers: lossless on representable inputs, within the format's error bound on random ones.

use crate::common::Rng;
use paged_qkv::Error;
use paged_qkv::bf16;
use paged_qkv::formats::fp8::{e4m3_to_f32, e8m0_to_f32};
use paged_qkv::formats::quantize::{dequantize, nvfp4_global_scale, quantize};
use paged_qkv::formats::{BlockFormat, QuantizedRef};

const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
const E4M3_SAMPLES: [f32; 8] = [0.0, 0.015625, 0.5, 1.0, 1.75, 13.0, 240.0, 448.0];

/// Rows of blocks built from grid values times a per-block power of two, each block containing
/// its format's maximum so the block scale is exactly that power of two.
fn representable(format: BlockFormat, rng: &mut Rng, rows: usize, k: usize) -> Vec<f32> {
    let v = format.vector_size();
    let mut x = vec![0.0f32; rows * k];
    for r in 0..rows {
        for kb in 0..k.div_ceil(v) {
            let p = 2f32.powi(rng.range(0, 17) as i32 - 9); // NVFP4: p must be an E4M3 value
            let block = kb * v..((kb + 1) * v).min(k);
            for (n, i) in block.clone().enumerate() {
                let g = if format.is_fp4() { E2M1[rng.below(8)] } else { E4M3_SAMPLES[rng.below(8)] };
                let g = if n == 0 { if format.is_fp4() { 6.0 } else { 448.0 } } else { g };
                x[r * k + i] = if rng.below(2) == 0 { g * p } else { -g * p };
            }
        }
    }
    x
}

#[test]
fn exactly_representable_inputs_round_trip() {
    let mut rng = Rng::new(3);
    for format in BlockFormat::ALL {
        for (rows, k) in [(1, 32), (3, 64), (130, 96), (5, 40), (2, 200)] {
            let x = representable(format, &mut rng, rows, k);
            let q = quantize(format, &x, rows, k, 1.0).unwrap();
            assert_eq!(q.tensor_scale(), 1.0);
            let back = dequantize(q.as_ref(), q.tensor_scale());
            for (i, (a, b)) in x.iter().zip(&back).enumerate() {
                assert_eq!(a, b, "{format:?} {rows}x{k} element {i}");
            }
        }
    }
}

/// Per-element error bound of one block, from the grid spacing (see quantize.rs's docs):
/// E2M1 half-gaps are 0.25 below 2, 0.5 below 4, 1 above (times the block's step `s`), plus
/// the saturated excess; E4M3 is 2^-4 relative plus half a subnormal step.
fn check_bound(format: BlockFormat, x: &[f32], back: &[f32], step: f32) {
    for (&a, &b) in x.iter().zip(back) {
        let err = (a - b).abs() as f64;
        let s = step as f64;
        let y = a.abs() as f64 / s;
        let bound = if format.is_fp4() {
            let half_gap = if y < 2.0 {
                0.25
            } else if y < 4.0 {
                0.5
            } else {
                1.0
            };
            if y > 6.0 { (y - 6.0) * s + 1e-6 * s } else { half_gap * s * (1.0 + 1e-6) }
        } else {
            a.abs() as f64 * 2f64.powi(-4) + s * 2f64.powi(-10)
        };
        assert!(err <= bound + 1e-37, "{format:?}: x {a} -> {b}, err {err} > bound {bound} (step {s})");
    }
}

#[test]
fn random_inputs_stay_within_the_format_bound() {
    let mut rng = Rng::new(4);
    for format in BlockFormat::ALL {
        for (rows, k) in [(4, 64), (129, 48), (3, 4096), (2, 40)] {
            let x: Vec<f32> = (0..rows * k).map(|_| rng.normal() * 10f32.powi(rng.range(0, 6) as i32 - 3)).collect();
            let g = nvfp4_global_scale(paged_qkv::formats::quantize::amax(&x));
            let q = quantize(format, &x, rows, k, g).unwrap();
            let back = dequantize(q.as_ref(), q.tensor_scale());
            let v = format.vector_size();
            for r in 0..rows {
                for kb in 0..k.div_ceil(v) {
                    let byte = q.as_ref().scale_byte(r, kb);
                    let step = match format {
                        BlockFormat::Nvfp4 => e4m3_to_f32(byte) * q.tensor_scale(),
                        _ => e8m0_to_f32(byte),
                    };
                    let range = r * k + kb * v..r * k + ((kb + 1) * v).min(k);
                    if format == BlockFormat::Mxfp4 {
                        let amax = x[range.clone()].iter().fold(0f32, |m, a| m.max(a.abs()));
                        assert!(amax <= 6.0 * step, "MXFP4 scales round up: no saturation");
                    }
                    check_bound(format, &x[range.clone()], &back[range], step);
                }
            }
        }
    }
}

#[test]
fn zero_tiny_and_huge_blocks() {
    for format in BlockFormat::ALL {
        let k = 64;
        let mut x = vec![0.0f32; 3 * k];
        for i in 0..k {
            x[k + i] = 1.0e-30 * (i as f32 - 30.0);
            x[2 * k + i] = 1.0e30 * (i as f32 - 30.0);
        }
        // Per-row quantization so each row gets a fitting global scale.
        for r in 0..3 {
            let row = &x[r * k..(r + 1) * k];
            let g = nvfp4_global_scale(paged_qkv::formats::quantize::amax(row));
            let q = quantize(format, row, 1, k, g).unwrap();
            let back = dequantize(q.as_ref(), q.tensor_scale());
            if r == 0 {
                assert!(back.iter().all(|&b| b == 0.0), "{format:?} zero block");
                if format == BlockFormat::Nvfp4 {
                    assert_eq!(q.as_ref().scale_byte(0, 0), 0, "zero block gets scale 0");
                }
            }
            let amax = row.iter().fold(0f32, |m, a| m.max(a.abs()));
            for (a, b) in row.iter().zip(&back) {
                let rel = if format == BlockFormat::Mxfp8 { 0.07 } else { 0.34 };
                assert!((a - b).abs() <= rel * amax, "{format:?} row {r}: {a} -> {b}");
                assert!(a.signum() == b.signum() || *b == 0.0);
            }
        }
    }
}

#[test]
fn partial_last_block_and_odd_k() {
    let mut rng = Rng::new(5);
    // K = 40: NVFP4 blocks of 16, 16, 8; MX blocks of 32, 8. K = 18 too.
    for format in BlockFormat::ALL {
        for k in [40usize, 18, 2] {
            let x: Vec<f32> = (0..2 * k).map(|_| rng.normal()).collect();
            let q = quantize(format, &x, 2, k, 448.0 * 6.0 / 4.0).unwrap();
            let v = format.vector_size();
            assert_eq!(q.as_ref().k_blocks(), k.div_ceil(v));
            assert_eq!(q.scales().len(), 128 * 4, "one tile");
            let back = dequantize(q.as_ref(), q.tensor_scale());
            let amax = x.iter().fold(0f32, |m, a| m.max(a.abs()));
            for (a, b) in x.iter().zip(&back) {
                assert!((a - b).abs() <= 0.34 * amax);
            }
        }
    }
    assert!(matches!(quantize(BlockFormat::Nvfp4, &[0.0f32; 3], 1, 3, 1.0), Err(Error::InvalidDim { .. })));
    assert!(quantize(BlockFormat::Mxfp8, &[0.0f32; 3], 1, 3, 1.0).is_ok(), "MXFP8 is not packed");
}

#[test]
fn bad_input_is_an_error() {
    assert!(matches!(
        quantize(BlockFormat::Nvfp4, &[1.0f32, f32::NAN], 1, 2, 1.0),
        Err(Error::NonFinite { arg: "x", index: 1 })
    ));
    assert!(matches!(quantize(BlockFormat::Nvfp4, &[1.0f32; 4], 1, 2, 1.0), Err(Error::Shape { .. })));
    for g in [0.0, -1.0, f32::INFINITY, f32::NAN] {
        assert!(matches!(quantize(BlockFormat::Nvfp4, &[1.0f32; 2], 1, 2, g), Err(Error::InvalidDim { .. })));
    }
    // The MX formats ignore the global scale.
    assert!(quantize(BlockFormat::Mxfp4, &[1.0f32; 2], 1, 2, 0.0).is_ok());
    assert!(QuantizedRef::new(BlockFormat::Nvfp4, 2, 32, &[0; 32], &[0; 511]).is_err());
    assert!(QuantizedRef::new(BlockFormat::Nvfp4, 2, 32, &[0; 31], &[0; 512]).is_err());
    assert!(QuantizedRef::new(BlockFormat::Nvfp4, 2, 32, &[0; 32], &[0; 512]).is_ok());
}

#[test]
fn bf16_input_matches_its_f32_values_and_global_scale_direction() {
    let mut rng = Rng::new(6);
    let x: Vec<bf16> = (0..4 * 64).map(|_| bf16::from_f32(rng.normal() * 3.0)).collect();
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let g = nvfp4_global_scale(paged_qkv::formats::quantize::amax(&x));
    let a = quantize(BlockFormat::Nvfp4, &x, 4, 64, g).unwrap();
    let b = quantize(BlockFormat::Nvfp4, &xf, 4, 64, g).unwrap();
    assert_eq!(a, b);
    // tensor_scale is the dequantization multiplier, 1/global_scale.
    assert_eq!(a.tensor_scale(), 1.0 / g);
    // With the recipe's global scale the largest block scale is E4M3's maximum.
    let max_scale =
        (0..4).flat_map(|r| (0..4).map(move |kb| (r, kb))).map(|(r, kb)| a.as_ref().scale_byte(r, kb)).max();
    assert_eq!(max_scale, Some(0x7E));
}
