"""Configs: presets, official config.json reading, validation errors."""

import json

import pytest

from dspark_jax import config
from dspark_jax.config import ConfigError, ModelConfig, from_hf_config

FLASH_DSPARK_JSON = {  # the fields of DeepSeek-V4-Flash-0731 (DSpark) config.json that matter here
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0],
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048, "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_nextn_predict_layers": 1,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [40, 41, 42],
    "dspark_markov_rank": 256, "bos_token_id": 0, "eos_token_id": 1,
}


def test_flash_dspark_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLASH_DSPARK_JSON))
    cfg = from_hf_config(tmp_path)
    assert cfg == config.flash()
    assert len(cfg.compress_ratios) == 43 and cfg.compress_ratios[:4] == (0, 0, 4, 128)
    assert cfg.dspark.num_stages == 3  # from the compress_ratios tail, not num_nextn_predict_layers
    assert cfg.dspark.target_layer_ids == (40, 41, 42)
    # the stage count seen in the weights wins
    assert from_hf_config(FLASH_DSPARK_JSON, num_dspark_stages=2).dspark.num_stages == 2


def test_round_trip_and_presets():
    for make in (config.tiny, config.flash, config.pro):
        cfg = make()
        assert from_hf_config(cfg.to_hf_dict()) == cfg
    pro = config.pro()
    assert 0 not in pro.compress_ratios and pro.hidden_size == 7168 and pro.dspark.markov_rank == 512
    sl = config.flash_slice(4)
    assert sl.hidden_size == 4096 and sl.compress_ratios == (0, 0, 4, 128) and sl.dspark.target_layer_ids == (1, 2, 3)
    tiny = config.tiny()
    assert {0, 4, 128} <= set(tiny.compress_ratios) and tiny.num_hash_layers >= 1
    assert any(not tiny.is_hash_layer(i) for i in range(tiny.num_hidden_layers))


def test_hf_layer_types_form():
    raw = dict(FLASH_DSPARK_JSON)
    del raw["compress_ratios"], raw["num_hash_layers"]
    raw["layer_types"] = ["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 20 \
        + ["compressed_sparse_attention"]
    raw["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 40
    cfg = from_hf_config(raw, num_dspark_stages=3)
    assert cfg.compress_ratios == config.flash().compress_ratios and cfg.num_hash_layers == 3


@pytest.mark.parametrize("change, message", [
    (dict(compress_ratios=(0, 4)), "compress_ratios has 2 entries"),
    (dict(num_attention_heads=5), "divisible by o_groups"),
    (dict(head_dim=100), "multiple of 64"),
    (dict(num_experts_per_tok=300), "exceeds n_routed_experts"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(n_shared_experts=2), "shared expert"),
    (dict(index_head_dim=96), "power of two"),
    (dict(dspark=config.DSparkConfig(block_size=5, noise_token_id=10**6, target_layer_ids=(1,), markov_rank=4)),
     "outside the vocabulary"),
    (dict(dspark=config.DSparkConfig(block_size=5, noise_token_id=3, target_layer_ids=(99,), markov_rank=4)),
     "target layer 99"),
])
def test_invalid_configs(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**config.tiny().__dict__, **change})


def test_unsupported_architecture():
    with pytest.raises(ConfigError, match="unsupported architecture"):
        from_hf_config({**FLASH_DSPARK_JSON, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(ConfigError, match="window-only"):
        from_hf_config({**FLASH_DSPARK_JSON, "compress_ratios": FLASH_DSPARK_JSON["compress_ratios"][:-1] + [4]})
