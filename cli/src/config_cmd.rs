//! `ivme config`: the questionnaire that writes the config file, `ivme config default`, which
//! writes a sane one without asking, and `ivme config show`, which prints the one in use.

use crate::cli::{self, Checked};
use crate::hosts::Hosts;
use crate::prompt::{Lines, Prompter, Terminal};
use crate::settings::{Location, Settings, BACKENDS};
use crate::values;
use clap::Parser;
use ivme::{Error, Precision, Result};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// The subcommand's name.
pub const COMMAND: &str = "config";

/// Write or show the settings `ivme launch` reads, so that `ivme launch PROGRAM` needs no flags.
#[derive(Parser, Debug)]
#[command(rename_all = "snake_case", override_usage = usage())]
struct Flags {
    /// the file to write or show (default: $IVME_CONFIG, else ~/.config/ivme/default_config.toml)
    #[arg(long, value_name = "file", value_parser = Checked::new(values::text))]
    config_file: Option<String>,
    /// `config default` only: replace an existing file
    #[arg(long, value_name = cli::SWITCH)]
    force: Option<bool>,
    /// Words after the flags, which `ivme config` does not take.
    #[arg(hide = true)]
    extra: Vec<String>,
}

fn usage() -> String {
    format!(
        "\n  ivme config [--config_file FILE]           answer a few questions (piped answers work too)\n  \
         ivme config default [--config_file FILE]   write one process, {}, no mixed precision\n  \
         ivme config show [--config_file FILE]      print the file in use and its path",
        if cfg!(feature = "cuda") { "GPU" } else { "CPU" },
    )
}

/// Runs `ivme config` and returns the exit code.
pub fn main(words: &[String]) -> Result<i32> {
    let (sub, rest) = match words.first().map(String::as_str) {
        Some(s @ ("default" | "show")) => (s, &words[1..]),
        _ => ("ask", words),
    };
    let Some(flags) = cli::read::<Flags>(COMMAND, rest)? else {
        return Ok(0);
    };
    if let Some(extra) = flags.extra.first() {
        let hint = cli::closest(extra, ["default", "show"].into_iter())
            .map(|c| format!("did you mean `ivme config {c}`? "))
            .unwrap_or_default();
        return Err(Error::Usage(format!(
            "`ivme config` does not take `{extra}`; {hint}use `ivme config`, `ivme config default` \
             or `ivme config show`"
        )));
    }
    let force = flags.force.unwrap_or(false);
    if force && sub != "default" {
        return Err(Error::Usage(
            "`--force` belongs to `ivme config default`".into(),
        ));
    }
    let location = Location::find(flags.config_file.as_deref().map(Path::new), |k| {
        std::env::var(k).ok()
    })?;
    match sub {
        "default" => write_default(&location, force),
        "show" => show(&location),
        _ => ask(&location),
    }
}

fn write_default(location: &Location, force: bool) -> Result<i32> {
    if location.path.exists() && !force {
        return Err(Error::Usage(format!(
            "{} already exists; pass `--force` to replace it, or change it with `ivme config`",
            location.path.display()
        )));
    }
    Settings::sane_default().write(&location.path)?;
    println!(
        "ivme: wrote a default config to {}",
        location.path.display()
    );
    Ok(0)
}

fn show(location: &Location) -> Result<i32> {
    let Some(config) = location.load()? else {
        return Err(Error::Usage(format!(
            "there is no config file at {} ({}); create one with `ivme config` or `ivme config default`",
            location.path.display(),
            location.chosen_by
        )));
    };
    println!(
        "# ivme config: {} (from {})",
        location.path.display(),
        location.chosen_by
    );
    print!("{}", config.to_toml());
    let unset: Vec<&str> = [
        ("num_processes = 1", config.num_processes.is_none()),
        ("cpu = false", config.cpu.is_none()),
        (
            "gradient_accumulation_steps = 1",
            config.gradient_accumulation_steps.is_none(),
        ),
        ("mixed_precision = \"no\"", config.mixed_precision.is_none()),
    ]
    .into_iter()
    .filter_map(|(line, missing)| missing.then_some(line))
    .collect();
    if !unset.is_empty() {
        println!("\n# Not set in the file, so ivme launch's defaults apply:");
        for line in unset {
            println!("# {line}");
        }
    }
    Ok(0)
}

fn ask(location: &Location) -> Result<i32> {
    let interactive = std::io::stdin().is_terminal() && std::io::stdout().is_terminal();
    let config = if interactive {
        questionnaire(&mut Terminal::new())?
    } else {
        let stdin = std::io::stdin();
        let echo = !stdin.is_terminal();
        questionnaire(&mut Lines::new(stdin.lock(), std::io::stdout(), echo))?
    };
    let replaced = location.path.exists();
    config.write(&location.path)?;
    println!(
        "ivme: {} {}; check it with `ivme config show`, and `ivme launch PROGRAM` now uses it",
        if replaced { "replaced" } else { "wrote" },
        location.path.display()
    );
    Ok(0)
}

fn whole(a: &str, min: usize, max: usize) -> std::result::Result<usize, String> {
    match a.parse::<usize>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ if max == usize::MAX => Err(format!("`{a}` is not a whole number of at least {min}")),
        _ => Err(format!("`{a}` is not a whole number from {min} to {max}")),
    }
}

fn address(a: &str) -> std::result::Result<(), String> {
    if a.is_empty() || a.contains(char::is_whitespace) || a.contains(',') {
        Err(format!(
            "`{a}` is not a machine address; give a name or IP such as 10.0.0.1"
        ))
    } else {
        Ok(())
    }
}

fn split_list(a: &str) -> Vec<String> {
    a.split([',', ' '])
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// Asks the questions and returns the config they describe.
pub fn questionnaire(p: &mut dyn Prompter) -> Result<Settings> {
    let mut c = Settings {
        backend: Some(BACKENDS[0].to_string()),
        ..Settings::default()
    };
    let several = p.select(
        "Where will you train?",
        &[
            "this machine",
            "several machines (MPI starts them all from machine 0)",
        ],
        0,
    )? == 1;
    let mut default_processes = 1;
    let mut limit: Box<dyn Fn(usize) -> std::result::Result<(), String>> = Box::new(|_| Ok(()));
    if several {
        let hostfile = p.text(
            "MPI hostfile listing the machines (`host slots=N` per line); leave empty to type their addresses",
            Some(""),
            &|a| if a.is_empty() { Ok(()) } else { Hosts::read(Path::new(a)).map(|_| ()).map_err(|e| e.to_string()) },
        )?;
        if !hostfile.is_empty() {
            let path = std::path::absolute(&hostfile).unwrap_or_else(|_| PathBuf::from(&hostfile));
            let hosts = Hosts::read(&path)?;
            c.num_machines = Some(hosts.machines.len());
            default_processes = hosts.slots();
            let slots = hosts.slots();
            limit = Box::new(move |n| {
                (n <= slots).then_some(()).ok_or(format!(
                    "the hostfile has {slots} slots; use at most {slots}"
                ))
            });
            c.hostfile = Some(path);
        } else {
            let m = whole(
                &p.text("How many machines?", Some("2"), &|a| {
                    whole(a, 2, usize::MAX).map(|_| ())
                })?,
                2,
                usize::MAX,
            )
            .map_err(Error::Usage)?;
            let rank = p.text(
                "This machine's rank (0 is the main machine, the one that starts everything)",
                Some("0"),
                &|a| whole(a, 0, m - 1).map(|_| ()),
            )?;
            let ip = p.text("Address of the main machine (rank 0)", None, &address)?;
            let port = p.text("Rendezvous port on the main machine", Some("29500"), &|a| {
                whole(a, 1, 65535).map(|_| ())
            })?;
            let others = p.text(
                &format!(
                    "Addresses of the other {} machine(s), separated by spaces or commas",
                    m - 1
                ),
                None,
                &|a| {
                    let list = split_list(a);
                    if list.len() != m - 1 {
                        return Err(format!(
                            "{} address(es) given; give exactly {}",
                            list.len(),
                            m - 1
                        ));
                    }
                    list.iter().try_for_each(|w| address(w))
                },
            )?;
            let mut hosts = vec![ip.clone()];
            hosts.extend(split_list(&others));
            c.num_machines = Some(m);
            c.machine_rank = Some(rank.parse().unwrap_or(0));
            c.main_process_ip = Some(ip);
            c.main_process_port = port.parse().ok();
            c.hosts = Some(hosts);
            default_processes = m;
            limit = Box::new(move |n| {
                (n.checked_rem(m) == Some(0)).then_some(()).ok_or(format!(
                    "{n} cannot be shared evenly by {m} machines; use a multiple of {m}"
                ))
            });
        }
    } else {
        c.num_machines = Some(1);
    }
    let question = if several {
        "How many processes in total, over all machines?"
    } else {
        "How many processes?"
    };
    let n = p.text(question, Some(&default_processes.to_string()), &|a| {
        whole(a, 1, usize::MAX).and_then(&limit)
    })?;
    c.num_processes = n.parse().ok();
    c.cpu = Some(p.confirm(
        "Train on the CPU only, even where a GPU is present?",
        !cfg!(feature = "cuda"),
    )?);
    let i = p.select("Mixed precision?", Precision::VALID, 0)?;
    c.mixed_precision = Some(Precision::VALID[i].parse()?);
    let k = p.text(
        "Gradient accumulation steps (micro-batches per optimizer step)?",
        Some("1"),
        &|a| whole(a, 1, usize::MAX).map(|_| ()),
    )?;
    c.gradient_accumulation_steps = k.parse().ok();
    if c.num_processes.unwrap_or(1) > 1 {
        let stages = ["no", "optimizer", "gradients", "parameters"];
        let i = p.select(
            "Shard across the processes (ZeRO: optimizer = stage 1, gradients = stage 2, \
             parameters = stage 3)?",
            &stages,
            0,
        )?;
        c.sharding = Some(stages[i].parse()?);
    }
    if BACKENDS.len() > 1 {
        let i = p.select("Backend?", BACKENDS, 0)?;
        c.backend = Some(BACKENDS[i].to_string());
    } else {
        p.say(&format!(
            "Backend: {} (the only one this build launches)",
            BACKENDS[0]
        ));
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(answers: &str) -> (Result<Settings>, String) {
        let mut p = Lines::new(answers.as_bytes(), Vec::new(), false);
        let c = questionnaire(&mut p);
        (c, String::new())
    }

    #[test]
    fn one_machine_answers_make_a_config() {
        let (c, _) = run("1\n4\nno\nbf16\n2\ngradients\n");
        let c = c.unwrap();
        assert_eq!(c.sharding, Some(ivme::Sharding::Gradients));
        assert_eq!(c.num_machines, Some(1));
        assert_eq!(c.num_processes, Some(4));
        assert_eq!(c.cpu, Some(false));
        assert_eq!(c.mixed_precision, Some(Precision::Bf16));
        assert_eq!(c.gradient_accumulation_steps, Some(2));
        assert_eq!(c.backend.as_deref(), Some("mpi"));
    }

    #[test]
    fn several_machines_by_address() {
        let (c, _) = run("several\n\n2\n1\n10.0.0.1\n\n10.0.0.2\n3\n4\nyes\n\n\n\n");
        let c = c.unwrap();
        assert_eq!(
            c.hosts,
            Some(vec!["10.0.0.1".to_string(), "10.0.0.2".to_string()])
        );
        assert_eq!(
            (c.machine_rank, c.main_process_port),
            (Some(1), Some(29500))
        );
        // 3 processes cannot be split over 2 machines, so the next answer (4) is taken.
        assert_eq!(c.num_processes, Some(4));
    }
}
