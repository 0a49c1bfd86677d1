//! FP8-quantized caches ([semantics §3.1](crate::semantics)): E4M3 codes in the cache and one f32
//! scale per `granularity` elements along the head dimension, in a separate scales tensor
//! `[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size / granularity]` (MAX's
//! `kv_scales` with `KVCacheQuantizationConfig`).
//!
//! Every operation that writes K/V writes such a cache the same way: the values it would store
//! in a cache of its activation dtype `S` (the output dtype of a fused QKV, the input dtype of a
//! RoPE or a store) are formed first, rounded to `S`, then each group is quantized as MAX's FP8
//! KV writer quantizes it (`amax / 448`, the elements times the reciprocal). The operations run
//! their usual kernels into a small staging cache of `S` (one page of one slot per written row:
//! memory proportional to what the call writes), then quantize the staged rows into their slots.
//! RoPE, which reads the K it rotates from the cache, first dequantizes it into the staging cache
//! (the oracle; the fast path does the same steps one row at a time, without staging).

use super::{CacheShape, KvSel, KvWrite, PageTable, PagedKvCacheMut, RowSlot, SlotPlan};
use crate::element::{DType, Element};
use crate::error::{Error, Result, checked_len};
pub(crate) use crate::formats::quantize::fp8_scale as group_scale;
use crate::pool::Pooled;

/// The dimensions of the scales tensor of a cache of `shape` at `granularity`.
fn scale_dims(shape: &CacheShape, granularity: usize) -> [usize; 6] {
    let mut d = shape.dims();
    d[5] = shape.head_size() / granularity;
    d
}

/// Checks a granularity against a cache shape: at least 2 and a divisor of the head size, as
/// MAX's FP8 KV writer asserts (`quantization_granularity > 1 and head_size % it == 0`).
fn check_granularity(shape: &CacheShape, granularity: usize) -> Result<()> {
    if granularity < 2 || !shape.head_size().is_multiple_of(granularity) {
        return Err(Error::dim(
            "kv_scales",
            format!(
                "quantization_granularity {granularity} must be at least 2 and divide head_size {}",
                shape.head_size()
            ),
        ));
    }
    Ok(())
}

/// The f32 scales of an FP8-quantized cache, owned.
#[derive(Debug, Clone, PartialEq)]
pub struct KvScales {
    shape: CacheShape,
    granularity: usize,
    data: Vec<f32>,
}

impl KvScales {
    /// Zero scales for a cache of `shape` (a zero scale dequantizes every code to 0) at
    /// `granularity` elements per scale (MAX's default: 128).
    pub fn zeros(shape: CacheShape, granularity: usize) -> Result<Self> {
        check_granularity(&shape, granularity)?;
        let len = checked_len("kv_scales", &scale_dims(&shape, granularity))?;
        Ok(KvScales { shape, granularity, data: vec![0.0; len] })
    }
    /// Wraps existing scales; their length must be the product of [`dims`](Self::dims).
    pub fn from_vec(shape: CacheShape, granularity: usize, data: Vec<f32>) -> Result<Self> {
        check_granularity(&shape, granularity)?;
        expect_len(&shape, granularity, data.len())?;
        Ok(KvScales { shape, granularity, data })
    }
    /// The granularity of a scales tensor of shape `dims` for a cache of `shape`: `dims` must be
    /// `[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, groups]` with the cache's first
    /// five dimensions and `groups` dividing the head size; the granularity is `head_size /
    /// groups` (at least 2). An error names `kv_scales`.
    pub fn granularity_of(shape: CacheShape, dims: &[usize]) -> Result<usize> {
        let cd = shape.dims();
        let groups = dims.get(5).copied().unwrap_or(0);
        if dims.len() != 6 || dims[..5] != cd[..5] || groups == 0 || !cd[5].is_multiple_of(groups) {
            return Err(Error::dim(
                "kv_scales",
                format!(
                    "expected shape [{}, {}, {}, {}, {}, head_size / granularity] (the cache's first five \
                     dimensions, a granularity dividing head_size {}), found {dims:?}",
                    cd[0], cd[1], cd[2], cd[3], cd[4], cd[5]
                ),
            ));
        }
        let g = cd[5] / groups;
        check_granularity(&shape, g)?;
        Ok(g)
    }
    /// The rank-6 shape `[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size /
    /// granularity]`.
    pub fn dims(&self) -> [usize; 6] {
        scale_dims(&self.shape, self.granularity)
    }
    /// Elements per scale along the head dimension.
    pub fn granularity(&self) -> usize {
        self.granularity
    }
    /// The scales.
    pub fn data(&self) -> &[f32] {
        &self.data
    }
    /// A mutable view, as [`KvWrite::with_scales`] takes it.
    pub fn view_mut(&mut self) -> KvScalesMut<'_> {
        KvScalesMut { shape: self.shape, granularity: self.granularity, data: &mut self.data }
    }
    /// Gives the storage back.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }
    /// The scale of element `[block, kv, layer, slot, head, dim]` of the cache (panics when out of
    /// range, like slice indexing).
    pub fn get(&self, block: usize, kv: usize, layer: usize, slot: usize, head: usize, dim: usize) -> f32 {
        self.data[scale_index(&self.shape, self.granularity, self.shape.index(block, kv, layer, slot, head, dim))]
    }
}

fn expect_len(shape: &CacheShape, granularity: usize, len: usize) -> Result<()> {
    let dims = scale_dims(shape, granularity);
    if len == dims.iter().product::<usize>() { Ok(()) } else { Err(Error::dims("kv_scales", &dims, len)) }
}

/// The index in the scales tensor of the cache element at flat index `i`.
#[inline]
fn scale_index(shape: &CacheShape, granularity: usize, i: usize) -> usize {
    let d = shape.head_size();
    (i / d) * (d / granularity) + (i % d) / granularity
}

/// The f32 scales of an FP8-quantized cache over caller-owned memory: one scale per
/// `granularity` elements along the head dimension, for the cache of the shape given.
#[derive(Debug)]
pub struct KvScalesMut<'a> {
    shape: CacheShape,
    granularity: usize,
    data: &'a mut [f32],
}

impl<'a> KvScalesMut<'a> {
    /// Wraps caller-owned scales of a cache of `shape`; `granularity` must be at least 2 and
    /// divide the head size, and `data.len()` must be the product of
    /// `[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size / granularity]`.
    pub fn new(shape: CacheShape, granularity: usize, data: &'a mut [f32]) -> Result<Self> {
        check_granularity(&shape, granularity)?;
        expect_len(&shape, granularity, data.len())?;
        Ok(KvScalesMut { shape, granularity, data })
    }
    /// The rank-6 shape of the scales.
    pub fn dims(&self) -> [usize; 6] {
        scale_dims(&self.shape, self.granularity)
    }
    /// Elements per scale along the head dimension.
    pub fn granularity(&self) -> usize {
        self.granularity
    }
    /// The scales.
    pub fn data(&self) -> &[f32] {
        self.data
    }
    /// The scales, mutably.
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.data
    }
    /// The cache shape these scales belong to.
    pub fn cache_shape(&self) -> CacheShape {
        self.shape
    }
}

/// Checks a write's scales (when it has them) against its cache, before anything is written:
/// the cache holds E4M3 codes and the scales were made for its shape.
pub(crate) fn check<C: Element>(kv: &KvWrite<'_, C>) -> Result<()> {
    let Some(s) = &kv.scales else { return Ok(()) };
    if C::DTYPE != DType::F8E4M3 {
        return Err(Error::dim(
            "kv_scales",
            format!("scales quantize a float8_e4m3fn cache; this cache holds {}", C::DTYPE.name()),
        ));
    }
    if s.shape != kv.cache.shape() {
        return Err(Error::dim(
            "kv_scales",
            format!("made for a cache of shape {:?}, the cache is {:?}", s.shape.dims(), kv.cache.shape().dims()),
        ));
    }
    Ok(())
}

/// Checks that a fused QKV into a quantized cache writes whole heads: its `kv_cols` K/V columns
/// are all of the cache's (an MLA weight may write fewer; their groups would mix new and old
/// values under one scale).
pub(crate) fn check_columns<C: Element>(kv: &KvWrite<'_, C>, kv_cols: usize) -> Result<()> {
    let shape = kv.cache.shape();
    let full = shape.kv_dim() * shape.kv_width();
    if kv.scales.is_some() && kv_cols != full {
        return Err(Error::Unsupported {
            what: format!(
                "a quantized cache written by a fused QKV whose weight has {kv_cols} K/V rows: \
                 it must write whole heads ({full} rows)"
            ),
        });
    }
    Ok(())
}

/// A staging cache of `S` for a quantized write: row `i` of `rows` (the real slot of the plan's
/// `i`-th writing row) is staged at block `i` of a one-layer, one-slot-per-page cache. Its
/// buffers come from the thread's pool (`crate::pool`): a steady-state call allocates nothing.
pub(crate) struct Stage<S: Element> {
    /// The staging cache's shape, `[rows, kv_dim, 1, 1, num_kv_heads, head_size]`.
    pub shape: CacheShape,
    /// Its values (zeros before the write).
    pub data: Pooled<S>,
    /// The call's plan with each writing row moved to its staging block.
    pub plan: SlotPlan,
    /// `(staged row, real slot)` of each staged row, in order.
    pub rows: Pooled<(usize, RowSlot)>,
}

impl<S: Element> Stage<S> {
    /// Stages the writing rows of `plan` (a validated plan of a cache of `shape`).
    pub fn new(plan: &SlotPlan, shape: CacheShape) -> Result<Self> {
        let rows: Pooled<(usize, RowSlot)> = plan.rows.iter().flatten().copied().enumerate().collect();
        let st = CacheShape::new(rows.len().max(1), shape.kv_dim(), 1, 1, shape.num_kv_heads(), shape.head_size())?;
        let mut i = 0;
        let staged = plan
            .rows
            .iter()
            .map(|s| {
                s.map(|s| {
                    i += 1;
                    RowSlot { block: i - 1, offset: 0, ..s }
                })
            })
            .collect();
        Ok(Stage { shape: st, data: Pooled::filled(S::default(), st.len()), plan: SlotPlan { rows: staged }, rows })
    }

    /// The staging cache as a write of layer 0 (the page table is never read through it: the
    /// staged plan addresses the rows).
    pub fn kv<'a>(&'a mut self, page_table: PageTable<'a>) -> KvWrite<'a, S> {
        let cache = PagedKvCacheMut::new(self.shape, &mut self.data).expect("the staging cache's own shape");
        KvWrite::new(cache, page_table, 0)
    }

    /// The staged values `(K or V)` of staged row `i`: `num_kv_heads · head_size` values.
    pub fn part(&self, i: usize, which: KvSel) -> &[S] {
        let at = self.shape.index(i, which as usize, 0, 0, 0, 0);
        &self.data[at..at + self.shape.kv_width()]
    }
}
