"""`strata-nb needle`: does a decode query still find a fact planted deep in its context?

QSA block selection (--qsa-budget N) lets a decode query read block 0, the recent window
and the best-scoring other 16-cell blocks, N cells in all. A fact in a block that scores
low is not read, and a reply that needs it goes wrong, while perplexity hardly moves: most
tokens need nothing from far back. The probe plants one fact (needle_text.py) at a depth
of a filler prompt, asks for it at the end, and counts the greedy replies that hold the
answer, per (budget, length, depth): full attention (budget 0) beside each QSA budget.

A case's length is the context it fills: its prompt is at most `length - max_tokens`
tokens, so prompt and reply fit a cache of `length` cells. The prompt's own pass is dense
at any budget, so the reply's first token always sees the whole prompt; the facts are
worded so the answer comes a few tokens into the reply, from decode steps (needle_text.fact).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import SettingError, StrataError
from .needle_text import Fact, fact, filler, sentences
from .settings import SamplingSettings

MIN_PROMPT = 128  # prompt tokens a case needs: the chat template, fact and question take ~70
SEP = "\n\n"  # paragraphs, the fact and the question are joined by blank lines


def build_case(eng, length: int, depth: float, seed: int) -> tuple[list[int], Fact]:
    """A chat prompt of at most `length` tokens, short of it by less than a filler sentence:
    filler paragraphs, the fact as a paragraph of its own at `depth` of the filler's tokens
    (0 = before all of it, 1 = after all of it), then a blank line and the question.
    Deterministic from `seed`."""
    rng = np.random.default_rng(seed)
    planted = fact(rng)
    fixed = len(eng.prompt_ids(planted.text + SEP + planted.question))  # the chat template, fact and question
    room = length - fixed  # filler tokens
    if room < 0:
        raise SettingError("lengths", f"too short: a {length}-token prompt cannot hold the chat template, fact and "
                                      f"question ({fixed} tokens)")
    sizes: list[int] = []  # tokens of each filler paragraph, blank line included: counted once

    def count(text: str) -> int:
        sizes.append(len(eng.tokenize(text)))
        return sizes[-1]

    drawn = filler(rng, room, count)  # its last paragraph runs past room
    kept, used = [], 0
    for paragraph, n in zip(drawn, sizes):
        if used + n > room:  # the first that does not fit: as many of its sentences as do
            head = sentences(paragraph)
            for k in range(len(head) - 1, 0, -1):
                size = len(eng.tokenize(SEP + " ".join(head[:k])))
                if used + size <= room:
                    kept.append((" ".join(head[:k]), size))
                    used += size
                    break
            break
        kept.append((paragraph, n))
        used += n
    before = np.cumsum([0] + [n for _, n in kept]) / max(used, 1)  # share of the filler before each gap
    at = int(np.argmin(np.abs(before - depth)))
    parts = [p for p, _ in kept[:at]] + [planted.text] + [p for p, _ in kept[at:]] + [planted.question]
    ids = eng.prompt_ids(SEP.join(parts))
    # the counts add up because the byte-level BPE never merges across a blank line
    assert len(ids) == fixed + used, (len(ids), fixed, used)
    return ids, planted


def check(lengths, depths, budgets, trials: int, max_tokens: int, seed: int = 0, max_context: int | None = None):
    """The probe's settings, checked: (lengths, depths, budgets), each sorted without repeats.
    max_context: the engine's, once it is loaded (None: not checked)."""
    SamplingSettings(max_tokens=max_tokens)  # its own check of max_tokens
    if not lengths or not depths or not budgets:
        empty = "lengths" if not lengths else "depths" if not depths else "budgets"
        raise SettingError(empty, "must name at least one value")
    for length in lengths:
        if length - max_tokens < MIN_PROMPT:
            raise SettingError("lengths", f"{length} leaves {length - max_tokens} prompt tokens beside the reply's "
                                          f"{max_tokens} (max_tokens); a case needs at least {MIN_PROMPT}")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:  # also catches NaN
            raise SettingError("depths", f"must lie in [0, 1] (0 = the start of the filler, 1 = its end), got {depth}")
    for budget in budgets:
        if budget < 0:
            raise SettingError("budgets", f"must be 0 (full attention) or positive cell counts, got {budget}")
    if max_context is not None and max(lengths) > max_context:
        raise SettingError("lengths", f"{max(lengths)} does not fit the engine's max_context of {max_context} cells")
    if trials < 1:
        raise SettingError("trials", f"must be at least 1, got {trials}")
    if seed < 0:
        raise SettingError("seed", f"must be >= 0, got {seed}")
    return sorted(set(lengths)), sorted(set(depths)), sorted(set(budgets))


def key(x) -> str:
    """A length, depth or budget as a key of the result's tables: JSON keys are strings."""
    return f"{x:g}" if isinstance(x, float) else str(x)


def case_seed(seed: int, length: int, depth: float, trial: int) -> int:
    """Each (length, depth, trial) cell its own seed, and so its own filler and fact."""
    return int(np.random.SeedSequence([seed, length, round(depth * 1000), trial]).generate_state(1)[0])


def first_index(ids: list[int], part: list[int]) -> int:
    """Where `part` first occurs in `ids`, or -1."""
    return next((i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part), -1)


def run(eng, lengths, depths, budgets, trials: int, max_tokens: int = 16, progress=None, seed: int = 0) -> dict:
    """Every (length, depth, trial) case, built once, answered greedily at every budget
    (0 = full attention). progress(1) hears of each reply. accuracy[budget][length][depth]
    is the share of a cell's trials whose reply holds the answer; keys are strings (`key`)."""
    s = eng.settings
    lengths, depths, budgets = check(lengths, depths, budgets, trials, max_tokens, seed, s.max_context)
    engines = {b: eng if b == s.qsa_budget else eng.derive(quiet=True, qsa_budget=b) for b in budgets}
    sampling = SamplingSettings(max_tokens=max_tokens)
    cases = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                case_s = case_seed(seed, length, depth, trial)
                ids, planted = build_case(eng, length - max_tokens, depth, case_s)
                case = dict(length=length, depth=depth, trial=trial, seed=case_s, prompt_tokens=len(ids),
                            fact_cell=first_index(ids, eng.tokenize(planted.text)), fact=planted.text,
                            question=planted.question, answer=planted.answer, replies={}, found={})
                for b, e in engines.items():
                    reply = "".join(e.generate_ids(ids, sampling))
                    case["replies"][key(b)], case["found"][key(b)] = reply, planted.found(reply)
                    if progress:
                        progress(1)
                cases.append(case)

    def share(b, pick) -> float:
        hits = [c["found"][key(b)] for c in cases if pick(c)]
        return sum(hits) / len(hits)

    accuracy = {key(b): {key(n): {key(d): share(b, lambda c: c["length"] == n and c["depth"] == d) for d in depths}
                         for n in lengths} for b in budgets}
    return dict(settings=dict(model=str(eng.model.path), kv=s.kv, kv_resident=s.kv_resident, kv_window=s.kv_window,
                              max_context=s.max_context, prefill_chunk=s.prefill_chunk, backend=eng.be.name,
                              max_tokens=max_tokens, seed=seed),
                lengths=lengths, depths=depths, budgets=budgets, trials=trials, accuracy=accuracy,
                overall={key(b): share(b, lambda c: True) for b in budgets}, cases=cases)


def facts_per_cell(result: dict) -> str:
    n = result["trials"]
    return f"{n} fact{'s' if n > 1 else ''} per cell"


def attention_name(budget) -> str:
    return "full attention" if int(budget) == 0 else f"QSA {budget}"


def table(result: dict) -> str:
    """Markdown: a row per (budget, length) and an `all` row per budget; a column per depth,
    the row's accuracy over all depths, and that as a share of full attention's."""
    acc, depths = result["accuracy"], result["depths"]
    full = acc.get("0")

    def of_full(mine: float, theirs: float | None) -> str:
        return "-" if theirs is None or theirs == 0 else f"{100 * mine / theirs:.0f}%"

    lines = ["| attention | length | " + " | ".join(f"depth {key(d)}" for d in depths) + " | all depths | of full |",
             "| --- | ---: | " + " | ".join("---:" for _ in depths) + " | ---: | ---: |"]
    for b in map(key, result["budgets"]):
        rows = [(f"{n:,}", [acc[b][key(n)][key(d)] for d in depths],
                 None if full is None else np.mean(list(full[key(n)].values()))) for n in result["lengths"]]
        by_depth = [np.mean([acc[b][key(n)][key(d)] for n in result["lengths"]]) for d in depths]
        rows.append(("all", by_depth, None if full is None else result["overall"]["0"]))
        for label, cells, theirs in rows:
            mine = result["overall"][b] if label == "all" else np.mean(cells)
            lines.append(f"| {attention_name(b)} | {label} | " + " | ".join(f"{a:.2f}" for a in cells)
                         + f" | {mine:.2f} | {'-' if b == '0' else of_full(mine, theirs)} |")
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display), or a clear error: matplotlib
    comes with the `bench` extra."""
    try:
        import matplotlib
    except ImportError:
        raise StrataError("the heat map needs matplotlib: pip install 'strata-nb[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap(result: dict, path) -> Path:
    """A panel per budget, side by side: depth down, length across, colour = accuracy."""
    plt = pyplot()
    lengths, depths, budgets = result["lengths"], result["depths"], result["budgets"]
    fig, axes = plt.subplots(1, len(budgets), squeeze=False, sharey=True, layout="constrained",
                             figsize=(1.5 + len(budgets) * (0.8 + 0.9 * len(lengths)), 1.5 + 0.4 * len(depths)))
    for ax, b in zip(axes[0], budgets):
        acc = result["accuracy"][key(b)]
        grid = np.array([[acc[key(n)][key(d)] for n in lengths] for d in depths])  # (depths, lengths)
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for (i, j), a in np.ndenumerate(grid):  # white on the dark ends of the colour map
            ax.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if abs(a - 0.5) > 0.3 else "black")
        ax.set_xticks(range(len(lengths)), labels=[f"{n:,}" for n in lengths])
        ax.set_yticks(range(len(depths)), labels=[key(d) for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(attention_name(b))
    axes[0][0].set_ylabel("depth of the fact")
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy")
    s = result["settings"]
    fig.suptitle(f"needle retrieval: {Path(s['model']).name}, kv {s['kv']}, {facts_per_cell(result)}")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
