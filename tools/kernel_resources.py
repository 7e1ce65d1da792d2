"""What each kernel of a decode step and a prompt chunk costs an SM of the H200, without a
GPU: registers per thread, static shared memory per thread block, spilled bytes, how
many warps the register file lets an SM keep (of 64), and the longest run of loads in
its SASS (with nvdisasm: loads with no use of a loaded value between them,
sm90.load_runs). fast/sm90.py explains the
numbers; this runs a tiny random-weight model under the simulator to record the
launches (prefill and a decode step, resident and streamed with QSA, the resident step
also past its narrow list, so both builds of the step attention run; a prefill with the
prompt kernels on tensor cores, as on a GPU), then compiles each for sm_90 and
asks ptxas. The tiny model has 2 query heads per KV head where the default
model has 3: the step attention is compiled per group size, the rest is the same code.

    python tools/kernel_resources.py            # fp16 and k8v4, resident and streamed QSA
    python tools/kernel_resources.py k8v4

Needs ptxas (the nvidia-cuda-nvcc-cu12 wheel of the dev extra, or a CUDA toolkit).
"""
import os
import sys
import tempfile

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba is imported: record the launches
sys.setswitchinterval(1e-4)

from strata_nb.fast.sm90 import compile_recorded, nvdisasm, ptxas, record_launches, warps_by_registers  # noqa: E402


def main(formats: list[str]) -> int:
    from strata_nb.fast.backend import FastCudaBackend
    from strata_nb.engine.engine import Engine
    from strata_nb.fast import tensor_core
    from strata_nb.model.gguf_file import GGUFModel
    from strata_nb.model.synthetic import write_synthetic_gguf
    from strata_nb.kv_layout import BLOCK
    from strata_nb.settings import Settings

    binary = ptxas()
    if not binary:
        print("kernel_resources: ptxas not found (pip install nvidia-cuda-nvcc-cu12)", file=sys.stderr)
        return 1
    launches: dict = {}
    record_launches(launches)
    prompt = list(range(3, 40))
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_synthetic_gguf(tmp + "/tiny.gguf"))
        for kv in formats:
            for extra in ({}, {"kv_resident": 128, "kv_window": 64, "qsa_budget": 128}):  # resident, streamed QSA
                eng = Engine(Settings(model=model, kv=kv, max_context=512, device="cuda", **extra),
                             GGUFModel(model), FastCudaBackend())
                token = int(eng.prefill(prompt).argmax())
                step = eng.device_step()
                step.run(token, len(prompt))
                if eng.kv.step.narrow:  # a resident step past the narrow list: the other build
                    step.run(token, eng.kv.step.narrow * BLOCK)
            tensor_core._ON = True  # the prompt chunk's matmuls and attention on tensor cores
            Engine(Settings(model=model, kv=kv, max_context=512, device="cuda"), GGUFModel(model),
                   FastCudaBackend()).prefill(prompt)
            tensor_core._ON = False
    failures, rows = compile_recorded(launches, binary, disassembler=nvdisasm())
    for f in failures:
        print("not compiled:", f, file=sys.stderr)
    print("| kernel (made from) | registers | warps/SM by registers | shared bytes | spilled bytes | stack bytes "
          "| 64-bit divides | longest run of loads |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    lines = []
    for r in sorted(rows, key=lambda r: (-r["registers"], r["kernel"], r["made_from"])):
        made_from = ", ".join(v.split("=", 1)[1] for v in r["made_from"].split(",") if v)
        line = (f"| `{r['kernel']}`{' (' + made_from + ')' if made_from else ''} | {r['registers']} | "
                f"{warps_by_registers(r['registers'])} | {r['shared']:,} | {r['spill_stores'] + r['spill_loads']} | "
                f"{r['stack']} | {r['divides']} | {r.get('load_run', '')} |")
        if line not in lines:  # one row per kernel: its launches' argument layouts compile alike
            lines.append(line)
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["fp16", "k8v4"]))
