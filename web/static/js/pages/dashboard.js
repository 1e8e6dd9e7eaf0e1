// Dashboard: every job the user may see (ticked ones open side by side in the comparison), and
// the GPUs with their memory in use.
import { firstData, get, requireUser } from '../api.js';
import { $, bar, el, fill, fmtBytes, fmtDate, fmtDuration, fmtInt, fmtNum, ownerName, showError, statusBadge } from '../ui.js';
import { jobProgress, modelLabel, placeInLine, queuePosition } from './job_fields.js';

const user = await requireUser();
const admin = user.role === 'admin';
// Ticked jobs, kept across the periodic refresh.
const chosen = new Set();

function syncCompare() {
  const button = $('#compare');
  const ids = [...chosen].sort((a, b) => a - b);
  button.href = `/jobs/compare?ids=${ids.join(',')}`;
  button.classList.toggle('disabled', ids.length < 2);
  button.setAttribute('aria-disabled', String(ids.length < 2));
  $('#compare-hint').textContent = ids.length < 2 ? 'Tick two or more jobs to compare them.' : `${ids.length} jobs ticked.`;
}

function jobRow(job) {
  const { step, steps, fraction } = jobProgress(job);
  const position = queuePosition(job);
  let detail = '';
  if (job.status === 'queued') detail = placeInLine(position);
  else if (job.status === 'running' && typeof job.eta_s === 'number') detail = `about ${fmtDuration(job.eta_s)} left`;
  const finalLoss = job.summary && typeof job.summary.final_loss === 'number' ? fmtNum(job.summary.final_loss) : '—';
  return el('tr', { dataset: { job: job.id } },
    el('td', { class: 'tick' }, el('input', {
      type: 'checkbox', 'aria-label': `Compare job ${job.id}`, checked: chosen.has(job.id), dataset: { compare: job.id },
      onchange: (event) => {
        if (event.target.checked) chosen.add(job.id); else chosen.delete(job.id);
        syncCompare();
      },
    })),
    // The name is the link (with the number beside it); an unnamed job is its number.
    el('td', {}, el('a', { href: `/jobs/${job.id}`, dataset: { name: job.id } },
      job.name ? [job.name, ' ', el('span', { class: 'muted small' }, `#${job.id}`)] : `#${job.id}`)),
    el('td', {}, modelLabel(job.model)),
    el('td', {}, job.dataset_name || `#${job.dataset}`),
    admin ? el('td', {}, ownerName(job.owner)) : null,
    // Why a job failed goes with its status; the time-left column is about time.
    el('td', {}, statusBadge(job.status),
      job.status === 'failed' && job.error ? el('div', { class: 'small muted', dataset: { error: job.id } }, job.error) : null),
    el('td', {}, el('div', { class: 'progress-line' }, bar(fraction),
      el('span', { class: 'num small' }, steps ? `${fmtInt(step)} / ${fmtInt(steps)}` : '—'))),
    el('td', { class: 'num' }, finalLoss),
    el('td', { class: 'small muted' }, detail),
    el('td', { class: 'small muted' }, fmtDate(job.created_at)));
}

function renderJobs(jobs) {
  const box = $('#jobs');
  if (!jobs.length) {
    fill(box, el('p', { class: 'empty' }, 'No jobs yet. ',
      el('a', { href: '/jobs/new' }, 'Start one'), ' — the tiny preset with the demo dataset trains in a minute, even without a GPU.'));
    return;
  }
  const sorted = [...jobs].sort((a, b) => b.id - a.id);
  fill(box, el('table', { class: 'list', id: 'jobs-table' },
    el('thead', {}, el('tr', {}, ['Compare', 'Job', 'Model', 'Dataset', admin ? 'Owner' : null, 'Status', 'Progress', 'Loss', 'Time left', 'Created']
      .filter((h) => h !== null).map((h) => el('th', {}, h)))),
    el('tbody', {}, sorted.map(jobRow))));
}

function renderGpus(gpus) {
  const box = $('#gpus');
  if (!gpus.length) {
    fill(box, el('p', { class: 'empty' }, 'No device reported.'));
    return;
  }
  fill(box, gpus.map((gpu) => {
    const total = gpu.memory_total;
    const used = gpu.memory_used;
    const hasMemory = typeof total === 'number' && total > 0;
    const meta = [gpu.id, gpu.pcie ? `PCIe ${gpu.pcie}` : null,
      typeof gpu.utilization === 'number' ? `${Math.round(gpu.utilization)}% busy` : null].filter(Boolean).join(' · ');
    return el('div', { class: 'gpu', dataset: { gpu: gpu.id } },
      el('div', { class: 'name' }, gpu.name || gpu.id),
      el('div', { class: 'meta' }, meta),
      hasMemory ? bar(used / total, { title: 'memory in use' }) : null,
      el('div', { class: 'small muted', style: { marginTop: '0.3rem' } },
        hasMemory ? `${fmtBytes(used)} of ${fmtBytes(total)} in use`
          : ''),
      gpu.id === 'cpu' ? el('div', { class: 'small muted' }, 'host memory; trains small models such as the tiny preset') : null);
  }));
}

async function refresh() {
  const given = firstData('jobs');
  const [jobs, gpus] = await Promise.allSettled([given ?? get('/api/jobs'), get('/api/gpus')]);
  const failed = [jobs, gpus].find((r) => r.status === 'rejected');
  showError($('#error'), failed ? failed.reason : null);
  if (jobs.status === 'fulfilled') renderJobs(jobs.value);
  if (gpus.status === 'fulfilled') renderGpus(gpus.value);
}

$('#compare').addEventListener('click', (event) => {
  if (chosen.size < 2) event.preventDefault();
});
syncCompare();
await refresh();
setInterval(refresh, 5000);
