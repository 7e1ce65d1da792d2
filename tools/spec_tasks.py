"""Speculative decoding on tasks: decode tok/s with --spec T against --spec 0 on prompts
that ask the model to copy (correct a given paragraph or email, restate given steps), on
one that asks it to edit code, and on prompts with little to copy (free prose), greedy,
the same model and settings.

    python tools/spec_tasks.py --device cuda --spec 4,8 --out docs/measured/spec

Each prompt runs once per setting after one warm-up run; the rate is the steady decode
rate `--stats` prints (RunStats: the first passes are warm-up). A --spec row's tokens must
equal the --spec 0 row's (greedy identity): a row that differs is marked and the script
exits 1. Writes spec_tasks.json and spec_tasks.md (per prompt, then the geometric mean
speedup per kind) to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from strata_nb.bench.report import model_file, pastable
from strata_nb.cli import _device_name
from strata_nb import Engine
from strata_nb.settings import SamplingSettings

PASSAGE = ("The lighthouse stood on the northern cliff for more then two hundred years. Every night the keeper "
           "climbed the one hundred and twelve steps, trimmed the wick, and wound the clockwork that turned the "
           "great lens. Ships passing the point could see its beam from twenty miles away, and sailors said that "
           "as long as the light was burning, no vessel would be lost on the rocks below. When the lamp was "
           "finally replaced by an electric bulb, the keeper's cottage became a small museum.")
FUNCTION = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages'''
STEPS = ("Preheat the oven to 180 degrees. Mix the flour, sugar and baking powder in a large bowl. Beat the eggs "
         "with the milk and melted butter. Pour the wet ingredients into the dry ones and stir until smooth. "
         "Pour the batter into a greased tin and bake for thirty five minutes.")

EMAIL = ("Dear Mr Patel, thank you for your leter of the fourth of March. I am pleased to confirm that your order of "
         "twelve wooden chairs and two oak tables has been dispatched today. The delivery company will contact you "
         "to arange a convenient time. If you have any questions, please do not hesitate to call our office. "
         "Kind regards, Sarah Jones")

TASKS = {  # "code": the default model (135M) rewrites the function's body instead of copying it
    "copy": [
        ("fix-typos", "Correct the spelling mistakes in the following paragraph and write out the whole corrected "
                      "paragraph:\n\n" + PASSAGE),
        ("fix-email", "Correct the spelling mistakes in the following email and write out the whole corrected "
                      "email:\n\n" + EMAIL),
        ("restate", "Rewrite these instructions as a numbered list, one step per line, keeping the wording:\n\n"
                    + STEPS),
    ],
    "code": [
        ("edit-code", "Add a docstring to this Python function. Write out the whole function with the docstring "
                      "and change nothing else:\n\n" + FUNCTION),
    ],
    "prose": [
        ("story", "Write a short story about a fox who learns to swim."),
        ("explain", "Explain how a bicycle's gears make pedalling easier on a hill."),
        ("advice", "Give some advice to someone starting to learn the piano as an adult."),
    ],
}


def run(eng: Engine, prompt: str, max_tokens: int) -> tuple[list[int], dict]:
    ids = eng.prompt_ids(prompt, chat=True)
    tokens: list[int] = []
    list(eng.generate_ids(ids, SamplingSettings(max_tokens=max_tokens), on_token=tokens.append))
    st = eng.last_stats
    rate = st.decode_steps / st.decode_seconds if st.decode_seconds else 0.0
    spec = st.extra.get("spec") or {}
    return tokens, dict(rate=rate, steps=st.decode_steps, tokens=len(tokens), **{
        k: spec[k] for k in ("passes", "drafts_offered", "drafts_accepted") if k in spec})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kv", default="fp16")
    ap.add_argument("--spec", default="4,8", help="verify windows to time against --spec 0")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default="spec-out")
    a = ap.parse_args(argv)
    windows = [int(w) for w in a.spec.split(",")]
    engines = {t: Engine.load(model=a.model, device=a.device, kv=a.kv, spec=t) for t in [0, *windows]}
    for eng in engines.values():  # kernels made, graphs captured, caches warm
        run(eng, TASKS["copy"][0][1], 32)
    rows, bad = [], 0
    for kind, prompts in TASKS.items():
        for name, prompt in prompts:
            want, base = run(engines[0], prompt, a.max_tokens)
            for t in windows:
                got, r = run(engines[t], prompt, a.max_tokens)
                r |= dict(kind=kind, prompt=name, spec=t, base_rate=base["rate"], speedup=r["rate"] / base["rate"],
                          identical=got == want, acceptance=r["drafts_accepted"] / max(r["drafts_offered"], 1),
                          tokens_per_pass=r["tokens"] / max(r["passes"], 1))
                bad += not r["identical"]
                rows.append(r)
                print(f"{kind:5} {name:10} spec {t}: {r['rate']:7.1f} tok/s vs {base['rate']:7.1f} "
                      f"({r['speedup']:.2f}x), {r['tokens']} tokens, acceptance {r['acceptance']:.0%}, "
                      f"{r['tokens_per_pass']:.2f} a pass{'' if r['identical'] else ', NOT IDENTICAL'}",
                      file=sys.stderr)
    eng = engines[0]
    about = dict(model=eng.config.name, device=a.device, gpu=_device_name(eng.be), kv=a.kv, max_tokens=a.max_tokens,
                 command="python tools/spec_tasks.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_tasks.json").write_text(json.dumps(about | dict(rows=rows), indent=1))
    (out / "spec_tasks.md").write_text(table(about, rows))
    return 1 if bad else 0


def table(about: dict, rows: list[dict]) -> str:
    lines = [f"Measured with `{pastable(about['command'])}` ({model_file(about['command'])}"
             f"{', ' + about['gpu'] if about.get('gpu') else ''}, --kv {about['kv']}, greedy, "
             f"at most {about['max_tokens']} tokens).", "",
             "| kind | prompt | --spec | tok/s | --spec 0 tok/s | speedup | acceptance | tokens a pass | identical |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['prompt']} | {r['spec']} | {r['rate']:.1f} | {r['base_rate']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['acceptance']:.0%} | {r['tokens_per_pass']:.2f} | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    lines += ["", "| kind | --spec | geometric mean speedup | acceptance (all drafts) |", "| --- | ---: | ---: | ---: |"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        for t in dict.fromkeys(r["spec"] for r in rows):
            sel = [r for r in rows if r["kind"] == kind and r["spec"] == t]
            mean = math.exp(sum(math.log(r["speedup"]) for r in sel) / len(sel))
            acc = sum(r["drafts_accepted"] for r in sel) / max(sum(r["drafts_offered"] for r in sel), 1)
            lines.append(f"| {kind} | {t} | {mean:.2f}x | {acc:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
