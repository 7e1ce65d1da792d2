"""Launch geometry: every size that differs between a GPU and Numba's CUDA simulator.

The kernels are the same code on both. What differs is how many threads they launch and
how large their tiles are: the simulator runs each CUDA thread as a Python thread, wakes
them one by one at every barrier and computes every padded row of a tile, so there the
kernels launch as few threads as their logic allows. The tests run the simulator's
sizes; a GPU runs these on the right. `SIMULATED` also picks the simulator's twins of the
warp-shuffle device functions (gpu/reduce.py), which the simulator does not have.

Kernel files import their sizes from here, so this table is the whole difference.
"""
import functools

from numba import config

SIMULATED: bool = config.ENABLE_CUDASIM


def on_gpu(gpu, simulator):
    """`gpu` on a real device, `simulator` under NUMBA_ENABLE_CUDASIM=1."""
    return simulator if SIMULATED else gpu


SIMULATED_SMS = 2  # the simulator's SMs, for a kernel choice that counts them


@functools.cache
def multiprocessors() -> int:
    """The GPU's SMs (132 on an H100 or H200), read once; SIMULATED_SMS under the simulator."""
    if SIMULATED:
        return SIMULATED_SMS
    from numba import cuda

    return cuda.get_current_device().MULTIPROCESSOR_COUNT


# ---- dense: kernels/dense/ -------------------------------------------------------------
# matvec: warps per thread block and thread blocks per launch; rows are grid-strided
MATVEC_MAX_WARPS = on_gpu(8, simulator=1)
MATVEC_MAX_BLOCKS = on_gpu(16 * 132, simulator=1)
MATMUL_TILE = on_gpu(64, simulator=16)  # the plain matmul: rows of W and rows of x per thread block
MATMUL_SIDE = on_gpu(16, simulator=8)  # the plain matmul's block is SIDE x SIDE threads
MATMUL_W_THREADS = on_gpu(32, simulator=2)  # the fast matmul's threads along W's rows (4 rows each)
MATMUL_X_THREADS = on_gpu(8, simulator=2)  # and along x's rows (8 rows each)
MATMUL_MMA_W_THREADS = on_gpu(16, simulator=8)  # the tensor-core matmul's threads (4 rows of W, 8 of x each)
MATMUL_MMA_X_THREADS = on_gpu(8, simulator=4)
MATMUL_MMA_SPLIT_BELOW = on_gpu(160, simulator=2)  # the tensor-core matmul splits `in` when its tiles are fewer
# shared tiles read 4 floats at a time: aligned to 16 bytes, or the compiler loads them one
# by one (the simulator refuses an alignment, and needs none)
VECTOR_ALIGN = on_gpu(16, simulator=None)
RMSNORM_THREADS = on_gpu(128, simulator=32)  # threads per row

# ---- experts: kernels/experts/ ---------------------------------------------------------
ROUTE_THREADS = on_gpu(256, simulator=64)  # threads of a token's router block: a warp per expert at a time
EXPERT_WARPS = on_gpu(4, simulator=1)  # rows of an expert matrix per thread block, a warp each
EXPERT_GATE_UP_WARPS = on_gpu(8, simulator=1)  # the fast expert_gate_up's warps a block, at most
EXPERT_DOWN_WARPS = on_gpu(8, simulator=1)  # the fast expert_down's warps a block, at most
FETCH_BLOCKS = on_gpu(32, simulator=2)  # thread blocks copying one missed expert of a prompt chunk
FETCH_THREADS = on_gpu(256, simulator=32)

# ---- kv: kernels/kv/ -------------------------------------------------------------------
# threads quantizing one 32-value group of the key sketch: a warp, a value a lane; one
# thread walking the group alone under the simulator, where each of a warp's trades is a
# block-wide barrier of Python threads
SKETCH_LANES = on_gpu(32, simulator=1)

# ---- attention: fast/attention_*.py (the plain kernel has a thread per head dim) ------
PROMPT_TILE_ROWS = on_gpu(48, simulator=12)  # query rows of a prompt tile
PROMPT_ROW_GROUPS = on_gpu(8, simulator=2)  # thread rows of a prompt tile
PROMPT_MMA_WARPS = on_gpu(4, simulator=1)  # warps of the tensor-core prompt kernel's block, 16 rows each
PROMPT_BLOCKS_PER_SPLIT = on_gpu(4, simulator=64)  # selected blocks per prompt thread block, at least
PROMPT_ALONE_BLOCKS_PER_SPLIT = on_gpu(16, simulator=64)  # per prompt thread block, when rows stand alone
COMBINE_GROUPS = on_gpu(16, simulator=1)  # thread rows of the combine kernel
PROMPT_ALONE_COMBINE_GROUPS = on_gpu(4, simulator=4)  # ... when rows stand alone: fixed, at most this
STEP_THREADS = on_gpu(256, simulator=32)  # threads of a decode step's attention block
MERGE_UNROLL = on_gpu(8, simulator=2)  # splits a merging thread loads before it adds them

# ---- step: kernels/step/ ----------------------------------------------------------------
ARGMAX_THREADS = on_gpu(256, simulator=64)  # threads per chunk of logits
SAMPLE_THREADS = on_gpu(1024, simulator=64)  # threads of top-p's one thread block
SELECT_ROWS_THREADS = on_gpu(256, simulator=32)  # threads of a query's selection block
SELECT_CANDIDATES = on_gpu(4, simulator=8)  # blocks a selection thread block ranks
SELECT_PARTS = on_gpu(64, simulator=4)  # threads per candidate
SELECT_SHARED_SCORES = on_gpu(4096, simulator=64)  # candidates' scores held in shared memory

# ---- the megakernel: fast/mega/ ----------------------------------------------------------
MEGA_ON_GPU = dict(threads=256, splits=64)  # (the plan's printout for the docs shows a GPU's)
MEGA_THREADS = on_gpu(MEGA_ON_GPU["threads"], simulator=128)  # threads of each thread block (8 warps)
MEGA_SPLITS = on_gpu(MEGA_ON_GPU["splits"], simulator=2)  # at most, shares of a KV head's cells attention folds apart
SM_REGISTERS = 65536  # 32-bit registers of an SM (every GPU since Maxwell); a thread uses at most 255
# what the megakernel is compiled with: a thread block of MEGA_THREADS must fit one SM's registers
MEGA_JIT = on_gpu(dict(max_registers=min(255, SM_REGISTERS // MEGA_THREADS)), simulator={})
