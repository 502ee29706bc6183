//! The builder calls an attribute's configuration becomes, each named by its setting's builder
//! method in the settings table and spanned on the user's value.

use super::Config;
use ivme_settings::{self as table, Setting};
use proc_macro2::{Literal, Span, TokenStream};
use quote::quote_spanned;

/// The builder method of `row`, as an identifier spanned at `span`.
fn method(row: &Setting, span: Span) -> syn::Ident {
    syn::Ident::new(row.builder.unwrap_or(row.name), span)
}

fn spanned_lit(mut lit: Literal, span: Span) -> Literal {
    lit.set_span(span);
    lit
}

/// The `ivme::Precision` variant of each of [`crate::PRECISIONS`], in the same order.
const PRECISION_VARIANTS: &[&str] = &["No", "Fp16", "Bf16"];

impl Config {
    /// The builder calls between `Accelerator::builder()` and `.build()`, each spanned on the
    /// user's value so a type error points at the attribute.
    pub fn builder_calls(&self) -> TokenStream {
        let mut calls = TokenStream::new();
        let mut call = |row: &Setting, span: Span, arg: TokenStream| {
            let m = method(row, span);
            calls.extend(quote_spanned!(span=> .#m(#arg)));
        };
        let lit = |l: Literal, span: Span| {
            let l = spanned_lit(l, span);
            quote_spanned!(span=> #l)
        };
        let boolean = |b: bool, span: Span| {
            let b = syn::LitBool::new(b, span);
            quote_spanned!(span=> #b)
        };
        let text = |s: &str, span: Span| {
            let s = syn::LitStr::new(s, span);
            quote_spanned!(span=> #s)
        };
        if let Some(s) = &self.grad_accum {
            call(
                &table::GRAD_ACCUM,
                s.span,
                lit(Literal::usize_unsuffixed(s.value), s.span),
            );
        }
        if let Some(s) = &self.precision {
            let at = crate::PRECISIONS
                .iter()
                .position(|p| *p == s.value)
                .unwrap_or(0);
            let variant = syn::Ident::new(PRECISION_VARIANTS[at], s.span);
            call(
                &table::PRECISION,
                s.span,
                quote_spanned!(s.span=> ::ivme::Precision::#variant),
            );
        }
        if let Some(s) = &self.clip_grad_norm {
            call(
                &table::CLIP_GRAD_NORM,
                s.span,
                lit(Literal::f64_unsuffixed(s.value), s.span),
            );
        }
        if let Some(s) = &self.clip_grad_value {
            call(
                &table::CLIP_GRAD_VALUE,
                s.span,
                lit(Literal::f64_unsuffixed(s.value), s.span),
            );
        }
        if let Some(s) = &self.cpu {
            call(&table::CPU, s.span, boolean(s.value, s.span));
        }
        if let Some(s) = &self.seed {
            call(
                &table::SEED,
                s.span,
                lit(Literal::u64_unsuffixed(s.value), s.span),
            );
        }
        if let Some(s) = &self.project_dir {
            call(&table::PROJECT_DIR, s.span, text(&s.value, s.span));
        }
        if let Some(s) = &self.total_limit {
            call(
                &table::TOTAL_LIMIT,
                s.span,
                lit(Literal::usize_unsuffixed(s.value), s.span),
            );
        }
        if let Some(s) = &self.collective_timeout {
            let v = spanned_lit(Literal::f64_unsuffixed(s.value), s.span);
            let arg = quote_spanned!(s.span=> ::std::time::Duration::from_secs_f64(#v));
            call(&table::COLLECTIVE_TIMEOUT, s.span, arg);
        }
        if let Some(s) = &self.debug_sync {
            call(&table::DEBUG_SYNC, s.span, boolean(s.value, s.span));
        }
        if let Some(s) = &self.overlap {
            call(&table::OVERLAP, s.span, boolean(s.value, s.span));
        }
        if let Some(s) = &self.activation_checkpointing {
            let on = boolean(s.value, s.span);
            call(&table::ACTIVATION_CHECKPOINTING, s.span, on);
        }
        if let Some(s) = &self.async_checkpoints {
            call(&table::ASYNC_CHECKPOINTS, s.span, boolean(s.value, s.span));
        }
        if let Some(s) = &self.snapshot_every {
            call(
                &table::SNAPSHOT_EVERY,
                s.span,
                lit(Literal::u64_unsuffixed(s.value), s.span),
            );
        }
        if let Some(s) = &self.zero {
            let variant = match s.value {
                1 => "Optimizer",
                2 => "Gradients",
                3 => "Parameters",
                _ => "No",
            };
            let variant = syn::Ident::new(variant, s.span);
            call(
                &table::SHARDING,
                s.span,
                quote_spanned!(s.span=> ::ivme::Sharding::#variant),
            );
        }
        if let Some(s) = &self.buffers {
            let variant = match s.value {
                "average" => "Average",
                "local" => "Local",
                _ => "Broadcast",
            };
            let variant = syn::Ident::new(variant, s.span);
            call(
                &table::BUFFERS,
                s.span,
                quote_spanned!(s.span=> ::ivme::BufferSync::#variant),
            );
        }
        if let Some(s) = &self.profile {
            call(&table::PROFILE, s.span, text(&s.value, s.span));
        }
        if let Some(s) = &self.flops_per_sample {
            let arg = lit(Literal::f64_unsuffixed(s.value), s.span);
            call(&table::FLOPS_PER_SAMPLE, s.span, arg);
        }
        calls
    }
}
