//! Remote devices on loopback: in-process device servers on 127.0.0.1:0 and clients that drive
//! them through the ordinary device, buffer, backend and scheduler interfaces.

use std::io::{Read, Write};
use std::net::TcpStream;

mod remote_wire;
use remote_wire::{error_message, Raw};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferrograph::alloc::alloc_ctx_tensors_from_buft;
use ferrograph::backend::{tensor_copy, tensor_copy_async, Backend};
use ferrograph::buffer::BufferUsage;
use ferrograph::context::Context;
use ferrograph::device::{BackendParams, Device};
use ferrograph::dtype::DType;
use ferrograph::error::Error;
use ferrograph::graph::Graph;
use ferrograph::graph_copy::compare_graph_backend;
use ferrograph::ops::{self, GluOp, Op, RopeMode, RopeParams, UnaryOp};
use ferrograph::remote::protocol::{
    decode_meta, encode_meta, Command, ErrorReply, FrameHeader, FrameLimits, Reply, Request,
    HEADER_LEN, PROTOCOL_VERSION,
};
use ferrograph::remote::secure::{client_handshake, Role};
use ferrograph::remote::weight_cache::{content_hash, ENTRY_OVERHEAD};
use ferrograph::remote::wire::{build_graph, GraphDesc, GraphLimits, TensorDesc};
use ferrograph::remote::{connect, ClientSettings, RemoteRegistration, Server, ServerConfig};
use ferrograph::sched::Scheduler;
use ferrograph::tensor::Tensor;
use proptest::prelude::*;

const TOKEN: &[u8] = b"test-token-0123456789";

fn server() -> Server {
    let mut config = ServerConfig::new(TOKEN);
    config.n_threads = Some(1);
    Server::start(config).expect("server starts")
}

fn fast_settings() -> ClientSettings {
    ClientSettings {
        heartbeat: Duration::from_millis(200),
        dead_after: Duration::from_millis(1500),
        ..ClientSettings::default()
    }
}

fn client(server: &Server) -> Arc<RemoteRegistration> {
    connect(&server.addr().to_string(), Some(TOKEN), fast_settings()).expect("client connects")
}

fn remote_backend(reg: &RemoteRegistration) -> Arc<dyn Backend> {
    reg.remote_devices()[0]
        .init_backend(&BackendParams::default())
        .unwrap()
}

fn cpu() -> Arc<dyn Backend> {
    ferrograph::registry::init_by_name("CPU", "n_threads=1").unwrap()
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

fn fill(t: &Tensor, seed: u32) {
    if t.dtype() == DType::I32 {
        let rows: Vec<f32> = (0..t.nelements()).map(|i| (i % 7) as f32).collect();
        t.set_f32(&rows).unwrap();
    } else {
        t.set_f32(&values(t.nelements(), seed)).unwrap();
    }
}

/// The ops of the MiniLM graph (embedding gather, layer norm, linear layers with f32 and f16
/// weights, attention through permutes, a masked softmax and flash attention, exact GELU,
/// residuals) in one small graph.
fn minilm_ops_graph(ctx: &Context) -> (Graph, Vec<Tensor>) {
    let (d, heads, seq, batch, vocab) = (16usize, 2usize, 5usize, 2usize, 11usize);
    let hd = d / heads;
    let table = ctx.new_tensor(DType::F32, &[d, vocab]).unwrap();
    let ids = ctx.new_tensor(DType::I32, &[seq * batch]).unwrap();
    let w_f32 = ctx.new_tensor(DType::F32, &[d, d]).unwrap();
    let w_f16 = ctx.new_tensor(DType::F16, &[d, d]).unwrap();
    let bias = ctx.new_tensor(DType::F32, &[d]).unwrap();
    let gamma = ctx.new_tensor(DType::F32, &[d]).unwrap();
    let mask = ctx.new_tensor(DType::F32, &[seq, seq]).unwrap();
    let mask16 = ctx.new_tensor(DType::F16, &[seq, seq]).unwrap();
    let leafs = vec![
        table.clone(),
        ids.clone(),
        w_f32.clone(),
        w_f16.clone(),
        bias.clone(),
        gamma.clone(),
        mask.clone(),
        mask16.clone(),
    ];
    let x = ops::get_rows(ctx, &table, &ids).unwrap();
    let x = ops::norm(ctx, &x, 1e-12).unwrap();
    let x = ops::add(ctx, &ops::mul(ctx, &x, &gamma).unwrap(), &bias).unwrap();
    let q = ops::add(ctx, &ops::mul_mat(ctx, &w_f32, &x).unwrap(), &bias).unwrap();
    let k = ops::mul_mat(ctx, &w_f16, &x).unwrap();
    let heads_of = |t: &Tensor| {
        let r = ops::reshape(ctx, t, &[hd, heads, seq, batch]).unwrap();
        ops::permute(ctx, &r, [0, 2, 1, 3]).unwrap()
    };
    let (qh, kh) = (heads_of(&q), heads_of(&k));
    let scores = ops::mul_mat(ctx, &kh, &qh).unwrap();
    let probs = ops::soft_max(ctx, &scores, Some(&mask), 0.35, 0.0).unwrap();
    let vt = ops::cont(ctx, &ops::transpose(ctx, &kh).unwrap()).unwrap();
    let ctx_heads = ops::mul_mat(ctx, &vt, &probs).unwrap();
    let merged = ops::cont(ctx, &ops::permute(ctx, &ctx_heads, [0, 2, 1, 3]).unwrap()).unwrap();
    let merged = ops::reshape(ctx, &merged, &[d, seq * batch]).unwrap();
    let qf = ops::cont(ctx, &qh).unwrap();
    let kf = ops::cont(ctx, &kh).unwrap();
    let fa = ops::flash_attn_ext(ctx, &qf, &kf, &kf, Some(&mask16), 0.35, 0.0, 0.0).unwrap();
    let fa = ops::reshape(ctx, &fa, &[d, seq * batch]).unwrap();
    let h = ops::unary(ctx, &ops::add(ctx, &merged, &fa).unwrap(), UnaryOp::GeluErf).unwrap();
    let first = ops::view(ctx, &h, &[d, seq], &[h.nb()[1]], 0).unwrap();
    let out = ops::add(ctx, &ops::cont(ctx, &first).unwrap(), &bias).unwrap();
    out.set_output();
    (Graph::build(&[out]), leafs)
}

#[test]
fn minilm_ops_on_a_remote_device_equal_the_local_cpu() {
    let srv = server();
    let reg = client(&srv);
    let remote = remote_backend(&reg);
    let cpu = cpu();
    let ctx = Context::new(true);
    let (graph, leafs) = minilm_ops_graph(&ctx);
    let _buffer =
        alloc_ctx_tensors_from_buft(&ctx, ferrograph::buffer::CpuBufferType::shared()).unwrap();
    for (i, leaf) in leafs.iter().enumerate() {
        fill(leaf, i as u32 + 1);
    }
    let mut compared = 0;
    let mut worst = 0f32;
    let ok = compare_graph_backend(cpu.as_ref(), remote.as_ref(), &graph, |_, a, b| {
        let (x, y) = (a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
        assert_eq!(x.len(), y.len());
        for (p, q) in x.iter().zip(&y) {
            worst = worst.max((p - q).abs());
        }
        compared += 1;
        true
    })
    .unwrap();
    assert!(ok);
    let computed = graph
        .nodes()
        .iter()
        .filter(|t| !t.op().is_view_op())
        .count();
    assert_eq!(compared, computed);
    // Same kernels, same thread count: the same bits.
    assert_eq!(
        worst, 0.0,
        "remote results differ from the CPU's by {worst}"
    );
}

#[test]
fn copies_in_every_direction() {
    let b = server();
    let mut config = ServerConfig::new(TOKEN);
    config.n_threads = Some(1);
    config.peers = vec![b.addr()];
    let a = Server::start(config).unwrap();
    let (ra, rb) = (client(&a), client(&b));
    let (ba, bb, cpu) = (remote_backend(&ra), remote_backend(&rb), cpu());
    let ctx = Context::new(true);
    let n = 1000;
    let host = ctx.new_tensor(DType::F32, &[n]).unwrap();
    let back = ctx.new_tensor(DType::F32, &[n]).unwrap();
    let host_buf =
        alloc_ctx_tensors_from_buft(&ctx, ferrograph::buffer::CpuBufferType::shared()).unwrap();
    let rctx = Context::new(true);
    let on_a = rctx.new_tensor(DType::F32, &[n]).unwrap();
    let on_a2 = rctx.new_tensor(DType::F32, &[n]).unwrap();
    let _a_buf = alloc_ctx_tensors_from_buft(&rctx, ra.remote_devices()[0].buffer_type()).unwrap();
    let bctx = Context::new(true);
    let on_b = bctx.new_tensor(DType::F32, &[n]).unwrap();
    let _b_buf = alloc_ctx_tensors_from_buft(&bctx, rb.remote_devices()[0].buffer_type()).unwrap();
    let data = values(n, 9);
    host.set_f32(&data).unwrap();
    // host → A, A → A, A → B (server to server), B → host.
    tensor_copy_async(cpu.as_ref(), ba.as_ref(), &host, &on_a).unwrap();
    tensor_copy_async(ba.as_ref(), ba.as_ref(), &on_a, &on_a2).unwrap();
    tensor_copy_async(ba.as_ref(), bb.as_ref(), &on_a2, &on_b).unwrap();
    bb.synchronize().unwrap();
    tensor_copy_async(bb.as_ref(), cpu.as_ref(), &on_b, &back).unwrap();
    assert_eq!(back.to_f32_vec().unwrap(), data);
    // The same through this process (direct copies off), into a second client of B.
    let settings = ClientSettings {
        direct_copies: false,
        ..fast_settings()
    };
    let rb_relay = connect(&b.addr().to_string(), Some(TOKEN), settings).unwrap();
    let bb_relay = remote_backend(&rb_relay);
    let relay_ctx = Context::new(true);
    let relayed = relay_ctx.new_tensor(DType::F32, &[n]).unwrap();
    let _relay_buf =
        alloc_ctx_tensors_from_buft(&relay_ctx, rb_relay.remote_devices()[0].buffer_type())
            .unwrap();
    tensor_copy_async(ba.as_ref(), bb_relay.as_ref(), &on_a2, &relayed).unwrap();
    assert_eq!(relayed.to_f32_vec().unwrap(), data);
    // The synchronous generic copy (host bounce), and partial reads at an offset.
    on_a.fill_bytes(0, 4 * n, 0).unwrap();
    tensor_copy(&on_b, &on_a).unwrap();
    let mut four = [0u8; 16];
    on_a.read_bytes(40, &mut four).unwrap();
    let expect: Vec<u8> = data[10..14].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(four.to_vec(), expect);
    // Out of range reads are refused by the tensor (before the wire) and by the server.
    assert!(matches!(
        on_a.read_bytes(4 * n - 2, &mut four),
        Err(Error::OutOfRange { .. })
    ));
    drop(host_buf);
}

/// y = gelu(W x + b) with W and b on the remote device, x fed from the host.
fn mlp(ctx: &Context, d: usize, n: usize) -> (Tensor, Tensor, Tensor, Tensor) {
    mlp_in(ctx, ctx, d, n)
}

/// [`mlp`] with the weights made in `wctx`.
fn mlp_in(wctx: &Context, ctx: &Context, d: usize, n: usize) -> (Tensor, Tensor, Tensor, Tensor) {
    let w = wctx.new_tensor(DType::F32, &[d, d]).unwrap();
    let b = wctx.new_tensor(DType::F32, &[d]).unwrap();
    let x = ctx.new_tensor(DType::F32, &[d, n]).unwrap();
    x.set_input();
    let h = ops::add(ctx, &ops::mul_mat(ctx, &w, &x).unwrap(), &b).unwrap();
    let y = ops::scale(ctx, &ops::unary(ctx, &h, UnaryOp::Gelu).unwrap(), 0.5, 0.0).unwrap();
    y.set_output();
    (w, b, x, y)
}

#[test]
fn scheduler_pipelines_over_a_remote_device_with_two_copies() {
    let srv = server();
    let reg = client(&srv);
    let remote = remote_backend(&reg);
    let (d, n) = (32, 6);
    // Reference on the CPU alone.
    let cctx = Context::new(false);
    let (cw, cb, cx, cy) = mlp(&cctx, d, n);
    cw.set_f32(&values(d * d, 1)).unwrap();
    cb.set_f32(&values(d, 2)).unwrap();
    // Weights on the remote device; the scheduler copies x over and y back.
    let (wctx, ctx) = (Context::new(true), Context::new(true));
    let (w, b, x, y) = mlp_in(&wctx, &ctx, d, n);
    let wbuf = alloc_ctx_tensors_from_buft(&wctx, reg.remote_devices()[0].buffer_type()).unwrap();
    for buffer in &wbuf {
        buffer.set_usage(BufferUsage::Weights);
    }
    w.set_f32(&values(d * d, 1)).unwrap();
    b.set_f32(&values(d, 2)).unwrap();
    let graph = Graph::build(std::slice::from_ref(&y));
    let mut sched = Scheduler::new(vec![remote.clone(), cpu()], None, 64, true, false).unwrap();
    sched.set_n_copies(2).unwrap();
    sched.reserve(&graph).unwrap();
    let cpu_backend = cpu();
    for round in 0..4u32 {
        let input = values(d * n, 10 + round);
        sched.alloc_graph(&graph).unwrap();
        x.set_f32(&input).unwrap();
        sched.graph_compute(&graph).unwrap();
        cx.set_f32(&input).unwrap();
        cpu_backend
            .graph_compute(&Graph::build(std::slice::from_ref(&cy)))
            .unwrap();
        assert_eq!(
            y.to_f32_vec().unwrap(),
            cy.to_f32_vec().unwrap(),
            "round {round}"
        );
    }
    let plan = sched.plan().unwrap();
    assert!(plan.splits.iter().any(|s| s.backend == 0), "{plan}");
}

#[test]
fn two_clients_compute_at_once() {
    let srv = server();
    let run = |seed: u32| {
        let reg = client(&srv);
        let remote = remote_backend(&reg);
        let ctx = Context::new(true);
        let (w, b, x, y) = mlp(&ctx, 64, 8);
        let _buf =
            alloc_ctx_tensors_from_buft(&ctx, reg.remote_devices()[0].buffer_type()).unwrap();
        w.set_f32(&values(64 * 64, seed)).unwrap();
        b.set_f32(&values(64, seed + 1)).unwrap();
        x.set_f32(&values(64 * 8, seed + 2)).unwrap();
        let graph = Graph::build(std::slice::from_ref(&y));
        let mut last = Vec::new();
        for _ in 0..20 {
            remote.graph_compute(&graph).unwrap();
            last = y.to_f32_vec().unwrap();
        }
        (last, reg)
    };
    let (one, two) = std::thread::scope(|s| {
        let a = s.spawn(|| run(1));
        let b = s.spawn(|| run(50));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!(srv.sessions(), 2);
    // Each equals a single-client CPU run of its own data.
    for (seed, (result, _)) in [(1, &one), (50, &two)] {
        let ctx = Context::new(false);
        let (w, b, x, y) = mlp(&ctx, 64, 8);
        w.set_f32(&values(64 * 64, seed)).unwrap();
        b.set_f32(&values(64, seed + 1)).unwrap();
        x.set_f32(&values(64 * 8, seed + 2)).unwrap();
        cpu()
            .graph_compute(&Graph::build(std::slice::from_ref(&y)))
            .unwrap();
        assert_eq!(result, &y.to_f32_vec().unwrap());
    }
    drop((one, two));
    let deadline = Instant::now() + Duration::from_secs(5);
    while srv.sessions() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(srv.sessions(), 0, "sessions end when their clients leave");
}

/// Rows and columns of [`slow_graph`]'s matrices.
const SLOW: usize = 512;

/// A graph that takes a while: a chain of 400 products of SLOW × SLOW matrices (107 GFLOP,
/// a quarter of a second at 450 GFLOPS; 256 × 256 finished within the test's 150 ms on a
/// Zen 5 machine).
fn slow_graph(ctx: &Context) -> (Tensor, Tensor, Graph) {
    let w = ctx.new_tensor(DType::F32, &[SLOW, SLOW]).unwrap();
    let x = ctx.new_tensor(DType::F32, &[SLOW, SLOW]).unwrap();
    let mut y = x.clone();
    for _ in 0..400 {
        y = ops::scale(ctx, &ops::mul_mat(ctx, &w, &y).unwrap(), 0.01, 0.0).unwrap();
    }
    (w, x, Graph::build(&[y]))
}

fn lost_within(limit: Duration, what: &str, f: impl FnOnce() -> Result<(), Error>) {
    let start = Instant::now();
    let err = f().expect_err(what);
    let took = start.elapsed();
    assert!(matches!(err, Error::DeviceLost(_)), "{what}: {err}");
    assert!(took < limit, "{what}: DeviceLost after {took:?}");
}

#[test]
fn a_server_killed_mid_compute_gives_device_lost() {
    let mut srv = server();
    let reg = client(&srv);
    let remote = remote_backend(&reg);
    let ctx = Context::new(true);
    let (w, x, graph) = slow_graph(&ctx);
    let _buf = alloc_ctx_tensors_from_buft(&ctx, reg.remote_devices()[0].buffer_type()).unwrap();
    w.set_f32(&values(SLOW * SLOW, 3)).unwrap();
    x.set_f32(&values(SLOW * SLOW, 4)).unwrap();
    remote.graph_compute_async(&graph).unwrap();
    std::thread::sleep(Duration::from_millis(150));
    srv.stop();
    lost_within(Duration::from_secs(3), "killed server", || {
        remote.synchronize()
    });
    // Everything after fails the same way, at once.
    lost_within(Duration::from_millis(200), "after loss", || {
        remote.graph_compute(&graph).map(|_| ())
    });
    assert!(reg.lost().is_some());
    // A scheduler rebuilt from the remaining devices (another server and the CPU) works.
    let other = server();
    let reg2 = client(&other);
    let (wctx, gctx) = (Context::new(true), Context::new(true));
    let (w2, b2, x2, y2) = mlp_in(&wctx, &gctx, 16, 3);
    let _wbuf = alloc_ctx_tensors_from_buft(&wctx, reg2.remote_devices()[0].buffer_type()).unwrap();
    fill(&w2, 5);
    fill(&b2, 6);
    let g2 = Graph::build(std::slice::from_ref(&y2));
    let mut sched =
        Scheduler::new(vec![remote_backend(&reg2), cpu()], None, 64, false, false).unwrap();
    sched.alloc_graph(&g2).unwrap();
    fill(&x2, 7);
    sched.graph_compute(&g2).unwrap();
    assert!(y2.to_f32_vec().unwrap().iter().all(|v| v.is_finite()));
}

#[test]
fn a_hung_server_gives_device_lost_within_the_deadline() {
    let srv = server();
    let reg = client(&srv);
    let remote = remote_backend(&reg);
    let ctx = Context::new(true);
    let (w, b, x, y) = mlp(&ctx, 16, 2);
    let _buf = alloc_ctx_tensors_from_buft(&ctx, reg.remote_devices()[0].buffer_type()).unwrap();
    for (i, t) in [&w, &b, &x].into_iter().enumerate() {
        fill(t, i as u32);
    }
    remote
        .graph_compute(&Graph::build(std::slice::from_ref(&y)))
        .unwrap();
    srv.set_frozen(true);
    lost_within(Duration::from_secs(4), "hung server", || {
        remote
            .graph_compute(&Graph::build(std::slice::from_ref(&y)))
            .map(|_| ())
    });
    srv.set_frozen(false);
    // The server itself is fine: a new client works.
    let again = client(&srv);
    assert_eq!(again.remote_devices().len(), reg.remote_devices().len());
}

// ----- the raw protocol (tests/remote_wire) -----

#[test]
fn wrong_token_version_or_build_is_refused() {
    let srv = server();
    let err = connect(
        &srv.addr().to_string(),
        Some(b"not the token"),
        fast_settings(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("authentication failed"), "{err}");
    let refused = Raw::connect(srv.addr(), b"also wrong", Role::Client);
    assert!(refused.is_err_and(|e| e.to_string().contains("authentication failed")));
    // The token of a client is not the key of a peer: a client cannot pose as a server.
    assert!(Raw::connect(srv.addr(), TOKEN, Role::Peer).is_ok());
    let mut peer_cfg = ServerConfig::new(TOKEN);
    peer_cfg.peer_token = Some(b"cluster secret".to_vec());
    let guarded = Server::start(peer_cfg).unwrap();
    assert!(Raw::connect(guarded.addr(), TOKEN, Role::Peer).is_err());

    // Another protocol version learns why, and nothing more.
    let mut s = TcpStream::connect(srv.addr()).unwrap();
    let err =
        client_handshake(&mut s, TOKEN, Role::Client, PROTOCOL_VERSION + 1, "srv").unwrap_err();
    assert!(
        err.to_string().contains("protocol version mismatch"),
        "{err}"
    );
    let mut raw = Raw::connect(srv.addr(), TOKEN, Role::Client).unwrap();
    let (h, m) = raw
        .hello(PROTOCOL_VERSION + 1, ferrograph::dynload::abi_fingerprint())
        .unwrap();
    assert_eq!(h.command, Command::Error);
    assert!(error_message(&m).contains("protocol version mismatch"));
    assert!(raw.recv().is_none(), "closed after the refusal");

    let mut raw = Raw::connect(srv.addr(), TOKEN, Role::Client).unwrap();
    let (h, m) = raw.hello(PROTOCOL_VERSION, "some other build").unwrap();
    assert_eq!(h.command, Command::Error);
    assert!(error_message(&m).contains("build fingerprint mismatch"));

    // A frame in the clear before the handshake gets no answer at all: the connection closes.
    let mut plain = TcpStream::connect(srv.addr()).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let h = FrameHeader {
        command: Command::Request,
        request_id: 1,
        meta_len: 3,
        payload_len: 0,
    };
    let _ = plain.write_all(&h.encode());
    let _ = plain.write_all(&encode_meta(&Request::Memory { device: 0 }).unwrap());
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer);
    assert!(answer.is_empty(), "{answer:?}");
    // A request instead of HELLO is refused.
    let mut raw = Raw::connect(srv.addr(), TOKEN, Role::Client).unwrap();
    let (c, _, _) = raw.request(1, &Request::Memory { device: 0 }, &[]).unwrap();
    assert_eq!(c, Command::Error);
    // And the right token works.
    let (_, ok) = Raw::handshake(srv.addr(), TOKEN);
    assert!(ok.unwrap().devices.iter().any(|d| d.name == "CPU"));
}

fn leaf(dtype: DType, ne: [u64; 4], binding: Option<(u64, u64)>) -> TensorDesc {
    let nb0 = dtype.type_size() as u64;
    TensorDesc {
        dtype,
        ne,
        nb: [
            nb0,
            nb0 * ne[0],
            nb0 * ne[0] * ne[1],
            nb0 * ne[0] * ne[1] * ne[2],
        ],
        ndim: 4,
        op: Some(Op::None),
        srcs: vec![],
        view: None,
        binding,
        flags: 0,
    }
}

#[test]
fn graphs_are_validated_and_invalidated_with_their_buffers() {
    let srv = server();
    let (mut raw, welcome) = Raw::handshake(srv.addr(), TOKEN);
    welcome.unwrap();
    let (c, m, _) = raw
        .request(
            1,
            &Request::Alloc {
                device: 0,
                size: 256,
            },
            &[],
        )
        .unwrap();
    assert_eq!(c, Command::Reply);
    let Reply::Buffer { handle, .. } = decode_meta(&m).unwrap() else {
        panic!("no buffer")
    };
    let a = leaf(DType::F32, [4, 4, 1, 1], Some((handle, 0)));
    let mut sum = leaf(DType::F32, [4, 4, 1, 1], Some((handle, 128)));
    sum.op = Some(Op::Add);
    sum.srcs = vec![0, 0];
    let good = GraphDesc {
        tensors: vec![a.clone(), sum.clone()],
        nodes: vec![1],
        leafs: vec![0],
    };
    let compute = |graph: u64, desc: Option<GraphDesc>| Request::Compute {
        device: 0,
        graph,
        desc,
    };
    let (c, m, _) = raw
        .request(2, &compute(7, Some(good.clone())), &[])
        .unwrap();
    assert_eq!(c, Command::Reply, "{}", String::from_utf8_lossy(&m));
    let (c, _, _) = raw.request(3, &compute(7, None), &[]).unwrap();
    assert_eq!(c, Command::Reply, "the cached graph runs again by key");

    // Each of these is refused with an error, and the session goes on.
    let mut bad_cases: Vec<(&str, GraphDesc)> = Vec::new();
    let mut g = good.clone();
    g.tensors[1].binding = Some((handle, 250));
    bad_cases.push(("out of the buffer", g));
    let mut g = good.clone();
    g.tensors[1].binding = Some((handle, 4));
    bad_cases.push(("misaligned", g));
    let mut g = good.clone();
    g.tensors[1].binding = Some((handle + 99, 0));
    bad_cases.push(("unknown handle", g));
    let mut g = good.clone();
    g.tensors[1].srcs = vec![0, 1];
    bad_cases.push(("edge to itself", g));
    let mut g = good.clone();
    g.tensors[1].ne = [4, 5, 1, 1];
    bad_cases.push(("shape that the op does not give", g));
    let mut g = good.clone();
    g.tensors[1].op = Some(Op::MulMat);
    g.tensors[0].dtype = DType::I32;
    bad_cases.push(("dtype the op refuses", g));
    let mut g = good.clone();
    g.tensors[0].nb = [u64::MAX / 2, 1, 1, 1];
    bad_cases.push(("strides that are not the leaf's", g));
    let mut g = good.clone();
    g.tensors[1].binding = None;
    bad_cases.push(("unbound node", g));
    let mut g = good.clone();
    g.nodes = vec![1, 1];
    bad_cases.push(("node twice", g));
    let mut g = good.clone();
    g.tensors[0].op = None;
    g.tensors[0].nb = [4, u64::MAX / 3, 16, 16];
    bad_cases.push(("overflowing strides", g));
    let mut g = good.clone();
    g.tensors[0].op = None;
    g.tensors[0].nb = [4, 0, 16, 16];
    bad_cases.push(("overlapping rows", g));
    for (i, (what, desc)) in bad_cases.into_iter().enumerate() {
        let (c, m, _) = raw
            .request(10 + i as u64, &compute(100 + i as u64, Some(desc)), &[])
            .unwrap();
        assert_eq!(c, Command::Error, "{what} was accepted");
        assert!(!decode_meta::<ErrorReply>(&m).unwrap().fatal, "{what}");
    }
    // Freeing the buffer forgets the graph: recomputing it by key is an error, not a read of
    // freed memory.
    let (c, _, _) = raw
        .request(50, &Request::Free { buffer: handle }, &[])
        .unwrap();
    assert_eq!(c, Command::Reply);
    let (c, m, _) = raw.request(51, &compute(7, None), &[]).unwrap();
    assert_eq!(c, Command::Error);
    assert!(error_message(&m).contains("not cached"));
    // Reads and writes out of range, and oversized allocations.
    let (_, m, _) = raw
        .request(
            52,
            &Request::Alloc {
                device: 0,
                size: 64,
            },
            &[],
        )
        .unwrap();
    let Reply::Buffer { handle, .. } = decode_meta(&m).unwrap() else {
        panic!()
    };
    let get = Request::Get {
        buffer: handle,
        offset: 60,
        len: 8,
    };
    assert_eq!(raw.request(53, &get, &[]).unwrap().0, Command::Error);
    let set = Request::Set {
        buffer: handle,
        offset: u64::MAX - 2,
    };
    assert_eq!(
        raw.request(54, &set, &[1, 2, 3, 4]).unwrap().0,
        Command::Error
    );
    let alloc = Request::Alloc {
        device: 0,
        size: u64::MAX,
    };
    assert_eq!(raw.request(55, &alloc, &[]).unwrap().0, Command::Error);
    let alloc = Request::Alloc { device: 9, size: 8 };
    assert_eq!(raw.request(56, &alloc, &[]).unwrap().0, Command::Error);
    // A malformed frame closes this connection (after an error), and only this one.
    raw.send(Command::Request, 57, &[250, 250, 250], &[]);
    let (h, m, _) = raw.recv().unwrap();
    assert_eq!(h.command, Command::Error);
    assert!(decode_meta::<ErrorReply>(&m).unwrap().fatal);
    assert!(raw.recv().is_none());
    let (_, ok) = Raw::handshake(srv.addr(), TOKEN);
    assert!(ok.is_ok());
}

/// A count or size parameter: small, or large enough to overflow whatever it drives.
fn arb_count() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..8,
        Just(usize::MAX),
        Just(1usize << 62),
        Just(1usize << 40)
    ]
}

fn arb_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        any::<f32>(),
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(-1.0f32),
        Just(0.0f32)
    ]
}

/// Any op but a custom one (which no decoder produces), with hostile parameters among the
/// plausible ones; `None` is an external tensor.
fn arb_op() -> impl Strategy<Value = Option<Op>> {
    let plain = prop::sample::select(vec![
        Op::None,
        Op::Dup,
        Op::Add,
        Op::Sub,
        Op::Mul,
        Op::Div,
        Op::Add1,
        Op::Sqr,
        Op::Sqrt,
        Op::Log,
        Op::Sin,
        Op::Cos,
        Op::Sum,
        Op::SumRows,
        Op::Mean,
        Op::Argmax,
        Op::Repeat,
        Op::MulMat,
        Op::MulMatId,
        Op::OutProd,
        Op::Cpy,
        Op::Cont,
        Op::Reshape,
        Op::View,
        Op::Transpose,
        Op::GetRows,
        Op::SetRows,
    ]);
    let with_params = prop_oneof![
        [arb_count(), arb_count(), arb_count(), arb_count()].prop_map(|a| Op::Permute { axes: a }),
        arb_f32().prop_map(|eps| Op::Norm { eps }),
        arb_f32().prop_map(|eps| Op::RmsNorm { eps }),
        arb_f32().prop_map(|eps| Op::L2Norm { eps }),
        (arb_count(), arb_f32()).prop_map(|(n_groups, eps)| Op::GroupNorm { n_groups, eps }),
        prop::sample::select(UnaryOp::ALL.to_vec()).prop_map(Op::Unary),
        arb_f32().prop_map(|negative_slope| Op::LeakyRelu { negative_slope }),
        (
            prop::sample::select(vec![GluOp::Reglu, GluOp::Geglu, GluOp::Swiglu]),
            any::<bool>()
        )
            .prop_map(|(op, swapped)| Op::Glu { op, swapped }),
        (arb_f32(), arb_f32()).prop_map(|(scale, max_bias)| Op::SoftMax { scale, max_bias }),
        (arb_f32(), arb_f32()).prop_map(|(s, b)| Op::Scale { s, b }),
        (arb_f32(), arb_f32()).prop_map(|(min, max)| Op::Clamp { min, max }),
        arb_count().prop_map(|n_past| Op::DiagMaskInf { n_past }),
        (arb_count(), arb_count(), arb_count(), arb_count()).prop_map(|(nb1, nb2, nb3, offset)| {
            Op::Acc {
                nb1: nb1.saturating_mul(4),
                nb2,
                nb3,
                offset,
            }
        }),
        (arb_f32(), arb_f32(), arb_f32()).prop_map(|(scale, max_bias, logit_softcap)| {
            Op::FlashAttnExt {
                scale,
                max_bias,
                logit_softcap,
            }
        }),
        arb_count().prop_map(|dim| Op::Concat { dim }),
        (
            arb_count(),
            any::<bool>(),
            arb_count(),
            arb_f32(),
            arb_f32()
        )
            .prop_map(|(n_dims, neox, n_ctx_orig, freq_base, beta_fast)| {
                let mode = if neox {
                    RopeMode::Neox
                } else {
                    RopeMode::Normal
                };
                Op::Rope(RopeParams {
                    n_ctx_orig,
                    freq_base,
                    beta_fast,
                    ..RopeParams::new(n_dims, mode)
                })
            }),
    ];
    prop_oneof![
        1 => Just(None),
        4 => plain.prop_map(Some),
        4 => with_params.prop_map(Some),
    ]
}

fn arb_dim() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..8, Just(0u64), Just(u64::MAX), Just(1u64 << 40)]
}

fn arb_tensor() -> impl Strategy<Value = TensorDesc> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        [arb_dim(), arb_dim(), arb_dim(), arb_dim()],
        [arb_dim(), arb_dim(), arb_dim(), arb_dim()],
        0u8..6,
        arb_op(),
        prop::collection::vec(0u32..8, 0..4),
        prop::option::of((0u32..8, 0u64..64)),
        prop::option::of((0u64..4, 0u64..512)),
        any::<u8>(),
    )
        .prop_map(
            |(dtype, ne, nb, ndim, op, srcs, view, binding, flags)| TensorDesc {
                dtype,
                ne,
                nb: nb.map(|x| x.wrapping_mul(4)),
                ndim,
                op,
                srcs,
                view,
                binding,
                flags,
            },
        )
}

fn arb_graph() -> impl Strategy<Value = GraphDesc> {
    (
        prop::collection::vec(arb_tensor(), 0..8),
        prop::collection::vec(0u32..10, 0..6),
        prop::collection::vec(0u32..10, 0..4),
    )
        .prop_map(|(tensors, nodes, leafs)| GraphDesc {
            tensors,
            nodes,
            leafs,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The deserializers never panic: any bytes give a value or an error.
    #[test]
    fn decoders_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let mut head = [0u8; HEADER_LEN];
        for (h, b) in head.iter_mut().zip(&bytes) {
            *h = *b;
        }
        let limits = FrameLimits { max_meta: 1 << 20, max_payload: 1 << 20 };
        let _ = FrameHeader::decode(&head, limits);
        let _ = decode_meta::<Request>(&bytes);
        let _ = decode_meta::<ferrograph::remote::protocol::Hello>(&bytes);
        let _ = decode_meta::<GraphDesc>(&bytes);
        // The handshake's decoders: preambles, Noise messages, records.
        let mut pre = [0u8; 9];
        for (p, b) in pre.iter_mut().zip(&bytes) {
            *p = *b;
        }
        let _ = ferrograph::remote::secure::parse_preamble(&pre);
        let key = ferrograph::remote::secure::psk(TOKEN, Role::Client);
        let mut responder =
            ferrograph::remote::secure::handshake_state(&key, &pre, false).unwrap();
        let mut out = [0u8; 512];
        let _ = responder.read_message(&bytes, &mut out);
        let mut sink = Vec::new();
        let _ = ferrograph::remote::secure::RecordReader::new(&bytes[..], fuzz_keys())
            .read_to_end(&mut sink);
    }

    /// Any graph description is rebuilt or refused, never a panic.
    #[test]
    fn graph_validator_never_panics(desc in arb_graph()) {
        let buffers: Vec<_> = (0..4)
            .map(|_| ferrograph::buffer::alloc_cpu_buffer(512).unwrap())
            .collect();
        let lookup = |h: u64| {
            buffers
                .get(h as usize)
                .cloned()
                .ok_or_else(|| Error::InvalidArgument("no such buffer".into()))
        };
        let _ = build_graph(&desc, &lookup, true, GraphLimits { max_tensors: 64 });
        let _ = build_graph(&desc, &lookup, false, GraphLimits { max_tensors: 64 });
    }
}

/// Transport keys of a finished handshake, for decoding fuzzed records.
fn fuzz_keys() -> ferrograph::remote::secure::Keys {
    use ferrograph::remote::secure::{handshake_state, into_keys, psk};
    let key = psk(TOKEN, Role::Client);
    let mut i = handshake_state(&key, b"fuzz", true).unwrap();
    let mut r = handshake_state(&key, b"fuzz", false).unwrap();
    let (mut m, mut p) = ([0u8; 256], [0u8; 256]);
    let n = i.write_message(&[], &mut m).unwrap();
    r.read_message(&m[..n], &mut p).unwrap();
    let n = r.write_message(&[], &mut m).unwrap();
    i.read_message(&m[..n], &mut p).unwrap();
    into_keys(r).unwrap()
}

#[test]
fn fuzzed_sessions_leave_the_server_serving() {
    let srv = server();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    });
    // Random graphs computed inside an authenticated session (with one real buffer).
    runner
        .run(&arb_graph(), |desc| {
            let (mut raw, welcome) = Raw::handshake(srv.addr(), TOKEN);
            prop_assert!(welcome.is_ok());
            let alloc = Request::Alloc {
                device: 0,
                size: 512,
            };
            let _ = raw.request(1, &alloc, &[]);
            let request = Request::Compute {
                device: 0,
                graph: 1,
                desc: Some(desc),
            };
            if let Some((c, _, _)) = raw.request(2, &request, &[]) {
                prop_assert!(c == Command::Reply || c == Command::Error);
            }
            Ok(())
        })
        .unwrap();
    // Random frames before and after authentication.
    runner
        .run(&prop::collection::vec(any::<u8>(), 0..300), |bytes| {
            // In the clear, and after a valid preamble (fuzzed handshake messages).
            let preamble = ferrograph::remote::secure::preamble(PROTOCOL_VERSION, Role::Client);
            for opening in [&[][..], &preamble[..]] {
                let mut plain = TcpStream::connect(srv.addr()).unwrap();
                plain
                    .set_read_timeout(Some(Duration::from_secs(10)))
                    .unwrap();
                let _ = plain.write_all(opening);
                let _ = plain.write_all(&bytes);
                let _ = plain.shutdown(std::net::Shutdown::Write);
                let _ = plain.read_to_end(&mut Vec::new());
            }
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            raw.send_bytes(&bytes);
            let (mut raw, _) = Raw::handshake(srv.addr(), TOKEN);
            let _ = raw.stream.write_all(&bytes);
            Ok(())
        })
        .unwrap();
    // The server still answers a new client, correctly.
    let reg = client(&srv);
    let remote = remote_backend(&reg);
    let ctx = Context::new(true);
    let (w, b, x, y) = mlp(&ctx, 8, 2);
    let _buf = alloc_ctx_tensors_from_buft(&ctx, reg.remote_devices()[0].buffer_type()).unwrap();
    for (i, t) in [&w, &b, &x].into_iter().enumerate() {
        fill(t, i as u32 + 20);
    }
    remote
        .graph_compute(&Graph::build(std::slice::from_ref(&y)))
        .unwrap();
    let cctx = Context::new(false);
    let (cw, cb, cx, cy) = mlp(&cctx, 8, 2);
    for (i, t) in [&cw, &cb, &cx].into_iter().enumerate() {
        fill(t, i as u32 + 20);
    }
    cpu()
        .graph_compute(&Graph::build(std::slice::from_ref(&cy)))
        .unwrap();
    assert_eq!(y.to_f32_vec().unwrap(), cy.to_f32_vec().unwrap());
}

#[test]
fn supports_op_is_answered_by_the_server() {
    let srv = server();
    let reg = client(&srv);
    let dev = &reg.remote_devices()[0];
    let ctx = Context::new(true);
    let a = ctx.new_tensor(DType::F32, &[8, 4]).unwrap();
    let w = ctx.new_tensor(DType::Q8_0, &[32, 4]).unwrap();
    let x = ctx.new_tensor(DType::F32, &[32, 2]).unwrap();
    assert!(dev.supports_op(&ops::add(&ctx, &a, &a).unwrap()));
    let local = ferrograph::registry::dev_by_name("CPU").unwrap();
    let mm = ops::mul_mat(&ctx, &w, &x).unwrap();
    assert_eq!(dev.supports_op(&mm), local.supports_op(&mm));
    // A custom op runs code of this process: never sent.
    struct Twice;
    impl ferrograph::ops::CustomOp for Twice {
        fn name(&self) -> &str {
            "twice"
        }
        fn compute(&self, _: &Tensor, _: &[Tensor]) -> ferrograph::error::Result<()> {
            Ok(())
        }
    }
    let custom = ops::custom(
        &ctx,
        Arc::new(Twice),
        std::slice::from_ref(&a),
        DType::F32,
        &[8, 4],
    )
    .unwrap();
    assert!(!dev.supports_op(&custom));
    assert!(dev.supports_buft(dev.buffer_type().as_ref()));
    assert!(!dev.supports_buft(ferrograph::buffer::CpuBufferType::shared().as_ref()));
    let (free, total) = dev.memory();
    assert!(total > 0 && free <= total);
}

#[test]
fn large_uploads_are_cached_by_content_hash_across_clients() {
    let srv = server();
    let n = 3 << 20;
    let data: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8).collect();
    let upload = |reg: &RemoteRegistration| {
        let ctx = Context::new(true);
        let t = ctx.new_tensor(DType::I8, &[n]).unwrap();
        let bufs =
            alloc_ctx_tensors_from_buft(&ctx, reg.remote_devices()[0].buffer_type()).unwrap();
        // Not a weight buffer: sent as is, never cached.
        let before = srv.weight_cache_bytes();
        t.write_bytes(0, &data).unwrap();
        t.read_bytes(0, &mut [0u8; 4]).unwrap();
        assert_eq!(srv.weight_cache_bytes(), before);
        for buffer in &bufs {
            buffer.set_usage(BufferUsage::Weights);
        }
        t.write_bytes(0, &data).unwrap();
        let mut back = vec![0u8; n];
        t.read_bytes(0, &mut back).unwrap();
        assert!(back == data);
        bufs
    };
    let first = client(&srv);
    let _a = upload(&first);
    assert_eq!(srv.weight_cache_bytes(), n + ENTRY_OVERHEAD);
    // A second client (or a reconnect) finds it: the server answers the probe from its cache.
    let second = client(&srv);
    let _b = upload(&second);
    assert_eq!(srv.weight_cache_bytes(), n + ENTRY_OVERHEAD, "stored once");
    let (mut raw, welcome) = Raw::handshake(srv.addr(), TOKEN);
    welcome.unwrap();
    let alloc = Request::Alloc {
        device: 0,
        size: n as u64,
    };
    let (_, m, _) = raw.request(1, &alloc, &[]).unwrap();
    let Reply::Buffer { handle, .. } = decode_meta(&m).unwrap() else {
        panic!()
    };
    let probe = |hash| Request::SetCached {
        buffer: handle,
        offset: 0,
        len: n as u64,
        hash,
    };
    let (_, m, _) = raw.request(2, &probe(content_hash(&data)), &[]).unwrap();
    assert_eq!(decode_meta::<Reply>(&m).unwrap(), Reply::Cached(true));
    // Bytes sent under another content's hash are refused and never cached.
    let fake = [9u8; 32];
    let poison = Request::SetAndCache {
        buffer: handle,
        offset: 0,
        hash: fake,
    };
    let (c, _, _) = raw.request(3, &poison, &[1u8; 64]).unwrap();
    assert_eq!(c, Command::Error);
    let (_, m, _) = raw.request(4, &probe(fake), &[]).unwrap();
    assert_eq!(decode_meta::<Reply>(&m).unwrap(), Reply::Cached(false));
}

#[test]
fn a_direct_copy_falls_back_through_the_client_when_servers_cannot_talk() {
    let a = server();
    let mut other = ServerConfig::new(b"another token".to_vec());
    other.n_threads = Some(1);
    let b = Server::start(other).unwrap();
    let ra = client(&a);
    let rb = connect(
        &b.addr().to_string(),
        Some(b"another token"),
        fast_settings(),
    )
    .unwrap();
    let (ba, bb) = (remote_backend(&ra), remote_backend(&rb));
    let (actx, bctx) = (Context::new(true), Context::new(true));
    let src = actx.new_tensor(DType::F32, &[300]).unwrap();
    let dst = bctx.new_tensor(DType::F32, &[300]).unwrap();
    let _abuf = alloc_ctx_tensors_from_buft(&actx, ra.remote_devices()[0].buffer_type()).unwrap();
    let _bbuf = alloc_ctx_tensors_from_buft(&bctx, rb.remote_devices()[0].buffer_type()).unwrap();
    src.set_f32(&values(300, 77)).unwrap();
    // A cannot authenticate to B (different tokens): the copy still arrives.
    tensor_copy_async(ba.as_ref(), bb.as_ref(), &src, &dst).unwrap();
    assert_eq!(dst.to_f32_vec().unwrap(), values(300, 77));
    assert!(ra.lost().is_none() && rb.lost().is_none());
}

#[test]
fn the_ferrograph_serve_binary_prints_its_address_and_serves() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ferrograph"))
        .args(["serve", "--port", "0", "--threads", "1"])
        .env("FERROGRAPH_TOKEN", std::str::from_utf8(TOKEN).unwrap())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let address = line.trim().to_owned();
    let reg = connect(&address, Some(TOKEN), fast_settings());
    let _ = child.kill();
    let _ = child.wait();
    let reg = reg.unwrap();
    assert!(address.starts_with("127.0.0.1:"), "{address}");
    assert_eq!(reg.remote_devices()[0].name(), format!("CPU@{address}"));
    // Without a token it refuses to start.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferrograph"))
        .args(["serve"])
        .env_remove("FERROGRAPH_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("token is required"));
}
