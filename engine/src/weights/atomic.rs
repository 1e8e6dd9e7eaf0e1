//! Crash-safe file writing: a reader sees either the old file or the complete new one, never a
//! prefix. The new content goes to `NAME.tmp`, is fsynced, and is renamed over `NAME`; the
//! folder is fsynced afterwards so the rename itself survives a power cut.

use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Large enough that writing multi-gigabyte shards is not dominated by syscalls.
const WRITE_BUFFER_BYTES: usize = 8 << 20;

/// Writes `path` atomically with the bytes `write` produces. On failure the temporary file is
/// removed and `path` is left as it was.
pub fn write_file_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> Result<()> {
    let tmp = tmp_path(path);
    let attempt = || -> io::Result<()> {
        let mut out = BufWriter::with_capacity(WRITE_BUFFER_BYTES, File::create(&tmp)?);
        write(&mut out)?;
        out.flush()?;
        let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
        file.sync_all()?;
        fs::rename(&tmp, path)
    };
    attempt().map_err(|e| {
        // Best effort: the write already failed, and a stray `.tmp` is harmless to readers.
        let _ = fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// Flushes a folder's entries (creations, renames, removals) to disk.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))
    }
    // Other systems cannot open a folder as a file; their rename is as durable as it gets.
    #[cfg(not(unix))]
    {
        let _ = dir;
        Ok(())
    }
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_content_and_leaves_no_tmp() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let path = dir.path().join("a.bin");
        write_file_atomically(&path, |w| w.write_all(b"old"))?;
        write_file_atomically(&path, |w| w.write_all(b"new"))?;
        assert_eq!(fs::read(&path).map_err(|e| Error::io(&path, e))?, b"new");
        assert!(!tmp_path(&path).exists());
        Ok(())
    }

    #[test]
    fn failed_write_keeps_old_file_and_removes_tmp() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| Error::io("tempdir", e))?;
        let path = dir.path().join("a.bin");
        write_file_atomically(&path, |w| w.write_all(b"old"))?;
        let err = write_file_atomically(&path, |w| {
            w.write_all(b"partial")?;
            Err(io::Error::other("disk on fire"))
        });
        let Err(Error::Io { path: err_path, source }) = err else {
            panic!("expected an I/O error, got {err:?}");
        };
        assert_eq!(err_path, path);
        assert!(source.to_string().contains("disk on fire"));
        assert_eq!(fs::read(&path).map_err(|e| Error::io(&path, e))?, b"old");
        assert!(!tmp_path(&path).exists());
        Ok(())
    }
}
