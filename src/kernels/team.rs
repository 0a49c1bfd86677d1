//! The threads a call runs on ([`Team`]): the calling thread alone, the current rayon pool, or a
//! [`Workers`] team. The kernels see only the two shapes of parallel work they use: a call's
//! tasks drained from per-thread chunks ([`Team::spread`]), and disjoint chunks of a buffer
//! ([`Team::chunks_mut`]).

use crate::workers::Workers;
use rayon::prelude::*;
use std::sync::Mutex;

/// Where a call's parallel work runs (from `Exec::par`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Team {
    /// The calling thread.
    One,
    /// The current rayon pool.
    Rayon,
    /// A long-lived team.
    Workers(&'static Workers),
}

impl Team {
    /// Threads the work may spread over.
    pub fn threads(self) -> usize {
        match self {
            Team::One => 1,
            Team::Rayon => rayon::current_num_threads(),
            Team::Workers(w) => w.threads(),
        }
    }

    /// Runs `f(me)` on up to `n` threads at once, `me < n` naming the thread's home share (the
    /// same thread gets the same `me` from call to call on a [`Workers`] team; on rayon, the
    /// pool's thread index modulo `n`). `f` must claim its work through shared state and help
    /// with the other shares when its own is done: an index may run more than once, or not at
    /// all, and the work is done when every call of `f` has returned.
    pub fn spread(self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        match self {
            Team::One => f(0),
            Team::Rayon => (0..n).into_par_iter().with_max_len(1).for_each(|_| {
                f(rayon::current_thread_index().unwrap_or(0) % n);
            }),
            Team::Workers(w) => w.each_thread(&|i| {
                if i < n {
                    f(i)
                }
            }),
        }
    }

    /// Runs `f(item)` for every item of `items`, in parallel unless `One` (each thread takes the
    /// next item when it is free).
    pub fn each<I: Iterator + Send>(self, items: I, f: impl Fn(I::Item) + Sync)
    where
        I::Item: Send,
    {
        match self {
            Team::One => items.for_each(f),
            Team::Rayon => items.par_bridge().for_each(&f),
            Team::Workers(w) => {
                let items = Mutex::new(items);
                w.each_thread(&|_| {
                    loop {
                        let next = items.lock().unwrap_or_else(|e| e.into_inner()).next();
                        match next {
                            Some(item) => f(item),
                            None => break,
                        }
                    }
                });
            }
        }
    }

    /// Runs `f(chunk)` for every `chunk`-long chunk of `data` (the last may be shorter), in
    /// parallel unless `One` (on rayon as an indexed split: `par_bridge`, which [`Team::each`]
    /// uses there, allocates per call).
    pub fn chunks<T: Sync>(self, data: &[T], chunk: usize, f: impl Fn(&[T]) + Sync) {
        if chunk == 0 {
            return;
        }
        match self {
            Team::One => data.chunks(chunk).for_each(f),
            Team::Rayon => data.par_chunks(chunk).for_each(&f),
            Team::Workers(_) => self.each(data.chunks(chunk), f),
        }
    }

    /// Runs `f(i, chunk)` for every `chunk`-long chunk of `data` (the last may be shorter), in
    /// parallel unless `One`.
    pub fn chunks_mut<T: Send>(self, data: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
        if chunk == 0 {
            return;
        }
        match self {
            Team::One => data.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c)),
            Team::Rayon => data.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c)),
            Team::Workers(_) => self.each(data.chunks_mut(chunk).enumerate(), |(i, c)| f(i, c)),
        }
    }
}
