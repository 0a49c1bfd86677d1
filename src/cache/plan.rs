//! Validation of a call's cache writes, done once before anything is written: layer in range,
//! positions fit `u32`, the lookup table holds every page the new tokens need and those entries
//! are blocks of the cache, and no two tokens write one physical slot.

use super::{CacheShape, PageTable};
use crate::error::{Error, Result, TokenRef};
use crate::pool::Pooled;

/// Where one row's K/V go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowSlot {
    /// Sequence index.
    pub batch: usize,
    /// Cache position `cache_lengths[batch] + t`.
    pub pos: u32,
    /// Physical block.
    pub block: usize,
    /// Slot in the block (`pos % page_size`).
    pub offset: usize,
}

/// The validated slot of every row of a call (`None`: the row writes no K/V).
#[derive(Debug, Clone)]
pub(crate) struct SlotPlan {
    pub rows: Pooled<Option<RowSlot>>,
}

impl SlotPlan {
    /// `rows[i] = (batch, t, writes)` for every row of the call in order; `t` is the token's index
    /// in its sequence. The caller has checked `batch < table.batch_size()`.
    pub fn build(
        table: &PageTable<'_>,
        shape: &CacheShape,
        layer: usize,
        rows: &[(usize, usize, bool)],
    ) -> Result<Self> {
        if layer >= shape.num_layers() {
            return Err(Error::LayerOutOfRange { layer, num_layers: shape.num_layers() });
        }
        let batch = table.batch_size();
        // New tokens per sequence: one past the largest written t; and whether the written rows'
        // `(b, t)` strictly increase (as every operation lists them), which makes them distinct.
        let mut new_tokens = Pooled::filled(0usize, batch);
        let (mut increasing, mut last) = (true, None);
        for &(b, t, w) in rows {
            if w {
                new_tokens[b] = new_tokens[b].max(t + 1);
                increasing &= last.is_none_or(|l| l < (b, t));
                last = Some((b, t));
            }
        }
        let p = shape.page_size() as u64;
        // The blocks of the pages written (each sequence's pages from its first new position
        // to its last).
        let mut blocks: Pooled<u32> = Pooled::new();
        for (b, &n) in new_tokens.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let start = table.cache_length(b) as u64;
            let end = start + n as u64; // one past the last position written
            if end - 1 > u32::MAX as u64 {
                return Err(Error::PositionOverflow { batch: b, cache_length: table.cache_length(b), new_tokens: n });
            }
            let pages_needed = end.div_ceil(p);
            if pages_needed > table.cols() as u64 {
                return Err(Error::PageTableCapacity { batch: b, pages_needed, cols: table.cols() });
            }
            for page in (start / p)..pages_needed {
                let block = table.block(b, page as usize);
                if block as usize >= shape.num_blocks() {
                    return Err(Error::BlockOutOfRange {
                        batch: b,
                        logical_page: page as usize,
                        block,
                        num_blocks: shape.num_blocks(),
                    });
                }
                blocks.push(block);
            }
        }
        // Page and offset of a position: a shift and a mask for the usual power-of-two page sizes
        // (a 64-bit division per row was ~1 % of a 512-row Qwen-shaped bf16 RoPE call on AMD Zen 5).
        let shift = if p.is_power_of_two() { Some(p.trailing_zeros()) } else { None };
        let split = |pos: u64| match shift {
            Some(s) => (pos >> s, pos & (p - 1)),
            None => (pos / p, pos % p),
        };
        let plan: Pooled<Option<RowSlot>> = rows
            .iter()
            .map(|&(b, t, w)| {
                w.then(|| {
                    let pos = table.cache_length(b) as u64 + t as u64;
                    let (page, offset) = split(pos);
                    let block = table.block(b, page as usize) as usize;
                    RowSlot { batch: b, pos: pos as u32, block, offset: offset as usize }
                })
            })
            .collect();
        // Two writes to one physical slot would race on a GPU and silently overwrite here. Where
        // the written rows are distinct (strictly increasing `(b, t)`) and no block holds two
        // written pages, no two of them share a slot: two rows of one sequence have distinct
        // positions, so distinct pages (distinct blocks) or distinct offsets in one page, and two
        // rows of distinct sequences lie in distinct pages. That check sorts the few pages, not
        // the rows; otherwise the exact check below finds the first conflict. Measured (Intel
        // Xeon, one core, a ragged RoPE call's validation alone, Qwen-2.5-0.5B shapes): 512 rows
        // 8.7 → 8.1 µs, 64 rows 1.1 → 0.8 µs.
        blocks.sort_unstable();
        if increasing && blocks.windows(2).all(|w| w[0] != w[1]) {
            return Ok(SlotPlan { rows: plan });
        }
        let mut keys: Pooled<(usize, RowSlot)> =
            plan.iter().filter_map(|s| s.map(|s| (s.block * shape.page_size() + s.offset, s))).collect();
        // Among equal slots the earlier row comes first: rows are in (batch, position) order.
        // (Unstable: a stable sort allocates its buffer for a prefill's rows.)
        keys.sort_unstable_by_key(|k| (k.0, k.1.batch, k.1.pos));
        if let Some(w) = keys.windows(2).find(|w| w[0].0 == w[1].0) {
            let (a, c) = (w[0].1, w[1].1);
            return Err(Error::SlotConflict {
                block: a.block as u32,
                slot: a.offset,
                first: TokenRef { batch: a.batch, position: a.pos as u64 },
                second: TokenRef { batch: c.batch, position: c.pos as u64 },
            });
        }
        Ok(SlotPlan { rows: plan })
    }
}
