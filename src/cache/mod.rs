//! The paged KV cache ([semantics §3](crate::semantics)): storage `[num_blocks, kv_dim, num_layers, page_size,
//! num_kv_heads, head_size]`, owned or borrowed, and the page table MAX passes with it.

pub(crate) mod plan;
pub(crate) mod quant;

pub(crate) use plan::{RowSlot, SeqCursor, SeqSlots, SlotPlan};
pub use quant::{KvScales, KvScalesMut};

use crate::element::Element;
use crate::error::{Error, Result, checked_len};

/// Which half of an MHA/GQA cache: K (`kv = 0`) or V (`kv = 1`). MLA caches have only K.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvSel {
    /// The key cache (`kv = 0`).
    K = 0,
    /// The value cache (`kv = 1`).
    V = 1,
}

/// The dimensions of a paged cache, row-major
/// `[num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheShape {
    num_blocks: usize,
    kv_dim: usize,
    num_layers: usize,
    page_size: usize,
    num_kv_heads: usize,
    head_size: usize,
}

impl CacheShape {
    /// Checks and builds a shape. `kv_dim` is 2 (K and V) or 1 (MLA, K only); every other
    /// dimension must be at least 1 and the total size must fit in `usize`.
    pub fn new(
        num_blocks: usize,
        kv_dim: usize,
        num_layers: usize,
        page_size: usize,
        num_kv_heads: usize,
        head_size: usize,
    ) -> Result<Self> {
        if kv_dim != 1 && kv_dim != 2 {
            return Err(Error::dim("kv_blocks", format!("kv_dim (dim 1) must be 1 (MLA) or 2, found {kv_dim}")));
        }
        for (name, d) in [
            ("num_blocks", num_blocks),
            ("num_layers", num_layers),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_size", head_size),
        ] {
            if d == 0 {
                return Err(Error::dim("kv_blocks", format!("{name} must be at least 1")));
            }
        }
        let s = CacheShape { num_blocks, kv_dim, num_layers, page_size, num_kv_heads, head_size };
        checked_len("kv_blocks", &s.dims())?;
        Ok(s)
    }

    /// An MHA/GQA cache (`kv_dim = 2`).
    pub fn mha(
        num_blocks: usize,
        num_layers: usize,
        page_size: usize,
        num_kv_heads: usize,
        head_size: usize,
    ) -> Result<Self> {
        CacheShape::new(num_blocks, 2, num_layers, page_size, num_kv_heads, head_size)
    }

    /// An MLA cache (`kv_dim = 1`, K only).
    pub fn mla(
        num_blocks: usize,
        num_layers: usize,
        page_size: usize,
        num_kv_heads: usize,
        head_size: usize,
    ) -> Result<Self> {
        CacheShape::new(num_blocks, 1, num_layers, page_size, num_kv_heads, head_size)
    }

    /// From a rank-6 shape as stored in `kv_blocks`.
    pub fn from_dims(dims: &[usize]) -> Result<Self> {
        match *dims {
            [a, b, c, d, e, f] => CacheShape::new(a, b, c, d, e, f),
            _ => Err(Error::Shape { arg: "kv_blocks", expected: crate::error::Expected::Rank(6), found: dims.len() }),
        }
    }

    /// The six dimensions.
    pub fn dims(&self) -> [usize; 6] {
        [self.num_blocks, self.kv_dim, self.num_layers, self.page_size, self.num_kv_heads, self.head_size]
    }
    /// Physical blocks (pages).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    /// 2 for K and V, 1 for MLA.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }
    /// Whether this is an MLA (K-only) cache.
    pub fn is_mla(&self) -> bool {
        self.kv_dim == 1
    }
    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }
    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// KV heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }
    /// Head size.
    pub fn head_size(&self) -> usize {
        self.head_size
    }
    /// `num_kv_heads · head_size`: columns of K (and of V) in the fused weight.
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_size
    }
    /// Total elements.
    pub fn len(&self) -> usize {
        self.dims().iter().product()
    }
    /// Whether the cache has no elements (never, for a checked shape).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Flat index of `[block, kv, layer, slot, head, dim]` ([semantics §3](crate::semantics)).
    #[inline]
    pub fn index(&self, block: usize, kv: usize, layer: usize, slot: usize, head: usize, dim: usize) -> usize {
        debug_assert!(block < self.num_blocks && kv < self.kv_dim && layer < self.num_layers);
        debug_assert!(slot < self.page_size && head < self.num_kv_heads && dim < self.head_size);
        ((((block * self.kv_dim + kv) * self.num_layers + layer) * self.page_size + slot) * self.num_kv_heads + head)
            * self.head_size
            + dim
    }
    /// The fused-QKV router: where column `j` of the K|V part of a fused QKV result goes
    /// (`j = column − q_dim`), as `(K or V, head, dim)`. MHA/GQA: the first
    /// [`kv_width`](Self::kv_width) columns are the K heads in order, the next ones the V heads;
    /// MLA: every column goes to K head 0, dim `j`. Columns `< q_dim` go to the output.
    #[inline]
    pub fn kv_column(&self, j: usize) -> (KvSel, usize, usize) {
        let (hd, kvw) = (self.head_size, self.kv_width());
        if self.is_mla() {
            (KvSel::K, 0, j)
        } else if j < kvw {
            (KvSel::K, j / hd, j % hd)
        } else {
            (KvSel::V, (j - kvw) / hd, (j - kvw) % hd)
        }
    }
    /// The offset of [`kv_column`](Self::kv_column)`(j)` from the first element of the token's
    /// slot, [`slot_base`](Self::slot_base).
    #[inline]
    pub fn kv_column_offset(&self, j: usize) -> usize {
        let (kv, h, d) = self.kv_column(j);
        self.index(0, kv as usize, 0, 0, h, d)
    }
    /// Flat index of `[block, 0, layer, slot, 0, 0]`: the first element a token stored at
    /// (block, slot) of `layer` owns (its K heads; its V heads follow at
    /// [`kv_column_offset`](Self::kv_column_offset)).
    #[inline]
    pub fn slot_base(&self, block: usize, layer: usize, slot: usize) -> usize {
        self.index(block, 0, layer, slot, 0, 0)
    }
    /// [`slot_base`](Self::slot_base) of `layer` as a function of `(block, slot)`, the strides
    /// computed once: two multiplications per row instead of `index`'s chain of five (the
    /// per-row slot bases were ~3 % of a 512-row Qwen-shaped bf16 RoPE call, AMD Zen 5, `perf`).
    #[inline]
    pub(crate) fn slot_base_fn(&self, layer: usize) -> impl Fn(usize, usize) -> usize + use<> {
        let (block, at, slot) = self.slot_strides(layer);
        move |b, s| b * block + at + s * slot
    }
    /// The strides of [`slot_base_fn`](Self::slot_base_fn): `slot_base(b, layer, s) = b · block
    /// + at + s · slot` as `(block, at, slot)`.
    #[inline]
    pub(crate) fn slot_strides(&self, layer: usize) -> (usize, usize, usize) {
        let slot = self.num_kv_heads * self.head_size;
        (self.kv_dim * self.num_layers * self.page_size * slot, layer * self.page_size * slot, slot)
    }
    /// The coordinates `[block, kv, layer, slot, head, dim]` of a flat index.
    pub fn coords(&self, mut index: usize) -> [usize; 6] {
        let dims = self.dims();
        let mut c = [0; 6];
        for i in (0..6).rev() {
            c[i] = index % dims[i];
            index /= dims[i];
        }
        c
    }
}

/// An owned paged KV cache.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedKvCache<T> {
    shape: CacheShape,
    data: Vec<T>,
}

impl<T: Element> PagedKvCache<T> {
    /// A zero-filled cache.
    pub fn zeros(shape: CacheShape) -> Self {
        PagedKvCache { shape, data: vec![T::default(); shape.len()] }
    }
    /// Wraps existing storage; its length must be `shape.len()`.
    pub fn from_vec(shape: CacheShape, data: Vec<T>) -> Result<Self> {
        expect_cache_len(&shape, data.len())?;
        Ok(PagedKvCache { shape, data })
    }
    /// The shape.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }
    /// The storage.
    pub fn data(&self) -> &[T] {
        &self.data
    }
    /// The storage, mutably.
    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
    /// Gives the storage back.
    pub fn into_vec(self) -> Vec<T> {
        self.data
    }
    /// A mutable view, as the operations take it.
    pub fn view_mut(&mut self) -> PagedKvCacheMut<'_, T> {
        PagedKvCacheMut { shape: self.shape, data: &mut self.data }
    }
    /// Element `[block, kv, layer, slot, head, dim]` (panics when out of range, like slice indexing).
    pub fn get(&self, block: usize, kv: usize, layer: usize, slot: usize, head: usize, dim: usize) -> T {
        self.data[self.shape.index(block, kv, layer, slot, head, dim)]
    }
}

/// A mutable view of a paged cache over caller-owned memory (a server owns its cache memory).
#[derive(Debug)]
pub struct PagedKvCacheMut<'a, T> {
    shape: CacheShape,
    data: &'a mut [T],
}

impl<'a, T: Element> PagedKvCacheMut<'a, T> {
    /// Wraps caller-owned storage; its length must be `shape.len()`.
    pub fn new(shape: CacheShape, data: &'a mut [T]) -> Result<Self> {
        expect_cache_len(&shape, data.len())?;
        Ok(PagedKvCacheMut { shape, data })
    }
    /// The shape.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }
    /// The storage.
    pub fn data(&self) -> &[T] {
        self.data
    }
    /// The storage, mutably.
    pub fn data_mut(&mut self) -> &mut [T] {
        self.data
    }
    /// A shorter-lived view of the same cache.
    pub fn reborrow(&mut self) -> PagedKvCacheMut<'_, T> {
        PagedKvCacheMut { shape: self.shape, data: self.data }
    }
}

fn expect_cache_len(shape: &CacheShape, len: usize) -> Result<()> {
    if len == shape.len() { Ok(()) } else { Err(Error::dims("kv_blocks", &shape.dims(), len)) }
}

/// MAX's page table: `kv_lookup_table` `[batch, cols]` (entry `[b, j]` is the physical block of
/// logical page `j` of sequence `b`) and `cache_lengths` `[batch]` (tokens already cached).
#[derive(Debug, Clone, Copy)]
pub struct PageTable<'a> {
    lookup: &'a [u32],
    cols: usize,
    cache_lengths: &'a [u32],
}

impl<'a> PageTable<'a> {
    /// Checks `lookup.len() == cache_lengths.len() · cols`. Entries are checked against a cache
    /// by each operation, for the pages it writes.
    pub fn new(lookup: &'a [u32], cols: usize, cache_lengths: &'a [u32]) -> Result<Self> {
        let want = checked_len("kv_lookup_table", &[cache_lengths.len(), cols])?;
        if lookup.len() != want {
            return Err(Error::dims("kv_lookup_table", &[cache_lengths.len(), cols], lookup.len()));
        }
        Ok(PageTable { lookup, cols, cache_lengths })
    }
    /// Sequences in the batch.
    pub fn batch_size(&self) -> usize {
        self.cache_lengths.len()
    }
    /// Columns of the lookup table (logical pages per sequence).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// `cache_lengths[b]`.
    pub fn cache_length(&self, b: usize) -> u32 {
        self.cache_lengths[b]
    }
    /// `cache_lengths`.
    pub fn cache_lengths(&self) -> &'a [u32] {
        self.cache_lengths
    }
    /// `kv_lookup_table`, flat.
    pub fn lookup(&self) -> &'a [u32] {
        self.lookup
    }
    /// `kv_lookup_table[b, page]`.
    pub fn block(&self, b: usize, page: usize) -> u32 {
        self.lookup[b * self.cols + page]
    }
}

/// A cache to write, the page table that addresses it and the layer: the cache side of every
/// operation. With [`scales`](Self::scales) the cache is FP8-quantized ([`KvScalesMut`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct KvWrite<'a, T> {
    /// The cache.
    pub cache: PagedKvCacheMut<'a, T>,
    /// Its page table for this batch.
    pub page_table: PageTable<'a>,
    /// The layer written (`layer_idx`).
    pub layer_idx: usize,
    /// The scales of a quantized (E4M3) cache, or `None`: every operation then quantizes each
    /// group of K/V it writes ([semantics §3.1](crate::semantics)).
    pub scales: Option<KvScalesMut<'a>>,
}

impl<'a, T: Element> KvWrite<'a, T> {
    /// Bundles the three (an unquantized cache: an E4M3 cache without scales stores each value
    /// rounded to E4M3, scale 1).
    pub fn new(cache: PagedKvCacheMut<'a, T>, page_table: PageTable<'a>, layer_idx: usize) -> Self {
        KvWrite { cache, page_table, layer_idx, scales: None }
    }
    /// The same write into an FP8-quantized cache: `T` must be [`E4M3`](crate::E4M3) and the
    /// scales made for this cache's shape (each operation checks both before it writes).
    ///
    /// # Examples
    /// ```
    /// use paged_qkv::{CacheShape, E4M3, Exec, KvScales, KvSel, KvStoreRaggedArgs, KvWrite, PageTable, PagedKvCache, bf16, fast};
    ///
    /// # fn main() -> paged_qkv::Result<()> {
    /// let shape = CacheShape::mha(2, 1, 4, 1, 128)?; // one KV head of 128
    /// let mut codes = PagedKvCache::<E4M3>::zeros(shape);
    /// let mut scales = KvScales::zeros(shape, 128)?; // one scale per head
    /// let k: Vec<bf16> = (0..128).map(|i| bf16::from_f32(i as f32 - 64.0)).collect(); // one token
    /// let table = PageTable::new(&[1], 1, &[0])?; // its page is block 1
    /// let mut kv = KvWrite::new(codes.view_mut(), table, 0).with_scales(scales.view_mut());
    /// fast::kv_store_ragged(&KvStoreRaggedArgs::new(&k, &[0, 1], KvSel::K), &mut kv, Exec::default())?;
    /// let scale = scales.get(1, 0, 0, 0, 0, 0);
    /// assert_eq!(scale, 64.0 / 448.0); // amax / 448
    /// assert!((codes.get(1, 0, 0, 0, 0, 0).to_f32() * scale + 64.0).abs() < 1e-4); // -64 → code -448
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_scales(self, scales: KvScalesMut<'a>) -> Self {
        KvWrite { scales: Some(scales), ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::CacheShape;

    /// `slot_base_fn` gives `slot_base` (the 6-D index) for every block, layer and slot, on MHA
    /// and MLA shapes of several layers, page sizes (a power of two or not) and head counts.
    #[test]
    fn slot_base_fn_equals_slot_base() {
        let shapes = [
            CacheShape::mha(3, 4, 5, 2, 8).unwrap(),
            CacheShape::mha(2, 1, 16, 8, 128).unwrap(),
            CacheShape::mla(4, 3, 7, 1, 576).unwrap(),
            CacheShape::mha(1, 2, 1, 1, 1).unwrap(),
        ];
        for shape in shapes {
            for layer in 0..shape.num_layers() {
                let base = shape.slot_base_fn(layer);
                for block in 0..shape.num_blocks() {
                    for slot in 0..shape.page_size() {
                        assert_eq!(
                            base(block, slot),
                            shape.slot_base(block, layer, slot),
                            "{shape:?} {layer} {block} {slot}"
                        );
                    }
                }
            }
        }
    }
}
