//! Compile-time behaviour of `#[accelerate]`: every error a user can trigger, with its exact
//! message (`ui-tests/fail/*.stderr`), and every supported shape compiling (`ui-tests/pass`).
//! Regenerate the `.stderr` files with `TRYBUILD=overwrite` and read each one before keeping it.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui-tests/fail/*.rs");
    t.pass("ui-tests/pass/*.rs");
}
