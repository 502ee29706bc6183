//! One call reseeds ivme's generator, the same on every rank or per rank; the seed decides the
//! initial weights, through the runtime and under the attribute.

mod common;

use candle_core::DType;
use candle_nn::{linear, VarMap};
use ivme::Accelerator;

fn draws(acc: &Accelerator) -> Vec<f32> {
    let rng = acc.rng();
    let mut r = rng.lock();
    (0..8).map(|_| r.next_f32()).collect()
}

#[test]
fn set_seed_restarts_the_same_stream_and_rank_specific_seeds_differ() {
    let acc = Accelerator::builder().cpu(true).build().unwrap();
    acc.set_seed(5, false);
    let a = draws(&acc);
    acc.set_seed(5, false);
    assert_eq!(a, draws(&acc), "the same seed must give the same draws");
    acc.set_seed(6, false);
    assert_ne!(a, draws(&acc), "another seed must give other draws");
    acc.set_seed(5, true);
    assert_ne!(
        a,
        draws(&acc),
        "a rank-specific stream must differ from the shared one"
    );
}

/// The weights `macro_check mode=seeded` (an MLP under `#[accelerate(seed = 5)]`) starts from.
fn initial_under_the_attribute(tag: &str) -> serde_json::Value {
    let dir = common::scratch(tag);
    let out = std::process::Command::new(common::example_bin("macro_check"))
        .args(["mode=seeded".to_string(), format!("out={}", dir.display())])
        .output()
        .unwrap();
    common::ok(&out);
    let text = std::fs::read_to_string(dir.join("rank0.json")).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    serde_json::from_str::<serde_json::Value>(&text).unwrap()["params"].clone()
}

#[test]
fn the_seed_decides_the_initial_weights_in_every_run_and_under_the_attribute() {
    let first = initial_under_the_attribute("seeded-init-1");
    assert_eq!(first, initial_under_the_attribute("seeded-init-2"));
    // The runtime's builder with the same seed draws the same layer `a` (4 -> 8) by name.
    let acc = Accelerator::builder().cpu(true).seed(5).build().unwrap();
    let varmap = VarMap::new();
    let vb = acc.var_builder(&varmap, DType::F32);
    let a = linear(4, 8, vb.pp("a")).unwrap();
    let w: Vec<f32> = a.weight().flatten_all().unwrap().to_vec1().unwrap();
    let from_macro: Vec<f32> = serde_json::from_value(first["a.weight"].clone()).unwrap();
    assert_eq!(w, from_macro);
    // Another seed, other weights.
    let other = Accelerator::builder().cpu(true).seed(6).build().unwrap();
    let varmap = VarMap::new();
    let b = linear(4, 8, other.var_builder(&varmap, DType::F32).pp("a")).unwrap();
    assert_ne!(
        b.weight().flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        w
    );
}

#[test]
fn set_seed_also_decides_the_weights_made_afterwards_on_every_rank_alike() {
    let layer = |acc: &Accelerator| -> Vec<f32> {
        let varmap = VarMap::new();
        let l = linear(4, 8, acc.var_builder(&varmap, DType::F32)).unwrap();
        l.weight().flatten_all().unwrap().to_vec1().unwrap()
    };
    let seeded = layer(&Accelerator::builder().cpu(true).seed(5).build().unwrap());
    let acc = Accelerator::builder().cpu(true).seed(1).build().unwrap();
    assert_ne!(layer(&acc), seeded);
    acc.set_seed(5, false);
    assert_eq!(layer(&acc), seeded);
    // A rank-specific generator still initialises alike on every rank: by seed and name.
    acc.set_seed(5, true);
    assert_eq!(layer(&acc), seeded);
}
