//! Parsers for the attribute's literal values: each returns the typed value or an error
//! spanned on the value that says what to write instead.

use crate::spelling::closest;
use ivme_settings::Setting;
use quote::quote;
use syn::{Expr, Lit, UnOp};

/// The precisions `precision = ".."` accepts: the canonical spellings, which `ivme::Precision`
/// reads and writes too (`Precision::VALID` is this list).
pub const PRECISIONS: &[&str] = &["no", "fp16", "bf16"];

/// The literal inside `value`, and whether it was negated (`-1`).
fn literal(value: &Expr) -> Option<(&Lit, bool)> {
    match value {
        Expr::Lit(l) => Some((&l.lit, false)),
        Expr::Unary(u) if matches!(u.op, UnOp::Neg(_)) => match &*u.expr {
            Expr::Lit(l) => Some((&l.lit, true)),
            _ => None,
        },
        Expr::Group(g) => literal(&g.expr),
        Expr::Paren(p) => literal(&p.expr),
        _ => None,
    }
}

/// `grad_accum = N`: micro-batches per optimizer step, within its row's bound.
pub(crate) fn grad_accum(row: &Setting, value: &Expr) -> syn::Result<usize> {
    let key = row.attribute.unwrap_or(row.name);
    let range = format!(
        "`{key}` must be {}: it is the number of micro-batches summed into each optimizer step",
        row.bound.limit()
    );
    match literal(value) {
        Some((Lit::Int(i), negative)) => {
            // syn folds `-3` in an attribute into one literal with a `-` in its digits.
            let negative = negative || i.base10_digits().starts_with('-');
            if negative {
                return Err(syn::Error::new_spanned(value, range));
            }
            let n: usize = i.base10_parse().map_err(|_| {
                syn::Error::new_spanned(value, format!("`{key}` is too large for a usize"))
            })?;
            if !row.bound.admits(n as f64) {
                return Err(syn::Error::new_spanned(value, range));
            }
            Ok(n)
        }
        _ => Err(syn::Error::new_spanned(
            value,
            format!("`{key}` takes an integer literal, e.g. `{key} = 4`"),
        )),
    }
}

pub(crate) fn precision(value: &Expr) -> syn::Result<&'static str> {
    let valid = PRECISIONS
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join(", ");
    match literal(value) {
        Some((Lit::Str(s), false)) => {
            let v = s.value();
            if let Some(p) = PRECISIONS.iter().find(|p| **p == v) {
                return Ok(p);
            }
            let hint = match closest(&v.to_ascii_lowercase(), PRECISIONS) {
                Some(p) => format!("; did you mean \"{p}\"?"),
                None => String::new(),
            };
            Err(syn::Error::new_spanned(
                value,
                format!("unknown precision \"{v}\": use one of {valid}{hint}"),
            ))
        }
        _ => {
            let hint = match value {
                Expr::Path(p) if p.path.get_ident().is_some() => {
                    let word = quote!(#p).to_string();
                    format!(" (write `precision = \"{word}\"`)")
                }
                _ => String::new(),
            };
            Err(syn::Error::new_spanned(
                value,
                format!("`precision` takes a string, one of {valid}{hint}"),
            ))
        }
    }
}

/// The ways `buffers = ".."` may be spelled (`ivme::BufferSync` reads the same words).
pub const BUFFER_MODES: &[&str] = &["broadcast", "average", "local"];

/// How buffers agree across processes: one of [`BUFFER_MODES`].
pub(crate) fn buffer_mode(value: &Expr) -> syn::Result<&'static str> {
    let valid = BUFFER_MODES
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join(", ");
    if let Some((Lit::Str(s), false)) = literal(value) {
        let v = s.value();
        if let Some(m) = BUFFER_MODES.iter().find(|m| **m == v) {
            return Ok(m);
        }
        let hint = match closest(&v.to_ascii_lowercase(), BUFFER_MODES) {
            Some(m) => format!("; did you mean \"{m}\"?"),
            None => String::new(),
        };
        return Err(syn::Error::new_spanned(
            value,
            format!("unknown buffers mode \"{v}\": use one of {valid}{hint}"),
        ));
    }
    Err(syn::Error::new_spanned(
        value,
        format!("`buffers` takes a string, one of {valid}, e.g. `buffers = \"average\"`"),
    ))
}

/// A positive, finite number of seconds (an integer or a float literal).
pub(crate) fn seconds(key: &str, value: &Expr) -> syn::Result<f64> {
    let parsed = match literal(value) {
        Some((Lit::Float(f), false)) => f.base10_parse::<f64>().ok(),
        Some((Lit::Int(i), false)) => i.base10_parse::<f64>().ok(),
        Some((Lit::Float(_) | Lit::Int(_), true)) => None,
        _ => {
            return Err(syn::Error::new_spanned(
                value,
                format!("`{key}` takes a number of seconds, e.g. `{key} = 600`"),
            ))
        }
    };
    match parsed {
        Some(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(syn::Error::new_spanned(
            value,
            format!(
                "`{key}` must be a positive number of seconds: it is how long a collective may \
                 wait for the other processes, e.g. `{key} = 600`"
            ),
        )),
    }
}

/// A numeric literal's value (a leading minus included); `None` for anything else.
fn number(value: &Expr) -> Option<Option<f64>> {
    let signed = |v: f64, neg: bool| if neg { -v } else { v };
    match literal(value) {
        Some((Lit::Float(f), neg)) => Some(f.base10_parse::<f64>().ok().map(|v| signed(v, neg))),
        Some((Lit::Int(i), neg)) => Some(i.base10_parse::<f64>().ok().map(|v| signed(v, neg))),
        _ => None,
    }
}

/// A number within its row's bound (the clipping thresholds).
pub(crate) fn positive_float(row: &Setting, value: &Expr) -> syn::Result<f64> {
    let key = row.attribute.unwrap_or(row.name);
    let Some(parsed) = number(value) else {
        return Err(syn::Error::new_spanned(
            value,
            format!("`{key}` takes a number, e.g. `{key} = 1.0`"),
        ));
    };
    match parsed {
        Some(v) if row.bound.admits(v) => Ok(v),
        _ => Err(syn::Error::new_spanned(
            value,
            format!(
                "`{key}` must be {}: it is the clipping threshold",
                row.bound.limit()
            ),
        )),
    }
}

pub(crate) fn boolean(key: &str, value: &Expr) -> syn::Result<bool> {
    match literal(value) {
        Some((Lit::Bool(b), false)) => Ok(b.value),
        _ => Err(syn::Error::new_spanned(
            value,
            format!("`{key}` takes `true` or `false`"),
        )),
    }
}

pub(crate) fn project_dir(value: &Expr) -> syn::Result<String> {
    match literal(value) {
        Some((Lit::Str(s), false)) if !s.value().trim().is_empty() => Ok(s.value()),
        _ => Err(syn::Error::new_spanned(
            value,
            "`project_dir` takes a non-empty string, the folder checkpoints go under, e.g. \
             `project_dir = \"runs/demo\"`",
        )),
    }
}

/// `profile = "DIR"`: the folder a profile of the run goes to.
pub(crate) fn profile_dir(value: &Expr) -> syn::Result<String> {
    match literal(value) {
        Some((Lit::Str(s), false)) if !s.value().trim().is_empty() => Ok(s.value()),
        _ => Err(syn::Error::new_spanned(
            value,
            "`profile` takes a non-empty string, the folder each rank's trace and the summary \
             go to, e.g. `profile = \"runs/profile\"`",
        )),
    }
}

/// `flops_per_sample = F`: the model's FLOPs per sample, for a profile's FLOP rate.
pub(crate) fn flops_per_sample(value: &Expr) -> syn::Result<f64> {
    match number(value).flatten() {
        Some(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(syn::Error::new_spanned(
            value,
            "`flops_per_sample` must be a positive number, the model's FLOPs per sample \
             (forward and backward), e.g. `flops_per_sample = 6e9`",
        )),
    }
}

/// `zero = 0 | 1 | 2 | 3`: the ZeRO stage (0 none, 1 optimizer state, 2 also gradients, 3
/// also the weights of checkpointed blocks).
pub(crate) fn zero_stage(value: &Expr) -> syn::Result<u8> {
    let msg = "`zero` is the ZeRO sharding stage: 0 (none), 1 (masters and optimizer state \
               split across processes), 2 (gradients too) or 3 (the blocks' weights too), e.g. `zero = 2`";
    match literal(value) {
        Some((Lit::Int(i), false)) => match i.base10_parse::<u8>() {
            Ok(n) if n <= 3 => Ok(n),
            _ => Err(syn::Error::new_spanned(
                value,
                "`zero` must be 0, 1, 2 or 3 (3: the blocks' weights sharded too)",
            )),
        },
        _ => Err(syn::Error::new_spanned(value, msg)),
    }
}

/// `total_limit = N`: how many checkpoints are kept, within its row's bound.
pub(crate) fn total_limit(row: &Setting, value: &Expr) -> syn::Result<usize> {
    let key = row.attribute.unwrap_or(row.name);
    match literal(value) {
        Some((Lit::Int(i), false)) => match i.base10_parse::<usize>() {
            Ok(n) if row.bound.admits(n as f64) => Ok(n),
            _ => Err(syn::Error::new_spanned(
                value,
                format!(
                    "`{key}` must be {}: it is how many checkpoints are kept",
                    row.bound.limit()
                ),
            )),
        },
        _ => Err(syn::Error::new_spanned(
            value,
            format!(
                "`{key}` takes {}, e.g. `{key} = {}`",
                row.bound.wording(),
                row.example
            ),
        )),
    }
}

pub(crate) fn snapshot_every(value: &Expr) -> syn::Result<u64> {
    match literal(value) {
        Some((Lit::Int(i), false)) if !i.base10_digits().starts_with('-') => {
            i.base10_parse::<u64>().map_err(|_| {
                syn::Error::new_spanned(value, "`snapshot_every` is too large for a step count")
            })
        }
        _ => Err(syn::Error::new_spanned(
            value,
            "`snapshot_every` takes a whole number of optimizer steps (0: no snapshots), e.g. \
             `snapshot_every = 10`",
        )),
    }
}

pub(crate) fn seed(value: &Expr) -> syn::Result<u64> {
    match literal(value) {
        Some((Lit::Int(i), false)) if !i.base10_digits().starts_with('-') => {
            i.base10_parse().map_err(|_| {
                syn::Error::new_spanned(
                    value,
                    "`seed` must fit in a u64 (0 to 18446744073709551615)",
                )
            })
        }
        Some((Lit::Int(_), _)) => Err(syn::Error::new_spanned(
            value,
            "`seed` must not be negative: it is a u64",
        )),
        _ => Err(syn::Error::new_spanned(
            value,
            "`seed` takes an integer literal, e.g. `seed = 42`",
        )),
    }
}
