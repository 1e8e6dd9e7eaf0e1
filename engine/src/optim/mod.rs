//! The optimizer side of a step, on the host where the fp32 master weights, gradients and Adam
//! moments live: global-norm gradient clipping ([`clip`]), the learning-rate schedule
//! ([`schedule`]) and the fused AdamW update of one tensor ([`adamw`]).
//!
//! Everything follows PyTorch and transformers to the bit where that is possible (the module
//! docs say where and why not), because correctness is checked against them: a 5-step AdamW
//! trajectory of every model family is compared with fixtures made by transformers.
//!
//! One optimizer step, in order: sum the squares of every gradient ([`sum_of_squares`]), turn the
//! norm into a factor ([`clip_coef`]), [`scale`] the gradients, then [`adamw_step`] each tensor
//! with the rate [`LrSchedule::lr_at`] gives for the steps already taken, decaying only tensors
//! that [`decays`] selects. The streaming trainer does the last two in one pass per unit with
//! [`adamw_fused`] on its own [`AdamPool`], which also writes the unit's bf16 streaming copy
//! where one is kept.

pub mod adamw;
pub mod clip;
pub mod pool;
pub mod schedule;

pub use adamw::{
    AdamW, FusedStep, GradIn, TensorStep, UnitState, adamw_fused, adamw_fused_from,
    adamw_fused_scalar, adamw_step, as_written, bf16_bits, decays, fused_isa,
};
pub use clip::{clip_coef, clip_grad_norm, scale, sum_of_squares};
pub use pool::AdamPool;
pub use schedule::{LrSchedule, Schedule};

#[cfg(test)]
mod torch_parity;
