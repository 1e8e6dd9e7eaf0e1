//! Where every parameter lives: the model is cut into units (the embedding, each decoder layer,
//! the head), and each unit's parameters are one flat f32 slab. Tensors that the decoder fuses
//! sit next to each other in Hugging Face's order, so the fused matrix is simply a range of the
//! slab: `q_proj | k_proj | v_proj` is the `[Dqkv, H]` qkv weight, `gate_proj | up_proj` the
//! `[2I, H]` gate_up weight (row-major concatenation along the output dimension).
//!
//! Invariant: a slab is the unit of transfer. Streaming, checkpoints and the optimizer all move
//! whole units; only this file knows the offsets inside one.

use std::ops::Range;

use crate::spec::ModelSpec;

/// Offsets of groups inside a slab are rounded up to this many elements (256 bytes in f32), so
/// every group starts aligned for vector loads and DMA.
const ALIGN: usize = 64;

/// Which part of the model a unit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitKind {
    Embedding,
    Layer(usize),
    /// Final norm, and the LM head unless it is tied to the embedding.
    Head,
}

/// One Hugging Face tensor inside a unit slab.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSlot {
    /// The name transformers uses, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
    /// Whether AdamW applies weight decay: matrices yes, norms and biases no.
    pub decay: bool,
}

/// The tensors of one unit and the slab length that holds them.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitLayout {
    pub kind: UnitKind,
    pub tensors: Vec<TensorSlot>,
    pub len: usize,
}

/// Ranges of a decoder layer's (possibly fused) operands inside its slab; the same for every
/// layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRanges {
    pub ln1: Range<usize>,
    /// `[Dqkv, H]`: q_proj, k_proj, v_proj weights.
    pub qkv_w: Range<usize>,
    /// `[Dqkv]`: q, k, v biases.
    pub qkv_b: Option<Range<usize>>,
    /// `[2 hd]`: q_norm then k_norm weights.
    pub qk_norm: Option<Range<usize>>,
    /// `[H, nq hd]`.
    pub o_w: Range<usize>,
    pub o_b: Option<Range<usize>>,
    /// The MLP's input norm: `post_attention_layernorm`, or Gemma's `pre_feedforward_layernorm`.
    pub ln2: Range<usize>,
    /// Gemma's norms of the attention output and of the MLP output, before their residual adds
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`).
    pub post_attn_norm: Option<Range<usize>>,
    pub post_mlp_norm: Option<Range<usize>>,
    /// `[2I, H]`: gate_proj then up_proj weights.
    pub gate_up_w: Range<usize>,
    /// `[H, I]`.
    pub down_w: Range<usize>,
}

/// Ranges inside the head slab.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadRanges {
    pub norm: Range<usize>,
    /// `[V, H]`, or `None` when the head reuses the embedding table.
    pub lm_head: Option<Range<usize>>,
}

/// The layout of the whole model: unit 0 is the embedding, units `1..=layers` the decoder layers,
/// the last unit the head.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelLayout {
    pub units: Vec<UnitLayout>,
    pub layer: LayerRanges,
    pub head: HeadRanges,
}

struct SlabBuilder {
    prefix: String,
    tensors: Vec<TensorSlot>,
    len: usize,
}

impl SlabBuilder {
    fn new(prefix: &str) -> Self {
        SlabBuilder { prefix: prefix.to_string(), tensors: Vec::new(), len: 0 }
    }

    /// Starts a group on an aligned offset; tensors pushed until the next group are contiguous.
    fn group(&mut self) {
        self.len = self.len.div_ceil(ALIGN) * ALIGN;
    }

    fn push(&mut self, name: &str, shape: &[usize]) -> Range<usize> {
        let n: usize = shape.iter().product();
        let range = self.len..self.len + n;
        self.tensors.push(TensorSlot {
            name: format!("{}{name}", self.prefix),
            shape: shape.to_vec(),
            range: range.clone(),
            decay: shape.len() >= 2,
        });
        self.len += n;
        range
    }

    /// A group of tensors that must be contiguous; returns the range covering all of them.
    fn fused(&mut self, parts: &[(&str, Vec<usize>)]) -> Range<usize> {
        self.group();
        let start = self.len;
        for (name, shape) in parts {
            self.push(name, shape);
        }
        start..self.len
    }

    fn finish(mut self, kind: UnitKind) -> UnitLayout {
        self.group();
        UnitLayout { kind, tensors: self.tensors, len: self.len }
    }
}

impl ModelLayout {
    pub fn new(spec: &ModelSpec) -> ModelLayout {
        let (h, i, hd) = (spec.hidden, spec.intermediate, spec.head_dim);
        let (q, kv) = (spec.q_heads * hd, spec.kv_heads * hd);

        let mut embed = SlabBuilder::new("model.");
        embed.fused(&[("embed_tokens.weight", vec![spec.vocab, h])]);
        let mut units = vec![embed.finish(UnitKind::Embedding)];

        let mut layer = None;
        for l in 0..spec.layers {
            let mut s = SlabBuilder::new(&format!("model.layers.{l}."));
            let ranges = LayerRanges {
                ln1: s.fused(&[("input_layernorm.weight", vec![h])]),
                // Phi-3's checkpoint stores the fused matrices themselves; either way the slab
                // holds q | k | v rows and then gate | up rows.
                qkv_w: if spec.fused_checkpoint {
                    s.fused(&[("self_attn.qkv_proj.weight", vec![q + 2 * kv, h])])
                } else {
                    s.fused(&[
                        ("self_attn.q_proj.weight", vec![q, h]),
                        ("self_attn.k_proj.weight", vec![kv, h]),
                        ("self_attn.v_proj.weight", vec![kv, h]),
                    ])
                },
                qkv_b: spec.qkv_bias.then(|| {
                    s.fused(&[
                        ("self_attn.q_proj.bias", vec![q]),
                        ("self_attn.k_proj.bias", vec![kv]),
                        ("self_attn.v_proj.bias", vec![kv]),
                    ])
                }),
                qk_norm: spec.qk_norm.then(|| {
                    s.fused(&[
                        ("self_attn.q_norm.weight", vec![hd]),
                        ("self_attn.k_norm.weight", vec![hd]),
                    ])
                }),
                o_w: s.fused(&[("self_attn.o_proj.weight", vec![h, q])]),
                o_b: spec.o_bias.then(|| s.fused(&[("self_attn.o_proj.bias", vec![h])])),
                post_attn_norm: spec
                    .sandwich_norms
                    .then(|| s.fused(&[("post_attention_layernorm.weight", vec![h])])),
                ln2: if spec.sandwich_norms {
                    s.fused(&[("pre_feedforward_layernorm.weight", vec![h])])
                } else {
                    s.fused(&[("post_attention_layernorm.weight", vec![h])])
                },
                gate_up_w: if spec.fused_checkpoint {
                    s.fused(&[("mlp.gate_up_proj.weight", vec![2 * i, h])])
                } else {
                    s.fused(&[
                        ("mlp.gate_proj.weight", vec![i, h]),
                        ("mlp.up_proj.weight", vec![i, h]),
                    ])
                },
                down_w: s.fused(&[("mlp.down_proj.weight", vec![h, i])]),
                post_mlp_norm: spec
                    .sandwich_norms
                    .then(|| s.fused(&[("post_feedforward_layernorm.weight", vec![h])])),
            };
            units.push(s.finish(UnitKind::Layer(l)));
            layer = Some(ranges);
        }

        let mut s = SlabBuilder::new("");
        let head = HeadRanges {
            norm: s.fused(&[("model.norm.weight", vec![h])]),
            lm_head: (!spec.tie_embeddings)
                .then(|| s.fused(&[("lm_head.weight", vec![spec.vocab, h])])),
        };
        units.push(s.finish(UnitKind::Head));

        // A model always has at least one layer (the spec rejects zero), so `layer` is set; the
        // fallback only keeps this function total.
        let layer = layer.unwrap_or(LayerRanges {
            ln1: 0..0,
            qkv_w: 0..0,
            qkv_b: None,
            qk_norm: None,
            o_w: 0..0,
            o_b: None,
            ln2: 0..0,
            post_attn_norm: None,
            post_mlp_norm: None,
            gate_up_w: 0..0,
            down_w: 0..0,
        });
        ModelLayout { units, layer, head }
    }

    /// Index of the head unit.
    pub fn head_unit(&self) -> usize {
        self.units.len() - 1
    }

    /// Number of decoder layers.
    pub fn layers(&self) -> usize {
        self.units.len() - 2
    }

    /// Every tensor with its unit index, in Hugging Face order.
    pub fn tensors(&self) -> impl Iterator<Item = (usize, &TensorSlot)> {
        self.units.iter().enumerate().flat_map(|(u, unit)| unit.tensors.iter().map(move |t| (u, t)))
    }

    /// Total parameters (excluding alignment padding).
    pub fn params(&self) -> usize {
        self.tensors().map(|(_, t)| t.range.len()).sum()
    }
}
