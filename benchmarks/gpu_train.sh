#!/usr/bin/env bash
# GPU runs for the shipped model, one device call each (logs and results under $OUT):
#   STEP=probe  compile time of the target train step (as trained vs Sinkhorn unrolled)
#   STEP=train  the one-command training (python -m dspark_jax.train, 7 minutes) -> $OUT/run/model
#   STEP=speed  benchmarks/tiny_model.py on the GPU with the shipped model (tau, calibration, tokens/s)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
case "${STEP:-probe}" in
  probe) timeout 560 python3 benchmarks/compile_probe.py --only as_trained,sinkhorn_unrolled --limit 270 \
           2>&1 | tail -n 50 > "$OUT/probe.log"; echo "probe rc=$?"; cat "$OUT/probe.log" ;;
  train) timeout 580 python3 -m dspark_jax.train "$OUT/run" --minutes "${MINUTES:-7}" --work-dir /tmp/dspark_work \
           2>&1 | tr '\r' '\n' | grep -v '^drafter:\|^target:' | tail -n 80 > "$OUT/train.log"; echo "train rc=$?"
         tail -n 30 "$OUT/train.log" ;;
  speed) timeout 560 python3 benchmarks/tiny_model.py --prompts 8 --new-tokens 128 2>&1 | tail -n 20 > "$OUT/speed.log"
         echo "speed rc=$?"; tail -c 3000 "$OUT/speed.log" ;;
esac
