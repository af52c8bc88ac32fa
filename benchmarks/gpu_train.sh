#!/usr/bin/env bash
# GPU runs for the shipped model, one device call each (logs and results under $OUT):
#   STEP=probe  compile time of the target train step (ONLY=variants, LIMIT=s each)
#   STEP=train  the one-command training (python -m dspark_jax.train, MINUTES=7, TRAIN_ARGS=more flags) -> $OUT/run/model,
#               in a fresh work directory (WORK_DIR=path to resume one);
#               PACKAGES_ARCHIVE=zip reads the corpus packages from an archive made with
#               `python -m dspark_jax.train.corpus pack` (the machine's own versions differ from the pins)
#   STEP=speed  benchmarks/tiny_model.py on the GPU with the shipped model (tau, calibration, tokens/s,
#               where speculative and target-only outputs part), float32 and TF32 matmuls
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
case "${STEP:-probe}" in
  probe) timeout 560 python3 benchmarks/compile_probe.py --only "${ONLY:-as_trained,sinkhorn_unrolled}" --limit "${LIMIT:-270}" \
           2>&1 | tail -n 50 > "$OUT/probe.log"; echo "probe rc=$?"; cat "$OUT/probe.log" ;;
  train) # a fresh work directory per call: a warm machine keeps /tmp, and a finished run there would be resumed
         work=${WORK_DIR:-$(mktemp -d /tmp/dspark_work.XXXXXX)}
         timeout 580 python3 -m dspark_jax.train "$OUT/run" --minutes "${MINUTES:-7}" ${TRAIN_ARGS:-} --work-dir "$work" \
           ${PACKAGES_ARCHIVE:+--packages-archive "$PACKAGES_ARCHIVE"} \
           2>&1 | tr '\r' '\n' | grep -v '^drafter:\|^target:' | tail -n 80 > /tmp/train.log; echo "train rc=$?"
         tail -n 30 /tmp/train.log ;;  # $OUT keeps its 8 files for the model, log and plot
  speed) # float32 matmuls in float32 (the default) and in TF32: does greedy DSpark == target-only hold?
         for prec in highest default; do
           d="$OUT/speed_$prec"; mkdir -p "$d"
           OUT="$d" timeout "${SPEED_LIMIT:-290}" python3 benchmarks/tiny_model.py --prompts 8 --new-tokens 128 \
             --single "${SINGLE:-2}" --matmul-precision $prec 2>&1 | grep -v Warning | tee "$d/speed.log"
         done ;;
esac
