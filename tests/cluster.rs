//! Jobs across machines, for real: `scripts/cluster.sh` builds two "machines" as Linux network
//! namespaces (each its own address on a private bridge, hostname, /dev/shm and sshd), and
//! `ivme launch --hostfile` on machine 0 starts two ranks on each through mpirun over ssh.
//! Skipped, saying why, where namespaces cannot be made (not root, no sshd).

mod common;
mod reference;

use common::{example_bin, ivme_bin, params, scratch, text};
use ivme::data::sampler::epoch_order;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The cluster script.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/cluster.sh")
}

/// A cluster for the length of a test; taken down (every process of every machine stopped,
/// the namespaces removed) when dropped, also after a failed assertion.
struct Cluster {
    dir: PathBuf,
}

impl Cluster {
    /// `n` machines, or `None` (said on stderr) where this system cannot make them.
    fn up(n: usize) -> Option<Cluster> {
        let dir = scratch("cluster");
        let o = Command::new("bash")
            .arg(script())
            .args(["up", &n.to_string()])
            .env("IVME_CLUSTER_DIR", &dir)
            .output()
            .expect("running scripts/cluster.sh");
        let (so, se) = text(&o);
        if o.status.code() == Some(77) {
            eprintln!("skipped: {}", se.trim());
            return None;
        }
        assert!(o.status.success(), "cluster up failed\n{so}\n{se}");
        Some(Cluster { dir })
    }

    /// A hostfile naming the first `machines` machines with `slots` ranks each.
    fn hostfile_of(&self, machines: usize, slots: usize) -> String {
        let listed = std::fs::read_to_string(self.dir.join("hostfile")).unwrap();
        let lines: Vec<String> = listed
            .lines()
            .take(machines)
            .map(|l| format!("{} slots={slots}", l.split_whitespace().next().unwrap()))
            .collect();
        assert_eq!(lines.len(), machines, "{listed}");
        let path = self.dir.join(format!("hostfile-{machines}x{slots}"));
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        path.display().to_string()
    }

    /// Runs `ivme launch --hostfile .. --num_processes 4 --cpu PROGRAM ARGS` on machine 0, two
    /// ranks on each of machines 0 and 1.
    fn launch(&self, program: &Path, args: &[&str]) -> std::process::Child {
        self.launch_on(&self.hostfile_of(2, 2), 4, program, args)
    }

    /// Runs `ivme launch --hostfile HOSTFILE --num_processes N --cpu PROGRAM ARGS` on machine 0.
    fn launch_on(
        &self,
        hostfile: &str,
        n: usize,
        program: &Path,
        args: &[&str],
    ) -> std::process::Child {
        self.launch_with(hostfile, n, &[], &[], program, args)
    }

    /// [`launch_on`](Self::launch_on) with more launcher flags and variables.
    fn launch_with(
        &self,
        hostfile: &str,
        n: usize,
        flags: &[&str],
        envs: &[(&str, &str)],
        program: &Path,
        args: &[&str],
    ) -> std::process::Child {
        Command::new("bash")
            .arg(script())
            .args(["exec", "0"])
            .arg(ivme_bin())
            .args([
                "launch",
                "--hostfile",
                hostfile,
                "--num_processes",
                &n.to_string(),
            ])
            .args(["--cpu", "--collective_timeout", "5"])
            .args(flags)
            .arg(program)
            .args(args)
            .env("IVME_CLUSTER_DIR", &self.dir)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .envs(envs.iter().copied())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting ivme launch on machine 0")
    }

    /// Runs `ivme ARGS` on machine 0.
    fn ivme(&self, args: &[&str]) -> Output {
        Command::new("bash")
            .arg(script())
            .args(["exec", "0"])
            .arg(ivme_bin())
            .args(args)
            .env("IVME_CLUSTER_DIR", &self.dir)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .output()
            .expect("running ivme on machine 0")
    }

    fn run(&self, program: &Path, args: &[&str]) -> Output {
        self.launch(program, args).wait_with_output().unwrap()
    }

    /// Brings machine `i`'s link `up` or `down`.
    fn link(&self, i: usize, state: &str) {
        let o = Command::new("bash")
            .arg(script())
            .args(["link", &i.to_string(), state])
            .env("IVME_CLUSTER_DIR", &self.dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "{:?}", text(&o));
    }

    /// The processes still running on machine `i` (its sshd not counted).
    fn processes(&self, i: usize) -> Vec<String> {
        let o = Command::new("ip")
            .args(["netns", "pids", &format!("ivme-c{i}")])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).ok())
            .map(|c| c.trim().to_string())
            .filter(|c| c != "sshd")
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .arg("down")
            .env("IVME_CLUSTER_DIR", &self.dir)
            .output();
    }
}

/// Waits for `job` to end, at most `limit` after `since`; its status and how long after
/// `since` it ended.
fn wait_within(
    job: &mut std::process::Child,
    since: Instant,
    limit: Duration,
) -> (std::process::ExitStatus, Duration) {
    loop {
        if let Some(status) = job.try_wait().unwrap() {
            return (status, since.elapsed());
        }
        if since.elapsed() > limit {
            let _ = job.kill();
            panic!("the job still runs {limit:?} after the failure");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The final weights of every rank of `harness` run with `args` through `run`.
fn weights(
    args: &[&str],
    out: &Path,
    run: impl FnOnce(&[&str]) -> Output,
) -> Vec<std::collections::BTreeMap<String, Vec<f32>>> {
    let out_arg = format!("out={}", out.display());
    let mut all = args.to_vec();
    all.push(&out_arg);
    let o = run(&all);
    let (so, se) = text(&o);
    assert!(o.status.success(), "harness {args:?} failed\n{so}\n{se}");
    (0..4)
        .map(|r| {
            let bytes = std::fs::read(out.join(format!("rank{r}.json"))).unwrap();
            params(&serde_json::from_slice(&bytes).unwrap())
        })
        .collect()
}

#[test]
fn two_machines_of_two_ranks_train_as_four_ranks_on_one_machine_and_a_lost_machine_ends_the_job() {
    let Some(cluster) = Cluster::up(3) else {
        return;
    };
    // Two ranks on each machine, each machine its own host.
    let o = cluster.run(Path::new("/bin/hostname"), &[]);
    let (so, se) = text(&o);
    assert!(o.status.success(), "{so}\n{se}");
    let mut hosts: Vec<&str> = so.lines().collect();
    hosts.sort();
    assert_eq!(hosts, ["ivme-c0", "ivme-c0", "ivme-c1", "ivme-c1"], "{se}");

    // `ivme test` across the machines of a config file: with a folder they share, the
    // save/load round trip is checked too; with each machine's own /dev/shm it fails, saying why.
    let config = cluster.dir.join("test.toml");
    let hostfile = cluster.hostfile_of(2, 2);
    std::fs::write(
        &config,
        format!("version = 1\nnum_processes = 4\ncpu = true\nhostfile = \"{hostfile}\"\n"),
    )
    .unwrap();
    let shared = scratch("cluster-selftest");
    std::fs::create_dir_all(&shared).unwrap();
    let config = config.to_str().unwrap();
    let o = cluster.ivme(&[
        "test",
        "--config_file",
        config,
        "--checkpoint_dir",
        shared.to_str().unwrap(),
    ]);
    let (so, se) = text(&o);
    assert!(
        o.status.success()
            && so.contains("ivme test: PASS: 4 process(es)")
            && so.contains("save_state then load_state restored the weights exactly"),
        "{so}\n{se}"
    );
    let _ = std::fs::remove_dir_all(&shared);
    let o = cluster.ivme(&[
        "test",
        "--config_file",
        config,
        "--checkpoint_dir",
        "/dev/shm",
    ]);
    let (so, se) = text(&o);
    assert!(
        !o.status.success()
            && so.contains("ivme test: FAIL")
            && so.contains("must be one folder every machine sees"),
        "{so}\n{se}"
    );

    // A third machine that does not exist: refused before any rank starts, naming it.
    let three = cluster.dir.join("hostfile-3");
    let listed = std::fs::read_to_string(cluster.hostfile_of(2, 2)).unwrap();
    std::fs::write(&three, format!("{listed}10.213.0.99 slots=1\n")).unwrap();
    let marker = cluster.dir.join("a-rank-ran");
    let started = Instant::now();
    let o = cluster
        .launch_on(
            three.to_str().unwrap(),
            5,
            Path::new("/bin/touch"),
            &[marker.to_str().unwrap()],
        )
        .wait_with_output()
        .unwrap();
    let took = started.elapsed();
    let (so, se) = text(&o);
    assert!(!o.status.success(), "{so}\n{se}");
    assert!(
        se.contains("machine 2 (10.213.0.99)") && se.contains("did not answer over ssh"),
        "{se}"
    );
    assert!(!se.contains("machine 1 ("), "machine 1 answers: {se}");
    assert!(!marker.exists(), "a rank started");
    assert!(took < Duration::from_secs(15), "{took:?}");

    // A rank of machine 1 fails while the launcher's status folder is machine 0's own (its
    // TMPDIR in /dev/shm, which machine 1 does not share, as on real machines): the rank's
    // record reaches the launcher through mpirun, and the launcher names it.
    let faults = example_bin("faults");
    let o = cluster
        .launch_with(
            &cluster.hostfile_of(2, 2),
            4,
            &[],
            &[("TMPDIR", "/dev/shm")],
            &faults,
            &["mode=err", "rank=3", "at=2"],
        )
        .wait_with_output()
        .unwrap();
    let (_, se) = text(&o);
    assert!(!o.status.success(), "{se}");
    assert!(se.contains("rank 3 failed first, with exit code 1"), "{se}");
    assert!(
        !se.contains("ivme-status"),
        "relayed records are not shown: {se}"
    );

    // Plain data parallelism and ZeRO stage 2: bit for bit the 4-rank run on one machine (the
    // same collectives in the same order; only the transport differs).
    let harness = example_bin("harness");
    for args in [
        &[
            "opt=adamw",
            "steps=6",
            "batch=4",
            "n=64",
            "lr=0.01",
            "shuffle=1",
        ][..],
        &[
            "opt=adamw",
            "steps=6",
            "batch=4",
            "n=64",
            "lr=0.01",
            "sharding=gradients",
        ],
    ] {
        let (one, two) = (scratch("cluster-one"), scratch("cluster-two"));
        let local = weights(args, &one, |a| common::launch(4, &harness, a, &[]));
        let across = weights(args, &two, |a| cluster.run(&harness, a));
        for (r, w) in across.iter().enumerate() {
            assert_eq!(w, &local[0], "{args:?}: rank {r} across machines");
        }
        let _ = (std::fs::remove_dir_all(one), std::fs::remove_dir_all(two));
    }

    // Saved on 2 machines × 2 ranks (stage 2: each rank writes its own slice into the shared
    // project folder), resumed on 1 machine × 2 ranks (unsharded) and on 3 machines × 1 rank
    // (stage 2): both continue over the epoch's unused samples as plain candle does.
    saved_on_two_machines_resumes_on_one_and_on_three(&cluster);

    // Machine 2 of 3 lost mid-epoch, with `--min_machines 2`: the restart runs on machines 0
    // and 1 and resumes from the newest checkpoint; every sample of the epoch is used once.
    a_restart_leaves_out_a_lost_machine(&cluster);

    // Machine 1's link cut mid-run: the ranks of machine 0 give up on machine 1's at the
    // collective deadline (5 s), and the launcher stops an mpirun that cannot reach machine 1
    // to end the job within 10 s more.
    let faults = example_bin("faults");
    let mut job = cluster.launch(&faults, &["mode=none", "steps=1000000"]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        job.try_wait().unwrap().is_none(),
        "the job ended on its own"
    );
    let cut = Instant::now();
    cluster.link(1, "down");
    let (ended, took) = wait_within(&mut job, cut, Duration::from_secs(40));
    let o = job.wait_with_output().unwrap();
    let (_, se) = text(&o);
    assert!(!ended.success(), "{se}");
    assert!(took < Duration::from_secs(25), "took {took:?}\n{se}");
    // Which rank sees it first varies: a transfer that stalls, or a collective ranks 2 and 3
    // never arrive at.
    assert!(
        se.contains("stalled on rank") || se.contains("not arrived: rank 2, rank 3"),
        "{se}"
    );
    eprintln!("machine 1's link cut: the job ended in {took:?}");
    // Once the link is back, nothing of the job is left on either machine.
    cluster.link(1, "up");
    let back = Instant::now();
    while !(cluster.processes(0).is_empty() && cluster.processes(1).is_empty()) {
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "left running: {:?} on machine 0, {:?} on machine 1",
            cluster.processes(0),
            cluster.processes(1)
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Every process of machine 1 killed mid-run: the job ends within seconds, naming the
    // machine and its ranks, and nothing is left running on either machine.
    let mut job = cluster.launch(&faults, &["mode=none", "steps=1000000"]);
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        job.try_wait().unwrap().is_none(),
        "the job ended on its own"
    );
    let killed = Instant::now();
    let o = Command::new("sh")
        .arg("-c")
        .arg("ip netns pids ivme-c1 | xargs -r kill -9")
        .output()
        .unwrap();
    assert!(o.status.success());
    let (ended, took) = wait_within(&mut job, killed, Duration::from_secs(30));
    let o = job.wait_with_output().unwrap();
    let (_, se) = text(&o);
    assert!(!ended.success(), "{se}");
    assert!(took < Duration::from_secs(15), "took {took:?}\n{se}");
    assert!(
        se.contains("ivme: lost machine 1 (10.213.0.2, ranks 2, 3)"),
        "{se}"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        cluster.processes(0),
        Vec::<String>::new(),
        "left on machine 0"
    );
    assert_eq!(
        cluster.processes(1),
        Vec::<String>::new(),
        "left on machine 1"
    );
    eprintln!("machine 1 lost: the job ended in {took:?}");
}

/// The harness's arguments for AdamW on the MLP over a shuffled data set of 24 samples.
fn resume_args(batch: usize, sharding: &str, project: &Path, more: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["opt=adamw", "lr=0.01", "n=24", "shuffle=1"]
        .map(String::from)
        .to_vec();
    args.push(format!("batch={batch}"));
    args.push(format!("sharding={sharding}"));
    args.push(format!("project={}", project.display()));
    args.extend(more.iter().map(|s| s.to_string()));
    args
}

fn saved_on_two_machines_resumes_on_one_and_on_three(cluster: &Cluster) {
    let harness = example_bin("harness");
    let root = common::Scratch::new("cluster-resume");
    // 4 ranks × 3 samples: step 1 uses 12 of epoch 0's 24 samples, then the job saves and ends.
    let saved = root.0.join("saved");
    let args = resume_args(3, "gradients", &saved, &["save_at=1", "steps=99"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = cluster
        .launch_on(&cluster.hostfile_of(2, 2), 4, &harness, &args)
        .wait_with_output()
        .unwrap();
    let (so, se) = text(&o);
    assert!(
        o.status.success(),
        "saving on 2 machines failed\n{so}\n{se}"
    );
    // Plain candle on one process: the global batches of 12 in the harness's order (seed 11),
    // two per epoch, for 4 steps.
    let order = |e| epoch_order(24, true, 11, e);
    let batches: Vec<Vec<usize>> = [order(0), order(1)]
        .iter()
        .flat_map(|o| reference::chunks(o, 12, 2))
        .collect();
    let adamw = candle_nn::ParamsAdamW {
        lr: 0.01,
        ..Default::default()
    };
    let expected = reference::train::<candle_nn::AdamW>(24, &batches, adamw);
    // A project folder in /dev/shm, each machine's own: the save fails, saying the folder
    // must be one that every machine shares, instead of a commit that misses ranks 2 and 3.
    let private = Path::new("/dev/shm/ivme-not-shared");
    let args = resume_args(3, "gradients", private, &["save_at=1", "steps=99"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = cluster
        .launch_on(&cluster.hostfile_of(2, 2), 4, &harness, &args)
        .wait_with_output()
        .unwrap();
    let (_, se) = text(&o);
    assert!(!o.status.success(), "{se}");
    assert!(
        se.contains("is not there for rank 2 (on ivme-c1)")
            && se.contains("must be one folder every machine sees"),
        "{se}"
    );
    type Resume<'a> = (&'a str, usize, &'a str);
    let resumes: [Resume; 2] = [
        ("one machine × 2", 6, "no"),
        ("three machines × 1", 4, "gradients"),
    ];
    for (what, batch, sharding) in resumes {
        let project = root.0.join(format!("resumed-{batch}"));
        common::copy_tree(&saved, &project);
        let out = root.0.join(format!("out-{batch}"));
        let out_arg = format!("out={}", out.display());
        let args = resume_args(
            batch,
            sharding,
            &project,
            &["resume=1", "steps=4", &out_arg],
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = if batch == 6 {
            common::launch(2, &harness, &args, &[])
        } else {
            cluster
                .launch_on(&cluster.hostfile_of(3, 1), 3, &harness, &args)
                .wait_with_output()
                .unwrap()
        };
        let (so, se) = text(&o);
        assert!(o.status.success(), "resuming on {what} failed\n{so}\n{se}");
        let report: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("rank0.json")).unwrap()).unwrap();
        let got: BTreeMap<String, Vec<f32>> = params(&report);
        let diff = reference::max_diff(&got, &expected);
        assert!(
            diff <= 1e-6,
            "saved on 2 machines, resumed on {what}: max abs diff {diff} from plain candle"
        );
    }
}

/// Plain candle on one process over the harness's shuffled order (seed 11): `saved` steps of
/// global batch 6, then the rest of epoch 0 and then epoch 1 in global batches of 4 (a short
/// last batch of the epoch split between the 2 ranks), `steps` in all.
fn six_then_four(saved: usize, steps: usize) -> BTreeMap<String, Vec<f32>> {
    let order = |e| epoch_order(24, true, 11, e);
    let mut batches: Vec<Vec<usize>> = order(0)
        .chunks(6)
        .take(saved)
        .map(<[usize]>::to_vec)
        .collect();
    batches.extend(order(0)[6 * saved..].chunks(4).map(<[usize]>::to_vec));
    batches.extend(order(1).chunks(4).map(<[usize]>::to_vec));
    batches.truncate(steps);
    let adamw = candle_nn::ParamsAdamW {
        lr: 0.01,
        ..Default::default()
    };
    reference::train::<candle_nn::AdamW>(24, &batches, adamw)
}

fn a_restart_leaves_out_a_lost_machine(cluster: &Cluster) {
    let harness = example_bin("harness");
    let root = common::Scratch::new("cluster-elastic");
    let project = root.0.join("project");
    let out = root.0.join("out");
    let out_arg = format!("out={}", out.display());
    // 3 machines × 1 rank × 2 samples: 4 steps an epoch; a checkpoint after every step.
    let more = [
        "resume_any=1",
        "save_every=1",
        "steps=8",
        "step_ms=400",
        &out_arg,
    ];
    let args = resume_args(2, "no", &project, &more);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let flags = ["--max_restarts", "1", "--min_machines", "2"];
    let hostfile = cluster.hostfile_of(3, 1);
    let mut job = cluster.launch_with(&hostfile, 3, &flags, &[], &harness, &args);
    // Machine 2's link cut once the second checkpoint is committed.
    let second = project.join("checkpoints/checkpoint_1/manifest.json");
    let started = Instant::now();
    while !second.exists() {
        if let Some(status) = job.try_wait().unwrap() {
            let o = job.wait_with_output().unwrap();
            panic!(
                "the job ended ({status}) before its second checkpoint: {:?}",
                text(&o)
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no second checkpoint"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    cluster.link(2, "down");
    let cut = Instant::now();
    let (ended, took) = wait_within(&mut job, cut, Duration::from_secs(120));
    let o = job.wait_with_output().unwrap();
    let (so, se) = text(&o);
    cluster.link(2, "up");
    assert!(ended.success(), "{so}\n{se}");
    assert!(
        se.contains("restarting on the 2 machines that still answer, with 2 processes (was 3)")
            && se.contains("machine 2 (10.213.0.3)"),
        "{se}"
    );
    let resumed = so
        .lines()
        .find_map(|l| l.strip_prefix("resumed at step "))
        .and_then(|rest| rest.strip_suffix(" on 2 processes"))
        .and_then(|k| k.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("no resume on 2 processes said:\n{so}\n{se}"));
    assert!((2..4).contains(&resumed), "resumed at step {resumed}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("rank0.json")).unwrap()).unwrap();
    assert_eq!(report["world"], 2, "the job ended on 2 processes");
    let diff = reference::max_diff(&params(&report), &six_then_four(resumed, 8));
    assert!(
        diff <= 1e-6,
        "resumed at step {resumed} on 2 machines: max abs diff {diff} from plain candle"
    );
    eprintln!(
        "machine 2 lost at step {resumed}: the job finished on 2 machines {took:?} after the cut"
    );
    // Machine 2's rank gives up at its own deadline; nothing is left anywhere.
    let back = Instant::now();
    while (0..3).any(|i| !cluster.processes(i).is_empty()) {
        assert!(
            back.elapsed() < Duration::from_secs(20),
            "left running: {:?}",
            (0..3).map(|i| cluster.processes(i)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
