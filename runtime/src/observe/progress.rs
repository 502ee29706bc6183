//! Progress bars over any iterator (typically a prepared loader's batches): drawn on the main
//! process only, and only when stderr is a terminal, so CI logs get no escape codes.
//!
//! ```no_run
//! # fn demo(accelerator: &ivme::Accelerator,
//! #         loader: &mut ivme::data::DataLoader<ivme::data::TensorDataset<candle_core::Tensor>>)
//! #         -> ivme::Result<()> {
//! let batches = accelerator.progress(loader.iter());
//! let bar = batches.handle(); // keeps working while the loop owns the iterator
//! for batch in batches {
//!     let loss = batch?.sum_all()?.to_scalar::<f32>()?;
//!     bar.set_loss(loss as f64);
//! }
//! # Ok(()) }
//! ```
//!
//! `IVME_PROGRESS=0` turns bars off even on a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

// Known length: position, rate, ETA. Unknown length: position and rate only.
const WITH_LEN: &str =
    "{spinner} {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}] {msg}";
const WITHOUT_LEN: &str = "{spinner} {pos} steps [{elapsed_precise}, {per_sec}] {msg}";

/// An iterator that advances a progress bar by one for every item completed.
///
/// The bar counts an item as done when the next one is asked for, so the rate measures whole
/// training steps (fetch plus the loop body), and finishes when the iterator runs out.
pub struct Progress<I> {
    inner: I,
    bar: ProgressBar,
    started: bool,
}

/// A handle on a [`Progress`] bar, usable inside the loop that consumes the iterator.
#[derive(Clone, Debug)]
pub struct ProgressHandle {
    bar: ProgressBar,
}

/// Wraps `iter` in a progress bar of `len` steps (`None`: unknown), drawn only if `visible`
/// and stderr is a terminal and `IVME_PROGRESS` is not `0`.
pub fn progress<I: Iterator>(iter: I, len: Option<u64>, visible: bool) -> Progress<I> {
    let draw = visible && should_draw(std::io::stderr().is_terminal(), progress_env().as_deref());
    let target = if draw {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(len, target);
    let template = if len.is_some() { WITH_LEN } else { WITHOUT_LEN };
    // The templates are constants, so a parse failure would be a bug in this file; fall back
    // to indicatif's default style rather than panic.
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    Progress {
        inner: iter,
        bar,
        started: false,
    }
}

fn progress_env() -> Option<String> {
    crate::setup::env::PROGRESS.get()
}

/// Whether to draw: only on a terminal, and not when the user turned bars off.
fn should_draw(terminal: bool, env: Option<&str>) -> bool {
    terminal && env.map(str::trim) != Some("0")
}

impl<I> Progress<I> {
    /// Returns a handle for setting the message (e.g. the loss) while a loop consumes `self`.
    pub fn handle(&self) -> ProgressHandle {
        ProgressHandle {
            bar: self.bar.clone(),
        }
    }

    /// Whether the bar is drawn (main process, a terminal, not turned off).
    pub fn is_visible(&self) -> bool {
        !self.bar.is_hidden()
    }

    /// Steps completed so far.
    pub fn position(&self) -> u64 {
        self.bar.position()
    }
}

impl ProgressHandle {
    /// Shows `loss` after the rate.
    pub fn set_loss(&self, loss: f64) {
        self.bar.set_message(format!("loss {loss:.4}"));
    }

    /// Shows any text after the rate.
    pub fn set_message(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
    }

    /// Prints a line above the bar without breaking it (nothing when the bar is hidden).
    pub fn println(&self, msg: impl AsRef<str>) {
        self.bar.println(msg);
    }
}

impl<I: Iterator> Iterator for Progress<I> {
    type Item = I::Item;

    fn next(&mut self) -> Option<I::Item> {
        if self.started {
            self.bar.inc(1);
        }
        self.started = true;
        let item = self.inner.next();
        if item.is_none() {
            self.bar.finish();
        }
        item
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.inner.size_hint()
    }
}

impl<I: ExactSizeIterator> ExactSizeIterator for Progress<I> {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Accelerator;

    #[test]
    fn draws_only_on_a_terminal_not_turned_off() {
        assert!(should_draw(true, None));
        assert!(should_draw(true, Some("1")));
        assert!(!should_draw(true, Some("0")));
        assert!(!should_draw(false, None));
    }

    #[test]
    fn yields_every_item_and_counts_completed_steps() {
        let mut p = progress(10..14, Some(4), false);
        assert!(!p.is_visible());
        let handle = p.handle();
        assert_eq!(p.next(), Some(10));
        assert_eq!(p.position(), 0, "the first item is still in progress");
        handle.set_loss(0.25);
        let rest: Vec<i32> = p.by_ref().collect();
        assert_eq!(rest, [11, 12, 13]);
        assert_eq!(p.position(), 4);
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn the_accelerator_reads_the_length_from_the_iterator() -> crate::Result<()> {
        let acc = Accelerator::builder().cpu(true).build()?;
        let p = acc.progress(vec![1, 2, 3]);
        assert_eq!(p.bar.length(), Some(3));
        let p = acc.progress((0..).take_while(|&x| x < 3));
        assert_eq!(p.bar.length(), None);
        assert_eq!(p.count(), 3);
        Ok(())
    }
}
