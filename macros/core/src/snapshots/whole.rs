//! Whole-function snapshots (under `tests/snapshots/`): what `cargo expand` prints for the
//! main shapes of training function, and the one `macros/macro.md` shows.

use super::check_snapshot;
use proc_macro2::TokenStream;
use quote::quote;
use std::path::PathBuf;

#[test]
fn snapshot_spec_loop_fp16_accumulation() {
    check_snapshot(
        "spec_loop_fp16",
        quote!(grad_accum = 2, precision = "fp16"),
        quote! {
            fn train(batches: Vec<(Tensor, Tensor)>, params: ParamsAdamW) -> candle_core::Result<()> {
                let device = Device::Cpu;
                let varmap = VarMap::new();
                let model = Mlp::new(VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
                let mut opt = AdamW::new(varmap.all_vars(), params)?;
                for (inputs, targets) in batches {
                    let inputs = inputs.to_device(&device)?;
                    let targets = targets.to_device(&device)?;
                    let outputs = model.forward(&inputs)?;
                    let loss = loss_fn(&outputs, &targets)?;
                    let grads = loss.backward()?;
                    opt.step(&grads)?;
                }
                Ok(())
            }
        },
    );
}

#[test]
fn snapshot_minimal_no_config() {
    check_snapshot(
        "minimal",
        quote!(),
        quote! {
            fn train(model: &Linear, opt: &mut SGD, data: &[(Tensor, Tensor)]) -> anyhow::Result<()> {
                for (x, y) in data {
                    let loss = candle_nn::loss::mse(&model.forward(x)?, y)?;
                    opt.backward_step(&loss)?;
                }
                Ok(())
            }
        },
    );
}

#[test]
fn snapshot_parameter_form() {
    check_snapshot(
        "parameter",
        quote!(),
        quote! {
            pub fn train<M: Module>(
                accelerator: &mut Accelerator,
                model: &M,
                varmap: &VarMap,
                data: Vec<(Tensor, Tensor)>,
                epochs: usize,
            ) -> candle_core::Result<f32> {
                let mut opt = SGD::new(varmap.all_vars(), 0.1)?;
                let mut last = 0.0;
                for _epoch in 0..epochs {
                    for (x, y) in &data {
                        let logits = model.forward(&x.to_device(&Device::Cpu)?)?;
                        let loss = candle_nn::loss::mse(&logits, y)?;
                        let grads = loss.backward()?;
                        opt.step(&grads)?;
                        last = loss.to_scalar::<f32>()?;
                    }
                }
                Ok(last)
            }
        },
    );
}

/// The README's main example, read from `examples/tutorial_macro.rs`: its expansion is kept as
/// a snapshot and shown verbatim in `macros/macro.md`, so neither can drift from the macro.
#[test]
fn snapshot_of_the_main_example_matches_the_docs() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let source = std::fs::read_to_string(root.join("examples/tutorial_macro.rs")).unwrap();
    let file: syn::File = syn::parse_str(&source).unwrap();
    let mut train = file
        .items
        .into_iter()
        .find_map(|i| match i {
            syn::Item::Fn(f) if f.sig.ident == "train" => Some(f),
            _ => None,
        })
        .expect("examples/tutorial_macro.rs has a `fn train`");
    let attr = train.attrs.remove(0);
    let args = match attr.meta {
        syn::Meta::List(l) => l.tokens,
        _ => TokenStream::new(),
    };
    check_snapshot("tutorial_macro", args, quote!(#train));
    let snapshot = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/tutorial_macro.rs"),
    )
    .unwrap();
    let docs = std::fs::read_to_string(root.join("macros/macro.md")).unwrap();
    assert!(
        docs.contains(&snapshot),
        "macros/macro.md must show the current expansion of examples/tutorial_macro.rs:\n{snapshot}"
    );
}
