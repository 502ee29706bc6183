//! The attribute's keys, parsed into typed values that keep their spans and validated in one
//! pass, so a user sees every mistake in the attribute at once.

use crate::errors::Errors;
use crate::spelling::closest;
use crate::values::{
    boolean, buffer_mode, flops_per_sample, grad_accum, positive_float, precision, profile_dir,
    project_dir, seconds, seed, snapshot_every, total_limit, zero_stage, PRECISIONS,
};
use proc_macro2::{Literal, Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Meta, Token};

/// Every key the attribute accepts, in the order the builder calls are emitted.
pub const KEYS: &[&str] = &[
    "grad_accum",
    "precision",
    "clip_grad_norm",
    "clip_grad_value",
    "cpu",
    "seed",
    "project_dir",
    "total_limit",
    "collective_timeout",
    "debug_sync",
    "async_checkpoints",
    "snapshot_every",
    "zero",
    "buffers",
    "profile",
    "flops_per_sample",
    "overlap",
];

/// Names users bring from other training libraries, mapped to ours.
pub const ALIASES: &[(&str, &str)] = &[
    ("gradient_accumulation_steps", "grad_accum"),
    ("mixed_precision", "precision"),
    ("max_grad_norm", "clip_grad_norm"),
    ("zero_stage", "zero"),
    ("sharding", "zero"),
    ("broadcast_buffers", "buffers"),
    ("profile_dir", "profile"),
];

/// The `ivme::Precision` variant of each of [`PRECISIONS`], in the same order.
const PRECISION_VARIANTS: &[&str] = &["No", "Fp16", "Bf16"];

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

    /// The builder calls between `Accelerator::builder()` and `.build()`, each spanned on the
    /// user's value so a type error points at the attribute.
    pub fn builder_calls(&self) -> TokenStream {
        let mut calls = TokenStream::new();
        if let Some(s) = &self.grad_accum {
            let v = spanned_lit(Literal::usize_unsuffixed(s.value), s.span);
            calls.extend(quote_spanned!(s.span=> .grad_accum(#v)));
        }
        if let Some(s) = &self.precision {
            let at = PRECISIONS.iter().position(|p| *p == s.value).unwrap_or(0);
            let variant = syn::Ident::new(PRECISION_VARIANTS[at], s.span);
            calls.extend(quote_spanned!(s.span=> .precision(::ivme::Precision::#variant)));
        }
        if let Some(s) = &self.clip_grad_norm {
            let v = spanned_lit(Literal::f64_unsuffixed(s.value), s.span);
            calls.extend(quote_spanned!(s.span=> .clip_grad_norm(#v)));
        }
        if let Some(s) = &self.clip_grad_value {
            let v = spanned_lit(Literal::f64_unsuffixed(s.value), s.span);
            calls.extend(quote_spanned!(s.span=> .clip_grad_value(#v)));
        }
        if let Some(s) = &self.cpu {
            let v = syn::LitBool::new(s.value, s.span);
            calls.extend(quote_spanned!(s.span=> .cpu(#v)));
        }
        if let Some(s) = &self.seed {
            let v = spanned_lit(Literal::u64_unsuffixed(s.value), s.span);
            calls.extend(quote_spanned!(s.span=> .seed(#v)));
        }
        if let Some(s) = &self.project_dir {
            let v = syn::LitStr::new(&s.value, s.span);
            calls.extend(quote_spanned!(s.span=> .project_dir(#v)));
        }
        if let Some(s) = &self.total_limit {
            let v = spanned_lit(Literal::usize_unsuffixed(s.value), s.span);
            calls.extend(quote_spanned!(s.span=> .total_limit(#v)));
        }
        if let Some(s) = &self.collective_timeout {
            let v = spanned_lit(Literal::f64_unsuffixed(s.value), s.span);
            calls.extend(quote_spanned!(s.span=>
                .collective_timeout(::std::time::Duration::from_secs_f64(#v))));
        }
        if let Some(s) = &self.debug_sync {
            let v = syn::LitBool::new(s.value, s.span);
            calls.extend(quote_spanned!(s.span=> .debug_sync(#v)));
        }
        if let Some(s) = &self.overlap {
            let v = syn::LitBool::new(s.value, s.span);
            calls.extend(quote_spanned!(s.span=> .overlap(#v)));
        }
        if let Some(s) = &self.async_checkpoints {
            let v = syn::LitBool::new(s.value, s.span);
            calls.extend(quote_spanned!(s.span=> .async_checkpoints(#v)));
        }
        if let Some(s) = &self.snapshot_every {
            let v = spanned_lit(Literal::u64_unsuffixed(s.value), s.span);
            calls.extend(quote_spanned!(s.span=> .snapshot_every(#v)));
        }
        if let Some(s) = &self.zero {
            let variant = syn::Ident::new(
                match s.value {
                    1 => "Optimizer",
                    2 => "Gradients",
                    _ => "No",
                },
                s.span,
            );
            calls.extend(quote_spanned!(s.span=> .sharding(::ivme::Sharding::#variant)));
        }
        if let Some(s) = &self.buffers {
            let variant = syn::Ident::new(
                match s.value {
                    "average" => "Average",
                    "local" => "Local",
                    _ => "Broadcast",
                },
                s.span,
            );
            calls.extend(quote_spanned!(s.span=> .buffers(::ivme::BufferSync::#variant)));
        }
        if let Some(s) = &self.profile {
            let v = syn::LitStr::new(&s.value, s.span);
            calls.extend(quote_spanned!(s.span=> .profile(#v)));
        }
        if let Some(s) = &self.flops_per_sample {
            let v = spanned_lit(Literal::f64_unsuffixed(s.value), s.span);
            calls.extend(quote_spanned!(s.span=> .flops_per_sample(#v)));
        }
        calls
    }
}

fn spanned_lit(mut lit: Literal, span: Span) -> Literal {
    lit.set_span(span);
    lit
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
        if !KEYS.contains(&key.as_str()) {
            errors.push(unknown_key(&nv.path, &key));
            continue;
        }
        if config.keys.iter().any(|k| k.is_ident(&key)) {
            errors.push(syn::Error::new_spanned(
                &nv.path,
                format!("`{key}` is set twice in this attribute; keep one"),
            ));
            continue;
        }
        let clip_other = match key.as_str() {
            "clip_grad_norm" => Some("clip_grad_value"),
            "clip_grad_value" => Some("clip_grad_norm"),
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
        let value = &nv.value;
        let span = value.span();
        let result = match key.as_str() {
            "grad_accum" => grad_accum(value).map(|v| config.grad_accum = setting(v, span)),
            "precision" => precision(value).map(|v| config.precision = setting(v, span)),
            "clip_grad_norm" => {
                positive_float(&key, value).map(|v| config.clip_grad_norm = setting(v, span))
            }
            "clip_grad_value" => {
                positive_float(&key, value).map(|v| config.clip_grad_value = setting(v, span))
            }
            "cpu" => boolean(&key, value).map(|v| config.cpu = setting(v, span)),
            "project_dir" => project_dir(value).map(|v| config.project_dir = setting(v, span)),
            "total_limit" => total_limit(value).map(|v| config.total_limit = setting(v, span)),
            "collective_timeout" => {
                seconds(&key, value).map(|v| config.collective_timeout = setting(v, span))
            }
            "debug_sync" => boolean(&key, value).map(|v| config.debug_sync = setting(v, span)),
            "overlap" => boolean(&key, value).map(|v| config.overlap = setting(v, span)),
            "async_checkpoints" => {
                boolean(&key, value).map(|v| config.async_checkpoints = setting(v, span))
            }
            "snapshot_every" => {
                snapshot_every(value).map(|v| config.snapshot_every = setting(v, span))
            }
            "zero" => zero_stage(value).map(|v| config.zero = setting(v, span)),
            "buffers" => buffer_mode(value).map(|v| config.buffers = setting(v, span)),
            "profile" => profile_dir(value).map(|v| config.profile = setting(v, span)),
            "flops_per_sample" => {
                flops_per_sample(value).map(|v| config.flops_per_sample = setting(v, span))
            }
            _ => seed(value).map(|v| config.seed = setting(v, span)),
        };
        if let Err(e) = result {
            errors.push(e);
        }
    }
    if let (Some(limit), None) = (&config.total_limit, &config.project_dir) {
        errors.push(syn::Error::new(
            limit.span,
            "`total_limit` keeps the newest checkpoints of a project: add `project_dir = \"..\"`",
        ));
    }
    if let (Some(o), Some(z)) = (&config.overlap, &config.zero) {
        if o.value && z.value > 0 {
            errors.push(syn::Error::new(
                o.span,
                "`overlap = true` steps a replicated model's optimizer inside `backward`; under \
                 `zero` the sharded step already runs there: remove one of them",
            ));
        }
    }
    errors.finish()?;
    Ok(config)
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
    let example = match key.as_str() {
        "grad_accum" => "grad_accum = 2",
        "precision" => "precision = \"bf16\"",
        "clip_grad_norm" => "clip_grad_norm = 1.0",
        "clip_grad_value" => "clip_grad_value = 0.5",
        "cpu" => "cpu = true",
        "seed" => "seed = 42",
        "project_dir" => "project_dir = \"runs/demo\"",
        "total_limit" => "total_limit = 3",
        "collective_timeout" => "collective_timeout = 600",
        "debug_sync" => "debug_sync = true",
        "overlap" => "overlap = true",
        "async_checkpoints" => "async_checkpoints = true",
        "snapshot_every" => "snapshot_every = 10",
        "zero" => "zero = 2",
        "buffers" => "buffers = \"average\"",
        "profile" => "profile = \"runs/profile\"",
        "flops_per_sample" => "flops_per_sample = 6e9",
        _ => return unknown_key(path, &key),
    };
    syn::Error::new_spanned(path, format!("`{key}` needs a value, e.g. `{example}`"))
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
        for (stage, variant) in [(0u8, "No"), (1, "Optimizer"), (2, "Gradients")] {
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
        let errs = errors_of(quote!(zero = 3));
        assert!(errs[0].contains("must be 0, 1 or 2"), "{errs:?}");
        let errs = errors_of(quote!(zero = "2"));
        assert!(errs[0].contains("e.g. `zero = 2`"), "{errs:?}");
        let errs = errors_of(quote!(zero_stage = 2));
        assert!(errs[0].contains("did you mean `zero`"), "{errs:?}");
    }
}
