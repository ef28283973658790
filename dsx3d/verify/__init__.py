"""`dsx3d verify` and its machinery: numerical parity with single-process HF (`parity`), bf16's allowances
(`bf16_roundoff`, `topk_ties`), the update-length check of the clipping norm (`clip_check`), ranks forked from a
warmed-up parent (`harness`), deliberate defects it must catch (`faults`) and tiny configs to sweep (`sweep`)."""
