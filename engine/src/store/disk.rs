//! The disk tier: the Adam moments of chosen units in one file on a local SSD, for models whose
//! training state outgrows host memory.
//!
//! The file holds, per disk unit, m then v, each padded to a 4 KiB block, so every request is
//! block-aligned and runs with `O_DIRECT`: the moments pass straight between the SSD and a
//! staging slot, never through the page cache (which would take back the host memory the tier
//! exists to save). A request is cut into [`CHUNK`]-byte pieces that [`IO_DEPTH`] threads issue
//! at once, enough requests in flight for an NVMe drive's bandwidth.
//!
//! [`DiskStage`] keeps the optimizer worker fed: a few staging slots, two I/O threads (reads,
//! and write-backs, each served in the order asked for, so a read ahead and a write-back run at
//! once where the drive serves both), and a guess of the unit the worker will update next (the
//! one that followed it last time: the update order repeats every step), read while the
//! current unit is updated. A read of a unit whose write-back is still under way waits for it,
//! so it sees the moments the last update wrote.
//!
//! The file is scratch: created empty (its blocks read as zeros, the moments' initial value)
//! when a run starts and removed when it ends. A saved training state holds the moments
//! themselves (`train::state`), so a run killed at any moment resumes exactly from its last
//! saved state, whatever the file held.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::slab::{HostSlab, SLAB_ALIGN};
use crate::error::{Error, Result};
use crate::placement::{DiskSpace, MemorySource};

/// Alignment of every offset and length in the file (direct I/O's requirement on any common
/// drive and file system).
pub const BLOCK: usize = 4096;
/// Bytes per I/O request.
pub const CHUNK: usize = 4 << 20;
/// Requests in flight per transfer.
pub const IO_DEPTH: usize = 8;
/// Staging slots: the unit being updated, the next one being read, the last one being written.
pub const STAGE_SLOTS: usize = 3;

/// Bytes of one moment array of `n` f32s in the file and in a slot.
pub fn padded_bytes(n: usize) -> usize {
    (n * 4).next_multiple_of(BLOCK)
}

/// One unit's place in the file: m at `offset`, v at `offset + padded_bytes(len)`.
#[derive(Debug, Clone, Copy)]
struct Region {
    offset: u64,
    len: usize,
}

/// The moments file.
pub struct DiskTier {
    file: File,
    path: PathBuf,
    /// Whether the file is open with `O_DIRECT` (file systems without it, tmpfs for one, go
    /// through the page cache).
    direct: bool,
    regions: Vec<Option<Region>>,
    bytes: u64,
    /// Reads and writes each have their own requests in flight, so a read ahead and a
    /// write-back proceed together where the drive serves both.
    read_pool: rayon::ThreadPool,
    write_pool: rayon::ThreadPool,
}

impl DiskTier {
    /// Creates the moments file in `dir` for the units in `on_disk`, `sizes[u]` f32s each, with
    /// all its blocks allocated now (a full disk is an error at start, not mid-run).
    pub fn create(dir: &Path, sizes: &[usize], on_disk: &[usize]) -> Result<DiskTier> {
        let mut regions = vec![None; sizes.len()];
        let mut offset = 0u64;
        for &u in on_disk {
            let len = *sizes.get(u).ok_or_else(|| {
                Error::invalid(format!(
                    "the disk tier names unit {u}, the model has {}",
                    sizes.len()
                ))
            })?;
            if regions[u].is_some() {
                return Err(Error::invalid(format!("the disk tier names unit {u} twice")));
            }
            regions[u] = Some(Region { offset, len });
            offset += 2 * padded_bytes(len) as u64;
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        sweep(dir);
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{FILE_PREFIX}{}-{}.bin",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        let (file, direct) = open_direct(&path, true)?;
        let (read_pool, write_pool) = (io_pool("read")?, io_pool("write")?);
        let tier = DiskTier { file, path, direct, regions, bytes: offset, read_pool, write_pool };
        tier.allocate()?;
        Ok(tier)
    }

    fn allocate(&self) -> Result<()> {
        if self.bytes == 0 {
            return Ok(());
        }
        use std::os::fd::AsRawFd;
        let len = libc::off_t::try_from(self.bytes)
            .map_err(|_| Error::invalid("the disk tier's file is too large for this system"))?;
        // SAFETY: the descriptor is this tier's open file; posix_fallocate reads no memory.
        let rc = unsafe { libc::posix_fallocate(self.file.as_raw_fd(), 0, len) };
        match rc {
            0 => Ok(()),
            // File systems that cannot preallocate still hold a sparse file.
            libc::EOPNOTSUPP | libc::EINVAL => {
                self.file.set_len(self.bytes).map_err(|e| Error::io(&self.path, e))
            }
            libc::ENOSPC => Err(Error::invalid(format!(
                "the disk tier at {} has no room for {} bytes of Adam moments",
                self.path.display(),
                self.bytes
            ))),
            e => Err(Error::io(&self.path, std::io::Error::from_raw_os_error(e))),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of the file.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Whether `unit`'s moments live here.
    pub fn holds(&self, unit: usize) -> bool {
        self.regions.get(unit).is_some_and(Option::is_some)
    }

    /// Units whose moments live here, in unit order.
    pub fn units(&self) -> Vec<usize> {
        (0..self.regions.len()).filter(|&u| self.holds(u)).collect()
    }

    /// Bytes a staging slot needs for any unit here.
    pub fn slot_bytes(&self) -> usize {
        self.regions.iter().flatten().map(|r| 2 * padded_bytes(r.len)).max().unwrap_or(0)
    }

    fn region(&self, unit: usize) -> Result<Region> {
        self.regions.get(unit).copied().flatten().ok_or_else(|| {
            Error::invalid(format!("unit {unit}'s moments are not on the disk tier"))
        })
    }

    /// Reads `unit`'s m and v into `slot` (m at byte 0, v at `padded_bytes(n)`).
    pub fn read(&self, unit: usize, slot: &mut HostSlab) -> Result<()> {
        let r = self.region(unit)?;
        let len = 2 * padded_bytes(r.len);
        let buf = slot.as_bytes_mut().get_mut(..len).ok_or_else(|| small_slot(unit))?;
        let file = &self.file;
        self.read_pool
            .install(|| {
                buf.par_chunks_mut(CHUNK).enumerate().try_for_each(|(i, chunk)| {
                    file.read_exact_at(chunk, r.offset + (i * CHUNK) as u64)
                })
            })
            .map_err(|e| Error::io(&self.path, e))
    }

    /// Writes `unit`'s m and v from `slot`, laid out as [`DiskTier::read`] leaves them.
    pub fn write(&self, unit: usize, slot: &HostSlab) -> Result<()> {
        let r = self.region(unit)?;
        let len = 2 * padded_bytes(r.len);
        let buf = slot.as_bytes().get(..len).ok_or_else(|| small_slot(unit))?;
        let file = &self.file;
        self.write_pool
            .install(|| {
                buf.par_chunks(CHUNK).enumerate().try_for_each(|(i, chunk)| {
                    file.write_all_at(chunk, r.offset + (i * CHUNK) as u64)
                })
            })
            .map_err(|e| Error::io(&self.path, e))
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Moments files are `sluice-moments-<pid>-<n>.bin`.
const FILE_PREFIX: &str = "sluice-moments-";

/// Removes the moments files of processes that no longer run (a run killed before it could
/// remove its own): their blocks would otherwise stay allocated until someone noticed.
fn sweep(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(FILE_PREFIX))
            .and_then(|n| n.split('-').next())
            .and_then(|p| p.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: kill with signal 0 only asks whether the process exists; it sends nothing.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn small_slot(unit: usize) -> Error {
    Error::invalid(format!("a disk staging slot is too small for unit {unit}'s moments"))
}

fn io_pool(what: &'static str) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(IO_DEPTH)
        .thread_name(move |i| format!("sluice-{what}-{i}"))
        .build()
        .map_err(|e| Error::invalid(format!("cannot start the disk tier's I/O threads: {e}")))
}

/// Opens (creating with `create`) `path` for reading and writing with `O_DIRECT`, or without
/// where the file system refuses it.
fn open_direct(path: &Path, create: bool) -> Result<(File, bool)> {
    let open = |flags: i32| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(create)
            .custom_flags(flags)
            .open(path)
    };
    match open(libc::O_DIRECT) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            open(0).map(|f| (f, false)).map_err(|e| Error::io(path, e))
        }
        Err(e) => Err(Error::io(path, e)),
    }
}

/// Bytes free for unprivileged users in the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| Error::invalid(format!("{}: a path with a NUL byte", dir.display())))?;
    // SAFETY: statvfs is plain data; zeroed is a valid value that the call overwrites.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid statvfs to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(Error::io(dir, std::io::Error::last_os_error()));
    }
    // The field widths differ between targets (u64 on 64-bit Linux).
    #[allow(clippy::useless_conversion)]
    let free = u64::from(st.f_bavail).saturating_mul(st.f_frsize);
    Ok(free)
}

/// Bytes the probe writes and reads back.
const PROBE_BYTES: usize = 512 << 20;

/// The disk tier's folder as the planner sees it: its free bytes and the rates a transfer as
/// the tier issues them reaches there (a file of [`PROBE_BYTES`] written, synced and read back
/// with direct I/O, then removed). Creates the folder if needed.
pub fn probe(dir: &Path) -> Result<DiskSpace> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let free = free_bytes(dir)?;
    let bytes = PROBE_BYTES.min((free / 4) as usize / CHUNK * CHUNK).max(CHUNK);
    let path = dir.join(format!(".sluice-probe-{}", std::process::id()));
    let result = (|| -> Result<(u64, u64)> {
        let (file, _) = open_direct(&path, true)?;
        let pool = io_pool("probe")?;
        let mut slab = HostSlab::zeroed(bytes)?;
        // Random-looking bytes, so a compressing drive cannot flatter itself.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for word in slab.as_bytes_mut().chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            word.copy_from_slice(&x.to_le_bytes());
        }
        let io = |e| Error::io(&path, e);
        let start = Instant::now();
        pool.install(|| {
            slab.as_bytes()
                .par_chunks(CHUNK)
                .enumerate()
                .try_for_each(|(i, c)| file.write_all_at(c, (i * CHUNK) as u64))
        })
        .map_err(io)?;
        file.sync_all().map_err(io)?;
        let write = start.elapsed();
        let start = Instant::now();
        pool.install(|| {
            slab.as_bytes_mut()
                .par_chunks_mut(CHUNK)
                .enumerate()
                .try_for_each(|(i, c)| file.read_exact_at(c, (i * CHUNK) as u64))
        })
        .map_err(io)?;
        let read = start.elapsed();
        let rate = |d: Duration| (bytes as f64 / d.as_secs_f64().max(1e-6)) as u64;
        Ok((rate(read), rate(write)))
    })();
    let _ = std::fs::remove_file(&path);
    let (read_bytes_per_s, write_bytes_per_s) = result?;
    Ok(DiskSpace {
        dir: dir.to_path_buf(),
        bytes: free,
        read_bytes_per_s,
        write_bytes_per_s,
        source: MemorySource::Measured,
    })
}

/// Disk traffic and waits since the last [`DiskStage::take_stats`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DiskStats {
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Time the I/O thread spent reading and writing.
    pub read_busy: Duration,
    pub write_busy: Duration,
    /// Time the optimizer waited for a unit's moments to arrive (the reads it did not hide).
    pub waited: Duration,
}

/// What a staging slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Free,
    /// A read of this unit is queued or running.
    Reading(usize),
    /// This unit's moments, as on disk.
    Ready(usize),
    /// Being updated by the optimizer.
    InUse(usize),
    /// A write-back of this unit is queued or running.
    Writing(usize),
}

enum Io {
    Read(usize, usize),
    Write(usize, usize),
}

struct Table {
    slots: Vec<Slot>,
    /// The unit updated after each unit last time.
    next: Vec<Option<usize>>,
    last: Option<usize>,
    failed: Option<String>,
    stats: DiskStats,
}

struct Shared {
    tier: DiskTier,
    buffers: Vec<Mutex<HostSlab>>,
    table: Mutex<Table>,
    changed: Condvar,
}

impl Shared {
    fn table(&self) -> Result<MutexGuard<'_, Table>> {
        self.table.lock().map_err(|_| Error::invalid("the disk tier's state was poisoned"))
    }

    fn buffer(&self, slot: usize) -> Result<MutexGuard<'_, HostSlab>> {
        self.buffers[slot].lock().map_err(|_| Error::invalid("a disk staging slot was poisoned"))
    }
}

/// The moments of disk units on their way to and from the optimizer.
pub struct DiskStage {
    shared: Arc<Shared>,
    /// (reads, writes): each served in order by its own thread.
    queues: Mutex<Option<(Sender<Io>, Sender<Io>)>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// One unit's moments in a staging slot, for the optimizer's update; handed back with
/// [`DiskStage::release`].
pub struct Staged<'a> {
    unit: usize,
    slot: usize,
    len: usize,
    buffer: MutexGuard<'a, HostSlab>,
}

impl Staged<'_> {
    /// (m, v).
    pub fn moments(&mut self) -> (&mut [f32], &mut [f32]) {
        let (m, v) = self.buffer.as_f32_mut().split_at_mut(padded_bytes(self.len) / 4);
        (&mut m[..self.len], &mut v[..self.len])
    }
}

impl DiskStage {
    pub fn new(tier: DiskTier) -> Result<DiskStage> {
        let bytes = tier.slot_bytes();
        let buffers = (0..STAGE_SLOTS)
            .map(|_| HostSlab::zeroed(bytes).map(Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        let units = tier.regions.len();
        let shared = Arc::new(Shared {
            tier,
            buffers,
            table: Mutex::new(Table {
                slots: vec![Slot::Free; STAGE_SLOTS],
                next: vec![None; units],
                last: None,
                failed: None,
                stats: DiskStats::default(),
            }),
            changed: Condvar::new(),
        });
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        for what in ["reads", "writes"] {
            let (tx, rx) = channel();
            let inner = shared.clone();
            let thread = std::thread::Builder::new()
                .name(format!("sluice-disk-{what}"))
                .spawn(move || serve(&inner, rx))
                .map_err(|e| Error::invalid(format!("cannot start the disk tier's thread: {e}")))?;
            queues.push(tx);
            threads.push(thread);
        }
        let (writes, reads) = (queues.pop(), queues.pop());
        let queues = reads.zip(writes);
        Ok(DiskStage { shared, queues: Mutex::new(queues), threads: Mutex::new(threads) })
    }

    pub fn tier(&self) -> &DiskTier {
        &self.shared.tier
    }

    /// Host bytes of the staging slots.
    pub fn staging_bytes(&self) -> usize {
        self.shared.buffers.len() * self.shared.tier.slot_bytes()
    }

    fn send(&self, io: Io) -> Result<()> {
        let queues =
            self.queues.lock().map_err(|_| Error::invalid("the disk tier's queue was poisoned"))?;
        let sent = queues.as_ref().map(|(reads, writes)| match io {
            Io::Read(..) => reads.send(io),
            Io::Write(..) => writes.send(io),
        });
        match sent {
            Some(Ok(())) => Ok(()),
            _ => Err(Error::invalid("the disk tier's thread has stopped")),
        }
    }

    /// Waits for `unit`'s moments in a slot (reading them if no read was ahead of it), then
    /// starts reading the unit expected next.
    pub fn acquire(&self, unit: usize) -> Result<Staged<'_>> {
        let shared = &*self.shared;
        let len = shared.tier.region(unit)?.len;
        let start = Instant::now();
        let mut t = shared.table()?;
        if let Some(prev) = t.last {
            t.next[prev] = Some(unit);
        }
        t.last = Some(unit);
        let slot = loop {
            if let Some(e) = &t.failed {
                return Err(Error::invalid(e.clone()));
            }
            match t
                .slots
                .iter()
                .position(|s| matches!(s, Slot::Reading(x) | Slot::Ready(x) if *x == unit))
            {
                Some(i) if t.slots[i] == Slot::Ready(unit) => break i,
                Some(_) => {}
                None => {
                    if let Some(i) = claim(&mut t.slots) {
                        t.slots[i] = Slot::Reading(unit);
                        drop(t);
                        self.send(Io::Read(unit, i))?;
                        t = shared.table()?;
                        continue;
                    }
                }
            }
            t = shared
                .changed
                .wait(t)
                .map_err(|_| Error::invalid("the disk tier's state was poisoned"))?;
        };
        t.slots[slot] = Slot::InUse(unit);
        t.stats.waited += start.elapsed();
        // Read ahead: the unit that followed this one last time, else the next disk unit.
        let next = t.next[unit].or_else(|| {
            let units = shared.tier.regions.len();
            (1..units).map(|d| (unit + d) % units).find(|&u| shared.tier.holds(u))
        });
        let mut ahead = None;
        if let Some(next) = next.filter(|&n| n != unit) {
            let queued = t
                .slots
                .iter()
                .any(|s| matches!(s, Slot::Reading(x) | Slot::Ready(x) if *x == next));
            if !queued && let Some(i) = t.slots.iter().position(|s| *s == Slot::Free) {
                t.slots[i] = Slot::Reading(next);
                ahead = Some((next, i));
            }
        }
        drop(t);
        if let Some((next, i)) = ahead {
            self.send(Io::Read(next, i))?;
        }
        Ok(Staged { unit, slot, len, buffer: shared.buffer(slot)? })
    }

    /// Queues the write-back of an updated unit; its slot frees once the write is done.
    pub fn release(&self, staged: Staged<'_>) -> Result<()> {
        let (unit, slot) = (staged.unit, staged.slot);
        drop(staged);
        self.shared.table()?.slots[slot] = Slot::Writing(unit);
        self.send(Io::Write(unit, slot))
    }

    /// Waits until every write-back is on disk and forgets every read ahead, so the file is
    /// the whole truth (before a save reads it or a restore rewrites it).
    pub fn flush(&self) -> Result<()> {
        let shared = &*self.shared;
        let mut t = shared.table()?;
        loop {
            if let Some(e) = &t.failed {
                return Err(Error::invalid(e.clone()));
            }
            if !t
                .slots
                .iter()
                .any(|s| matches!(s, Slot::Writing(_) | Slot::Reading(_) | Slot::InUse(_)))
            {
                break;
            }
            t = shared
                .changed
                .wait(t)
                .map_err(|_| Error::invalid("the disk tier's state was poisoned"))?;
        }
        t.slots.iter_mut().for_each(|s| *s = Slot::Free);
        Ok(())
    }

    /// Calls `with(m, v)` on `unit`'s moments as on disk (call [`DiskStage::flush`] first).
    pub fn read_unit<R>(
        &self,
        unit: usize,
        with: impl FnOnce(&[f32], &[f32]) -> Result<R>,
    ) -> Result<R> {
        let len = self.shared.tier.region(unit)?.len;
        let mut buf = HostSlab::zeroed(2 * padded_bytes(len))?;
        self.shared.tier.read(unit, &mut buf)?;
        let (m, v) = buf.as_f32().split_at(padded_bytes(len) / 4);
        with(&m[..len], &v[..len])
    }

    /// Writes `unit`'s moments as `fill(m, v)` sets them (call [`DiskStage::flush`] first).
    pub fn write_unit(
        &self,
        unit: usize,
        fill: impl FnOnce(&mut [f32], &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let len = self.shared.tier.region(unit)?.len;
        let mut buf = HostSlab::zeroed(2 * padded_bytes(len))?;
        {
            let (m, v) = buf.as_f32_mut().split_at_mut(padded_bytes(len) / 4);
            fill(&mut m[..len], &mut v[..len])?;
        }
        self.shared.tier.write(unit, &buf)
    }

    /// Traffic and waits since the last call.
    pub fn take_stats(&self) -> DiskStats {
        self.shared.table().map(|mut t| std::mem::take(&mut t.stats)).unwrap_or_default()
    }
}

impl Drop for DiskStage {
    fn drop(&mut self) {
        if let Ok(mut queues) = self.queues.lock() {
            queues.take();
        }
        let threads = self.threads.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default();
        for thread in threads {
            let _ = thread.join();
        }
    }
}

/// A free slot, or else one holding a clean read ahead nobody asked for yet (dropped: it can be
/// read again).
fn claim(slots: &mut [Slot]) -> Option<usize> {
    slots
        .iter()
        .position(|s| *s == Slot::Free)
        .or_else(|| slots.iter().position(|s| matches!(s, Slot::Ready(_))))
}

/// An I/O thread: serves its requests in order until the stage is dropped or a request fails.
/// A read waits for any write-back of its unit still under way (the other thread's), so it
/// sees the moments the last update wrote.
fn serve(shared: &Shared, rx: Receiver<Io>) {
    for io in rx {
        let (unit, slot, write) = match io {
            Io::Read(u, s) => (u, s, false),
            Io::Write(u, s) => (u, s, true),
        };
        if !write {
            let Ok(mut t) = shared.table() else { return };
            while t.failed.is_none() && t.slots.contains(&Slot::Writing(unit)) {
                let Ok(next) = shared.changed.wait(t) else { return };
                t = next;
            }
        }
        let start = Instant::now();
        let done = shared.buffer(slot).and_then(|mut buf| {
            if write { shared.tier.write(unit, &buf) } else { shared.tier.read(unit, &mut buf) }
        });
        let busy = start.elapsed();
        let Ok(mut t) = shared.table() else { return };
        let bytes = shared.tier.region(unit).map_or(0, |r| 2 * padded_bytes(r.len) as u64);
        match done {
            Ok(()) if write => {
                t.slots[slot] = Slot::Free;
                t.stats.write_bytes += bytes;
                t.stats.write_busy += busy;
            }
            Ok(()) => {
                t.slots[slot] = Slot::Ready(unit);
                t.stats.read_bytes += bytes;
                t.stats.read_busy += busy;
            }
            Err(e) => {
                let what = if write { "write" } else { "read" };
                t.failed =
                    Some(format!("the disk tier could not {what} unit {unit}'s moments: {e}"));
                shared.changed.notify_all();
                return;
            }
        }
        shared.changed.notify_all();
    }
}

const _: () = assert!(SLAB_ALIGN.is_multiple_of(BLOCK) && CHUNK.is_multiple_of(BLOCK));
