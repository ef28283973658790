"""The estimator's activation memory for scripts/bench/context_parallel.py's shapes, against what it measured.

`dsx3d.estimate` for pp 1, tp 1, ZeRO-0, fp32, one micro-batch of one sequence, at cp 1 and cp 2, with the
attention counted unfused (the s x s scores and probabilities kept per head) and as flash attention (only the
softmax statistics). The measured figure is the step's peak resident set over the resident set before it
(scripts/bench/context_parallel.py part 1). DeepSpeed frees the gradients after each step (ZeRO-0), so the
step adds the activations, the gradients and the step's transients to the weights and Adam's moments it
starts with; the comparable estimate is the stage's peak less those states: activations + gradients +
transients (the estimator counts the whole of both at once, while in the backward the activations are freed
as the gradients appear). The activations alone are compared too.
"""

from __future__ import annotations

MiB = 1024**2


def estimator_rows(config: dict[str, object], seq_len: int, measured_mib: dict[str, float]) -> dict[str, object]:
    from transformers import LlamaConfig

    from dsx3d.estimate import GB, Setup, estimate, shape_from_hf_config

    hf = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    shape = shape_from_hf_config(hf)
    rows = []
    for cp in (1, 2):
        for flash in (False, True):
            setup = Setup(
                dp=1, cp=cp, tp=1, pp=1, zero_stage=0, dtype="fp32", micro_batch_size=1, seq_len=seq_len,
                grad_accum=1, flash_attention=flash,
            )
            stage = estimate(shape, setup).stages[0]
            act = stage.activations_gb * GB / MiB
            added = (stage.activations_gb + stage.grads_gb + stage.transient_gb) * GB / MiB
            measured = measured_mib[str(cp)]
            rows.append(
                {
                    "cp": cp,
                    "attention": "flash" if flash else "unfused",
                    "activations_mib": round(act, 1),
                    "transient_mib": round(stage.transient_gb * GB / MiB, 1),
                    "grads_mib": round(stage.grads_gb * GB / MiB, 1),
                    "measured_step_peak_mib": measured,
                    "measured_over_activations": round(measured / act, 3),
                    "step_added_mib": round(added, 1),
                    "measured_over_step_added": round(measured / added, 3),
                }
            )
    by = {(r["cp"], r["attention"]): r["activations_mib"] for r in rows}
    return {
        "rows": rows,
        "estimated_ratio_cp2_over_cp1": {
            a: round(by[(2, a)] / by[(1, a)], 3) for a in ("unfused", "flash")
        },
    }
