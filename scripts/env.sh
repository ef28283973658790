# Sourced by the scripts: one thread per rank, a project-private extension cache, quiet libraries.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1
export PATH="$PWD/.venv/bin:$PATH"
