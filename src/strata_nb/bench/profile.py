"""Where a decode step's time goes: each kernel's GPU time, against the step's wall time
with graph replay, one step at a time and with the next step queued while the host reads
the pick (DeviceStep.run_ahead, what generate and the bench do), and without graph replay
(every kernel launched from Python).

Kernel times come from CUPTI through `torch.profiler`, which records every kernel the
process runs, Numba's included; so this needs torch. Without it the breakdown is skipped.
"""
from __future__ import annotations

import time
from collections import defaultdict

from ..engine.decode_step import DeviceStep

STEPS = 20


def kernel_name(event_name: str) -> str:
    """'strata_nb::kernels::dense::matvec::make_matvec_kernel::_3clocals...::matvec_kernel[abi...'
    -> 'matvec_kernel'."""
    parts = [p for p in event_name.split("[")[0].split("::") if p and not p.startswith("_3c")]
    return parts[-1] if parts else event_name


def kernel_times(run, steps: int) -> dict:
    """{kernel: (launches per step, GPU us per step)} over `steps` calls of run()."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
    total = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA" and "strata_nb" in e.name:
            t = total[kernel_name(e.name)]
            t[0] += 1
            t[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return {k: (n / steps, us / steps) for k, (n, us) in total.items()}


def wall_us(run, steps: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    sync()
    return (time.perf_counter() - t0) / steps * 1e6


def ahead_wall_us(s: DeviceStep, steps: int, sync) -> float:
    """Wall time per step of `steps` steps run ahead: no host wait between them."""
    sync()
    t0 = time.perf_counter()
    for _ in s.run_ahead(*s.next_input, steps):
        pass
    sync()
    return (time.perf_counter() - t0) / steps * 1e6


# --8<-- [start:profile_step]
def profile_decode(eng, prompt: list[int]) -> dict:
    """One configuration's decode step: kernels (graph replay), wall time with and without."""
    logits = eng.prefill(prompt)
    pos, token = len(prompt), int(logits.argmax())
    graph = DeviceStep(eng.be, eng.weights, eng.kv, use_graph=True)
    eager = DeviceStep(eng.be, eng.weights, eng.kv, use_graph=False)
    for s in (graph, eager):  # compile, capture
        s.run(token, pos)
        s.run(token, pos)

    # Every measurement decodes the same STEPS positions from here: a step's time depends
    # on its position (attention near an empty context skips its merge below 64 cells).
    start = graph.next_input

    def step(s):  # each call decodes the token the last one picked, at the next position
        s.seek(*start)
        return lambda: s.run(*s.next_input)

    def ahead(s):
        s.seek(*start)
        return ahead_wall_us(s, STEPS, eng.be.synchronize)

    kernels = kernel_times(step(graph), STEPS)
    chunk = prompt[-min(len(prompt), eng.settings.prefill_chunk):]
    prefill = kernel_times(lambda: eng._forward(chunk, len(prompt) - len(chunk), True, False), 1)
    return {"kernels": kernels, "gpu_us": sum(us for _, us in kernels.values()),
            "graph_wall_us": wall_us(step(graph), STEPS, eng.be.synchronize),
            "ahead_wall_us": ahead(graph),
            "eager_wall_us": wall_us(step(eager), STEPS, eng.be.synchronize),
            "launches": sum(n for n, _ in kernels.values()),
            "prefill_chunk": len(chunk), "prefill_kernels": prefill,
            "prefill_gpu_us": sum(us for _, us in prefill.values())}
# --8<-- [end:profile_step]
