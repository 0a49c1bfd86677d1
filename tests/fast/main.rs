//! The fast paths against the scalar kernel (bit for bit, on every ISA this CPU has) and against
//! the oracle's Exact mode (within the summation error bound), plus thread-count and batch
//! invariance, and validation. Runs under QEMU for NEON (see README).

#[path = "../oracle/common.rs"]
mod common;
mod edges;
#[path = "../oracle/fp4_setup.rs"]
mod fp4_setup;
mod fp8;
mod kvquant;
mod plain;
mod rope;

use common::*;
use fp4_setup::*;
use paged_qkv::fast::{qkv_fp4_ragged, qkv_fp4_ragged_packed};
use paged_qkv::formats::BlockFormat;
use paged_qkv::formats::QuantizedMatrix;
use paged_qkv::formats::scale_layout::ScaleLayout;
use paged_qkv::reference;
use paged_qkv::{
    Accumulation, Element, Error, Exec, Isa, KvWrite, PackedWeights, PageTable, PagedKvCache, Par, QkvFp4Args,
    QkvFp4PackedArgs, bf16,
};
use proptest::prelude::{ProptestConfig, any, prop_assert_eq, proptest};

/// Runs the fast path (or the oracle when `exec` is None) on `s` with a cache seeded by `seed`.
fn run<O: Element, C: Element>(s: &Setup, tsf: f32, exec: Option<Exec>, seed: u64) -> (Vec<O>, Vec<C>) {
    let mut cache: PagedKvCache<C> = random_cache(&mut Rng::new(seed), s.shape);
    let mut out = vec![O::from_f32(-7.0); s.rows.len() * s.q_dim];
    let args = QkvFp4Args::new(s.a.as_ref(), &s.offsets, s.w.as_ref(), s.q_dim).with_tensor_sf(tsf);
    let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
    match exec {
        Some(e) => qkv_fp4_ragged(&args, &mut out, &mut kv, e).unwrap(),
        None => reference::qkv_fp4_ragged(&args, &mut out, &mut kv, Accumulation::Exact).unwrap(),
    }
    (out, cache.into_vec())
}

pub fn isas() -> Vec<Isa> {
    let v = Isa::available();
    eprintln!(
        "ISAs tested: {:?} (not available here: {:?})",
        v,
        Isa::ALL.iter().filter(|i| !v.contains(i)).collect::<Vec<_>>()
    );
    v
}

fn scalar() -> Exec {
    Exec { par: Par::Sequential, isa: Some(Isa::Scalar) }
}

/// Σ_blocks |isum · sa · sb| · |tsf| for (row i, col n), in f64 from the decoded values.
pub fn abs_block_sum(s: &Setup, i: usize, n: usize, tsf: f32) -> f64 {
    let (a, w) = (s.a.as_ref(), s.w.as_ref());
    let f = a.format();
    let v = f.vector_size();
    let mut total = 0f64;
    for kb in 0..a.k_blocks() {
        let mut bs = 0f64;
        for k in kb * v..((kb + 1) * v).min(a.k()) {
            bs += f.element_to_f32(a.row(i), k) as f64 * f.element_to_f32(w.row(n), k) as f64;
        }
        total += (bs * a.scale(i, kb) as f64 * w.scale(n, kb) as f64).abs();
    }
    total * tsf.abs() as f64
}

/// Σ_k |a_k · b_k · sa · sb| · |tsf| (every product's magnitude).
fn abs_term_sum(s: &Setup, i: usize, n: usize, tsf: f32) -> f64 {
    let (a, w) = (s.a.as_ref(), s.w.as_ref());
    let f = a.format();
    let v = f.vector_size();
    (0..a.k())
        .map(|k| {
            (f.element_to_f32(a.row(i), k) as f64
                * f.element_to_f32(w.row(n), k) as f64
                * a.scale(i, k / v) as f64
                * w.scale(n, k / v) as f64)
                .abs()
        })
        .sum::<f64>()
        * tsf.abs() as f64
}

/// Checks (f32 output and cache) the documented bound: FP4 block sums are exact, so
/// `|fast − exact| ≤ (Kb + 2) · 2^-24 · Σ|block terms| + ulp`; MXFP8 also rounds inside a block:
/// `≤ (K + Kb + 2) · 2^-24 · Σ|terms| + ulp`.
fn check_bound(s: &Setup, tsf: f32, fast: &(Vec<f32>, Vec<f32>), exact: &(Vec<f32>, Vec<f32>)) {
    let fp4 = s.a.as_ref().format().is_fp4();
    let kb = s.a.as_ref().k_blocks() as f64 + if fp4 { 0.0 } else { s.a.k() as f64 };
    let u = 2f64.powi(-24);
    let check = |got: f32, want: f32, i: usize, n: usize| {
        if want.is_nan() {
            assert!(got.is_nan(), "row {i} col {n}: NaN expected, got {got}");
            return;
        }
        if want.is_infinite() {
            assert_eq!(got, want, "row {i} col {n}: overflow expected");
            return;
        }
        let sum = if fp4 { abs_block_sum(s, i, n, tsf) } else { abs_term_sum(s, i, n, tsf) };
        let bound = (kb + 2.0) * u * sum + want.abs() as f64 * u + 1e-38;
        let diff = (got as f64 - want as f64).abs();
        assert!(diff <= bound, "row {i} col {n}: fast {got} exact {want} diff {diff} > bound {bound}");
    };
    for i in 0..s.rows.len() {
        for n in 0..s.q_dim {
            check(fast.0[i * s.q_dim + n], exact.0[i * s.q_dim + n], i, n);
        }
    }
    // Cache: compare element-wise; entries the op does not write are equal in both (same seed).
    for (idx, (g, w)) in fast.1.iter().zip(&exact.1).enumerate() {
        if g.to_bits() != w.to_bits() {
            let c = s.shape.coords(idx);
            // Find the (row, col) that writes this element.
            let (i, n) = s
                .rows
                .iter()
                .enumerate()
                .find_map(|(i, &(b, t))| {
                    (s.q_dim..s.w.rows())
                        .find(|&n| {
                            let (bl, kv, l, sl, h, d) = kv_coord(s, b, t, n);
                            [bl, kv, l, sl, h, d] == c
                        })
                        .map(|n| (i, n))
                })
                .unwrap_or_else(|| panic!("fast path changed cache element {c:?} that no token writes"));
            check(*g, *w, i, n);
        }
    }
}

fn config(rng: &mut Rng, format: BlockFormat, mla: bool) -> Config {
    let lens: Vec<usize> = (0..rng.range(1, 4)).map(|_| rng.range(0, 7)).collect();
    Config {
        format,
        k: [32, 64, 96, 48, 160, 200, 18][rng.below(7)].max(if format.is_fp4() { 2 } else { 1 }),
        cache_lengths: lens.iter().map(|_| rng.range(0, 9) as u32).collect(),
        lens,
        hq: rng.range(1, 3),
        hkv: rng.range(1, 2),
        hd: [16, 32, 8][rng.below(3)],
        page: [1, 3, 4, 16][rng.below(4)],
        layers: rng.range(1, 2),
        mla_width: mla.then(|| rng.range(1, 8)),
    }
}

#[test]
fn every_isa_is_bit_identical_to_the_scalar_kernel_and_close_to_exact() {
    let isas = isas();
    let mut rng = Rng::new(50);
    for case in 0..30 {
        let format = BlockFormat::ALL[case % 3];
        let c = config(&mut rng, format, case % 5 == 4);
        let s = setup(&mut rng, &c);
        let tsf = [1.0f32, 0.75, 3.0e-3][rng.below(3)];
        let base: (Vec<f32>, Vec<f32>) = run(&s, tsf, Some(scalar()), 7);
        let exact: (Vec<f32>, Vec<f32>) = run(&s, tsf, None, 7);
        check_bound(&s, tsf, &base, &exact);
        for &isa in &isas {
            for par in [Par::Sequential, Par::Rayon, Par::Workers(paged_qkv::Workers::shared(3).unwrap())] {
                let got: (Vec<f32>, Vec<f32>) = run(&s, tsf, Some(Exec { par, isa: Some(isa) }), 7);
                assert_eq!(bits(&got.0), bits(&base.0), "{isa:?} {par:?} output, case {case}");
                assert_eq!(bits(&got.1), bits(&base.1), "{isa:?} {par:?} cache, case {case}");
            }
        }
        // bf16 output and cache: the same values, rounded once from f32.
        let b: (Vec<bf16>, Vec<bf16>) = run(&s, tsf, Some(Exec::default()), 7);
        for (x, y) in b.0.iter().zip(&base.0) {
            assert_eq!(x.to_bits(), bf16::from_f32(*y).to_bits());
        }
    }
}

#[test]
fn real_shapes_and_adversarial_scales() {
    let isas = isas();
    let mut rng = Rng::new(51);
    // Qwen2.5-0.5B (K 896, 14/2 heads of 64), M = 9 (crosses the decode tiling and MR).
    for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp4] {
        let c = Config {
            format,
            k: 896,
            lens: vec![5, 0, 4],
            cache_lengths: vec![126, 0, 300],
            hq: 14,
            hkv: 2,
            hd: 64,
            page: 128,
            layers: 1,
            mla_width: None,
        };
        let mut s = setup(&mut rng, &c);
        if format == BlockFormat::Nvfp4 {
            // 1 in 8 weight scales subnormal (0x01..0x07), some at the maximum 0x7E.
            let lay = s.w.as_ref().scale_layout();
            let (data, mut scales, ts) = s.w.clone().into_parts();
            for r in 0..s.w.rows() {
                for kb in 0..lay.k_blocks() {
                    let o = lay.offset(r, kb);
                    match rng.below(16) {
                        0 | 1 => scales[o] = 1 + rng.below(7) as u8,
                        2 => scales[o] = 0x7E,
                        _ => {}
                    }
                }
            }
            s.w = QuantizedMatrix::from_parts(format, s.w.rows(), 896, data, scales, ts).unwrap();
        }
        let base: (Vec<f32>, Vec<f32>) = run(&s, 0.5, Some(scalar()), 3);
        let exact: (Vec<f32>, Vec<f32>) = run(&s, 0.5, None, 3);
        check_bound(&s, 0.5, &base, &exact);
        for &isa in &isas {
            let got: (Vec<f32>, Vec<f32>) = run(&s, 0.5, Some(Exec { par: Par::Rayon, isa: Some(isa) }), 3);
            assert_eq!(bits(&got.0), bits(&base.0), "{isa:?}");
            assert_eq!(bits(&got.1), bits(&base.1), "{isa:?}");
        }
    }
}

/// Decode: the one-row kernels (FP4 and MXFP8) take four column groups per call, and on AVX-512
/// the MXFP8 one takes two rows (two sequences of one token each, or one of two); a decode step's
/// 3, 4, 7, 8, 13 and 16 rows take AVX2's few-row kernels (7 in chunks of 4 and 3, 13 of 4, 3, 3
/// and 3; 13 and 16 only FP4: MXFP8 takes its tiled kernel from 9 rows). Head sizes of
/// 16, 64, 128 and 48 columns give panels of 1 to 8 groups: whole four-group calls, remainders,
/// and panels with no four-group call at all; a tiny `tensor_sf` checks the subnormal end.
#[test]
fn decode_row_kernel_is_bit_identical() {
    let isas = isas();
    let mut rng = Rng::new(54);
    for (case, (hd, hq)) in [(16usize, 7usize), (64, 5), (128, 3), (48, 3)].into_iter().enumerate() {
        for (format, lens) in BlockFormat::ALL.into_iter().flat_map(|f| {
            [
                (f, vec![1]),
                (f, vec![1, 1]),
                (f, vec![2]),
                (f, vec![1, 1, 1]),
                (f, vec![2, 2]),
                (f, vec![3, 4]),
                (f, vec![4, 4]),
                (f, vec![4, 4, 5]),
                (f, vec![4, 4, 4, 4]),
            ]
        }) {
            let c = Config {
                format,
                k: [256, 160, 512, 96][case],
                cache_lengths: lens.iter().map(|_| rng.range(0, 40) as u32).collect(),
                lens,
                hq,
                hkv: 1,
                hd,
                page: 16,
                layers: 1,
                mla_width: None,
            };
            let s = setup(&mut rng, &c);
            for tsf in [1.0f32, 2.5e-38] {
                let base: (Vec<f32>, Vec<f32>) = run(&s, tsf, Some(scalar()), 5);
                let exact: (Vec<f32>, Vec<f32>) = run(&s, tsf, None, 5);
                check_bound(&s, tsf, &base, &exact);
                for &isa in &isas {
                    let got: (Vec<f32>, Vec<f32>) = run(&s, tsf, Some(Exec { par: Par::Rayon, isa: Some(isa) }), 5);
                    assert_eq!(bits(&got.0), bits(&base.0), "{isa:?} {format:?} hd {hd} lens {:?}", c.lens);
                    assert_eq!(bits(&got.1), bits(&base.1), "{isa:?} {format:?} hd {hd} lens {:?}", c.lens);
                }
            }
        }
    }
}

#[test]
fn nan_scales_match_the_oracle() {
    let mut rng = Rng::new(52);
    for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8] {
        let c = config(&mut rng, format, false);
        let mut s = setup(&mut rng, &Config { lens: vec![3, 2], cache_lengths: vec![0, 1], ..c });
        let nan = if format == BlockFormat::Nvfp4 { 0x7F } else { 0xFF };
        for m in [&mut s.a, &mut s.w] {
            let lay = m.as_ref().scale_layout();
            let (data, mut scales, ts) = m.clone().into_parts();
            scales[lay.offset(1, lay.k_blocks() - 1)] = nan;
            *m = QuantizedMatrix::from_parts(format, m.rows(), m.k(), data, scales, ts).unwrap();
        }
        if format == BlockFormat::Mxfp8 {
            // NaN elements too (0x7F, 0xFF): the SIMD decode has no NaN, the column goes exact.
            for (m, byte) in [(&mut s.w, 0x7Fu8), (&mut s.a, 0xFF)] {
                let (mut data, scales, ts) = m.clone().into_parts();
                let k = m.k();
                data[(m.rows() - 1) * k + k / 2] = byte;
                *m = QuantizedMatrix::from_parts(format, m.rows(), k, data, scales, ts).unwrap();
            }
        }
        let exact: (Vec<f32>, Vec<f32>) = run(&s, 1.0, None, 1);
        for &isa in &isas() {
            let got: (Vec<f32>, Vec<f32>) = run(&s, 1.0, Some(Exec::default().with_isa(isa)), 1);
            for (g, e) in got.0.iter().zip(&exact.0).chain(got.1.iter().zip(&exact.1)) {
                assert_eq!(g.is_nan(), e.is_nan(), "{format:?} {isa:?}");
            }
        }
    }
}

/// E8M0 scale extremes through the `vscalefps` scale products (MXFP4 and MXFP8 on AVX-512), and
/// MXFP8 tiles of 16 rows or more on the tiled kernel (weights decoded once per tile, slices of 8
/// blocks, group pairs plus a lone last group, accumulators continued through memory):
/// bit-identical to the scalar kernel for tiles of 2 to 8 full chunks and a short last chunk, K of
/// 3, 9 and 17 blocks (slices cut short), heads of 1, 3 and 8 groups; weight scales of 2^-127
/// (the subnormal weight-scale factor, with activation scales that keep the product normal),
/// products past f32 (exact path), and (MXFP8) NaN elements.
#[test]
fn mx_scale_extremes_and_mxfp8_tiles_are_bit_identical() {
    let isas = isas();
    let mut rng = Rng::new(56);
    let cases = [(vec![16usize], 96usize, 16usize, 3usize), (vec![9, 0, 8], 288, 48, 2), (vec![70, 3], 544, 128, 1)];
    for (format, (case, (lens, k, hd, hq))) in [BlockFormat::Mxfp4, BlockFormat::Mxfp8]
        .into_iter()
        .flat_map(|f| cases.iter().cloned().enumerate().map(move |c| (f, c)))
    {
        let c = Config {
            format,
            k,
            cache_lengths: lens.iter().map(|_| rng.range(0, 40) as u32).collect(),
            lens,
            hq,
            hkv: 1,
            hd,
            page: 16,
            layers: 1,
            mla_width: None,
        };
        let mut s = setup(&mut rng, &c);
        let (m, n) = (s.a.rows(), s.w.rows());
        // Activation scales 2^60 .. 2^80 in some rows (so a weight scale of 2^-127 stays normal
        // in the product), weight scales 2^-127 in some blocks (in every block of some columns)
        // and 2^120 in others.
        let lay = s.a.as_ref().scale_layout();
        let (data, mut scales, ts) = s.a.clone().into_parts();
        for r in (0..m).filter(|r| r % 3 != 1) {
            for b in 0..lay.k_blocks() {
                scales[lay.offset(r, b)] = 187 + rng.below(20) as u8;
            }
        }
        s.a = QuantizedMatrix::from_parts(format, m, k, data, scales, ts).unwrap();
        let lay = s.w.as_ref().scale_layout();
        let (mut data, mut scales, ts) = s.w.clone().into_parts();
        for r in 0..n {
            for b in 0..lay.k_blocks() {
                match rng.below(12) {
                    _ if r % 5 == 2 => scales[lay.offset(r, b)] = 0, // every block: visible
                    0 => scales[lay.offset(r, b)] = 0,
                    1 => scales[lay.offset(r, b)] = 247,
                    _ => {}
                }
            }
        }
        if format == BlockFormat::Mxfp8 {
            data[(n / 2) * k + k / 3] = 0x7F; // a NaN element: that column goes exact
        }
        s.w = QuantizedMatrix::from_parts(format, n, k, data, scales, ts).unwrap();
        let base: (Vec<f32>, Vec<f32>) = run(&s, 1.0, Some(scalar()), 6);
        let exact: (Vec<f32>, Vec<f32>) = run(&s, 1.0, None, 6);
        check_bound(&s, 1.0, &base, &exact);
        assert!(base.0.iter().any(|v| v.is_finite() && *v != 0.0), "{format:?} case {case}: some ordinary values");
        for &isa in &isas {
            for par in [Par::Sequential, Par::Rayon, Par::Workers(paged_qkv::Workers::shared(3).unwrap())] {
                let got: (Vec<f32>, Vec<f32>) = run(&s, 1.0, Some(Exec { par, isa: Some(isa) }), 6);
                assert_eq!(bits(&got.0), bits(&base.0), "{format:?} {isa:?} {par:?} output, case {case}");
                assert_eq!(bits(&got.1), bits(&base.1), "{format:?} {isa:?} {par:?} cache, case {case}");
            }
        }
    }
}

pub fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

#[test]
fn thread_counts_and_batch_composition_do_not_change_bits() {
    let mut rng = Rng::new(53);
    for (lens, format) in
        [(vec![70usize, 3], BlockFormat::Nvfp4), (vec![2, 1], BlockFormat::Mxfp4), (vec![9], BlockFormat::Mxfp8)]
    {
        let c = Config {
            format,
            k: 256,
            cache_lengths: lens.iter().map(|_| 5).collect(),
            lens: lens.clone(),
            hq: 4,
            hkv: 2,
            hd: 32,
            page: 16,
            layers: 1,
            mla_width: None,
        };
        let s = setup(&mut rng, &c);
        let one: (Vec<bf16>, Vec<bf16>) = in_pool(1, || run(&s, 1.0, Some(Exec::default()), 9));
        for threads in [2, 8] {
            let got: (Vec<bf16>, Vec<bf16>) = in_pool(threads, || run(&s, 1.0, Some(Exec::default()), 9));
            assert_eq!(bits(&got.0), bits(&one.0), "{threads} threads");
            assert_eq!(bits(&got.1), bits(&one.1), "{threads} threads");
        }
        // The last sequence alone (a different M, possibly another tiling) gives the same rows.
        let last = *lens.last().unwrap();
        let m = s.rows.len();
        let (data, _, ts) = s.a.clone().into_parts();
        let rb = format.row_bytes(c.k);
        let kb = s.a.as_ref().k_blocks();
        let plain: Vec<u8> = (m - last..m)
            .flat_map(|r| (0..kb).map(move |b| (r, b)))
            .map(|(r, b)| s.a.as_ref().scale_byte(r, b))
            .collect();
        let a1 = QuantizedMatrix::from_parts(
            format,
            last,
            c.k,
            data[(m - last) * rb..].to_vec(),
            ScaleLayout::new(last, kb).interleave(&plain).unwrap(),
            ts,
        )
        .unwrap();
        let cols = s.pages.cols;
        let b = lens.len() - 1;
        let alone = Setup {
            a: a1,
            offsets: vec![0, last as u32],
            pages: Pages { lookup: s.pages.lookup[b * cols..(b + 1) * cols].to_vec(), cols, cache_lengths: vec![5] },
            rows: (0..last).map(|t| (0, t)).collect(),
            ..s.clone()
        };
        let got: (Vec<bf16>, Vec<bf16>) = run(&alone, 1.0, Some(Exec::default()), 9);
        assert_eq!(bits(&got.0), bits(&one.0[(m - last) * s.q_dim..]), "batch composition changed Q");
    }
}

#[test]
fn packed_entry_point_and_validation() {
    let mut rng = Rng::new(54);
    let c = config(&mut rng, BlockFormat::Nvfp4, false);
    let s = setup(&mut rng, &Config { lens: vec![2, 3], cache_lengths: vec![3, 0], ..c });
    let raw: (Vec<f32>, Vec<f32>) = run(&s, 1.0, Some(Exec::default()), 4);
    let packed = PackedWeights::new(s.w.as_ref());
    let mut cache: PagedKvCache<f32> = random_cache(&mut Rng::new(4), s.shape);
    let mut out = vec![-7.0f32; 5 * s.q_dim];
    let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
    let args = QkvFp4PackedArgs::new(s.a.as_ref(), &s.offsets, &packed, s.q_dim).with_tensor_sf(1.0);
    let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
    qkv_fp4_ragged_packed(&args, &mut out, &mut kv, Exec::default()).unwrap();
    assert_eq!(bits(&out), bits(&raw.0));
    assert_eq!(bits(cache.data()), bits(&raw.1));

    // Errors leave everything unchanged: a slot conflict, a wrong output size, an unavailable ISA.
    let before = (bits(&out), bits(cache.data()));
    // Sequence 1 gets sequence 0's pages and start position: both write position 3.
    let cols = s.pages.cols;
    let mut lookup = s.pages.lookup.clone();
    lookup.copy_within(0..cols, cols);
    let same_start = [3u32, 3];
    let table = PageTable::new(&lookup, cols, &same_start).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
    assert!(matches!(
        qkv_fp4_ragged_packed(&args, &mut out, &mut kv, Exec::default()),
        Err(Error::SlotConflict { .. })
    ));
    let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
    assert!(matches!(qkv_fp4_ragged_packed(&args, &mut out[1..], &mut kv, Exec::default()), Err(Error::Shape { .. })));
    for isa in Isa::ALL.into_iter().filter(|i| !i.is_available()) {
        let r = qkv_fp4_ragged_packed(&args, &mut out, &mut kv, Exec::default().with_isa(isa));
        assert!(matches!(r, Err(Error::Unsupported { .. })), "forcing {isa:?} must fail");
    }
    assert_eq!((bits(&out), bits(cache.data())), before);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random shapes: K not a multiple of 64, M not a multiple of the tile, empty sequences,
    /// page boundaries, one KV head, MLA.
    #[test]
    fn random_shapes_all_isas(seed in any::<u64>(), fmt in 0usize..3, mla in any::<bool>(), k2 in 1usize..90) {
        let mut rng = Rng::new(seed);
        let format = BlockFormat::ALL[fmt];
        let c = Config { k: 2 * k2, ..config(&mut rng, format, mla) };
        let s = setup(&mut rng, &c);
        let base: (Vec<f32>, Vec<f32>) = run(&s, 0.5, Some(scalar()), seed);
        let exact: (Vec<f32>, Vec<f32>) = run(&s, 0.5, None, seed);
        check_bound(&s, 0.5, &base, &exact);
        for isa in Isa::available() {
            let got: (Vec<f32>, Vec<f32>) = run(&s, 0.5, Some(Exec::default().with_isa(isa)), seed);
            prop_assert_eq!(bits(&got.0), bits(&base.0));
            prop_assert_eq!(bits(&got.1), bits(&base.1));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// `PackedWeights::to_quantized` gives back every code and every scale the operations read,
    /// and the tensor scale, for every format (K not a multiple of the block, N not a multiple of
    /// the 16-column group).
    #[test]
    fn packing_a_block_scaled_weight_is_lossless(seed in any::<u64>(), fmt in 0usize..3, k2 in 1usize..90) {
        let mut rng = Rng::new(seed);
        let format = BlockFormat::ALL[fmt];
        let c = Config { k: 2 * k2, ..config(&mut rng, format, false) };
        let s = setup(&mut rng, &c);
        let w = s.w.as_ref().with_tensor_scale(0.375);
        let back = PackedWeights::new(w).to_quantized();
        prop_assert_eq!((back.format(), back.rows(), back.k()), (w.format(), w.rows(), w.k()));
        prop_assert_eq!(back.tensor_scale(), 0.375);
        prop_assert_eq!(back.data(), w.data());
        let b = back.as_ref();
        for r in 0..w.rows() {
            for kb in 0..w.k_blocks() {
                prop_assert_eq!(b.scale_byte(r, kb), w.scale_byte(r, kb));
            }
        }
    }
}

/// Small enough for Miri (`cargo +nightly miri test --test fast miri_`): the scalar kernel and the
/// parallel scatter (2 threads writing the output and cache through raw pointers, on rayon and on a
/// `Workers` team) against the sequential run and the oracle. Under Miri only the scalar ISA is detected.
#[test]
fn miri_sized_parallel_call() {
    let mut rng = Rng::new(55);
    for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp8] {
        let c = Config {
            format,
            k: 32,
            lens: vec![3, 0, 2],
            cache_lengths: vec![1, 0, 3],
            hq: 1,
            hkv: 1,
            hd: 16,
            page: 2,
            layers: 1,
            mla_width: None,
        };
        let s = setup(&mut rng, &c);
        let seq: (Vec<f32>, Vec<f32>) = run(&s, 1.0, Some(Exec::sequential()), 3);
        let par: (Vec<f32>, Vec<f32>) = in_pool(2, || run(&s, 1.0, Some(Exec::default()), 3));
        assert_eq!(bits(&seq.0), bits(&par.0));
        assert_eq!(bits(&seq.1), bits(&par.1));
        // A `Workers` team: the job hand-off (the lifetime-erased closure) under Miri too.
        let team = Exec::on(paged_qkv::Workers::shared(2).unwrap());
        let on_team: (Vec<f32>, Vec<f32>) = run(&s, 1.0, Some(team), 3);
        assert_eq!(bits(&seq.0), bits(&on_team.0));
        assert_eq!(bits(&seq.1), bits(&on_team.1));
        let exact: (Vec<f32>, Vec<f32>) = run(&s, 1.0, None, 3);
        check_bound(&s, 1.0, &seq, &exact);
    }
}
