//! Before any rank starts: every other machine of a multi-machine launch answers over ssh, the
//! way mpirun will reach it, or the launch stops naming the machines that do not. Without it,
//! an unreachable machine shows as mpirun's own words after the reachable machines' ranks have
//! started, or as a long wait for TCP.

use crate::hosts::Hosts;
use ivme::{Error, Result};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a machine has to answer.
const ANSWER: Duration = Duration::from_secs(10);

/// Checks that each machine after the first (this one) that is not this machine under another
/// name answers `ssh HOST true` through mpirun's ssh agent (`OMPI_MCA_plm_rsh_agent` when set),
/// all at once; an error names every machine that did not, with ssh's reason.
pub fn check(hosts: &Hosts) -> Result<()> {
    let silent = silent(hosts);
    if silent.is_empty() {
        return Ok(());
    }
    let which = match silent.len() {
        1 => "a machine".to_string(),
        n => format!("{n} machines"),
    };
    let lines: Vec<&str> = silent.iter().map(|(_, line)| line.as_str()).collect();
    Err(Error::Usage(format!(
        "{which} of {} did not answer over ssh, so no rank was started:\n  {}\nmpirun starts \
         every other machine's ranks over ssh from this one: check the address, that sshd runs \
         there, and that it accepts this machine's key without a password",
        hosts.origin,
        lines.join("\n  ")
    )))
}

/// The machines (their index among `hosts`, and a line naming them with ssh's reason) that do
/// not answer `ssh HOST true`, asked as [`check`] asks; none where mpirun's agent is not ssh.
pub fn silent(hosts: &Hosts) -> Vec<(usize, String)> {
    let agent = agent();
    if agent.first().and_then(|p| p.rsplit('/').next()) != Some("ssh") {
        return Vec::new(); // another agent (rsh, a scheduler's): its own rules
    }
    let this = this_host();
    let remote: Vec<(usize, &str)> = hosts
        .machines
        .iter()
        .enumerate()
        .skip(1)
        .map(|(i, h)| (i, h.name.as_str()))
        .filter(|(_, name)| !is_this_machine(name, this.as_deref()))
        .collect();
    let started = Instant::now();
    let children: Vec<_> = remote
        .iter()
        .map(|&(i, host)| {
            let child = Command::new(&agent[0])
                .args(&agent[1..])
                .args([
                    "-o",
                    "BatchMode=yes",
                    "-o",
                    "ConnectTimeout=5",
                    host,
                    "true",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn();
            (i, host, child)
        })
        .collect();
    let mut silent = Vec::new();
    for (i, host, child) in children {
        let why = match child {
            Err(e) => Some(format!("{} could not be started: {e}", agent[0])),
            Ok(child) => answer(child, started),
        };
        if let Some(why) = why {
            silent.push((i, format!("machine {i} ({host}): {why}")));
        }
    }
    silent
}

/// Waits for one `ssh HOST true` until [`ANSWER`] after `started`: `None` when it succeeded,
/// else why not (ssh's last line, or the wait running out, after which it is killed).
fn answer(mut child: std::process::Child, started: Instant) -> Option<String> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return None,
            Ok(Some(status)) => {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                let last = err.lines().rev().find(|l| !l.trim().is_empty());
                return Some(match last {
                    Some(line) => line.trim().to_string(),
                    None => format!("ssh ended with {status}"),
                });
            }
            Ok(None) if started.elapsed() < ANSWER => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Some(format!("no answer within {} s", ANSWER.as_secs()));
            }
            Err(e) => return Some(format!("waiting for ssh failed: {e}")),
        }
    }
}

/// mpirun's remote agent: Open MPI's `plm_rsh_agent` setting, else plain `ssh`.
fn agent() -> Vec<String> {
    std::env::var("OMPI_MCA_plm_rsh_agent")
        .ok()
        .map(|a| a.split_whitespace().map(String::from).collect::<Vec<_>>())
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| vec!["ssh".to_string()])
}

/// This machine's host name.
fn this_host() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    Some(name.trim().to_string()).filter(|n| !n.is_empty())
}

/// Whether `name` is this machine (which mpirun runs without ssh): a loopback name or address,
/// or this machine's host name (with or without its domain).
fn is_this_machine(name: &str, this: Option<&str>) -> bool {
    let short = |n: &str| n.split('.').next().unwrap_or(n).to_string();
    name == "localhost"
        || name == "::1"
        || name.starts_with("127.")
        || this.is_some_and(|t| {
            t == name
                || (!name.starts_with(|c: char| c.is_ascii_digit()) && short(t) == short(name))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_this_hosts_name_are_this_machine() {
        for name in [
            "localhost",
            "127.0.0.1",
            "127.0.1.1",
            "::1",
            "node1",
            "node1.lab",
        ] {
            assert!(is_this_machine(name, Some("node1")), "{name}");
        }
        for name in ["node2", "10.0.0.1", "node10"] {
            assert!(!is_this_machine(name, Some("node1")), "{name}");
        }
        assert!(
            !is_this_machine("10.0.0.1", Some("10")),
            "an address is not a short name"
        );
    }
}
