//! Fast RoPE (padded and ragged), fused RoPE in the QKV epilogue, and the fast KV stores: bit for
//! bit against the oracle on every ISA, both pairings, both math modes, partial rotary, position
//! ids, MLA head sizes, page boundaries, positions at the end of the table; fused equals unfused;
//! bad input is an error with nothing written.

use crate::common::*;
use crate::fp4_setup::{Config, setup as fp4_setup};
use crate::plain::{Cfg, Values, setup as plain_setup};
use paged_qkv::fast::{self, PackedWeights, QkvFp4PackedArgs, QkvRaggedPackedArgs};
use paged_qkv::ops::{Freqs, QkvRope};
use paged_qkv::{
    BlockFormat, CacheShape, Element, Error, Exec, Isa, KvSel, KvStoreBshdArgs, KvStoreRaggedArgs, KvWrite,
    PackedPlainWeights, PageTable, PagedKvCache, Par, QkvBshdArgs, RopeBshdArgs, RopeMath, RopeRaggedArgs, bf16, f16,
    reference,
};

fn execs() -> Vec<Exec> {
    Isa::available()
        .into_iter()
        .flat_map(|isa| {
            [Par::Sequential, Par::Rayon, Par::Workers(paged_qkv::Workers::shared(3).unwrap())]
                .map(|par| Exec { par, isa: Some(isa) })
        })
        .collect()
}

/// A table of `rows` positions of `dim` values as `F`.
fn freqs<F: Element>(rows: usize, dim: usize) -> Vec<F> {
    paged_qkv::freqs_cis(rows, dim, 10000.0).into_iter().map(F::from_f32).collect()
}

struct Ragged {
    lens: Vec<usize>,
    cache_lengths: Vec<u32>,
    hq: usize,
    dq: usize,
    hkv: usize,
    dk: usize,
    rd: usize,
    page: usize,
    mla: bool,
    ids: bool,
}

/// Fast (every ISA) and reference `rope_ragged`, compared bit for bit on the output and the
/// whole cache; run twice (rotating twice).
fn check_ragged<T: Element, F: paged_qkv::FreqsElement, C: Element>(rng: &mut Rng, c: &Ragged) {
    check_ragged_values::<T, F, C>(rng, c, &|rng| rng.normal(), None)
}

/// [`check_ragged`] with Q values drawn by `value`, and the cache's too when `cache_value` is given
/// (else a random finite cache).
fn check_ragged_values<T: Element, F: paged_qkv::FreqsElement, C: Element>(
    rng: &mut Rng,
    c: &Ragged,
    value: &dyn Fn(&mut Rng) -> f32,
    cache_value: Option<&dyn Fn(&mut Rng) -> f32>,
) {
    let m: usize = c.lens.iter().sum();
    let shape = if c.mla {
        CacheShape::mla(64, 2, c.page, 1, c.dk).unwrap()
    } else {
        CacheShape::mha(64, 2, c.page, c.hkv, c.dk).unwrap()
    };
    let pg = pages(rng, &c.cache_lengths, &c.lens, c.page, 64);
    let max_pos = c.lens.iter().zip(&c.cache_lengths).map(|(&l, &s)| s as usize + l).max().unwrap_or(0);
    // The table ends exactly at the last position used (positions near the end of the table).
    // Position ids: stretches going up by one (a server's ids are the cache positions or an
    // offset of them, which the fast path takes in runs), broken by random ids.
    let ids: Option<Vec<u32>> = c.ids.then(|| {
        let n = max_pos.max(1);
        let mut prev: Option<usize> = None;
        (0..m)
            .map(|_| {
                let id = match prev {
                    Some(p) if p + 1 < n && rng.below(4) != 0 => p + 1,
                    _ => rng.below(n),
                };
                prev = Some(id);
                id as u32
            })
            .collect()
    });
    let rows = max_pos.max(1);
    let f: Vec<F> = freqs(rows, c.rd);
    let q: Vec<T> = (0..m * c.hq * c.dq).map(|_| T::from_f32(value(rng))).collect();
    let offs = offsets(&c.lens);
    let layer = rng.below(2);
    for interleaved in [false, true] {
        for math in [RopeMath::F32, RopeMath::MaxCompat] {
            let args =
                RopeRaggedArgs::new(&q, &offs, (c.hq, c.dq), &f, c.rd, interleaved).maybe_position_ids(ids.as_deref());
            let run = |e: Option<Exec>| -> (Vec<u32>, Vec<u32>) {
                let mut cache: PagedKvCache<C> = match cache_value {
                    Some(v) => {
                        let mut r = Rng::new(5);
                        PagedKvCache::from_vec(shape, (0..shape.len()).map(|_| C::from_f32(v(&mut r))).collect())
                            .unwrap()
                    }
                    None => random_cache(&mut Rng::new(5), shape),
                };
                let mut out = vec![T::from_f32(-3.0); q.len()];
                for _ in 0..2 {
                    let table = PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap();
                    let mut kv = KvWrite::new(cache.view_mut(), table, layer);
                    match e {
                        Some(e) => fast::rope_ragged(&args, &mut out, &mut kv, math, e).unwrap(),
                        None => reference::rope_ragged(&args, &mut out, &mut kv, math).unwrap(),
                    }
                }
                // NaN sign and payload are outside the bit-exact promise (inf − inf can arise
                // here): every NaN compares as one value.
                fn canon<E: Element>(x: &[E]) -> Vec<u32> {
                    x.iter().map(|v| if v.to_f32().is_nan() { u32::MAX } else { v.to_bits() }).collect()
                }
                (canon(&out), canon(cache.data()))
            };
            let want = run(None);
            for e in execs() {
                let got = run(Some(e));
                if got != want {
                    let diff = |g: &[u32], w: &[u32]| g.iter().zip(w).position(|(a, b)| a != b);
                    let (o, k) = (diff(&got.0, &want.0), diff(&got.1, &want.1));
                    let show = |v: &[u32], i: Option<usize>| i.map(|i| format!("{i}: {:#x}", v[i]));
                    panic!(
                        "{e:?} interleaved {interleaved} {math:?}: output {:?} want {:?}; cache {:?} want {:?}",
                        show(&got.0, o),
                        show(&want.0, o),
                        show(&got.1, k),
                        show(&want.1, k)
                    );
                }
            }
        }
    }
}

#[test]
fn rope_ragged_every_isa_bit_for_bit() {
    let mut rng = Rng::new(70);
    for case in 0..12 {
        let dk = [8, 16, 64, 128, 24][rng.below(5)];
        let mla = case % 4 == 3;
        let dq = if mla { dk / 2 + 8 } else { dk };
        let rd = 2 * rng.range(1, dq.min(dk) / 2);
        let c = Ragged {
            lens: (0..rng.range(1, 3)).map(|_| rng.range(0, 9)).collect(),
            cache_lengths: vec![0; 3].into_iter().map(|_| rng.range(0, 20) as u32).collect(),
            hq: rng.range(1, 3),
            dq,
            hkv: rng.range(1, 2),
            dk,
            rd,
            page: [1, 4, 16][rng.below(3)],
            mla,
            ids: case % 3 == 1,
        };
        let c = Ragged { cache_lengths: c.cache_lengths[..c.lens.len()].to_vec(), ..c };
        match case % 4 {
            0 => check_ragged::<bf16, bf16, bf16>(&mut rng, &c),
            1 => check_ragged::<bf16, f32, bf16>(&mut rng, &c),
            2 => check_ragged::<f16, f16, f32>(&mut rng, &c),
            _ => check_ragged::<f32, f32, f16>(&mut rng, &c),
        }
    }
}

/// Two sequences of `lens` new tokens after `cache_lengths`, `hq` Q heads and 2 KV heads of `dk`
/// dims (`rd` rotary), pages of 4, no MLA or position ids.
fn two_sequences(dk: usize, rd: usize, hq: usize, lens: [usize; 2], cache_lengths: [u32; 2]) -> Ragged {
    Ragged {
        lens: lens.to_vec(),
        cache_lengths: cache_lengths.to_vec(),
        hq,
        dq: dk,
        hkv: 2,
        dk,
        rd,
        page: 4,
        mla: false,
        ids: false,
    }
}

/// Whole-head and wide partial rotary (the vector paths: 32-element bf16 steps, 16-lane steps and
/// scalar tails), every element type, Q and cache of the same or different types, both pairings
/// and math modes, against the oracle; with position ids, runs of rows cut where an id breaks.
#[test]
fn rope_wide_heads_every_isa_bit_for_bit() {
    let mut rng = Rng::new(72);
    for (dk, rd) in [(64, 64), (128, 128), (128, 96), (96, 96), (128, 80), (160, 160)] {
        let c = two_sequences(dk, rd, 2, [3, 1], [5, 0]);
        // Position ids over longer sequences: runs of rows crossing pages of 4, cut where an id
        // does not follow its row's predecessor.
        let ids = Ragged {
            lens: vec![11, 6],
            cache_lengths: vec![2, 7],
            ids: true,
            ..two_sequences(dk, rd, 2, [0, 0], [0, 0])
        };
        check_ragged::<bf16, bf16, bf16>(&mut rng, &ids);
        check_ragged::<f32, f32, f32>(&mut rng, &ids);
        check_ragged::<bf16, bf16, bf16>(&mut rng, &c);
        check_ragged::<bf16, f32, bf16>(&mut rng, &c);
        check_ragged::<f16, f16, f16>(&mut rng, &c);
        check_ragged::<f32, f32, f32>(&mut rng, &c);
        // Q and cache of different types (each set on its own kernel).
        check_ragged::<bf16, f32, f16>(&mut rng, &c);
        check_ragged::<f16, f16, f32>(&mut rng, &c);
        check_ragged::<f32, f32, bf16>(&mut rng, &c);
    }
}

/// Values at the edges of the f32 range in Q and in the cache: zeros of both signs, subnormals
/// (whose rotations are subnormal or zero, where a narrowing that flushes subnormals would
/// differ), the smallest
/// normals, the largest finite values (rotations overflow to infinity), infinities, mixed with
/// ordinary values so that one vector holds both kinds. Every ISA equals the oracle bit for bit.
#[test]
fn rope_extreme_values_every_isa_bit_for_bit() {
    let value = |rng: &mut Rng| -> f32 {
        let sign = if rng.below(2) == 0 { 1.0 } else { -1.0 };
        sign * match rng.below(12) {
            0 => 0.0,
            1 => f32::from_bits(rng.range(1, 0x7F_FFFF) as u32), // f32 subnormal
            2 => f32::from_bits(rng.range(0x1_0000, 0x7F_FFFF) as u32), // a bf16 subnormal
            3 => f32::MIN_POSITIVE * (1.0 + rng.f32().abs()),
            4 => f32::MAX * (0.9 + 0.1 * rng.f32().abs()),
            5 => f32::INFINITY,
            6 => 65504.0 * (1.0 + rng.f32().abs()),
            _ => rng.normal(),
        }
    };
    let mut rng = Rng::new(74);
    for (dk, rd) in [(64, 64), (128, 128), (128, 96)] {
        let c = two_sequences(dk, rd, 3, [9, 4], [3, 0]);
        check_ragged_values::<bf16, f32, bf16>(&mut rng, &c, &value, Some(&value));
        check_ragged_values::<bf16, bf16, bf16>(&mut rng, &c, &value, Some(&value));
        check_ragged_values::<f16, f16, f16>(&mut rng, &c, &value, Some(&value));
        check_ragged_values::<f32, f32, f32>(&mut rng, &c, &value, Some(&value));
        check_ragged_values::<bf16, f32, f16>(&mut rng, &c, &value, Some(&value));
    }
}

/// Negative subnormals alone: at position 0 (cos 1, sin 0) a Q or K value passes through the
/// rotation unchanged, so a negative bf16 subnormal there is the only value in its vector that a
/// flushing conversion (`vcvtne2ps2bf16`) turns into a ±0 word — here −0, with no +0 word
/// anywhere in the token (no zeros among the inputs). Every ISA equals the oracle bit for bit.
/// (A check of the conversion's results that caught only +0 passed the extreme-values test,
/// whose tokens also hold +0 words.)
#[test]
fn rope_negative_subnormals_alone_every_isa_bit_for_bit() {
    let value = |rng: &mut Rng| -> f32 {
        match rng.below(24) {
            0 => -f32::from_bits(rng.range(0x1_0000, 0x7F_FFFF) as u32), // a negative bf16 subnormal
            _ => {
                let v = rng.normal();
                if v.abs() < 1e-3 { 1.0 } else { v }
            }
        }
    };
    let mut rng = Rng::new(76);
    for (dk, rd) in [(64, 64), (128, 128)] {
        let c = two_sequences(dk, rd, 3, [3, 2], [0, 0]);
        check_ragged_values::<bf16, f32, bf16>(&mut rng, &c, &value, Some(&value));
        check_ragged_values::<bf16, bf16, bf16>(&mut rng, &c, &value, Some(&value));
    }
}

/// The output placed at chosen distances past `q` (one allocation): 0, 16 and 48 bytes modulo
/// 4 KiB (where a `memcpy` of the row falls off glibc's `rep movsb` cliff on AMD: the f32 path
/// once copied there, and took a separate branch at those distances), 64 and 2 KiB; at every one
/// every ISA equals the oracle bit for bit, also at the rows' partial-rotary dims the one pass
/// copies.
#[test]
fn rope_output_near_q_every_isa_bit_for_bit() {
    fn check<T: Element>(rng: &mut Rng) {
        let (lens, hq, d, page) = ([3usize, 2], 3, 128, 4);
        let m: usize = lens.iter().sum();
        let n = m * hq * d;
        let shape = CacheShape::mha(16, 1, page, 1, d).unwrap();
        let pg = pages(rng, &[1, 6], &lens, page, 16);
        let offs = offsets(&lens);
        let q: Vec<T> = (0..n).map(|_| T::from_f32(rng.normal())).collect();
        for gap in [0usize, 16, 48, 64, 2048] {
            let size = size_of::<T>();
            for (interleaved, rd) in [(false, 128), (false, 96), (true, 96)] {
                let f: Vec<f32> = freqs(8, rd);
                let run = |e: Option<Exec>| -> (Vec<u32>, Vec<u32>) {
                    // q at the start of `buf`, the output `gap` bytes past it modulo 4 KiB.
                    let pad = (gap + 4096 - (n * size) % 4096) % 4096 / size;
                    let mut buf = q.clone();
                    buf.resize(2 * n + pad, T::from_f32(-3.0));
                    let (qs, rest) = buf.split_at_mut(n);
                    let out = &mut rest[pad..];
                    assert_eq!((out.as_ptr() as usize - qs.as_ptr() as usize) % 4096, gap);
                    let args = RopeRaggedArgs::new(qs, &offs, (hq, d), &f, rd, interleaved);
                    let mut cache: PagedKvCache<T> = random_cache(&mut Rng::new(5), shape);
                    let table = PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap();
                    let mut kv = KvWrite::new(cache.view_mut(), table, 0);
                    match e {
                        Some(e) => fast::rope_ragged(&args, out, &mut kv, RopeMath::F32, e).unwrap(),
                        None => reference::rope_ragged(&args, out, &mut kv, RopeMath::F32).unwrap(),
                    }
                    (bits(out), bits(cache.data()))
                };
                let want = run(None);
                for e in execs() {
                    assert_eq!(run(Some(e)), want, "{e:?} gap {gap} interleaved {interleaved} rd {rd}");
                }
            }
        }
    }
    let mut rng = Rng::new(73);
    check::<f32>(&mut rng);
    check::<bf16>(&mut rng);
}

/// f32 freqs holding NaNs whose payload fills the low 16 bits (and an infinity): rounding such a
/// NaN to bf16 like a number would carry into the sign (`0x7FFF_FFFF` → −0) or the exponent. Every
/// ISA must give NaN where the oracle does (sign and payload are not promised) and equal bits
/// elsewhere, on the vector paths (whole 128-dim heads) of both pairings, also in vectors that
/// hold a zero result.
#[test]
fn rope_nan_payload_freqs_stay_nan() {
    let canon =
        |x: &[bf16]| -> Vec<u32> { x.iter().map(|v| if v.is_nan() { u32::MAX } else { v.to_bits() as u32 }).collect() };
    let (hq, hkv, d, tokens) = (2, 2, 128, 3);
    let mut f = paged_qkv::freqs_cis(tokens, d, 10000.0);
    for (i, bits) in [0x7FFF_FFFFu32, 0xFFFF_FFFF, 0x7F80_0001, 0x7FC0_FFFF, 0x7F80_0000].into_iter().enumerate() {
        f[d + 2 * (7 * i) + (i % 2)] = f32::from_bits(bits); // token 1: some c, some s
        f[2 * d + 2 * (40 + 3 * i) + 1 - (i % 2)] = f32::from_bits(bits); // token 2
    }
    let mut rng = Rng::new(74);
    let mut q: Vec<bf16> = (0..tokens * hq * d).map(|_| bf16::from_f32(rng.normal())).collect();
    // Zeros in the vectors the NaNs land in (pair 3 of each head: elements 3 and 67 half-split,
    // 6 and 7 interleaved), so that a ±0 result sends them through the kernels' slower join
    // (`join_bf16_cvt`'s fallback) too.
    for h in 0..tokens * hq {
        for e in [3, 67, 6, 7] {
            q[h * d + e] = bf16::ZERO;
        }
    }
    let shape = CacheShape::mha(4, 1, 4, hkv, d).unwrap();
    let offs = [0, tokens as u32];
    for interleaved in [false, true] {
        let args = RopeRaggedArgs::new(&q, &offs, (hq, d), &f, d, interleaved);
        let run = |e: Option<Exec>| {
            let mut cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(5), shape);
            let mut out = vec![bf16::from_f32(-3.0); q.len()];
            let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[2, 3], 2, &[0]).unwrap(), 0);
            match e {
                Some(e) => fast::rope_ragged(&args, &mut out, &mut kv, RopeMath::F32, e).unwrap(),
                None => reference::rope_ragged(&args, &mut out, &mut kv, RopeMath::F32).unwrap(),
            }
            (canon(&out), canon(cache.data()))
        };
        let want = run(None);
        assert!(want.0.iter().filter(|&&b| b == u32::MAX).count() >= 10 * hq, "the NaNs reach the output");
        for e in execs() {
            assert_eq!(run(Some(e)), want, "{e:?} interleaved {interleaved}");
        }
    }
}

/// Padded RoPE: every ISA bit for bit, padded rows of `output` untouched, valid lengths 0/1/full,
/// freqs of q's dtype (MAX's) or another.
#[test]
fn rope_bshd_every_isa_bit_for_bit() {
    let mut rng = Rng::new(71);
    for case in 0..10 {
        let (batch, seq, hq, hkv, d, page) = (3, 5, rng.range(1, 3), rng.range(1, 2), [8, 32, 128][case % 3], 4);
        let valid: Vec<u32> = (0..batch).map(|b| [0, 1, seq as u32][(b + case) % 3]).collect();
        let lens: Vec<u32> = (0..batch).map(|_| rng.range(0, 9) as u32).collect();
        let new: Vec<usize> = valid.iter().map(|&v| v as usize).collect();
        let pg = pages(&mut rng, &lens, &new, page, 64);
        let max_pos = lens.iter().zip(&valid).map(|(&l, &v)| (l + v) as usize).max().unwrap().max(1);
        let shape = CacheShape::mha(64, 1, page, hkv, d).unwrap();
        macro_rules! go {
            ($t:ty, $f:ty) => {{
                let q: Vec<$t> = (0..batch * seq * hq * d).map(|_| <$t>::from_f32(rng.normal())).collect();
                let f: Vec<$f> = freqs(max_pos, d);
                for (interleaved, math) in [(true, RopeMath::F32), (false, RopeMath::MaxCompat), (false, RopeMath::F32)]
                {
                    let args = RopeBshdArgs::new(&q, (batch, seq, hq), &f, &valid, interleaved);
                    let run = |e: Option<Exec>| {
                        let mut cache: PagedKvCache<$t> = random_cache(&mut Rng::new(6), shape);
                        let mut out = vec![<$t>::from_f32(-3.0); q.len()];
                        let table = PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap();
                        let mut kv = KvWrite::new(cache.view_mut(), table, 0);
                        match e {
                            Some(e) => fast::rope_bshd(&args, &mut out, &mut kv, math, e).unwrap(),
                            None => reference::rope_bshd(&args, &mut out, &mut kv, math).unwrap(),
                        }
                        (bits(&out), bits(cache.data()))
                    };
                    let want = run(None);
                    // Padded rows keep the buffer's contents.
                    for b in 0..batch {
                        for s in valid[b] as usize..seq {
                            let row = &want.0[(b * seq + s) * hq * d..(b * seq + s + 1) * hq * d];
                            assert!(row.iter().all(|&x| x == Element::to_bits(<$t>::from_f32(-3.0))));
                        }
                    }
                    for e in execs() {
                        assert_eq!(run(Some(e)), want, "{e:?} {} freqs {}", stringify!($t), stringify!($f));
                    }
                }
            }};
        }
        // q's dtype, and (MAX's) the same for freqs, or another one.
        match case % 5 {
            0 => go!(bf16, bf16),
            1 => go!(f16, f16),
            2 => go!(f32, f32),
            3 => go!(bf16, f32),
            _ => go!(f32, bf16),
        }
    }
}

/// The fused QKV + RoPE equals the QKV followed by the standalone RoPE, bit for bit, for FP4
/// (ragged) and bf16 (ragged and BSHD), on every ISA and in both math modes; and the oracle's
/// fused form equals its unfused form.
#[test]
fn fused_rope_equals_qkv_then_rope() {
    let mut rng = Rng::new(72);
    for case in 0..6 {
        let (hd, rd) = [(16, 16), (32, 8), (64, 64)][case % 3];
        let interleaved = case % 2 == 0;
        let math = if case % 4 < 2 { RopeMath::F32 } else { RopeMath::MaxCompat };
        // FP4, ragged, with position ids in odd cases.
        let c = Config {
            format: [BlockFormat::Nvfp4, BlockFormat::Mxfp4, BlockFormat::Mxfp8][case % 3],
            k: 64,
            lens: vec![3, 0, 5],
            cache_lengths: vec![2, 0, 9],
            hq: 2,
            hkv: 1,
            hd,
            page: 4,
            layers: 1,
            mla_width: None,
        };
        let s = fp4_setup(&mut rng, &c);
        let m = s.rows.len();
        let f: Vec<bf16> = freqs(32, rd);
        let ids: Option<Vec<u32>> = (case % 2 == 1).then(|| (0..m).map(|i| (i * 3 % 31) as u32).collect());
        let rope =
            QkvRope::new(Freqs::Bf16(&f), hd, rd, interleaved).maybe_position_ids(ids.as_deref()).with_math(math);
        let pw = PackedWeights::new(s.w.as_ref());
        for e in execs() {
            let run = |fused: bool| {
                let mut cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(3), s.shape);
                let mut q = vec![bf16::ZERO; m * s.q_dim];
                let table = PageTable::new(&s.pages.lookup, s.pages.cols, &s.pages.cache_lengths).unwrap();
                let mut kv = KvWrite::new(cache.view_mut(), table, s.layer);
                let args =
                    QkvFp4PackedArgs::new(s.a.as_ref(), &s.offsets, &pw, s.q_dim).maybe_rope(fused.then_some(rope));
                fast::qkv_fp4_ragged_packed(&args, &mut q, &mut kv, e).unwrap();
                if !fused {
                    let qp = q.clone();
                    let r = RopeRaggedArgs::new(&qp, &s.offsets, (s.q_dim / hd, hd), &f, rd, interleaved)
                        .maybe_position_ids(ids.as_deref());
                    fast::rope_ragged(&r, &mut q, &mut kv, math, e).unwrap();
                }
                (bits(&q), bits(cache.data()))
            };
            assert_eq!(run(true), run(false), "fp4 {e:?} case {case}");
        }

        // bf16, ragged with bias and BSHD with padding.
        for ragged in [true, false] {
            let pc = Cfg {
                ragged,
                k: 48,
                lens: vec![4, 1, 0],
                seq: 4,
                cache_lengths: vec![3, 0, 7],
                hq: 2,
                hkv: 2,
                hd,
                page: 4,
                mla: None,
                bias: ragged,
                values: Values::Normal,
            };
            let ps = plain_setup::<bf16>(&mut rng, &pc);
            let rd = if ragged { rd } else { hd };
            let f: Vec<f32> = freqs(16, rd);
            let rope = QkvRope::new(Freqs::F32(&f), hd, rd, interleaved).with_math(math);
            let pw = PackedPlainWeights::new(&ps.w, ps.k).unwrap();
            let mut all = vec![None];
            all.extend(execs().into_iter().map(Some));
            for e in all {
                let run = |fused: bool| {
                    let mut cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(4), ps.shape);
                    let mut q = vec![bf16::from_f32(9.0); ps.rows.len() * ps.q_dim];
                    let table = PageTable::new(&ps.pages.lookup, ps.pages.cols, &ps.pages.cache_lengths).unwrap();
                    let mut kv = KvWrite::new(cache.view_mut(), table, ps.layer);
                    let r = fused.then_some(rope);
                    match (&ps.offsets, e) {
                        (Some(offs), Some(e)) => {
                            let a = QkvRaggedPackedArgs::new(&ps.x, offs, &pw, ps.q_dim)
                                .maybe_bias(ps.bias.as_deref())
                                .maybe_rope(r);
                            fast::qkv_ragged_packed(&a, &mut q, &mut kv, e).unwrap();
                        }
                        (None, e) => {
                            let a = QkvBshdArgs::new(&ps.x, (ps.batch, ps.seq, ps.k), &ps.w, &ps.valid, ps.q_dim)
                                .maybe_rope(r);
                            match e {
                                Some(e) => fast::qkv_bshd(&a, &mut q, &mut kv, e).unwrap(),
                                None => {
                                    reference::qkv_bshd(&a, &mut q, &mut kv, paged_qkv::Accumulation::Exact).unwrap()
                                }
                            }
                        }
                        (Some(offs), None) => {
                            let a = paged_qkv::QkvRaggedArgs::new(&ps.x, offs, &ps.w, ps.k, ps.q_dim)
                                .maybe_bias(ps.bias.as_deref())
                                .maybe_rope(r);
                            reference::qkv_ragged(&a, &mut q, &mut kv, paged_qkv::Accumulation::Exact).unwrap();
                        }
                    }
                    if !fused {
                        let qp = q.clone();
                        let ex = e.unwrap_or(Exec::sequential().with_isa(Isa::Scalar));
                        match &ps.offsets {
                            Some(offs) => {
                                let a = RopeRaggedArgs::new(&qp, offs, (ps.q_dim / hd, hd), &f, rd, interleaved);
                                match e {
                                    Some(_) => fast::rope_ragged(&a, &mut q, &mut kv, math, ex).unwrap(),
                                    None => reference::rope_ragged(&a, &mut q, &mut kv, math).unwrap(),
                                }
                            }
                            None => {
                                // rope_bshd's freqs are the q dtype: the same table as bf16 would
                                // round it, so use an f32 table through rope_ragged semantics on
                                // the valid rows instead: rotate each valid row as its own
                                // one-token sequence.
                                for (i, &(b, t, w)) in ps.rows.iter().enumerate() {
                                    if !w {
                                        continue;
                                    }
                                    let cols = ps.pages.cols;
                                    let lens = [ps.pages.cache_lengths[b] + t as u32];
                                    let table = PageTable::new(&ps.pages.lookup[b * cols..(b + 1) * cols], cols, &lens)
                                        .unwrap();
                                    let mut kv1 = KvWrite::new(kv.cache.reborrow(), table, ps.layer);
                                    let row = &qp[i * ps.q_dim..(i + 1) * ps.q_dim];
                                    let a = RopeRaggedArgs::new(row, &[0, 1], (ps.q_dim / hd, hd), &f, rd, interleaved);
                                    let o = &mut q[i * ps.q_dim..(i + 1) * ps.q_dim];
                                    match e {
                                        Some(_) => fast::rope_ragged(&a, o, &mut kv1, math, ex).unwrap(),
                                        None => reference::rope_ragged(&a, o, &mut kv1, math).unwrap(),
                                    }
                                }
                            }
                        }
                    }
                    (bits(&q), bits(cache.data()))
                };
                assert_eq!(run(true), run(false), "bf16 ragged {ragged} {e:?} case {case}");
            }
        }
    }
}

/// Bad RoPE input is the same error from the oracle and the fast path, fused or not, with
/// nothing written.
#[test]
fn rope_errors_write_nothing() {
    let shape = CacheShape::mha(8, 1, 4, 1, 8).unwrap();
    let (lookup, lens) = ([0u32, 1, 2, 3], [0u32, 5]);
    let q = vec![bf16::ONE; 3 * 2 * 8];
    let f: Vec<bf16> = freqs(6, 8);
    let cases: [(&str, RopeRaggedArgs<'_, bf16>); 3] = [
        // Sequence 1 has 2 tokens at positions 5 and 6: the table has rows 0..6.
        ("freqs too short", RopeRaggedArgs::new(&q, &[0, 1, 3], (2, 8), &f, 8, true)),
        ("odd rope_dim", RopeRaggedArgs::new(&q, &[0, 1, 3], (2, 8), &f[..35], 7, false)),
        (
            "position id out of range",
            RopeRaggedArgs::new(&q, &[0, 1, 3], (2, 8), &f, 8, false).with_position_ids(&[0, 1, 6]),
        ),
    ];
    for (what, args) in cases {
        let mut errs = Vec::new();
        for e in [None].into_iter().chain(execs().into_iter().map(Some)) {
            let mut cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(8), shape);
            let before = bits(cache.data());
            let mut out = vec![bf16::from_f32(7.0); q.len()];
            let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&lookup, 2, &lens).unwrap(), 0);
            let err = match e {
                Some(e) => fast::rope_ragged(&args, &mut out, &mut kv, RopeMath::F32, e),
                None => reference::rope_ragged(&args, &mut out, &mut kv, RopeMath::F32),
            }
            .expect_err(what);
            assert_eq!(bits(cache.data()), before, "{what}");
            assert!(out.iter().all(|&v| v == bf16::from_f32(7.0)), "{what}");
            errs.push(err);
        }
        assert!(errs.windows(2).all(|w| w[0] == w[1]), "{what}: {errs:?}");
        match what {
            "odd rope_dim" => assert!(matches!(errs[0], Error::InvalidDim { arg: "rope_dim", .. })),
            _ => assert!(matches!(errs[0], Error::FreqsRows { .. }), "{what}: {:?}", errs[0]),
        }
    }
    // The same through a fused QKV: the QKV part is valid, the RoPE is not; nothing written.
    let w = vec![bf16::from_f32(0.5); 32 * 4];
    let x = vec![bf16::ONE; 3 * 4];
    let rope = QkvRope::new(Freqs::Bf16(&f), 8, 8, true).with_position_ids(&[0, 1, 9]).with_math(RopeMath::F32);
    for e in [None].into_iter().chain(execs().into_iter().map(Some)) {
        let mut cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(8), shape);
        let before = bits(cache.data());
        let mut out = vec![bf16::from_f32(7.0); 3 * 16];
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&lookup, 2, &lens).unwrap(), 0);
        let args = paged_qkv::QkvRaggedArgs::new(&x, &[0, 1, 3], &w, 4, 16).with_rope(rope);
        let err = match e {
            Some(e) => fast::qkv_ragged(&args, &mut out, &mut kv, e),
            None => reference::qkv_ragged(&args, &mut out, &mut kv, paged_qkv::Accumulation::Exact),
        }
        .expect_err("position id 9 is past the table");
        assert!(matches!(err, Error::FreqsRows { position: 9, rows: 6 }), "{err:?}");
        assert_eq!(bits(cache.data()), before);
        assert!(out.iter().all(|&v| v == bf16::from_f32(7.0)));
    }
    // Fused RoPE on an MLA cache with two KV heads (found by `fuzz/fast_paths`): the QKV writes
    // K head 0 only, the standalone RoPE would rotate both heads, so the fast path and the oracle
    // disagreed on head 1's stale contents. Now both reject it, writing nothing.
    let mla = CacheShape::mla(4, 2, 2, 2, 2).unwrap();
    let f2: Vec<f32> = paged_qkv::freqs_cis(8, 2, 100.0);
    let w2 = vec![bf16::from_f32(0.5); 4 * 3];
    for e in [None].into_iter().chain(execs().into_iter().map(Some)) {
        let mut cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(9), mla);
        let before = bits(cache.data());
        let mut out = vec![bf16::from_f32(7.0); 2];
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[0, 2], 2, &[1]).unwrap(), 0);
        let args = paged_qkv::QkvRaggedArgs::new(&[bf16::ONE; 3], &[0, 1], &w2, 3, 2)
            .with_rope(QkvRope::new(Freqs::F32(&f2), 2, 2, true).with_math(RopeMath::MaxCompat));
        let err = match e {
            Some(e) => fast::qkv_ragged(&args, &mut out, &mut kv, e),
            None => reference::qkv_ragged(&args, &mut out, &mut kv, paged_qkv::Accumulation::Exact),
        }
        .expect_err("fused RoPE on a two-head MLA cache");
        assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
        assert_eq!(bits(cache.data()), before);
        assert!(out.iter().all(|&v| v == bf16::from_f32(7.0)));
    }
}

/// One KV store into a fresh cache of `shape` (random values, the same for every call) by the fast
/// path with `e` or by the oracle (`None`): ragged (`vals` in rows `offs`), or padded (`padded`,
/// `batch × seq_len` rows, `valid` lengths); the cache's bits after it.
#[allow(clippy::too_many_arguments)]
fn kv_store_bits<T: Element, C: Element>(
    e: Option<Exec>,
    shape: CacheShape,
    pg: &Pages,
    which: KvSel,
    ragged: (&[T], &[u32]),
    padded: (&[T], usize, usize, &[u32]),
    use_ragged: bool,
) -> Vec<u32> {
    let mut cache: PagedKvCache<C> = random_cache(&mut Rng::new(2), shape);
    let table = PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, 1);
    if use_ragged {
        let a = KvStoreRaggedArgs::new(ragged.0, ragged.1, which);
        match e {
            Some(e) => fast::kv_store_ragged(&a, &mut kv, e).unwrap(),
            None => reference::kv_store_ragged(&a, &mut kv).unwrap(),
        }
    } else {
        let (values, batch, seq_len, valid_lengths) = padded;
        let a = KvStoreBshdArgs::new(values, (batch, seq_len), valid_lengths, which);
        match e {
            Some(e) => fast::kv_store_bshd(&a, &mut kv, e).unwrap(),
            None => reference::kv_store_bshd(&a, &mut kv).unwrap(),
        }
    }
    bits(cache.data())
}

/// The fast KV stores equal the oracle's bit for bit (every ISA, K and V, ragged and padded,
/// every cache dtype from bf16 values, and f16 values into the 16-bit and f32 caches).
#[test]
fn kv_stores_every_isa() {
    let mut rng = Rng::new(73);
    let shape = CacheShape::mha(64, 2, 4, 2, 16).unwrap();
    let lens = [3usize, 0, 9];
    let cl = [1u32, 0, 6];
    let pg = pages(&mut rng, &cl, &lens, 4, 64);
    let m: usize = lens.iter().sum();
    let normal = |rng: &mut Rng, n: usize| (0..n).map(|_| rng.normal() * 300.0).collect::<Vec<f32>>();
    let (vals, padded) = (normal(&mut rng, m * 32), normal(&mut rng, 3 * 9 * 32));
    let offs = offsets(&lens);
    macro_rules! go {
        ($v:ty, $c:ty) => {
            let vals: Vec<$v> = vals.iter().map(|&x| <$v>::from_f32(x)).collect();
            let padded: Vec<$v> = padded.iter().map(|&x| <$v>::from_f32(x)).collect();
            for which in [KvSel::K, KvSel::V] {
                let run = |e: Option<Exec>, ragged: bool| {
                    let padded = (&padded[..], 3, 9, &[3, 0, 9][..]);
                    kv_store_bits::<$v, $c>(e, shape, &pg, which, (&vals, &offs), padded, ragged)
                };
                for ragged in [true, false] {
                    let want = run(None, ragged);
                    for e in execs() {
                        assert_eq!(run(Some(e), ragged), want, "{e:?} {which:?} {}", stringify!($v -> $c));
                    }
                }
            }
        };
    }
    go!(bf16, bf16);
    go!(bf16, f16);
    go!(bf16, f32);
    go!(bf16, paged_qkv::E4M3);
    go!(f16, f16);
    go!(f16, bf16);
    go!(f16, f32);
}

/// Sequences whose written pages share a block (each writing its own slots of it: valid, no
/// conflict) take the fast path's full validation instead of its per-sequence slots; RoPE and the
/// KV stores, ragged and padded, still equal the oracle on every ISA. Two writes to one slot are
/// a conflict with nothing written.
#[test]
fn rope_and_kv_store_shared_blocks_every_isa() {
    let mut rng = Rng::new(75);
    let shape = CacheShape::mha(8, 1, 4, 2, 16).unwrap();
    // Sequence 0 writes positions 0..2 (slots 0, 1 of block 5); sequence 1, cache length 2,
    // writes positions 2..7: slots 2, 3 of block 5 (its page 0) and then block 3. Padded: 6 rows
    // per sequence, the first 2 and 6 valid.
    let (lens, lookup) = ([2usize, 6], [5u32, 0, 5, 3]);
    let offs = offsets(&lens);
    let valid = lens.map(|l| l as u32);
    // Rows of 3 Q heads of 16 (48 values) and of 32 K or V values; 12 padded rows, 8 ragged.
    let q: Vec<bf16> = (0..12 * 48).map(|_| bf16::from_f32(rng.normal())).collect();
    let vals: Vec<bf16> = (0..12 * 32).map(|_| bf16::from_f32(rng.normal())).collect();
    let (f, fb): (Vec<f32>, Vec<bf16>) = (freqs(16, 16), freqs(16, 16));
    let run = |e: Option<Exec>, cache_lengths: &[u32], padded: bool| -> paged_qkv::Result<(Vec<u32>, Vec<u32>)> {
        let mut cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(2), shape);
        let m = if padded { 12 } else { 8 };
        let (q, vals) = (&q[..m * 48], &vals[..m * 32]);
        let mut out = vec![bf16::from_f32(-3.0); q.len()];
        let table = PageTable::new(&lookup, 2, cache_lengths).unwrap();
        let ragged = RopeRaggedArgs::new(q, &offs, (3, 16), &f, 16, false);
        let bshd = RopeBshdArgs::new(q, (2, 6, 3), &fb, &valid, false);
        let store = KvStoreRaggedArgs::new(vals, &offs, KvSel::V);
        let store_bshd = KvStoreBshdArgs::new(vals, (2, 6), &valid, KvSel::V);
        let mut kv = KvWrite::new(cache.view_mut(), table, 0);
        let r = match (e, padded) {
            (Some(e), false) => fast::kv_store_ragged(&store, &mut kv, e)
                .and_then(|_| fast::rope_ragged(&ragged, &mut out, &mut kv, RopeMath::F32, e)),
            (None, false) => reference::kv_store_ragged(&store, &mut kv)
                .and_then(|_| reference::rope_ragged(&ragged, &mut out, &mut kv, RopeMath::F32)),
            (Some(e), true) => fast::kv_store_bshd(&store_bshd, &mut kv, e)
                .and_then(|_| fast::rope_bshd(&bshd, &mut out, &mut kv, RopeMath::F32, e)),
            (None, true) => reference::kv_store_bshd(&store_bshd, &mut kv)
                .and_then(|_| reference::rope_bshd(&bshd, &mut out, &mut kv, RopeMath::F32)),
        };
        let before = random_cache::<bf16>(&mut Rng::new(2), shape);
        if r.is_err() {
            // Nothing written.
            assert_eq!(bits(cache.data()), bits(before.data()));
            assert!(out.iter().all(|x| x.to_f32() == -3.0));
        }
        r.map(|_| (bits(&out), bits(cache.data())))
    };
    for padded in [false, true] {
        let want = run(None, &[0, 2], padded).unwrap();
        // Every valid row is rotated (sequence 0's first, at position 0, by angle 0).
        let rows: Vec<usize> = if padded { vec![0, 1, 6, 7, 8, 9, 10, 11] } else { (0..8).collect() };
        let rotated = |row: usize| want.0[row * 48..(row + 1) * 48] != bits(&q[row * 48..(row + 1) * 48]);
        assert!(rows[1..].iter().all(|&r| rotated(r)) && !rotated(0), "padded {padded}");
        for e in execs() {
            assert_eq!(run(Some(e), &[0, 2], padded).unwrap(), want, "{e:?} padded {padded}");
            // Sequence 1 from cache length 1: position 1 of block 5 is written twice.
            for got in [run(Some(e), &[0, 1], padded), run(None, &[0, 1], padded)] {
                let got = got.map(|_| "written");
                assert!(matches!(got, Err(Error::SlotConflict { .. })), "{e:?} padded {padded}: {got:?}");
            }
        }
    }
}

/// The fast KV stores of f32 values at the edges of the range into every cache dtype equal the
/// oracle's bit for bit on every ISA: zeros of both signs, f32 and bf16 subnormals, f16
/// subnormals and values that round to f16's largest finite or overflow it, halfway cases of
/// bf16 and f16 rounding, the largest finite f32, infinities, mixed with ordinary values in one
/// row of 40 (whole vectors and a tail). NaN compares as one value (payloads are outside the
/// promise).
#[test]
fn kv_stores_edge_values_every_isa() {
    let mut rng = Rng::new(77);
    let shape = CacheShape::mha(16, 1, 4, 2, 20).unwrap();
    let (lens, cl) = ([5usize, 3], [2u32, 0]);
    let pg = pages(&mut rng, &cl, &lens, 4, 16);
    let m: usize = lens.iter().sum();
    let edge = |rng: &mut Rng| -> f32 {
        let sign = if rng.below(2) == 0 { 1.0 } else { -1.0 };
        sign * match rng.below(14) {
            0 => 0.0,
            1 => f32::from_bits(rng.range(1, 0x7F_FFFF) as u32),
            2 => f32::from_bits(rng.range(0x1_0000, 0x7F_FFFF) as u32),
            3 => f32::from_bits(0x0001_8000 | (rng.below(2) as u32) << 16), // bf16 halfway, odd or even
            4 => f32::from_bits(0x3F80_8000 + ((rng.below(2) as u32) << 16)),
            5 => 2f32.powi(-24) * (0.5 + rng.below(4) as f32 * 0.5), // f16 subnormal halfway cases
            6 => 65504.0 + rng.below(3) as f32 * 16.0,               // f16 max, its halfway, overflow
            7 => f32::MAX,
            8 => f32::INFINITY,
            9 => f32::NAN,
            _ => rng.normal() * 100.0,
        }
    };
    let vals: Vec<f32> = (0..m * 40).map(|_| edge(&mut rng)).collect();
    let offs = offsets(&lens);
    macro_rules! go {
        ($c:ty) => {
            for which in [KvSel::K, KvSel::V] {
                let run = |e: Option<Exec>| {
                    let mut cache: PagedKvCache<$c> = random_cache(&mut Rng::new(2), shape);
                    let table = PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap();
                    let mut kv = KvWrite::new(cache.view_mut(), table, 0);
                    let a = KvStoreRaggedArgs::new(&vals, &offs, which);
                    match e {
                        Some(e) => fast::kv_store_ragged(&a, &mut kv, e).unwrap(),
                        None => reference::kv_store_ragged(&a, &mut kv).unwrap(),
                    }
                    let nan = cache.data().iter().map(|v| v.to_f32().is_nan());
                    bits(cache.data())
                        .into_iter()
                        .zip(nan)
                        .map(|(b, n)| if n { u32::MAX } else { b })
                        .collect::<Vec<_>>()
                };
                let want = run(None);
                for e in execs() {
                    assert_eq!(run(Some(e)), want, "{e:?} {which:?} {}", stringify!($c));
                }
            }
        };
    }
    go!(bf16);
    go!(f16);
    go!(f32);
    go!(paged_qkv::E4M3);
}

/// KV stores into a cache of the values' own type (the fast path copies, quieting NaNs, instead of
/// converting through f32) equal the oracle bit for bit on every ISA, NaN payloads and signalling
/// NaNs included (the oracle's `from_f32(to_f32(v))` sets a 16-bit NaN's quiet bit and keeps its
/// payload; f32 is kept as it is): zeros of both signs, subnormals, the largest finite values,
/// infinities, NaNs of every kind, ordinary values; rows of 40 values (whole vectors and a tail)
/// in runs of consecutive slots that cross pages of 4, ragged and padded, K and V.
#[test]
fn kv_stores_same_type_exact_bits_every_isa() {
    fn check<T: Element>(rng: &mut Rng, special: &[u32], random_bits: u32) {
        let shape = CacheShape::mha(32, 2, 4, 2, 20).unwrap();
        let (lens, cl) = ([7usize, 0, 10], [2u32, 0, 3]);
        let pg = pages(rng, &cl, &lens, 4, 32);
        let m: usize = lens.iter().sum();
        let value = |rng: &mut Rng| -> T {
            if rng.below(3) == 0 {
                T::from_bits(special[rng.below(special.len())])
            } else {
                T::from_bits(rng.below(random_bits as usize + 1) as u32)
            }
        };
        let vals: Vec<T> = (0..m * 40).map(|_| value(rng)).collect();
        let padded: Vec<T> = (0..3 * 10 * 40).map(|_| value(rng)).collect();
        let offs = offsets(&lens);
        for which in [KvSel::K, KvSel::V] {
            for ragged in [true, false] {
                let run = |e: Option<Exec>| {
                    let padded = (&padded[..], 3, 10, &[7, 0, 10][..]);
                    kv_store_bits::<T, T>(e, shape, &pg, which, (&vals, &offs), padded, ragged)
                };
                let want = run(None);
                for e in execs() {
                    assert_eq!(run(Some(e)), want, "{e:?} {which:?} ragged {ragged} {}", T::DTYPE.name());
                }
            }
        }
    }
    let mut rng = Rng::new(78);
    // bf16: ±0, subnormals, the largest finite, ±infinity, signalling and quiet NaNs with payloads.
    let bf16_special =
        [0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7F81, 0xFFBF, 0x7FC0, 0xFFFF, 0x7FA5];
    check::<bf16>(&mut rng, &bf16_special, 0xFFFF);
    let f16_special =
        [0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7C01, 0xFDFF, 0x7E00, 0xFFFF, 0x7D2A];
    check::<f16>(&mut rng, &f16_special, 0xFFFF);
    let f32_special = [
        0,
        0x8000_0000,
        1,
        0x807F_FFFF,
        0x7F7F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0xFFBF_FFFF,
        0x7FC0_0000,
        0xFFFF_FFFF,
    ];
    check::<f32>(&mut rng, &f32_special, u32::MAX);
}

/// A KV store followed by a RoPE on the same cache, ragged or padded (bf16 values and Q).
enum StoreThenRope<'a> {
    Ragged(KvStoreRaggedArgs<'a, bf16>, RopeRaggedArgs<'a, bf16>),
    Bshd(KvStoreBshdArgs<'a, bf16>, RopeBshdArgs<'a, bf16>),
}

impl StoreThenRope<'_> {
    /// Runs both (`F32` math) by the fast path with `e`, or by the oracle (`None`), into a fresh
    /// copy of `cache`, and returns the RoPE output's and the cache's bits.
    fn run(
        &self,
        e: Option<Exec>,
        cache: &PagedKvCache<bf16>,
        table: PageTable<'_>,
        out_len: usize,
        fill: bf16,
    ) -> (Vec<u32>, Vec<u32>) {
        let mut cache = cache.clone();
        let mut out = vec![fill; out_len];
        let mut kv = KvWrite::new(cache.view_mut(), table, 0);
        let m = RopeMath::F32;
        match (self, e) {
            (StoreThenRope::Ragged(st, _), Some(e)) => fast::kv_store_ragged(st, &mut kv, e),
            (StoreThenRope::Ragged(st, _), None) => reference::kv_store_ragged(st, &mut kv),
            (StoreThenRope::Bshd(st, _), Some(e)) => fast::kv_store_bshd(st, &mut kv, e),
            (StoreThenRope::Bshd(st, _), None) => reference::kv_store_bshd(st, &mut kv),
        }
        .unwrap();
        match (self, e) {
            (StoreThenRope::Ragged(_, r), Some(e)) => fast::rope_ragged(r, &mut out, &mut kv, m, e),
            (StoreThenRope::Ragged(_, r), None) => reference::rope_ragged(r, &mut out, &mut kv, m),
            (StoreThenRope::Bshd(_, r), Some(e)) => fast::rope_bshd(r, &mut out, &mut kv, m, e),
            (StoreThenRope::Bshd(_, r), None) => reference::rope_bshd(r, &mut out, &mut kv, m),
        }
        .unwrap();
        (bits(&out), bits(cache.data()))
    }
}

/// The parallel row split (one share per pool thread, balanced by rows with work) on pools of
/// 1, 2, 3 and 5 threads, with the padding of a BSHD batch concentrated in one end: the padded
/// RoPE and KV store equal the oracle bit for bit (padded rows untouched) whatever the shares.
/// The calls are large enough to be cut at all (a share moves at least the byte grain of
/// `kernels::rope`): 256 rows, the RoPE's of 12 416 bytes (at most 23 shares of 11 rows), the
/// KV store's of 8 KiB (at most 4 shares of 64 rows).
#[test]
fn rope_and_kv_store_thread_counts_and_skewed_padding() {
    let mut rng = Rng::new(79);
    let (batch, seq, hq, hkv, d, page) = (4, 64, 16, 32, 64, 16);
    let shape = CacheShape::mha(64, 1, page, hkv, d).unwrap();
    let q: Vec<bf16> = (0..batch * seq * hq * d).map(|_| bf16::from_f32(rng.normal())).collect();
    let values: Vec<bf16> = (0..batch * seq * hkv * d).map(|_| bf16::from_f32(rng.normal())).collect();
    let f: Vec<bf16> = freqs(80, d);
    for valid in [[64u32, 64, 0, 1], [0, 0, 3, 64], [64, 0, 0, 0], [1, 1, 1, 1]] {
        let lens: Vec<u32> = (0..batch).map(|_| rng.range(0, 9) as u32).collect();
        let new: Vec<usize> = valid.iter().map(|&v| v as usize).collect();
        let pg = pages(&mut rng, &lens, &new, page, 64);
        let (seq_len, valid_lengths) = (seq, &valid[..]);
        let args = RopeBshdArgs::new(&q, (batch, seq_len, hq), &f, valid_lengths, false);
        let store = KvStoreBshdArgs::new(&values, (batch, seq_len), valid_lengths, KvSel::V);
        let call = StoreThenRope::Bshd(store, args);
        let cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(8), shape);
        let table = PageTable::new(&pg.lookup, pg.cols, &pg.cache_lengths).unwrap();
        let run = |e: Option<Exec>| call.run(e, &cache, table, q.len(), bf16::from_f32(-3.0));
        let want = run(None);
        for threads in [1, 2, 3, 5] {
            for isa in [Isa::Scalar, Isa::best()] {
                let e = Exec { par: Par::Rayon, isa: Some(isa) };
                assert_eq!(crate::in_pool(threads, || run(Some(e))), want, "{valid:?} {threads} threads {isa:?}");
            }
        }
    }
}

/// Small enough for Miri (`cargo +nightly miri test --test fast miri_`): the standalone RoPE and
/// the KV store on two threads (rows reach their cache slots through raw pointers) against the
/// sequential run and the oracle, on a scrambled page table (slots out of row order).
#[test]
fn miri_rope_and_kv_store_parallel() {
    let (hq, hkv, d, m) = (1, 2, 8, 10);
    let shape = CacheShape::mha(8, 1, 2, hkv, d).unwrap();
    let freqs = paged_qkv::freqs_cis(16, d, 10000.0);
    let mut rng = Rng::new(76);
    let q: Vec<bf16> = (0..m * hq * d).map(|_| bf16::from_f32(rng.normal())).collect();
    let values: Vec<bf16> = (0..m * hkv * d).map(|_| bf16::from_f32(rng.normal())).collect();
    let offs = [0u32, 4, m as u32];
    let lookup = [5u32, 1, 7, 0, 3, 6, 2, 4]; // 2 sequences × 4 pages of 2
    let store = KvStoreRaggedArgs::new(&values, &offs, KvSel::K);
    let rope = RopeRaggedArgs::new(&q, &offs, (hq, d), &freqs, d, false);
    let call = StoreThenRope::Ragged(store, rope);
    let cache: PagedKvCache<bf16> = random_cache(&mut Rng::new(5), shape);
    let table = PageTable::new(&lookup, 4, &[1, 0]).unwrap();
    let run = |e: Option<Exec>| call.run(e, &cache, table, q.len(), bf16::ZERO);
    let want = run(None);
    assert_eq!(run(Some(Exec::sequential())), want);
    assert_eq!(crate::in_pool(2, || run(Some(Exec::default()))), want);
    assert_eq!(run(Some(Exec::on(paged_qkv::Workers::shared(2).unwrap()))), want);
}
