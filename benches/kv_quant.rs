//! The cost of an FP8-quantized cache (E4M3 codes, f32 scales per 128 elements of a head): each
//! operation into a quantized cache paired, call by call (`common/paired.rs`), with the same call
//! into a bf16 cache. The printed ratio is bf16-cache time ÷ quantized-cache time (≥ 0.95: the
//! quantized write costs at most 1.05× the bf16 one).
//!
//! `cargo bench --bench kv_quant` (filter with e.g. `-- qkv_bf16`). Groups
//! `paired/{model}/{op}_m{M}/rows`: the bf16 fused QKV (prepacked weight, warm; `qkv_rope_bf16`
//! with its fused RoPE) and the standalone ragged RoPE, M = 1 and 512, 1 and 2 threads.

use criterion::{Criterion, criterion_group, criterion_main};
use paged_qkv::fast::{qkv_ragged_packed, rope_ragged};
use paged_qkv::{
    CacheShape, E4M3, KvScales, KvWrite, PackedPlainWeights, PageTable, PagedKvCache, QkvRaggedPackedArgs, QkvRope,
    RopeMath, RopeRaggedArgs, bf16,
};

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::*;

#[path = "common/exec.rs"]
mod exec;
use exec::exec;

#[path = "common/paired.rs"]
mod paired;
use paired::Side;

/// MAX's default quantization granularity.
const GRAN: usize = 128;

/// A quantized cache of the shape of [`cache_for`]'s.
struct QCache {
    codes: PagedKvCache<E4M3>,
    scales: KvScales,
    lookup: Vec<u32>,
    lens: [u32; 1],
}

fn qcache_for(model: &Model, m: usize) -> QCache {
    let c = cache_for(model, m);
    let shape: CacheShape = c.cache.shape();
    let gran = GRAN.min(model.hd);
    QCache {
        codes: PagedKvCache::zeros(shape),
        scales: KvScales::zeros(shape, gran).unwrap(),
        lookup: c.lookup,
        lens: c.lens,
    }
}

/// Runs `call` with the bf16 cache and with the quantized one, paired.
fn pair(
    c: &mut Criterion,
    gname: &str,
    m: usize,
    call: &(dyn Fn(&mut KvWrite<'_, bf16>) + Sync),
    qcall: &(dyn Fn(&mut KvWrite<'_, E4M3>) + Sync),
    model: &Model,
) {
    let mut g = setup_group(c, gname);
    for threads in [1usize, 2] {
        let p = pool(threads);
        let mut plain = cache_for(model, m);
        let mut q = qcache_for(model, m);
        let mut base = || {
            let table = PageTable::new(&plain.lookup, plain.lookup.len(), &plain.lens).unwrap();
            call(&mut KvWrite::new(plain.cache.view_mut(), table, 0));
        };
        let mut kern = || {
            let table = PageTable::new(&q.lookup, q.lookup.len(), &q.lens).unwrap();
            qcall(&mut KvWrite::new(q.codes.view_mut(), table, 0).with_scales(q.scales.view_mut()));
        };
        let (kn, bn) = (format!("fp8_cache_t{threads}"), format!("bf16_cache_t{threads}"));
        let kern = Side { name: &kn, work: m as u64, run: &mut kern };
        let base = Side { name: &bn, work: m as u64, run: &mut base };
        paired::run(&mut g, gname, &p, kern, base);
    }
    g.finish();
}

/// The bf16 fused QKV into either cache, without and with the fused RoPE (`qkv_rope_bf16`: the
/// K rotated before it is quantized; Qwen only).
fn qkv(c: &mut Criterion) {
    let cases = [
        (QWEN, 1, false),
        (QWEN, 512, false),
        (LLAMA, 1, false),
        (LLAMA, 512, false),
        (QWEN, 1, true),
        (QWEN, 512, true),
    ];
    for (model, m, fused) in cases {
        let (k, n, q_dim) = (model.k, model.n(), model.q_dim());
        let w: Vec<bf16> = random(n * k, 1).into_iter().map(bf16::from_f32).collect();
        let pw = PackedPlainWeights::new(&w, k).unwrap();
        let freqs: Vec<bf16> = paged_qkv::freqs_cis(1024, model.hd, 1e4).into_iter().map(bf16::from_f32).collect();
        {
            let x: Vec<bf16> = random(m * k, 3).into_iter().map(bf16::from_f32).collect();
            let offsets = [0, m as u32];
            let out = std::sync::Mutex::new(vec![bf16::ZERO; m * q_dim]);
            let rope = QkvRope::new(&freqs, model.hd, model.hd, false);
            let args = QkvRaggedPackedArgs::new(&x, &offsets, &pw, q_dim).maybe_rope(fused.then_some(rope));
            let op = if fused { "qkv_rope_bf16" } else { "qkv_bf16" };
            macro_rules! run {
                () => {
                    |kv: &mut KvWrite<'_, _>| {
                        qkv_ragged_packed(&args, &mut out.lock().unwrap(), kv, exec()).unwrap();
                    }
                };
            }
            pair(c, &format!("paired/{}/{op}_m{m}/rows", model.name), m, &run!(), &run!(), &model);
        }
    }
}

/// The ragged RoPE (whole heads) on the K just stored in either cache.
fn rope(c: &mut Criterion) {
    for (model, ms) in [(QWEN, [1, 512]), (LLAMA, [1, 512])] {
        let (hq, hd) = (model.hq, model.hd);
        let freqs: Vec<bf16> = paged_qkv::freqs_cis(1024, hd, 1e4).into_iter().map(bf16::from_f32).collect();
        for m in ms {
            let q: Vec<bf16> = random(m * hq * hd, 5).into_iter().map(bf16::from_f32).collect();
            let offsets = [0, m as u32];
            let out = std::sync::Mutex::new(vec![bf16::ZERO; q.len()]);
            let args = RopeRaggedArgs::new(&q, &offsets, (hq, hd), &freqs, hd, false);
            macro_rules! run {
                () => {
                    |kv: &mut KvWrite<'_, _>| {
                        rope_ragged(&args, &mut out.lock().unwrap(), kv, RopeMath::MaxCompat, exec()).unwrap();
                    }
                };
            }
            pair(c, &format!("paired/{}/rope_m{m}/rows", model.name), m, &run!(), &run!(), &model);
        }
    }
}

criterion_group!(benches, qkv, rope);
criterion_main!(benches);
