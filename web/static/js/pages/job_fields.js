// Reading a job as `GET /api/jobs` and `GET /api/jobs/{id}` send it, in one place.

/** `{step, steps, fraction}`; fraction is 0..1. `total_steps` is 0 until a one-pass job starts. */
export function jobProgress(job) {
  const step = num(job.step) ?? 0;
  const steps = num(job.total_steps) || num(job.config && job.config.steps) || 0;
  let fraction = num(job.progress) ?? (steps > 0 ? step / steps : 0);
  if (job.status === 'completed') fraction = 1;
  return { step, steps, fraction: Math.max(0, Math.min(1, fraction)) };
}

/** The 1-based place in the device's line while queued, or null. */
export function queuePosition(job) {
  return job.status === 'queued' ? (num(job.position) ?? null) : null;
}

/** "next in line", "3rd in line". */
export function placeInLine(position) {
  if (position === null) return 'waiting';
  if (position <= 1) return 'next in line';
  const suffix = position % 10 === 2 && position % 100 !== 12 ? 'nd' : position % 10 === 3 && position % 100 !== 13 ? 'rd' : 'th';
  return `${position}${suffix} in line`;
}

/** `preset:tiny` -> "tiny", `local:Qwen3-8B` -> "Qwen3-8B". */
export function modelLabel(id) {
  if (typeof id !== 'string') return '—';
  return id.replace(/^(preset|local):/, '');
}

/** Whether the job can be resumed (the server says so when it knows). */
export function canResume(job) {
  if (typeof job.resumable === 'boolean') return job.resumable;
  return job.status === 'interrupted' || job.status === 'cancelled';
}

function num(value) {
  return typeof value === 'number' && Number.isFinite(value) ? value : undefined;
}
