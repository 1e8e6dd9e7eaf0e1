//! Handler tests: requests go straight through `app(state)` with no socket, each test with its
//! own data directory and SQLite database. One binary, one module per area.

mod common;

mod auth;
mod authorization;
mod damaged_uploads;
mod dataset_formats;
mod datasets;
mod demo;
mod evaluation;
mod exports;
mod hub;
mod isolation;
mod jobs;
mod misc;
mod models;
mod openai;
mod pages;
mod passwords;
mod plan_words;
mod recovery;
mod runs;
mod storage;
mod streams;
mod tokens;
mod try_checkpoint;
mod webhooks;
