"""Model configuration: frozen dataclasses for DeepSeek-V4 and its DSpark drafter.

Field names follow the Hugging Face ``config.json`` of the official checkpoints, so
``from_hf_config`` is a thin translation. Runtime choices (dtype, fake-quantisation, cache
sizes) are not part of the model config; they are arguments of ``init`` / ``load`` / caches.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

# Largest number of tokens one forward may append tentatively beyond the committed length
# (a verify block of γ + 1 tokens). Ring buffers keep this much slack so that rejected
# tokens can never overwrite a committed row that some later query still needs (DESIGN 4).
MAX_VERIFY_TOKENS = 16

SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


class ConfigError(ValueError):
    """An invalid or unsupported model configuration."""


@dataclass(frozen=True)
class YarnConfig:
    """YaRN frequency interpolation, used only by compressed (C4 / C128) layers."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark drafter shipped under ``mtp.{0..num_stages-1}`` of a checkpoint."""

    block_size: int  # γ: draft tokens per round = [anchor, noise × (γ-1)]
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    num_stages: int = 3


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4 (Flash / Pro family) hyper-parameters; see the architecture reference."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnConfig | None = field(default_factory=YarnConfig)
    sliding_window: int = 128
    # One entry per target layer: 0 = sliding window only, 4 = C4 + indexer, m > 0 = Cm.
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4,)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    bos_token_id: int = 0
    eos_token_id: int = 1
    num_nextn_predict_layers: int = 1
    dspark: DSparkConfig | None = None

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        if self.dspark is not None and not isinstance(self.dspark, DSparkConfig):
            raise ConfigError(f"dspark must be a DSparkConfig, got {type(self.dspark).__name__}")
        self._validate()

    # ------------------------------------------------------------------ derived values
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def is_compressed(self, layer: int) -> bool:
        return self.compress_ratios[layer] > 0

    def has_indexer(self, layer: int) -> bool:
        return self.compress_ratios[layer] == 4

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def window_ring_size(self) -> int:
        """Slots of a window KV ring: the window plus room for a tentative verify block."""
        return self.sliding_window + MAX_VERIFY_TOKENS

    def compressor_ring_size(self, ratio: int) -> int:
        """Rows of per-token compressor inputs kept between chunks (DESIGN 4)."""
        overlap = 2 if ratio == 4 else 1
        return overlap * ratio + MAX_VERIFY_TOKENS

    # ------------------------------------------------------------------ validation
    def _validate(self):
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_groups", "o_lora_rank", "max_position_embeddings", "sliding_window",
                     "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "hc_mult",
                     "hc_sinkhorn_iters", "index_n_heads", "index_head_dim"):
            need(int(getattr(self, name)) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0,
             f"qk_rope_head_dim must be a positive even number, got {self.qk_rope_head_dim}")
        need(self.nope_head_dim > 0 and self.nope_head_dim % 64 == 0,
             f"head_dim - qk_rope_head_dim must be a positive multiple of 64 (fp8 KV blocks), "
             f"got head_dim={self.head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}")
        need(self.num_attention_heads % self.o_groups == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be divisible by o_groups ({self.o_groups})")
        need(len(self.compress_ratios) == self.num_hidden_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_hidden_layers} target layers")
        for i, r in enumerate(self.compress_ratios):
            need(r == 0 or r >= 2, f"compress_ratios[{i}] = {r}: must be 0 (window only) or a ratio >= 2")
        idx = self.index_head_dim
        if any(r == 4 for r in self.compress_ratios):
            need(idx & (idx - 1) == 0 and idx % 32 == 0 and idx > self.qk_rope_head_dim,
                 f"index_head_dim must be a power of two, a multiple of 32 and larger than "
                 f"qk_rope_head_dim ({self.qk_rope_head_dim}); got {idx}")
            need(self.index_topk > 0, f"index_topk must be positive, got {self.index_topk}")
        need(self.num_experts_per_tok <= self.n_routed_experts,
             f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        need(self.n_shared_experts == 1,
             f"DeepSeek-V4 has exactly one shared expert; n_shared_experts={self.n_shared_experts} is unsupported")
        need(0 <= self.num_hash_layers <= self.num_hidden_layers,
             f"num_hash_layers ({self.num_hash_layers}) must lie in [0, num_hidden_layers]")
        need(self.scoring_func in SCORING_FUNCS,
             f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        need(self.rms_norm_eps > 0 and self.hc_eps > 0, "rms_norm_eps and hc_eps must be positive")
        need(0 <= self.bos_token_id < self.vocab_size and 0 <= self.eos_token_id < self.vocab_size,
             "bos_token_id / eos_token_id must be valid token ids")
        if self.dspark is not None:
            d = self.dspark
            need(2 <= d.block_size < MAX_VERIFY_TOKENS,
                 f"dspark block_size must lie in [2, {MAX_VERIFY_TOKENS - 1}], got {d.block_size}")
            need(0 <= d.noise_token_id < self.vocab_size,
                 f"dspark noise_token_id {d.noise_token_id} is outside the vocabulary ({self.vocab_size})")
            need(len(d.target_layer_ids) > 0, "dspark target_layer_ids must not be empty")
            for t in d.target_layer_ids:
                need(0 <= t < self.num_hidden_layers,
                     f"dspark target layer {t} is outside [0, {self.num_hidden_layers})")
            need(d.markov_rank > 0, f"dspark markov_rank must be positive, got {d.markov_rank}")
            need(d.num_stages >= 1, f"dspark num_stages must be >= 1, got {d.num_stages}")

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        """The official ``config.json`` representation (inverse of ``from_hf_config``)."""
        n_extra = self.dspark.num_stages if self.dspark is not None else self.num_nextn_predict_layers
        out: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios) + [0] * n_extra,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hash_layers": self.num_hash_layers,
            "scoring_func": self.scoring_func,
            "topk_method": "noaux_tc",
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        if self.dspark is not None:
            out.update({
                "dspark_block_size": self.dspark.block_size,
                "dspark_noise_token_id": self.dspark.noise_token_id,
                "dspark_target_layer_ids": list(self.dspark.target_layer_ids),
                "dspark_markov_rank": self.dspark.markov_rank,
            })
        return out


# ---------------------------------------------------------------------------- HF config reading
_HF_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_SUPPORTED_ARCHS = ("DeepseekV4ForCausalLM",)
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "o_groups",
                  "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any], *,
                   num_dspark_stages: int | None = None) -> ModelConfig:
    """Read an official DeepSeek-V4 ``config.json`` (a path to the file or its directory, or a dict).

    ``compress_ratios`` may be longer than ``num_hidden_layers``: the tail describes the MTP /
    DSpark stages. DSpark checkpoints keep ``num_nextn_predict_layers: 1`` while shipping three
    stages, so the stage count comes from ``num_dspark_stages`` (pass the count of ``mtp.<k>.``
    prefixes found in the weights) or else from the length of the ``compress_ratios`` tail.
    A malformed file, a missing or mistyped key raises ``ConfigError`` naming the file and the key.
    """
    from dspark_jax.checkpoint.files import read_json

    if isinstance(path_or_dict, Mapping):
        raw, where = dict(path_or_dict), "config"
    else:
        where = os.fspath(path_or_dict)
        if os.path.isdir(where):
            where = os.path.join(where, "config.json")
        if not os.path.exists(where):
            raise FileNotFoundError(f"no config.json at {where}")
        raw = read_json(where, ConfigError)
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    try:
        return _from_raw(raw, num_dspark_stages)
    except KeyError as e:  # a key needed by another present key (dspark_*, rope_scaling, ...)
        raise ConfigError(f"{where}: missing key {e.args[0]!r}") from None
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: a value has the wrong type ({e})") from None


def _from_raw(raw: dict[str, Any], num_dspark_stages: int | None) -> ModelConfig:
    archs = raw.get("architectures") or ["DeepseekV4ForCausalLM"]
    if not any(a in _SUPPORTED_ARCHS for a in archs) or raw.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"unsupported architecture {archs} / model_type {raw.get('model_type')!r}; "
                          f"expected DeepseekV4ForCausalLM / deepseek_v4")
    if raw.get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"DeepSeek-V4 uses a single shared KV latent; num_key_value_heads="
                          f"{raw['num_key_value_heads']} is unsupported")
    missing = [k for k in _REQUIRED_KEYS if k not in raw]
    if missing:
        raise ConfigError(f"missing required keys {missing}")
    bad = [f"{k}={raw[k]!r}" for k in _REQUIRED_KEYS if isinstance(raw[k], bool) or not isinstance(raw[k], int)]
    if bad:
        raise ConfigError(f"these keys must hold integers: {', '.join(bad)}")

    n_layers = int(raw["num_hidden_layers"])
    if "compress_ratios" in raw:
        ratios_all = [int(r) for r in raw["compress_ratios"]]
    elif "layer_types" in raw:
        try:
            ratios_all = [_HF_LAYER_TYPES[t] for t in raw["layer_types"]]
        except KeyError as e:
            raise ConfigError(f"unknown layer type {e.args[0]!r} in layer_types") from None
        rates = raw.get("compress_rates") or {}
        ratios_all = [rates.get(t, r) if r else 0 for t, r in zip(raw["layer_types"], ratios_all)]
    else:
        raise ConfigError("config has neither compress_ratios nor layer_types")
    if len(ratios_all) < n_layers:
        raise ConfigError(f"compress_ratios has {len(ratios_all)} entries for {n_layers} layers")
    tail = ratios_all[n_layers:]
    if any(r != 0 for r in tail):
        raise ConfigError(f"MTP / DSpark stages must be window-only layers (ratio 0); got tail {tail}")

    num_hash = raw.get("num_hash_layers", raw.get("n_hash_layers"))
    if num_hash is None and "mlp_layer_types" in raw:
        num_hash = sum(1 for t in raw["mlp_layer_types"] if t == "hash_moe")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters")
    if isinstance(rope, Mapping) and "compress" in rope:
        rope = rope["compress"]
    yarn = None
    if isinstance(rope, Mapping) and rope.get("type", rope.get("rope_type")) == "yarn":
        yarn = YarnConfig(factor=float(rope["factor"]),
                          original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                          beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)))

    dspark = None
    if "dspark_block_size" in raw:
        stages = num_dspark_stages if num_dspark_stages is not None else len(tail)
        if stages < 1:
            raise ConfigError("config has DSpark keys but no DSpark stages (empty compress_ratios tail "
                              "and no num_dspark_stages given)")
        dspark = DSparkConfig(block_size=int(raw["dspark_block_size"]),
                              noise_token_id=int(raw["dspark_noise_token_id"]),
                              target_layer_ids=tuple(int(t) for t in raw["dspark_target_layer_ids"]),
                              markov_rank=int(raw["dspark_markov_rank"]), num_stages=int(stages))

    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0]
    kw = dict(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], num_hidden_layers=n_layers,
        num_attention_heads=raw["num_attention_heads"], head_dim=raw.get("head_dim", 512),
        qk_rope_head_dim=raw.get("qk_rope_head_dim", 64), q_lora_rank=raw["q_lora_rank"],
        o_groups=raw["o_groups"], o_lora_rank=raw["o_lora_rank"],
        max_position_embeddings=raw.get("max_position_embeddings", 1048576),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 10000.0),
        compress_rope_theta=raw.get("compress_rope_theta", 160000.0), rope_scaling=yarn,
        sliding_window=raw.get("sliding_window", 128), compress_ratios=tuple(ratios_all[:n_layers]),
        index_n_heads=raw.get("index_n_heads", 64), index_head_dim=raw.get("index_head_dim", 128),
        index_topk=raw.get("index_topk", 512), n_routed_experts=raw["n_routed_experts"],
        num_experts_per_tok=raw["num_experts_per_tok"], n_shared_experts=raw.get("n_shared_experts", 1),
        moe_intermediate_size=raw["moe_intermediate_size"],
        num_hash_layers=3 if num_hash is None else int(num_hash),
        scoring_func=raw.get("scoring_func", "sqrtsoftplus"), norm_topk_prob=raw.get("norm_topk_prob", True),
        routed_scaling_factor=raw.get("routed_scaling_factor", 1.5), swiglu_limit=raw.get("swiglu_limit", 10.0),
        hc_mult=raw.get("hc_mult", 4), hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20),
        hc_eps=raw.get("hc_eps", 1e-6), bos_token_id=raw.get("bos_token_id", 0), eos_token_id=eos,
        num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 1), dspark=dspark,
    )
    return ModelConfig(**kw)


# ---------------------------------------------------------------------------- presets
_FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)
_PRO_RATIOS = (128, 128) + (4, 128) * 29 + (4,)


def flash(*, dspark: bool = True) -> ModelConfig:
    """DeepSeek-V4-Flash (with the DSpark drafter of the -DSpark / -0731 checkpoint)."""
    ds = DSparkConfig(block_size=5, noise_token_id=128799, target_layer_ids=(40, 41, 42), markov_rank=256)
    return ModelConfig(dspark=ds if dspark else None)


def pro(*, dspark: bool = True) -> ModelConfig:
    """DeepSeek-V4-Pro (with the DSpark drafter of the -0813 checkpoint)."""
    ds = DSparkConfig(block_size=5, noise_token_id=128799, target_layer_ids=(58, 59, 60), markov_rank=512)
    return ModelConfig(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                       o_groups=16, compress_ratios=_PRO_RATIOS, index_topk=1024, n_routed_experts=384,
                       moe_intermediate_size=3072, routed_scaling_factor=2.5, dspark=ds if dspark else None)


def flash_slice(n_layers: int, *, dspark: bool = True) -> ModelConfig:
    """Real Flash dimensions with only the first ``n_layers`` layers (single-GPU benchmarks).

    The DSpark drafter taps the last (up to) three layers of the slice.
    """
    if not 1 <= n_layers <= 43:
        raise ConfigError(f"flash_slice needs 1 <= n_layers <= 43, got {n_layers}")
    targets = tuple(range(max(0, n_layers - 3), n_layers))
    ds = DSparkConfig(block_size=5, noise_token_id=128799, target_layer_ids=targets, markov_rank=256)
    return ModelConfig(num_hidden_layers=n_layers, compress_ratios=_FLASH_RATIOS[:n_layers],
                       num_hash_layers=min(3, n_layers), dspark=ds if dspark else None)


def tiny(*, dspark: bool = True) -> ModelConfig:
    """A CPU-sized config that keeps every mechanism: window-only, C4 + indexer and C128 layers
    (real ratio 128), hash and learned MoE, mHC, and a 3-stage DSpark drafter."""
    ds = DSparkConfig(block_size=5, noise_token_id=511, target_layer_ids=(3, 4, 5), markov_rank=16)
    return ModelConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=6, num_attention_heads=4, head_dim=128,
        qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64, max_position_embeddings=4096,
        rope_scaling=YarnConfig(factor=16.0, original_max_position_embeddings=512),
        sliding_window=8, compress_ratios=(0, 4, 128, 4, 128, 0), index_n_heads=4, index_head_dim=128,
        index_topk=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        num_hash_layers=2, dspark=ds if dspark else None)


def shipped(*, dspark: bool = True) -> ModelConfig:
    """The small trained DeepSeek-V4 + DSpark pair shipped in ``dspark_jax/assets`` (built by
    ``python -m dspark_jax.train``): the Flash layer pattern (2 window-only layers, then C4 + indexer
    and C128 alternating, ending on C4), 3 hash-routed MoE layers then learned routing, mHC,
    window 128, 1024-token context, and a 3-stage DSpark drafter over the last 3 layers.
    Token ids 0 / 1 / 2 are the tokenizer's ``<|bos|>`` / ``<|eos|>`` / ``<|noise|>``."""
    ds = DSparkConfig(block_size=5, noise_token_id=2, target_layer_ids=(4, 5, 6), markov_rank=64)
    return ModelConfig(
        vocab_size=6144, hidden_size=256, num_hidden_layers=7, num_attention_heads=4, head_dim=128,
        qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, max_position_embeddings=1024,
        rope_scaling=YarnConfig(factor=16.0, original_max_position_embeddings=1024),
        sliding_window=128, compress_ratios=(0, 0, 4, 128, 4, 128, 4), index_n_heads=4, index_head_dim=128,
        index_topk=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
        num_hash_layers=3, bos_token_id=0, eos_token_id=1, dspark=ds if dspark else None)


PRESETS = {"tiny": tiny, "flash": flash, "pro": pro, "shipped": shipped}
