//! `#[accelerate(...)]`: turns a plain candle training function into one that runs on ivme's
//! `Accelerator` (device placement, data sharding, gradient sync, accumulation, clipping and
//! mixed precision) by rewriting its body into the runtime calls a user could write by hand.
//!
//! Use it through the runtime crate as `ivme::accelerate`; the rules are documented on the
//! attribute itself and in `macros/macro.md`. The rewriting lives in `ivme-macros-core`, which
//! `ivme expand` shares.

#[doc = include_str!("../macro.md")]
#[proc_macro_attribute]
pub fn accelerate(
    attr: proc_macro::TokenStream,
    item: proc_macro::TokenStream,
) -> proc_macro::TokenStream {
    ivme_macros_core::expand(attr.into(), item.into()).into()
}
