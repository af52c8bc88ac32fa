#!/usr/bin/env bash
# One GPU run: kernel benchmark, then the decode benchmark; logs and results under $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
KERNELS_S=${KERNELS_S:-590}
timeout "$KERNELS_S" python3 benchmarks/kernels.py --device-time --budget-s $((KERNELS_S - 110)) 2>&1 \
  | tail -n 400 > "$OUT/kernels.log"; echo "kernels rc=$?"
timeout "${DECODE_S:-240}" python3 benchmarks/decode.py --layers 4 --experts 128 --batch 1 --context 2048 --rounds 10 \
  2>&1 | tail -n 200 > "$OUT/decode.log"; echo "decode rc=$?"
tail -n 5 "$OUT/kernels.log" "$OUT/decode.log"
