//! NVIDIA's 5-D block-scale layout (the tcgen05 "SF atom" layout MAX uses, [semantics §2](crate::semantics)).
//!
//! An operand with `R` rows and `Kb = ceil(K / V)` k-blocks stores its scales as a row-major
//! `[ceil(R/128), ceil(Kb/4), 32, 4, 4]` tensor. Scale `(r, kb)` lives at coordinate
//! `(r / 128, kb / 4, r % 32, (r % 128) / 32, kb % 4)`. Each 128-row × 4-block tile is 512
//! contiguous bytes. Slots for rows ≥ R or blocks ≥ Kb are padding: producers write 0 there,
//! consumers never read them.

use crate::error::{Error, Result, checked_len};

/// Rows per scale tile (`SF_MN_GROUP_SIZE`).
pub const ROWS_PER_TILE: usize = 128;
/// K-blocks per scale tile (`SF_ATOM_K`).
pub const BLOCKS_PER_TILE: usize = 4;
/// Bytes in one 128 × 4 tile.
pub const TILE_LEN: usize = ROWS_PER_TILE * BLOCKS_PER_TILE;

/// The 5-D scale layout of one operand: `rows` rows and `k_blocks` scale blocks per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScaleLayout {
    rows: usize,
    k_blocks: usize,
}

impl ScaleLayout {
    /// Layout for `rows` rows with `k_blocks` scale blocks each.
    pub fn new(rows: usize, k_blocks: usize) -> Self {
        ScaleLayout { rows, k_blocks }
    }

    /// Layout for an operand of `rows` rows and logical length `k`, one scale per `vector_size`
    /// elements (a partial last block gets a scale too).
    pub fn for_operand(rows: usize, k: usize, vector_size: usize) -> Self {
        ScaleLayout::new(rows, k.div_ceil(vector_size))
    }

    /// Rows of the operand.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Scale blocks per row (`Kb`).
    pub fn k_blocks(&self) -> usize {
        self.k_blocks
    }

    /// `[ceil(R/128), ceil(Kb/4), 32, 4, 4]`.
    pub fn shape(&self) -> [usize; 5] {
        [self.rows.div_ceil(ROWS_PER_TILE), self.k_blocks.div_ceil(BLOCKS_PER_TILE), 32, 4, 4]
    }

    /// Number of bytes (elements) of the 5-D tensor, padding included; an error if it overflows.
    pub fn checked_len(&self) -> Result<usize> {
        checked_len("scales", &self.shape())
    }

    /// Number of elements of the 5-D tensor, padding included. Panics on `usize` overflow;
    /// [`checked_len`](Self::checked_len) does not.
    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Flat offset of the scale of row `r`, k-block `kb` (`r < rows`, `kb < k_blocks`):
    /// `((((r/128)·ceil(Kb/4) + kb/4)·32 + r%32)·4 + (r%128)/32)·4 + kb%4`.
    #[inline]
    pub fn offset(&self, r: usize, kb: usize) -> usize {
        debug_assert!(r < self.rows && kb < self.k_blocks);
        let kb_tiles = self.k_blocks.div_ceil(BLOCKS_PER_TILE);
        ((((r / 128) * kb_tiles + kb / 4) * 32 + r % 32) * 4 + (r % 128) / 32) * 4 + kb % 4
    }

    /// Converts a plain row-major `[rows, k_blocks]` scale matrix to the 5-D layout, writing
    /// `T::default()` (zero) into every padding slot (MAX's `block_scales_interleave`).
    pub fn interleave<T: Copy + Default>(&self, plain: &[T]) -> Result<Vec<T>> {
        let want = checked_len("scales", &[self.rows, self.k_blocks])?;
        if plain.len() != want {
            return Err(Error::dims("scales", &[self.rows, self.k_blocks], plain.len()));
        }
        let mut out = vec![T::default(); self.checked_len()?];
        for r in 0..self.rows {
            for kb in 0..self.k_blocks {
                out[self.offset(r, kb)] = plain[r * self.k_blocks + kb];
            }
        }
        Ok(out)
    }

    /// Converts a 5-D scale tensor back to the plain `[rows, k_blocks]` matrix (padding dropped).
    pub fn deinterleave<T: Copy>(&self, five_d: &[T]) -> Result<Vec<T>> {
        let want = self.checked_len()?;
        if five_d.len() != want {
            return Err(Error::dims("scales", &self.shape(), five_d.len()));
        }
        let mut out = Vec::with_capacity(self.rows * self.k_blocks);
        for r in 0..self.rows {
            for kb in 0..self.k_blocks {
                out.push(five_d[self.offset(r, kb)]);
            }
        }
        Ok(out)
    }
}
