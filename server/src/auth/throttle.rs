//! The login throttle: failed logins are counted per account name and per client address, and
//! past a few free failures each further failure makes that key wait twice as long as the last,
//! up to a cap. A successful login clears its account's count.
//!
//! Unknown account names are counted exactly like real ones, so the throttle's answers do not
//! tell which names exist. Counts live in memory only: a restart forgets them. Memory stays
//! bounded: counts idle for [`FORGET_AFTER`] are dropped, and at most [`MAX_KEYS`] keys are kept
//! (the least recently failed go first when a new key needs room).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How one kind of key is throttled.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Failures that cost nothing; from the next one on, each failure imposes a wait.
    pub free: u32,
    /// The wait after the last free failure; it doubles with each failure after that.
    pub first_delay: Duration,
    pub max_delay: Duration,
}

/// An account is one person's: a handful of typos is plenty.
pub const ACCOUNT: Policy =
    Policy { free: 5, first_delay: Duration::from_secs(1), max_delay: Duration::from_secs(300) };

/// An address may be a lab or an office behind one NAT, with many people mistyping at once, so
/// it gets more room than an account.
pub const ADDRESS: Policy =
    Policy { free: 20, first_delay: Duration::from_secs(1), max_delay: Duration::from_secs(300) };

/// A key whose last failure is this old (and that is not waiting) is forgotten. Longer than the
/// longest wait, so a slow guesser stays at the cap instead of starting over.
pub const FORGET_AFTER: Duration = Duration::from_secs(15 * 60);

/// Keys kept at most (plus those of attempts in flight). An entry is well under 200 bytes.
pub const MAX_KEYS: usize = 10_000;

/// How often expired keys are swept out when the table is not full.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    /// An account name as typed, lowercased (usernames are ASCII and compared without case).
    Account(String),
    Address(IpAddr),
}

impl Key {
    fn policy(&self) -> Policy {
        match self {
            Key::Account(_) => ACCOUNT,
            Key::Address(_) => ADDRESS,
        }
    }
}

#[derive(Debug)]
struct Entry {
    failures: u32,
    /// Attempts admitted and not yet decided.
    in_flight: u32,
    blocked_until: Option<Instant>,
    last_failure: Instant,
}

impl Entry {
    fn forgettable(&self, now: Instant) -> bool {
        self.in_flight == 0
            && self.blocked_until.is_none_or(|until| until <= now)
            && now.saturating_duration_since(self.last_failure) >= FORGET_AFTER
    }
}

/// Why an attempt was not admitted: the client should come back after `retry_after`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Throttled {
    pub retry_after: Duration,
    pub message: String,
}

#[derive(Debug)]
struct Table {
    entries: HashMap<Key, Entry>,
    last_sweep: Instant,
}

#[derive(Debug)]
pub struct Throttle {
    table: Mutex<Table>,
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle {
            table: Mutex::new(Table { entries: HashMap::new(), last_sweep: Instant::now() }),
        }
    }
}

/// One admitted login attempt. Report its outcome with [`Attempt::failed`] or
/// [`Attempt::succeeded`]; dropped without either (the hasher was busy, the request went away)
/// it counts for nothing.
#[derive(Debug)]
pub struct Attempt<'a> {
    throttle: &'a Throttle,
    keys: Vec<Key>,
}

impl Throttle {
    /// Admits an attempt on `account` from `address` (`None`: not known, or a loopback peer,
    /// which is most often a reverse proxy speaking for everyone; one shared count for all of
    /// those would let any guesser lock every user out, so they are counted per account only).
    ///
    /// Refused while a key waits out its delay, and also while enough attempts on a key are in
    /// flight that they could use up its free failures: otherwise a burst of concurrent guesses
    /// would all pass before the first of them failed.
    pub fn admit(
        &self,
        account: &str,
        address: Option<IpAddr>,
        now: Instant,
    ) -> Result<Attempt<'_>, Throttled> {
        let mut keys = vec![Key::Account(account.to_ascii_lowercase())];
        if let Some(address) = address.filter(|a| !a.is_loopback()) {
            keys.push(Key::Address(address));
        }
        let mut table = self.lock();
        if now.saturating_duration_since(table.last_sweep) >= SWEEP_EVERY {
            table.sweep(now);
        }
        for key in &keys {
            let Some(entry) = table.entries.get(key) else { continue };
            let whose = match key {
                Key::Account(_) => "for this account",
                Key::Address(_) => "from this address",
            };
            if let Some(until) = entry.blocked_until.filter(|until| *until > now) {
                let retry_after = until - now;
                return Err(Throttled {
                    message: format!(
                        "too many failed logins {whose}: try again in {} s",
                        whole_seconds(retry_after)
                    ),
                    retry_after,
                });
            }
            if entry.in_flight > 0 && entry.failures + entry.in_flight >= key.policy().free {
                return Err(Throttled {
                    message: format!("too many logins {whose} at once: try again in a second"),
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        for key in &keys {
            if !table.entries.contains_key(key) {
                table.make_room(now);
            }
            table
                .entries
                .entry(key.clone())
                .or_insert(Entry {
                    failures: 0,
                    in_flight: 0,
                    blocked_until: None,
                    last_failure: now,
                })
                .in_flight += 1;
        }
        Ok(Attempt { throttle: self, keys })
    }

    /// Keys tracked now (for tests and diagnostics).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // The table stays consistent at every await-free step, so a panic elsewhere while the
        // lock was held leaves nothing half-done worth refusing logins over.
        self.table.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Table {
    fn sweep(&mut self, now: Instant) {
        self.entries.retain(|_, entry| !entry.forgettable(now));
        self.last_sweep = now;
    }

    /// Makes room for one more key when the table is full: first what is forgotten anyway,
    /// then the tenth of the keys that failed longest ago, so this runs once per many inserts.
    fn make_room(&mut self, now: Instant) {
        if self.entries.len() < MAX_KEYS {
            return;
        }
        self.sweep(now);
        if self.entries.len() < MAX_KEYS {
            return;
        }
        let mut idle: Vec<(Instant, Key)> = self
            .entries
            .iter()
            .filter(|(_, entry)| entry.in_flight == 0)
            .map(|(key, entry)| (entry.last_failure, key.clone()))
            .collect();
        idle.sort_unstable_by_key(|(last, _)| *last);
        for (_, key) in idle.into_iter().take(MAX_KEYS / 10) {
            self.entries.remove(&key);
        }
    }

    /// Ends one in-flight attempt on `key`; an entry that never failed is not kept, so attempts
    /// that were only admitted (and turned away by the hasher) leave nothing behind.
    fn settle(&mut self, key: &Key) -> Option<&mut Entry> {
        let entry = self.entries.get_mut(key)?;
        entry.in_flight = entry.in_flight.saturating_sub(1);
        if entry.failures == 0 && entry.in_flight == 0 {
            self.entries.remove(key);
            return None;
        }
        self.entries.get_mut(key)
    }
}

impl Attempt<'_> {
    /// The password was wrong (or the account does not exist).
    pub fn failed(mut self, now: Instant) {
        let keys = std::mem::take(&mut self.keys);
        let mut table = self.throttle.lock();
        for key in keys {
            let policy = key.policy();
            let entry = table.entries.entry(key.clone()).or_insert(Entry {
                failures: 0,
                in_flight: 1,
                blocked_until: None,
                last_failure: now,
            });
            entry.in_flight = entry.in_flight.saturating_sub(1);
            entry.failures = entry.failures.saturating_add(1);
            entry.last_failure = now;
            if entry.failures >= policy.free {
                entry.blocked_until = Some(now + delay(policy, entry.failures - policy.free));
            }
        }
    }

    /// The login succeeded: the account starts over. The address keeps its count, or one
    /// guesser holding one real account could wipe it between guesses at others.
    pub fn succeeded(mut self) {
        let keys = std::mem::take(&mut self.keys);
        let mut table = self.throttle.lock();
        for key in keys {
            if matches!(key, Key::Account(_)) {
                table.entries.remove(&key);
            } else {
                table.settle(&key);
            }
        }
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let mut table = self.throttle.lock();
        for key in &self.keys {
            table.settle(key);
        }
    }
}

/// The wait after the `extra`-th failure beyond the free ones (0 for the last free one).
fn delay(policy: Policy, extra: u32) -> Duration {
    let factor = 1u32.checked_shl(extra.min(31)).unwrap_or(u32::MAX);
    policy.first_delay.saturating_mul(factor).min(policy.max_delay)
}

/// `duration` in whole seconds, rounded up, at least 1: the unit of `Retry-After`.
pub fn whole_seconds(duration: Duration) -> u64 {
    let secs = duration.as_secs() + u64::from(duration.subsec_nanos() > 0);
    secs.max(1)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const LAB: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));

    fn fail(throttle: &Throttle, account: &str, address: Option<IpAddr>, now: Instant) {
        match throttle.admit(account, address, now) {
            Ok(attempt) => attempt.failed(now),
            Err(refused) => panic!("attempt on {account} refused: {refused:?}"),
        }
    }

    #[test]
    fn free_failures_then_doubling_waits_up_to_the_cap() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        for _ in 0..ACCOUNT.free {
            fail(&throttle, "alice", None, t0);
        }
        // The fifth failure already costs the first delay.
        let refused = throttle.admit("Alice", None, t0).err();
        assert_eq!(refused.map(|r| r.retry_after), Some(ACCOUNT.first_delay));
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..12 {
            now += ACCOUNT.max_delay;
            fail(&throttle, "alice", None, now);
            let refused = throttle.admit("alice", None, now).err();
            waits.push(refused.map_or(0, |r| r.retry_after.as_secs()));
        }
        assert_eq!(waits, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300, 300]);
        assert!(throttle.admit("bob", None, now).is_ok(), "other accounts are untouched");
    }

    #[test]
    fn success_resets_the_account_but_not_the_address() {
        let throttle = Throttle::default();
        let now = Instant::now();
        for _ in 0..ACCOUNT.free - 1 {
            fail(&throttle, "alice", Some(LAB), now);
        }
        throttle.admit("alice", Some(LAB), now).map(Attempt::succeeded).ok();
        for _ in 0..ACCOUNT.free - 1 {
            fail(&throttle, "alice", Some(LAB), now);
        }
        assert!(throttle.admit("alice", Some(LAB), now).is_ok(), "the count started over");
        for i in 0..ADDRESS.free - 2 * (ACCOUNT.free - 1) {
            fail(&throttle, &format!("user{i}"), Some(LAB), now);
        }
        let refused = throttle.admit("carol", Some(LAB), now).err();
        assert!(
            refused.as_ref().is_some_and(|r| r.message.contains("from this address")),
            "{refused:?}"
        );
        let elsewhere = Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 8)));
        assert!(throttle.admit("carol", elsewhere, now).is_ok());
        assert!(throttle.admit("carol", None, now).is_ok(), "an unknown address is not counted");
        let loopback = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        for i in 0..ADDRESS.free + 1 {
            fail(&throttle, &format!("proxied{i}"), loopback, now);
        }
        assert!(throttle.admit("dave", loopback, now).is_ok(), "a local proxy is not one client");
    }

    #[test]
    fn concurrent_attempts_cannot_outrun_the_free_failures() {
        let throttle = Throttle::default();
        let now = Instant::now();
        let admitted: Vec<Attempt<'_>> =
            (0..50).filter_map(|_| throttle.admit("alice", None, now).ok()).collect();
        assert_eq!(admitted.len(), ACCOUNT.free as usize);
        for attempt in admitted {
            attempt.failed(now);
        }
        let later = now + ACCOUNT.first_delay;
        let one = throttle.admit("alice", None, later);
        assert!(one.is_ok());
        assert!(throttle.admit("alice", None, later).is_err(), "past the free ones: one at a time");
        drop(one);
        assert!(throttle.admit("alice", None, later).is_ok(), "an undecided attempt costs nothing");
    }

    #[test]
    fn memory_stays_bounded() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        // Admitted but never failed (turned away by a busy hasher): nothing is kept.
        for i in 0..1000 {
            drop(throttle.admit(&format!("ghost{i}"), Some(LAB), t0));
        }
        assert!(throttle.is_empty());
        for i in 0..MAX_KEYS + 500 {
            fail(&throttle, &format!("user{i}"), None, t0);
        }
        assert!(throttle.len() <= MAX_KEYS, "{} keys", throttle.len());
        let later = t0 + FORGET_AFTER + SWEEP_EVERY;
        fail(&throttle, "late", None, later);
        assert_eq!(throttle.len(), 1, "idle keys are forgotten");
    }
}
