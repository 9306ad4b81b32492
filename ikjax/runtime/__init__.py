"""Runtime: the engine that loads a model and runs its compiled steps.

`engine` (Engine, load: the facade), `executors` (how a step runs on the placement's devices: one
device, `pipeline` for -sm layer, `mesh` for -sm graph), `executables` (compiled steps, their cache
and their charge to the memory plan; `compile_cache` stores them across runs), `memory_plan`,
`generation` (decode loop, generate / generate_batch scheduling), `sampling`, `buckets` (batch and
KV-length buckets); `distributed` (several hosts).
"""
