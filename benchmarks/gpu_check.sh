#!/usr/bin/env bash
# All of dpsweep's GPU measurements in one command, on any CUDA machine with dpsweep installed (make setup):
#
#   benchmarks/gpu_check.sh                   # results in gpu_check/
#   benchmarks/gpu_check.sh /scratch/gpu_run  # results there
#   STEPS="stages speed" benchmarks/gpu_check.sh   # some steps only (in this order: env stages speed
#                                                  #   speed_224 profile probes_cnn probes_vgg fit oom
#                                                  #   oom_expandable fused throughput packing packing_long
#                                                  #   sysmetrics)
#   STEPS="fit oom" PROBES_CSV=analysis/data/gpu_probes_h100.csv benchmarks/gpu_check.sh
#                                                  # the largest-batch check on the committed probes
#   PYTHON=/opt/venv/bin/python PARALLEL=4 OOM_CASES=cnn SPEED_ARGS=--quick benchmarks/gpu_check.sh
#
# Steps (each logs to RESULTS/<step>.log; a failing step does not stop the others):
#   env         nvidia-smi, the GPU's name, driver, torch and CUDA versions          -> env.txt
#   stages      benchmarks/cuda_stages.py: dpsweep's four logged memory stages, iteration and reserved
#               peaks against an independent torch.cuda.memory_allocated() reading  -> stages.json
#   speed       benchmarks/training_speed.py --device cuda: the speed goals         -> speed.json
#   speed_224   its cache goal again at 224 px, VGG16's own input (Flowers-102 at downscale 1) -> speed_224.json
#   profile     benchmarks/profile_step.py: GPU busy share and host time by package (ours or the
#               libraries') of the settings behind the speed goals                  -> profile.json
#   probes_cnn  dpsweep-memory probe of the CNN: hidden units x batch size x image size, DP hooks, DP
#               ghost and non-private, one fresh process per config, PARALLEL at once -> probes_cnn.csv
#   probes_vgg  the same for vgg16_frozen (random weights, no feature cache; digits at 224, 112 and 56
#               pixels: Flowers-102's dataset.downscale=1,2,4 sizes)               -> probes_vgg.csv
#   fit         both tables as gpu_probes.csv (or PROBES_CSV, a table from an earlier run, when set);
#               dpsweep-memory fit (memory_model.json, the per-stage formulas) and
#               benchmarks/memory_fit.py (24 probes fitted per model, the rest scored)
#   oom         benchmarks/oom_check.py: the largest batch predicted for the card runs; the real limit
#               is found by running larger batches until CUDA runs out of memory  -> oom.json
#   oom_expandable  the same for the cnn under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less
#               fragmentation: how much of the 2% headroom the default allocator needs) -> oom_expandable.json
#   fused       benchmarks/fused_check.py: the compiled fused DP step (CUDA graphs) against the eager one, one
#               pass and two, at example and user level; fused runs beside hooks runs and beside user-level
#               DP-SGD's own steps on the card (same ε and steps)                 -> fused.json
#   throughput  benchmarks/throughput.py: the fused DP step's and Opacus hooks' and ghost's step time over
#               the non-private step, cnn and cached VGG16 head, B=64 and 256      -> throughput.json
#   packing     benchmarks/packing.py: K trials per device (launcher.trials_per_device): trials per hour of a
#               16-trial cnn grid at K = 1, 2, 4, 8, 16; auto's K against the GPU memory in use; K + 1
#               trials without a memory model, the ones out of memory FAILED  -> packing.json
#   packing_long  benchmarks/packing_long.py: K = 1, 2, 4, 8, 16 training-dominated DP trials per device (cnn at
#               32 px and the cached VGG16 head at 224 px, B = 256, each ~60 s of training alone), default sharing
#               and CUDA MPS: trials per GPU-hour, busy share, slowdowns, peak memory against the prediction, ε
#               against alone. About 35-40 min with every case (its own limit: PACKING_LONG_TIMEOUT_S, 2700 s;
#               rows are saved as measured); PACKING_LONG_ARGS="--cases cnn32 --ks 1,8" fits one 10-min call
#                                                                                -> packing_long.json
#   sysmetrics  benchmarks/system_metrics_gpu.py: the GPU memory MLflow's system metrics log, by batch
#               size, for non-private and DP runs                                -> sysmetrics.json
# Exit status: the number of steps that failed (0: all passed).
set -u
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
R=$(mkdir -p "${1:-gpu_check}" && cd "${1:-gpu_check}" && pwd)
STEPS=${STEPS:-env stages speed speed_224 profile probes_cnn probes_vgg fit oom oom_expandable fused throughput packing packing_long sysmetrics}
PARALLEL=${PARALLEL:-16}          # probes at once: each is its own process with its own allocator
STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-1800}
export PYTHONUNBUFFERED=1
unset MLFLOW_TRACKING_URI
failed=0

step() {  # step NAME COMMAND...: run it with a time limit, logging to $R/NAME.log
  local name=$1; shift
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name: $*"
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT_S" bash -c '"$@"' "$name" "$@" > >(tee "$R/$name.log") 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || failed=$((failed + 1))
}

probe() {  # probe NAME OVERRIDES...: the DP (hooks, ghost) and non-private probes of one grid
  local name=$1; shift
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1  # PARALLEL processes share the CPU cores
  "$PY" -m dpsweep.cli.memory probe --csv "$R/$name.dp.csv" "$@" dp=dpsgd dp.noise_multiplier=1.0 \
      dp.grad_sample_mode=hooks,ghost "tracking.uri=sqlite:///$R/probes.db" "launcher.max_parallel=$PARALLEL" \
    && "$PY" -m dpsweep.cli.memory probe --csv "$R/$name.off.csv" "$@" dp=off \
      "tracking.uri=sqlite:///$R/probes.db" "launcher.max_parallel=$PARALLEL" \
    && "$PY" - "$R/$name.csv" "$R/$name.dp.csv" "$R/$name.off.csv" <<'EOF'
import sys, pandas as pd
out, *parts = sys.argv[1:]
table = pd.concat([pd.read_csv(p) for p in parts], ignore_index=True)
table.insert(0, "probed_on", pd.Timestamp.now(tz="UTC").date().isoformat())
table.drop(columns=["run_id", "config_hash"], errors="ignore").to_csv(out, index=False)
print(f"{len(table)} probes in {out}")
EOF
}

fit() {
  if [ -n "${PROBES_CSV:-}" ]; then
    cp "$PROBES_CSV" "$R/gpu_probes.csv" || return 1
  else "$PY" - "$R/gpu_probes.csv" "$R"/probes_cnn.csv "$R"/probes_vgg.csv <<'EOF' || return 1
import sys, pandas as pd
out, *parts = sys.argv[1:]
pd.concat([pd.read_csv(p) for p in parts], ignore_index=True).to_csv(out, index=False)
EOF
  fi
  "$PY" -m dpsweep.cli.memory fit --csv "$R/gpu_probes.csv" --out "$R/memory_model.json" \
    && "$PY" benchmarks/memory_fit.py --csv "$R/gpu_probes.csv" --json "$R/memory_fit.json"
}

gpu_env() {
  nvidia-smi
  "$PY" - <<'EOF'
import platform, torch, opacus
p = torch.cuda.get_device_properties(0)
print(f"gpu: {p.name}, {p.total_memory} bytes; driver: {torch.cuda.driver_version() if hasattr(torch.cuda, 'driver_version') else '?'}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), opacus {opacus.__version__}, python {platform.python_version()}")
EOF
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
}

export PY R PARALLEL PROBES_CSV
export -f probe fit gpu_env  # the steps run in a child bash, under timeout
step env gpu_env
[ -f "$R/env.log" ] && cp "$R/env.log" "$R/env.txt"
step stages "$PY" benchmarks/cuda_stages.py --device cuda --json "$R/stages.json"
step speed "$PY" benchmarks/training_speed.py --device cuda --json "$R/speed.json" ${SPEED_ARGS:-}
step speed_224 "$PY" benchmarks/training_speed.py --device cuda --sections cache --cache-image-size 224 \
  --json "$R/speed_224.json" ${SPEED_ARGS:-}
step profile "$PY" benchmarks/profile_step.py --device cuda --json "$R/profile.json"
step probes_cnn probe probes_cnn model=cnn dataset.image_size=28,224 train.batch_size=8,32,128 \
  model.hidden_units=16,128,512
step probes_vgg probe probes_vgg model=vgg16_frozen model.pretrained=false model.feature_cache=false \
  dataset.image_size=56,224 train.batch_size=8,32,128 model.hidden_units=64,256,1024
step fit fit
oom_cases=()
for c in ${OOM_CASES:-cnn vgg16_frozen}; do oom_cases+=(--case "$c"); done
step oom "$PY" benchmarks/oom_check.py --memory-model "$R/memory_model.json" --json "$R/oom.json" "${oom_cases[@]}"
step oom_expandable env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  "$PY" benchmarks/oom_check.py --memory-model "$R/memory_model.json" --json "$R/oom_expandable.json" --case cnn
step fused "$PY" benchmarks/fused_check.py --device cuda --json "$R/fused.json"
step throughput "$PY" benchmarks/throughput.py --device cuda --json "$R/throughput.json" ${THROUGHPUT_ARGS:-}
step packing "$PY" benchmarks/packing.py --json "$R/packing.json" ${PACKING_ARGS:-}
STEP_TIMEOUT_S=${PACKING_LONG_TIMEOUT_S:-2700} step packing_long "$PY" benchmarks/packing_long.py \
  --json "$R/packing_long.json" ${PACKING_LONG_ARGS:-}
step sysmetrics "$PY" benchmarks/system_metrics_gpu.py --json "$R/sysmetrics.json"
echo "gpu_check: $failed step(s) failed; results in $R"
exit "$failed"
