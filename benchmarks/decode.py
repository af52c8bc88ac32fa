"""Per-user decode speed: DSpark rounds vs target-only decoding, at real Flash dimensions.

A round's cost does not depend on how many drafts are accepted (static shapes), so one timing of
the speculative round and one of the target-only step give the speed-up for any accept length τ
(tokens per round): speedup(τ) = τ * t_target / t_round. The script times the full jitted rounds
plus their parts (draft pass, verify forward), measures the device ceilings in the same run, and
writes decode.json and decode.png under $OUT.

    python benchmarks/decode.py --layers 4 --experts 128 --batch 1,16 --context 2048
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dspark_jax
from benchmarks.common import ceilings, environment, median_time, out_dir, write_json
from dspark_jax import SamplingParams
from dspark_jax.decoding.engine import Engine
from dspark_jax.model.dspark import draft_block


def bench_batch(model, batch: int, context: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, model.config.vocab_size - 1, context) for _ in range(batch)]
    params = [SamplingParams(max_new_tokens=4 * rounds)] * batch
    max_len = -(-(context + 4 * rounds + 32) // 128) * 128
    out = {"batch": batch, "context": context}
    for name, gamma in (("target", 0), ("dspark", model.config.dspark.block_size)):
        eng = Engine(model, gamma=gamma)
        bs = eng.init_state(prompts, params, list(range(batch)), max_len)
        bs, _ = eng.prefill(bs, prompts)
        state = {"bs": bs}

        def step():
            state["bs"], res = eng.round(state["bs"], sampled=False, top_k=False, top_p=False)
            return res.tokens

        out[f"{name}_round_s"] = median_time(step, repeat=rounds, warmup=3)
        if gamma:  # the parts of a round
            graphdef, st = model.graphdef, model.state

            @jax.jit
            def draft(st, bs):
                m = nnx.merge(graphdef, st)
                return draft_block(m, bs.draft, bs.anchor, bs.cache.lengths,
                                   lambda lg, k: jnp.argmax(lg, -1).astype(jnp.int32)).tokens

            @jax.jit
            def verify(st, bs):
                m = nnx.merge(graphdef, st)
                ids = jnp.zeros((batch, gamma + 1), jnp.int32)
                lg, hid, _ = m.forward(ids, jnp.full((batch,), gamma + 1, jnp.int32), bs.cache,
                                       capture=tuple(model.config.dspark.target_layer_ids))
                return lg, hid

            out["draft_s"] = median_time(draft, st, state["bs"], repeat=rounds)
            out["verify_s"] = median_time(verify, st, state["bs"], repeat=rounds)
        del state
    t0, t1 = out["target_round_s"], out["dspark_round_s"]
    out["speedup_by_tau"] = {str(tau): tau * t0 / t1 for tau in range(1, model.config.dspark.block_size + 2)}
    out["target_tok_s_per_user"] = 1 / t0
    out["breakeven_tau"] = t1 / t0
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--weights", default="fp8", choices=("official", "fp8", "dense"),
                    help="official: FP8 linears and FP4 experts as in the checkpoints; fp8: the FP4 experts "
                         "widened to e4m3 (same values); dense: bf16")
    ap.add_argument("--smoke", action="store_true", help="tiny config, CPU-sized: checks the script runs")
    args = ap.parse_args()

    env = environment()
    print(env, flush=True)
    ceil = ceilings(0.0625, 512) if args.smoke else ceilings()
    print(ceil, flush=True)
    cfg = dspark_jax.config.flash_slice(args.layers).replace(n_routed_experts=args.experts)
    if args.smoke:
        cfg, args.context, args.batch = dspark_jax.config.tiny(), 64, "2"
    model = dspark_jax.init(cfg, 0, dtype=jnp.bfloat16, weight_format=args.weights, quant_sim=True)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(model.state))
    results = []
    for b in (int(x) for x in args.batch.split(",")):
        r = bench_batch(model, b, args.context, args.rounds)
        print(r, flush=True)
        results.append(r)
    write_json("decode.json", {"env": env, "ceilings": ceil, "config": {
        "layers": args.layers, "experts": args.experts, "params": n_params, "context": args.context,
        "weights": args.weights, "weight_bytes": sum(x.nbytes for x in jax.tree_util.tree_leaves(model.state))},
        "results": results})

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        taus = [int(t) for t in r["speedup_by_tau"]]
        ax.plot(taus, list(r["speedup_by_tau"].values()), marker="o", label=f"batch {r['batch']}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("accept length τ (tokens per round)")
    ax.set_ylabel("per-user speed-up vs target-only")
    ax.set_title(f"Flash dims, {args.layers} layers, {args.experts} experts, ctx {args.context}\n{env['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir(), "decode.png"), dpi=120)


if __name__ == "__main__":
    main()
