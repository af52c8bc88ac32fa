"""Score a sequence with a tiny randomly initialised DeepSeek-V4 (CPU)."""

import numpy as np

import dspark_jax

model = dspark_jax.init(dspark_jax.config.tiny(), seed=0)
ids = np.arange(1, 33) % model.config.vocab_size
logits = model.logits(ids)
print(model)
print("logits", logits.shape, "greedy next tokens:", np.asarray(logits[0]).argmax(-1)[-8:])
