#!/usr/bin/env bash
# run_clm.py under `accelerate launch`: a tiny local Llama checkpoint fine-tuned with dsx3d.Trainer on 4
# processes, pp 2 x dp 2. Runs on a CPU-only machine (gloo) as on GPUs.
#
#   bash scripts/examples/accelerate.sh [WORK_DIR]      # default WORK_DIR: runs/example-accelerate
#
# Steps: create the checkpoint (save_pretrained), write a recipe for it, generate the accelerate config and the
# DeepSpeed JSON it names (`dsx3d accelerate-config`), then launch. The script reads the layout from
# ACCELERATE_DEEPSPEED_CONFIG_FILE, which accelerate sets. `accelerate launch ... -m dsx3d.train RECIPE`
# launches the recipe's own training the same way.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
WORK=${1:-runs/example-accelerate}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)  # absolute: the recipe and the accelerate config name files in it

[ -f "$WORK/tiny-llama/config.json" ] || python scripts/examples/run_clm.py --make_tiny "$WORK/tiny-llama"

cat > "$WORK/recipe.yaml" <<YAML
model:
  name_or_path: $WORK/tiny-llama
parallel: {dp: 2, tp: 1, pp: 2}
cluster: {nodes: 1, gpus_per_node: 4}
train: {micro_batch_size: 2, gradient_accumulation_steps: 4, seq_len: 64, dtype: fp32, grad_clip: 1.0}
zero: {stage: 1}
YAML

python -m dsx3d accelerate-config "$WORK/recipe.yaml" -o "$WORK/accelerate.yaml"

# --main_process_port 0: a free port, so concurrent runs on one machine do not collide
accelerate launch --config_file "$WORK/accelerate.yaml" --main_process_port 0 \
    scripts/examples/run_clm.py --model_name_or_path "$WORK/tiny-llama" --output_dir "$WORK/clm" \
    --block_size 64 --max_steps 20 --do_train --do_eval --logging_steps 5 --report_to none --save_strategy no
