//! x86-64 kernels: AVX2 and AVX-512 (see the parent module for the arithmetic they share).

pub(super) mod fp4;
pub(super) mod fp8;
pub(super) mod plain;
pub(super) mod rope;
