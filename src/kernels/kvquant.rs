//! The fast side of quantized caches ([semantics §3.1](crate::semantics)): the quantization of
//! staged K/V rows into their slots (a RoPE's one pass per row is `rope::rope_rows_quant`).
//! Rows run in parallel (each row owns its slot, the slot plan promises it; a decode call's few
//! rows on the calling thread). Within a row the values are widened by the SIMD conversion and
//! each group quantized by [`kv_groups`] (compiled per ISA, the branch-free E4M3 encoder: the
//! scalar encoder made a Qwen2.5-0.5B M = 512 bf16 QKV into an FP8 cache 1.08x the bf16-cache
//! call, AMD Zen 3). The same bits as the oracle's `quantize_part`.

#![allow(unsafe_code)] // writes through `SharedMut`, one slot per row

use super::scatter::SharedMut;
use super::team::Team;
use crate::cache::quant::group_scale;
use crate::cache::{CacheShape, KvSel, RowSlot};
use crate::dtype::E4M3;
use crate::element::Element;
use crate::pool::Pooled;
use crate::simd::rope::{narrow, same_type_mut, widen};
use crate::simd::{IsaToken, kv_groups};

/// Rows handed to a thread at once.
const ROWS: usize = 16;

/// Where quantized rows go: the cache, its scales, the layer and the granularity.
pub(crate) struct QuantCache<'a, C> {
    pub data: &'a mut [C],
    pub scales: &'a mut [f32],
    pub shape: CacheShape,
    pub layer: usize,
    pub granularity: usize,
}

/// Quantizes the rows `rows` (`(source row, slot)`) of `src` (rows of `stride` values; part
/// `(which, at)` of a row is its `num_kv_heads · head_size` values from `at`) into their slots.
pub(crate) fn quantize_rows<S: Element, C: Element>(
    token: IsaToken,
    team: Team,
    src: &[S],
    stride: usize,
    rows: &[(usize, RowSlot)],
    parts: &[(KvSel, usize)],
    dst: QuantCache<'_, C>,
) {
    let (shape, g) = (dst.shape, dst.granularity);
    let width = shape.kv_width();
    let (cache, scales) = (SharedMut::new(dst.data), SharedMut::new(dst.scales));
    // One chunk runs on the calling thread: a hand-off to the pool costs more than a decode
    // call's few rows.
    let team = if rows.len() <= ROWS { Team::One } else { team };
    team.chunks(rows, ROWS, |chunk| {
        let mut buf = Pooled::filled(0f32, width);
        for &(r, slot) in chunk {
            for &(which, at) in parts {
                let x = &src[r * stride + at..][..width];
                widen(token, x, &mut buf);
                let base = shape.index(slot.block, which as usize, dst.layer, slot.offset, 0, 0);
                // SAFETY: the slot of this row (and so its part `which`, and that part's scales,
                // the cache's indices divided by `g`) is written by no other row: the slot plan
                // gives every row its own slot, and each row is in one chunk.
                let (out, sc) = unsafe { (cache.slice_mut(base, width), scales.slice_mut(base / g, width / g)) };
                match same_type_mut::<C, E4M3>(out) {
                    Some(codes) => kv_groups(token, &buf, g, codes, sc),
                    // Not reached (quantized caches are E4M3, checked before the call); the
                    // element-wise form of the same quantization all the same.
                    None => {
                        for ((group, s), o) in buf.chunks_mut(g).zip(sc).zip(out.chunks_mut(g)) {
                            let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
                            let (scale, inv) = group_scale(amax);
                            group.iter_mut().for_each(|v| *v *= inv);
                            narrow(token, group, o);
                            *s = scale;
                        }
                    }
                }
            }
        }
    });
}
