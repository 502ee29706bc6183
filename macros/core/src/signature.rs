//! What the function's signature decides: where the `Accelerator` comes from, and whether
//! the function can host the generated code at all.

use crate::config::Config;
use crate::errors::Errors;
use proc_macro2::{Span, TokenStream};
use syn::{FnArg, Ident, Pat, ReturnType, Signature, Type};

/// Where the rewritten body finds its `Accelerator`.
pub(crate) enum Source {
    /// A `&mut Accelerator` parameter with this name.
    Param(Ident),
    /// The macro builds one from the attribute's keys into `let mut accelerator`.
    Created(Ident),
}

impl Source {
    /// The name the generated code calls the accelerator by.
    pub fn ident(&self) -> &Ident {
        match self {
            Source::Param(i) | Source::Created(i) => i,
        }
    }
}

/// Checks the signature and decides the accelerator's source; problems go to `errors`.
pub(crate) fn inspect(
    sig: &Signature,
    config: &Config,
    attr: &TokenStream,
    errors: &mut Errors,
) -> Source {
    if let Some(token) = &sig.asyncness {
        errors.push(syn::Error::new_spanned(
            token,
            "#[accelerate] cannot go on an `async fn`: the training loop runs synchronously; \
             make it a plain `fn` (call it from `spawn_blocking` if you need it from async code)",
        ));
    }
    if let Some(token) = &sig.constness {
        errors.push(syn::Error::new_spanned(
            token,
            "#[accelerate] cannot go on a `const fn`: the rewritten body calls the runtime; \
             remove `const`",
        ));
    }

    let mut param: Option<Ident> = None;
    for arg in &sig.inputs {
        let FnArg::Typed(arg) = arg else { continue };
        let (mutable, is_ref) = match strip(&arg.ty) {
            Type::Reference(r) if is_accelerator(&r.elem) => (r.mutability.is_some(), true),
            ty if is_accelerator(ty) => (false, false),
            _ => continue,
        };
        if !mutable {
            let how = if is_ref {
                "a shared reference"
            } else {
                "value"
            };
            errors.push(syn::Error::new_spanned(
                &arg.ty,
                format!(
                    "take the Accelerator as `&mut Accelerator`, not by {how}: backward and the \
                     optimizer steps update its state, and the caller keeps using it afterwards"
                ),
            ));
            continue;
        }
        let Pat::Ident(pat) = &*arg.pat else {
            errors.push(syn::Error::new_spanned(
                &arg.pat,
                "name the Accelerator parameter (e.g. `accelerator: &mut Accelerator`): the \
                 rewritten body calls it by that name",
            ));
            continue;
        };
        if param.is_some() {
            errors.push(syn::Error::new_spanned(
                &arg.pat,
                "only one `&mut Accelerator` parameter is allowed: a program has one Accelerator",
            ));
            continue;
        }
        param = Some(pat.ident.clone());
    }

    if let Some(ident) = param {
        if !config.keys.is_empty() {
            errors.push(syn::Error::new_spanned(
                attr,
                format!(
                    "the Accelerator comes from the parameter `{ident}`, so the attribute takes \
                     no keys: configure the Accelerator with its builder where you create it, or \
                     remove the parameter"
                ),
            ));
        }
        return Source::Param(ident);
    }

    if !returns_result(&sig.output) {
        let msg = "#[accelerate] creates the Accelerator with `?`: return a Result (e.g. \
                   candle_core::Result<()>) so ivme's errors can propagate, or take an \
                   `accelerator: &mut Accelerator` parameter";
        errors.push(match &sig.output {
            ReturnType::Type(_, ty) => syn::Error::new_spanned(ty, msg),
            ReturnType::Default => syn::Error::new_spanned(&sig.ident, msg),
        });
    }
    Source::Created(Ident::new("accelerator", Span::call_site()))
}

/// Looks through parentheses and invisible groups around a type.
fn strip(ty: &Type) -> &Type {
    match ty {
        Type::Paren(p) => strip(&p.elem),
        Type::Group(g) => strip(&g.elem),
        other => other,
    }
}

/// True for any path whose last segment is `Accelerator` (`Accelerator`, `ivme::Accelerator`).
fn is_accelerator(ty: &Type) -> bool {
    match strip(ty) {
        Type::Path(p) if p.qself.is_none() => p
            .path
            .segments
            .last()
            .is_some_and(|s| s.ident == "Accelerator"),
        _ => false,
    }
}

/// True when the return type's last path segment ends in `Result` (`Result<..>`,
/// `candle_core::Result<()>`, `anyhow::Result<()>`, `io::Result<()>`).
fn returns_result(output: &ReturnType) -> bool {
    let ReturnType::Type(_, ty) = output else {
        return false;
    };
    match strip(ty) {
        Type::Path(p) if p.qself.is_none() => p
            .path
            .segments
            .last()
            .is_some_and(|s| s.ident.to_string().ends_with("Result")),
        _ => false,
    }
}
