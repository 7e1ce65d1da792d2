"""The megakernel's plan: the work items one decode step is made of, in the order the
thread blocks walk them, with a grid barrier after each.

    embed                      x = the token's row of the embedding table
    per layer:
      qkv      rmsnorm(x) @ Wqkv.T, RoPE on q and k; the step's k and v kept
      attend   each KV head's queries over the cells, in as many shares as fill the grid,
               merged by the block that finishes its head's last; the block whose share
               holds the position writes the step's cell first
      wo       the shares merged, x += a @ Wo.T
      gate_up  h = silu(g) * u, g|u = rmsnorm(x) @ Wgate_up.T
      down     x += h @ Wdown.T
    head                       logits = rmsnorm(x) @ Wout.T
    pick                       the argmax: the next token, its position, the host's copy

An item waits for the one before it because it reads what that one wrote: qkv reads x,
which down wrote; attend reads qkv's k and v; wo reads attend's merged output. Each
item's work is split in units: a warp's (a row or a pair of rows of a product) or a
thread block's (a KV head's share of the cells); `units` says how many, for the printout.

What the megakernel runs (`why_not`): a dense llama model, fully resident KV in fp16 or
k8v4, greedy picks, one weight type per kind of matrix across the layers (the stacked
matrices are read by one dequantizer). The engine runs the fast tier's step otherwise,
and `--stats` says why.
"""
from __future__ import annotations

import numpy as np

from ...gpu.geometry import MEGA_SPLITS, MEGA_THREADS

OPS = ("embed", "qkv", "attend", "wo", "gate_up", "down", "head", "pick")
EMBED, QKV, ATTEND, WO, GATE_UP, DOWN, HEAD, PICK = range(len(OPS))
FORMATS = ("fp16", "k8v4")  # the KV formats the megakernel writes and reads
MAX_D = 4096  # the longest row a thread block keeps in shared memory (d_model, n_heads * head_dim)
MAX_HEAD_DIM = 128
MAX_GROUP = MEGA_THREADS // 64  # query heads per KV head: a thread per (head, dim) of a group, dims >= 64


# --8<-- [start:build_plan]
def build_plan(n_layers: int) -> np.ndarray:
    """(items, 2) int32: each item's op and layer (-1 for embed, head and pick)."""
    items = [(EMBED, -1)]
    for layer in range(n_layers):
        items += [(QKV, layer), (ATTEND, layer), (WO, layer), (GATE_UP, layer), (DOWN, layer)]
    items += [(HEAD, -1), (PICK, -1)]
    return np.array(items, np.int32)
# --8<-- [end:build_plan]


def units(op: int, cfg, splits: int = MEGA_SPLITS) -> tuple[int, str]:
    """How many units an item of `op` splits into, and whose they are."""
    hd, kv = cfg.head_dim, cfg.n_kv_heads
    return {EMBED: (cfg.d_model // 8, "threads: 8 values each"),
            QKV: ((cfg.n_heads + 2 * kv) * hd // 2, "warps: a pair of rows each"),
            ATTEND: (kv * splits, "blocks at most: a KV head's share of the cells each, as many as fill the grid"),
            WO: (cfg.d_model, "warps: a row each"),
            GATE_UP: (cfg.d_ff, "warps: a gate row and its up row each"),
            DOWN: (cfg.d_model, "warps: a row each"),
            HEAD: (cfg.vocab_size, "warps: a row each"),
            PICK: (1, "block 0")}[op]


def describe(plan: np.ndarray, cfg, fmt: str, threads: int = MEGA_THREADS, splits: int = MEGA_SPLITS) -> str:
    """The plan as `strata-nb info --mega-plan` prints it: one line per kind of item
    (threads and splits: this machine's geometry, or a GPU's for the docs)."""
    lines = [f"megakernel plan for {cfg.name} ({fmt} KV): {len(plan)} items, {len(plan) - 1} grid barriers "
             f"a step; {threads} threads a block, a block per SM"]
    shown = set()
    for op, layer in plan:
        n_items = int((plan[:, 0] == op).sum())
        if op in shown:
            continue
        shown.add(op)
        n, whose = units(int(op), cfg, splits)
        where = f"x {n_items} (a layer each)" if layer >= 0 else ""
        lines.append(f"  {OPS[op]:<8} {where:<18} {n:>7,} units ({whose})")
    return "\n".join(lines)


def layer_types(layers) -> dict:
    """{kind: the set of its matrices' weight types over the layers}: a layer's LayerWeights,
    or anything with a `qtype` per kind."""
    return {kind: {getattr(L, kind).qtype for L in layers} for kind in ("wqkv", "wo", "wgate_up", "wdown")}


def why_not(cfg, fmt: str, resident: bool, greedy: bool, types: dict, threads: int = MEGA_THREADS) -> str | None:
    """Why the megakernel cannot run this step (the engine then runs the fast tier's), or None.
    types: layer_types of the model's layers; threads: a thread block's (this machine's)."""
    if cfg.arch != "llama" or cfg.n_expert:
        return f"it runs dense llama models (this one: {cfg.arch}{', experts' if cfg.n_expert else ''})"
    if fmt not in FORMATS:
        return f"it reads {' and '.join(FORMATS)} KV, not {fmt}"
    if not resident:
        return "it reads a fully resident KV cache (--kv-resident 0)"
    if not greedy:
        return "it picks greedily (temperature 0)"
    group = cfg.n_heads // cfg.n_kv_heads
    if cfg.head_dim > MAX_HEAD_DIM or group * cfg.head_dim > threads or \
            max(cfg.d_model, cfg.n_heads * cfg.head_dim) > MAX_D:
        return (f"it is built for head_dim <= {MAX_HEAD_DIM}, a KV head's query heads times head_dim <= "
                f"{threads} (a thread each) and rows of <= {MAX_D}")
    for kind, kinds in types.items():  # layer_types'
        if len(kinds) > 1:
            return f"its layers' {kind} matrices differ in type ({', '.join(sorted(kinds))})"
    return None
