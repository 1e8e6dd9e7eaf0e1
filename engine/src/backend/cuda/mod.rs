//! placeholder
pub mod compile;
