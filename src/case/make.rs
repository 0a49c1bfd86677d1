//! Making cases: model shapes and random calls of each op.

use super::*;
use crate::ops::Fp8Granularity;

/// Model shapes for [`make()`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelShape {
    /// `llama3-8b`, `qwen2.5-0.5b` or `tiny`.
    pub name: &'static str,
    /// Hidden size (K).
    pub hidden: usize,
    /// Q heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head size.
    pub head: usize,
    /// Tokens per page.
    pub page: usize,
    /// RoPE θ.
    pub rope_theta: f64,
}

/// The models [`make()`] knows.
pub const MODELS: [ModelShape; 3] = [
    ModelShape {
        name: "llama3-8b",
        hidden: 4096,
        q_heads: 32,
        kv_heads: 8,
        head: 128,
        page: 128,
        rope_theta: 500000.0,
    },
    ModelShape {
        name: "qwen2.5-0.5b",
        hidden: 896,
        q_heads: 14,
        kv_heads: 2,
        head: 64,
        page: 128,
        rope_theta: 1000000.0,
    },
    ModelShape { name: "tiny", hidden: 64, q_heads: 2, kv_heads: 1, head: 16, page: 4, rope_theta: 10000.0 },
];

/// A model by name.
pub fn model(name: &str) -> Option<ModelShape> {
    MODELS.into_iter().find(|m| m.name == name)
}

/// An approximately normal value (mean 0, variance 1) from four uniforms: bell-shaped enough for
/// activations and weights, and cheap.
pub fn normal(rng: &mut fastrand::Rng) -> f32 {
    (0..4).map(|_| rng.f32() - 0.5).sum::<f32>() * 1.732
}

/// Options of [`make_with`]: build them with [`MakeOptions::new`] and the `with_` methods.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MakeOptions {
    /// Store E4M3 data and scales as `F8_E4M3` and E8M0 scales as `F8_E8M0` instead of `U8`.
    /// `U8` (the default) is what `safetensors.numpy` can load; the reader accepts both.
    pub f8_dtypes: bool,
    /// Make the cache FP8-quantized ([semantics §3.1](crate::semantics)) with one f32 scale per
    /// this many elements of a head (MAX's default: 128; at least 2, dividing the head size):
    /// `kv_blocks` holds E4M3 codes (`U8`, or `F8_E4M3` with [`f8_dtypes`](Self::f8_dtypes)),
    /// `kv_scales` the scales, each group of the random cache quantized as the ops quantize what
    /// they write.
    pub kv_quant: Option<usize>,
}

impl MakeOptions {
    /// The defaults: FP8 bytes as `U8`, a bf16 cache.
    pub fn new() -> Self {
        Self::default()
    }
    /// With [`f8_dtypes`](Self::f8_dtypes) set.
    pub fn with_f8_dtypes(self, f8_dtypes: bool) -> Self {
        MakeOptions { f8_dtypes, ..self }
    }
    /// With [`kv_quant`](Self::kv_quant) set.
    pub fn with_kv_quant(self, granularity: Option<usize>) -> Self {
        MakeOptions { kv_quant: granularity, ..self }
    }
}

/// Writes a realistic random case of `op` for `m` (see [`make_with`]), with FP8 bytes as U8.
pub fn make(op: Op, m: ModelShape, batch: usize, seed: u64, format: BlockFormat) -> Result<Case> {
    make_with(op, m, batch, seed, format, MakeOptions::default())
}

/// Writes a realistic random case of `op` for `model`: `batch` sequences of a few new tokens
/// after random cached lengths, pages scattered over a bf16 cache of 2 layers (layer 1 written),
/// with one extra block as MAX's null-block sentinel. FP4 operands are quantized with this crate's
/// quantizers in `format`.
pub fn make_with(
    op: Op,
    m: ModelShape,
    batch: usize,
    seed: u64,
    format: BlockFormat,
    opts: MakeOptions,
) -> Result<Case> {
    make_case(op, m, batch, seed, (format, Fp8Granularity::Tensor), opts)
}

/// A `qkv_fp8_ragged` case (as [`make_with`] makes the others) with scales of granularity `g`:
/// activations and weight quantized to E4M3 by
/// [`quantize_fp8_input`](crate::formats::quantize::quantize_fp8_input) and
/// [`quantize_fp8_weight`](crate::formats::quantize::quantize_fp8_weight), a bf16 bias and output.
/// ([`make_with`] makes it per tensor.)
pub fn make_fp8(m: ModelShape, batch: usize, seed: u64, g: Fp8Granularity, opts: MakeOptions) -> Result<Case> {
    make_case(Op::QkvFp8Ragged, m, batch, seed, (BlockFormat::Mxfp8, g), opts)
}

fn make_case(
    op: Op,
    m: ModelShape,
    batch: usize,
    seed: u64,
    (format, g): (BlockFormat, Fp8Granularity),
    opts: MakeOptions,
) -> Result<Case> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let max_new = if m.name == "tiny" { 5 } else { 4 };
    let lens: Vec<usize> = (0..batch).map(|b| if b == 2 { 0 } else { 1 + rng.usize(..max_new) }).collect();
    let cache_lengths: Vec<u32> = (0..batch).map(|_| rng.usize(..3 * m.page) as u32).collect();
    let pages: Vec<usize> = lens.iter().zip(&cache_lengths).map(|(&l, &c)| (c as usize + l).div_ceil(m.page)).collect();
    let cols = pages.iter().copied().max().unwrap_or(0) + 1;
    let num_blocks = pages.iter().sum::<usize>() + 1;
    let mut free: Vec<u32> = (0..num_blocks as u32 - 1).collect();
    for i in (1..free.len()).rev() {
        let j = rng.usize(..i + 1);
        free.swap(i, j);
    }
    let mut lookup = vec![num_blocks as u32 - 1; batch * cols];
    let mut next = 0;
    for (b, &p) in pages.iter().enumerate() {
        for j in 0..p {
            lookup[b * cols + j] = free[next];
            next += 1;
        }
    }
    let shape = CacheShape::mha(num_blocks, 2, m.page, m.kv_heads, m.head)?;
    let kv: Vec<bf16> = (0..shape.len()).map(|_| bf16::from_f32(normal(&mut rng) * 0.5)).collect();
    let mut t = BTreeMap::new();
    match opts.kv_quant {
        None => {
            t.insert("kv_blocks".to_string(), Tensor::from_elements(shape.dims().to_vec(), &kv));
        }
        Some(g) => {
            let (codes, scales) = quantize_cache(&kv, shape, g)?;
            // The codes as U8 (what `safetensors.numpy` loads) or F8_E4M3, as `f8_dtypes` says:
            // `kv_scales` is what makes the cache quantized.
            let d = if opts.f8_dtypes { Dtype::F8E4M3 } else { Dtype::U8 };
            t.insert("kv_blocks".to_string(), Tensor::from_bytes(d, shape.dims().to_vec(), codes));
            t.insert("kv_scales".to_string(), Tensor::from_elements(scales.dims().to_vec(), scales.data()));
        }
    }
    t.insert("cache_lengths".into(), Tensor::from_u32(vec![batch], &cache_lengths));
    t.insert("kv_lookup_table".into(), Tensor::from_u32(vec![batch, cols], &lookup));
    let mut meta = BTreeMap::new();
    meta.insert("layer_idx".to_string(), "1".to_string());
    let total: usize = lens.iter().sum();
    let s_max = lens.iter().copied().max().unwrap_or(0);
    let (k, q_dim, n) = (m.hidden, m.q_heads * m.head, (m.q_heads + 2 * m.kv_heads) * m.head);
    let mut offsets = vec![0u32];
    for &l in &lens {
        offsets.push(offsets[offsets.len() - 1] + l as u32);
    }
    let randv =
        |rng: &mut fastrand::Rng, n: usize, scale: f32| -> Vec<f32> { (0..n).map(|_| normal(rng) * scale).collect() };
    let bf = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
    let max_pos = lens.iter().zip(&cache_lengths).map(|(&l, &c)| c as usize + l).max().unwrap_or(0);
    match op {
        Op::QkvFp4Ragged => {
            use crate::formats::quantize::{amax, nvfp4_global_scale, quantize};
            let x = randv(&mut rng, total * k, 1.0);
            let w = randv(&mut rng, n * k, 0.05);
            let a = quantize(format, &x, total, k, nvfp4_global_scale(amax(&x)))?;
            let wq = quantize(format, &w, n, k, nvfp4_global_scale(amax(&w)))?;
            let (data_dt, scale_dt) = match (opts.f8_dtypes, format) {
                (false, _) => (Dtype::U8, Dtype::U8),
                (true, BlockFormat::Nvfp4) => (Dtype::U8, Dtype::F8E4M3),
                (true, BlockFormat::Mxfp4) => (Dtype::U8, Dtype::F8E8M0),
                (true, BlockFormat::Mxfp8) => (Dtype::F8E4M3, Dtype::F8E8M0),
            };
            let cols_of = |rows: usize| vec![rows, format.row_bytes(k)];
            let lay = |rows: usize| ScaleLayout::for_operand(rows, k, format.vector_size()).shape().to_vec();
            t.insert("hidden_state".into(), Tensor::from_bytes(data_dt, cols_of(total), a.data().to_vec()));
            t.insert("input_scale".into(), Tensor::from_bytes(scale_dt, lay(total), a.scales().to_vec()));
            t.insert("weight".into(), Tensor::from_bytes(data_dt, cols_of(n), wq.data().to_vec()));
            t.insert("weight_scale".into(), Tensor::from_bytes(scale_dt, lay(n), wq.scales().to_vec()));
            t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
            t.insert("output".into(), Tensor::from_elements(vec![total, q_dim], &vec![bf16::ZERO; total * q_dim]));
            meta.insert("format".into(), format.name().into());
            meta.insert("tensor_sf".into(), format!("{:e}", a.tensor_scale() * wq.tensor_scale()));
        }
        Op::QkvFp8Ragged => {
            use crate::formats::quantize::{quantize_fp8_input, quantize_fp8_weight};
            let x = randv(&mut rng, total * k, 1.0);
            let w = randv(&mut rng, n * k, 1.0 / (k as f32).sqrt());
            let (xq, si) = quantize_fp8_input(&x, total, k, g)?;
            let (wq, sw) = quantize_fp8_weight(&w, n, k, g)?;
            let (is, ws) = g.scale_shapes(total, n, k);
            let dt = if opts.f8_dtypes { Dtype::F8E4M3 } else { Dtype::U8 };
            t.insert("hidden_state".into(), Tensor::from_bytes(dt, vec![total, k], xq));
            t.insert("weight".into(), Tensor::from_bytes(dt, vec![n, k], wq));
            t.insert("input_scale".into(), Tensor::from_elements(is.to_vec(), &si));
            t.insert("weight_scale".into(), Tensor::from_elements(ws.to_vec(), &sw));
            t.insert("bias".into(), Tensor::from_elements(vec![n], &bf(&randv(&mut rng, n, 0.1))));
            t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
            t.insert("output".into(), Tensor::from_elements(vec![total, q_dim], &vec![bf16::ZERO; total * q_dim]));
        }
        Op::QkvRagged | Op::QkvBshd => {
            let w = bf(&randv(&mut rng, n * k, 1.0 / (k as f32).sqrt()));
            t.insert("weight".into(), Tensor::from_elements(vec![n, k], &w));
            if op == Op::QkvRagged {
                let x = bf(&randv(&mut rng, total * k, 1.0));
                t.insert("hidden_state".into(), Tensor::from_elements(vec![total, k], &x));
                t.insert("bias".into(), Tensor::from_elements(vec![n], &bf(&randv(&mut rng, n, 0.1))));
                t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
                t.insert("output".into(), Tensor::from_elements(vec![total, q_dim], &vec![bf16::ZERO; total * q_dim]));
            } else {
                let x = bf(&randv(&mut rng, batch * s_max * k, 1.0));
                t.insert("hidden_state".into(), Tensor::from_elements(vec![batch, s_max, k], &x));
                t.insert(
                    "valid_lengths".into(),
                    Tensor::from_u32(vec![batch], &lens.iter().map(|&l| l as u32).collect::<Vec<_>>()),
                );
                let z = vec![bf16::ZERO; batch * s_max * q_dim];
                t.insert("output".into(), Tensor::from_elements(vec![batch, s_max, q_dim], &z));
            }
        }
        Op::RopeBshd | Op::RopeRagged => {
            let rows = max_pos + 1;
            let f = freqs_cis(rows, m.head, m.rope_theta);
            meta.insert("interleaved".into(), (op == Op::RopeBshd).to_string());
            if op == Op::RopeBshd {
                let q = bf(&randv(&mut rng, batch * s_max * m.q_heads * m.head, 1.0));
                let sh = vec![batch, s_max, m.q_heads, m.head];
                t.insert("q_proj".into(), Tensor::from_elements(sh.clone(), &q));
                t.insert("output".into(), Tensor::from_elements(sh, &vec![bf16::ZERO; q.len()]));
                t.insert("freqs_cis".into(), Tensor::from_elements(vec![rows, m.head], &bf(&f)));
                t.insert(
                    "valid_lengths".into(),
                    Tensor::from_u32(vec![batch], &lens.iter().map(|&l| l as u32).collect::<Vec<_>>()),
                );
            } else {
                let q = bf(&randv(&mut rng, total * m.q_heads * m.head, 1.0));
                let sh = vec![total, m.q_heads, m.head];
                t.insert("q_proj".into(), Tensor::from_elements(sh.clone(), &q));
                t.insert("output".into(), Tensor::from_elements(sh, &vec![bf16::ZERO; q.len()]));
                t.insert("freqs_cis".into(), Tensor::from_elements(vec![rows, m.head], &f));
                t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
            }
        }
        Op::KvStoreRagged | Op::KvStoreBshd => {
            meta.insert("cache".into(), "v".into());
            if op == Op::KvStoreRagged {
                let v = bf(&randv(&mut rng, total * m.kv_heads * m.head, 1.0));
                t.insert("hidden_state".into(), Tensor::from_elements(vec![total, m.kv_heads, m.head], &v));
                t.insert("input_row_offsets".into(), Tensor::from_u32(vec![batch + 1], &offsets));
            } else {
                let v = bf(&randv(&mut rng, batch * s_max * m.kv_heads * m.head, 1.0));
                t.insert("hidden_state".into(), Tensor::from_elements(vec![batch, s_max, m.kv_heads, m.head], &v));
                t.insert(
                    "valid_lengths".into(),
                    Tensor::from_u32(vec![batch], &lens.iter().map(|&l| l as u32).collect::<Vec<_>>()),
                );
            }
        }
    }
    Ok(Case { op, meta, tensors: t })
}

/// A cache's values quantized as the ops quantize what they write ([semantics §3.1](crate::semantics)):
/// per group of `g` elements `scale = amax / 448`, codes `E4M3(x · (1 / scale))`.
fn quantize_cache(kv: &[bf16], shape: CacheShape, g: usize) -> Result<(Vec<u8>, crate::KvScales)> {
    let mut scales = crate::KvScales::zeros(shape, g)?;
    let mut codes = vec![0u8; kv.len()];
    let mut s = scales.view_mut();
    for ((x, c), sc) in kv.chunks(g).zip(codes.chunks_mut(g)).zip(s.data_mut()) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        let (scale, inv) = crate::formats::quantize::fp8_scale(amax);
        for (c, v) in c.iter_mut().zip(x) {
            *c = E4M3::from_f32(v.to_f32() * inv).0;
        }
        *sc = scale;
    }
    Ok((codes, scales))
}
