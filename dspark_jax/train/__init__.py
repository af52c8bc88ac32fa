"""Training of the small DeepSeek-V4 + DSpark pair shipped in ``dspark_jax/assets``.

``python -m dspark_jax.train <out_dir> [--minutes M] [--toy]`` runs the whole pipeline
(``run.train_all``): stdlib corpus, byte-level BPE, target pretraining, drafter training
(DeepSpec losses), STS calibration and export in the official checkpoint layout.
"""

from dspark_jax.train.config import PRESETS, RunConfig, shipped, toy
from dspark_jax.train.run import train_all

__all__ = ["PRESETS", "RunConfig", "shipped", "toy", "train_all"]
