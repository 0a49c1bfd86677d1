//! The crate's one error type. Every rejection names the argument, what was expected and what was found.

use crate::dtype::BlockFormat;
use std::fmt;

/// A (batch, position) pair naming one token of a call: `position` is the cache position
/// `cache_lengths[batch] + t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRef {
    /// Sequence index in the batch.
    pub batch: usize,
    /// Cache position of the token (`cache_lengths[batch] + t`).
    pub position: u64,
}

/// Everything a public entry point can reject. Returned before anything is written: when an
/// operation returns an error, its output and the whole cache are unchanged.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A tensor's length or rank disagrees with what the other arguments imply.
    Shape {
        /// The argument (MAX's name where there is one).
        arg: &'static str,
        /// What the other arguments imply.
        expected: Expected,
        /// What was passed: the length of the slice (elements or entries), or for
        /// [`Expected::Rank`] the rank.
        found: usize,
    },
    /// A dimension that is invalid on its own (zero, odd where it must be even, too large).
    InvalidDim {
        /// The argument.
        arg: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// `input_row_offsets` does not start at 0, decreases, or does not end at the row count.
    RowOffsets {
        /// Index of the offending entry.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The weight's N does not split into Q | K | V for this cache.
    ColumnSplit {
        /// Rows of the weight (N).
        n: usize,
        /// Columns routed to the output.
        q_dim: usize,
        /// `num_kv_heads * head_size` of the cache.
        kv_width: usize,
        /// Whether the cache is MLA (K only): then `N - q_dim` must be in `1..=head_size`.
        mla: bool,
    },
    /// `layer_idx` is not a layer of the cache.
    LayerOutOfRange {
        /// The layer asked for.
        layer: usize,
        /// Layers in the cache.
        num_layers: usize,
    },
    /// `valid_lengths[batch]` exceeds the padded sequence length.
    ValidLength {
        /// Sequence index.
        batch: usize,
        /// `valid_lengths[batch]`.
        valid_length: u32,
        /// The padded sequence length.
        seq_len: usize,
    },
    /// A token's cache position does not fit in `u32`.
    PositionOverflow {
        /// Sequence index.
        batch: usize,
        /// `cache_lengths[batch]`.
        cache_length: u32,
        /// New tokens of the sequence in this call.
        new_tokens: usize,
    },
    /// The lookup table row has too few columns for `cache_length + new_tokens`.
    PageTableCapacity {
        /// Sequence index.
        batch: usize,
        /// Pages needed to hold `cache_lengths[batch] + new_tokens` tokens.
        pages_needed: u64,
        /// Columns of `kv_lookup_table`.
        cols: usize,
    },
    /// A lookup-table entry that this call writes through is not a block of the cache.
    BlockOutOfRange {
        /// Sequence index.
        batch: usize,
        /// Logical page (column of `kv_lookup_table`).
        logical_page: usize,
        /// The entry found there.
        block: u32,
        /// Blocks in the cache.
        num_blocks: usize,
    },
    /// Two tokens of one call would write the same physical cache slot.
    SlotConflict {
        /// Physical block.
        block: u32,
        /// Slot within the block (page offset).
        slot: usize,
        /// The first token writing it.
        first: TokenRef,
        /// The second token writing it.
        second: TokenRef,
    },
    /// `freqs_cis` (or `position_ids`) has no row for a position the call uses.
    FreqsRows {
        /// The position needing a row.
        position: u64,
        /// Rows of `freqs_cis`.
        rows: usize,
    },
    /// The activations and the weight disagree on the block-scaled format or on K.
    FormatMismatch {
        /// The activations' format (`hidden_state`).
        hidden_state: BlockFormat,
        /// The activations' logical K.
        hidden_k: usize,
        /// The weight's format.
        weight: BlockFormat,
        /// The weight's logical K.
        weight_k: usize,
    },
    /// A value that must be finite is NaN or infinite.
    NonFinite {
        /// The argument.
        arg: &'static str,
        /// Flat index of the first offending element.
        index: usize,
    },
    /// The combination is valid MAX input but not supported here.
    Unsupported {
        /// What is not supported.
        what: String,
    },
}

/// What a [`Error::Shape`] expected.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Expected {
    /// Exactly these dimensions (row-major; the length is their product).
    Dims(Vec<usize>),
    /// Any whole number of rows of this width (e.g. `[N, hidden_size]`, `[rows, rope_dim]`).
    RowsOf(usize),
    /// At least this many entries.
    AtLeast(usize),
    /// This rank.
    Rank(usize),
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expected::Dims(d) => match d.iter().try_fold(1usize, |a, &x| a.checked_mul(x)) {
                Some(n) => write!(f, "{n} elements ({d:?})"),
                None => write!(f, "{d:?} (overflows usize)"),
            },
            Expected::RowsOf(w) => write!(f, "a multiple of {w} elements ([rows, {w}])"),
            Expected::AtLeast(n) => write!(f, "at least {n} entries"),
            Expected::Rank(r) => write!(f, "rank {r}"),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// `arg` must have exactly `dims`; it has `found` elements.
    pub(crate) fn dims(arg: &'static str, dims: &[usize], found: usize) -> Self {
        Error::Shape { arg, expected: Expected::Dims(dims.to_vec()), found }
    }

    pub(crate) fn dim(arg: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidDim { arg, reason: reason.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Shape { arg, expected: Expected::Rank(r), found } => {
                write!(f, "`{arg}`: expected rank {r}, found rank {found}")
            }
            Error::Shape { arg, expected, found } => {
                write!(f, "`{arg}`: expected {expected}, found {found} elements")
            }
            Error::InvalidDim { arg, reason } => write!(f, "`{arg}`: {reason}"),
            Error::RowOffsets { index, reason } => {
                write!(f, "`input_row_offsets[{index}]`: {reason}")
            }
            // u128: the sum of two usize values never overflows it (the inputs may be anything).
            Error::ColumnSplit { n, q_dim, kv_width, mla: false } => write!(
                f,
                "`weight`: N = {n} rows, expected q_dim + 2*kv_dim = {q_dim} + 2*{kv_width} = {}",
                *q_dim as u128 + 2 * *kv_width as u128
            ),
            Error::ColumnSplit { n, q_dim, kv_width, mla: true } => write!(
                f,
                "`weight`: N = {n} rows, expected q_dim + 1..={kv_width} (MLA: N - q_dim columns go to K head 0) with q_dim = {q_dim}"
            ),
            Error::LayerOutOfRange { layer, num_layers } => {
                write!(f, "`layer_idx`: expected < {num_layers}, found {layer}")
            }
            Error::ValidLength { batch, valid_length, seq_len } => {
                write!(f, "`valid_lengths[{batch}]`: expected <= seq_len {seq_len}, found {valid_length}")
            }
            Error::PositionOverflow { batch, cache_length, new_tokens } => {
                write!(f, "`cache_lengths[{batch}]`: {cache_length} + {new_tokens} new tokens overflows u32 positions")
            }
            Error::PageTableCapacity { batch, pages_needed, cols } => write!(
                f,
                "`kv_lookup_table`: sequence {batch} needs {pages_needed} pages, the table has {cols} columns"
            ),
            Error::BlockOutOfRange { batch, logical_page, block, num_blocks } => {
                write!(f, "`kv_lookup_table[{batch}, {logical_page}]`: expected a block < {num_blocks}, found {block}")
            }
            Error::SlotConflict { block, slot, first, second } => write!(
                f,
                "`kv_lookup_table`: block {block} slot {slot} is written twice: by (batch {}, position {}) and (batch {}, position {})",
                first.batch, first.position, second.batch, second.position
            ),
            Error::FreqsRows { position, rows } => {
                write!(f, "`freqs_cis`: position {position} needs row {position}, the table has {rows} rows")
            }
            Error::FormatMismatch { hidden_state, hidden_k, weight, weight_k } => write!(
                f,
                "format mismatch: hidden_state is {} with K = {hidden_k}, weight is {} with K = {weight_k}",
                hidden_state.name(),
                weight.name()
            ),
            Error::NonFinite { arg, index } => {
                write!(f, "`{arg}`: element {index} is not finite")
            }
            Error::Unsupported { what } => write!(f, "unsupported: {what}"),
        }
    }
}

impl std::error::Error for Error {}

/// Product of dimensions, or an error naming `arg` when it overflows `usize`.
pub(crate) fn checked_len(arg: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::dim(arg, format!("the size {dims:?} overflows usize")))
}

/// N of a `[N, k]` weight, or the error the reference gives.
pub(crate) fn weight_rows<T>(weight: &[T], k: usize) -> Result<usize> {
    if k == 0 {
        return Err(Error::dim("hidden_size", "must be at least 1"));
    }
    if !weight.len().is_multiple_of(k) {
        return Err(Error::Shape { arg: "weight", expected: Expected::RowsOf(k), found: weight.len() });
    }
    Ok(weight.len() / k)
}
