//! `ivme expand FILE [FUNCTION]`: prints what `#[accelerate]` writes for the functions of a
//! source file, in milliseconds and without compiling anything.
//!
//! The attribute's rewrites are syntactic (macros/macro.md), so running the attribute's own
//! expansion (`ivme-macros-core`, the code the compiler runs) over the parsed file gives
//! exactly what `cargo expand` shows for those functions, without rebuilding every dependency.
//! Mistakes are reported as the compiler would, with the file, line and column of each.

use crate::cli;
use clap::Parser;
use ivme::{Error, Result};
use proc_macro2::TokenStream;
use quote::quote;
use std::path::Path;

/// The subcommand's name.
pub const COMMAND: &str = "expand";

/// Print what `#[accelerate]` writes for a source file's functions, without compiling.
#[derive(Parser, Debug)]
#[command(
    after_help = "The same rewriting the compiler runs. Mistakes in the attribute are \
                        reported with their line and column, and the command exits with status 1."
)]
struct Flags {
    /// the source file
    #[arg(value_name = "FILE")]
    file: Option<String>,
    /// only this function (default: every function under the attribute)
    #[arg(value_name = "FUNCTION")]
    function: Option<String>,
}

/// One function under the attribute, as found in the file.
struct Annotated {
    name: String,
    line: usize,
    attr: TokenStream,
    func: syn::ItemFn,
}

/// Runs `ivme expand` with the words after the command name.
pub fn main(words: &[String]) -> Result<i32> {
    let Some(flags) = cli::read::<Flags>(COMMAND, words)? else {
        return Ok(0);
    };
    let Some(file) = &flags.file else {
        return Err(Error::Usage(format!(
            "expected a file, e.g. `ivme {COMMAND} src/main.rs`; run `ivme {COMMAND} --help`"
        )));
    };
    let only = flags.function.as_deref();
    let path = Path::new(file);
    let source = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let parsed = syn::parse_file(&source).map_err(|e| {
        Error::Usage(format!(
            "{}: not valid Rust: {e}",
            located(path, e.span().start())
        ))
    })?;
    let mut found = Vec::new();
    collect(&parsed.items, &mut found);
    let names: Vec<String> = found.iter().map(|a| a.name.clone()).collect();
    if let Some(name) = only {
        found.retain(|a| a.name == name);
    }
    if found.is_empty() {
        let what = only.map_or(String::new(), |n| format!(" named `{n}`"));
        let listed = if names.is_empty() {
            String::new()
        } else {
            format!(" (it has: {})", names.join(", "))
        };
        return Err(Error::Usage(format!(
            "{} has no function{what} under #[accelerate]{listed}",
            path.display()
        )));
    }
    let mut failed = false;
    for a in found {
        let func = &a.func;
        match ivme_macros_core::try_expand(a.attr.clone(), quote!(#func)) {
            Ok(tokens) => {
                let item: syn::File = syn::parse2(tokens).map_err(|e| {
                    Error::Usage(format!("the expansion of `{}` does not parse: {e}", a.name))
                })?;
                println!(
                    "// {}:{}: `fn {}` as #[accelerate] writes it",
                    path.display(),
                    a.line,
                    a.name
                );
                println!("{}", prettyplease::unparse(&item));
            }
            Err(errors) => {
                failed = true;
                for e in errors {
                    eprintln!("{}: error: {e}", located(path, e.span().start()));
                }
            }
        }
    }
    Ok(i32::from(failed))
}

fn located(path: &Path, at: proc_macro2::LineColumn) -> String {
    format!("{}:{}:{}", path.display(), at.line, at.column + 1)
}

/// Every function under an attribute whose path ends in `accelerate`, in file order, through
/// inline modules and impl blocks.
fn collect(items: &[syn::Item], out: &mut Vec<Annotated>) {
    for item in items {
        match item {
            syn::Item::Fn(f) => push(f.clone(), out),
            syn::Item::Mod(m) => {
                if let Some((_, inner)) = &m.content {
                    collect(inner, out);
                }
            }
            syn::Item::Impl(i) => {
                for member in &i.items {
                    if let syn::ImplItem::Fn(f) = member {
                        push(
                            syn::ItemFn {
                                attrs: f.attrs.clone(),
                                vis: f.vis.clone(),
                                sig: f.sig.clone(),
                                block: Box::new(f.block.clone()),
                            },
                            out,
                        );
                    }
                }
            }
            _ => {}
        }
    }
}

fn push(mut func: syn::ItemFn, out: &mut Vec<Annotated>) {
    let Some(at) = func.attrs.iter().position(|a| {
        a.path()
            .segments
            .last()
            .is_some_and(|s| s.ident == "accelerate")
    }) else {
        return;
    };
    let attr = func.attrs.remove(at);
    let line = attr.pound_token.span.start().line;
    let attr = match attr.meta {
        syn::Meta::List(l) => l.tokens,
        syn::Meta::Path(_) => TokenStream::new(),
        // `#[accelerate = ..]`: handed over whole, for the attribute's own error.
        syn::Meta::NameValue(nv) => quote!(#nv),
    };
    out.push(Annotated {
        name: func.sig.ident.to_string(),
        line,
        attr,
        func,
    });
}
