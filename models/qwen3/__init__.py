"""Native Qwen3 (MLX, 4-bit or dense) model: load, generate, continuous-batching Engine."""

from .cache import KVCache, init_kv_cache
from .config import QuantSpec, Quantization, Qwen3Config
from .engine import Engine, SeqEvent
from .generate import generate
from .loader import State, load
from .sampling import SamplingParams

__all__ = [
    "Engine",
    "KVCache",
    "QuantSpec",
    "Quantization",
    "Qwen3Config",
    "SamplingParams",
    "SeqEvent",
    "State",
    "generate",
    "init_kv_cache",
    "load",
]
