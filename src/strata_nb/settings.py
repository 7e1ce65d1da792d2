"""Every engine setting in one place. The CLI flags map onto these fields one to one, so a
bad value names the field (`max_tokens`) and the CLI shows it as its flag (`--max-tokens`)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import SettingError
from .kv_layout import BLOCK, FORMATS

DEVICES = ("auto", "cpu", "cuda")
KERNELS = ("plain", "fast", "mega")  # the cuda backend's tiers: src/strata_nb/kernels/, src/strata_nb/fast/ and
# the fast tier with its decode step as one megakernel launch (src/strata_nb/fast/mega/)
FAULTS = ("none", "drop-v-mirror", "verify-no-mirror", "expert-early-resident")
MAX_WINDOW = 8  # --spec: positions a verify window holds, at most (the matvec's rows)


@dataclass(slots=True)
class Settings:
    model: str | None = None  # GGUF path; None = the default model, fetched on first use
    kv: str = "fp16"  # KV format: fp16, int8, q4_0, k8v4 (fp32 is the reference cache)
    kv_resident: int = 0  # cells per layer kept in VRAM; 0 = fully resident
    kv_window: int = 256  # recent cells per layer held in the ring (streaming)
    qsa_budget: int = 0  # cells a query reads with block selection; 0 = every cell
    device: str = "auto"  # auto, cpu (the numpy backend), cuda
    kernels: str = "fast"  # on the cuda backend: plain (one plain kernel per op), fast (fused, graphs) or mega
    max_context: int | None = None  # cells per layer the KV cache holds; None = the model's trained context
    prefill_chunk: int | None = None  # prompt tokens per forward pass; None = the backend's (prefill_chunk)
    fault: str = "none"  # teaching switches: drop-v-mirror (the unfolded-V-half bug), verify-no-mirror, expert-early-resident
    spec: int = 0  # speculative decoding: the verify window's positions T (2..8); 0 = off
    suffix_draft: int = 3  # the drafter's longest n-gram matched against the prompt and output
    expert_cache: int | str = "auto"  # MoE: experts held in VRAM slots; "auto" = what free VRAM holds
    adapt_every: int = 4  # MoE: passes between the expert cache's adapts
    adapt_swaps: int = 96  # MoE: swaps (an expert evicted for another) at most, per adapt
    vram_reserve_mib: int = 1024  # MoE: VRAM "auto" leaves free
    graph: bool = True  # replay each decode step from a captured CUDA graph (on a GPU)

    def __post_init__(self):
        if self.kv not in FORMATS:
            raise SettingError("kv", f"{self.kv!r} is not a KV format; choose one of fp16, int8, q4_0, k8v4")
        if self.device not in DEVICES:
            raise SettingError("device", f"{self.device!r} is not one of {', '.join(DEVICES)}")
        if self.kernels not in KERNELS:
            raise SettingError("kernels", f"{self.kernels!r} is not one of {', '.join(KERNELS)}")
        if self.max_context is not None and self.max_context < BLOCK:
            raise SettingError("max_context", f"must be at least {BLOCK} (one block), got {self.max_context}")
        if self.kv_resident < 0:
            raise SettingError("kv_resident", f"must be 0 (fully resident) or a positive cell count, got {self.kv_resident}")
        if self.kv_window < BLOCK or self.kv_window % BLOCK:
            raise SettingError("kv_window", f"must be a positive multiple of {BLOCK} cells, got {self.kv_window}")
        if self.qsa_budget < 0:
            raise SettingError("qsa_budget", f"must be 0 (read every cell) or a positive cell count, got {self.qsa_budget}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise SettingError("prefill_chunk", f"must be at least 1, got {self.prefill_chunk}")
        if self.fault not in FAULTS:
            raise SettingError("fault", f"{self.fault!r} is not one of {', '.join(FAULTS)}")
        if self.expert_cache != "auto":
            try:
                self.expert_cache = int(self.expert_cache)
            except (TypeError, ValueError):
                raise SettingError("expert_cache", f"must be 'auto' or a number of experts, got {self.expert_cache!r}")
            if self.expert_cache < 0:
                raise SettingError("expert_cache", f"must be 'auto' or a number of experts >= 0, got {self.expert_cache}")
        if self.adapt_every < 1:
            raise SettingError("adapt_every", f"must be at least 1 pass, got {self.adapt_every}")
        if self.adapt_swaps < 1:
            raise SettingError("adapt_swaps", f"must be at least 1, got {self.adapt_swaps}")
        if self.vram_reserve_mib < 0:
            raise SettingError("vram_reserve_mib", f"must be >= 0, got {self.vram_reserve_mib}")
        if self.spec != 0 and not 2 <= self.spec <= MAX_WINDOW:
            raise SettingError("spec", f"must be 0 (off) or a window of 2 .. {MAX_WINDOW} positions, got {self.spec}")
        if self.suffix_draft < 1:
            raise SettingError("suffix_draft", f"must be at least 1 token, got {self.suffix_draft}")
        if self.fault == "verify-no-mirror" and (self.spec == 0 or self.kv_resident == 0):
            raise SettingError("fault", "'verify-no-mirror' breaks the verify window's host copy: it needs --spec and a "
                                        "streamed cache (--kv-resident)")
        if self.fault == "drop-v-mirror" and self.kv != "k8v4":
            raise SettingError("fault", "'drop-v-mirror' breaks the k8v4 V half, so it needs the KV format k8v4")


@dataclass(slots=True)
class SamplingSettings:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # 1 = no nucleus cut
    seed: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise SettingError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0):  # also catches NaN
            raise SettingError("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SettingError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SettingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise SettingError("seed", f"must be >= 0, got {self.seed}")
