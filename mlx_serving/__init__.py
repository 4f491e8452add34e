"""mlx-serving: a batching serving runtime modeled on Nx.Serving, with native MLX model families (Qwen3, Qwen2, Llama).

One distribution namespace: the repository's three folders install as
``mlx_serving.serving`` (the generic runtime), ``mlx_serving.tokenization`` (text <-> token ids)
and ``mlx_serving.models`` (model families and the text-generation serving). The public names
are re-exported here::

    from mlx_serving import Serving, ServingPool, text_generation
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .models import text_generation
from .models.sources import default_checkpoint
from .serving import *  # noqa: F403  (the runtime's public names, listed in serving.__all__)
from .serving import __all__ as _serving_all

try:
    __version__ = version("mlx-serving")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [*_serving_all, "__version__", "default_checkpoint", "text_generation"]
