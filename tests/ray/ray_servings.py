"""Servings for the Ray tests that need Ray inside the actor (imported by name in the actors: the
caller's sys.path, with tests/ray on it, is added there)."""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from mlx_serving.serving import Batch, Serving

__all__ = ["node_probe"]


def node_probe() -> Serving:
    """Each row is a number of seconds: sleep the longest of the batch, then answer
    ``{"node": the actor's Ray node id (hex), "pid": its process id}``."""
    node = ray.get_runtime_context().get_node_id()

    def rows(batch: Batch) -> list[dict[str, Any]]:
        time.sleep(max(batch.rows()))
        return [{"node": node, "pid": os.getpid()}] * batch.size

    return (Serving.new(rows)
            .client_preprocessing(lambda seconds: (Batch.stack([float(seconds)]), None))
            .client_postprocessing(lambda output_metadata, info: output_metadata[0][0]))
