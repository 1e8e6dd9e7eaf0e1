//! The pulls of this process and how far each has come: plain data the appliance keeps in its
//! state, for the models page.

use serde::Serialize;

/// The pulls of this process, one per repo: the one under way, or how the last one ended.
#[derive(Debug, Default)]
pub struct Pulls(std::sync::Mutex<std::collections::BTreeMap<String, PullView>>);

/// A pull as the models page shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PullView {
    pub repo: String,
    pub revision: String,
    pub commit: Option<String>,
    /// "running", "done" or "failed".
    pub state: &'static str,
    /// Why it failed, for the user.
    pub error: Option<String>,
    /// The model id, once done.
    pub model: Option<String>,
    pub files: Vec<super::FileProgress>,
    pub done: u64,
    pub total: u64,
}

impl PullView {
    pub fn running(repo: &str, revision: &str) -> PullView {
        PullView {
            repo: repo.to_string(),
            revision: revision.to_string(),
            commit: None,
            state: "running",
            error: None,
            model: None,
            files: Vec::new(),
            done: 0,
            total: 0,
        }
    }
}

impl Pulls {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<String, PullView>> {
        // A panic while holding the lock leaves plain data behind: still usable.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a new pull of `repo`, unless one is under way (then `false`).
    pub fn begin(&self, repo: &str, revision: &str) -> bool {
        let mut pulls = self.lock();
        if pulls.get(repo).is_some_and(|p| p.state == "running") {
            return false;
        }
        pulls.insert(repo.to_string(), PullView::running(repo, revision));
        true
    }

    /// Changes the record of `repo`'s pull.
    pub fn update(&self, repo: &str, change: impl FnOnce(&mut PullView)) {
        if let Some(view) = self.lock().get_mut(repo) {
            change(view);
        }
    }

    /// Forgets `repo`'s pull (one refused before it started).
    pub fn forget(&self, repo: &str) {
        self.lock().remove(repo);
    }

    pub fn all(&self) -> Vec<PullView> {
        self.lock().values().cloned().collect()
    }
}
