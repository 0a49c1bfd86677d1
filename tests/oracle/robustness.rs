//! Consistent calls of every entry point (oracle and fast), then one argument perturbed: never a
//! panic; the oracle and the fast path return the same result kind and the same error; an error
//! leaves output and cache unchanged; a success writes only the slots its tokens own (and the
//! output). The generator is checked to produce successes and failures both.

use crate::common::{Rng, bits, offsets, pages, random_cache};
use paged_qkv::fast;
use paged_qkv::formats::BlockFormat;
use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::reference::*;
use paged_qkv::*;
use proptest::prelude::*;
use std::collections::HashSet;

/// One generated call's plain data.
#[derive(Debug, Clone)]
struct Call {
    op: usize,
    lens: Vec<usize>,
    seq: usize,
    valid: Vec<u32>,
    cache_lengths: Vec<u32>,
    lookup: Vec<u32>,
    cols: usize,
    shape: CacheShape,
    layer: usize,
    hq: usize,
    k: usize,
    q_dim: usize,
    out_len: usize,
    x_len: usize,
    w_rows: usize,
    freq_rows: usize,
    rope_dim: usize,
    perturbation: Option<usize>,
}

fn generate(seed: u64) -> Call {
    let mut rng = Rng::new(seed);
    let op = rng.below(7);
    let batch = rng.range(1, 3);
    let (hkv, hd, page) = (rng.range(1, 2), 2 * rng.range(1, 4), rng.range(1, 4));
    let mla = rng.below(5) == 0 && !matches!(op, 2 | 3 | 6);
    let shape =
        if mla { CacheShape::mla(40, 2, page, 1, hd).unwrap() } else { CacheShape::mha(40, 2, page, hkv, hd).unwrap() };
    let seq = rng.range(1, 4);
    let bshd = matches!(op, 2 | 3 | 6);
    let lens: Vec<usize> = (0..batch).map(|_| if bshd { seq } else { rng.range(0, 4) }).collect();
    let valid: Vec<u32> = (0..batch).map(|_| rng.range(0, seq) as u32).collect();
    let cache_lengths: Vec<u32> = (0..batch).map(|_| rng.range(0, 6) as u32).collect();
    let new: Vec<usize> = if bshd { valid.iter().map(|&v| v as usize).collect() } else { lens.clone() };
    let pg = pages(&mut rng, &cache_lengths, &new, page, 40);
    let m: usize = lens.iter().sum();
    let hq = rng.range(1, 2);
    let q_dim = hq * hd;
    let kvw = if mla { hd } else { shape.kv_width() };
    let w_rows = if mla { q_dim + hd } else { q_dim + 2 * kvw };
    let k = 2 * rng.range(1, 20);
    let rope_dim = if op == 4 { 2 * rng.range(1, hd / 2) } else { hd };
    let max_pos = cache_lengths.iter().zip(&new).map(|(&c, &n)| c as usize + n).max().unwrap_or(0);
    let (out_len, x_len) = match op {
        0 | 1 => (m * q_dim, m * k),
        2 => (m * q_dim, m * k),
        3 => (m * hq * hd, m * hq * hd),
        4 => (m * hq * hd, m * hq * hd),
        5 => (0, m * kvw),
        _ => (0, m * kvw),
    };
    Call {
        op,
        lens,
        seq,
        valid,
        cache_lengths,
        lookup: pg.lookup,
        cols: pg.cols,
        shape,
        layer: rng.below(2),
        hq,
        k,
        q_dim,
        out_len,
        x_len,
        w_rows,
        freq_rows: max_pos + 1,
        rope_dim,
        perturbation: None,
    }
}

/// Breaks one argument (or none).
fn perturb(mut c: Call, which: usize, rng: &mut Rng) -> Call {
    c.perturbation = Some(which);
    match which {
        0 => c.out_len += 1 + rng.below(3),
        1 => c.x_len = c.x_len.saturating_sub(1),
        2 => c.layer = 2 + rng.below(3),
        3 => {
            let i = rng.below(c.lookup.len().max(1));
            if let Some(e) = c.lookup.get_mut(i) {
                *e = 40 + rng.below(5) as u32;
            }
        }
        4 => c.cache_lengths[0] = u32::MAX - rng.below(3) as u32,
        5 => c.lens.push(1), // offsets for one more sequence than the table has
        6 => c.freq_rows = c.freq_rows.saturating_sub(1 + rng.below(2)),
        7 => c.w_rows += 1 + rng.below(3),
        8 => c.valid[0] = c.seq as u32 + 1,
        9 => c.rope_dim += 1,
        10 => {
            // Two sequences share a page at the same position.
            if c.lookup.len() >= 2 * c.cols && c.cols > 0 {
                let first = c.lookup[..c.cols].to_vec();
                c.lookup[c.cols..2 * c.cols].copy_from_slice(&first);
                c.cache_lengths[1] = c.cache_lengths[0];
            }
        }
        _ => c.perturbation = None,
    }
    c
}

/// The cache elements a successful call may change: every element of the slots its tokens own.
fn allowed(c: &Call) -> HashSet<usize> {
    let mut set = HashSet::new();
    let p = c.shape.page_size();
    for (b, &cl) in c.cache_lengths.iter().enumerate() {
        let n = if matches!(c.op, 2 | 3 | 6) { c.valid.get(b).copied().unwrap_or(0) as usize } else { c.lens[b] };
        for t in 0..n {
            let pos = cl as usize + t;
            let Some(&block) = c.lookup.get(b * c.cols + pos / p) else { continue };
            for kv in 0..c.shape.kv_dim() {
                for h in 0..c.shape.num_kv_heads() {
                    for d in 0..c.shape.head_size() {
                        if (block as usize) < c.shape.num_blocks() {
                            set.insert(c.shape.index(block as usize, kv, c.layer.min(1), pos % p, h, d));
                        }
                    }
                }
            }
        }
    }
    set
}

/// Runs the call through the oracle (`exec` None) or the fast path; returns the result, the output
/// and the cache.
fn execute(c: &Call, exec: Option<Exec>) -> (Result<()>, Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut rng = Rng::new(9);
    let mut cache: PagedKvCache<bf16> = random_cache(&mut rng, c.shape);
    let before = bits(cache.data());
    let mut out = vec![bf16::from_f32(3.0); c.out_len];
    let offs = offsets(&c.lens);
    let x: Vec<bf16> = (0..c.x_len).map(|_| bf16::from_f32(rng.f32())).collect();
    let w: Vec<bf16> = (0..c.w_rows * c.k).map(|_| bf16::from_f32(rng.f32() / 4.0)).collect();
    let freqs: Vec<bf16> = freqs_cis(c.freq_rows, c.rope_dim, 100.0).into_iter().map(bf16::from_f32).collect();
    let freqs_f32 = freqs_cis(c.freq_rows, c.rope_dim, 100.0);
    let r = match PageTable::new(&c.lookup, c.cols, &c.cache_lengths) {
        Err(e) => Err(e),
        Ok(table) => {
            let mut kv = KvWrite::new(cache.view_mut(), table, c.layer);
            let e = exec.unwrap_or_default();
            let oracle = exec.is_none();
            match c.op {
                0 => {
                    let m = x.len() / c.k.max(1);
                    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                    let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
                    let a = quantize(BlockFormat::Nvfp4, &xf[..m * c.k], m, c.k, nvfp4_global_scale(amax(&xf)));
                    let wq = quantize(BlockFormat::Nvfp4, &wf, c.w_rows, c.k, 1.0);
                    match (a, wq) {
                        (Ok(a), Ok(wq)) => {
                            let args = QkvFp4Args::new(a.as_ref(), &offs, wq.as_ref(), c.q_dim).with_tensor_sf(0.5);
                            if oracle {
                                qkv_fp4_ragged(&args, &mut out, &mut kv, Accumulation::Exact)
                            } else {
                                fast::qkv_fp4_ragged(&args, &mut out, &mut kv, e)
                            }
                        }
                        (Err(e), _) | (_, Err(e)) => Err(e),
                    }
                }
                1 => {
                    let args = QkvRaggedArgs::new(&x, &offs, &w, c.k, c.q_dim);
                    if oracle {
                        qkv_ragged(&args, &mut out, &mut kv, Accumulation::Exact)
                    } else {
                        fast::qkv_ragged(&args, &mut out, &mut kv, e)
                    }
                }
                2 => {
                    let args = QkvBshdArgs::new(&x, (c.valid.len(), c.seq, c.k), &w, &c.valid, c.q_dim);
                    if oracle {
                        qkv_bshd(&args, &mut out, &mut kv, Accumulation::Exact)
                    } else {
                        fast::qkv_bshd(&args, &mut out, &mut kv, e)
                    }
                }
                3 => {
                    let args =
                        RopeBshdArgs::new(&x, (c.valid.len(), c.seq, c.hq), &freqs, &c.valid, c.k.is_multiple_of(4));
                    if oracle {
                        rope_bshd(&args, &mut out, &mut kv, RopeMath::MaxCompat)
                    } else {
                        fast::rope_bshd(&args, &mut out, &mut kv, RopeMath::MaxCompat, e)
                    }
                }
                4 => {
                    let args = RopeRaggedArgs::new(
                        &x,
                        &offs,
                        (c.hq, c.shape.head_size()),
                        &freqs_f32,
                        c.rope_dim,
                        c.k.is_multiple_of(4),
                    );
                    if oracle {
                        rope_ragged(&args, &mut out, &mut kv, RopeMath::F32)
                    } else {
                        fast::rope_ragged(&args, &mut out, &mut kv, RopeMath::F32, e)
                    }
                }
                5 => {
                    let args = KvStoreRaggedArgs::new(&x, &offs, KvSel::K);
                    if oracle { kv_store_ragged(&args, &mut kv) } else { fast::kv_store_ragged(&args, &mut kv, e) }
                }
                _ => {
                    let which = if c.shape.is_mla() { KvSel::K } else { KvSel::V };
                    let args = KvStoreBshdArgs::new(&x, (c.valid.len(), c.seq), &c.valid, which);
                    if oracle { kv_store_bshd(&args, &mut kv) } else { fast::kv_store_bshd(&args, &mut kv, e) }
                }
            }
        }
    };
    (r, bits(&out), bits(cache.data()), before)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn perturbed_calls_never_panic_and_write_only_their_slots(seed in any::<u64>(), which in 0usize..16) {
        let mut rng = Rng::new(seed ^ 0x5555);
        let c = perturb(generate(seed), which, &mut rng);
        let (r, out, cache, before) = execute(&c, None);
        match &r {
            Err(e) => {
                prop_assert_eq!(&cache, &before, "a failing oracle call changed the cache: {}", e);
                prop_assert!(out.iter().all(|&v| v == bf16::from_f32(3.0).to_bits() as u32));
                // The message names an argument (`like_this`) or a dimension.
                let msg = e.to_string();
                prop_assert!(msg.contains('`') || msg.contains("format") || msg.contains("ISA"), "{}", msg);
            }
            Ok(()) => {
                let ok = allowed(&c);
                for (i, (a, b)) in cache.iter().zip(&before).enumerate() {
                    prop_assert!(a == b || ok.contains(&i), "cache element {:?} outside the call's slots changed", c.shape.coords(i));
                }
            }
        }
        // The fast path: the same result, the same writes (RoPE and the stores bit for bit).
        for isa in Isa::available() {
            let (fr, fout, fcache, _) = execute(&c, Some(Exec::sequential().with_isa(isa)));
            prop_assert_eq!(&fr, &r, "{:?}", isa);
            if r.is_err() || c.op >= 3 {
                prop_assert_eq!(&fcache, &cache);
                prop_assert_eq!(&fout, &out);
            }
        }
    }
}

/// The generator is useful: unperturbed calls all succeed, perturbed ones often fail.
#[test]
fn the_generator_produces_successes_and_failures() {
    let (mut ok, mut err) = (0, 0);
    for seed in 0..300u64 {
        let c = generate(seed);
        assert!(execute(&c, None).0.is_ok(), "unperturbed call {c:?} failed: {:?}", execute(&c, None).0);
        let mut rng = Rng::new(seed);
        match execute(&perturb(c, (seed % 11) as usize, &mut rng), None).0 {
            Ok(()) => ok += 1,
            Err(_) => err += 1,
        }
    }
    eprintln!("perturbed calls: {ok} successes, {err} failures");
    assert!(ok > 30 && err > 100, "successes {ok}, failures {err}");
}
