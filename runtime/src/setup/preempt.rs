//! Preemption: the signals a scheduler sends before it takes the machines away (SIGTERM, and
//! SIGUSR1 ahead of time), caught so the run can stop at a step boundary and save.
//!
//! Building an Accelerator installs the handlers once per process. Until the first `backward`
//! a signal keeps its default effect (the process ends: there is nothing to save yet); from
//! then on it only raises a flag. The ranks learn of each other's flag with the arrival token
//! of every collective (comm/watch/arrival.rs), so they agree, at the same gradient sync, that
//! the run stops after that optimizer step; `Accelerator::preemption_point` then saves and
//! ends the loop. A thread per process bounds the whole stop by the grace period: a rank still
//! running then exits, leaving the checkpoints already committed intact.

use crate::error::{Error, Result};
use crate::setup::env;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

/// The signal that asked this process to stop (0 while none has).
static REQUESTED: AtomicI32 = AtomicI32::new(0);
/// Whether a signal now asks for a stop rather than ending the process (training has begun).
static ARMED: AtomicBool = AtomicBool::new(false);
static INSTALL: Once = Once::new();

/// The signals taken as a preemption unless `IVME_PREEMPT_SIGNALS` says otherwise.
pub const DEFAULT_SIGNALS: &str = "TERM,USR1";
/// How long a stop may take unless `IVME_PREEMPT_GRACE` says otherwise.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(25);
/// The launcher's exit code after a preemption unless `IVME_REQUEUE_EXIT_CODE` says otherwise
/// (EX_TEMPFAIL: "try again later").
pub const DEFAULT_REQUEUE_EXIT_CODE: i32 = 75;

/// The signal `ivme launch` and its rank wrappers pass a preemption on with (mpirun forwards
/// it to every rank on every machine).
#[cfg(unix)]
pub const RELAY_SIGNAL: i32 = libc::SIGUSR1;

/// Reads a list of signal names (`TERM,USR1`, `SIGTERM`, `usr2`, `none`) into numbers.
pub fn parse_signals(raw: &str) -> Result<Vec<i32>> {
    let text = raw.trim();
    if text.eq_ignore_ascii_case("none") || text.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for word in text.split([',', ' ']).filter(|w| !w.is_empty()) {
        let name = word.to_ascii_uppercase();
        let name = name.strip_prefix("SIG").unwrap_or(&name);
        let sig = match name {
            "TERM" => libc::SIGTERM,
            "USR1" => libc::SIGUSR1,
            "USR2" => libc::SIGUSR2,
            "HUP" => libc::SIGHUP,
            "INT" => libc::SIGINT,
            _ => {
                return Err(Error::config(
                    env::PREEMPT_SIGNALS.name,
                    raw,
                    "use signal names separated by commas, from TERM, USR1, USR2, HUP and INT \
                     (e.g. `TERM,USR1`), or `none` to turn preemption handling off",
                ))
            }
        };
        if !out.contains(&sig) {
            out.push(sig);
        }
    }
    Ok(out)
}

/// The preemption settings of this process: which signals, and how long a stop may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreemptSettings {
    /// The signals taken as a preemption (empty: none).
    pub signals: Vec<i32>,
    /// How long after the first signal the process may still run.
    pub grace: Duration,
}

impl PreemptSettings {
    /// Reads `IVME_PREEMPT_SIGNALS` and `IVME_PREEMPT_GRACE` through `get`. A process that
    /// `ivme launch` started also takes the launcher's relay signal (SIGUSR1) unless
    /// preemption handling is off.
    pub fn read(get: impl Fn(&str) -> Option<String>) -> Result<PreemptSettings> {
        let raw = env::lookup(env::PREEMPT_SIGNALS.name, &get);
        let mut signals = parse_signals(raw.as_deref().unwrap_or(DEFAULT_SIGNALS))?;
        let launched = env::lookup(env::LAUNCHER.name, &get).is_some_and(|v| v == "ivme");
        if launched && !signals.is_empty() && !signals.contains(&RELAY_SIGNAL) {
            signals.push(RELAY_SIGNAL);
        }
        let grace = match env::lookup(env::PREEMPT_GRACE.name, &get) {
            None => DEFAULT_GRACE,
            Some(raw) => env::parse_duration(&raw)
                .ok_or_else(|| Error::config(env::PREEMPT_GRACE.name, &raw, env::DURATION_FORMS))?,
        };
        Ok(PreemptSettings { signals, grace })
    }
}

/// The exit code `ivme launch` ends with after a preemption (`IVME_REQUEUE_EXIT_CODE`).
pub fn requeue_exit_code(get: impl Fn(&str) -> Option<String>) -> Result<i32> {
    match env::lookup(env::REQUEUE_EXIT_CODE.name, get) {
        None => Ok(DEFAULT_REQUEUE_EXIT_CODE),
        Some(raw) => raw
            .parse::<i32>()
            .ok()
            .filter(|c| (1..=255).contains(c))
            .ok_or_else(|| {
                Error::config(
                    env::REQUEUE_EXIT_CODE.name,
                    &raw,
                    "use an exit code from 1 to 255",
                )
            }),
    }
}

#[cfg(unix)]
extern "C" fn on_signal(sig: libc::c_int) {
    if ARMED.load(Ordering::SeqCst) {
        let _ = REQUESTED.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
        return;
    }
    // Not training: the signal does what it would have done without ivme.
    // SAFETY: signal and raise are async-signal-safe.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        libc::raise(sig);
    }
}

/// Installs the handlers for `settings` (once per process; later calls change nothing) and
/// starts the thread that bounds a stop by the grace period.
pub(crate) fn install(settings: &PreemptSettings) {
    if settings.signals.is_empty() {
        return;
    }
    INSTALL.call_once(|| {
        #[cfg(unix)]
        // SAFETY: the handler touches atomics only, or restores the default and re-raises.
        unsafe {
            let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            for &sig in &settings.signals {
                // A signal the process was told to ignore (nohup) stays ignored.
                if libc::signal(sig, handler) == libc::SIG_IGN {
                    libc::signal(sig, libc::SIG_IGN);
                }
            }
        }
        let grace = settings.grace;
        let _ = std::thread::Builder::new()
            .name("ivme-preempt".into())
            .spawn(move || bound_by_grace(grace));
    });
}

/// Waits for a stop to be asked for, then gives the process `grace` to end on its own.
fn bound_by_grace(grace: Duration) {
    while REQUESTED.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let asked = Instant::now();
    while asked.elapsed() < grace {
        std::thread::sleep(Duration::from_millis(50));
    }
    let sig = REQUESTED.load(Ordering::SeqCst);
    warn_user!(
        "preempted (signal {sig}) {:.1} s ago and not stopped within the grace period \
         (IVME_PREEMPT_GRACE): exiting now; the checkpoints already committed are intact",
        grace.as_secs_f64()
    );
    std::process::exit(128 + sig);
}

/// Lets signals ask for a stop from now on (training has begun).
pub(crate) fn arm() {
    ARMED.store(true, Ordering::SeqCst);
}

/// Gives the signals their default effect again (the run has stopped for a preemption).
pub(crate) fn disarm() {
    ARMED.store(false, Ordering::SeqCst);
}

/// Whether a signal asked this process to stop.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst) != 0
}

/// Asks this process to stop as a preemption signal would (for tests and for programs that
/// learn of a preemption another way, e.g. a cloud's metadata endpoint).
pub fn request_stop() {
    let _ = REQUESTED.compare_exchange(0, libc::SIGUSR1, Ordering::SeqCst, Ordering::SeqCst);
}

pub use crate::setup::status::STATUS_DIR_VAR;

/// The status file in which a rank tells `ivme launch` it stopped for a preemption.
pub const MARKER_PREFIX: &str = "preempted-";

/// Notes for `ivme launch` that this rank stopped for a preemption after `step`, having saved
/// `checkpoint` (or nothing). Nothing is written outside `ivme launch`.
pub(crate) fn note_stopped(rank: usize, step: u64, checkpoint: Option<&Path>) {
    if let Some(dir) = std::env::var_os(STATUS_DIR_VAR).filter(|d| !d.is_empty()) {
        let saved = checkpoint.map_or(String::new(), |p| p.display().to_string());
        let file = Path::new(&dir).join(format!("{MARKER_PREFIX}{rank}"));
        // Best effort: the error itself still reaches the program.
        let _ = std::fs::write(file, format!("{step}\n{saved}\n"));
    }
}

/// An Accelerator's part in a preemption.
#[derive(Debug, Default)]
pub(crate) struct Preemption {
    /// Whether the ranks agreed at a gradient sync that the run stops after this step.
    pub(crate) agreed: bool,
    /// How the run stopped, once it did (every later call repeats the error).
    pub(crate) stopped: Option<Stopped>,
}

/// How a preempted run stopped.
#[derive(Debug, Clone)]
pub(crate) struct Stopped {
    /// The optimizer steps taken.
    pub(crate) step: u64,
    /// The checkpoint written at that step, if any.
    pub(crate) checkpoint: Option<std::path::PathBuf>,
}

impl Stopped {
    /// The error that ends the loop.
    pub(crate) fn error(&self) -> Error {
        Error::Preempted {
            step: self.step,
            checkpoint: self.checkpoint.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn signal_lists_read_names_and_refuse_others() {
        assert_eq!(
            parse_signals("TERM,USR1").unwrap(),
            [libc::SIGTERM, libc::SIGUSR1]
        );
        assert_eq!(
            parse_signals("sigusr2 hup").unwrap(),
            [libc::SIGUSR2, libc::SIGHUP]
        );
        assert!(parse_signals("none").unwrap().is_empty());
        let e = parse_signals("TERM,KILL").unwrap_err().to_string();
        assert!(
            e.contains("IVME_PREEMPT_SIGNALS") && e.contains("none"),
            "{e}"
        );
    }

    #[test]
    fn settings_default_and_take_the_relay_under_the_launcher() {
        let s = PreemptSettings::read(from(&[])).unwrap();
        assert_eq!(s.signals, [libc::SIGTERM, libc::SIGUSR1]);
        assert_eq!(s.grace, DEFAULT_GRACE);
        let s = PreemptSettings::read(from(&[
            ("IVME_PREEMPT_SIGNALS", "TERM"),
            ("IVME_LAUNCHER", "ivme"),
            ("IVME_PREEMPT_GRACE", "90s"),
        ]))
        .unwrap();
        assert_eq!(s.signals, [libc::SIGTERM, libc::SIGUSR1]);
        assert_eq!(s.grace, Duration::from_secs(90));
        let s = PreemptSettings::read(from(&[
            ("IVME_PREEMPT_SIGNALS", "none"),
            ("IVME_LAUNCHER", "ivme"),
        ]))
        .unwrap();
        assert!(s.signals.is_empty());
        let e = PreemptSettings::read(from(&[("IVME_PREEMPT_GRACE", "soon")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("IVME_PREEMPT_GRACE"), "{e}");
        assert_eq!(requeue_exit_code(from(&[])).unwrap(), 75);
        assert_eq!(
            requeue_exit_code(from(&[("IVME_REQUEUE_EXIT_CODE", "3")])).unwrap(),
            3
        );
        assert!(requeue_exit_code(from(&[("IVME_REQUEUE_EXIT_CODE", "0")])).is_err());
    }
}
