"""Hugging Face checkpoints in and out.

- `source.checkpoint_source(path)`: a `WeightSource` over a local HF checkpoint directory; each rank reads
  only the slices it owns, after every tensor name and shape has been verified against the model.
- `export.export_hf(run, out_dir)`: the collective end-of-run export to a standard HF checkpoint.
- `offline_export.export_checkpoint(checkpoint_dir, out_dir)`: the same output from a DeepSpeed pipeline
  checkpoint, one process, one layer at a time (`dsx3d export`).
"""
