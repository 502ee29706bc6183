//! Which machine a multi-machine job lost: mpirun's messages are passed on to the user line by
//! line as they come, and the machines they say mpirun lost its connection to are noted, so
//! the launcher can end by naming the machine and its ranks instead of only "mpirun failed".
//! Status files that ranks on other machines relay on their stderr (`rank.rs`) are written into
//! the launcher's status folder rather than shown.

use crate::hosts::Hosts;
use crate::rank;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Passes a child's stderr on to ours and notes the machines it says were lost.
pub struct LostMachines {
    found: Arc<Mutex<Vec<String>>>,
    done: Receiver<()>,
}

impl LostMachines {
    /// Starts copying `stderr` (mpirun's) to this process's stderr, line by line; the status
    /// files that ranks on other machines relay there are written into `status_dir` instead.
    pub fn watch(stderr: impl Read + Send + 'static, status_dir: Option<PathBuf>) -> LostMachines {
        let found = Arc::new(Mutex::new(Vec::new()));
        let noted = found.clone();
        let (finished, done) = channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stderr);
            let mut line = Vec::new();
            while matches!(lines.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                let text = String::from_utf8_lossy(&line);
                if status_dir
                    .as_deref()
                    .is_some_and(|d| rank::receive(&text, d))
                {
                    line.clear();
                    continue;
                }
                let _ = std::io::stderr().write_all(&line);
                if let Some(host) = lost_machine(&text) {
                    let mut noted = noted.lock().unwrap_or_else(|e| e.into_inner());
                    if !noted.contains(&host) {
                        noted.push(host);
                    }
                }
                line.clear();
            }
            let _ = finished.send(());
        });
        LostMachines { found, done }
    }

    /// Waits for the child's stderr to end and returns the machines it said were lost, in the
    /// order it first named them. A process the child left behind (an ssh to a machine whose
    /// link is down) may hold the stream open: after 2 s the rest is left to the copying thread.
    pub fn finish(self) -> Vec<String> {
        let _ = self.done.recv_timeout(Duration::from_secs(2));
        let found = self.found.lock().unwrap_or_else(|e| e.into_inner());
        found.clone()
    }
}

/// The machine a line of mpirun's (or ssh's) output says was lost, if it says so: ssh's
/// `Connection to HOST closed by remote host.`, Open MPI's TCP transport's `Peer host: HOST`
/// and its runtime's `Remote daemon: [[..]] on node HOST`.
pub fn lost_machine(line: &str) -> Option<String> {
    let line = line.trim();
    let host = if let Some(rest) = line.strip_prefix("Connection to ") {
        rest.strip_suffix(" closed by remote host.")?
    } else if let Some(rest) = line.strip_prefix("Peer host:") {
        rest
    } else if let Some(rest) = line.strip_prefix("Remote daemon:") {
        rest.rsplit_once(" on node ")?.1
    } else {
        return None;
    };
    let host = host.trim();
    (!host.is_empty() && !host.contains(char::is_whitespace)).then(|| host.to_string())
}

/// What to say about the machines a job lost: each with the ranks it ran (Open MPI places
/// ranks on the machines in order, filling each machine's slots).
pub fn describe(lost: &[String], hosts: &Hosts, num_processes: usize) -> Option<String> {
    if lost.is_empty() {
        return None;
    }
    let mut first = 0;
    let ranks: Vec<(&str, Vec<usize>)> = hosts
        .machines
        .iter()
        .map(|m| {
            let ranks = (first..(first + m.slots).min(num_processes)).collect();
            first += m.slots;
            (m.name.as_str(), ranks)
        })
        .collect();
    let named: Vec<String> = lost
        .iter()
        .map(|host| {
            let index = ranks.iter().position(|(name, _)| name == host);
            match index.map(|i| (i, &ranks[i].1)) {
                Some((i, r)) if !r.is_empty() => {
                    let list: Vec<String> = r.iter().map(usize::to_string).collect();
                    format!("machine {i} ({host}, ranks {})", list.join(", "))
                }
                _ => format!("machine {host}"),
            }
        })
        .collect();
    Some(format!(
        "ivme: lost {}: mpirun lost its connection to it (the machine or its network went down, \
         or every process on it was killed)",
        named.join(" and ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lost_machine_is_read_from_mpiruns_and_sshs_words() {
        for (line, host) in [
            (
                "Connection to 10.213.0.2 closed by remote host.\n",
                Some("10.213.0.2"),
            ),
            ("  Peer host:  node2\n", Some("node2")),
            (
                "  Remote daemon: [[25789,0],1] on node ivme-c1\n",
                Some("ivme-c1"),
            ),
            ("  Local host: ivme-c0\n", None),
            ("Connection to node2 refused\n", None),
            ("rank 1 of 4\n", None),
        ] {
            assert_eq!(lost_machine(line).as_deref(), host, "{line}");
        }
    }

    #[test]
    fn a_lost_machine_is_named_with_its_ranks() {
        let hosts = Hosts::parse("a slots=2\nb slots=3\n", "test").unwrap();
        let said = describe(&["b".into()], &hosts, 5).unwrap();
        assert!(said.contains("lost machine 1 (b, ranks 2, 3, 4)"), "{said}");
        let said = describe(&["c".into(), "a".into()], &hosts, 5).unwrap();
        assert!(
            said.contains("lost machine c and machine 0 (a, ranks 0, 1)"),
            "{said}"
        );
        assert_eq!(describe(&[], &hosts, 5), None);
    }

    #[test]
    fn every_line_is_passed_on_and_the_machines_noted_once() {
        let text = "x\nConnection to b closed by remote host.\n  Peer host: b\ny";
        let watch = LostMachines::watch(std::io::Cursor::new(text.as_bytes().to_vec()), None);
        assert_eq!(watch.finish(), vec!["b".to_string()]);
    }
}
