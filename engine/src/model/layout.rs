//! Where every parameter lives: the model is cut into units (the embedding, each decoder layer,
//! the head), and each unit's parameters are one flat f32 slab. Tensors that the decoder fuses
//! sit next to each other in Hugging Face's order, so the fused matrix is simply a range of the
//! slab: `q_proj | k_proj | v_proj` is the `[Dqkv, H]` qkv weight, `gate_proj | up_proj` the
//! `[2I, H]` gate_up weight (row-major concatenation along the output dimension).
//!
//! Invariant: a slab is the unit of transfer. Streaming, checkpoints and the optimizer all move
//! whole units; only this file knows the offsets inside one.

use std::ops::Range;

use crate::spec::{Family, ModelSpec, MoeSpec};

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

/// Ranges of a decoder layer's (possibly fused) operands inside its slab. Layers of one model
/// share their attention's layout; their MLPs may differ (Qwen MoE's dense layers among
/// mixtures).
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
    /// `[nq]`: GPT-OSS's attention sinks.
    pub sinks: Option<Range<usize>>,
    pub mlp: MlpRanges,
}

/// A layer's MLP: dense, or a mixture of experts.
#[derive(Debug, Clone, PartialEq)]
pub enum MlpRanges {
    Dense {
        /// `[2I, H]`: gate_proj then up_proj weights.
        gate_up_w: Range<usize>,
        /// `[H, I]`.
        down_w: Range<usize>,
    },
    Moe(MoeRanges),
}

/// A MoE layer's router and experts. Expert `e`'s matrices follow expert `e − 1`'s, so each
/// projection of every expert is one range (`[E, ...]`), as grouped GEMMs want it.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeRanges {
    /// `[E, H]`.
    pub router_w: Range<usize>,
    /// `[E]` (GPT-OSS).
    pub router_b: Option<Range<usize>>,
    /// `[E, 2I, H]` (each expert's gate then up rows), or GPT-OSS's `[E, H, 2I]` with gate
    /// and up columns interleaved.
    pub gate_up_w: Range<usize>,
    /// `[E, 2I]` (GPT-OSS).
    pub gate_up_b: Option<Range<usize>>,
    /// `[E, H, I]`, or GPT-OSS's `[E, I, H]`.
    pub down_w: Range<usize>,
    /// `[E, H]` (GPT-OSS).
    pub down_b: Option<Range<usize>>,
    /// Qwen2 MoE's shared expert.
    pub shared: Option<SharedExpertRanges>,
}

/// Qwen2 MoE's shared expert: a dense gated MLP and its one-logit gate.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedExpertRanges {
    /// `[2Is, H]`: gate_proj then up_proj.
    pub gate_up_w: Range<usize>,
    /// `[H, Is]`.
    pub down_w: Range<usize>,
    /// `[1, H]`: `shared_expert_gate`.
    pub gate_w: Range<usize>,
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
    /// Per decoder layer.
    pub layers: Vec<LayerRanges>,
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

/// A MoE layer's tensors under their checkpoint names: Mixtral's `block_sparse_moe.gate` and
/// `experts.{e}.w1` (gate), `w3` (up), `w2` (down); Qwen MoE's `mlp.gate` and
/// `mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`; GPT-OSS's `mlp.router` and the fused
/// `mlp.experts.gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]` with their biases.
fn moe_ranges(s: &mut SlabBuilder, spec: &ModelSpec, moe: &MoeSpec) -> MoeRanges {
    let (h, i, e) = (spec.hidden, moe.inter, moe.experts);
    let per_expert = |s: &mut SlabBuilder, prefix: &str, names: [&str; 3]| {
        let gate_up: Vec<(String, Vec<usize>)> = (0..e)
            .flat_map(|x| {
                [
                    (format!("{prefix}.{x}.{}.weight", names[0]), vec![i, h]),
                    (format!("{prefix}.{x}.{}.weight", names[1]), vec![i, h]),
                ]
            })
            .collect();
        let down: Vec<(String, Vec<usize>)> =
            (0..e).map(|x| (format!("{prefix}.{x}.{}.weight", names[2]), vec![h, i])).collect();
        (s.fused(&as_parts(&gate_up)), s.fused(&as_parts(&down)))
    };
    match spec.family {
        Family::Mixtral => {
            let router_w = s.fused(&[("block_sparse_moe.gate.weight", vec![e, h])]);
            let (gate_up_w, down_w) = per_expert(s, "block_sparse_moe.experts", ["w1", "w3", "w2"]);
            let shared = None;
            MoeRanges {
                router_w,
                router_b: None,
                gate_up_w,
                gate_up_b: None,
                down_w,
                down_b: None,
                shared,
            }
        }
        Family::GptOss => MoeRanges {
            router_w: s.fused(&[("mlp.router.weight", vec![e, h])]),
            router_b: Some(s.fused(&[("mlp.router.bias", vec![e])])),
            gate_up_w: s.fused(&[("mlp.experts.gate_up_proj", vec![e, h, 2 * i])]),
            gate_up_b: Some(s.fused(&[("mlp.experts.gate_up_proj_bias", vec![e, 2 * i])])),
            down_w: s.fused(&[("mlp.experts.down_proj", vec![e, i, h])]),
            down_b: Some(s.fused(&[("mlp.experts.down_proj_bias", vec![e, h])])),
            shared: None,
        },
        _ => {
            let router_w = s.fused(&[("mlp.gate.weight", vec![e, h])]);
            let (gate_up_w, down_w) =
                per_expert(s, "mlp.experts", ["gate_proj", "up_proj", "down_proj"]);
            // Qwen2MoeSparseMoeBlock: `mlp.shared_expert` (a Qwen2MoeMLP) and its gate.
            let shared = moe.shared_inter.map(|si| SharedExpertRanges {
                gate_up_w: s.fused(&[
                    ("mlp.shared_expert.gate_proj.weight", vec![si, h]),
                    ("mlp.shared_expert.up_proj.weight", vec![si, h]),
                ]),
                down_w: s.fused(&[("mlp.shared_expert.down_proj.weight", vec![h, si])]),
                gate_w: s.fused(&[("mlp.shared_expert_gate.weight", vec![1, h])]),
            });
            MoeRanges {
                router_w,
                router_b: None,
                gate_up_w,
                gate_up_b: None,
                down_w,
                down_b: None,
                shared,
            }
        }
    }
}

fn as_parts(v: &[(String, Vec<usize>)]) -> Vec<(&str, Vec<usize>)> {
    v.iter().map(|(n, shape)| (n.as_str(), shape.clone())).collect()
}

impl ModelLayout {
    pub fn new(spec: &ModelSpec) -> ModelLayout {
        let (h, i, hd) = (spec.hidden, spec.intermediate, spec.head_dim);
        let (q, kv) = (spec.q_heads * hd, spec.kv_heads * hd);

        let mut embed = SlabBuilder::new("model.");
        embed.fused(&[("embed_tokens.weight", vec![spec.vocab, h])]);
        let mut units = vec![embed.finish(UnitKind::Embedding)];

        let mut layers = Vec::with_capacity(spec.layers);
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
                sinks: spec.attn_sinks.then(|| s.fused(&[("self_attn.sinks", vec![spec.q_heads])])),
                post_attn_norm: spec
                    .sandwich_norms
                    .then(|| s.fused(&[("post_attention_layernorm.weight", vec![h])])),
                ln2: if spec.sandwich_norms {
                    s.fused(&[("pre_feedforward_layernorm.weight", vec![h])])
                } else {
                    s.fused(&[("post_attention_layernorm.weight", vec![h])])
                },
                mlp: match spec.moe_at(l) {
                    Some(moe) => MlpRanges::Moe(moe_ranges(&mut s, spec, moe)),
                    None if spec.fused_checkpoint => MlpRanges::Dense {
                        gate_up_w: s.fused(&[("mlp.gate_up_proj.weight", vec![2 * i, h])]),
                        down_w: s.fused(&[("mlp.down_proj.weight", vec![h, i])]),
                    },
                    None => MlpRanges::Dense {
                        gate_up_w: s.fused(&[
                            ("mlp.gate_proj.weight", vec![i, h]),
                            ("mlp.up_proj.weight", vec![i, h]),
                        ]),
                        down_w: s.fused(&[("mlp.down_proj.weight", vec![h, i])]),
                    },
                },
                post_mlp_norm: spec
                    .sandwich_norms
                    .then(|| s.fused(&[("post_feedforward_layernorm.weight", vec![h])])),
            };
            units.push(s.finish(UnitKind::Layer(l)));
            layers.push(ranges);
        }

        let mut s = SlabBuilder::new("");
        let head = HeadRanges {
            norm: s.fused(&[("model.norm.weight", vec![h])]),
            lm_head: (!spec.tie_embeddings)
                .then(|| s.fused(&[("lm_head.weight", vec![spec.vocab, h])])),
        };
        units.push(s.finish(UnitKind::Head));

        ModelLayout { units, layers, head }
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
