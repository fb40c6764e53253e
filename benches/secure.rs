//! Cost of the remote transport's encryption: sealing and opening the records of an 8 MiB
//! payload (MiniLM's 32x128 activation traffic is about that per call), next to a plain copy
//! of the same bytes. Run with `cargo bench --bench secure`.

use std::hint::black_box;
use std::io::Read;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ferrograph::remote::secure::{handshake_state, into_keys, psk, RecordReader, Role, Sealer};

const BYTES: usize = 8 << 20;

fn keys() -> (
    ferrograph::remote::secure::Keys,
    ferrograph::remote::secure::Keys,
) {
    let key = psk(b"bench token", Role::Client);
    let mut i = handshake_state(&key, b"bench", true).unwrap();
    let mut r = handshake_state(&key, b"bench", false).unwrap();
    let (mut m, mut p) = ([0u8; 256], [0u8; 256]);
    let n = i.write_message(&[], &mut m).unwrap();
    r.read_message(&m[..n], &mut p).unwrap();
    let n = r.write_message(&[], &mut m).unwrap();
    i.read_message(&m[..n], &mut p).unwrap();
    (into_keys(i).unwrap(), into_keys(r).unwrap())
}

fn bench(c: &mut Criterion) {
    let data: Vec<u8> = (0..BYTES).map(|i| (i * 31) as u8).collect();
    let mut group = c.benchmark_group("secure");
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.measurement_time(Duration::from_secs(3));
    group.sample_size(10);
    group.bench_function("copy", |b| {
        let mut out = vec![0u8; BYTES];
        b.iter(|| out.copy_from_slice(black_box(&data)))
    });
    group.bench_function("seal", |b| {
        let (send, _) = keys();
        b.iter(|| {
            let mut sealer = Sealer::new(send.clone());
            sealer.write(black_box(&data)).unwrap();
            sealer.seal_pending().unwrap();
            black_box(sealer.out.len())
        })
    });
    let (send, receive) = keys();
    let mut sealer = Sealer::new(send);
    sealer.write(&data).unwrap();
    sealer.seal_pending().unwrap();
    let wire = sealer.out;
    group.bench_function("open", |b| {
        let mut out = vec![0u8; BYTES];
        b.iter(|| {
            RecordReader::new(black_box(&wire[..]), receive.clone())
                .read_exact(&mut out)
                .unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
