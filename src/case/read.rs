//! Reading a case: parsing, metadata, typed tensors, the cache and page table it describes.

use super::*;

impl Case {
    /// Parses a safetensors file (no tensor is interpreted yet beyond its header).
    pub fn from_bytes(bytes: &[u8]) -> Result<Case> {
        let tensors = load_tensors(bytes)?;
        let (_, header) =
            SafeTensors::read_metadata(bytes).map_err(|e| CaseError(format!("not a valid safetensors file: {e}")))?;
        let meta: BTreeMap<String, String> = header.metadata().clone().unwrap_or_default().into_iter().collect();
        let op_name = meta.get("op").ok_or_else(|| CaseError("`__metadata__`: missing `op`".into()))?;
        let op = Op::from_name(op_name).ok_or_else(|| {
            CaseError(format!(
                "`__metadata__.op`: expected one of {}, found `{op_name}`",
                Op::ALL.map(Op::name).join(", ")
            ))
        })?;
        Ok(Case { op, meta, tensors })
    }

    /// Serialises to safetensors bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut meta = self.meta.clone();
        meta.insert("op".into(), self.op.name().into());
        save_tensors(&self.tensors, Some(meta))
    }

    /// The tensor `name`, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| CaseError(format!("`{name}`: missing tensor (op {})", self.op.name())))
    }

    fn meta_str(&self, key: &str) -> Result<&str> {
        self.meta
            .get(key)
            .map(|s| s.as_str())
            .ok_or_else(|| CaseError(format!("`__metadata__`: missing `{key}` (op {})", self.op.name())))
    }

    pub(super) fn meta_parse<T: std::str::FromStr>(&self, key: &str, what: &str) -> Result<T> {
        let s = self.meta_str(key)?;
        s.trim().parse().map_err(|_| CaseError(format!("`__metadata__.{key}`: expected {what}, found `{s}`")))
    }

    pub(super) fn layer(&self) -> Result<usize> {
        self.meta_parse("layer_idx", "an unsigned integer")
    }

    pub(super) fn interleaved(&self) -> Result<bool> {
        self.meta_parse("interleaved", "`true` or `false`")
    }

    /// The block format of a `qkv_fp4_ragged` case.
    pub fn format(&self) -> Result<BlockFormat> {
        let s = self.meta_str("format")?;
        BlockFormat::from_name(s)
            .ok_or_else(|| CaseError(format!("`__metadata__.format`: expected nvfp4, mxfp4 or mxfp8, found `{s}`")))
    }

    /// A U32 tensor of exactly `shape`, or of rank 1 (any length) when `shape` is `None`.
    pub(super) fn u32s(&self, name: &str, shape: Option<&[usize]>) -> Result<Vec<u32>> {
        let t = self.tensor(name)?;
        if t.dtype != Dtype::U32 {
            return err(format!("`{name}`: expected dtype U32, found {}", t.dtype));
        }
        match shape {
            Some(s) if t.shape != s => {
                return err(format!("`{name}`: expected shape {}, found {}", dims(s), dims(&t.shape)));
            }
            None if t.shape.len() != 1 => {
                return err(format!("`{name}`: expected rank 1, found shape {}", dims(&t.shape)));
            }
            _ => {}
        }
        Ok(t.data.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }

    /// A float tensor decoded as `T`, which must be its dtype.
    pub(super) fn typed<T: Element>(&self, name: &str) -> Result<Vec<T>> {
        let t = self.tensor(name)?;
        if elem_dtype(t.dtype) != Some(T::DTYPE) {
            return err(format!("`{name}`: expected dtype {}, found {}", st_dtype(T::DTYPE), t.dtype));
        }
        Ok(decode(&t.data))
    }

    /// A float tensor's dtype and shape, checked to be `rank`-dimensional (if given).
    pub(super) fn float_info(&self, name: &str, rank: Option<usize>) -> Result<(DType, &[usize])> {
        let t = self.tensor(name)?;
        let d = elem_dtype(t.dtype).ok_or_else(|| {
            CaseError(format!("`{name}`: expected dtype BF16, F16, F32 or F8_E4M3, found {}", t.dtype))
        })?;
        if let Some(r) = rank
            && t.shape.len() != r
        {
            return err(format!("`{name}`: expected rank {r}, found shape {}", dims(&t.shape)));
        }
        Ok((d, &t.shape))
    }

    pub(super) fn floats_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        Ok(match elem_dtype(t.dtype) {
            Some(DType::F32) => decode::<f32>(&t.data),
            Some(DType::BF16) => decode::<bf16>(&t.data).iter().map(|v| v.to_f32()).collect(),
            Some(DType::F16) => decode::<f16>(&t.data).iter().map(|v| v.to_f32()).collect(),
            Some(DType::F8E4M3) => decode::<E4M3>(&t.data).iter().map(|v| v.to_f32()).collect(),
            None => return err(format!("`{name}`: expected dtype BF16, F16 or F32, found {}", t.dtype)),
        })
    }

    pub(super) fn expect_shape(&self, name: &str, want: &[usize]) -> Result<()> {
        let t = self.tensor(name)?;
        if t.shape == want {
            Ok(())
        } else {
            err(format!("`{name}`: expected shape {}, found {}", dims(want), dims(&t.shape)))
        }
    }

    /// A quantized cache's `kv_scales` (F32 `[num_blocks, kv_dim, num_layers, page_size,
    /// num_kv_heads, head_size / g]`, `kv_blocks`' first five dimensions) and its granularity `g`,
    /// or None when the case has none.
    pub(super) fn kv_scales(&self, shape: &CacheShape) -> Result<Option<(Vec<f32>, usize)>> {
        let Some(t) = self.tensors.get("kv_scales") else { return Ok(None) };
        if t.dtype != Dtype::F32 {
            return err(format!("`kv_scales`: expected dtype F32, found {}", t.dtype));
        }
        let g = crate::cache::KvScales::granularity_of(*shape, &t.shape)?;
        Ok(Some((decode::<f32>(&t.data), g)))
    }

    /// The cache's shape and dtype. A quantized cache's E4M3 codes may come as `U8` (what
    /// `safetensors.numpy` loads and `make-case` writes) or `F8_E4M3`; `U8` codes need
    /// `kv_scales`, which is what makes them a quantized cache.
    pub(super) fn cache_shape(&self) -> Result<(CacheShape, DType)> {
        let (d, shape) = match self.tensor("kv_blocks")? {
            t if t.dtype == Dtype::U8 => {
                if !self.tensors.contains_key("kv_scales") {
                    return err("`kv_blocks`: U8 is a quantized cache's E4M3 codes and needs `kv_scales` \
                         (a cache of values is BF16, F16, F32 or F8_E4M3)");
                }
                if t.shape.len() != 6 {
                    return err(format!("`kv_blocks`: expected rank 6, found shape {}", dims(&t.shape)));
                }
                (DType::F8E4M3, &t.shape[..])
            }
            _ => self.float_info("kv_blocks", Some(6))?,
        };
        let s = CacheShape::from_dims(shape).map_err(|e| CaseError(e.to_string()))?;
        Ok((s, d))
    }

    pub(super) fn page_table_parts(&self) -> Result<(Vec<u32>, usize, Vec<u32>)> {
        let lens = self.u32s("cache_lengths", None)?;
        let t = self.tensor("kv_lookup_table")?;
        if t.shape.len() != 2 || t.shape[0] != lens.len() {
            return err(format!(
                "`kv_lookup_table`: expected shape [{}, cols] (batch from cache_lengths), found {}",
                lens.len(),
                dims(&t.shape)
            ));
        }
        let cols = t.shape[1];
        Ok((self.u32s("kv_lookup_table", Some(&[lens.len(), cols]))?, cols, lens))
    }

    /// A block-scaled operand: data (U8 packed, F4 or F8_E4M3) and 5-D scales (U8, F8_E4M3 or F8_E8M0).
    pub(super) fn quantized(&self, data: &str, scales: &str, format: BlockFormat) -> Result<(usize, usize)> {
        let t = self.tensor(data)?;
        if t.shape.len() != 2 {
            return err(format!("`{data}`: expected rank 2, found shape {}", dims(&t.shape)));
        }
        let (rows, k) = match (format.is_fp4(), t.dtype) {
            (true, Dtype::U8) => (t.shape[0], 2 * t.shape[1]),
            (true, Dtype::F4) => (t.shape[0], t.shape[1]),
            (false, Dtype::U8 | Dtype::F8E4M3) => (t.shape[0], t.shape[1]),
            (true, d) => {
                return err(format!(
                    "`{data}`: expected dtype U8 ([rows, K/2]) or F4 for {}, found {d}",
                    format.name()
                ));
            }
            (false, d) => return err(format!("`{data}`: expected dtype F8_E4M3 or U8 for mxfp8, found {d}")),
        };
        let s = self.tensor(scales)?;
        let ok_dtype = match format {
            BlockFormat::Nvfp4 => matches!(s.dtype, Dtype::U8 | Dtype::F8E4M3),
            _ => matches!(s.dtype, Dtype::U8 | Dtype::F8E8M0),
        };
        if !ok_dtype {
            let want = if format == BlockFormat::Nvfp4 { "F8_E4M3 or U8" } else { "F8_E8M0 or U8" };
            return err(format!("`{scales}`: expected dtype {want} for {}, found {:?}", format.name(), s.dtype));
        }
        let want = ScaleLayout::for_operand(rows, k, format.vector_size()).shape();
        if s.shape != want {
            return err(format!(
                "`{scales}`: expected 5-D shape {} for {rows} rows and K = {k}, found {}",
                dims(&want),
                dims(&s.shape)
            ));
        }
        Ok((rows, k))
    }

    pub(super) fn weight_rows(&self) -> Result<usize> {
        Ok(self.tensor("weight")?.shape.first().copied().unwrap_or(0))
    }

    /// The RoPE math: metadata `rope_math` (`max`: MAX's rounding sequence, the default; `f32`).
    pub fn rope_math(&self) -> Result<RopeMath> {
        match self.meta.get("rope_math").map(|s| s.as_str()) {
            None | Some("max") => Ok(RopeMath::MaxCompat),
            Some("f32") => Ok(RopeMath::F32),
            Some(other) => err(format!("`__metadata__.rope_math`: expected `max` or `f32`, found `{other}`")),
        }
    }

    /// Whether [`run`](Self::run) in `mode` uses a fast path.
    pub fn runs_fast(&self, mode: Mode) -> bool {
        mode == Mode::Fast && self.op.has_fast_path()
    }
}

/// Reads the tensors of any safetensors file (e.g. a GPU kernel's dump), without requiring `op`.
pub fn load_tensors(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| CaseError(format!("not a valid safetensors file: {e}")))?;
    st.iter()
        .map(|(n, v)| {
            let dtype = Dtype::from_st(v.dtype())
                .ok_or_else(|| CaseError(format!("`{n}`: unsupported dtype {:?}", v.dtype())))?;
            Ok((n.to_string(), Tensor { dtype, shape: v.shape().to_vec(), data: v.data().to_vec() }))
        })
        .collect()
}

/// Serialises named tensors (e.g. `run`'s result) with optional metadata.
pub fn save_tensors(tensors: &BTreeMap<String, Tensor>, meta: Option<BTreeMap<String, String>>) -> Result<Vec<u8>> {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, t)| {
            TensorView::new(t.dtype.to_st(), t.shape.clone(), &t.data)
                .map(|v| (n.clone(), v))
                .map_err(|e| CaseError(format!("`{n}`: {e}")))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize(views, meta.map(|m| m.into_iter().collect()))
        .map_err(|e| CaseError(format!("serialising: {e}")))
}
