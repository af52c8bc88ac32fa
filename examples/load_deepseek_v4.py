"""Load the real DeepSeek-V4-Flash-DSpark checkpoint on 8 GPUs and generate with DSpark drafting.

    python examples/load_deepseek_v4.py /data/DeepSeek-V4-Flash-DSpark --prompt "Why is the sky blue?"
    python examples/load_deepseek_v4.py /data/DeepSeek-V4-Flash-DSpark --cache /data/flash-orbax --thinking
    python examples/load_deepseek_v4.py      # the shipped tiny model, on whatever devices there are

The checkpoint directory is the official one: config.json, model.safetensors.index.json with
its shards (FP8 attention / shared experts, FP4 routed experts, E8M0 scales) and tokenizer.json.

What happens:
1. ``sharding.make_mesh()`` puts the 8 GPUs on one ``model`` axis: attention heads, output
   groups, routed experts and the vocabulary are split over them, small tensors replicated.
2. ``dspark_jax.load(..., mesh=mesh)`` streams the checkpoint tensor by tensor and places each
   one directly on its devices (host memory stays around one tensor), the FP8 linears and FP4
   routed experts kept as stored (``weight_format="official"``, the default for such
   checkpoints). FP8 / FP4 checkpoints default to ``quant_sim=True``: activations and the KV
   cache are fake-quantised like the official inference code. ``dspark=True`` fails early on a
   checkpoint without the DSpark drafter.
   ``--dense-copies`` also holds the FP8 linears dequantised (``dspark_jax.with_dense_copies``:
   11.7 GB more over the 8 GPUs for Flash), which makes verify rounds of many requests faster.
3. With ``--cache`` the converted parameters are also saved with orbax; later runs restore them
   straight into the sharded layout, skipping the safetensors conversion.
4. The prompt is encoded with the DeepSeek-V4 chat format and decoded speculatively. A tokenizer
   without the chat special tokens (the shipped tiny model's: it continues plain code) gets the
   prompt as plain text.

Memory: kept as stored (``weight_format="official"``) Flash needs 21.9 GB of weights per GPU on
the default (1, 8) mesh (``docs/sharding.md``). Dequantised to bf16 (``weight_format="dense"``)
it would be about 0.6 TB (routed experts grow 4x from FP4), about 75 GB per GPU of 141 GB (H200)
or 288 GB (MI355X); Pro does not fit 8 GPUs in bf16.
"""

from __future__ import annotations

import argparse
import time

import jax

import dspark_jax
from dspark_jax import sharding
from dspark_jax.checkpoint import orbax
from dspark_jax.checkpoint.tokenizer import encode_chat, has_chat_tokens
from dspark_jax.decoding.generate import DEFAULT_MODEL_DIR, prompt_ids


def load_model(checkpoint: str, cache: str | None, mesh) -> dspark_jax.Model:
    if cache and orbax.is_orbax_checkpoint(cache):
        print(f"restoring converted parameters from {cache}")
        return orbax.restore(cache, mesh=mesh)  # dtype, formats and quant_sim as saved
    model = dspark_jax.load(checkpoint, mesh=mesh, dspark=True)  # formats and quant_sim from the files
    if cache:
        orbax.save(model, cache)
    return model


def encode_prompt(model: dspark_jax.Model, text: str, thinking: bool) -> list[int]:
    """The prompt in the DeepSeek-V4 chat format, or as plain text when the tokenizer has no chat tokens."""
    if has_chat_tokens(model.tokenizer):
        return encode_chat([{"role": "user", "content": text}], thinking=thinking, tokenizer=model.tokenizer)
    print("note: this tokenizer has no DeepSeek-V4 chat tokens; the prompt is plain text")
    return prompt_ids(model, text).tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", default=DEFAULT_MODEL_DIR,
                    help="official DeepSeek-V4 DSpark checkpoint directory (default: the shipped tiny model)")
    ap.add_argument("--prompt", default=None,
                    help="default: a question for chat models, the start of a function for the tiny model")
    ap.add_argument("--thinking", action="store_true", help="thinking mode (the reply starts with <think>)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cache", help="orbax directory for fast restarts")
    ap.add_argument("--dense-copies", action="store_true",
                    help="also hold the FP8 linears dequantised (more memory, faster verify of many requests)")
    args = ap.parse_args()

    n = len(jax.devices())
    if n != 8:
        print(f"note: {n} devices found; the defaults assume 8 GPUs")
    mesh = sharding.make_mesh()

    t0 = time.perf_counter()
    model = load_model(args.checkpoint, args.cache, mesh)
    if args.dense_copies:
        model = dspark_jax.with_dense_copies(model)
    print(f"{model} ready in {time.perf_counter() - t0:.0f} s")

    default = "Explain speculative decoding in two sentences." if has_chat_tokens(model.tokenizer) else "def fib(n):"
    ids = encode_prompt(model, args.prompt or default, args.thinking)
    sampling = dspark_jax.SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    (result,) = dspark_jax.generate([ids], model=model, sampling=sampling, speculative=True)
    print(model.tokenizer.decode(result.tokens, skip_special_tokens=False))
    print(f"finish: {result.finish_reason}; mean accepted length {result.stats.get('mean_accept_length')}")


if __name__ == "__main__":
    main()
