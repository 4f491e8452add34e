"""Native Llama (Llama 2 / 3.x and fine-tunes; Mistral, the same architecture) on MLX, 4-bit or
dense: load a checkpoint into a :class:`State` whose forward pass (:mod:`.model`) the
continuous-batching Engine runs through ``models.registry`` like any other family."""

from .config import LlamaConfig, RopeScaling, read_config
from .loader import State, load

__all__ = ["LlamaConfig", "RopeScaling", "State", "load", "read_config"]
