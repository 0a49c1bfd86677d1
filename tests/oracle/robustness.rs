//! Random, mostly inconsistent arguments thrown at every entry point: never a panic; an error
//! leaves output and cache unchanged; a success writes only what the op may write.

use crate::common::bits;
use paged_qkv::formats::{BlockFormat, QuantizedRef};
use paged_qkv::reference::*;
use paged_qkv::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Raw {
    dims: Vec<usize>,
    offsets: Vec<u32>,
    lookup: Vec<u32>,
    lens: Vec<u32>,
    valid: Vec<u32>,
    bytes: Vec<u8>,
    layer: usize,
    flag: bool,
    fmt: usize,
}

fn raw() -> impl Strategy<Value = Raw> {
    (
        proptest::collection::vec(0usize..6, 12),
        proptest::collection::vec(0u32..8, 0..5),
        proptest::collection::vec(0u32..6, 0..12),
        proptest::collection::vec(prop_oneof![0u32..10, Just(u32::MAX - 1)], 0..4),
        proptest::collection::vec(0u32..5, 0..4),
        proptest::collection::vec(any::<u8>(), 0..2048),
        0usize..3,
        any::<bool>(),
        0usize..3,
    )
        .prop_map(|(dims, offsets, lookup, lens, valid, bytes, layer, flag, fmt)| Raw {
            dims,
            offsets,
            lookup,
            lens,
            valid,
            bytes,
            layer,
            flag,
            fmt,
        })
}

fn f32s(bytes: &[u8], n: usize) -> Vec<f32> {
    (0..n).map(|i| bytes.get(i).map_or(0.5, |&b| (b as f32 - 128.0) / 16.0)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn entry_points_never_panic(r in raw()) {
        let d = &r.dims;
        let shape = match CacheShape::new(d[0] + 1, 1 + (d[1] % 2), d[2] + 1, d[3] + 1, d[4] % 3 + 1, 2 * (d[5] % 3 + 1)) {
            Ok(s) => s,
            Err(_) => return Ok(()),
        };
        let cols = d[6];
        // Mostly a well-formed table (entries random, often out of range); sometimes one entry short.
        let want = r.lens.len() * cols - usize::from(r.fmt == 0 && !r.flag && cols > 0 && !r.lens.is_empty());
        let lookup: Vec<u32> = r.lookup.iter().copied().chain(std::iter::repeat(1)).take(want).collect();
        let Ok(table) = PageTable::new(&lookup, cols, &r.lens) else { return Ok(()) };
        let mut cache = PagedKvCache::<bf16>::from_vec(shape, f32s(&r.bytes, shape.len()).iter().map(|&x| bf16::from_f32(x)).collect()).unwrap();
        let before = bits(cache.data());
        let m = r.offsets.last().copied().unwrap_or(0) as usize;
        let out_len = d[7] * 4 + d[8];
        let mut out = vec![bf16::from_f32(3.0); out_len];
        let out_before = bits(&out);
        let mut out32 = vec![7.0f32; out_len];
        let format = BlockFormat::ALL[r.fmt];
        let k = 2 * (d[9] + 1) * 8;
        let n = d[10] * 4 + d[11];
        let (a_data, w_data) = (vec![0x5Au8; m * format.row_bytes(k)], r.bytes.iter().cycle().take(n * format.row_bytes(k)).copied().collect::<Vec<_>>());
        let a_sc = vec![0x38u8; paged_qkv::formats::scale_layout::ScaleLayout::for_operand(m, k, format.vector_size()).len()];
        let w_sc: Vec<u8> = r.bytes.iter().cycle().take(paged_qkv::formats::scale_layout::ScaleLayout::for_operand(n, k, format.vector_size()).len()).copied().collect();
        let x = f32s(&r.bytes, d[7] * 8 + d[8]);
        let results: Vec<Result<()>> = {
            let mut kv = KvWrite::new(cache.view_mut(), table, r.layer);
            let mut res = Vec::new();
            if let (Ok(a), Ok(w)) = (QuantizedRef::new(format, m, k, &a_data, &a_sc), QuantizedRef::new(format, n, k, &w_data, &w_sc)) {
                let args = QkvFp4Args { hidden_state: a, input_row_offsets: &r.offsets, weight: w, tensor_sf: 0.5, q_dim: d[8] * 2, rope: None };
                res.push(qkv_fp4_ragged(&args, &mut out, &mut kv, Accumulation::Exact));
            }
            let args = QkvRaggedArgs { hidden_state: &x, input_row_offsets: &r.offsets, weight: &x, hidden_size: d[9], bias: r.flag.then_some(&x[..]), q_dim: d[8], rope: None };
            res.push(qkv_ragged(&args, &mut out, &mut kv, Accumulation::Sequential));
            let args = QkvBshdArgs { hidden_state: &x, batch: r.lens.len(), seq_len: d[3], hidden_size: d[9], weight: &x, valid_lengths: &r.valid, q_dim: d[8], rope: None };
            res.push(qkv_bshd(&args, &mut out, &mut kv, Accumulation::Exact));
            let args = RopeBshdArgs { q_proj: &x, batch: r.lens.len(), seq_len: d[3], num_q_heads: d[10], freqs_cis: &x, valid_lengths: &r.valid, interleaved: r.flag };
            res.push(rope_bshd(&args, &mut out32, &mut kv, RopeMath::MaxCompat));
            let args = RopeRaggedArgs { q_proj: &x, input_row_offsets: &r.offsets, num_q_heads: d[10], q_head_size: d[11] * 2, freqs_cis: &x, rope_dim: d[2] * 2, position_ids: r.flag.then_some(&r.valid[..]), interleaved: r.flag };
            res.push(rope_ragged(&args, &mut out32, &mut kv, RopeMath::F32));
            let which = if r.flag { KvSel::K } else { KvSel::V };
            res.push(kv_store_ragged(&KvStoreRaggedArgs { values: &x, input_row_offsets: &r.offsets, which }, &mut kv));
            res.push(kv_store_bshd(&KvStoreBshdArgs { values: &x, batch: r.lens.len(), seq_len: d[3], valid_lengths: &r.valid, which }, &mut kv));
            res
        };
        // If every call failed, nothing may have changed.
        if results.iter().all(|x| x.is_err()) {
            prop_assert_eq!(bits(cache.data()), before);
            prop_assert_eq!(bits(&out), out_before);
            prop_assert!(out32.iter().all(|&v| v == 7.0));
        }
        if std::env::var_os("ROBUSTNESS_STATS").is_some() {
            eprintln!("ok: {}", results.iter().filter(|x| x.is_ok()).count());
        }
        for e in results.into_iter().filter_map(|x| x.err()) {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}
