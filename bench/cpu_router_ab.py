"""Issue 26: the CPU decode's router in the C++ kernels (01edb33) against the form before it, in one
process each (RESULTS §26t). `old` restores the float32 router as loaded and XLA's reduction by two
monkeypatches; `new` is the code as it is. A 512-token prompt step, then 6 decode calls of 32 tokens
at N_KV 512 at -t 2; prints the best and the median time a token. Alternate the two, several runs:

    for r in 1 2 3; do for v in old new; do IKJAX_CPU_ISA=avx2 python bench/cpu_router_ab.py $v FILE; done; done
"""
import sys, time
import numpy as np, jax
variant, model = sys.argv[1], sys.argv[2]
import ikjax
from ikjax.model import weights as W
from ikjax.ops import quant_matmul as Q
if variant == "old":  # the router as before: float32 as loaded, XLA's reduction in decode
    init = W.TensorLoader.__init__
    def patched(self, *a, **k):
        init(self, *a, **k); self._f32_bytes = False
    W.TensorLoader.__init__ = patched
    Q._router_cpu_supported = lambda *a: False
eng = ikjax.load(model, mla=3, fa=True, ctx=1024, threads=2, threads_batch=2)
cache = eng.new_cache(1)
rng = np.random.default_rng(0)
out, cache = eng.step(cache, rng.integers(0, eng.config.vocab_size, (1, 512)), np.array([0]))
ts = []
for r in range(6):
    t = time.perf_counter()
    out, cache = eng.decode(cache, rng.integers(0, eng.config.vocab_size, (1,)), [512], 32)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) / 32)
print(f"{variant}: {min(ts)*1e3:.2f} ms/token min, {np.median(ts)*1e3:.2f} median")
