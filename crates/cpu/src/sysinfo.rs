//! Facts about the host read from the operating system: CPU model and memory.

/// The CPU model name (from `/proc/cpuinfo` on Linux), or the architecture name.
pub fn cpu_model_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("model name") || line.starts_with("Model"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, value)| value.trim().to_owned())
        })
        .unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH))
}

/// `(available, total)` system memory in bytes (from `/proc/meminfo` on Linux; `(0, 0)` where
/// unknown).
pub fn system_memory() -> (usize, usize) {
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else {
        return (0, 0);
    };
    let field = |name: &str| {
        text.lines()
            .find(|line| line.starts_with(name))
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|kib| kib.parse::<usize>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    (field("MemAvailable:"), field("MemTotal:"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_figures_are_real_on_linux() {
        let (free, total) = system_memory();
        if cfg!(target_os = "linux") {
            assert!(total > 0 && free > 0 && free <= total);
        }
        assert!(!cpu_model_name().is_empty());
    }
}
