//! Learning-rate schedules with warmup, exactly as transformers' `get_constant_schedule_with_warmup`,
//! `get_linear_schedule_with_warmup` and `get_cosine_schedule_with_warmup` (num_cycles 0.5) in
//! transformers/optimization.py compute their multiplier, times the peak learning rate (what
//! torch's `LambdaLR` sets). Arithmetic is f64 like Python's, from the peak rate as written
//! ([`as_written`]); the result is rounded to f32 last.
//!
//! Step numbering is the scheduler's: `lr_at(0)` is the rate of the first optimizer step, so with
//! warmup the first step runs at lr 0, as it does under the Hugging Face Trainer.

use std::f64::consts::PI;
use std::fmt;
use std::str::FromStr;

use super::adamw::as_written;
use crate::error::Error;

/// The shape of the schedule after warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// The peak rate for every step after warmup.
    Constant,
    /// Linear decay from the peak to 0 at `total_steps`.
    Linear,
    /// Half a cosine from the peak to 0 at `total_steps`.
    Cosine,
}

impl FromStr for Schedule {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "constant" => Ok(Schedule::Constant),
            "linear" => Ok(Schedule::Linear),
            "cosine" => Ok(Schedule::Cosine),
            other => Err(Error::invalid(format!(
                "unknown learning-rate schedule {other:?}; expected \"constant\", \"linear\" or \
                 \"cosine\""
            ))),
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Schedule::Constant => "constant",
            Schedule::Linear => "linear",
            Schedule::Cosine => "cosine",
        })
    }
}

/// A schedule bound to its peak rate and step counts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub kind: Schedule,
    /// The rate at the end of warmup.
    pub peak_lr: f32,
    /// Steps of linear warmup from 0 to `peak_lr`.
    pub warmup_steps: u64,
    /// Optimizer steps in the whole run (ignored by [`Schedule::Constant`]).
    pub total_steps: u64,
}

impl LrSchedule {
    /// The learning rate of the optimizer step taken after `step` steps (0-based).
    pub fn lr_at(&self, step: u64) -> f32 {
        (as_written(self.peak_lr) * self.multiplier(step)) as f32
    }

    /// transformers' `lr_lambda(current_step)`. Like transformers, cosine does not clamp progress
    /// past `total_steps` (the rate rises again); the trainer never asks for those steps.
    pub fn multiplier(&self, step: u64) -> f64 {
        let (step, warmup, total) =
            (step as f64, self.warmup_steps as f64, self.total_steps as f64);
        if step < warmup {
            return step / warmup.max(1.0);
        }
        match self.kind {
            Schedule::Constant => 1.0,
            Schedule::Linear => ((total - step) / (total - warmup).max(1.0)).max(0.0),
            Schedule::Cosine => {
                let progress = (step - warmup) / (total - warmup).max(1.0);
                // transformers writes math.pi * num_cycles * 2.0 * progress; with num_cycles 0.5
                // the first three factors are exactly pi.
                (0.5 * (1.0 + (PI * 0.5 * 2.0 * progress).cos())).max(0.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: Schedule, warmup: u64, total: u64) -> LrSchedule {
        LrSchedule { kind, peak_lr: 1e-2, warmup_steps: warmup, total_steps: total }
    }

    /// `lr_at(0..)` against transformers 5.17.0's schedulers (LambdaLR's lr before each
    /// `scheduler.step()`, peak 1e-2), printed by Python as f64 and rounded to f32 here.
    fn check(s: LrSchedule, expected: &[f64]) {
        for (step, &want) in expected.iter().enumerate() {
            let got = s.lr_at(step as u64);
            assert_eq!(got, want as f32, "{} step {step}: {got} vs transformers {want}", s.kind);
        }
    }

    #[test]
    fn constant_matches_transformers() {
        check(
            sched(Schedule::Constant, 3, 10),
            &[0.0, 0.003333333333333333, 0.006666666666666666, 0.01, 0.01, 0.01],
        );
        check(sched(Schedule::Constant, 0, 10), &[0.01, 0.01]);
    }

    #[test]
    fn linear_matches_transformers() {
        check(
            sched(Schedule::Linear, 2, 6),
            &[0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025, 0.0, 0.0, 0.0],
        );
    }

    #[test]
    fn cosine_matches_transformers() {
        check(
            sched(Schedule::Cosine, 2, 5),
            &[0.0, 0.005, 0.01, 0.0075, 0.0025000000000000014, 0.0, 0.002499999999999998],
        );
        // Warmup edges: the last warmup step is below the peak, the first after it is the peak.
        let s = sched(Schedule::Cosine, 100, 1000);
        assert!(s.lr_at(99) < 1e-2);
        assert_eq!(s.lr_at(100), 1e-2);
        assert_eq!(s.lr_at(1000), 0.0);
    }

    #[test]
    fn degenerate_counts_do_not_divide_by_zero() {
        // total == warmup: transformers divides by max(1, 0) = 1.
        check(sched(Schedule::Linear, 2, 2), &[0.0, 0.005, 0.0]);
        check(sched(Schedule::Cosine, 0, 0), &[0.01, 0.0]);
    }

    #[test]
    fn parses_names_and_rejects_others() {
        for kind in [Schedule::Constant, Schedule::Linear, Schedule::Cosine] {
            assert_eq!(kind.to_string().parse::<Schedule>().expect("round trip"), kind);
        }
        let err = "Cosine".parse::<Schedule>().expect_err("names are lower case");
        let msg = err.to_string();
        assert!(msg.contains("\"Cosine\"") && msg.contains("\"linear\""), "{msg}");
    }
}
