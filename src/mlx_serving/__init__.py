"""mlx-serving: a batching serving runtime modeled on Nx.Serving, with native MLX model families (Qwen3, Qwen2, Llama).

One distribution namespace: the repository's three folders install as
``mlx_serving.serving`` (the generic runtime), ``mlx_serving.tokenization`` (text <-> token ids)
and ``mlx_serving.models`` (model families and the text-generation serving). The public names
are re-exported here::

    from mlx_serving import Serving, ServingPool, text_embedding, text_generation
"""

from __future__ import annotations

from ._version import __version__
from .models import text_embedding, text_generation
from .models.sources import default_checkpoint
from .serving import *  # noqa: F403  (the runtime's public names, listed in serving.__all__)
from .serving import __all__ as _serving_all

__all__ = [*_serving_all, "__version__", "default_checkpoint", "text_embedding", "text_generation"]
