//! The login throttle: failed logins slow down the client address they came from and the
//! (address, account) pair, never the account as such, so a stranger's wrong passwords cannot
//! keep its owner out. Past a few free failures each further failure makes that key wait twice
//! as long as the last, up to a cap. A successful login clears its pair's count.
//!
//! Guessing at one account from many addresses (each too few times for its own counts) is
//! watched per account, and answered with an alert rather than a delay: once an account has
//! failed [`ALERT_FAILURES`] times within [`FORGET_AFTER`] of each other, the log warns and the
//! admins' list of users shows the count and how many addresses sent them
//! ([`Throttle::alerts`]). Nothing is refused because of it: any delay on the account would
//! reach its owner's good login too, which is the lockout this throttle exists to prevent.
//!
//! Where the appliance cannot tell clients apart (no known address, or a loopback peer, most
//! often a reverse proxy speaking for everyone) they all share one address, so there the pair is
//! the account alone and a stranger's failures do slow its owner, as they must: otherwise
//! nothing would bound guesses through the proxy.
//!
//! Unknown account names are throttled exactly like real ones, so the throttle's answers do not
//! tell which names exist (only real accounts are watched for alerts, which no visitor sees).
//! Counts live in memory only: a restart forgets them. Memory stays bounded: counts idle for
//! [`FORGET_AFTER`] are dropped, and at most [`MAX_KEYS`] keys are kept (the least recently failed
//! go first when a new key needs room).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::warn;

/// How one kind of key is throttled.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Failures that cost nothing; from the next one on, each failure imposes a wait.
    pub free: u32,
    /// The wait after the last free failure; it doubles with each failure after that.
    pub first_delay: Duration,
    pub max_delay: Duration,
}

/// One account from one address is one person: a handful of typos is plenty.
pub const PAIR: Policy =
    Policy { free: 5, first_delay: Duration::from_secs(1), max_delay: Duration::from_secs(300) };

/// An address may be a lab or an office behind one NAT, with many people mistyping at once, so
/// it gets more room than a pair.
pub const ADDRESS: Policy =
    Policy { free: 20, first_delay: Duration::from_secs(1), max_delay: Duration::from_secs(300) };

/// Failures of one account, from any addresses, that raise its alert: twice what one address
/// may try freely, so the owner's own typos rarely do.
pub const ALERT_FAILURES: u32 = 2 * PAIR.free;

/// Distinct addresses remembered per watched account; an alert says "at least" beyond it.
pub const MAX_WATCHED_ADDRESSES: usize = 64;

/// A key whose last failure is this old (and that is not waiting) is forgotten, and so is an
/// account's alert. Longer than the longest wait, so a slow guesser stays at the cap instead of
/// starting over.
pub const FORGET_AFTER: Duration = Duration::from_secs(15 * 60);

/// Keys kept at most (plus those of attempts in flight). An entry is well under 200 bytes.
pub const MAX_KEYS: usize = 10_000;

/// How often expired keys are swept out when the table is not full.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// An account name as typed, lowercased (usernames are ASCII and compared without case).
type Account = String;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    /// Everything tried from one client address.
    Address(IpAddr),
    /// One account tried from one address (`None`: the clients the appliance cannot tell apart).
    Pair(Option<IpAddr>, Account),
}

impl Key {
    fn policy(&self) -> Policy {
        match self {
            Key::Address(_) => ADDRESS,
            Key::Pair(..) => PAIR,
        }
    }

    fn whose(&self) -> &'static str {
        match self {
            Key::Address(_) => "from this address",
            Key::Pair(..) => "for this account from this address",
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

/// One real account's failures from every address, for the alert. Kept apart from the keys:
/// it never refuses anything, and only real accounts have one, so there are at most as many as
/// there are users.
#[derive(Debug)]
struct Watch {
    failures: u32,
    /// The distinct addresses the failures came from, at most [`MAX_WATCHED_ADDRESSES`].
    addresses: Vec<Option<IpAddr>>,
    last_failure: Instant,
}

/// An account that many failed logins were aimed at, as the admins' list shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alert {
    /// The account name, lowercased.
    pub account: String,
    /// Failed logins, none of them more than [`FORGET_AFTER`] after the one before.
    pub failures: u32,
    /// Distinct client addresses they came from (at most [`MAX_WATCHED_ADDRESSES`]).
    pub addresses: usize,
    pub last_failure: Instant,
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
    watched: HashMap<Account, Watch>,
    last_sweep: Instant,
}

#[derive(Debug)]
pub struct Throttle {
    table: Mutex<Table>,
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle {
            table: Mutex::new(Table {
                entries: HashMap::new(),
                watched: HashMap::new(),
                last_sweep: Instant::now(),
            }),
        }
    }
}

/// One admitted login attempt. Report its outcome with [`Attempt::failed`] or
/// [`Attempt::succeeded`]; dropped without either (the hasher was busy, the request went away)
/// it counts for nothing.
#[derive(Debug)]
pub struct Attempt<'a> {
    throttle: &'a Throttle,
    account: Account,
    address: Option<IpAddr>,
    keys: Vec<Key>,
}

impl Throttle {
    /// Admits an attempt on `account` from `address` (`None`: not known, or a loopback peer,
    /// which is most often a reverse proxy speaking for everyone; one shared address count for
    /// all of those would let any guesser lock every user out, so they are counted per account
    /// only).
    ///
    /// Refused while the address or the pair waits out its delay, and also while enough
    /// attempts on one of them are in flight that they could use up its free failures:
    /// otherwise a burst of concurrent guesses would all pass before the first of them failed.
    /// Only failures from this same address count, so an address that has not failed is
    /// admitted whatever others did.
    pub fn admit(
        &self,
        account: &str,
        address: Option<IpAddr>,
        now: Instant,
    ) -> Result<Attempt<'_>, Throttled> {
        let account = account.to_ascii_lowercase();
        let address = address.filter(|a| !a.is_loopback());
        let mut keys = vec![Key::Pair(address, account.clone())];
        if let Some(address) = address {
            keys.push(Key::Address(address));
        }
        let mut table = self.lock();
        if now.saturating_duration_since(table.last_sweep) >= SWEEP_EVERY {
            table.sweep(now);
        }
        for key in &keys {
            let Some(entry) = table.entries.get(key) else { continue };
            if let Some(until) = entry.blocked_until.filter(|until| *until > now) {
                let retry_after = until - now;
                return Err(Throttled {
                    message: format!(
                        "too many failed logins {}: try again in {} s",
                        key.whose(),
                        whole_seconds(retry_after)
                    ),
                    retry_after,
                });
            }
            if entry.in_flight > 0 && entry.failures + entry.in_flight >= key.policy().free {
                return Err(Throttled {
                    message: format!(
                        "too many logins {} at once: try again in a second",
                        key.whose()
                    ),
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
        Ok(Attempt { throttle: self, account, address, keys })
    }

    /// The accounts whose alert is raised now, most failures first.
    pub fn alerts(&self, now: Instant) -> Vec<Alert> {
        let table = self.lock();
        let mut alerts: Vec<Alert> = table
            .watched
            .iter()
            .filter(|(_, watch)| {
                watch.failures >= ALERT_FAILURES
                    && now.saturating_duration_since(watch.last_failure) < FORGET_AFTER
            })
            .map(|(account, watch)| Alert {
                account: account.clone(),
                failures: watch.failures,
                addresses: watch.addresses.len(),
                last_failure: watch.last_failure,
            })
            .collect();
        alerts.sort_by(|a, b| b.failures.cmp(&a.failures).then_with(|| a.account.cmp(&b.account)));
        alerts
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
        self.watched
            .retain(|_, watch| now.saturating_duration_since(watch.last_failure) < FORGET_AFTER);
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

    /// Counts a failure on the real account `account` from `address` towards its alert, and
    /// warns in the log the moment the alert is raised.
    fn watch(&mut self, account: &str, address: Option<IpAddr>, now: Instant) {
        let watch = self.watched.entry(account.to_string()).or_insert(Watch {
            failures: 0,
            addresses: Vec::new(),
            last_failure: now,
        });
        if now.saturating_duration_since(watch.last_failure) >= FORGET_AFTER {
            watch.failures = 0;
            watch.addresses.clear();
        }
        watch.failures = watch.failures.saturating_add(1);
        watch.last_failure = now;
        if !watch.addresses.contains(&address) && watch.addresses.len() < MAX_WATCHED_ADDRESSES {
            watch.addresses.push(address);
        }
        if watch.failures == ALERT_FAILURES {
            warn!(
                account,
                addresses = watch.addresses.len(),
                "{ALERT_FAILURES} failed logins for one account: someone may be guessing its \
                 password (the admins' Users page shows it)"
            );
        }
    }
}

impl Attempt<'_> {
    /// The password was wrong, or the account does not exist (`account_exists` false: then only
    /// the throttle counts it, since no one can guess their way into a name nobody has).
    pub fn failed(mut self, now: Instant, account_exists: bool) {
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
        if account_exists {
            table.watch(&self.account, self.address, now);
        }
    }

    /// The login succeeded: the pair starts over. The address keeps its count, or one guesser
    /// holding one real account could wipe it between guesses at others; the account's alert
    /// stays too, so a guesser's run stays visible to the admins after its owner logs in.
    pub fn succeeded(mut self) {
        let keys = std::mem::take(&mut self.keys);
        let mut table = self.throttle.lock();
        for key in keys {
            if matches!(key, Key::Pair(..)) {
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
    const HOME: IpAddr = IpAddr::V4(Ipv4Addr::new(192, 168, 1, 20));

    fn fail(throttle: &Throttle, account: &str, address: Option<IpAddr>, now: Instant) {
        match throttle.admit(account, address, now) {
            Ok(attempt) => attempt.failed(now, true),
            Err(refused) => panic!("attempt on {account} refused: {refused:?}"),
        }
    }

    #[test]
    fn free_failures_then_doubling_waits_up_to_the_cap() {
        let throttle = Throttle::default();
        let t0 = Instant::now();
        for _ in 0..PAIR.free {
            fail(&throttle, "alice", Some(LAB), t0);
        }
        // The fifth failure already costs the first delay.
        let refused = throttle.admit("Alice", Some(LAB), t0).err();
        assert_eq!(refused.map(|r| r.retry_after), Some(PAIR.first_delay));
        let mut now = t0;
        let mut waits = Vec::new();
        for _ in 0..12 {
            now += PAIR.max_delay;
            fail(&throttle, "alice", Some(LAB), now);
            let refused = throttle.admit("alice", Some(LAB), now).err();
            waits.push(refused.map_or(0, |r| r.retry_after.as_secs()));
        }
        assert_eq!(waits, [2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300, 300]);
        assert!(throttle.admit("bob", Some(LAB), now).is_ok(), "other accounts are untouched");
    }

    #[test]
    fn a_stranger_cannot_keep_the_owner_out() {
        let throttle = Throttle::default();
        let mut now = Instant::now();
        // The stranger comes back each time the wait ends, for as long as the cap allows.
        for _ in 0..3 * PAIR.free {
            match throttle.admit("alice", Some(LAB), now) {
                Ok(attempt) => attempt.failed(now, true),
                Err(refused) => {
                    assert!(refused.message.contains("for this account from this address"));
                    now += refused.retry_after;
                    continue;
                }
            }
            let owner = throttle.admit("alice", Some(HOME), now);
            assert!(owner.is_ok(), "the owner was refused: {owner:?}");
            owner.map(Attempt::succeeded).ok();
        }
        let refused = throttle.admit("alice", Some(LAB), now).err();
        assert!(refused.is_some(), "the stranger is slowed down");
        assert!(throttle.admit("bob", Some(LAB), now).is_ok(), "the address is under its limit");
        assert!(throttle.admit("alice", Some(HOME), now).is_ok());
    }

    #[test]
    fn success_resets_the_pair_but_not_the_address() {
        let throttle = Throttle::default();
        let now = Instant::now();
        for _ in 0..PAIR.free - 1 {
            fail(&throttle, "alice", Some(LAB), now);
        }
        throttle.admit("alice", Some(LAB), now).map(Attempt::succeeded).ok();
        for _ in 0..PAIR.free - 1 {
            fail(&throttle, "alice", Some(LAB), now);
        }
        assert!(throttle.admit("alice", Some(LAB), now).is_ok(), "the count started over");
        for i in 0..ADDRESS.free - 2 * (PAIR.free - 1) {
            fail(&throttle, &format!("user{i}"), Some(LAB), now);
        }
        let refused = throttle.admit("carol", Some(LAB), now).err();
        assert!(
            refused.as_ref().is_some_and(|r| r.message.contains("failed logins from this address")),
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
        for _ in 0..PAIR.free {
            fail(&throttle, "erin", loopback, now);
        }
        let refused = throttle.admit("erin", None, now).err();
        assert!(refused.is_some(), "clients the appliance cannot tell apart share one pair");
    }

    #[test]
    fn guessing_from_many_addresses_raises_an_alert_and_refuses_no_one() {
        let throttle = Throttle::default();
        let now = Instant::now();
        let bot = |i: u32| Some(IpAddr::V4(Ipv4Addr::from(0x0a63_0000 + i)));
        for i in 0..ALERT_FAILURES - 1 {
            fail(&throttle, "alice", bot(i), now);
            fail(&throttle, "Alice", bot(i), now);
        }
        let raised = throttle.alerts(now);
        assert_eq!(raised.len(), 1, "{raised:?}");
        assert_eq!(raised[0].account, "alice");
        assert_eq!(raised[0].failures, 2 * (ALERT_FAILURES - 1));
        assert_eq!(raised[0].addresses, ALERT_FAILURES as usize - 1);
        assert!(throttle.admit("alice", Some(HOME), now).is_ok(), "the owner is not refused");
        throttle.admit("alice", Some(HOME), now).map(Attempt::succeeded).ok();
        assert_eq!(throttle.alerts(now).len(), 1, "the owner's login does not hide the alert");

        // Names nobody has raise nothing; below the threshold, nothing either.
        for i in 0..2 * ALERT_FAILURES {
            let attempt = throttle.admit("nobody", bot(i), now);
            attempt.map(|a| a.failed(now, false)).ok();
        }
        for i in 0..ALERT_FAILURES - 1 {
            fail(&throttle, "bob", bot(i), now);
        }
        assert_eq!(throttle.alerts(now).len(), 1);

        for i in 0..2 * MAX_WATCHED_ADDRESSES as u32 {
            fail(&throttle, "carol", bot(1000 + i), now);
        }
        let carol = throttle.alerts(now).into_iter().find(|a| a.account == "carol");
        assert_eq!(carol.map(|a| a.addresses), Some(MAX_WATCHED_ADDRESSES), "bounded");

        let later = now + FORGET_AFTER;
        assert!(throttle.alerts(later).is_empty(), "a quiet account's alert ends");
        fail(&throttle, "alice", bot(0), later);
        assert!(throttle.alerts(later).is_empty(), "and its count starts over");
    }

    #[test]
    fn concurrent_attempts_cannot_outrun_the_free_failures() {
        let throttle = Throttle::default();
        let now = Instant::now();
        let admitted: Vec<Attempt<'_>> =
            (0..50).filter_map(|_| throttle.admit("alice", Some(LAB), now).ok()).collect();
        assert_eq!(admitted.len(), PAIR.free as usize);
        for attempt in admitted {
            attempt.failed(now, true);
        }
        let later = now + PAIR.first_delay;
        let one = throttle.admit("alice", Some(LAB), later);
        assert!(one.is_ok());
        let second = throttle.admit("alice", Some(LAB), later);
        assert!(second.is_err(), "past the free ones: one at a time");
        drop(one);
        assert!(throttle.admit("alice", Some(LAB), later).is_ok(), "an undecided attempt is free");
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
        assert_eq!(throttle.lock().watched.len(), 1, "and so are idle accounts");
    }
}
