import gc
import os

# LLVM's optimisation level 0 for the CPU backend: the suite is compile-bound and spends about a third
# less CPU time than at the default level. Results differ from the default level's only by float32
# rounding (the tiny model's logits by at most 1.4e-6), well inside every tolerance of the suite.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import perturbed_tiny  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test file ends. XLA's CPU backend maps each compiled
    kernel's code and data as three memory regions that live as long as the program; one worker
    running a few hundred tests reached Linux's limit of 65,530 maps per process (vm.max_map_count)
    and crashed inside the compiler."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_f32():
    """The tiny preset in fp32 with every parameter randomised (non-zero sinks, ape, biases)."""
    return perturbed_tiny(jnp.float32)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    """A one-layer DeepSeek-V4 + one-stage DSpark checkpoint directory with random weights, the
    shipped tokenizer and an sts.json: quick to load and to compile (for API and CLI tests)."""
    import json

    from dspark_jax import config
    from dspark_jax.checkpoint.hf import save_official
    from dspark_jax.checkpoint.tokenizer import load_tokenizer
    from dspark_jax.decoding.generate import DEFAULT_MODEL_DIR
    from tests.checkpoint_helpers import random_model

    ds = config.DSparkConfig(block_size=3, noise_token_id=2, target_layer_ids=(0,), markov_rank=16, num_stages=1)
    cfg = config.shipped().replace(num_hidden_layers=1, compress_ratios=(0,), num_hash_layers=1, dspark=ds)
    model = random_model(cfg, tokenizer=load_tokenizer(DEFAULT_MODEL_DIR))
    path = tmp_path_factory.mktemp("small") / "ckpt"
    save_official(model, str(path))
    with open(path / "sts.json", "w") as f:
        json.dump({"temperatures": [1.5, 1.0, 0.5]}, f)
    return str(path)


# The longest test files first, longest first (CPU seconds of each on a 2-worker run: ~100 down to
# ~12): with `--dist loadfile` each worker takes the next whole file in this order when it runs
# short of tests, so both end within about one short file of each other. pytest-xdist would
# otherwise order the files by their number of tests (its "loadscope reorder", turned off below),
# which can leave a long file with few tests for the end.
_LONG_FIRST = ("test_sampling.py", "test_sharding.py", "test_engine.py", "test_kernels_integration.py",
               "test_default_model.py", "test_train_e2e.py", "test_model.py", "test_serving.py",
               "test_kernels_attention.py", "test_mechanisms.py", "test_kernels_grouped_matmul.py",
               "test_checkpoint.py", "test_accept_profile.py", "test_cli.py", "test_precision.py",
               "test_train_drafter.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist >= 3.8: keep the collection order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
