"""Configuration of one training run (corpus -> tokenizer -> target -> drafter -> STS -> export)
and its two presets: ``shipped`` (the H200 run that builds the embedded model) and ``toy``
(the same code path at CPU-test scale)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dspark_jax import config as model_config
from dspark_jax.config import DSparkConfig, ModelConfig, YarnConfig
from dspark_jax.train.corpus import CorpusConfig
from dspark_jax.train.drafter import DraftLossConfig
from dspark_jax.train.optim import OptimConfig


@dataclass(frozen=True)
class PhaseConfig:
    batch_size: int  # windows per step
    optim: OptimConfig
    max_steps: int | None = None  # stop earlier than the clock (toy runs)
    eval_every_s: float = 60.0
    ckpt_every_s: float = 120.0

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    corpus: CorpusConfig
    seq_len: int  # training window (the shipped model's context)
    target: PhaseConfig
    drafter: PhaseConfig
    draft_loss: DraftLossConfig = DraftLossConfig()
    minutes: float = 7.0  # wall-clock budget of the whole run (process start-up comes on top)
    target_share: float = 0.6  # of the time left for training after data preparation
    reserve_s: float = 40.0  # kept for the final evaluation, STS, export and plots
    dtype: str = "bfloat16"  # parameter storage and activations (fp32 master and moments)
    seed: int = 0
    eval_windows: int = 16  # held-out windows per evaluation batch
    max_eval_batches: int = 16  # final evaluation: at most this many batches
    max_file_mib: float = 16.0
    max_total_mib: float = 32.0

    def __post_init__(self):
        m = self.model
        if m.dspark is None:
            raise ValueError("the run trains a DSpark drafter: model.dspark must be set")
        if self.seq_len > m.max_position_embeddings:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_position_embeddings {m.max_position_embeddings}")
        if self.seq_len < m.sliding_window + m.dspark.block_size + 1:
            raise ValueError(f"seq_len {self.seq_len} is shorter than a window plus a block")
        if not 0 < self.target_share < 1:
            raise ValueError(f"target_share must lie in (0, 1), got {self.target_share}")
        if self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if m.dspark.noise_token_id != 2 or m.bos_token_id != 0 or m.eos_token_id != 1:
            raise ValueError("the tokenizer puts <|bos|>, <|eos|>, <|noise|> at ids 0, 1, 2; the model config "
                             f"has bos {m.bos_token_id}, eos {m.eos_token_id}, noise {m.dspark.noise_token_id}")

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)


def shipped(minutes: float = 7.0) -> RunConfig:
    """One H200: ~14M-parameter V4 target + 3-stage drafter on 1024-token windows."""
    return RunConfig(
        model=model_config.shipped(),
        corpus=CorpusConfig(),
        seq_len=1024,
        target=PhaseConfig(batch_size=48, optim=OptimConfig(peak_lr=2e-3, weight_decay=0.1)),
        drafter=PhaseConfig(batch_size=32, optim=OptimConfig(peak_lr=2e-3, weight_decay=0.0)),
        draft_loss=DraftLossConfig(num_anchors=128),
        minutes=minutes)


def toy_model() -> ModelConfig:
    """Every mechanism at CPU-test size: a window-only, a C4 + indexer and a C128 layer (the real
    ratio, so windows must exceed 128 tokens), hash then learned MoE, mHC, a 2-stage drafter."""
    ds = DSparkConfig(block_size=5, noise_token_id=2, target_layer_ids=(1, 2), markov_rank=8, num_stages=2)
    return ModelConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=128,
        qk_rope_head_dim=64, q_lora_rank=64, o_groups=1, o_lora_rank=32, max_position_embeddings=256,
        rope_scaling=YarnConfig(factor=16.0, original_max_position_embeddings=256), sliding_window=16,
        compress_ratios=(0, 4, 128), index_n_heads=2, index_head_dim=128, index_topk=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1, bos_token_id=0, eos_token_id=1,
        dspark=ds)


def toy(minutes: float = 10.0) -> RunConfig:
    """A few steps of each phase on a few stdlib files (CPU, seconds)."""
    return RunConfig(
        model=toy_model(),
        corpus=CorpusConfig(max_files=60, max_file_bytes=40_000, heldout_percent=10.0, include_tests=False),
        seq_len=256,
        target=PhaseConfig(batch_size=4, optim=OptimConfig(peak_lr=3e-3, weight_decay=0.1, warmup_fraction=0.0),
                           max_steps=6, eval_every_s=1e9),
        drafter=PhaseConfig(batch_size=4, optim=OptimConfig(peak_lr=3e-3, warmup_fraction=0.0), max_steps=6,
                            eval_every_s=1e9),
        draft_loss=DraftLossConfig(num_anchors=16),
        minutes=minutes, reserve_s=5.0, dtype="float32", eval_windows=4, max_eval_batches=2)


PRESETS = {"shipped": shipped, "toy": toy}
