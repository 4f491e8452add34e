"""Ray backends of a Serving (needs the ``ray`` extra: ``pip install 'mlx-serving[ray]'``).

``RayServingPool`` (also ``ServingPool(factory, workers=N, backend="ray")``): the client contract
over Ray actors, one started Serving per actor. Nothing in ``mlx_serving.serving`` imports this
package (nor ray) unless ``backend="ray"`` is asked for.
"""

from ._pool import RayServingPool

__all__ = ["RayServingPool"]
