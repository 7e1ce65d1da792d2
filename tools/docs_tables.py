"""Write the tables the README and the GPU pages show, from measured data files, so no
figure is typed by hand (tests/test_docs.py checks both are up to date):

- README.md, between its bench-table markers: decode tok/s at each depth and prefill
  tok/s at the deepest, per format and mode, from docs/measured/bench/bench.json
  (the latest `strata-nb bench` run);
- docs/measured/lessons/<id>.md: each "From plain to fast" lesson's before/after figure,
  with the hardware and the command that measured it, and docs/measured/lessons/all.md,
  every figure in one table, from docs/measured/lessons.json;
- docs/measured/experts/experts.md: the MoE bench table (the dense model, the split
  E = K file, the copies file at each expert-cache size), from the `strata-nb bench`
  files in docs/measured/experts/, and on a plain run its plot,
  docs/assets/expert_hit_rate.png (matplotlib, the `bench` extra).

- docs/measured/needle/needle.md and needle_quest_bound.md: the retrieval probe's tables
  (`strata-nb needle` on the H200, with the key sketch and with Quest's bound, the scores
  before it), from the needle.json files beside them, and on a plain run their heat-maps,
  docs/assets/needle.png and needle_quest_bound.png; and needle/speed.md, decode tok/s
  with each score, from the two `strata-nb bench` runs beside them (bench_*.json), and
  needle/speed_h100.md, the code before the sketch against a later engine's, from
  bench_*_h100.json.

- docs/reading-the-code.md, its reading order of the plain tier: each file's line count
  and the total, from src/strata_nb/kernels/.

- docs/measured/load/q4_k_by_hand.md: one Q4_K super-block (random bytes, seed 0)
  decoded step by step, each step's numbers computed here and the weights checked
  against model/dequant.py's reference.

- each docs/measured/**/bench.md, from the bench.json beside it, as `strata-nb bench`
  writes it (bench/report.py: the command as a reader pastes it, no machine's paths).

- docs/measured/mega/timeline.md, where a decode step's time goes in the fast tier and in
  the megakernel, from docs/measured/mega/timeline.json (`python tools/measure_docs.py mega-timeline` on a GPU),
  and on a plain run its figure, docs/assets/mega_timeline.png. Neither is written
  before that file exists.

- docs/measured/models/two_models.md: the default model and Gemma 3 270M side by side,
  from the two files' metadata and tensors as the engine reads them, and
  docs/measured/mega/plan.md, the megakernel's plan for the default model
  (`strata-nb info --mega-plan`). They need the files in the model cache (`strata-nb
  fetch`, `strata-nb fetch --model gemma3-270m`); where one is absent they are neither
  written nor checked, and it says so.

    python tools/docs_tables.py           # rewrite them
    python tools/docs_tables.py --check   # exit 1 if any table is out of date (the plot is not checked)
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path

from strata_nb.bench.report import markdown, model_file, pastable

ROOT = Path(__file__).resolve().parents[1]
BENCH_JSON = ROOT / "docs" / "measured" / "bench" / "bench.json"
LESSONS_JSON = ROOT / "docs" / "measured" / "lessons.json"
LESSONS_DIR = ROOT / "docs" / "measured" / "lessons"
README = ROOT / "README.md"
NEEDLE_DIR = ROOT / "docs" / "measured" / "needle"  # needle.json, needle_quest_bound.json: one probe run each
NEEDLE_RUNS = {"needle": "the key sketch", "needle_quest_bound": "Quest's bound (the code before the key sketch)"}
EXPERTS_DIR = ROOT / "docs" / "measured" / "experts"  # dense.json, split.json, copies.json: one bench run each
EXPERTS_MD = EXPERTS_DIR / "experts.md"
EXPERTS_PNG = ROOT / "docs" / "assets" / "expert_hit_rate.png"
READING = ROOT / "docs" / "reading-the-code.md"
PLAIN_TIER = ROOT / "src" / "strata_nb" / "kernels"
BY_HAND = ROOT / "docs" / "measured" / "load" / "q4_k_by_hand.md"
TWO_MODELS = ROOT / "docs" / "measured" / "models" / "two_models.md"
MEGA_PLAN = ROOT / "docs" / "measured" / "mega" / "plan.md"
MEGA_TIMELINE = ROOT / "docs" / "measured" / "mega" / "timeline.json"  # measure_docs.py mega-timeline, on a GPU
MEGA_TIMELINE_PNG = ROOT / "docs" / "assets" / "mega_timeline.png"
MEGA_ITEMS = ("embed", "qkv", "attend", "wo", "gate_up", "down", "head", "pick")
START = "<!-- bench-table: written by python tools/docs_tables.py from docs/measured/bench/bench.json -->"
END = "<!-- /bench-table -->"


def rate(x: float) -> str:
    """The bench's own rounding (bench/report.py): whole numbers from 100 up."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def readme_table(bench: dict) -> str:
    """One row per format and mode (then each peer): decode tok/s at every depth, prefill
    tok/s at the deepest."""
    rows = [(f"{r['fmt']} {r['mode']}", r) for r in bench["rows"]]
    rows += [(p["peer"], p) for p in bench.get("peer", []) + bench.get("llama", []) if "error" not in p]
    depths = sorted({r["depth"] for _, r in rows})
    names = list(dict.fromkeys(name for name, _ in rows))
    by = {(name, r["depth"]): r for name, r in rows}
    deepest = depths[-1]
    head = ["configuration"] + [f"decode tok/s at {d:,}" for d in depths] + [f"prefill tok/s at {deepest:,}"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name in names:
        cells = [rate(by[name, d]["decode_tok_s"]) if (name, d) in by else "-" for d in depths]
        cells.append(rate(by[name, deepest]["prefill_tok_s"]) if (name, deepest) in by else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    caption = (f"{model_file(bench['command'])} on {bench['device']}, medians of {bench['runs']} runs, "
               f"{bench['decode_tokens']} decode tokens a run: `{pastable(bench['command'])}`")
    return "\n".join([START, "", caption, "", *lines, "", END])


def figure(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def lesson_table(lesson: dict) -> str:
    """The lesson's figure, then the hardware and the command that measured it (and the
    lesson's note: how it was run, what else the same runs gave)."""
    note = f", {lesson['note']}" if lesson.get("note") else ""
    return "\n".join([
        f"| {lesson['measure']} | {lesson['unit']} |",
        "| --- | ---: |",
        f"| before: {lesson['before_label']} | {figure(lesson['before'])} |",
        f"| after: {lesson['after_label']} | **{figure(lesson['after'])}** |",
        "",
        f"Measured on {lesson['hardware']}{bench_of(lesson['command'])}: `{lesson['command']}`{note}.",
    ]) + "\n"


def bench_of(command: str) -> str:
    """Where a lesson's command runs: a script in tools/ is the product's; one that is not
    is the lab bench's (the `lab-bench` branch keeps it), and the lesson says so."""
    script = re.search(r"\btools/(\w+\.py)\b", command)
    return "" if script is None or (ROOT / "tools" / script[1]).is_file() else \
        " with the lab bench (the `lab-bench` branch)"


def all_lessons_table(lessons: list[dict]) -> str:
    lines = ["| lesson | measure | before | after | unit | on |", "| --- | --- | ---: | ---: | --- | --- |"]
    for ls in lessons:
        lines.append(f"| [{ls['title']}](#{ls['anchor']}) | {ls['measure']} | "
                     f"{figure(ls['before'])} | {figure(ls['after'])} | {ls['unit']} | {short_hardware(ls)} |")
    return "\n".join(lines) + "\n"


def short_hardware(lesson: dict) -> str:
    """The table's column: the GPU's name (H100, H200), or what measured it without one."""
    m = re.fullmatch(r"an NVIDIA (\S+)", lesson["hardware"])
    return m.group(1) if m else "no GPU (ptxas)"


# ---- the expert cache: docs/measured/experts/ ---------------------------------------

def moe_kind(bench: dict) -> str:
    """The file a bench ran, from its model name: moefy appends "MoE <kind> E<n> K<k>"."""
    return bench["model"].split(" MoE ", 1)[1] if " MoE " in bench["model"] else "dense"


def cached(row: dict) -> str:
    """How many experts a row held in VRAM slots: the bench's mode says "experts N/M
    cached" for a --expert-cache share; a plain row is the engine's default, auto."""
    if row["experts"] is None:
        return "dense FFN"
    m = re.search(r"experts (\d+)/(\d+) cached", row["mode"])
    if m is None:  # all_resident() checks it held every expert
        return f"all {row['experts']['slots']:,} (auto)"
    slots, every = int(m.group(1)), int(m.group(2))
    return f"{slots:,} of {every:,} ({100 * slots / every:.0f}%)"


def share(x: float) -> str:
    return f"{100 * x:.0f}%"


KIND_ORDER = ("dense", "split", "copies")  # the dense model, then the exact oracle, then the cache's workload


def expert_benches() -> dict[str, dict]:
    """{kind: bench} for each bench file in docs/measured/experts/ (its path added as
    "file"), in KIND_ORDER."""
    benches = {}
    for path in sorted(EXPERTS_DIR.glob("*.json")):
        bench = json.loads(path.read_text()) | {"file": path.relative_to(ROOT).as_posix()}
        benches[moe_kind(bench)] = bench
    assert "dense" in benches, f"{EXPERTS_DIR.relative_to(ROOT)} has no dense model's bench"
    order = {kind: i for i, kind in enumerate(KIND_ORDER)}
    return dict(sorted(benches.items(), key=lambda kv: (order.get(kv[0].split()[0], len(order)), kv[0])))


def all_resident(bench: dict) -> dict:
    """{depth: the row with the engine's default cache}: every expert resident (checked),
    the row the others are measured against."""
    base = {r["depth"]: r for r in bench["rows"] if r["mode"] == "resident"}
    for r in base.values():
        x = r["experts"]
        assert x is None or x["hits"] == x["lookups"], f"{bench['model']}: its plain row is not all-resident: {x}"
    return base


def experts_table(benches: dict[str, dict]) -> str:
    """One row per file and expert-cache size: at each depth the cache's hit rate over
    the timed steps, decode tok/s, and the rate against the same file all-resident; then
    each split K = E file against the dense model."""
    depths = sorted({r["depth"] for b in benches.values() for r in b["rows"]})
    head = ["file", "experts in VRAM slots"]
    for d in depths:
        head += [f"hit rate at {d:,}", f"decode tok/s at {d:,}", f"of all-resident at {d:,}"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    for kind, bench in benches.items():
        base = all_resident(bench)
        by = {}
        for r in bench["rows"]:
            by.setdefault(cached(r), {})[r["depth"]] = r
        for label, at in by.items():
            cells = [kind, label]
            for d in depths:
                r = at.get(d)
                if r is None:
                    cells += ["-", "-", "-"]
                    continue
                hit = share(r["experts"]["hit_rate"]) if r["experts"] else "-"
                vs = "-" if r["mode"] == "resident" else share(r["decode_tok_s"] / base[d]["decode_tok_s"])
                cells += [hit, rate(r["decode_tok_s"]), vs]
            lines.append("| " + " | ".join(cells) + " |")
    moved = ["| file | experts in VRAM slots | depth | copies into slots | of them swaps | MiB moved |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for kind, bench in benches.items():
        for r in bench["rows"]:
            if r["experts"] and r["mode"] != "resident":
                x = r["experts"]
                moved.append(f"| {kind} | {cached(r)} | {r['depth']:,} | {x['copies']:,} | {x['swaps']:,} | "
                             f"{x['bytes_moved'] / 2**20:,.0f} |")
    lines += ["", "What the cache moved over the same timed steps (the copies are part of the steps' time):", "",
              *moved]
    dense = all_resident(benches["dense"])
    against = []
    for kind, bench in benches.items():
        e, k = re.fullmatch(r"\w+ E(\d+) K(\d+)", kind).groups() if kind != "dense" else (None, None)
        if kind.startswith("split") and e == k:
            base = all_resident(bench)
            ratios = ", ".join(f"{share(base[d]['decode_tok_s'] / dense[d]['decode_tok_s'])} at {d:,}"
                               for d in depths if d in base and d in dense)
            against.append(f"{kind} all-resident against the dense model (every expert used: the dense FFN's "
                           f"weight bytes, read as {e} experts): {ratios} of its decode tok/s.")
    first = next(iter(benches.values()))
    notes = [f"On {first['device']}; medians of {first['runs']} runs of {first['decode_tokens']} decode tokens, "
             "the hit rate over the median run's timed steps. The depth is the prompt's length in tokens. "
             "Written by `python tools/docs_tables.py` from these `strata-nb bench` runs:", ""]
    for kind, bench in benches.items():
        notes.append(f"- {kind}, `{bench['file']}` ({model_file(bench['command'])}): `{pastable(bench['command'])}`")
    return "\n".join(lines + [""] + against + ([""] if against else []) + notes) + "\n"


def experts_plot(benches: dict[str, dict], path: Path) -> None:
    """Hit rate and decode tok/s against the share of experts cached (the copies file),
    with the dense model and the split E = K file as reference lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    copies = next(b for kind, b in benches.items() if kind.startswith("copies"))
    depths = sorted({r["depth"] for r in copies["rows"]})
    fig, (ax_hit, ax_rate) = plt.subplots(1, 2, figsize=(13, 4.2))
    for i, d in enumerate(depths):
        pts = []
        for r in copies["rows"]:
            m = re.search(r"experts (\d+)/(\d+) cached", r["mode"])
            if r["depth"] == d and m:
                pts.append((int(m.group(1)) / int(m.group(2)), r["experts"]["hit_rate"], r["decode_tok_s"]))
        pts.sort()
        color = f"C{i}"
        ax_hit.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=color, label=f"depth {d:,}")
        ax_rate.plot([p[0] for p in pts], [p[2] for p in pts], "-o", color=color,
                     label=f"{moe_kind(copies)}, depth {d:,}")
        for kind, style in (("dense", "--"), ("split", ":")):
            ref = next((b for k, b in benches.items() if k.startswith(kind)), None)
            if ref is not None and d in all_resident(ref):
                ax_rate.axhline(all_resident(ref)[d]["decode_tok_s"], ls=style, color=color, lw=1,
                                label=f"{'dense model' if kind == 'dense' else moe_kind(ref) + ' all-resident'}, "
                                      f"depth {d:,}")
    ax_hit.set_ylabel("expert hit rate")
    ax_hit.set_ylim(0, 1.05)
    ax_rate.set_ylabel("decode tok/s")
    ax_rate.set_ylim(bottom=0)
    for ax in (ax_hit, ax_rate):
        ax.set_xlabel("share of experts in VRAM slots")
        ax.set_xlim(0, 1.05)
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(True, alpha=0.3)
    ax_hit.legend(fontsize=7, loc="lower right")
    ax_rate.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))  # beside the plot, off its lines
    fig.suptitle(f"The expert cache: {copies['model']} on {copies['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def needle_page(result: dict, scores: str) -> str:
    """A probe run's table, under the command and settings that produced it."""
    from strata_nb.needle import table

    s = result["settings"]
    trials = f" --trials {result['trials']}" if result["trials"] != 2 else ""  # 2: the command's default
    return (f"Measured with `strata-nb needle --device {s['backend']} --kv {s['kv']} --kv-resident {s['kv_resident']}"
            f"{trials}` "
            f"on an {s.get('device', s['backend'])}, block scores from {scores}: {result['trials']} facts per "
            f"(length, depth), {s['max_tokens']}-token greedy replies; a cell is the share of replies that hold "
            f"the fact's answer.\n\n{table(result)}\n")


def needle_speed(before: dict, after: dict, code: str = "with it", sketch: str = "key sketch") -> str:
    """Decode tok/s per (mode, depth) with Quest's bound and with the key sketch: `code`
    says which code the second run is (the sketch's own, or a later engine's)."""
    rate = lambda bench: {(r["mode"], r["depth"]): r["decode_tok_s"] for r in bench["rows"]}  # noqa: E731
    old, new = rate(before), rate(after)
    weights = " (random weights of the default model's shapes)" if after.get("model") == "synthetic" else ""
    command = pastable(after["command"])
    lines = [f"Measured with `{command}`{weights} on an {after['device']}, at the code "
             f"before the key sketch and {code}; medians of {after['runs']} runs.\n",
             f"| k8v4 | depth | decode tok/s, Quest's bound | decode tok/s, {sketch} | {sketch} / bound |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for mode, depth in sorted(new, key=lambda k: (k[1], k[0])):
        a, b = old[mode, depth], new[mode, depth]
        lines.append(f"| {mode} | {depth:,} | {a:,.0f} | {b:,.0f} | {b / a:.1%} |")
    return "\n".join(lines) + "\n"


def plain_tier_counts(page: str) -> str:
    """The reading-order table's line column and its total, as the plain tier is today."""
    files = [f for f in PLAIN_TIER.rglob("*.py") if f.name != "__init__.py"]
    lines = {f.relative_to(PLAIN_TIER).as_posix(): len(f.read_text().splitlines()) for f in files}
    page = re.sub(r"(the plain tier in reading order: \*\*)\d+ files, [\d,]+ lines(\*\*)",
                  lambda m: f"{m[1]}{len(files)} files, {sum(lines.values()):,} lines{m[2]}", page)
    return re.sub(r"^(\| \d+ \| `src/strata_nb/kernels/([\w/]+\.py)` \| )\d+( \|)",
                  lambda m: f"{m[1]}{lines[m[2]]}{m[3]}", page, flags=re.MULTILINE)


def q4_k_by_hand(seed: int = 0) -> str:
    """One Q4_K super-block's bytes and every step from them to its 256 weights."""
    import numpy as np

    from strata_nb.model.dequant import dequant_q4_k_ref, scale_min_k4
    from strata_nb.model.synthetic import random_k_quant_rows

    raw = random_k_quant_rows(np.random.default_rng(seed), "Q4_K", 1, 256, 0.1)[0]
    d, dmin = (float(raw[i:i + 2].view(np.float16)[0]) for i in (0, 2))
    sc, m = (a.tolist() for a in scale_min_k4(raw[4:16]))
    weights = dequant_q4_k_ref(raw[None])[0].reshape(8, 32)
    hexes = lambda b: " ".join(f"{x:02x}" for x in b)  # noqa: E731
    lines = [f"Bytes 0-3, `d` and `dmin` (fp16): `{hexes(raw[0:4])}` = {d:.6g} and {dmin:.6g}.", "",
             f"Bytes 4-15, the packed scales and mins: `{hexes(raw[4:16])}`. Sub-blocks 0-3 read theirs "
             "from the low 6 bits of scale bytes 0-3 and 4-7; sub-block 4, for one, takes the low nibble of "
             f"scale byte 8 (0x{raw[12]:02x}) and the top 2 bits of byte 0 (0x{raw[4]:02x}): "
             f"`sc_4` = {raw[12] & 15} + 16 * {raw[4] >> 6} = {sc[4]}; its min the high nibble of byte 8 and the "
             f"top bits of byte 4 (0x{raw[8]:02x}): `m_4` = {raw[12] >> 4} + 16 * {raw[8] >> 6} = {m[4]}.", "",
             "| sub-block j | `sc_j` (6 bits) | `m_j` (6 bits) | scale `d*sc_j` | low `dmin*m_j` "
             "| its codes (bytes) | first codes `q` | first weights `scale*q - low` |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for j in range(8):
        scale = np.float32(d) * np.float32(sc[j])
        low = np.float32(dmin) * np.float32(m[j])
        chunk, shift = 16 + 32 * (j // 2), 4 * (j % 2)
        q = (raw[chunk:chunk + 3] >> shift) & 15
        w = [scale * np.float32(x) - low for x in q]
        assert [np.float32(x) for x in w] == weights[j, :3].tolist()
        lines.append(f"| {j} | {sc[j]} | {m[j]} | {scale:.6g} | {low:.6g} | {chunk}-{chunk + 31}, "
                     f"{'low' if shift == 0 else 'high'} nibbles | {', '.join(map(str, q.tolist()))}, ... "
                     f"| {', '.join(f'{x:.5g}' for x in w)}, ... |")
    lines += ["", "Written by `python tools/docs_tables.py` from `random_k_quant_rows` (seed 0); every "
              "weight above is `dequant_q4_k_ref`'s, and that is gguf-py's to the bit "
              "(`tests/test_dequant.py`).", ""]
    return "\n".join(lines)


# ---- two models side by side: docs/measured/models/ ---------------------------------

def model_files() -> dict[str, tuple[Path, str]]:
    """{column: (the file in the model cache, the command that fetches it)}."""
    from strata_nb.model.fetch import default_model_path, named_model_path

    return {"SmolLM2-135M-Instruct (the default)": (default_model_path(), "strata-nb fetch"),
            "Gemma 3 270M": (named_model_path("gemma3-270m"), "strata-nb fetch --model gemma3-270m")}


def absent_models() -> list[str]:
    """The model files the two-models table reads that this machine lacks, with the
    command that fetches each."""
    return [f"{path.name} (`{fetch}`)" for path, fetch in model_files().values() if not path.is_file()]


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def model_facts(path: Path) -> list[tuple[str, str, str]]:
    """(row, cell, where the engine has it) for one file: every cell read from the file,
    its metadata and tensor list, through the engine's own reader (GGUFModel, ModelConfig)."""
    import numpy as np

    from strata_nb.engine.engine import FAST_ARCHS
    from strata_nb.kv_layout import cell_bytes
    from strata_nb.model.gguf_file import GGUFModel

    m = GGUFModel(path)
    c = m.config
    sizes = {t.name: int(np.prod(t.shape)) for t in m.reader.tensors}
    params, table = sum(sizes.values()), sizes["token_embd.weight"]
    types = Counter(t.tensor_type.name for t in m.reader.tensors)
    glob = [i for i in range(c.n_layers) if not c.local(i)]
    span = "every cell, in every layer" if not c.window else (
        f"the last {c.window:,} positions in {c.n_layers - len(glob)} local layers; every cell in "
        f"{len(glob)} global ones ({', '.join(f'blk.{i}' for i in glob)})")
    rope = f"{c.rope_base:,.0f}" + (f" global, {c.rope_base_local:,.0f} local" if c.rope_base_local else "")
    template = m.metadata("tokenizer.chat_template")
    spm = m.metadata("tokenizer.ggml.model") == "llama"
    head = "tied: the embedding table" if not m.has("output.weight") else "its own matrix"
    return [
        ("file", f"`{path.name}`", "`model/fetch.py`"),
        ("architecture", c.arch, "`cfg.arch`"),
        ("parameters", f"{params:,}", "the tensors' shapes"),
        ("of them the embedding table", f"{table:,} ({table / params:.0%})", "`token_embd.weight`"),
        ("weight types (tensors)", ", ".join(f"{t} ({n})" for t, n in types.most_common()), "`QTensor.qtype`"),
        ("layers", f"{c.n_layers}", "`cfg.n_layers`"),
        ("hidden size d", f"{c.d_model:,}", "`cfg.d_model`"),
        ("FFN size", f"{c.d_ff:,}", "`cfg.d_ff`"),
        ("query heads, KV heads", f"{c.n_heads}, {c.n_kv_heads}", "`cfg.n_heads`, `cfg.n_kv_heads`"),
        ("head size hd", f"{c.head_dim}", "`cfg.head_dim`"),
        ("attention width (query heads x hd)", f"{c.n_heads * c.head_dim:,}", "`Wo`'s input"),
        ("one KV cell of one layer, fp16", f"{cell_bytes('fp16', c.n_kv_heads, c.head_dim):,} bytes",
         "`kv_layout.cell_bytes`"),
        ("vocabulary", f"{c.vocab_size:,}", "`cfg.vocab_size`"),
        ("trained context", f"{c.context_length:,}", "`cfg.context_length`"),
        ("RMS norm eps", f"{c.rms_eps:.0e}", "`cfg.rms_eps`"),
        ("embedding scale", "1" if c.embed_scale == 1 else f"{c.embed_scale:.4f} (sqrt d)", "`cfg.embed_scale`"),
        ("RoPE base", rope, "`cfg.rope_base`, `cfg.rope_base_local`"),
        ("RoPE turns", "(i, i + hd/2), reordered at load" if c.rope_halves else "(2i, 2i + 1), as stored",
         "`cfg.rope_halves`"),
        ("QK-norm (q, k heads normed before RoPE)", yes_no(c.qk_norm), "`cfg.qk_norm`"),
        ("norms after attention and the FFN", yes_no(c.post_norms), "`cfg.post_norms`"),
        ("FFN gate", "GELU, tanh form (GeGLU)" if c.gate == "gelu_tanh" else "SiLU (SwiGLU)", "`cfg.gate`"),
        ("what a query attends to", span, "`cfg.window`, `cfg.local(layer)`"),
        ("output head", f"{head} ({m.tensors['token_embd.weight'].tensor_type.name})", "`w.output`"),
        ("tokenizer", "SentencePiece, merges by score" if spm else
         f"byte-level BPE (pre-tokenizer `{m.metadata('tokenizer.ggml.pre')}`)", "`tokenizer.ggml.model`"),
        ("BOS put first", yes_no(bool(m.metadata("tokenizer.ggml.add_bos_token", False))),
         "`tokenizer.ggml.add_bos_token`"),
        ("chat template", "none: a base model" if template is None else
         ("ChatML" if "<|im_start|>" in template else "yes"), "`tokenizer.chat_template`"),
        ("kernels on a GPU", "the fast tier" if c.arch in FAST_ARCHS else "the plain tier", "`FAST_ARCHS`"),
    ]


def two_models_table(files: dict[str, tuple[Path, str]]) -> str:
    """One row per fact, one column per model, and where the engine keeps each."""
    facts = {name: model_facts(path) for name, (path, _) in files.items()}
    names = list(facts)
    lines = ["| | " + " | ".join(names) + " | in the code |", "| --- |" + " --- |" * (len(names) + 1)]
    for i, (row, _, where) in enumerate(facts[names[0]]):
        lines.append(f"| {row} | " + " | ".join(facts[n][i][1] for n in names) + f" | {where} |")
    fetches = " and ".join(f"`{fetch}`" for _, fetch in files.values())
    return "\n".join(lines + ["", "Written by `python tools/docs_tables.py` from the two files' metadata and tensor "
                                  f"list, read by `GGUFModel` as the engine reads them ({fetches} put them in the "
                                  "model cache)."]) + "\n"


def mega_plans() -> str:
    """`strata-nb info --mega-plan` on the default model (the same plan for both KV formats it runs)."""
    from strata_nb.cli import _mega_plan
    from strata_nb.gpu.geometry import MEGA_ON_GPU
    from strata_nb.model.fetch import default_model_path
    from strata_nb.model.gguf_file import GGUFModel

    plan = _mega_plan(GGUFModel(default_model_path()), "k8v4", **MEGA_ON_GPU)
    return f"```text title=\"strata-nb info --mega-plan --kv k8v4\"\n{plan}\n```\n"


def mega_timeline_table(t: dict) -> str:
    """Where a step's time goes, fast tier against megakernel (measure_docs.py mega-timeline's run),
    and what the barriers alone cost."""
    lines = ["| depth | KV | fast tier: step | its launches | its kernels' times, summed | megakernel: step | "
             "its items, summed | its barriers alone |", "| ---: | --- |" + " ---: |" * 6]
    for r in t["rows"]:
        f, m = r["fast"], r["mega"]
        lines.append(f"| {r['depth']:,} | {r['kv']} | {f['ahead_wall_us']:,.0f} us | {f['launches']:.0f} | "
                     f"{f['gpu_us']:,.0f} us | {m['ahead_wall_us']:,.0f} us | {m['clocked_us']:,.0f} us | "
                     f"{m['barriers'] * t['barrier_us']:,.0f} us |")
    lines += ["", "The megakernel's items by kind: us a step, each item with the barrier after it, as thread "
              "block 0 saw them, summed over the layers:", "",
              "| depth | KV | " + " | ".join(MEGA_ITEMS) + " |", "| ---: | --- |" + " ---: |" * len(MEGA_ITEMS)]
    for r in t["rows"]:
        items = r["mega"]["items_us"]
        lines.append(f"| {r['depth']:,} | {r['kv']} | " + " | ".join(f"{items.get(k, 0):,.0f}" for k in MEGA_ITEMS) + " |")
    first, barriers = t["rows"][0], t["rows"][0]["mega"]["barriers"]
    fast_us, mega_us = first["fast"]["ahead_wall_us"], first["mega"]["ahead_wall_us"]
    layers = (barriers - 2) // 5  # plan.build_plan: embed, 5 items a layer, head, pick
    one = t["barrier_us"]
    per_layer = ", ".join(f"{k} {first['mega']['items_us'][k] / layers:.1f} us ({first['mega']['items_us'][k] / layers / one:.1f})"
                          for k in ("qkv", "attend", "wo", "gate_up", "down"))
    return "\n".join(lines + [
        "", f"At depth {first['depth']:,} ({first['kv']}) the megakernel's step takes {mega_us:,.0f} us, "
        f"{mega_us / fast_us:.1f} times the fast tier's {fast_us:,.0f} us. One grid barrier alone (a launch of "
        f"nothing but {barriers} of them, less an empty launch) costs {t['barrier_us']:.2f} us, so a step's "
        f"{barriers} barriers are {barriers * t['barrier_us']:,.0f} us of it; the rest is the items' own work. "
        f"A layer's items there, each with its barrier (and in barriers' worth): {per_layer}. "
        "The fast tier's kernels overlap (each is launched as dependent on the one before, and sets out "
        "before it ends), so their times add up to more than its step.",
        "", f"{t['device']}, {t['model']}; the megakernel on {t['blocks']} thread blocks of {t['threads']} "
        f"threads. Measured by `{t['command']}`; each step run ahead, as `generate` and the bench run them."]) + "\n"


def mega_timeline_plot(t: dict, path: Path) -> None:
    """Two bars a configuration: the fast tier's step and the megakernel's (its items by kind)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 1.2 + 1.1 * len(t["rows"])))
    labels, ticks = [], []
    for i, r in enumerate(t["rows"]):
        f, m, y = r["fast"], r["mega"], 2.6 * i
        ax.barh(y, f["ahead_wall_us"], color="C0", label="fast tier: its step" if i == 0 else None)
        left = 0.0
        for j, k in enumerate(MEGA_ITEMS):
            us = m["items_us"].get(k, 0.0)
            ax.barh(y + 1, us, left=left, color=f"C{j + 1}", label=f"megakernel: {k}" if i == 0 else None)
            left += us
        floor = m["barriers"] * t["barrier_us"]
        ax.plot([floor, floor], [y + 0.55, y + 1.45], color="k", lw=2,
                label="megakernel: its barriers alone" if i == 0 else None)
        labels += [f"fast, depth {r['depth']:,} {r['kv']}", f"mega, depth {r['depth']:,} {r['kv']}"]
        ticks += [y, y + 1]
    ax.set_yticks(ticks, labels)
    ax.invert_yaxis()
    ax.set_xlabel("us a decode step (run ahead)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"Where a decode step's time goes: {t['model']} on {t['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_outputs() -> dict[Path, str]:
    """The tables made from model files (absent_models() must be empty)."""
    return {TWO_MODELS: two_models_table(model_files()), MEGA_PLAN: mega_plans()}


def outputs() -> dict[Path, str]:
    """Every generated file's path and the text it must hold."""
    lessons = json.loads(LESSONS_JSON.read_text())["lessons"]
    out = {LESSONS_DIR / f"{ls['id']}.md": lesson_table(ls) for ls in lessons}
    out[LESSONS_DIR / "all.md"] = all_lessons_table(lessons)
    readme = README.read_text()
    table = readme_table(json.loads(BENCH_JSON.read_text()))
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    assert pattern.search(readme), f"README.md has no {START} ... {END} block"
    out[README] = pattern.sub(lambda _: table, readme)
    out[EXPERTS_MD] = experts_table(expert_benches())
    out[READING] = plain_tier_counts(READING.read_text())
    out[BY_HAND] = q4_k_by_hand()
    out[NEEDLE_DIR / "speed.md"] = needle_speed(*(json.loads((NEEDLE_DIR / f"bench_{n}.json").read_text())
                                                  for n in ("quest_bound", "key_sketch")))
    out[NEEDLE_DIR / "speed_h100.md"] = needle_speed(
        *(json.loads((NEEDLE_DIR / f"bench_{n}_h100.json").read_text()) for n in ("quest_bound", "key_sketch")),
        code="at a later engine's (select_blocks launched plain), one after the other on one machine",
        sketch="later engine")
    for name, scores in NEEDLE_RUNS.items():
        out[NEEDLE_DIR / f"{name}.md"] = needle_page(json.loads((NEEDLE_DIR / f"{name}.json").read_text()), scores)
    if MEGA_TIMELINE.exists():
        out[MEGA_TIMELINE.with_suffix(".md")] = mega_timeline_table(json.loads(MEGA_TIMELINE.read_text()))
    for bench in sorted((ROOT / "docs" / "measured").rglob("bench.json")):  # each run's own page, as the bench writes it
        out[bench.with_suffix(".md")] = markdown(json.loads(bench.read_text()))
    return out


def main(argv: list[str]) -> int:
    absent = absent_models()
    tables = outputs() | ({} if absent else model_outputs())
    if absent:
        print(f"not {'checked' if '--check' in argv else 'written'}: {TWO_MODELS.relative_to(ROOT)}, "
              f"{MEGA_PLAN.relative_to(ROOT)} "
              f"reads model files this machine lacks: {', '.join(absent)}")
    stale = [p for p, text in tables.items() if not p.exists() or p.read_text() != text]
    if "--check" in argv:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)} (run python tools/docs_tables.py)")
        return 1 if stale else 0
    for p, text in tables.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    try:
        experts_plot(expert_benches(), EXPERTS_PNG)
        if MEGA_TIMELINE.exists():
            mega_timeline_plot(json.loads(MEGA_TIMELINE.read_text()), MEGA_TIMELINE_PNG)
        from strata_nb.needle import heatmap
        for name in NEEDLE_RUNS:
            heatmap(json.loads((NEEDLE_DIR / f"{name}.json").read_text()), ROOT / "docs" / "assets" / f"{name}.png")
    except ImportError:
        print(f"not written: {EXPERTS_PNG.relative_to(ROOT)} and the needle heat-maps need matplotlib (pip install -e '.[bench]')")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
