//! Fast FP8 W8A8 fused QKV (tensor, channel and 128-block scales) against baselines measured in
//! the same run, call by call (`common/paired.rs`).
//!
//! `cargo bench --bench qkv_fp8` (filter with e.g. `-- decode_fp8_block`). Groups:
//! * `paired/llama3-8b/m512/flop`: M = 512 against the f32 FMA peak loop of the ISA in use (the
//!   MXFP8 kernels it runs on are f32 FMA chains; 2·M·N·K FLOP on both sides' scale);
//! * `paired/{model}/decode_fp8_{granularity}/bytes`: M = 1 from DRAM (each call on its own cold
//!   layer) against a plain read of the weight's E4M3 and scale bytes, 1 and 2 threads;
//! * `peak/ops`: the FMA peak loops themselves.

use criterion::{Criterion, criterion_group, criterion_main};
use paged_qkv::fast::{PackedFp8Weights, QkvFp8PackedArgs, qkv_fp8_ragged_packed};
use paged_qkv::formats::quantize::{quantize_fp8_input, quantize_fp8_weight};
use paged_qkv::{Fp8Granularity, Fp8Scales, Isa, KvWrite, PageTable, bf16};
use std::hint::black_box;

#[path = "common/fixtures.rs"]
mod fixtures;
use fixtures::*;

/// Quantized activations: E4M3 codes and their scales.
struct Acts {
    x: Vec<u8>,
    s: Vec<f32>,
    m: usize,
}

fn fused(a: &Acts, w: &PackedFp8Weights, sw: &[f32], g: Fp8Granularity, q_dim: usize, out: &mut [bf16], c: &mut Cache) {
    let offsets = [0, a.m as u32];
    let args = QkvFp8PackedArgs::<bf16>::new(&a.x, &offsets, w, Fp8Scales::of(g, &a.s, sw), q_dim);
    let table = PageTable::new(&c.lookup, c.lookup.len(), &c.lens).unwrap();
    let mut kv = KvWrite::new(c.cache.view_mut(), table, 0);
    qkv_fp8_ragged_packed(&args, out, &mut kv, exec()).unwrap();
}

#[path = "common/exec.rs"]
mod exec;
use exec::exec;

#[path = "common/peak.rs"]
mod peak;

#[path = "common/paired.rs"]
mod paired;
use paired::Side;

/// M = 512 on Llama-3-8B against the FMA peak loop, per granularity and thread count.
fn compute(c: &mut Criterion) {
    let model = LLAMA;
    let (k, n, m) = (model.k, model.n(), 512);
    let Some((pname, _, per, l)) = peak::for_isa(exec().isa.unwrap_or_else(Isa::best), peak::Unit::Fma) else {
        return;
    };
    let wf = random(n * k, 1);
    let af = random(m * k, 3);
    let gname = format!("paired/{}/m{m}/flop", model.name);
    let mut g = setup_group(c, &gname);
    let flop = (2 * m * n * k) as u64;
    for gran in Fp8Granularity::ALL {
        let (wq, sw) = quantize_fp8_weight(&wf, n, k, gran).unwrap();
        let pw = PackedFp8Weights::new(&wq, k).unwrap();
        let (x, s) = quantize_fp8_input(&af, m, k, gran).unwrap();
        let a = Acts { x, s, m };
        for threads in [1usize, 2] {
            let p = pool(threads);
            let mut out = vec![bf16::ZERO; m * model.q_dim()];
            let mut cache = cache_for(&model, m);
            let mut kern = || fused(&a, &pw, &sw, gran, model.q_dim(), &mut out, &mut cache);
            let mut base = || peak::call(l, threads);
            let id = format!("fused_fp8_{}_t{threads}", gran.name());
            let kern = Side { name: &id, work: flop, run: &mut kern };
            let peak =
                Side { name: &format!("{pname}_t{threads}"), work: peak::ops(per) * threads as u64, run: &mut base };
            paired::run(&mut g, &gname, &p, kern, peak);
        }
    }
    g.finish();
}

/// M = 1 from DRAM against a plain read of the weight's bytes (E4M3 codes and f32 scales).
fn decode(c: &mut Criterion) {
    for model in [LLAMA, QWEN] {
        let (k, n) = (model.k, model.n());
        let wf = random(n * k, 1);
        let af = random(k, 9);
        for gran in Fp8Granularity::ALL {
            let (wq, sw) = quantize_fp8_weight(&wf, n, k, gran).unwrap();
            let raw: Vec<u8> = wq.iter().copied().chain(sw.iter().flat_map(|v| v.to_le_bytes())).collect();
            let pw = PackedFp8Weights::new(&wq, k).unwrap();
            let layers = (400 << 20) / raw.len() + 1; // > the last-level caches of the machines used
            let cold: Vec<PackedFp8Weights> = (0..layers).map(|_| pw.clone()).collect();
            let cold_raw: Vec<Vec<u8>> = (0..layers).map(|_| raw.clone()).collect();
            let (x, s) = quantize_fp8_input(&af, 1, k, gran).unwrap();
            let a = Acts { x, s, m: 1 };
            let mut out = vec![bf16::ZERO; model.q_dim()];
            let mut cache = cache_for(&model, 1);
            let gname = format!("paired/{}/decode_fp8_{}/bytes", model.name, gran.name());
            let mut g = setup_group(c, &gname);
            for threads in [1usize, 2] {
                let p = pool(threads);
                let mut kern = |i: usize| fused(&a, &cold[i], &sw, gran, model.q_dim(), &mut out, &mut cache);
                let mut read = |j: usize| {
                    black_box(plain_read_par(&cold_raw[j], threads));
                };
                paired::dram(&mut g, &gname, &p, threads, layers, raw.len() as u64, &mut kern, &mut read);
            }
            g.finish();
        }
    }
}

fn peaks(c: &mut Criterion) {
    let mut g = setup_group(c, "peak/ops");
    peak::run(&mut g, &["fma_zmm", "fma_ymm"]);
    g.finish();
}

criterion_group!(benches, peaks, decode, compute);
criterion_main!(benches);
