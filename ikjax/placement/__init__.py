"""Placement: where every tensor lives and where every op runs, decided once at load.

`rules` (the Placement: -ot, -ngl, --cpu-moe, devices), `splits` (-sm layer / -sm graph / -ts rules),
`devices` (the Placement as JAX devices, meshes and shardings), `host` (arrays kept in host memory
next to an accelerator, and the page handling of memory-mapped weights).
"""
