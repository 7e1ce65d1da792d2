"""The megakernel (`--kernels mega`): a decode step as one launch of one persistent kernel.

The fast tier's step is about 300 launches; each costs a launch, a ramp up and a tail
down, even replayed from a graph. Here one launch puts a thread block or more on every SM
and keeps it there for the whole step. The blocks walk the same list of work items (the
plan): every layer's norm and q|k|v with RoPE and the append, attention, the o-projection,
the FFN; then the head and the argmax. Between two items every block waits at a grid
barrier: a counter in global memory that the last block to arrive moves on.

Read in this order: plan.py (the items a step is made of, built on the host and printed
by `strata-nb info --mega-plan`), stages.py (what the blocks do for each kind of item,
through the plain tier's dequantizers, dot products, attention and KV writers),
interpreter.py (the kernel: a loop over the plan with a barrier after each item), and
step.py (the host side: the model's matrices stacked by layer, and the decode step the
engine runs).
"""
