//! Open live streams (a job's server-sent events) counted per user and in all, each capped, so
//! one user cannot hold a thousand connections and the server cannot be filled with them. A
//! stream holds a [`Watch`] for as long as it is open; dropping it (the stream ended, or the
//! client went away) gives the place back.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The caps and the count of open streams.
#[derive(Debug)]
pub struct Watchers {
    per_user: usize,
    total: usize,
    open: Arc<Mutex<Open>>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    /// Streams of each logged-in user; anonymous ones (demo links) count in the total only.
    by_user: HashMap<i64, usize>,
}

/// A place among the open streams, given back when dropped.
#[derive(Debug)]
pub struct Watch {
    open: Arc<Mutex<Open>>,
    user: Option<i64>,
}

/// Why a stream was refused: which cap it would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Full {
    #[error("you have {0} live views open, the most allowed; close some pages and try again")]
    User(usize),
    #[error("the server has {0} live views open, the most it serves; try again shortly")]
    Server(usize),
}

impl Watchers {
    pub fn new(per_user: usize, total: usize) -> Watchers {
        Watchers { per_user, total, open: Arc::default() }
    }

    /// A place for one more stream of `user` (`None`: a visitor without an account).
    pub fn admit(&self, user: Option<i64>) -> Result<Watch, Full> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if open.total >= self.total {
            return Err(Full::Server(open.total));
        }
        if let Some(user) = user {
            let mine = open.by_user.entry(user).or_default();
            if *mine >= self.per_user {
                return Err(Full::User(*mine));
            }
            *mine += 1;
        }
        open.total += 1;
        Ok(Watch { open: Arc::clone(&self.open), user })
    }

    /// Streams open now.
    pub fn open(&self) -> usize {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).total
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.total = open.total.saturating_sub(1);
        if let Some(user) = self.user
            && let Some(mine) = open.by_user.get_mut(&user)
        {
            *mine = mine.saturating_sub(1);
            if *mine == 0 {
                open.by_user.remove(&user);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_hold_per_user_and_in_all_and_places_come_back() {
        let watchers = Watchers::new(2, 3);
        let a1 = watchers.admit(Some(1));
        let a2 = watchers.admit(Some(1));
        assert!(a1.is_ok() && a2.is_ok());
        assert_eq!(watchers.admit(Some(1)).err(), Some(Full::User(2)));
        let b1 = watchers.admit(Some(2));
        assert!(b1.is_ok());
        assert_eq!(watchers.admit(Some(2)).err(), Some(Full::Server(3)));
        assert_eq!(watchers.admit(None).err(), Some(Full::Server(3)));
        drop(a1);
        assert_eq!(watchers.open(), 2);
        let a3 = watchers.admit(Some(1));
        assert!(a3.is_ok());
        drop((a2, a3, b1));
        assert_eq!(watchers.open(), 0);
        // Visitors count in the total only.
        let visitors: Vec<_> = (0..3).map(|_| watchers.admit(None)).collect();
        assert!(visitors.iter().all(Result::is_ok));
        assert_eq!(watchers.admit(Some(1)).err(), Some(Full::Server(3)));
    }
}
