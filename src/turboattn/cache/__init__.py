"""Compressed K/V storage: the cache objects that own the tensors the ops read and write."""

from .dynamic import QuantizedKVCache

__all__ = ["QuantizedKVCache"]
