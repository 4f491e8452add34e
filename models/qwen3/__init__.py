"""Native Qwen3 (MLX, 4-bit or dense) model: load, generate, continuous-batching Engine."""

from .cache import KVCache, init_kv_cache
from .config import QuantSpec, Quantization, Qwen3Config
from ..generation.engine import Engine
from .events import FinishReason, SeqEvent
from .generate import generate
from .loader import State, load
from .sampling import SamplerKind, SamplingParams

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
