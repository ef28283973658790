"""The one reader of a model's shape: parameter counts per part, and the dimensions that size activations,
FLOPs and TP traffic. Built from an HF config or from a bare parameter count; no tensors (pure).

The engine's stage split (`dsx3d.pipeline.split`), the checker (`model_dim`) and the estimator all read the model
through this module, so they cannot disagree on what a layer costs.

Parameters are split into *sharded* (linear weights, column-parallel biases, the vocab-parallel embedding
and head: divided by tp), *replicated* (norms, row-parallel biases, routers: every TP rank holds them) and
*experts* (the experts of MoE layers: divided by tp x ep). MoE models are counted layer by layer as the engine
places them (experts modules, shared experts, dense layers) by walking a meta-device model with the engine's
own plan interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsx3d.boundary_types import HFConfig
from dsx3d.errors import UserError
from dsx3d.models import tp_plan
from dsx3d.models.config_dims import _ATTRIBUTE_NAMES, model_dim, text_config  # noqa: F401
from dsx3d.models.meta_build import _ERROR_KEYS, _meta_layers, build_meta_model, sequence_parallel_blocker  # noqa: F401
from dsx3d.models.tp_traffic import TPTraffic, _tp_traffic, tp_traffic  # noqa: F401


def dropout_probabilities(config: HFConfig) -> dict[str, float]:
    """The config's non-zero dropout probabilities ("attention_dropout", "resid_pdrop", ...)."""
    text = text_config(config)
    out = {}
    for key, value in text.to_dict().items() if hasattr(text, "to_dict") else []:
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0:
            out[key] = value
    return out


def is_gated_mlp(config: HFConfig) -> bool:
    """Gate, up and down matrices (Llama-style GLU) rather than fc_in -> act -> fc_out. The family's TP plan
    names its MLP linears; families without MLP entries in a plan are looked up in
    `dsx3d.models.known_families.NON_GATED_MLP`."""
    from dsx3d.models.known_families import NON_GATED_MLP, declared_tp_plan

    plan = declared_tp_plan(config)
    mlp_leaves = [
        k.rsplit(".", 1)[-1]
        for k in plan
        if k.startswith("layers.*.") and "attn" not in k and "attention" not in k and k.count(".") >= 3
    ]
    if mlp_leaves:
        return any(leaf.startswith("gate_") or leaf in ("w1", "w3") for leaf in mlp_leaves)
    return str(getattr(config, "model_type", "")) not in NON_GATED_MLP


@dataclass(frozen=True)
class ParamCount:
    """A parameter count split by how TP (and EP) store it."""

    sharded: int = 0
    replicated: int = 0
    experts: int = 0
    """MoE experts: each of the tp x ep ranks of an expert group holds E / (tp x ep) of them."""

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.experts

    def dense_per_device(self, tp: int) -> float:
        """Non-expert parameters one TP rank holds: sharded / tp + replicated (reduced over all DP ranks)."""
        return self.sharded / tp + self.replicated

    def experts_per_device(self, tp: int, ep: int = 1) -> float:
        """Expert parameters one rank holds (reduced over its expert-data-parallel group, dp / ep ranks)."""
        return self.experts / (tp * ep)

    def per_device(self, tp: int, ep: int = 1) -> float:
        """Parameters one rank holds."""
        return self.dense_per_device(tp) + self.experts_per_device(tp, ep)

    def __add__(self, other: ParamCount) -> ParamCount:
        return ParamCount(
            self.sharded + other.sharded, self.replicated + other.replicated, self.experts + other.experts
        )

    def __mul__(self, k: int) -> ParamCount:
        return ParamCount(self.sharded * k, self.replicated * k, self.experts * k)


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer of a model whose layers differ (dense and MoE layers)."""

    params: ParamCount
    flop_params: int
    """Parameters one token multiplies through (the router, shared experts and top-k routed experts)."""
    moe: bool = False


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
    ffn_size: int = 0
    """MLP width (per expert for MoE); 0 when unknown (a bare parameter count)."""
    gated_mlp: bool = True
    """gate, up and down (SwiGLU) rather than fc_in -> act -> fc_out."""
    rms_norm: bool = True
    """RMSNorm (computed in fp32 by HF) rather than LayerNorm."""
    tp_forward_allreduces: float = 2
    """All-reduces of b*s*h a decoder layer issues forward at tp > 1: one per row-parallel linear (a TP
    region's exit; with sequence parallelism a reduce-scatter, and an all-gather backward)."""
    tp_backward_allreduces: float = 2
    """... and backward: one per TP region entry, i.e. per module whose column-parallel linears read one
    input (q/k/v share one, gate/up one: 2 for a Llama layer; with sequence parallelism a reduce-scatter,
    and an all-gather forward). Defaults are a Llama layer's; HF configs count their TP plan."""
    tp_grad_allreduce_params: float = 0
    """Parameters per layer kept whole on every TP rank whose gradients are summed over TP (q/k norms)."""
    tp_sequence_params: float = 0
    """Replicated parameters per layer that run on sequence shards with sequence parallelism (norms, biases
    added after a reduce-scatter): their gradients are summed over TP too."""
    sequence_parallel_blocker: str | None = None
    """Why the engine runs this model without sequence parallelism (None: it can run it)."""
    tp_forward_gather_width: float = 0
    """Values per token a decoder layer all-gathers forward (outputs of `colwise_gather_output` linears)."""
    tp_backward_gather_width: float = 0
    """... and backward (input gradients of `rowwise_split_input` linears)."""
    tp_routing_allreduce_width: float = 0
    """fp32 values per token a decoder layer all-reduces backward besides those: the routing weights (top-k
    per token) entering an experts region."""
    tp_call_counts: tuple[float, float, float, float] = (0, 0, 0, 0)
    """Calls per layer the byte counts above leave out: all-reduces of `tp_grad_allreduce_params` tensors and
    of `tp_sequence_params` tensors (one per tensor), all-gathers forward and backward
    (`dsx3d.models.tp_traffic.TPTraffic`)."""
    per_layer: tuple[LayerShape, ...] = ()
    """Layer by layer, when layers differ (MoE models); empty: `num_layers` copies of `layer`."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """k: routes per token and MoE layer."""
    expert_width: int = 0
    """The intermediate width of one expert."""

    def layer_shapes(self, start: int = 0, count: int | None = None) -> list[LayerShape]:
        """Decoder layers [start, start + count), each as a LayerShape."""
        count = self.num_layers - start if count is None else count
        if self.per_layer:
            return list(self.per_layer[start : start + count])
        return [LayerShape(self.layer, self.layer_flop_params)] * count

    def layers_params(self, start: int = 0, count: int | None = None) -> ParamCount:
        total = ParamCount()
        for layer in self.layer_shapes(start, count):
            total = total + layer.params
        return total

    def moe_layers(self, start: int = 0, count: int | None = None) -> int:
        return sum(layer.moe for layer in self.layer_shapes(start, count))

    @property
    def total_params(self) -> int:
        """Unique parameters (a tied embedding/head counted once)."""
        head = 0 if self.tie_word_embeddings else self.head
        return self.layers_params().total + self.embedding + head + self.final_norm

    @property
    def flop_params(self) -> int:
        """N in 6*N*tokens: decoder layers (active experts) and the head; the embedding lookup is free."""
        return sum(layer.flop_params for layer in self.layer_shapes()) + self.head

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


def _get(config: HFConfig, *names: str, default: object = None) -> Any:
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
    moe = experts > 1
    sharded = qkv + out + (0 if moe else mlp)
    replicated = 2 * h + (h * experts if moe else 0)
    expert_params = experts * mlp if moe else 0
    if attn_bias:
        sharded += (heads + 2 * kv) * d
        replicated += h
    if mlp_bias:
        if moe:
            expert_params += experts * ((2 if gated else 1) * ffn + h)
        else:
            sharded += (2 if gated else 1) * ffn
            replicated += h
    return ParamCount(sharded, replicated, expert_params)


def moe_layer_shapes(config: HFConfig) -> tuple[LayerShape, ...]:
    """Each decoder layer of an MoE model as the engine places it: the plan interpreter's experts modules
    (split over tp x ep), column- and row-parallel linears (weights and column biases over tp; row biases,
    routers, norms and modules kept whole replicated), on a meta-device model."""
    from torch import nn

    spec, layers = _meta_layers(config)
    top_k = model_dim(config, "num_experts_per_tok") or 1
    out = []
    for i, layer in enumerate(layers):
        total = sum(p.numel() for p in layer.parameters())
        sharded = experts = active = 0
        for _, sub, sharding in tp_plan.plan_modules(
            layer, f"{spec.layers_name}.{i}", spec.tp_plan, lambda m: isinstance(m, nn.Linear)
        ):
            numel = sum(p.numel() for p in sub.parameters())
            if sharding.experts:
                experts += numel
                active += numel // next(sub.parameters()).shape[0] * top_k
            elif sharding.column:
                sharded += numel
            elif sharding.row:
                sharded += sub.weight.numel()
        params = ParamCount(sharded=sharded, replicated=total - sharded - experts, experts=experts)
        out.append(LayerShape(params, total - experts + active, moe=experts > 0))
    return tuple(out)


def shape_from_hf_config(config: HFConfig) -> ModelShape:
    """Count a decoder-only HF config (Llama-style attention and MLP, GQA, MoE as top-k of E equal
    experts). Multimodal configs use their text config."""
    plan_source, config = config, text_config(config)
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
    experts = model_dim(config, "num_experts") or 1
    top_k = (model_dim(config, "num_experts_per_tok") or 1) if experts > 1 else 1
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
    gated = is_gated_mlp(config)
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
    tp = tp_traffic(plan_source)
    per_layer: tuple[LayerShape, ...] = ()
    if experts > 1:
        try:
            per_layer = moe_layer_shapes(plan_source)
        except Exception:  # a family the engine cannot build: E equal experts in every layer, as below
            per_layer = ()
    if per_layer:
        layer = max((s.params for s in per_layer), key=lambda c: c.total)
    return ModelShape(
        num_layers=layers,
        layer=layer,
        layer_flop_params=layer.total - (experts - top_k) * per_expert,
        per_layer=per_layer,
        num_experts=experts if experts > 1 else 0,
        experts_per_token=top_k if experts > 1 else 0,
        expert_width=ffn if experts > 1 else 0,
        tp_routing_allreduce_width=tp.routing_allreduce_width,
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
        ffn_size=ffn,
        gated_mlp=gated,
        rms_norm=_get(config, "layer_norm_eps", "layer_norm_epsilon", "norm_eps") is None,
        tp_forward_allreduces=tp.forward_allreduces,
        tp_backward_allreduces=tp.backward_allreduces,
        tp_grad_allreduce_params=tp.grad_allreduce_params,
        tp_sequence_params=tp.sequence_params,
        sequence_parallel_blocker=tp.sequence_parallel_blocker,
        tp_forward_gather_width=tp.forward_gather_width,
        tp_backward_gather_width=tp.backward_gather_width,
        tp_call_counts=(tp.grad_allreduce_tensors, tp.sequence_tensors, tp.forward_gathers, tp.backward_gathers),
    )
