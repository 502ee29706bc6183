//! Examples, integration tests and benches for ivme.
