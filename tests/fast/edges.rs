//! The FP4 fast path at the edges: overflowing block terms and NaN scales (every ISA equal to the
//! oracle's exact answer), subnormal `tensor_sf`, every output and cache dtype (E4M3 rounding
//! included), and `matmul_fp4_packed`.

use crate::common::*;
use crate::fp4_setup::{Config, setup};
use paged_qkv::fast::{self, PackedWeights, QkvFp4PackedArgs, matmul_fp4_packed};
use paged_qkv::formats::scale_layout::ScaleLayout;
use paged_qkv::formats::{BlockFormat, QuantizedMatrix, QuantizedRef};
use paged_qkv::{
    Accumulation, CacheShape, E4M3, Element, Exec, Isa, KvWrite, PageTable, PagedKvCache, QkvFp4Args, bf16, f16,
    reference,
};

fn all_execs() -> Vec<Exec> {
    Isa::available().into_iter().map(|i| Exec::default().with_isa(i)).collect()
}

/// Runs one fused call (fast with `exec`, or the exact oracle) into an f32 output and cache.
fn run1(a: QuantizedRef<'_>, w: QuantizedRef<'_>, q_dim: usize, tsf: f32, exec: Option<Exec>) -> (Vec<f32>, Vec<f32>) {
    let m = a.rows();
    let shape = CacheShape::mha(m + 1, 1, 1, 1, (w.rows() - q_dim) / 2).unwrap();
    let mut cache: PagedKvCache<f32> = PagedKvCache::zeros(shape);
    let mut out = vec![0f32; m * q_dim];
    let lookup: Vec<u32> = (0..m as u32).collect();
    let table = PageTable::new(&lookup, m, &[0]).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, 0);
    let offsets = [0, m as u32];
    let args = QkvFp4Args::new(a, &offsets, w, q_dim).with_tensor_sf(tsf);
    match exec {
        Some(e) => fast::qkv_fp4_ragged(&args, &mut out, &mut kv, e).unwrap(),
        None => reference::qkv_fp4_ragged(&args, &mut out, &mut kv, Accumulation::Exact).unwrap(),
    }
    (out, cache.into_vec())
}

/// A `rows × k` FP4 matrix with every nibble `code` in block `b` given by `codes(r, b)`, and
/// every scale byte `scale`.
fn fp4(format: BlockFormat, rows: usize, k: usize, codes: impl Fn(usize, usize) -> u8, scale: u8) -> QuantizedMatrix {
    let v = format.vector_size();
    let data: Vec<u8> = (0..rows)
        .flat_map(|r| (0..k / 2).map(move |j| (r, j)))
        .map(|(r, j)| codes(r, 2 * j / v) | codes(r, (2 * j + 1) / v) << 4)
        .collect();
    let lay = ScaleLayout::for_operand(rows, k, v);
    let scales = lay.interleave(&vec![scale; rows * lay.k_blocks()]).unwrap();
    QuantizedMatrix::from_parts(format, rows, k, data, scales, 1.0).unwrap()
}

/// The example: activation scale byte 127, weight scale byte 254, K = 64, activations all
/// +6, weight block 0 all +6 and block 1 all −6. Each block term overflows f32 (2^127 · 72 · 32 · …)
/// while the true sum is 0. Before the fix the scalar kernel gave NaN and the SIMD ones ∞.
#[test]
fn overflowing_block_terms_are_exact_on_every_isa() {
    let a = fp4(BlockFormat::Mxfp4, 1, 64, |_, _| 7, 127); // code 7 = +6
    let w = fp4(BlockFormat::Mxfp4, 4, 64, |r, b| if r == 1 && b == 1 { 15 } else { 7 }, 254); // 15 = −6
    let exact = run1(a.as_ref(), w.as_ref(), 2, 1.0, None);
    assert_eq!(exact.0[1], 0.0, "the oracle's answer: +big − big = 0");
    assert_eq!(exact.0[0], f32::INFINITY, "+big + big overflows for real");
    for e in all_execs() {
        let got = run1(a.as_ref(), w.as_ref(), 2, 1.0, Some(e));
        assert_eq!(bits(&got.0), bits(&exact.0), "{e:?} output");
        assert_eq!(bits(&got.1), bits(&exact.1), "{e:?} cache");
    }
}

/// MX scale products below f32's normal range (the kernels would flush them): exact on every ISA.
#[test]
fn underflowing_mx_scales_are_exact_on_every_isa() {
    let mut rng = Rng::new(80);
    for format in [BlockFormat::Mxfp4, BlockFormat::Mxfp8] {
        let c = Config {
            format,
            k: 96,
            lens: vec![3],
            cache_lengths: vec![0],
            hq: 1,
            hkv: 1,
            hd: 16,
            page: 4,
            layers: 1,
            mla_width: None,
        };
        let mut s = setup(&mut rng, &c);
        for m in [&mut s.a, &mut s.w] {
            let lay = m.as_ref().scale_layout();
            let (data, mut scales, ts) = m.clone().into_parts();
            for r in 0..m.rows() {
                for kb in 0..lay.k_blocks() {
                    scales[lay.offset(r, kb)] = 20 + rng.below(60) as u8; // 2^-107 .. 2^-48
                }
            }
            *m = QuantizedMatrix::from_parts(format, m.rows(), m.k(), data, scales, ts).unwrap();
        }
        let q_dim = s.q_dim;
        let exact = run1(s.a.as_ref(), s.w.as_ref(), q_dim, 1.0, None);
        assert!(exact.0.iter().any(|&v| v != 0.0), "the true values are not all 0");
        for e in all_execs() {
            let got = run1(s.a.as_ref(), s.w.as_ref(), q_dim, 1.0, Some(e));
            assert_eq!(bits(&got.0), bits(&exact.0), "{format:?} {e:?}");
        }
    }
}

/// NaN scales: the affected values are NaN and every other value is the normal fast value (the
/// same bits as without the NaN scale), on every ISA.
#[test]
fn nan_scales_poison_exactly_their_values() {
    let mut rng = Rng::new(81);
    for format in BlockFormat::ALL {
        let c = Config {
            format,
            k: 64,
            lens: vec![4],
            cache_lengths: vec![0],
            hq: 1,
            hkv: 1,
            hd: 16,
            page: 4,
            layers: 1,
            mla_width: None,
        };
        let s = setup(&mut rng, &c);
        let nan = if format == BlockFormat::Nvfp4 { 0x7F } else { 0xFF };
        let poisoned = |m: &QuantizedMatrix, row: usize| {
            let lay = m.as_ref().scale_layout();
            let (data, mut scales, ts) = m.clone().into_parts();
            scales[lay.offset(row, 0)] = nan;
            QuantizedMatrix::from_parts(format, m.rows(), m.k(), data, scales, ts).unwrap()
        };
        let (a2, w2) = (poisoned(&s.a, 1), poisoned(&s.w, 2));
        for e in all_execs() {
            let clean = run1(s.a.as_ref(), s.w.as_ref(), s.q_dim, 1.0, Some(e));
            let got = run1(a2.as_ref(), w2.as_ref(), s.q_dim, 1.0, Some(e));
            for r in 0..4 {
                for c in 0..s.q_dim {
                    let (g, cl) = (got.0[r * s.q_dim + c], clean.0[r * s.q_dim + c]);
                    if r == 1 || c == 2 {
                        assert!(g.is_nan(), "{format:?} {e:?} ({r}, {c}) must be NaN");
                    } else {
                        assert_eq!(g.to_bits(), cl.to_bits(), "{format:?} {e:?} ({r}, {c})");
                    }
                }
            }
        }
    }
}

/// The smallest subnormal `tensor_sf` values: the fast value is the one rounding of the exact
/// accumulator times `tensor_sf` (within one subnormal step of the oracle), on every ISA.
#[test]
fn subnormal_tensor_sf() {
    let mut rng = Rng::new(82);
    let c = Config {
        format: BlockFormat::Nvfp4,
        k: 32,
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
    let kb = s.a.as_ref().k_blocks() as f64;
    for tsf in [f32::from_bits(1), f32::from_bits(3), f32::from_bits(0x7F_FFFF), 3.0 * f32::MIN_POSITIVE / 7.0] {
        let exact = run1(s.a.as_ref(), s.w.as_ref(), s.q_dim, tsf, None);
        for e in all_execs() {
            let got = run1(s.a.as_ref(), s.w.as_ref(), s.q_dim, tsf, Some(e));
            for i in 0..2 {
                for n in 0..s.q_dim {
                    let (g, x) = (got.0[i * s.q_dim + n] as f64, exact.0[i * s.q_dim + n] as f64);
                    // The documented bound with one subnormal step (2^-149) of slack — not the
                    // 1e-38 of the other tests, which would dwarf these values. Before the fix,
                    // `tensor_sf · 1/4` rounded: 3·2^-149 gave −7.06e-43 for −5.3e-43.
                    let bound = (kb + 2.0) * 2f64.powi(-24) * crate::abs_block_sum(&s, i, n, tsf)
                        + x.abs() * 2f64.powi(-24)
                        + f32::from_bits(1) as f64;
                    assert!((g - x).abs() <= bound, "tsf {tsf:e} {e:?} ({i}, {n}): {g:e} vs {x:e} (bound {bound:e})");
                }
            }
        }
    }
}

/// Every output and cache dtype, FP8 E4M3 included: one rounding of the f32 fast value (E4M3
/// saturates at 448 and rounds to nearest even below it).
#[test]
fn every_destination_dtype() {
    let mut rng = Rng::new(83);
    let c = Config {
        format: BlockFormat::Nvfp4,
        k: 128,
        lens: vec![3, 2],
        cache_lengths: vec![1, 4],
        hq: 2,
        hkv: 1,
        hd: 16,
        page: 4,
        layers: 1,
        mla_width: None,
    };
    let s = setup(&mut rng, &c);
    let pw = PackedWeights::new(s.w.as_ref());
    fn go<O: Element, C: Element>(
        s: &crate::fp4_setup::Setup,
        pw: &PackedWeights,
        tsf: f32,
        e: Exec,
    ) -> (Vec<O>, Vec<C>) {
        let mut cache: PagedKvCache<C> = PagedKvCache::zeros(s.shape);
        let mut out = vec![O::default(); s.rows.len() * s.q_dim];
        let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
        let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
        let args = QkvFp4PackedArgs::new(s.a.as_ref(), &s.offsets, pw, s.q_dim).with_tensor_sf(tsf);
        fast::qkv_fp4_ragged_packed(&args, &mut out, &mut kv, e).unwrap();
        (out, cache.into_vec())
    }
    // tsf large enough that some K/V values exceed 448 (E4M3 saturation) and others do not.
    let (mut saturated, mut rounded) = (0, 0);
    for tsf in [1.0f32, 30.0, 300.0, 3000.0] {
        for e in all_execs() {
            let wide: (Vec<f32>, Vec<f32>) = go(&s, &pw, tsf, e);
            let a: (Vec<bf16>, Vec<E4M3>) = go(&s, &pw, tsf, e);
            let b: (Vec<f16>, Vec<f16>) = go(&s, &pw, tsf, e);
            for (i, w) in wide.0.iter().enumerate() {
                assert_eq!(a.0[i], bf16::from_f32(*w));
                assert_eq!(b.0[i].to_bits(), f16::from_f32(*w).to_bits());
            }
            for (i, w) in wide.1.iter().enumerate() {
                assert_eq!(a.1[i], E4M3::from_f32(*w), "E4M3 cache element {i}");
                assert_eq!(b.1[i].to_bits(), f16::from_f32(*w).to_bits());
                if w.abs() >= 448.0 {
                    saturated += 1;
                    assert_eq!(a.1[i].to_f32().abs(), 448.0);
                } else if *w != 0.0 && a.1[i].to_f32() != *w {
                    rounded += 1;
                    // Round to nearest: no E4M3 value is closer.
                    let got = a.1[i].to_f32();
                    assert!(
                        (0..=255u8)
                            .map(|c| E4M3(c).to_f32())
                            .filter(|v| v.is_finite())
                            .all(|v| (v - w).abs() >= (got - w).abs())
                    );
                }
            }
        }
    }
    assert!(saturated > 0 && rounded > 0, "both saturated ({saturated}) and rounded ({rounded}) E4M3 values occur");
}

/// `matmul_fp4_packed` is the fused kernels into a plain matrix: the same values as the fused op's
/// Q and K/V columns, on every ISA; and its validation.
#[test]
fn matmul_fp4_packed_matches_the_fused_op() {
    let mut rng = Rng::new(84);
    for format in BlockFormat::ALL {
        let c = Config {
            format,
            k: 96,
            lens: vec![5],
            cache_lengths: vec![0],
            hq: 2,
            hkv: 1,
            hd: 16,
            page: 8,
            layers: 1,
            mla_width: None,
        };
        let s = setup(&mut rng, &c);
        let pw = PackedWeights::new(s.w.as_ref());
        let n = s.w.rows();
        for e in all_execs() {
            let mut plain = vec![0f32; 5 * n];
            matmul_fp4_packed(s.a.as_ref(), &pw, 0.5, &mut plain, e).unwrap();
            let (q, cache) = run_fused(&s, &pw, 0.5, e);
            for r in 0..5 {
                assert_eq!(bits(&plain[r * n..r * n + s.q_dim]), bits(&q[r * s.q_dim..(r + 1) * s.q_dim]));
                for j in 0..n - s.q_dim {
                    let (bl, kv, l, sl, h, d) = crate::fp4_setup::kv_coord(&s, 0, r, s.q_dim + j);
                    assert_eq!(
                        plain[r * n + s.q_dim + j].to_bits(),
                        cache[s.shape.index(bl, kv, l, sl, h, d)].to_bits()
                    );
                }
            }
            // Validation: output size, format mismatch, non-finite tensor_sf.
            assert!(matmul_fp4_packed(s.a.as_ref(), &pw, 0.5, &mut plain[1..], e).is_err());
            assert!(matmul_fp4_packed(s.a.as_ref(), &pw, f32::NAN, &mut plain, e).is_err());
        }
    }
}

fn run_fused(s: &crate::fp4_setup::Setup, pw: &PackedWeights, tsf: f32, e: Exec) -> (Vec<f32>, Vec<f32>) {
    let mut cache: PagedKvCache<f32> = PagedKvCache::zeros(s.shape);
    let mut out = vec![0f32; s.rows.len() * s.q_dim];
    let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
    let args = QkvFp4PackedArgs::new(s.a.as_ref(), &s.offsets, pw, s.q_dim).with_tensor_sf(tsf);
    fast::qkv_fp4_ragged_packed(&args, &mut out, &mut kv, e).unwrap();
    (out, cache.into_vec())
}
