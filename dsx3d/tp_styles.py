"""The TP plan styles dsx3d shards on plain tensors (pure data, shared by the engine and the estimator).

Other styles of HF plans (packed projections, MoE experts, MLA) are kept whole on every TP rank.
"""

SUPPORTED_TP_STYLES = frozenset(
    {
        "colwise",
        "rowwise",
        "colwise_gather_output",
        "rowwise_split_input",
        "replicated_with_grad_allreduce",
    }
)
