//! Where each launch setting comes from: a flag, then an `IVME_*` variable already in the
//! launcher's environment (for the settings the Accelerator reads), then the config file, then
//! the default. The merged settings remember their source so `--dry_run` can show it.

use crate::flags::LaunchArgs;
use crate::settings::Settings;
use ivme::env;
use ivme::{BufferSync, Error, Precision, Result, Sharding};
use std::path::{Path, PathBuf};

/// The place one setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum From {
    /// A command-line flag.
    Flag,
    /// A variable in the launcher's environment.
    Env(&'static str),
    /// The config file at this path.
    File(PathBuf),
    /// Nothing set it.
    Default,
}

/// One setting's source, and what a weaker source said that it overrode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The setting, spelled as its flag and config key.
    pub key: &'static str,
    /// Where its value came from.
    pub from: From,
    /// The config file's value when a stronger source replaced it.
    pub overrode: Option<String>,
}

impl Origin {
    /// Says where the value came from, for `--dry_run`.
    pub fn describe(&self) -> String {
        let mut s = match &self.from {
            From::Flag => format!("flag --{}", self.key),
            From::Env(var) => format!("environment {var}"),
            From::File(p) => format!("config file {}", p.display()),
            From::Default => "default".to_string(),
        };
        if let Some(v) = &self.overrode {
            s.push_str(&format!("; the config file's {v} is overridden"));
        }
        s
    }
}

/// How a setting's value reads in `--dry_run`.
trait Show {
    fn show(&self) -> String;
}

macro_rules! show_display {
    ($($t:ty),+) => {$(
        impl Show for $t {
            fn show(&self) -> String {
                self.to_string()
            }
        }
    )+};
}
show_display!(usize, u8, u16, bool, Precision, Sharding, BufferSync, String);

impl Show for PathBuf {
    fn show(&self) -> String {
        self.display().to_string()
    }
}

impl Show for std::time::Duration {
    fn show(&self) -> String {
        format!("{}s", ivme::env::seconds_text(*self))
    }
}

impl Show for Vec<String> {
    fn show(&self) -> String {
        format!("[{}]", self.join(", "))
    }
}

/// Picks one setting by precedence and records where it came from.
fn pick<T: Clone + Show>(
    origins: &mut Vec<Origin>,
    key: &'static str,
    flag: Option<T>,
    env: Option<(&'static str, T)>,
    (path, from_file): (Option<&Path>, Option<T>),
) -> Option<T> {
    let shown = |v: &Option<T>| v.as_ref().map(Show::show);
    let (value, from, overrode) = match (flag, env, from_file) {
        (Some(v), _, f) => (Some(v), From::Flag, shown(&f)),
        (None, Some((var, v)), f) => (Some(v), From::Env(var), shown(&f)),
        (None, None, Some(v)) => (
            Some(v),
            From::File(path.unwrap_or(Path::new("")).to_path_buf()),
            None,
        ),
        (None, None, None) => (None, From::Default, None),
    };
    origins.push(Origin {
        key,
        from,
        overrode,
    });
    value
}

/// Reads one of the Accelerator's `IVME_*` variables from the launcher's environment.
fn env_value<T>(
    inherited: &[(String, String)],
    var: &'static str,
    parse: impl Fn(&str) -> Option<T>,
    valid: &str,
) -> Result<Option<T>> {
    let Some((_, raw)) = inherited
        .iter()
        .find(|(k, _)| k == var)
        .filter(|(_, v)| !v.trim().is_empty())
    else {
        return Ok(None);
    };
    parse(raw.trim()).map(Some).ok_or_else(|| {
        Error::config(
            var,
            raw,
            format!("set by the environment: use {valid}, or unset it"),
        )
    })
}

/// The settings layer of the launcher's environment: the `IVME_*` variables the Accelerator
/// reads, checked here so a bad one fails before anything starts.
fn from_env(inherited: &[(String, String)]) -> Result<Settings> {
    Ok(Settings {
        cpu: env_value(inherited, env::CPU.name, env::parse_bool, env::CPU.values)?,
        mixed_precision: env_value(
            inherited,
            env::PRECISION.name,
            |s| s.parse::<Precision>().ok(),
            &format!("one of {}", Precision::VALID.join(", ")),
        )?,
        sharding: env_value(
            inherited,
            env::SHARDING.name,
            |s| s.parse::<Sharding>().ok(),
            &format!("one of {}", Sharding::VALID.join(", ")),
        )?,
        buffers: env_value(
            inherited,
            env::BUFFERS.name,
            |s| s.parse::<BufferSync>().ok(),
            &format!("one of {}", BufferSync::VALID.join(", ")),
        )?,
        gradient_accumulation_steps: env_value(
            inherited,
            env::GRAD_ACCUM.name,
            |s| s.parse::<usize>().ok().filter(|&n| n >= 1),
            "a whole number of at least 1",
        )?,
        collective_timeout: env_value(
            inherited,
            env::COLLECTIVE_TIMEOUT.name,
            env::parse_duration,
            env::DURATION_FORMS,
        )?,
        debug_sync: env_value(
            inherited,
            env::DEBUG_SYNC.name,
            env::parse_bool,
            env::DEBUG_SYNC.values,
        )?,
        preempt_signals: env_value(
            inherited,
            env::PREEMPT_SIGNALS.name,
            |s| ivme::preempt::parse_signals(s).ok().map(|_| s.to_string()),
            env::PREEMPT_SIGNALS.values,
        )?,
        preempt_grace: env_value(
            inherited,
            env::PREEMPT_GRACE.name,
            env::parse_duration,
            env::DURATION_FORMS,
        )?,
        requeue_exit_code: env_value(
            inherited,
            env::REQUEUE_EXIT_CODE.name,
            |s| s.parse::<u8>().ok().filter(|&c| c >= 1),
            env::REQUEUE_EXIT_CODE.values,
        )?,
        ..Settings::default()
    })
}

/// The variable behind a setting of the environment layer.
fn env_name(key: &str) -> &'static str {
    match key {
        "cpu" => env::CPU.name,
        "mixed_precision" => env::PRECISION.name,
        "sharding" => env::SHARDING.name,
        "buffers" => env::BUFFERS.name,
        "gradient_accumulation_steps" => env::GRAD_ACCUM.name,
        "collective_timeout" => env::COLLECTIVE_TIMEOUT.name,
        "debug_sync" => env::DEBUG_SYNC.name,
        "preempt_signals" => env::PREEMPT_SIGNALS.name,
        "preempt_grace" => env::PREEMPT_GRACE.name,
        "requeue_exit_code" => env::REQUEUE_EXIT_CODE.name,
        _ => "",
    }
}

/// Stacks the layers (flags over the environment over the config file at `file`'s path) into
/// one set of settings, and returns it in the flags' place with each setting's origin.
pub fn merge(
    flags: LaunchArgs,
    file: Option<(&Path, &Settings)>,
    inherited: &[(String, String)],
) -> Result<(LaunchArgs, Vec<Origin>)> {
    let path = file.map(|(p, _)| p);
    let mut file = file.map(|(_, c)| c.clone()).unwrap_or_default();
    let env = from_env(inherited)?;
    // A hostfile on the command line describes the machines anew, so the file's machine list
    // (and its count) would only contradict it.
    if flags.settings.hostfile.is_some() {
        (file.num_machines, file.hosts, file.hostfile) = (None, None, None);
    }
    let (mut o, f) = (Vec::new(), flags.settings);
    macro_rules! layered {
        ($($key:ident),+ $(,)?) => {
            Settings {$(
                $key: pick(
                    &mut o,
                    stringify!($key),
                    f.$key,
                    env.$key.map(|v| (env_name(stringify!($key)), v)),
                    (path, file.$key),
                ),
            )+}
        };
    }
    // In the order `--dry_run` lists them.
    let settings = layered!(
        num_processes,
        cpu,
        mixed_precision,
        sharding,
        buffers,
        gradient_accumulation_steps,
        num_machines,
        machine_rank,
        main_process_ip,
        main_process_port,
        hostfile,
        hosts,
        max_restarts,
        collective_timeout,
        debug_sync,
        preempt_signals,
        preempt_grace,
        requeue_exit_code,
        backend,
    );
    Ok((LaunchArgs { settings, ..flags }, o))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn origin<'a>(o: &'a [Origin], key: &str) -> &'a Origin {
        o.iter().find(|x| x.key == key).unwrap()
    }

    #[test]
    fn flags_beat_the_environment_which_beats_the_file() {
        let file = Settings {
            num_processes: Some(4),
            mixed_precision: Some(Precision::Fp16),
            gradient_accumulation_steps: Some(3),
            cpu: Some(true),
            ..Settings::default()
        };
        let flags = LaunchArgs {
            settings: Settings {
                num_processes: Some(2),
                ..Settings::default()
            },
            ..LaunchArgs::default()
        };
        let p = Path::new("/cfg.toml");
        let (a, o) = merge(flags, Some((p, &file)), &env(&[("IVME_PRECISION", "bf16")])).unwrap();
        assert_eq!(a.settings.num_processes, Some(2));
        assert_eq!(a.settings.mixed_precision, Some(Precision::Bf16));
        assert_eq!(a.settings.gradient_accumulation_steps, Some(3));
        assert_eq!(
            origin(&o, "num_processes").describe(),
            "flag --num_processes; the config file's 4 is overridden"
        );
        assert_eq!(
            origin(&o, "mixed_precision").from,
            From::Env("IVME_PRECISION")
        );
        assert_eq!(
            origin(&o, "gradient_accumulation_steps").describe(),
            "config file /cfg.toml"
        );
        assert_eq!(origin(&o, "main_process_port").from, From::Default);
    }

    #[test]
    fn preemption_settings_come_from_flags_or_the_environment_and_bad_ones_stop_the_launch() {
        let flags = LaunchArgs {
            settings: Settings {
                requeue_exit_code: Some(9),
                ..Settings::default()
            },
            ..LaunchArgs::default()
        };
        let inherited = env(&[
            ("IVME_PREEMPT_SIGNALS", "USR2"),
            ("IVME_REQUEUE_EXIT_CODE", "3"),
        ]);
        let (a, o) = merge(flags, None, &inherited).unwrap();
        assert_eq!(a.settings.preempt_signals.as_deref(), Some("USR2"));
        assert_eq!(a.settings.requeue_exit_code, Some(9));
        assert_eq!(
            origin(&o, "preempt_signals").from,
            From::Env("IVME_PREEMPT_SIGNALS")
        );
        assert_eq!(origin(&o, "requeue_exit_code").from, From::Flag);
        let e = merge(
            LaunchArgs::default(),
            None,
            &env(&[("IVME_PREEMPT_SIGNALS", "STOP")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("IVME_PREEMPT_SIGNALS"), "{e}");
    }

    #[test]
    fn fault_settings_come_from_flags_the_environment_or_the_file() {
        let file = Settings {
            max_restarts: Some(2),
            ..Settings::default()
        };
        let flags = LaunchArgs {
            settings: Settings {
                debug_sync: Some(false),
                ..Settings::default()
            },
            ..LaunchArgs::default()
        };
        let inherited = env(&[("IVME_COLLECTIVE_TIMEOUT", "2m"), ("IVME_DEBUG_SYNC", "1")]);
        let p = Path::new("/cfg.toml");
        let (a, o) = merge(flags, Some((p, &file)), &inherited).unwrap();
        assert_eq!(a.settings.max_restarts, Some(2));
        assert_eq!(
            origin(&o, "max_restarts").describe(),
            "config file /cfg.toml"
        );
        assert_eq!(
            a.settings.collective_timeout,
            Some(std::time::Duration::from_secs(120))
        );
        assert_eq!(
            origin(&o, "collective_timeout").from,
            From::Env("IVME_COLLECTIVE_TIMEOUT")
        );
        assert_eq!(a.settings.debug_sync, Some(false));
        assert_eq!(origin(&o, "debug_sync").from, From::Flag);
        let e = merge(
            LaunchArgs::default(),
            None,
            &env(&[("IVME_COLLECTIVE_TIMEOUT", "soon")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("IVME_COLLECTIVE_TIMEOUT") && e.contains("10m"),
            "{e}"
        );
    }

    #[test]
    fn a_bad_environment_value_is_named() {
        let e = merge(
            LaunchArgs::default(),
            None,
            &env(&[("IVME_GRAD_ACCUM", "0")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("IVME_GRAD_ACCUM") && e.contains("at least 1"),
            "{e}"
        );
    }

    #[test]
    fn a_hostfile_flag_replaces_the_files_machines() {
        let file = Settings {
            num_machines: Some(3),
            hosts: Some(vec!["a".into(), "b".into(), "c".into()]),
            ..Settings::default()
        };
        let flags = LaunchArgs {
            settings: Settings {
                hostfile: Some("h".into()),
                ..Settings::default()
            },
            ..LaunchArgs::default()
        };
        let (a, _) = merge(flags, Some((Path::new("c"), &file)), &[]).unwrap();
        assert_eq!((a.settings.num_machines, a.settings.hosts), (None, None));
    }
}
