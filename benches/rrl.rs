//! Response rate limiting (`dns::rrl`): what one response's check costs, from one network
//! and from random sources, and what the table holds under a flood of a million random
//! sources: the heap allocated while they are charged (counted by this binary's allocator,
//! which must stay at zero) and the resident memory the table's pages take once touched.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicUsize, Ordering};

use criterion::{Criterion, criterion_group, criterion_main};
use koder_dns::dns::rrl::{BUCKETS, RateLimiter, Settings};

/// The system allocator, counting the bytes it hands out.
struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to the system allocator unchanged; the counter is a side effect.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on to the system allocator as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above, that is from the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Resident memory of this process, in KiB.
fn rss_kib() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn limiter(rate: u32) -> RateLimiter {
    RateLimiter::new(&Settings {
        rate,
        slip: 2,
        exempt: Vec::new(),
    })
    .expect("a rate above 0 is on")
}

/// A million random sources, one response each, at 200k a second (what the server answers
/// on two cores): the allocations made and the memory the table takes.
fn flood_memory() {
    let before = rss_kib();
    let rrl = limiter(20);
    let mut rng = fastrand::Rng::with_seed(29);
    let allocated = ALLOCATED.load(Ordering::Relaxed);
    let mut answered = 0usize;
    let start = rrl.now();
    for i in 0..1_000_000u64 {
        let source = IpAddr::V4(Ipv4Addr::from(rng.u32(..)));
        // 200k/s: five ticks (of 2^-20 s) apart.
        answered += rrl.charge(source, start + i * 5) as usize;
    }
    let allocated = ALLOCATED.load(Ordering::Relaxed) - allocated;
    println!(
        "rrl flood: 1,000,000 random sources, {answered} answered; table {} words = {} MiB fixed; \
         allocated while charging: {allocated} bytes; resident memory +{} MiB",
        BUCKETS,
        rrl.table_bytes() >> 20,
        (rss_kib().saturating_sub(before)) >> 10
    );
    assert_eq!(allocated, 0, "the rate limiter allocated per response");
}

fn bench(c: &mut Criterion) {
    flood_memory();
    let rrl = limiter(1_000_000);
    let one = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1));
    let mut group = c.benchmark_group("rrl");
    group.bench_function("charge_one_network", |b| {
        b.iter(|| black_box(rrl.charge(black_box(one), rrl.now())))
    });
    let batch = [Some(one); 32];
    let mut over = [false; 32];
    group.bench_function("charge_batch_of_32_one_network", |b| {
        b.iter(|| {
            rrl.charge_batch(rrl.now(), black_box(&batch), &mut over);
            black_box(over[31])
        })
    });
    let mut rng = fastrand::Rng::with_seed(1);
    group.bench_function("charge_random_sources", |b| {
        b.iter(|| black_box(rrl.charge(IpAddr::V4(Ipv4Addr::from(rng.u32(..))), rrl.now())))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
