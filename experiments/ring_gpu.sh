#!/usr/bin/env bash
# Ring attention (context parallelism) on the GPUs of one machine: the sharded forward and backward
# checked against one GPU's float64 reference, then timed into results/<gpu>/ring.csv: world size 1
# (the ring degenerates to one local call: the baseline every larger ring is read against), and, when
# more than one GPU is visible, torchrun over every visible GPU. Each timing row holds the ring's time
# per pass and per step, its compute alone, its transfers alone, the hidden fraction of the
# communication and the overlap model's prediction (harness/ring.py says how each is measured).
#
#     experiments/ring_gpu.sh                  # everything (a few minutes on an 8-GPU H200 machine)
#     experiments/ring_gpu.sh check time1      # some parts: check time1 timeN
#     ARGS="--causal yes --N 65536" experiments/ring_gpu.sh timeN   # extra flags for the timing runs
#
# Logs go to ${LOG:-ring_gpu.log}; the GPU topology (NVLink or PCIe between the GPUs, which sets the
# link bandwidth the model needs) is recorded there first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
parts=${*:-check time1 timeN}
log=${LOG:-ring_gpu.log}
has() { [[ " $parts " == *" $1 "* ]]; }
run() { echo "+ $*" | tee -a "$log"; "$@" 2>&1 | tee -a "$log" | tail -${TAIL:-40}; }
gpus=$($py -c "import torch; print(torch.cuda.device_count())")
torchrun=($py -m torch.distributed.run --standalone --nproc-per-node "$gpus")  # torchrun, whether or not on PATH

nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv >> "$log" 2>&1
nvidia-smi topo -m >> "$log" 2>&1
echo "visible GPUs: $gpus" | tee -a "$log"
if has check; then
  run timeout ${CHECK_S:-300} $py -m harness ring --check --world-size 1
  if (( gpus > 1 )); then
    run timeout ${CHECK_S:-300} "${torchrun[@]}" -m harness ring --check
  fi
fi
if has time1; then
  run timeout ${TIME_S:-600} $py -m harness ring --time --world-size 1 ${ARGS:-}
fi
if has timeN; then
  if (( gpus > 1 )); then
    run timeout ${TIME_S:-600} "${torchrun[@]}" -m harness ring --time ${ARGS:-}
  else
    echo "timeN: one GPU visible, no ring to time across GPUs" | tee -a "$log"
  fi
fi
