//! The job queue, with no HTTP in it: a request body made into the engine's job
//! ([`request`]), the planner's verdict on it ([`plan`]) with the disk tier where it needs one
//! ([`disk`]), the dispatcher and training threads ([`runner`], over the [`queue`]'s shared
//! state), and what is recorded and told of a job as it goes ([`record`]). Its SQL is in
//! `store::jobs`; its failures are [`JobsError`], which the API maps to statuses.

pub mod disk;
pub mod plan;
pub mod queue;
pub mod record;
pub mod request;
pub mod runner;

/// Why the queue refused or could not do something.
#[derive(Debug, thiserror::Error)]
pub enum JobsError {
    /// The request is malformed or names something unknown (a field the engine refuses, a
    /// model, dataset or device that does not exist); the message is for the user.
    #[error("{0}")]
    Invalid(String),
    /// The database failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// Any other fault of the server.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl JobsError {
    pub fn invalid(message: impl Into<String>) -> Self {
        JobsError::Invalid(message.into())
    }
}

impl From<tokio::task::JoinError> for JobsError {
    fn from(err: tokio::task::JoinError) -> Self {
        JobsError::Internal(err.into())
    }
}
