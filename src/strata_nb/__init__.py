"""strata-nb: a teaching-grade LLM inference engine with quantized, streamed KV."""
from .kernel_cache import use_kernel_cache

use_kernel_cache()  # before any kernel is defined: Numba's cache folder is read then (kernel_cache.py)

from .engine.engine import Engine  # noqa: E402
from .errors import StrataError  # noqa: E402

__all__ = ["Engine", "StrataError"]
__version__ = "0.1.0"
