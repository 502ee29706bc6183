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
//! Besides the steps per second, a bar shows the share of the time spent waiting for the next
//! item (`data 3%`: the loader building a batch, or waiting for its prefetch workers) and,
//! over a prepared loader's batches, the samples per second of all processes together
//! (`2,048 samples/s`).
//!
//! `IVME_PROGRESS=0` turns bars off even on a terminal.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// Known length: position, rate, ETA. Unknown length: position and rate only. The prefix holds
// the data wait and the samples per second.
const WITH_LEN: &str =
    "{spinner} {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}] {prefix} {msg}";
const WITHOUT_LEN: &str = "{spinner} {pos} steps [{elapsed_precise}, {per_sec}] {prefix} {msg}";

/// An iterator that advances a progress bar by one for every item completed.
///
/// The bar counts an item as done when the next one is asked for, so the rate measures whole
/// training steps (fetch plus the loop body), and finishes when the iterator runs out.
pub struct Progress<I> {
    inner: I,
    bar: ProgressBar,
    started: bool,
    /// When the first item was asked for.
    began: Option<Instant>,
    /// Time spent inside the inner iterator's `next`: waiting for data.
    waited: Duration,
    /// The samples the prepared loaders handed out on this process, the count when the bar
    /// began, and the number of processes (each hands out as many).
    samples: Option<(Arc<AtomicU64>, u64, usize)>,
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
        began: None,
        waited: Duration::ZERO,
        samples: None,
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
    /// Counts samples per second from `counter` (this process's samples, as the prepared
    /// loaders report them) times `processes`.
    pub(crate) fn with_samples(mut self, counter: Arc<AtomicU64>, processes: usize) -> Self {
        let now = counter.load(Ordering::Relaxed);
        self.samples = Some((counter, now, processes));
        self
    }

    /// Time spent so far waiting for the next item (inside the wrapped iterator).
    pub fn data_wait(&self) -> Duration {
        self.waited
    }

    /// Samples handed out since the bar began, all processes together (each process is
    /// assumed to hand out as many, padding aside); `None` when the items do not come from a
    /// prepared loader.
    pub fn samples(&self) -> Option<u64> {
        let (counter, start, processes) = self.samples.as_ref()?;
        let local = counter.load(Ordering::Relaxed) - start;
        (local > 0).then_some(local * *processes as u64)
    }

    /// The bar's figures after the rate: data wait share and samples per second.
    fn figures(&self) -> String {
        let Some(began) = self.began else {
            return String::new();
        };
        let elapsed = began.elapsed().as_secs_f64().max(1e-9);
        let share = 100.0 * self.waited.as_secs_f64() / elapsed;
        let mut out = format!("data {share:.0}%");
        if let Some(n) = self.samples() {
            out.push_str(&format!(
                ", {} samples/s",
                grouped((n as f64 / elapsed).round() as u64)
            ));
        }
        out
    }

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
        let asked = Instant::now();
        self.began.get_or_insert(asked);
        let item = self.inner.next();
        self.waited += asked.elapsed();
        if !self.bar.is_hidden() {
            self.bar.set_prefix(self.figures());
        }
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

/// Writes `n` with thousands separators (12,345).
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

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

    #[test]
    fn the_time_waiting_for_data_is_counted_and_shown() {
        let slow = (0..3).inspect(|_| std::thread::sleep(Duration::from_millis(20)));
        let mut p = progress(slow, Some(3), false);
        assert_eq!(p.by_ref().count(), 3);
        assert!(
            p.data_wait() >= Duration::from_millis(60),
            "{:?}",
            p.data_wait()
        );
        assert!(p.figures().starts_with("data "), "{}", p.figures());
        assert_eq!(p.samples(), None, "not a prepared loader");
        assert_eq!(grouped(1234567), "1,234,567");
        assert_eq!(grouped(999), "999");
    }

    #[test]
    fn a_prepared_loaders_samples_are_counted_padding_aside() -> crate::Result<()> {
        use crate::data::{DataLoader, TensorDataset};
        use candle_core::{Device, Tensor};
        let mut acc = Accelerator::builder().cpu(true).build()?;
        let data = TensorDataset::new(Tensor::arange(0u32, 10, &Device::Cpu)?)?;
        // Batches of 4 over 10 samples: 4, 4, then 2 (no padding on one process).
        let mut loader = acc.prepare(DataLoader::new(data, 4))?;
        let mut p = acc.progress(loader.iter());
        p.next();
        p.next();
        assert_eq!(p.samples(), Some(8));
        assert_eq!(p.by_ref().count(), 1);
        assert_eq!(p.samples(), Some(10));
        assert!(p.figures().contains("samples/s"), "{}", p.figures());
        Ok(())
    }
}
