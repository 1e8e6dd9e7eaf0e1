// Reading a job as `GET /api/jobs` and `GET /api/jobs/{id}` send it. The contract names the
// facts (status, queue position, progress, eta_s) but leaves some field names open, so each
// reader accepts the plausible spellings in one place.

/** `{step, steps, fraction}`; fraction is 0..1. */
export function jobProgress(job) {
  const p = job.progress;
  const step = num(p && typeof p === 'object' ? p.step : undefined) ?? num(job.step) ?? num(job.current_step) ?? 0;
  const steps = num(p && typeof p === 'object' ? (p.steps ?? p.total_steps) : undefined)
    ?? num(job.steps) ?? num(job.total_steps) ?? num(job.config && job.config.steps) ?? 0;
  let fraction = typeof p === 'number' ? p : (steps > 0 ? step / steps : 0);
  if (fraction > 1.0001 && fraction <= 100) fraction /= 100;
  if (job.status === 'completed') fraction = 1;
  return { step: typeof p === 'number' && steps ? Math.round(p * steps) : step, steps, fraction };
}

/** Jobs ahead of this one in its GPU's line (0 = next), or null when not queued. */
export function queuePosition(job) {
  const value = num(job.position) ?? num(job.queue_position);
  return value === undefined ? null : value;
}

function num(value) {
  return typeof value === 'number' && Number.isFinite(value) ? value : undefined;
}
