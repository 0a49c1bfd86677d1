//! The FP4/FP8 fused QKV oracle against an independent exact computation, MAX's naive order, the
//! error bound between them, real model shapes, routing and cache integrity.

use crate::common::*;
use crate::fp4_setup::*;
use paged_qkv::formats::{BlockFormat, QuantizedMatrix, QuantizedRef};
use paged_qkv::reference::qkv_fp4_ragged;
use paged_qkv::{Accumulation, CacheShape, E4M3, Element, KvWrite, PageTable, PagedKvCache, QkvFp4Args, bf16, f16};

pub fn expected<T: Element>(v: Option<(i128, i32)>) -> T {
    match v {
        None => T::from_f32(f32::NAN),
        Some((s, e)) => T::from_f64(round_scaled(s, e, prec::<T>())),
    }
}

/// MAX's `naive_block_scaled_matmul_kernel`, written here: ((a·b)·sa)·sb in k order in f32.
fn naive_max(a: QuantizedRef<'_>, w: QuantizedRef<'_>, m: usize, n: usize, tensor_sf: f32) -> f32 {
    let f = a.format();
    let v = f.vector_size();
    let mut acc = 0f32;
    for k in 0..a.k() {
        let x = f.element_to_f32(a.row(m), k);
        let y = f.element_to_f32(w.row(n), k);
        acc += ((x * y) * a.scale(m, k / v)) * w.scale(n, k / v);
    }
    acc * tensor_sf
}

/// Runs the oracle on `s` with output `O` and cache `C`, returning (output, cache before, cache after).
pub fn run<O: Element, C: Element>(
    rng: &mut Rng,
    s: &Setup,
    tensor_sf: f32,
    mode: Accumulation,
) -> (Vec<O>, Vec<C>, Vec<C>) {
    let mut cache: PagedKvCache<C> = random_cache(rng, s.shape);
    let before = cache.data().to_vec();
    let mut out = vec![O::from_f32(-7.0); s.rows.len() * s.q_dim];
    let args = QkvFp4Args::new(s.a.as_ref(), &s.offsets, s.w.as_ref(), s.q_dim).with_tensor_sf(tensor_sf);
    let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
    qkv_fp4_ragged(&args, &mut out, &mut kv, mode).unwrap();
    (out, before, cache.into_vec())
}

/// Checks every output and cache element of an Exact run against [`exact_value`].
fn check_exact<O: Element, C: Element>(rng: &mut Rng, s: &Setup, tensor_sf: f32) {
    let (out, before, after) = run::<O, C>(rng, s, tensor_sf, Accumulation::Exact);
    let n_total = s.w.rows();
    let mut written = Vec::new();
    for (i, &(b, t)) in s.rows.iter().enumerate() {
        for n in 0..n_total {
            let v = exact_value(s.a.as_ref(), s.w.as_ref(), i, n, tensor_sf);
            if n < s.q_dim {
                let want: O = expected(v);
                assert_eq!(
                    out[i * s.q_dim + n].to_bits(),
                    want.to_bits(),
                    "Q row {i} col {n}: {:?} vs {:?}",
                    out[i * s.q_dim + n],
                    want
                );
            } else {
                written.push((kv_coord(s, b, t, n), expected::<C>(v)));
            }
        }
    }
    assert_cache_writes(s.shape, &before, &after, &written);
}

#[test]
fn hand_checkable_value() {
    // a = 1.0 everywhere (code 2) with block scales 0.5 and 2.0; w = 0.5 everywhere (code 1)
    // with scales 1.0: 16·(1·0.5·0.5·1) + 16·(1·0.5·2·1) = 4 + 16 = 20, times tensor_sf 0.75 = 15.
    let lay = paged_qkv::formats::scale_layout::ScaleLayout::new(1, 2);
    let a_scales = lay.interleave(&[0x30u8, 0x40]).unwrap(); // 0.5, 2.0
    let a = QuantizedRef::new(BlockFormat::Nvfp4, 1, 32, &[0x22; 16], &a_scales).unwrap();
    let w_lay = paged_qkv::formats::scale_layout::ScaleLayout::new(3, 2);
    let w_scales = w_lay.interleave(&[0x38u8; 6]).unwrap();
    // 3 weight rows: Q (1 column), K, V with head_size 1.
    let w_data: Vec<u8> = [0x11u8; 16].into_iter().chain([0x99; 16]).chain([0x00; 16]).collect();
    let w = QuantizedRef::new(BlockFormat::Nvfp4, 3, 32, &w_data, &w_scales).unwrap();
    let mut cache = PagedKvCache::<f32>::zeros(CacheShape::mha(2, 1, 4, 1, 1).unwrap());
    let (lut, lens) = ([1u32, 0], [2u32]);
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&lut, 2, &lens).unwrap(), 0);
    let mut out = [0f32; 1];
    let args = QkvFp4Args::new(a, &[0, 1], w, 1).with_tensor_sf(0.75);
    for mode in [Accumulation::Exact, Accumulation::Sequential] {
        qkv_fp4_ragged(&args, &mut out, &mut kv, mode).unwrap();
        assert_eq!(out[0], 15.0);
        // Position 2 of sequence 0: page 0 → block 1, slot 2. K = −15 (w = −0.5), V = 0.
        assert_eq!(kv.cache.data()[CacheShape::mha(2, 1, 4, 1, 1).unwrap().index(1, 0, 0, 2, 0, 0)], -15.0);
    }
    assert_eq!(cache.data().iter().filter(|&&v| v != 0.0).count(), 1, "only K of one slot written");
}

#[test]
fn random_cases_match_independent_exact_computation() {
    let mut rng = Rng::new(10);
    for case in 0..24 {
        let format = BlockFormat::ALL[case % 3];
        let lens: Vec<usize> = (0..rng.range(1, 4)).map(|_| rng.range(0, 5)).collect();
        let cache_lengths: Vec<u32> = lens.iter().map(|_| rng.range(0, 9) as u32).collect();
        let c = Config {
            format,
            k: [32, 64, 96, 48, 160][rng.below(5)],
            hq: rng.range(1, 3),
            hkv: rng.range(1, 2),
            hd: [16, 32][rng.below(2)],
            page: [1, 3, 4, 16][rng.below(4)],
            layers: rng.range(1, 3),
            mla_width: if case % 4 == 3 { Some(16) } else { None },
            lens,
            cache_lengths,
        };
        let s = setup(&mut rng, &c);
        let tsf = [1.0f32, 0.75, 3.0e-3, 1.0 / 448.0][rng.below(4)];
        match case % 4 {
            0 => check_exact::<bf16, bf16>(&mut rng, &s, tsf),
            1 => check_exact::<f32, f32>(&mut rng, &s, tsf),
            2 => check_exact::<bf16, f16>(&mut rng, &s, tsf),
            _ => check_exact::<f32, bf16>(&mut rng, &s, tsf),
        }
    }
}

#[test]
fn sequential_is_max_naive_reference_bit_for_bit() {
    let mut rng = Rng::new(11);
    for format in BlockFormat::ALL {
        let c = Config {
            format,
            k: 128,
            lens: vec![3, 2],
            cache_lengths: vec![5, 0],
            hq: 2,
            hkv: 1,
            hd: 16,
            page: 4,
            layers: 2,
            mla_width: None,
        };
        let s = setup(&mut rng, &c);
        let tsf = 0.37;
        let (out, _, after) = run::<f32, f32>(&mut rng, &s, tsf, Accumulation::Sequential);
        for (i, &(b, t)) in s.rows.iter().enumerate() {
            for n in 0..s.w.rows() {
                let want = naive_max(s.a.as_ref(), s.w.as_ref(), i, n, tsf);
                let got = if n < s.q_dim {
                    out[i * s.q_dim + n]
                } else {
                    let (bl, kv, l, sl, h, d) = kv_coord(&s, b, t, n);
                    after[s.shape.index(bl, kv, l, sl, h, d)]
                };
                assert_eq!(got.to_bits(), want.to_bits(), "{format:?} row {i} col {n}");
            }
        }
    }
}

#[test]
fn exact_and_sequential_differ_only_within_the_summation_bound() {
    let mut rng = Rng::new(12);
    for format in BlockFormat::ALL {
        let c = Config {
            format,
            k: 512,
            lens: vec![4],
            cache_lengths: vec![0],
            hq: 4,
            hkv: 1,
            hd: 32,
            page: 8,
            layers: 1,
            mla_width: None,
        };
        let s = setup(&mut rng, &c);
        let tsf = 1.0;
        let (seq, _, _) = run::<f32, f32>(&mut rng, &s, tsf, Accumulation::Sequential);
        let (exact, _, _) = run::<f32, f32>(&mut rng, &s, tsf, Accumulation::Exact);
        let v = format.vector_size();
        let mut max_rel_to_bound = 0f64;
        for i in 0..4 {
            for n in 0..s.q_dim {
                // |seq − exact| ≤ γ_K · Σ|terms| + half an ulp of the exact result (f32).
                let (a, w) = (s.a.as_ref(), s.w.as_ref());
                let abs_sum: f64 = (0..c.k)
                    .map(|k| {
                        (format.element_to_f32(a.row(i), k) as f64
                            * format.element_to_f32(w.row(n), k) as f64
                            * a.scale(i, k / v) as f64
                            * w.scale(n, k / v) as f64)
                            .abs()
                    })
                    .sum();
                let u = 2f64.powi(-24);
                let gamma = c.k as f64 * u / (1.0 - c.k as f64 * u);
                let e = exact[i * s.q_dim + n] as f64;
                let bound = gamma * abs_sum + e.abs() * u + f64::MIN_POSITIVE;
                let diff = (seq[i * s.q_dim + n] as f64 - e).abs();
                assert!(diff <= bound, "{format:?} ({i},{n}): |{} - {e}| = {diff} > {bound}", seq[i * s.q_dim + n]);
                max_rel_to_bound = max_rel_to_bound.max(diff / bound);
            }
        }
        assert!(max_rel_to_bound > 0.0 || format == BlockFormat::Mxfp8, "the two orders should differ somewhere");
    }
}

#[test]
fn real_model_shapes() {
    let mut rng = Rng::new(13);
    // Llama-3-8B: K 4096, 32 Q / 8 KV heads of 128, page 128; small M, prefill + decode mix.
    let llama = Config {
        format: BlockFormat::Nvfp4,
        k: 4096,
        lens: vec![2, 0, 1],
        cache_lengths: vec![127, 0, 300],
        hq: 32,
        hkv: 8,
        hd: 128,
        page: 128,
        layers: 2,
        mla_width: None,
    };
    let s = setup(&mut rng, &llama);
    let tsf = s.a.tensor_scale() * s.w.tensor_scale();
    check_exact::<bf16, bf16>(&mut rng, &s, tsf);
    // Qwen2.5-0.5B: K 896, 14 Q / 2 KV heads of 64, in both MX formats.
    for format in [BlockFormat::Mxfp4, BlockFormat::Mxfp8] {
        let qwen = Config {
            format,
            k: 896,
            lens: vec![3, 1],
            cache_lengths: vec![0, 200],
            hq: 14,
            hkv: 2,
            hd: 64,
            page: 128,
            layers: 1,
            mla_width: None,
        };
        let s = setup(&mut rng, &qwen);
        check_exact::<bf16, bf16>(&mut rng, &s, 1.0);
    }
}

fn padding_positions(layout: paged_qkv::formats::scale_layout::ScaleLayout) -> Vec<usize> {
    let mut used = vec![false; layout.len()];
    for r in 0..layout.rows() {
        for kb in 0..layout.k_blocks() {
            used[layout.offset(r, kb)] = true;
        }
    }
    (0..layout.len()).filter(|&i| !used[i]).collect()
}

#[test]
fn padding_scales_are_never_read() {
    let mut rng = Rng::new(14);
    for format in BlockFormat::ALL {
        let c = Config {
            format,
            k: 96, // 6 or 3 blocks: padding k-blocks, and rows < 128: padding rows
            lens: vec![3],
            cache_lengths: vec![1],
            hq: 1,
            hkv: 1,
            hd: 16,
            page: 4,
            layers: 1,
            mla_width: None,
        };
        let s = setup(&mut rng, &c);
        let (clean, _, clean_cache) = run::<f32, f32>(&mut Rng::new(99), &s, 1.0, Accumulation::Exact);
        let mut dirty = s.clone();
        for m in [&mut dirty.a, &mut dirty.w] {
            let pad = padding_positions(m.as_ref().scale_layout());
            assert!(!pad.is_empty());
            let (data, mut scales, ts) = m.clone().into_parts();
            for &p in &pad {
                scales[p] = 0xFF; // NaN in every format
            }
            *m = QuantizedMatrix::from_parts(format, m.rows(), m.k(), data, scales, ts).unwrap();
        }
        let (got, _, got_cache) = run::<f32, f32>(&mut Rng::new(99), &dirty, 1.0, Accumulation::Exact);
        assert_eq!(bits(&clean), bits(&got), "{format:?}");
        assert_eq!(bits(&clean_cache), bits(&got_cache), "{format:?}");
    }
}

#[test]
fn nan_scales_poison_their_rows_and_sign_bits_are_ignored() {
    let mut rng = Rng::new(15);
    let c = Config {
        format: BlockFormat::Nvfp4,
        k: 64,
        lens: vec![2],
        cache_lengths: vec![0],
        hq: 1,
        hkv: 1,
        hd: 16,
        page: 4,
        layers: 1,
        mla_width: None,
    };
    let s = setup(&mut rng, &c);
    let (base, _, _) = run::<f32, f32>(&mut Rng::new(1), &s, 1.0, Accumulation::Exact);
    let lay = s.a.as_ref().scale_layout();
    let (data, scales, ts) = s.a.clone().into_parts();
    // Sign bits set on every scale of row 1: |E4M3| decoding ignores them.
    let mut signed = scales.clone();
    for kb in 0..lay.k_blocks() {
        signed[lay.offset(1, kb)] |= 0x80;
    }
    // A NaN scale (0x7F) in row 0, block 2.
    signed[lay.offset(0, 2)] = 0x7F;
    let a2 = QuantizedMatrix::from_parts(BlockFormat::Nvfp4, 2, 64, data, signed, ts).unwrap();
    let s2 = Setup { a: a2, ..s.clone() };
    for mode in [Accumulation::Exact, Accumulation::Sequential] {
        let (got, _, _) = run::<f32, f32>(&mut Rng::new(1), &s2, 1.0, mode);
        assert!(got[..16].iter().all(|v| v.is_nan()), "row 0 is NaN ({mode:?})");
        if mode == Accumulation::Exact {
            assert_eq!(bits(&got[16..]), bits(&base[16..]), "row 1 unchanged by sign bits");
        }
    }
}

#[test]
fn rows_do_not_depend_on_the_rest_of_the_batch() {
    let mut rng = Rng::new(16);
    let c = Config {
        format: BlockFormat::Nvfp4,
        k: 64,
        lens: vec![2, 3, 1],
        cache_lengths: vec![4, 0, 9],
        hq: 2,
        hkv: 1,
        hd: 16,
        page: 4,
        layers: 1,
        mla_width: None,
    };
    let s = setup(&mut rng, &c);
    let (all, _, _) = run::<bf16, bf16>(&mut Rng::new(2), &s, 0.5, Accumulation::Sequential);
    // Sequence 1 alone: rows 2..5 of A.
    let (data, _, ts) = s.a.clone().into_parts();
    let rb = s.a.as_ref().format().row_bytes(64);
    let sub: Vec<u8> = data[2 * rb..5 * rb].to_vec();
    let plain: Vec<u8> =
        (2..5).flat_map(|r| (0..4).map(move |kb| (r, kb))).map(|(r, kb)| s.a.as_ref().scale_byte(r, kb)).collect();
    let sub_scales = paged_qkv::formats::scale_layout::ScaleLayout::new(3, 4).interleave(&plain).unwrap();
    let a1 = QuantizedMatrix::from_parts(BlockFormat::Nvfp4, 3, 64, sub, sub_scales, ts).unwrap();
    let pages1 = Pages {
        lookup: s.pages.lookup[s.pages.cols..2 * s.pages.cols].to_vec(),
        cols: s.pages.cols,
        cache_lengths: vec![0],
    };
    let s1 = Setup { a: a1, offsets: vec![0, 3], pages: pages1, rows: vec![(0, 0), (0, 1), (0, 2)], ..s.clone() };
    let (alone, _, _) = run::<bf16, bf16>(&mut Rng::new(2), &s1, 0.5, Accumulation::Sequential);
    assert_eq!(bits(&all[2 * s.q_dim..5 * s.q_dim]), bits(&alone));
}

#[test]
fn empty_batches_and_sequences() {
    let mut rng = Rng::new(17);
    for lens in [vec![], vec![0], vec![0, 2, 0], vec![0, 0]] {
        let c = Config {
            format: BlockFormat::Mxfp4,
            k: 64,
            cache_lengths: lens.iter().map(|_| 3).collect(),
            lens,
            hq: 1,
            hkv: 1,
            hd: 16,
            page: 2,
            layers: 1,
            mla_width: None,
        };
        let s = setup(&mut rng, &c);
        check_exact::<f32, f32>(&mut rng, &s, 1.0);
    }
}

#[test]
fn fp8_cache_saturates() {
    let mut rng = Rng::new(18);
    let c = Config {
        format: BlockFormat::Nvfp4,
        k: 64,
        lens: vec![3],
        cache_lengths: vec![0],
        hq: 1,
        hkv: 1,
        hd: 16,
        page: 4,
        layers: 1,
        mla_width: None,
    };
    let s = setup(&mut rng, &c);
    let (q, _, after) = run::<f32, E4M3>(&mut rng, &s, 1.0e6, Accumulation::Exact);
    let mut saw_sat = false;
    for (i, &(b, t)) in s.rows.iter().enumerate() {
        for n in s.q_dim..s.w.rows() {
            let (bl, kv, l, sl, h, d) = kv_coord(&s, b, t, n);
            let got = after[s.shape.index(bl, kv, l, sl, h, d)];
            let v = exact_value(s.a.as_ref(), s.w.as_ref(), i, n, 1.0e6).unwrap();
            let x = round_scaled(v.0, v.1, 24);
            assert!(!got.to_f32().is_nan());
            if x.abs() >= 448.0 {
                assert_eq!(got.to_f32(), 448f32.copysign(x as f32));
                saw_sat = true;
            }
        }
    }
    assert!(saw_sat && q.iter().any(|v| v.abs() > 448.0));
}
