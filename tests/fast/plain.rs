//! The bf16/f16/f32 fast fused QKV (ragged with bias, padded BSHD): every ISA against the scalar
//! kernel bit for bit (AVX-512 BF16 against an independent emulation of `vdpbf16ps`), the scalar
//! kernel against the oracle's Exact mode within the documented bound, narrow destinations as one
//! rounding of the f32 result, the whole cache outside the written slots unchanged, thread-count
//! and batch invariance.

use crate::common::*;
use crate::isas;
use paged_qkv::fast::{self, PackedPlainWeights, QkvBshdPackedArgs, QkvRaggedPackedArgs};
use paged_qkv::reference;
use paged_qkv::{
    Accumulation, CacheShape, DType, E4M3, Element, Exec, Isa, KvWrite, PageTable, PagedKvCache, Par, QkvBshdArgs,
    QkvRaggedArgs, bf16, f16,
};
use proptest::prelude::{ProptestConfig, any, proptest};

/// How values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Values {
    /// Roughly normal, scaled by 1/sqrt(K) for weights.
    Normal,
    /// Exponents spread over the whole bf16/f32 range (subnormals, products that overflow).
    Extreme,
    /// f16 values near ±65504 and tiny ones: results that overflow f16.
    NearF16Max,
    /// Magnitudes 2^-135 .. 2^-55: subnormal inputs, products and sums (where `vdpbf16ps` flushes).
    Tiny,
}

#[derive(Clone, Debug)]
pub struct Plain<T> {
    pub x: Vec<T>,
    pub w: Vec<T>,
    pub bias: Option<Vec<T>>,
    pub k: usize,
    pub n: usize,
    pub q_dim: usize,
    pub shape: CacheShape,
    pub pages: Pages,
    pub layer: usize,
    /// Ragged: Some(offsets); BSHD: None (then `seq` and `valid` apply).
    pub offsets: Option<Vec<u32>>,
    pub batch: usize,
    pub seq: usize,
    pub valid: Vec<u32>,
    /// (batch, t, writes K/V) per row.
    pub rows: Vec<(usize, usize, bool)>,
}

fn value<T: Element>(rng: &mut Rng, v: Values, scale: f32) -> T {
    let x = match v {
        Values::Normal => rng.normal() * scale,
        Values::Extreme => {
            let e = rng.range(0, 250) as i32 - 140; // 2^-140 (subnormal) .. 2^110
            rng.f32() * 2f32.powi(e.clamp(-149, 127))
        }
        Values::Tiny => rng.f32() * 2f32.powi(-(rng.range(55, 135) as i32)),
        Values::NearF16Max => match rng.below(4) {
            0 => 65504.0 * rng.f32(),
            1 => 6.0e-5 * rng.f32(),
            _ => rng.normal(),
        },
    };
    T::from_f32(x)
}

pub struct Cfg {
    pub ragged: bool,
    pub k: usize,
    pub lens: Vec<usize>,
    pub seq: usize,
    pub cache_lengths: Vec<u32>,
    pub hq: usize,
    pub hkv: usize,
    pub hd: usize,
    pub page: usize,
    pub mla: Option<usize>,
    pub bias: bool,
    pub values: Values,
}

pub fn random_cfg(rng: &mut Rng, ragged: bool) -> Cfg {
    let batch = rng.range(1, 3);
    let seq = rng.range(1, 7);
    let lens: Vec<usize> = (0..batch)
        .map(|_| match rng.below(4) {
            0 => 0,
            1 => {
                if ragged {
                    1
                } else {
                    seq
                }
            }
            _ => rng.range(0, seq),
        })
        .collect();
    Cfg {
        ragged,
        k: [1, 2, 7, 16, 33, 64, 100][rng.below(7)],
        cache_lengths: lens.iter().map(|_| rng.range(0, 9) as u32).collect(),
        lens,
        seq,
        hq: rng.range(1, 3),
        hkv: rng.range(1, 2),
        hd: [16, 32, 8, 48][rng.below(4)],
        page: [1, 3, 4, 16][rng.below(4)],
        mla: (ragged && rng.below(4) == 0).then(|| rng.range(1, 16)),
        bias: ragged && rng.below(2) == 0,
        values: Values::Normal,
    }
}

pub fn setup<T: Element>(rng: &mut Rng, c: &Cfg) -> Plain<T> {
    let q_dim = c.hq * c.hd;
    let (shape, n) = match c.mla {
        Some(wd) => (CacheShape::mla(64, 2, c.page, 1, c.hd).unwrap(), q_dim + wd.min(c.hd)),
        None => (CacheShape::mha(64, 2, c.page, c.hkv, c.hd).unwrap(), q_dim + 2 * c.hkv * c.hd),
    };
    let batch = c.lens.len();
    let m = if c.ragged { c.lens.iter().sum() } else { batch * c.seq };
    let wscale = 1.0 / (c.k as f32).sqrt();
    let x = (0..m * c.k).map(|_| value(rng, c.values, 1.0)).collect();
    let w = (0..n * c.k).map(|_| value(rng, c.values, wscale)).collect();
    let bias = c.bias.then(|| (0..n).map(|_| value(rng, c.values, 0.1)).collect());
    let pages = pages(rng, &c.cache_lengths, &c.lens, c.page, 64);
    let rows = if c.ragged {
        c.lens.iter().enumerate().flat_map(|(b, &l)| (0..l).map(move |t| (b, t, true))).collect()
    } else {
        c.lens.iter().enumerate().flat_map(|(b, &l)| (0..c.seq).map(move |t| (b, t, t < l))).collect()
    };
    Plain {
        x,
        w,
        bias,
        k: c.k,
        n,
        q_dim,
        shape,
        pages,
        layer: rng.below(2),
        offsets: c.ragged.then(|| offsets(&c.lens)),
        batch,
        seq: c.seq,
        valid: c.lens.iter().map(|&l| l as u32).collect(),
        rows,
    }
}

/// How a call is run.
#[derive(Clone, Copy, Debug)]
pub enum How {
    Fast(Exec),
    /// The prepacked entry point.
    Packed(Exec),
    Oracle,
}

pub fn run<T: Element, O: Element, C: Element>(s: &Plain<T>, how: How, seed: u64) -> (Vec<O>, Vec<C>) {
    let mut cache: PagedKvCache<C> = random_cache(&mut Rng::new(seed), s.shape);
    let mut out = vec![O::from_f32(-7.0); s.rows.len() * s.q_dim];
    let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
    let packed = || PackedPlainWeights::new(&s.w, s.k).unwrap();
    let r = match &s.offsets {
        Some(offs) => {
            let args = QkvRaggedArgs::new(&s.x, offs, &s.w, s.k, s.q_dim).maybe_bias(s.bias.as_deref());
            match how {
                How::Fast(e) => fast::qkv_ragged(&args, &mut out, &mut kv, e),
                How::Packed(e) => {
                    let pw = packed();
                    let pargs = QkvRaggedPackedArgs::new(&s.x, offs, &pw, s.q_dim).maybe_bias(s.bias.as_deref());
                    fast::qkv_ragged_packed(&pargs, &mut out, &mut kv, e)
                }
                How::Oracle => reference::qkv_ragged(&args, &mut out, &mut kv, Accumulation::Exact),
            }
        }
        None => {
            let args = QkvBshdArgs::new(&s.x, (s.batch, s.seq, s.k), &s.w, &s.valid, s.q_dim);
            match how {
                How::Fast(e) => fast::qkv_bshd(&args, &mut out, &mut kv, e),
                How::Packed(e) => {
                    let pw = packed();
                    let pargs = QkvBshdPackedArgs::new(&s.x, (s.batch, s.seq), &pw, &s.valid, s.q_dim);
                    fast::qkv_bshd_packed(&pargs, &mut out, &mut kv, e)
                }
                How::Oracle => reference::qkv_bshd(&args, &mut out, &mut kv, Accumulation::Exact),
            }
        }
    };
    r.unwrap();
    (out, cache.into_vec())
}

/// The cache index written by column `n ≥ q_dim` of row `i`, or None (a padded row).
pub fn kv_index<T>(s: &Plain<T>, i: usize, n: usize) -> Option<usize> {
    let (b, t, writes) = s.rows[i];
    if !writes {
        return None;
    }
    let p = s.shape.page_size();
    let pos = s.pages.cache_lengths[b] as usize + t;
    let block = s.pages.lookup[b * s.pages.cols + pos / p] as usize;
    let j = n - s.q_dim;
    let (hd, kvw) = (s.shape.head_size(), s.shape.kv_width());
    // Independent of the crate's router: the MAX routing rule written out.
    let (kv, h, d) = if s.shape.is_mla() {
        (0, 0, j)
    } else if j < kvw {
        (0, j / hd, j % hd)
    } else {
        (1, (j - kvw) / hd, (j - kvw) % hd)
    };
    Some(s.shape.index(block, kv, s.layer, pos % p, h, d))
}

/// (value to compare, Σ|a·w| + |bias|) of every written element, in output order then cache
/// order, with its cache index (None for the output).
pub fn elements<T: Element>(s: &Plain<T>) -> Vec<(usize, usize, Option<usize>)> {
    let mut v = Vec::new();
    for i in 0..s.rows.len() {
        for n in 0..s.n {
            if n < s.q_dim {
                v.push((i, n, None));
            } else if let Some(ix) = kv_index(s, i, n) {
                v.push((i, n, Some(ix)));
            }
        }
    }
    v
}

fn abs_sum<T: Element>(s: &Plain<T>, i: usize, n: usize) -> f64 {
    let x = &s.x[i * s.k..(i + 1) * s.k];
    let w = &s.w[n * s.k..(n + 1) * s.k];
    let b = s.bias.as_ref().map_or(0.0, |b| b[n].to_f32().abs() as f64);
    x.iter().zip(w).map(|(a, c)| (a.to_f32() as f64 * c.to_f32() as f64).abs()).sum::<f64>() + b
}

/// The documented bound: `(K + 2) · 2^-24 · (Σ|a·w| + |bias|)` before the final rounding, plus
/// `K · 2^-126` where AVX-512 BF16 flushes subnormals, plus subnormal roundings.
pub fn check_bound<T: Element>(s: &Plain<T>, fast: &(Vec<f32>, Vec<f32>), exact: &(Vec<f32>, Vec<f32>), ftz: bool) {
    let u = 2f64.powi(-24);
    for (i, n, ix) in elements(s) {
        let (got, want) = match ix {
            None => (fast.0[i * s.q_dim + n], exact.0[i * s.q_dim + n]),
            Some(ix) => (fast.1[ix], exact.1[ix]),
        };
        if want.is_nan() || want.is_infinite() {
            assert_eq!(got.to_bits(), want.to_bits(), "row {i} col {n}: non-finite exact {want}, got {got}");
            continue;
        }
        let extra = if ftz { s.k as f64 * 2f64.powi(-126) } else { 0.0 };
        let bound = (s.k as f64 + 2.0) * u * abs_sum(s, i, n) + want.abs() as f64 * u + extra + 1e-44;
        let diff = (got as f64 - want as f64).abs();
        assert!(diff <= bound, "row {i} col {n}: fast {got} exact {want} diff {diff} > bound {bound}");
    }
    // Nothing else in the cache changed (both runs start from the same random cache).
    let written: std::collections::HashSet<usize> = elements(s).iter().filter_map(|e| e.2).collect();
    let before: PagedKvCache<f32> = random_cache(&mut Rng::new(SEED), s.shape);
    for (ix, (&g, &b)) in fast.1.iter().zip(before.data()).enumerate() {
        if !written.contains(&ix) {
            assert_eq!(g.to_bits(), b.to_bits(), "cache element {:?} changed", s.shape.coords(ix));
        }
    }
}

pub const SEED: u64 = 17;

/// `vdpbf16ps` as its manual describes it: per pair, two f32 FMAs (odd element first) with
/// subnormal inputs treated as zero and subnormal results flushed to zero; then the bias add and
/// the epilogue's rule (a non-finite value is recomputed exactly).
fn emulate_dpbf16(s: &Plain<bf16>, i: usize, n: usize, exact: f32) -> f32 {
    let daz = |v: f32| if v.is_subnormal() { 0f32.copysign(v) } else { v };
    let x = |k: usize| if k < s.k { s.x[i * s.k + k].to_f32() } else { 0.0 };
    let w = |k: usize| if k < s.k { s.w[n * s.k + k].to_f32() } else { 0.0 };
    let mut acc = 0f32;
    for p in 0..s.k.div_ceil(2) {
        for k in [2 * p + 1, 2 * p] {
            acc = daz(daz(x(k)).mul_add(daz(w(k)), daz(acc)));
        }
    }
    let v = match &s.bias {
        Some(b) => acc + b[n].to_f32(),
        None => acc,
    };
    if v.is_finite() { v } else { exact }
}

/// The two results hold the same bits.
fn same_bits(a: &(Vec<f32>, Vec<f32>), b: &(Vec<f32>, Vec<f32>)) -> bool {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    bits(&a.0) == bits(&b.0) && bits(&a.1) == bits(&b.1)
}

fn isa_exec(isa: Isa) -> Exec {
    Exec { par: Par::Rayon, isa: Some(isa) }
}

fn scalar() -> Exec {
    Exec { par: Par::Sequential, isa: Some(Isa::Scalar) }
}

/// Every ISA against the scalar kernel (bit for bit), the scalar kernel against the oracle.
fn check_isas<T: Element>(s: &Plain<T>) {
    let base: (Vec<f32>, Vec<f32>) = run(s, How::Fast(scalar()), SEED);
    let exact: (Vec<f32>, Vec<f32>) = run(s, How::Oracle, SEED);
    check_bound(s, &base, &exact, false);
    for isa in Isa::available() {
        let got: (Vec<f32>, Vec<f32>) = run(s, How::Fast(isa_exec(isa)), SEED);
        // A `Workers` team of three (uneven shares on any machine) gives the rayon pool's bits.
        let team = Exec { par: Par::Workers(paged_qkv::Workers::shared(3).unwrap()), isa: Some(isa) };
        let on_team: (Vec<f32>, Vec<f32>) = run(s, How::Fast(team), SEED);
        assert!(same_bits(&on_team, &got), "{isa:?}: Workers and rayon differ");
        if isa == Isa::Avx512Bf16 && T::DTYPE == DType::BF16 {
            // Bit for bit against the emulation; within the bound (with flushes) of the oracle.
            let sb: &Plain<bf16> = unsafe_cast(s);
            for (i, n, ix) in elements(s) {
                let (g, e) = match ix {
                    None => (got.0[i * s.q_dim + n], exact.0[i * s.q_dim + n]),
                    Some(ix) => (got.1[ix], exact.1[ix]),
                };
                let want = emulate_dpbf16(sb, i, n, e);
                assert_eq!(g.to_bits(), want.to_bits(), "avx512bf16 row {i} col {n}: {g} vs emulated {want}");
            }
            check_bound(s, &got, &exact, true);
        } else {
            assert_eq!(bits(&got.0), bits(&base.0), "{isa:?} output");
            assert_eq!(bits(&got.1), bits(&base.1), "{isa:?} cache");
        }
    }
    // The prepacked entry point computes the same bits.
    let packed: (Vec<f32>, Vec<f32>) = run(s, How::Packed(scalar()), SEED);
    assert_eq!((bits(&packed.0), bits(&packed.1)), (bits(&base.0), bits(&base.1)));
}

/// `&Plain<T>` as `&Plain<bf16>` when T is bf16 (checked by the caller via `T::DTYPE`).
fn unsafe_cast<T: Element>(s: &Plain<T>) -> &Plain<bf16> {
    assert_eq!(T::DTYPE, DType::BF16);
    (s as &dyn std::any::Any).downcast_ref::<Plain<bf16>>().expect("bf16 setup")
}

/// The value a narrow destination D holds for an f32 product `p` (the kernel's accumulator) and
/// bias `b`: one rounding without a bias; with one, MAX's bias step `D(D(p) + b)`, and for an
/// E4M3 cache `D(p + b)` (semantics §4).
fn narrow_of<D: Element>(p: f32, b: Option<f32>) -> D {
    match b {
        None => D::from_f32(p),
        Some(b) if D::DTYPE == DType::F8E4M3 => D::from_f32(p + b),
        Some(b) => D::from_f32(D::from_f32(p).to_f32() + b),
    }
}

/// Narrow destinations (bf16, f16, E4M3 cache; bf16/f16 output) are one rounding of the f32
/// accumulator (or, with a bias, MAX's bias step on it: `narrow_of`), on every ISA.
fn check_narrow<T: Element, O: Element, C: Element>(s: &Plain<T>) {
    // The accumulators: the same call without its bias, into f32 destinations.
    let plain = Plain { bias: None, ..s.clone() };
    for isa in Isa::available() {
        let acc: (Vec<f32>, Vec<f32>) = run(&plain, How::Fast(isa_exec(isa)), SEED);
        let narrow: (Vec<O>, Vec<C>) = run(s, How::Fast(isa_exec(isa)), SEED);
        let before: PagedKvCache<C> = random_cache(&mut Rng::new(SEED), s.shape);
        let bias = |n: usize| s.bias.as_ref().map(|b| b[n].to_f32());
        for (i, n, ix) in elements(s) {
            match ix {
                None => {
                    let j = i * s.q_dim + n;
                    let want: O = narrow_of(acc.0[j], bias(n));
                    assert_eq!(narrow.0[j].to_bits(), want.to_bits(), "{isa:?} output ({i}, {n})");
                }
                Some(ix) => {
                    let want: C = narrow_of(acc.1[ix], bias(n));
                    assert_eq!(narrow.1[ix].to_bits(), want.to_bits(), "{isa:?} cache {:?}", s.shape.coords(ix));
                }
            }
        }
        let written: std::collections::HashSet<usize> = elements(s).iter().filter_map(|e| e.2).collect();
        for (ix, c) in narrow.1.iter().enumerate() {
            if !written.contains(&ix) {
                assert_eq!(c.to_bits(), before.data()[ix].to_bits(), "{isa:?} cache {:?}", s.shape.coords(ix));
            }
        }
    }
}

#[test]
fn plain_every_isa_bit_identical_and_within_the_bound() {
    let _ = isas();
    let mut rng = Rng::new(60);
    for case in 0..24 {
        let c = random_cfg(&mut rng, case % 2 == 0);
        match case % 3 {
            0 => check_isas(&setup::<bf16>(&mut rng, &c)),
            1 => check_isas(&setup::<f16>(&mut rng, &c)),
            _ => check_isas(&setup::<f32>(&mut rng, &c)),
        }
    }
}

#[test]
fn plain_real_shapes() {
    let mut rng = Rng::new(61);
    // Qwen2.5-0.5B (K 896, 14/2 heads of 64), ragged with bias; M = 13 crosses every row tile size.
    let c = Cfg {
        ragged: true,
        k: 896,
        lens: vec![9, 0, 4],
        seq: 0,
        cache_lengths: vec![126, 0, 300],
        hq: 14,
        hkv: 2,
        hd: 64,
        page: 128,
        mla: None,
        bias: true,
        values: Values::Normal,
    };
    check_isas(&setup::<bf16>(&mut rng, &c));
    // A BSHD batch with padding: 3 sequences of 13, valid 13, 0, 5.
    let c = Cfg { ragged: false, lens: vec![13, 0, 5], seq: 13, cache_lengths: vec![0, 7, 127], bias: false, ..c };
    check_isas(&setup::<f16>(&mut rng, &c));
}

/// Decode (M = 1 and 2): the kernels stream whole weight groups (no k-blocks) four at a time on
/// `vdpbf16ps`; K spans several of the larger calls' k-blocks and N = 15 groups leaves a partial
/// pass of four. M = 4, 7 and 12: AVX2 streams whole groups of bf16 and f16 through one and two
/// row blocks (`plain_stream_rows`), f32 in k-blocks.
#[test]
fn plain_decode_shapes() {
    let mut rng = Rng::new(62);
    for (m, cache) in [(1usize, 127u32), (2, 0), (4, 5), (7, 0), (12, 300)] {
        let c = Cfg {
            ragged: true,
            k: 1201,
            lens: vec![m],
            seq: 0,
            cache_lengths: vec![cache],
            hq: 3,
            hkv: 1,
            hd: 48,
            page: 128,
            mla: None,
            bias: m == 1,
            values: Values::Normal,
        };
        check_isas(&setup::<bf16>(&mut rng, &c));
        check_isas(&setup::<f16>(&mut rng, &c));
        check_isas(&setup::<f32>(&mut rng, &c));
    }
}

#[test]
fn plain_adversarial_values() {
    let mut rng = Rng::new(62);
    for (case, values) in
        [Values::Extreme, Values::Extreme, Values::Tiny, Values::Tiny, Values::NearF16Max].into_iter().enumerate()
    {
        let mut c = random_cfg(&mut rng, case % 2 == 0);
        c.values = values;
        c.k = 33;
        match values {
            Values::NearF16Max => {
                let s = setup::<f16>(&mut rng, &c);
                check_isas(&s);
                check_narrow::<f16, f16, f16>(&s);
            }
            _ => {
                check_isas(&setup::<bf16>(&mut rng, &c));
                check_isas(&setup::<f32>(&mut rng, &c));
            }
        }
    }
}

#[test]
fn plain_every_destination_dtype() {
    let mut rng = Rng::new(63);
    for case in 0..6 {
        let c = random_cfg(&mut rng, case % 2 == 0);
        let s = setup::<bf16>(&mut rng, &c);
        check_narrow::<bf16, bf16, bf16>(&s);
        check_narrow::<bf16, f16, E4M3>(&s);
        check_narrow::<bf16, f32, f16>(&s);
        let s = setup::<f32>(&mut rng, &c);
        check_narrow::<f32, f16, E4M3>(&s);
    }
}

#[test]
fn plain_thread_counts_and_batch_composition_do_not_change_bits() {
    let mut rng = Rng::new(64);
    let c = Cfg {
        ragged: true,
        k: 200,
        lens: vec![130, 3],
        seq: 0,
        cache_lengths: vec![5, 5],
        hq: 4,
        hkv: 2,
        hd: 32,
        page: 16,
        mla: None,
        bias: true,
        values: Values::Normal,
    };
    let s = setup::<bf16>(&mut rng, &c);
    let one: (Vec<bf16>, Vec<bf16>) = crate::in_pool(1, || run(&s, How::Fast(Exec::default()), 9));
    for threads in [2, 8] {
        let got: (Vec<bf16>, Vec<bf16>) = crate::in_pool(threads, || run(&s, How::Fast(Exec::default()), 9));
        assert_eq!((bits(&got.0), bits(&got.1)), (bits(&one.0), bits(&one.1)), "{threads} threads");
    }
    // The last sequence alone (M = 3 instead of 133: another tiling) gives the same rows.
    let m = s.rows.len();
    let b = 1;
    let cols = s.pages.cols;
    let alone = Plain {
        x: s.x[(m - 3) * s.k..].to_vec(),
        offsets: Some(vec![0, 3]),
        pages: Pages {
            lookup: s.pages.lookup[b * cols..(b + 1) * cols].to_vec(),
            cols,
            cache_lengths: vec![s.pages.cache_lengths[b]],
        },
        rows: vec![(0, 0, true), (0, 1, true), (0, 2, true)],
        batch: 1,
        valid: vec![3],
        ..s.clone()
    };
    let got: (Vec<bf16>, Vec<bf16>) = run(&alone, How::Fast(Exec::default()), 9);
    assert_eq!(bits(&got.0), bits(&one.0[(m - 3) * s.q_dim..]), "batch composition changed Q");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random shapes: K odd and even, empty sequences, valid lengths 0/1/full, page boundaries,
    /// one KV head, MLA, bias on and off.
    #[test]
    fn plain_random_shapes_all_isas(seed in any::<u64>(), ragged in any::<bool>(), dt in 0usize..3) {
        let mut rng = Rng::new(seed);
        let c = random_cfg(&mut rng, ragged);
        match dt {
            0 => check_isas(&setup::<bf16>(&mut rng, &c)),
            1 => check_isas(&setup::<f16>(&mut rng, &c)),
            _ => check_isas(&setup::<f32>(&mut rng, &c)),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// `PackedPlainWeights::to_vec` gives back the packed weight bit for bit (every element type,
    /// odd K, N not a multiple of the 16-column group, extreme values, NaN and signed zeros).
    #[test]
    fn packing_a_plain_weight_is_lossless(seed in any::<u64>()) {
        fn roundtrip<T: Element>(rng: &mut Rng) {
            let (n, k) = (rng.range(1, 40), rng.range(1, 70));
            let mut w: Vec<T> = (0..n * k).map(|_| value(rng, Values::Extreme, 1.0)).collect();
            w[0] = T::from_f32(-0.0);
            w[n * k - 1] = T::from_f32(f32::NAN);
            let back = PackedPlainWeights::new(&w, k).unwrap().to_vec();
            let b = |v: &[T]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(b(&back), b(&w), "{:?} [{n}, {k}]", T::DTYPE);
        }
        let mut rng = Rng::new(seed);
        roundtrip::<f32>(&mut rng);
        roundtrip::<bf16>(&mut rng);
        roundtrip::<f16>(&mut rng);
        roundtrip::<E4M3>(&mut rng);
    }
}
