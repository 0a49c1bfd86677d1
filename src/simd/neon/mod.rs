//! aarch64 NEON kernels (see the parent module for the arithmetic they share).

pub(super) mod fp4;
pub(super) mod fp8;
pub(super) mod plain;
pub(super) mod rope;
