//! Time as the registry sees it: Unix nanoseconds from an injectable clock, so lease
//! boundaries can be tested to the nanosecond without sleeping.

use std::sync::atomic::{AtomicI64, Ordering};

/// Nanoseconds since the Unix epoch. Wall-clock time, because leases are defined as
/// `updated_at + ttl` and `updated_at` is a wall-clock stamp that survives restarts.
pub type Nanos = i64;

pub const SECOND: Nanos = 1_000_000_000;

pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> Nanos;
}

/// The real clock.
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Nanos {
        // Read on every DNS query, so straight from SystemTime rather than through a calendar date.
        let nanos = |d: std::time::Duration| i64::try_from(d.as_nanos()).expect("system clock is within 1677..2262");
        match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            Ok(after) => nanos(after),
            Err(before) => -nanos(before.duration()),
        }
    }
}

/// A clock that moves only when told to; for tests.
pub struct ManualClock(AtomicI64);

/// Where a [`ManualClock`] of the tests starts: 2027-01-15, far from the epoch so that
/// "long ago" is still a positive time.
pub const MANUAL_START: Nanos = 1_800_000_000_000_000_000;

impl ManualClock {
    pub fn new(start: Nanos) -> Self {
        Self(AtomicI64::new(start))
    }

    pub fn advance(&self, by: std::time::Duration) {
        self.0.fetch_add(by.as_nanos() as i64, Ordering::SeqCst);
    }

    pub fn set(&self, to: Nanos) {
        self.0.store(to, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        self.0.load(Ordering::SeqCst)
    }
}

/// RFC 3339 in UTC with nanosecond digits, the wire form of every timestamp. Written by
/// humantime, which is several times cheaper than chrono's formatter (it runs twice for
/// every instance in every REST answer); chrono only for times before 1970.
pub fn rfc3339(ns: Nanos) -> String {
    match u64::try_from(ns) {
        Ok(ns) => {
            humantime::format_rfc3339_nanos(std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns)).to_string()
        }
        Err(_) => chrono::DateTime::from_timestamp_nanos(ns).to_rfc3339_opts(chrono::SecondsFormat::Nanos, true),
    }
}

pub fn parse_rfc3339(s: &str) -> Option<Nanos> {
    chrono::DateTime::parse_from_rfc3339(s).ok()?.timestamp_nanos_opt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_is_utc_with_nine_digits_and_reads_back() {
        for ns in [
            0,
            1,
            999_999_999,
            1_800_000_000_123_456_789,
            1_700_000_000_000_000_000,
            i64::MAX,
            -1,
            -86_400_000_000_123,
        ] {
            let text = rfc3339(ns);
            let chrono = chrono::DateTime::from_timestamp_nanos(ns).to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
            assert_eq!(text, chrono, "{ns}");
            assert_eq!(parse_rfc3339(&text), Some(ns), "{text}");
        }
        assert_eq!(rfc3339(1_800_000_000_000_000_007), "2027-01-15T08:00:00.000000007Z");
    }
}
