//! Every error variant is produced, and leaves the output and the whole cache unchanged.

use crate::common::*;
use crate::fp4_setup::{Config, Setup, setup};
use paged_qkv::formats::BlockFormat;
use paged_qkv::formats::quantize::quantize;
use paged_qkv::reference::{kv_store_ragged, qkv_bshd, qkv_fp4_ragged, rope_bshd, rope_ragged};
use paged_qkv::{
    Accumulation, CacheShape, Error, KvSel, KvStoreRaggedArgs, KvWrite, PageTable, PagedKvCache, PagedKvCacheMut,
    QkvBshdArgs, QkvFp4Args, RopeBshdArgs, RopeMath, RopeRaggedArgs, bf16,
};

/// Everything a fp4 call takes, as plain data the tests can break.
#[derive(Clone)]
struct Call {
    s: Setup,
    q_dim: usize,
    out_len: usize,
    tensor_sf: f32,
    offsets: Vec<u32>,
    lookup: Vec<u32>,
    cols: usize,
    cache_lengths: Vec<u32>,
    layer: usize,
}

fn base(mla: bool) -> Call {
    let mut rng = Rng::new(40);
    let s = setup(
        &mut rng,
        &Config {
            format: BlockFormat::Nvfp4,
            k: 32,
            lens: vec![2, 1],
            cache_lengths: vec![3, 0],
            hq: 1,
            hkv: 1,
            hd: 16,
            page: 4,
            layers: 2,
            mla_width: mla.then_some(16),
        },
    );
    Call {
        q_dim: s.q_dim,
        out_len: 3 * s.q_dim,
        tensor_sf: 1.0,
        offsets: s.offsets.clone(),
        lookup: s.pages.lookup.clone(),
        cols: s.pages.cols,
        cache_lengths: s.pages.cache_lengths.clone(),
        layer: s.layer,
        s,
    }
}

/// Runs a (broken) call; asserts it fails and that nothing changed; returns the error.
fn fails(c: &Call) -> Error {
    let mut rng = Rng::new(41);
    let mut cache: PagedKvCache<bf16> = random_cache(&mut rng, c.s.shape);
    let before = bits(cache.data());
    let mut out: Vec<bf16> = (0..c.out_len).map(|_| bf16::from_f32(rng.f32())).collect();
    let out_before = bits(&out);
    let args = QkvFp4Args::new(c.s.a.as_ref(), &c.offsets, c.s.w.as_ref(), c.q_dim).with_tensor_sf(c.tensor_sf);
    let table = PageTable::new(&c.lookup, c.cols, &c.cache_lengths).unwrap();
    let mut kv = KvWrite::new(cache.view_mut(), table, c.layer);
    let err = qkv_fp4_ragged(&args, &mut out, &mut kv, Accumulation::Exact).expect_err("must fail");
    assert_eq!(bits(cache.data()), before, "cache changed by a failing call ({err})");
    assert_eq!(bits(&out), out_before, "output changed by a failing call ({err})");
    assert!(!err.to_string().is_empty());
    err
}

#[test]
fn the_base_call_succeeds() {
    for mla in [false, true] {
        let c = base(mla);
        let mut cache: PagedKvCache<bf16> = PagedKvCache::zeros(c.s.shape);
        let mut out = vec![bf16::ZERO; c.out_len];
        let args = QkvFp4Args::new(c.s.a.as_ref(), &c.offsets, c.s.w.as_ref(), c.q_dim).with_tensor_sf(1.0);
        let mut kv =
            KvWrite::new(cache.view_mut(), PageTable::new(&c.lookup, c.cols, &c.cache_lengths).unwrap(), c.layer);
        qkv_fp4_ragged(&args, &mut out, &mut kv, Accumulation::Exact).unwrap();
    }
}

#[test]
fn shape_errors() {
    let mut c = base(false);
    c.out_len += 1;
    assert!(matches!(fails(&c), Error::Shape { arg: "output", .. }));
    let mut c = base(false);
    c.offsets.clear();
    assert!(matches!(fails(&c), Error::Shape { arg: "input_row_offsets", .. }));
    // cache_lengths for 3 sequences, offsets for 2.
    let mut c = base(false);
    c.cache_lengths.push(0);
    c.lookup.extend(vec![0; c.cols]);
    assert!(matches!(fails(&c), Error::Shape { arg: "cache_lengths", .. }));
}

#[test]
fn row_offset_errors() {
    for (offs, index) in [(vec![1u32, 2, 3], 0), (vec![0, 2, 1, 3], 2), (vec![0, 2, 2], 2)] {
        let mut c = base(false);
        c.cache_lengths = vec![0; offs.len() - 1];
        c.lookup = vec![0; c.cache_lengths.len() * c.cols];
        c.offsets = offs;
        match fails(&c) {
            Error::RowOffsets { index: i, .. } => assert_eq!(i, index),
            e => panic!("{e:?}"),
        }
    }
}

#[test]
fn column_split_errors() {
    let mut c = base(false);
    c.q_dim += 16;
    c.out_len = 3 * c.q_dim;
    assert!(matches!(fails(&c), Error::ColumnSplit { mla: false, .. }));
    // MLA: N − q_dim must be in 1..=head_size.
    let mut c = base(true);
    c.q_dim -= 16;
    c.out_len = 3 * c.q_dim;
    assert!(matches!(fails(&c), Error::ColumnSplit { mla: true, .. }));
}

#[test]
fn layer_page_table_and_position_errors() {
    let mut c = base(false);
    c.layer = 2;
    assert!(matches!(fails(&c), Error::LayerOutOfRange { layer: 2, num_layers: 2 }));

    // Sequence 0 holds 3 + 2 = 5 tokens: 2 pages of 4; give the table 1 column.
    let mut c = base(false);
    c.lookup = vec![c.lookup[0], c.lookup[c.cols]];
    c.cols = 1;
    assert!(matches!(fails(&c), Error::PageTableCapacity { batch: 0, pages_needed: 2, cols: 1 }));

    let mut c = base(false);
    c.lookup[1] = 64; // the cache has 64 blocks
    assert!(matches!(fails(&c), Error::BlockOutOfRange { batch: 0, logical_page: 1, block: 64, .. }));

    let mut c = base(false);
    c.cache_lengths[0] = u32::MAX;
    assert!(matches!(fails(&c), Error::PositionOverflow { batch: 0, .. }));
}

#[test]
fn slot_conflicts() {
    // Sequence 1 (1 token at position 0) shares sequence 0's second page (positions 4..8):
    // sequence 0 writes positions 3 and 4, so slot 0 of that page is written twice.
    let mut c = base(false);
    c.lookup[c.cols] = c.lookup[1];
    match fails(&c) {
        Error::SlotConflict { block, slot, first, second } => {
            assert_eq!((block, slot), (c.lookup[1], 0));
            assert_eq!((first.batch, first.position, second.batch, second.position), (0, 4, 1, 0));
        }
        e => panic!("{e:?}"),
    }
    // Sharing a page is fine when the writes miss each other: sequence 1 at position 1 of it.
    let mut c = base(false);
    c.lookup[c.cols] = c.lookup[1];
    c.cache_lengths[1] = 1;
    passes(&c);
    // One block as both pages of sequence 0 (its positions 3 and 4: slots 3 and 0 of it), a block
    // written twice by one sequence without a shared slot: the validation's page-level shortcut
    // does not apply and the exact check passes the call; both rows land in that block.
    let mut c = base(false);
    c.lookup[1] = c.lookup[0];
    let (shape, cache) = (c.s.shape, passes(&c));
    let block = c.lookup[0] as usize;
    for slot in [3, 0] {
        let base = shape.slot_base(block, c.layer, slot);
        let k = &cache.data()[base..base + shape.head_size()];
        assert!(k.iter().any(|v| v.to_f32() != 0.0), "slot {slot} of block {block} was not written");
    }
}

/// Runs a valid call into a zeroed cache; asserts it succeeds and returns the cache.
fn passes(c: &Call) -> PagedKvCache<bf16> {
    let mut cache: PagedKvCache<bf16> = PagedKvCache::zeros(c.s.shape);
    let mut out = vec![bf16::ZERO; c.out_len];
    let args = QkvFp4Args::new(c.s.a.as_ref(), &c.offsets, c.s.w.as_ref(), c.q_dim).with_tensor_sf(1.0);
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&c.lookup, c.cols, &c.cache_lengths).unwrap(), c.layer);
    qkv_fp4_ragged(&args, &mut out, &mut kv, Accumulation::Exact).unwrap();
    cache
}

#[test]
fn format_and_value_errors() {
    let mut c = base(false);
    let x = vec![0.5f32; c.s.w.rows() * 32];
    c.s.w = quantize(BlockFormat::Mxfp4, &x, c.s.w.rows(), 32, 1.0).unwrap();
    assert!(matches!(fails(&c), Error::FormatMismatch { .. }));
    let mut c = base(false);
    let x = vec![0.5f32; c.s.w.rows() * 64];
    c.s.w = quantize(BlockFormat::Nvfp4, &x, c.s.w.rows(), 64, 1.0).unwrap();
    assert!(matches!(fails(&c), Error::FormatMismatch { .. }));
    for t in [f32::NAN, f32::INFINITY] {
        let mut c = base(false);
        c.tensor_sf = t;
        assert!(matches!(fails(&c), Error::NonFinite { arg: "tensor_sf", .. }));
    }
}

/// A small padded setup for the BSHD and RoPE errors.
fn bshd_fixture() -> (CacheShape, Vec<u32>, usize, Vec<u32>) {
    let shape = CacheShape::mha(8, 1, 4, 1, 4).unwrap();
    (shape, vec![0, 1, 2, 3], 2, vec![0, 0])
}

fn unchanged<F: FnOnce(&mut [bf16], &mut KvWrite<'_, bf16>) -> paged_qkv::Result<()>>(
    shape: CacheShape,
    lookup: &[u32],
    cols: usize,
    lens: &[u32],
    out_len: usize,
    f: F,
) -> Error {
    let mut rng = Rng::new(42);
    let mut cache: PagedKvCache<bf16> = random_cache(&mut rng, shape);
    let before = bits(cache.data());
    let mut out: Vec<bf16> = (0..out_len).map(|_| bf16::from_f32(rng.f32())).collect();
    let out_before = bits(&out);
    let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(lookup, cols, lens).unwrap(), 0);
    let err = f(&mut out, &mut kv).expect_err("must fail");
    assert_eq!(bits(cache.data()), before, "{err}");
    assert_eq!(bits(&out), out_before, "{err}");
    err
}

#[test]
fn bshd_errors() {
    let (shape, lookup, cols, lens) = bshd_fixture();
    let x = vec![bf16::ONE; 2 * 3 * 8];
    let w = vec![bf16::ONE; 12 * 8];
    let call = |valid: &[u32], out: &mut [bf16], kv: &mut KvWrite<'_, bf16>| {
        let args = QkvBshdArgs::new(&x, (2, 3, 8), &w, valid, 4);
        qkv_bshd(&args, out, kv, Accumulation::Exact)
    };
    let e = unchanged(shape, &lookup, cols, &lens, 24, |o, kv| call(&[3, 4], o, kv));
    assert!(matches!(e, Error::ValidLength { batch: 1, valid_length: 4, seq_len: 3 }));
    let e = unchanged(shape, &lookup, cols, &lens, 24, |o, kv| call(&[3], o, kv));
    assert!(matches!(e, Error::Shape { arg: "valid_lengths", .. }));
    // Two sequences on one page, both starting at position 0.
    let shared = [0u32, 1, 0, 3];
    let e = unchanged(shape, &shared, cols, &lens, 24, |o, kv| call(&[1, 1], o, kv));
    assert!(matches!(e, Error::SlotConflict { block: 0, slot: 0, .. }));
    let mla = CacheShape::mla(8, 1, 4, 1, 4).unwrap();
    let e = unchanged(mla, &lookup, cols, &lens, 24, |o, kv| call(&[1, 1], o, kv));
    assert!(matches!(e, Error::Unsupported { .. }));
}

#[test]
fn rope_and_store_errors() {
    let (shape, lookup, cols, lens) = bshd_fixture();
    let q = vec![bf16::ONE; 2 * 3 * 2 * 4];
    let freqs = vec![bf16::ONE; 4 * 4]; // 4 rows: positions 0..4
    let call = |valid: &[u32], f: &[bf16], out: &mut [bf16], kv: &mut KvWrite<'_, bf16>| {
        let args = RopeBshdArgs::new(&q, (2, 3, 2), f, valid, true);
        rope_bshd(&args, out, kv, RopeMath::F32)
    };
    let e = unchanged(shape, &lookup, cols, &lens, 48, |o, kv| call(&[3, 3], &freqs[..8], o, kv));
    assert!(matches!(e, Error::FreqsRows { position: 2, rows: 2 }));
    let e = unchanged(shape, &lookup, cols, &lens, 48, |o, kv| call(&[3, 3], &freqs[..7], o, kv));
    assert!(matches!(e, Error::Shape { arg: "freqs_cis", .. }));
    let odd = CacheShape::mha(8, 1, 4, 1, 3).unwrap();
    let e = unchanged(odd, &lookup, cols, &lens, 36, |o, kv| {
        let args = RopeBshdArgs::new(&q[..36], (2, 3, 2), &freqs[..12], &[1, 1], true);
        rope_bshd(&args, o, kv, RopeMath::F32)
    });
    assert!(matches!(e, Error::InvalidDim { arg: "kv_blocks", .. }));
    // Ragged: odd rope_dim.
    let e = unchanged(shape, &lookup, cols, &lens, 8, |o, kv| {
        let args = RopeRaggedArgs::new(&q[..8], &[0, 1, 1], (2, 4), &freqs, 3, false);
        rope_ragged(&args, o, kv, RopeMath::F32)
    });
    assert!(matches!(e, Error::InvalidDim { arg: "rope_dim", .. }));
    // Ragged: a position id past the table.
    let e = unchanged(shape, &lookup, cols, &lens, 8, |o, kv| {
        let args = RopeRaggedArgs::new(&q[..8], &[0, 1, 1], (2, 4), &freqs, 4, false).with_position_ids(&[4]);
        rope_ragged(&args, o, kv, RopeMath::F32)
    });
    assert!(matches!(e, Error::FreqsRows { position: 4, rows: 4 }));
    // Storing V into an MLA cache.
    let mla = CacheShape::mla(8, 1, 4, 1, 4).unwrap();
    let e = unchanged(mla, &lookup, cols, &lens, 0, |_, kv| {
        kv_store_ragged(&KvStoreRaggedArgs::new(&q[..4], &[0, 1, 1], KvSel::V), kv)
    });
    assert!(matches!(e, Error::Unsupported { .. }));
}

#[test]
fn constructor_errors() {
    assert!(matches!(CacheShape::new(4, 3, 1, 4, 1, 4), Err(Error::InvalidDim { .. })));
    assert!(matches!(CacheShape::mha(0, 1, 4, 1, 4), Err(Error::InvalidDim { .. })));
    assert!(matches!(CacheShape::mha(usize::MAX, 2, 4, 1, 4), Err(Error::InvalidDim { .. })));
    assert!(matches!(CacheShape::from_dims(&[1, 2, 3]), Err(Error::Shape { .. })));
    let shape = CacheShape::mha(2, 1, 4, 1, 4).unwrap();
    let mut buf = vec![bf16::ZERO; shape.len() - 1];
    assert!(matches!(PagedKvCacheMut::new(shape, &mut buf), Err(Error::Shape { arg: "kv_blocks", .. })));
    assert!(matches!(PagedKvCache::from_vec(shape, vec![0f32; 3]), Err(Error::Shape { .. })));
    assert!(matches!(PageTable::new(&[0, 1, 2], 2, &[0, 0]), Err(Error::Shape { arg: "kv_lookup_table", .. })));
    // Index and coordinates agree.
    for i in 0..shape.len() {
        let [a, b, c, d, e, f] = shape.coords(i);
        assert_eq!(shape.index(a, b, c, d, e, f), i);
    }
}

#[test]
fn zero_width_dimensions_are_rejected() {
    // K = 0 or zero Q heads would make any row count look consistent with empty data.
    assert!(matches!(
        paged_qkv::QuantizedRef::new(BlockFormat::Mxfp8, 1 << 40, 0, &[], &[]),
        Err(Error::InvalidDim { arg: "k", .. })
    ));
    assert!(matches!(
        quantize(BlockFormat::Nvfp4, &[0f32; 0], 1 << 40, 0, 1.0),
        Err(Error::InvalidDim { arg: "k", .. })
    ));
    let (shape, lookup, cols, lens) = bshd_fixture();
    let e = unchanged(shape, &lookup, cols, &lens, 0, |o, kv| {
        let args = RopeBshdArgs::new(&[], (2, 1 << 40, 0), &[bf16::ONE; 4], &[0, 0], true);
        rope_bshd(&args, o, kv, RopeMath::F32)
    });
    assert!(matches!(e, Error::InvalidDim { arg: "num_q_heads", .. }));
    let e = unchanged(shape, &lookup, cols, &lens, 0, |o, kv| {
        let args = RopeRaggedArgs::new(&[], &[0, u32::MAX, u32::MAX], (0, 4), &[bf16::ONE; 4], 4, false);
        rope_ragged(&args, o, kv, RopeMath::F32)
    });
    assert!(matches!(e, Error::InvalidDim { arg: "num_q_heads", .. }));
}

/// A row offset of 2³² − 1 with a handful of values: the KV store's validation rejects the values
/// before listing the rows (it listed 2³² rows first: ~100 GB, an abort; found by the `case_file`
/// fuzz target), on the oracle and the fast path.
#[test]
fn kv_store_row_count_is_bounded_by_values_before_rows_are_listed() {
    let shape = CacheShape::mha(2, 1, 4, 1, 16).unwrap();
    let mut cache = PagedKvCache::<f32>::zeros(shape);
    let values = vec![0f32; 80];
    let offsets = [0, u32::MAX];
    let args = KvStoreRaggedArgs::new(&values, &offsets, KvSel::K);
    for fast in [false, true] {
        let mut kv = KvWrite::new(cache.view_mut(), PageTable::new(&[0], 1, &[0]).unwrap(), 0);
        let e = if fast {
            paged_qkv::fast::kv_store_ragged(&args, &mut kv, paged_qkv::Exec::default()).unwrap_err()
        } else {
            kv_store_ragged(&args, &mut kv).unwrap_err()
        };
        assert!(matches!(e, Error::Shape { arg: "values", .. }), "{e}");
    }
}
