#!/usr/bin/env python3
"""Generate llama.cpp reference fixtures for strata-nb's tests.

What it does
------------
Uses llama-cpp-python (llama.cpp) as the reference implementation and writes
into ``tests/fixtures/``:

* ``llama_tokens.json``     -- llama.cpp tokenizer output for a varied set of
  strings: ``llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)``.
* ``llama_f32_logits.npz``  -- teacher-forced logits of the all-F32 GGUF
  (f32 KV cache, flash attention off) over three texts.
* ``llama_q4_1_logits.npz`` -- the same for the Q4_1 GGUF (default f16 KV
  cache, flash attention off).
  Keys per text i in {0,1,2}:
    text_i         str (0-d unicode array), the exact text that was tokenized
    ids_i          int32 (n,)        token ids (special=True, add_bos=False)
    topk_ids_i     int32 (n, 32)     row p = logits after ids[:p+1], i.e. the
                                     prediction of token p+1; top-32 ids
                                     sorted by logit descending (ties: lower id)
    topk_logits_i  float32 (n, 32)   the matching logits
    full_pos_i     int32 (4,)        positions (0, n//3, 2n//3, n-1)
    full_logits_i  float32 (4, 49152) full logit rows at those positions
* ``llama_greedy.json``     -- greedy (argmax over llama.cpp's logits, i.e.
  temperature 0 / top_k=1) completions, up to 48 new tokens, stopping at token
  2 (<|im_end|>) or 0 (<|endoftext|>), for three ChatML prompts, for both
  files.  ``ids`` excludes the stop token; ``stop_token`` records it.
* ``llama_reference_meta.json`` -- versions, sha256 of the model files, how
  the fixtures were made, and llama.cpp CPU speed (decode / prefill tok/s,
  median of 3 runs) on the Q4_1 file.

* ``--moe``: fixtures for two mixture-of-experts files made from the default model
  by ``strata-nb moefy`` (MOE_FILES below says how), each through its all-F32 copy
  with an f32 KV cache, teacher-forced over the same three texts:
  ``llama_moe_oracle_logits.npz`` (split, 8 experts all used, zero router: the
  dense model, exactly) and ``llama_moe_routed_logits.npz`` (split, 6 of 8
  experts, a seeded random router: llama.cpp's routing itself).  Same keys as
  above, but full rows only at (0, n//3, n-1), which keeps each file under 2 MB.
  ``llama_moe_reference_meta.json`` records each file's moefy settings (the
  tests rebuild the files from them), sha256s, and the comparisons below.

* ``--k-quants``: the default model requantized by llama.cpp's quantizer to Q4_K_M,
  Q5_K_M and Q6_K (tests/k_quant_files.py makes each file once into the model cache),
  each teacher-forced over the same three texts with the default f16 KV cache:
  ``llama_k_quants_logits.npz`` (keys ``<kind>_topk_ids_<i>`` and
  ``<kind>_topk_logits_<i>``, top-32 rows only; the ids are the dense fixture's) and
  ``llama_k_quants_meta.json`` (each file's sha256, size and tensor types, and how its
  llama.cpp logits stand against llama.cpp's F32 run).

* ``--gemma3``: Gemma 3 270M (``strata-nb fetch --model gemma3-270m``), the second
  architecture, teacher-forced with an f32 KV cache over short raw prompts (BOS first) and
  a long text that crosses the 512-cell sliding window: ``llama_gemma3_logits.npz``
  (``text_<i>``, ``ids_<i>``, ``topk_ids_<i>``, ``topk_logits_<i>``: top-32 rows; the
  262,144-wide rows would be 1 MB each) and ``llama_gemma3_meta.json`` (the file's
  sha256, and llama.cpp's greedy continuations of the short prompts, 24 tokens each, on
  the file and on its all-F32 copy (``--gemma3-f32``, made by tools/write_f32_gguf.py):
  ``f32_agrees`` marks the prompts where the two are the same tokens).

How to run
----------
    python3 tools/write_f32_gguf.py /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf \
        /tmp/model/SmolLM2-135M-Instruct.F32.gguf
    /tmp/llamaenv/bin/python tools/make_llama_fixtures.py \
        [--q4 PATH] [--f32 PATH] [--no-speed]

For --moe, first write the MoE files and their F32 copies (settings from MOE_FILES):

    strata-nb moefy --kind split --experts 8 --used 8 --router zero \
        --out /tmp/model/moe-split-e8k8.gguf
    strata-nb moefy --kind split --experts 8 --used 6 --router random --seed 2 \
        --out /tmp/model/moe-split-e8k6.gguf
    python3 tools/write_f32_gguf.py /tmp/model/moe-split-e8k8.gguf /tmp/model/moe-split-e8k8.F32.gguf
    python3 tools/write_f32_gguf.py /tmp/model/moe-split-e8k6.gguf /tmp/model/moe-split-e8k6.F32.gguf
    /tmp/llamaenv/bin/python tools/make_llama_fixtures.py --moe [--moe-oracle PATH] [--moe-routed PATH]

It writes only the MoE fixtures (about 15 seconds on 2 cores; the dense ones stay as they are).

For --k-quants, only the Q4_1 file (the default model) is needed:

    /tmp/llamaenv/bin/python tools/make_llama_fixtures.py --k-quants [--q4 PATH]

Runtime: about 20 seconds on a 2-core x86 machine (~12 s for the fixtures,
~5 s for the speed measurement).  Needs llama-cpp-python, numpy and the two
GGUF files (not in the repo).  CI does NOT run this script; it only reads the
committed fixtures.  With --no-speed the previous speed numbers in
llama_reference_meta.json are kept.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import llama_cpp
from llama_cpp import Llama

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
DOC_PATH = REPO / "src" / "strata_nb" / "data" / "default_document.txt"

DEFAULT_Q4 = "/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_F32 = "/tmp/model/SmolLM2-135M-Instruct.F32.gguf"

# The MoE files: fixture name, moefy's settings (the tests rebuild each file from them, as
# recorded in llama_moe_reference_meta.json), and where the F32 copy is by default.
# The routed file uses 6 of 8 experts, not 2: 2 of 8 leaves a model so far from the dense
# one that it amplifies float32 rounding (llama.cpp's logits and ours drift apart by 1e-2
# with identical routing), and a router near-tie that the two break differently moves the
# later logits by tens. At 6 of 8 the seed's closest call between the 6th and 7th expert
# is a 3e-6 logit gap over the three texts, and the two agree within the dense 1e-3.
MOE_FILES = {
    "oracle": {"fixture": "llama_moe_oracle_logits.npz",
               "moefy": {"kind": "split", "experts": 8, "used": 8, "router": "zero", "seed": 0},
               "f32": "/tmp/model/moe-split-e8k8.F32.gguf"},
    "routed": {"fixture": "llama_moe_routed_logits.npz",
               "moefy": {"kind": "split", "experts": 8, "used": 6, "router": "random", "seed": 2},
               "f32": "/tmp/model/moe-split-e8k6.F32.gguf"},
}
MOE_META = "llama_moe_reference_meta.json"

N_THREADS = 2
N_CTX = 1024
N_BATCH = 512
TOPK = 32
GREEDY_MAX_NEW = 48
STOP_IDS = (2, 0)

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml_prompt(user: str) -> str:
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------
# Tokenizer cases
# --------------------------------------------------------------------------
TOKEN_CASES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces",
    "trailing spaces   ",
    " a  b   c    d     e",
    "tab\tseparated\tvalues\t\tdouble tab",
    "line one\nline two\n\n\nafter three newlines",
    "windows\r\nline\r\nendings\r\n",
    "1234567890",
    "pi is 3.14159 and e is 2.71828",
    "The date is 2026-11-29 at 08:45.",
    "café naïve résumé",
    "Die Größe der Straße",
    "日本語のテキスト",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "👍🏽 🎉 family 👨‍👩‍👧",
    "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n    return a + b\n",
    "int main(void) {\n\tif (x > 0) { return 1; }\n\treturn 0;\n}",
    "See https://example.com/path?q=1&lang=en#top for details.",
    "don't I'll we've they're it's",
    "Wait!!!??? What...",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>",
    "text before<|endoftext|>text after",
    "",
    " ",
    "HeLLo WoRLD",
    "    ",
    "\n",
    "x = [1, 2, 3]  # comment\n",
    "ALL CAPS SENTENCE. lower case sentence.",
    "A\u00a0non-breaking space and an em dash \u2014 here",
    "<|im_start|>system\n" + SYSTEM + "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]

# --------------------------------------------------------------------------
# Teacher-forced texts
# --------------------------------------------------------------------------
CODE_TEXT = '''import json
from pathlib import Path


def load_scores(path: Path) -> dict[str, float]:
    """Read a JSON file of name -> score and drop invalid entries."""
    with path.open("r", encoding="utf-8") as f:
        raw = json.load(f)
    scores = {}
    for name, value in raw.items():
        try:
            scores[name] = float(value)
        except (TypeError, ValueError):
            continue
    return scores


def top_n(scores: dict[str, float], n: int = 3) -> list[tuple[str, float]]:
    return sorted(scores.items(), key=lambda kv: kv[1], reverse=True)[:n]


if __name__ == "__main__":
    best = top_n(load_scores(Path("scores.json")))
    for rank, (name, score) in enumerate(best, start=1):
        print(f"{rank}. {name}: {score:.2f}")
'''

CHAT_TEXT = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    "<|im_start|>user\nI have a small garden that gets about four hours of sun a day. "
    "What vegetables could I grow there?<|im_end|>\n"
    "<|im_start|>assistant\nFour hours of direct sun is considered partial shade, but many "
    "vegetables still do well in it. Leafy greens are the best choice: lettuce, spinach, "
    "kale and Swiss chard all grow happily with less light, and they may even bolt more "
    "slowly in the heat of summer. Herbs such as parsley, mint and chives are also good "
    "options. Root vegetables like radishes and beets can work too, although their roots "
    "will be a little smaller. I would avoid tomatoes, peppers and squash, which need six "
    "to eight hours of sun to produce a good harvest.<|im_end|>\n"
)

GREEDY_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
]


def sha256(path: str) -> str:
    from strata_nb.model.fetch import sha256 as of_file

    return of_file(Path(path))


def make_llm(path: str, f32_kv: bool, logits_all: bool = True) -> Llama:
    kw = dict(model_path=path, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=N_THREADS,
              n_threads_batch=N_THREADS, logits_all=logits_all, flash_attn=False,
              verbose=False)
    if f32_kv:
        kw.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    return Llama(**kw)


def tok(llm: Llama, text: str) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


def doc_prefix(llm: Llama, target: int = 200) -> str:
    """Longest prefix of the default document ending at a sentence/line end
    whose token count is <= target."""
    doc = DOC_PATH.read_text(encoding="utf-8")
    best = None
    for i, ch in enumerate(doc):
        if ch in ".\n" and (i + 1 == len(doc) or doc[i + 1] in " \n"):
            prefix = doc[: i + 1]
            if len(tok(llm, prefix)) <= target:
                best = prefix
            else:
                break
    assert best is not None
    return best


def four_rows(n: int) -> tuple[int, ...]:
    return (0, n // 3, 2 * n // 3, n - 1)


def three_rows(n: int) -> tuple[int, ...]:  # the MoE fixtures: one row fewer keeps a file under 2 MB
    return (0, n // 3, n - 1)


def teacher_forced(llm: Llama, ids: list[int], full_rows=four_rows) -> dict[str, np.ndarray]:
    llm.reset()
    llm.eval(ids)
    n = len(ids)
    logits = np.array(llm.scores[:n], dtype=np.float32, copy=True)
    assert np.isfinite(logits).all()
    # sort by (-logit, id): stable argsort on the negated row
    order = np.argsort(-logits, axis=1, kind="stable")[:, :TOPK]
    topk_ids = order.astype(np.int32)
    topk_logits = np.take_along_axis(logits, order, axis=1).astype(np.float32)
    pos = np.array(full_rows(n), dtype=np.int32)
    return dict(ids=np.asarray(ids, np.int32), topk_ids=topk_ids,
                topk_logits=topk_logits, full_pos=pos,
                full_logits=logits[pos].copy(), _all=logits)


def greedy(llm: Llama, prompt_ids: list[int]) -> dict:
    llm.reset()
    llm.eval(prompt_ids)
    out: list[int] = []
    margins: list[float] = []
    stop = None
    for _ in range(GREEDY_MAX_NEW):
        row = llm.scores[llm.n_tokens - 1]
        nxt = int(np.argmax(row))
        top2 = np.partition(row, -2)[-2:]
        margins.append(round(float(top2[1] - top2[0]), 4))
        if nxt in STOP_IDS:
            stop = nxt
            break
        out.append(nxt)
        llm.eval([nxt])
    text = llm.detokenize(out, special=False).decode("utf-8", errors="replace")
    # top1_margins[j] = logit(top1) - logit(top2) at step j (the last one is the
    # step that produced the stop token, if any); tiny margins mean the step is
    # fragile to numerical differences.
    return {"ids": out, "text": text, "stop_token": stop,
            "finish_reason": "stop" if stop is not None else "length",
            "top1_margins": margins}


def measure_speed(path: str, doc_ids: list[int], short_prompt: list[int]) -> dict:
    llm = make_llm(path, f32_kv=False, logits_all=False)
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))

    # warm-up
    llm.reset(); llm.eval(doc_ids[:64]); llm.eval([int(np.argmax(last_logits()))])

    prefill, decode = [], []
    for _ in range(3):
        prompt = doc_ids[:512]
        assert len(prompt) == 512
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill.append(512 / (time.perf_counter() - t0))

        llm.reset()
        llm.eval(short_prompt)
        nxt = int(np.argmax(last_logits()))
        dt = 0.0
        for _ in range(128):
            t0 = time.perf_counter()
            llm.eval([nxt])
            dt += time.perf_counter() - t0
            nxt = int(np.argmax(last_logits()))
        decode.append(128 / dt)
    del llm
    return {
        "model_file": os.path.basename(path),
        "n_threads": N_THREADS,
        "decode_tok_s_median": round(statistics.median(decode), 2),
        "decode_tok_s_runs": [round(x, 2) for x in decode],
        "decode_method": ("prompt = ChatML 'What is the capital of France?' "
                          f"({len(short_prompt)} tokens, not timed), then 128 single-token "
                          "llm.eval calls (greedy, stop tokens ignored); only the eval "
                          "calls are timed (wall clock, includes the small Python overhead)"),
        "prefill_tok_s_median": round(statistics.median(prefill), 2),
        "prefill_tok_s_runs": [round(x, 2) for x in prefill],
        "prefill_method": ("first 512 tokens of default_document.txt evaluated in one "
                           "llm.eval call, n_batch=512, logits only for the last token"),
        "note": "machine shared with other jobs; numbers are noisy",
    }


def moefy_command(settings: dict, out: str) -> str:
    return (f"strata-nb moefy --kind {settings['kind']} --experts {settings['experts']} "
            f"--used {settings['used']} --router {settings['router']} --seed {settings['seed']} --out {out}")


def overlap_diff(a: dict, b: dict) -> tuple[float, int]:
    """Two teacher-forced runs over the same ids: (largest |logit difference| where their
    top-32 ids overlap, rows whose top-1 ids agree)."""
    assert np.array_equal(a["ids"], b["ids"])
    md = 0.0
    for p in range(len(a["ids"])):
        _, ia, ib = np.intersect1d(a["topk_ids"][p], b["topk_ids"][p], return_indices=True)
        if len(ia):
            md = max(md, float(np.abs(a["topk_logits"][p][ia] - b["topk_logits"][p][ib]).max()))
    return md, int((a["topk_ids"][:, 0] == b["topk_ids"][:, 0]).sum())


def moe_fixtures(paths: dict[str, str], t_start: float) -> int:
    """The --moe mode: llama_moe_{oracle,routed}_logits.npz and llama_moe_reference_meta.json."""
    dense = np.load(FIXTURES / "llama_f32_logits.npz")
    texts = [str(dense[f"text_{i}"]) for i in range(3)]  # the dense fixtures' texts, so rows line up
    results, files = {}, {}
    for key, spec in MOE_FILES.items():
        path, settings = paths[key], spec["moefy"]
        llm = make_llm(path, f32_kv=True)
        got = (llm.metadata.get("llama.expert_count"), llm.metadata.get("llama.expert_used_count"))
        want = (str(settings["experts"]), str(settings["used"]))
        assert got == want, f"{path}: (experts, used) = {got}, MOE_FILES says {want}"
        results[key] = []
        for i, t in enumerate(texts):
            ids = tok(llm, t)
            assert ids == dense[f"ids_{i}"].tolist(), f"text {i} tokenizes differently from the dense fixture"
            results[key].append(teacher_forced(llm, ids, full_rows=three_rows))
            print(f"[moe {key}] text {i}: {len(ids)} tokens", flush=True)
        del llm
        arrs = {}
        for i, t in enumerate(texts):
            arrs[f"text_{i}"] = np.array(t)
            for k in ("ids", "topk_ids", "topk_logits", "full_pos", "full_logits"):
                arrs[f"{k}_{i}"] = results[key][i][k]
        np.savez_compressed(FIXTURES / spec["fixture"], **arrs)
        files[key] = {"fixture": spec["fixture"], "moefy": settings,
                      "made_by": [moefy_command(settings, "MOE.gguf"),
                                  "python3 tools/write_f32_gguf.py MOE.gguf MOE.F32.gguf"],
                      "f32_file": os.path.basename(path), "f32_size": os.path.getsize(path),
                      "f32_sha256": sha256(path)}

    # how each file's logits stand against llama.cpp's dense F32 run (llama_f32_logits.npz)
    against_dense = {}
    for key in MOE_FILES:
        n = agree = 0
        md = full_md = 0.0
        for i, r in enumerate(results[key]):
            d = dict(ids=dense[f"ids_{i}"], topk_ids=dense[f"topk_ids_{i}"], topk_logits=dense[f"topk_logits_{i}"])
            m, a = overlap_diff(r, d)
            md, agree, n = max(md, m), agree + a, n + len(r["ids"])
            rows = [list(dense[f"full_pos_{i}"]).index(p) for p in r["full_pos"]]
            full_md = max(full_md, float(np.abs(r["full_logits"] - dense[f"full_logits_{i}"][rows]).max()))
        against_dense[key] = {"top1_agreement": f"{agree}/{n}",
                              "max_abs_diff_topk_overlap": float(f"{md:.3g}"),
                              "max_abs_diff_full_rows": float(f"{full_md:.3g}")}
    print("against llama.cpp's dense F32 run:", json.dumps(against_dense), flush=True)

    meta = {
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "python": sys.version.split()[0], "numpy": np.__version__, "platform": platform.platform(),
        "source_model": "the default model (SmolLM2-135M-Instruct Q4_1), the sha256 in llama_reference_meta.json",
        "files": files,
        "llama_params": {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_threads": N_THREADS, "logits_all": True,
                         "flash_attn": False, "kv_cache": "type_k=type_v=GGML_TYPE_F32 (0)"},
        "texts": "the three texts of llama_f32_logits.npz, same ids; full rows at (0, n//3, n-1)",
        "against_llama_cpp_dense_f32": against_dense,
        "generated_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "script_runtime_s": round(time.time() - t_start, 1),
    }
    (FIXTURES / MOE_META).write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"done in {meta['script_runtime_s']} s", flush=True)
    return 0


def k_quant_fixtures(source: str, t_start: float) -> int:
    """The --k-quants mode: llama_k_quants_logits.npz and llama_k_quants_meta.json."""
    import gguf

    sys.path.insert(0, str(REPO / "tests"))
    from k_quant_files import FTYPES, LOGITS, META, k_quant_file

    if META.exists():
        META.unlink()  # the files are made anew and their sha256 recorded
    dense = np.load(FIXTURES / "llama_f32_logits.npz")
    arrs, files = {}, {}
    for kind in FTYPES:
        path = k_quant_file(kind, source)
        llm = make_llm(str(path), f32_kv=False)
        n = agree = 0
        md = 0.0
        for i in range(3):
            ids = dense[f"ids_{i}"].tolist()
            r = teacher_forced(llm, ids)
            arrs[f"{kind}_topk_ids_{i}"], arrs[f"{kind}_topk_logits_{i}"] = r["topk_ids"], r["topk_logits"]
            d = dict(ids=dense[f"ids_{i}"], topk_ids=dense[f"topk_ids_{i}"], topk_logits=dense[f"topk_logits_{i}"])
            m, a = overlap_diff(r, d)
            md, agree, n = max(md, m), agree + a, n + len(ids)
        del llm
        types: dict[str, int] = {}
        for t in gguf.GGUFReader(str(path)).tensors:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        files[kind] = {"file": path.name, "size": path.stat().st_size, "sha256": sha256(str(path)),
                       "llama_ftype": FTYPES[kind], "tensor_types": dict(sorted(types.items())),
                       "against_llama_cpp_f32": {"top1_agreement": f"{agree}/{n}",
                                                 "max_abs_diff_topk_overlap": float(f"{md:.3g}")}}
        print(f"[{kind}] {json.dumps(files[kind])}", flush=True)
    np.savez_compressed(LOGITS, **arrs)
    meta = {
        "llama_cpp_python_version": llama_cpp.__version__,
        "python": sys.version.split()[0], "numpy": np.__version__, "platform": platform.platform(),
        "source_model": "the default model (SmolLM2-135M-Instruct Q4_1), the sha256 in llama_reference_meta.json",
        "made_by": "tests/k_quant_files.py: llama_model_quantize(Q4_1 file, out, ftype, allow_requantize)",
        "files": files,
        "llama_params": {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_threads": N_THREADS, "logits_all": True,
                         "flash_attn": False, "kv_cache": "default (f16)"},
        "texts": "the three texts of llama_f32_logits.npz, same ids; top-32 rows",
        "script_runtime_s": round(time.time() - t_start, 1),
    }
    META.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


GEMMA3_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                  "The three primary colors are", "Water boils at", "The largest planet in our solar system is",
                  "import numpy as np\n", "My favourite season is autumn because"]


def greedy_ids(llm: Llama, ids: list[int], n: int = 24) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if nxt == llm.token_eos():
            break
        out.append(nxt)
        llm.eval([nxt])
    return out


def gemma3_fixtures(path: str, f32_path: str, t_start: float) -> int:
    """The --gemma3 mode: llama_gemma3_logits.npz and llama_gemma3_meta.json."""
    f32 = make_llm(f32_path, f32_kv=True)
    llm = make_llm(path, f32_kv=True)
    bos = llm.token_bos()
    doc = DOC_PATH.read_text(encoding="utf-8")
    texts = GEMMA3_PROMPTS + [doc[:3000]]  # about 640 tokens: past the 512-cell window
    arrs, greedy_out = {}, []
    for i, text in enumerate(texts):
        ids = [bos] + tok(llm, text)
        r = teacher_forced(llm, ids)
        arrs |= {f"text_{i}": np.array(text), f"ids_{i}": r["ids"], f"topk_ids_{i}": r["topk_ids"],
                 f"topk_logits_{i}": r["topk_logits"]}
        print(f"[gemma3] text {i}: {len(ids)} tokens", flush=True)
        if i < len(GEMMA3_PROMPTS):
            out = greedy_ids(llm, ids)
            greedy_out.append({"prompt": text, "ids": out, "f32_agrees": greedy_ids(f32, ids) == out,
                               "text": llm.detokenize(out).decode("utf-8", errors="replace")})
    np.savez_compressed(FIXTURES / "llama_gemma3_logits.npz", **arrs)
    meta = {
        "llama_cpp_python_version": llama_cpp.__version__, "numpy": np.__version__,
        "platform": platform.platform(), "file": Path(path).name, "sha256": sha256(path),
        "llama_params": {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_threads": N_THREADS, "logits_all": True,
                         "flash_attn": False, "kv_cache": "f32"},
        "texts": f"{len(GEMMA3_PROMPTS)} raw prompts and the default document's first 3,000 characters, "
                 "each after BOS; top-32 rows",
        "greedy": greedy_out,
        "script_runtime_s": round(time.time() - t_start, 1),
    }
    (FIXTURES / "llama_gemma3_meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--q4", default=DEFAULT_Q4)
    ap.add_argument("--f32", default=DEFAULT_F32)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--moe", action="store_true", help="write only the MoE fixtures")
    ap.add_argument("--k-quants", action="store_true", help="write only the K-quant fixtures")
    ap.add_argument("--gemma3", metavar="PATH", help="write only the Gemma 3 fixtures, from this file")
    ap.add_argument("--gemma3-f32", metavar="PATH", default="/tmp/gemma3-270m.F32.gguf",
                    help="its all-F32 copy (tools/write_f32_gguf.py)")
    for key, spec in MOE_FILES.items():
        ap.add_argument(f"--moe-{key}", default=spec["f32"], help=f"F32 copy of the {key} MoE file")
    args = ap.parse_args()
    FIXTURES.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if args.k_quants:
        return k_quant_fixtures(args.q4, t_start)
    if args.gemma3:
        return gemma3_fixtures(args.gemma3, args.gemma3_f32, t_start)
    if args.moe:
        return moe_fixtures({key: getattr(args, f"moe_{key}") for key in MOE_FILES}, t_start)

    # ---------------- tokenizer + teacher-forced + greedy on Q4_1 --------
    models = {"q4_1": (args.q4, False), "f32": (args.f32, True)}
    results: dict[str, dict] = {}
    greedy_out: dict[str, list] = {}
    texts = None
    token_cases = None
    for key, (path, f32_kv) in models.items():
        llm = make_llm(path, f32_kv=f32_kv)
        if token_cases is None:
            token_cases = [{"text": s, "ids": tok(llm, s)} for s in TOKEN_CASES]
            texts = [doc_prefix(llm), CODE_TEXT, CHAT_TEXT]
        else:  # both files share the tokenizer: check it
            for c in token_cases:
                assert tok(llm, c["text"]) == c["ids"], c["text"]
        results[key] = {}
        for i, t in enumerate(texts):
            results[key][i] = teacher_forced(llm, tok(llm, t))
            print(f"[{key}] text {i}: {len(results[key][i]['ids'])} tokens", flush=True)
        greedy_out[key] = []
        for q in GREEDY_PROMPTS:
            p = chatml_prompt(q)
            pids = tok(llm, p)
            g = greedy(llm, pids)
            greedy_out[key].append({"user": q, "prompt": p, "prompt_ids": pids, **g})
            print(f"[{key}] greedy {q!r} -> {g['text']!r}", flush=True)
        del llm

    # ---------------- write tokens -------------------------------------
    with open(FIXTURES / "llama_tokens.json", "w", encoding="utf-8") as f:
        json.dump({"llama_cpp_python_version": llama_cpp.__version__,
                   "call": "llm.tokenize(text.encode('utf-8'), add_bos=False, special=True)",
                   "cases": token_cases}, f, ensure_ascii=False, indent=1)

    # ---------------- write logits -------------------------------------
    for key, fname in (("f32", "llama_f32_logits.npz"), ("q4_1", "llama_q4_1_logits.npz")):
        arrs = {}
        for i, t in enumerate(texts):
            r = results[key][i]
            arrs[f"text_{i}"] = np.array(t)
            for k in ("ids", "topk_ids", "topk_logits", "full_pos", "full_logits"):
                arrs[f"{k}_{i}"] = r[k]
        np.savez_compressed(FIXTURES / fname, **arrs)

    # ---------------- greedy --------------------------------------------
    with open(FIXTURES / "llama_greedy.json", "w", encoding="utf-8") as f:
        json.dump({"llama_cpp_python_version": llama_cpp.__version__,
                   "max_new_tokens": GREEDY_MAX_NEW, "stop_ids": list(STOP_IDS),
                   "method": "argmax of llama.cpp logits after each llm.eval (== temperature 0, "
                             "top_k=1); ids exclude the stop token; text = detokenize(ids, special=False)",
                   "f32": {"model_file": os.path.basename(args.f32), "kv_cache": "f32",
                           "completions": greedy_out["f32"]},
                   "q4_1": {"model_file": os.path.basename(args.q4), "kv_cache": "f16",
                            "completions": greedy_out["q4_1"]}},
                  f, ensure_ascii=False, indent=1)

    # ---------------- sanity: F32 vs Q4_1 --------------------------------
    agree = total = 0
    max_diff = 0.0
    per_text = []
    for i in range(len(texts)):
        a, b = results["f32"][i], results["q4_1"][i]
        assert np.array_equal(a["ids"], b["ids"])
        ag = int((a["topk_ids"][:, 0] == b["topk_ids"][:, 0]).sum())
        n = len(a["ids"])
        md = 0.0
        for p in range(n):
            common, ia, ib = np.intersect1d(a["topk_ids"][p], b["topk_ids"][p],
                                            return_indices=True)
            if len(common):
                md = max(md, float(np.abs(a["topk_logits"][p][ia] - b["topk_logits"][p][ib]).max()))
        full_md = float(np.abs(a["_all"] - b["_all"]).max())

        def logsm(x):
            m = x.max(axis=1, keepdims=True)
            return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))
        lp_md = float(np.abs(logsm(a["_all"].astype(np.float64)) - logsm(b["_all"].astype(np.float64))).max())
        per_text.append({"n": n, "top1_agree": ag, "max_abs_diff_topk_overlap": round(md, 4),
                         "max_abs_diff_full": round(full_md, 4),
                         "max_abs_logprob_diff_full": round(lp_md, 4)})
        agree += ag; total += n; max_diff = max(max_diff, md)
    sanity = {"top1_agreement": f"{agree}/{total}", "top1_agreement_frac": round(agree / total, 4),
              "max_abs_logit_diff_on_overlapping_top32": round(max_diff, 4), "per_text": per_text}
    print("sanity F32 vs Q4_1:", json.dumps(sanity), flush=True)

    # ---------------- meta + speed --------------------------------------
    meta_path = FIXTURES / "llama_reference_meta.json"
    old = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if args.no_speed:
        speed = old.get("speed")
    else:
        q4 = make_llm(args.q4, f32_kv=False, logits_all=False)
        doc_ids = tok(q4, DOC_PATH.read_text(encoding="utf-8"))
        short = tok(q4, chatml_prompt(GREEDY_PROMPTS[0]))
        del q4
        speed = measure_speed(args.q4, doc_ids, short)
        print("speed:", json.dumps(speed), flush=True)

    meta = {
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "python": sys.version.split()[0], "numpy": np.__version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "models": {
            "q4_1": {"file": os.path.basename(args.q4), "size": os.path.getsize(args.q4),
                     "sha256": sha256(args.q4)},
            "f32": {"file": os.path.basename(args.f32), "size": os.path.getsize(args.f32),
                    "sha256": sha256(args.f32),
                    "made_by": "tools/write_f32_gguf.py (gguf.quants.dequantize of every tensor)"},
        },
        "llama_params": {"n_ctx": N_CTX, "n_batch": N_BATCH, "n_threads": N_THREADS,
                         "logits_all": True, "flash_attn": False,
                         "kv_cache": {"f32": "type_k=type_v=GGML_TYPE_F32 (0)",
                                      "q4_1": "default (f16)"}},
        "fixtures": {
            "llama_tokens.json": "llm.tokenize(text.encode('utf-8'), add_bos=False, special=True) "
                                 f"for {len(token_cases)} strings",
            "llama_f32_logits.npz / llama_q4_1_logits.npz": (
                "llm.reset(); llm.eval(ids); rows llm.scores[:n] (row p predicts token p+1). "
                "Texts: 0 = longest sentence-aligned prefix of default_document.txt with <= 200 "
                "tokens, 1 = Python snippet, 2 = ChatML conversation incl. assistant reply. "
                "topk = 32 ids sorted by logit desc (ties -> lower id), full rows at "
                "(0, n//3, 2n//3, n-1)."),
            "text_token_counts": [int(len(results["q4_1"][i]["ids"])) for i in range(len(texts))],
            "default_document_tokens": None,  # filled in below
            "llama_greedy.json": "argmax decoding, <= 48 new tokens, stop at 2 or 0",
        },
        "sanity_f32_vs_q4_1": sanity,
        "speed": speed,
        "generated_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "script_runtime_s": None,
    }
    # token count of the whole default document
    llm_v = Llama(model_path=args.q4, vocab_only=True, verbose=False)
    meta["fixtures"]["default_document_tokens"] = len(tok(llm_v, DOC_PATH.read_text(encoding="utf-8")))
    del llm_v
    meta["script_runtime_s"] = round(time.time() - t_start, 1)
    meta_path.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"done in {meta['script_runtime_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
