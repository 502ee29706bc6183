//! A Llama trained under ZeRO-3 (or any stage) on every process of an `ivme launch`, for
//! tests/zero3.rs and tests/memory_limit.rs; or by plain candle on one process, the reference.
//!
//! Each micro-batch is 12 sequences; process `r` of `W` takes sequences `12r/W .. 12(r+1)/W`,
//! so any `W` dividing 12 sees the same global batches as plain candle. Each rank writes
//! `out/rank{r}.json`: the whole f32 weights by name (`params`), the bytes it holds
//! (`held`) and its peak memory (`vm_hwm_kib`, `vm_peak_kib`).
//!
//! Arguments are `key=value`: `mode=ivme|candle size=small|big sharding=no|…|parameters
//! precision=no|bf16 opt=adamw|sgd accum=A steps=S clip=F tied=0|1 lora=BASE_DIR out=DIR`; `save_base=DIR`
//! (candle) writes the initial weights as a model folder first; `weights=FILE` writes the
//! trained weights as safetensors instead of into the report (candle), or `state=DIR` saves
//! each rank's sharded state there instead, with nothing gathered (ivme): a model that does not
//! fit one process is merged afterwards by `ivme merge-weights`.
//! Plain SGD is what exactness against candle is measured with: AdamW's first steps divide
//! each gradient by its own size, so a gradient within rounding of zero moves its weight by a
//! whole learning rate either way.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use ivme::models::llama::{Llama, LlamaConfig};
use ivme::{Accelerator, Precision, Sharding};
use std::collections::{BTreeMap, HashMap};

const ROWS: usize = 12;

/// A prepared optimizer's step, whichever optimizer it is.
type IvmeStep = Box<dyn FnMut(&ivme::Gradients) -> ivme::Result<()>>;
/// Plain candle's optimizer step, whichever optimizer it is.
type CandleStep = Box<dyn FnMut(&candle_core::backprop::GradStore) -> candle_core::Result<()>>;
const SGD_LR: f64 = 0.1;

struct Args(HashMap<String, String>);

impl Args {
    fn get<T: std::str::FromStr>(&self, k: &str, d: T) -> T {
        self.0.get(k).and_then(|v| v.parse().ok()).unwrap_or(d)
    }
    fn str(&self, k: &str, d: &str) -> String {
        self.0.get(k).cloned().unwrap_or_else(|| d.to_string())
    }
}

/// `small`: 3 blocks of hidden 32 on 12 tokens, quick; `big`: 8 blocks of hidden 512 (about
/// 27 M parameters, 430 MB with AdamW's state and the gradients) on 16 tokens, whose
/// training state outweighs its activations.
fn config(size: &str, tied: bool) -> (LlamaConfig, usize) {
    let (hidden, inter, layers, vocab, tokens) = match size {
        "big" => (512, 1376, 8, 512, 16),
        _ => (32, 64, 3, 64, 12),
    };
    let cfg = LlamaConfig::from_json(&format!(
        r#"{{"model_type": "llama", "hidden_size": {hidden}, "intermediate_size": {inter},
            "vocab_size": {vocab}, "num_hidden_layers": {layers}, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 64, "tie_word_embeddings": {tied}}}"#
    ))
    .expect("the config parses");
    (cfg, tokens)
}

/// Sets every variable of `varmap` from one seeded generator, in name order.
fn init(varmap: &VarMap) -> ivme::Result<()> {
    let mut rng = ivme::rng::Rng::new(7);
    let data = varmap.data().lock().expect("the varmap's lock");
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let v = &data[name];
        let value = rng.randn(0.0, 0.2, v.shape(), &Device::Cpu)?;
        v.set(&value.to_dtype(v.dtype())?)?;
    }
    Ok(())
}

/// Rows `rows` of micro-batch `j`'s token ids and next tokens.
fn batch(j: usize, tokens: usize, vocab: usize, rows: std::ops::Range<usize>) -> (Tensor, Tensor) {
    let seq = |r: usize| -> Vec<u32> {
        (0..=tokens)
            .map(|i| ((i * i * 5 + j * 11 + r * 7 + i) % vocab) as u32)
            .collect()
    };
    let n = rows.len();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for r in rows {
        let s = seq(r);
        x.extend_from_slice(&s[..tokens]);
        y.extend(s[1..].iter().map(|&t| t as i64));
    }
    (
        Tensor::from_vec(x, (n, tokens), &Device::Cpu).expect("ids"),
        Tensor::from_vec(y, (n, tokens), &Device::Cpu).expect("targets"),
    )
}

fn loss(model: &Llama, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    let logits = model.forward(x)?.to_dtype(DType::F32)?;
    ivme::models::causal_lm_loss(&logits, y, ivme::models::IGNORE_INDEX)
}

/// AdamW with an `eps` of 1e-4: its first steps divide each gradient by its own size plus
/// `eps`, so with the default 1e-8 a gradient within rounding of zero moves its weight by up to
/// a whole learning rate either way, and runs that sum gradients in another order (over ranks,
/// per micro-batch) end far apart for no fault of theirs.
fn adamw() -> ivme::optim::ParamsAdamW {
    ivme::optim::ParamsAdamW {
        lr: 0.01,
        eps: 1e-4,
        ..Default::default()
    }
}

/// Peak resident and virtual memory of this process, and its data segment now, in KiB.
fn peaks() -> (u64, u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmPeak:"), field("VmData:"))
}

fn write_report(out: &str, rank: usize, params: Vec<(String, Tensor)>, held: [usize; 4]) {
    let params: BTreeMap<String, Vec<f32>> = params
        .into_iter()
        .map(|(k, t)| {
            let v = t
                .to_dtype(DType::F32)
                .and_then(|t| t.flatten_all()?.to_vec1());
            (k, v.expect("weights"))
        })
        .collect();
    let (hwm, peak, data) = peaks();
    let report = serde_json::json!({
        "rank": rank, "params": params, "vm_hwm_kib": hwm, "vm_peak_kib": peak,
        "vm_data_kib": data,
        "held": { "weights": held[0], "masters": held[1], "gradients": held[2],
                  "optimizer": held[3] },
    });
    std::fs::create_dir_all(out).expect("the out folder");
    std::fs::write(
        format!("{out}/rank{rank}.json"),
        serde_json::to_vec_pretty(&report).expect("JSON"),
    )
    .expect("the report");
}

/// What both kinds of run read from the arguments.
struct Run {
    cfg: LlamaConfig,
    tokens: usize,
    accum: usize,
    steps: usize,
    clip: f64,
}

impl Run {
    fn of(a: &Args) -> Run {
        let (cfg, tokens) = config(&a.str("size", "small"), a.get("tied", 0u8) == 1);
        Run {
            cfg,
            tokens,
            accum: a.get("accum", 1),
            steps: a.get("steps", 3),
            clip: a.get("clip", 0.0),
        }
    }
}

/// Plain candle on one process: each window's mean gradient over the whole micro-batches,
/// clipped by its global norm, candle-nn's AdamW.
fn candle(a: &Args, r: &Run) -> ivme::Result<()> {
    let (cfg, tokens, accum, steps, clip) = (&r.cfg, r.tokens, r.accum, r.steps, r.clip);
    let varmap = VarMap::new();
    let model = Llama::new(
        cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    init(&varmap)?;
    if let Some(dir) = a.0.get("save_base") {
        // The initial weights as a Hugging Face folder: the frozen base of a LoRA run.
        std::fs::create_dir_all(dir).map_err(|e| ivme::Error::io(format!("creating {dir}"), e))?;
        varmap.save(format!("{dir}/model.safetensors"))?;
    }
    let mut named: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .expect("lock")
        .clone()
        .into_iter()
        .collect();
    named.sort_by(|x, y| x.0.cmp(&y.0));
    let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
    let p = adamw();
    let params = candle_nn::ParamsAdamW {
        lr: p.lr,
        beta1: p.beta1,
        beta2: p.beta2,
        eps: p.eps,
        weight_decay: p.weight_decay,
    };
    let mut clipped = false;
    let mut opt: CandleStep = match a.str("opt", "adamw").as_str() {
        "sgd" => {
            let mut o = candle_nn::SGD::new(vars.clone(), SGD_LR)?;
            Box::new(move |g| o.step(g))
        }
        _ => {
            let mut o = candle_nn::AdamW::new(vars.clone(), params)?;
            Box::new(move |g| o.step(g))
        }
    };
    for step in 0..steps {
        let mut sums: Vec<Option<Tensor>> = vec![None; vars.len()];
        for j in step * accum..(step + 1) * accum {
            let (x, y) = batch(j, tokens, cfg.vocab_size, 0..ROWS);
            let g = (loss(&model, &x, &y)? / accum as f64)?.backward()?;
            for (sum, v) in sums.iter_mut().zip(&vars) {
                let gv = g.get(v.as_tensor()).expect("a gradient").clone();
                *sum = Some(match sum.take() {
                    Some(s) => (s + gv)?,
                    None => gv,
                });
            }
        }
        let sums: Vec<Tensor> = sums.into_iter().map(|s| s.expect("summed")).collect();
        let mut sq = 0f64;
        for g in &sums {
            sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
        let coef = match clip > 0.0 {
            true => (clip / (sq.sqrt() + 1e-6)).min(1.0),
            false => 1.0,
        };
        clipped |= coef < 1.0;
        let mut store = candle_core::backprop::GradStore::default();
        for (v, g) in vars.iter().zip(sums) {
            store.insert(v.as_tensor(), (g * coef)?);
        }
        opt(&store)?;
    }
    let params = match a.0.get("weights") {
        Some(file) => {
            varmap.save(file)?;
            Vec::new()
        }
        None => named
            .into_iter()
            .map(|(k, v)| (k, v.as_tensor().clone()))
            .collect(),
    };
    write_report(&a.str("out", "."), 0, params, [0; 4]);
    println!("clipped: {clipped}");
    Ok(())
}

fn ivme_run(a: &Args, r: &Run) -> ivme::Result<()> {
    let (cfg, tokens, accum, steps, clip) = (&r.cfg, r.tokens, r.accum, r.steps, r.clip);
    let precision: Precision = a.str("precision", "no").parse()?;
    let mut builder = Accelerator::builder()
        .cpu(true)
        .grad_accum(accum)
        .precision(precision)
        .sharding(a.str("sharding", "no").parse::<Sharding>()?)
        .activation_checkpointing(a.get("ckpt", 1u8) == 1);
    if clip > 0.0 {
        builder = builder.clip_grad_norm(clip);
    }
    let mut acc = builder.build()?;
    let varmap = VarMap::new();
    let model = match a.0.get("lora") {
        Some(dir) => {
            let base = acc.load_base(dir)?;
            let config = ivme::finetune::LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]);
            let lora = acc.lora(config)?;
            let vb = acc.base_var_builder(&base, &varmap, acc.param_dtype(DType::F32));
            Llama::with_lora(cfg, vb, &lora)?
        }
        None => {
            let dtype = acc.param_dtype(DType::F32);
            let model = Llama::new(cfg, VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu))?;
            init(&varmap)?;
            model
        }
    };
    let vars = varmap.all_vars();
    let mut opt: IvmeStep = match a.str("opt", "adamw").as_str() {
        "sgd" => {
            let p = ivme::optim::ParamsSgd {
                lr: SGD_LR,
                ..Default::default()
            };
            let mut o = acc.prepare_optimizer(&varmap, ivme::optim::Sgd::new(vars, p))?;
            Box::new(move |g| o.step(g))
        }
        _ => {
            let o = ivme::optim::AdamW::new(vars, adamw());
            let mut o = acc.prepare_optimizer(&varmap, o)?;
            Box::new(move |g| o.step(g))
        }
    };
    let (w, r) = (acc.num_processes(), acc.process_index());
    let rows = ROWS * r / w..ROWS * (r + 1) / w;
    for j in 0..steps * accum {
        let (x, y) = batch(j, tokens, cfg.vocab_size, rows.clone());
        let grads = acc.backward(&loss(&model, &x, &y)?)?;
        opt(&grads)?;
    }
    drop(opt);
    let params = match a.0.get("state") {
        Some(dir) => {
            acc.save_state(Some(std::path::Path::new(dir)))?;
            Vec::new()
        }
        None => acc.whole_masters()?,
    };
    let h = acc.held_bytes()?;
    write_report(
        &a.str("out", "."),
        r,
        params,
        [h.weights, h.masters, h.gradients, h.optimizer],
    );
    Ok(())
}

fn main() -> ivme::Result<()> {
    let args = Args(
        std::env::args()
            .skip(1)
            .filter_map(|a| a.split_once('=').map(|(k, v)| (k.into(), v.into())))
            .collect(),
    );
    let run = Run::of(&args);
    match args.str("mode", "ivme").as_str() {
        "candle" => candle(&args, &run),
        _ => ivme_run(&args, &run),
    }
}
