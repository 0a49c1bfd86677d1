//! Worker pools for `threads=`: one per thread count, built on first use and kept for the
//! process (building one costs ~100 µs and as many thread starts; a call reuses it).

use pyo3::PyResult;
use pyo3::exceptions::PyValueError;
use rayon::ThreadPool;
use std::sync::{Arc, Mutex};

static POOLS: Mutex<Vec<(usize, Arc<ThreadPool>)>> = Mutex::new(Vec::new());

/// Most threads a pool may have (a typo such as `threads=10**6` is an error, not a million threads).
pub const MAX_THREADS: usize = 1024;

/// The pool of `threads` threads (`None`: the global pool; `Some(1)`: none, the calling thread).
pub fn get(threads: Option<usize>) -> PyResult<Option<Arc<ThreadPool>>> {
    let n = match threads {
        None | Some(1) => return Ok(None),
        Some(0) => return Err(PyValueError::new_err("threads: must be at least 1")),
        Some(n) if n > MAX_THREADS => {
            return Err(PyValueError::new_err(format!("threads: at most {MAX_THREADS}, found {n}")));
        }
        Some(n) => n,
    };
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = pools.iter().find(|(k, _)| *k == n) {
        return Ok(Some(p.clone()));
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(move |i| format!("paged-qkv-{n}-{i}"))
        .build()
        .map_err(|e| PyValueError::new_err(format!("threads: could not start a pool of {n}: {e}")))?;
    let p = Arc::new(p);
    pools.push((n, p.clone()));
    Ok(Some(p))
}
