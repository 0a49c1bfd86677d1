//! The fast paths' execution for the benches (`#[path]`): the best ISA, or the one named by
//! `PAGED_QKV_BENCH_ISA` (bench-only), read once. Read per call, the environment lookup and its
//! `String` were part of every timed call (~15–20 ns: about 1 % of a 64-token Qwen-shaped RoPE
//! call, which its copy baseline did not pay).

use paged_qkv::{Exec, Isa};
use std::sync::OnceLock;

pub fn exec() -> Exec {
    static EXEC: OnceLock<Exec> = OnceLock::new();
    *EXEC.get_or_init(|| {
        let isa = std::env::var("PAGED_QKV_BENCH_ISA").ok().and_then(|s| Isa::from_name(&s));
        Exec { isa, ..Exec::default() }
    })
}
