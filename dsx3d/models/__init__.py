"""Hugging Face causal LMs as tensor-parallel-sharded DeepSpeed pipeline stages."""
