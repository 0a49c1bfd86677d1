//! Checking a kernel's results against a case: which elements the op writes, the comparison,
//! the report.

use super::*;
use std::borrow::Cow;

impl Case {
    /// Which elements of `output` and of `kv_blocks` the op writes and [`check()`] compares, under
    /// the default policy ([`CheckOptions::default`]: the padded operations' Q rows past
    /// `valid_lengths[b]` are not compared). Meaningful for a case that [`run`](Self::run)s; on
    /// an inconsistent one it returns an error or a partial mask, never panics.
    pub fn written(&self) -> Result<(Vec<bool>, Vec<bool>)> {
        self.written_with(CheckOptions::default())
    }

    /// [`written`](Self::written) under `opts`.
    pub fn written_with(&self, opts: CheckOptions) -> Result<(Vec<bool>, Vec<bool>)> {
        let (shape, _) = self.cache_shape()?;
        let (lookup, cols, lens) = self.page_table_parts()?;
        let table = PageTable::new(&lookup, cols, &lens)?;
        let layer = self.layer()?;
        let out_len = if self.op.has_output() { self.tensor("output")?.shape.iter().product() } else { 0 };
        // The padded ops' Q rows past `valid_lengths[b]` are MAX's undefined rows (its padded RoPE
        // leaves them unwritten): compared only when asked (semantics §9).
        let padded = matches!(self.op, Op::QkvBshd | Op::RopeBshd);
        let mut out_mask = vec![!padded || opts.compare_padded_q; out_len];
        let mut cache_mask = vec![false; shape.len()];
        // Rows (b, t, writes) in the op's row order. Every count comes from a tensor whose other
        // dimensions are non-zero, so it is bounded by the bytes of the file.
        let nonzero = |name: &str, sh: &[usize], from: usize| -> Result<()> {
            if sh.len() <= from || sh[from..].contains(&0) {
                return err(format!(
                    "`{name}`: expected non-zero dimensions after the first {from}, found {}",
                    dims(sh)
                ));
            }
            Ok(())
        };
        let rows: Vec<(usize, usize, bool)> = match self.op {
            Op::QkvBshd | Op::RopeBshd | Op::KvStoreBshd => {
                let x = if self.op == Op::RopeBshd { "q_proj" } else { "hidden_state" };
                let sh = &self.tensor(x)?.shape;
                nonzero(x, sh, 2)?;
                let valid = self.u32s("valid_lengths", Some(&sh[..1]))?;
                let s = sh[1];
                valid.iter().enumerate().flat_map(|(b, &v)| (0..s).map(move |t| (b, t, t < v as usize))).collect()
            }
            _ => {
                let x = if self.op == Op::RopeRagged { "q_proj" } else { "hidden_state" };
                let sh = &self.tensor(x)?.shape;
                nonzero(x, sh, 1)?;
                let offsets = self.u32s("input_row_offsets", None)?;
                ops::ragged_rows(&offsets, sh[0])?.iter().map(|&(b, t)| (b, t, true)).collect()
            }
        };
        if matches!(self.op, Op::QkvFp4Ragged | Op::QkvFp8Ragged | Op::QkvRagged | Op::QkvBshd) {
            nonzero("weight", &self.tensor("weight")?.shape, 1)?;
        }
        let plan = SlotPlan::build(&table, &shape, layer, &rows)?;
        let hd = shape.head_size();
        let row_len = if out_len > 0 { out_len / rows.len().max(1) } else { 0 };
        for (r, slot) in plan.rows.iter().enumerate() {
            if padded
                && slot.is_some()
                && let Some(m) = out_mask.get_mut(r * row_len..(r + 1) * row_len)
            {
                m.iter_mut().for_each(|x| *x = true);
            }
            let Some(slot) = slot else { continue };
            // Out-of-range coordinates (an inconsistent file not yet run) are skipped, not indexed.
            let mut mark = |kv: usize, h: usize, d: usize| {
                if kv < shape.kv_dim() && h < shape.num_kv_heads() && d < hd {
                    cache_mask[shape.index(slot.block, kv, layer, slot.offset, h, d)] = true;
                }
            };
            match self.op {
                Op::QkvFp4Ragged | Op::QkvFp8Ragged | Op::QkvRagged | Op::QkvBshd => {
                    let n = self.weight_rows()?;
                    let q_dim = self.tensor("output")?.shape.last().copied().unwrap_or(0);
                    for j in 0..n.saturating_sub(q_dim) {
                        let (kv, h, d) = shape.kv_column(j);
                        mark(kv as usize, h, d)
                    }
                }
                Op::RopeBshd | Op::RopeRagged => {
                    let rd = if self.op == Op::RopeRagged {
                        self.tensor("freqs_cis")?.shape.get(1).copied().unwrap_or(0)
                    } else {
                        hd
                    };
                    let interleaved = self.interleaved()?;
                    for h in 0..shape.num_kv_heads() {
                        for d in 0..rd.min(hd) {
                            mark(0, h, if interleaved { (hd + d).saturating_sub(rd) } else { d });
                        }
                    }
                }
                Op::KvStoreRagged | Op::KvStoreBshd => {
                    let kv = if self.meta.get("cache").map(|s| s.as_str()) == Some("v") { 1 } else { 0 };
                    for h in 0..shape.num_kv_heads() {
                        for d in 0..hd {
                            mark(kv, h, d);
                        }
                    }
                }
            }
        }
        Ok((out_mask, cache_mask))
    }

    /// Names an element of `output` for reports: `(token t, head h, dim d)` or `((b, s), head, dim)`
    /// (`#i` when the case's shapes cannot name it).
    pub fn name_output(&self, i: usize) -> String {
        let fallback = || format!("#{i}");
        let Ok(t) = self.tensor("output") else { return fallback() };
        let hd = self.cache_shape().map(|(s, _)| s.head_size()).unwrap_or(1);
        let div = |a: usize, b: usize| a.checked_div(b);
        let named = match (self.op, t.shape.as_slice()) {
            (Op::RopeBshd, &[_, s, h, d]) => h.checked_mul(d).and_then(|hd2| {
                let (bs, rest) = (div(i, hd2)?, i % hd2);
                Some(format!("((b {}, s {}), head {}, dim {})", div(bs, s)?, bs % s, div(rest, d)?, rest % d))
            }),
            (Op::RopeRagged, &[_, h, d]) => h
                .checked_mul(d)
                .and_then(|hd2| Some(format!("(token {}, head {}, dim {})", div(i, hd2)?, div(i, d)? % h, i % d))),
            (Op::QkvBshd, &[_, s, q]) => (|| {
                let (bs, c) = (div(i, q)?, i % q);
                Some(format!("((b {}, s {}), head {}, dim {})", div(bs, s)?, bs % s, c / hd, c % hd))
            })(),
            (_, &[_, q]) => div(i, q).map(|t| format!("(token {t}, head {}, dim {})", (i % q) / hd, (i % q) % hd)),
            _ => None,
        };
        named.unwrap_or_else(fallback)
    }

    /// Names an element of `kv_blocks`: `(layer, K/V, block, slot, head, dim)`.
    pub fn name_cache(&self, i: usize) -> String {
        match self.cache_shape() {
            Ok((s, _)) => {
                let [b, kv, l, sl, h, d] = s.coords(i);
                format!("(layer {l}, {}, block {b}, slot {sl}, head {h}, dim {d})", if kv == 0 { "K" } else { "V" })
            }
            Err(_) => format!("#{i}"),
        }
    }
}

/// The verdict of a kernel's results against the reference: what `paged-qkv check` prints.
#[derive(Debug, Clone)]
pub struct Report {
    /// Every compared element within tolerance and no corruption.
    pub passed: bool,
    /// The report: per tensor the elements compared, the largest errors and where, the ULP
    /// histogram, the worst positions named, corruption; then the verdict.
    pub text: String,
    /// The numbers behind it, per tensor (`output`, `kv_blocks`; for a quantized cache also
    /// `kv_scales` and `kv_values`, its values code × scale, which decide).
    pub tensors: Vec<(String, TensorReport)>,
}

/// What [`check_with`] compares beyond the elements every check compares.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckOptions {
    /// Compare the padded operations' Q rows past `valid_lengths[b]` (`qkv_bshd`, `rope_bshd`),
    /// which MAX leaves undefined; by default they are not compared.
    pub compare_padded_q: bool,
}

impl CheckOptions {
    /// The default policy.
    pub fn new() -> Self {
        Self::default()
    }
    /// With [`compare_padded_q`](Self::compare_padded_q) set.
    pub fn with_compare_padded_q(self, compare_padded_q: bool) -> Self {
        CheckOptions { compare_padded_q }
    }
}

/// Checks a kernel's `actual` results (`output` unless the op has none, and `kv_blocks`) against
/// the reference run of `case` in `mode`, under the default [`CheckOptions`]. Errors: a malformed
/// case, a missing or mismatched tensor.
pub fn check(case: &Case, actual: &BTreeMap<String, Tensor>, tol: Tolerance, mode: Mode) -> Result<Report> {
    check_with(case, actual, tol, mode, CheckOptions::default())
}

/// [`check()`] under `opts`.
pub fn check_with(
    case: &Case,
    actual: &BTreeMap<String, Tensor>,
    tol: Tolerance,
    mode: Mode,
    opts: CheckOptions,
) -> Result<Report> {
    use std::fmt::Write as _;
    let mut refs = case.run_all(mode, Exec::default())?;
    let (ref_out, ref_kv) = (refs.remove("output"), refs.remove("kv_blocks"));
    let ref_kv = ref_kv.ok_or_else(|| CaseError("`kv_blocks`: not written".into()))?;
    let (out_mask, kv_mask) = case.written_with(opts)?;
    // A quantized cache's scales: a group is written where its elements are (the scales tensor is
    // the cache with its last dimension divided by the granularity).
    let scales_mask: Vec<bool> = match refs.get("kv_scales") {
        Some(t) => {
            let n: usize = t.shape.iter().product();
            let g = kv_mask.len().checked_div(n).unwrap_or(1);
            kv_mask.chunks(g.max(1)).map(|c| c.iter().any(|&w| w)).collect()
        }
        None => Vec::new(),
    };
    let mut text = String::new();
    let mut passed = true;
    let mut tensors = Vec::new();
    let _ = writeln!(
        text,
        "paged-qkv check: op {}, reference mode {:?}, tolerance atol {} rtol {} ulps {}",
        case.op.name(),
        mode,
        tol.atol,
        tol.rtol,
        tol.ulps
    );
    if matches!(case.op, Op::QkvBshd | Op::RopeBshd) {
        let how = if opts.compare_padded_q { "compared" } else { "not compared" };
        let _ = writeln!(text, "padded Q rows (t >= valid_lengths[b]): {how}");
    }
    let missing = |name: &str| CaseError(format!("`{name}`: missing tensor in the actual results"));
    // (name, actual, reference, the mask of what the op writes, the input tensor for the rest)
    type Pair<'a> = (&'static str, &'a Tensor, Tensor, &'a [bool], Option<&'a Tensor>);
    let mut pairs: Vec<Pair<'_>> = Vec::new();
    if let Some(ro) = ref_out {
        pairs.push(("output", actual.get("output").ok_or_else(|| missing("output"))?, ro, &out_mask, None));
    }
    let quantized = refs.contains_key("kv_scales");
    // A quantized cache's codes compare as E4M3 whether each side has them as U8 or F8_E4M3.
    fn codes(t: &Tensor, quantized: bool) -> Cow<'_, Tensor> {
        match t.dtype {
            Dtype::U8 if quantized => Cow::Owned(Tensor { dtype: Dtype::F8E4M3, ..t.clone() }),
            _ => Cow::Borrowed(t),
        }
    }
    let got_kv = codes(actual.get("kv_blocks").ok_or_else(|| missing("kv_blocks"))?, quantized);
    let in_kv = codes(case.tensor("kv_blocks")?, quantized);
    let ref_kv = codes(&ref_kv, quantized).into_owned();
    pairs.push(("kv_blocks", &got_kv, ref_kv, &kv_mask, Some(&in_kv)));
    let g = kv_mask.len().checked_div(scales_mask.len()).unwrap_or(1);
    if let Some(rs) = refs.remove("kv_scales") {
        let got = actual.get("kv_scales").ok_or_else(|| missing("kv_scales"))?;
        pairs.push(("kv_scales", got, rs, &scales_mask, Some(case.tensor("kv_scales")?)));
    }
    // A quantized cache's meaning is code × scale: those values decide (`values` below); its codes
    // and scales are compared and reported too, and must not change outside the written groups,
    // but a code or scale off by more than the tolerance fails only through the values it gives
    // (a scale one f32 ulp off moves no value by more than that ulp, yet can move codes).
    if quantized {
        let _ = writeln!(
            text,
            "quantized cache: the values code × scale decide; codes and scales outside the tolerance are \
             reported, corruption of either fails"
        );
    }
    // The values, from the codes (`kv_blocks`) and scales (`kv_scales`), the last two pairs.
    let values = match &pairs[..] {
        [.., (_, gc, wc, ..), (_, gs, ws, ..)] if quantized => {
            let (gs, ws) = (decode::<f32>(&gs.data), decode::<f32>(&ws.data));
            Some(compare_values((&gc.data, &gs), (&wc.data, &ws), g, &kv_mask, tol))
        }
        _ => None,
    };
    for (name, got, want, mask, input) in pairs {
        let r = compare(name, got, &want, mask, input, tol)?;
        let decides = !(quantized && name != "output");
        let namer = |i: usize| match name {
            "output" => case.name_output(i),
            // A scale: its group's first element.
            "kv_scales" => format!("the scale of {}", case.name_cache(i * g)),
            _ => case.name_cache(i),
        };
        report_tensor(&mut text, name, &got.dtype.to_string(), &r, decides, namer);
        passed &= (!decides || r.failures == 0) && r.corrupted.is_empty();
        tensors.push((name.to_string(), r));
    }
    if let Some(r) = values {
        report_tensor(
            &mut text,
            "kv_values",
            "code × scale; an ulp: a step of the reference code at its scale",
            &r,
            true,
            |i| case.name_cache(i),
        );
        passed &= r.failures == 0;
        tensors.push(("kv_values".to_string(), r));
    }
    let _ = write!(text, "verdict: {}", if passed { "PASS" } else { "FAIL" });
    Ok(Report { passed, text, tensors })
}

/// One tensor's section of a report: `decides` false marks its failures as reported only.
fn report_tensor(
    text: &mut String,
    name: &str,
    dtype: &str,
    r: &TensorReport,
    decides: bool,
    namer: impl Fn(usize) -> String,
) {
    use std::fmt::Write as _;
    let _ = writeln!(text, "{name}: {} elements compared ({dtype})", r.compared);
    let at = |(v, i): (f64, usize)| if v > 0.0 { format!("{v:.3e} at {}", namer(i)) } else { "0".into() };
    let _ = writeln!(text, "  max abs error {}", at(r.max_abs));
    let _ = writeln!(text, "  max rel error {}", at(r.max_rel));
    let mut h = String::new();
    let mut lo = 0;
    for (i, &b) in ULP_BUCKETS.iter().enumerate() {
        let label = if b == lo { format!("{b}") } else { format!("{lo}-{b}") };
        h += &format!("{label}: {}  ", r.ulp_hist[i]);
        lo = b + 1;
    }
    h += &format!(">{}: {}  NaN mismatch: {}", ULP_BUCKETS[6], r.ulp_hist[7], r.ulp_hist[8]);
    let _ = writeln!(text, "  ULP histogram  {h}");
    let note = if decides || r.failures == 0 { "" } else { " (reported: the values decide)" };
    let _ = writeln!(text, "  outside tolerance: {}{note}", r.failures);
    for &(i, g, w, u) in &r.worst {
        let u = if u == u64::MAX { "NaN".into() } else { u.to_string() };
        let _ = writeln!(text, "    {} actual {g:e}, reference {w:e}, {u} ulp", namer(i));
    }
    if !r.corrupted.is_empty() {
        let _ = writeln!(
            text,
            "  CORRUPTION: {} elements outside the written slots changed, e.g. {}",
            r.corrupted.len(),
            namer(r.corrupted[0])
        );
    }
}

/// The E4M3 step at `code`'s magnitude (the distance to the next code up): 2^-9 for the
/// subnormals, 2^(e − 10) for exponent field `e`.
fn e4m3_step(code: u8) -> f64 {
    let e = (code >> 3) & 15;
    2f64.powi(if e == 0 { -9 } else { i32::from(e) - 10 })
}

/// Compares a quantized cache's values, `code × scale` of its group (`g` elements), at the
/// `mask`ed elements: `got` against the reference `want` (codes, scales). An element passes within
/// `atol + rtol · |ref|` or within `ulps` steps of the reference code at the reference scale (its
/// "ulp" as a value of the cache); NaN matches NaN only. The ULP histogram counts those steps,
/// rounded up.
pub fn compare_values(
    got: (&[u8], &[f32]),
    want: (&[u8], &[f32]),
    g: usize,
    mask: &[bool],
    tol: Tolerance,
) -> TensorReport {
    let g = g.max(1);
    let value = |(c, s): (&[u8], &[f32]), i: usize| E4M3(c[i]).to_f32() as f64 * s[i / g] as f64;
    let mut rep = TensorReport::default();
    let mut worst = Vec::new();
    let n = got.0.len().min(want.0.len()).min(mask.len());
    for i in (0..n).filter(|&i| mask[i] && i / g < got.1.len().min(want.1.len())) {
        let (x, y) = (value(got, i), value(want, i));
        let step = e4m3_step(want.0[i]) * want.1[i / g].abs() as f64;
        let d = (x - y).abs();
        let ulps = if x.is_nan() != y.is_nan() {
            u64::MAX
        } else if x == y || x.is_nan() {
            0
        } else if step > 0.0 && (d / step).is_finite() {
            ((d / step).ceil() as u64).min(u64::MAX - 1)
        } else {
            u64::MAX - 1
        };
        rep.tally(&mut worst, i, (x, y), ulps, tol);
    }
    rep.finish(worst);
    rep
}

/// Comparison tolerances: an element passes when `|x − ref| ≤ atol + rtol · |ref|` **or** it is
/// within `ulps` units in the last place of its dtype (NaN matches NaN only).
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
    /// ULPs in the tensor's own dtype.
    pub ulps: u64,
}

/// ULP histogram buckets (upper bounds; the last is "more").
pub const ULP_BUCKETS: [u64; 7] = [0, 1, 2, 4, 8, 16, 256];

/// The comparison of one tensor.
#[derive(Debug, Clone, Default)]
pub struct TensorReport {
    /// Elements compared.
    pub compared: usize,
    /// Largest |x − ref| and where.
    pub max_abs: (f64, usize),
    /// Largest |x − ref| / |ref| and where.
    pub max_rel: (f64, usize),
    /// Counts per ULP bucket ([`ULP_BUCKETS`], then "more"), then NaN mismatches.
    pub ulp_hist: [usize; 9],
    /// Elements outside the tolerance.
    pub failures: usize,
    /// The worst elements: (index, got, reference, ulps).
    pub worst: Vec<(usize, f64, f64, u64)>,
    /// Elements the op does not write that differ from the case's input (`kv_blocks` only).
    pub corrupted: Vec<usize>,
}

impl TensorReport {
    /// Counts one compared element `i` (actual `x`, reference `y`, `ulps` apart; `u64::MAX`: NaN
    /// against a number) into the maxima, the histogram, the failures and the `worst` candidates.
    fn tally(
        &mut self,
        worst: &mut Vec<(usize, f64, f64, u64)>,
        i: usize,
        (x, y): (f64, f64),
        ulps: u64,
        tol: Tolerance,
    ) {
        self.compared += 1;
        let abs = match ulps {
            0 => 0.0,
            u64::MAX => f64::INFINITY,
            _ => (x - y).abs(),
        };
        let rel = if y != 0.0 {
            abs / y.abs()
        } else if abs == 0.0 {
            0.0
        } else {
            f64::INFINITY
        };
        if abs > self.max_abs.0 {
            self.max_abs = (abs, i);
        }
        if rel > self.max_rel.0 {
            self.max_rel = (rel, i);
        }
        let bucket = if ulps == u64::MAX { 8 } else { ULP_BUCKETS.iter().position(|&b| ulps <= b).unwrap_or(7) };
        self.ulp_hist[bucket] += 1;
        if !(ulps != u64::MAX && (abs <= tol.atol + tol.rtol * y.abs() || ulps <= tol.ulps)) {
            self.failures += 1;
        }
        if ulps > 0 {
            worst.push((i, x, y, ulps));
        }
    }

    /// Keeps the ten worst of `worst` (most ulps first, then by index).
    fn finish(&mut self, mut worst: Vec<(usize, f64, f64, u64)>) {
        worst.sort_by(|a, b| b.3.cmp(&a.3).then(a.0.cmp(&b.0)));
        worst.truncate(10);
        self.worst = worst;
    }
}

fn ordered(bits: u32, width_bits: u32) -> i64 {
    let sign = 1u32 << (width_bits - 1);
    if bits & sign != 0 { -((bits & !sign) as i64) } else { bits as i64 }
}

fn to_f64s(t: &Tensor) -> Result<(Vec<f64>, Vec<u32>, u32)> {
    let d = elem_dtype(t.dtype).ok_or_else(|| CaseError(format!("unsupported dtype {}", t.dtype)))?;
    let (vals, bits): (Vec<f64>, Vec<u32>) = match d {
        DType::F32 => decode::<f32>(&t.data).iter().map(|v| (v.to_f32() as f64, v.to_bits())).unzip(),
        DType::BF16 => decode::<bf16>(&t.data).iter().map(|v| (v.to_f32() as f64, Element::to_bits(*v))).unzip(),
        DType::F16 => decode::<f16>(&t.data).iter().map(|v| (v.to_f32() as f64, Element::to_bits(*v))).unzip(),
        DType::F8E4M3 => decode::<E4M3>(&t.data).iter().map(|v| (v.to_f32() as f64, Element::to_bits(*v))).unzip(),
    };
    Ok((vals, bits, 8 * d.size() as u32))
}

/// Compares `got` against the reference `want` at the `mask`ed elements; elements outside the
/// mask are checked against `input` (when given) for corruption.
pub fn compare(
    name: &str,
    got: &Tensor,
    want: &Tensor,
    mask: &[bool],
    input: Option<&Tensor>,
    tol: Tolerance,
) -> Result<TensorReport> {
    if got.dtype != want.dtype || got.shape != want.shape {
        return err(format!(
            "actual `{name}`: expected {} {}, found {} {}",
            want.dtype,
            dims(&want.shape),
            got.dtype,
            dims(&got.shape)
        ));
    }
    let (g, gb, w) = to_f64s(got)?;
    let (r, rb, _) = to_f64s(want)?;
    let inp = input.map(to_f64s).transpose()?;
    let mut rep = TensorReport::default();
    let mut worst = Vec::new();
    for i in 0..g.len() {
        if !mask.get(i).copied().unwrap_or(false) {
            if let Some((_, ib, _)) = &inp
                && ib[i] != gb[i]
            {
                rep.corrupted.push(i);
            }
            continue;
        }
        let (x, y) = (g[i], r[i]);
        let ulps = if x.is_nan() || y.is_nan() {
            if x.is_nan() && y.is_nan() { 0 } else { u64::MAX }
        } else {
            (ordered(gb[i], w) - ordered(rb[i], w)).unsigned_abs()
        };
        rep.tally(&mut worst, i, (x, y), ulps, tol);
    }
    rep.finish(worst);
    Ok(rep)
}
