"""Build the Hugging Face parity fixture: a tiny random DeepSeek-V4 checkpoint in the official
tensor naming, and the logits that transformers' independent ``DeepseekV4ForCausalLM`` computes
for it.

Runs in a side environment with PyTorch (CPU) and transformers >= 5.24 (Python 3.11 is fine; it
does not import dspark_jax):

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    /tmp/hfenv/bin/python tools/make_hf_parity_fixture.py tests/fixtures/hf_parity

Writes config.json, model.safetensors (bf16 matrices, fp32 hc / sink / ape / router bias, int64
tid2eid, as in the official checkpoints) and reference.safetensors (input ids and fp32 logits).
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 512,
                     "beta_fast": 32, "beta_slow": 1},
    "sliding_window": 8,
    # layer 0: window only + hash MoE, 1: C4 + indexer + hash MoE, 2: C128, 3: C4; one MTP entry.
    "compress_ratios": [0, 4, 128, 4, 0],
    "index_n_heads": 8,
    "index_head_dim": 128,
    "index_topk": 3,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "num_hash_layers": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
SEQ_LEN = 300  # crosses the window, many C4 windows and two C128 windows


def random_checkpoint(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = np.random.default_rng(seed)
    d, h, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    n = cfg["hc_mult"]
    out: dict[str, torch.Tensor] = {}

    def mat(name, rows, cols):  # bf16, std 1/sqrt(fan_in)
        out[name] = torch.from_numpy(g.normal(0, 1 / math.sqrt(cols), (rows, cols)).astype(np.float32)).bfloat16()

    def norm(name, dim):  # bf16 RMSNorm weights around 1
        out[name] = torch.from_numpy(1 + 0.2 * g.standard_normal(dim).astype(np.float32)).bfloat16()

    def f32(name, shape, std, mean=0.0):
        out[name] = torch.from_numpy((mean + std * g.standard_normal(shape)).astype(np.float32))

    def hc(prefix, rows):
        f32(f"{prefix}_fn", (rows, n * d), 0.05)
        f32(f"{prefix}_base", (rows,), 0.5)
        f32(f"{prefix}_scale", (3 if rows > n else 1,), 0.3, mean=1.0)

    mat("embed.weight", cfg["vocab_size"], d)
    mat("head.weight", cfg["vocab_size"], d)
    norm("norm.weight", d)
    hc("hc_head", n)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        ratio = cfg["compress_ratios"][i]
        norm(p + "attn_norm.weight", d)
        norm(p + "ffn_norm.weight", d)
        hc(p + "hc_attn", (2 + n) * n)
        hc(p + "hc_ffn", (2 + n) * n)
        mat(p + "attn.wq_a.weight", cfg["q_lora_rank"], d)
        norm(p + "attn.q_norm.weight", cfg["q_lora_rank"])
        mat(p + "attn.wq_b.weight", h * hd, cfg["q_lora_rank"])
        mat(p + "attn.wkv.weight", hd, d)
        norm(p + "attn.kv_norm.weight", hd)
        g_ = cfg["o_groups"]
        mat(p + "attn.wo_a.weight", g_ * cfg["o_lora_rank"], h * hd // g_)
        mat(p + "attn.wo_b.weight", d, g_ * cfg["o_lora_rank"])
        f32(p + "attn.attn_sink", (h,), 1.0)
        if ratio:
            coff = 2 if ratio == 4 else 1
            mat(p + "attn.compressor.wkv.weight", coff * hd, d)
            mat(p + "attn.compressor.wgate.weight", coff * hd, d)
            f32(p + "attn.compressor.ape", (ratio, coff * hd), 0.5)
            norm(p + "attn.compressor.norm.weight", hd)
        if ratio == 4:
            ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
            mat(p + "attn.indexer.wq_b.weight", ih * idim, cfg["q_lora_rank"])
            mat(p + "attn.indexer.weights_proj.weight", ih, d)
            mat(p + "attn.indexer.compressor.wkv.weight", 2 * idim, d)
            mat(p + "attn.indexer.compressor.wgate.weight", 2 * idim, d)
            f32(p + "attn.indexer.compressor.ape", (4, 2 * idim), 0.5)
            norm(p + "attn.indexer.compressor.norm.weight", idim)
        e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        mat(p + "ffn.gate.weight", e, d)
        if i < cfg["num_hash_layers"]:
            tid = g.integers(0, e, (cfg["vocab_size"], cfg["num_experts_per_tok"]))
            for r in range(tid.shape[0]):  # distinct experts per token, like the real table
                tid[r] = g.permutation(e)[:cfg["num_experts_per_tok"]]
            out[p + "ffn.gate.tid2eid"] = torch.from_numpy(tid.astype(np.int64))
        else:
            f32(p + "ffn.gate.bias", (e,), 0.1)
        for j in range(e):
            mat(p + f"ffn.experts.{j}.w1.weight", inter, d)
            mat(p + f"ffn.experts.{j}.w2.weight", d, inter)
            mat(p + f"ffn.experts.{j}.w3.weight", inter, d)
        mat(p + "ffn.shared_experts.w1.weight", inter, d)
        mat(p + "ffn.shared_experts.w2.weight", d, inter)
        mat(p + "ffn.shared_experts.w3.weight", inter, d)
    return out


def check_yarn(model, cfg):
    """The compressed layers must use YaRN-blended frequencies with base compress_rope_theta."""
    rd, base, y = cfg["qk_rope_head_dim"], cfg["compress_rope_theta"], cfg["rope_scaling"]
    freqs = 1.0 / (base ** (np.arange(0, rd, 2, dtype=np.float32) / rd))
    cd = lambda r: rd * math.log(y["original_max_position_embeddings"] / (r * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(cd(y["beta_fast"])), 0), min(math.ceil(cd(y["beta_slow"])), rd - 1)
    smooth = 1 - np.clip((np.arange(rd // 2) - low) / (high - low), 0, 1)
    expect = freqs / y["factor"] * (1 - smooth) + freqs * smooth
    got = model.model.rotary_emb.compress_inv_freq.float().numpy()
    if not np.allclose(got, expect, rtol=1e-6):
        raise SystemExit(f"transformers did not apply the expected YaRN frequencies:\n{got}\n{expect}")


def main(out_dir: str):
    from transformers import DeepseekV4ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    save_file(random_checkpoint(CONFIG), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    model, info = DeepseekV4ForCausalLM.from_pretrained(out_dir, dtype=torch.float32, output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise SystemExit(f"transformers could not load the fixture: {info}")
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    if unexpected:
        raise SystemExit(f"transformers did not use tensors: {unexpected}")
    check_yarn(model, CONFIG)
    model.eval()

    ids = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], (2, SEQ_LEN)).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(ids), use_cache=False).logits.float().numpy()
    save_numpy({"input_ids": ids.astype(np.int32), "logits": logits.astype(np.float32)},
               os.path.join(out_dir, "reference.safetensors"),
               metadata={"transformers": __import__("transformers").__version__, "torch": torch.__version__})
    print(f"wrote {out_dir}: logits {logits.shape}, |logits| max {np.abs(logits).max():.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf_parity")
