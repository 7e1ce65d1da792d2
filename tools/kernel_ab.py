"""Two versions of a kernel module timed side by side in one process, on a GPU (CUPTI,
needs torch): the working tree's against the same file at a git revision, or against a
file. Both run on the same device arrays, in alternation, twice over, and the outputs are
compared bit for bit, so a change that moves the time is seen next to the one it
replaces, not across two runs (or two machines) whose clocks and neighbours differ.

    STRATA_NB_GPU=1 python tools/kernel_ab.py attention_step HEAD~1
    STRATA_NB_GPU=1 python tools/kernel_ab.py matvec_fused path/to/old_matvec_fused.py
    STRATA_NB_GPU=1 python tools/kernel_ab.py attention_step HEAD variant_a.py variant_b.py

Files after the first are more versions, timed in the same rounds (variants of one idea
in one device call); outputs are compared with the first's.

Modules it knows how to drive (FILES: the kernel file each compares), on the default
model's shapes with random bytes for K/V and weights (the times depend on the shapes only):

- `attention_step`: one decode query at 48, 1,024 and 8,192 cells of a 512-block list
  (as a replayed step lists every block), and 1,024 of a 68-block list, fp16 and k8v4;
- `attention_prefill`: the prompt kernel and its combine, 256 queries ending at 8K and
  2,048 ending at 4K, fp16 and k8v4;
- `matvec_fused`: each fused matvec of a decode step (q|k|v, o, gate|up, down, the Q8_0 head);
- `argmax`: the greedy pick over the default model's 49,152 logits.
- `route`, `expert_gate_up`, `expert_down`: one token through an MoE layer of moefy's
  shapes (split E8 K8 F192 and copies E8 K2 F1536, every expert in a slot), each kernel alone.

Each version is loaded as its own module (`strata_nb.kernels.<name>_ab0`, `_ab1`), so
its kernels compile apart and CUPTI names them as the product's. The product's launcher
(`attention`, `matvec`) runs each version by taking its launcher or kernel table in turn.
"""
import importlib.util
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(f"strata_nb.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def old_source(module: str, against: str, tmp: Path) -> Path:
    """The file to compare with: `against` itself if it is one, else the module's file at
    that git revision."""
    if Path(against).is_file():
        return Path(against)
    # the file's path now, then where it was before the kernels were grouped by role
    for rel in (f"src/strata_nb/kernels/{FILES[module]}", f"src/strata_nb/kernels/{Path(FILES[module]).name}"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{against}:{rel}"], capture_output=True, text=True)
        if text.returncode == 0:
            break
    else:
        sys.exit(f"kernel_ab: no {FILES[module]} at {against!r}: {text.stderr.strip()}")
    path = tmp / f"{module}_{against.replace('/', '_').replace('~', '_')}.py"
    path.write_text(text.stdout if rel.endswith(FILES[module]) else with_todays_imports(text.stdout))
    return path


def with_todays_imports(source: str) -> str:
    """A kernel file from before the kernels were grouped by role (64401d1), with its
    imports pointed at where each module is now, so it loads beside today's tree."""
    src = ROOT / "src" / "strata_nb"
    moved = {f"strata_nb.kernels.{p.stem}": ".".join(p.relative_to(src.parent).with_suffix("").parts)
             for p in list(src.glob("kernels/*/*.py")) + list(src.glob("gpu/*.py")) if p.stem != "__init__"}
    moved["strata_nb.kv.formats"] = "strata_nb.kv_layout"
    return re.sub(r"strata_nb\.(?:kernels\.\w+|kv\.formats)\b", lambda m: moved.get(m.group(0), m.group(0)), source)


def side_by_side(label: str, versions: dict, run, result, steps: int) -> None:
    """Time run(module) for each version, twice in alternation; print us and whether
    result(module), the output of one fresh run, agrees with the first version's bit for bit."""
    import kernel_bench as kb

    cells, first = [], None
    for _ in range(2):
        for name, module in versions.items():
            t = kb.us(lambda: run(module), steps)
            out = result(module)
            first = out if first is None else first
            same = "" if np.array_equal(out, first, equal_nan=True) else " (output differs)"
            cells.append(f"{name} {sum(t.values()):.1f}{same}")
    print(f"{label}: " + " | ".join(cells), flush=True)


def rerun_and_read(run, out):
    """result() for side_by_side when run writes `out` afresh each time: one more run, read back."""
    def result(module):
        run(module)
        return out.copy_to_host()
    return result


def launcher(module):
    """module.attention_step, given `ordered` only if it takes it (a version before the lone split)."""
    import inspect

    if "ordered" in inspect.signature(module.attention_step).parameters:
        return module.attention_step
    return lambda *args: module.attention_step(*args[:7])


def attention_step_cases(versions: dict) -> None:
    from numba import cuda

    import kernel_bench as kb
    import strata_nb.fast.attention as at

    page_table = cuda.to_device(np.arange(kb.N_BLOCKS, dtype=np.int32))
    for fmt in ("fp16", "k8v4"):
        kv = kb.pool(fmt)
        q = cuda.to_device(kb.rng.standard_normal((1, 9, 64)).astype(np.float32))
        out = cuda.device_array((1, 9, 64), np.float32)
        for depth, listed in ((48, 512), (1024, 68), (1024, 512), (8192, 512)):
            blocks = cuda.to_device(np.arange(listed, dtype=np.int32).reshape(1, listed))
            q_pos = cuda.to_device(np.array([depth - 1], np.int32))

            def run(module):
                at.attention_step = launcher(module)  # the launcher attention() calls
                at.attention(fmt, q, q_pos, blocks, page_table, kv, None, out, rotate_out=fmt == "k8v4",
                             ordered=True)  # as a step's list is
            side_by_side(f"{fmt}, one query at {depth} cells of a {listed}-block list (us)", versions, run,
                         rerun_and_read(run, out), 30)


def attention_prefill_cases(versions: dict) -> None:
    from numba import cuda

    import kernel_bench as kb
    import strata_nb.fast.attention as at
    from strata_nb.kv_layout import all_blocks_upto

    page_table = cuda.to_device(np.arange(kb.N_BLOCKS, dtype=np.int32))
    for fmt in ("fp16", "k8v4"):
        kv = kb.pool(fmt)
        for n_q, end in ((256, kb.N_BLOCKS * 16), (2048, 4096)):
            pos = np.arange(end - n_q, end, dtype=np.int32)
            q = cuda.to_device(kb.rng.standard_normal((n_q, 9, 64)).astype(np.float32))
            out = cuda.device_array((n_q, 9, 64), np.float32)

            def run(module):
                at.attention_prompt = module.attention_prompt  # the launcher attention() calls
                at.attention(fmt, q, pos, all_blocks_upto(pos), page_table, kv, None, out)
            side_by_side(f"{fmt}, a prompt chunk of {n_q} ending at {end} (us, with its combine)", versions,
                         run, rerun_and_read(run, out), 3)


def matvec_fused_cases(versions: dict) -> None:
    from numba import cuda

    import kernel_bench as kb
    import strata_nb.fast.matvec_fused as mv
    from strata_nb.kernels.dense.gguf_rows import row_bytes

    def matvec(module, *args, **kw):
        mv.MATVEC_KERNELS = module.MATVEC_KERNELS  # the table the launcher picks from
        mv.matvec_fused(*args, **kw)

    for name, (qtype, n_out, n_in, kind) in kb.MATVEC_SHAPES.items():
        w = cuda.to_device(kb.rng.integers(0, 64, (n_out, row_bytes(qtype, n_in)), dtype=np.uint8))
        x = cuda.to_device(kb.rng.standard_normal((1, 2 * n_in if kind == "gated" else n_in)).astype(np.float32))
        norm = cuda.to_device(np.ones(n_in, np.float32))
        y = cuda.device_array((1, n_out), np.float32)
        kw = kb.fused(kind, norm)

        def result(module):  # one product into zeros: the timed runs keep adding to y
            fresh = cuda.to_device(np.zeros((1, n_out), np.float32))
            matvec(module, x, w, qtype, fresh, **kw)
            return fresh.copy_to_host()
        side_by_side(f"matvec {name} ({n_out} x {n_in} {qtype}, {kind}) (us)", versions,
                     lambda m: matvec(m, x, w, qtype, y, **kw), result, 50)


def argmax_cases(versions: dict) -> None:
    from numba import cuda

    import kernel_bench as kb

    logits = cuda.to_device(kb.rng.standard_normal((1, 49152)).astype(np.float32))
    out = cuda.device_array(1, np.int32)

    def run(module):
        module.argmax(logits, out)
    side_by_side("argmax of 49,152 logits (us)", versions, run, rerun_and_read(run, out), 50)


def expert_layer(e: int, k: int, f: int):
    """One token through an MoE layer of moefy's shapes from the default model (D 576, F32
    router, Q4_1 experts, every expert in a slot): random inputs and weights, and the
    device arrays route, expert_gate_up and expert_down read and write."""
    from numba import cuda

    import kernel_bench as kb
    from moe_layer import D, QTYPE, q41

    a = dict(x=cuda.to_device(kb.rng.standard_normal((1, D)).astype(np.float32)),
             norm=cuda.to_device(np.ones(D, np.float32)),
             router=cuda.to_device((0.1 * kb.rng.standard_normal((e, D))).astype(np.float32).view(np.uint8)),
             res=cuda.to_device(np.arange(e, dtype=np.int32)),
             lookups=cuda.to_device(np.zeros(e, np.int32)), hits=cuda.to_device(np.zeros(e, np.int32)),
             x_norm=cuda.device_array((1, D), np.float32), chosen=cuda.device_array((1, k), np.int32),
             weights=cuda.device_array((1, k), np.float32), slot_of=cuda.device_array((1, k), np.int32),
             gate_up=cuda.to_device(q41(kb.rng, e, 2 * f, D)), down=cuda.to_device(q41(kb.rng, e, D, f)),
             h=cuda.device_array((1, k, f), np.float32))
    return types.SimpleNamespace(**a, qtype=QTYPE)


EXPERT_SHAPES = (("split", 8, 8, 192), ("copies", 8, 2, 1536))  # (moefy kind, E, K, F)


def route_cases(versions: dict) -> None:
    for kind, e, k, f in EXPERT_SHAPES:
        m = expert_layer(e, k, f)

        def run(module):
            module.route(m.x, m.norm, 1e-5, m.router, "F32", m.x_norm, m.chosen, m.weights, m.slot_of, m.res, 0,
                         m.lookups, m.hits)

        def result(module):  # every output's bits; the counts only grow
            run(module)
            return np.concatenate([a.copy_to_host().view(np.uint32).ravel() for a in (m.x_norm, m.chosen, m.weights,
                                                                                    m.slot_of)])
        side_by_side(f"route, {kind} E{e} K{k}, one token (us)", versions, run, result, 50)


def expert_gate_up_cases(versions: dict) -> None:
    from strata_nb.kernels.experts.route import route

    for kind, e, k, f in EXPERT_SHAPES:
        m = expert_layer(e, k, f)
        route(m.x, m.norm, 1e-5, m.router, "F32", m.x_norm, m.chosen, m.weights, m.slot_of, m.res, 0, m.lookups,
              m.hits)

        def run(module):
            module.expert_gate_up(m.x_norm, m.chosen, m.slot_of, 0, m.gate_up, m.gate_up, m.qtype, m.h)
        side_by_side(f"expert_gate_up, {kind} E{e} K{k} F{f}, one token (us)", versions, run,
                     rerun_and_read(run, m.h), 50)


def expert_down_cases(versions: dict) -> None:
    from numba import cuda

    import kernel_bench as kb
    from strata_nb.kernels.experts.route import route

    for kind, e, k, f in EXPERT_SHAPES:
        m = expert_layer(e, k, f)
        route(m.x, m.norm, 1e-5, m.router, "F32", m.x_norm, m.chosen, m.weights, m.slot_of, m.res, 0, m.lookups,
              m.hits)
        m.h.copy_to_device((0.1 * kb.rng.standard_normal((1, k, f))).astype(np.float32))

        def result(module):  # one layer's sum into zeros: the timed runs keep adding to x
            fresh = cuda.to_device(np.zeros(m.x.shape, np.float32))
            module.expert_down(m.h, m.chosen, m.weights, m.slot_of, 0, m.down, m.down, m.qtype, fresh)
            return fresh.copy_to_host()
        side_by_side(f"expert_down, {kind} E{e} K{k} F{f}, one token (us)", versions,
                     lambda module: module.expert_down(m.h, m.chosen, m.weights, m.slot_of, 0, m.down, m.down,
                                                       m.qtype, m.x), result, 50)


FILES = {"attention_step": "attention/attention_step.py", "attention_prefill": "attention/attention_prefill.py",
         "matvec_fused": "dense/matvec_fused.py", "argmax": "step/argmax.py", "route": "experts/route.py",
         "expert_gate_up": "experts/expert_gate_up.py", "expert_down": "experts/expert_down.py"}
CASES = {"attention_step": attention_step_cases, "attention_prefill": attention_prefill_cases,
         "matvec_fused": matvec_fused_cases, "argmax": argmax_cases, "route": route_cases,
         "expert_gate_up": expert_gate_up_cases, "expert_down": expert_down_cases}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in CASES or not all(Path(p).is_file() for p in argv[2:]):
        print(__doc__, file=sys.stderr)
        return 2
    module, against, more = argv[0], argv[1], argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        old = old_source(module, against, Path(tmp))
        files = [(against, old), ("working tree", ROOT / "src/strata_nb/kernels" / FILES[module])]
        files += [(Path(p).stem, Path(p)) for p in more]
        versions = {name: load(f"{module}_ab{i}", path) for i, (name, path) in enumerate(files)}
        CASES[module](versions)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
