"""The JAX side of a Placement: its device labels as `jax.Device`s, the -sm graph mesh and its
PartitionSpecs, and the loader's placer for several devices of one CPU process."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ikjax.placement.splits import MESH_AXIS


def jax_devices(placement) -> list:
    """The JAX devices the Placement's labels name, in label order (accelerators, or the CPU
    devices of a CPU-only machine; every process's under jax.distributed)."""
    devs = jax.devices()
    accel = [d for d in devs if d.platform != "cpu"]
    return (accel or devs)[:len(placement.devices)]


def mesh_for(placement):
    """The 1-D mesh of -sm graph over the devices that hold parts (the first tensor's `spread`)."""
    by_label = dict(zip(placement.devices, jax_devices(placement)))
    spread = placement.tensors[0].spread
    return Mesh(np.array([by_label[d] for d in spread]), (MESH_AXIS,))


def partition_spec(split_dim: int | None, ndim: int):
    """The PartitionSpec of an array of `ndim` dims split on `split_dim` (None: replicated)."""
    if split_dim is None or ndim == 0:
        return P()
    d = split_dim % ndim
    return P(*[MESH_AXIS if i == d else None for i in range(ndim)])


def replicated(mesh):
    return NamedSharding(mesh, P())


# bytes of tensor data this process copied out of the file for its devices (-sm graph,
# ikjax.runtime.mesh): under jax.distributed each process reads only its devices' parts
BYTES_READ = [0]


def placer(placement):
    """The loader's placer for -sm layer / -mg over several devices of a CPU-only process: each
    tensor on the device whose step reads it (host-resident ones too: on a CPU, host and device
    memory are one RAM). Next to accelerators, -sm layer goes through the single-device loader
    (each tensor to its label's device) instead; -sm graph loads through ikjax.runtime.mesh."""
    devs = jax_devices(placement)

    def place(name: str, data):
        return jax.device_put(data, devs[placement.stage_device(name)])
    return place
