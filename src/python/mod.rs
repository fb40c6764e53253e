//! PyO3 bindings (module `ferrograph._core`).
