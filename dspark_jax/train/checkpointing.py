"""Resumable training checkpoints with orbax: the phase's TrainState plus a JSON of metadata
(progress, data position, loss history, whether the phase finished)."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class PhaseCheckpointer:
    """Keeps the latest checkpoint of one training phase under ``directory``."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        # Synchronous saves: the next train step donates the arrays being saved.
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False))

    def save(self, step: int, state, meta: dict) -> None:
        self.manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, like) -> tuple[object, dict] | None:
        """The latest (state, meta), with ``like`` (a state of the right structure) as the target;
        None when there is no checkpoint."""
        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def close(self) -> None:
        self.manager.close()
