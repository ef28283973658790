"""`dsx3d verify` and its machinery: numerical parity with single-process HF (`parity`), ranks forked from a
warmed-up parent (`harness`), deliberate defects it must catch (`faults`; `cp_faults` for context parallelism) and tiny configs to sweep
(`sweep`, with `cp_sweep_cases` for context parallelism)."""
