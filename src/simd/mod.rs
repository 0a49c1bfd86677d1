//! The only module with `core::arch`: ISA detection and the per-ISA micro-kernels, behind one
//! dispatch per kernel family. It knows memory layouts of operands (defined in [`fp4`] and
//! [`plain`], next to the portable kernel of each family) and nothing of formats, caches or
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
#[cfg(target_arch = "aarch64")]
mod neon;
pub(crate) mod plain;
#[cfg(target_arch = "x86_64")]
mod x86;

use crate::error::{Error, Result};
use fp4::{Fp4Group, Fp4Rows, group_scalar};
use plain::{PlainKind, PlainPanel, PlainRows, panel_scalar};
use std::sync::OnceLock;

/// Most activation rows one FP4 kernel call handles.
pub(crate) const MR: usize = 4;
/// Columns per weight group (FP4 and plain).
pub(crate) const GROUP: usize = 16;

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
}

impl Isa {
    /// All ISAs this crate knows; on each architecture, best last.
    pub const ALL: [Isa; 5] = [Isa::Scalar, Isa::Neon, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    /// Lower-case name (`scalar`, `avx2`, `avx512`, `avx512bf16`, `neon`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Neon => "neon",
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
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The ISAs this CPU can run.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The best available ISA, detected once per process.
    pub fn best() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| Isa::ALL.into_iter().rev().find(|i| i.is_available()).unwrap_or(Isa::Scalar))
    }
}

/// Proof that an ISA is available on this CPU: only [`IsaToken::new`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IsaToken(Isa);

impl IsaToken {
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

/// Runs the FP4 group kernel of `token`'s ISA on `rows.count()` (≤ MR) rows, writing
/// `out[r][c]` for r < rows.count(), c < 16.
pub(crate) fn fp4_group(token: IsaToken, g: &Fp4Group<'_>, rows: &Fp4Rows<'_>, out: &mut [[f32; GROUP]; MR]) {
    g.check(rows);
    // One monomorphised kernel per row count keeps the accumulators in registers.
    macro_rules! by_rows {
        ($f:ident) => {
            match rows.count() {
                1 => $f::<1>(g, rows, out),
                2 => $f::<2>(g, rows, out),
                3 => $f::<3>(g, rows, out),
                _ => $f::<4>(g, rows, out),
            }
        };
    }
    match token.0 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2 and FMA were detected; `check` proved the slice lengths
        // the kernel's unchecked loads rely on.
        Isa::Avx2 => unsafe {
            use x86::fp4::fp4_group_avx2 as k;
            by_rows!(k)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F, BW and VNNI were detected; lengths as above.
        Isa::Avx512 | Isa::Avx512Bf16 => unsafe {
            use x86::fp4::fp4_group_avx512 as k;
            by_rows!(k)
        },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the token proves NEON was detected; lengths as above.
        Isa::Neon => unsafe {
            use neon::fp4::fp4_group_neon as k;
            by_rows!(k)
        },
        _ => group_scalar(g, rows, out),
    }
}

/// Whether the plain kernel of `token` for weights of `kind` takes its activation rows as bf16
/// pairs ([`PlainRows::Bf16Pairs`]) rather than f32.
pub(crate) fn plain_wants_bf16_pairs(token: IsaToken, kind: PlainKind) -> bool {
    token.0 == Isa::Avx512Bf16 && kind == PlainKind::Bf16
}

/// Multiplies every activation row of `rows` with every column of the panel `w`:
/// `out[i·ld + c]` for row `i` and panel column `c`, in the canonical order of [`plain`].
/// `rows` must be in the form [`plain_wants_bf16_pairs`] asks for.
pub(crate) fn plain_panel(token: IsaToken, w: &PlainPanel<'_>, rows: &PlainRows<'_>, out: &mut [f32], ld: usize) {
    w.check(rows, out.len(), ld);
    if rows.len() == 0 {
        return;
    }
    match (token.0, rows) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 BF16 (and F) were detected; `check` proved the lengths
        // the kernel's unchecked loads and stores rely on, and that the weight kind is bf16.
        (Isa::Avx512Bf16, PlainRows::Bf16Pairs(r)) => unsafe { x86::plain::panel_avx512bf16(w, r, out, ld) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX-512 F was detected; lengths as above.
        (Isa::Avx512 | Isa::Avx512Bf16, PlainRows::F32(r)) => unsafe { x86::plain::panel_avx512(w, r, out, ld) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves AVX2, FMA and F16C were detected; lengths as above.
        (Isa::Avx2, PlainRows::F32(r)) => unsafe { x86::plain::panel_avx2(w, r, out, ld) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: the token proves NEON was detected; lengths as above.
        (Isa::Neon, PlainRows::F32(r)) => unsafe { neon::plain::panel_neon(w, r, out, ld) },
        _ => panel_scalar(w, rows, out, ld),
    }
}
