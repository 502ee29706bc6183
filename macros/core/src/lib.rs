//! The expansion of `#[accelerate(...)]` over `proc_macro2` tokens: the rewrite rules of
//! `macros/macro.md`, shared by the attribute (the `ivme-macros` crate) and by `ivme expand`,
//! which prints what the attribute writes without compiling anything.

mod config;
pub use config::{ALIASES, KEYS};
mod spelling;
pub use ivme_settings::spelling::edit_distance;
pub use values::BUFFER_MODES;
pub use values::PRECISIONS;
mod errors;
mod rewrite;
mod signature;
mod values;

#[cfg(test)]
mod snapshots;

use errors::Errors;
use proc_macro2::{Span, TokenStream};
use quote::quote;
use signature::Source;
use syn::visit_mut::VisitMut;
use syn::{parse_quote, Item, ItemFn};

/// Expands `#[accelerate(attr)]` on `item`: the function the compiler gets.
///
/// On any error it returns the user's item unchanged followed by the `compile_error!`s, so
/// the rest of the crate (and the IDE) still sees the function.
pub fn expand(attr: TokenStream, item: TokenStream) -> TokenStream {
    try_expand(attr, item.clone()).unwrap_or_else(|e| with_errors(e, item))
}

/// Expands `#[accelerate(attr)]` on `item`, or returns every error it finds (combined into
/// one `syn::Error`, each with its span), for tools that report them themselves.
pub fn try_expand(attr: TokenStream, item: TokenStream) -> Result<TokenStream, syn::Error> {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(_) => return Err(not_a_function(&item)),
    };
    let mut errors = Errors::default();
    let config = config::parse(attr.clone()).unwrap_or_else(|e| {
        errors.push(e);
        config::Config::default()
    });
    let source = signature::inspect(&func.sig, &config, &attr, &mut errors);

    // Only `precision = "no"` lets a created accelerator skip the scopes, which do nothing in
    // f32: without the key the launcher or config file may still set bf16/fp16 at run time,
    // and the batch must then be cast. A passed-in one may have any precision: scopes stay.
    let autocast = matches!(source, Source::Param(_)) || !config.precision_is_f32();
    let mut rewriter = rewrite::Rewriter::new(source.ident().clone(), autocast);
    let mut body = (*func.block).clone();
    rewriter.visit_block_mut(&mut body);
    let used_autocast = rewriter.used_autocast;
    if let Err(e) = rewriter.finish() {
        errors.push(e);
    }
    errors.finish()?;

    let mut prologue: Vec<syn::Stmt> = Vec::new();
    if let Source::Created(acc) = &source {
        let calls = config.builder_calls();
        prologue.push(parse_quote! {
            #[allow(unused_mut, unused_variables)]
            let mut #acc = ::ivme::Accelerator::builder() #calls .build()?;
        });
    }
    if used_autocast {
        let acc = source.ident();
        let scope = rewrite::scope_binding();
        prologue.push(parse_quote! {
            let #scope = #acc.autocast_scope();
        });
    }
    if let (Source::Created(acc), true) = (&source, config.async_checkpoints()) {
        commit_before_returning(&mut body, acc, &func.sig);
    }
    body.stmts.splice(0..0, prologue);
    let mut func = func;
    *func.block = body;
    Ok(quote!(#func))
}

/// With `async_checkpoints = true` and an Accelerator the attribute created, the last save
/// may still be writing when the body returns: the body runs as a closure, and a successful
/// result is returned only once that save committed, so a failed commit is the function's
/// error rather than a message from the Accelerator's drop. (An `async fn` or an `impl Trait`
/// return type cannot be named on a closure; those keep the drop as their wait point.)
fn commit_before_returning(body: &mut syn::Block, acc: &syn::Ident, sig: &syn::Signature) {
    let syn::ReturnType::Type(_, ret) = &sig.output else {
        return;
    };
    if sig.asyncness.is_some() || mentions_impl_trait(ret) {
        return;
    }
    let stmts = std::mem::take(&mut body.stmts);
    let wrapped: syn::Block = parse_quote! {{
        let __ivme_trained = (|| -> #ret { #(#stmts)* })();
        if __ivme_trained.is_ok() {
            #acc.wait_for_checkpoint()?;
        }
        __ivme_trained
    }};
    body.stmts = wrapped.stmts;
}

/// Whether `ty` holds an `impl Trait` anywhere (`impl Future`, `Result<impl Iterator, E>`):
/// such a type cannot be written on a closure. Read through syn, so a type merely named like
/// one (`Simple`, `implementation::Out`) does not count.
fn mentions_impl_trait(ty: &syn::Type) -> bool {
    struct Finder(bool);
    impl<'ast> syn::visit::Visit<'ast> for Finder {
        fn visit_type_impl_trait(&mut self, _: &'ast syn::TypeImplTrait) {
            self.0 = true;
        }
    }
    let mut finder = Finder(false);
    syn::visit::Visit::visit_type(&mut finder, ty);
    finder.0
}

fn with_errors(error: syn::Error, item: TokenStream) -> TokenStream {
    let errors = error.to_compile_error();
    quote!(#errors #item)
}

/// The error for an attribute placed on something other than a function with a body, spanned
/// on the item's keyword (or the attribute when the item does not parse).
fn not_a_function(item: &TokenStream) -> syn::Error {
    let (kind, span) = match syn::parse2::<Item>(item.clone()) {
        Ok(Item::Struct(s)) => ("a struct", s.struct_token.span),
        Ok(Item::Enum(e)) => ("an enum", e.enum_token.span),
        Ok(Item::Impl(i)) => (
            "an impl block (put it on the training method inside)",
            i.impl_token.span,
        ),
        Ok(Item::Mod(m)) => ("a module", m.mod_token.span),
        Ok(Item::Trait(t)) => ("a trait", t.trait_token.span),
        Ok(Item::Const(c)) => ("a constant", c.const_token.span),
        Ok(Item::Static(s)) => ("a static", s.static_token.span),
        Ok(_) => ("this item", Span::call_site()),
        Err(_) => ("a function without a body", Span::call_site()),
    };
    syn::Error::new(
        span,
        format!(
            "#[accelerate] goes on a training function with a body, e.g. \
             `fn train(..) -> candle_core::Result<()> {{ .. }}`, not on {kind}"
        ),
    )
}

#[cfg(test)]
mod impl_trait_tests {
    use super::mentions_impl_trait;

    #[test]
    fn only_a_real_impl_trait_counts() {
        let ty = |t: &str| syn::parse_str::<syn::Type>(t).unwrap();
        assert!(mentions_impl_trait(&ty("impl Iterator<Item = u8>")));
        assert!(mentions_impl_trait(&ty("Result<impl Fn(), Error>")));
        assert!(!mentions_impl_trait(&ty("Result<Simple, Error>")));
        assert!(!mentions_impl_trait(&ty("implementation::Out")));
    }

    #[test]
    fn a_return_type_named_like_impl_still_waits_for_the_last_save() {
        let out = crate::expand(
            quote::quote!(project_dir = "runs/a", async_checkpoints = true),
            quote::quote!(
                fn f() -> Result<Simple, ivme::Error> {
                    Ok(Simple)
                }
            ),
        )
        .to_string();
        assert!(out.contains("__ivme_trained"), "{out}");
    }
}
