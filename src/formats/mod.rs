//! Data formats: E2M1 (FP4), E4M3 and E8M0 (FP8), the 5-D block-scale layout, and the
//! block-scaled matrix types with their quantizers.

pub mod fp4;
pub mod fp8;
pub mod quantize;
pub mod scale_layout;

use crate::error::{Error, Result, checked_len};
use scale_layout::ScaleLayout;

pub use crate::dtype::BlockFormat;

/// Decoding, which belongs to the formats (the type itself lives in the leaf `dtype` module).
impl BlockFormat {
    /// Decodes a scale byte to f32: `|E4M3|` for NVFP4, E8M0 for the MX formats (NaN for NaN codes).
    #[inline]
    pub fn scale_to_f32(self, byte: u8) -> f32 {
        match self {
            BlockFormat::Nvfp4 => fp8::e4m3_scale_to_f32(byte),
            BlockFormat::Mxfp4 | BlockFormat::Mxfp8 => fp8::e8m0_to_f32(byte),
        }
    }

    /// Decodes logical element `k` of a data row (E2M1 or E4M3) to f32.
    #[inline]
    pub fn element_to_f32(self, row: &[u8], k: usize) -> f32 {
        if self.is_fp4() { fp4::e2m1_to_f32(fp4::fp4_code(row, k)) } else { fp8::e4m3_to_f32(row[k]) }
    }
}

/// A borrowed block-scaled matrix: `rows × k` logical elements with its 5-D scales, validated,
/// and the tensor's dequantization multiplier (1 unless set).
#[derive(Debug, Clone, Copy)]
pub struct QuantizedRef<'a> {
    format: BlockFormat,
    rows: usize,
    k: usize,
    data: &'a [u8],
    scales: &'a [u8],
    tensor_scale: f32,
}

impl<'a> QuantizedRef<'a> {
    /// Checks and wraps `data` (row-major `[rows, k/2]` packed FP4, or `[rows, k]` E4M3) and
    /// `scales` (5-D `[ceil(rows/128), ceil(ceil(k/V)/4), 32, 4, 4]`). `arg` names the tensor in
    /// errors (`hidden_state` or `weight`; its scales are `input_scale` or `weight_scale`).
    pub fn new(format: BlockFormat, rows: usize, k: usize, data: &'a [u8], scales: &'a [u8]) -> Result<Self> {
        // K = 0 would let any row count pass with empty data (and size allocations by it).
        if k == 0 || (format.is_fp4() && !k.is_multiple_of(2)) {
            return Err(Error::dim("k", format!("must be at least 1 (even for packed FP4), found {k}")));
        }
        let want = checked_len("data", &[rows, format.row_bytes(k)])?;
        if data.len() != want {
            return Err(Error::dims("data", &[rows, format.row_bytes(k)], data.len()));
        }
        let layout = ScaleLayout::for_operand(rows, k, format.vector_size());
        let want = layout.checked_len()?;
        if scales.len() != want {
            return Err(Error::dims("scales", &layout.shape(), scales.len()));
        }
        Ok(QuantizedRef { format, rows, k, data, scales, tensor_scale: 1.0 })
    }

    /// The same matrix with its dequantization multiplier `tensor_scale` (see
    /// [`QuantizedMatrix::tensor_scale`]); [`PackedWeights`](crate::PackedWeights) remembers it.
    pub fn with_tensor_scale(self, tensor_scale: f32) -> Self {
        QuantizedRef { tensor_scale, ..self }
    }
    /// The dequantization multiplier (1 unless set by [`with_tensor_scale`](Self::with_tensor_scale)
    /// or taken from a [`QuantizedMatrix`]).
    pub fn tensor_scale(&self) -> f32 {
        self.tensor_scale
    }

    /// The format.
    pub fn format(&self) -> BlockFormat {
        self.format
    }
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Logical K (elements per row).
    pub fn k(&self) -> usize {
        self.k
    }
    /// Raw data bytes.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
    /// Raw 5-D scale bytes.
    pub fn scales(&self) -> &'a [u8] {
        self.scales
    }
    /// Scale blocks per row.
    pub fn k_blocks(&self) -> usize {
        self.k.div_ceil(self.format.vector_size())
    }
    /// The 5-D layout of the scales.
    pub fn scale_layout(&self) -> ScaleLayout {
        ScaleLayout::new(self.rows, self.k_blocks())
    }
    /// Data bytes of row `r`.
    #[inline]
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.format.row_bytes(self.k);
        &self.data[r * rb..(r + 1) * rb]
    }
    /// Raw scale byte of row `r`, block `kb`.
    #[inline]
    pub fn scale_byte(&self, r: usize, kb: usize) -> u8 {
        self.scales[self.scale_layout().offset(r, kb)]
    }
    /// The scale bytes of row `r` into `out` (`k_blocks` long): runs of four blocks, one per
    /// 5-D tile (`scale_byte` of block `kb` is at the row's first offset `+ (kb/4) · 512 + kb % 4`).
    pub(crate) fn scale_row(&self, r: usize, out: &mut [u8]) {
        const TILE: usize = 32 * 4 * 4;
        let base = self.scale_layout().offset(r, 0);
        for (t, run) in out.chunks_mut(4).enumerate() {
            let at = base + t * TILE;
            run.copy_from_slice(&self.scales[at..at + run.len()]);
        }
    }
    /// Decoded scale of row `r`, block `kb` (`|E4M3|` or E8M0).
    #[inline]
    pub fn scale(&self, r: usize, kb: usize) -> f32 {
        self.format.scale_to_f32(self.scale_byte(r, kb))
    }
}

/// An owned block-scaled matrix, as the quantizers produce it.
///
/// **Direction of `tensor_scale`:** it is a *dequantization multiplier*: element `(r, k)` stands
/// for `tensor_scale · dec(code) · dec(block_scale)`. For a product `A · Wᵀ` pass MAX's
/// `tensor_sf = a.tensor_scale() · w.tensor_scale()`, which multiplies the f32 accumulator.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedMatrix {
    format: BlockFormat,
    rows: usize,
    k: usize,
    data: Vec<u8>,
    scales: Vec<u8>,
    tensor_scale: f32,
}

impl QuantizedMatrix {
    /// Assembles a matrix from its parts, checking them as [`QuantizedRef::new`] does.
    pub fn from_parts(
        format: BlockFormat,
        rows: usize,
        k: usize,
        data: Vec<u8>,
        scales: Vec<u8>,
        tensor_scale: f32,
    ) -> Result<Self> {
        QuantizedRef::new(format, rows, k, &data, &scales)?;
        Ok(QuantizedMatrix { format, rows, k, data, scales, tensor_scale })
    }
    /// Borrows it as a [`QuantizedRef`].
    pub fn as_ref(&self) -> QuantizedRef<'_> {
        QuantizedRef {
            format: self.format,
            rows: self.rows,
            k: self.k,
            data: &self.data,
            scales: &self.scales,
            tensor_scale: self.tensor_scale,
        }
    }
    /// The format.
    pub fn format(&self) -> BlockFormat {
        self.format
    }
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Logical K.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Row-major data: `[rows, k/2]` packed E2M1 or `[rows, k]` E4M3.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
    /// 5-D block scales, zero padding included.
    pub fn scales(&self) -> &[u8] {
        &self.scales
    }
    /// Dequantization multiplier (`1 / global_scale` for NVFP4, 1 for the MX formats).
    pub fn tensor_scale(&self) -> f32 {
        self.tensor_scale
    }
    /// `(data, scales, tensor_scale)`.
    pub fn into_parts(self) -> (Vec<u8>, Vec<u8>, f32) {
        (self.data, self.scales, self.tensor_scale)
    }
}

pub(crate) fn check_len_2d(arg: &'static str, len: usize, rows: usize, cols: usize) -> Result<()> {
    let want = checked_len(arg, &[rows, cols])?;
    if len == want { Ok(()) } else { Err(Error::dims(arg, &[rows, cols], len)) }
}
