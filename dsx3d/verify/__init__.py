"""`dsx3d verify` and its machinery: numerical parity with single-process HF (`parity`), ranks forked from a
warmed-up parent (`harness`), deliberate defects it must catch (`faults`) and tiny configs to sweep (`sweep`)."""
