//! Throughput of the scalar oracle (the baseline the fast paths are compared with).
//! `cargo bench --bench reference`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::reference::qkv_fp4_ragged;
use paged_qkv::{Accumulation, BlockFormat, CacheShape, KvWrite, PageTable, PagedKvCache, QkvFp4Args, bf16};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    // Qwen2.5-0.5B QKV: K 896, 14 Q / 2 KV heads of 64.
    let (k, q_dim, n, m) = (896, 14 * 64, 18 * 64, 1);
    let mut s = 1u64;
    let mut rnd = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    };
    let w: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
    let x: Vec<f32> = (0..m * k).map(|_| rnd()).collect();
    let mut g = c.benchmark_group("reference_qkv_fp4_qwen_m1");
    g.throughput(Throughput::Elements((2 * m * n * k) as u64)); // FLOP
    g.sample_size(10);
    for format in [BlockFormat::Nvfp4, BlockFormat::Mxfp4] {
        let wq = quantize(format, &w, n, k, nvfp4_global_scale(amax(&w))).unwrap();
        let xq = quantize(format, &x, m, k, nvfp4_global_scale(amax(&x))).unwrap();
        let shape = CacheShape::mha(4, 1, 128, 2, 64).unwrap();
        let mut cache = PagedKvCache::<bf16>::zeros(shape);
        let mut out = vec![bf16::ZERO; m * q_dim];
        for mode in [Accumulation::Sequential, Accumulation::Exact] {
            g.bench_function(format!("{}_{mode:?}", format.name()), |b| {
                b.iter(|| {
                    let offsets = [0, m as u32];
                    let args = QkvFp4Args::new(xq.as_ref(), &offsets, wq.as_ref(), q_dim).with_tensor_sf(1.0);
                    let table = PageTable::new(&[0], 1, &[0]).unwrap();
                    let mut kv = KvWrite::new(cache.view_mut(), table, 0);
                    qkv_fp4_ragged(black_box(&args), &mut out, &mut kv, mode).unwrap();
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
