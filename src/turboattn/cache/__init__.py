"""Compressed K/V storage: the cache objects that own the tensors the ops read and write."""

from .dynamic import QuantizedKVCache
from .persist import load_cache, save_cache

__all__ = ["QuantizedKVCache", "load_cache", "save_cache"]
