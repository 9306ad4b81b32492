# A chat turn's step: 64 new tokens after a 4096-token history vs the same 64 at position 0, -mla 3,
# on the engine's own steps (issue 23's second turn). Run once per form:
#   for m in expanded absorbed; do IKJAX_SHORT_STEPS=$m python bench/cpu_short_steps.py MODEL 64; done
import os, sys, time, numpy as np, ikjax
path, T = sys.argv[1], int(sys.argv[2])
eng = ikjax.load(path, ctx=8192, ubatch=512, mla=3, fa=True)
rng = np.random.default_rng(0)
V = eng.config.vocab_size
hist = rng.integers(0, V, 4096).astype(np.int32)
turn = rng.integers(0, V, T).astype(np.int32)
def best(cache, at):
    ts = []
    for rep in range(4):
        t0 = time.perf_counter(); logits, cache = eng.prefill(cache, turn, at); np.asarray(logits); ts.append(time.perf_counter() - t0)
    return min(ts[1:]), cache
cache = eng.new_cache(1)
t0, cache = best(cache, 0)
for c0 in range(0, 4096, 512):
    _, cache = eng.prefill(cache, hist[c0:c0 + 512], c0)
t1, cache = best(cache, 4096)
print(f"| {os.environ.get('IKJAX_SHORT_STEPS', 'absorbed')} | {t0*1e3:.0f} | {t1*1e3:.0f} | {t1/t0:.2f} |")
