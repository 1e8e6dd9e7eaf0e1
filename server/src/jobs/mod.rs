//! The job queue, with no HTTP in it: a request body made into the engine's job
//! ([`request`]), the planner's verdict on it ([`plan`]) with the disk tier where it needs one
//! ([`disk`]), the dispatcher and training threads ([`runner`]), and the `jobs` table
//! ([`store`], where all of its SQL lives).

pub mod disk;
pub mod plan;
pub mod request;
pub mod runner;
pub mod store;

pub use runner::Queue;
