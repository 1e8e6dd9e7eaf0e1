//! A safetensors file read as its bf16 twin: every F32 tensor rounded to BF16 (nearest, ties to
//! even, as [`super::write_safetensors`] and PyTorch round), other dtypes copied, the header
//! rewritten with the new offsets. The converted file is produced as it is read, a chunk at a
//! time, and its length is known up front, so a download can announce it and stream it.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

use half::bf16;
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Source bytes converted per read (a multiple of 4).
const CHUNK: usize = 1 << 20;
/// A header larger than this is refused as garbled (transformers' own are a few hundred KB).
const MAX_HEADER: u64 = 100 << 20;

/// A tensor's bytes in the source file, in data order.
struct Segment {
    start: u64,
    len: u64,
    to_bf16: bool,
}

/// A [`Read`] over the bf16 version of one safetensors file.
pub struct Bf16Safetensors {
    file: File,
    header: Vec<u8>,
    header_pos: usize,
    segments: Vec<Segment>,
    segment: usize,
    /// Source bytes of the current segment already converted.
    done: u64,
    buf: Vec<u8>,
    buf_pos: usize,
    len: u64,
}

impl Bf16Safetensors {
    /// Opens `path` and plans the converted file; a damaged header is an `Err` naming the file.
    pub fn open(path: &Path) -> Result<Bf16Safetensors> {
        let err = |m: String| Error::weights(path, m);
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(|_| err("too short for a safetensors header".into()))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || 8 + n > file_len {
            return Err(err(format!("header length {n} does not fit the {file_len}-byte file")));
        }
        let mut raw = vec![0u8; n as usize];
        file.read_exact(&mut raw).map_err(|e| Error::io(path, e))?;
        let header: Map<String, Value> = serde_json::from_slice(&raw)
            .map_err(|e| err(format!("the header is not a JSON object: {e}")))?;
        let data_start = 8 + n;
        let data_len = file_len - data_start;

        let mut tensors = Vec::new();
        let mut metadata = None;
        for (name, entry) in header {
            if name == "__metadata__" {
                metadata = Some(entry);
                continue;
            }
            let dtype = entry["dtype"].as_str().unwrap_or_default().to_string();
            let offsets = entry["data_offsets"].as_array().map(|o| (o.first(), o.get(1)));
            let (Some((Some(s), Some(e))), Some(_)) = (offsets, entry["shape"].as_array()) else {
                return Err(err(format!("tensor {name}: no dtype, shape and data_offsets")));
            };
            let (s, e) = (s.as_u64().unwrap_or(u64::MAX), e.as_u64().unwrap_or(u64::MAX));
            let to_bf16 = dtype == "F32";
            if s > e || e > data_len || (to_bf16 && (e - s) % 4 != 0) {
                return Err(err(format!(
                    "tensor {name}: offsets [{s}, {e}] do not fit {data_len} bytes of {dtype} data"
                )));
            }
            tensors.push((s, e, name, entry, to_bf16));
        }
        tensors.sort_by_key(|t| (t.0, t.1));

        let mut out = Map::new();
        if let Some(m) = metadata {
            out.insert("__metadata__".into(), m);
        }
        let (mut offset, mut segments) = (0u64, Vec::new());
        for (s, e, name, mut entry, to_bf16) in tensors {
            let len = if to_bf16 { (e - s) / 2 } else { e - s };
            if to_bf16 {
                entry["dtype"] = "BF16".into();
            }
            entry["data_offsets"] = serde_json::json!([offset, offset + len]);
            offset += len;
            out.insert(name, entry);
            segments.push(Segment { start: data_start + s, len: e - s, to_bf16 });
        }
        let mut json = serde_json::to_vec(&Value::Object(out))
            .map_err(|e| err(format!("cannot write the header: {e}")))?;
        // Padded with spaces so the data starts 8-aligned, as the safetensors serializer does.
        json.resize(json.len().next_multiple_of(8), b' ');
        let mut header = (json.len() as u64).to_le_bytes().to_vec();
        header.extend_from_slice(&json);
        let len = header.len() as u64 + offset;
        Ok(Bf16Safetensors {
            file,
            header,
            header_pos: 0,
            segments,
            segment: 0,
            done: 0,
            buf: Vec::new(),
            buf_pos: 0,
            len,
        })
    }

    /// The converted file's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Converts the next chunk of the current segment into `buf`; false at the end.
    fn refill(&mut self) -> io::Result<bool> {
        while let Some(seg) = self.segments.get(self.segment) {
            if self.done == seg.len {
                self.segment += 1;
                self.done = 0;
                continue;
            }
            let take = (seg.len - self.done).min(CHUNK as u64) as usize;
            let mut src = vec![0u8; take];
            self.file.seek(SeekFrom::Start(seg.start + self.done))?;
            self.file.read_exact(&mut src)?;
            self.done += take as u64;
            self.buf.clear();
            self.buf_pos = 0;
            if seg.to_bf16 {
                for x in src.chunks_exact(4) {
                    let v = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                    self.buf.extend_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
            } else {
                self.buf = src;
            }
            return Ok(true);
        }
        Ok(false)
    }
}

impl Read for Bf16Safetensors {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.header_pos < self.header.len() {
            let n = out.len().min(self.header.len() - self.header_pos);
            out[..n].copy_from_slice(&self.header[self.header_pos..self.header_pos + n]);
            self.header_pos += n;
            return Ok(n);
        }
        if self.buf_pos == self.buf.len() && !self.refill()? {
            return Ok(0);
        }
        let n = out.len().min(self.buf.len() - self.buf_pos);
        out[..n].copy_from_slice(&self.buf[self.buf_pos..self.buf_pos + n]);
        self.buf_pos += n;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::weights::{Dtype, SaveDtype, TensorRef, TensorSource, write_safetensors};

    #[test]
    fn an_f32_file_reads_as_the_bf16_file_the_writer_would_write() {
        let dir = tempfile::tempdir().unwrap();
        let a: Vec<f32> = (0..3000).map(|i| (i as f32 * 0.37).sin() * 1e-2 + 1.0 / 3.0).collect();
        let b: Vec<f32> = (0..6).map(|i| i as f32 - 2.5).collect();
        let tensors = [
            TensorRef { name: "a.weight", shape: vec![30, 100], data: a[..].into() },
            TensorRef { name: "b", shape: vec![6], data: b[..].into() },
        ];
        let f32_dir = dir.path().join("f32");
        let bf16_dir = dir.path().join("bf16");
        std::fs::create_dir_all(&f32_dir).unwrap();
        std::fs::create_dir_all(&bf16_dir).unwrap();
        write_safetensors(&f32_dir, &tensors, SaveDtype::F32, usize::MAX).unwrap();
        write_safetensors(&bf16_dir, &tensors, SaveDtype::Bf16, usize::MAX).unwrap();

        let mut stream = Bf16Safetensors::open(&f32_dir.join("model.safetensors")).unwrap();
        let want_len = stream.len();
        let mut bytes = Vec::new();
        stream.read_to_end(&mut bytes).unwrap();
        assert_eq!(bytes.len() as u64, want_len);
        let out = dir.path().join("converted.safetensors");
        std::fs::write(&out, &bytes).unwrap();
        let converted = TensorSource::open(&out).unwrap();
        let written = TensorSource::open(&bf16_dir).unwrap();
        for name in ["a.weight", "b"] {
            assert_eq!(converted.dtype(name).unwrap(), Dtype::BF16);
            assert_eq!(converted.read_f32(name).unwrap(), written.read_f32(name).unwrap());
        }
        // A bf16 file passes through unchanged in its data.
        let again = Bf16Safetensors::open(&bf16_dir.join("model.safetensors")).unwrap();
        assert_eq!(
            again.len(),
            std::fs::metadata(bf16_dir.join("model.safetensors")).unwrap().len()
        );
    }

    #[test]
    fn a_damaged_header_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.safetensors");
        std::fs::write(&path, 1000u64.to_le_bytes()).unwrap();
        assert!(Bf16Safetensors::open(&path).is_err());
        let header = br#"{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0u8; 8]);
        std::fs::write(&path, &bytes).unwrap();
        let err = Bf16Safetensors::open(&path).err().unwrap().to_string();
        assert!(err.contains("do not fit"), "{err}");
    }
}
