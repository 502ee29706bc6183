//! Who this process is: rank, world size, local rank and device, read from the launcher's
//! environment (`ivme launch`, Open MPI, MPICH, PMIx, SLURM's `srun`, or a plain `cargo run`).

use crate::error::{Error, Result};
use crate::setup::env;
use candle_core::Device;

/// This process's place in the distributed run.
#[derive(Debug, Clone)]
pub struct ProcessState {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the run.
    pub world_size: usize,
    /// Rank among the processes on this machine.
    pub local_rank: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// Where this process computes.
    pub device: Device,
}

impl ProcessState {
    /// Whether this is global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }

    /// Whether this is rank 0 on its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }
}

/// The rank layout a launcher announced through environment variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvLayout {
    /// Global rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank on this machine.
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
}

// Each launcher spells the same facts differently; the first family present wins.
const FAMILIES: &[[&str; 4]] = crate::setup::env::RANK_FAMILIES;

impl EnvLayout {
    /// Reads the layout from the environment; `None` means no launcher started this process.
    pub fn from_env() -> Result<Option<EnvLayout>> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the layout through `get`, so tests need not touch the process environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<EnvLayout>> {
        let num = |key: &str| -> Result<Option<usize>> {
            match get(key) {
                None => Ok(None),
                Some(raw) => raw.trim().parse::<usize>().map(Some).map_err(|_| {
                    Error::Setup(format!(
                        "{key}={raw:?} is not a whole number; start the program with `ivme launch` or mpirun"
                    ))
                }),
            }
        };
        for [rank, size, local_rank, local_size] in FAMILIES {
            let (Some(r), Some(w)) = (num(rank)?, num(size)?) else {
                continue;
            };
            if w == 0 || r >= w {
                return Err(Error::Setup(format!(
                    "{rank}={r} with {size}={w} is not a valid layout; start the program with `ivme launch`"
                )));
            }
            let lr = num(local_rank)?.unwrap_or(r);
            let lw = num(local_size)?.unwrap_or(w);
            return Ok(Some(EnvLayout {
                rank: r,
                world_size: w,
                local_rank: lr,
                local_world_size: lw,
            }));
        }
        slurm(&get, num)
    }
}

/// SLURM's `srun` tasks, when no MPI family above spoke (`srun --mpi=pmix` exports PMIx's rank
/// but not its size): the task's rank (`SLURM_PROCID`), the step's task count
/// (`SLURM_STEP_NUM_TASKS`, which a batch script's own environment lacks, so a program run
/// directly there stays one process), the rank on this node (`SLURM_LOCALID`) and this node's
/// task count (its entry of `SLURM_STEP_TASKS_PER_NODE`, `2(x3),1` style, at `SLURM_NODEID`).
fn slurm(
    get: &impl Fn(&str) -> Option<String>,
    num: impl Fn(&str) -> Result<Option<usize>>,
) -> Result<Option<EnvLayout>> {
    let (Some(rank), Some(world)) = (num(env::SLURM_PROCID)?, num(env::SLURM_STEP_NUM_TASKS)?)
    else {
        return Ok(None);
    };
    if world == 0 || rank >= world {
        return Err(Error::Setup(format!(
            "{}={rank} with {}={world} is not a valid layout",
            env::SLURM_PROCID,
            env::SLURM_STEP_NUM_TASKS
        )));
    }
    let local_rank = num(env::SLURM_LOCALID)?.unwrap_or(rank);
    let node = num(env::SLURM_NODEID)?.unwrap_or(0);
    let local_world = match get(env::SLURM_STEP_TASKS_PER_NODE) {
        Some(raw) => tasks_on_node(&raw, node).ok_or_else(|| {
            Error::Setup(format!(
                "{}={raw:?} has no entry for node {node} ({}); expected counts like `2(x3),1`",
                env::SLURM_STEP_TASKS_PER_NODE,
                env::SLURM_NODEID
            ))
        })?,
        None => world,
    };
    Ok(Some(EnvLayout {
        rank,
        world_size: world,
        local_rank,
        local_world_size: local_world,
    }))
}

/// The task count of node `node` in SLURM's compressed list: `2(x3),1` is 2, 2, 2, 1.
fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut seen = 0;
    for part in list.split(',') {
        let part = part.trim();
        let (count, times) = match part.split_once("(x") {
            Some((c, rest)) => (c, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part, 1),
        };
        let count: usize = count.parse().ok()?;
        if node < seen + times {
            return Some(count);
        }
        seen += times;
    }
    None
}

/// Picks the device for a local rank: that rank's CUDA device when the build has CUDA and one is
/// present (`cuda:(local_rank mod GPUs)`, so more ranks than GPUs share them), else the Metal device when the build has Metal and one is present (unless `cpu`
/// forces the CPU), otherwise the CPU.
pub fn select_device(local_rank: usize, cpu: bool) -> Result<Device> {
    if cpu {
        return Ok(Device::Cpu);
    }
    #[cfg(feature = "cuda")]
    {
        if candle_core::utils::cuda_is_available() {
            // More local ranks than GPUs share them round-robin (the communicator then avoids
            // NCCL, which refuses two ranks on one GPU).
            let count = candle_core::cuda::cudarc::driver::CudaContext::device_count()
                .map_or(1, |n| n.max(1) as usize);
            let ordinal = local_rank % count;
            if local_rank == count {
                tracing::warn!(
                    "more processes on this machine than its {count} GPU(s): local rank \
                     {local_rank} and later share them (local rank r uses cuda:(r mod {count}))"
                );
            }
            return Device::new_cuda(ordinal).map_err(|e| {
                Error::Setup(format!(
                    "cannot open CUDA device {ordinal} for local rank {local_rank}: {e}; pass \
                     `cpu = true` to train on the CPU"
                ))
            });
        }
    }
    #[cfg(feature = "metal")]
    {
        if candle_core::utils::metal_is_available() {
            // A Mac has one GPU: every local rank shares it.
            return Device::new_metal(0).map_err(|e| {
                Error::Setup(format!(
                    "cannot open the Metal device: {e}; pass `cpu = true` to train on the CPU"
                ))
            });
        }
    }
    let _ = local_rank;
    Ok(Device::Cpu)
}

/// This machine's host name (`unknown-host` when the system will not say).
pub(crate) fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates, and we stop at the first NUL or the end either way.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match (rc, std::str::from_utf8(&buf[..end])) {
        (0, Ok(s)) if !s.is_empty() => s.to_string(),
        _ => "unknown-host".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn layout(vars: &[(&str, &str)]) -> Result<Option<EnvLayout>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        EnvLayout::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn no_launcher_means_no_layout() {
        assert_eq!(layout(&[]).unwrap(), None);
    }

    #[test]
    fn open_mpi_variables_are_read() {
        let l = layout(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            l,
            EnvLayout {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                local_world_size: 2
            }
        );
    }

    #[test]
    fn mpich_variables_without_local_info_default_to_one_machine() {
        let l = layout(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")])
            .unwrap()
            .unwrap();
        assert_eq!(l.local_rank, 1);
        assert_eq!(l.local_world_size, 2);
    }

    #[test]
    fn srun_tasks_read_slurms_variables_when_no_mpi_family_speaks() {
        // `srun --mpi=pmix -N 3 -n 7`: PMIx exports the rank only; node 1 runs tasks 3..5.
        let l = layout(&[
            ("PMIX_RANK", "4"),
            ("SLURM_PROCID", "4"),
            ("SLURM_STEP_NUM_TASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "3(x2),1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            l,
            EnvLayout {
                rank: 4,
                world_size: 7,
                local_rank: 1,
                local_world_size: 3
            }
        );
        assert_eq!(tasks_on_node("3(x2),1", 2), Some(1));
        assert_eq!(tasks_on_node("3(x2),1", 3), None);
        assert_eq!(tasks_on_node("4", 0), Some(4));
        // A batch script's own environment has no step: one process, no layout.
        let batch = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "0"),
        ];
        assert_eq!(layout(&batch).unwrap(), None);
        // An MPI family wins over SLURM's.
        let l = layout(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "5"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((l.rank, l.world_size), (1, 2));
        let e = layout(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x"),
        ])
        .unwrap_err();
        assert!(e.to_string().contains("SLURM_STEP_TASKS_PER_NODE"), "{e}");
    }

    #[test]
    fn bad_values_are_errors_that_name_the_variable() {
        let e = layout(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("PMI_RANK"), "{e}");
        let e = layout(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")]).unwrap_err();
        assert!(e.to_string().contains("not a valid layout"), "{e}");
    }
}
