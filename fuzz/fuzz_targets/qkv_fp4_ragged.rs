//! Arbitrary bytes → shapes, offsets, page table and operands of the FP4 fused QKV oracle.
//! It must never panic, and an error must leave the cache and output untouched.
//! `cargo +nightly fuzz run qkv_fp4_ragged -- -max_total_time=60`
#![no_main]

use libfuzzer_sys::fuzz_target;
use paged_qkv::formats::scale_layout::ScaleLayout;
use paged_qkv::formats::{BlockFormat, QuantizedRef};
use paged_qkv::reference::qkv_fp4_ragged;
use paged_qkv::{Accumulation, CacheShape, KvWrite, PageTable, PagedKvCache, QkvFp4Args, bf16};

fuzz_target!(|data: &[u8]| {
    if data.len() < 16 {
        return;
    }
    let (h, rest) = data.split_at(16);
    let format = BlockFormat::ALL[h[0] as usize % 3];
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
    let k = 2 * (h[9] as usize % 40 + 1);
    let n = h[10] as usize % 96;
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
    let a: Vec<u8> = (0..m * format.row_bytes(k)).map(|_| next()).collect();
    let w: Vec<u8> = (0..n * format.row_bytes(k)).map(|_| next()).collect();
    let sa: Vec<u8> = (0..ScaleLayout::for_operand(m, k, format.vector_size()).len()).map(|_| next()).collect();
    let sw: Vec<u8> = (0..ScaleLayout::for_operand(n, k, format.vector_size()).len()).map(|_| next()).collect();
    let (Ok(a), Ok(w)) = (QuantizedRef::new(format, m, k, &a, &sa), QuantizedRef::new(format, n, k, &w, &sw)) else {
        return;
    };
    let Ok(table) = PageTable::new(&lookup, cols, &lens) else { return };
    let mut cache = PagedKvCache::<bf16>::zeros(shape);
    let mut out = vec![bf16::from_f32(1.0); m * q_dim + (h[13] as usize % 2)];
    let args = QkvFp4Args::new(a, &offsets, w, q_dim).with_tensor_sf(0.25);
    let mut kv = KvWrite::new(cache.view_mut(), table, h[14] as usize % 4);
    let mode = if h[15] & 1 == 0 { Accumulation::Exact } else { Accumulation::Sequential };
    if qkv_fp4_ragged(&args, &mut out, &mut kv, mode).is_err() {
        assert!(cache.data().iter().all(|v| v.to_bits() == 0));
        assert!(out.iter().all(|v| v.to_f32() == 1.0));
    }
});
