//! The `ferrograph` command: `ferrograph serve` runs a device server (see `ferrograph::remote`).

use std::io::Write;
use std::process::ExitCode;

use ferrograph::remote::server::{set_limit, LIMIT_NAMES};
use ferrograph::remote::{Server, ServerConfig};

const USAGE: &str = "usage: ferrograph serve [--host 127.0.0.1] [--port 0] [--token-file PATH] \
[--threads N] [--peers IP:PORT,...] [--peer-token-file PATH] [--max-frame BYTES] \
[--max-meta BYTES] [--max-session-bytes BYTES] [--max-queued-requests N] \
[--max-reply-queue-bytes BYTES] [--max-deposit-bytes BYTES] [--max-handshakes N] \
[--max-sessions N] [--max-graphs N] [--max-graph-tensors N] [--max-peers-per-session N] \
[--weight-cache-bytes BYTES] [--weight-cache-min-bytes BYTES]

Exposes this machine's devices to ferrograph clients over TCP, encrypted and authenticated
with the token (Noise protocol, the token as pre-shared key). The token comes from
--token-file or the FERROGRAPH_TOKEN environment variable (required). Pushes between servers
go only to the --peers listed (none by default), authenticated with --peer-token-file (default:
the token). The first line printed is the host:port the server listens on (--port 0 picks a
free port).";

fn read_token(path: &str) -> Result<Vec<u8>, String> {
    Ok(std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the token file {path}: {e}"))?
        .trim()
        .as_bytes()
        .to_vec())
}

fn count(flag: &str, value: &str) -> Result<usize, String> {
    usize::try_from(parse_number(flag, value)?).map_err(|_| format!("{flag}: {value} is too large"))
}

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
            "--peers" => {
                for peer in value()?.split(',').filter(|p| !p.is_empty()) {
                    config.peers.push(peer.trim().parse().map_err(|_| {
                        format!("--peers expects ip:port entries separated by commas, got {peer:?}")
                    })?);
                }
            }
            "--peer-token-file" => config.peer_token = Some(read_token(&value()?)?),
            "--max-frame" => config.max_payload = parse_number(flag, &value()?)?,
            "--max-meta" => {
                let v = parse_number(flag, &value()?)?;
                config.max_meta =
                    u32::try_from(v).map_err(|_| format!("{flag}: {v} is too large"))?;
            }
            "--max-queued-requests" => config.max_queued_requests = count(flag, &value()?)?,
            "--max-reply-queue-bytes" => {
                config.max_reply_queue_bytes = parse_number(flag, &value()?)?
            }
            "--max-deposit-bytes" => config.max_deposit_bytes = parse_number(flag, &value()?)?,
            "--max-handshakes" => config.max_handshakes = count(flag, &value()?)?,
            "--max-sessions" => config.max_sessions = count(flag, &value()?)?,
            "--weight-cache-min-bytes" => {
                config.weight_cache_min_bytes = parse_number(flag, &value()?)?
            }
            "--max-session-bytes" => config.max_session_bytes = parse_number(flag, &value()?)?,
            "--weight-cache-bytes" => config.weight_cache_bytes = parse_number(flag, &value()?)?,
            "-h" | "--help" => return Err(String::new()),
            other => {
                // The server's other limits, by name (--max-graphs, --max-graph-tensors, ...).
                let name = other.trim_start_matches("--").replace('-', "_");
                if !other.starts_with("--") || !LIMIT_NAMES.contains(&name.as_str()) {
                    return Err(format!("unknown option {other:?}"));
                }
                let v = parse_number(other, &value()?)?;
                set_limit(&mut config, &name, v).map_err(|e| e.to_string())?;
            }
        }
    }
    config.token = match token_file {
        Some(path) => read_token(&path)?,
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
