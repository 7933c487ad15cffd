#!/usr/bin/env bash
# Every check that needs a GPU, in one go (for a machine with CUDA): the cuda-marked
# tests (single GPU at off/float16/bfloat16, restore onto cuda and cpu, two-GPU NCCL
# when two GPUs are visible), then a float16 and a bfloat16 smoke run from the CLI, then a
# smoke run with CUDA event timing (NNPD_PROBES_CUDA=1) printing its timing table with
# device time (and a two-GPU DDP one when two GPUs are visible), then the default
# profile's inference rate on the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
$PY -m pytest -q -m cuda -p no:cacheprovider tests/ -rs
status=$?
work=$(mktemp -d)

# cuda_settings DIR PRECISION PARALLEL: the smoke settings on CUDA, writing to DIR/out.
cuda_settings() {
  mkdir -p "$1"
  cp settings_analysis.py "$1/"
  { cat settings_training.py; cat <<PATCH

_repository_make_settings = make_settings


def make_settings(profile):
    settings = _repository_make_settings(profile)
    settings["runtime"]["device"] = "cuda"
    settings["runtime"]["parallel"] = "$3"
    settings["training"]["precision"] = "$2"
    settings["output"]["root"] = "$1/out"
    return settings
PATCH
  } > "$1/settings_training.py"
}

for precision in float16 bfloat16; do
  cuda_settings "$work/$precision" "$precision" jobs
  start=$(date +%s)
  $PY nnpd.py run --profile smoke --settings-dir "$work/$precision" || status=1
  echo "smoke run at $precision: $(( $(date +%s) - start )) s"
  $PY nnpd.py verify --profile smoke --settings-dir "$work/$precision" | tail -4 || status=1
done

# device_time ROOT: say which phases have device time in the launch's timings.json; fail without any.
device_time() {
  $PY - "$1/timings.json" <<'CHECK'
import json, sys
record = json.load(open(sys.argv[1]))
timed = sorted({name for worker in record["workers"].values() for name, phase in worker["phases"].items()
                if "device_s" in phase})
print(f"phases with device time: {', '.join(timed) or 'none'}")
sys.exit(0 if "train.forward" in timed else 1)
CHECK
}

echo "smoke run with CUDA event timing (NNPD_PROBES_CUDA=1):"
cuda_settings "$work/events" off jobs
NNPD_PROBES_CUDA=1 $PY nnpd.py run --profile smoke --settings-dir "$work/events" > "$work/events.log" 2>&1 \
  || { status=1; tail -20 "$work/events.log"; }
sed -n '/^timings:/,/^advice:/p' "$work/events.log"
device_time "$work/events/out" || status=1
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  echo "two-GPU DDP smoke training with CUDA event timing (train.communicate is NCCL's all-reduce):"
  cuda_settings "$work/events-ddp" off ddp
  NNPD_PROBES_CUDA=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} timeout 600 $PY -m torch.distributed.run \
    --standalone --nproc_per_node=2 nnpd.py train --profile smoke --settings-dir "$work/events-ddp" \
    > "$work/events-ddp.log" 2>&1 || { status=1; tail -20 "$work/events-ddp.log"; }
  sed -n '/^timings:/,/^advice:/p' "$work/events-ddp.log"
  device_time "$work/events-ddp/out" || status=1
fi

echo "default profile's inference rate on the GPU (16,385 candidates x 15 observations, mlp [64]*4):"
$PY bench/bench_inference.py --device cuda --repeats 6 || status=1
exit $status
