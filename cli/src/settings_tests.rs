//! Reading, writing and locating config files.

use super::*;

fn parse(text: &str) -> Result<Settings> {
    Settings::parse(text, Path::new("/etc/ivme.toml"))
}

fn err(text: &str) -> String {
    parse(text).unwrap_err().to_string()
}

#[test]
fn a_written_config_reads_back_the_same() {
    let c = Settings {
        num_processes: Some(4),
        cpu: Some(false),
        mixed_precision: Some(Precision::Fp16),
        sharding: Some(ivme::Sharding::Gradients),
        buffers: Some(ivme::BufferSync::Average),
        gradient_accumulation_steps: Some(2),
        backend: Some("mpi".into()),
        num_machines: Some(2),
        machine_rank: Some(1),
        main_process_ip: Some("10.0.0.1".into()),
        main_process_port: Some(29500),
        hosts: Some(vec!["10.0.0.1".into(), "node \"2\"".replace(' ', "_")]),
        hostfile: None,
        max_restarts: Some(3),
        snapshot_every: Some(10),
        // Flag- and environment-only settings: no file key.
        ..Settings::default()
    };
    assert_eq!(parse(&c.to_toml()).unwrap(), c);
    assert_eq!(
        parse(&Settings::sane_default().to_toml()).unwrap(),
        Settings::sane_default()
    );
    assert_eq!(parse("version = 1\n").unwrap(), Settings::default());
}

#[test]
fn a_relative_hostfile_is_read_beside_the_config() {
    let c = parse("version = 1\nhostfile = \"hosts.txt\"\n").unwrap();
    assert_eq!(c.hostfile, Some(PathBuf::from("/etc/hosts.txt")));
}

#[test]
fn unknown_keys_and_bad_values_name_the_key_file_and_fix() {
    let m = err("version = 1\nnum_process = 2\n");
    assert!(
        m.contains("/etc/ivme.toml has an unknown key `num_process`"),
        "{m}"
    );
    assert!(
        m.contains("did you mean `num_processes`") && m.contains("valid keys are: version"),
        "{m}"
    );
    let m = err("version = 1\nmixed_precision = \"fp8\"\n");
    assert!(
        m.contains("`mixed_precision` = \"fp8\"") && m.contains("/etc/ivme.toml"),
        "{m}"
    );
    assert!(m.contains("use one of no, fp16, bf16"), "{m}");
    let m = err("version = 1\nmain_process_port = 70000\n");
    assert!(m.contains("from 1 to 65535"), "{m}");
    let m = err("version = 1\nhosts = []\n");
    assert!(
        m.contains("`hosts`") && m.contains("list of machine addresses"),
        "{m}"
    );
    let m = err("version = 1\nmain_process_ip = \"a b\"\n");
    assert!(m.contains("without spaces"), "{m}");
    let m = err("version = 1\nhosts = [\"a\"]\nhostfile = \"h\"\n");
    assert!(m.contains("both `hosts` and `hostfile`"), "{m}");
    let m = err("version = 1\ngradient_accumulation_steps = 1.5\n");
    assert!(m.contains("whole number of at least 1"), "{m}");
}

#[test]
fn the_version_must_be_present_and_known() {
    assert!(err("num_processes = 1\n").contains("has no `version`"));
    let m = err("version = 7\n");
    assert!(
        m.contains("`version` = \"7\"") && m.contains("reads version 1"),
        "{m}"
    );
    let m = err("version = \"1\"\n");
    assert!(m.contains("reads version 1"), "{m}");
    let m = err("version = 1\n[launch\n");
    assert!(m.contains("is not valid TOML"), "{m}");
}

#[test]
fn the_file_is_found_by_flag_then_variable_then_default() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let l = Location::find(Some(Path::new("f.toml")), env(&[(CONFIG_VAR, "/v.toml")])).unwrap();
    assert_eq!(
        (l.path, l.chosen_by),
        (PathBuf::from("f.toml"), "--config_file")
    );
    let l = Location::find(None, env(&[(CONFIG_VAR, "/v.toml"), ("HOME", "/h")])).unwrap();
    assert_eq!(l.path, PathBuf::from("/v.toml"));
    let l = Location::find(None, env(&[("XDG_CONFIG_HOME", "/x"), ("HOME", "/h")])).unwrap();
    assert_eq!(l.path, PathBuf::from("/x/ivme/default_config.toml"));
    let l = Location::find(None, env(&[("HOME", "/h")])).unwrap();
    assert_eq!(l.path, PathBuf::from("/h/.config/ivme/default_config.toml"));
    assert!(!l.explicit());
    assert!(Location::find(None, env(&[])).is_err());
}

#[test]
fn a_missing_file_is_fine_only_at_the_default_location() {
    let missing = std::env::temp_dir().join(format!("ivme-no-config-{}.toml", std::process::id()));
    let default = Location {
        path: missing.clone(),
        chosen_by: "the default location",
    };
    assert_eq!(default.load().unwrap(), None);
    let named = Location {
        path: missing,
        chosen_by: CONFIG_VAR,
    };
    let m = named.load().unwrap_err().to_string();
    assert!(
        m.contains("does not exist") && m.contains("ivme config default --config_file"),
        "{m}"
    );
}
