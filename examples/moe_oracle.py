"""The exact oracle of the expert path, then a router at work, on a tiny random-weight model.

A dense 2-layer model is written, then `moefy` splits its FFN into 4 experts. With all 4
used (K = E) and a zero router, every expert weighs 1/4 and its down projection is scaled
by 4, so the MoE model is the dense model with its sums in another order: its logits
match to float32 rounding, and greedy decoding gives the same tokens. Then a random router
sends each token to 2 of the 4 experts, and the script prints which ones, layer by layer.
No model download is needed; the numpy backend runs both.

    python examples/moe_oracle.py
"""
import shutil
import tempfile
from pathlib import Path

import numpy as np

from strata_nb import Engine
from strata_nb.kernels.experts.moe import moe_route_ref
from strata_nb.model.moefy import moefy
from strata_nb.model.synthetic import write_synthetic_gguf

PROMPT = "expert"


def load(path):
    return Engine.load(model=str(path), device="cpu", max_context=64)


def greedy(eng, ids, n):  # n greedy tokens after ids
    token, out = int(np.argmax(eng.prefill(ids))), []
    for pos in range(len(ids), len(ids) + n):
        out.append(token)
        token = int(np.argmax(eng.decode_one_token(token, pos)))
    return out


folder = Path(tempfile.mkdtemp())
dense_path = write_synthetic_gguf(folder / "dense.gguf", d_ff=256, seed=3)  # 256 / 4 = 64 columns an expert
split_path = moefy(dense_path, folder / "split-e4k4.gguf", "split", experts=4)  # K = E, zero router

dense, split = load(dense_path), load(split_path)
ids = dense.tokenize(PROMPT)
print(f"dense: FFN width {dense.config.d_ff}; split: {split.config.n_expert} experts of width "
      f"{split.config.d_ff}, {split.config.n_expert_used} used")
want, got = dense.score(ids), split.score(ids)
print(f"largest logit difference over {len(ids)} tokens: {np.abs(got - want).max():.2e} "
      f"(largest logit {np.abs(want).max():.2f})")
print(f"16 greedy tokens agree: {greedy(split, ids, 16) == greedy(dense, ids, 16)}")

# K = 2 of 4 with a random router (seeded): not the dense model any more
routed = load(moefy(dense_path, folder / "split-e4k2.gguf", "split", experts=4, used=2, seed=0))
print(f"\nK = 2 of 4, random router: largest logit difference from the dense model "
      f"{np.abs(routed.score(ids) - want).max():.2f}")
print("(each token reads 2 of the 4 slices, weighted by an untrained router: another model)")

# what each layer's router chooses, noted as the forward pass runs through the backend's op
be, chosen = routed.be, []  # chosen: one (T, K) array of expert ids per MoE layer, in layer order
ffn_add = be.moe_ffn_add_


def moe_ffn_add_(x, norm, eps, router, experts, layer, ahead=None, last=None):  # the backend's op, routing noted
    chosen.append(moe_route_ref(be.rmsnorm(x, norm, eps), router, experts.k)[0])
    return ffn_add(x, norm, eps, router, experts, layer, ahead=ahead, last=last)


be.moe_ffn_add_ = moe_ffn_add_
routed.prefill(ids)
print(f"\nthe experts each token took, {routed.config.n_expert_used} of {routed.config.n_expert} "
      "(most probable first):")
for t, token in enumerate(ids):
    layers = "  ".join(f"layer {layer}: {chosen[layer][t].tolist()}" for layer in range(len(chosen)))
    print(f"  {routed.tokenizer.decode([token])!r:6} {layers}")
shutil.rmtree(folder)
