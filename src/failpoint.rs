//! Injected failures, for tests of the error paths (the caches' "nothing is written on
//! error"): a point name, set on one thread, that the next [`check`] of that name on that
//! thread turns into an error, as an out-of-memory or a failed launch there would. Not part
//! of the API; one thread-local read per check when unused.

use std::cell::Cell;

thread_local! {
    static NEXT: Cell<Option<&'static str>> = const { Cell::new(None) };
}

/// Makes the next check of `point` on this thread fail (`None`: clears it).
#[doc(hidden)]
pub fn inject_failure(point: Option<&'static str>) {
    NEXT.with(|next| next.set(point));
}

/// An error if a failure was injected at `point` (once).
pub(crate) fn check(point: &'static str) -> candle::Result<()> {
    if NEXT.with(|next| next.get()) == Some(point) {
        NEXT.with(|next| next.set(None));
        candle::bail!("injected failure at {point}")
    }
    Ok(())
}
