//! Running a case: dispatch to the oracle or the fast path by op and dtypes.

use super::*;

/// A QKV case's RoPE tensors: the table, its width (`rope_dim`), the position ids.
type CaseRope = (OwnedFreqs, usize, Option<Vec<u32>>);

/// A decoded `freqs_cis` table.
enum OwnedFreqs {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Case {
    /// Runs the case; returns the new `output` (None for the KV stores) and `kv_blocks`. A case
    /// with `kv_scales` (a quantized cache) updates them too: [`run_all`](Self::run_all) returns
    /// every tensor the op writes.
    pub fn run(&self, mode: Mode, exec: Exec) -> Result<(Option<Tensor>, Tensor)> {
        let mut all = self.run_all(mode, exec)?;
        let kv = all.remove("kv_blocks").ok_or_else(|| CaseError("`kv_blocks`: not written".into()))?;
        Ok((all.remove("output"), kv))
    }

    /// Runs the case; returns every tensor the op writes by name: `output` (not for the KV
    /// stores), `kv_blocks`, and `kv_scales` when the case has them.
    pub fn run_all(&self, mode: Mode, exec: Exec) -> Result<BTreeMap<String, Tensor>> {
        let (shape, cdt) = self.cache_shape()?;
        let mut scales = self.kv_scales(&shape)?;
        let (lookup, cols, lens) = self.page_table_parts()?;
        let table = PageTable::new(&lookup, cols, &lens)?;
        let layer = self.layer()?;
        let kv_t = self.tensor("kv_blocks")?;
        let out_t = if self.op.has_output() { Some(self.tensor("output")?) } else { None };
        let odt = match out_t {
            Some(_) => self.float_info("output", None)?.0,
            None => DType::F32,
        };
        if odt == DType::F8E4M3 {
            return err("`output`: expected dtype BF16, F16 or F32, found F8_E4M3");
        }
        macro_rules! go {
            ($o:ty, $c:ty) => {{
                let mut out: Vec<$o> = out_t.map(|t| decode::<$o>(&t.data)).unwrap_or_default();
                let mut cache: Vec<$c> = decode::<$c>(&kv_t.data);
                {
                    let view = PagedKvCacheMut::new(shape, &mut cache)?;
                    let mut kv = KvWrite::new(view, table, layer);
                    if let Some((s, g)) = scales.as_mut() {
                        kv = kv.with_scales(KvScalesMut::new(shape, *g, s)?);
                    }
                    self.dispatch::<$o, $c>(&mut out, &mut kv, mode, exec)?;
                }
                let mut all = BTreeMap::new();
                if let Some(t) = out_t {
                    all.insert("output".to_string(), Tensor::from_elements(t.shape.clone(), &out));
                }
                // E4M3 codes given as U8 go back as U8 (the same bytes).
                let mut kv = Tensor::from_elements(kv_t.shape.clone(), &cache);
                if kv_t.dtype == Dtype::U8 {
                    kv.dtype = Dtype::U8;
                }
                all.insert("kv_blocks".to_string(), kv);
                if let Some((s, _)) = &scales {
                    let t = self.tensor("kv_scales")?;
                    all.insert("kv_scales".to_string(), Tensor::from_elements(t.shape.clone(), s));
                }
                Ok(all)
            }};
        }
        match (odt, cdt) {
            (DType::F32, DType::F32) => go!(f32, f32),
            (DType::F32, DType::BF16) => go!(f32, bf16),
            (DType::F32, DType::F16) => go!(f32, f16),
            (DType::F32, DType::F8E4M3) => go!(f32, E4M3),
            (DType::BF16, DType::F32) => go!(bf16, f32),
            (DType::BF16, DType::BF16) => go!(bf16, bf16),
            (DType::BF16, DType::F16) => go!(bf16, f16),
            (DType::BF16, DType::F8E4M3) => go!(bf16, E4M3),
            (DType::F16, DType::F32) => go!(f16, f32),
            (DType::F16, DType::BF16) => go!(f16, bf16),
            (DType::F16, DType::F16) => go!(f16, f16),
            (DType::F16, DType::F8E4M3) => go!(f16, E4M3),
            (o, _) => err(format!("`output`: unsupported dtype {}", o.name())),
        }
    }

    fn acc(mode: Mode) -> Accumulation {
        if mode == Mode::Sequential { Accumulation::Sequential } else { Accumulation::Exact }
    }

    fn dispatch<O: Element, C: Element>(
        &self,
        out: &mut [O],
        kv: &mut KvWrite<'_, C>,
        mode: Mode,
        exec: Exec,
    ) -> Result<()> {
        match self.op {
            Op::QkvFp4Ragged => {
                let format = self.format()?;
                let tensor_sf: f32 = self.meta_parse("tensor_sf", "a decimal number")?;
                let (m, k) = self.quantized("hidden_state", "input_scale", format)?;
                let (n, wk) = self.quantized("weight", "weight_scale", format)?;
                if k != wk {
                    return err(format!("`weight`: expected K = {k} (from hidden_state), found K = {wk}"));
                }
                let offsets = self.u32s("input_row_offsets", None)?;
                let (_, oshape) = self.float_info("output", Some(2))?;
                if oshape[0] != m {
                    return err(format!("`output`: expected shape [{m}, q_dim], found {}", dims(oshape)));
                }
                let a = QuantizedRef::new(
                    format,
                    m,
                    k,
                    &self.tensor("hidden_state")?.data,
                    &self.tensor("input_scale")?.data,
                )?;
                let w =
                    QuantizedRef::new(format, n, k, &self.tensor("weight")?.data, &self.tensor("weight_scale")?.data)?;
                let freqs = self.qkv_freqs()?;
                let args = ops::QkvFp4Args {
                    hidden_state: a,
                    input_row_offsets: &offsets,
                    weight: w,
                    tensor_sf,
                    q_dim: oshape[1],
                    rope: self.qkv_rope(&freqs, kv.cache.shape().head_size())?,
                };
                match mode {
                    Mode::Fast => fast::qkv_fp4_ragged(&args, out, kv, exec)?,
                    _ => reference::qkv_fp4_ragged(&args, out, kv, Self::acc(mode))?,
                }
            }
            Op::QkvFp8Ragged => match self.tensors.get("bias").map(|t| elem_dtype(t.dtype)) {
                None => self.qkv_fp8::<bf16, O, C>(out, kv, mode, exec)?,
                Some(Some(DType::BF16)) => self.qkv_fp8::<bf16, O, C>(out, kv, mode, exec)?,
                Some(Some(DType::F16)) => self.qkv_fp8::<f16, O, C>(out, kv, mode, exec)?,
                Some(Some(DType::F32)) => self.qkv_fp8::<f32, O, C>(out, kv, mode, exec)?,
                Some(_) => {
                    return err(format!(
                        "`bias`: expected dtype BF16, F16 or F32, found {}",
                        self.tensor("bias")?.dtype
                    ));
                }
            },
            Op::QkvRagged | Op::QkvBshd => {
                let (xd, _) = self.float_info("hidden_state", None)?;
                match xd {
                    DType::F32 => self.qkv_plain::<f32, O, C>(out, kv, mode, exec)?,
                    DType::BF16 => self.qkv_plain::<bf16, O, C>(out, kv, mode, exec)?,
                    DType::F16 => self.qkv_plain::<f16, O, C>(out, kv, mode, exec)?,
                    DType::F8E4M3 => self.qkv_plain::<E4M3, O, C>(out, kv, mode, exec)?,
                }
            }
            Op::RopeBshd => {
                let (qd, qs) = self.float_info("q_proj", Some(4))?;
                let (od, os) = self.float_info("output", Some(4))?;
                let (fd, fs) = self.float_info("freqs_cis", Some(2))?;
                let hd = kv.cache.shape().head_size();
                if qs[3] != hd {
                    return err(format!(
                        "`q_proj`: expected shape [batch, seq_len, heads, {hd}] (the cache's head size), found {}",
                        dims(qs)
                    ));
                }
                if fs[1] != hd {
                    return err(format!(
                        "`freqs_cis`: expected shape [rows, {hd}] (the cache's head size), found {}",
                        dims(fs)
                    ));
                }
                if od != qd || fd != qd || os != qs {
                    return err(format!(
                        "`output`/`freqs_cis`: expected the dtype and shape of q_proj ({}, {}), found output {} {}, freqs_cis {}",
                        qd.name(),
                        dims(qs),
                        od.name(),
                        dims(os),
                        fd.name()
                    ));
                }
                let valid = self.u32s("valid_lengths", Some(&[qs[0]]))?;
                let q: Vec<O> = decode(&self.tensor("q_proj")?.data);
                let f: Vec<O> = decode(&self.tensor("freqs_cis")?.data);
                let Some(freqs) = ops::Freqs::of(&f) else {
                    return err("`freqs_cis`: expected dtype BF16, F16 or F32, found F8_E4M3");
                };
                let args = ops::RopeBshdArgs::new(&q, (qs[0], qs[1], qs[2]), freqs, &valid, self.interleaved()?);
                match mode {
                    Mode::Fast => fast::rope_bshd(&args, out, kv, self.rope_math()?, exec)?,
                    _ => reference::rope_bshd(&args, out, kv, self.rope_math()?)?,
                }
            }
            Op::RopeRagged => {
                let (qd, qs) = self.float_info("q_proj", Some(3))?;
                let (od, os) = self.float_info("output", Some(3))?;
                if od != qd || os != qs {
                    return err(format!(
                        "`output`: expected {} {}, found {} {}",
                        qd.name(),
                        dims(qs),
                        od.name(),
                        dims(os)
                    ));
                }
                let (fd, fs) = self.float_info("freqs_cis", Some(2))?;
                let offsets = self.u32s("input_row_offsets", None)?;
                let ids = if self.tensors.contains_key("position_ids") {
                    Some(self.u32s("position_ids", Some(&[qs[0]]))?)
                } else {
                    None
                };
                let q: Vec<O> = decode(&self.tensor("q_proj")?.data);
                let ft = &self.tensor("freqs_cis")?.data;
                macro_rules! with_f {
                    ($f:ty) => {{
                        let f: Vec<$f> = decode(ft);
                        let args = ops::RopeRaggedArgs {
                            position_ids: ids.as_deref(),
                            ..ops::RopeRaggedArgs::new(&q, &offsets, (qs[1], qs[2]), &f, fs[1], self.interleaved()?)
                        };
                        match mode {
                            Mode::Fast => fast::rope_ragged(&args, out, kv, self.rope_math()?, exec)?,
                            _ => reference::rope_ragged(&args, out, kv, self.rope_math()?)?,
                        }
                    }};
                }
                match fd {
                    DType::F32 => with_f!(f32),
                    DType::BF16 => with_f!(bf16),
                    DType::F16 => with_f!(f16),
                    DType::F8E4M3 => return err("`freqs_cis`: expected dtype BF16, F16 or F32, found F8_E4M3"),
                }
            }
            Op::KvStoreRagged | Op::KvStoreBshd => {
                let which = match self.meta.get("cache").map(|s| s.as_str()) {
                    None | Some("k") => KvSel::K,
                    Some("v") => KvSel::V,
                    Some(s) => return err(format!("`__metadata__.cache`: expected `k` or `v`, found `{s}`")),
                };
                let values = self.floats_f32("hidden_state")?;
                let shape = kv.cache.shape();
                let (hkv, hd) = (shape.num_kv_heads(), shape.head_size());
                let rank = if self.op == Op::KvStoreRagged { 3 } else { 4 };
                let (_, xs) = self.float_info("hidden_state", Some(rank))?;
                if xs[rank - 2..] != [hkv, hd] {
                    return err(format!(
                        "`hidden_state`: expected shape [{}, {hkv}, {hd}] (the cache's heads), found {}",
                        if rank == 3 { "M" } else { "batch, seq_len" },
                        dims(xs)
                    ));
                }
                if self.op == Op::KvStoreRagged {
                    let offsets = self.u32s("input_row_offsets", None)?;
                    let args = ops::KvStoreRaggedArgs { values: &values, input_row_offsets: &offsets, which };
                    match mode {
                        Mode::Fast => fast::kv_store_ragged(&args, kv, exec)?,
                        _ => reference::kv_store_ragged(&args, kv)?,
                    }
                } else {
                    let valid = self.u32s("valid_lengths", Some(&[xs[0]]))?;
                    let args = ops::KvStoreBshdArgs {
                        values: &values,
                        batch: xs[0],
                        seq_len: xs[1],
                        valid_lengths: &valid,
                        which,
                    };
                    match mode {
                        Mode::Fast => fast::kv_store_bshd(&args, kv, exec)?,
                        _ => reference::kv_store_bshd(&args, kv)?,
                    }
                }
            }
        }
        Ok(())
    }

    /// A QKV case's optional fused RoPE table: the `freqs_cis` tensor (f32, bf16 or f16,
    /// `[rows, rope_dim]`), with `position_ids` for the ragged ops.
    fn qkv_freqs(&self) -> Result<Option<CaseRope>> {
        if !self.tensors.contains_key("freqs_cis") {
            return Ok(None);
        }
        let (fd, fs) = self.float_info("freqs_cis", Some(2))?;
        let rd = fs[1];
        let data = &self.tensor("freqs_cis")?.data;
        let f = match fd {
            DType::F32 => OwnedFreqs::F32(decode(data)),
            DType::BF16 => OwnedFreqs::Bf16(decode(data)),
            DType::F16 => OwnedFreqs::F16(decode(data)),
            DType::F8E4M3 => return err("`freqs_cis`: expected dtype BF16, F16 or F32, found F8_E4M3"),
        };
        let ids = if self.tensors.contains_key("position_ids") { Some(self.u32s("position_ids", None)?) } else { None };
        Ok(Some((f, rd, ids)))
    }

    /// The fused RoPE of a QKV case that has a `freqs_cis` tensor: metadata `interleaved`
    /// (default `false`), `q_head_size` (default: the cache's head size) and `rope_math` (as for
    /// the RoPE ops: [`rope_math`](Self::rope_math)).
    fn qkv_rope<'f>(&self, freqs: &'f Option<CaseRope>, head: usize) -> Result<Option<ops::QkvRope<'f>>> {
        let Some((f, rope_dim, ids)) = freqs else { return Ok(None) };
        let interleaved = if self.meta.contains_key("interleaved") { self.interleaved()? } else { false };
        let q_head_size = if self.meta.contains_key("q_head_size") {
            self.meta_parse("q_head_size", "an unsigned integer")?
        } else {
            head
        };
        Ok(Some(ops::QkvRope {
            freqs_cis: match f {
                OwnedFreqs::F32(v) => ops::Freqs::F32(v),
                OwnedFreqs::Bf16(v) => ops::Freqs::Bf16(v),
                OwnedFreqs::F16(v) => ops::Freqs::F16(v),
            },
            q_head_size,
            rope_dim: *rope_dim,
            interleaved,
            position_ids: ids.as_deref(),
            math: self.rope_math()?,
        }))
    }

    /// `qkv_fp8_ragged` with a bias of dtype `B` (if any): E4M3 `hidden_state` and `weight`
    /// (F8_E4M3 or U8), f32 (or bf16, f16) scales whose shapes give the granularity.
    fn qkv_fp8<B: Element, O: Element, C: Element>(
        &self,
        out: &mut [O],
        kv: &mut KvWrite<'_, C>,
        mode: Mode,
        exec: Exec,
    ) -> Result<()> {
        let e4m3 = |name: &str| -> Result<(&[u8], usize, usize)> {
            let t = self.tensor(name)?;
            if !matches!(t.dtype, Dtype::U8 | Dtype::F8E4M3) {
                return err(format!("`{name}`: expected dtype F8_E4M3 or U8, found {}", t.dtype));
            }
            match t.shape[..] {
                [r, k] => Ok((&t.data, r, k)),
                _ => err(format!("`{name}`: expected rank 2, found shape {}", dims(&t.shape))),
            }
        };
        let (x, m, k) = e4m3("hidden_state")?;
        let (w, n, wk) = e4m3("weight")?;
        if wk != k {
            return err(format!("`weight`: expected shape [N, {k}] (K from hidden_state), found [{n}, {wk}]"));
        }
        let (_, os) = self.float_info("output", Some(2))?;
        if os[0] != m {
            return err(format!("`output`: expected shape [{m}, q_dim], found {}", dims(os)));
        }
        let offsets = self.u32s("input_row_offsets", None)?;
        let (si, sw) = (self.floats_f32("input_scale")?, self.floats_f32("weight_scale")?);
        let (sis, sws) = (&self.tensor("input_scale")?.shape, &self.tensor("weight_scale")?.shape);
        let scales = ops::Fp8Scales::infer((&si, sis), (&sw, sws), (m, n, k))?;
        let bias = if self.tensors.contains_key("bias") {
            self.expect_shape("bias", &[n])?;
            Some(self.typed::<B>("bias")?)
        } else {
            None
        };
        let freqs = self.qkv_freqs()?;
        let args = ops::QkvFp8Args {
            hidden_state: x,
            input_row_offsets: &offsets,
            weight: w,
            hidden_size: k,
            scales,
            bias: bias.as_deref(),
            q_dim: os[1],
            rope: self.qkv_rope(&freqs, kv.cache.shape().head_size())?,
        };
        match mode {
            Mode::Fast => fast::qkv_fp8_ragged(&args, out, kv, exec)?,
            _ => reference::qkv_fp8_ragged(&args, out, kv, Self::acc(mode))?,
        }
        Ok(())
    }

    /// `qkv_ragged` / `qkv_bshd` with activations, weight and bias of one dtype `T` (as MAX).
    fn qkv_plain<T: Element, O: Element, C: Element>(
        &self,
        out: &mut [O],
        kv: &mut KvWrite<'_, C>,
        mode: Mode,
        exec: Exec,
    ) -> Result<()> {
        let ragged = self.op == Op::QkvRagged;
        let rank = if ragged { 2 } else { 3 };
        let (_, xs) = self.float_info("hidden_state", Some(rank))?;
        let k = xs[rank - 1];
        let x: Vec<T> = self.typed("hidden_state")?;
        let w: Vec<T> = self.typed("weight")?;
        let (_, ws) = self.float_info("weight", Some(2))?;
        if ws[1] != k {
            return err(format!("`weight`: expected shape [N, {k}], found {}", dims(ws)));
        }
        let (_, os) = self.float_info("output", Some(rank))?;
        if os[..rank - 1] != xs[..rank - 1] {
            let lead: Vec<String> = xs[..rank - 1].iter().map(|d| d.to_string()).collect();
            return err(format!("`output`: expected shape [{}, q_dim], found {}", lead.join(", "), dims(os)));
        }
        let q_dim = os[rank - 1];
        if ragged {
            let bias = if self.tensors.contains_key("bias") {
                self.expect_shape("bias", &[ws[0]])?;
                Some(self.typed::<T>("bias")?)
            } else {
                None
            };
            let offsets = self.u32s("input_row_offsets", None)?;
            let freqs = self.qkv_freqs()?;
            let args = ops::QkvRaggedArgs {
                hidden_state: &x,
                input_row_offsets: &offsets,
                weight: &w,
                hidden_size: k,
                bias: bias.as_deref(),
                q_dim,
                rope: self.qkv_rope(&freqs, kv.cache.shape().head_size())?,
            };
            match mode {
                Mode::Fast => fast::qkv_ragged(&args, out, kv, exec)?,
                _ => reference::qkv_ragged(&args, out, kv, Self::acc(mode))?,
            }
        } else {
            let valid = self.u32s("valid_lengths", Some(&[xs[0]]))?;
            let freqs = self.qkv_freqs()?;
            let args = ops::QkvBshdArgs {
                hidden_state: &x,
                batch: xs[0],
                seq_len: xs[1],
                hidden_size: k,
                weight: &w,
                valid_lengths: &valid,
                q_dim,
                rope: self.qkv_rope(&freqs, kv.cache.shape().head_size())?,
            };
            match mode {
                Mode::Fast => fast::qkv_bshd(&args, out, kv, exec)?,
                _ => reference::qkv_bshd(&args, out, kv, Self::acc(mode))?,
            }
        }
        Ok(())
    }
}

/// Runs `case` with `par` threads (Rayon) or sequentially.
pub fn exec(threads: Option<usize>) -> Exec {
    Exec { par: if threads == Some(1) { Par::Sequential } else { Par::Rayon }, isa: None }
}
