//! RoPE oracles (padded and ragged, partial rotary) and the KV store, against f64 rotations.

use crate::common::*;
use paged_qkv::reference::{kv_store_bshd, kv_store_ragged, rope_bshd, rope_ragged};
use paged_qkv::{
    CacheShape, KvSel, KvStoreBshdArgs, KvStoreRaggedArgs, KvWrite, PageTable, PagedKvCache, RopeBshdArgs, RopeMath,
    RopeRaggedArgs, bf16,
};

/// A freqs_cis table as MAX builds it: row p = cos(p θ_i), sin(p θ_i) interleaved, θ_i = theta^(−2i/d),
/// θ computed in f64 and cast to f32.
fn freqs(rows: usize, dim: usize, theta: f64) -> Vec<f32> {
    let mut f = Vec::with_capacity(rows * dim);
    for p in 0..rows {
        for i in 0..dim / 2 {
            let th = theta.powf(-2.0 * i as f64 / dim as f64) as f32;
            let a = p as f32 * th;
            f.push(a.cos());
            f.push(a.sin());
        }
    }
    f
}

/// (j0, j1) of pair i for a head of size `head`, rotary dims `rd`.
fn pair(i: usize, head: usize, rd: usize, interleaved: bool) -> (usize, usize) {
    if interleaved { (head - rd + 2 * i, head - rd + 2 * i + 1) } else { (i, i + rd / 2) }
}

fn close(got: f32, x0: f64, x1: f64, c: f64, s: f64, y: f64, ulp_bits: i32) {
    let bound =
        (x0 * c).abs().max((x1 * s).abs()).max((x0 * s).abs()).max((x1 * c).abs()) * 2f64.powi(-ulp_bits) * 2.0 + 1e-30;
    assert!((got as f64 - y).abs() <= bound, "got {got}, want {y} (bound {bound})");
}

/// Spec §J's golden configuration: batch 2, seq 3, cache lengths [0, 5], 2 Q and 2 KV heads,
/// head dim 8, a 32-row table with θ_i = 32^(−2i/8); f32; both pairings.
#[test]
fn golden_configuration_against_f64() {
    let (batch, seq, h, d, page) = (2, 3, 2, 8, 4);
    let table = freqs(32, d, 32.0);
    for interleaved in [true, false] {
        for valid in [vec![3u32, 3], vec![2, 0]] {
            let mut rng = Rng::new(30);
            let q: Vec<f32> = (0..batch * seq * h * d).map(|_| rng.f32()).collect();
            let shape = CacheShape::mha(16, 2, page, h, d).unwrap();
            let cl = [0u32, 5];
            let new: Vec<usize> = valid.iter().map(|&v| v as usize).collect();
            let pg = pages(&mut rng, &cl, &new, page, 16);
            let mut cache: PagedKvCache<f32> = random_cache(&mut rng, shape);
            let before = cache.data().to_vec();
            let mut out = vec![f32::from_bits(0x7FC0_1234); q.len()]; // sentinel NaN
            let args = RopeBshdArgs::new(&q, (batch, seq, h), &table, &valid, interleaved);
            let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &cl).unwrap(), 1);
            rope_bshd(&args, &mut out, &mut kv, RopeMath::F32).unwrap();
            let mut written = Vec::new();
            for b in 0..batch {
                for s in 0..seq {
                    let p = cl[b] as usize + s;
                    for hh in 0..h {
                        let base = ((b * seq + s) * h + hh) * d;
                        if s >= valid[b] as usize {
                            for j in 0..d {
                                assert_eq!(out[base + j].to_bits(), 0x7FC0_1234, "padded Q untouched");
                            }
                            continue;
                        }
                        let blk = pg.lookup[b * pg.cols + p / page] as usize;
                        for i in 0..d / 2 {
                            let (j0, j1) = pair(i, d, d, interleaved);
                            let (c, sn) = (table[p * d + 2 * i] as f64, table[p * d + 2 * i + 1] as f64);
                            let (x0, x1) = (q[base + j0] as f64, q[base + j1] as f64);
                            close(out[base + j0], x0, x1, c, sn, x0 * c - x1 * sn, 24);
                            close(out[base + j1], x0, x1, c, sn, x0 * sn + x1 * c, 24);
                            let k0 = before[shape.index(blk, 0, 1, p % page, hh, j0)] as f64;
                            let k1 = before[shape.index(blk, 0, 1, p % page, hh, j1)] as f64;
                            let g0 = cache_get(&kv, blk, p % page, hh, j0);
                            let g1 = cache_get(&kv, blk, p % page, hh, j1);
                            close(g0, k0, k1, c, sn, k0 * c - k1 * sn, 24);
                            close(g1, k0, k1, c, sn, k0 * sn + k1 * c, 24);
                            written.push(((blk, 0, 1, p % page, hh, j0), g0));
                            written.push(((blk, 0, 1, p % page, hh, j1), g1));
                        }
                    }
                }
            }
            // Only the new tokens' K of layer 1 changed.
            assert_cache_writes(shape, &before, cache.data(), &written);
        }
    }
}

fn cache_get(kv: &KvWrite<'_, f32>, blk: usize, slot: usize, h: usize, d: usize) -> f32 {
    let s = kv.cache.shape();
    kv.cache.data()[s.index(blk, 0, 1, slot, h, d)]
}

#[test]
fn max_compat_equals_f32_for_f32_and_follows_bf16_rounding() {
    let (batch, seq, h, d, page) = (1, 4, 2, 16, 2);
    let table32 = freqs(64, d, 10000.0);
    let mut rng = Rng::new(31);
    let cl = [3u32];
    let pg = pages(&mut rng, &cl, &[seq], page, 16);
    let shape = CacheShape::mha(16, 1, page, h, d).unwrap();
    // f32: MaxCompat is F32.
    let q: Vec<f32> = (0..batch * seq * h * d).map(|_| rng.normal()).collect();
    let cache0: PagedKvCache<f32> = random_cache(&mut rng, shape);
    let mut results = Vec::new();
    for math in [RopeMath::F32, RopeMath::MaxCompat] {
        let mut cache = cache0.clone();
        let mut out = vec![0f32; q.len()];
        let args = RopeBshdArgs::new(&q, (batch, seq, h), &table32, &[4], false);
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &cl).unwrap(), 0);
        rope_bshd(&args, &mut out, &mut kv, math).unwrap();
        results.push((bits(&out), bits(cache.data())));
    }
    assert_eq!(results[0], results[1]);

    // bf16: MaxCompat rounds every step to bf16 (spec §H); F32 rounds once. Both near the truth.
    let qb: Vec<bf16> = q.iter().map(|&x| bf16::from_f32(x)).collect();
    let tb: Vec<bf16> = table32.iter().map(|&x| bf16::from_f32(x)).collect();
    let cacheb: PagedKvCache<bf16> = random_cache(&mut rng, shape);
    for math in [RopeMath::F32, RopeMath::MaxCompat] {
        let mut cache = cacheb.clone();
        let mut out = vec![bf16::ZERO; qb.len()];
        let args = RopeBshdArgs::new(&qb, (batch, seq, h), &tb, &[4], true);
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &cl).unwrap(), 0);
        rope_bshd(&args, &mut out, &mut kv, math).unwrap();
        for s in 0..seq {
            let p = 3 + s;
            for hh in 0..h {
                let base = (s * h + hh) * d;
                for i in 0..d / 2 {
                    let (c, sn) = (tb[p * d + 2 * i], tb[p * d + 2 * i + 1]);
                    let (x0, x1) = (qb[base + 2 * i], qb[base + 2 * i + 1]);
                    let (got0, got1) = (out[base + 2 * i], out[base + 2 * i + 1]);
                    let r = |v: f32| bf16::from_f32(v);
                    let (want0, want1) = match math {
                        RopeMath::MaxCompat => {
                            let t1 = r(x1.to_f32() * sn.to_f32());
                            let y0 = r(x0.to_f32().mul_add(c.to_f32(), -t1.to_f32()));
                            let t2 = r(x1.to_f32() * c.to_f32());
                            let y1 = r(x0.to_f32().mul_add(sn.to_f32(), t2.to_f32()));
                            (y0, y1)
                        }
                        RopeMath::F32 => {
                            let (x0, x1, c, sn) = (x0.to_f32(), x1.to_f32(), c.to_f32(), sn.to_f32());
                            (r(x0.mul_add(c, -(x1 * sn))), r(x0.mul_add(sn, x1 * c)))
                        }
                    };
                    assert_eq!((got0, got1), (want0, want1), "{math:?} s {s} h {hh} i {i}");
                    let (fx0, fx1, fc, fs) =
                        (x0.to_f32() as f64, x1.to_f32() as f64, c.to_f32() as f64, sn.to_f32() as f64);
                    let ulps = if math == RopeMath::F32 { 8 } else { 6 };
                    close(got0.to_f32(), fx0, fx1, fc, fs, fx0 * fc - fx1 * fs, ulps);
                    close(got1.to_f32(), fx0, fx1, fc, fs, fx0 * fs + fx1 * fc, ulps);
                }
            }
        }
    }
}

#[test]
fn calling_twice_rotates_twice() {
    let (seq, h, d, page) = (2, 1, 8, 4);
    let table = freqs(16, d, 10000.0);
    let double: Vec<f32> =
        (0..16).flat_map(|p| freqs(2 * 16, d, 10000.0)[2 * p * d..(2 * p + 1) * d].to_vec()).collect();
    let mut rng = Rng::new(32);
    let q: Vec<f32> = (0..seq * h * d).map(|_| rng.f32()).collect();
    let shape = CacheShape::mha(8, 1, page, h, d).unwrap();
    let cl = [1u32];
    let pg = pages(&mut rng, &cl, &[seq], page, 8);
    let cache0: PagedKvCache<f32> = random_cache(&mut rng, shape);
    let run = |table: &[f32], times: usize| {
        let mut cache = cache0.clone();
        for _ in 0..times {
            let mut out = vec![0f32; q.len()];
            let args = RopeBshdArgs::new(&q, (1, seq, h), table, &[2], true);
            let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &cl).unwrap(), 0);
            rope_bshd(&args, &mut out, &mut kv, RopeMath::F32).unwrap();
        }
        cache.into_vec()
    };
    let twice = run(&table, 2);
    let once_double = run(&double, 1);
    for (a, b) in twice.iter().zip(&once_double) {
        assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
    }
    assert_ne!(bits(&twice), bits(&run(&table, 1)));
}

#[test]
fn ragged_partial_rotary_and_position_ids() {
    let mut rng = Rng::new(33);
    let (hq, dq, dk, rd, page) = (2, 16, 24, 8, 4);
    let lens = [2usize, 1];
    let cl = [2u32, 0];
    let m = 3;
    let table = freqs(40, rd, 10000.0);
    let q: Vec<bf16> = (0..m * hq * dq).map(|_| bf16::from_f32(rng.f32())).collect();
    let shape = CacheShape::mla(8, 1, page, 1, dk).unwrap();
    let pg = pages(&mut rng, &cl, &lens, page, 8);
    let offs = offsets(&lens);
    for interleaved in [true, false] {
        for ids in [None, Some(vec![30u32, 7, 39])] {
            let mut cache: PagedKvCache<bf16> = random_cache(&mut rng, shape);
            let before = cache.data().to_vec();
            let mut out = vec![bf16::from_f32(5.0); q.len()];
            let args =
                RopeRaggedArgs::new(&q, &offs, (hq, dq), &table, rd, interleaved).maybe_position_ids(ids.as_deref());
            let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &cl).unwrap(), 0);
            rope_ragged(&args, &mut out, &mut kv, RopeMath::F32).unwrap();
            let rows = [(0usize, 0usize), (0, 1), (1, 0)];
            let mut written = Vec::new();
            for (r, &(b, t)) in rows.iter().enumerate() {
                let p = ids.as_ref().map_or(cl[b] as usize + t, |v| v[r] as usize);
                let rotated_q: Vec<usize> = (0..rd / 2)
                    .flat_map(|i| {
                        let (a, c) = pair(i, dq, rd, interleaved);
                        [a, c]
                    })
                    .collect();
                for hh in 0..hq {
                    let base = (r * hq + hh) * dq;
                    for j in 0..dq {
                        if !rotated_q.contains(&j) {
                            assert_eq!(out[base + j], q[base + j], "non-rotary dims pass through");
                        }
                    }
                    for i in 0..rd / 2 {
                        let (j0, j1) = pair(i, dq, rd, interleaved);
                        let (c, s) = (table[p * rd + 2 * i] as f64, table[p * rd + 2 * i + 1] as f64);
                        let (x0, x1) = (q[base + j0].to_f32() as f64, q[base + j1].to_f32() as f64);
                        close(out[base + j0].to_f32(), x0, x1, c, s, x0 * c - x1 * s, 8);
                        close(out[base + j1].to_f32(), x0, x1, c, s, x0 * s + x1 * c, 8);
                    }
                }
                let pos = cl[b] as usize + t; // K is stored at cache_length + t regardless of position_ids
                let blk = pg.lookup[b * pg.cols + pos / page] as usize;
                for i in 0..rd / 2 {
                    let (j0, j1) = pair(i, dk, rd, interleaved);
                    let (c, s) = (table[p * rd + 2 * i] as f64, table[p * rd + 2 * i + 1] as f64);
                    let k0 = before[shape.index(blk, 0, 0, pos % page, 0, j0)].to_f32() as f64;
                    let k1 = before[shape.index(blk, 0, 0, pos % page, 0, j1)].to_f32() as f64;
                    let g0 = kv.cache.data()[shape.index(blk, 0, 0, pos % page, 0, j0)];
                    let g1 = kv.cache.data()[shape.index(blk, 0, 0, pos % page, 0, j1)];
                    close(g0.to_f32(), k0, k1, c, s, k0 * c - k1 * s, 8);
                    close(g1.to_f32(), k0, k1, c, s, k0 * s + k1 * c, 8);
                    written.push(((blk, 0, 0, pos % page, 0, j0), g0));
                    written.push(((blk, 0, 0, pos % page, 0, j1), g1));
                }
            }
            assert_cache_writes(shape, &before, cache.data(), &written);
        }
    }
}

#[test]
fn kv_store_ragged_and_padded() {
    let mut rng = Rng::new(34);
    let (h, d, page) = (2, 4, 3);
    let shape = CacheShape::mha(16, 2, page, h, d).unwrap();
    let lens = [2usize, 0, 4];
    let cl = [1u32, 0, 2];
    let pg = pages(&mut rng, &cl, &lens, page, 16);
    let vals: Vec<f32> = (0..6 * h * d).map(|_| rng.normal()).collect();
    for which in [KvSel::K, KvSel::V] {
        let mut cache: PagedKvCache<bf16> = random_cache(&mut rng, shape);
        let before = cache.data().to_vec();
        let offs = offsets(&lens);
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &cl).unwrap(), 1);
        kv_store_ragged(&KvStoreRaggedArgs::new(&vals, &offs, which), &mut kv).unwrap();
        let mut written = Vec::new();
        let mut r = 0;
        for (b, &l) in lens.iter().enumerate() {
            for t in 0..l {
                let pos = cl[b] as usize + t;
                let blk = pg.lookup[b * pg.cols + pos / page] as usize;
                for hh in 0..h {
                    for dd in 0..d {
                        written.push((
                            (blk, which as usize, 1, pos % page, hh, dd),
                            bf16::from_f32(vals[(r * h + hh) * d + dd]),
                        ));
                    }
                }
                r += 1;
            }
        }
        assert_cache_writes(shape, &before, cache.data(), &written);
    }
    // Padded: [batch 3, seq 4], valid [2, 0, 4].
    let valid = [2u32, 0, 4];
    let vals: Vec<f32> = (0..3 * 4 * h * d).map(|_| rng.normal()).collect();
    let mut cache: PagedKvCache<f32> = random_cache(&mut rng, shape);
    let before = cache.data().to_vec();
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&pg.lookup, pg.cols, &cl).unwrap(), 0);
    kv_store_bshd(&KvStoreBshdArgs::new(&vals, (3, 4), &valid, KvSel::V), &mut kv).unwrap();
    let mut written = Vec::new();
    for b in 0..3 {
        for t in 0..valid[b] as usize {
            let pos = cl[b] as usize + t;
            let blk = pg.lookup[b * pg.cols + pos / page] as usize;
            for hh in 0..h {
                for dd in 0..d {
                    written.push(((blk, 1, 0, pos % page, hh, dd), vals[((b * 4 + t) * h + hh) * d + dd]));
                }
            }
        }
    }
    assert_cache_writes(shape, &before, cache.data(), &written);
}
