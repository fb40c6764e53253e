//! PyO3 bindings: the native module `ferrograph._core`.
//!
//! The Python package `python/ferrograph/` wraps this module; users import `ferrograph`, not
//! `_core`. Each concept has its own file: errors, dtypes, conversions, tensors, contexts,
//! graphs, op builders, logging and system information.
//!
//! No Rust panic crosses into Python: the places where kernels or user callbacks run go
//! through [`errors::guard`], which turns a panic into `ferrograph.Error`.

use pyo3::prelude::*;

mod alloc;
mod backend;
mod context;
mod convert;
mod dtype;
mod dynload;
mod errors;
mod gguf;
mod graph;
mod lock;
mod log;
mod ops;
mod plugin;
mod profile;
mod raised;
mod remote;
mod row_split;
mod sched;
mod system;
mod tensor;
mod tensor_raw;
mod utils;
mod wordpiece;

/// The native module `ferrograph._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", ferrograph::VERSION)?;
    ferrograph_base::error::python::set_converter(errors::convert_error);
    // The CPU device announces itself as the owner of host memory when it is made (the host
    // buffer type lives below it); make it now, so `cpu_buffer_type().device` is the CPU
    // from the first call on.
    let _ = ferrograph::CpuDevice::shared();
    errors::register(m)?;
    dtype::register(m)?;
    convert::register(m)?;
    system::register(m)?;
    m.add_class::<tensor::PyTensor>()?;
    m.add_class::<context::PyContext>()?;
    m.add_class::<graph::PyGraph>()?;
    backend::register(m)?;
    tensor_raw::register(m)?;
    alloc::register(m)?;
    plugin::register(m)?;
    dynload::register(m)?;
    sched::register(m)?;
    profile::register(m)?;
    remote::register(m)?;
    row_split::register(m)?;
    gguf::register(m)?;
    utils::register(m)?;
    wordpiece::register(m)?;
    let ops_module = PyModule::new(py, "ops")?;
    ops::register(&ops_module)?;
    m.add_submodule(&ops_module)?;
    log::register(m)?;
    log::install();
    register_testing(m)?;
    Ok(())
}

/// The submodule `ferrograph._core._testing`: hooks for the test suite (a panic inside the
/// guard, a Rust log record, each error variant raised, the abort-slot count), kept out of
/// `_core`'s own namespace. It is entered in `sys.modules` too, so both
/// `from ferrograph._core import _testing` and `import ferrograph._core._testing` work.
fn register_testing(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    const NAME: &str = "ferrograph._core._testing";
    let testing = PyModule::new(py, NAME)?;
    errors::register_testing(&testing)?;
    log::register_testing(&testing)?;
    backend::register_testing(&testing)?;
    m.add("_testing", &testing)?;
    py.import("sys")?
        .getattr("modules")?
        .set_item(NAME, &testing)?;
    Ok(())
}
