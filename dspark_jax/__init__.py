"""DeepSeek-V4 with DSpark speculative decoding in JAX / Flax NNX / Pallas."""

from dspark_jax import config
from dspark_jax.api import InputError, Model, init, load, with_dense_copies, with_numerics
from dspark_jax.compile_cache import enable_compile_cache
from dspark_jax.config import DSparkConfig, ModelConfig, from_hf_config

__all__ = ["config", "DSparkConfig", "ModelConfig", "from_hf_config", "InputError", "Model", "init", "load",
           "with_dense_copies", "with_numerics", "enable_compile_cache"]
__version__ = "0.1.0"

from dspark_jax.decoding.generate import Result, generate  # noqa: E402
from dspark_jax.decoding.sampling import SamplingParams  # noqa: E402

__all__ += ["Result", "generate", "SamplingParams"]
