"""The transformers integration under its public name (`turboattn.hf`); it lives in integrations/hf.py.

Importing this module registers the "turboattn" attention implementation.
"""

from .integrations.hf import (ATTN_NAME, KEY_FIT_DEFAULT, TurboQuantCache, TurboQuantLayer, register,
                              turboattn_attention, turboattn_mask)
from .integrations.hf_persist import load_turboquant_cache, save_turboquant_cache

__all__ = ["ATTN_NAME", "KEY_FIT_DEFAULT", "TurboQuantCache", "TurboQuantLayer", "load_turboquant_cache", "register",
           "save_turboquant_cache", "turboattn_attention", "turboattn_mask"]
