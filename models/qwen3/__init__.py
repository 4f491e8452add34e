"""Native Qwen3 (MLX, 4-bit or dense): config, loader, forward pass, CUDA decode kernels, checkpoint
writer. The generation core's names (Engine, generate, SamplingParams, ...) are re-exported from
``models.generation`` for convenience."""

from ..generation.engine import Engine
from ..generation.events import FinishReason, SeqEvent
from ..generation.generate import generate
from ..generation.sampling import SamplerKind, SamplingParams
from ..generation.slot_cache import KVCache, init_kv_cache
from .config import QuantSpec, Quantization, Qwen3Config
from .loader import State, load

__all__ = [
    "Engine",
    "FinishReason",
    "KVCache",
    "QuantSpec",
    "Quantization",
    "Qwen3Config",
    "SamplerKind",
    "SamplingParams",
    "SeqEvent",
    "State",
    "generate",
    "init_kv_cache",
    "load",
]
