#!/usr/bin/env bash
# Every check that needs a GPU, as one prepared run of about five minutes on one GPU:
#   1. the cuda-marked tests (pytest -m cuda) that need one GPU;
#   2. a float16 and 3. a bfloat16 smoke run from the CLI, each followed by verify;
#   4. a smoke run with CUDA event timing (NNPD_PROBES_CUDA=1), checked for device time;
#   5. the ensemble-score rate on device-built rows (bench/bench_inference.py);
#   6. one d = 6 job's whole analysis (learned and exact) against a plain forward pass, with
#      the share of the measured FP32 peak (bench/bench_analysis.py);
#   7. the whole `default` profile end to end on one GPU (goal: under 10 minutes), with the
#      learned product's evaluations per second and rows per network call from its timings;
#   8. the cuda-marked tests that need two GPUs, and 9. a two-GPU DDP smoke training with
#      CUDA event timing (NCCL's timed all-reduce): both only when two GPUs are visible.
# It ends with a summary table (check, result, figure). Without CUDA every check is
# reported SKIPPED or NOT RUN with its reason and the exit status is 0 (unless the driver
# lists GPUs that torch cannot see); with a GPU the exit status is 1 when any check fails.
# PYTHON chooses the interpreter (default: .venv/bin/python if present, else python3).
set -uo pipefail        # no -e: a failing check is recorded and the next one still runs
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi

# Seconds each part may take (timeout(1) stops it, and its children, past that); each can
# be set from the environment, for a slower machine. The one-GPU parts but the default
# profile add up to about five minutes; they usually need far less.
LIMIT_PROBE=${LIMIT_PROBE:-20}            # import torch and ask CUDA what it sees
LIMIT_TESTS=${LIMIT_TESTS:-100}           # one pytest process: 15 single-GPU tests, a few seconds each
LIMIT_SMOKE=${LIMIT_SMOKE:-30}            # one smoke run (4 tiny models and their analysis) with CUDA start-up
LIMIT_VERIFY=${LIMIT_VERIFY:-15}          # recompute the checksums of that smoke run's store
LIMIT_EVENTS=${LIMIT_EVENTS:-30}          # a smoke run with CUDA events
LIMIT_BENCH=${LIMIT_BENCH:-20}            # bench_inference, 6 repeats of 245,775 rows
LIMIT_ANALYSIS=${LIMIT_ANALYSIS:-60}      # bench_analysis, 1,024 default-profile cases at d = 6, 3 repeats
LIMIT_DEFAULT=${LIMIT_DEFAULT:-900}       # the default profile end to end (the goal is under 600 s)
LIMIT_TESTS_2GPU=${LIMIT_TESTS_2GPU:-150} # four two-GPU tests, each a torchrun launch
LIMIT_DDP=${LIMIT_DDP:-60}                # a two-GPU DDP smoke training
# The cuda-marked tests that need two GPUs, by name (tests/test_gpu_checks.py keeps this
# in step with the tests that skip below two GPUs).
TWO_GPU_TESTS="two_gpus or two_nccl"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
names=() results=() figures=() failed=0

# record NAME RESULT FIGURE: one row of the summary table.
record() {
  names+=("$1"); results+=("$2"); figures+=("$3")
  [ "$2" = FAIL ] && failed=1
  return 0
}

# part LIMIT LOG COMMAND...: run COMMAND under timeout, its output shown and kept in LOG;
# sets $seconds; returns COMMAND's status (124 or 137 when stopped at LIMIT).
part() {
  local limit=$1 log=$2 start=$SECONDS
  shift 2
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  local status=${PIPESTATUS[0]}
  seconds=$(( SECONDS - start ))
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then echo "(stopped at its ${limit} s limit)" | tee -a "$log"; fi
  return "$status"
}

# failure STATUS LIMIT: the figure of a failed part.
failure() {
  if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo "over its ${2} s limit"; else echo "exit status $1"; fi
}

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

# device_time ROOT: say which phases have device time in the launch's timings.json; fail without train.forward's.
device_time() {
  $PY - "$1/timings.json" <<'CHECK'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    sys.exit(print("phases with device time: none (no timings.json)"))
record = json.load(open(sys.argv[1]))
timed = sorted({name for worker in record["workers"].values() for name, phase in worker["phases"].items()
                if "device_s" in phase})
print(f"phases with device time: {len(timed)} ({', '.join(timed) or 'none'})")
sys.exit(0 if "train.forward" in timed else 1)
CHECK
}

# pytest_tests NAME LIMIT SELECTION: the cuda-marked tests that -k SELECTION picks.
pytest_tests() {
  local log="$work/$1.log" status
  echo "== $1"
  part "$2" "$log" $PY -m pytest -q -m cuda -k "$3" -p no:cacheprovider -rs tests/
  status=$?
  # pytest's last line says how many passed, failed and skipped, and how long it took.
  local counts
  counts=$(tail -n 3 "$log" | grep -E '(passed|failed|skipped|error)' | tail -n 1 | tr -d '=' \
    | sed -E 's/, [0-9]+ (deselected|warnings?)//g; s/^ *//; s/ *$//')
  if [ "$status" -eq 0 ]; then record "$1" PASS "${counts:-$seconds s}"
  elif [ "$status" -eq 5 ]; then record "$1" FAIL "no tests selected"   # pytest: nothing collected
  else record "$1" FAIL "$(failure "$status" "$2")${counts:+: $counts}"; fi
}

# smoke_precision PRECISION: a smoke run at PRECISION on one GPU, then verify its store.
smoke_precision() {
  local name="$1 smoke run + verify" dir="$work/$1" run_s status
  echo "== $name"
  cuda_settings "$dir" "$1" jobs
  part "$LIMIT_SMOKE" "$dir.run.log" $PY nnpd.py run --profile smoke --settings-dir "$dir"
  status=$?
  run_s=$seconds
  if [ "$status" -ne 0 ]; then record "$name" FAIL "run: $(failure "$status" "$LIMIT_SMOKE")"; return; fi
  part "$LIMIT_VERIFY" "$dir.verify.log" $PY nnpd.py verify --profile smoke --settings-dir "$dir" > /dev/null
  status=$?
  tail -n 4 "$dir.verify.log"
  if [ "$status" -ne 0 ]; then record "$name" FAIL "verify: $(failure "$status" "$LIMIT_VERIFY")"; return; fi
  record "$name" PASS "run ${run_s} s, verify ${seconds} s"
}

# events_smoke: a one-GPU smoke run with CUDA event timing, whose timings must hold device time.
events_smoke() {
  local name="CUDA-event timing smoke run" dir="$work/events" status
  echo "== $name"
  cuda_settings "$dir" off jobs
  part "$LIMIT_EVENTS" "$dir.log" env NNPD_PROBES_CUDA=1 $PY nnpd.py run --profile smoke --settings-dir "$dir" \
    > /dev/null
  status=$?
  sed -n '/^timings:/,/^advice:/p' "$dir.log"
  if [ "$status" -ne 0 ]; then
    tail -n 20 "$dir.log"; record "$name" FAIL "$(failure "$status" "$LIMIT_EVENTS")"; return
  fi
  local timed
  if timed=$(device_time "$dir/out"); then record "$name" PASS "${seconds} s, ${timed%% (*}"
  else record "$name" FAIL "${timed%% (*}"; fi
}

# default_profile: the whole default profile on one GPU, with the learned product's throughput from its timings.
default_profile() {
  local name="default profile end to end" dir="$work/default" status
  echo "== $name"
  cuda_settings "$dir" off jobs
  part "$LIMIT_DEFAULT" "$dir.log" $PY nnpd.py run --profile default --settings-dir "$dir" > /dev/null
  status=$?
  sed -n '/^timings:/,/^advice:/p' "$dir.log"
  if [ "$status" -ne 0 ]; then
    tail -n 20 "$dir.log"; record "$name" FAIL "$(failure "$status" "$LIMIT_DEFAULT")"; return
  fi
  local rate
  rate=$($PY - "$dir/out/timings.json" <<'RATE'
import json, sys
learned = json.load(open(sys.argv[1])).get("throughput", {}).get("product.learned", {})
print(f"{learned.get('evaluations_per_s', 0) / 1e6:.3g} M evaluations/s, {learned.get('rows_per_call', 0):,} rows per call")
RATE
)
  record "$name" PASS "${seconds} s, learned $rate"
}

# ddp_events: a two-GPU DDP smoke training with CUDA event timing (train.communicate is NCCL's all-reduce).
ddp_events() {
  local name="two-GPU DDP event timing (NCCL)" dir="$work/events-ddp" status
  echo "== $name"
  cuda_settings "$dir" off ddp
  part "$LIMIT_DDP" "$dir.log" env NNPD_PROBES_CUDA=1 CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0,1}" \
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 nnpd.py train --profile smoke --settings-dir "$dir" \
    > /dev/null
  status=$?
  sed -n '/^timings:/,/^advice:/p' "$dir.log"
  if [ "$status" -ne 0 ]; then
    tail -n 20 "$dir.log"; record "$name" FAIL "$(failure "$status" "$LIMIT_DDP")"; return
  fi
  local timed
  if timed=$(device_time "$dir/out"); then
    case "$timed" in
      *train.communicate*) record "$name" PASS "${seconds} s, ${timed%% (*} incl. train.communicate" ;;
      *) record "$name" FAIL "no device time for train.communicate" ;;
    esac
  else record "$name" FAIL "${timed%% (*}"; fi
}

# bench NAME LIMIT LOG SCRIPT ARGS...: a bench on cuda; its figure is the line it starts with "figure: ".
bench() {
  local name=$1 limit=$2 log="$work/$3.log" status
  shift 3
  echo "== $name"
  part "$limit" "$log" $PY "$@"
  status=$?
  if [ "$status" -ne 0 ]; then record "$name" FAIL "$(failure "$status" "$limit")"; return; fi
  record "$name" PASS "$(sed -n 's/^figure: //p' "$log" | tail -n 1)"
}

# The machine: what the driver and torch see. The probe prints "GPUS BF16 ABOUT".
command -v nvidia-smi > /dev/null && timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
probe=$(timeout "$LIMIT_PROBE" $PY - <<'PROBE' 2>&1
import os, torch
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
bf16 = int(count > 0 and torch.cuda.is_bf16_supported())
if torch.version.cuda is None:
    about = f"torch {torch.__version__} is built without CUDA"
elif count == 0:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    about = f"no CUDA device visible to torch {torch.__version__} (CUDA {torch.version.cuda}" + \
        ("" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}") + ")"
else:
    about = f"{count} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
print(count, bf16, about)
PROBE
)
probe_status=$?
read -r gpus bf16 about <<< "$(echo "$probe" | tail -n 1)"
# A probe that fails, or a driver showing GPUs that torch cannot use (a CPU-only torch, say),
# is a failure of its own: otherwise a broken GPU set-up would read as "no GPU, all skipped".
driver_gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
if [ "$probe_status" -ne 0 ] || ! [[ "$gpus" =~ ^[0-9]+$ ]]; then
  record "CUDA probe" FAIL "$(failure "$probe_status" "$LIMIT_PROBE"): $(echo "$probe" | tail -n 1)"
  gpus=0 about="the CUDA probe failed"
elif [ "$gpus" -eq 0 ] && [ "$driver_gpus" -gt 0 ] && [ -z "${CUDA_VISIBLE_DEVICES+set}" ]; then
  record "CUDA probe" FAIL "the driver lists $driver_gpus GPU(s), torch none: $about"
fi
echo "$about"

if [ "$gpus" -ge 1 ]; then
  pytest_tests "cuda tests, one GPU" "$LIMIT_TESTS" "not ($TWO_GPU_TESTS)"
  smoke_precision float16
  if [ "$bf16" = 1 ]; then smoke_precision bfloat16
  else record "bfloat16 smoke run + verify" SKIPPED "this GPU does not support bfloat16"; fi
  events_smoke
  bench "inference rate (bench_inference)" "$LIMIT_BENCH" bench-inference \
    bench/bench_inference.py --device cuda --repeats 6
  bench "analysis (bench_analysis)" "$LIMIT_ANALYSIS" bench-analysis \
    bench/bench_analysis.py --device cuda --cases 1024 --repeats 3
  default_profile
else
  # Nothing below could run: say so for each check, without starting pytest or a launch.
  for name in "cuda tests, one GPU" "float16 smoke run + verify" "bfloat16 smoke run + verify" \
              "CUDA-event timing smoke run" "inference rate (bench_inference)" "analysis (bench_analysis)" \
              "default profile end to end"; do
    record "$name" SKIPPED "$about"
  done
fi
if [ "$gpus" -ge 2 ]; then
  pytest_tests "cuda tests, two GPUs" "$LIMIT_TESTS_2GPU" "$TWO_GPU_TESTS"
  ddp_events
else
  record "cuda tests, two GPUs" "NOT RUN" "needs two GPUs ($gpus visible)"
  record "two-GPU DDP event timing (NCCL)" "NOT RUN" "needs two GPUs ($gpus visible)"
fi

echo
echo "== summary of bench/gpu_checks.sh ($(( SECONDS - started )) s)"
printf '%-38s %-8s %s\n' check result figure
for i in "${!names[@]}"; do
  printf '%-38s %-8s %s\n' "${names[$i]}" "${results[$i]}" "${figures[$i]}"
done
exit "$failed"
