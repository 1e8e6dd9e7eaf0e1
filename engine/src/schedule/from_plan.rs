//! From the planner's placement to the streamer's options: one mapping for `sluice train`,
//! `sluice bench train` and the appliance, so the streamer runs exactly the placement whose
//! memory the planner budgeted.

use super::{ScheduleOptions, Tier};
use crate::error::{Error, Result};
use crate::plan::{Capabilities, CheckpointTier, GradientTier, Plan};

/// What the streamer implements today, for [`crate::plan::PlanInput::supports`]: every layer's
/// input is kept (K = 1), and each unit's gradients land in the host store as soon as they are
/// complete, with clipping on or off (no device gradient store, no two-slot ring yet).
pub const STREAMER: Capabilities =
    Capabilities { max_checkpoint_interval: 1, device_gradient_store: false, gradient_ring: false };

/// The streamer's options for `plan`, with `optimizer_threads` threads for AdamW (0: one per
/// core). A placement the streamer does not implement (a plan made with more than [`STREAMER`]
/// allows) is an error naming it, never silently approximated.
pub fn schedule_options(plan: &Plan, optimizer_threads: usize) -> Result<ScheduleOptions> {
    let p = &plan.placement;
    if p.checkpoint_interval != 1 {
        return Err(Error::invalid(format!(
            "the plan keeps one checkpoint every {} layers; the streamer keeps every layer's \
             input (plan with schedule::STREAMER)",
            p.checkpoint_interval
        )));
    }
    if p.gradients != GradientTier::HostStore {
        return Err(Error::invalid(format!(
            "the plan puts gradients in the {:?} tier; the streamer lands them in the host store \
             (plan with schedule::STREAMER)",
            p.gradients
        )));
    }
    let checkpoints = match p.checkpoints {
        CheckpointTier::Device => Tier::Device,
        CheckpointTier::Host => Tier::Host,
    };
    let max_tokens = usize::try_from(plan.batch.micro_tokens())
        .map_err(|_| Error::invalid("the micro-batch does not fit this machine's address space"))?;
    Ok(ScheduleOptions {
        max_tokens,
        grad_accum: plan.batch.grad_accum,
        checkpoints,
        optimizer_threads,
        resident: p.resident_units.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert_eq!(o.checkpoints, Tier::Device);
        // On an H200 every unit of a 3B model stays on the device.
        assert_eq!(o.resident, p.placement.resident_units);
        assert_eq!(o.resident, (0..p.model.units).collect::<Vec<_>>());

        // A small GPU with long sequences: checkpoints go to the host, fewer units stay.
        let p = plan_for(16 * GIB, STREAMER, 8192);
        let o = schedule_options(&p, 0).expect("maps");
        assert_eq!(o.checkpoints, Tier::Host, "{p}");
        assert_eq!(o.resident, p.placement.resident_units);
        assert!(o.resident.len() < p.model.units, "{p}");
    }

    #[test]
    fn placements_the_streamer_lacks_are_refused_by_name() {
        let p = plan_for(139 * GIB, Capabilities::ALL, 1024);
        assert_eq!(p.placement.gradients, GradientTier::DeviceStore);
        let err = schedule_options(&p, 0).expect_err("no device gradient store yet");
        assert!(err.to_string().contains("DeviceStore"), "{err}");

        let mut p = plan_for(139 * GIB, STREAMER, 1024);
        p.placement.checkpoint_interval = 3;
        let err = schedule_options(&p, 0).expect_err("K = 3");
        assert!(err.to_string().contains("every 3 layers"), "{err}");
    }
}
