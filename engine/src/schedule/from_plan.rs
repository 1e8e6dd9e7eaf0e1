//! From the planner's placement to the streamer's options: one mapping for `sluice train`,
//! `sluice bench train` and the appliance, so the streamer runs exactly the placement whose
//! memory the planner budgeted. The options are then the one value a run carries (its
//! `run.json` records them) into [`super::Streamer::new`].

use super::{DiskOptions, ScheduleOptions};
use crate::error::{Error, Result};
use crate::placement::{CheckpointTier, GradientTier, RING_SLOTS, WeightSource};
use crate::plan::{BatchShape, Capabilities, Plan};

/// What the streamer implements, for [`crate::plan::PlanInput::supports`]: every placement
/// the planner offers (any checkpoint interval, every gradient tier, both weight sources, the
/// disk tier, kept activations). A capability the planner gains is the streamer's only once
/// this says so; the tests below hold the streamer to running its plans.
pub const STREAMER: Capabilities = Capabilities::ALL;

/// The streamer's options for `plan`, with `optimizer_threads` threads for AdamW (0: one per
/// core). A placement the streamer does not implement is an error naming it, never silently
/// approximated.
pub fn schedule_options(plan: &Plan, optimizer_threads: usize) -> Result<ScheduleOptions> {
    let p = &plan.placement;
    let options = ScheduleOptions {
        max_tokens: micro_tokens(plan.batch)?,
        grad_accum: plan.batch.grad_accum,
        checkpoints: p.checkpoints,
        checkpoint_interval: p.checkpoint_interval,
        optimizer_threads,
        resident: p.resident_units.clone(),
        gradients: p.gradients,
        weights: p.weights,
        ring_slots: p.ring_slots,
        kept: p.kept_layers.clone(),
        kept_attention: p.kept_attention_layers.clone(),
        disk: match (&plan.memory.disk, p.disk_units.is_empty()) {
            (_, true) => None,
            (Some(d), false) => {
                Some(DiskOptions { dir: d.dir.clone(), units: p.disk_units.clone() })
            }
            (None, false) => {
                return Err(Error::invalid("the plan puts moments on a disk tier it has not got"));
            }
        },
    };
    options
        .check_runs(plan.batch, plan.clipping)
        .map_err(|e| Error::invalid(format!("the plan: {e}")))?;
    Ok(options)
}

impl ScheduleOptions {
    /// The simplest placement for `batch`, which needs no plan: every layer's input
    /// checkpointed on the device, nothing resident or kept, gradients in host memory (the
    /// store with clipping, the ring without), weights streamed from a copy.
    pub fn simplest(batch: BatchShape, clipping: bool) -> Result<ScheduleOptions> {
        batch.check_sizes(
            [BatchShape::MAX_SEQ_LEN, BatchShape::MAX_MICRO_BATCH, BatchShape::MAX_GRAD_ACCUM],
            BatchShape::MAX_MICRO_TOKENS,
        )?;
        Ok(ScheduleOptions {
            max_tokens: micro_tokens(batch)?,
            grad_accum: batch.grad_accum,
            checkpoints: CheckpointTier::Device,
            checkpoint_interval: 1,
            optimizer_threads: 0,
            resident: Vec::new(),
            gradients: ScheduleOptions::host_gradients(clipping),
            weights: WeightSource::StreamingCopy,
            ring_slots: RING_SLOTS,
            disk: None,
            kept: Vec::new(),
            kept_attention: Vec::new(),
        })
    }

    /// Checks that these options run micro-batches of `batch` with clipping on or off: the
    /// streamer's buffers are sized by `max_tokens`, its step takes `grad_accum` micro-batches,
    /// and only the ring cannot wait for the global norm.
    pub fn check_runs(&self, batch: BatchShape, clipping: bool) -> Result<()> {
        let tokens = micro_tokens(batch)?;
        if self.max_tokens < tokens {
            return Err(Error::invalid(format!(
                "the placement's buffers hold {} tokens a micro-batch, the job's micro-batches \
                 have {tokens}",
                self.max_tokens
            )));
        }
        if self.grad_accum != batch.grad_accum {
            return Err(Error::invalid(format!(
                "the placement steps over {} micro-batches, the job over {}",
                self.grad_accum, batch.grad_accum
            )));
        }
        if self.checkpoint_interval == 0 {
            return Err(Error::invalid("the placement keeps no checkpoint (interval 0)"));
        }
        if self.gradients == GradientTier::HostRing && clipping {
            return Err(Error::invalid(
                "the placement lands gradients in the ring, which cannot wait for the global \
                 norm, but clipping is on",
            ));
        }
        Ok(())
    }

    /// One line for logs and the job page: "3 of 30 units resident, checkpoints on the
    /// device every layer, gradients wait on the device, ...".
    pub fn describe(&self, units: usize) -> String {
        let checkpoints = match self.checkpoints {
            CheckpointTier::Device => "on the device",
            CheckpointTier::Host => "in host memory",
        };
        let interval = match self.checkpoint_interval {
            1 => "every layer".to_string(),
            k => format!("every {k} layers"),
        };
        let gradients = match self.gradients {
            GradientTier::DeviceStore => "gradients wait on the device",
            GradientTier::HostStore => "gradients wait in host memory",
            GradientTier::HostStoreBf16 => "gradients wait in host memory in bf16",
            GradientTier::HostRing => "gradients go straight to the optimizer",
        };
        let weights = match self.weights {
            WeightSource::Master => "weights stream from the fp32 master",
            WeightSource::StreamingCopy => "weights stream from a copy",
        };
        let kept = match self.kept.len() {
            0 => String::new(),
            n => format!(", activations of {n} layers kept (no recompute)"),
        };
        let kept = match self.kept_attention.len() {
            0 => kept,
            n => format!("{kept}, attention outputs of {n} layers kept"),
        };
        format!(
            "{} of {units} units resident, checkpoints {checkpoints} {interval}{kept}, \
             {gradients}, {weights}",
            self.resident.len()
        )
    }
}

/// Tokens in one micro-batch of `batch`, as the streamer sizes its buffers.
fn micro_tokens(batch: BatchShape) -> Result<usize> {
    usize::try_from(batch.micro_tokens())
        .map_err(|_| Error::invalid("the micro-batch does not fit this machine's address space"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::CheckpointTier;
    use crate::plan::{BatchShape, MachineMemory, MachineRates, PlanInput, Verdict, plan};
    use crate::spec::preset;

    const GIB: u64 = 1 << 30;

    fn plan_for(gpu: u64, supports: Capabilities, seq_len: usize) -> Plan {
        let spec = preset("qwen2.5-3b").expect("preset");
        let input = PlanInput {
            spec: &spec,
            batch: BatchShape { seq_len, micro_batch: 4, grad_accum: 8 },
            clipping: true,
            memory: MachineMemory::given(gpu, 125 * GIB),
            rates: MachineRates::default(),
            supports,
            gpus: 1,
        };
        match plan(&input).expect("valid") {
            Verdict::Fits(p) => *p,
            Verdict::Refused(r) => panic!("refused: {}", r.details()),
        }
    }

    #[test]
    fn a_streamer_plan_maps_to_its_options() {
        let p = plan_for(139 * GIB, STREAMER, 1024);
        let o = schedule_options(&p, 3).expect("the streamer runs its own plans");
        assert_eq!(o.max_tokens, 4 * 1024);
        assert_eq!(o.grad_accum, 8);
        assert_eq!(o.optimizer_threads, 3);
        assert_eq!(o.checkpoints, CheckpointTier::Device);
        // On an H200 every unit of a 3B model stays on the device.
        assert_eq!(o.resident, p.placement.resident_units);
        assert_eq!(o.resident, (0..p.model.units).collect::<Vec<_>>());

        // A small GPU with long sequences: checkpoints go to the host, fewer units stay.
        let p = plan_for(16 * GIB, STREAMER, 8192);
        let o = schedule_options(&p, 0).expect("maps");
        assert_eq!(o.checkpoints, CheckpointTier::Host, "{p}");
        assert_eq!(o.resident, p.placement.resident_units);
        assert!(o.resident.len() < p.model.units, "{p}");
    }

    #[test]
    fn gradient_tiers_and_intervals_map_through() {
        let mut p = plan_for(139 * GIB, STREAMER, 1024);
        // 3B's fp32 gradients fit an H200 beside everything else: they wait there.
        assert_eq!(p.placement.gradients, GradientTier::DeviceStore);
        assert_eq!(schedule_options(&p, 0).expect("maps").gradients, GradientTier::DeviceStore);
        p.placement.checkpoint_interval = 3;
        assert_eq!(schedule_options(&p, 0).expect("maps").checkpoint_interval, 3);
        // A ring cannot hold gradients back for the norm.
        p.placement.gradients = GradientTier::HostRing;
        let err = schedule_options(&p, 0).expect_err("ring with clipping");
        assert!(err.to_string().contains("ring"), "{err}");
    }
}
