"""The transformers integration under its public name (`turboattn.hf`); it lives in integrations/hf.py.

Importing this module registers the "turboattn" attention implementation.
"""

from .integrations.hf import (ATTN_NAME, DEFAULT_PRESETS, KEY_FIT_DEFAULT, TurboQuantCache, TurboQuantLayer,
                              default_preset, register, turboattn_attention, turboattn_mask)
from .integrations.hf_persist import load_turboquant_cache, save_turboquant_cache

__all__ = ["ATTN_NAME", "DEFAULT_PRESETS", "KEY_FIT_DEFAULT", "TurboQuantCache", "TurboQuantLayer", "default_preset",
           "load_turboquant_cache", "register", "save_turboquant_cache", "turboattn_attention", "turboattn_mask"]
