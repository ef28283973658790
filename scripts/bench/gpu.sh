#!/usr/bin/env bash
# GPU benchmark in one command (never part of CI): bf16 throughput and MFU of a 1B-class Llama through dsx3d
# at tp=1 pp=1 vs the plain HF model, same process; then the memory estimator against max_memory_allocated. Needs one CUDA GPU; fits in about 8 minutes on an H200
# (set-up included when no pip download is needed; the measurement itself takes 1-2 minutes).
#
#   bash scripts/bench/gpu.sh [bench_gpu.py options]      e.g. --rounds 8 --micro-batch 4 --seq-len 2048
#
# Python: $PYTHON if set, else .venv-gpu/bin/python if it works, else the system python3 if it has CUDA torch
# and the pinned packages. Otherwise it creates .venv-gpu (with --system-site-packages, so a system CUDA torch
# is reused) and pip-installs the pinned deepspeed/transformers/accelerate and dsx3d's other dependencies
# (torch 2.13.0 from PyPI, a CUDA build, only when no CUDA torch is present). dsx3d runs from this checkout
# (PYTHONPATH), not installed. Prints one JSON object on stdout (logs on stderr); with $OUT set it also
# writes $OUT/bench_gpu.json. Without pip access: point PYTHON at a ready environment, or pre-fetch wheels
# (pip download) and set PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels, which pip reads from the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TOKENIZERS_PARALLELISM=false DS_SKIP_CUDA_CHECK=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PINS=(deepspeed==0.19.8 transformers==5.23.0 accelerate==1.15.0 safetensors==0.8.0 pydantic==2.13.4 PyYAML==6.0.3 tqdm==4.70.1)

ready() {  # does this python have CUDA torch and the pinned packages?
  "$1" - <<'EOF' 2>/dev/null
import importlib.metadata as md, torch
assert torch.cuda.is_available(), "no CUDA device"
for pin in ["deepspeed==0.19.8", "transformers==5.23.0", "accelerate==1.15.0"]:
    name, version = pin.split("==")
    assert md.version(name) == version, pin
import pydantic, yaml, safetensors  # noqa: F401
EOF
}

PY=""
for candidate in "${PYTHON:-}" .venv-gpu/bin/python python3; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && ready "$candidate"; then PY=$candidate; break; fi
done
if [ -z "$PY" ]; then
  echo "[bench_gpu] setting up .venv-gpu (pinned packages; needs pip access)" >&2
  [ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu
  PY=.venv-gpu/bin/python
  if ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0" >&2
  fi
  # deepspeed's own torch requirement is unpinned, so pip keeps the CUDA torch found above
  "$PY" -m pip install -q "${PINS[@]}" >&2
  ready "$PY" || { echo "[bench_gpu] no usable Python with CUDA torch and the pinned packages" >&2; exit 2; }
fi
echo "[bench_gpu] python: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'))" >&2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
timeout 450 "$PY" -m scripts.bench.gpu "$@"
# issue 12: the estimator's peak per stage against torch.cuda.max_memory_allocated on this GPU (world size 1,
# bf16 and fp32, DeepSpeed's default bucket); DSX3D_GPU_MEMORY=0 skips it
if [ "${DSX3D_GPU_MEMORY:-1}" != 0 ]; then
  timeout 300 "$PY" -m scripts.bench.memory --device cuda >&2
fi
# zero bubble: measured idle per stage and step-window ratio, zb-h1 and zb-v against 1f1b (p 2, m 4 8 16; CPU
# ranks on the GPU box: the schedule's order and the engine's overheads, not GPU kernels); DSX3D_GPU_ZB=0 skips it
if [ "${DSX3D_GPU_ZB:-1}" != 0 ]; then
  timeout 500 "$PY" -m scripts.bench.bubble --pp 2 --micro-batches 4 8 16 --rounds 6 \
    --schedules 1f1b zb-h1 zb-h1-auto zb-v zb-v-auto >&2
fi
# issue 32: torch.distributed.pipelining's schedules beside dsx3d's (p 2, m 8 16), CPU ranks with gloo on the GPU
# box's idle cores (a quiet machine for the ratios; one GPU cannot hold two NCCL ranks); DSX3D_GPU_PEER=0 skips it
if [ "${DSX3D_GPU_PEER:-1}" != 0 ]; then
  DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 timeout 600 "$PY" -m scripts.bench.pipeline_peer \
    --micro-batches 8 16 --rounds 12 --no-write > "${OUT:-/tmp}/pipeline_peer.json"
fi
