//! Tests of `expand`: each rewrite rule against a hand-written expected function, the error
//! paths, and whole-function snapshots (under `tests/snapshots/`) that show what
//! `cargo expand` prints. `IVME_BLESS=1` rewrites the snapshots; read the diff before keeping it.

use crate::expand;
use proc_macro2::TokenStream;
use quote::quote;
use std::path::PathBuf;

fn pretty(tokens: TokenStream) -> String {
    match syn::parse2::<syn::File>(tokens.clone()) {
        Ok(file) => prettyplease::unparse(&file),
        Err(e) => panic!("expansion does not parse as items ({e}):\n{tokens}"),
    }
}

/// Asserts that the macro turns `item` into exactly `expected`.
fn assert_expands(attr: TokenStream, item: TokenStream, expected: TokenStream) {
    let got = pretty(expand(attr, item));
    let want = pretty(expected);
    assert_eq!(got, want, "\n--- got ---\n{got}\n--- want ---\n{want}");
}

/// The error messages of an expansion, which must also carry the original function.
fn errors(attr: TokenStream, item: TokenStream) -> Vec<String> {
    let out = expand(attr, item.clone());
    assert!(
        out.to_string().ends_with(&item.to_string()),
        "the user's item must follow the errors unchanged:\n{out}"
    );
    let file: syn::File = syn::parse2(out).unwrap();
    file.items
        .iter()
        .filter_map(|item| match item {
            syn::Item::Macro(m)
                if m.mac
                    .path
                    .segments
                    .last()
                    .is_some_and(|s| s.ident == "compile_error") =>
            {
                Some(m.mac.parse_body::<syn::LitStr>().unwrap().value())
            }
            _ => None,
        })
        .collect()
}

fn check_snapshot(name: &str, attr: TokenStream, item: TokenStream) {
    let got = pretty(expand(attr, item));
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(format!("{name}.rs"));
    if std::env::var_os("IVME_BLESS").is_some() {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("no snapshot {}; run with IVME_BLESS=1", path.display()));
    assert_eq!(
        got, want,
        "snapshot {name} differs; rerun with IVME_BLESS=1 if intended"
    );
}

#[test]
fn no_config_creates_a_default_accelerator_and_places_on_its_device() {
    assert_expands(
        quote!(),
        quote! {
            fn train() -> Result<()> {
                let device = Device::Cpu;
                let x = x.to_device(&device)?;
                let y = y.to_device(&Device::Cpu)?;
                Ok(())
            }
        },
        quote! {
            fn train() -> Result<()> {
                #[allow(unused_mut, unused_variables)]
                let mut accelerator = ::ivme::Accelerator::builder().build()?;
                #[allow(unused_variables)]
                let device = Device::clone(accelerator.device());
                let x = x.to_device(accelerator.device())?;
                let y = y.to_device(&Device::clone(accelerator.device()))?;
                Ok(())
            }
        },
    );
}

#[test]
fn keys_become_builder_calls_in_a_fixed_order() {
    assert_expands(
        quote!(
            seed = 3,
            cpu = true,
            clip_grad_value = 2,
            precision = "bf16",
            grad_accum = 4
        ),
        quote!(
            fn f() -> anyhow::Result<()> {
                Ok(())
            }
        ),
        quote! {
            fn f() -> anyhow::Result<()> {
                #[allow(unused_mut, unused_variables)]
                let mut accelerator = ::ivme::Accelerator::builder()
                    .grad_accum(4)
                    .precision(::ivme::Precision::Bf16)
                    .clip_grad_value(2.0)
                    .cpu(true)
                    .seed(3)
                    .build()?;
                Ok(())
            }
        },
    );
}

#[test]
fn fault_keys_set_the_collective_deadline_and_debug_mode() {
    assert_expands(
        quote!(debug_sync = true, collective_timeout = 30),
        quote!(
            fn f() -> anyhow::Result<()> {
                Ok(())
            }
        ),
        quote! {
            fn f() -> anyhow::Result<()> {
                #[allow(unused_mut, unused_variables)]
                let mut accelerator = ::ivme::Accelerator::builder()
                    .collective_timeout(::std::time::Duration::from_secs_f64(30.0))
                    .debug_sync(true)
                    .build()?;
                Ok(())
            }
        },
    );
}

#[test]
fn every_device_choice_becomes_the_accelerators_device() {
    assert_expands(
        quote!(),
        quote! {
            fn f(acc: &mut Accelerator) {
                let a = candle_core::Device::new_cuda(0)?;
                let b = Device::cuda_if_available(1).unwrap();
                let c = Device::new_metal(0);
                let d = VarBuilder::from_varmap(&vm, DType::F32, &a);
            }
        },
        quote! {
            fn f(acc: &mut Accelerator) {
                #[allow(unused_variables)]
                let a = candle_core::Device::clone(acc.device());
                #[allow(unused_variables)]
                let b = Device::clone(acc.device());
                #[allow(unused_variables)]
                let c = ::core::result::Result::<_, ::ivme::Error>::Ok(Device::clone(acc.device()));
                let d = VarBuilder::clone(&acc.var_builder(&vm, DType::F32));
            }
        },
    );
}

#[test]
fn optimizers_and_loaders_are_prepared() {
    assert_expands(
        quote!(),
        quote! {
            fn f(acc: &mut Accelerator) {
                let opt = AdamW::new(varmap.all_vars(), params)?;
                let lora = AdamW::new(adapters, params)?;
                let sgd = ivme::optim::Sgd::new(head.clone(), lr)?;
                let other = Thing::new(adapters, params)?;
                let a = DataLoader::new(ds, 8);
                let b = ivme::data::DataLoader::new(ds, 8)?;
                let c = Vec::new(varmap.vars());
            }
        },
        quote! {
            fn f(acc: &mut Accelerator) {
                let opt = acc.prepare_optimizer(&varmap, AdamW::new(varmap.all_vars(), params))?;
                let lora = acc.prepare_optimizer_of(AdamW::new(adapters, params))?;
                let sgd = acc.prepare_optimizer_of(ivme::optim::Sgd::new(head.clone(), lr))?;
                let other = Thing::new(adapters, params)?;
                let a = acc.prepare(DataLoader::new(ds, 8))?;
                let b = acc.prepare(ivme::data::DataLoader::new(ds, 8)?)?;
                let c = Vec::new(varmap.vars());
            }
        },
    );
}

#[test]
fn hand_written_prepare_calls_are_not_prepared_twice() {
    let item = quote! {
        fn f(acc: &mut Accelerator) {
            let opt = acc.prepare_optimizer(&vm, AdamW::new(vm.all_vars(), p))?;
            let sub = acc.prepare_optimizer_of(AdamW::new(adapters, p))?;
            let (m, l) = acc.prepare((vm, DataLoader::new(ds, 8)))?;
        }
    };
    assert_expands(quote!(), item.clone(), item);
}

#[test]
fn the_innermost_loop_with_backward_is_sharded_and_steps_stay() {
    assert_expands(
        quote!(),
        quote! {
            fn f(acc: &mut Accelerator) {
                for epoch in 0..3 {
                    for (x, y) in batches.iter() {
                        let grads = loss.backward()?;
                        opt.step(&grads)?;
                        sched.step();
                    }
                    for x in eval.iter() { println!("{}", x.backward()); }
                }
            }
        },
        quote! {
            fn f(acc: &mut Accelerator) {
                for epoch in 0..3 {
                    for (x, y) in ::ivme::macro_support::shard(&acc, batches.iter())? {
                        let grads = acc.backward(&loss)?;
                        opt.step(&grads)?;
                        sched.step();
                        acc.preemption_point()?;
                    }
                    for x in eval.iter() { println!("{}", x.backward()); }
                }
            }
        },
    );
}

#[test]
fn backward_step_becomes_a_step_on_the_accelerators_gradients() {
    assert_expands(
        quote!(),
        quote! {
            fn f(acc: &mut Accelerator) {
                for (a, b) in data.iter() {
                    loop { opt.backward_step(&loss_fn(&a, &b)?)?; }
                }
            }
        },
        quote! {
            fn f(acc: &mut Accelerator) {
                for (a, b) in ::ivme::macro_support::shard(&acc, data.iter())? {
                    loop { opt.step(&acc.backward(&loss_fn(&a, &b)?)?)?; }
                    acc.preemption_point()?;
                }
            }
        },
    );
}

#[test]
fn an_enumerated_batch_loop_shards_what_it_enumerates() {
    assert_expands(
        quote!(),
        quote! {
            fn f(acc: &mut Accelerator) {
                for (i, (x, y)) in batches.iter().enumerate() { opt.backward_step(&l(x, y))?; }
            }
        },
        quote! {
            fn f(acc: &mut Accelerator) {
                for (i, (x, y)) in ::ivme::macro_support::shard(&acc, batches.iter())?.enumerate() {
                    opt.step(&acc.backward(&l(x, y))?)?;
                    acc.preemption_point()?;
                }
            }
        },
    );
}

#[test]
fn the_preemption_point_follows_a_tail_expression_and_skips_a_body_that_leaves() {
    assert_expands(
        quote!(),
        quote! {
            fn f(acc: &mut Accelerator) {
                for x in xs.iter() { let g = l(x).backward()?; opt.step(&g)? }
                for x in ys.iter() { let g = l(x).backward()?; opt.step(&g)?; break; }
            }
        },
        quote! {
            fn f(acc: &mut Accelerator) {
                for x in ::ivme::macro_support::shard(&acc, xs.iter())? {
                    let g = acc.backward(&l(x))?;
                    opt.step(&g)?;
                    acc.preemption_point()?;
                }
                for x in ::ivme::macro_support::shard(&acc, ys.iter())? {
                    let g = acc.backward(&l(x))?;
                    opt.step(&g)?;
                    break;
                }
            }
        },
    );
}

#[test]
fn a_while_batch_loop_is_refused_not_run_on_every_batch() {
    let out = crate::expand(
        quote!(),
        quote! {
            fn f(acc: &mut Accelerator) {
                while let Some((x, y)) = it.next() { opt.backward_step(&l(x, y))?; }
            }
        },
    )
    .to_string();
    assert!(out.contains("cannot shard a `while` batch loop"), "{out}");
}

#[test]
fn forward_runs_in_an_autocast_scope_with_reference_inputs_cast() {
    assert_expands(
        quote!(precision = "fp16"),
        quote! {
            fn f() -> Result<()> {
                let y = head.forward_t(&body.forward(&x)?, true)?;
                let z = model.forward(xs)?;
                fn nested() { model.forward(&x); }
            }
        },
        quote! {
            fn f() -> Result<()> {
                #[allow(unused_mut, unused_variables)]
                let mut accelerator = ::ivme::Accelerator::builder()
                    .precision(::ivme::Precision::Fp16)
                    .build()?;
                let __ivme_autocast = accelerator.autocast_scope();
                let y = __ivme_autocast.run(|__ivme_ac| head.forward_t(
                    &__ivme_ac.input(&body.forward(&__ivme_ac.input(&x)?)?)?,
                    true,
                ))?;
                let z = __ivme_autocast.run(|__ivme_ac| model.forward(xs))?;
                fn nested() { model.forward(&x); }
            }
        },
    );
}

#[test]
fn apply_and_apply_t_cast_their_receiver_and_a_model_s_own_methods_are_left_alone() {
    assert_expands(
        quote!(precision = "bf16"),
        quote! {
            fn f() -> Result<()> {
                let y = x.apply(&model)?;
                let z = x.apply_t(&head, true)?.apply(&tail)?;
                let e = model.encode(&x)?;
            }
        },
        quote! {
            fn f() -> Result<()> {
                #[allow(unused_mut, unused_variables)]
                let mut accelerator = ::ivme::Accelerator::builder()
                    .precision(::ivme::Precision::Bf16)
                    .build()?;
                let __ivme_autocast = accelerator.autocast_scope();
                let y = __ivme_autocast.run(|__ivme_ac| __ivme_ac.input(&x)?.apply(&model))?;
                let z = __ivme_autocast.run(|__ivme_ac| __ivme_ac
                    .input(&__ivme_ac.input(&x)?.apply_t(&head, true)?)?
                    .apply(&tail))?;
                let e = model.encode(&x)?;
            }
        },
    );
}

#[test]
fn forward_is_left_alone_only_when_the_attribute_fixes_f32() {
    let item = quote!(
        fn f() -> Result<()> {
            let y = m.forward(&x)?;
            Ok(())
        }
    );
    let out = expand(quote!(precision = "no"), item.clone()).to_string();
    assert!(out.contains("m . forward (& x)"), "{out}");
    assert!(!out.contains("autocast"), "{out}");
    // Without the key the launcher may still set bf16 at run time: the batch is cast then.
    let out = expand(quote!(grad_accum = 2), item).to_string();
    assert!(
        out.contains(
            "__ivme_autocast . run (| __ivme_ac | m . forward (& __ivme_ac . input (& x) ?))"
        ),
        "{out}"
    );
}

#[test]
fn config_errors_come_all_at_once_with_the_function_kept() {
    let errs = errors(
        quote!(grad_acum = 2, precision = "fp8"),
        quote!(
            fn f() -> Result<()> {
                Ok(())
            }
        ),
    );
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert!(errs[0].contains("did you mean `grad_accum`"), "{errs:?}");
    assert!(errs[1].contains("unknown precision"), "{errs:?}");
}

#[test]
fn signature_and_body_errors_are_reported_together() {
    let errs = errors(
        quote!(grad_accum = 2),
        quote! {
            async fn f(acc: &Accelerator) {
                loss.backward()?;
                opt.step(&g)?;
            }
        },
    );
    assert_eq!(errs.len(), 5, "{errs:?}");
    assert!(errs[0].contains("async fn"));
    assert!(errs[1].contains("&mut Accelerator"));
    assert!(errs[2].contains("return a Result"));
    assert!(errs[3].contains("bind the gradients"));
    assert!(errs[4].contains("outside a loop"));
}

#[test]
fn a_parameter_accelerator_takes_no_keys() {
    let errs = errors(
        quote!(seed = 1),
        quote!(
            fn f(a: &mut ivme::Accelerator) {}
        ),
    );
    assert_eq!(errs.len(), 1);
    assert!(errs[0].contains("configure the Accelerator with its builder"));
}

#[test]
fn other_items_are_rejected_and_kept() {
    let errs = errors(
        quote!(),
        quote!(
            struct S;
        ),
    );
    assert!(errs[0].contains("not on a struct"), "{errs:?}");
}

mod whole;

#[test]
fn async_checkpoints_commit_the_last_save_before_a_created_accelerator_returns() {
    assert_expands(
        quote!(async_checkpoints = true),
        quote!(
            fn f() -> anyhow::Result<u32> {
                if done() {
                    return Ok(1);
                }
                Ok(2)
            }
        ),
        quote! {
            fn f() -> anyhow::Result<u32> {
                #[allow(unused_mut, unused_variables)]
                let mut accelerator = ::ivme::Accelerator::builder()
                    .async_checkpoints(true)
                    .build()?;
                let __ivme_trained = (|| -> anyhow::Result<u32> {
                    if done() {
                        return Ok(1);
                    }
                    Ok(2)
                })();
                if __ivme_trained.is_ok() {
                    accelerator.wait_for_checkpoint()?;
                }
                __ivme_trained
            }
        },
    );
}
