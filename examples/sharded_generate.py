"""Generate with the shipped DeepSeek-V4 + DSpark pair spread over a (data, model) mesh of 8
devices, and check that the tokens are those of the same model on one device.

On a CPU host the 8 devices are virtual (``--xla_force_host_platform_device_count=8``, set below
before JAX starts); on a host with 8 GPUs the same script spreads the model over them.

    python examples/sharded_generate.py              # data=2 x model=4
    python examples/sharded_generate.py --data 1     # model=8: heads, vocabulary, experts over 8
    python examples/sharded_generate.py --data 8     # data=8: requests and experts over 8

Requests go by slot over ``data`` (8 prompts: 8 slots, which divide by every data size), attention
heads, the vocabulary and the shared expert over ``model``, the routed experts over both (the
rules are in ``dspark_jax.sharding``; docs/sharding.md).
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dspark_jax  # noqa: E402
from dspark_jax import sharding  # noqa: E402
from dspark_jax.decoding.generate import DEFAULT_MODEL_DIR, default_model  # noqa: E402

PROMPTS = ["import os\nimport sys\n\n\ndef main():", "class Stack:\n    def __init__(self):",
           "def fibonacci(n):", "for i in range(10):", "def read_lines(path):", "import numpy as np",
           "class Point:", "def is_prime(n):"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=int, default=2, help="devices of the data axis (the rest: model)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    n = len(jax.devices())
    mesh = sharding.make_mesh(model=n // args.data, data=args.data)
    # each tensor is placed on its devices as it is read: no device ever holds the whole model
    model = dspark_jax.load(DEFAULT_MODEL_DIR, dtype=jnp.float32, mesh=mesh, progress=False)
    per_device = sharding.shard_bytes(model.module, sharding.param_shardings(model.module, model.config, mesh))
    print(f"{model} on {n} {jax.devices()[0].platform} devices, mesh {dict(mesh.shape)}: "
          f"{per_device / 2**20:.1f} MiB of weights per device")

    sampling = dspark_jax.SamplingParams(max_new_tokens=args.max_new_tokens)  # greedy
    results = dspark_jax.generate(PROMPTS, model=model, sampling=sampling)
    for prompt, r in zip(PROMPTS, results):
        print("-" * 60)
        print(prompt + r.text)
    print("-" * 60)
    stats = results[0].stats
    print(f"mean accept length {sum(r.stats['mean_accept_length'] for r in results) / len(results):.2f}, "
          f"{sum(len(r.tokens) for r in results) / max(r.stats['decode_s'] for r in results):.1f} tok/s "
          f"({stats['slots']} slots; compile {stats['compile_s']:.0f} s)")

    single = dspark_jax.generate(PROMPTS, model=default_model(), sampling=sampling)
    same = all(a.tokens == b.tokens for a, b in zip(results, single))
    print(f"tokens identical to the model on one device: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
