//! The element type of the host store's streaming copy, which a backend streams as its
//! weights; here, below the backends, so the store does not depend on them.

/// Element type of weights on a device, and so of the host store's streaming copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
}

impl WeightDtype {
    pub fn bytes(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }
}
