//! The memory of the calls running without the GIL, so that two Python threads never have the
//! kernels write memory the other reads or writes: a call claims its arguments' byte ranges
//! (written ones exclusively, read ones shared) before it makes slices of them, and waits while
//! a conflicting claim is held. Claims are all-or-nothing and taken without the GIL, so a wait
//! cannot deadlock. Calls on disjoint memory (two caches, or one weight read by both) run side
//! by side.
//!
//! What this cannot stop: Python code that writes an array while a call reads or writes it
//! (as with every numpy extension that releases the GIL); the result is then unspecified.

use std::sync::{Condvar, Mutex};

/// A byte range `[start, end)` and whether the call writes it.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub start: usize,
    pub end: usize,
    pub write: bool,
}

impl Span {
    pub fn conflicts_with(&self, o: &Span) -> bool {
        (self.write || o.write) && self.start < o.end && o.start < self.end
    }
}

struct Claims {
    next: u64,
    held: Vec<(u64, Span)>,
}

static CLAIMS: Mutex<Claims> = Mutex::new(Claims { next: 0, held: Vec::new() });
static RELEASED: Condvar = Condvar::new();

/// Held ranges, released on drop.
pub struct Claim(u64);

/// Claims `spans` (empty ones are skipped), waiting until no held claim conflicts.
pub fn claim(spans: &[Span]) -> Claim {
    let spans: Vec<Span> = spans.iter().copied().filter(|s| s.start < s.end).collect();
    let mut c = CLAIMS.lock().unwrap_or_else(|e| e.into_inner());
    while c.held.iter().any(|(_, h)| spans.iter().any(|s| s.conflicts_with(h))) {
        c = RELEASED.wait(c).unwrap_or_else(|e| e.into_inner());
    }
    let id = c.next;
    c.next += 1;
    c.held.extend(spans.into_iter().map(|s| (id, s)));
    Claim(id)
}

impl Drop for Claim {
    fn drop(&mut self) {
        let mut c = CLAIMS.lock().unwrap_or_else(|e| e.into_inner());
        c.held.retain(|(id, _)| *id != self.0);
        drop(c);
        RELEASED.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn readers_share_and_a_writer_waits() {
        let r = |a, b| Span { start: a, end: b, write: false };
        let w = |a, b| Span { start: a, end: b, write: true };
        assert!(!r(0, 10).conflicts_with(&r(5, 15)));
        assert!(w(0, 10).conflicts_with(&r(5, 15)));
        assert!(!w(0, 10).conflicts_with(&w(10, 20)));
        let first = claim(&[w(100, 200), r(0, 50)]);
        let _reader = claim(&[r(0, 50)]); // shared with the first claim's read
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let t = std::thread::spawn(move || {
            let _c = claim(&[r(150, 160)]); // inside the first claim's write: waits
            d.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!done.load(Ordering::SeqCst), "a read of written memory waited for the writer");
        drop(first);
        t.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
    }
}
