#!/usr/bin/env bash
# The kernels inside real models, on one GPU: the GPU tests of the shape-stable host path, the custom
# ops (torch.compile, CUDA graphs) and the transformers integration (every test of those files runs
# on the GPU, not only the gpu-marked ones); then the measurements into
# results/<gpu>/: the decode loop with a growing cache against a fixed one (decode.csv), generate()
# with the dynamic and the static (compiled, CUDA-graphed) cache and a training step of GPT-2- and
# Llama-shaped transformers models (generate/runs.csv), and the
# stage C cells of the forward and backward grid at N = 4096 beside cuDNN and FA2 (runs.csv), so a
# change of the host path that cost kernel speed shows.
#
#     experiments/models_gpu.sh                 # everything (~15 minutes on an H200)
#     experiments/models_gpu.sh tests decode    # some parts: tests decode generate grid latency
#
# Logs go to ${LOG:-models_gpu.log}. Rows are appended as measured, so an interrupted part loses
# only the row it was measuring.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
parts=${*:-tests decode generate grid latency}
log=${LOG:-models_gpu.log}
has() { [[ " $parts " == *" $1 "* ]]; }
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log" | tail -${TAIL:-40}; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv >> "$log" 2>&1
$py -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    >> "$log" 2>&1
if has tests; then
  run timeout ${TEST_S:-420} $py -m pytest -q -n 8 -p no:cacheprovider -m "not slow" tests/test_host_path.py \
      tests/test_custom_ops.py tests/test_hf.py tests/test_stage_c_backward.py tests/test_stage_c_shapes.py \
      tests/test_backward.py tests/test_generate_cli.py tests/test_key_ranges.py
fi
if has decode; then
  run timeout ${DECODE_S:-420} $py -m harness decode
fi
if has generate; then
  for model in gpt2 llama; do
    run timeout ${GENERATE_S:-420} $py -m harness generate --model $model --impls ${IMPLS:-a,b,c,sdpa} \
        --dtype bf16 --batch 4 --prompt-len 128 --new-tokens 64 --train-batch 8 --train-seq 2048 --reps 5 --warmup 2 \
        --cache ${CACHES:-dynamic,static}
  done
fi
if has grid; then
  run timeout ${GRID_S:-420} $py -m harness sweep --stages c --peers flash,cudnn --N 4096 --D 64,128 --causal both \
      --dtype bf16 --pass fwd,bwd
fi
if has latency; then
  run timeout 120 $py -m harness latency
fi
