"""Every engine setting in one place. The CLI flags map onto these fields one to one."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import StrataError
from .kv_layout import BLOCK, FORMATS

DEVICES = ("auto", "cpu", "cuda")
FAULTS = ("none", "drop-v-mirror")


@dataclass(slots=True)
class Settings:
    model: str | None = None  # GGUF path; None = the default model, fetched on first use
    kv: str = "fp16"  # KV format: fp16, int8, q4_0, k8v4 (fp32 is the reference cache)
    kv_resident: int = 0  # cells per layer kept in VRAM; 0 = fully resident
    kv_window: int = 256  # recent cells per layer held in the ring (streaming)
    qsa_budget: int = 0  # cells a query reads with block selection; 0 = every cell
    device: str = "auto"  # auto, cpu (the numpy backend), cuda
    max_context: int | None = None  # cells per layer the KV cache holds; None = the model's trained context
    prefill_chunk: int | None = None  # prompt tokens per forward pass; None = the backend's (prefill_chunk)
    fault: str = "none"  # teaching switch: drop-v-mirror reproduces the unfolded-V-half bug
    graph: bool = True  # replay each decode step from a captured CUDA graph (on a GPU)

    def __post_init__(self):
        if self.kv not in FORMATS:
            raise StrataError(f"--kv {self.kv!r} is not a KV format; choose one of fp16, int8, q4_0, k8v4")
        if self.device not in DEVICES:
            raise StrataError(f"--device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.max_context is not None and self.max_context < BLOCK:
            raise StrataError(f"--max-context must be at least {BLOCK} (one block), got {self.max_context}")
        if self.kv_resident < 0:
            raise StrataError(f"--kv-resident must be 0 (fully resident) or a positive cell count, got {self.kv_resident}")
        if self.kv_window < BLOCK or self.kv_window % BLOCK:
            raise StrataError(f"--kv-window must be a positive multiple of {BLOCK} cells, got {self.kv_window}")
        if self.qsa_budget < 0:
            raise StrataError(f"--qsa-budget must be 0 (read every cell) or a positive cell count, got {self.qsa_budget}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise StrataError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if self.fault not in FAULTS:
            raise StrataError(f"--fault {self.fault!r} is not one of {', '.join(FAULTS)}")
        if self.fault == "drop-v-mirror" and self.kv != "k8v4":
            raise StrataError("--fault drop-v-mirror applies to the k8v4 V half; use it with --kv k8v4")


@dataclass(slots=True)
class SamplingSettings:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut
    seed: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise StrataError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0):  # also catches NaN
            raise StrataError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise StrataError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise StrataError(f"--top-p must be in (0, 1], got {self.top_p}")
