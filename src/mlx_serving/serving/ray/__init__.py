"""Ray backends of a Serving (needs the ``ray`` extra: ``pip install 'mlx-serving[ray]'``).

- ``RayBackend``: a ``ServingPool``'s workers as Ray actors, one started Serving per actor
  (``ServingPool(factory, workers=N, backend=RayBackend(...))``, or ``backend="ray"``).
- ``ServingDeployment`` / ``serving_app``: a Ray Serve deployment, one started Serving per
  replica (imported on first use: ``ray.serve`` is heavier than ``ray``).

The same with the OpenAI-compatible server as its HTTP ingress is ``mlx_serving.server.ray``
(``OpenAIDeployment`` / ``openai_app``: the ``server`` and ``ray`` extras).

Nothing in ``mlx_serving.serving`` imports this package (nor ray) unless a ``RayBackend`` is
made (``backend="ray"`` imports it).
"""

from typing import TYPE_CHECKING

from ._backend import RayBackend

if TYPE_CHECKING:  # imported on first use (see __getattr__)
    from ._deployment import ServingDeployment, serving_app

__all__ = ["RayBackend", "ServingDeployment", "serving_app"]

_LAZY = {"ServingDeployment": "_deployment", "serving_app": "_deployment"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
