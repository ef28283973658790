"""`dsx3d verify` and its machinery: numerical parity with single-process HF (`parity`), bf16's allowances
(`bf16_roundoff`, `topk_ties`), the update-length check of the clipping norm (`clip_check`), ranks forked from a
warmed-up parent (`harness`), deliberate defects it must catch (`faults`; `cp_faults` for context parallelism)
and tiny configs to sweep (`sweep`, with `cp_sweep_cases` for context parallelism); DPO steps of the recipe face
against DPO's math on one process, and the fault of a reference computed by the policy (`dpo`)."""
