//! Validation of a call's cache writes, done once before anything is written: layer in range,
//! positions fit `u32`, the lookup table holds every page the new tokens need and those entries
//! are blocks of the cache, and no two tokens write one physical slot.

use super::{CacheShape, PageTable};
use crate::error::{Error, Result, TokenRef};
use crate::pool::{Pooled, poolable};

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

poolable!(Option<RowSlot>, (usize, RowSlot));

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
        // New tokens per sequence: one past the largest written t; and whether the written rows'
        // `(b, t)` strictly increase (as every operation lists them), which makes them distinct.
        let mut new_tokens = Pooled::filled(0usize, table.batch_size());
        let (mut increasing, mut last) = (true, None);
        for &(b, t, w) in rows {
            if w {
                new_tokens[b] = new_tokens[b].max(t + 1);
                increasing &= last.is_none_or(|l| l < (b, t));
                last = Some((b, t));
            }
        }
        let mut blocks = written_blocks(table, shape, layer, new_tokens.iter().copied())?;
        let p = shape.page_size() as u64;
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
        if increasing && distinct(&mut blocks) {
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

/// Checks the pages a call writes, `new_tokens[b]` tokens of every sequence `b` from its cache
/// length on (the layer, positions within `u32`, the table's capacity, blocks of the cache), and
/// returns the blocks of those pages. The checks and their order are [`SlotPlan::build`]'s.
fn written_blocks(
    table: &PageTable<'_>,
    shape: &CacheShape,
    layer: usize,
    new_tokens: impl Iterator<Item = usize>,
) -> Result<Pooled<u32>> {
    if layer >= shape.num_layers() {
        return Err(Error::LayerOutOfRange { layer, num_layers: shape.num_layers() });
    }
    let p = shape.page_size() as u64;
    // The blocks of the pages written (each sequence's pages from its first new position to its
    // last).
    let mut blocks: Pooled<u32> = Pooled::new();
    for (b, n) in new_tokens.enumerate() {
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
    Ok(blocks)
}

/// Whether no block appears twice (sorts `blocks`).
fn distinct(blocks: &mut [u32]) -> bool {
    blocks.sort_unstable();
    blocks.windows(2).all(|w| w[0] != w[1])
}

/// How a batch's rows lie: which rows are sequence `b`'s, and which of them write.
#[derive(Debug, Clone, Copy)]
enum Layout<'a> {
    /// `input_row_offsets`: rows `offsets[b] .. offsets[b + 1]`, all written.
    Ragged(&'a [u32]),
    /// `seq_len` rows per sequence (`[batch, seq_len, …]`), the first `valid[b]` written.
    Padded { seq_len: usize, valid: &'a [u32] },
}

impl Layout<'_> {
    /// Sequence `b`'s first row, and its rows written and in all.
    #[inline(always)]
    fn seq(&self, b: usize) -> (usize, usize, usize) {
        match *self {
            Layout::Ragged(o) => (o[b] as usize, (o[b + 1] - o[b]) as usize, (o[b + 1] - o[b]) as usize),
            Layout::Padded { seq_len, valid } => (b * seq_len, valid[b] as usize, seq_len),
        }
    }

    /// The sequence of row `r` (a row of the batch).
    fn seq_of(&self, r: usize) -> usize {
        match *self {
            Layout::Ragged(o) => o.partition_point(|&o| o as usize <= r) - 1,
            Layout::Padded { seq_len, .. } => r / seq_len,
        }
    }

    /// The rows written among rows `0 .. r` (`r` at most the batch's rows).
    fn written_before(&self, r: usize) -> usize {
        match *self {
            Layout::Ragged(_) => r,
            Layout::Padded { seq_len, valid } => {
                let (full, part) = (r / seq_len, r % seq_len);
                let whole: usize = valid[..full].iter().map(|&v| v as usize).sum();
                whole + valid.get(full).map_or(0, |&v| part.min(v as usize))
            }
        }
    }
}

/// The slots of a batch whose rows write from each sequence's cache length on (a ragged batch,
/// every row; a padded one, each sequence's first `valid_lengths[b]` rows), found from each row's
/// sequence and index when it is visited rather than listed per row: what [`SlotPlan::build`]
/// gives such a batch, without its passes over the rows (validation, then the slot of every
/// row, then their bases), which were ~10 % of a 512-row Qwen-shaped bf16 RoPE call on one core
/// and serial on every core count.
///
/// It exists only where the plan would succeed with no two written pages in one block, which is
/// what makes the rows' slots disjoint (as in `SlotPlan::build`: distinct rows of one sequence
/// have distinct positions, and distinct sequences write distinct pages).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SeqSlots<'a> {
    layout: Layout<'a>,
    table: PageTable<'a>,
    /// `log2(page_size)` where the page size is a power of two.
    shift: Option<u32>,
    page: usize,
    /// `CacheShape::slot_strides` of the layer.
    strides: (usize, usize, usize),
}

impl<'a> SeqSlots<'a> {
    /// The slots of every row of a ragged batch (`offsets` already checked: starts at 0,
    /// non-decreasing, one entry per sequence of `table` plus one), or `None` where
    /// [`SlotPlan::build`] would fail or two written pages share a block (the plan then finds
    /// the error or checks every slot).
    pub fn ragged(table: PageTable<'a>, shape: &CacheShape, layer: usize, offsets: &'a [u32]) -> Option<Self> {
        debug_assert_eq!(offsets.len(), table.batch_size() + 1);
        Self::new(Layout::Ragged(offsets), table, shape, layer)
    }

    /// As [`Self::ragged`] for a padded batch: `seq_len` rows per sequence of `table`, the first
    /// `valid[b]` of sequence `b` written (`valid` already checked: one per sequence, each at
    /// most `seq_len`).
    pub fn padded(
        table: PageTable<'a>,
        shape: &CacheShape,
        layer: usize,
        seq_len: usize,
        valid: &'a [u32],
    ) -> Option<Self> {
        debug_assert!(valid.len() == table.batch_size() && valid.iter().all(|&v| v as usize <= seq_len));
        // (No rows at all without a sequence length: the plan's path, which has nothing to do.)
        if seq_len == 0 {
            return None;
        }
        Self::new(Layout::Padded { seq_len, valid }, table, shape, layer)
    }

    fn new(layout: Layout<'a>, table: PageTable<'a>, shape: &CacheShape, layer: usize) -> Option<Self> {
        let new_tokens = (0..table.batch_size()).map(|b| layout.seq(b).1);
        let mut blocks = written_blocks(&table, shape, layer, new_tokens).ok()?;
        if !distinct(&mut blocks) {
            return None;
        }
        let page = shape.page_size();
        let strides = shape.slot_strides(layer);
        let shift = page.is_power_of_two().then(|| page.trailing_zeros());
        Some(SeqSlots { layout, table, shift, page, strides })
    }

    /// A cursor at row `first` (a row of the batch), for [`Self::slot`].
    pub fn cursor(&self, first: usize) -> SeqCursor {
        self.at_seq(self.layout.seq_of(first))
    }

    fn at_seq(&self, b: usize) -> SeqCursor {
        let (start, written, rows) = self.layout.seq(b);
        // Row r of sequence b lies at cache position `cache_lengths[b] + r − start`, which is
        // `r + delta` in wrapping arithmetic.
        let delta = (self.table.cache_length(b) as usize).wrapping_sub(start);
        SeqCursor { b, end: start + written, next: start + rows, delta, lookup: b * self.table.cols() }
    }

    /// Row `r`'s slot (its first element in the cache) and cache position, `None` for a row that
    /// writes nothing (padding), moving `cursor` (from [`Self::cursor`] at or before `r`, moved
    /// only forward) to `r`'s sequence.
    #[inline(always)]
    pub fn slot(&self, cursor: &mut SeqCursor, r: usize) -> Option<(usize, usize)> {
        while r >= cursor.next {
            *cursor = self.at_seq(cursor.b + 1);
        }
        if r >= cursor.end {
            return None;
        }
        let pos = r.wrapping_add(cursor.delta);
        let (page, slot) = match self.shift {
            Some(s) => (pos >> s, pos & (self.page - 1)),
            None => (pos / self.page, pos % self.page),
        };
        let block = self.table.lookup()[cursor.lookup + page] as usize;
        let (bs, at, ss) = self.strides;
        Some((block * bs + at + slot * ss, pos))
    }

    /// [`Self::slot`] of row `r` and the length of its run: the rows from `r` to its
    /// sequence's last written row or its page's last slot, whichever comes first (consecutive
    /// positions, slots [`Self::stride`] apart).
    #[inline(always)]
    pub fn run(&self, cursor: &mut SeqCursor, r: usize) -> Option<(usize, usize, usize)> {
        let (base, pos) = self.slot(cursor, r)?;
        let in_page = match self.shift {
            Some(_) => self.page - (pos & (self.page - 1)),
            None => self.page - pos % self.page,
        };
        Some((base, pos, in_page.min(cursor.end - r)))
    }

    /// The distance between the slots of consecutive positions in one page.
    pub fn stride(&self) -> usize {
        self.strides.2
    }

    /// The fewest rows from `first` on (at most `rows`) holding `want` written rows, where
    /// rows `first .. first + rows` hold at least that many: a binary search over the rows
    /// written before each row (O(batch · log rows) for a padded batch, not a pass over rows).
    pub fn rows_holding(&self, first: usize, rows: usize, want: usize) -> usize {
        let before = self.layout.written_before(first);
        let (mut lo, mut hi) = (0, rows); // the answer lies in lo ..= hi
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.layout.written_before(first + mid) - before >= want { hi = mid } else { lo = mid + 1 }
        }
        lo
    }

    /// The rows written among rows `first .. first + rows`.
    pub fn written_in(&self, first: usize, rows: usize) -> usize {
        self.layout.written_before(first + rows) - self.layout.written_before(first)
    }
}

/// A place in a [`SeqSlots`] batch: a sequence and what its rows share.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SeqCursor {
    b: usize,
    /// One past the sequence's last written row.
    end: usize,
    /// The next sequence's first row.
    next: usize,
    /// `cache_lengths[b]` minus the sequence's first row (wrapping).
    delta: usize,
    /// The first entry of the sequence's row of the lookup table.
    lookup: usize,
}

#[cfg(test)]
mod tests {
    use super::{SeqSlots, SlotPlan};
    use crate::cache::{CacheShape, PageTable};

    /// On random batches, ragged and padded (page sizes a power of two or not, MHA and MLA, cache
    /// lengths, empty sequences and padding, tables whose entries may repeat a block or leave the
    /// cache), `SeqSlots` exists exactly where the slot plan succeeds with no two written pages in
    /// one block, and then gives every row the plan's slot (none for padding), runs of rows with
    /// consecutive slots that end only at a sequence's last written row or a page's last slot,
    /// and the plan's counts of written rows for the shares' cuts.
    #[test]
    fn seq_slots_equal_the_plan() {
        let mut rng = fastrand::Rng::with_seed(11);
        let (mut some, mut none) = (0, 0);
        for case in 0..6000 {
            let page = [1, 2, 3, 4, 5, 16][rng.usize(..6)];
            let blocks = rng.usize(1..12);
            let shape = if case % 5 == 4 {
                CacheShape::mla(blocks, 2, page, 1, 6).unwrap()
            } else {
                CacheShape::mha(blocks, 2, page, rng.usize(1..3), 4).unwrap()
            };
            let batch = rng.usize(0..4);
            let padded = case % 2 == 1;
            let seq_len = rng.usize(1..7);
            let lens: Vec<u32> = (0..batch).map(|_| rng.u32(0..=seq_len as u32)).collect();
            let cache_lengths: Vec<u32> = (0..batch).map(|_| rng.u32(0..9)).collect();
            let cols = rng.usize(1..6);
            // Mostly distinct blocks in range; sometimes a repeated or out-of-range entry.
            let mut pool: Vec<u32> = (0..(batch * cols) as u32).collect();
            rng.shuffle(&mut pool);
            let lookup: Vec<u32> = pool
                .iter()
                .map(|&b| match rng.usize(..20) {
                    0 => rng.u32(..blocks as u32 + 2),
                    _ => b,
                })
                .collect();
            let table = PageTable::new(&lookup, cols, &cache_lengths).unwrap();
            let mut offsets = vec![0u32];
            for &l in &lens {
                offsets.push(offsets.last().unwrap() + l);
            }
            let layer = rng.usize(0..3); // 2: out of range
            // The rows as the operations list them: every row of a ragged batch writes; a padded
            // one has `seq_len` rows per sequence, the first `lens[b]` written.
            let lens_ref = &lens;
            let span = |b: usize| if padded { seq_len } else { lens[b] as usize };
            let rows: Vec<(usize, usize, bool)> =
                (0..batch).flat_map(|b| (0..span(b)).map(move |t| (b, t, t < lens_ref[b] as usize))).collect();
            let plan = SlotPlan::build(&table, &shape, layer, &rows);
            let slots = match padded {
                true => SeqSlots::padded(table, &shape, layer, seq_len, &lens),
                false => SeqSlots::ragged(table, &shape, layer, &offsets),
            };
            // Whether two written pages (each sequence's, from the one holding its first new
            // position to the one holding its last) lie in one block.
            let shared = plan.is_ok() && {
                let mut written: Vec<u32> = Vec::new();
                for b in 0..batch {
                    if lens[b] > 0 {
                        let (start, end) = (cache_lengths[b] as usize, (cache_lengths[b] + lens[b]) as usize);
                        written.extend((start / page..end.div_ceil(page)).map(|p| table.block(b, p)));
                    }
                }
                written.sort();
                written.windows(2).any(|w| w[0] == w[1])
            };
            assert_eq!(slots.is_some(), plan.is_ok() && !shared, "case {case}");
            let (Some(s), Ok(plan)) = (slots, plan) else {
                none += 1;
                continue;
            };
            some += 1;
            let base = shape.slot_base_fn(layer);
            let n_rows = rows.len();
            let mut from_0 = (n_rows > 0).then(|| s.cursor(0));
            for (r, slot) in plan.rows.iter().enumerate() {
                let want = slot.map(|slot| (base(slot.block, slot.offset), slot.pos as usize));
                // A cursor carried from row 0, and one from the row itself.
                assert_eq!(s.slot(from_0.as_mut().unwrap(), r), want, "case {case} row {r}");
                assert_eq!(s.slot(&mut s.cursor(r), r), want, "case {case} row {r}");
                // The run from row r: its rows' slots `stride` apart, positions consecutive, in
                // one sequence; it ends at the sequence's last written row or the page's end.
                let run = s.run(&mut s.cursor(r), r);
                let (Some(slot), Some((at, pos, n))) = (slot, run) else {
                    assert!(slot.is_none() && run.is_none(), "case {case} row {r}");
                    continue;
                };
                assert!(Some((at, pos)) == want && n >= 1 && r + n <= n_rows, "case {case} row {r}");
                for i in 0..n {
                    let si = plan.rows[r + i].unwrap();
                    assert_eq!(si.batch, slot.batch, "case {case} row {r}");
                    assert_eq!(base(si.block, si.offset), at + i * s.stride(), "case {case} row {r}");
                    assert_eq!(si.pos as usize, pos + i, "case {case} row {r}");
                }
                let last = plan.rows[r + n - 1].unwrap();
                let ends = plan.rows.get(r + n).is_none_or(|next| next.is_none_or(|next| next.batch != slot.batch))
                    || (last.pos as usize + 1).is_multiple_of(page);
                assert!(ends, "case {case} row {r}: run of {n} stops early");
            }
            // The written rows of every range, and the fewest rows holding each count of them.
            for first in 0..n_rows {
                for len in 0..=n_rows - first {
                    let written = |k: usize| (first..first + k).filter(|&r| plan.rows[r].is_some()).count();
                    assert_eq!(s.written_in(first, len), written(len), "case {case} rows {first}+{len}");
                    for want in 0..=written(len) {
                        let fewest = (0..=len).find(|&k| written(k) >= want).unwrap();
                        assert_eq!(s.rows_holding(first, len, want), fewest, "case {case} rows {first}+{len}");
                    }
                }
            }
        }
        // Both outcomes are exercised.
        assert!(some > 800 && none > 800, "{some} built, {none} not");
    }
}
