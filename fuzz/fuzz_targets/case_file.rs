//! Arbitrary bytes as a case file: reading, running (reference and fast), the written-slot mask
//! and position naming must never panic.
//! `cargo +nightly fuzz run case_file -- -max_total_time=60`
#![no_main]

use libfuzzer_sys::fuzz_target;
use paged_qkv::Exec;
use paged_qkv::case::{Case, Mode};

fuzz_target!(|data: &[u8]| {
    if let Ok(c) = Case::from_bytes(data) {
        let _ = c.run(Mode::Exact, Exec::sequential());
        let _ = c.run(Mode::Fast, Exec::sequential());
        let _ = c.written();
        let _ = c.name_output(1);
        let _ = c.name_cache(1);
    }
});
