//! The model: how parameters are laid out by unit ([`layout`]), their host-side slabs
//! ([`params`]), and the decoder's forward and backward on any backend ([`decoder`], its
//! mixture-of-experts MLP in [`moe`]).

pub mod decoder;
pub mod layout;
pub mod moe;
pub mod params;

pub use decoder::{
    Decoder, DeviceBatch, HeadGrads, HeadScratch, HeadWeights, KeptAttention, Keys, LayerAt,
    LayerGrads, LayerScratch, SeqRows,
};
pub use layout::{
    LayerRanges, MlpRanges, ModelLayout, MoeRanges, TensorSlot, UnitKind, UnitLayout,
};
pub use moe::RouterStats;
pub use params::HostParams;
