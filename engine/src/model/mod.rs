//! The model: how parameters are laid out by unit ([`layout`]), their host-side slabs
//! ([`params`]), and the decoder's forward and backward on any backend ([`decoder`]).

pub mod decoder;
pub mod layout;
pub mod params;

pub use decoder::{Decoder, DeviceBatch, HeadScratch, HeadWeights, Keys, LayerAt, LayerScratch};
pub use layout::{ModelLayout, TensorSlot, UnitKind, UnitLayout};
pub use params::HostParams;
