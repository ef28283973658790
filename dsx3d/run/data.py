"""A rank's data: the slow preparation once per node, then every rank's stream of its DP rank.

Local rank 0 of each node trains the tokenizer and tokenizes the corpus into the cache while the others
wait at a barrier; then every rank maps the cached blocks. Per node rather than once per job, because
nodes need not share a cache directory (cache entries appear atomically, so a shared one is safe too).
TP and PP peers pass the same DP rank and so read identical micro-batches.
"""

from __future__ import annotations

from transformers import PretrainedConfig, PreTrainedTokenizerBase

from dsx3d.data import prepare_data
from dsx3d.distributed import comm
from dsx3d.errors import UserError
from dsx3d.models.shape import model_dim
from dsx3d.recipe.schema import Recipe


def prepare_once_per_node(recipe: Recipe, local_rank: int) -> None:
    if local_rank == 0:
        prepare_data(recipe)
    comm.barrier()


def check_vocab(tokenizer: PreTrainedTokenizerBase, hf_config: PretrainedConfig) -> None:
    """Token ids at or past the model's vocab_size would index outside the embedding (or, vocab-parallel,
    fall outside every TP shard and be silently zeroed)."""
    vocab = model_dim(hf_config, "vocab_size")
    size = len(tokenizer)
    if vocab is not None and size > vocab:
        raise UserError.single(
            "model.config.vocab_size",
            vocab,
            f"smaller than the tokenizer's {size} tokens",
            f"set the model's vocab_size to at least {size}, or data.tokenizer_vocab_size to at most {vocab}",
        )
