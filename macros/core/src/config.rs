//! The attribute's keys, parsed into typed values that keep their spans and validated in one
//! pass, so a user sees every mistake in the attribute at once. The keys, their aliases and
//! examples are the settings table's (`ivme_settings`); each is found by its row's [`Id`].

use crate::errors::Errors;
use crate::spelling::closest;
#[cfg(test)]
use crate::values::PRECISIONS;
use crate::values::{
    boolean, buffer_mode, flops_per_sample, grad_accum, positive_float, precision, profile_dir,
    project_dir, seconds, seed, snapshot_every, total_limit, zero_stage,
};
use ivme_settings::{self as table, Id};
use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Meta, Token};

#[path = "calls.rs"]
mod calls;

/// Every key the attribute accepts: the settings table's attribute keys, in its order.
pub const KEYS: &[&str] = &table::ATTRIBUTE_KEYS;

/// Names users bring from other training libraries, mapped to ours: `(alias, key)`.
pub const ALIASES: &[(&str, &str)] = &table::ATTRIBUTE_ALIASES;

/// One value from the attribute with the spans errors and generated code point at.
#[derive(Debug, Clone)]
pub(crate) struct Setting<T> {
    pub value: T,
    pub span: Span,
}

/// The validated configuration of one `#[accelerate(...)]`.
#[derive(Debug, Default)]
pub(crate) struct Config {
    pub grad_accum: Option<Setting<usize>>,
    pub precision: Option<Setting<&'static str>>,
    pub clip_grad_norm: Option<Setting<f64>>,
    pub clip_grad_value: Option<Setting<f64>>,
    pub cpu: Option<Setting<bool>>,
    pub seed: Option<Setting<u64>>,
    pub project_dir: Option<Setting<String>>,
    pub total_limit: Option<Setting<usize>>,
    pub collective_timeout: Option<Setting<f64>>,
    pub debug_sync: Option<Setting<bool>>,
    pub async_checkpoints: Option<Setting<bool>>,
    pub snapshot_every: Option<Setting<u64>>,
    pub zero: Option<Setting<u8>>,
    pub buffers: Option<Setting<&'static str>>,
    pub profile: Option<Setting<String>>,
    pub flops_per_sample: Option<Setting<f64>>,
    pub overlap: Option<Setting<bool>>,
    pub activation_checkpointing: Option<Setting<bool>>,
    /// The key names as written, for errors about the attribute as a whole.
    pub keys: Vec<syn::Path>,
}

impl Config {
    /// Whether the attribute asked for checkpoints saved in the background.
    pub fn async_checkpoints(&self) -> bool {
        self.async_checkpoints.as_ref().is_some_and(|s| s.value)
    }

    /// True when the attribute fixes the precision to f32 (`precision = "no"`), which no
    /// launcher flag or config file can change at run time (code wins).
    pub fn precision_is_f32(&self) -> bool {
        matches!(&self.precision, Some(p) if p.value == "no")
    }
}

/// The attribute key of a row that has one.
fn key(row: &table::Setting) -> &'static str {
    row.attribute.unwrap_or(row.name)
}

/// Parses and validates the attribute's arguments; every problem found is in the error.
pub(crate) fn parse(attr: TokenStream) -> Result<Config, syn::Error> {
    let metas = Punctuated::<Meta, Token![,]>::parse_terminated.parse2(attr)?;
    let mut config = Config::default();
    let mut errors = Errors::default();
    for meta in metas {
        let nv = match meta {
            Meta::NameValue(nv) => nv,
            Meta::Path(path) => {
                errors.push(missing_value(&path));
                continue;
            }
            Meta::List(list) => {
                errors.push(syn::Error::new_spanned(
                    &list.path,
                    format!(
                        "write `{} = value`, not a list",
                        quote!(#list.path).to_string().replace(' ', "")
                    ),
                ));
                continue;
            }
        };
        let Some(key) = nv.path.get_ident().map(|i| i.to_string()) else {
            errors.push(unknown_key(&nv.path, &quote!(#nv.path).to_string()));
            continue;
        };
        let Some(row) = table::Setting::by_attribute(&key) else {
            errors.push(unknown_key(&nv.path, &key));
            continue;
        };
        if config.keys.iter().any(|k| k.is_ident(&key)) {
            errors.push(syn::Error::new_spanned(
                &nv.path,
                format!("`{key}` is set twice in this attribute; keep one"),
            ));
            continue;
        }
        let clip_other = match row.id {
            Id::ClipGradNorm => Some(self::key(&table::CLIP_GRAD_VALUE)),
            Id::ClipGradValue => Some(self::key(&table::CLIP_GRAD_NORM)),
            _ => None,
        };
        if let Some(other) = clip_other {
            if config.keys.iter().any(|k| k.is_ident(other)) {
                errors.push(syn::Error::new_spanned(
                    &nv.path,
                    format!(
                        "`{key}` conflicts with `{other}`: gradients are clipped either by \
                         global norm or by value, so set only one of them"
                    ),
                ));
                continue;
            }
        }
        config.keys.push(nv.path.clone());
        if let Err(e) = take(&mut config, row, &nv.value) {
            errors.push(e);
        }
    }
    if let (Some(limit), None) = (&config.total_limit, &config.project_dir) {
        errors.push(syn::Error::new(
            limit.span,
            format!(
                "`{}` keeps the newest checkpoints of a project: add `{} = \"..\"`",
                key(&table::TOTAL_LIMIT),
                key(&table::PROJECT_DIR)
            ),
        ));
    }
    if let (Some(a), Some(z)) = (&config.activation_checkpointing, &config.zero) {
        if !a.value && z.value == 3 {
            errors.push(syn::Error::new(
                a.span,
                format!(
                    "`{} = 3` gathers each block's weights for its checkpointed segment and \
                     frees them after, so it needs activation checkpointing (which it turns \
                     on): remove `{} = false`, or use `{} = 2`",
                    key(&table::SHARDING),
                    key(&table::ACTIVATION_CHECKPOINTING),
                    key(&table::SHARDING)
                ),
            ));
        }
    }
    if let (Some(o), Some(z)) = (&config.overlap, &config.zero) {
        if o.value && z.value > 0 {
            errors.push(syn::Error::new(
                o.span,
                format!(
                    "`{} = true` steps a replicated model's optimizer inside `backward`; under \
                     `{}` the sharded step already runs there: remove one of them",
                    key(&table::OVERLAP),
                    key(&table::SHARDING)
                ),
            ));
        }
    }
    errors.finish()?;
    Ok(config)
}

/// Reads `value` as the row's key wants it into its field of `config`.
fn take(config: &mut Config, row: &table::Setting, value: &syn::Expr) -> syn::Result<()> {
    let span = value.span();
    let key = key(row);
    match row.id {
        Id::GradAccum => grad_accum(row, value).map(|v| config.grad_accum = setting(v, span)),
        Id::Precision => precision(value).map(|v| config.precision = setting(v, span)),
        Id::ClipGradNorm => {
            positive_float(row, value).map(|v| config.clip_grad_norm = setting(v, span))
        }
        Id::ClipGradValue => {
            positive_float(row, value).map(|v| config.clip_grad_value = setting(v, span))
        }
        Id::Cpu => boolean(key, value).map(|v| config.cpu = setting(v, span)),
        Id::ProjectDir => project_dir(value).map(|v| config.project_dir = setting(v, span)),
        Id::TotalLimit => total_limit(row, value).map(|v| config.total_limit = setting(v, span)),
        Id::CollectiveTimeout => {
            seconds(key, value).map(|v| config.collective_timeout = setting(v, span))
        }
        Id::DebugSync => boolean(key, value).map(|v| config.debug_sync = setting(v, span)),
        Id::Overlap => boolean(key, value).map(|v| config.overlap = setting(v, span)),
        Id::ActivationCheckpointing => {
            boolean(key, value).map(|v| config.activation_checkpointing = setting(v, span))
        }
        Id::AsyncCheckpoints => {
            boolean(key, value).map(|v| config.async_checkpoints = setting(v, span))
        }
        Id::SnapshotEvery => {
            snapshot_every(value).map(|v| config.snapshot_every = setting(v, span))
        }
        Id::Sharding => zero_stage(value).map(|v| config.zero = setting(v, span)),
        Id::Buffers => buffer_mode(value).map(|v| config.buffers = setting(v, span)),
        Id::Profile => profile_dir(value).map(|v| config.profile = setting(v, span)),
        Id::FlopsPerSample => {
            flops_per_sample(value).map(|v| config.flops_per_sample = setting(v, span))
        }
        Id::Seed => seed(value).map(|v| config.seed = setting(v, span)),
        // Only rows with an attribute key get here; a new one needs its parser above.
        _ => Err(syn::Error::new_spanned(
            value,
            format!("`{key}` is not read by this version of the attribute"),
        )),
    }
}

fn setting<T>(value: T, span: Span) -> Option<Setting<T>> {
    Some(Setting { value, span })
}

fn unknown_key(path: &syn::Path, key: &str) -> syn::Error {
    let alias = ALIASES
        .iter()
        .find(|(from, _)| *from == key)
        .map(|(_, to)| *to);
    let msg = match alias.or_else(|| closest(key, KEYS)) {
        Some(k) => format!("unknown key `{key}`; did you mean `{k}`?"),
        None => format!("unknown key `{key}`; the keys are: {}", KEYS.join(", ")),
    };
    syn::Error::new_spanned(path, msg)
}

fn missing_value(path: &syn::Path) -> syn::Error {
    let key = quote!(#path).to_string().replace(' ', "");
    match table::Setting::by_attribute(&key) {
        Some(row) => syn::Error::new_spanned(
            path,
            format!("`{key}` needs a value, e.g. `{key} = {}`", row.example),
        ),
        None => unknown_key(path, &key),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors_of(attr: TokenStream) -> Vec<String> {
        match parse(attr) {
            Ok(_) => vec![],
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    #[test]
    fn typos_get_a_suggestion_and_strangers_get_the_list() {
        assert_eq!(closest("precison", KEYS), Some("precision"));
        assert_eq!(closest("f16", PRECISIONS), Some("fp16"));
        assert_eq!(closest("learning_rate", KEYS), None);
    }

    #[test]
    fn valid_keys_parse_into_typed_values() {
        let c = parse(quote!(
            grad_accum = 4,
            precision = "bf16",
            clip_grad_norm = 1,
            cpu = true,
            seed = 7
        ))
        .unwrap();
        assert_eq!(c.grad_accum.unwrap().value, 4);
        assert_eq!(c.precision.unwrap().value, "bf16");
        assert_eq!(c.clip_grad_norm.unwrap().value, 1.0);
        assert!(c.cpu.unwrap().value);
        assert_eq!(c.seed.unwrap().value, 7);
    }

    #[test]
    fn every_error_is_reported_together() {
        let errs = errors_of(quote!(
            grad_accum = 0,
            precision = "fp8",
            seeed = 1,
            clip_grad_value = -1.0
        ));
        assert_eq!(errs.len(), 4, "{errs:?}");
        assert!(errs[0].contains("at least 1"));
        assert!(errs[1].contains("\"no\", \"fp16\", \"bf16\""));
        assert!(errs[2].contains("did you mean `seed`"));
        assert!(errs[3].contains("positive"));
    }

    #[test]
    fn duplicates_and_conflicts_are_errors() {
        let errs = errors_of(quote!(
            seed = 1,
            seed = 2,
            clip_grad_norm = 1.0,
            clip_grad_value = 1.0
        ));
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(errs[0].contains("set twice"));
        assert!(errs[1].contains("conflicts"));
    }

    #[test]
    fn negative_numbers_are_out_of_range_not_too_large() {
        // Built the way rustc hands `-3` to an attribute: a `-` then a literal.
        let errs = errors_of(quote!(grad_accum = -3, seed = -1, clip_grad_norm = -0.5));
        assert_eq!(errs.len(), 3, "{errs:?}");
        assert!(errs[0].contains("at least 1"), "{errs:?}");
        assert!(errs[1].contains("must not be negative"), "{errs:?}");
        assert!(errs[2].contains("positive"), "{errs:?}");
    }

    #[test]
    fn async_checkpoints_is_a_boolean_that_becomes_its_builder_call() {
        let c = parse(quote!(project_dir = "runs/a", async_checkpoints = true)).unwrap();
        assert!(c.async_checkpoints.as_ref().unwrap().value);
        let calls = c.builder_calls().to_string();
        assert!(calls.ends_with(". async_checkpoints (true)"), "{calls}");
        let errs = errors_of(quote!(async_checkpoints = "yes", debug_sync = 1));
        assert_eq!(
            errs,
            [
                "`async_checkpoints` takes `true` or `false`",
                "`debug_sync` takes `true` or `false`"
            ]
        );
    }

    #[test]
    fn profile_and_flops_become_their_builder_calls_and_bad_values_are_refused() {
        let c = parse(quote!(profile = "runs/p", flops_per_sample = 6e9)).unwrap();
        let calls = c.builder_calls().to_string();
        assert!(calls.contains(". profile (\"runs/p\")"), "{calls}");
        assert!(calls.contains(". flops_per_sample (6000000000"), "{calls}");
        let errs = errors_of(quote!(profile = 3, flops_per_sample = -1.0));
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(
            errs[0].contains("`profile` takes a non-empty string"),
            "{errs:?}"
        );
        assert!(
            errs[1].contains("`flops_per_sample` must be a positive"),
            "{errs:?}"
        );
        let errs = errors_of(quote!(profile_dir = "p"));
        assert!(errs[0].contains("did you mean `profile`?"), "{errs:?}");
    }

    #[test]
    fn activation_checkpointing_is_a_boolean_that_becomes_its_builder_call() {
        let c = parse(quote!(activation_checkpointing = true)).unwrap();
        let calls = c.builder_calls().to_string();
        assert!(
            calls.contains(". activation_checkpointing (true)"),
            "{calls}"
        );
        let errs = errors_of(quote!(activation_checkpointing = "yes"));
        assert!(
            errs[0].contains("`activation_checkpointing` takes `true` or `false`"),
            "{errs:?}"
        );
        let errs = errors_of(quote!(activation_checkpoint = true));
        assert!(
            errs[0].contains("did you mean `activation_checkpointing`?"),
            "{errs:?}"
        );
    }

    #[test]
    fn overlap_is_a_boolean_that_becomes_its_builder_call_and_refuses_zero() {
        let c = parse(quote!(overlap = true, zero = 0)).unwrap();
        let calls = c.builder_calls().to_string();
        assert!(calls.contains(". overlap (true)"), "{calls}");
        let errs = errors_of(quote!(overlap = true, zero = 2));
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].contains("under `zero`"), "{errs:?}");
        let errs = errors_of(quote!(overlap = 1));
        assert!(
            errs[0].contains("`overlap` takes `true` or `false`"),
            "{errs:?}"
        );
    }

    #[test]
    fn snapshot_every_is_a_step_count_that_becomes_its_builder_call() {
        let c = parse(quote!(snapshot_every = 5)).unwrap();
        let calls = c.builder_calls().to_string();
        assert!(calls.ends_with(". snapshot_every (5)"), "{calls}");
        let errs = errors_of(quote!(snapshot_every = -1));
        assert!(
            errs[0].contains("whole number of optimizer steps"),
            "{errs:?}"
        );
        let errs = errors_of(quote!(snapshot_every));
        assert!(errs[0].contains("snapshot_every = 10"), "{errs:?}");
    }

    #[test]
    fn aliases_from_other_libraries_point_to_our_key() {
        let errs = errors_of(quote!(gradient_accumulation_steps = 2));
        assert!(errs[0].contains("did you mean `grad_accum`"), "{errs:?}");
    }

    #[test]
    fn buffers_is_a_mode_that_becomes_its_builder_call() {
        for (mode, variant) in [
            ("broadcast", "Broadcast"),
            ("average", "Average"),
            ("local", "Local"),
        ] {
            let calls = parse(quote!(buffers = #mode))
                .unwrap()
                .builder_calls()
                .to_string();
            assert!(
                calls.ends_with(&format!(". buffers (:: ivme :: BufferSync :: {variant})")),
                "{calls}"
            );
        }
        let errs = errors_of(quote!(buffers = "averge"));
        assert!(errs[0].contains("did you mean \"average\""), "{errs:?}");
        let errs = errors_of(quote!(buffers = average));
        assert!(errs[0].contains("`buffers` takes a string"), "{errs:?}");
    }

    #[test]
    fn zero_is_a_stage_that_becomes_the_sharding_builder_call() {
        let stages = [
            (0u8, "No"),
            (1, "Optimizer"),
            (2, "Gradients"),
            (3, "Parameters"),
        ];
        for (stage, variant) in stages {
            let lit = proc_macro2::Literal::u8_unsuffixed(stage);
            let calls = parse(quote!(zero = #lit))
                .unwrap()
                .builder_calls()
                .to_string();
            assert!(
                calls.ends_with(&format!(". sharding (:: ivme :: Sharding :: {variant})")),
                "{calls}"
            );
        }
        let errs = errors_of(quote!(zero = 4));
        assert!(errs[0].contains("must be 0, 1, 2 or 3"), "{errs:?}");
        let errs = errors_of(quote!(zero = 3, activation_checkpointing = false));
        assert!(
            errs[0].contains("needs activation checkpointing"),
            "{errs:?}"
        );
        assert!(parse(quote!(zero = 3, activation_checkpointing = true)).is_ok());
        let errs = errors_of(quote!(zero = "2"));
        assert!(errs[0].contains("e.g. `zero = 2`"), "{errs:?}");
        let errs = errors_of(quote!(zero_stage = 2));
        assert!(errs[0].contains("did you mean `zero`"), "{errs:?}");
    }
}
