//! `qkv_fp8_ragged` (FP8 W8A8): hand-checkable values for every granularity, MAX's epilogue
//! rounding (scale product and bias in the output dtype), the two accumulation modes, the
//! granularity inferred from scale shapes, and errors that name the tensor and write nothing.

use crate::common::*;
use paged_qkv::formats::fp8::e4m3_from_f32;
use paged_qkv::reference::qkv_fp8_ragged;
use paged_qkv::{Accumulation, CacheShape, Error, Fp8Scales, KvWrite, PageTable, PagedKvCache, QkvFp8Args, bf16};

/// One token, K = `k`, q_dim 2, one KV head of 2 (N = 6), page size 4, the token at position 1.
struct Tiny {
    x: Vec<u8>,
    w: Vec<u8>,
    k: usize,
}

fn tiny(k: usize, xv: impl Fn(usize) -> f32, wv: impl Fn(usize, usize) -> f32) -> Tiny {
    Tiny {
        x: (0..k).map(|i| e4m3_from_f32(xv(i))).collect(),
        w: (0..6 * k).map(|i| e4m3_from_f32(wv(i / k, i % k))).collect(),
        k,
    }
}

/// Runs the oracle; returns (Q, K row, V row) as f32.
fn go(t: &Tiny, scales: Fp8Scales<'_>, bias: Option<&[bf16]>, mode: Accumulation) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(2, 1, 4, 1, 2).unwrap());
    let mut q = vec![bf16::ZERO; 2];
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[1], 1, &[1]).unwrap(), 0);
    let args = QkvFp8Args::new(&t.x, &[0, 1], &t.w, t.k, scales, 2).maybe_bias(bias);
    qkv_fp8_ragged(&args, &mut q, &mut kv, mode).unwrap();
    let row = |which| (0..2).map(|d| cache.get(1, which, 0, 1, 0, d).to_f32()).collect();
    (q.iter().map(|v| v.to_f32()).collect(), row(0), row(1))
}

#[test]
fn tensor_scales_multiply_in_bf16_after_the_sum_is_rounded() {
    // Σ a·w = 4 · (1.5 · 1.25 · 2^n) = 7.5 · 2^n for row n; the scales are rounded to bf16, their
    // product rounded to bf16, and the bf16 sum times it rounded to bf16 (MAX's per-tensor epilogue).
    let t = tiny(4, |_| 1.5, |n, _| 1.25 * 2f32.powi(n as i32));
    let r = |x: f32| bf16::from_f32(x).to_f32();
    let mut differs = 0;
    for (sa, sw) in [(0.1f32, 3.0f32), (0.3, 0.7), (1.1, 1.3), (0.013, 77.0), (2.9, 0.37), (0.6, 0.6)] {
        for mode in [Accumulation::Exact, Accumulation::Sequential] {
            let (q, k, v) = go(&t, Fp8Scales::Tensor { input: sa, weight: sw }, None, mode);
            let s = r(r(sa) * r(sw));
            let want = |n: usize| r(7.5 * 2f32.powi(n as i32) * s);
            assert_eq!((q, k, v), (vec![want(0), want(1)], vec![want(2), want(3)], vec![want(4), want(5)]));
            // Where MAX's roundings show: not the product of the true scales rounded once.
            differs +=
                (0..6).filter(|&n| want(n) != r((7.5 * 2f64.powi(n as i32) * sa as f64 * sw as f64) as f32)).count();
        }
    }
    assert!(differs > 0, "no case tells MAX's epilogue from one rounding");
}

#[test]
fn channel_scales_are_per_token_and_per_weight_row_and_the_bias_is_added_in_bf16() {
    let t = tiny(2, |_| 2.0, |n, _| (n + 1) as f32); // Σ = 4 (n + 1)
    let (input, weight) = ([0.5f32], [1.0f32, 2.0, 0.25, 4.0, 8.0, 0.125]);
    let bias: Vec<bf16> = (0..6).map(|n| bf16::from_f32(1000.0 + n as f32)).collect();
    let (q, k, v) = go(&t, Fp8Scales::Channel { input: &input, weight: &weight }, Some(&bias), Accumulation::Exact);
    let got: Vec<f32> = q.into_iter().chain(k).chain(v).collect();
    for (n, g) in got.into_iter().enumerate() {
        let scaled = 4.0 * (n + 1) as f32 * 0.5 * weight[n];
        // The bias (rounded to bf16: 1000 + n in steps of 4) is added to the bf16 value and the sum
        // rounded to bf16.
        let b = bias[n].to_f32();
        assert_eq!(g, bf16::from_f32(bf16::from_f32(scaled).to_f32() + b).to_f32(), "column {n}");
    }
}

#[test]
fn block_scales_apply_per_128_elements_before_the_one_rounding() {
    // K = 200: two blocks (128 + 72). Row 0 of the weight: all 1; x: 1 in block 0, 2 in block 1.
    let t = tiny(200, |i| if i < 128 { 1.0 } else { 2.0 }, |_, _| 1.0);
    let input = [0.5f32, 0.25]; // [kb = 2, M = 1]
    let weight = [3.0f32, 5.0]; // [ceil(6/128) = 1, kb = 2]
    for mode in [Accumulation::Exact, Accumulation::Sequential] {
        let (q, _, _) = go(&t, Fp8Scales::Block { input: &input, weight: &weight }, None, mode);
        // 128 · 0.5 · 3 + 72 · 2 · 0.25 · 5 = 192 + 180 = 372.
        assert_eq!(q, vec![372.0, 372.0]);
    }
}

#[test]
fn sequential_is_the_f32_chain_and_exact_the_true_sum() {
    // 448·448, then 38 products of 2^-18 (below half an f32 ulp of 200704), then −448·448: the
    // chain loses the small terms and ends at 0; the true sum is 38 · 2^-18.
    let k = 40;
    let big = |i: usize| i == 0 || i == k - 1;
    let t = tiny(
        k,
        |i| if big(i) { 448.0 } else { 2f32.powi(-9) },
        |_, i| match i {
            0 => 448.0,
            i if i == k - 1 => -448.0,
            _ => 2f32.powi(-9),
        },
    );
    let s = Fp8Scales::Tensor { input: 1.0, weight: 1.0 };
    assert_eq!(go(&t, s, None, Accumulation::Exact).0[0], bf16::from_f32(38.0 * 2f32.powi(-18)).to_f32());
    assert_eq!(go(&t, s, None, Accumulation::Sequential).0[0], 0.0);
}

#[test]
fn the_granularity_is_inferred_from_the_scale_shapes() {
    let (m, n, k) = (3, 300, 260);
    let one = [1.0f32];
    let per_m = vec![1.0f32; m];
    let per_n = vec![1.0f32; n];
    assert!(matches!(Fp8Scales::infer((&one, &[]), (&one, &[1, 1]), (m, n, k)), Ok(Fp8Scales::Tensor { .. })));
    assert!(matches!(Fp8Scales::infer((&one, &[1]), (&one, &[1]), (m, n, k)), Ok(Fp8Scales::Tensor { .. })));
    assert!(matches!(Fp8Scales::infer((&per_m, &[1, m]), (&per_n, &[n, 1]), (m, n, k)), Ok(Fp8Scales::Channel { .. })));
    assert!(matches!(Fp8Scales::infer((&one, &[1, 1]), (&per_n, &[n, 1]), (m, n, k)), Ok(Fp8Scales::Channel { .. })));
    let (bi, bw) = (vec![1.0f32; 3 * m], vec![1.0f32; 3 * 3]);
    assert!(matches!(Fp8Scales::infer((&bi, &[3, m]), (&bw, &[3, 3]), (m, n, k)), Ok(Fp8Scales::Block { .. })));
    // Shapes that fit no granularity name the tensor.
    let e = Fp8Scales::infer((&bi, &[3, m]), (&bw, &[9]), (m, n, k)).unwrap_err();
    assert!(matches!(e, Error::Shape { arg: "weight_scale", .. }), "{e}");
    let e = Fp8Scales::infer((&per_n, &[1, n]), (&per_n, &[n, 1]), (m, n, k)).unwrap_err();
    assert!(matches!(e, Error::Shape { arg: "input_scale", .. }), "{e}");
    let e = Fp8Scales::infer((&bi, &[3, m, 1]), (&bw, &[3, 3]), (m, n, k)).unwrap_err();
    assert!(matches!(e, Error::Shape { arg: "input_scale", .. }), "{e}");
    let e = Fp8Scales::infer((&bi, &[2, m]), (&bw, &[3, 3]), (m, n, k)).unwrap_err();
    assert!(matches!(e, Error::Shape { arg: "input_scale", .. }), "{e}");
}

#[test]
fn bad_scales_and_outputs_are_errors_that_write_nothing() {
    let mut rng = Rng::new(3);
    let t = tiny(130, |i| (i % 7) as f32 - 3.0, |n, i| ((n + i) % 5) as f32 - 2.0);
    let two = [1.0f32, 1.0];
    let cases: Vec<(Fp8Scales<'_>, &str)> = vec![
        (Fp8Scales::Tensor { input: f32::NAN, weight: 1.0 }, "input_scale"),
        (Fp8Scales::Tensor { input: 1.0, weight: f32::INFINITY }, "weight_scale"),
        (Fp8Scales::Channel { input: &two, weight: &[1.0; 6] }, "input_scale"),
        (Fp8Scales::Channel { input: &[1.0], weight: &[1.0; 5] }, "weight_scale"),
        (Fp8Scales::Block { input: &[1.0; 3], weight: &[1.0; 2] }, "input_scale"),
        (Fp8Scales::Block { input: &[1.0; 2], weight: &[1.0; 4] }, "weight_scale"),
        (Fp8Scales::Block { input: &[1.0, f32::NAN], weight: &[1.0; 2] }, "input_scale"),
    ];
    for (scales, arg) in cases {
        let before: PagedKvCache<bf16> = random_cache(&mut rng, CacheShape::mha(2, 1, 4, 1, 2).unwrap());
        let mut cache = before.clone();
        let mut q = vec![bf16::from_f32(-3.0); 2];
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[1], 1, &[1]).unwrap(), 0);
        let args = QkvFp8Args::<bf16>::new(&t.x, &[0, 1], &t.w, t.k, scales, 2);
        let e = qkv_fp8_ragged(&args, &mut q, &mut kv, Accumulation::Exact).unwrap_err();
        let named = match &e {
            Error::Shape { arg, .. } | Error::NonFinite { arg, .. } => *arg,
            other => panic!("{other}"),
        };
        assert_eq!(named, arg, "{e}");
        assert_eq!(q, vec![bf16::from_f32(-3.0); 2]);
        assert_eq!(cache.data(), before.data());
    }
    // An FP8 output: the scaling is computed in the output dtype, which must be bf16, f16 or f32.
    let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(2, 1, 4, 1, 2).unwrap());
    let mut q = vec![paged_qkv::E4M3::default(); 2];
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[1], 1, &[1]).unwrap(), 0);
    let args = QkvFp8Args::<bf16>::new(&t.x, &[0, 1], &t.w, t.k, Fp8Scales::Tensor { input: 1.0, weight: 1.0 }, 2);
    assert!(matches!(qkv_fp8_ragged(&args, &mut q, &mut kv, Accumulation::Exact), Err(Error::Unsupported { .. })));
}

#[test]
fn the_fp8_quantizers_scale_by_amax_over_448_per_tensor_row_or_block() {
    use paged_qkv::Fp8Granularity as G;
    use paged_qkv::formats::fp8::e4m3_to_f32;
    use paged_qkv::formats::quantize::{quantize_fp8_input, quantize_fp8_weight};
    let (m, k) = (3, 200);
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) * (1 + i / k) as f32).collect();
    // Per tensor: one scale, the largest magnitude maps to ±448.
    let (q, s) = quantize_fp8_input(&x, m, k, G::Tensor).unwrap();
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    assert_eq!(s, vec![amax / 448.0]);
    assert!(q.iter().any(|&b| e4m3_to_f32(b).abs() == 448.0));
    // Per token: [1, M] laid out as M values.
    let (_, s) = quantize_fp8_input(&x, m, k, G::Channel).unwrap();
    for r in 0..m {
        let a = x[r * k..(r + 1) * k].iter().fold(0f32, |a, v| a.max(v.abs()));
        assert_eq!(s[r], a / 448.0);
    }
    // Per 1×128 block: [ceil(K/128), M], block-major.
    let (q, s) = quantize_fp8_input(&x, m, k, G::Block).unwrap();
    assert_eq!(s.len(), 2 * m);
    for r in 0..m {
        for b in 0..2 {
            let blk = &x[r * k + b * 128..r * k + (b * 128 + 128).min(k)];
            let a = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(s[b * m + r], a / 448.0, "row {r} block {b}");
            // Each element within half an E4M3 step of its value.
            for (j, &v) in blk.iter().enumerate() {
                let d = e4m3_to_f32(q[r * k + b * 128 + j]) * s[b * m + r];
                assert!((d - v).abs() <= v.abs() / 16.0 + s[b * m + r] * 2f32.powi(-9), "{d} vs {v}");
            }
        }
    }
    // Weights per 128×128 block: [ceil(N/128), ceil(K/128)]; an all-zero block gets scale 0.
    let n = 130;
    let mut w = vec![0f32; n * k];
    w[129 * k + 5] = -896.0; // row 129 is in row block 1, column block 0
    let (_, s) = quantize_fp8_weight(&w, n, k, G::Block).unwrap();
    assert_eq!(s, vec![0.0, 0.0, 2.0, 0.0]);
    assert!(quantize_fp8_weight(&w, n, k + 1, G::Tensor).is_err());
}
