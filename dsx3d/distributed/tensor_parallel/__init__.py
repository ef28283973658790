"""Tensor parallelism on plain tensors, Megatron-style, with every process group passed explicitly.

- `mappings`: the f/g autograd functions (enter/leave a TP region), gather/split along the last dim, the
  gradient all-reduce hook of replicated parameters;
- `cross_entropy`: the vocab-parallel cross-entropy;
- `tiled_loss`: the LM head and its loss a tile of tokens at a time, recomputed in the backward
  (`train.loss_tile_tokens`);
- `layers`: column/row-parallel linears, the vocab-parallel embedding and head (HF parameter names kept);
- `context`: a rank's TP coordinates and group.

Which module of a Hugging Face model gets which treatment is decided by `dsx3d.models.tp_plan` (pure),
from the family's own `base_model_tp_plan`.
"""
