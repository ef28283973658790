"""Mixture-of-experts layers split over the tensor- and expert-parallel ranks, every group passed explicitly.

- `placement`: which experts a rank holds (pure);
- `all_to_all`: the token exchange between the ranks of an EP group, as an autograd function;
- `experts`: the region around a family's own experts module (`shard_experts`): tokens routed to this rank's
  experts run through the family's forward, partial outputs are summed over TP like a row-parallel layer;
- `groups`: the EP and expert-data-parallel groups of a layout, and their registration with DeepSpeed's ZeRO.

Which module is an experts module is decided by `dsx3d.models.tp_plan` (the family's `moe_tp_experts` style).
"""
