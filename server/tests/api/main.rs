//! Handler tests: requests go straight through `app(state)` with no socket, each test with its
//! own data directory and SQLite database. One binary, one module per area.

mod common;

mod auth;
mod authorization;
mod damaged_uploads;
mod dataset_formats;
mod datasets;
mod hub;
mod exports;
mod isolation;
mod jobs;
mod misc;
mod models;
mod plan_words;
mod recovery;
mod tokens;
mod runs;
mod storage;
mod try_checkpoint;
mod webhooks;
