"""dsx3d: 3D parallelism (data x tensor x pipeline) for Hugging Face causal LMs on DeepSpeed."""

__version__ = "0.1.0"
