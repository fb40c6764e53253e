//! The `ferrograph` command: `ferrograph serve` runs a device server (see `ferrograph::remote`).

use std::io::Write;
use std::process::ExitCode;

use ferrograph::remote::{Server, ServerConfig};

const USAGE: &str = "usage: ferrograph serve [--host 127.0.0.1] [--port 0] [--token-file PATH] \
[--threads N] [--max-frame BYTES] [--max-session-bytes BYTES] [--weight-cache-bytes BYTES]

Exposes this machine's devices to ferrograph clients over TCP. The token comes from
--token-file or the FERROGRAPH_TOKEN environment variable (required). The first line printed
is the host:port the server listens on (--port 0 picks a free port).";

fn parse_number(flag: &str, value: &str) -> Result<u64, String> {
    value
        .parse()
        .map_err(|_| format!("{flag} expects a non-negative integer, got {value:?}"))
}

fn config_from_args(args: &[String]) -> Result<ServerConfig, String> {
    let mut config = ServerConfig::new(Vec::new());
    let mut token_file = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--host" => config.host = value()?,
            "--port" => {
                let port = parse_number(flag, &value()?)?;
                config.port = u16::try_from(port).map_err(|_| format!("no port {port}"))?;
            }
            "--token-file" => token_file = Some(value()?),
            "--threads" => {
                let n = parse_number(flag, &value()?)?;
                config.n_threads = Some(usize::try_from(n.max(1)).unwrap_or(1));
            }
            "--max-frame" => config.max_payload = parse_number(flag, &value()?)?,
            "--max-session-bytes" => config.max_session_bytes = parse_number(flag, &value()?)?,
            "--weight-cache-bytes" => config.weight_cache_bytes = parse_number(flag, &value()?)?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    config.token = match token_file {
        Some(path) => std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read the token file {path}: {e}"))?
            .trim()
            .as_bytes()
            .to_vec(),
        None => std::env::var("FERROGRAPH_TOKEN")
            .unwrap_or_default()
            .into_bytes(),
    };
    if config.token.is_empty() {
        return Err("a token is required: --token-file PATH or FERROGRAPH_TOKEN".into());
    }
    Ok(config)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) != Some("serve") {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    }
    let config = match config_from_args(&args[1..]) {
        Ok(config) => config,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("ferrograph serve: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let server = match Server::start(config) {
        Ok(server) => server,
        Err(e) => {
            eprintln!("ferrograph serve: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", server.addr());
    let _ = std::io::stdout().flush();
    server.wait(|| false);
    ExitCode::SUCCESS
}
