"""The `strata-nb` command line. Flags map one to one onto `Settings` / `SamplingSettings`."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

import click

from .errors import SettingError, StrataError
from .kv_layout import USER_FORMATS
from .settings import KERNELS, MAX_WINDOW

KV_CHOICE = click.Choice(USER_FORMATS)
_ARGV: list[str] = []  # the command line main() was given, for outputs that record it


def engine_options(f):
    """Flags every command that builds an engine takes."""
    opts = [
        click.option("--model", type=click.Path(dir_okay=False), default=None,
                     help="GGUF file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use)."),
        click.option("--kv", type=KV_CHOICE, default="fp16", show_default=True, help="KV cache format."),
        click.option("--kv-resident", type=int, default=0, show_default=True,
                     help="KV cells per layer kept in VRAM; 0 = fully resident."),
        click.option("--max-context", type=int, default=None,
                     help="KV cells per layer (default: the model's trained context, 8192 for the default model)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                     help="cpu runs the NumPy references; cuda the Numba-CUDA kernels."),
        click.option("--kernels", type=click.Choice(["plain", "fast", "mega"]), default="fast", show_default=True,
                     help="On the cuda backend: plain runs one plain kernel per op (src/strata_nb/kernels/), "
                          "fast the fast tier's fused kernels, dependent launches and CUDA graphs "
                          "(src/strata_nb/fast/), mega the fast tier with each greedy decode step of a resident "
                          "dense model one launch of a persistent kernel (src/strata_nb/fast/mega/). The CPU runs "
                          "the references either way."),
        click.option("--prefill-chunk", type=int, default=None,
                     help="Prompt tokens per forward pass (default: 256 on the CPU, 2048 on a GPU)."),
        click.option("--kv-window", type=int, default=256, show_default=True,
                     help="Recent KV cells per layer held in the VRAM ring when streaming."),
        click.option("--qsa-budget", type=int, default=0, show_default=True,
                     help="KV cells a decode query reads, chosen by QSA block selection; 0 = all."),
        click.option("--graph/--no-graph", default=True, show_default=True,
                     help="On a GPU, capture a decode step into a CUDA graph once and replay it per token "
                          "(resident or streamed KV); --no-graph launches every kernel each step."),
        click.option("--expert-cache", default="auto", show_default=True,
                     help="MoE models: experts held in VRAM slots, a number or auto (as many as free VRAM holds "
                          "after --vram-reserve-mib; every expert on the CPU). The rest are read from pinned host memory."),
        click.option("--adapt-every", type=int, default=4, show_default=True,
                     help="MoE models: forward passes between the expert cache's adapts (moving hot experts in); "
                          "it adapts after every prompt chunk too."),
        click.option("--adapt-swaps", type=int, default=96, show_default=True,
                     help="MoE models: swaps (a resident expert evicted for a busier one) at most, per adapt; "
                          "empty slots are filled without a cap."),
        click.option("--vram-reserve-mib", type=int, default=1024, show_default=True,
                     help="MoE models: VRAM that --expert-cache auto leaves free."),
        click.option("--spec", type=int, default=0, show_default=True,
                     help="Speculative decoding (greedy): verify windows of this many positions (2-8), drafted "
                          "by prompt lookup; 0 = off."),
        click.option("--suffix-draft", type=int, default=3, show_default=True,
                     help="With --spec: the longest n-gram of the last tokens the drafter looks up."),
        click.option("--fault", type=click.Choice(["none", "drop-v-mirror", "verify-no-mirror", "expert-early-resident"]),
                     default="none",
                     help="Teaching switch: drop-v-mirror makes the k8v4 V half skip the host copy "
                          "(the unfolded-half bug); verify-no-mirror makes the verify window's batched append "
                          "skip it (Strata #1188); expert-early-resident marks an expert resident before "
                          "its copy lands. Off by default."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def load_engine(**engine_kw):
    from .engine.engine import Engine

    return Engine.load(**engine_kw)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.version_option(package_name="strata-nb")
@click.pass_context
def cli(ctx):
    """strata-nb: a teaching-grade LLM inference engine with quantized, streamed KV."""
    if ctx.invoked_subcommand is None:  # bare `strata-nb` asks what there is: the help, not an error
        click.echo(ctx.get_help())


@cli.command()
@click.argument("prompt", required=False)
@engine_options
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (temperature > 0).")
@click.option("--raw", is_flag=True, help="Send the prompt as is, without the chat template.")
@click.option("--stats", is_flag=True,
              help="Print load and warm-up time, prefill tok/s and the steady decode tok/s to stderr.")
def run(prompt, max_tokens, temperature, top_k, top_p, seed, raw, stats, **engine_kw):
    """Generate from PROMPT (or stdin), streaming text to stdout as tokens come."""
    from tqdm import tqdm

    from .settings import SamplingSettings

    prompt = _prompt_text(prompt)
    if not prompt.strip():
        raise StrataError("the prompt is empty")
    sampling = SamplingSettings(max_tokens, temperature, top_k, top_p, seed)  # check flags before loading
    eng = load_engine(**engine_kw)
    if not raw and not eng.tokenizer.chat_template:
        print("strata-nb: this model has no chat template (a base model): sending the prompt as it is",
              file=sys.stderr)
        raw = True
    ids = eng.prompt_ids(prompt, chat=not raw)
    # a prompt of several chunks takes seconds before the first token: show it on stderr,
    # gone once the text starts, so stdout holds only the generated text; one update a
    # chunk, each drawn (mininterval=0)
    bar = tqdm(total=len(ids), unit="tok", desc="prefill", file=sys.stderr, leave=False, mininterval=0,
               disable=len(ids) <= eng.settings.prefill_chunk)

    def prefilled(n):
        bar.update(n)
        if bar.n == bar.total:
            bar.close()

    first_token = None  # seconds from _STARTED (set by main) to the first token's text
    try:
        for piece in eng.generate_ids(ids, sampling, on_prefill=prefilled):
            sys.stdout.write(piece)
            sys.stdout.flush()
            if first_token is None:
                first_token = time.monotonic() - _STARTED
    finally:
        bar.close()
    sys.stdout.write("\n")
    if stats:
        from .engine.engine import WARM_STEPS

        s = eng.last_stats
        warm = [f"{s.kernels_compiled} kernels compiled"] if s.kernels_compiled else []
        warm += [f"{s.kernels_loaded} kernels loaded from the cache"] if s.kernels_loaded else []
        warm += [f"the first {WARM_STEPS} decode steps"] if s.decode_steps and s.generated_tokens - 1 > WARM_STEPS else []
        click.echo(f"load: {s.load_seconds:.2f} s, warm-up: {s.warmup_seconds:.2f} s" + (f" ({', '.join(warm)})"
                   if warm else ""), err=True)
        if first_token is not None:
            click.echo(f"first token: {first_token:.2f} s after {_START_NAME} (the model's load included)", err=True)
        click.echo(f"prompt tokens: {s.prompt_tokens}, prefill: {s.prefill_tok_s:.1f} tok/s, "
                   f"generated: {s.generated_tokens}, decode: {s.decode_tok_s:.1f} tok/s over {s.decode_steps} steps "
                   f"({s.finish_reason})", err=True)
        if eng.be.name == "cuda":
            click.echo(f"kernels: {eng.be.kernels}", err=True)
        if eng.mega_note:
            click.echo(f"decode steps: {eng.mega_note}", err=True)
        if eng.be.dependent_launches() not in ("off", "no GPU", "off: plain kernels"):  # fast/dependent_launch.py
            click.echo(f"dependent launches: {eng.be.dependent_launches()}", err=True)
        prompt_kernels = eng.be.prompt_kernels(eng.config.head_dim)
        if prompt_kernels not in ("plain", "reference"):  # on a GPU: tensor cores, or why not
            click.echo(f"prompt kernels: {prompt_kernels}", err=True)
        if eng.kv.streamed:
            c = eng.kv.counters
            click.echo(f"KV streaming: {c.lookups} lookups, {c.misses} misses ({c.misses_per_step:.1f} per layer-step), "
                       f"hit rate {c.hit_rate:.3f}, {c.copies} copies, {c.in_place} read in place, "
                       f"{c.bytes_moved / 2**20:.1f} MiB moved", err=True)
        if "spec" in s.extra:
            x = s.extra["spec"]
            click.echo(f"speculation: window {x['window']}, {x['passes']} passes, {x['drafts_accepted']} of "
                       f"{x['drafts_offered']} drafts accepted ({x['acceptance_rate']:.3f}), "
                       f"{x['tokens_per_pass']:.2f} tokens a pass", err=True)
        if "experts" in s.extra:
            x = s.extra["experts"]
            click.echo(f"experts: {x['lookups']} lookups, {x['hits']} hits, hit rate {x['hit_rate']:.3f}, "
                       f"{x['copies']} copied in ({x['swaps']} swaps), {x['bytes_moved'] / 2**20:.1f} MiB moved "
                       f"({eng.weights.experts.n_slots} slots)", err=True)


@cli.command()
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--conversation-cache-mib", type=float, default=1024, show_default=True,
              help="Host memory for parked conversations' KV cells, reserved (pinned on a GPU) at start; "
                   "0 = no conversation cache.")
@click.option("--conversation-fault", type=click.Choice(["none", "skip-restore"]), default="none",
              help="Teaching switch: skip-restore resumes a parked conversation without writing its cells back "
                   "(the probe's 'repeat after others' check catches it). Off by default.")
def serve(host, port, conversation_cache_mib, conversation_fault, **engine_kw):
    """An OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models, /metrics."""

    from .serve.app import create_app, listen, serve_forever

    if conversation_cache_mib < 0:
        raise click.BadParameter("must be >= 0", param_hint="--conversation-cache-mib")
    if not 0 <= port <= 65535:
        raise click.BadParameter(f"{port} is not a port number", param_hint="--port")
    sock = listen(host, port)  # before loading: a taken port is said at once
    eng = load_engine(**engine_kw)
    hello = eng.prompt_ids("Hello")
    eng.warm_up(hello)  # make the kernels on a GPU now, not in the first request
    chunks = eng.prompt_chunks()
    if chunks is not None and chunks.use_graph:  # and every prompt width's graph (engine/prompt_chunk.py)
        chunks.warm(hello[0])
    model_id = Path(eng.model.path).stem
    app = create_app(eng, model_id, conversation_cache_mib, conversation_fault)
    click.echo(f"serving {model_id} on http://{host}:{sock.getsockname()[1]}/v1 ({eng.kv.describe()}; conversation cache "
               f"{conversation_cache_mib:g} MiB)", err=True)
    serve_forever(app, sock)


def _prompt_text(prompt: str | None) -> str:
    """The prompt from the argument or else stdin, as text. Bytes that are not UTF-8 are a
    mistake in the input, said before the model loads."""
    if prompt is not None:
        where, raw = "the prompt", prompt.encode("utf-8", "surrogateescape")  # argv's undecodable bytes
    elif sys.stdin is None or sys.stdin.isatty():
        raise StrataError("give a prompt as an argument or on stdin")
    else:
        where, raw = "stdin", getattr(sys.stdin, "buffer", sys.stdin).read()  # bytes, undecoded
        if isinstance(raw, str):  # a text stream with no bytes beneath (io.StringIO)
            raw = raw.encode("utf-8", "surrogateescape")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise StrataError(f"{where} is not UTF-8 text: byte 0x{raw[err.start]:02x} at offset {err.start} "
                          "(convert it first, e.g. iconv -t UTF-8)") from None


@cli.command()
@click.option("--model", type=click.Path(dir_okay=False), default=None, help="GGUF file.")
@click.option("--kv", type=KV_CHOICE, default="fp16", show_default=True, help="KV format to size.")
@click.option("--max-context", type=int, default=None, help="Context to size the KV for (default: trained).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--mega-plan", is_flag=True,
              help="Print the megakernel's plan for a decode step (--kernels mega): its work items, in order.")
def info(model, kv, max_context, as_json, mega_plan):
    """Print the model's facts and the KV format's sizes."""
    from .model.fetch import model_path
    from .model.gguf_file import GGUFModel
    from .kv_layout import BLOCK, cell_bytes, kv_block_bytes, ring_blocks, runs_of

    m = GGUFModel(model_path(model))
    c = m.config
    if mega_plan:
        click.echo(_mega_plan(m, kv))
        return
    ctx = max_context or c.context_length
    cell = cell_bytes(kv, c.n_kv_heads, c.head_dim)
    local = sum(c.local(i) for i in range(c.n_layers))  # sliding-window layers: their cells stop at a ring
    ring = min(ring_blocks(c.window, 256) * BLOCK, ctx) if local else 0  # at the default --prefill-chunk
    per_token = cell * (c.n_layers - local)  # what each token adds once the rings are full
    window = {"sliding_window": f"{c.window} positions in {local} of {c.n_layers} layers, each a ring of {ring} "
                                "cells (at --prefill-chunk 256)"} if local else {}
    facts = {
        "path": str(m.path), "name": c.name, "architecture": c.arch, **window,
        "n_layers": c.n_layers, "d_model": c.d_model, "d_ff": c.d_ff, "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "rope_base": c.rope_base,
        "rms_eps": c.rms_eps, "vocab_size": c.vocab_size, "context_length": c.context_length,
        "tensor_types": _tensor_type_counts(m),
        "kv": kv, "block": BLOCK,
        "cell_bytes": cell_bytes(kv, c.n_kv_heads, c.head_dim),
        "block_bytes": kv_block_bytes(kv, c.n_kv_heads, c.head_dim),
        "runs": [{"name": n, "bytes": b} for n, _, b in runs_of(kv, c.n_kv_heads, c.head_dim)],
        "bytes_per_token": per_token,
        "max_context": ctx,
        "bytes_at_max_context": per_token * ctx + cell * local * ring,
    }
    if as_json:
        click.echo(json.dumps(facts, indent=1))
        return
    width = max(len(k) for k in facts)
    for k, v in facts.items():
        if k == "runs":
            v = ", ".join(f"{r['name']} {r['bytes']} B" for r in v)
        elif k == "bytes_at_max_context":
            v = f"{v} ({v / 2**20:.1f} MiB)"
        click.echo(f"{k:<{width}}  {v}")


def _mega_plan(m, kv: str, **geometry) -> str:
    """info --mega-plan: the plan, or why the megakernel does not run this model
    (geometry: plan.describe's threads and splits, where not this machine's)."""
    from .fast.mega.plan import build_plan, describe, why_not

    c = m.config
    fused = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "wgate_up": ("ffn_gate", "ffn_up"),
             "wdown": ("ffn_down",)}

    def stored(layer: int, names) -> str:  # as the cuda backend stores a fused matrix: F32 where its parts differ
        parts = {m.tensor(f"blk.{layer}.{name}.weight").qtype for name in names}
        return parts.pop() if len(parts) == 1 else "F32"

    types = {} if c.n_expert else {kind: {stored(i, names) for i in range(c.n_layers)} for kind, names in fused.items()}
    why = why_not(c, kv, True, True, types, **({"threads": geometry["threads"]} if geometry else {}))
    if why is not None:
        raise StrataError(f"the megakernel does not run {c.name or m.path} with {kv} KV: {why}")
    return describe(build_plan(c.n_layers), c, kv, **geometry)


def _tensor_type_counts(m) -> dict:
    counts: dict[str, int] = {}
    for t in m.reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


@cli.command("compare-kv")
@click.option("--model", type=click.Path(dir_okay=False), default=None, help="GGUF file.")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Text to score (default: the bundled document, ~2,800 tokens).")
@click.option("--ctx", type=int, default=None, help="Score the first N tokens (default: the whole text).")
@click.option("--kv", "formats", default="fp16,int8,q4_0,k8v4", show_default=True,
              help="Comma-separated formats to compare against the fp32 reference cache.")
@click.option("--qsa-budget", "budgets", default="0", show_default=True,
              help="Comma-separated QSA budgets in cells (0 = dense); each format runs with each.")
@click.option("--prefill-chunk", type=int, default=256, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def compare_kv_cmd(model, text_file, ctx, formats, budgets, prefill_chunk, device, as_json):
    """Teacher-forced quality of KV formats against an fp32 KV cache: KL, top-1, perplexity."""
    from importlib import resources

    from tqdm import tqdm

    from .engine.compare import compare_kv, format_table

    fmts = [f.strip() for f in formats.split(",") if f.strip()]
    for f in fmts:
        if f not in USER_FORMATS + ("fp32",):
            raise StrataError(f"--kv {f!r} is not a KV format; choose from {', '.join(USER_FORMATS)}")
    qsa = _numbers(budgets, "--qsa-budget", int, "cell counts")
    if not fmts or not qsa or min(qsa) < 0:
        raise StrataError("give at least one format and budgets >= 0")
    if text_file:
        text = Path(text_file).read_text(encoding="utf-8", errors="replace")
        name = text_file
    else:
        text = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
        name = "default_document.txt (bundled)"
    if ctx is not None and ctx < 2:
        raise StrataError(f"--ctx must be at least 2 tokens, got {ctx}")
    eng = load_engine(model=model, kv="fp32", device=device, prefill_chunk=prefill_chunk, max_context=16)
    ids = eng.tokenize(text)[: ctx or None]
    if len(ids) < 2:
        raise StrataError(f"{name} has fewer than 2 tokens to score")
    if len(ids) > eng.config.context_length:
        ids = ids[: eng.config.context_length]
    with tqdm(total=len(ids), unit="tok", desc="compare-kv", file=sys.stderr, disable=as_json) as bar:
        result = compare_kv(eng, ids, fmts, qsa, progress=bar.update)
    result["text"] = name
    click.echo(json.dumps(result, indent=1) if as_json else format_table(result))


@cli.command()
@click.option("--model", type=click.Path(dir_okay=False), default=None, help="GGUF file.")
@click.option("--kv", type=KV_CHOICE, default="fp16", show_default=True, help="KV cache format.")
@click.option("--kv-resident", type=int, default=0, show_default=True,
              help="KV cells per layer kept in VRAM; 0 = fully resident.")
@click.option("--kv-window", type=int, default=256, show_default=True,
              help="Recent KV cells per layer: the VRAM ring when streaming, and QSA's always-read window.")
@click.option("--max-context", type=int, default=None,
              help="KV cells per layer (default: the model's trained context); the longest --lengths must fit.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--prefill-chunk", type=int, default=None,
              help="Prompt tokens per forward pass (default: 256 on the CPU, 2048 on a GPU).")
@click.option("--lengths", default="2048,4096,8192", show_default=True,
              help="Context lengths in tokens: each case's prompt fills one, less the reply's --max-tokens.")
@click.option("--depths", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1", show_default=True,
              help="Where the fact sits, as the share of the filler before it: 0 = the first paragraph, "
                   "1 = the last, just before the question (11 depths by default).")
@click.option("--budgets", default="0,512,1024", show_default=True,
              help="QSA budgets in KV cells a decode query reads; 0 = full attention.")
@click.option("--trials", type=int, default=2, show_default=True, help="Facts per (length, depth) cell.")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="Reply tokens (greedy).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the filler and the facts.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder to write needle.json, needle.md and needle.png (the heat map) to.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON (with every reply) instead of the table.")
def needle(lengths, depths, budgets, trials, max_tokens, seed, out, as_json, **engine_kw):
    """Retrieval accuracy of a planted fact per (depth, length), full attention beside QSA budgets."""
    from importlib.util import find_spec

    from tqdm import tqdm

    from . import needle as probe

    grid = probe.check(_numbers(lengths, "--lengths", int, "token counts"),
                       _numbers(depths, "--depths", float, "shares from 0 to 1"),
                       _numbers(budgets, "--budgets", int, "cell counts"), trials, max_tokens, seed)
    folder = _out_folder(out) if out is not None else None
    plot = out is not None and find_spec("matplotlib") is not None
    if out is not None and not plot:
        click.echo("strata-nb: needle.png needs matplotlib (pip install 'strata-nb[bench]'); "
                   "writing needle.json and needle.md only", err=True)
    eng = load_engine(**engine_kw)
    probe.check(*grid, trials, max_tokens, seed, eng.settings.max_context)  # before the progress bar shows
    with tqdm(total=len(grid[0]) * len(grid[1]) * trials * len(grid[2]), unit="reply", desc="needle",
              file=sys.stderr, disable=as_json) as bar:
        result = probe.run(eng, *grid, trials, max_tokens, progress=bar.update, seed=seed)
    result["settings"]["device"] = _device_name(eng.be)
    result["command"] = "strata-nb " + shlex.join(_ARGV)
    if folder is not None:
        (folder / "needle.json").write_text(json.dumps(result, indent=1))
        s = result["settings"]
        (folder / "needle.md").write_text(
            f"# strata-nb needle\n\n`{result['command']}`\n\nModel: {Path(s['model']).name}; device: {s['device']}; "
            f"kv {s['kv']}, kv_resident {s['kv_resident']}, kv_window {s['kv_window']}; "
            f"{probe.facts_per_cell(result)}, {s['max_tokens']}-token greedy replies. A cell is the share of "
            f"replies that hold the planted fact's answer.\n\n{probe.table(result)}\n")
        written = [folder / "needle.json", folder / "needle.md"]
        if plot:
            written.append(probe.heatmap(result, folder / "needle.png"))
        for path in written:
            click.echo(str(path), err=True)
    click.echo(json.dumps(result, indent=1) if as_json else probe.table(result))


def _out_folder(out: str) -> "Path":
    """--out's folder, made before the work whose results it will hold, or a clear error."""

    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StrataError(f"--out {out}: cannot make the folder ({e.strerror or e})") from None
    return Path(out)


def _out_file(out: str) -> "Path":
    """--out's file, its folder checked before the work whose results it will hold."""

    if not Path(out).parent.is_dir():
        raise StrataError(f"--out {out}: the folder {Path(out).parent} does not exist")
    return Path(out)


def _numbers(text: str, flag: str, kind, what: str) -> list:
    """--lengths 2048,4096 -> [2048, 4096]: comma-separated numbers of one kind (int or float)."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise StrataError(f"{flag} takes comma-separated {what}, got {text!r}") from None


@cli.command()
@click.option("--model", type=click.Path(dir_okay=False), default=None,
              help="GGUF file (default: the default model). Speed depends on its shapes only.")
@click.option("--formats", default="fp16,int8,q4_0,k8v4", show_default=True, help="KV formats, fully resident.")
@click.option("--streamed-formats", default=None,
              help="KV formats also run streamed at the minimum resident size with QSA 1024 (default: --formats; '' = none).")
@click.option("--depths", default="1024,4096,8192", show_default=True,
              help="Prompt tokens before decode (clamped to fit --max-context with the decoded tokens).")
@click.option("--runs", type=int, default=5, show_default=True, help="Runs per configuration; rates are medians.")
@click.option("--decode-tokens", type=int, default=64, show_default=True, help="Timed decode steps per run.")
@click.option("--check-tokens", type=int, default=32, show_default=True,
              help="First greedy tokens held against the numpy backend; 0 = no check.")
@click.option("--peer/--no-peer", default=True, show_default=True,
              help="Also time HF transformers (eager bf16) on the same shapes, if torch and transformers import.")
@click.option("--profile/--no-profile", default=True, show_default=True,
              help="Per-kernel breakdown of one decode step (needs torch for CUPTI).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--graph/--no-graph", default=True, show_default=True, help="Replay decode steps from a CUDA graph.")
@click.option("--kernels", "kernel_tiers", default="fast", show_default=True,
              help="The cuda backend's tiers to time, e.g. fast,plain: the plain tier's resident and streamed "
                   "rows beside the fast tier's; fast,mega the megakernel's beside the fast tier's.")
@click.option("--max-context", type=int, default=None, help="KV cells per layer (default: the model's trained context).")
@click.option("--out", type=click.Path(file_okay=False), default="bench-out", show_default=True,
              help="Folder for bench.json, bench.md and bench.png.")
@click.option("--append", is_flag=True,
              help="Add this run's rows, peer rows and profile to the bench.json already in --out.")
@click.option("--expert-cache", "expert_cache", default=None,
              help="MoE models: also bench the resident rows with these shares of the experts in VRAM, "
                   "e.g. 25%,50%,100% (the rest read from pinned host memory).")
@click.option("--spec", "spec_windows", default=None,
              help="Also bench the resident rows with speculative decoding at these verify windows, e.g. 4 or 4,8 "
                   "(acceptance and tokens a pass beside tok/s; each row's tokens are held to --spec 0's).")
@click.option("--llama-bench", "llama_bench", default=None,
              help="A llama.cpp llama-bench binary: run it on the same GGUF, depths and KV types (k8v4 as q8_0 K + "
                   "q4_0 V) and put its rows and ours-over-llama.cpp ratios beside ours.")
def bench(model, formats, streamed_formats, depths, runs, decode_tokens, check_tokens, peer, profile, device,
          graph, kernel_tiers, max_context, out, append, expert_cache, spec_windows, llama_bench):
    """Measure prefill and decode tok/s per KV format, resident and streamed, at several depths."""
    from importlib import resources

    from .bench.report import write
    from .bench.run import bench as run_bench

    earlier = None
    if append:
        try:
            earlier = json.loads((Path(out) / "bench.json").read_text())
        except (OSError, ValueError) as e:
            raise StrataError(f"--append needs a readable bench.json in {out}: {e}") from None
    fmts = _formats(formats, "--formats", allow_empty=True)
    streamed = fmts if streamed_formats is None else _formats(streamed_formats, "--streamed-formats", allow_empty=True)
    depth_list = _numbers(depths, "--depths", int, "token counts")
    if not depth_list or min(depth_list) < 1:
        raise StrataError("--depths needs at least one depth >= 1")
    if runs < 1 or decode_tokens < 1 or check_tokens < 0:
        raise StrataError("--runs and --decode-tokens must be >= 1, --check-tokens >= 0")
    tiers = tuple(dict.fromkeys(t.strip() for t in kernel_tiers.split(",") if t.strip()))
    if not tiers or any(t not in KERNELS for t in tiers):
        raise StrataError(f"--kernels takes tiers from {', '.join(KERNELS)}, got {kernel_tiers!r}")
    shares = _shares(expert_cache) if expert_cache is not None else None
    windows = _windows(spec_windows) if spec_windows is not None else None
    if llama_bench is not None:
        from .bench.llama import check_binary

        llama_bench = check_binary(llama_bench)
    folder = _out_folder(out)
    eng = load_engine(model=model, device=device, graph=graph, max_context=max_context, kernels=tiers[0])
    if eng.be.name == "cuda" and eng.settings.kernels != tiers[0]:  # a family the fast tier does not run:
        tiers = ("plain",)  # Engine.load said so, and loaded it on the plain tier
    if eng.be.name != "cuda" and tiers != ("fast",):
        raise StrataError("--kernels picks the cuda backend's tiers; the numpy backend (--device cpu) runs the "
                          "references")
    if shares and not eng.config.n_expert:
        raise StrataError("--expert-cache benches an MoE model's expert cache; this model is dense")
    text = resources.files("strata_nb.data").joinpath("default_document.txt").read_text()
    about = {"model": eng.config.name or str(eng.model.path), "device": _device_name(eng.be),
             "command": "strata-nb " + shlex.join(_ARGV)}
    partial = folder / "bench.partial.json"  # this run's rows so far: what a cut-short run leaves

    def progress(result):
        partial.write_text(json.dumps(result | about, indent=1))

    result = run_bench(eng, text, fmts, streamed, depth_list, runs, decode_tokens, check_tokens, peer, profile,
                       lambda m: click.echo(m, err=True), progress, shares, windows, llama_bench, tiers)
    result |= about
    if earlier is not None:
        result = earlier | {k: v for k, v in result.items() if k not in ("rows", "peer", "command")} | {
            "rows": earlier["rows"] + result["rows"], "peer": earlier.get("peer", []) + result["peer"],
            "llama": earlier.get("llama", []) + result.get("llama", []),
            "command": earlier["command"] + "; then: " + result["command"]}
    for path in write(result, folder):
        click.echo(str(path))
    partial.unlink(missing_ok=True)


def _shares(text: str) -> list[float]:
    """--expert-cache 25%,50%,100% -> [0.25, 0.5, 1.0]."""
    try:
        shares = [float(s.strip().rstrip("%")) / 100 for s in text.split(",") if s.strip()]
    except ValueError:
        shares = []
    if not shares or not all(0 <= s <= 1 for s in shares):
        raise StrataError(f"--expert-cache takes shares of the experts from 0% to 100%, e.g. 25%,50%,100%; got {text!r}")
    return shares


def _windows(text: str) -> list[int]:
    """bench --spec 4,8 -> [4, 8]: verify windows as run --spec takes them."""
    try:
        windows = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        windows = []
    if not windows or not all(2 <= w <= MAX_WINDOW for w in windows):
        raise StrataError(f"--spec takes verify windows from 2 to {MAX_WINDOW}, e.g. 4 or 4,8; got {text!r}")
    return windows


def _formats(text: str, flag: str, allow_empty: bool = False) -> list[str]:
    fmts = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in fmts if f not in USER_FORMATS]
    if bad or (not fmts and not allow_empty):
        raise StrataError(f"{flag} takes formats from {', '.join(USER_FORMATS)}, got {text!r}")
    return fmts


def _device_name(be) -> str:
    if be.name != "cuda":
        return "CPU (numpy backend)"
    from numba import cuda

    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


@cli.command()
@click.option("--model", type=click.Path(dir_okay=False), default=None,
              help="Dense llama GGUF to start from (default: the default model).")
@click.option("--kind", type=click.Choice(["split", "copies"]), default="split", show_default=True,
              help="split: expert e owns FFN columns [e ff/E, (e+1) ff/E), down scaled by E; "
                   "copies: every expert is the whole dense FFN.")
@click.option("--experts", type=int, default=8, show_default=True, help="E, experts per layer.")
@click.option("--used", type=int, default=None,
              help="K, experts each token takes (default: E for split, the exact oracle; 2 for copies).")
@click.option("--router", type=click.Choice(["zero", "random"]), default=None,
              help="Router weights (default: zero when K = E, else random).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random router.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="File to write (default: <model>-<kind>-e<E>k<K>.gguf in the current folder).")
def moefy(model, kind, experts, used, router, seed, out):
    """Write a mixture-of-experts GGUF (llama.cpp's layout) from a dense one, byte for byte."""
    from .model.fetch import model_path
    from .model.moefy import moefy as write_moe

    path = write_moe(model_path(model), out, kind, experts, used, router, seed)
    click.echo(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")


@cli.command()
@click.option("--model", "name", default=None, metavar="NAME",
              help="A model by name, e.g. gemma3-270m (its terms are shown); default: the default model.")
def fetch(name):
    """Download a model into the cache (STRATA_NB_HOME or the user cache dir)."""
    from .model.fetch import fetch as fetch_model
    from .model.fetch import fetch_named

    click.echo(str(fetch_named(name) if name else fetch_model(progress=True)))


@cli.command("probe")
@click.option("--url", required=True,
              help="The server's base URL, e.g. http://127.0.0.1:8080 (with or without /v1 on the end).")
@click.option("--model", default=None,
              help="The model field to send (default: the first id of GET /v1/models, else 'default').")
@click.option("--api-key", default=None, help="Sent as a Bearer token.")
@click.option("--timeout", type=float, default=300, show_default=True,
              help="Seconds to wait for the server at any one point of a request.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Sent with every request (temperature 0); also the seed of the filler and the facts.")
@click.option("--max-tokens", type=int, default=32, show_default=True, help="Reply tokens of the short checks.")
@click.option("--parked/--no-parked", default=True, show_default=True,
              help="Check 'repeat after others': a conversation's reply is the same after other conversations "
                   "(catches a conversation cache that restores wrong, or any state leaking between requests).")
@click.option("--others", type=int, default=3, show_default=True,
              help="With --parked: the other conversations, every other one two-turn.")
@click.option("--parked-words", type=int, default=2000, show_default=True,
              help="With --parked: filler words of each conversation, enough that a cache which parks whole "
                   "chunks (ours: 2048 tokens on a GPU) parks some; lower it for a server on a CPU.")
@click.option("--needle-words", type=int, default=600, show_default=True,
              help="Filler words around the planted fact.")
@click.option("--free-tokens", type=int, default=200, show_default=True,
              help="max_tokens of the free generation the repetition check scores.")
@click.option("--ttft", type=int, default=None,
              help="Also time the first token of a follow-up turn after a first turn of this many filler words "
                   "(e.g. 3000), beside an uncached twin.")
@click.option("--ttft-runs", type=int, default=3, show_default=True, help="Timings of each kind; medians are shown.")
@click.option("--rate", type=int, default=None,
              help="Also time a streamed reply of this many tokens at the client; against strata-nb serve, beside "
                   "the engine's own decode rate (the server's cost a token).")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON (with every reply) instead of the table.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the JSON to this file.")
@click.pass_context
def probe_cmd(ctx, url, api_key, timeout, as_json, out, **settings):
    """Check an OpenAI-compatible chat server: streaming, repeats, state between requests, retrieval, loops.
    Exit 0 when every check passes, 1 when one fails."""
    from .serve import probe

    checks = probe.ProbeSettings(**settings)  # bad flags are said before the server is asked anything
    out_file = _out_file(out) if out is not None else None
    result = probe.run(probe.Server(url, api_key, timeout), checks)  # no command line in it: it may hold the key
    if out_file is not None:
        out_file.write_text(json.dumps(result, indent=1))
    click.echo(json.dumps(result, indent=1) if as_json else probe.table(result))
    ctx.exit(0 if result["passed"] else 1)


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that is unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_STARTED, _START_NAME = time.monotonic(), "the command started"


def main(argv=None):
    """Entry point: user mistakes print one line and exit 2; bugs keep their traceback."""
    global _ARGV, _STARTED, _START_NAME
    _ARGV = list(sys.argv[1:] if argv is None else argv)
    # --stats' first token counts from the process's start when this is the program (Python's
    # start-up and imports included), else (a test calling main) from this call
    age = process_age() if argv is None else None
    _STARTED = time.monotonic() - (age or 0.0)
    _START_NAME = "the process started" if age is not None else "the command started"
    try:
        rv = cli.main(args=argv, prog_name="strata-nb", standalone_mode=False)
    except click.exceptions.UsageError as err:
        click.echo(f"strata-nb: error: {err.format_message()}", err=True)
        sys.exit(2)
    except SettingError as err:  # the setting as the flag that set it
        click.echo(f"strata-nb: error: {err.flag} {err.problem}", err=True)
        sys.exit(2)
    except StrataError as err:
        click.echo(f"strata-nb: error: {err}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("strata-nb: interrupted", err=True)
        sys.exit(130)
    except click.exceptions.ClickException as err:
        click.echo(f"strata-nb: error: {err.format_message()}", err=True)
        sys.exit(err.exit_code)
    except BrokenPipeError:
        sys.exit(0)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
