"""Generate with the shipped DeepSeek-V4 + DSpark pair on CPU, and compare speculative decoding
with target-only decoding of the same prompts in the same run."""

import dspark_jax
from dspark_jax.cli import speed_comparison
from dspark_jax.decoding.generate import default_model

dspark_jax.enable_compile_cache()  # compiled programs are kept on disk: later runs start faster
model = default_model()
print(model)
# Prompts end where a line ends, before its newline: the tokenizer merges a newline with the
# indentation that follows it, so a prompt that ends in "\n" leaves the model an unusual split.
prompts = ["import os\nimport sys\n\n\ndef main():", "class Stack:\n    def __init__(self):"]
sampling = dspark_jax.SamplingParams(max_new_tokens=96)  # greedy

run = speed_comparison(model, prompts, sampling, repeats=3, progress=True)  # phases on stderr
for prompt, r in zip(prompts, run["dspark"]["results"]):
    print("-" * 60)
    print(prompt + r.text)
print("-" * 60)
print(f"speculative output identical to target-only output: {run['outputs_identical']} "
      f"(expected token for token: {run['greedy_exact']}; see README, 'Exact greedy output')")
print(f"mean accept length (tokens per round, incl. bonus): {run['dspark']['mean_accept_length']:.2f}")
print(f"target-only: {run['target_only']['tokens_per_s']:.1f} tok/s, "
      f"DSpark: {run['dspark']['tokens_per_s']:.1f} tok/s, speed-up {run['speedup']:.2f}x")
