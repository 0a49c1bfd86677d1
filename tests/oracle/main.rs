//! The oracle's test suite: formats (exhaustive), the 5-D scale layout, quantizers, the cache,
//! every reference operation (hand-checkable and real model shapes), cache integrity and errors.

mod common;
mod errors;
mod formats;
mod fp4_setup;
mod layout;
mod plain;
mod qkv_fp4;
mod qkv_fp8;
mod quantize;
mod robustness;
mod rope;
