//! The SQL of the appliance, one module per table or small group of tables. Functions take the
//! pool and return `sqlx::Result`; what a failure means to a user is decided above.

pub mod datasets;
pub mod jobs;
pub mod sessions;
pub mod tokens;
pub mod users;
pub mod webhooks;
