"""Dependent launches (Hopper's programmatic dependent launch): a kernel starts while the
kernel before it in the stream is still running, and waits inside itself for that
kernel's results.

A decode step of the default model is a long chain of small kernels, several a layer,
each waiting for the one before. Between two of them the GPU drains the first (its last
thread blocks finish, its writes are flushed), then launches the second and places its
thread blocks: microseconds a boundary in which no weights are read. With a dependent
launch the second kernel is launched and its blocks placed while the first still runs;
they stop at their first instruction until the first is done, so the gap shrinks to the
wait itself.

Two instructions make it (PTX `griddepcontrol`, compute capability 9.0 and up):

    wait_for_inputs()   blocks until every kernel this one depends on has finished and
                        its writes are visible. A kernel launched as dependent calls it
                        before it reads or writes any memory another kernel touches.
    let_next_start()    tells the GPU that the next kernel in the stream may be launched
                        now, once every thread block of this one has said so (or ended).

The rule every dependent kernel here keeps: it calls `wait_for_inputs()` first, and
`let_next_start()` only after it. So when the next kernel's blocks start, every kernel
before this one has finished and this one is running; that next kernel waits for it at
its own first instruction. Nothing is written early, nothing is read early but what
"Reading before the wait" (below) allows, and the results are the same bits as with
plain launches. Most kernels let the next one start at once. The step attention lets it
start only when a split has written its record:
its blocks fill the GPU, and a next kernel launched at their start would have its blocks
placed among them, waiting, which measured slower.

Two kernels end in one thread block's chain of work, and let nothing start early. The
router (kernels/experts/route.py, one block a token) waits for its inputs but lets
expert_gate_up launch only when it ends. select_blocks (fast/select_blocks.py,
whose last block writes the list) is not marked at all: it starts when block_scores has
ended, and the step attention starts when it has. Either way, early, measured slower
(docs/gpu/fast.md, "Kernels that end in one thread block").

Reading before the wait. When a dependent kernel's blocks start, the kernel before it has
passed its own wait, so every kernel before *that* one has finished and its writes are
visible. A kernel may therefore read, before it waits, what only those earlier kernels
write, and what no kernel of the step writes at all (the weights): only the outputs of
the kernel just before it need the wait. expert_down (kernels/experts/expert_down.py) is
the one kernel marked so (`waits_for_inputs(kernel, reads_early=True)`): it loads the
router's choice (the experts, their slots and weights) and the first of its down-matrix
rows while expert_gate_up still runs, and waits only before it reads expert_gate_up's
h. It stores nothing before the wait, as the PTX check (fast/sm90.py: dependent_order)
holds it to.

Which launches are dependent: a kernel marked with `waits_for_inputs(kernel)` (its
factory marks it; its code keeps the rule), launched through the fast path
(fast/fast_launch.py) while `enabled()`, on a device of compute capability 9.0 or more. A
graph captured from such launches keeps them as programmatic edges, so a replayed step
overlaps its launches too. Every other launch stays plain, and a plain launch after a
dependent one waits for it whole. On an older GPU the instructions compile to nothing
(NVVM's `__nvvm_reflect("__CUDA_ARCH")`); under the simulator they are Python no-ops,
since it runs one launch after another anyway.

It is on wherever the GPU and cuda.core have it; `dependent_launches(False)` turns it
off within a process, for an A/B whose two sides give the same bits.
"""
from __future__ import annotations

from contextlib import contextmanager

from strata_nb.gpu.geometry import SIMULATED

_ON = True


def enabled() -> bool:
    """Whether marked kernels launch as dependent (on a GPU that has it)."""
    return _ON


@contextmanager
def dependent_launches(on: bool):
    """Within it, marked kernels launch as dependent (on) or plain: the GPU test's A/B in
    one process. Graphs keep what they were captured with."""
    global _ON
    before, _ON = _ON, on
    try:
        yield
    finally:
        _ON = before


def waits_for_inputs(kernel, reads_early: bool = False):
    """Mark a @cuda.jit kernel whose code calls wait_for_inputs() before it reads or writes
    memory another kernel touches: the fast path may launch it as dependent. reads_early:
    it reads, before it waits, memory that only kernels before the one before it write
    ("Reading before the wait"), and writes nothing before it waits."""
    kernel._strata_waits = True
    kernel._strata_reads_early = reads_early
    return kernel


def is_dependent(kernel) -> bool:
    return _ON and getattr(kernel, "_strata_waits", False)


if SIMULATED:
    def wait_for_inputs():
        """The simulator runs one launch after another: nothing to wait for."""

    def let_next_start():
        """The simulator runs one launch after another: nothing to let start."""

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _ARCH = "__CUDA_ARCH"

    def _on_sm90(builder, ptx: str):
        """`if (__nvvm_reflect("__CUDA_ARCH") >= 900) asm volatile(ptx ::: "memory")`:
        NVVM replaces the reflect call with the target's architecture and drops the branch
        it cannot take, so older GPUs get no instruction they lack."""
        module = builder.module
        char_p = ir.IntType(8).as_pointer()
        reflect = module.globals.get("__nvvm_reflect")
        if reflect is None:
            reflect = ir.Function(module, ir.FunctionType(ir.IntType(32), [char_p]), "__nvvm_reflect")
        name = module.globals.get("__strata_cuda_arch")
        if name is None:
            text = bytearray(_ARCH.encode()) + b"\x00"
            kind = ir.ArrayType(ir.IntType(8), len(text))
            name = ir.GlobalVariable(module, kind, "__strata_cuda_arch", addrspace=4)  # constant memory
            name.global_constant, name.linkage, name.initializer = True, "internal", ir.Constant(kind, text)
        zero = ir.Constant(ir.IntType(32), 0)
        arch = builder.call(reflect, [builder.addrspacecast(builder.gep(name, [zero, zero]), char_p)])
        with builder.if_then(builder.icmp_signed(">=", arch, ir.Constant(ir.IntType(32), 900))):
            builder.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), ptx, "~{memory}", side_effect=True), [])

    # --8<-- [start:dependent_instructions]
    def _emits(ptx: str):
        """An intrinsic's code generation: the one instruction, on sm_90 and up."""
        def codegen(context, builder, signature, args):
            _on_sm90(builder, ptx)
            return context.get_dummy_value()
        return codegen

    @intrinsic
    def wait_for_inputs(typingctx):
        """griddepcontrol.wait: until the kernels this one depends on have finished."""
        return types.void(), _emits("griddepcontrol.wait;")

    @intrinsic
    def let_next_start(typingctx):
        """griddepcontrol.launch_dependents: the next kernel may be launched."""
        return types.void(), _emits("griddepcontrol.launch_dependents;")
    # --8<-- [end:dependent_instructions]
