"""What the estimator needs to know about a model: parameter counts per part, and the shapes that size
activations and FLOPs. Built from an HF config or from a bare parameter count; no tensors.

Parameters are split into *sharded* (linear weights, column-parallel biases, the vocab-parallel embedding
and head: divided by tp) and *replicated* (norms, row-parallel biases: every TP rank holds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsx3d.errors import UserError
from dsx3d.tp_styles import SUPPORTED_TP_STYLES

# Families whose MLP is fc_in -> act -> fc_out (2 matrices); every other family is taken as gated
# (gate, up, down: 3 matrices), the Llama-style default.
NON_GATED_MLP = frozenset(
    {
        "gpt2",
        "gpt_neox",
        "gptj",
        "gpt_bigcode",
        "opt",
        "bloom",
        "falcon",
        "phi",
        "mpt",
        "codegen",
        "starcoder2",
        "biogpt",
        "gpt_neo",
    }
)


@dataclass(frozen=True)
class ParamCount:
    """A parameter count split by how TP stores it."""

    sharded: int = 0
    replicated: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def per_device(self, tp: int) -> float:
        """Parameters one TP rank holds: sharded / tp + replicated."""
        return self.sharded / tp + self.replicated

    def __add__(self, other: ParamCount) -> ParamCount:
        return ParamCount(self.sharded + other.sharded, self.replicated + other.replicated)

    def __mul__(self, k: int) -> ParamCount:
        return ParamCount(self.sharded * k, self.replicated * k)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only LM as counts. `hidden_size == 0` means unknown (a bare parameter count): activations,
    TP/PP traffic and the attention FLOP term are then left out."""

    num_layers: int
    layer: ParamCount
    """Parameters of one decoder layer (all experts for MoE)."""
    layer_flop_params: int
    """Parameters one token multiplies through in a decoder layer (top-k experts for MoE)."""
    embedding: int = 0
    head: int = 0
    """The vocab projection; with tied embeddings it is the same tensor as `embedding`."""
    final_norm: int = 0
    hidden_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    model_type: str = "unknown"
    tp_forward_allreduces: int = 2
    """All-reduces of b*s*h a decoder layer issues forward at tp > 1: one per row-parallel linear."""
    tp_backward_allreduces: int = 5
    """... and backward: one per column-parallel linear (dsx3d shards each HF projection on its own, so a
    Llama layer has 5: q, k, v, gate, up). Defaults are a Llama layer's; HF configs count their TP plan."""
    tp_grad_allreduce_params: int = 0
    """Parameters per layer kept whole on every TP rank whose gradients are summed over TP (q/k norms)."""
    tp_forward_gather_width: int = 0
    """Values per token a decoder layer all-gathers forward (outputs of `colwise_gather_output` linears)."""
    tp_backward_gather_width: int = 0
    """... and backward (input gradients of `rowwise_split_input` linears)."""

    @property
    def total_params(self) -> int:
        """Unique parameters (a tied embedding/head counted once)."""
        head = 0 if self.tie_word_embeddings else self.head
        return self.num_layers * self.layer.total + self.embedding + head + self.final_norm

    @property
    def flop_params(self) -> int:
        """N in 6*N*tokens: decoder layers (active experts) and the head; the embedding lookup is free."""
        return self.num_layers * self.layer_flop_params + self.head

    @property
    def attention_width(self) -> int:
        """num_heads * head_dim: the width of QK^T and AV (equals hidden_size for most families)."""
        return self.num_heads * self.head_dim


def shape_from_params(
    num_params: float,
    num_layers: int | None = None,
    hidden_size: int | None = None,
    num_heads: int | None = None,
) -> ModelShape:
    """A shape from a bare parameter count: all of it in `num_layers` equal, fully sharded layers
    (default 1 layer); no embedding or head. With `hidden_size` activations can be estimated
    (num_heads defaults to hidden_size / 128)."""
    if num_params <= 0:
        raise UserError.single(
            "--params", num_params, "must be positive", "pass a parameter count such as 7.5e9"
        )
    layers = num_layers or 1
    hidden = hidden_size or 0
    heads = num_heads or (max(hidden // 128, 1) if hidden else 0)
    per_layer = round(num_params / layers)
    return ModelShape(
        num_layers=layers,
        layer=ParamCount(sharded=per_layer),
        layer_flop_params=per_layer,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads if heads else 0,
    )


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _layer_params(
    h: int, heads: int, kv: int, d: int, ffn: int, gated: bool, experts: int, attn_bias: bool, mlp_bias: bool
) -> ParamCount:
    """One decoder layer. q: h x (heads*d), k, v: h x (kv*d), o: (heads*d) x h; MLP: 3 (gated) or 2
    matrices of h x ffn per expert plus a router h x experts; two norms of h (RMSNorm; LayerNorm's bias
    is ignored)."""
    qkv = h * (heads + 2 * kv) * d
    out = heads * d * h
    mlp = (3 if gated else 2) * h * ffn
    sharded = qkv + out + experts * mlp
    replicated = 2 * h + (h * experts if experts > 1 else 0)
    if attn_bias:
        sharded += (heads + 2 * kv) * d
        replicated += h
    if mlp_bias:
        sharded += experts * ((2 if gated else 1) * ffn)
        replicated += experts * h
    return ParamCount(sharded, replicated)




@dataclass(frozen=True)
class TPTraffic:
    """What one decoder layer sends over TP per micro-batch, in units the timing model scales by b*s."""

    forward_allreduces: int = 2
    backward_allreduces: int = 5
    grad_allreduce_params: int = 0
    forward_gather_width: int = 0
    backward_gather_width: int = 0


def _linear_width(name: str, side: str, heads: int, kv: int, d: int, ffn: int) -> int:
    """Features on the sharded side of a plan entry's linear: the output of a column-parallel one
    (side "out"), the input of a row-parallel one (side "in"), read from the HF module name."""
    leaf = name.rsplit(".", 1)[-1]
    if ".mlp." in name:
        return 2 * ffn if "gate_up" in leaf and side == "out" else ffn
    if side == "in":
        return heads * d
    if "qkv" in leaf or "query_key_value" in leaf:
        return (heads + 2 * kv) * d
    return kv * d if leaf.startswith(("k_", "v_", "key", "value")) else heads * d


def tp_plan_traffic(config: Any, experts: int, heads: int, kv: int, d: int, ffn: int) -> TPTraffic:
    """A decoder layer's TP traffic from the family's `base_model_tp_plan`, as dsx3d applies it
    (`dsx3d.models.stages.StageBuilder._shard`, `dsx3d.models.tp_layers`): rowwise styles all-reduce their
    output forward; colwise styles all-reduce their input gradient backward; `colwise_gather_output` also
    all-gathers its output forward, `rowwise_split_input` its input gradient backward;
    `replicated_with_grad_allreduce` modules (q/k norms over head_dim) all-reduce their weight gradient. A
    module with a style dsx3d does not implement stays whole with its children; MoE experts stay whole on
    every TP rank, so in MoE families only the attention entries count. Families without a plan get a Llama
    layer's traffic. Exact for families whose layers are all alike; families that mix layer kinds (dense and
    MoE layers, linear-attention layers) get the traffic of the plan's full-attention, dense-or-MoE layer."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        return TPTraffic()
    layer_plan = {k: v for k, v in plan.items() if k.startswith("layers.*.") and "experts" not in k}
    # a module whose own style dsx3d does not implement stays whole on every TP rank, children included
    whole = [k for k, v in layer_plan.items() if v not in SUPPORTED_TP_STYLES]
    layer_plan = {k: v for k, v in layer_plan.items() if not any(k.startswith(w + ".") for w in whole)}
    if experts > 1:
        layer_plan = {k: v for k, v in layer_plan.items() if ".mlp." not in k}
    row = ("rowwise", "rowwise_split_input")
    col = ("colwise", "colwise_gather_output")
    return TPTraffic(
        forward_allreduces=sum(1 for v in layer_plan.values() if v in row),
        backward_allreduces=sum(1 for v in layer_plan.values() if v in col),
        grad_allreduce_params=sum(d for v in layer_plan.values() if v == "replicated_with_grad_allreduce"),
        forward_gather_width=sum(
            _linear_width(k, "out", heads, kv, d, ffn)
            for k, v in layer_plan.items()
            if v == "colwise_gather_output"
        ),
        backward_gather_width=sum(
            _linear_width(k, "in", heads, kv, d, ffn)
            for k, v in layer_plan.items()
            if v == "rowwise_split_input"
        ),
    )


def shape_from_hf_config(config: Any) -> ModelShape:
    """Count a decoder-only HF config (Llama-style attention and MLP, GQA, MoE as top-k of E equal
    experts). Multimodal configs use their text config."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    model_type = str(getattr(config, "model_type", "unknown"))
    try:
        h = int(_get(config, "hidden_size", "n_embd", "d_model"))
        layers = int(_get(config, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_get(config, "num_attention_heads", "n_head"))
        vocab = int(_get(config, "vocab_size"))
    except (TypeError, ValueError):
        raise UserError.single(
            "model",
            model_type,
            "the config lacks hidden_size, num_hidden_layers, num_attention_heads or vocab_size",
            "pass a decoder-only causal LM config",
        ) from None
    kv = int(_get(config, "num_key_value_heads", "n_head_kv", default=heads))
    d = int(_get(config, "head_dim", default=h // heads))
    experts = int(_get(config, "num_local_experts", "num_experts", "n_routed_experts", default=1))
    top_k = int(_get(config, "num_experts_per_tok", default=1)) if experts > 1 else 1
    ffn = int(
        _get(
            config,
            "moe_intermediate_size" if experts > 1 else "intermediate_size",
            "intermediate_size",
            "n_inner",
            "ffn_dim",
            default=4 * h,
        )
    )
    gated = model_type not in NON_GATED_MLP
    layer = _layer_params(
        h,
        heads,
        kv,
        d,
        ffn,
        gated,
        experts,
        bool(_get(config, "attention_bias", default=False)),
        bool(_get(config, "mlp_bias", default=False)),
    )
    per_expert = (3 if gated else 2) * h * ffn
    tp = tp_plan_traffic(config, experts, heads, kv, d, ffn)
    return ModelShape(
        num_layers=layers,
        layer=layer,
        layer_flop_params=layer.total - (experts - top_k) * per_expert,
        embedding=vocab * h,
        head=vocab * h,
        final_norm=h,
        hidden_size=h,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=d,
        vocab_size=vocab,
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", default=False)),
        model_type=model_type,
        tp_forward_allreduces=tp.forward_allreduces,
        tp_backward_allreduces=tp.backward_allreduces,
        tp_grad_allreduce_params=tp.grad_allreduce_params,
        tp_forward_gather_width=tp.forward_gather_width,
        tp_backward_gather_width=tp.backward_gather_width,
    )
