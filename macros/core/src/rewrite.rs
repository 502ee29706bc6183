//! The body rewrites: a syntactic pass over the function body that swaps candle calls for
//! the runtime calls a user would write by hand. Each rule is listed in `macros/macro.md`.
//!
//! Nested items (`fn`, `impl`, `mod`) and macro invocations' token bodies are left alone:
//! the macro cannot know what they mean, and a nested `fn` has no accelerator in scope.

use crate::errors::Errors;
use proc_macro2::Span;
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{parse_quote_spanned, Expr, ExprForLoop, Ident, Item, Local, Pat, Path, Stmt};

/// Walks a body and rewrites it in place, collecting the errors it finds.
pub(crate) struct Rewriter {
    /// The name of the accelerator in scope.
    acc: Ident,
    /// Whether forward calls go into autocast scopes.
    autocast: bool,
    /// How many `for` / `while` / `loop` bodies enclose the current expression.
    loop_depth: usize,
    /// A backward call was seen that no inner `for` loop has claimed yet.
    backward_pending: bool,
    /// How many `for` loops enclose the current expression.
    for_depth: usize,
    /// Inside the arguments of a forward call that is already in an autocast scope.
    in_autocast: bool,
    /// Whether any forward call was put in an autocast scope (the scope handle is then bound).
    pub used_autocast: bool,
    /// Inside the arguments of a hand-written `prepare` / `prepare_optimizer(_of)` call, whose
    /// objects must not be prepared a second time.
    in_prepare: bool,
    errors: Errors,
}

impl Rewriter {
    /// A rewriter that calls the accelerator `acc` and wraps forward calls in autocast scopes
    /// when `autocast` is set.
    pub fn new(acc: Ident, autocast: bool) -> Self {
        Rewriter {
            acc,
            autocast,
            loop_depth: 0,
            backward_pending: false,
            for_depth: 0,
            in_autocast: false,
            used_autocast: false,
            in_prepare: false,
            errors: Errors::default(),
        }
    }

    /// The errors found while rewriting.
    pub fn finish(self) -> syn::Result<()> {
        self.errors.finish()
    }

    /// The binding the autocast closure gives its scope handle.
    /// (The handle itself is bound once, by [`scope_binding`], at the top of the body.)
    fn scope_ident(&self, span: Span) -> Ident {
        Ident::new("__ivme_ac", span)
    }

    fn in_loop<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        self.loop_depth += 1;
        let r = f(self);
        self.loop_depth -= 1;
        r
    }

    fn require_loop(&mut self, call: &Expr) {
        if self.loop_depth == 0 {
            self.errors.push(syn::Error::new_spanned(
                call,
                "an optimizer step outside a loop runs once; move it into the training loop, \
                 or call the runtime by hand",
            ));
        }
    }

    /// Rule f: shard the innermost `for` loop whose body calls backward.
    fn visit_for(&mut self, f: &mut ExprForLoop) {
        self.visit_expr_mut(&mut f.expr);
        let outer = std::mem::take(&mut self.backward_pending);
        self.for_depth += 1;
        self.in_loop(|this| this.visit_block_mut(&mut f.body));
        self.for_depth -= 1;
        if self.backward_pending {
            let acc = &self.acc;
            let span = f.expr.span();
            *f.expr = match enumerated(&f.expr) {
                // `.enumerate()` numbers this process's batches: shard what it enumerates.
                Some(inner) => parse_quote_spanned!(span=>
                    ::ivme::macro_support::shard(&#acc, #inner)?.enumerate()
                ),
                None => {
                    let iterable = &f.expr;
                    parse_quote_spanned!(span=>
                        ::ivme::macro_support::shard(&#acc, #iterable)?
                    )
                }
            };
            // The loop stops here, after the optimizer and scheduler steps, when the ranks
            // agreed to stop for a preemption: it saves and ends the function with the error.
            // (A body that ends by leaving the iteration never reaches it: nothing is added.)
            let leaves = matches!(
                f.body.stmts.last(),
                Some(syn::Stmt::Expr(
                    Expr::Break(_) | Expr::Continue(_) | Expr::Return(_),
                    _
                ))
            );
            if !leaves {
                // A tail expression that is not a block (`foo()`) needs a `;` before the call.
                if let Some(syn::Stmt::Expr(e, semi @ None)) = f.body.stmts.last_mut() {
                    let block_like = matches!(
                        e,
                        Expr::Block(_)
                            | Expr::If(_)
                            | Expr::Match(_)
                            | Expr::Loop(_)
                            | Expr::While(_)
                            | Expr::ForLoop(_)
                            | Expr::Unsafe(_)
                    );
                    if !block_like {
                        *semi = Some(Default::default());
                    }
                }
                f.body
                    .stmts
                    .push(parse_quote_spanned!(span=> #acc.preemption_point()?;));
            }
        }
        self.backward_pending = outer;
    }

    /// `while` and `loop` bodies cannot be sharded: one that calls backward itself (not in a
    /// `for` loop inside it) would train every process on every batch, so it is refused,
    /// unless a `for` loop around it is the batch loop (a retry loop inside, say).
    fn visit_while_or_loop(&mut self, e: &mut Expr) {
        let outer = std::mem::take(&mut self.backward_pending);
        self.in_loop(|this| visit_mut::visit_expr_mut(this, e));
        if self.backward_pending && self.for_depth > 0 {
            // The enclosing `for` loop is sharded instead.
            return;
        }
        if self.backward_pending {
            let (kind, head): (&str, &dyn quote::ToTokens) = match &*e {
                Expr::While(w) => ("while", &w.while_token),
                Expr::Loop(l) => ("loop", &l.loop_token),
                _ => ("loop", &*e),
            };
            self.errors.push(syn::Error::new_spanned(
                head,
                format!(
                    "`#[accelerate]` cannot shard a `{kind}` batch loop, so every process would \
                     train on every batch: write it as `for batch in batches {{ .. }}` over a \
                     `Vec`, slice or `DataLoader` (sharded), or, when each process already reads \
                     its own data, call `accelerator.backward(&loss)?` yourself"
                ),
            ));
        }
        self.backward_pending = outer;
    }

    /// Rules d, h, g, i, b, j: calls through a method.
    fn visit_method_call(&mut self, e: &mut Expr) {
        let Expr::MethodCall(mc) = e else { return };
        let name = mc.method.to_string();
        let span = mc.method.span();
        let acc = self.acc.clone();
        match (name.as_str(), mc.args.len()) {
            ("backward", 0) => {
                self.visit_expr_mut(&mut mc.receiver);
                self.backward_pending = true;
                let loss = &mc.receiver;
                *e = parse_quote_spanned!(span=> #acc.backward(&#loss));
            }
            ("backward_step", 1) => {
                self.require_loop(e);
                let Expr::MethodCall(mc) = e else { return };
                visit_mut::visit_expr_method_call_mut(self, mc);
                self.backward_pending = true;
                let (opt, loss) = (&mc.receiver, &mc.args[0]);
                *e = parse_quote_spanned!(span=> #opt.step(&#acc.backward(#loss)?));
            }
            ("step", 1) => {
                self.require_loop(e);
                visit_mut::visit_expr_mut(self, e);
            }
            ("to_device", 1) => {
                self.visit_expr_mut(&mut mc.receiver);
                let arg = &mut mc.args[0];
                let direct = match &*arg {
                    Expr::Reference(r) => device_expr(&r.expr).is_some(),
                    other => device_expr(other).is_some(),
                };
                if direct {
                    // Rule a turns it into the accelerator's device and keeps the user's
                    // `Device` import in use.
                    self.visit_expr_mut(arg);
                } else {
                    let arg_span = arg.span();
                    *arg = parse_quote_spanned!(arg_span=> #acc.device());
                }
            }
            ("forward" | "forward_t", _) if self.autocast => {
                self.visit_expr_mut(&mut mc.receiver);
                let outermost = !self.in_autocast;
                self.in_autocast = true;
                let ac = self.scope_ident(span);
                for arg in mc.args.iter_mut() {
                    self.visit_expr_mut(arg);
                    let arg_span = arg.span();
                    if let Expr::Reference(r) = arg {
                        if r.mutability.is_none() {
                            let inner = r.expr.clone();
                            *arg = parse_quote_spanned!(arg_span=> &#ac.input(&#inner)?);
                        }
                    }
                }
                if outermost {
                    self.in_autocast = false;
                    let scope = scope_binding();
                    self.used_autocast = true;
                    *e = parse_quote_spanned!(span=> #scope.run(|#ac| #e));
                }
            }
            // `x.apply(&model)` / `x.apply_t(&model, train)`: the receiver is the input.
            ("apply", 1) | ("apply_t", 2) if self.autocast => {
                let outermost = !self.in_autocast;
                self.in_autocast = true;
                let ac = self.scope_ident(span);
                self.visit_expr_mut(&mut mc.receiver);
                for arg in mc.args.iter_mut() {
                    self.visit_expr_mut(arg);
                }
                let input = &mc.receiver;
                let input_span = input.span();
                // An input already cast (a chained apply) passes through `input` unchanged.
                *mc.receiver = parse_quote_spanned!(input_span=> #ac.input(&#input)?);
                if outermost {
                    self.in_autocast = false;
                    let scope = scope_binding();
                    self.used_autocast = true;
                    *e = parse_quote_spanned!(span=> #scope.run(|#ac| #e));
                }
            }
            ("prepare" | "prepare_optimizer" | "prepare_optimizer_of", _) => {
                let outer = std::mem::replace(&mut self.in_prepare, true);
                visit_mut::visit_expr_mut(self, e);
                self.in_prepare = outer;
            }
            _ => visit_mut::visit_expr_mut(self, e),
        }
    }

    /// Rules c, d, a: calls through a path.
    fn visit_call(&mut self, e: &mut Expr) {
        visit_mut::visit_expr_mut(self, e);
        let Expr::Call(call) = e else { return };
        let acc = self.acc.clone();
        if let Expr::Path(f) = &*call.func {
            if ends_with(&f.path, &["VarBuilder", "from_varmap"]) && call.args.len() == 3 {
                // The accelerator's builder: its device, the precision's dtype, and under
                // bf16/fp16 f32 masters from the exact initialisation.
                // `VarBuilder::clone(..)` through the path written keeps the user's `use` of
                // `VarBuilder` alive, as rule a does for `Device`.
                let varmap = call.args[0].clone();
                let dtype = call.args[1].clone();
                let mut clone = f.path.clone();
                if let Some(last) = clone.segments.last_mut() {
                    last.ident = syn::Ident::new("clone", last.ident.span());
                }
                let span = e.span();
                *e = parse_quote_spanned!(span=> #clone(&#acc.var_builder(#varmap, #dtype)));
                return;
            }
        }
        if self.in_prepare {
            return;
        }
        if let Some(Expr::MethodCall(first)) = call.args.first() {
            if first.method == "all_vars" && first.args.is_empty() {
                let varmap = first.receiver.clone();
                let span = e.span();
                *e = parse_quote_spanned!(span=> #acc.prepare_optimizer(&#varmap, #e));
                return;
            }
        }
        // An ivme optimizer over any other list of variables (a fine-tune's adapters, a
        // filter): prepared with the model its variables belong to (rule d).
        let ivme_optimizer = matches!(&*call.func, Expr::Path(f)
            if ["AdamW", "Sgd", "AnyOptimizer"].iter().any(|o| ends_with(&f.path, &[o, "new"])));
        if ivme_optimizer && call.args.len() == 2 {
            let span = e.span();
            *e = parse_quote_spanned!(span=> #acc.prepare_optimizer_of(#e));
        }
    }
}

impl VisitMut for Rewriter {
    fn visit_expr_mut(&mut self, e: &mut Expr) {
        let acc = self.acc.clone();
        // `Device::clone(..)` rather than `.clone()` keeps the user's `use` of `Device` alive.
        if let Some((kind, device)) = device_expr(e) {
            let span = e.span();
            *e = match kind {
                DeviceExpr::Value => parse_quote_spanned!(span=> #device::clone(#acc.device())),
                DeviceExpr::Fallible => parse_quote_spanned!(span=>
                    ::core::result::Result::<_, ::ivme::Error>::Ok(#device::clone(#acc.device()))
                ),
            };
            return;
        }
        if !self.in_prepare && is_data_loader(e) {
            // Visit the call's own parts; visiting the call as an expression would match again.
            match e {
                Expr::Try(t) => visit_mut::visit_expr_mut(self, &mut t.expr),
                _ => visit_mut::visit_expr_mut(self, e),
            }
            let span = e.span();
            *e = parse_quote_spanned!(span=> #acc.prepare(#e)?);
            return;
        }
        match e {
            Expr::ForLoop(f) => self.visit_for(f),
            Expr::While(_) | Expr::Loop(_) => self.visit_while_or_loop(e),
            Expr::MethodCall(_) => self.visit_method_call(e),
            Expr::Call(_) => self.visit_call(e),
            _ => visit_mut::visit_expr_mut(self, e),
        }
    }

    fn visit_stmt_mut(&mut self, stmt: &mut Stmt) {
        let dropped = match stmt {
            Stmt::Expr(e, Some(_)) => is_backward(e).then_some(&*e),
            Stmt::Local(Local {
                pat: Pat::Wild(_),
                init: Some(init),
                ..
            }) => is_backward(&init.expr).then_some(&*init.expr),
            _ => None,
        };
        if let Some(e) = dropped {
            self.errors.push(syn::Error::new_spanned(
                e,
                "the gradients from this backward are dropped: bind the gradients and pass them \
                 to the optimizer: `let grads = loss.backward()?; opt.step(&grads)?;`",
            ));
        }
        visit_mut::visit_stmt_mut(self, stmt);
    }

    fn visit_local_mut(&mut self, local: &mut Local) {
        // The binding keeps existing for the user's own code, but the rewrites below may take
        // over all its uses; that is the macro's doing, not something to warn the user about.
        if local
            .init
            .as_ref()
            .is_some_and(|i| device_expr(&i.expr).is_some())
        {
            local
                .attrs
                .push(syn::parse_quote!(#[allow(unused_variables)]));
        }
        visit_mut::visit_local_mut(self, local);
    }

    fn visit_item_mut(&mut self, _: &mut Item) {}

    fn visit_macro_mut(&mut self, _: &mut syn::Macro) {}
}

/// What a device expression evaluates to before the rewrite.
enum DeviceExpr {
    /// A `Device` (`Device::Cpu`, `Device::new_cuda(0)?`, `.unwrap()`ed calls).
    Value,
    /// A `Result<Device>` (a constructor call not yet unwrapped).
    Fallible,
}

/// Rule a: recognises the device choices the accelerator replaces, with the path the user
/// named the `Device` type by (`Device`, `candle_core::Device`).
fn device_expr(e: &Expr) -> Option<(DeviceExpr, Path)> {
    let ctor = |e: &Expr| match e {
        Expr::Call(c) => match &*c.func {
            Expr::Path(p)
                if ["new_cuda", "cuda_if_available", "new_metal"]
                    .iter()
                    .any(|ctor| ends_with(&p.path, &["Device", ctor])) =>
            {
                Some(type_path(&p.path))
            }
            _ => None,
        },
        _ => None,
    };
    match e {
        Expr::Path(p) if ends_with(&p.path, &["Device", "Cpu"]) => {
            Some((DeviceExpr::Value, type_path(&p.path)))
        }
        Expr::Try(t) => ctor(&t.expr).map(|p| (DeviceExpr::Value, p)),
        Expr::MethodCall(m) if m.method == "unwrap" || m.method == "expect" => {
            ctor(&m.receiver).map(|p| (DeviceExpr::Value, p))
        }
        e => ctor(e).map(|p| (DeviceExpr::Fallible, p)),
    }
}

/// `path` without its last segment: the type a variant or constructor belongs to.
fn type_path(path: &Path) -> Path {
    let mut ty = path.clone();
    ty.segments.pop();
    ty.segments.pop_punct();
    ty
}

/// Rule e: `DataLoader::new(..)`, or `DataLoader::new(..)?` as one unit.
fn is_data_loader(e: &Expr) -> bool {
    let is_new = |e: &Expr| match e {
        Expr::Call(c) => {
            matches!(&*c.func, Expr::Path(p) if ends_with(&p.path, &["DataLoader", "new"]))
        }
        _ => false,
    };
    match e {
        Expr::Try(t) => is_new(&t.expr),
        e => is_new(e),
    }
}

/// A `loss.backward()` whose value is the whole expression (under `?`, `unwrap`, `expect`).
fn is_backward(e: &Expr) -> bool {
    match e {
        Expr::Try(t) => is_backward(&t.expr),
        Expr::Paren(p) => is_backward(&p.expr),
        Expr::MethodCall(m) if m.method == "unwrap" || m.method == "expect" => {
            is_backward(&m.receiver)
        }
        Expr::MethodCall(m) => m.method == "backward" && m.args.is_empty(),
        _ => false,
    }
}

/// True when `path`'s last segments are `tail`.
fn ends_with(path: &Path, tail: &[&str]) -> bool {
    let n = path.segments.len();
    n >= tail.len()
        && path
            .segments
            .iter()
            .skip(n - tail.len())
            .zip(tail)
            .all(|(s, t)| s.ident == t)
}

/// The name the body binds `accelerator.autocast_scope()` to: a `Copy` handle, so closures
/// that run forward passes borrow it instead of the Accelerator.
pub fn scope_binding() -> Ident {
    Ident::new("__ivme_autocast", proc_macro2::Span::call_site())
}

/// The receiver of `X.enumerate()`, if the expression is one.
fn enumerated(e: &Expr) -> Option<&Expr> {
    match e {
        Expr::MethodCall(mc) if mc.method == "enumerate" && mc.args.is_empty() => {
            Some(&mc.receiver)
        }
        _ => None,
    }
}
