//! Every kernel's parameter list, declared once: a struct per signature whose fields are the
//! parameters in order, built by name at each launch, so a missing, extra or mistyped argument
//! fails to compile. The kernels' CUDA C signatures are checked against these declarations
//! without a GPU (the tests below parse each entry point's `extern "C" __global__` signature from
//! its source): same count, order, names and kinds (pointer, `int`, `long long`, `float`).
//!
//! A declaration names the entry points it serves when several share one signature (the
//! instantiations of a templated kernel per head size, `_capped`, the Hopper twins):
//! `name ["prefix_*", ...] (params)`; such a kernel is launched with [`super::Cuda::launch_as`]
//! and the entry point's name, which must match one of the patterns.

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{LaunchArgs, PushKernelArg};

/// What a kernel parameter is, as the launch passes it. Read by the signature check only: a
/// launch passes each field by its Rust type.
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A device address (any `T*` in the CUDA C signature).
    Ptr,
    /// `int`.
    I32,
    /// `long long`.
    I64,
    /// `float`.
    F32,
}

/// One kernel signature: its entry points and its parameters.
pub(super) trait Kernel {
    /// The entry points this signature serves: a name, or a prefix ending in `*`.
    const NAMES: &'static [&'static str];
    /// The parameters in order, with their C names (read by the signature check).
    #[cfg_attr(not(test), allow(dead_code))]
    const PARAMS: &'static [(&'static str, Kind)];
    /// Pushes the arguments, in the declared order, onto a launch.
    fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>);
}

/// Whether `name` is one of the entry points `names` describes.
pub(super) fn serves(names: &[&str], name: &str) -> bool {
    names.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => *p == name,
    })
}

macro_rules! field_type {
    (ptr) => {
        CUdeviceptr
    };
    (i32) => {
        i32
    };
    (i64) => {
        i64
    };
    (f32) => {
        f32
    };
}

macro_rules! kind {
    (ptr) => {
        Kind::Ptr
    };
    (i32) => {
        Kind::I32
    };
    (i64) => {
        Kind::I64
    };
    (f32) => {
        Kind::F32
    };
}

macro_rules! kernels {
    ($($name:ident $([$($pattern:literal),+ $(,)?])? ($($param:ident: $kind:ident),* $(,)?);)*) => {
        $(
            #[allow(non_camel_case_types, non_snake_case)]
            #[derive(Debug, Clone, Copy)]
            pub(super) struct $name {
                $(pub $param: field_type!($kind),)*
            }

            impl Kernel for $name {
                const NAMES: &'static [&'static str] = kernels!(@names $name $([$($pattern),+])?);
                const PARAMS: &'static [(&'static str, Kind)] =
                    &[$((stringify!($param), kind!($kind))),*];
                fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
                    $(launch.arg(&self.$param);)*
                }
            }
        )*

        /// Every declaration's entry points and parameters, for the signature check.
        #[cfg(test)]
        pub(super) const DECLARED: &[(&[&str], &[(&str, Kind)])] =
            &[$((<$name as Kernel>::NAMES, <$name as Kernel>::PARAMS)),*];
    };
    (@names $name:ident) => { &[stringify!($name)] };
    (@names $name:ident [$($pattern:literal),+]) => { &[$($pattern),+] };
}

kernels! {
    // kernels/elementwise.cu
    add(out: ptr, out_f32: i32, a: ptr, a_f32: i32, b: ptr, b_f32: i32, n: i64);
    add_assign(dst: ptr, dst_f32: i32, src: ptr, src_f32: i32, n: i64);
    convert(dst: ptr, dst_f32: i32, src: ptr, src_f32: i32, n: i64);
    sum_partials(partials: ptr, src: ptr, src_f32: i32, n: i64, chunk: i64, squares: i32);
    bias_forward(out: ptr, out_f32: i32, bias: ptr, bias_f32: i32, rows: i64, n: i64);
    colsum_partials(partials: ptr, src: ptr, src_f32: i32, rows: i64, n: i64, rows_per: i64);
    colsum_finish(dst: ptr, dst_f32: i32, partials: ptr, chunks: i64, n: i64);
    glu_forward(out: ptr, out_f32: i32, gu: ptr, gu_f32: i32, rows: i64, inter: i64, act: i32);
    glu_backward(
        dgu: ptr, dgu_f32: i32, dout: ptr, dout_f32: i32, gu: ptr, gu_f32: i32, rows: i64,
        inter: i64, act: i32,
    );
    glu_forward_vec(out: ptr, gu: ptr, rows: i64, vecs: i32, act: i32);
    glu_backward_vec(dgu: ptr, dout: ptr, gu: ptr, rows: i64, vecs: i32, act: i32);
    rope(
        qkv: ptr, qkv_f32: i32, pos: ptr, inv_freq: ptr, freq_f32: i32, tokens: i64, width: i64,
        heads: i32, hd: i32, half: i32, scale: f32, sign: f32,
    );
    rope_vec(
        qkv: ptr, pos: ptr, inv_freq: ptr, freq_f32: i32, width: i64, heads: i32, hd: i32,
        half: i32, scale: f32, sign: f32,
    );
    embedding_forward(
        out: ptr, out_f32: i32, ids: ptr, table: ptr, table_f32: i32, tokens: i64, hidden: i64,
        scale: f32,
    );
    embedding_backward(
        dtable: ptr, dtable_f32: i32, dout: ptr, dout_f32: i32, order: ptr, starts: ptr, rows: ptr,
        hidden: i64, scale: f32,
    );
    // kernels/norm.cu
    rmsnorm_forward(
        out: ptr, out_f32: i32, rstd: ptr, inp: ptr, inp_f32: i32, w: ptr, w_f32: i32, stride: i64,
        heads: i32, nq: i32, dim: i32, eps: f32, copy_tail: i32,
    );
    rmsnorm_backward(
        dinp: ptr, dinp_f32: i32, partials: ptr, wlen: i32, dout: ptr, dout_f32: i32, inp: ptr,
        inp_f32: i32, w: ptr, w_f32: i32, rstd: ptr, tokens: i64, rows_per: i64, stride: i64,
        heads: i32, nq: i32, dim: i32, copy_tail: i32,
    );
    rmsnorm_forward_vec(out: ptr, rstd: ptr, inp: ptr, w: ptr, vecs: i32, eps: f32);
    rmsnorm_backward_vec(
        dinp: ptr, residual: ptr, partials: ptr, dout: ptr, inp: ptr, w: ptr, rstd: ptr,
        tokens: i64, rows_per: i64, vecs: i32,
    );
    // kernels/attention.cu
    attention_backward_dot(dsum: ptr, dout: ptr, out: ptr, rows: i64, hd: i32);
    attention_forward ["attention_forward_*"](
        out: ptr, lse: ptr, qkv: ptr, cu: ptr, docs: i32, T: i32, nq: i32, nkv: i32, hd: i32,
        window: i32, scale: f32, cap: f32,
    );
    attention_backward ["attention_backward_dq_*", "attention_backward_dkv_*"](
        dqkv: ptr, dout: ptr, qkv: ptr, lse: ptr, dsum: ptr, cu: ptr, docs: i32, T: i32, nq: i32,
        nkv: i32, hd: i32, window: i32, scale: f32, cap: f32,
    );
    flash_forward ["flash_forward_*", "hopper_forward_*"](
        out: ptr, lse: ptr, qkv: ptr, cu: ptr, docs: i32, T: i32, nq: i32, nkv: i32, window: i32,
        scale: f32,
    );
    flash_backward [
        "flash_backward_dq_*",
        "flash_backward_dkv_*",
        "flash_backward_dk_*",
        "flash_backward_dv_*",
        "hopper_backward_dq_*",
        "hopper_backward_dkv_*",
    ] (
        dqkv: ptr, dout: ptr, qkv: ptr, lse: ptr, dsum: ptr, cu: ptr, docs: i32, T: i32, nq: i32,
        nkv: i32, window: i32, scale: f32,
    );
    flash_backward_fused ["flash_backward_fused_*"](
        dqkv: ptr, acc: ptr, sync: ptr, dout: ptr, qkv: ptr, lse: ptr, dsum: ptr, cu: ptr,
        docs: i32, T: i32, nq: i32, nkv: i32, window: i32, scale: f32,
    );
    attention_sinks_forward(
        out: ptr, lse: ptr, sinks: ptr, sinks_f32: i32, rows: i64, nq: i32, hd: i32,
    );
    attention_sinks_backward(
        partials: ptr, dout: ptr, out: ptr, lse: ptr, sinks: ptr, sinks_f32: i32, tokens: i64,
        rows_per: i64, nq: i32, hd: i32,
    );
    // kernels/loss.cu
    cross_entropy_rows(losses: ptr, lse: ptr, logits: ptr, targets: ptr, vocab: i64, cap: f32);
    cross_entropy_grad_rows(
        grad: ptr, logits: ptr, lse: ptr, targets: ptr, scale: f32, vocab: i64, cap: f32,
    );
    cross_entropy_loss_grad_rows(
        losses: ptr, lse: ptr, grad: ptr, logits: ptr, targets: ptr, scale: f32, vocab: i64,
        cap: f32,
    );
    // kernels/decode.cu
    attention_decode ["attention_decode_*"](
        out: ptr, q: ptr, kc: ptr, vc: ptr, sinks: ptr, sinks_f32: i32, past: i32, nq: i32,
        nkv: i32, hd: i32, window: i32, scale: f32, cap: f32,
    );
    // kernels/moe.cu
    moe_route(
        weights: ptr, probs: ptr, experts: ptr, logits: ptr, z_f32: i32, tokens: i64, E: i32,
        k: i32, router: i32,
    );
    moe_route_backward(
        dlogits: ptr, dz_f32: i32, dweights: ptr, dw_f32: i32, weights: ptr, probs: ptr,
        experts: ptr, counts: ptr, aux_scale: f32, tokens: i64, E: i32, k: i32, router: i32,
    );
    moe_count(counts: ptr, experts: ptr, pairs: i64, E: i32, chunk: i64);
    moe_count_stats(stats: ptr, stats_f32: i32, counts: ptr, chunks: i32, E: i32);
    moe_sort_bounds(offsets: ptr, base: ptr, counts: ptr, chunks: i32, E: i32);
    moe_sort_scatter(
        order: ptr, rows: ptr, experts: ptr, base: ptr, pairs: i64, E: i32, chunk: i64,
    );
    moe_gather(
        xs: ptr, xs_f32: i32, x: ptr, x_f32: i32, order: ptr, pairs: i64, hidden: i64, k: i32,
    );
    moe_gather_backward(
        dx: ptr, dx_f32: i32, dxs: ptr, dxs_f32: i32, rows: ptr, tokens: i64, pairs: i64,
        hidden: i64, k: i32,
    );
    moe_combine(
        out: ptr, out_f32: i32, y: ptr, y_f32: i32, weights: ptr, rows: ptr, tokens: i64,
        pairs: i64, hidden: i64, k: i32,
    );
    moe_combine_backward_dy(
        dy: ptr, dy_f32: i32, dout: ptr, dout_f32: i32, weights: ptr, rows: ptr, pairs: i64,
        hidden: i64, k: i32,
    );
    moe_combine_backward_dw(
        dweights: ptr, dout: ptr, dout_f32: i32, y: ptr, y_f32: i32, rows: ptr, pairs: i64,
        hidden: i64, k: i32,
    );
    grouped_bias_forward(
        out: ptr, out_f32: i32, bias: ptr, bias_f32: i32, offsets: ptr, E: i32, rows: i64, n: i64,
    );
    sigmoid_gate_forward(
        out: ptr, out_f32: i32, y: ptr, y_f32: i32, logits: ptr, rows: i64, n: i64,
    );
    sigmoid_gate_backward(
        dy: ptr, dy_f32: i32, dlogits: ptr, dlogits_f32: i32, dout: ptr, dout_f32: i32, y: ptr,
        y_f32: i32, logits: ptr, rows: i64, n: i64,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::compile::SOURCES;

    /// A C parameter's kind: any pointer, `int`, `long long` or `float`; `None` for anything else.
    fn c_kind(ty: &str) -> Option<Kind> {
        if ty.contains('*') {
            return Some(Kind::Ptr);
        }
        let bare: Vec<&str> = ty.split_whitespace().filter(|w| *w != "const").collect();
        match bare.as_slice() {
            ["int"] => Some(Kind::I32),
            ["long", "long"] => Some(Kind::I64),
            ["float"] => Some(Kind::F32),
            _ => None,
        }
    }

    /// Every `extern "C" __global__` definition of a source: its name as written (a macro's
    /// `prefix_##ARG` or one of its parameters) and its parameters. Line continuations of macros
    /// are joined first.
    fn definitions(source: &str) -> Vec<(String, Vec<(String, Kind)>)> {
        let text = source.replace("\\\n", " ");
        let mut out = Vec::new();
        for (at, _) in text.match_indices("extern \"C\" __global__ void") {
            let mut rest = text[at + "extern \"C\" __global__ void".len()..].trim_start();
            if let Some(after) = rest.strip_prefix("__launch_bounds__") {
                let close = after.find(')').expect("launch bounds close");
                rest = after[close + 1..].trim_start();
            }
            let open = rest.find('(').expect("parameter list");
            let name = rest[..open].trim().to_string();
            let close = rest.find(')').expect("parameter list's end");
            let params = rest[open + 1..close]
                .split(',')
                .map(|p| {
                    let p = p.trim();
                    let split =
                        p.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).expect("type");
                    let (ty, name) = (&p[..=split], &p[split + 1..]);
                    let kind =
                        c_kind(ty).unwrap_or_else(|| panic!("unknown parameter type in {p}"));
                    (name.to_string(), kind)
                })
                .collect();
            out.push((name, params));
        }
        out
    }

    /// The parameters of entry point `entry` in `source`: its own definition, else the macro
    /// definition `prefix_##X` with the longest prefix it starts with, else a definition named by
    /// a macro parameter that a call of that macro with `entry` as its first argument fills.
    fn signature(source: &str, entry: &str) -> Option<Vec<(String, Kind)>> {
        let defs = definitions(source);
        if let Some((_, p)) = defs.iter().find(|(n, _)| n == entry) {
            return Some(p.clone());
        }
        let pasted = defs
            .iter()
            .filter_map(|(n, p)| Some((n.split_once("##")?.0, p)))
            .filter(|(prefix, _)| entry.starts_with(prefix))
            .max_by_key(|(prefix, _)| prefix.len());
        if let Some((_, p)) = pasted {
            return Some(p.clone());
        }
        let text = source.replace("\\\n", " ");
        for (at, _) in text.match_indices("#define ") {
            let head = &text[at + "#define ".len()..];
            let open = head.find('(')?;
            let (mac, args) = (&head[..open], &head[open + 1..]);
            let first = args.split([',', ')']).next()?.trim();
            let called = text.contains(&format!("{mac}({entry},"));
            if let Some((_, p)) = defs.iter().find(|(n, _)| n == first).filter(|_| called) {
                return Some(p.clone());
            }
        }
        None
    }

    /// Every entry point of every kernel source has one declaration whose parameters are the
    /// signature's: the same count, order, names and kinds.
    #[test]
    fn every_entry_point_matches_its_declaration() {
        for k in SOURCES {
            for &entry in k.entry_points {
                let decls: Vec<_> = DECLARED.iter().filter(|(n, _)| serves(n, entry)).collect();
                assert_eq!(decls.len(), 1, "{entry}: declared {} times", decls.len());
                let declared: Vec<(String, Kind)> =
                    decls[0].1.iter().map(|&(n, kind)| (n.to_string(), kind)).collect();
                let source = signature(k.source, entry)
                    .unwrap_or_else(|| panic!("{}: no signature for {entry}", k.name));
                assert_eq!(
                    declared, source,
                    "{}: {entry}'s declaration is not its signature",
                    k.name
                );
            }
        }
    }

    /// Every declaration serves some entry point, so none outlives its kernel.
    #[test]
    fn every_declaration_serves_an_entry_point() {
        for (names, _) in DECLARED {
            for name in *names {
                let used = SOURCES.iter().flat_map(|k| k.entry_points).any(|e| serves(&[name], e));
                assert!(used, "{name} is declared but no source defines it");
            }
        }
    }

    #[test]
    fn patterns_match_prefixes_and_names_match_whole() {
        assert!(serves(&["flash_forward_*"], "flash_forward_128"));
        assert!(!serves(&["flash_forward_*"], "hopper_forward_128"));
        assert!(serves(&["add"], "add"));
        assert!(!serves(&["add"], "add_assign"));
    }
}
