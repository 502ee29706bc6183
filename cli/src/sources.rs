//! Where each launch setting comes from: a flag, then an `IVME_*` variable already in the
//! launcher's environment (for the settings the Accelerator reads), then the config file, then
//! the default. The merged settings remember their source so `--dry_run` can show it.

use crate::row::Layers;
pub use crate::row::{From, Origin};
use crate::settings::Settings;
use crate::table::ROWS;
use ivme::Result;
use std::path::Path;

/// The settings layer of the launcher's environment: the `IVME_*` variables the Accelerator
/// reads, checked here so a bad one fails before anything starts.
fn from_env(inherited: &[(String, String)]) -> Result<Settings> {
    let mut s = Settings::default();
    for row in ROWS {
        row.read_env(inherited, &mut s)?;
    }
    Ok(s)
}

/// Stacks the layers (the flags' settings over the environment over the config file at
/// `file`'s path) into one set of settings, with each setting's origin in the table's order.
pub fn merge(
    flags: &Settings,
    file: Option<(&Path, &Settings)>,
    inherited: &[(String, String)],
) -> Result<(Settings, Vec<Origin>)> {
    let path = file.map(|(p, _)| p);
    let mut file = file.map(|(_, c)| c.clone()).unwrap_or_default();
    let env = from_env(inherited)?;
    // A hostfile on the command line describes the machines anew, so the file's machine list
    // (and its count) would only contradict it.
    if flags.hostfile.is_some() {
        (file.num_machines, file.hosts, file.hostfile) = (None, None, None);
    }
    let layers = Layers {
        flags,
        env: &env,
        file: (path, &file),
    };
    let mut settings = Settings::default();
    let origins = ROWS
        .iter()
        .map(|row| row.pick(&layers, &mut settings))
        .collect();
    Ok((settings, origins))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ivme::Precision;

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
        let flags = Settings {
            num_processes: Some(2),
            ..Settings::default()
        };
        let p = Path::new("/cfg.toml");
        let (a, o) = merge(
            &flags,
            Some((p, &file)),
            &env(&[("IVME_PRECISION", "bf16")]),
        )
        .unwrap();
        assert_eq!(a.num_processes, Some(2));
        assert_eq!(a.mixed_precision, Some(Precision::Bf16));
        assert_eq!(a.gradient_accumulation_steps, Some(3));
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
        let flags = Settings {
            requeue_exit_code: Some(9),
            ..Settings::default()
        };
        let inherited = env(&[
            ("IVME_PREEMPT_SIGNALS", "USR2"),
            ("IVME_REQUEUE_EXIT_CODE", "3"),
        ]);
        let (a, o) = merge(&flags, None, &inherited).unwrap();
        assert_eq!(a.preempt_signals.as_deref(), Some("USR2"));
        assert_eq!(a.requeue_exit_code, Some(9));
        assert_eq!(
            origin(&o, "preempt_signals").from,
            From::Env("IVME_PREEMPT_SIGNALS")
        );
        assert_eq!(origin(&o, "requeue_exit_code").from, From::Flag);
        let e = merge(
            &Settings::default(),
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
        let flags = Settings {
            debug_sync: Some(false),
            ..Settings::default()
        };
        let inherited = env(&[("IVME_COLLECTIVE_TIMEOUT", "2m"), ("IVME_DEBUG_SYNC", "1")]);
        let p = Path::new("/cfg.toml");
        let (a, o) = merge(&flags, Some((p, &file)), &inherited).unwrap();
        assert_eq!(a.max_restarts, Some(2));
        assert_eq!(
            origin(&o, "max_restarts").describe(),
            "config file /cfg.toml"
        );
        assert_eq!(
            a.collective_timeout,
            Some(std::time::Duration::from_secs(120))
        );
        assert_eq!(
            origin(&o, "collective_timeout").from,
            From::Env("IVME_COLLECTIVE_TIMEOUT")
        );
        assert_eq!(a.debug_sync, Some(false));
        assert_eq!(origin(&o, "debug_sync").from, From::Flag);
        let e = merge(
            &Settings::default(),
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
            &Settings::default(),
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
        let flags = Settings {
            hostfile: Some("h".into()),
            ..Settings::default()
        };
        let (a, _) = merge(&flags, Some((Path::new("c"), &file)), &[]).unwrap();
        assert_eq!((a.num_machines, a.hosts), (None, None));
    }
}
