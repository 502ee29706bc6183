//! Collects every error the macro finds so the user sees all of them in one compile.

/// A growing set of spanned errors, combined into one `syn::Error`.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    /// Adds one error (which may itself hold several).
    pub fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    /// `Err` with everything collected, or `Ok` when nothing went wrong.
    pub fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}
