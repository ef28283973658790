"""Checkpoints: Hugging Face checkpoints in and out (`hf`), a run's DeepSpeed training checkpoints (`training`),
and what both share: loading files without running code (`safe_load`) and the manifests of what dsx3d wrote
(`manifest`)."""
