//! Model files written by ivme read by other readers (candle's mmaped `VarBuilder`, Python's
//! `safetensors` package), and a sharded checkpoint written by Python loaded by ivme.
//!
//! The Python tests need `python3` with `safetensors` and `numpy` (`scripts/setup.sh`).

mod common;

use common::Scratch;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use ivme::checkpoint::{load_checkpoint_in_model, save_model, ShardSize};
use serde_json::Value;

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Tensors whose values every reader can represent exactly: f32, f16, bf16 and i64.
fn weights(with_bf16: bool) -> Vec<(String, Tensor)> {
    let dev = Device::Cpu;
    let f: Vec<f32> = (0..24).map(|i| (i as f32 * 0.7).cos() * 2.5).collect();
    let mut out = vec![
        (
            "encoder.w".to_string(),
            Tensor::from_vec(f.clone(), (4, 6), &dev).unwrap(),
        ),
        (
            "encoder.b".to_string(),
            Tensor::from_vec(f[..6].to_vec(), 6, &dev)
                .unwrap()
                .to_dtype(DType::F16)
                .unwrap(),
        ),
        (
            "head.w".to_string(),
            Tensor::from_vec(f[6..18].to_vec(), (3, 4), &dev).unwrap(),
        ),
        (
            "position".to_string(),
            Tensor::new(&[3i64, -7, 1 << 40], &dev).unwrap(),
        ),
    ];
    if with_bf16 {
        let t = Tensor::from_vec(f[..8].to_vec(), (2, 4), &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        out.push(("norm.scale".to_string(), t));
    }
    out
}

fn check_with_var_builder(files: &[PathBuf], src: &[(String, Tensor)]) {
    // SAFETY: the files are private to this test and are not modified while mapped.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(files, DType::F64, &Device::Cpu) }.unwrap();
    for (name, t) in src {
        let got = vb.get(t.shape(), name).unwrap();
        assert_eq!(values(&got), values(t), "{name}");
    }
}

#[test]
fn candle_var_builder_reads_single_and_sharded_saves() {
    let tmp = Scratch::new("interop-vb");
    let src = weights(true);
    let single = save_model(&src, &tmp.0.join("single"), None).unwrap();
    assert_eq!(single, vec![tmp.0.join("single/model.safetensors")]);
    check_with_var_builder(&single, &src);

    let dir = tmp.0.join("sharded");
    save_model(&src, &dir, Some(ShardSize::from_bytes(64).unwrap())).unwrap();
    // Find the shards the way candle's examples do: through the index's weight_map.
    let index: Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let mut files: Vec<PathBuf> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| dir.join(f.as_str().unwrap()))
        .collect();
    files.sort();
    files.dedup();
    assert!(files.len() >= 3, "{files:?}");
    check_with_var_builder(&files, &src);
}

fn python(script: &str, args: &[&Path]) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 must be installed for the interop tests (scripts/setup.sh)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python failed (run scripts/setup.sh to install safetensors and numpy):\n{stderr}"
    );
    String::from_utf8(out.stdout).unwrap()
}

const READ_ALL: &str = r#"
import json, os, sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
d = sys.argv[1]
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
out = {"total_size": index["metadata"]["total_size"], "tensors": {}, "formats": []}
for f in sorted(set(index["weight_map"].values())):
    path = os.path.join(d, f)
    with safe_open(path, framework="numpy") as h:
        out["formats"].append((h.metadata() or {}).get("format"))
    for name, a in load_file(path).items():
        assert index["weight_map"][name] == f, name
        out["tensors"][name] = {"dtype": str(a.dtype), "shape": list(a.shape),
                                "bits": [int(x) for x in a.astype(np.float64).ravel().view(np.uint64)]}
print(json.dumps(out))
"#;

#[test]
fn python_safetensors_reads_every_shard_ivme_wrote() {
    let tmp = Scratch::new("interop-py-read");
    let src = weights(false); // numpy has no bfloat16
    save_model(&src, &tmp.0, Some(ShardSize::parse("40B").unwrap())).unwrap();
    let got: Value = serde_json::from_str(&python(READ_ALL, &[&tmp.0])).unwrap();
    let formats = got["formats"].as_array().unwrap();
    assert!(formats.len() >= 3);
    assert!(formats.iter().all(|f| f == "pt"), "{formats:?}");
    let bytes: usize = src
        .iter()
        .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    assert_eq!(got["total_size"], Value::from(bytes));
    let dtypes = [
        ("encoder.w", "float32"),
        ("encoder.b", "float16"),
        ("head.w", "float32"),
        ("position", "int64"),
    ];
    assert_eq!(got["tensors"].as_object().unwrap().len(), src.len());
    for ((name, t), (dname, dtype)) in src.iter().zip(dtypes) {
        assert_eq!(name, dname);
        let entry = &got["tensors"][name];
        assert_eq!(entry["dtype"], dtype, "{name}");
        assert_eq!(entry["shape"], serde_json::json!(t.dims()), "{name}");
        let py: Vec<f64> = entry["bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| f64::from_bits(v.as_u64().unwrap()))
            .collect();
        assert_eq!(py, values(t), "{name}");
    }
}

const WRITE_SHARDED: &str = r#"
import json, os, sys
import numpy as np
from safetensors.numpy import save_file
d = sys.argv[1]
w = np.array([[i * 0.5 - j * 0.25 for j in range(5)] for i in range(4)], dtype=np.float32)
b = np.array([k / 8 for k in range(5)], dtype=np.float16)
e = np.arange(12, dtype=np.float32).reshape(3, 4)
shards = {"model-00001-of-00002.safetensors": {"layer.w": w, "layer.b": b},
          "model-00002-of-00002.safetensors": {"embed": e}}
weight_map = {}
for f, ts in shards.items():
    save_file(ts, os.path.join(d, f), metadata={"format": "pt"})
    weight_map.update({n: f for n in ts})
total = sum(a.nbytes for ts in shards.values() for a in ts.values())
json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
          open(os.path.join(d, "model.safetensors.index.json"), "w"))
"#;

#[test]
fn ivme_loads_a_sharded_checkpoint_written_by_python() {
    let tmp = Scratch::new("interop-py-write");
    python(WRITE_SHARDED, &[&tmp.0]);
    let dev = Device::Cpu;
    let vars = vec![
        (
            "layer.w".to_string(),
            Var::zeros((4, 5), DType::F32, &dev).unwrap(),
        ),
        (
            "layer.b".to_string(),
            Var::zeros(5, DType::F16, &dev).unwrap(),
        ),
        (
            "embed".to_string(),
            Var::zeros((3, 4), DType::F32, &dev).unwrap(),
        ),
    ];
    let report = load_checkpoint_in_model(&vars, &tmp.0, &dev).unwrap();
    assert_eq!(report.files.len(), 2);
    assert!(report.unexpected.is_empty());
    let w: Vec<f64> = (0..4)
        .flat_map(|i| (0..5).map(move |j| i as f64 * 0.5 - j as f64 * 0.25))
        .collect();
    let b: Vec<f64> = (0..5).map(|k| k as f64 / 8.0).collect();
    let e: Vec<f64> = (0..12).map(f64::from).collect();
    assert_eq!(values(vars[0].1.as_tensor()), w);
    assert_eq!(values(vars[1].1.as_tensor()), b);
    assert_eq!(vars[1].1.dtype(), DType::F16);
    assert_eq!(values(vars[2].1.as_tensor()), e);
}
