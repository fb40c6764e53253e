//! ferrograph's BLAS backend built as a loadable library (`libferrograph_blas.so`).
//!
//! Load it with `ferrograph::dynload::load(path)` or let `ferrograph::dynload::load_all()`
//! find it. It scores 0 (and is skipped) on machines without a BLAS library.

ferrograph::export_backend!(ferrograph::blas::registration, ferrograph::blas::score);
