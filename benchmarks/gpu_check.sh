#!/usr/bin/env bash
# GPU check for a machine with one CUDA device: what fulmen needs from it, the GPU-marked tests,
# and the `fulmen bench` table for the GPT and LLaMA models. Run from the repository root:
#
#   bash benchmarks/gpu_check.sh [OUTDIR] [smoke|tests|table|diag|all|scale]
#
# On an H100 (2026-11-24): smoke about 1 min, tests about 2 min (2,985 GPU tests on 12 workers), table about
# 3 min per model with REPEAT=2 (MODELS, BACKENDS, MODE and REPEAT choose), diag about 1 min per model.
# scale (not part of all): llama-1b and gpt2-124m training steps, bf16 autocast, under eager, torch.compile,
# torch.compile max-autotune-no-cudagraphs and fulmen, each in a fresh process stopped at its time limit, all
# within SCALE_BUDGET_S (default 450 s): OUTDIR/scale.json and scale.md (python -m fulmen.bench.scale --help).
# SCALE_TOY=1 runs the same on the CPU at toy size (2 layers, width 128, 64 tokens, one thread); SCALE_ARGS adds options.
#
# fulmen is taken from this checkout (PYTHONPATH), so nothing needs installing beyond torch,
# triton and pytest. Logs and JSON land in OUTDIR (default ./gpu-results).
set -u
out=${1:-gpu-results}; what=${2:-all}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if [[ $what == smoke || $what == all ]]; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $py -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  } 2>&1 | tee "$out/env.txt"
  $py -m fulmen.bench.cli bench --device cuda --model gpt-tiny,llama-tiny --mode both \
      --backends eager,fulmen-sync,fulmen --steps 5 --verbose 2>&1 | tee "$out/smoke.txt"
fi
if [[ $what == tests || $what == all ]]; then
  timeout "${TEST_TIMEOUT:-420}" $py -m pytest -m gpu -q -n "${WORKERS:-12}" -p no:cacheprovider \
      -o addopts="" --maxfail=200 -rf 2>&1 | tee "$out/tests.txt" | tail -60
fi
if [[ $what == table || $what == all ]]; then
  models=${MODELS:-gpt-small,llama-small}
  $py -m fulmen.bench.cli bench --device cuda --model "$models" --mode "${MODE:-train}" \
      --backends "${BACKENDS:-eager,torch.compile,fulmen,fulmen-cudagraphs}" --isolate --repeat "${REPEAT:-3}" \
      --json "$out/table-${models//,/-}.json" 2>&1 | tee "$out/table-${models//,/-}.txt"
fi
if [[ $what == diag || $what == all ]]; then
  models=${MODELS:-gpt-small,llama-small}
  for m in ${models//,/ }; do
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) \
      $py benchmarks/profile_gpu.py --model "$m" 2>&1 | tee "$out/diag-$m.txt" | grep -E "^(==|first|fully|  lowering)"
  done
fi
if [[ $what == scale ]]; then
  toy=(); [[ ${SCALE_TOY:-0} == 1 ]] && toy=(--toy)
  # shellcheck disable=SC2086  # SCALE_ARGS is a list of options
  $py -m fulmen.bench.scale --out "$out" ${toy[@]+"${toy[@]}"} ${SCALE_ARGS:-} 2>&1 | tee "$out/scale.txt"
fi
