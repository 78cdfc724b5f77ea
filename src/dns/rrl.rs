//! Response rate limiting over UDP (`--dns-rrl-rate`): a spoofed query makes us send its
//! answer to whoever the source claims to be, so an authority that anyone reaches is a
//! reflector. Past a rate of responses to one client network (a /24 for IPv4, a /56 for
//! IPv6), responses are dropped, and every `--dns-rrl-slip`-th of them is sent as an empty
//! reply with TC set instead, so that a real client behind a forged flood retries over TCP,
//! which cannot be spoofed. A burst of five seconds' worth of the rate passes.
//!
//! The state is one fixed table, as Knot's `mod-rrl` keeps it: [`BUCKETS`] 64-bit words
//! (8 MiB), allocated once when the limit is on, and never a byte per source. A word holds
//! a network's tag (20 bits of a keyed hash of the network) and its theoretical arrival time
//! (the generic cell rate algorithm: each response moves it `1/rate` seconds on from the
//! later of itself and now; a response is sent while that stays within the burst ahead of
//! now). A network may use either of two words its hash picks; it takes over a word whose
//! owner is idle (its time not ahead of now, so nothing is lost by forgetting it), and when
//! both are busy it shares the first, which limits both owners a little sooner. A flood of
//! random sources therefore only ever rewrites idle words: a network being limited keeps
//! its word, and a source sending one query holds a word for `1/rate` seconds. At the
//! 200k queries/s this server answers on two cores, with `--dns-rrl-rate 20`, that is
//! 10,000 words busy at once, 1% of the table.
//!
//! The UDP workers charge a batch of datagrams at once, run by run: per run of responses to
//! one network, one keyed hash of the network (SipHash-1-3), a load or two and one
//! compare-and-swap; no lock, no allocation. Measured with `cargo bench --bench rrl` (on a
//! busy machine): 155 ns a check alone, the clock read included; 465 ns from random
//! sources (the table's cache misses); 25 ns a response in a batch of 32 from one network.
//! With the limit off the workers test one `Option`.

use std::hash::{BuildHasher, Hasher};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ipnet::IpNet;

/// Words in the table: 2^20, 8 MiB.
pub const BUCKETS: usize = 1 << 20;
/// Bits of the network's tag in a word; the rest is the time.
const TAG_BITS: u32 = 20;
const TIME_BITS: u32 = 64 - TAG_BITS;
const TIME_MASK: u64 = (1 << TIME_BITS) - 1;
/// The clock's resolution: 2^20 ticks a second (~0.95 µs). 44 bits of ticks last 194 days;
/// times compare with wrapping arithmetic (see [`RateLimiter::charge`]).
const TICKS_PER_SECOND: u64 = 1 << 20;
/// How much of the rate may come at once.
const BURST_SECONDS: u64 = 5;
/// The highest `--dns-rrl-rate`: one tick per response.
pub const MAX_RATE: u32 = 1_000_000;

/// The settings.
#[derive(Clone, Debug, Default)]
pub struct Settings {
    /// `--dns-rrl-rate`: responses per second to one network; 0 = off.
    pub rate: u32,
    /// `--dns-rrl-slip`: every how many-th limited response is sent as an empty TC reply;
    /// 0 = none (all dropped), 1 = all.
    pub slip: u32,
    /// `--dns-rrl-exempt`: networks never limited.
    pub exempt: Vec<IpNet>,
}

/// What to do with one response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Within the rate (or exempt): send it.
    Send,
    /// Over the rate: send nothing.
    Drop,
    /// Over the rate: send an empty reply with TC instead.
    Slip,
}

/// The table and the settings. Shared by every UDP worker.
pub struct RateLimiter {
    words: Box<[AtomicU64]>,
    /// Keys the network hash, so that no one can aim sources at one word.
    hasher: std::hash::RandomState,
    /// Ticks between two responses at the rate.
    interval: u64,
    /// How far ahead of now a network's time may run: the burst.
    burst: u64,
    slip: u32,
    exempt: Vec<IpNet>,
    epoch: Instant,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter")
            .field("per_second", &(TICKS_PER_SECOND / self.interval))
            .field("slip", &self.slip)
            .field("exempt", &self.exempt)
            .finish()
    }
}

/// A client network as the table knows it: a /24 or a /56, with its family.
fn network(ip: IpAddr) -> u64 {
    match ip {
        IpAddr::V4(v4) => u64::from(u32::from(v4) >> 8),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => u64::from(u32::from(v4) >> 8),
            None => (u128::from(v6) >> 72) as u64 | 1 << 63,
        },
    }
}

impl RateLimiter {
    /// `None` when the limit is off.
    pub fn new(settings: &Settings) -> Option<Self> {
        (settings.rate > 0).then(|| {
            let interval = TICKS_PER_SECOND / u64::from(settings.rate.min(MAX_RATE));
            Self {
                words: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
                hasher: std::hash::RandomState::new(),
                interval,
                burst: BURST_SECONDS * TICKS_PER_SECOND,
                slip: settings.slip,
                exempt: settings.exempt.clone(),
                epoch: Instant::now(),
            }
        })
    }

    /// The table's memory: fixed whatever the sources.
    pub fn table_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.words)
    }

    /// Now on the table's clock; a worker reads it once per batch of datagrams.
    pub fn now(&self) -> u64 {
        let elapsed = self.epoch.elapsed();
        (elapsed.as_secs() * TICKS_PER_SECOND + (u64::from(elapsed.subsec_nanos()) * TICKS_PER_SECOND) / 1_000_000_000)
            & TIME_MASK
    }

    /// Whether `ip` is in `--dns-rrl-exempt`.
    pub fn exempt(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.exempt.iter().any(|net| net.contains(&ip))
    }

    /// Counts one response to `ip` at `now` (from [`Self::now`]); false when it is over the
    /// rate, and then nothing is counted.
    pub fn charge(&self, ip: IpAddr, now: u64) -> bool {
        self.charge_run(network(ip), now, 1) == 1
    }

    /// Charges a batch of responses: `sources[i]` is the client of the i-th, `None` for one
    /// not charged (no reply goes out); marks in `over` those over the rate. Consecutive
    /// responses to one network are charged as a run, with one hash and one
    /// compare-and-swap: under load a batch is mostly runs from a few resolvers, and both
    /// workers writing one network's word for every response would pass its cache line
    /// back and forth between the cores.
    pub fn charge_batch(&self, now: u64, sources: &[Option<IpAddr>], over: &mut [bool]) {
        let charged = |ip: &Option<IpAddr>| ip.filter(|&ip| !self.exempt(ip)).map(network);
        let mut i = 0;
        while i < sources.len() {
            let Some(net) = charged(&sources[i]) else {
                over[i] = false;
                i += 1;
                continue;
            };
            let run = 1 + sources[i + 1..]
                .iter()
                .take_while(|ip| charged(ip) == Some(net))
                .count();
            let allowed = self.charge_run(net, now, run as u64) as usize;
            for (k, over) in over[i..i + run].iter_mut().enumerate() {
                *over = k >= allowed;
            }
            i += run;
        }
    }

    /// Counts up to `n` responses to network `net` at `now`; returns how many are within the
    /// rate (those are counted, the rest not).
    fn charge_run(&self, net: u64, now: u64, n: u64) -> u64 {
        let mut hasher = self.hasher.build_hasher();
        hasher.write_u64(net);
        let hash = hasher.finish();
        let mask = BUCKETS as u64 - 1;
        let tag = hash >> (64 - TAG_BITS);
        let candidates = [(hash & mask) as usize, ((hash >> 20) & mask) as usize];
        // Ours if tagged so; else the first idle one; else shared.
        let mut pick = None;
        for &i in &candidates {
            let word = self.words[i].load(Ordering::Relaxed);
            if word >> TIME_BITS == tag {
                pick = Some(i);
                break;
            }
            if pick.is_none() && self.ahead(word, now).is_none() {
                pick = Some(i);
            }
        }
        let word = &self.words[pick.unwrap_or(candidates[0])];
        let mut current = word.load(Ordering::Relaxed);
        loop {
            let owner = current >> TIME_BITS;
            let ahead = self.ahead(current, now).unwrap_or(0);
            // Each response moves the time one interval on, while it stays within the burst.
            let allowed = (self.burst.saturating_sub(ahead) / self.interval).min(n);
            if allowed == 0 {
                return 0;
            }
            // An idle word changes hands; a busy one keeps its owner (shared).
            let owner = if ahead == 0 { tag } else { owner };
            let next = owner << TIME_BITS | ((now + ahead + allowed * self.interval) & TIME_MASK);
            match word.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return allowed,
                Err(seen) => current = seen,
            }
        }
    }

    /// How far the time in `word` is ahead of `now`, if at all. A word never used, a time
    /// behind now, or one further ahead than a network can ever get (the burst and one
    /// interval) is idle: the last only a word untouched for the 97 days after which the
    /// 44-bit clock wraps.
    fn ahead(&self, word: u64, now: u64) -> Option<u64> {
        if word == 0 {
            return None;
        }
        let ahead = (word & TIME_MASK).wrapping_sub(now) & TIME_MASK;
        (ahead > 0 && ahead <= self.burst + self.interval).then_some(ahead)
    }

    /// The verdict on a response that [`Self::charge`] refused: every `slip`-th one (counted
    /// by the worker in `limited`, so no counter is shared) slips.
    pub fn over_rate(&self, limited: &mut u64) -> Verdict {
        *limited += 1;
        if self.slip > 0 && (*limited).is_multiple_of(u64::from(self.slip)) {
            Verdict::Slip
        } else {
            Verdict::Drop
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(rate: u32) -> RateLimiter {
        RateLimiter::new(&Settings {
            rate,
            slip: 2,
            exempt: vec!["10.9.0.0/16".parse().unwrap()],
        })
        .unwrap()
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    /// Responses a network gets at `now` before the first refusal, at most `max`.
    fn sent(rrl: &RateLimiter, from: &str, now: u64, max: usize) -> usize {
        (0..max).take_while(|_| rrl.charge(ip(from), now)).count()
    }

    #[test]
    fn a_network_gets_five_seconds_of_the_rate_at_once_then_the_rate() {
        let rrl = limiter(100);
        let start = 10 * TICKS_PER_SECOND;
        assert_eq!(sent(&rrl, "192.0.2.1", start, 10_000), 500);
        // The same /24 from another address is the same network; another /24 is not.
        assert!(!rrl.charge(ip("192.0.2.200"), start));
        assert_eq!(sent(&rrl, "192.0.3.1", start, 10_000), 500);
        // A second later: one second's worth again.
        assert_eq!(sent(&rrl, "192.0.2.1", start + TICKS_PER_SECOND, 10_000), 100);
        // Idle for five seconds: the whole burst.
        assert_eq!(sent(&rrl, "192.0.2.9", start + 7 * TICKS_PER_SECOND, 10_000), 500);
    }

    #[test]
    fn ipv6_networks_are_56_bits() {
        let rrl = limiter(10);
        assert_eq!(sent(&rrl, "2001:db8:0:1100::1", 0, 1000), 50);
        assert!(!rrl.charge(ip("2001:db8:0:11ff:ffff::1"), 0), "same /56");
        assert!(rrl.charge(ip("2001:db8:0:1200::1"), 0), "next /56");
        assert_eq!(sent(&rrl, "::ffff:192.0.2.1", 0, 1000), 50);
        assert!(
            !rrl.charge(ip("192.0.2.7"), 0),
            "an IPv4-mapped address is its IPv4 /24"
        );
    }

    /// A batch is charged run by run, as the same responses one by one would be.
    #[test]
    fn a_batch_is_charged_as_its_responses_one_by_one() {
        let (batched, single) = (limiter(10), limiter(10));
        let now = TICKS_PER_SECOND;
        let mut rng = fastrand::Rng::with_seed(3);
        let nets = ["192.0.2.1", "192.0.2.77", "198.51.100.1", "10.9.0.1", "2001:db8::1"];
        for round in 0..20 {
            let sources: Vec<Option<IpAddr>> = (0..32)
                .map(|_| (rng.u8(..8) != 0).then(|| ip(nets[rng.usize(..nets.len())])))
                .collect();
            let mut over = [true; 32];
            batched.charge_batch(now + round, &sources, &mut over);
            let expected: Vec<bool> = sources
                .iter()
                .map(|s| s.is_some_and(|ip| !single.exempt(ip) && !single.charge(ip, now + round)))
                .collect();
            assert_eq!(over.to_vec(), expected, "round {round}: {sources:?}");
        }
    }

    #[test]
    fn every_slip_th_limited_response_slips() {
        let rrl = limiter(1);
        let mut limited = 0;
        let verdicts: Vec<Verdict> = (0..6).map(|_| rrl.over_rate(&mut limited)).collect();
        use Verdict::*;
        assert_eq!(verdicts, [Drop, Slip, Drop, Slip, Drop, Slip]);
        assert!(rrl.exempt(ip("10.9.200.1")) && rrl.exempt(ip("::ffff:10.9.0.1")));
        assert!(!rrl.exempt(ip("10.10.0.1")));
    }

    /// A million random sources, one response each, then the networks that were limited
    /// before: each kept its word, so none got more than the rate (a few may get less: a
    /// source whose two words are both busy shares one); and the table is the same size.
    #[test]
    fn a_flood_of_random_sources_does_not_free_a_limited_network() {
        let rrl = limiter(20);
        let now = 100 * TICKS_PER_SECOND;
        let victims: Vec<String> = (0..64).map(|i| format!("198.51.{i}.1")).collect();
        for victim in &victims {
            assert_eq!(sent(&rrl, victim, now, 1000), 100);
        }
        let bytes = rrl.table_bytes();
        let mut rng = fastrand::Rng::with_seed(7);
        for i in 0..1_000_000u64 {
            let source = IpAddr::V4(rng.u32(..).into());
            rrl.charge(source, now + i);
        }
        assert_eq!(rrl.table_bytes(), bytes);
        assert_eq!(bytes, BUCKETS * 8);
        // One second of the flood later: each victim has exactly one second's worth more.
        let later = now + TICKS_PER_SECOND;
        let got: Vec<usize> = victims.iter().map(|v| sent(&rrl, v, later, 1000)).collect();
        assert!(got.iter().all(|&n| n <= 20), "{got:?}");
        assert!(got.iter().sum::<usize>() >= 64 * 19, "{got:?}");
    }

    #[test]
    fn the_clock_wrapping_around_frees_nobody_for_long() {
        let rrl = limiter(10);
        let near_end = TIME_MASK - TICKS_PER_SECOND;
        assert_eq!(sent(&rrl, "192.0.2.1", near_end, 1000), 50);
        // Two seconds on, past the wrap: 20 more, as without a wrap.
        let after = (near_end + 2 * TICKS_PER_SECOND) & TIME_MASK;
        assert_eq!(sent(&rrl, "192.0.2.1", after, 1000), 20);
    }
}
