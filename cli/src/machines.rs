//! How many machines a launch spans and which ranks each runs.
//!
//! With MPI one launcher starts every rank: `ivme launch` on machine 0 runs mpirun, which
//! starts the other machines' ranks over ssh. So the machines are listed up front (a hostfile,
//! or the config's `hosts` with `num_machines`), and on any other machine `ivme launch` only
//! says where to run it instead. `main_process_ip` must then be the first machine, where rank 0
//! lands; it and `main_process_port` reach the ranks as `IVME_MAIN_PROCESS_*` for backends that
//! rendezvous themselves (mpirun picks its own ports).

use crate::hosts::Hosts;
use crate::settings::Settings;
use ivme::{Error, Result};

/// The machine layout of a launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machines {
    /// Ranks in all.
    pub num_processes: usize,
    /// The machines when more than this one is listed.
    pub hosts: Option<Hosts>,
    /// Machines in the run.
    pub num_machines: usize,
    /// This machine's rank.
    pub machine_rank: usize,
}

/// Works out the machines from the merged settings and checks they agree.
pub fn resolve(a: &Settings) -> Result<Machines> {
    let hosts = match &a.hostfile {
        Some(path) => {
            let h = Hosts::read(path)?;
            if let Some(m) = a.num_machines.filter(|&m| m != h.machines.len()) {
                return Err(Error::Usage(format!(
                    "num_machines is {m} but {} lists {} machines; drop `--num_machines` (the \
                     hostfile decides) or fix the hostfile",
                    h.origin,
                    h.machines.len()
                )));
            }
            Some(h)
        }
        None => {
            let m = a
                .num_machines
                .or(a.hosts.as_ref().map(Vec::len))
                .unwrap_or(1);
            if m > 1 {
                let Some(list) = &a.hosts else {
                    return Err(Error::Usage(format!(
                        "{m} machines need their addresses: give `--hostfile FILE` (one \
                         `host slots=N` per line), or list them as `hosts = [\"main\", \"node2\"]` \
                         in the config file (`ivme config` asks for them)"
                    )));
                };
                if list.len() != m {
                    return Err(Error::Usage(format!(
                        "num_machines is {m} but the config's `hosts` lists {} machines; make \
                         them agree",
                        list.len()
                    )));
                }
                Some(Hosts::from_list(list, a.num_processes.unwrap_or(m))?)
            } else {
                None
            }
        }
    };
    let num_machines = hosts.as_ref().map_or(1, |h| h.machines.len());
    let machine_rank = a.machine_rank.unwrap_or(0);
    if machine_rank >= num_machines {
        return Err(Error::Usage(format!(
            "machine_rank {machine_rank} does not exist in a run of {num_machines} machine(s); \
             machine ranks go from 0 to {}",
            num_machines - 1
        )));
    }
    let num_processes = match (a.num_processes, &hosts) {
        (Some(n), Some(h)) if n > h.slots() => {
            return Err(Error::Usage(format!(
                "{n} processes do not fit the {} slots of {}; give machines more slots \
                 (`host slots=N`) or lower `--num_processes`",
                h.slots(),
                h.origin
            )))
        }
        (Some(n), _) => n,
        (None, Some(h)) => h.slots(),
        (None, None) => 1,
    };
    if let (Some(ip), Some(h)) = (&a.main_process_ip, &hosts) {
        let first = &h.machines[0].name;
        if first != ip {
            return Err(Error::Usage(format!(
                "main_process_ip is {ip} but the first machine of {} is {first}; rank 0 runs on \
                 the first machine, so list {ip} first or drop main_process_ip",
                h.origin
            )));
        }
    }
    Ok(Machines {
        num_processes,
        hosts,
        num_machines,
        machine_rank,
    })
}
