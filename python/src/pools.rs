//! Worker teams for `threads=`: one [`Workers`] team per thread count, built on first use and
//! kept for the process (`Workers::shared`): its threads spin briefly after each call, so calls
//! that follow each other (a model's layers) start on every thread at once.

use paged_qkv::{Exec, Workers};
use pyo3::PyResult;
use pyo3::exceptions::PyValueError;

/// Most threads a team may have (a typo such as `threads=10**6` is an error, not a million threads).
pub const MAX_THREADS: usize = 1024;

/// What a call with `threads` runs on (`None`: every core; `Some(1)`: the calling thread).
pub fn exec(threads: Option<usize>) -> PyResult<Exec> {
    let n = match threads {
        Some(1) => return Ok(Exec::sequential()),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        Some(0) => return Err(PyValueError::new_err("threads: must be at least 1")),
        Some(n) if n > MAX_THREADS => {
            return Err(PyValueError::new_err(format!("threads: at most {MAX_THREADS}, found {n}")));
        }
        Some(n) => n,
    };
    if n == 1 {
        return Ok(Exec::sequential());
    }
    let w =
        Workers::shared(n).map_err(|e| PyValueError::new_err(format!("threads: could not start {n} threads: {e}")))?;
    Ok(Exec::on(w))
}
