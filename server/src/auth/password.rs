//! Password hashing with argon2id (the crate's defaults: 19 MiB, 2 passes) on a small, fixed
//! set of threads of its own.
//!
//! A hash takes tens of milliseconds and 19 MiB on purpose, so how many run at once decides the
//! appliance's memory under a flood of logins. At most [`workers`] hashes run at a time, each on
//! a thread that keeps its one 19 MiB work area for the life of the process; a few more wait
//! their [`Turn`] in a short queue, and a login that finds the queue full is turned away at once
//! ([`Busy`]) instead of piling up.

use std::num::NonZero;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{Output, ParamsString, PasswordHash, SaltString};
use argon2::{Algorithm, Argon2, Block, Params, Version};
use rand::RngCore;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, oneshot};

use crate::error::{ApiError, ApiResult};

pub const MIN_PASSWORD_LEN: usize = 8;
const MAX_PASSWORD_LEN: usize = 1024;

/// Hashing threads at most: past a few, more logins per second buy nothing and cost 19 MiB each.
const MAX_WORKERS: usize = 4;
/// Turns that may wait per hashing thread; at ~30 ms a hash the last in line waits ~0.25 s.
const QUEUE_PER_WORKER: usize = 8;

/// Refuses passwords too short to be worth hashing, or long enough to be an attack on the hasher.
pub fn check_password(password: &str) -> ApiResult<()> {
    let len = password.chars().count();
    if len < MIN_PASSWORD_LEN {
        return Err(ApiError::bad_request(format!(
            "the password needs at least {MIN_PASSWORD_LEN} characters"
        )));
    }
    if len > MAX_PASSWORD_LEN {
        return Err(ApiError::bad_request(format!(
            "the password may have at most {MAX_PASSWORD_LEN} characters"
        )));
    }
    Ok(())
}

/// Usernames: 1 to 64 letters, digits, `.`, `_` or `-`.
pub fn check_username(username: &str) -> ApiResult<()> {
    let ok = !username.is_empty()
        && username.len() <= 64
        && username.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request("a username is 1 to 64 letters, digits, '.', '_' or '-'"))
    }
}

/// The PHC string of `password` under a fresh random salt. Waits for a turn however long the
/// queue is: only someone logged in gets here (an admin setting a password, a user changing
/// theirs after proving the current one), never an anonymous flood.
pub async fn hash(password: String) -> ApiResult<String> {
    Turn::wait().await?.hash(password).await
}

/// Every hash and queue place is taken; the client should retry in a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// A place in the hashing queue. It lasts until the hash it pays for has finished, even when the
/// request that took it has gone away, so abandoned requests cannot let more hashes run.
#[derive(Debug)]
pub struct Turn(OwnedSemaphorePermit);

impl Turn {
    /// A turn now, or [`Busy`] when the queue is full.
    pub fn try_take() -> Result<Turn, Busy> {
        match Arc::clone(&POOL.turns).try_acquire_owned() {
            Ok(permit) => Ok(Turn(permit)),
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => Err(Busy),
        }
    }

    async fn wait() -> ApiResult<Turn> {
        if POOL.workers == 0 {
            return Err(no_workers());
        }
        let permit = Arc::clone(&POOL.turns).acquire_owned().await.map_err(|_| no_workers())?;
        Ok(Turn(permit))
    }

    /// The PHC string of `password` under a fresh random salt, with the crate's default
    /// parameters (what `Argon2::default().hash_password` writes).
    pub async fn hash(self, password: String) -> ApiResult<String> {
        self.run(move |memory| {
            let salt = SaltString::generate(&mut OsRng);
            let mut salt_bytes = [0u8; 64];
            let salt_bytes = salt.decode_b64(&mut salt_bytes).map_err(argon2_fault)?;
            let params = Params::DEFAULT;
            let mut out = [0u8; Params::DEFAULT_OUTPUT_LEN];
            Argon2::new(Algorithm::Argon2id, Version::V0x13, params.clone())
                .hash_password_into_with_memory(
                    password.as_bytes(),
                    salt_bytes,
                    &mut out,
                    work_area(memory, &params),
                )
                .map_err(argon2_fault)?;
            let phc = PasswordHash {
                algorithm: Algorithm::Argon2id.ident(),
                version: Some(Version::V0x13.into()),
                params: ParamsString::try_from(&params).map_err(argon2_fault)?,
                salt: Some(salt.as_salt()),
                hash: Some(Output::new(&out).map_err(argon2_fault)?),
            };
            Ok(phc.to_string())
        })
        .await
    }

    /// Whether `password` matches the stored PHC string. With no stored hash (no such user)
    /// the same work is done against [`DUMMY_HASH`] and the answer is no, so a login for a name
    /// that does not exist takes as long as one with a wrong password. A corrupt stored hash is
    /// a server fault.
    pub async fn verify(self, password: String, stored: Option<String>) -> ApiResult<bool> {
        self.run(move |memory| {
            let known = stored.is_some();
            let stored = stored.as_deref().unwrap_or(&DUMMY_HASH);
            let matches = verify_in(memory, password.as_bytes(), stored)?;
            Ok(known && matches)
        })
        .await
    }

    async fn run<T: Send + 'static>(
        self,
        work: impl FnOnce(&mut Vec<Block>) -> ApiResult<T> + Send + 'static,
    ) -> ApiResult<T> {
        let (reply, answer) = oneshot::channel();
        let Turn(permit) = self;
        let job: Job = Box::new(move |memory| {
            let _turn = permit;
            // Nobody waits for the answer any more: the turn ends without the 19 MiB of work.
            if reply.is_closed() {
                return;
            }
            let _ = reply.send(work(memory));
        });
        POOL.jobs.send(job).map_err(|_| {
            ApiError::internal(anyhow::anyhow!("the password hashing threads stopped"))
        })?;
        answer.await.map_err(|_| {
            ApiError::internal(anyhow::anyhow!("a password hashing thread dropped its work"))
        })?
    }
}

/// How many hashes may run at once: half the cores (the rest serve requests and run the
/// optimizer beside a training job), at least one, at most [`MAX_WORKERS`].
pub fn workers() -> usize {
    POOL.workers
}

/// How many turns may be out at once: the running hashes plus the queue.
pub fn turns() -> usize {
    POOL.workers * (1 + QUEUE_PER_WORKER)
}

/// A syntactically valid hash with the default parameters that no password matches (its output
/// is random bytes, not a hash of anything), made once per process.
static DUMMY_HASH: LazyLock<String> = LazyLock::new(|| {
    let mut salt = [0u8; 16];
    let mut output = [0u8; Params::DEFAULT_OUTPUT_LEN];
    rand::rng().fill_bytes(&mut salt);
    rand::rng().fill_bytes(&mut output);
    let params = ParamsString::try_from(&Params::DEFAULT);
    let salt = SaltString::encode_b64(&salt);
    match (params, salt, Output::new(&output)) {
        (Ok(params), Ok(salt), Ok(output)) => PasswordHash {
            algorithm: Algorithm::Argon2id.ident(),
            version: Some(Version::V0x13.into()),
            params,
            salt: Some(salt.as_salt()),
            hash: Some(output),
        }
        .to_string(),
        // Not reachable with these fixed sizes; an unparseable dummy makes unknown users a 500,
        // which at least never logs anyone in.
        _ => String::new(),
    }
});

type Job = Box<dyn FnOnce(&mut Vec<Block>) + Send>;

struct Pool {
    /// Permits for the running hashes and the queue together.
    turns: Arc<Semaphore>,
    jobs: Sender<Job>,
    workers: usize,
}

static POOL: LazyLock<Pool> = LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(1, NonZero::get);
    let wanted = (cores / 2).clamp(1, MAX_WORKERS);
    let (jobs, queue) = mpsc::channel::<Job>();
    let queue = Arc::new(Mutex::new(queue));
    let mut workers = 0;
    for i in 0..wanted {
        let queue = Arc::clone(&queue);
        match std::thread::Builder::new()
            .name(format!("sluice-hash-{i}"))
            .spawn(move || hash_worker(&queue))
        {
            Ok(_) => workers += 1,
            Err(err) => tracing::error!("cannot start a password hashing thread: {err}"),
        }
    }
    Pool { turns: Arc::new(Semaphore::new(workers * (1 + QUEUE_PER_WORKER))), jobs, workers }
});

/// Runs hashing jobs until the process ends, all in one reused work area.
fn hash_worker(queue: &Mutex<Receiver<Job>>) {
    let mut memory: Vec<Block> = Vec::new();
    loop {
        let job = queue.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(job) = job else { return };
        // A panicking job loses its answer (its caller sees an internal error) but not the thread.
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut memory)));
        // Only a stored hash with unusual parameters grows it; back to the usual size.
        if memory.len() > Params::DEFAULT.block_count() {
            memory = Vec::new();
        }
    }
}

/// The first `params.block_count()` blocks of the thread's work area, grown on first use.
/// Argon2 writes every block before it reads it, so what a previous hash left there is harmless.
fn work_area<'a>(memory: &'a mut Vec<Block>, params: &Params) -> &'a mut [Block] {
    let blocks = params.block_count();
    if memory.len() < blocks {
        memory.resize(blocks, Block::new());
    }
    &mut memory[..blocks]
}

/// What `PasswordVerifier::verify_password` does, in the thread's work area instead of a fresh
/// 19 MiB allocation: the parameters, salt and expected output come from the PHC string, and the
/// outputs are compared in constant time (`Output`'s `PartialEq`).
fn verify_in(memory: &mut Vec<Block>, password: &[u8], stored: &str) -> ApiResult<bool> {
    let corrupt = |err: &dyn std::fmt::Display| {
        ApiError::internal(anyhow::anyhow!("stored password hash: {err}"))
    };
    let parsed = PasswordHash::new(stored).map_err(|e| corrupt(&e))?;
    let algorithm = Algorithm::try_from(parsed.algorithm).map_err(|e| corrupt(&e))?;
    let version = match parsed.version {
        Some(v) => Version::try_from(v).map_err(|e| corrupt(&e))?,
        None => Version::default(),
    };
    let params = Params::try_from(&parsed).map_err(|e| corrupt(&e))?;
    let (Some(salt), Some(expected)) = (parsed.salt, parsed.hash) else {
        return Err(corrupt(&"no salt or no hash"));
    };
    let mut salt_bytes = [0u8; 64];
    let salt_bytes = salt.decode_b64(&mut salt_bytes).map_err(|e| corrupt(&e))?;
    let mut out = [0u8; Output::MAX_LENGTH];
    let out = &mut out[..expected.len()];
    Argon2::new(algorithm, version, params.clone())
        .hash_password_into_with_memory(password, salt_bytes, out, work_area(memory, &params))
        .map_err(|e| corrupt(&e))?;
    let computed = Output::new(out).map_err(|e| corrupt(&e))?;
    Ok(computed == expected)
}

fn argon2_fault(err: impl std::fmt::Display) -> ApiError {
    ApiError::internal(anyhow::anyhow!("argon2: {err}"))
}

fn no_workers() -> ApiError {
    ApiError::internal(anyhow::anyhow!("no password hashing thread could be started"))
}

#[cfg(test)]
mod tests {
    use argon2::password_hash::{PasswordHasher, PasswordVerifier};

    use super::*;

    /// One test, since the pool is the process's: a second test taking turns at the same time
    /// would see it busy.
    #[tokio::test]
    async fn the_pool_is_bounded_and_its_hashes_are_the_crates() -> anyhow::Result<()> {
        assert!((1..=MAX_WORKERS).contains(&workers()), "{} workers", workers());
        let all: Vec<Turn> = std::iter::from_fn(|| Turn::try_take().ok()).take(1000).collect();
        assert_eq!(all.len(), turns());
        assert_eq!(Turn::try_take().err(), Some(Busy));
        drop(all);

        // Hashes stored before the pool (by `Argon2::default()`) still verify, and the pool's
        // hashes verify with the crate's own verifier, so both kinds of rows keep working.
        let salt = SaltString::generate(&mut OsRng);
        let old = Argon2::default()
            .hash_password(b"correct horse battery", &salt)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .to_string();
        let take = || Turn::try_take().map_err(|_| anyhow::anyhow!("busy"));
        let verify = |password: &str, stored: Option<&str>| {
            let (password, stored) = (password.to_string(), stored.map(str::to_string));
            async move { take()?.verify(password, stored).await.map_err(|e| anyhow::anyhow!("{e:?}")) }
        };
        assert!(verify("correct horse battery", Some(&old)).await?);
        assert!(!verify("correct horse batterY", Some(&old)).await?);

        let new = take()?.hash("another long password".into()).await;
        let new = new.map_err(|e| anyhow::anyhow!("{e:?}"))?;
        assert!(new.starts_with("$argon2id$v=19$m=19456,t=2,p=1$"), "{new}");
        let parsed = PasswordHash::new(&new).map_err(|e| anyhow::anyhow!("{e}"))?;
        assert!(Argon2::default().verify_password(b"another long password", &parsed).is_ok());
        assert!(verify("another long password", Some(&new)).await?);

        assert!(!verify("", None).await?, "no user: no match, whatever the password");
        assert!(PasswordHash::new(&DUMMY_HASH).is_ok(), "{}", *DUMMY_HASH);
        assert!(verify("x", Some("not a hash")).await.is_err());
        Ok(())
    }
}
