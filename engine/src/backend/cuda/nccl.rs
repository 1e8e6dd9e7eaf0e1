//! NCCL, the collective library of NVIDIA GPUs, for data parallelism: one [`Communicator`] per
//! rank, and an in-place f32 sum across ranks on the rank's compute stream.
//!
//! Loaded at run time like the other CUDA libraries, so the binary links nothing. The types and
//! constants are cudarc's NCCL bindings; the library itself is opened here because cudarc's
//! loader tries `libnccl.so` and CUDA-versioned names but not NCCL's soname, `libnccl.so.2`,
//! which is all the runtime package (and torch's `nvidia-nccl` wheel) installs. Search order:
//! `SLUICE_NCCL_LIB` (a path), `libnccl.so.2` and `libnccl.so` on the loader's path, then
//! `nvidia/nccl/lib/libnccl.so.2` under the usual Python site-packages folders.
//!
//! Communicators: [`Communicator::local`] makes one per GPU of this process
//! (`ncclCommInitAll`); [`Communicator::from_id`] joins a group spread over processes or hosts
//! through NCCL's own bootstrap: rank 0 makes a [`UniqueId`], every rank receives its 128 bytes
//! (through whatever the launcher offers: a rendezvous address, a shared file) and calls it
//! with its rank and the world size.
//!
//! Determinism: for a fixed world size, topology and NCCL version, NCCL picks the same
//! algorithm and ring order on every call of a given size, so two runs give the same bits, and
//! every rank receives the same bits. Nothing is promised across world sizes (another
//! association of the sum), NCCL versions or machines (another ring or tree).
//!
//! NVLink SHARP (multicast, "NVLS") is kept off: `NCCL_NVLS_ENABLE=0` is set before the first
//! communicator is made. It needs fabric-manager multicast support the lent machines do not
//! promise, and its reductions run in the switch, outside the fixed ring order above.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::nccl::sys::{self as nc, ncclComm_t, ncclUniqueId};

use super::{Cuda, Floats, ViewMut};
use crate::backend::{AllReduce, FloatKind};
use crate::error::{Error, Result};

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitAll = unsafe extern "C" fn(*mut ncclComm_t, c_int, *const c_int) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type CommDestroy = unsafe extern "C" fn(ncclComm_t) -> c_int;
type AllReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    ncclComm_t,
    nc::cudaStream_t,
) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The entry points Sluice uses, from a library that stays loaded for the whole process.
struct Nccl {
    path: String,
    version: c_int,
    get_unique_id: GetUniqueId,
    comm_init_all: CommInitAll,
    comm_init_rank: CommInitRank,
    comm_destroy: CommDestroy,
    all_reduce: AllReduceFn,
    error_string: GetErrorString,
}

fn nccl_err(message: impl std::fmt::Display) -> Error {
    Error::Backend { backend: "nccl".into(), message: message.to_string() }
}

/// Where to look for the library, in order.
fn candidates() -> Vec<String> {
    let mut c: Vec<String> = vec!["libnccl.so.2".into(), "libnccl.so".into()];
    let mut roots: Vec<PathBuf> =
        ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"].iter().map(PathBuf::from).collect();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            roots.push(PathBuf::from(v).join("lib"));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else { continue };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            for packages in ["site-packages", "dist-packages"] {
                let lib = py.join(packages).join("nvidia/nccl/lib/libnccl.so.2");
                if lib.is_file() {
                    c.push(lib.to_string_lossy().into_owned());
                }
            }
        }
    }
    c
}

fn open() -> std::result::Result<Nccl, String> {
    let (names, explicit) = match std::env::var("SLUICE_NCCL_LIB") {
        Ok(path) => (vec![path], true),
        Err(_) => (candidates(), false),
    };
    let mut tried = Vec::new();
    for name in &names {
        // SAFETY: loading NCCL runs its initialisers, which only set up its own state.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(lib) => lib,
            Err(e) => {
                tried.push(format!("{name} ({e})"));
                continue;
            }
        };
        // Never unloaded: communicators and the function pointers below outlive any scope.
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        let sym = |s: &str| -> std::result::Result<*const c_void, String> {
            // SAFETY: the symbol is only read as an address here; each is cast below to the
            // signature nccl.h declares for it.
            unsafe { lib.get::<*const c_void>(s.as_bytes()) }
                .map(|p| *p)
                .map_err(|e| format!("{name} has no {s}: {e}"))
        };
        // SAFETY: each transmute turns the address of a C function into the signature nccl.h
        // (NCCL 2.x) declares for it, in a library that is never unloaded.
        let nccl = unsafe {
            Nccl {
                path: name.clone(),
                version: 0,
                get_unique_id: std::mem::transmute::<*const c_void, GetUniqueId>(sym(
                    "ncclGetUniqueId",
                )?),
                comm_init_all: std::mem::transmute::<*const c_void, CommInitAll>(sym(
                    "ncclCommInitAll",
                )?),
                comm_init_rank: std::mem::transmute::<*const c_void, CommInitRank>(sym(
                    "ncclCommInitRank",
                )?),
                comm_destroy: std::mem::transmute::<*const c_void, CommDestroy>(sym(
                    "ncclCommDestroy",
                )?),
                all_reduce: std::mem::transmute::<*const c_void, AllReduceFn>(sym(
                    "ncclAllReduce",
                )?),
                error_string: std::mem::transmute::<*const c_void, GetErrorString>(sym(
                    "ncclGetErrorString",
                )?),
            }
        };
        // SAFETY: as above.
        let get_version =
            unsafe { std::mem::transmute::<*const c_void, GetVersion>(sym("ncclGetVersion")?) };
        let mut version = 0;
        // SAFETY: `version` is valid for writes.
        unsafe { get_version(&mut version) };
        return Ok(Nccl { version, ..nccl });
    }
    let hint = if explicit {
        "SLUICE_NCCL_LIB names a file that does not load"
    } else {
        "install NCCL 2 (the libnccl2 package, or pip's nvidia-nccl-cu12/cu13 wheel) or set \
         SLUICE_NCCL_LIB to the path of libnccl.so.2"
    };
    Err(format!("NCCL (libnccl.so.2) could not be loaded: {hint}; tried {}", tried.join(", ")))
}

fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| {
        let lib = open()?;
        // SAFETY: NCCL reads its settings from the environment when a communicator is made;
        // this runs once, before the first one, and Sluice itself reads no environment
        // variable concurrently with it (settings are read at start).
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
        Ok(lib)
    })
    .as_ref()
    .map_err(nccl_err)
}

/// The loaded library: its path and version (e.g. 22703 for 2.27.3).
pub fn library() -> Result<(String, i32)> {
    nccl().map(|n| (n.path.clone(), n.version))
}

fn check(n: &Nccl, what: &str, code: c_int) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe { CStr::from_ptr((n.error_string)(code)) }.to_string_lossy();
    Err(nccl_err(format!("{what}: {text} (NCCL error {code})")))
}

/// The 128 bytes that let the ranks of a group find each other (NCCL's bootstrap address).
#[derive(Clone, Copy)]
pub struct UniqueId(ncclUniqueId);

impl UniqueId {
    /// Made by rank 0 and handed to every other rank by the launcher.
    pub fn new() -> Result<UniqueId> {
        let n = nccl()?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is valid for writes of one ncclUniqueId.
        check(n, "ncclGetUniqueId", unsafe { (n.get_unique_id)(&mut id) })?;
        Ok(UniqueId(id))
    }

    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    pub fn from_bytes(bytes: [u8; 128]) -> UniqueId {
        UniqueId(ncclUniqueId { internal: bytes.map(|b| b as c_char) })
    }
}

/// One rank's NCCL communicator, bound to one GPU.
pub struct Communicator {
    comm: ncclComm_t,
    rank: usize,
    world: usize,
    ordinal: usize,
}

// SAFETY: an NCCL communicator may be used from any thread as long as one thread at a time does;
// `Communicator` is only used through `&self` by the one rank that owns it, and is not `Sync`.
unsafe impl Send for Communicator {}

impl Communicator {
    /// One communicator per GPU of this process, rank i on `gpus[i]` (`ncclCommInitAll`).
    pub fn local(gpus: &[&Cuda]) -> Result<Vec<Communicator>> {
        let n = nccl()?;
        if gpus.is_empty() {
            return Err(nccl_err("a communicator needs at least one GPU"));
        }
        let ordinals: Vec<c_int> = gpus.iter().map(|g| g.ctx.ordinal() as c_int).collect();
        let mut comms = vec![std::ptr::null_mut(); gpus.len()];
        for g in gpus {
            g.bind()?;
        }
        // SAFETY: `comms` has room for one handle per device in `ordinals`, which are distinct
        // GPUs this process has open (NCCL uses their primary contexts, as cudarc does).
        check(n, "ncclCommInitAll", unsafe {
            (n.comm_init_all)(comms.as_mut_ptr(), ordinals.len() as c_int, ordinals.as_ptr())
        })?;
        let world = gpus.len();
        Ok(comms
            .into_iter()
            .zip(&ordinals)
            .enumerate()
            .map(|(rank, (comm, &o))| Communicator { comm, rank, world, ordinal: o as usize })
            .collect())
    }

    /// Joins a group of `world` ranks spread over processes or hosts as rank `rank`, on `gpu`.
    /// Every rank calls this with the same id; it returns once all of them have.
    pub fn from_id(gpu: &Cuda, id: &UniqueId, rank: usize, world: usize) -> Result<Communicator> {
        let n = nccl()?;
        if rank >= world {
            return Err(nccl_err(format!("rank {rank} of a group of {world}")));
        }
        gpu.bind()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is valid for writes; the id is passed by value as nccl.h declares.
        check(n, "ncclCommInitRank", unsafe {
            (n.comm_init_rank)(&mut comm, world as c_int, id.0, rank as c_int)
        })?;
        Ok(Communicator { comm, rank, world, ordinal: gpu.ctx.ordinal() })
    }
}

impl AllReduce<Cuda> for Communicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, b: &Cuda, x: ViewMut<'_>) -> Result<()> {
        let n = nccl()?;
        if b.ctx.ordinal() != self.ordinal {
            return Err(nccl_err(format!(
                "rank {} lives on GPU {}, asked to reduce on GPU {}",
                self.rank,
                self.ordinal,
                b.ctx.ordinal()
            )));
        }
        if x.buf.kind() != FloatKind::Accum || !matches!(x.buf, Floats::F32(_)) {
            return Err(nccl_err("all-reduce sums f32 accumulators only"));
        }
        if x.len == 0 {
            return Ok(());
        }
        b.bind()?;
        let ptr = b.ptr_mut(&x) as *mut c_void;
        let (f32_type, sum) = (nc::ncclDataType_t::ncclFloat32, nc::ncclRedOp_t::ncclSum);
        // SAFETY: `ptr` addresses `x.len` f32 values of a live device buffer of this GPU, which
        // the view borrows mutably until the call returns; the reduction is queued on the
        // compute stream after the work that produced the values, and everything that reads
        // them later is queued on that stream too (or waits for an event recorded on it).
        check(n, "ncclAllReduce", unsafe {
            (n.all_reduce)(
                ptr,
                ptr,
                x.len,
                f32_type as c_int,
                sum as c_int,
                self.comm,
                b.compute.cu_stream() as nc::cudaStream_t,
            )
        })
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Ok(n) = nccl() {
            // SAFETY: the communicator is destroyed once; NCCL waits for its queued work.
            let _ = unsafe { (n.comm_destroy)(self.comm) };
        }
    }
}
