//! `paged-qkv`: the demo, a runner and checker for case files, a case generator and a quick bench.
//! A thin layer over the library; `paged-qkv --help` lists the subcommands.

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use paged_qkv::case::{self, Case, MakeOptions, Mode, Op, Tolerance};
use paged_qkv::fast::{self, QkvFp4PackedArgs};
use paged_qkv::formats::quantize::{amax, nvfp4_global_scale, quantize};
use paged_qkv::formats::scale_layout::ScaleLayout;
use paged_qkv::formats::{BlockFormat, QuantizedMatrix};
use paged_qkv::ops::{Freqs, QkvRope};
use paged_qkv::{
    Accumulation, CacheShape, Exec, Fp8Granularity, Isa, KvWrite, PackedWeights, PageTable, PagedKvCache, QkvFp4Args,
    RopeMath, bf16, reference,
};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Set once stdout is a closed pipe (`paged-qkv check … | head -1`): later lines are dropped and
/// the command still ends with its documented exit code.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// `println!` that ends quietly on a broken pipe instead of panicking.
macro_rules! outln {
    () => { $crate::out_line(format_args!("")) };
    ($($t:tt)*) => { $crate::out_line(format_args!($($t)*)) };
}

fn out_line(args: std::fmt::Arguments<'_>) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    if let Err(e) = writeln!(std::io::stdout().lock(), "{args}") {
        // A closed pipe or any other write failure: nobody reads this output any more.
        let _ = e;
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
    }
}

mod bench;

#[derive(Parser)]
#[command(
    name = "paged-qkv",
    version,
    about = "Fused QKV + paged KV cache + RoPE on the CPU, and an oracle for GPU kernels.\nWith no subcommand: the demo."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModeArg {
    /// The SIMD path where one exists, else the exact reference.
    Fast,
    /// The reference in MAX's CPU order (an f32 FMA chain).
    Sequential,
    /// The reference with exact accumulation.
    Exact,
}

#[derive(Clone, Copy, ValueEnum)]
enum RopeMathArg {
    /// MAX's rounding sequence in the freqs dtype (MAX's RoPE bit for bit).
    Max,
    /// f32 math, one rounding per value.
    F32,
}

impl RopeMathArg {
    fn name(self) -> &'static str {
        match self {
            RopeMathArg::Max => "max",
            RopeMathArg::F32 => "f32",
        }
    }
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Fast => Mode::Fast,
            ModeArg::Sequential => Mode::Sequential,
            ModeArg::Exact => Mode::Exact,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum OpArg {
    /// Block-scaled (NVFP4/MXFP4/MXFP8) fused QKV, ragged.
    #[value(name = "qkv_fp4_ragged")]
    QkvFp4Ragged,
    /// bf16/f16/f32 fused QKV, ragged, with bias.
    #[value(name = "qkv_ragged")]
    QkvRagged,
    /// FP8 W8A8 fused QKV (E4M3, f32 scales per tensor, channel or block), ragged.
    #[value(name = "qkv_fp8_ragged")]
    QkvFp8Ragged,
    /// bf16/f16/f32 fused QKV, padded BSHD.
    #[value(name = "qkv_bshd")]
    QkvBshd,
    /// RoPE on Q and the new K, padded BSHD.
    #[value(name = "rope_bshd")]
    RopeBshd,
    /// RoPE on Q and the new K, ragged.
    #[value(name = "rope_ragged")]
    RopeRagged,
    /// Store K or V, ragged.
    #[value(name = "kv_store_ragged")]
    KvStoreRagged,
    /// Store K or V, padded BSHD.
    #[value(name = "kv_store_bshd")]
    KvStoreBshd,
}

impl From<OpArg> for Op {
    fn from(o: OpArg) -> Op {
        match o {
            OpArg::QkvFp4Ragged => Op::QkvFp4Ragged,
            OpArg::QkvFp8Ragged => Op::QkvFp8Ragged,
            OpArg::QkvRagged => Op::QkvRagged,
            OpArg::QkvBshd => Op::QkvBshd,
            OpArg::RopeBshd => Op::RopeBshd,
            OpArg::RopeRagged => Op::RopeRagged,
            OpArg::KvStoreRagged => Op::KvStoreRagged,
            OpArg::KvStoreBshd => Op::KvStoreBshd,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum ModelArg {
    /// K 4096, 32 Q / 8 KV heads of 128.
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// K 896, 14 Q / 2 KV heads of 64.
    #[value(name = "qwen2.5-0.5b")]
    Qwen2_5_0_5b,
    /// K 64, 2 Q / 1 KV head of 16, pages of 4.
    Tiny,
}

impl ModelArg {
    fn shape(self) -> case::ModelShape {
        let name = match self {
            ModelArg::Llama3_8b => "llama3-8b",
            ModelArg::Qwen2_5_0_5b => "qwen2.5-0.5b",
            ModelArg::Tiny => "tiny",
        };
        case::MODELS.into_iter().find(|m| m.name == name).unwrap_or(case::MODELS[2])
    }
}

/// The scale granularity of an FP8 W8A8 case.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum GranularityArg {
    /// One f32 scale per tensor.
    Tensor,
    /// Per token and per weight row.
    Channel,
    /// Per 1×128 activation block and 128×128 weight block.
    Block,
}

impl From<GranularityArg> for Fp8Granularity {
    fn from(g: GranularityArg) -> Fp8Granularity {
        match g {
            GranularityArg::Tensor => Fp8Granularity::Tensor,
            GranularityArg::Channel => Fp8Granularity::Channel,
            GranularityArg::Block => Fp8Granularity::Block,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FormatArg {
    Nvfp4,
    Mxfp4,
    Mxfp8,
}

impl From<FormatArg> for BlockFormat {
    fn from(f: FormatArg) -> BlockFormat {
        match f {
            FormatArg::Nvfp4 => BlockFormat::Nvfp4,
            FormatArg::Mxfp4 => BlockFormat::Mxfp4,
            FormatArg::Mxfp8 => BlockFormat::Mxfp8,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DtypeArg {
    /// Block-scaled NVFP4 weights and activations.
    Nvfp4,
    /// Block-scaled MXFP4.
    Mxfp4,
    /// Block-scaled MXFP8.
    Mxfp8,
    /// FP8 W8A8 (E4M3 weights and activations), one f32 scale per tensor.
    Fp8,
    /// FP8 W8A8, f32 scales per token and per weight row.
    Fp8Channel,
    /// FP8 W8A8, f32 scales per 1×128 activation block and 128×128 weight block.
    Fp8Block,
    /// bf16 weights and activations.
    Bf16,
    /// f16 weights and activations.
    F16,
    /// f32 weights and activations.
    F32,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the op of CASE and write OUT with `output` and the updated `kv_blocks` (and
    /// `kv_scales`, for a quantized cache).
    Run {
        /// The case file (safetensors).
        case: PathBuf,
        /// Where to write the result.
        #[arg(short = 'o', long = "out")]
        out: PathBuf,
        /// fast: the SIMD path where one exists (qkv_fp4_ragged, qkv_ragged, qkv_bshd), else the exact reference.
        #[arg(long, value_enum, default_value = "fast")]
        mode: ModeArg,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// RoPE math (RoPE ops and fused RoPE): MAX's rounding sequence (the case file's
        /// `rope_math`, by default `max`) or f32 throughout.
        #[arg(long, value_enum)]
        rope_math: Option<RopeMathArg>,
    },
    /// Compare a GPU kernel's results (`output`, `kv_blocks`, and `kv_scales` for a quantized
    /// cache) with the reference. Exit 0: within
    /// tolerance, 1: not, 2: bad input.
    Check {
        /// The case file (the kernel's inputs).
        case: PathBuf,
        /// The kernel's actual results (`output`, `kv_blocks`). `--expected` is the old spelling.
        #[arg(long, alias = "expected")]
        actual: PathBuf,
        /// Absolute tolerance.
        #[arg(long, default_value_t = 0.0)]
        atol: f64,
        /// Relative tolerance.
        #[arg(long, default_value_t = 0.0)]
        rtol: f64,
        /// ULPs in the tensor's dtype (an element passes within atol + rtol·|ref| or within this).
        #[arg(long, default_value_t = 2)]
        ulps: u64,
        /// How the reference accumulates.
        #[arg(long, value_enum, default_value = "exact")]
        mode: ModeArg,
        /// Also compare the padded operations' Q rows past valid_lengths[b] (qkv_bshd,
        /// rope_bshd), which MAX leaves undefined (not compared by default).
        #[arg(long)]
        compare_padded_q: bool,
        /// RoPE math of the reference (the case file's `rope_math`, by default `max`).
        #[arg(long, value_enum)]
        rope_math: Option<RopeMathArg>,
    },
    /// Write a realistic random case.
    MakeCase {
        /// The operation.
        #[arg(long, value_enum)]
        op: OpArg,
        /// The model shape.
        #[arg(long, value_enum, default_value = "tiny")]
        model: ModelArg,
        /// Sequences.
        #[arg(long, default_value_t = 3)]
        batch: usize,
        /// Random seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Block format for qkv_fp4_ragged.
        #[arg(long, value_enum, default_value = "nvfp4")]
        format: FormatArg,
        /// Scale granularity for qkv_fp8_ragged.
        #[arg(long, value_enum, default_value = "tensor")]
        granularity: GranularityArg,
        /// Store FP8 data and scales as F8_E4M3 / F8_E8M0 instead of U8 (U8 loads in safetensors.numpy).
        #[arg(long)]
        f8_dtypes: bool,
        /// Make the cache FP8-quantized: E4M3 codes in kv_blocks, f32 kv_scales, one scale per this
        /// many elements of a head (MAX's quantization_granularity, e.g. 128; it must divide the head size).
        #[arg(long, value_name = "GRANULARITY")]
        kv_quant: Option<usize>,
        /// Where to write the case.
        #[arg(short = 'o', long = "out")]
        out: PathBuf,
    },
    /// The crate's main job on a Llama-3-8B-shaped layer: prefill, then 32 decode steps.
    Demo {
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// A quick table of the fast fused QKV + RoPE's throughput, with the weight-read bandwidth as yardstick.
    Bench {
        /// The model shape.
        #[arg(long, value_enum, default_value = "llama3-8b")]
        model: ModelArg,
        /// Worker threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Weight formats to run (repeatable; default nvfp4 and mxfp4).
        #[arg(long, value_enum)]
        dtype: Vec<DtypeArg>,
        /// Force an instruction set (scalar, avx2, avx512, avx512bf16, neon) instead of the best.
        #[arg(long, value_parser = parse_isa)]
        isa: Option<Isa>,
        /// What runs a multi-threaded call: a `Workers` team (a server's setup) or a rayon pool.
        #[arg(long, value_enum, default_value = "workers")]
        par: bench::ParArg,
        /// A whole decode step instead: every layer of the model (32 for Llama-3-8B, 24 for
        /// Qwen2.5-0.5B) for a batch of sequences of one new token each, by thread count, on a rayon
        /// pool and a `Workers` team (default formats nvfp4 and bf16).
        #[arg(long)]
        decode_step: bool,
        /// Sequences per decode step (repeatable or comma-separated; default 1, 8, 32).
        #[arg(long, value_delimiter = ',', requires = "decode_step")]
        batch: Vec<usize>,
        /// Layers of the decode step (default: the model's).
        #[arg(long, requires = "decode_step")]
        layers: Option<usize>,
    },
    /// The instruction sets the fast paths can use on this CPU (the best is the default).
    Isa {
        /// Print only the list of available levels, as the fast-path tests print it.
        #[arg(long)]
        available: bool,
    },
}

/// `isa`: the instruction sets of this CPU.
fn isa(available: bool) {
    if available {
        // The list the fast-path tests print ("ISAs tested: [...]"): CI compares the two.
        outln!("{:?}", Isa::available());
    } else {
        outln!("best: {}", Isa::best().name());
        outln!("available: {}", Isa::available().iter().map(|i| i.name()).collect::<Vec<_>>().join(", "));
    }
}

/// A failure to report with exit status 2.
struct Bad(String);

impl<E: std::fmt::Display> From<E> for Bad {
    fn from(e: E) -> Self {
        Bad(e.to_string())
    }
}

fn parse_isa(s: &str) -> Result<Isa, String> {
    let isa = Isa::from_name(s).ok_or_else(|| {
        format!("expected one of {}", Isa::ALL.iter().map(|i| i.name()).collect::<Vec<_>>().join(", "))
    })?;
    if isa.is_available() { Ok(isa) } else { Err(format!("{s} is not available on this CPU")) }
}

fn read(path: &PathBuf) -> Result<Vec<u8>, Bad> {
    std::fs::read(path).map_err(|e| Bad(format!("{}: {e}", path.display())))
}

fn pool(threads: Option<usize>) -> Result<rayon::ThreadPool, Bad> {
    let mut b = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads {
        if n == 0 {
            return Err(Bad("--threads must be at least 1".into()));
        }
        b = b.num_threads(n);
    }
    Ok(b.build()?)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd.unwrap_or(Cmd::Demo { threads: None }) {
        Cmd::Run { case, out, mode, threads, rope_math } => {
            run(&case, &out, mode.into(), threads, rope_math).map(|_| 0)
        }
        Cmd::Check { case, actual, atol, rtol, ulps, mode, compare_padded_q, rope_math } => {
            let opts = case::CheckOptions::new().with_compare_padded_q(compare_padded_q);
            check(&case, &actual, Tolerance { atol, rtol, ulps }, mode.into(), opts, rope_math)
        }
        Cmd::MakeCase { op, model, batch, seed, format, granularity, f8_dtypes, kv_quant, out } => {
            let opts = MakeOptions::new().with_f8_dtypes(f8_dtypes).with_kv_quant(kv_quant);
            make_case(op.into(), model.shape(), batch, seed, (format.into(), granularity.into()), opts, &out).map(|_| 0)
        }
        Cmd::Demo { threads } => pool(threads).and_then(|p| p.install(demo)).map(|_| 0),
        Cmd::Bench { model, threads, dtype, isa, par, decode_step: false, .. } => {
            bench::bench(model.shape(), threads, &dtype, isa, par).map(|_| 0)
        }
        Cmd::Bench { model, threads, dtype, isa, decode_step: true, batch, layers, .. } => {
            bench::decode_step(model.shape(), threads, &dtype, isa, &batch, layers).map(|_| 0)
        }
        Cmd::Isa { available } => {
            isa(available);
            Ok(0)
        }
    };
    match res {
        Ok(code) => ExitCode::from(code),
        Err(Bad(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
}

/// The case file at `path`, with `--rope-math` (if given) as its `rope_math`.
fn read_case(path: &PathBuf, rope_math: Option<RopeMathArg>) -> Result<Case, Bad> {
    let mut c = Case::from_bytes(&read(path)?)?;
    if let Some(m) = rope_math {
        c.meta.insert("rope_math".into(), m.name().into());
    }
    Ok(c)
}

fn run(
    case_path: &PathBuf,
    out: &PathBuf,
    mode: Mode,
    threads: Option<usize>,
    rope_math: Option<RopeMathArg>,
) -> Result<(), Bad> {
    let c = read_case(case_path, rope_math)?;
    // `output` (not for the KV stores), `kv_blocks`, and `kv_scales` for a quantized cache.
    let t = pool(threads)?.install(|| c.run_all(mode, case::exec(threads)))?;
    let meta = BTreeMap::from([("op".to_string(), c.op.name().to_string())]);
    std::fs::write(out, case::save_tensors(&t, Some(meta))?).map_err(|e| Bad(format!("{}: {e}", out.display())))?;
    eprintln!(
        "{}: wrote {} ({})",
        c.op.name(),
        out.display(),
        if c.runs_fast(mode) { "fast path" } else { "reference" }
    );
    Ok(())
}

fn check(
    case_path: &PathBuf,
    actual: &PathBuf,
    tol: Tolerance,
    mode: Mode,
    opts: case::CheckOptions,
    rope_math: Option<RopeMathArg>,
) -> Result<u8, Bad> {
    let c = read_case(case_path, rope_math)?;
    let act = case::load_tensors(&read(actual)?)?;
    let report = case::check_with(&c, &act, tol, mode, opts)?;
    for line in report.text.lines() {
        outln!("{line}");
    }
    Ok(if report.passed { 0 } else { 1 })
}

fn make_case(
    op: Op,
    m: case::ModelShape,
    batch: usize,
    seed: u64,
    (f, g): (BlockFormat, Fp8Granularity),
    opts: MakeOptions,
    out: &PathBuf,
) -> Result<(), Bad> {
    let c = if op == Op::QkvFp8Ragged {
        case::make_fp8(m, batch, seed, g, opts)?
    } else {
        case::make_with(op, m, batch, seed, f, opts)?
    };
    std::fs::write(out, c.to_bytes()?).map_err(|e| Bad(format!("{}: {e}", out.display())))?;
    eprintln!("wrote {} ({} on {}, batch {batch})", out.display(), op.name(), m.name);
    Ok(())
}

/// Uniform values in [-0.5, 0.5).
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut rng = fastrand::Rng::with_seed(seed);
    move || rng.f32() - 0.5
}

/// A spinner (or a bar, with `len`) on stderr for a phase that can take over a second; indicatif
/// hides it when stderr is not a terminal, so logs get no frames.
fn progress(label: &str, len: Option<u64>) -> ProgressBar {
    let pb = match len {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template("  {msg} [{bar:30}] {pos}/{len}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("#> "),
        ),
        None => ProgressBar::new_spinner(),
    };
    pb.set_message(label.to_string());
    pb.enable_steady_tick(Duration::from_millis(100));
    pb
}

/// Rows `rows` of a quantized matrix as a new matrix (data and re-interleaved scales).
fn take_rows(q: &QuantizedMatrix, rows: &[usize]) -> Result<QuantizedMatrix, Bad> {
    let (f, k) = (q.format(), q.k());
    let rb = f.row_bytes(k);
    let lay = q.as_ref().scale_layout();
    let plain = lay.deinterleave(q.scales())?;
    let data: Vec<u8> = rows.iter().flat_map(|&r| q.data()[r * rb..(r + 1) * rb].to_vec()).collect();
    let kb = lay.k_blocks();
    let sc: Vec<u8> = rows.iter().flat_map(|&r| plain[r * kb..(r + 1) * kb].to_vec()).collect();
    Ok(QuantizedMatrix::from_parts(
        f,
        rows.len(),
        k,
        data,
        ScaleLayout::new(rows.len(), kb).interleave(&sc)?,
        q.tensor_scale(),
    )?)
}

struct Phase {
    name: &'static str,
    tokens: usize,
    secs: f64,
    flop: f64,
    ref_per_token: f64,
    max_ulp: u64,
    max_abs: f32,
    pages: usize,
}

fn demo() -> Result<(), Bad> {
    let m = ModelArg::Llama3_8b.shape();
    let (k, q_dim, n) = (m.hidden, m.q_heads * m.head, (m.q_heads + 2 * m.kv_heads) * m.head);
    outln!(
        "paged-qkv demo — Llama-3-8B attention prologue (fused QKV + RoPE into a paged cache) on {} ({} threads)",
        Isa::best().name(),
        rayon::current_num_threads()
    );
    let t0 = Instant::now();
    let pb = progress("quantize + pack the layer", None);
    let mut rnd = uniform(0x2545_F491_4F6C_DD1D);
    let w: Vec<f32> = (0..n * k).map(|_| rnd() * 0.05).collect();
    let wq = quantize(BlockFormat::Nvfp4, &w, n, k, nvfp4_global_scale(amax(&w)))?;
    let packed = PackedWeights::new(wq.as_ref());
    pb.finish_and_clear();
    outln!(
        "  layer: K {k}, N {n} (32 Q + 2 x 8 KV heads of 128), NVFP4 {:.1} MB, quantized + packed in {:.2?}",
        packed.size_bytes() as f64 / 1e6,
        t0.elapsed()
    );

    let prompts = [211usize, 64, 130, 17];
    let steps = 32;
    let page = m.page;
    let pages: Vec<usize> = prompts.iter().map(|&p| (p + steps).div_ceil(page)).collect();
    let cols = pages.iter().copied().max().unwrap_or(1);
    let num_blocks = pages.iter().sum::<usize>() + 1;
    let mut lookup = vec![num_blocks as u32 - 1; prompts.len() * cols];
    let mut next = 0u32;
    for (b, &p) in pages.iter().enumerate() {
        for j in 0..p {
            lookup[b * cols + j] = (next * 5 + 3) % (num_blocks as u32 - 1); // scattered
            next += 1;
        }
    }
    let shape = CacheShape::mha(num_blocks, 1, page, m.kv_heads, m.head)?;
    let mut cache = PagedKvCache::<bf16>::zeros(shape);
    let freqs = paged_qkv::freqs_cis(512, m.head, m.rope_theta);
    let mut phases = Vec::new();

    // One step: fast fused QKV (Q out, K/V into the cache) + RoPE on Q and the new K; then the
    // exact oracle on `check` rows (each as its own 1-token sequence) compared with the fast result.
    let step = |x: &[f32],
                lens: &[usize],
                cache_lengths: &[u32],
                check: &[usize],
                cache: &mut PagedKvCache<bf16>|
     -> Result<(f64, f64, u64, f32), Bad> {
        let mtot: usize = lens.iter().sum();
        let a = quantize(BlockFormat::Nvfp4, x, mtot, k, nvfp4_global_scale(amax(x)))?;
        let mut offsets = vec![0u32];
        for &l in lens {
            offsets.push(offsets[offsets.len() - 1] + l as u32);
        }
        let mut q = vec![bf16::ZERO; mtot * q_dim];
        let rope = QkvRope::new(Freqs::F32(&freqs), m.head, m.head, false).with_math(RopeMath::F32);
        let t = Instant::now();
        {
            let table = PageTable::new(&lookup, cols, cache_lengths)?;
            let mut kv = KvWrite::new(cache.view_mut(), table, 0);
            let args = QkvFp4PackedArgs::new(a.as_ref(), &offsets, &packed, q_dim).with_rope(rope);
            fast::qkv_fp4_ragged_packed(&args, &mut q, &mut kv, Exec::default())?;
        }
        let secs = t.elapsed().as_secs_f64();
        // Oracle on the checked rows.
        let sub = take_rows(&a, check)?;
        let (mut b_of, mut t_of) = (Vec::new(), Vec::new());
        for &r in check {
            let b = offsets.iter().rposition(|&o| o as usize <= r).unwrap_or(0).min(lens.len() - 1);
            b_of.push(b);
            t_of.push(r - offsets[b] as usize);
        }
        let sub_lens: Vec<u32> = b_of.iter().zip(&t_of).map(|(&b, &t)| cache_lengths[b] + t as u32).collect();
        let sub_lookup: Vec<u32> = b_of.iter().flat_map(|&b| lookup[b * cols..(b + 1) * cols].to_vec()).collect();
        let mut scratch = cache.clone();
        let mut ref_q = vec![bf16::ZERO; check.len() * q_dim];
        let sub_offsets: Vec<u32> = (0..=check.len() as u32).collect();
        let tr = Instant::now();
        {
            let table = PageTable::new(&sub_lookup, cols, &sub_lens)?;
            let mut kv = KvWrite::new(scratch.view_mut(), table, 0);
            let args = QkvFp4Args::new(sub.as_ref(), &sub_offsets, wq.as_ref(), q_dim)
                .with_tensor_sf(a.tensor_scale() * packed.tensor_scale())
                .with_rope(rope);
            reference::qkv_fp4_ragged(&args, &mut ref_q, &mut kv, Accumulation::Exact)?;
        }
        let ref_secs = tr.elapsed().as_secs_f64() / check.len() as f64;
        let (mut max_ulp, mut max_abs) = (0u64, 0f32);
        let ord = |b: u16| if b & 0x8000 != 0 { -((b & 0x7FFF) as i64) } else { b as i64 };
        for (i, &r) in check.iter().enumerate() {
            for c in 0..q_dim {
                let (f, e) = (q[r * q_dim + c], ref_q[i * q_dim + c]);
                max_ulp = max_ulp.max((ord(f.to_bits()) - ord(e.to_bits())).unsigned_abs());
                max_abs = max_abs.max((f.to_f32() - e.to_f32()).abs());
            }
        }
        Ok((secs, ref_secs, max_ulp, max_abs))
    };

    // Prefill: 4 prompts at once.
    let mtot: usize = prompts.iter().sum();
    let x: Vec<f32> = (0..mtot * k).map(|_| rnd() * 2.0).collect();
    let mut starts = vec![0usize];
    for &p in &prompts {
        starts.push(starts[starts.len() - 1] + p);
    }
    let check: Vec<usize> = starts[1..].iter().map(|&e| e - 1).collect(); // each prompt's last token
    let zero = vec![0u32; prompts.len()];
    let pb = progress("prefill + oracle check", None);
    let (secs, ref_tok, ulp, abs) = step(&x, &prompts, &zero, &check, &mut cache)?;
    pb.finish_and_clear();
    phases.push(Phase {
        name: "prefill",
        tokens: mtot,
        secs,
        flop: 2.0 * (mtot * n * k) as f64,
        ref_per_token: ref_tok,
        max_ulp: ulp,
        max_abs: abs,
        pages: prompts.iter().map(|&p| p.div_ceil(page)).sum::<usize>(),
    });

    // Decode: 32 steps of one token per sequence; the oracle checks every 8th step.
    let mut d = Phase {
        name: "decode",
        tokens: 0,
        secs: 0.0,
        flop: 0.0,
        ref_per_token: 0.0,
        max_ulp: 0,
        max_abs: 0.0,
        pages: 0,
    };
    let mut checked = 0;
    let ones = vec![1usize; prompts.len()];
    let pb = progress("decode", Some(steps as u64));
    for s in 0..steps {
        let lens: Vec<u32> = prompts.iter().map(|&p| (p + s) as u32).collect();
        let x: Vec<f32> = (0..prompts.len() * k).map(|_| rnd() * 2.0).collect();
        let chk: Vec<usize> = if s % 8 == 0 { (0..prompts.len()).collect() } else { vec![0] };
        let (secs, ref_tok, ulp, abs) = step(&x, &ones, &lens, &chk, &mut cache)?;
        d.tokens += prompts.len();
        d.secs += secs;
        d.flop += 2.0 * (prompts.len() * n * k) as f64;
        if s % 8 == 0 {
            d.ref_per_token += ref_tok;
            checked += 1;
        }
        d.max_ulp = d.max_ulp.max(ulp);
        d.max_abs = d.max_abs.max(abs);
        pb.inc(1);
    }
    pb.finish_and_clear();
    d.ref_per_token /= checked as f64;
    d.pages = prompts.iter().map(|&p| (p + steps).div_ceil(page)).sum();
    phases.push(d);

    outln!();
    outln!(
        "  {:<8} {:>7} {:>10} {:>9} {:>10} {:>14} {:>6}",
        "phase",
        "tokens",
        "time",
        "GFLOP/s",
        "speed-up",
        "max err (Q)",
        "pages"
    );
    for p in &phases {
        outln!(
            "  {:<8} {:>7} {:>8.2}ms {:>9.1} {:>9.0}x {:>6} ulp {:.1e} {:>4}",
            p.name,
            p.tokens,
            p.secs * 1e3,
            p.flop / p.secs / 1e9,
            p.ref_per_token * p.tokens as f64 / p.secs,
            p.max_ulp,
            p.max_abs,
            p.pages
        );
    }
    outln!(
        "  (time: fast fused QKV + RoPE (one pass) per phase; speed-up: the scalar reference (Exact, same RoPE), timed on sampled tokens, per token;"
    );
    outln!(
        "   max err: fast bf16 Q against the exact oracle on those tokens, in bf16 ULPs and absolute; pages: cache pages in use)"
    );
    outln!("  total {:.1?}", t0.elapsed());
    Ok(())
}
