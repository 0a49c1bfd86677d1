use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::formats::{BlockFormat, QuantizedMatrix};
use paged_qkv::{CacheShape, Exec, Isa, KvWrite, PackedWeights, PageTable, PagedKvCache, QkvFp4PackedArgs, bf16, fast};
fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n).map(|_| { s ^= s << 13; s ^= s >> 7; s ^= s << 17; ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 }).collect()
}
fn quant(format: BlockFormat, x: &[f32], rows: usize, k: usize) -> QuantizedMatrix {
    quantize(format, x, rows, k, nvfp4_global_scale(amax(x))).unwrap()
}
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let f = BlockFormat::from_name(&args[1]).unwrap();
    let m: usize = args[2].parse().unwrap();
    let iters: usize = args[3].parse().unwrap();
    let (k, hq, hkv, hd) = (4096usize, 32usize, 8usize, 128usize);
    let n = (hq + 2 * hkv) * hd;
    let w = quant(f, &random(n * k, 1), n, k);
    let pw = PackedWeights::new(w.as_ref());
    let a = quant(f, &random(m * k, 7), m, k);
    let pages = m.div_ceil(128) + 1;
    let mut cache = PagedKvCache::<bf16>::zeros(CacheShape::mha(pages + 1, 1, 128, hkv, hd).unwrap());
    let lookup: Vec<u32> = (0..pages as u32).collect();
    let mut out = vec![bf16::ZERO; m * hq * hd];
    let isa = std::env::var("ISA").ok().and_then(|s| Isa::from_name(&s));
    let th: usize = std::env::var("TH").map(|v| v.parse().unwrap()).unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(th).build().unwrap();
    pool.install(|| {
        let mut best = f64::MAX;
        for _ in 0..iters {
            let t = std::time::Instant::now();
            let args = QkvFp4PackedArgs { hidden_state: a.as_ref(), input_row_offsets: &[0, m as u32], weight: &pw, tensor_sf: a.tensor_scale(), q_dim: hq * hd, rope: None };
            let table = PageTable::new(&lookup, pages, &[0]).unwrap();
            let mut kv = KvWrite::new(cache.view_mut(), table, 0);
            fast::qkv_fp4_ragged_packed(&args, &mut out, &mut kv, Exec { isa, ..Exec::default() }).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        let sum: f64 = out.iter().map(|v| v.to_f32() as f64).sum();
        println!("{} m={m} th={th}: best {:.3} ms = {:.1} GFLOP/s  (checksum {sum:.6})", args[1], best * 1e3, 2.0 * (m * n * k) as f64 / best / 1e9);
    });
}
