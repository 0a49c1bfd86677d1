//! Arbitrary bytes → shapes, offsets, page table, E4M3 operands, f32 scales (any granularity,
//! lengths sometimes wrong, values sometimes non-finite) and a bias of the FP8 W8A8 fused QKV.
//! The oracle and the fast path must never panic; an error must leave the cache and output
//! untouched; the fast path on the best ISA must give the scalar kernel's bits.
//! `cargo +nightly fuzz run qkv_fp8_ragged -- -max_total_time=60`
#![no_main]

use libfuzzer_sys::fuzz_target;
use paged_qkv::reference::qkv_fp8_ragged;
use paged_qkv::{
    Accumulation, CacheShape, Exec, Fp8Scales, Isa, KvWrite, PageTable, PagedKvCache, Par, QkvFp8Args, bf16, fast,
};

fuzz_target!(|data: &[u8]| {
    if data.len() < 16 {
        return;
    }
    let (h, rest) = data.split_at(16);
    let Ok(shape) = CacheShape::new(
        h[1] as usize % 8 + 1,
        1 + h[2] as usize % 2,
        h[3] as usize % 3 + 1,
        h[4] as usize % 9 + 1,
        h[5] as usize % 3 + 1,
        2 * (h[6] as usize % 9 + 1),
    ) else {
        return;
    };
    let batch = h[7] as usize % 4;
    let cols = h[8] as usize % 5;
    let k = h[9] as usize % 300 + 1;
    let n = h[10] as usize % 200;
    let q_dim = h[11] as usize % 64;
    let mut it = rest.iter().copied().cycle();
    let mut next = || it.next().unwrap_or(0);
    let mut offsets = vec![0u32];
    for _ in 0..batch {
        let o = *offsets.last().unwrap() + (next() % 4) as u32;
        offsets.push(if h[12] & 1 == 1 { o ^ (next() as u32 & 1) } else { o });
    }
    let m = *offsets.last().unwrap() as usize;
    let lens: Vec<u32> = (0..batch).map(|_| next() as u32 % 20).collect();
    let lookup: Vec<u32> = (0..batch * cols).map(|_| next() as u32 % 10).collect();
    let a: Vec<u8> = (0..m * k).map(|_| next()).collect();
    let w: Vec<u8> = (0..n * k).map(|_| next()).collect();
    let (kb, nb) = (k.div_ceil(128), n.div_ceil(128));
    let skew = (h[0] >> 4) as usize % 3; // 0: right lengths; else one short or long
    let (li, lw) = match h[0] % 3 {
        0 => (1, 1),
        1 => (if h[13] & 2 == 0 { m } else { 1 }, if h[13] & 4 == 0 { n } else { 1 }),
        _ => (kb * m, nb * kb),
    };
    let li = if skew == 1 { li + 1 } else { li };
    let lw = if skew == 2 { lw.saturating_sub(1) } else { lw };
    let scale = |b: u8| match b % 16 {
        0 => f32::NAN,
        1 => f32::INFINITY,
        2 => 0.0,
        3 => f32::MIN_POSITIVE / 4.0,
        4 => 1e30,
        b => (b as f32 - 8.0) * 0.37,
    };
    let si: Vec<f32> = (0..li).map(|_| scale(next())).collect();
    let sw: Vec<f32> = (0..lw).map(|_| scale(next())).collect();
    let scales = match h[0] % 3 {
        0 => Fp8Scales::Tensor { input: si[0], weight: sw.first().copied().unwrap_or(1.0) },
        1 => Fp8Scales::Channel { input: &si, weight: &sw },
        _ => Fp8Scales::Block { input: &si, weight: &sw },
    };
    let bias: Vec<bf16> = (0..n + (h[13] as usize & 1)).map(|_| bf16::from_bits(next() as u16 * 129)).collect();
    let Ok(table) = PageTable::new(&lookup, cols, &lens) else { return };
    let args = QkvFp8Args::new(&a, &offsets, &w, k, scales, q_dim).maybe_bias((h[13] & 8 != 0).then_some(&bias[..]));
    let out_len = m * q_dim + (h[14] as usize % 2);
    let layer = h[14] as usize / 2 % 4;
    let run = |how: Option<Exec>| {
        let mut cache = PagedKvCache::<bf16>::zeros(shape);
        let mut out = vec![bf16::from_f32(1.0); out_len];
        let mut kv = KvWrite::new(cache.view_mut(), table, layer);
        let mode = if h[15] & 1 == 0 { Accumulation::Exact } else { Accumulation::Sequential };
        let r = match how {
            Some(e) => fast::qkv_fp8_ragged(&args, &mut out, &mut kv, e),
            None => qkv_fp8_ragged(&args, &mut out, &mut kv, mode),
        };
        if r.is_err() {
            assert!(cache.data().iter().all(|v| v.to_bits() == 0));
            assert!(out.iter().all(|v| v.to_f32() == 1.0));
        }
        (r.is_ok(), out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), cache.into_vec())
    };
    let oracle = run(None);
    let best = run(Some(Exec { par: Par::Sequential, isa: None }));
    let scalar = run(Some(Exec { par: Par::Sequential, isa: Some(Isa::Scalar) }));
    assert_eq!(oracle.0, best.0, "the oracle and the fast path agree on validity");
    assert_eq!(best.1, scalar.1, "the best ISA's output is the scalar kernel's");
    assert!(best.2.iter().zip(&scalar.2).all(|(x, y)| x.to_bits() == y.to_bits()), "cache bits");
});
