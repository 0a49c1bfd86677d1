//! The standalone RoPE and KV-store fast paths: per row, the token's Q heads are rotated from
//! `q_proj` into `output` and its K heads rotated in place in its cache slot (or its K/V values
//! stored there), in parallel over rows. Each row reaches its own slot through
//! [`SharedMut::slice_mut`] (the validated slots, [`RowSlots`], give distinct rows disjoint
//! slots), so a call allocates nothing in steady state: the earlier safe version carved the cache
//! into a vector of slices per call. The slots come from a per-row slot plan, or are found per
//! sequence as the rows are visited ([`Seqs`]); the token kernels then take runs of consecutive
//! rows (one sequence, one page) whose slots are contiguous.
//!
//! The rotation itself is `crate::simd::rope`: the oracle's operations lane by lane.
#![allow(unsafe_code)] // `SharedMut::slice_mut` per row or run, under the slots' disjointness

use super::kvquant::QuantCache;
use super::scatter::SharedMut;
use super::team::Team;
use crate::cache::{CacheShape, SeqCursor, SeqSlots, SlotPlan};
use crate::dtype::E4M3;
use crate::element::Element;
use crate::pool::Pooled;
use crate::simd::rope::{HalfRows, RopeRow, Round, TokenFn, convert, narrow, rotate_heads, rotate_heads_from, widen};
use crate::simd::{IsaToken, kv_dequant, kv_groups};
use std::sync::Mutex;

/// The first element of each row's slot in layer `layer`, plus `offset` (the V part, or 0).
pub(crate) fn slot_bases(plan: &SlotPlan, shape: &CacheShape, layer: usize, offset: usize) -> Pooled<Option<usize>> {
    let base = shape.slot_base_fn(layer);
    plan.rows.iter().map(|s| s.map(|s| base(s.block, s.offset) + offset)).collect()
}

/// What one RoPE call rotates.
pub(crate) struct RopeSpec<'a, F> {
    pub freqs: &'a [F],
    pub rope_dim: usize,
    pub interleaved: bool,
    /// How each step rounds (from the public `RopeMath` and the freqs' type: `fast` translates).
    pub round: Round,
    /// Q heads and their size; K heads (the cache's) and their size.
    pub q_heads: (usize, usize),
    pub k_heads: (usize, usize),
}

impl<F: Element> RopeSpec<'_, F> {
    pub fn round(&self) -> Round {
        self.round
    }

    /// One token: Q heads from `q` into `out`, K heads of its slot `k` in place.
    fn row<T: Element, C: Element>(
        &self,
        token: IsaToken,
        p: usize,
        q: &[T],
        out: &mut [T],
        k: &mut [C],
        bufs: &mut Bufs,
    ) {
        let rd = self.rope_dim;
        bufs.0.resize(RopeRow::len(rd), 0.0);
        bufs.1.resize(rd, 0.0);
        RopeRow::fill_with(token, &self.freqs[p * rd..(p + 1) * rd], &mut bufs.0, self.interleaved);
        let row = RopeRow::view(&bufs.0, rd, self.interleaved);
        // Every element type in one pass from q into out. f32 used to copy the Q row and rotate
        // it in place (an Intel Xeon had measured that faster: 0.96 vs 1.17 ms for 512 Llama
        // tokens, cause not found), but glibc's `memcpy` of a row that size (`rep movsb`) runs
        // 5–20× slower on AMD Zen 3 when the output lies 1–31 bytes past `q` modulo 4 KiB, and
        // away from that distance the one pass measured faster on Zen 3 too (one core, best of
        // 300–5000 calls, alternating binaries: 64 Llama tokens 67–68 → 44–54 µs, 64 Qwen tokens
        // 15.8–16.1 → 11.5–11.7 µs, 512 Qwen tokens 131–182 → 93–121 µs; criterion, docs/performance.md).
        // (`rope_rows` comes here only where `HalfRows::new` found no prepared path, so neither
        // call takes the half-split kernels' shortcut for both Q and K.)
        let (i, r) = (self.interleaved, self.round());
        rotate_heads_from(token, Some(q), out, self.q_heads, &row, i, r, &mut bufs.1);
        rotate_heads(token, k, self.k_heads, &row, i, r, &mut bufs.1);
    }
}

/// Where the rows of a validated call go: each row's K slot (its first element in the cache) and
/// its freqs row, or `None` for a row left untouched (padding, no slot). Rows are asked in
/// increasing order through a cursor per share.
pub(crate) trait RowSlots: Sync {
    /// A share's place among the rows.
    type Cursor;
    /// The number of rows, from `first` on (of `rows`), that the first `left` of `threads`
    /// threads take: the fewest rows holding `⌊total · left / threads⌋` of the `total` rows with
    /// a slot among `first .. first + rows` (what the shares balance).
    fn cut(&self, first: usize, rows: usize, left: usize, threads: usize) -> usize;
    /// A cursor for a share from row `first` on.
    fn cursor(&self, first: usize) -> Self::Cursor;
    /// Row `r`'s slot and freqs row (rows asked in increasing order, from the cursor's first).
    fn get(&self, cursor: &mut Self::Cursor, r: usize) -> Option<(usize, usize)>;
    /// A run from row `r`: its slot, freqs row and length `n` (`1 ≤ n ≤ max`), the rows
    /// `r + i` (`i < n`) having slot `slot + i · stride()` and freqs row `freqs row + i`. As
    /// [`get`](Self::get) otherwise (rows asked in increasing order; `None`: row `r` has none).
    #[inline(always)]
    fn run(&self, cursor: &mut Self::Cursor, r: usize, max: usize) -> Option<(usize, usize, usize)> {
        let _ = max;
        self.get(cursor, r).map(|(slot, p)| (slot, p, 1))
    }
    /// The distance between the slots of a run's consecutive rows.
    fn stride(&self) -> usize {
        0
    }
}

/// A slot plan's rows: bases and positions listed per row.
pub(crate) struct Planned<'a> {
    pub bases: &'a [Option<usize>],
    pub positions: &'a [Option<usize>],
}

impl RowSlots for Planned<'_> {
    type Cursor = ();
    fn cut(&self, first: usize, rows: usize, left: usize, threads: usize) -> usize {
        cut(|r| self.bases[r].is_some() && self.positions[r].is_some(), first, rows, left, threads)
    }
    fn cursor(&self, _: usize) {}
    #[inline]
    fn get(&self, _: &mut (), r: usize) -> Option<(usize, usize)> {
        Some((self.bases[r]?, self.positions[r]?))
    }
}

/// A batch whose slots are found per sequence ([`SeqSlots`]), and its position ids (else each
/// row's cache position is its freqs row).
pub(crate) struct Seqs<'a> {
    pub slots: SeqSlots<'a>,
    pub ids: Option<&'a [u32]>,
}

impl RowSlots for Seqs<'_> {
    type Cursor = SeqCursor;
    fn cut(&self, first: usize, rows: usize, left: usize, threads: usize) -> usize {
        let want = self.slots.written_in(first, rows) * left / threads;
        self.slots.rows_holding(first, rows, want)
    }
    fn cursor(&self, first: usize) -> SeqCursor {
        self.slots.cursor(first)
    }
    // Always: left out of line, the call and its register saves were ~4 % of a 512-row
    // Qwen-shaped bf16 call (AMD Zen 5, `perf`).
    #[inline(always)]
    fn get(&self, cursor: &mut SeqCursor, r: usize) -> Option<(usize, usize)> {
        let (base, pos) = self.slots.slot(cursor, r)?;
        Some((base, self.ids.map_or(pos, |ids| ids[r] as usize)))
    }
    /// A run is the rest of row `r`'s written rows within its page (the cache positions and
    /// slots consecutive); with position ids, only as far as the ids also go up by one per row
    /// (the freqs rows consecutive), which costs one compare per row, as a row's own lookup did.
    /// Servers pass ids that are the cache positions (or a constant offset of them), so their
    /// rows keep the token kernels' runs.
    #[inline(always)]
    fn run(&self, cursor: &mut SeqCursor, r: usize, max: usize) -> Option<(usize, usize, usize)> {
        let (base, pos, n) = self.slots.run(cursor, r)?;
        let n = n.min(max);
        match self.ids {
            None => Some((base, pos, n)),
            Some(ids) => {
                let ids = &ids[r..r + n];
                let first = ids[0] as usize;
                let n = 1 + ids[1..].iter().zip(first + 1..).take_while(|&(&id, want)| id as usize == want).count();
                Some((base, first, n))
            }
        }
    }
    fn stride(&self) -> usize {
        self.slots.stride()
    }
}

/// A KV store's rows: bases listed per row (the position is not used).
pub(crate) struct Bases<'a>(pub &'a [Option<usize>]);

impl RowSlots for Bases<'_> {
    type Cursor = ();
    fn cut(&self, first: usize, rows: usize, left: usize, threads: usize) -> usize {
        cut(|r| self.0[r].is_some(), first, rows, left, threads)
    }
    fn cursor(&self, _: usize) {}
    #[inline]
    fn get(&self, _: &mut (), r: usize) -> Option<(usize, usize)> {
        Some((self.0[r]?, 0))
    }
}

/// A task's reusable f32 buffers (its thread's pool).
type Bufs = (Pooled<f32>, Pooled<f32>);

/// A share's empty [`Bufs`] (from its thread's pool).
fn bufs() -> Bufs {
    (Pooled::new(), Pooled::new())
}

/// Rows below which a call runs on the calling thread (a decode step's few tokens), and the
/// fewest rows a share takes (`PAR_ROWS / 2`: a pool of many threads does not cut a small call
/// into shares of a row or two, whose joins would cost more than their rows).
const PAR_ROWS: usize = 8;

/// The fewest bytes (read and written) a RoPE share moves, and a KV store's: below two shares'
/// worth, a call runs on the calling thread. A share's `rayon::join` costs about a µs on the
/// 2-vCPU VMs these were measured on, so cut by rows alone (at least four per share) small calls
/// ran slower on two threads than on one. Paired bench on AMD Zen 5 (`cargo bench --bench rope --
/// paired/threads`: each bf16 call on a two-thread pool against the same call kept on one
/// thread), rate on two threads ÷ on one, rows cut alone → with these grains:
/// RoPE, 8 Llama-3-8B-shaped tokens (164 KB moved) 0.77 → 0.99, 16 of them (328 KB, still cut)
/// 1.20 → 1.21; 8 / 16 / 32 Qwen2.5-0.5B-shaped (33–131 KB) 0.80 / 0.58 / 0.84 → 1.05 / 1.00 /
/// 0.99, 64 of them (262 KB, cut) 1.14 → 1.11. A KV store moves its bytes at about a copy's
/// rate, so a µs buys more of them: 8–64 Llama-shaped K rows (16–262 KB) 0.69–0.88 → 1.00–1.04,
/// 128 of them (524 KB) 0.69–0.73 in two reruns (→ 1.00); cut at 256 KiB they read 0.85–0.94.
/// Qwen-shaped K rows 8–128 (4–66 KB) 0.26–0.78 → 0.92–1.00. A driver calling back to back
/// found two threads faster from 1 MiB (256 Llama-shaped K rows: 9.0 → 4.9 µs).
/// docs/performance.md, "Small calls on one thread".
/// Under Miri none (0): its tests are small, and they are there to check the shares' threads.
const ROPE_SHARE_BYTES: usize = if cfg!(miri) { 0 } else { 128 << 10 };
/// See [`ROPE_SHARE_BYTES`].
const STORE_SHARE_BYTES: usize = if cfg!(miri) { 0 } else { 512 << 10 };

/// Runs `job(row, (slot, freqs row), buffers, output row)` for every row (`output` in rows of
/// `width`) that `slots` gives a slot, each share's buffers made by `init`. On a team of several threads, with enough rows, the rows
/// are cut into one contiguous share per thread of the team (each share at
/// least `PAR_ROWS / 2` rows and `grain` bytes, a row moving `row_bytes`; see
/// [`ROPE_SHARE_BYTES`]), each holding as many active rows as the others (an inactive row, a padded or unslotted one,
/// costs next to nothing), and the shares run through a tree of `rayon::join` (on a
/// [`Workers`](crate::Workers) team, one share per team thread); each share's
/// buffers come from its thread's pool.
///
/// Why one share per thread instead of rayon's adaptive split of the rows (`par_chunks_mut` +
/// `with_min_len(4)`, the earlier version): every split is a task with its own wake-up and
/// buffers, and on calls of a few µs that overhead was the difference between one and two
/// threads. Measured on AMD Zen 5, 2 threads, paired bench (`cargo bench --bench rope --
/// 'paired/rope/.*/t(64|512)/bytes/rope_t2'`, two interleaved runs of each), RoPE ÷ copy:
/// Llama-3-8B bf16 64 tokens 0.46–0.48 → 0.49–0.54, Qwen2.5-0.5B f32 64 tokens 0.32–0.42 → 0.55
/// and 512 tokens 0.74–0.75 → 0.79; no case slower beyond the run-to-run spread. A plain
/// `par_chunks_mut` of one share per thread read 0.37–0.52 / 0.45–0.51 / 0.74–0.78 (docs/performance.md).
///
/// `RUNS`: `job(first row, (slot, freqs row, n), buffers, n output rows)` for runs of `n` rows
/// ([`RowSlots::run`]) instead of one row at a time (`n` = 1).
fn for_rows<T: Send, S: RowSlots, B, const RUNS: bool>(
    team: Team,
    (row_bytes, grain): (usize, usize),
    output: &mut [T],
    width: usize,
    slots: &S,
    init: impl Fn() -> B + Sync,
    job: impl Fn(usize, (usize, usize, usize), &mut B, &mut [T]) + Sync,
) {
    let rows = output.len() / width;
    let threads = share_count(team, rows, row_bytes, grain);
    let share = |first: usize, out: &mut [T]| {
        let mut bufs = init();
        let mut cursor = slots.cursor(first);
        let rows = out.len() / width;
        let mut i = 0;
        while i < rows {
            let at = if RUNS {
                slots.run(&mut cursor, first + i, rows - i)
            } else {
                slots.get(&mut cursor, first + i).map(|(slot, p)| (slot, p, 1))
            };
            let n = at.map_or(1, |a| a.2);
            if let Some(at) = at {
                job(first + i, at, &mut bufs, &mut out[i * width..(i + n) * width]);
            }
            i += n;
        }
    };
    if threads <= 1 {
        if rows > 0 {
            share(0, output);
        }
        return;
    }
    match team {
        Team::Workers(w) => {
            // One share per thread of the team, each taken by the first thread that asks (its
            // own first), so every share runs once whichever threads run.
            let parts: [Part<'_, T>; MAX_SHARES] = std::array::from_fn(|_| Mutex::new(None));
            let threads = threads.min(MAX_SHARES);
            cut_shares(&parts[..threads], slots, 0, output, width);
            w.each_thread(&|me| {
                for j in 0..threads {
                    let part = parts[(me + j) % threads].lock().unwrap_or_else(|e| e.into_inner()).take();
                    if let Some((first, out)) = part {
                        share(first, out);
                    }
                }
            });
        }
        _ => shares(&share, slots, 0, output, width, threads),
    }
}

/// One share of rows on a [`Workers`](crate::Workers) team: its first row and output rows, taken once.
type Part<'a, T> = Mutex<Option<(usize, &'a mut [T])>>;

/// Most shares a call on a [`Workers`](crate::Workers) team is cut into.
const MAX_SHARES: usize = 64;

/// Cuts rows `first ..` (`output`, rows of `width`) into `parts.len()` contiguous shares of equal
/// active rows (the cuts of [`shares`]), one per part.
fn cut_shares<'a, T>(parts: &[Part<'a, T>], slots: &impl RowSlots, first: usize, output: &'a mut [T], width: usize) {
    let (threads, rows) = (parts.len(), output.len() / width);
    if threads <= 1 || rows < 2 {
        if let Some(p) = parts.first() {
            *p.lock().unwrap_or_else(|e| e.into_inner()) = Some((first, output));
        }
        return;
    }
    let left = threads / 2;
    let cut = slots.cut(first, rows, left, threads);
    let (a, b) = output.split_at_mut(cut * width);
    cut_shares(&parts[..left], slots, first, a, width);
    cut_shares(&parts[left..], slots, first + cut, b, width);
}

/// The number of shares [`for_rows`] cuts `rows` rows of `row_bytes` bytes each into: one per
/// thread of the current rayon pool, each at least `PAR_ROWS / 2` rows and `grain` bytes; 1 when
/// on one thread.
fn share_count(team: Team, rows: usize, row_bytes: usize, grain: usize) -> usize {
    let fewest = (PAR_ROWS / 2).max(grain.div_ceil(row_bytes.max(1)));
    match rows >= 2 * fewest {
        true => team.threads().min(rows / fewest).max(1),
        false => 1,
    }
}

/// Splits rows `first ..` (`output`, rows of `width`) into `threads` contiguous shares of equal
/// active rows and runs `share` on each, recursively halving the thread count through
/// `rayon::join` (O(rows · log threads) counting, no allocation).
fn shares<T: Send>(
    share: &(impl Fn(usize, &mut [T]) + Sync),
    slots: &impl RowSlots,
    first: usize,
    output: &mut [T],
    width: usize,
    threads: usize,
) {
    let rows = output.len() / width;
    if rows == 0 {
        return;
    }
    if threads <= 1 || rows < 2 {
        share(first, output);
        return;
    }
    let left = threads / 2;
    let cut = slots.cut(first, rows, left, threads);
    let (a, b) = output.split_at_mut(cut * width);
    rayon::join(
        || shares(share, slots, first, a, width, left),
        || shares(share, slots, first + cut, b, width, threads - left),
    );
}

/// The number of rows, from `first` on, that the first `left` of `threads` threads take: the
/// fewest rows holding `⌊total · left / threads⌋` of the `total` active rows among `first ..
/// first + rows`.
fn cut(active: impl Fn(usize) -> bool, first: usize, rows: usize, left: usize, threads: usize) -> usize {
    let total = (first..first + rows).filter(|&r| active(r)).count();
    let want = total * left / threads;
    let (mut seen, mut cut) = (0, 0);
    while cut < rows && seen < want {
        seen += usize::from(active(first + cut));
        cut += 1;
    }
    cut
}

/// Runs `job(row, freqs row, buffers, output row, K slot)` for every row (`output` in rows of
/// `qw`) that has a slot and a position (`slots`), its slot's `kw` values in `cache`, through
/// [`for_rows`]; with `RUNS`, `job(first row, freqs row, n, n output rows, their K slots)` for
/// runs of `n` rows whose slots lie `kw` apart (contiguous) and freqs rows are consecutive.
fn slot_rows<T: Send, C: Send, const RUNS: bool>(
    team: Team,
    grain: (usize, usize),
    output: &mut [T],
    (qw, kw): (usize, usize),
    cache: &SharedMut<'_, C>,
    slots: &impl RowSlots,
    job: impl Fn(usize, usize, usize, &mut Bufs, &mut [T], &mut [C]) + Sync,
) {
    // A run's slots must be the contiguous `n · kw` values that `slice_mut` hands out below.
    assert!(!RUNS || slots.stride() == kw, "runs of slots {} apart, {kw} values each", slots.stride());
    for_rows::<T, _, _, RUNS>(team, grain, output, qw, slots, bufs, |r, (base, p, n), bufs, o| {
        // SAFETY: every `RowSlots` gives distinct rows disjoint slots (a slot plan checked every
        // slot, or no two written pages share a block; `SeqSlots`), so the ranges
        // `base .. base + kw` of distinct rows are disjoint (a slot holds the row's kw K values);
        // a run's n rows have the n contiguous slots `base + i · kw` (asserted stride), which
        // `base .. base + n · kw` covers exactly. Each row is visited by one task, in one run;
        // nothing else touches `cache` during the call.
        let k = unsafe { cache.slice_mut(base, n * kw) };
        job(r, p, n, bufs, o, k)
    });
}

/// Runs a validated RoPE call: for every row with a slot and a position, rotate its Q heads
/// (`q_proj` row → `output` row) and its K heads in `cache`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_rows<T: Element, F: Element, C: Element>(
    token: IsaToken,
    team: Team,
    spec: &RopeSpec<'_, F>,
    q_proj: &[T],
    output: &mut [T],
    cache: &mut [C],
    slots: &impl RowSlots,
) {
    let (hq, dq) = spec.q_heads;
    let (hk, dk) = spec.k_heads;
    let (qw, kw) = (hq * dq, hk * dk);
    assert!(qw > 0 && output.len() == q_proj.len());
    let cache = SharedMut::new(cache);
    let rd = spec.rope_dim;
    // The path is decided once for the call rather than per token: the token kernel where it
    // applies (AVX-512, AVX2 or NEON, heads of 64 or 128 dims, `F32` math, either pairing), else the
    // prepared half-split kernels (half-split, `F32` math, whole heads of whole vectors), else
    // `RopeSpec::row`. The same kernels and bits either way.
    // Each path gets its own loop: one loop matching on the path per row measured 4–6 % slower
    // (Qwen-shaped bf16 tokens on one Zen 5 core, 512: 26.4–26.9 → 27.9 µs; 64: 3.11–3.17 →
    // 3.31–3.35 µs).
    let (i, r) = (spec.interleaved, spec.round());
    // The token kernels take runs of rows (where the slots give them: consecutive tokens of one
    // sequence in one page), the others one row at a time.
    let runs = slots.stride() == kw;
    // What a row moves (its Q row read and written, its K heads read and written, its freqs
    // read), and the fewest bytes a share moves (`for_rows`).
    let grain = (2 * (qw * size_of::<T>() + kw * size_of::<C>()) + rd * size_of::<F>(), ROPE_SHARE_BYTES);
    if let Some(t) = TokenFn::<T, C, F>::new(token, i, r, rd, spec.q_heads, spec.k_heads) {
        let job = |r, p, n, _: &mut Bufs, o: &mut [T], k: &mut [C]| {
            t.run(&spec.freqs[p * rd..(p + n) * rd], &q_proj[r * qw..(r + n) * qw], o, k, n, kw)
        };
        match runs {
            true => slot_rows::<T, C, true>(team, grain, output, (qw, kw), &cache, slots, job),
            false => slot_rows::<T, C, false>(team, grain, output, (qw, kw), &cache, slots, job),
        }
        return;
    }
    match HalfRows::<T, C>::new(token, i, r, rd, spec.q_heads, spec.k_heads) {
        Some(h) => slot_rows::<T, C, false>(team, grain, output, (qw, kw), &cache, slots, |r, p, _, bufs, o, k| {
            bufs.0.resize(h.buf_len(), 0.0);
            h.row(&spec.freqs[p * rd..(p + 1) * rd], &q_proj[r * qw..(r + 1) * qw], o, k, &mut bufs.0);
        }),
        None => slot_rows::<T, C, false>(team, grain, output, (qw, kw), &cache, slots, |r, p, _, bufs, o, k| {
            spec.row(token, p, &q_proj[r * qw..(r + 1) * qw], o, k, bufs)
        }),
    }
}

/// One row's rotation: `(row, freqs row, buffers, output row, K row)`.
type Rotate<'a, T> = dyn Fn(usize, usize, &mut Bufs, &mut [T], &mut [T]) + Sync + 'a;

/// Runs a validated RoPE call into an FP8-quantized cache ([semantics §3.1](crate::semantics)),
/// one pass per row: the K of the row's slot is dequantized into `T` (`T(code · scale)`, the
/// values the oracle stages), rotated together with the row's Q heads by the kernels
/// [`rope_rows`] runs on a cache of `T`, and quantized back into the slot with fresh scales
/// ([`kv_groups`]). The oracle stages every row in a cache of `T` and runs the three steps as
/// passes over the call; the same steps row by row give the same bits without the staging
/// cache, and the K row stays in L1 between them (an earlier version ran the oracle's passes:
/// measured against it in docs/performance.md).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_rows_quant<T: Element, F: Element>(
    token: IsaToken,
    team: Team,
    spec: &RopeSpec<'_, F>,
    q_proj: &[T],
    output: &mut [T],
    dst: QuantCache<'_, E4M3>,
    slots: &impl RowSlots,
) {
    let (hq, dq) = spec.q_heads;
    let (hk, dk) = spec.k_heads;
    let (qw, kw) = (hq * dq, hk * dk);
    let g = dst.granularity;
    assert!(qw > 0 && output.len() == q_proj.len() && g > 0 && kw.is_multiple_of(g));
    let (rd, i, r) = (spec.rope_dim, spec.interleaved, spec.round());
    let grain = (2 * (qw * size_of::<T>() + kw + kw / g * 4) + rd * size_of::<F>(), ROPE_SHARE_BYTES);
    let (codes, scales) = (SharedMut::new(dst.data), SharedMut::new(dst.scales));
    // One pass over the rows with `rotate(row, freqs row, buffers, output row, K row)`: the
    // rotation of `rope_rows`, its path decided once for the call.
    let mut rows = |rotate: &Rotate<'_, T>| {
        // The K row staged in `T`, from the thread's pool (a steady-state call allocates nothing).
        let init = || (bufs(), Pooled::<f32>::filled(0.0, kw), Pooled::<T>::filled(T::default(), kw));
        for_rows::<T, _, _, false>(team, grain, output, qw, slots, init, |r, (base, p, _), b, o| {
            let (bufs, wide, k) = b;
            // SAFETY: as in `slot_rows`: distinct rows have disjoint slots (`base .. base + kw`,
            // the row's K), and so disjoint scales (`base / g ..`, one per `g` values: the
            // head size is a multiple of `g`); each row is visited once; nothing else touches
            // the cache or its scales during the call.
            let (c, s) = unsafe { (codes.slice_mut(base, kw), scales.slice_mut(base / g, kw / g)) };
            kv_dequant(token, c, g, s, wide);
            narrow(token, wide, k);
            rotate(r, p, bufs, o, k);
            widen(token, k, wide);
            kv_groups(token, wide, g, c, s);
        });
    };
    if let Some(t) = TokenFn::<T, T, F>::new(token, i, r, rd, spec.q_heads, spec.k_heads) {
        return rows(&|r, p, _, o, k| {
            t.run(&spec.freqs[p * rd..(p + 1) * rd], &q_proj[r * qw..(r + 1) * qw], o, k, 1, kw)
        });
    }
    match HalfRows::<T, T>::new(token, i, r, rd, spec.q_heads, spec.k_heads) {
        Some(h) => rows(&|r, p, bufs, o, k| {
            bufs.0.resize(h.buf_len(), 0.0);
            h.row(&spec.freqs[p * rd..(p + 1) * rd], &q_proj[r * qw..(r + 1) * qw], o, k, &mut bufs.0);
        }),
        None => rows(&|r, p, bufs, o, k| spec.row(token, p, &q_proj[r * qw..(r + 1) * qw], o, k, bufs)),
    }
}

/// Runs a validated KV store: every row with a slot (`slots`) writes its `width` values, from
/// `offset` past the slot's first element (the V part's distance from the K part, or 0), rounded
/// once to the cache dtype. Where a run's slots lie `width` apart (consecutive cache positions in
/// one page: the cache's slots of one block and layer are contiguous), the run's rows are
/// converted as one stretch of values (the per-row lookup and call were most of a row's time for
/// small rows: see docs/performance.md, "KV stores").
pub(crate) fn store_rows<T: Element, C: Element>(
    token: IsaToken,
    team: Team,
    values: &[T],
    cache: &mut [C],
    slots: &impl RowSlots,
    (offset, width): (usize, usize),
) {
    if width == 0 {
        return;
    }
    let cache = SharedMut::new(cache);
    // The rows of `values` are read-only: `for_rows` walks a slice of units, one per row (a
    // `Vec<()>` never allocates).
    let mut rows = vec![(); values.len() / width];
    let job = |r: usize, (base, _, n): (usize, usize, usize), bufs: &mut Bufs, _: &mut [()]| {
        // SAFETY: as in `slot_rows`: distinct rows have disjoint slots, each holding its K and V
        // parts of `width` values (`offset` apart); a run's n rows (n > 1 only where the slots
        // lie `width` apart, `runs` below) have the parts `base + offset + i · width`, which the
        // n · width values from `base + offset` cover exactly.
        let dst = unsafe { cache.slice_mut(base + offset, n * width) };
        // The oracle's `C::from_f32(v.to_f32())`, NaNs included, directly where it can be.
        convert(token, &values[r * width..(r + n) * width], dst, &mut bufs.0);
    };
    let runs = slots.stride() == width;
    let grain = (width * (size_of::<T>() + size_of::<C>()), STORE_SHARE_BYTES);
    match runs {
        true => for_rows::<_, _, _, true>(team, grain, &mut rows, 1, slots, bufs, job),
        false => for_rows::<_, _, _, false>(team, grain, &mut rows, 1, slots, bufs, job),
    }
}

#[cfg(test)]
mod tests {
    use super::{PAR_ROWS, RowSlots, Team, cut, for_rows, share_count};
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    /// Rows active by [`pattern`], each with slot and position `r`.
    struct Pattern(usize, usize);

    impl Pattern {
        fn active(&self, r: usize) -> bool {
            pattern(self.0, r, self.1)
        }
    }

    impl RowSlots for Pattern {
        type Cursor = usize;
        fn cut(&self, first: usize, rows: usize, left: usize, threads: usize) -> usize {
            cut(|r| self.active(r), first, rows, left, threads)
        }
        fn cursor(&self, first: usize) -> usize {
            first
        }
        /// Checks that the rows come in order, from the cursor's first row.
        fn get(&self, next: &mut usize, r: usize) -> Option<(usize, usize)> {
            assert_eq!(r, *next, "rows out of order");
            *next += 1;
            self.active(r).then_some((r, r))
        }
        /// Runs of up to 3 active rows (cut by `max`).
        fn run(&self, next: &mut usize, r: usize, max: usize) -> Option<(usize, usize, usize)> {
            assert!(r == *next && max >= 1, "rows out of order");
            let n = (r..r + max.min(3)).take_while(|&r| self.active(r)).count();
            *next += n.max(1);
            (n > 0).then_some((r, r, n))
        }
    }

    /// Which rows of `rows` are active, by pattern.
    fn pattern(p: usize, r: usize, rows: usize) -> bool {
        match p {
            0 => true,
            1 => false,
            2 => r % 3 == 1,
            3 => r + 1 == rows,
            4 => r < rows / 2,
            _ => r > rows / 2,
        }
    }

    /// Every active row runs exactly once, with its own output row, and no inactive row runs,
    /// whatever the thread count (more threads than rows included) and where the active rows lie.
    /// With runs (`RUNS`), the same, each run's rows handed out together.
    #[test]
    fn for_rows_runs_each_active_row_once() {
        fn check<const RUNS: bool>() {
            for (threads, team) in [1, 2, 3, 8]
                .into_iter()
                .flat_map(|t| [(t, Team::Rayon), (t, Team::Workers(crate::Workers::shared(t).unwrap()))])
            {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                for rows in [0, 1, PAR_ROWS - 1, PAR_ROWS, PAR_ROWS + 1, 64, 65] {
                    for p in 0..6 {
                        let hits: Vec<AtomicUsize> = (0..rows).map(|_| AtomicUsize::new(0)).collect();
                        let mut out = vec![usize::MAX; 3 * rows];
                        let active = |r: usize| pattern(p, r, rows);
                        // A grain of 16 one-byte rows: 64 and 65 rows make at most four shares.
                        let grain = if p % 2 == 0 { 0 } else { 16 };
                        pool.install(|| {
                            for_rows::<_, _, _, RUNS>(
                                team,
                                (1, grain),
                                &mut out,
                                3,
                                &Pattern(p, rows),
                                || (),
                                |r, (s, q, n), _, o| {
                                    assert!((s, q) == (r, r) && o.len() == 3 * n && (RUNS || n == 1));
                                    for (i, o) in o.chunks_mut(3).enumerate() {
                                        hits[r + i].fetch_add(1, Relaxed);
                                        o.fill(r + i);
                                    }
                                },
                            )
                        });
                        for r in 0..rows {
                            let (want, got) = (usize::from(active(r)), hits[r].load(Relaxed));
                            let at = format!("{team:?}, {threads} threads, {rows} rows, pattern {p}, runs {RUNS}");
                            assert_eq!(got, want, "{at}: row {r}");
                            let row = if active(r) { r } else { usize::MAX };
                            assert_eq!(out[3 * r..3 * r + 3], [row; 3], "{at}");
                        }
                    }
                }
            }
        }
        check::<false>();
        check::<true>();
    }

    /// A call is cut into one share per thread, each share at least `PAR_ROWS / 2` rows and the
    /// grain's bytes, and runs on the calling thread when it cannot fill two such shares.
    #[test]
    fn shares_hold_the_grain() {
        for threads in [1, 2, 3, 8] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                for rows in [0, 1, 7, 8, 9, 63, 64, 65, 1000] {
                    for (row_bytes, grain) in [(1, 0), (1000, 0), (1000, 16_000), (1000, 16_001), (3, 100), (0, 100)] {
                        let n = share_count(Team::Rayon, rows, row_bytes, grain);
                        assert_eq!(share_count(Team::One, rows, row_bytes, grain), 1);
                        let fewest = (PAR_ROWS / 2).max(grain.div_ceil(row_bytes.max(1)));
                        let at = format!("{threads} threads, {rows} rows of {row_bytes} bytes, grain {grain}");
                        assert!(n >= 1 && n <= threads, "{at}: {n} shares");
                        if n > 1 {
                            // Each share holds at least `fewest` rows (so `grain` bytes; a row counts a byte at least).
                            assert!(rows / n >= fewest && (rows / n) * row_bytes.max(1) >= grain, "{at}: {n} shares");
                        }
                        // As many shares as fit, up to the threads.
                        let fit = rows / fewest;
                        assert_eq!(n, if fit >= 2 { fit.min(threads) } else { 1 }, "{at}");
                    }
                }
            });
        }
    }

    /// The left part of a cut holds its share of the active rows, however they lie.
    #[test]
    fn cut_balances_active_rows() {
        for rows in [2, 9, 64, 65] {
            for p in 0..6 {
                for threads in [2, 3, 5, 8] {
                    for first in [0, 7] {
                        let active = |r: usize| pattern(p, r - first, rows);
                        let left = threads / 2;
                        let c = cut(active, first, rows, left, threads);
                        let total = (first..first + rows).filter(|&r| active(r)).count();
                        let got = (first..first + c).filter(|&r| active(r)).count();
                        assert!(c <= rows);
                        assert_eq!(got, total * left / threads, "{rows} rows, pattern {p}, {threads} threads");
                        // The fewest such rows: the last row of the left part is active (or it is empty).
                        assert!(c == 0 || active(first + c - 1), "{rows} rows, pattern {p}, {threads} threads");
                    }
                }
            }
        }
    }
}
