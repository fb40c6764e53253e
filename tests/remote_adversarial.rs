//! Hostile clients against an in-process device server on loopback.
//!
//! Every case runs the same way ([`case`]): a server with the case's settings, a baseline of
//! this process's resident memory and thread count, the attack, then the checks that matter
//! to everyone else: a healthy client still completes a handshake and a round trip within a
//! deadline (during the attack where the attack holds connections open, and after it), the
//! server's connections drain, and memory and threads come back near the baseline. Cases run
//! one at a time (the measurements are of the whole process).

use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod remote_wire;
use remote_wire::{error_message, Raw};

use ferrograph::context::Context;
use ferrograph::dtype::DType;
use ferrograph::graph::Graph;
use ferrograph::ops;
use ferrograph::ops::Op;
use ferrograph::remote::protocol::{decode_meta, Command, ErrorReply, Reply, Request};
use ferrograph::remote::secure::Role;
use ferrograph::remote::weight_cache::content_hash;
use ferrograph::remote::wire::{Describer, GraphDesc, TensorDesc};
use ferrograph::remote::{Server, ServerConfig};

const TOKEN: &[u8] = b"adversarial-token-0123456789abcdef";

/// How long a healthy client may wait for its handshake and round trip.
const DEADLINE: Duration = Duration::from_secs(3);

static SERIAL: Mutex<()> = Mutex::new(());

fn config() -> ServerConfig {
    let mut config = ServerConfig::new(TOKEN);
    config.n_threads = Some(1);
    config
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// The library's threads in this process (the server's runtime and sessions, pools, clients:
/// every one is named `ferrograph-…`). Not the whole process: the test harness starts a
/// thread per test whenever another ends, and one started during a case (then waiting for
/// `SERIAL`) lasts past it, so a count of every thread could stay above its start for good.
fn threads() -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(Result::ok)
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|name| name.starts_with("ferrograph"))
        })
        .count()
}

/// A healthy client: handshake and one round trip, within [`DEADLINE`].
fn healthy(addr: SocketAddr) {
    let start = Instant::now();
    let (mut raw, welcome) = Raw::handshake(addr, TOKEN);
    welcome.expect("a healthy client is welcome");
    let (c, m, _) = raw
        .request(1, &Request::Memory { device: 0 }, &[])
        .expect("an answer");
    assert_eq!(c, Command::Reply, "{:?}", decode_meta::<ErrorReply>(&m));
    let took = start.elapsed();
    assert!(took < DEADLINE, "a healthy client waited {took:?}");
}

/// Waits (up to 15 s) until `ok` holds; `what` names it in the failure.
fn eventually(what: &str, ok: impl Fn() -> bool) {
    eventually_within(Duration::from_secs(15), what, ok);
}

/// [`eventually`] with its own deadline.
fn eventually_within(deadline: Duration, what: &str, ok: impl Fn() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs one case: `attack` gets the server; afterwards the server serves, drains, and this
/// process's memory and threads return near where they were.
fn case(setup: impl FnOnce(&mut ServerConfig), attack: impl FnOnce(&Server)) {
    let _one_at_a_time = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut cfg = config();
    setup(&mut cfg);
    let srv = Server::start(cfg).unwrap();
    healthy(srv.addr());
    eventually("the warm-up session ends", || srv.sessions() == 0);
    let (rss0, threads0) = (rss_bytes(), threads());
    attack(&srv);
    healthy(srv.addr());
    eventually("every connection closes", || srv.sessions() == 0);
    eventually("session threads end", || threads() <= threads0);
    // A generous deadline: it asks whether memory is returned at all, and on a loaded
    // machine the last buffers of a killed session were seen freed only after 15 s.
    eventually_within(Duration::from_secs(60), "memory comes back", || {
        rss_bytes() <= rss0 + (48 << 20)
    });
}

fn alloc(raw: &mut Raw, id: u64, size: u64) -> u64 {
    let (c, m, _) = raw
        .request(id, &Request::Alloc { device: 0, size }, &[])
        .unwrap();
    assert_eq!(c, Command::Reply, "{}", error_message(&m));
    let Reply::Buffer { handle, .. } = decode_meta(&m).unwrap() else {
        panic!("no buffer")
    };
    handle
}

fn f32_leaf(ne: [u64; 4], binding: (u64, u64)) -> TensorDesc {
    TensorDesc {
        dtype: DType::F32,
        ne,
        nb: [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]],
        ndim: 4,
        op: Some(Op::None),
        srcs: vec![],
        view: None,
        binding: Some(binding),
        flags: 0,
    }
}

/// Describes `outputs`' graph with every tensor bound to `handle` at consecutive offsets.
fn describe(outputs: &[ferrograph::tensor::Tensor], handle: u64) -> GraphDesc {
    let next = Cell::new(0u64);
    let resolve = |t: &ferrograph::tensor::Tensor| {
        let at = next.get();
        next.set(at + (t.nbytes() as u64).div_ceil(64) * 64);
        Ok(Some((handle, at)))
    };
    Describer::new(&resolve)
        .graph(&Graph::build(outputs))
        .unwrap()
}

// ----- 1. work without a bound -----

#[test]
fn group_norm_with_huge_n_groups_is_refused_at_once() {
    case(
        |_| {},
        |srv| {
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let h = alloc(&mut raw, 1, 256);
            for n_groups in [1usize << 63, usize::MAX, 4] {
                let x = f32_leaf([4, 3, 1, 1], (h, 0));
                let mut y = f32_leaf([4, 3, 1, 1], (h, 64));
                y.op = Some(Op::GroupNorm {
                    n_groups,
                    eps: 1e-5,
                });
                y.srcs = vec![0];
                let desc = GraphDesc {
                    tensors: vec![x, y],
                    nodes: vec![1],
                    leafs: vec![0],
                };
                let compute = Request::Compute {
                    device: 0,
                    graph: n_groups as u64,
                    desc: Some(desc),
                };
                let start = Instant::now();
                let (c, m, _) = raw.request(2, &compute, &[]).unwrap();
                assert!(start.elapsed() < DEADLINE);
                assert_eq!(c, Command::Error);
                assert!(
                    error_message(&m).contains("n_groups"),
                    "{}",
                    error_message(&m)
                );
            }
        },
    );
}

#[test]
fn a_computation_is_aborted_when_its_client_leaves() {
    case(
        |_| {},
        |srv| {
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            // A chain of 64 products of 512×512 matrices: seconds of work on one thread.
            let n = 512;
            let handle = alloc(&mut raw, 1, 80 << 20);
            // Described only, never computed here: the client's tensors need no memory (an
            // allocating context would put 66 MiB of this process's heap into the memory
            // check, which the allocator may keep after freeing it).
            let ctx = Context::new(true);
            let w = ctx.new_tensor(DType::F32, &[n, n]).unwrap();
            let mut x = ctx.new_tensor(DType::F32, &[n, n]).unwrap();
            for _ in 0..64 {
                x = ops::mul_mat(&ctx, &w, &x).unwrap();
            }
            let desc = describe(&[x], handle);
            let compute = Request::Compute {
                device: 0,
                graph: 1,
                desc: Some(desc),
            };
            raw.send_request(2, &compute, &[]);
            std::thread::sleep(Duration::from_millis(300));
            let threads_busy = threads();
            drop(raw);
            // The worker stops within a node or two, not after the whole chain.
            let start = Instant::now();
            eventually("the busy worker ends", || threads() < threads_busy);
            assert!(start.elapsed() < Duration::from_secs(5));
        },
    );
}

// ----- 2. memory without a bound -----

#[test]
fn replies_a_client_never_reads_stay_bounded() {
    case(
        |c| c.max_reply_queue_bytes = 8 << 20,
        |srv| {
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let len = 8u64 << 20;
            let handle = alloc(&mut raw, 1, len);
            let before = rss_bytes();
            for id in 0..48 {
                let get = Request::Get {
                    buffer: handle,
                    offset: 0,
                    len,
                };
                raw.send_request(10 + id, &get, &[]);
            }
            // Heartbeats unread too.
            for id in 0..20_000 {
                raw.send(Command::Ping, 1000 + id, &[], &[]);
            }
            std::thread::sleep(Duration::from_millis(800));
            let grown = rss_bytes().saturating_sub(before);
            assert!(grown < 96 << 20, "unread replies hold {} MiB", grown >> 20);
            healthy(srv.addr());
        },
    );
}

#[test]
fn a_request_flood_to_a_busy_session_stays_bounded() {
    case(
        |c| c.max_payload = 4 << 20,
        |srv| {
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let handle = alloc(&mut raw, 1, 4 << 20);
            let payload = vec![7u8; 4 << 20];
            let before = rss_bytes();
            let writer = std::thread::spawn({
                let mut raw = raw;
                move || {
                    raw.stream
                        .set_write_timeout(Some(Duration::from_secs(2)))
                        .unwrap();
                    for id in 0..64 {
                        let set = Request::Set {
                            buffer: handle,
                            offset: 0,
                        };
                        raw.send_request(10 + id, &set, &payload);
                    }
                    raw
                }
            });
            std::thread::sleep(Duration::from_millis(500));
            let grown = rss_bytes().saturating_sub(before);
            assert!(
                grown < 160 << 20,
                "queued requests hold {} MiB",
                grown >> 20
            );
            drop(writer.join().unwrap());
        },
    );
}

#[test]
fn large_metadata_is_charged_and_tensor_counts_are_checked_before_decoding() {
    case(
        |c| c.max_graph_tensors = 1000,
        |srv| {
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let h = alloc(&mut raw, 1, 64);
            let desc = GraphDesc {
                tensors: vec![f32_leaf([1, 1, 1, 1], (h, 0)); 1001],
                nodes: vec![],
                leafs: vec![],
            };
            let compute = Request::Compute {
                device: 0,
                graph: 1,
                desc: Some(desc),
            };
            raw.send_request(2, &compute, &[]);
            let (head, m, _) = raw.recv().unwrap();
            assert_eq!(head.command, Command::Error);
            assert!(
                error_message(&m).contains("exceeds the limit"),
                "{}",
                error_message(&m)
            );
            // Six requests of ~2 MiB metadata queue within the session's bounds.
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let h = alloc(&mut raw, 1, 64);
            let before = rss_bytes();
            let big = GraphDesc {
                tensors: vec![f32_leaf([1, 1, 1, 1], (h, 0)); 999],
                nodes: (0..500_000).collect(),
                leafs: vec![],
            };
            for id in 0..6 {
                let compute = Request::SupportsOp {
                    device: 0,
                    desc: big.clone(),
                };
                raw.send_request(10 + id, &compute, &[]);
            }
            for _ in 0..6 {
                let (head, _, _) = raw.recv().unwrap();
                assert_eq!(head.command, Command::Reply);
            }
            let grown = rss_bytes().saturating_sub(before);
            assert!(grown < 200 << 20, "metadata held {} MiB", grown >> 20);
        },
    );
}

#[test]
fn zero_and_one_byte_buffers_count_against_the_session_limit() {
    case(
        |c| c.max_session_bytes = 1 << 20,
        |srv| {
            for size in [0u64, 1] {
                let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
                let mut accepted = 0u64;
                for id in 0..20_000u64 {
                    let (c, m, _) = raw
                        .request(id + 1, &Request::Alloc { device: 0, size }, &[])
                        .unwrap();
                    if c == Command::Error {
                        assert!(error_message(&m).contains("session limit"));
                        break;
                    }
                    accepted += 1;
                }
                assert!(
                    accepted > 0 && accepted <= (1 << 20) / 512,
                    "{accepted} accepted"
                );
            }
        },
    );
}

#[test]
fn the_weight_cache_keeps_no_tiny_entries_and_counts_overhead() {
    case(
        |c| {
            c.weight_cache_bytes = 1 << 20;
            c.weight_cache_min_bytes = 4096;
        },
        |srv| {
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let h = alloc(&mut raw, 1, 1 << 20);
            for i in 0..200u32 {
                let data: Vec<u8> = i.to_le_bytes().repeat(64);
                let upload = Request::SetAndCache {
                    buffer: h,
                    offset: 0,
                    hash: content_hash(&data),
                };
                assert_eq!(
                    raw.request(10 + i as u64, &upload, &data).unwrap().0,
                    Command::Reply
                );
            }
            assert_eq!(srv.weight_cache_bytes(), 0, "256-byte uploads are not kept");
            // Entries of 64 KiB fill the 1 MiB cap with their overhead counted.
            for i in 0..40u32 {
                let data: Vec<u8> = i.to_le_bytes().repeat(16 << 10);
                let upload = Request::SetAndCache {
                    buffer: h,
                    offset: 0,
                    hash: content_hash(&data),
                };
                raw.request(1000 + i as u64, &upload, &data).unwrap();
            }
            assert!(srv.weight_cache_bytes() <= 1 << 20);
        },
    );
}

// ----- deposits and pushes -----

#[test]
fn only_servers_deposit_and_deposits_are_bounded_and_die_with_their_session() {
    case(
        |c| c.max_deposit_bytes = 1 << 20,
        |srv| {
            // A client may not deposit: fatal.
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let (c, m, _) = raw
                .request(1, &Request::Deposit { ticket: [1; 16] }, &[1, 2, 3])
                .unwrap();
            assert_eq!(c, Command::Error);
            assert!(decode_meta::<ErrorReply>(&m).unwrap().fatal);
            // A peer deposits within the server's bound.
            let (mut peer, welcome) = Raw::handshake_as(srv.addr(), TOKEN, Role::Peer);
            welcome.unwrap();
            let chunk = vec![5u8; 256 << 10];
            let mut refused = false;
            for i in 0..8u8 {
                let (c, _, _) = peer
                    .request(10 + i as u64, &Request::Deposit { ticket: [i; 16] }, &chunk)
                    .unwrap();
                refused |= c == Command::Error;
            }
            assert!(refused && srv.deposit_bytes() <= 1 << 20);
            // A peer only deposits.
            let (c, _, _) = peer
                .request(30, &Request::Memory { device: 0 }, &[])
                .unwrap();
            assert_eq!(c, Command::Error);
            eventually("the peer's deposits go with it", || {
                srv.deposit_bytes() == 0
            });
        },
    );
}

#[test]
fn a_claim_out_of_bounds_leaves_the_deposit() {
    case(
        |_| {},
        |srv| {
            let (mut peer, _) = Raw::handshake_as(srv.addr(), TOKEN, Role::Peer);
            let data: Vec<u8> = (0..64u8).collect();
            let deposit = Request::Deposit { ticket: [3; 16] };
            assert_eq!(peer.request(1, &deposit, &data).unwrap().0, Command::Reply);
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let small = alloc(&mut raw, 1, 16);
            let big = alloc(&mut raw, 2, 64);
            let claim = |buffer| Request::Claim {
                buffer,
                offset: 0,
                ticket: [3; 16],
            };
            assert_eq!(
                raw.request(3, &claim(small), &[]).unwrap().0,
                Command::Error
            );
            assert_eq!(raw.request(4, &claim(big), &[]).unwrap().0, Command::Reply);
            let get = Request::Get {
                buffer: big,
                offset: 0,
                len: 64,
            };
            assert_eq!(raw.request(5, &get, &[]).unwrap().2, data);
            drop(peer);
        },
    );
}

#[test]
fn pushes_go_only_to_allow_listed_servers_of_the_cluster() {
    // The peer server starts and stops inside `case`, under its lock: its runtime's threads
    // and memory must not come or go while another case measures the process.
    let peer: std::cell::RefCell<Option<Server>> = std::cell::RefCell::new(None);
    let foreign = TcpListener::bind("127.0.0.1:0").unwrap();
    let bystander = TcpListener::bind("127.0.0.1:0").unwrap();
    bystander.set_nonblocking(true).unwrap();
    let (foreign_addr, bystander_addr) = (
        foreign.local_addr().unwrap(),
        bystander.local_addr().unwrap(),
    );
    // The foreign listener accepts and says nothing (a silent port of another service).
    let silent = std::thread::spawn(move || {
        let held: Vec<TcpStream> = foreign.incoming().take(1).flatten().collect();
        std::thread::sleep(Duration::from_secs(3));
        drop(held);
    });
    case(
        |c| {
            let server = Server::start(config()).unwrap();
            c.peers = vec![server.addr(), foreign_addr];
            *peer.borrow_mut() = Some(server);
        },
        |srv| {
            let peer_addr = peer.borrow().as_ref().expect("started in setup").addr();
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let h = alloc(&mut raw, 1, 64);
            let push = |to: String, ticket| Request::Push {
                buffer: h,
                offset: 0,
                len: 64,
                to,
                ticket,
            };
            // Not on the list (an address, a name, another spelling): refused without a
            // connection attempt.
            for (i, to) in [
                bystander_addr.to_string(),
                format!("localhost:{}", peer_addr.port()),
                format!("127.000.000.001:{}", peer_addr.port()),
                "example.invalid:80".to_owned(),
            ]
            .into_iter()
            .enumerate()
            {
                let (c, m, _) = raw.request(10 + i as u64, &push(to, [1; 16]), &[]).unwrap();
                assert_eq!(c, Command::Error);
                assert!(error_message(&m).contains("not one of this server's peers"));
            }
            assert!(bystander.accept().is_err(), "no connection was attempted");
            // On the list but not a ferrograph server: one uniform error.
            let (c, m, _) = raw
                .request(20, &push(foreign_addr.to_string(), [2; 16]), &[])
                .unwrap();
            assert_eq!(c, Command::Error);
            assert!(error_message(&m).contains("did not authenticate as a server"));
            // A real peer: the bytes arrive.
            let (c, m, _) = raw
                .request(21, &push(peer_addr.to_string(), [4; 16]), &[])
                .unwrap();
            assert_eq!(c, Command::Reply, "{}", error_message(&m));
            let (mut there, _) = Raw::handshake(peer_addr, TOKEN);
            let target = alloc(&mut there, 1, 64);
            let claim = Request::Claim {
                buffer: target,
                offset: 0,
                ticket: [4; 16],
            };
            assert_eq!(there.request(2, &claim, &[]).unwrap().0, Command::Reply);
            drop(there);
            drop(peer.borrow_mut().take());
        },
    );
    silent.join().unwrap();
}

// ----- 3. authentication and confidentiality -----

/// A TCP relay between a client and `server` that records what each side sent.
struct Relay {
    addr: SocketAddr,
    upstream: Arc<Mutex<Vec<u8>>>,
    downstream: Arc<Mutex<Vec<u8>>>,
}

fn relay(server: SocketAddr) -> Relay {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (upstream, downstream) = (
        Arc::new(Mutex::new(Vec::new())),
        Arc::new(Mutex::new(Vec::new())),
    );
    let (up, down) = (upstream.clone(), downstream.clone());
    std::thread::spawn(move || {
        let Ok((client, _)) = listener.accept() else {
            return;
        };
        let server = TcpStream::connect(server).unwrap();
        let pump = |mut from: TcpStream, mut to: TcpStream, log: Arc<Mutex<Vec<u8>>>| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 || to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    log.lock().unwrap().extend_from_slice(&buf[..n]);
                }
                let _ = to.shutdown(std::net::Shutdown::Both);
            })
        };
        let a = pump(client.try_clone().unwrap(), server.try_clone().unwrap(), up);
        let b = pump(server, client, down);
        let _ = (a.join(), b.join());
    });
    Relay {
        addr,
        upstream,
        downstream,
    }
}

#[test]
fn traffic_is_confidential_and_a_recorded_session_cannot_be_replayed() {
    case(
        |_| {},
        |srv| {
            let relay = relay(srv.addr());
            let secret: Vec<u8> = b"a recognisable tensor payload!!!".repeat(64);
            {
                let (mut raw, welcome) = Raw::handshake(relay.addr, TOKEN);
                welcome.unwrap();
                let h = alloc(&mut raw, 1, secret.len() as u64);
                let set = Request::Set {
                    buffer: h,
                    offset: 0,
                };
                assert_eq!(raw.request(2, &set, &secret).unwrap().0, Command::Reply);
                let get = Request::Get {
                    buffer: h,
                    offset: 0,
                    len: secret.len() as u64,
                };
                assert_eq!(raw.request(3, &get, &[]).unwrap().2, secret);
            }
            std::thread::sleep(Duration::from_millis(200));
            let up = relay.upstream.lock().unwrap().clone();
            let down = relay.downstream.lock().unwrap().clone();
            let fingerprint = ferrograph::dynload::abi_fingerprint().as_bytes();
            for (side, bytes) in [("client", &up), ("server", &down)] {
                assert!(
                    !bytes.windows(32).any(|w| w == &secret[..32]),
                    "{side}: payload"
                );
                assert!(
                    !bytes.windows(fingerprint.len()).any(|w| w == fingerprint),
                    "{side}: build"
                );
                assert!(!bytes.windows(3).any(|w| w == b"CPU"), "{side}: devices");
            }
            // Replaying everything the client sent, on a new connection, gets no session: the
            // server's fresh key makes the recorded records fail authentication.
            let mut replay = TcpStream::connect(srv.addr()).unwrap();
            replay.set_read_timeout(Some(DEADLINE)).unwrap();
            let _ = replay.write_all(&up);
            let _ = replay.shutdown(std::net::Shutdown::Write);
            let mut answer = Vec::new();
            let _ = replay.read_to_end(&mut answer);
            // The preamble and the server's handshake message, then nothing.
            assert!(
                answer.len() <= 9 + 2 + 48,
                "{} bytes answered",
                answer.len()
            );
        },
    );
}

#[test]
fn a_wrong_token_learns_only_the_protocol_version() {
    case(
        |_| {},
        |srv| {
            let start = Instant::now();
            let err = Raw::connect(srv.addr(), b"guess", Role::Client)
                .err()
                .unwrap();
            assert!(err.to_string().contains("authentication failed"), "{err}");
            assert!(start.elapsed() < DEADLINE);
            // Bytes in the clear get nothing but the preamble, garbage gets nothing at all.
            for opening in [
                &b"FGRN\x02\x00\x00\x00\x00\xff\xff"[..],
                b"GET / HTTP/1.1\r\n\r\n",
                &[0u8; 4096],
            ] {
                let mut s = TcpStream::connect(srv.addr()).unwrap();
                s.set_read_timeout(Some(DEADLINE)).unwrap();
                let _ = s.write_all(opening);
                let _ = s.shutdown(std::net::Shutdown::Write);
                let mut answer = Vec::new();
                let _ = s.read_to_end(&mut answer);
                assert!(answer.len() <= 9, "{answer:?}");
            }
        },
    );
}

// ----- 5. connections -----

#[test]
fn idle_unauthenticated_connections_do_not_lock_out_a_token_holder() {
    case(
        |c| c.max_handshakes = 16,
        |srv| {
            let idle: Vec<TcpStream> = (0..200)
                .filter_map(|_| TcpStream::connect(srv.addr()).ok())
                .collect();
            std::thread::sleep(Duration::from_millis(200));
            healthy(srv.addr());
            drop(idle);
        },
    );
}

#[test]
fn sessions_beyond_the_limit_are_refused_and_the_others_go_on() {
    case(
        |c| c.max_sessions = 2,
        |srv| {
            let (mut a, wa) = Raw::handshake(srv.addr(), TOKEN);
            let (_b, wb) = Raw::handshake(srv.addr(), TOKEN);
            let (_c, wc) = Raw::handshake(srv.addr(), TOKEN);
            assert!(wa.is_ok() && wb.is_ok());
            assert!(wc.unwrap_err().message.contains("busy"));
            assert_eq!(
                a.request(1, &Request::Memory { device: 0 }, &[]).unwrap().0,
                Command::Reply
            );
        },
    );
}

// ----- load -----

#[test]
fn twenty_clients_times_fifty_round_trips() {
    case(
        |_| {},
        |srv| {
            let addr = srv.addr();
            let workers: Vec<_> = (0..20)
                .map(|_| {
                    std::thread::spawn(move || {
                        let (mut raw, welcome) = Raw::handshake(addr, TOKEN);
                        welcome.unwrap();
                        let h = alloc(&mut raw, 1, 4096);
                        let data = vec![9u8; 4096];
                        let mut times = Vec::new();
                        for i in 0..50u64 {
                            let start = Instant::now();
                            let set = Request::Set {
                                buffer: h,
                                offset: 0,
                            };
                            assert_eq!(
                                raw.request(10 + 2 * i, &set, &data).unwrap().0,
                                Command::Reply
                            );
                            let get = Request::Get {
                                buffer: h,
                                offset: 0,
                                len: 4096,
                            };
                            assert_eq!(raw.request(11 + 2 * i, &get, &[]).unwrap().2, data);
                            times.push(start.elapsed());
                        }
                        times
                    })
                })
                .collect();
            let mut times: Vec<Duration> = workers
                .into_iter()
                .flat_map(|w| w.join().unwrap())
                .collect();
            assert_eq!(times.len(), 1000);
            times.sort();
            println!(
                "20 clients x 50 round trips: p50 {:?}, p99 {:?}, max {:?}",
                times[500], times[989], times[999]
            );
        },
    );
}
