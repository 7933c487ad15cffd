#!/usr/bin/env bash
# Every check that needs a GPU, in one go (for a machine with CUDA): the cuda-marked
# tests (single GPU at off/float16/bfloat16, restore onto cuda and cpu, two-GPU NCCL
# when two GPUs are visible), then a float16 and a bfloat16 smoke run from the CLI, then the
# default profile's inference rate on the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
$PY -m pytest -q -m cuda -p no:cacheprovider tests/ -rs
status=$?
work=$(mktemp -d)
for precision in float16 bfloat16; do
  mkdir -p "$work/$precision"
  cp settings_analysis.py "$work/$precision/"
  { cat settings_training.py; cat <<PATCH

_repository_make_settings = make_settings


def make_settings(profile):
    settings = _repository_make_settings(profile)
    settings["runtime"]["device"] = "cuda"
    settings["training"]["precision"] = "$precision"
    settings["output"]["root"] = "$work/$precision/out"
    return settings
PATCH
  } > "$work/$precision/settings_training.py"
  start=$(date +%s)
  $PY nnpd.py run --profile smoke --settings-dir "$work/$precision" || status=1
  echo "smoke run at $precision: $(( $(date +%s) - start )) s"
  $PY nnpd.py verify --profile smoke --settings-dir "$work/$precision" | tail -4 || status=1
done
echo "default profile's inference rate on the GPU (16,385 candidates x 15 observations, mlp [64]*4):"
$PY bench/bench_inference.py --device cuda --repeats 6 || status=1
exit $status
