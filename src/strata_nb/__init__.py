"""strata-nb: a teaching-grade LLM inference engine with quantized, streamed KV."""
from .engine.engine import Engine
from .errors import StrataError

__all__ = ["Engine", "StrataError"]
__version__ = "0.1.0"
