//! The README's examples run on 1 and 2 processes, print once (from the main process), and
//! their loss goes down.

mod common;

fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| l.split("loss ").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect()
}

fn check(example: &str, procs: usize, epochs: &str) {
    let o = common::launch(procs, &common::example_bin(example), &[epochs], &[]);
    let (so, se) = common::text(&o);
    assert!(o.status.success(), "{example} on {procs}: {se}");
    let l = losses(&so);
    let n: usize = epochs.parse().unwrap();
    assert_eq!(
        l.len(),
        n,
        "{example} on {procs}: one line per epoch from the main process only:\n{so}"
    );
    assert!(
        l[n - 1] < l[0] * 0.5,
        "{example} on {procs}: loss did not fall: {l:?}"
    );
}

#[test]
fn the_macro_tutorial_trains_on_one_and_two_processes() {
    check("tutorial_macro", 1, "6");
    check("tutorial_macro", 2, "6");
}

#[test]
fn the_runtime_tutorial_trains_on_one_and_two_processes() {
    check("tutorial", 1, "4");
    check("tutorial", 2, "4");
}

#[test]
fn the_lora_example_fine_tunes_on_two_processes_and_its_adapter_merges() {
    let dir = common::scratch("example-lora");
    let d = dir.display().to_string();
    let o = common::launch(2, &common::example_bin("finetune_lora"), &[&d, "3"], &[]);
    let (so, se) = common::text(&o);
    assert!(o.status.success(), "finetune_lora: {se}");
    let l = losses(&so);
    assert_eq!(
        l.len(),
        3,
        "one line per epoch from the main process:\n{so}"
    );
    assert!(l[2] < l[0] * 0.5, "loss did not fall: {l:?}");
    assert!(
        se.contains("training 0.04 M of 7.38 M parameters"),
        "the share that trains is said once:\n{se}"
    );
    let merged = dir.join("merged");
    let o = std::process::Command::new(common::ivme_bin())
        .args(["merge-weights", "--adapter"])
        .arg(dir.join("adapter"))
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{:?}", common::text(&o));
    assert!(merged.join("model.safetensors").is_file() && merged.join("config.json").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}
