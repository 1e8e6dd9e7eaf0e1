//! From the planner's placement to the streamer's options: one mapping for `sluice train`,
//! `sluice bench train` and the appliance, so the streamer runs exactly the placement whose
//! memory the planner budgeted.

use super::{DiskOptions, ScheduleOptions};
use crate::error::{Error, Result};
use crate::placement::GradientTier;
use crate::plan::{Capabilities, Plan};

/// What the streamer implements, for [`crate::plan::PlanInput::supports`]: any checkpoint
/// interval, every gradient tier (device store, host store, host ring) and both weight sources.
pub const STREAMER: Capabilities = Capabilities {
    max_checkpoint_interval: usize::MAX,
    device_gradient_store: true,
    gradient_ring: true,
    bf16_gradient_store: true,
    master_streaming: true,
    only_gradients: None,
    disk_moments: true,
    moments: crate::plan::MomentsPolicy::Auto,
    keep_activations: true,
};

/// The streamer's options for `plan`, with `optimizer_threads` threads for AdamW (0: one per
/// core). A placement the streamer does not implement is an error naming it, never silently
/// approximated.
pub fn schedule_options(plan: &Plan, optimizer_threads: usize) -> Result<ScheduleOptions> {
    let p = &plan.placement;
    if p.checkpoint_interval == 0 {
        return Err(Error::invalid("the plan keeps no checkpoint (interval 0)"));
    }
    if p.gradients == GradientTier::HostRing && plan.clipping {
        return Err(Error::invalid(
            "the plan lands gradients in the ring, which cannot wait for the global norm, but \
             clipping is on",
        ));
    }
    let max_tokens = usize::try_from(plan.batch.micro_tokens())
        .map_err(|_| Error::invalid("the micro-batch does not fit this machine's address space"))?;
    Ok(ScheduleOptions {
        max_tokens,
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
    })
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
