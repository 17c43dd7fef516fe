"""turboattn: attention on a TurboQuant-compressed KV cache, and dense flash attention."""

from .attention import cached_attention, flash_attention
from .cache import QuantizedKVCache
from .format.codec import KVCodec, Packed

__version__ = "0.1.0"

__all__ = ["KVCodec", "Packed", "QuantizedKVCache", "cached_attention", "flash_attention", "__version__"]
