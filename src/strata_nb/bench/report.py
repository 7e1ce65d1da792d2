"""The bench's outputs: bench.json (everything), bench.md (the table), bench.png (the plot)."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..model.fetch import FILENAME as DEFAULT_MODEL_FILE
from ..probes import DEGENERATE


def pastable(command: str) -> str:
    """The bench's command as a reader can paste it: the model by its file name (none for
    the default model, which the bench fetches itself), llama-bench where the GPU page
    builds it, and no --out folder, so no path of the machine that ran it. An --append run's commands stay joined by "; then: "."""
    parts = []
    for part in command.split("; then: "):
        words, kept = shlex.split(part), []
        while words:
            word = words.pop(0)
            flag, _, value = word.partition("=")
            if flag in ("--model", "--out", "--llama-bench"):
                value = value or (words.pop(0) if words else "")
                if flag == "--model" and Path(value).name != DEFAULT_MODEL_FILE:
                    kept += ["--model", Path(value).name]
                elif flag == "--llama-bench":  # as docs/gpu/running.md builds it, beside the folder it runs in
                    kept += [flag, value[value.index("llama.cpp/"):] if "llama.cpp/" in value else Path(value).name]
                continue
            kept.append(word)
        parts.append(shlex.join(kept))
    return "; then: ".join(parts)


def model_file(command: str) -> str:
    """The file the bench ran, by name: --model's, else the default model's."""
    words = shlex.split(command.split("; then: ")[0])
    for i, word in enumerate(words):
        if word.startswith("--model="):
            return Path(word.split("=", 1)[1]).name
        if word == "--model" and i + 1 < len(words):
            return Path(words[i + 1]).name
    return DEFAULT_MODEL_FILE


def _rate(x) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


# --8<-- [start:bench_table]
def table(result: dict) -> str:
    bw = result.get("copy_gb_s")
    lines = ["| configuration | depth | prefill tok/s | decode tok/s | KV MiB | read/token MiB | GB/s "
             + (f"(% of copy {bw:,.0f}) " if bw else "") + "| hit rate | graph | output check |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in result["rows"]:
        c = r.get("check")
        if c is None:
            check = "not checked"
        else:
            verdict = "**BROKEN**" if c["broken"] else "ok"
            check = f"{verdict}: {c['exact']}/{c['tokens']} top-1, max gap {c['max_gap']:.2f}"
            if c.get("spread") is not None:
                check += f" (reference spread {c['spread']:.2f})"
            if c.get("layer0"):  # shown when any layer-0 prompt byte differs
                check += f", layer 0 bytes {100 * c['layer0']:.3f}% differ"
        gbs = f"{r['gb_s']:,.0f}" + (f" ({100 * r['gb_s'] / bw:.1f}%)" if bw else "")
        hits = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        if r.get("experts"):  # an MoE row: the expert cache's hit rate (KV streaming has none here)
            hits = f"experts {r['experts']['hit_rate']:.3f}"
        if r.get("loop", 0) > DEGENERATE:  # the free run goes round in a loop (probes.py)
            check += f", **DEGENERATE**: loop score {r['loop']:.2f}"
        sp = r.get("spec")
        if sp:  # a --spec row: what the drafts bought, and whether the tokens are --spec 0's
            check += (f"; {sp['drafts_accepted']}/{sp['drafts_offered']} drafts accepted, "
                      f"{sp['tokens_per_pass']:.2f} tokens a pass")
            if "identical" in sp:
                check += ", same tokens as spec 0" if sp["identical"] else ", **NOT the spec 0 tokens**"
        name = f"{r['fmt']} {r['mode']}"
        if (c and c["broken"]) or r.get("loop", 0) > DEGENERATE or (sp and not sp.get("identical", True)):
            name = f"~~{name}~~"
        lines.append(f"| {name} | {r['depth']:,} | {_rate(r['prefill_tok_s'])} | {_rate(r['decode_tok_s'])} | "
                     f"{r['kv_bytes'] / 2**20:.1f} | {r['bytes_per_token'] / 2**20:.1f} | {gbs} | "
                     f"{hits} | "
                     f"{'yes' if r['graph'] else 'no'} | {check} |")
    for p in result.get("peer", []):
        if "error" in p:
            lines.append(f"| {p['peer']} | {p['depth']:,} | failed | failed | | | | | | {p['error'][:80]} |")
        else:
            lines.append(f"| {p['peer']} | {p['depth']:,} | {_rate(p['prefill_tok_s'])} | "
                         f"{_rate(p['decode_tok_s'])} | | | | | | peer |")
    for p in result.get("llama", []):
        depth = f"{p['depth']:,}" if "depth" in p else "-"
        if "error" in p:
            lines.append(f"| {p['peer']} | {depth} | failed | failed | | | | | | {p['error'][:80]} |")
        else:
            lines.append(f"| {p['peer']} | {depth} | {_rate(p['prefill_tok_s'])} | {_rate(p['decode_tok_s'])} "
                         f"| | | | | | llama.cpp {p['build']} |")
    return "\n".join(lines)
# --8<-- [end:bench_table]


def llama_table(result: dict) -> str:
    """Ours over llama.cpp's, per format and depth: above 1 is faster."""
    from .llama import ratios

    lines = ["| format | depth | llama.cpp | prefill, ours / llama.cpp | decode, ours / llama.cpp |",
             "| --- | ---: | --- | ---: | ---: |"]
    lines += [f"| {r['fmt']} | {r['depth']:,} | {r['peer']} | {r['prefill']:.2f} | {r['decode']:.2f} |"
              for r in ratios(result)]
    return "\n".join(lines)


def profile_table(prof: dict) -> str:
    step_gpu = prof["gpu_us"]
    ahead = (f", {prof['ahead_wall_us']:,.0f} us with the next step queued while the host reads the pick"
             if "ahead_wall_us" in prof else "")  # JSON from before run_ahead has no such key
    lines = [f"Decode step: {prof['launches']:.0f} kernels, {step_gpu:,.0f} us of GPU time; wall time "
             f"{prof['graph_wall_us']:,.0f} us replayed from a graph one step at a time{ahead}, "
             f"{prof['eager_wall_us']:,.0f} us launched one by one.", "",
             "| kernel | launches per step | GPU us per step | share |", "| --- | ---: | ---: | ---: |"]
    for name, (n, us) in sorted(prof["kernels"].items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{name}` | {n:.0f} | {us:,.1f} | {100 * us / step_gpu:.1f}% |")
    lines += ["", f"Prefill chunk of {prof['prefill_chunk']} tokens: {prof['prefill_gpu_us']:,.0f} us of GPU time.", "",
              "| kernel | launches | GPU us | share |", "| --- | ---: | ---: | ---: |"]
    for name, (n, us) in sorted(prof["prefill_kernels"].items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| `{name}` | {n:.0f} | {us:,.1f} | {100 * us / prof['prefill_gpu_us']:.1f}% |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    """Decode and prefill tok/s against depth, one line per configuration and peer."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict = {}
    for r in result["rows"]:
        broken = r.get("check") and r["check"]["broken"]
        key = f"{r['fmt']} {r['mode']}" + (" (BROKEN)" if broken else "")
        series.setdefault(key, []).append((r["depth"], r["decode_tok_s"], r["prefill_tok_s"]))
    for p in result.get("peer", []):
        if "error" not in p:
            series.setdefault(p["peer"], []).append((p["depth"], p["decode_tok_s"], p["prefill_tok_s"]))
    for key, pts in series.items():
        pts.sort()
        style = "--" if key.startswith("transformers") else "-o"
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], style, label=key)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], style, label=key)
    for ax, what in zip(axes, ("decode", "prefill")):
        ax.set_xlabel("depth (tokens)")
        ax.set_ylabel(f"{what} tok/s")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"strata-nb bench: {result['model']} on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def markdown(result: dict) -> str:
    """bench.md: the command, the table, llama.cpp's rows and the step profiles."""
    md = ["# strata-nb bench", "", f"`{pastable(result['command'])}`", "",
          f"Model: {model_file(result['command'])}; device: {result['device']}; runs: {result['runs']} (median); "
          f"decode tokens per run: {result['decode_tokens']}"
          + (f"; dependent launches: {result['dependent_launches']}"
             if result.get("dependent_launches") not in (None, "off", "no GPU") else "") + ".", "", table(result)]
    if result.get("llama"):
        md += ["", "## Against llama.cpp", "", llama_table(result)]
    for key in ("profile", "profile_streamed"):
        if result.get(key):
            md += ["", f"## One decode step, {result[key]['config']}", "", profile_table(result[key])]
    return "\n".join(md) + "\n"


def write(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json", out / "bench.md"]
    written[0].write_text(json.dumps(result, indent=1))
    written[1].write_text(markdown(result))
    if plot(result, out / "bench.png"):
        written.append(out / "bench.png")
    return written
