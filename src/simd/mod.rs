//! The only module with `core::arch`: ISA detection and the per-ISA micro-kernels, behind one
//! dispatch per kernel family. It knows memory layouts of operands (defined in [`fp4`], [`fp8`]
//! and [`plain`], next to the portable kernel of each family) and nothing of formats, caches or
//! scheduling: `crate::kernels` builds the operands and calls in; nothing here calls back.
//!
//! **FP4** (NVFP4, MXFP4): for up to [`MR`] activation rows and one 16-column weight group, every
//! kernel computes the *canonical order*
//!
//! ```text
//! acc[r][c] = 0
//! for kb in 0..Kb:                                    // blocks in order
//!     isum = Σ_{k in block} w2[c,k] · a2[r,k]          // doubled E2M1 integers: exact int32
//!     acc[r][c] = fma(f32(isum), s(r, c, kb), acc)     // s: the block-scale product / 4
//! ```
//!
//! with `s` formed without denormals (see `crate::kernels`). The scalar kernel uses `f32::mul_add`,
//! an IEEE fused multiply-add like `vfmadd`/`vfmaq`, so **every ISA returns identical bits**, also
//! when a term overflows. The tests use the scalar kernel as the bit-exact judge of the SIMD
//! paths (the oracle judges the scalar kernel within an error bound).
//!
//! **MXFP8**: the same structure with f32 block sums, in the canonical order of [`fp8`] (E4M3
//! weights widened exactly through IEEE half bits, a chain of FMAs per block in k order). On
//! AVX2 and AVX-512, tiles of two or more row chunks go through [`fp8_tiled`]: each weight slice is
//! decoded once into an f32 buffer that every chunk reads from L1, the accumulators continue
//! through memory between blocks (the same chain, so the same bits). Decode rows go through
//! [`fp8_row`]: four groups (and on AVX-512 up to two rows) per call, one FMA chain per row,
//! group and vector, and on CPUs that take f32 subnormal operands at full speed an E4M3 decode
//! straight into f32 bits ([`fp8_bits_decode`]).
//!
//! **Scale products.** The AVX-512 kernels form E8M0 products `2^(sb − 127) · 2^offset` with
//! `vscalefps` where the other kernels clamp the exponent sum into the f32 field; the two agree
//! wherever the product is used (a sum in 1 ..= 254 is the same power of two, ≥ 255 is +∞ in
//! both) and differ only where the element takes the exact path anyway (a sum ≤ 0: see
//! `may_underflow`; a NaN scale).
//!
//! **Plain** (bf16, f16, f32): register-blocked micro-kernels over packed 16-column groups, in the
//! canonical order of [`plain`] (a chain of FMAs, odd element of each k-pair first). The FMA
//! kernels (scalar, AVX2, AVX-512 F, NEON) are bit-identical. [`Isa::Avx512Bf16`] runs bf16 on
//! `vdpbf16ps`, which performs the same chain but treats subnormal inputs and results as zero
//! (DAZ/FTZ): it equals the others whenever no bf16 operand, product or partial sum is subnormal.
//!
//! Why `std::arch` and not pulp's tokens: these kernels are int8 shuffles, `maddubs`, VNNI, BF16
//! dot products and widening NEON multiplies, which pulp's generic `Simd` trait does not expose;
//! with safe intrinsics inside `#[target_feature]` functions (Rust ≥ 1.87) the same proof-carrying
//! structure is an [`IsaToken`] that exists only for a detected ISA, and one `unsafe` call per
//! dispatch.
#![allow(unsafe_code)]
#![allow(clippy::needless_range_loop)]

pub(crate) mod fp4;
pub(crate) mod fp8;
#[cfg(target_arch = "aarch64")]
mod neon;
pub(crate) mod plain;
pub(crate) mod quant;
pub(crate) mod rope;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod rope_lanes;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::error::{Error, Result};
use fp4::{Fp4Group, Fp4Rows, group_scalar};
use fp8::{Fp8Group, Fp8Rows, Outer};
use plain::{PackedRows, PlainKind, PlainPanel, panel_scalar};
use std::sync::OnceLock;

/// Most activation rows one FP4 kernel call handles (on any ISA: see [`fp4_mr`]).
pub(crate) const MR: usize = 8;
/// Columns per weight group (FP4 and plain).
pub(crate) const GROUP: usize = 16;
/// Weight groups per call of the one-row FP4 kernel ([`fp4_row`]).
pub(crate) const ROW_GROUPS: usize = 4;

/// An instruction set the fast paths can run on. Levels are cumulative: a CPU that runs one runs
/// every level before it in [`Isa::ALL`] on the same architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Portable Rust: the bit-exact judge of the SIMD kernels, and the fallback everywhere.
    Scalar,
    /// x86-64 AVX2 + FMA (`vpshufb`, `vpmaddubsw`, `vpmaddwd`; f32 FMA with F16C for f16).
    Avx2,
    /// x86-64 AVX-512 F + BW + VNNI (`vpdpbusd`; zmm f32 FMA). AVX-512 without VNNI uses
    /// [`Isa::Avx2`].
    Avx512,
    /// [`Isa::Avx512`] plus AVX-512 BF16: bf16 weights run on `vdpbf16ps` (Zen 4, Sapphire Rapids
    /// and later). `vdpbf16ps` treats subnormal inputs and results as zero, so bf16 results can
    /// differ from the other ISAs' where a subnormal appears (see the module docs of `fast`).
    Avx512Bf16,
    /// aarch64 NEON (`tbl`, `smull`, `sadalp`; f32 `fmla`).
    Neon,
    /// [`Isa::Neon`] plus the dot-product extension (FEAT_DotProd, `sdot`: Cortex-A76 / Raspberry
    /// Pi 5, Neoverse N1 / Graviton2, Apple M1 and later) for the FP4 kernel.
    NeonDotprod,
    /// [`Isa::NeonDotprod`] plus the int8 matrix multiply (FEAT_I8MM, `smmla`: Neoverse V1/V2/N2,
    /// Graviton3/4, Cortex-A710 and later) for the FP4 kernel.
    NeonI8mm,
}

impl Isa {
    /// All ISAs this crate knows; on each architecture, best last.
    pub const ALL: [Isa; 7] =
        [Isa::Scalar, Isa::Neon, Isa::NeonDotprod, Isa::NeonI8mm, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    /// Lower-case name (`scalar`, `avx2`, `avx512`, `avx512bf16`, `neon`, `neon-dotprod`,
    /// `neon-i8mm`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Neon => "neon",
            Isa::NeonDotprod => "neon-dotprod",
            Isa::NeonI8mm => "neon-i8mm",
        }
    }

    /// Parses [`name`](Self::name).
    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name() == s)
    }

    /// Whether this CPU can run it (detected at run time).
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_available()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => Isa::Avx512.is_available() && std::arch::is_x86_feature_detected!("avx512bf16"),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDotprod => Isa::Neon.is_available() && std::arch::is_aarch64_feature_detected!("dotprod"),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonI8mm => Isa::NeonDotprod.is_available() && std::arch::is_aarch64_feature_detected!("i8mm"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The ISAs this CPU can run.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The fastest available ISA, detected once per process: the last available level, except
    /// that [`Isa::Avx512Bf16`] is chosen only where `vdpbf16ps` outruns zmm f32 FMA (AMD Zen 4
    /// and later: about 2×). On Intel Sapphire/Emerald Rapids it runs at half the FMA rate
    /// (measured: 85 vs 172 GFLOP/s per core, docs/performance.md), so [`Isa::Avx512`] is the best there and
    /// [`Isa::Avx512Bf16`] stays available to force.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            Isa::ALL
                .into_iter()
                .rev()
                .find(|&i| i.is_available() && (i != Isa::Avx512Bf16 || bf16_dot_beats_fma()))
                .unwrap_or(Isa::Scalar)
        })
    }
}

/// Whether this CPU's `vdpbf16ps` is faster than its zmm f32 FMA (AMD: yes; Intel: no).
fn bf16_dot_beats_fma() -> bool {
    is_amd()
}

/// Rows up to which a call is a decode: each weight is used once, so the kernels stream the
/// weight groups whole (no k-blocks: a k-block would only restart the hardware prefetcher's streams)
/// and, where [`prefetch_weights`] says so, prefetch ahead of them.
pub(crate) const DECODE_ROWS: usize = 2;

/// Whether the decode (one- or two-row) kernels issue software prefetches ahead of the weight
/// streams. Intel: yes (on Emerald Rapids they took bf16 decode from DRAM from ~1.3× to ~1.0× a
/// plain read of the bytes). AMD Zen 4 (family 19h with AVX-512): no — the same `prefetcht0`
/// 1 KiB ahead made bf16 decode from DRAM ~1.45× instead of ~1.25× a plain read, and
/// `prefetcht1` gained nothing over the hardware prefetcher. AMD Zen 3 (family 19h without
/// AVX-512): yes — paired on one thread, the setting alternated call by call (a temporary switch),
/// Llama-3-8B's weight from DRAM: NVFP4 0.91× the time without (two runs), bf16 1.004–1.009×,
/// MXFP8 0.993–0.996×; Qwen2.5-0.5B NVFP4 from L3 1.00×. AMD family 1Ah (Zen 5) and later:
/// yes — paired runs on Zen 5, the two settings alternated two or three times (`cargo bench
/// --bench qkv_fp4 -- 'paired/(llama3-8b|qwen2.5-0.5b)/decode_nvfp4'` and `--bench qkv_plain --
/// 'paired/llama3-8b/decode_bf16'`), ratio to a plain read's rate: Llama-3-8B NVFP4 from DRAM,
/// one thread, 0.76–0.81 → 0.84–0.85 (two threads unchanged, 0.84–0.85), L3-hot 0.77–0.79 →
/// 0.83–0.85; bf16 from DRAM 1.16–1.17 → 1.18–1.19; Qwen2.5-0.5B NVFP4 L3-hot 0.82–0.83 → 0.81
/// (docs/performance.md). Older AMD families (Zen 1, Zen 2) were not measured and keep the
/// hardware prefetcher alone.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // its callers are the x86 kernels
pub(crate) fn prefetch_weights() -> bool {
    !is_amd() || cpu_family() >= 0x1A || is_zen3()
}

/// AMD Zen 3: family 19h without AVX-512 (Zen 4, the same family, has it).
fn is_zen3() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_amd() && cpu_family() == 0x19 && !std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The CPU's family (CPUID leaf 1: the base family, plus the extended family where the base is
/// 0Fh), read once per process; 0 off x86-64.
fn cpu_family() -> u32 {
    static FAMILY: OnceLock<u32> = OnceLock::new();
    *FAMILY.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            #[allow(unused_unsafe)] // `__cpuid` is safe in newer Rust, unsafe in 1.89 (the MSRV)
            // SAFETY: CPUID leaf 1 exists on every x86-64 CPU; it only reads identification registers.
            let eax = unsafe { std::arch::x86_64::__cpuid(1) }.eax;
            let base = (eax >> 8) & 0xF;
            if base == 0xF { base + ((eax >> 20) & 0xFF) } else { base }
        }
        #[cfg(not(target_arch = "x86_64"))]
        0
    })
}

/// Whether the CPU is an AMD one (CPUID vendor "AuthenticAMD"), read once per process.
fn is_amd() -> bool {
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            #[allow(unused_unsafe)] // `__cpuid` is safe in newer Rust, unsafe in 1.89 (the MSRV)
            // SAFETY: CPUID leaf 0 exists on every x86-64 CPU; it only reads identification registers.
            let v = unsafe { std::arch::x86_64::__cpuid(0) };
            // "AuthenticAMD": ebx "Auth", edx "enti", ecx "cAMD".
            v.ebx == u32::from_le_bytes(*b"Auth") && v.edx == u32::from_le_bytes(*b"enti")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Proof that an ISA is available on this CPU: only [`IsaToken::new`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IsaToken(Isa);

impl IsaToken {
    /// The best available ISA's token.
    pub fn best() -> Self {
        IsaToken(Isa::best())
    }

    /// The token for `isa` (the best available when `None`), or an error when the CPU lacks it:
    /// forcing an ISA never silently falls back.
    pub fn new(isa: Option<Isa>) -> Result<Self> {
        let isa = isa.unwrap_or_else(Isa::best);
        if isa.is_available() {
            Ok(IsaToken(isa))
        } else {
            Err(Error::Unsupported { what: format!("ISA {} is not available on this CPU", isa.name()) })
        }
    }
}

/// Quantizes one row ([`quant::quantize_row_body`]) compiled for `token`'s ISA: the body's
/// loops vectorise at its width (AVX2, AVX-512; NEON is aarch64's baseline, so the plain build
/// already uses it). The same bytes on every ISA (tested).
pub(crate) fn quantize_row(
    token: IsaToken,
    format: crate::dtype::BlockFormat,
    row: &[f32],
    g: f32,
    data: &mut [u8],
    scales: &mut [u8],
) {
    #[cfg(target_arch = "x86_64")]
    match token.0 {
        Isa::Avx512 | Isa::Avx512Bf16 => {
            // SAFETY: the token proves AVX-512 F and BW (and AVX2, FMA) were detected.
            return unsafe { x86::quant::quantize_row_avx512(format, row, g, data, scales) };
        }
        // SAFETY: the token proves AVX2 and FMA were detected.
        Isa::Avx2 => return unsafe { x86::quant::quantize_row_avx2(format, row, g, data, scales) },
        _ => {}
    }
    let _ = token;
    quant::quantize_row_body(format, row, g, data, scales)
}

/// Quantizes a cache part's groups ([`quant::kv_groups_body`]) compiled for `token`'s ISA: the
/// same codes and scales on every ISA (the body's operations are exact or IEEE-rounded per lane).
pub(crate) fn kv_groups(token: IsaToken, x: &[f32], g: usize, codes: &mut [crate::dtype::E4M3], scales: &mut [f32]) {
    assert!(g > 0 && x.len() == codes.len() && x.len() == scales.len() * g);
    #[cfg(target_arch = "x86_64")]
    match token.0 {
        Isa::Avx512 | Isa::Avx512Bf16 => {
            // SAFETY: the token proves AVX-512 F and BW (and AVX2, FMA) were detected.
            return unsafe { x86::quant::kv_groups_avx512(x, g, codes, scales) };
        }
        // SAFETY: the token proves AVX2 and FMA were detected.
        Isa::Avx2 => return unsafe { x86::quant::kv_groups_avx2(x, g, codes, scales) },
        _ => {}
    }
    let _ = token;
    quant::kv_groups_body(x, g, codes, scales)
}

/// Dequantizes a cache part's groups ([`quant::kv_dequant_body`]) compiled for `token`'s ISA:
/// `out[i] = codes[i].to_f32() * scales[i / g]`, the same bits on every ISA.
pub(crate) fn kv_dequant(token: IsaToken, codes: &[crate::dtype::E4M3], g: usize, scales: &[f32], out: &mut [f32]) {
    assert!(g > 0 && out.len() == codes.len() && codes.len() == scales.len() * g);
    #[cfg(target_arch = "x86_64")]
    match token.0 {
        Isa::Avx512 | Isa::Avx512Bf16 => {
            // SAFETY: the token proves AVX-512 F and BW (and AVX2, FMA) were detected.
            return unsafe { x86::quant::kv_dequant_avx512(codes, g, scales, out) };
        }
        // SAFETY: the token proves AVX2 and FMA were detected.
        Isa::Avx2 => return unsafe { x86::quant::kv_dequant_avx2(codes, g, scales, out) },
        _ => {}
    }
    let _ = token;
    quant::kv_dequant_body(codes, g, scales, out)
}

/// Prepares one block-scaled activation row ([`fp4::prepare_row_body`]) compiled for `token`'s
/// ISA, as [`quantize_row`]: the same values on every ISA (tested).
pub(crate) fn prepare_row(
    token: IsaToken,
    format: crate::dtype::BlockFormat,
    data: &[u8],
    k: usize,
    out: fp4::ActRow<'_>,
) -> (bool, u8) {
    #[cfg(target_arch = "x86_64")]
    match token.0 {
        Isa::Avx512 | Isa::Avx512Bf16 => {
            // SAFETY: the token proves AVX-512 F and BW (and AVX2, FMA) were detected.
            return unsafe { x86::quant::prepare_row_avx512(format, data, k, out) };
        }
        // SAFETY: the token proves AVX2 and FMA were detected.
        Isa::Avx2 => return unsafe { x86::quant::prepare_row_avx2(format, data, k, out) },
        _ => {}
    }
    let _ = token;
    fp4::prepare_row_body(format, data, k, out)
}

/// Rows per call of the FP4 group kernel of `token`'s ISA: 8 where 32 vector registers hold 8
/// rows' integer and f32 accumulators (AVX-512: each weight load and nibble shuffle then feeds
/// 16 `vpdpbusd` instead of 8), else 4.
pub(crate) fn fp4_mr(token: IsaToken) -> usize {
    match token.0 {
        Isa::Avx512 | Isa::Avx512Bf16 => 8,
        _ => 4,
    }
}

/// Calls the group kernel `$f::<R>` with R = `$count` (a micro-kernel of at most 4 or 8 rows: a
/// count past the maximum takes the maximum, which the callers' asserts rule out).
macro_rules! by_rows {
    ($f:ident, 4, $count:expr, $($arg:expr),*) => {
        match $count {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            _ => $f::<4>($($arg),*),
        }
    };
    ($f:ident, 8, $count:expr, $($arg:expr),*) => {
        match $count {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            5 => $f::<5>($($arg),*),
            6 => $f::<6>($($arg),*),
            7 => $f::<7>($($arg),*),
            _ => $f::<8>($($arg),*),
        }
    };
}

/// Whether this CPU has AVX-512 VBMI (`vpermb`), which the AVX-512 FP4 kernels use for the
/// nibble decode where present (Ice Lake, Sapphire Rapids, Zen 4 and later; Skylake-SP and Cascade
/// Lake have AVX-512 VNNI without it). The same bits either way.
#[cfg(target_arch = "x86_64")]
fn has_vbmi() -> bool {
    std::arch::is_x86_feature_detected!("avx512vbmi")
}

/// Runs the FP4 group kernel of `token`'s ISA on `rows.count()` (≤ [`fp4_mr`]) rows, writing
/// `out[r][c]` for r < rows.count(), c < 16.
pub(crate) fn fp4_group(token: IsaToken, g: &Fp4Group<'_>, rows: &Fp4Rows<'_>, out: &mut [[f32; GROUP]; MR]) {
    fp4_group_v(token, true, g, rows, out)
}

/// [`fp4_group`], with the AVX-512 VBMI decode only when `vbmi` (and the CPU has it): the tests
/// reach the other AVX-512 kernel on CPUs with VBMI this way.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] // `vbmi` matters on x86 only
pub(crate) fn fp4_group_v(
    token: IsaToken,
    vbmi: bool,
    g: &Fp4Group<'_>,
    rows: &Fp4Rows<'_>,
    out: &mut [[f32; GROUP]; MR],
) {
    g.check(rows);
    assert!(rows.count() <= fp4_mr(token));
    // One monomorphised kernel per row count keeps the accumulators in registers.
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2 and FMA were detected; `check` proved the slice lengths
        // the kernel's unchecked loads rely on.
        Isa::Avx2 => unsafe {
            use x86::fp4::fp4_group_avx2 as k;
            by_rows!(k, 4, rows.count(), g, rows, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F, BW and VNNI were detected, `has_vbmi` VBMI;
        // lengths as above.
        Isa::Avx512 | Isa::Avx512Bf16 if vbmi && has_vbmi() => unsafe {
            use x86::fp4::fp4_group_avx512vbmi as k;
            by_rows!(k, 8, rows.count(), g, rows, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F, BW and VNNI were detected; lengths as above.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            use x86::fp4::fp4_group_avx512 as k;
            by_rows!(k, 8, rows.count(), g, rows, out)
        },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the token proves NEON was detected; lengths as above.
        Isa::Neon => unsafe {
            use neon::fp4::fp4_group_neon as k;
            by_rows!(k, 4, rows.count(), g, rows, out)
        },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the token proves NEON and dotprod were detected; lengths as above.
        Isa::NeonDotprod => unsafe {
            use neon::fp4::fp4_group_sdot as k;
            by_rows!(k, 4, rows.count(), g, rows, out)
        },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the token proves NEON, dotprod and i8mm were detected; lengths as above.
        Isa::NeonI8mm => unsafe {
            use neon::fp4::fp4_group_smmla as k;
            by_rows!(k, 4, rows.count(), g, rows, out)
        },
        _ => group_scalar(g, rows, out),
    }
}

/// Runs the MXFP8 group kernel of `token`'s ISA on `rows.count()` (≤ [`fp4_mr`]) rows, writing
/// `out[r][c]` for r < rows.count(), c < 16.
pub(crate) fn fp8_group(token: IsaToken, g: &Fp8Group<'_>, rows: &Fp8Rows<'_>, out: &mut [[f32; GROUP]; MR]) {
    g.check(rows);
    assert!(rows.count <= fp4_mr(token));
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2, FMA and F16C were detected; `check` proved the slice
        // lengths the kernel's unchecked loads rely on.
        Isa::Avx2 => unsafe {
            use x86::fp8::fp8_group_avx2 as k;
            by_rows!(k, 4, rows.count, g, rows, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F and BW were detected; lengths as above.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            use x86::fp8::fp8_group_avx512 as k;
            by_rows!(k, 8, rows.count, g, rows, out)
        },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the token proves NEON was detected; lengths as above.
        Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm => unsafe {
            use neon::fp8::fp8_group_neon as k;
            by_rows!(k, 4, rows.count, g, rows, out)
        },
        _ => fp8::group_scalar(g, rows, out),
    }
}

/// k-blocks per decoded slice of the tiled MXFP8 kernel ([`fp8_tiled`]): 8 blocks × 32 k × 32
/// columns of f32 = 32 KiB, which stays in L1 while every row chunk of a tile reads it
/// (measured on the Llama-3-8B shape at M = 512, Intel Xeon: 2, 4, 6, 12 and 16 blocks slower).
pub(crate) const FP8_DEC_BLOCKS: usize = 8;

/// Whether `token`'s ISA has the tiled MXFP8 kernel ([`fp8_tiled`]).
pub(crate) fn fp8_decodes(token: IsaToken) -> bool {
    #[cfg(target_arch = "x86_64")]
    if matches!(token.0, Isa::Avx2 | Isa::Avx512 | Isa::Avx512Bf16) {
        return true;
    }
    let _ = token;
    false
}

/// MXFP8 for several chunks of rows × `groups` adjacent weight groups (`group(i)`, all of one
/// weight), where [`fp8_decodes`]: for each pair of groups (the last alone when the count is
/// odd; one group at a time on AVX2) and each slice of [`FP8_DEC_BLOCKS`] blocks, the weights are decoded once into
/// `scratch` and every chunk runs on them, continuing its accumulators through `out`. Writes
/// `out[(ci·mr + i)·ld + g·16 + c]` (mr = [`fp4_mr`]; every chunk but the last has mr rows): the
/// canonical order of [`fp8`], so the bits of [`fp8_group`].
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables, unused_mut))] // only x86 has it
pub(crate) fn fp8_tiled<'w>(
    token: IsaToken,
    groups: usize,
    group: impl Fn(usize) -> Fp8Group<'w>,
    chunks: &[Fp8Rows<'_>],
    out: &mut [f32],
    ld: usize,
    scratch: &mut Vec<f32>,
) {
    assert!(fp8_decodes(token), "no tiled MXFP8 kernel on {:?}", token.0);
    let mr = fp4_mr(token);
    let Some(last) = chunks.last() else { return };
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c.count == mr));
    assert!(last.count >= 1 && last.count <= mr);
    let rows = (chunks.len() - 1) * mr + last.count;
    assert!(groups >= 1 && ld >= groups * GROUP && out.len() >= (rows - 1) * ld + groups * GROUP);
    let (v, kb) = (group(0).v, group(0).kb);
    for g in 0..groups {
        let gr = group(g);
        assert!(gr.v == v && gr.kb == kb && gr.w.len() >= kb * v * GROUP);
        for c in chunks {
            gr.check(c);
        }
    }
    let need = FP8_DEC_BLOCKS * v * GROUP * 2;
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    // Slices outermost: a slice of every row's activations stays in L2 while each group pair
    // is decoded and run on it (one group at a time on AVX2: two groups' accumulators for four
    // rows would not fit its sixteen registers).
    let most = if token.0 == Isa::Avx2 { 1 } else { 2 };
    for b0 in (0..kb).step_by(FP8_DEC_BLOCKS) {
        let b1 = (b0 + FP8_DEC_BLOCKS).min(kb);
        let mut g = 0;
        while g < groups {
            let gn = if g + most <= groups { most } else { 1 };
            let pair = [group(g), group(g + gn - 1)];
            let gs = &pair[..gn];
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `fp8_decodes` and the token prove the ISA's features were detected; the
            // groups share v and kb and hold their weight bytes, `b1 ≤ kb`, `scratch` holds
            // `need` values, every group's `check(rows)` passed (all checked above); chunk ci's
            // rows end at row ≤ rows − 1, so `o` holds (count − 1)·ld + 16·gn values
            // (`out.len()` checked above); count ≤ mr; gn ≤ 2, and 1 on AVX2.
            unsafe {
                fp8_decode_x86(token, gs, b0, b1, scratch);
                for (ci, rows) in chunks.iter().enumerate() {
                    fp8_decoded_x86(token, scratch, gs, b0, b1, rows, &mut out[ci * mr * ld + g * GROUP..], ld);
                }
            }
            g += gn;
        }
    }
}

/// [`fp8_tiled`]'s decode of blocks `b0 .. b1` of the groups `gs` into `scratch`, by `token`'s
/// ISA (`x86::fp8::fp8_decode_avx2` or `_avx512`).
///
/// # Safety
/// As `fp8_decode_avx2` / `fp8_decode_avx512` require, with [`fp8_decodes`]`(token)`.
#[cfg(target_arch = "x86_64")]
unsafe fn fp8_decode_x86(token: IsaToken, gs: &[Fp8Group<'_>], b0: usize, b1: usize, scratch: &mut [f32]) {
    match token.0 {
        // SAFETY: the token proves AVX2 and F16C; the rest is the caller's obligation.
        Isa::Avx2 => unsafe { x86::fp8::fp8_decode_avx2(gs, b0, b1, scratch) },
        // SAFETY: the token proves AVX-512 F and BW; the rest is the caller's obligation.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::fp8::fp8_decode_avx512(gs, b0, b1, scratch) },
        _ => unreachable!("no tiled MXFP8 kernel on {:?}", token.0),
    }
}

/// [`fp8_tiled`]'s run of one chunk of rows on the weights [`fp8_decode_x86`] decoded into `wd`,
/// by `token`'s ISA (`x86::fp8::fp8_decoded_avx2` for one group, `_avx512` for one or two).
///
/// # Safety
/// As `fp8_decoded_avx2` / `fp8_decoded_avx512` require (R = `rows.count` ≤ [`fp4_mr`], G =
/// `gs.len()`, one group on AVX2), with [`fp8_decodes`]`(token)`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn fp8_decoded_x86(
    token: IsaToken,
    wd: &[f32],
    gs: &[Fp8Group<'_>],
    b0: usize,
    b1: usize,
    rows: &Fp8Rows<'_>,
    o: &mut [f32],
    ld: usize,
) {
    use x86::fp8::{fp8_decoded_avx2 as k2, fp8_decoded_avx512 as k5};
    // `$k!(R)` for R = rows.count (at most `$last`).
    macro_rules! by_count {
        ($k:ident, [$($r:literal)*], $last:literal) => {
            match rows.count {
                $($r => $k!($r),)*
                _ => $k!($last),
            }
        };
    }
    macro_rules! avx2 {
        ($r:literal) => {
            k2::<$r>(wd, gs, b0, b1, rows, o, ld)
        };
    }
    macro_rules! avx512_1 {
        ($r:literal) => {
            k5::<$r, 1>(wd, gs, b0, b1, rows, o, ld)
        };
    }
    macro_rules! avx512_2 {
        ($r:literal) => {
            k5::<$r, 2>(wd, gs, b0, b1, rows, o, ld)
        };
    }
    match (token.0, gs.len()) {
        // SAFETY: the token proves AVX2 and FMA; R = rows.count (the caller guarantees ≤ mr = 4)
        // and one group; the rest is the caller's obligation.
        (Isa::Avx2, _) => unsafe { by_count!(avx2, [1 2 3], 4) },
        // SAFETY: the token proves AVX-512 F; R = rows.count (the caller guarantees ≤ mr = 8),
        // G = gs.len() = 2; the rest is the caller's obligation.
        (Isa::Avx512 | Isa::Avx512Bf16, 2) => unsafe { by_count!(avx512_2, [1 2 3 4 5 6 7], 8) },
        // SAFETY: as above, G = gs.len() = 1 (the caller's groups number 1 or 2).
        (Isa::Avx512 | Isa::Avx512Bf16, _) => unsafe { by_count!(avx512_1, [1 2 3 4 5 6 7], 8) },
        _ => unreachable!("no tiled MXFP8 kernel on {:?}", token.0),
    }
}

/// Runs the MXFP8 kernel of `token`'s ISA on R activation rows (`rows.count == R`, at most
/// [`row_rows`]) and [`ROW_GROUPS`] groups of the same weight, writing `out[r][g][c]`: the
/// same bits as [`fp8_group`] on each group, with independent chains where the ISA has a kernel
/// for it.
pub(crate) fn fp8_row<const R: usize>(
    token: IsaToken,
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) {
    fp8_row_v(token, fp8_bits_decode(), gs, rows, None, out);
}

/// The most rows [`fp4_row`] and [`fp8_row`] take at once on `token`'s ISA: 2 on AVX-512 (its 32
/// registers hold both rows' eight chains), 1 elsewhere.
pub(crate) fn row_rows(token: IsaToken) -> usize {
    if matches!(token.0, Isa::Avx512 | Isa::Avx512Bf16) { 2 } else { 1 }
}

/// Whether the decode MXFP8 kernels decode E4M3 straight into f32 bits
/// (`x86::fp8::fp8_row_avx512vbmi` where the CPU has VBMI, `x86::fp8::fp8_row_avx2::<true>`
/// on AVX2) rather than through IEEE halves: where the CPU takes f32 subnormal operands at full
/// speed, since that decode turns E4M3 subnormal weights into f32 subnormals. Measured so:
/// AMD family 1Ah (Zen 5) and later — eight independent FMAs with a subnormal multiplicand ran at
/// the rate of normal ones, and one-row MXFP8 decode went from 34.5 to 23.8 µs for
/// Qwen2.5-0.5B's L2-resident weight and (with the weights' prefetch) from 1.47× to 1.10× a
/// plain read for Llama-3-8B's from DRAM, one core; AMD family 19h without AVX-512 (Zen 3) —
/// the AVX2 kernel ran a weight of only subnormal codes as fast as one of normal codes, and
/// one-row MXFP8 decode at 0.50–0.62× the half decode's time (docs/performance.md). Intel
/// documents microcode assists for subnormal operands (hundreds of cycles each), and Zen 4
/// (family 19h with AVX-512) and Zen 1/2 were not measured: they keep the half decode. The same
/// bits either way.
fn fp8_bits_decode() -> bool {
    #[cfg(target_arch = "x86_64")]
    return is_amd() && (cpu_family() >= 0x1A || is_zen3());
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// What the MXFP8 decode kernels' unchecked loads rely on: every group's lengths for `rows`, and
/// one `v` and `kb` for all of them.
fn check_groups(gs: &[Fp8Group<'_>; ROW_GROUPS], rows: &Fp8Rows<'_>) {
    for g in gs {
        g.check(rows);
        assert!(g.v == gs[0].v && g.kb == gs[0].kb);
    }
}

/// [`fp8_row`], with the f32-bits decode only when `bits` (and, on AVX-512, the CPU has VBMI):
/// the tests reach both kernels of each ISA this way, whichever [`fp8_row`] chooses.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] // `bits` matters on x86 only
pub(crate) fn fp8_row_v<const R: usize>(
    token: IsaToken,
    bits: bool,
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    outer: Option<&Outer<'_>>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) -> bool {
    assert!(rows.count == R && R <= row_rows(token));
    check_groups(gs, rows);
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F and BW were detected, `has_vbmi` VBMI; `check`
        // proved every group's lengths for these rows, the groups share v and kb (asserted
        // above), and the guard checks the kernel's condition on v.
        Isa::Avx512 | Isa::Avx512Bf16 if bits && has_vbmi() && gs[0].v.is_multiple_of(4) && gs[0].v <= 32 => unsafe {
            x86::fp8::fp8_row_avx512vbmi::<R>(gs, rows, outer, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F and BW were detected; `check` proved every group's
        // lengths, and the groups share v and kb (asserted above).
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::fp8::fp8_row_avx512::<R>(gs, rows, outer, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2, FMA and F16C were detected; lengths as above; R = 1
        // (`row_rows`, asserted above); the guard checks the f32-bits kernel's condition on v.
        Isa::Avx2 if bits && gs[0].v <= 32 => unsafe {
            x86::fp8::fp8_row_avx2::<true>(gs, rows, outer, out.into_iter().next().expect("one row"))
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe {
            x86::fp8::fp8_row_avx2::<false>(gs, rows, outer, out.into_iter().next().expect("one row"))
        },
        _ => {
            if outer.is_some() {
                return false;
            }
            by_group(gs, out, |g, tile| fp8_group(token, g, rows, tile))
        }
    }
    true
}

/// [`fp8_row`] with [`Outer`] span scales (the FP8 W8A8 block granularity), where the ISA has a
/// decode kernel (x86); `false`, with `out` unwritten, where it has none (the caller then runs
/// each span alone).
pub(crate) fn fp8_row_outer<const R: usize>(
    token: IsaToken,
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    outer: &Outer<'_>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) -> bool {
    outer.check(gs[0].kb, R);
    fp8_row_v(token, fp8_bits_decode(), gs, rows, Some(outer), out)
}

/// The most rows [`fp8_few`] and [`fp4_few`] take at once on `token`'s ISA: 4 on AVX2 (its
/// few-row kernels), 0 elsewhere (AVX-512 runs two rows in [`fp8_row`] / [`fp4_row`] and more in
/// its eight-row group kernels).
pub(crate) fn few_rows(token: IsaToken) -> usize {
    if token.0 == Isa::Avx2 { 4 } else { 0 }
}

/// The MXFP8 / FP8 W8A8 kernel of a few rows (R = 2 ..= [`few_rows`]) on [`ROW_GROUPS`]
/// groups of the same weight, with [`Outer`] span scales or without: the bits of [`fp8_group`]
/// on each group (of each span, combined as [`Outer`] says), each weight decoded once for the R
/// rows. `false`, with `out` unwritten, where the ISA has no such kernel or the block is longer
/// than 32.
pub(crate) fn fp8_few<const R: usize>(
    token: IsaToken,
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    outer: Option<&Outer<'_>>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) -> bool {
    fp8_few_v(token, fp8_bits_decode(), gs, rows, outer, out)
}

/// [`fp8_few`], with the f32-bits decode only when `bits` (the tests reach both decodes).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] // only x86 has the kernel
pub(crate) fn fp8_few_v<const R: usize>(
    token: IsaToken,
    bits: bool,
    gs: &[Fp8Group<'_>; ROW_GROUPS],
    rows: &Fp8Rows<'_>,
    outer: Option<&Outer<'_>>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) -> bool {
    assert!(rows.count == R && (2..=4).contains(&R));
    check_groups(gs, rows);
    if let Some(o) = outer {
        o.check(gs[0].kb, R);
    }
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if gs[0].v <= 32 => {
            use x86::fp8::fp8_rows_avx2 as k;
            // SAFETY: the token proves AVX2, FMA and F16C were detected; rows.count == R (asserted
            // above); `check` proved every group's lengths for these rows and the groups share v
            // and kb (asserted), v ≤ 32 (the guard), `outer` holds a span scale for every span
            // (checked); R · G ≤ 4 with G = 2 for two rows and 1 otherwise, both dividing 4.
            unsafe {
                match (R == 2, bits) {
                    (true, true) => k::<R, 2, true>(gs, rows, outer, out),
                    (true, false) => k::<R, 2, false>(gs, rows, outer, out),
                    (false, true) => k::<R, 1, true>(gs, rows, outer, out),
                    (false, false) => k::<R, 1, false>(gs, rows, outer, out),
                }
            }
            true
        }
        _ => false,
    }
}

/// The decode dispatchers' fallback where the ISA has no decode kernel: the group kernel `run`
/// on each group in turn, its first R tile rows copied to `out[r][g]`.
fn by_group<G, const R: usize>(
    gs: &[G; ROW_GROUPS],
    mut out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
    mut run: impl FnMut(&G, &mut [[f32; GROUP]; MR]),
) {
    let mut tile = [[0f32; GROUP]; MR];
    for (gi, g) in gs.iter().enumerate() {
        run(g, &mut tile);
        for (o, t) in out.iter_mut().zip(&tile) {
            o[gi] = *t;
        }
    }
}

/// Runs the FP4 kernel of `token`'s ISA on R activation rows (`rows.count() == R`, at most
/// [`row_rows`]) and [`ROW_GROUPS`] groups of the same weight, writing `out[r][g][c]`: the same
/// bits as [`fp4_group`] on each group, with independent chains where the ISA has a kernel for it.
pub(crate) fn fp4_row<const R: usize>(
    token: IsaToken,
    gs: &[Fp4Group<'_>; ROW_GROUPS],
    rows: &Fp4Rows<'_>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) {
    fp4_row_v(token, true, gs, rows, out)
}

/// [`fp4_row`], with the AVX-512 VBMI decode only when `vbmi` (see [`fp4_group_v`]).
pub(crate) fn fp4_row_v<const R: usize>(
    token: IsaToken,
    vbmi: bool,
    gs: &[Fp4Group<'_>; ROW_GROUPS],
    rows: &Fp4Rows<'_>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) {
    assert!(rows.count() == R && R <= row_rows(token));
    check_fp4_groups(gs, rows);
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F, BW and VNNI were detected, `has_vbmi` VBMI;
        // `check_fp4_groups` proved every group's own lengths and the rows' for `gs[0]`, which
        // hold for every group since the groups share pairs, kb and kind (asserted there);
        // `rows.count() == R` (asserted above).
        Isa::Avx512 | Isa::Avx512Bf16 if vbmi && has_vbmi() => unsafe {
            x86::fp4::fp4_row_avx512vbmi::<R>(gs, rows, out)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, without VBMI.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::fp4::fp4_row_avx512::<R>(gs, rows, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2 and FMA were detected; the groups' and rows' checks as
        // above; two groups per pass divide ROW_GROUPS.
        Isa::Avx2 => unsafe { x86::fp4::fp4_row_avx2::<R, 2>(gs, rows, out) },
        _ => by_group(gs, out, |g, tile| fp4_group_v(token, vbmi, g, rows, tile)),
    }
}

/// What the FP4 decode kernels' unchecked loads rely on: the rows' lengths once (they depend only
/// on kb, pairs and kind, which the groups share), every group's own lengths, and one pairs, kb
/// and kind for all of them.
fn check_fp4_groups(gs: &[Fp4Group<'_>; ROW_GROUPS], rows: &Fp4Rows<'_>) {
    gs[0].check(rows);
    for g in &gs[1..] {
        g.check_group();
        assert!(g.pairs == gs[0].pairs && g.kb == gs[0].kb && g.kind == gs[0].kind);
    }
}

/// The NVFP4 / MXFP4 kernel of a few rows (R = 2 ..= [`few_rows`]) on [`ROW_GROUPS`] groups of
/// the same weight: the bits of [`fp4_group`] on each group, each weight vector decoded once for
/// the R rows and each group's 64-byte lines used whole (both halves in turn). `false`, with
/// `out` unwritten, where the ISA has no such kernel.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] // only x86 has the kernel
pub(crate) fn fp4_few<const R: usize>(
    token: IsaToken,
    gs: &[Fp4Group<'_>; ROW_GROUPS],
    rows: &Fp4Rows<'_>,
    out: [&mut [[f32; GROUP]; ROW_GROUPS]; R],
) -> bool {
    assert!(rows.count() == R && (2..=4).contains(&R));
    check_fp4_groups(gs, rows);
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            // SAFETY: the token proves AVX2 and FMA were detected; `check_fp4_groups` proved
            // every group's lengths and the rows' for all of them (asserted above);
            // rows.count() == R (asserted); one group per pass divides ROW_GROUPS.
            unsafe { x86::fp4::fp4_row_avx2::<R, 1>(gs, rows, out) };
            true
        }
        _ => false,
    }
}

/// Rows per micro-tile of the plain kernel of `token` for weights of `kind`, and whether it takes
/// its activations as bf16 pairs (`vdpbf16ps`) rather than f32 (see [`PackedRows`]).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] // `kind` matters on x86 only
pub(crate) fn plain_layout(token: IsaToken, kind: PlainKind) -> (usize, bool) {
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 => (x86::plain::MR512, kind == PlainKind::Bf16),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => (x86::plain::MR512, false),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => (x86::plain::MR256, false),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm => (neon::plain::MRN, false),
        _ => (1, false),
    }
}

/// k-pairs per k-block of the plain kernels of `token` (a prefill's task runs every micro-tile of
/// one k-block before the next; the chain continues through the tile, so the k-block changes no
/// bit). AVX-512 and NEON: 256 pairs (512 values of K; measured best of 64 … 2048 pairs on the
/// Xeon of docs/performance.md at M = 512). AVX2: 128 pairs, so one group's block (16 KiB of f32, 8 KiB of
/// bf16) stays in a 32 KiB L1 while the activations stream past it (Zen 3, Llama-3-8B M = 512,
/// interleaved runs: f32 medians +6 % on one thread, +9 % on two; bf16 +1-5 %; docs/performance.md). The
/// Intel sessions measured AVX2 k-blocks of 32-256 pairs within noise of each other.
pub(crate) fn plain_kc(token: IsaToken) -> usize {
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::plain::KC256,
        _ => 256,
    }
}

/// The most rows of a task for which the plain kernels of `token` stream each weight group whole
/// (one k-block, every pair) instead of in [`plain_kc`] blocks: a few rows use each weight once
/// or twice, so the call is a read of the weight, and a k-block only cuts its one sequential
/// stream into pieces a group's length apart, each of which restarts the hardware prefetcher.
/// AVX2 with bf16 or f16 weights: two micro-tiles (12 rows); the first row block streams each
/// group from DRAM with the software prefetch, the second reads it again from L2
/// (`x86::plain::panel_avx2`). Measured on AMD Zen 3, Llama-3-8B decode steps (`paged-qkv bench
/// --decode-step --threads 1`, the two settings alternated): bf16 4 rows 300–335 → 152–171 ms a
/// step (1.1–1.3× a plain read of the weight, was 2.0–2.4×), 8 rows 388–514 → 279–293 ms, 12
/// rows 439–547 → 316–380 ms; f16 4 / 8 / 12 rows 285–300 → 158–177, 398–458 → 259–279,
/// 469–508 → 316–333 ms. At 16 and more rows (compute-bound) the k-blocks were as fast or
/// faster, and f32 weights (a group of 256 KiB, half of Zen 3's L2) lost with whole groups at 8
/// rows (507–557 → 601–657 ms) and gained nothing at 4: they keep [`DECODE_ROWS`], as do the
/// other ISAs (AVX-512 and NEON were not measured with more).
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))] // only x86 streams more rows
pub(crate) fn plain_stream_rows(token: IsaToken, kind: PlainKind) -> usize {
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if kind != PlainKind::F32 => 2 * x86::plain::MR256,
        _ => DECODE_ROWS,
    }
}

/// Multiplies `n` packed activation rows (pairs `p0 ..` of them) with every column of the panel
/// block `w` (pairs `p0 .. p0 + w.pairs`): `out[i·ld + c]` for row `i` and panel column `c`, in the
/// canonical order of [`plain`], continuing the chains from the values in `out` when `acc_in`.
/// `a` must be packed in the layout [`plain_layout`] gives for `token`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn plain_panel(
    token: IsaToken,
    w: &PlainPanel<'_>,
    a: &PackedRows<'_>,
    p0: usize,
    n: usize,
    out: &mut [f32],
    ld: usize,
    acc_in: bool,
) {
    w.check(a, p0, n, out.len(), ld);
    assert_eq!((a.mr, a.bf16_pairs), plain_layout(token, w.kind), "activations packed for another kernel");
    if n == 0 {
        return;
    }
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 BF16 (and F) were detected; `check` proved the lengths
        // of the weight block, the packed rows (bf16 pairs of a bf16 weight) and `out`.
        Isa::Avx512Bf16 if a.bf16_pairs => unsafe { x86::plain::panel_avx512bf16(w, a, p0, n, out, ld, acc_in) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F was detected; lengths as above.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe { x86::plain::panel_avx512(w, a, p0, n, out, ld, acc_in) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2, FMA and F16C were detected; lengths as above.
        Isa::Avx2 => unsafe { x86::plain::panel_avx2(w, a, p0, n, out, ld, acc_in) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the token proves NEON was detected; lengths as above.
        Isa::Neon | Isa::NeonDotprod | Isa::NeonI8mm => unsafe {
            neon::plain::panel_neon(w, a, p0, n, out, ld, acc_in)
        },
        _ => panel_scalar(w, a, p0, n, out, ld, acc_in),
    }
}
