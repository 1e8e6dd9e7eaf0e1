//! Password hashing with argon2id (the crate's defaults: 19 MiB, 2 passes), off the async
//! threads because a hash takes tens of milliseconds on purpose.

use argon2::Argon2;
use argon2::password_hash::rand_core::OsRng;
use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};

use crate::error::{ApiError, ApiResult};

pub const MIN_PASSWORD_LEN: usize = 8;
const MAX_PASSWORD_LEN: usize = 1024;

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

/// The PHC string of `password` under a fresh random salt.
pub async fn hash(password: String) -> ApiResult<String> {
    tokio::task::spawn_blocking(move || {
        let salt = SaltString::generate(&mut OsRng);
        Argon2::default()
            .hash_password(password.as_bytes(), &salt)
            .map(|hash| hash.to_string())
            .map_err(|err| ApiError::internal(anyhow::anyhow!("argon2: {err}")))
    })
    .await?
}

/// Whether `password` matches the stored PHC string. A corrupt stored hash is a server fault.
pub async fn verify(password: String, stored: String) -> ApiResult<bool> {
    tokio::task::spawn_blocking(move || {
        let parsed = PasswordHash::new(&stored)
            .map_err(|err| ApiError::internal(anyhow::anyhow!("stored password hash: {err}")))?;
        Ok(Argon2::default().verify_password(password.as_bytes(), &parsed).is_ok())
    })
    .await?
}
