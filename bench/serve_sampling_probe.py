"""What a new sampling value costs a client of `ikjax serve`: one stream's /completion of 20 tokens
for new temperatures, top_k in one bucket and in a new one, top_p / min_p (RESULTS §23p). A value
that compiled a decode loop shows as seconds; one passed as a step argument as the step's time.

    python bench/serve_sampling_probe.py MODEL.gguf      (starts and stops its own server)
"""
import http.client
import json
import subprocess
import sys
import threading
import time

model = sys.argv[1]
cmd = [sys.executable, "-m", "ikjax.cli", "serve", "-m", model, "--port", "0", "-np", "4", "-c", "2048"]
p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
url = None
for line in p.stderr:
    if line.startswith("listening on "):
        url = line.split()[-1]
        break
threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
host, port = url.removeprefix("http://").rsplit(":", 1)
def req(**kw):
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    t = time.perf_counter()
    c.request("POST", "/completion", json.dumps({"prompt": "alpha beta", "n_predict": 20, "seed": 1, **kw}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    json.loads(r.read())
    c.close()
    return time.perf_counter() - t, r.status
req(temperature=0.8)  # the defaults' path, warm
for kw in (dict(temperature=0.51), dict(temperature=0.52), dict(temperature=0.53), dict(temperature=0.51),
           dict(temperature=0.7, top_k=17), dict(temperature=0.7, top_k=33), dict(temperature=0.7, top_k=300),
           dict(temperature=0.7, top_k=301), dict(temperature=0.9, top_p=0.5, min_p=0.2)):
    dt, st = req(**kw)
    print(f"{kw}: {dt:.3f} s (status {st})", flush=True)
p.terminate()
p.wait(30)
