//! Arbitrary bytes as a case file: reading, writing back, running (every mode, fast and oracle),
//! the written-slot mask and position naming must never panic, abort or allocate beyond what the
//! file holds. Seeded with `make-case` files (see `.ci/run`).
//! `cargo +nightly fuzz run case_file -- -max_total_time=60`
#![no_main]

use libfuzzer_sys::fuzz_target;
use paged_qkv::Exec;
use paged_qkv::case::{Case, Mode};

fuzz_target!(|data: &[u8]| {
    let Ok(c) = Case::from_bytes(data) else { return };
    let _ = c.to_bytes().map(|b| Case::from_bytes(&b));
    let _ = c.format();
    let _ = c.tensor("kv_blocks");
    for mode in [Mode::Exact, Mode::Sequential, Mode::Fast] {
        let _ = c.runs_fast(mode);
        let _ = c.run(mode, Exec::sequential());
    }
    if let Ok((out, kv)) = c.written() {
        for i in [0, 1, out.len().saturating_sub(1), usize::MAX / 3] {
            let _ = c.name_output(i);
        }
        for i in [0, kv.len().saturating_sub(1), usize::MAX] {
            let _ = c.name_cache(i);
        }
    }
    let _ = c.name_output(7);
    let _ = c.name_cache(7);
});
