//! FP8-quantized caches (E4M3 codes, f32 scales per group along the head dimension), written by
//! every operation that writes K/V, oracle and fast path on every ISA and thread team. The judge,
//! written here from the semantics (§3.1): the same call into a cache of the activation dtype
//! (for a RoPE, one holding the quantized cache dequantized, `S(code · scale)`), then every
//! written group quantized (`scale = amax / 448`, `E4M3(x · (1 / scale))`). The quantized call
//! must give those codes and scales bit for bit, the same output, and leave every other code and
//! scale as it was. Bad scales are errors that write nothing.

use crate::common::*;
use crate::fp4_setup::{Config, setup as fp4_setup};
use crate::plain::{Cfg, Values, setup as plain_setup};
use paged_qkv::fast;
use paged_qkv::formats::fp8::e4m3_from_f32;
use paged_qkv::formats::quantize::{quantize_fp8_input, quantize_fp8_weight};
use paged_qkv::ops::{Freqs, QkvRope};
use paged_qkv::{
    BlockFormat, CacheShape, E4M3, Element, Error, Exec, Fp8Granularity, Fp8Scales, Isa, KvScales, KvSel,
    KvStoreBshdArgs, KvStoreRaggedArgs, KvWrite, PageTable, PagedKvCache, Par, QkvBshdArgs, QkvFp4Args, QkvFp8Args,
    QkvRaggedArgs, RopeBshdArgs, RopeMath, RopeRaggedArgs, bf16, reference,
};

/// The oracle, or the fast path with an ISA and a thread team.
#[derive(Clone, Copy, Debug)]
enum How {
    Oracle,
    Fast(Exec),
}

fn hows() -> Vec<How> {
    let mut v = vec![How::Oracle];
    for isa in Isa::available() {
        for par in [Par::Sequential, Par::Rayon, Par::Workers(paged_qkv::Workers::shared(3).unwrap())] {
            v.push(How::Fast(Exec { par, isa: Some(isa) }));
        }
    }
    v
}

/// A quantized cache's starting state: random finite codes and random positive scales.
fn start(shape: CacheShape, g: usize, seed: u64) -> (PagedKvCache<E4M3>, KvScales) {
    let mut rng = Rng::new(seed);
    let codes = (0..shape.len()).map(|_| E4M3(e4m3_from_f32(rng.normal() * 100.0))).collect();
    let mut scales = KvScales::zeros(shape, g).unwrap();
    let n = scales.data().len();
    let data: Vec<f32> = (0..n).map(|_| rng.f32().abs() * 0.01 + 1e-4).collect();
    scales = KvScales::from_vec(shape, g, data).unwrap();
    (PagedKvCache::from_vec(shape, codes).unwrap(), scales)
}

/// `S(code · scale)` of every element: the cache of `S` a quantized cache stands for.
fn dequantized<S: Element>(codes: &PagedKvCache<E4M3>, scales: &KvScales) -> PagedKvCache<S> {
    let g = scales.granularity();
    let data = codes.data().iter().enumerate().map(|(i, c)| S::from_f32(c.to_f32() * scales.data()[i / g])).collect();
    PagedKvCache::from_vec(codes.shape(), data).unwrap()
}

/// One group quantized, from the semantics: `(codes, scale)`.
fn quantize_group(x: &[f32]) -> (Vec<u32>, f32) {
    let amax = x.iter().fold(0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    let scale = amax / 448.0;
    let inv = if scale == 0.0 || !(1.0 / scale).is_finite() { 0.0 } else { 1.0 / scale };
    (x.iter().map(|v| E4M3::from_f32(v * inv).to_bits()).collect(), scale)
}

/// The written slots `(block, offset)` of rows `(batch, t, writes)`.
fn slots(shape: CacheShape, pg: &Pages, rows: &[(usize, usize, bool)]) -> Vec<(usize, usize)> {
    let p = shape.page_size();
    rows.iter()
        .filter(|r| r.2)
        .map(|&(b, t, _)| {
            let pos = pg.cache_lengths[b] as usize + t;
            (pg.lookup[b * pg.cols + pos / p] as usize, pos % p)
        })
        .collect()
}

/// What the quantized call must leave: the start, with the `parts` (0 = K, 1 = V) of every
/// written slot of `layer` quantized from the plain call's cache.
fn expected<S: Element>(
    layer: usize,
    written: &[(usize, usize)],
    parts: &[usize],
    plain: &PagedKvCache<S>,
    start: (&PagedKvCache<E4M3>, &KvScales),
) -> (Vec<u32>, Vec<u32>) {
    let shape = plain.shape();
    let g = start.1.granularity();
    let mut codes = bits(start.0.data());
    let mut scales = bits(start.1.data());
    for &(block, offset) in written {
        for &kv in parts {
            for h in 0..shape.num_kv_heads() {
                for q in 0..shape.head_size() / g {
                    let at = shape.index(block, kv, layer, offset, h, q * g);
                    let x: Vec<f32> = plain.data()[at..at + g].iter().map(|v| v.to_f32()).collect();
                    let (c, s) = quantize_group(&x);
                    // The documented accuracy (semantics §10): each element dequantizes within
                    // 2^-4 of itself (E4M3's half ulp, plus the f32 steps), 2^-10 · scale in
                    // E4M3's subnormal range, 2^-119 where the group is too small to scale.
                    for (v, &code) in x.iter().zip(&c) {
                        let d = E4M3::from_bits(code).to_f32() * s;
                        let bound = v.abs() * 0.0626 + s * 2f32.powi(-10) + 2f32.powi(-119);
                        assert!(!v.is_finite() || (d - v).abs() <= bound, "{v} dequantized to {d} (scale {s})");
                    }
                    codes[at..at + g].copy_from_slice(&c);
                    scales[at / g] = s.to_bits();
                }
            }
        }
    }
    (codes, scales)
}

/// Runs `$call` (using `how` and `kv`) into a plain bf16 cache and into the quantized cache, and
/// checks the quantized result against [`expected`] (`$call` gives the output's bits).
macro_rules! check_op {
    ($shape:expr, $pg:expr, $layer:expr, $g:expr, $written:expr, $parts:expr, $tag:expr,
     |$how:ident, $kv:ident| $call:expr) => {{
        let (shape, pg, layer, g) = ($shape, $pg, $layer, $g);
        let (codes0, scales0) = start(shape, g, 5);
        for $how in hows() {
            let table = PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap();
            let mut plain: PagedKvCache<bf16> = dequantized(&codes0, &scales0);
            let plain_out = {
                let mut $kv = KvWrite::new(plain.view_mut(), table, layer);
                $call
            };
            let (mut codes, mut scales) = (codes0.clone(), scales0.clone());
            let quant_out = {
                let mut $kv = KvWrite::new(codes.view_mut(), table, layer).with_scales(scales.view_mut());
                $call
            };
            assert_eq!(plain_out, quant_out, "{} {:?}: output", $tag, $how);
            let (want_codes, want_scales) = expected(layer, $written, $parts, &plain, (&codes0, &scales0));
            assert_eq!(bits(scales.data()), want_scales, "{} {:?}: scales", $tag, $how);
            assert_eq!(bits(codes.data()), want_codes, "{} {:?}: codes", $tag, $how);
        }
    }};
}

/// The fused QKV ops (plain ragged with bias, BSHD, FP4 with fused RoPE), every ISA.
#[test]
fn quantized_cache_qkv_every_isa() {
    let mut rng = Rng::new(91);
    for case in 0..8 {
        let ragged = case % 2 == 0;
        let cfg = Cfg {
            ragged,
            k: [7, 33, 64][case % 3],
            lens: vec![3, 0, 2],
            seq: 4,
            cache_lengths: vec![1, 0, 6],
            hq: 2,
            hkv: 1 + case % 2,
            hd: [16, 32, 48, 8][case % 4],
            page: [4, 3, 16, 1][case % 4],
            mla: None,
            bias: ragged && case % 4 == 0,
            values: Values::Normal,
        };
        let s = plain_setup::<bf16>(&mut rng, &cfg);
        let g = [8, 16, 16, 2][case % 4];
        let written = slots(s.shape, &s.pages, &s.rows);
        let m = s.rows.len();
        check_op!(s.shape, &s.pages, s.layer, g, &written, &[0, 1], format!("plain case {case}"), |how, kv| {
            let mut q = vec![bf16::ZERO; m * s.q_dim];
            let r = match (&s.offsets, how) {
                (Some(offs), how) => {
                    let a = QkvRaggedArgs::new(&s.x, offs, &s.w, s.k, s.q_dim).maybe_bias(s.bias.as_deref());
                    match how {
                        How::Oracle => reference::qkv_ragged(&a, &mut q, &mut kv, paged_qkv::Accumulation::Exact),
                        How::Fast(e) => fast::qkv_ragged(&a, &mut q, &mut kv, e),
                    }
                }
                (None, how) => {
                    let a = QkvBshdArgs::new(&s.x, (s.batch, s.seq, s.k), &s.w, &s.valid, s.q_dim);
                    match how {
                        How::Oracle => reference::qkv_bshd(&a, &mut q, &mut kv, paged_qkv::Accumulation::Exact),
                        How::Fast(e) => fast::qkv_bshd(&a, &mut q, &mut kv, e),
                    }
                }
            };
            r.unwrap();
            bits(&q)
        });
    }
    // FP8 W8A8 (block scales, bias): the same staging through the FP8 kernels.
    for case in 0..2 {
        let cfg = Cfg {
            ragged: true,
            k: [100, 160][case],
            lens: vec![2, 3],
            seq: 3,
            cache_lengths: vec![4, 1],
            hq: 2,
            hkv: 2,
            hd: 32,
            page: 4,
            mla: None,
            bias: false,
            values: Values::Normal,
        };
        let s = plain_setup::<f32>(&mut rng, &cfg);
        let m = s.rows.len();
        let gran = [Fp8Granularity::Block, Fp8Granularity::Channel][case];
        let (x, sx) = quantize_fp8_input(&s.x, m, s.k, gran).unwrap();
        let (w, sw) = quantize_fp8_weight(&s.w, s.n, s.k, gran).unwrap();
        let bias: Vec<bf16> = (0..s.n).map(|j| bf16::from_f32(j as f32 * 0.01 - 0.3)).collect();
        let offs = s.offsets.clone().unwrap();
        let written = slots(s.shape, &s.pages, &s.rows);
        check_op!(s.shape, &s.pages, s.layer, 16, &written, &[0, 1], format!("fp8 case {case}"), |how, kv| {
            let mut q = vec![bf16::ZERO; m * s.q_dim];
            let scales = match gran {
                Fp8Granularity::Block => Fp8Scales::Block { input: &sx, weight: &sw },
                _ => Fp8Scales::Channel { input: &sx, weight: &sw },
            };
            let a = QkvFp8Args::new(&x, &offs, &w, s.k, scales, s.q_dim).with_bias(&bias);
            match how {
                How::Oracle => reference::qkv_fp8_ragged(&a, &mut q, &mut kv, paged_qkv::Accumulation::Exact),
                How::Fast(e) => fast::qkv_fp8_ragged(&a, &mut q, &mut kv, e),
            }
            .unwrap();
            bits(&q)
        });
    }
    // FP4 with a fused RoPE (the rotated K quantized), MLA included.
    for case in 0..4 {
        let mla = case == 3;
        let hd = [16, 32, 64, 32][case];
        let c = Config {
            format: [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8, BlockFormat::Nvfp4][case],
            k: 64,
            lens: vec![3, 0, 5],
            cache_lengths: vec![2, 0, 9],
            hq: 2,
            hkv: 1,
            hd,
            page: 4,
            layers: 2,
            mla_width: mla.then_some(hd),
        };
        let s = fp4_setup(&mut rng, &c);
        let m = s.rows.len();
        let f: Vec<bf16> = paged_qkv::freqs_cis(32, hd, 1e4).into_iter().map(bf16::from_f32).collect();
        let rope = QkvRope::new(Freqs::Bf16(&f), hd, hd, case % 2 == 0).with_math(RopeMath::MaxCompat);
        let rows: Vec<(usize, usize, bool)> = s.rows.iter().map(|&(b, t)| (b, t, true)).collect();
        let written = slots(s.shape, &s.pages, &rows);
        let parts: &[usize] = if mla { &[0] } else { &[0, 1] };
        check_op!(s.shape, &s.pages, s.layer, 16, &written, parts, format!("fp4 case {case}"), |how, kv| {
            let mut q = vec![bf16::ZERO; m * s.q_dim];
            let a = QkvFp4Args::new(s.a.as_ref(), &s.offsets, s.w.as_ref(), s.q_dim).with_rope(rope);
            match how {
                How::Oracle => reference::qkv_fp4_ragged(&a, &mut q, &mut kv, paged_qkv::Accumulation::Exact),
                How::Fast(e) => fast::qkv_fp4_ragged(&a, &mut q, &mut kv, e),
            }
            .unwrap();
            bits(&q)
        });
    }
}

/// RoPE on a quantized cache: the K dequantized, rotated, requantized (V untouched), ragged with
/// partial rotary and position ids, and padded; every ISA.
#[test]
fn quantized_cache_rope_every_isa() {
    let mut rng = Rng::new(92);
    for case in 0..7 {
        // Case 6: 9 KV heads of 128, a K row longer than the fast path stages on the stack.
        let (hq, dk, hkv) = if case == 6 { (9, 128, 9) } else { (2, [16, 32, 64][case % 3], 1 + case % 2) };
        let rd = if case % 3 == 1 { 8 } else { dk };
        let (lens, cls) = (vec![3usize, 0, 4], vec![2u32, 5, 7]);
        let shape = CacheShape::mha(32, 2, 4, hkv, dk).unwrap();
        let pg = pages(&mut rng, &cls, &lens, 4, 32);
        let m: usize = lens.iter().sum();
        let q: Vec<bf16> = (0..m * hq * dk).map(|_| bf16::from_f32(rng.normal())).collect();
        let f: Vec<bf16> = paged_qkv::freqs_cis(40, rd, 1e4).into_iter().map(bf16::from_f32).collect();
        let interleaved = case % 2 == 0;
        let math = if case < 3 { RopeMath::F32 } else { RopeMath::MaxCompat };
        let offs = offsets(&lens);
        let ids: Option<Vec<u32>> = (case % 3 == 2).then(|| (0..m).map(|i| (i * 5 % 39) as u32).collect());
        let rows: Vec<(usize, usize, bool)> =
            lens.iter().enumerate().flat_map(|(b, &l)| (0..l).map(move |t| (b, t, true))).collect();
        let written = slots(shape, &pg, &rows);
        check_op!(shape, &pg, 1, 8, &written, &[0], format!("rope ragged {case}"), |how, kv| {
            let mut o = vec![bf16::ZERO; q.len()];
            let a = RopeRaggedArgs::new(&q, &offs, (hq, dk), &f, rd, interleaved).maybe_position_ids(ids.as_deref());
            match how {
                How::Oracle => reference::rope_ragged(&a, &mut o, &mut kv, math),
                How::Fast(e) => fast::rope_ragged(&a, &mut o, &mut kv, math, e),
            }
            .unwrap();
            bits(&o)
        });
        // Padded: batch 3 of seq 4, valid lengths as `lens`.
        let (batch, seq) = (3, 4);
        let qp: Vec<bf16> = (0..batch * seq * hq * dk).map(|_| bf16::from_f32(rng.normal())).collect();
        let fp: Vec<bf16> = paged_qkv::freqs_cis(40, dk, 1e4).into_iter().map(bf16::from_f32).collect();
        let valid: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        check_op!(shape, &pg, 0, 16, &written, &[0], format!("rope bshd {case}"), |how, kv| {
            let mut o = vec![bf16::ZERO; qp.len()];
            let a = RopeBshdArgs::new(&qp, (batch, seq, hq), &fp, &valid, interleaved);
            match how {
                How::Oracle => reference::rope_bshd(&a, &mut o, &mut kv, math),
                How::Fast(e) => fast::rope_bshd(&a, &mut o, &mut kv, math, e),
            }
            .unwrap();
            bits(&o)
        });
    }
}

/// The KV stores into a quantized cache (K and V, ragged and padded, extreme values and zero
/// groups); every ISA.
#[test]
fn quantized_cache_stores_every_isa() {
    let mut rng = Rng::new(93);
    let shape = CacheShape::mha(32, 2, 4, 2, 32).unwrap();
    let (lens, cls) = (vec![5usize, 1, 0], vec![3u32, 0, 2]);
    let pg = pages(&mut rng, &cls, &lens, 4, 32);
    let m: usize = lens.iter().sum();
    let w = shape.kv_width();
    let value = |rng: &mut Rng, i: usize| match i % 97 {
        0..=15 => 0.0, // a zero group (scale 0) in most rows
        16 => 3e38,
        17 => -1e-40,
        _ => rng.normal() * 2f32.powi((i % 7) as i32 * 9 - 30),
    };
    let vals: Vec<bf16> = (0..m * w).map(|i| bf16::from_f32(value(&mut rng, i))).collect();
    let offs = offsets(&lens);
    let rows: Vec<(usize, usize, bool)> =
        lens.iter().enumerate().flat_map(|(b, &l)| (0..l).map(move |t| (b, t, true))).collect();
    let written = slots(shape, &pg, &rows);
    for (which, part) in [(KvSel::K, 0), (KvSel::V, 1)] {
        check_op!(shape, &pg, 1, 16, &written, &[part], format!("store ragged {which:?}"), |how, kv| {
            let a = KvStoreRaggedArgs::new(&vals, &offs, which);
            match how {
                How::Oracle => reference::kv_store_ragged(&a, &mut kv),
                How::Fast(e) => fast::kv_store_ragged(&a, &mut kv, e),
            }
            .unwrap();
            0
        });
        let (batch, seq) = (3, 5);
        let vp: Vec<bf16> = (0..batch * seq * w).map(|i| bf16::from_f32(value(&mut rng, i))).collect();
        let valid: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
        check_op!(shape, &pg, 0, 32, &written, &[part], format!("store bshd {which:?}"), |how, kv| {
            let a = KvStoreBshdArgs::new(&vp, (batch, seq), &valid, which);
            match how {
                How::Oracle => reference::kv_store_bshd(&a, &mut kv),
                How::Fast(e) => fast::kv_store_bshd(&a, &mut kv, e),
            }
            .unwrap();
            0
        });
    }
}

/// Bad scales are errors naming `kv_scales`, and nothing is written: scales on a bf16 cache,
/// scales of another cache's shape, a granularity that does not divide the head size, an MLA
/// fused QKV that writes part of the head.
#[test]
fn quantized_cache_errors_write_nothing() {
    let shape = CacheShape::mha(4, 1, 4, 1, 16).unwrap();
    assert!(matches!(KvScales::zeros(shape, 3), Err(Error::InvalidDim { arg: "kv_scales", .. })));
    assert!(matches!(KvScales::zeros(shape, 1), Err(Error::InvalidDim { arg: "kv_scales", .. })));
    assert!(KvScales::from_vec(shape, 8, vec![0.0; 7]).is_err());
    let other = CacheShape::mha(4, 1, 4, 1, 32).unwrap();
    let (lookup, lens) = ([1u32, 2], [0u32]);
    let vals = vec![bf16::ONE; 2 * 16];
    let a = KvStoreRaggedArgs::new(&vals, &[0, 2], KvSel::K);
    let table = PageTable::new(&lookup, 2, &lens).unwrap();
    // Scales on a bf16 cache.
    let mut c16 = PagedKvCache::<bf16>::zeros(shape);
    let mut sc = KvScales::zeros(shape, 8).unwrap();
    let mut kv = KvWrite::new(c16.view_mut(), table, 0).with_scales(sc.view_mut());
    let e = fast::kv_store_ragged(&a, &mut kv, Exec::default()).unwrap_err();
    assert!(matches!(e, Error::InvalidDim { arg: "kv_scales", .. }), "{e}");
    assert!(reference::kv_store_ragged(&a, &mut kv).is_err());
    assert!(c16.data().iter().all(|v| *v == bf16::ZERO));
    // Scales made for another shape.
    let mut c8 = PagedKvCache::<E4M3>::zeros(shape);
    let mut sc_other = KvScales::zeros(other, 8).unwrap();
    let mut kv = KvWrite::new(c8.view_mut(), table, 0).with_scales(sc_other.view_mut());
    let e = fast::kv_store_ragged(&a, &mut kv, Exec::default()).unwrap_err();
    assert!(e.to_string().contains("kv_scales"), "{e}");
    assert!(c8.data().iter().all(|v| v.to_bits() == 0) && sc_other.data().iter().all(|&s| s == 0.0));
    // An MLA fused QKV writing 8 of 16 dims.
    let mla = CacheShape::mla(4, 1, 4, 1, 16).unwrap();
    let mut cm = PagedKvCache::<E4M3>::zeros(mla);
    let mut sm = KvScales::zeros(mla, 8).unwrap();
    let (k, q_dim) = (4, 16);
    let x = vec![bf16::ONE; 2 * k];
    let wt = vec![bf16::ONE; (q_dim + 8) * k];
    let args = QkvRaggedArgs::new(&x, &[0, 2], &wt, k, q_dim);
    let mut q = vec![bf16::ZERO; 2 * q_dim];
    let mut kv = KvWrite::new(cm.view_mut(), table, 0).with_scales(sm.view_mut());
    let e = fast::qkv_ragged(&args, &mut q, &mut kv, Exec::default()).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(reference::qkv_ragged(&args, &mut q, &mut kv, paged_qkv::Accumulation::Exact).is_err());
    assert!(q.iter().all(|v| *v == bf16::ZERO) && cm.data().iter().all(|v| v.to_bits() == 0));
}

/// The parallel quantize and dequantize passes (their writes through shared slices) under Miri:
/// a quantized ragged store then RoPE of 40 rows (three chunks of rows), one thread, a rayon pool
/// of two and a team of two, against the oracle.
#[test]
fn miri_quantized_store_and_rope_parallel() {
    let (hq, hkv, d, m) = (1, 2, 8, 40);
    let shape = CacheShape::mha(24, 1, 2, hkv, d).unwrap();
    let freqs = paged_qkv::freqs_cis(48, d, 10000.0);
    let mut rng = Rng::new(77);
    let q: Vec<bf16> = (0..m * hq * d).map(|_| bf16::from_f32(rng.normal())).collect();
    let values: Vec<bf16> = (0..m * hkv * d).map(|_| bf16::from_f32(rng.normal())).collect();
    let offs = [0u32, 17, m as u32];
    let lookup: Vec<u32> = (0..24).map(|i| (i * 7) % 24).collect(); // 2 sequences × 12 pages of 2
    let table = PageTable::new(&lookup, 12, &[1, 0]).unwrap();
    let run = |how: How| {
        let (mut codes, mut scales) = start(shape, 4, 9);
        let mut out = vec![bf16::ZERO; q.len()];
        let mut kv = KvWrite::new(codes.view_mut(), table, 0).with_scales(scales.view_mut());
        let store = KvStoreRaggedArgs::new(&values, &offs, KvSel::K);
        let rope = RopeRaggedArgs::new(&q, &offs, (hq, d), &freqs, d, false);
        match how {
            How::Oracle => {
                reference::kv_store_ragged(&store, &mut kv).unwrap();
                reference::rope_ragged(&rope, &mut out, &mut kv, RopeMath::F32).unwrap();
            }
            How::Fast(e) => {
                fast::kv_store_ragged(&store, &mut kv, e).unwrap();
                fast::rope_ragged(&rope, &mut out, &mut kv, RopeMath::F32, e).unwrap();
            }
        }
        (bits(&out), bits(codes.data()), bits(scales.data()))
    };
    let want = run(How::Oracle);
    assert_eq!(run(How::Fast(Exec::sequential())), want);
    assert_eq!(crate::in_pool(2, || run(How::Fast(Exec::default()))), want);
    assert_eq!(run(How::Fast(Exec::on(paged_qkv::Workers::shared(2).unwrap()))), want);
}
