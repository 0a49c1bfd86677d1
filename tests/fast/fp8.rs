//! The FP8 W8A8 fast fused QKV (tensor, channel and block scales): every ISA against the scalar
//! kernel bit for bit, the prepacked entry point against the raw one, and every written element
//! against an independent f64 computation of the true sum within the documented bound, carried
//! through MAX's epilogue (scale and bias in the output dtype, then the cache dtype); the rest of
//! the cache unchanged; thread counts do not change bits.

use crate::common::*;
use crate::isas;
use crate::plain::{Plain, SEED, elements, random_cfg, setup};
use paged_qkv::fast::{self, PackedFp8Weights, QkvFp8PackedArgs};
use paged_qkv::formats::fp8::{e4m3_from_f32, e4m3_to_f32};
use paged_qkv::reference;
use paged_qkv::{
    Accumulation, E4M3, Element, Exec, FP8_BLOCK, Fp8Scales, Freqs, KvWrite, PageTable, PagedKvCache, Par, QkvFp8Args,
    QkvRope, RopeMath, RopeRaggedArgs, bf16, f16,
};

/// An FP8 case: a plain setup's shapes and routing, its values as E4M3 bytes, scales, bias.
struct Fp8 {
    s: Plain<f32>,
    x: Vec<u8>,
    w: Vec<u8>,
    m: usize,
    gran: usize,
    input: Vec<f32>,
    weight: Vec<f32>,
    bias: Option<Vec<bf16>>,
}

impl Fp8 {
    fn scales(&self) -> Fp8Scales<'_> {
        match self.gran {
            0 => Fp8Scales::Tensor { input: self.input[0], weight: self.weight[0] },
            1 => Fp8Scales::Channel { input: &self.input, weight: &self.weight },
            _ => Fp8Scales::Block { input: &self.input, weight: &self.weight },
        }
    }
}

fn scale(rng: &mut Rng) -> f32 {
    let e = rng.range(0, 16) as i32 - 12;
    let s = (1.0 + rng.f32().abs()) * 2f32.powi(e);
    if rng.below(5) == 0 { -s } else { s }
}

fn make(rng: &mut Rng, gran: usize, k: usize) -> Fp8 {
    let mut cfg = random_cfg(rng, true);
    cfg.k = k;
    cfg.bias = rng.below(2) == 0;
    let s: Plain<f32> = setup(rng, &cfg);
    let m = s.rows.len();
    let x = s.x.iter().map(|&v| e4m3_from_f32(v * 64.0)).collect();
    let w = s.w.iter().map(|&v| e4m3_from_f32(v * 64.0)).collect();
    let (kb, nb) = (k.div_ceil(FP8_BLOCK), s.n.div_ceil(FP8_BLOCK));
    let (ni, nw) = match gran {
        0 => (1, 1),
        1 => (if rng.below(4) == 0 { 1 } else { m }, if rng.below(4) == 0 { 1 } else { s.n }),
        _ => (kb * m, nb * kb),
    };
    let input = (0..ni).map(|_| scale(rng)).collect();
    let weight = (0..nw).map(|_| scale(rng)).collect();
    let bias = s.bias.as_ref().map(|b| b.iter().map(|&v| bf16::from_f32(v * 8.0)).collect());
    Fp8 { s, x, w, m, gran, input, weight, bias }
}

#[derive(Clone, Copy)]
enum How {
    Fast(Exec),
    Packed(Exec),
    Oracle(Accumulation),
}

fn run<O: Element, C: Element>(f: &Fp8, how: How) -> (Vec<O>, Vec<C>) {
    let s = &f.s;
    let mut cache: PagedKvCache<C> = random_cache(&mut Rng::new(SEED), s.shape);
    let mut out = vec![O::from_f32(-7.0); f.m * s.q_dim];
    let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
    let offs = s.offsets.as_ref().unwrap();
    let args = QkvFp8Args::new(&f.x, offs, &f.w, s.k, f.scales(), s.q_dim).maybe_bias(f.bias.as_deref());
    match how {
        How::Fast(e) => fast::qkv_fp8_ragged(&args, &mut out, &mut kv, e).unwrap(),
        How::Packed(e) => {
            let pw = PackedFp8Weights::new(&f.w, s.k).unwrap();
            let pa = QkvFp8PackedArgs::new(&f.x, offs, &pw, f.scales(), s.q_dim).maybe_bias(f.bias.as_deref());
            fast::qkv_fp8_ragged_packed(&pa, &mut out, &mut kv, e).unwrap()
        }
        How::Oracle(mode) => reference::qkv_fp8_ragged(&args, &mut out, &mut kv, mode).unwrap(),
    }
    (out, cache.into_vec())
}

fn bits<O: Element, C: Element>(r: &(Vec<O>, Vec<C>)) -> (Vec<u32>, Vec<u32>) {
    (r.0.iter().map(|x| x.to_bits()).collect(), r.1.iter().map(|x| x.to_bits()).collect())
}

/// MAX's epilogue on a true sum `raw` (f64), in `O`, then cast to `D`.
fn epilogue<O: Element, D: Element>(f: &Fp8, i: usize, n: usize, raw: f64) -> f32 {
    let o = |x: f32| O::from_f32(x).to_f32();
    let mut v = O::from_f64(raw).to_f32();
    if f.gran < 2 {
        let pick = |v: &[f32], j: usize| v[if v.len() == 1 { 0 } else { j }];
        v = o(v * o(o(pick(&f.input, i)) * o(pick(&f.weight, n))));
    }
    if let Some(b) = &f.bias {
        v = o(v + o(b[n].to_f32()));
    }
    D::from_f32(v).to_f32()
}

/// The true sum of (row i, column n) and the documented bound of the fast sum's error, in f64
/// (the E4M3 products and their per-block sums are exact in f64).
fn truth(f: &Fp8, i: usize, n: usize) -> (f64, f64) {
    let k = f.s.k;
    let (x, w) = (&f.x[i * k..(i + 1) * k], &f.w[n * k..(n + 1) * k]);
    let u = 2f64.powi(-24);
    let kb32 = k.div_ceil(32) as f64;
    if f.gran < 2 {
        let (mut p, mut a) = (0f64, 0f64);
        for (&xa, &wb) in x.iter().zip(w) {
            let t = e4m3_to_f32(xa) as f64 * e4m3_to_f32(wb) as f64;
            p += t;
            if t.is_nan() {
                return (f64::NAN, 0.0);
            }
            a += t.abs();
        }
        return (p, (k as f64 + kb32 + 2.0) * u * a);
    }
    let kbs = k.div_ceil(FP8_BLOCK);
    let (mut p, mut a) = (0f64, 0f64);
    for b in 0..kbs {
        let s = f.input[b * f.m + i] as f64 * f.weight[n / FP8_BLOCK * kbs + b] as f64;
        let (mut pb, mut ab) = (0f64, 0f64);
        for kk in b * FP8_BLOCK..((b + 1) * FP8_BLOCK).min(k) {
            let t = e4m3_to_f32(x[kk]) as f64 * e4m3_to_f32(w[kk]) as f64;
            pb += t;
            if t.is_nan() {
                return (f64::NAN, 0.0);
            }
            ab += t.abs();
        }
        p += s * pb;
        a += s.abs() * ab;
    }
    // Per block: its FMA chain and block sums, the scale product, the product and the add.
    (p, (k as f64 + kb32 + 3.0 * kbs as f64 + 2.0) * u * a + kbs as f64 * 3.0 * 2f64.powi(-149) + a * 1e-15)
}

/// Every written element within the bound (carried through the epilogue, which is monotone), and
/// nothing else in the cache changed.
fn check_bound<O: Element, C: Element>(f: &Fp8, got: &(Vec<O>, Vec<C>)) {
    let s = &f.s;
    for (i, n, ix) in elements(s) {
        let (p, bound) = truth(f, i, n);
        if p.is_nan() {
            // A NaN element (E4M3 0x7F / 0xFF) makes every value it enters NaN.
            let g = match ix {
                None => got.0[i * s.q_dim + n].to_f32(),
                Some(ix) => got.1[ix].to_f32(),
            };
            assert!(
                g.is_nan() || C::DTYPE == paged_qkv::DType::F8E4M3,
                "gran {} row {i} col {n}: {g}, not NaN",
                f.gran
            );
            continue;
        }
        let (g, lo, hi) = match ix {
            None => (
                got.0[i * s.q_dim + n].to_f32(),
                epilogue::<O, O>(f, i, n, p - bound),
                epilogue::<O, O>(f, i, n, p + bound),
            ),
            Some(ix) => {
                (got.1[ix].to_f32(), epilogue::<O, C>(f, i, n, p - bound), epilogue::<O, C>(f, i, n, p + bound))
            }
        };
        let (lo, hi) = (lo.min(hi), lo.max(hi));
        assert!(
            g >= lo && g <= hi,
            "gran {} row {i} col {n}: fast {g} not in [{lo}, {hi}] (true sum {p}, bound {bound})",
            f.gran
        );
    }
    let written: std::collections::HashSet<usize> = elements(s).iter().filter_map(|e| e.2).collect();
    let before: PagedKvCache<C> = random_cache(&mut Rng::new(SEED), s.shape);
    for (ix, (g, b)) in got.1.iter().zip(before.data()).enumerate() {
        if !written.contains(&ix) {
            assert_eq!(g.to_bits(), b.to_bits(), "cache element {:?} changed", s.shape.coords(ix));
        }
    }
}

fn scalar() -> Exec {
    Exec { par: Par::Sequential, isa: Some(paged_qkv::Isa::Scalar) }
}

fn check_all<O: Element, C: Element>(f: &Fp8, isas: &[paged_qkv::Isa]) {
    let want = run::<O, C>(f, How::Fast(scalar()));
    check_bound(f, &want);
    for &isa in isas {
        for how in [How::Fast(Exec { par: Par::Rayon, isa: Some(isa) }), How::Packed(Exec::default().with_isa(isa))] {
            assert_eq!(
                bits(&run::<O, C>(f, how)),
                bits(&want),
                "gran {} {isa:?}: not the scalar kernel's bits",
                f.gran
            );
        }
    }
    // The oracle's two modes are within the same bound.
    check_bound(f, &run::<O, C>(f, How::Oracle(Accumulation::Exact)));
    check_bound(f, &run::<O, C>(f, How::Oracle(Accumulation::Sequential)));
}

#[test]
fn fp8_every_isa_bit_identical_and_within_the_bound() {
    let isas = isas();
    let mut rng = Rng::new(41);
    for case in 0..24 {
        let gran = case % 3;
        let k = [1, 7, 32, 100, 128, 129, 300, 520][rng.below(8)];
        let f = make(&mut rng, gran, k);
        check_all::<bf16, bf16>(&f, &isas);
        if case % 4 == 0 {
            check_all::<f32, E4M3>(&f, &isas);
            check_all::<f16, f32>(&f, &isas);
        }
    }
}

#[test]
fn fp8_real_shape_decode_and_prefill() {
    // Qwen2.5-0.5B's QKV (K = 896, N = 1152) at M = 1, 2, 8 (AVX2's few-row kernel, 4 + 4) and
    // 40, every granularity; 128-block scales also at 11 and 12 rows (AVX2's few-row kernel in
    // chunks of 4 + 4 + 3 and 4 × 3: `FewWeight::Fp8Block`) and 13 (its tiled kernel).
    let isas = isas();
    let mut rng = Rng::new(5);
    let cases = [(0, vec![1]), (1, vec![2]), (2, vec![1]), (2, vec![2]), (2, vec![31, 9]), (1, vec![40])];
    for (gran, lens) in cases.into_iter().chain([
        (0, vec![3, 5]),
        (2, vec![4, 4]),
        (2, vec![4, 4, 3]),
        (2, vec![4; 3]),
        (2, vec![5, 4, 4]),
    ]) {
        let mut cfg = random_cfg(&mut rng, true);
        (cfg.k, cfg.hq, cfg.hkv, cfg.hd, cfg.mla, cfg.bias) = (896, 14, 2, 64, None, true);
        cfg.cache_lengths = lens.iter().map(|_| 3).collect();
        cfg.lens = lens;
        cfg.page = 16;
        let s: Plain<f32> = setup(&mut rng, &cfg);
        let m = s.rows.len();
        let (kb, nb) = (896usize.div_ceil(128), s.n.div_ceil(128));
        let (ni, nw) = [(1, 1), (m, s.n), (kb * m, nb * kb)][gran];
        let f = Fp8 {
            x: s.x.iter().map(|&v| e4m3_from_f32(v * 64.0)).collect(),
            w: s.w.iter().map(|&v| e4m3_from_f32(v * 64.0)).collect(),
            m,
            gran,
            input: (0..ni).map(|_| scale(&mut rng)).collect(),
            weight: (0..nw).map(|_| scale(&mut rng)).collect(),
            bias: s.bias.as_ref().map(|b| b.iter().map(|&v| bf16::from_f32(v)).collect()),
            s,
        };
        check_all::<bf16, bf16>(&f, &isas);
    }
}

#[test]
fn fp8_thread_counts_do_not_change_bits() {
    let mut rng = Rng::new(8);
    for gran in 0..3 {
        let f = make(&mut rng, gran, 300);
        let want = bits(&run::<bf16, bf16>(&f, How::Fast(scalar())));
        for threads in [1, 2, 8] {
            let got = crate::in_pool(threads, || bits(&run::<bf16, bf16>(&f, How::Fast(Exec::default()))));
            assert_eq!(got, want, "gran {gran}, {threads} threads");
        }
    }
}

#[test]
fn fp8_nan_elements_poison_exactly_their_values_on_every_isa() {
    let isas = isas();
    let mut rng = Rng::new(77);
    for gran in 0..3 {
        let mut f = make(&mut rng, gran, 300);
        let k = f.s.k;
        f.x[5] = 0x7F; // row 0: every value NaN
        f.w[3 * k + 200] = 0xFF; // column 3: NaN in every row
        check_all::<bf16, bf16>(&f, &isas);
        let (q, _) = run::<bf16, bf16>(&f, How::Fast(Exec::default()));
        assert!(q[..f.s.q_dim].iter().all(|v| v.is_nan()));
        if f.m > 1 {
            let row1 = &q[f.s.q_dim..2 * f.s.q_dim];
            assert!(row1[3].is_nan() && row1.iter().filter(|v| v.is_nan()).count() == 1, "gran {gran}");
        }
    }
}

/// The fused QKV + RoPE equals the FP8 QKV followed by the standalone RoPE, bit for bit, on every
/// ISA and in both math modes; the oracle likewise.
#[test]
fn fp8_fused_rope_equals_qkv_then_rope() {
    let mut rng = Rng::new(12);
    for case in 0..6 {
        let gran = case % 3;
        let mut f = make(&mut rng, gran, 260);
        while f.s.shape.is_mla() || f.m == 0 {
            f = make(&mut rng, gran, 260);
        }
        let (hd, interleaved) = (f.s.shape.head_size(), case % 2 == 0);
        let rd = if case % 4 < 2 { hd } else { hd / 2 };
        let math = if case < 3 { RopeMath::F32 } else { RopeMath::MaxCompat };
        let freqs: Vec<f32> = (0..64 * rd).map(|i| ((i % rd) as f32 * 0.37 + (i / rd) as f32 * 0.11).sin()).collect();
        let rope = QkvRope::new(Freqs::F32(&freqs), hd, rd, interleaved).with_math(math);
        let offs = f.s.offsets.clone().unwrap();
        let mut hows: Vec<Option<Exec>> = isas().into_iter().map(|i| Some(Exec::default().with_isa(i))).collect();
        hows.push(None);
        for how in hows {
            let go = |fused: bool| {
                let s = &f.s;
                let mut cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(SEED), s.shape);
                let mut q = vec![bf16::ZERO; f.m * s.q_dim];
                let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
                let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
                let args = QkvFp8Args::new(&f.x, &offs, &f.w, s.k, f.scales(), s.q_dim)
                    .maybe_bias(f.bias.as_deref())
                    .maybe_rope(fused.then_some(rope));
                match how {
                    Some(e) => fast::qkv_fp8_ragged(&args, &mut q, &mut kv, e).unwrap(),
                    None => reference::qkv_fp8_ragged(&args, &mut q, &mut kv, Accumulation::Exact).unwrap(),
                }
                if !fused {
                    let qp = q.clone();
                    let r = RopeRaggedArgs::new(&qp, &offs, (s.q_dim / hd, hd), &freqs, rd, interleaved);
                    match how {
                        Some(e) => fast::rope_ragged(&r, &mut q, &mut kv, math, e).unwrap(),
                        None => reference::rope_ragged(&r, &mut q, &mut kv, math).unwrap(),
                    }
                }
                (
                    q.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    cache.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                )
            };
            assert_eq!(go(true), go(false), "gran {gran} case {case} {how:?}");
        }
    }
}

/// Small enough for Miri (`cargo +nightly miri test --test fast miri_`, about a minute): the FP8
/// W8A8 path with 128-block scales (unit-scale operands, two spans, the epilogue's steps)
/// sequential and on a `Workers` team (the parallel scatter; rayon's is `miri_sized_parallel_call`),
/// the same bits, within the bound of the true sum.
#[test]
fn miri_sized_fp8_call() {
    let mut rng = Rng::new(91);
    let mut cfg = random_cfg(&mut rng, true);
    (cfg.k, cfg.hq, cfg.hkv, cfg.hd, cfg.mla, cfg.bias, cfg.page) = (130, 1, 1, 16, None, true, 2);
    cfg.lens = vec![1, 0, 1];
    cfg.cache_lengths = vec![1, 0, 3];
    let s: Plain<f32> = setup(&mut rng, &cfg);
    let m = s.rows.len();
    let f = Fp8 {
        x: s.x.iter().map(|&v| e4m3_from_f32(v * 64.0)).collect(),
        w: s.w.iter().map(|&v| e4m3_from_f32(v * 64.0)).collect(),
        m,
        gran: 2,
        input: (0..2 * m).map(|_| scale(&mut rng)).collect(),
        weight: (0..2).map(|_| scale(&mut rng)).collect(),
        bias: s.bias.as_ref().map(|b| b.iter().map(|&v| bf16::from_f32(v)).collect()),
        s,
    };
    let seq_run = run::<bf16, bf16>(&f, How::Fast(Exec::sequential()));
    check_bound(&f, &seq_run);
    let seq = bits(&seq_run);
    let team = Exec::on(paged_qkv::Workers::shared(2).unwrap());
    assert_eq!(seq, bits(&run::<bf16, bf16>(&f, How::Fast(team))), "workers");
}
