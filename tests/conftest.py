import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import perturbed_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_f32():
    """The tiny preset in fp32 with every parameter randomised (non-zero sinks, ape, biases)."""
    return perturbed_tiny(jnp.float32)
