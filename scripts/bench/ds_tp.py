"""The raw-DeepSpeed baseline for TP benchmarks: a Llama written by hand as a `PipelineModule` whose layers
are Hugging Face's, with DeepSpeed's own TP layers swapped in (module_inject/layers.py: `LinearLayer`
column-parallel for q/k/v/gate/up, `LinearAllreduce` row-parallel for o/down, `VocabParallelEmbedding`,
`VocabParallelLinear` head) and DeepSpeed's vocab-parallel cross-entropy: what a user of DeepSpeed alone
would write. Each column-parallel linear all-reduces its own input gradient (5 per layer), synchronously, or
with `overlap` asynchronously under its weight gradient (DeepSpeed's `tp_overlap_comm`). No sequence
parallelism (DeepSpeed has none for TP layers). Same stage split, weights and DeepSpeed JSON as dsx3d.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scripts.bench import common as bc


def _tp_layers(overlap: bool) -> tuple[Any, Any, Any, Any]:
    import deepspeed
    from deepspeed.module_inject import layers

    deepspeed.set_autotp_mode(training=True)  # the default (inference) sets requires_grad=False

    class Column(layers.LinearLayer):
        tp_overlap_comm = overlap

    return Column, layers.LinearAllreduce, layers.VocabParallelEmbedding, layers.VocabParallelLinear


class _Embed(nn.Module):
    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.embed = embedding

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed(ids), ids


class _Layer(nn.Module):
    """One HF Llama decoder layer, called with its rotary tables and the causal (mask-free sdpa) path."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, ids = inputs
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        out = self.layer(
            hidden,
            attention_mask=None,
            position_ids=positions,
            position_embeddings=self.rotary(hidden, positions),
        )
        return (out[0] if isinstance(out, tuple) else out), ids


class _Norm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, ids = inputs
        return self.norm(hidden), ids


class _Head(nn.Module):
    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.head(inputs[0])


def deepspeed_tp_contender(
    name: str, work: bc.Workload, state: dict[str, torch.Tensor], dp: int, tp: int, pp: int, overlap: bool = False
) -> bc.Contender:
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology
    from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

    from dsx3d.distributed import comm
    from dsx3d.pipeline.module import stage_bounds

    Column, Row, Embedding, Head = _tp_layers(overlap)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    group = PipelineParallelGrid(topology=topology).get_slice_parallel_group()  # DeepSpeed layers need it now
    hf = bc.hf_model(work, state)
    model, lm_head = hf.model, hf.lm_head
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for holder, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            for n in names:
                setattr(holder, n, Column(getattr(holder, n), group))
        attn.o_proj = Row(attn.o_proj, group)
        mlp.down_proj = Row(mlp.down_proj, group)
    head = Head(lm_head, group)
    items = [
        _Embed(Embedding(model.embed_tokens, group)),
        *(_Layer(layer, model.rotary_emb) for layer in model.layers),
        _Norm(model.norm),
        _Head(head),
    ]
    bounds = stage_bounds(work.config, pp, work.seq_len, None)

    class Staged(PipelineModule):
        def _partition_layers(self, method: str = "") -> None:
            self.parts = list(bounds)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        target = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        return vocab_parallel_cross_entropy(
            logits,
            target,
            tp_group=group,
            vocab_start_index=head.vocab_start_index,
            vocab_end_index=head.vocab_end_index,
            global_vocab_size=work.config.vocab_size,
        )

    module = Staged(items, topology=topology, loss_fn=loss_fn, partition_method="dsx3d")
    from dsx3d.recipe.ds_config import build_ds_config

    config = build_ds_config(bc.recipe_for(work, dp, tp, pp), dp * tp * pp)
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=config
    )
    dp_rank = topology.get_coord(comm.get_rank()).data

    def step(batch: torch.Tensor) -> float:
        micro = bc.rank_micro_batches(work, batch, dp, dp_rank)
        return float(engine.train_batch(data_iter=iter([(ids, ids) for ids in micro])))

    return bc.Contender(name, step, engine=engine, loss_is_global=True, info={"dp": dp, "tp": tp, "pp": pp})
