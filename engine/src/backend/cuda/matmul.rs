//! `nn.Linear` through cuBLASLt, and groups of GEMMs (a mixture of experts' experts) through
//! one cuBLAS call where it can take them; the CPU twin is `backend/cpu/matmul.rs`.
//!
//! Row-major `[r, c]` is column-major `[c, r]` with leading dimension `c`, so each row-major
//! product is written as its transpose:
//! - forward `out[T,N] = inp[T,K] · w[N,K]ᵀ`: `outᵀ = w · inpᵀ` → `gemm(T, N, m=N, n=T, k=K,
//!   A=w (ld K), B=inp (ld K), C=out (ld N))`;
//! - `dinp[T,K] = dout[T,N] · w[N,K]`: `dinpᵀ = wᵀ · doutᵀ` → `gemm(N, N, m=K, n=T, k=N,
//!   A=w (ld K), B=dout (ld N), C=dinp (ld K))`;
//! - `dw[N,K] += dout[T,N]ᵀ · inp[T,K]`: `dwᵀ += inpᵀ · dout` → `gemm(N, T, m=K, n=N, k=T,
//!   A=inp (ld K), B=dout (ld N), C=dw (ld K), beta=1)`.

use super::blas::{Blas, Gemm, GemmPtrs};
use super::profile::OpClass;
use super::{Cuda, View, ViewMut, check};
use crate::backend::{Addends, ElementwiseOps, FloatKind, Grads, MatmulOps, MatmulShape, Operands};
use crate::error::Result;

/// One column-major GEMM for [`Cuda::gemm`] and [`Cuda::gemm_group`]: (trans_a, trans_b),
/// (m, n, k), A, B and C with their leading dimensions, and whether C accumulates.
#[derive(Clone, Copy)]
pub(super) struct GemmCall<'a> {
    pub trans: (bool, bool),
    pub dims: (usize, usize, usize),
    pub a: (View<'a>, usize),
    pub b: (View<'a>, usize),
    pub c: (View<'a>, usize),
    pub accumulate: bool,
}

/// The column-major product `Blas` runs; C's precision is its buffer's.
fn gemm_of(
    (trans_a, trans_b): (bool, bool),
    (m, n, k): (usize, usize, usize),
    (lda, ldb, ldc): (usize, usize, usize),
    c: &View<'_>,
    accumulate: bool,
) -> Gemm {
    Gemm {
        trans_a,
        trans_b,
        m: m as u64,
        n: n as u64,
        k: k as u64,
        lda: lda as i64,
        ldb: ldb as i64,
        ldc: ldc as i64,
        c_f32: c.kind() == FloatKind::Accum,
        accumulate,
        bias: false,
    }
}

impl Cuda {
    /// `out = a · bᵀ`-style products on row-major views: see the module doc for the mapping.
    pub(super) fn gemm(&self, op: &str, call: &GemmCall<'_>) -> Result<()> {
        let &GemmCall { trans, dims: (m, n, k), a, b, c, accumulate } = call;
        check::kind(op, "the first GEMM operand", &a.0, FloatKind::Activation)?;
        check::kind(op, "the second GEMM operand", &b.0, FloatKind::Activation)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            // An empty sum: the product is zero.
            return if accumulate { Ok(()) } else { self.zero_view(&c.0) };
        }
        self.bind()?;
        let g = gemm_of(trans, (m, n, k), (a.1, b.1, c.1), &c.0, accumulate);
        self.blas.gemm(g, self.ptr(&a.0), self.ptr(&b.0), self.ptr(&c.0))
    }

    /// Every call of `calls`, as [`Cuda::gemm`] would run them one by one: one cuBLASLt GEMM per
    /// call, or, with [`Cuda::set_grouped_gemm`] on, one cuBLAS grouped GEMM when cuBLAS takes all
    /// of them (bf16 outputs, 16-byte alignment: [`Blas::groups`]). Calls with an empty output are skipped; an empty inner
    /// dimension goes to [`Cuda::gemm`], which writes the zero product.
    pub(super) fn gemm_group(&self, op: &str, calls: &[GemmCall<'_>]) -> Result<()> {
        for c in calls {
            check::kind(op, "the first GEMM operand", &c.a.0, FloatKind::Activation)?;
            check::kind(op, "the second GEMM operand", &c.b.0, FloatKind::Activation)?;
        }
        let calls: Vec<&GemmCall<'_>> =
            calls.iter().filter(|c| c.dims.0 != 0 && c.dims.1 != 0).collect();
        let problems: Vec<(Gemm, [u64; 3])> = calls
            .iter()
            .map(|c| {
                let g = gemm_of(c.trans, c.dims, (c.a.1, c.b.1, c.c.1), &c.c.0, c.accumulate);
                (g, [self.ptr(&c.a.0), self.ptr(&c.b.0), self.ptr(&c.c.0)])
            })
            .collect();
        let grouped = self.grouped_gemm.load(std::sync::atomic::Ordering::Relaxed);
        if grouped && problems.iter().all(|(g, p)| Blas::groups(g, *p)) {
            self.bind()?;
            return self.blas.grouped_gemm(&problems);
        }
        for call in calls {
            self.gemm(op, call)?;
        }
        Ok(())
    }

    pub(super) fn zero_view(&self, v: &View<'_>) -> Result<()> {
        if v.len == 0 {
            return Ok(());
        }
        self.bind()?;
        let bytes = v.len * v.buf.elem_bytes();
        // SAFETY: the view's `bytes` bytes lie inside its buffer, which the caller holds mutably.
        super::device::drv("zeroing a GEMM output", unsafe {
            cudarc::driver::result::memset_d8_async(self.ptr(v), 0, bytes, self.compute.cu_stream())
        })
    }
}

impl MatmulOps for Cuda {
    fn matmul_forward(
        &self,
        out: ViewMut<'_>,
        operands: Operands<View<'_>>,
        shape: &MatmulShape,
    ) -> Result<()> {
        let &MatmulShape { rows, k, n } = shape;
        let _t = self.timed("matmul_forward", OpClass::Gemm, 2.0 * (rows * k * n) as f64);
        const OP: &str = "matmul_forward";
        let Operands { inp, w } = operands;
        let &MatmulShape { rows, k, n } = shape;
        check::len(OP, "out", out.len, &[rows, n])?;
        check::len(OP, "inp", inp.len, &[rows, k])?;
        check::len(OP, "w", w.len, &[n, k])?;
        let o = out.as_view();
        self.gemm(
            OP,
            &GemmCall {
                trans: (true, false),
                dims: (n, rows, k),
                a: (w, k),
                b: (inp, k),
                c: (o, n),
                accumulate: false,
            },
        )
    }

    /// `out = inp · wᵀ + bias + residual` as one cuBLASLt GEMM: the residual as its C
    /// (beta 1, D = out), the bias in its epilogue. An addend the GEMM cannot take (an f32
    /// output or residual, a bias not on a 16-byte boundary or not bf16) is added by its own
    /// kernel after the product, as the unfused ops would.
    fn matmul_forward_add(
        &self,
        mut out: ViewMut<'_>,
        operands: Operands<View<'_>>,
        addends: Addends<View<'_>>,
        shape: &MatmulShape,
    ) -> Result<()> {
        let &MatmulShape { rows, k, n } = shape;
        // A GEMM: whatever its epilogue adds is a few bytes an output element.
        let _t = self.timed("matmul_forward", OpClass::Gemm, 2.0 * (rows * k * n) as f64);
        const OP: &str = "matmul_forward_add";
        let Operands { inp, w } = operands;
        let Addends { bias, residual } = addends;
        let &MatmulShape { rows, k, n } = shape;
        check::len(OP, "out", out.len, &[rows, n])?;
        check::len(OP, "inp", inp.len, &[rows, k])?;
        check::len(OP, "w", w.len, &[n, k])?;
        check::kind(OP, "inp", &inp, FloatKind::Activation)?;
        check::kind(OP, "w", &w, FloatKind::Activation)?;
        if let Some(bias) = &bias {
            check::len(OP, "bias", bias.len, &[n])?;
        }
        if let Some(residual) = &residual {
            check::len(OP, "residual", residual.len, &[rows, n])?;
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        // The epilogue takes bf16 addends into a bf16 output; an empty product (k = 0) none.
        let fusable = k > 0 && out.as_view().kind() == FloatKind::Activation;
        let epilogue_bias = bias.filter(|b| {
            fusable
                && b.kind() == FloatKind::Activation
                && self.ptr(b).is_multiple_of(Blas::BIAS_ALIGN)
        });
        let c_residual = residual.filter(|r| fusable && r.kind() == FloatKind::Activation);
        if epilogue_bias.is_none() && c_residual.is_none() {
            // Nothing for the epilogue: the plain product, then each addend in turn.
            self.matmul_forward(out.reborrow(), Operands { inp, w }, shape)?;
        } else {
            self.bind()?;
            let d = out.as_view();
            let g = Gemm {
                bias: epilogue_bias.is_some(),
                ..gemm_of((true, false), (n, rows, k), (k, k, n), &d, c_residual.is_some())
            };
            let ptrs = GemmPtrs {
                a: self.ptr(&w),
                b: self.ptr(&inp),
                c: c_residual.as_ref().map_or(self.ptr(&d), |r| self.ptr(r)),
                d: self.ptr(&d),
                bias: epilogue_bias.as_ref().map_or(0, |b| self.ptr(b)),
            };
            self.blas.gemm_into(g, ptrs)?;
        }
        if let Some(bias) = bias.filter(|_| epilogue_bias.is_none()) {
            self.bias_forward(out.reborrow(), bias, rows, n)?;
        }
        if let Some(residual) = residual.filter(|_| c_residual.is_none()) {
            self.add_assign(out.reborrow(), residual)?;
        }
        Ok(())
    }

    fn matmul_backward(
        &self,
        grads: Grads<ViewMut<'_>>,
        dout: View<'_>,
        operands: Operands<View<'_>>,
        shape: &MatmulShape,
    ) -> Result<()> {
        let &MatmulShape { rows, k, n } = shape;
        let _t = self.timed("matmul_backward", OpClass::Gemm, 4.0 * (rows * k * n) as f64);
        const OP: &str = "matmul_backward";
        let Operands { inp, w } = operands;
        let &MatmulShape { rows, k, n } = shape;
        check::len(OP, "dinp", grads.dinp.len, &[rows, k])?;
        check::len(OP, "dw", grads.dw.len, &[n, k])?;
        check::len(OP, "dout", dout.len, &[rows, n])?;
        check::len(OP, "inp", inp.len, &[rows, k])?;
        check::len(OP, "w", w.len, &[n, k])?;
        let (di, dwv) = (grads.dinp.as_view(), grads.dw.as_view());
        self.gemm(
            OP,
            &GemmCall {
                trans: (false, false),
                dims: (k, rows, n),
                a: (w, k),
                b: (dout, n),
                c: (di, k),
                accumulate: false,
            },
        )?;
        self.gemm(
            OP,
            &GemmCall {
                trans: (false, true),
                dims: (k, n, rows),
                a: (inp, k),
                b: (dout, n),
                c: (dwv, k),
                accumulate: true,
            },
        )
    }
}
