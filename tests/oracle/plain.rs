//! The bf16/f16/f32 fused QKV oracles (padded BSHD and ragged with bias) against independent
//! exact sums, MAX's CPU order (an f32 FMA chain), MAX's bias rounding, and the valid-length rule.

use crate::common::*;
use paged_qkv::reference::{qkv_bshd, qkv_ragged};
use paged_qkv::{
    Accumulation, CacheShape, Element, KvWrite, PageTable, PagedKvCache, QkvBshdArgs, QkvRaggedArgs, bf16, f16,
};

/// Random bf16-representable values with no magnitude below 2^-30, so that every product is an
/// integer multiple of 2^-100.
fn values<T: Element>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| {
            let x = bf16::from_f32(rng.normal()).to_f32();
            T::from_f32(if x.abs() < 2f32.powi(-30) { 0.0 } else { x })
        })
        .collect()
}

/// Σ x·w (+ bias) exactly, as S · 2^-100.
fn exact_dot<T: Element>(x: &[T], w: &[T], bias: Option<T>) -> i128 {
    let scaled = |v: f64| -> i128 {
        let s = v * 2f64.powi(100);
        assert_eq!(s.fract(), 0.0);
        s as i128
    };
    let mut s: i128 = x.iter().zip(w).map(|(a, b)| scaled(a.to_f32() as f64 * b.to_f32() as f64)).sum();
    if let Some(b) = bias {
        s += scaled(b.to_f32() as f64);
    }
    s
}

struct Bshd {
    batch: usize,
    seq: usize,
    k: usize,
    hq: usize,
    hkv: usize,
    hd: usize,
    valid: Vec<u32>,
    cache_lengths: Vec<u32>,
    page: usize,
}

fn check_bshd<T: Element, O: Element, C: Element>(rng: &mut Rng, c: &Bshd, mode: Accumulation) {
    let q_dim = c.hq * c.hd;
    let n = q_dim + 2 * c.hkv * c.hd;
    let x: Vec<T> = values(rng, c.batch * c.seq * c.k);
    let w: Vec<T> = values(rng, n * c.k);
    let shape = CacheShape::mha(64, 2, c.page, c.hkv, c.hd).unwrap();
    let new: Vec<usize> = c.valid.iter().map(|&v| v as usize).collect();
    let pg = pages(rng, &c.cache_lengths, &new, c.page, 64);
    let mut cache: PagedKvCache<C> = random_cache(rng, shape);
    let before = cache.data().to_vec();
    let mut out = vec![O::from_f32(-9.0); c.batch * c.seq * q_dim];
    let args = QkvBshdArgs::new(&x, (c.batch, c.seq, c.k), &w, &c.valid, q_dim);
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap(), 1);
    qkv_bshd(&args, &mut out, &mut kv, mode).unwrap();
    let mut written = Vec::new();
    for b in 0..c.batch {
        for t in 0..c.seq {
            let r = b * c.seq + t;
            let xr = &x[r * c.k..(r + 1) * c.k];
            for j in 0..n {
                let wr = &w[j * c.k..(j + 1) * c.k];
                let (want_o, want_c): (O, C) = match mode {
                    Accumulation::Exact => {
                        let s = exact_dot(xr, wr, None);
                        (
                            O::from_f64(round_scaled(s, -100, prec::<O>())),
                            C::from_f64(round_scaled(s, -100, prec::<C>())),
                        )
                    }
                    Accumulation::Sequential => {
                        // MAX's CPU matmul: acc = fma(x[k], w[k], acc) for k in order.
                        let mut acc = 0f32;
                        for (a, bb) in xr.iter().zip(wr) {
                            acc = a.to_f32().mul_add(bb.to_f32(), acc);
                        }
                        (O::from_f32(acc), C::from_f32(acc))
                    }
                };
                if j < q_dim {
                    // Q is written for every (b, t), padding included.
                    assert_eq!(out[r * q_dim + j].to_bits(), want_o.to_bits(), "Q ({b},{t},{j})");
                } else if t < c.valid[b] as usize {
                    let pos = c.cache_lengths[b] as usize + t;
                    let block = pg.lookup[b * pg.cols + pos / c.page] as usize;
                    let jj = j - q_dim;
                    let kvw = c.hkv * c.hd;
                    let (sel, h, d) =
                        if jj < kvw { (0, jj / c.hd, jj % c.hd) } else { (1, (jj - kvw) / c.hd, (jj - kvw) % c.hd) };
                    written.push(((block, sel, 1, pos % c.page, h, d), want_c));
                }
            }
        }
    }
    assert_cache_writes(shape, &before, cache.data(), &written);
}

#[test]
fn bshd_small_cases_with_padding() {
    let mut rng = Rng::new(20);
    let c =
        Bshd { batch: 2, seq: 3, k: 8, hq: 1, hkv: 1, hd: 4, valid: vec![3, 1], cache_lengths: vec![0, 6], page: 4 };
    check_bshd::<bf16, bf16, bf16>(&mut rng, &c, Accumulation::Exact);
    check_bshd::<f16, f32, f16>(&mut rng, &c, Accumulation::Exact);
    check_bshd::<f32, f32, f32>(&mut rng, &c, Accumulation::Sequential);
    check_bshd::<bf16, bf16, bf16>(&mut rng, &c, Accumulation::Sequential);
    let c = Bshd {
        batch: 3,
        seq: 5,
        k: 40,
        hq: 4,
        hkv: 2,
        hd: 8,
        valid: vec![0, 5, 2],
        cache_lengths: vec![3, 1, 30],
        page: 3,
    };
    check_bshd::<bf16, bf16, f32>(&mut rng, &c, Accumulation::Exact);
    check_bshd::<f32, bf16, bf16>(&mut rng, &c, Accumulation::Sequential);
}

#[test]
fn bshd_real_model_shapes() {
    let mut rng = Rng::new(21);
    let qwen = Bshd {
        batch: 2,
        seq: 2,
        k: 896,
        hq: 14,
        hkv: 2,
        hd: 64,
        valid: vec![2, 1],
        cache_lengths: vec![0, 129],
        page: 128,
    };
    check_bshd::<bf16, bf16, bf16>(&mut rng, &qwen, Accumulation::Exact);
    let llama = Bshd {
        batch: 1,
        seq: 2,
        k: 4096,
        hq: 32,
        hkv: 8,
        hd: 128,
        valid: vec![2],
        cache_lengths: vec![127],
        page: 128,
    };
    check_bshd::<bf16, bf16, bf16>(&mut rng, &llama, Accumulation::Exact);
}

#[test]
fn ragged_with_bias() {
    let mut rng = Rng::new(22);
    let (k, hq, hkv, hd, page) = (24, 2, 1, 8, 4);
    let q_dim = hq * hd;
    let n = q_dim + 2 * hkv * hd;
    let lens = [2usize, 0, 3];
    let cl = [1u32, 0, 7];
    let m: usize = lens.iter().sum();
    let x: Vec<f32> = values(&mut rng, m * k);
    let w: Vec<f32> = values(&mut rng, n * k);
    let bias: Vec<f32> = values(&mut rng, n);
    let shape = CacheShape::mha(32, 1, page, hkv, hd).unwrap();
    let pg = pages(&mut rng, &cl, &lens, page, 32);
    let offs = offsets(&lens);
    for with_bias in [false, true] {
        let mut cache: PagedKvCache<f32> = random_cache(&mut rng, shape);
        let before = cache.data().to_vec();
        let mut out = vec![0f32; m * q_dim];
        let args = QkvRaggedArgs::new(&x, &offs, &w, k, q_dim).maybe_bias(with_bias.then_some(&bias[..]));
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap(), 0);
        qkv_ragged(&args, &mut out, &mut kv, Accumulation::Exact).unwrap();
        let mut written = Vec::new();
        let mut row = 0;
        for (b, &l) in lens.iter().enumerate() {
            for t in 0..l {
                for j in 0..n {
                    // MAX's bias step: the product rounded to f32, the bias added, the sum rounded.
                    let s = exact_dot(&x[row * k..(row + 1) * k], &w[j * k..(j + 1) * k], None);
                    let product = round_scaled(s, -100, 24) as f32;
                    let want = if with_bias { product + bias[j] } else { product };
                    if j < q_dim {
                        assert_eq!(out[row * q_dim + j], want);
                    } else {
                        let pos = cl[b] as usize + t;
                        let block = pg.lookup[b * pg.cols + pos / page] as usize;
                        let jj = j - q_dim;
                        let (sel, h, d) = if jj < hd { (0, 0, jj) } else { (1, 0, jj - hd) };
                        written.push(((block, sel, 0, pos % page, h, d), want));
                    }
                }
                row += 1;
            }
        }
        assert_cache_writes(shape, &before, cache.data(), &written);
    }
}

/// MAX's bias step in a narrow dtype: the product rounded to bf16 (or f16), the bias added and the
/// sum rounded again — checked against an independent exact sum, in both modes; an E4M3 cache
/// rounds product + bias once (the crate's FP8 rule).
fn check_bias_rounding<O: Element, C: Element>(mode: Accumulation) {
    let mut rng = Rng::new(23);
    let (k, hq, hkv, hd, page) = (40, 2, 1, 8, 4);
    let q_dim = hq * hd;
    let n = q_dim + 2 * hkv * hd;
    let lens = [3usize, 2];
    let cl = [5u32, 0];
    let m: usize = lens.iter().sum();
    let x: Vec<bf16> = values(&mut rng, m * k);
    let w: Vec<bf16> = values(&mut rng, n * k);
    let bias: Vec<bf16> = values(&mut rng, n);
    let shape = CacheShape::mha(32, 1, page, hkv, hd).unwrap();
    let pg = pages(&mut rng, &cl, &lens, page, 32);
    let offs = offsets(&lens);
    let mut cache: PagedKvCache<C> = random_cache(&mut rng, shape);
    let before = cache.data().to_vec();
    let mut out = vec![O::from_f32(0.0); m * q_dim];
    let args = QkvRaggedArgs::new(&x, &offs, &w, k, q_dim).with_bias(&bias);
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap(), 0);
    qkv_ragged(&args, &mut out, &mut kv, mode).unwrap();
    // bf16 products are exact in f32, so Sequential's FMA chain is the multiply-then-add chain:
    // its product is the f32 sum in order; Exact's the exact sum.
    let product = |row: usize, j: usize, with_bias: bool| -> f64 {
        let (xr, wr) = (&x[row * k..(row + 1) * k], &w[j * k..(j + 1) * k]);
        match mode {
            Accumulation::Exact => {
                let s = exact_dot(xr, wr, with_bias.then_some(bias[j]));
                round_scaled(s, -100, 53)
            }
            Accumulation::Sequential => {
                let mut acc = 0f32;
                for (a, b) in xr.iter().zip(wr) {
                    acc += a.to_f32() * b.to_f32();
                }
                (if with_bias { acc + bias[j].to_f32() } else { acc }) as f64
            }
        }
    };
    fn step<D: Element>(p: f64, b: f32, summed: f64) -> D {
        if D::DTYPE == paged_qkv::DType::F8E4M3 {
            return D::from_f64(summed);
        }
        D::from_f32(D::from_f64(p).to_f32() + b)
    }
    let mut written = Vec::new();
    let mut row = 0;
    for (b, &l) in lens.iter().enumerate() {
        for t in 0..l {
            for j in 0..n {
                let (p, summed) = (product(row, j, false), product(row, j, true));
                if j < q_dim {
                    let want: O = step(p, bias[j].to_f32(), summed);
                    assert_eq!(out[row * q_dim + j].to_bits(), want.to_bits(), "{mode:?} Q ({row}, {j})");
                } else {
                    let want: C = step(p, bias[j].to_f32(), summed);
                    let pos = cl[b] as usize + t;
                    let block = pg.lookup[b * pg.cols + pos / page] as usize;
                    let jj = j - q_dim;
                    let (sel, h, d) = if jj < hd { (0, 0, jj) } else { (1, 0, jj - hd) };
                    written.push(((block, sel, 0, pos % page, h, d), want));
                }
            }
            row += 1;
        }
    }
    assert_cache_writes(shape, &before, cache.data(), &written);
}

#[test]
fn bias_rounds_like_max() {
    for mode in [Accumulation::Exact, Accumulation::Sequential] {
        check_bias_rounding::<bf16, bf16>(mode);
        check_bias_rounding::<f16, f16>(mode);
        check_bias_rounding::<bf16, paged_qkv::E4M3>(mode);
        check_bias_rounding::<f32, f32>(mode);
    }
}

/// MAX's CPU f32 matmul is an FMA chain: on f32 data `Sequential` differs from the
/// multiply-then-add chain somewhere (else the two orders would not be told apart here).
#[test]
fn sequential_f32_is_an_fma_chain() {
    let mut rng = Rng::new(24);
    let k = 64;
    let (q_dim, n) = (8, 16);
    let x: Vec<f32> = (0..k).map(|_| rng.normal()).collect();
    let w: Vec<f32> = (0..n * k).map(|_| rng.normal()).collect();
    let shape = CacheShape::mha(4, 1, 4, 1, 4).unwrap();
    let mut cache: PagedKvCache<f32> = PagedKvCache::zeros(shape);
    let mut out = vec![0f32; q_dim];
    let args = QkvRaggedArgs::new(&x, &[0, 1], &w, k, q_dim);
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[0], 1, &[0]).unwrap(), 0);
    qkv_ragged(&args, &mut out, &mut kv, Accumulation::Sequential).unwrap();
    let mut differs = 0;
    for (j, &o) in out.iter().enumerate() {
        let (mut fma, mut mul_add) = (0f32, 0f32);
        for (a, b) in x.iter().zip(&w[j * k..(j + 1) * k]) {
            fma = a.mul_add(*b, fma);
            mul_add += a * b;
        }
        assert_eq!(o.to_bits(), fma.to_bits(), "column {j}");
        differs += (fma != mul_add) as usize;
    }
    assert!(differs > 0, "no column tells the orders apart");
}
