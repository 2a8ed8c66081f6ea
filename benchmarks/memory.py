"""Where parameters and optimizer state live between steps, by strategy.

Trains the same MLP (64-512-512-10, Adam, so the optimizer state is twice the parameters)
for a few steps with `OneDeviceStrategy`, `MirroredStrategy` (8 replicas),
`CentralStorageStrategy` (8 compute devices), `FSDPStrategy` (8 replicas; and with
``offload_optimizer=True``) and
`ModelParallelStrategy` (a 2x4 ``batch`` x ``model`` mesh, the first two kernels split
Megatron-style over ``model``), then reads, from the live arrays of the train state, how
many bytes sit in device memory and in host memory: every shard's
``shard.data.sharding.memory_kind`` and ``shard.data.nbytes``. "Copies" divides by the
bytes of one copy of the state. "Per device" is the most bytes on any one device, as a
ratio to one copy (OneDevice's footprint). The last column sums every other live array in
device memory (the batch, metrics; any leftover copy of the parameters would show there).

Expected: OneDevice keeps one copy in device memory, Mirrored eight (1.0x per device),
CentralStorage none in device memory and one in host memory, FSDP one copy in all (about
1/8 per device: the small biases stay replicated), ModelParallel two (one per replica),
each split four ways where the layout splits it. FSDP with optimizer offload keeps the
same one copy, Adam's moments (two thirds of it) in host memory: a third of FSDP's per
device in device memory.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jstrategy
from jstrategy import training
from jstrategy._src import dispatch
from jstrategy._src.input.placement import distribute_batch

FEATURES, CLASSES, BATCH = 64, 10, 64
HOST_KINDS = ("pinned_host", "unpinned_host")


def megatron_2x4() -> jstrategy.Strategy:
    """The MLP's first kernel split on its output, the second on its input, over "model"."""
    layout_map = jstrategy.experimental.LayoutMap(
        jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    )
    layout_map["Dense_0/kernel"] = (None, "model")
    layout_map["Dense_0/bias"] = ("model",)
    layout_map["Dense_1/kernel"] = ("model", None)
    return jstrategy.experimental.ModelParallelStrategy(layout_map)


STRATEGIES: dict[str, Callable[[], jstrategy.Strategy]] = {
    "OneDevice": lambda: jstrategy.OneDeviceStrategy("cpu:0"),
    "Mirrored (8)": lambda: jstrategy.MirroredStrategy(),
    "CentralStorage (8)": lambda: jstrategy.CentralStorageStrategy(),
    "FSDP (8)": lambda: jstrategy.experimental.FSDPStrategy(),
    "FSDP (8), optimizer offload": lambda: jstrategy.experimental.FSDPStrategy(
        offload_optimizer=True
    ),
    "ModelParallel (2x4)": megatron_2x4,
}


class MLP(nn.Module):
    hidden: int = 512

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(CLASSES)(x)


@dataclasses.dataclass(frozen=True)
class Figures:
    """Bytes of parameters and optimizer state resident between steps."""

    strategy: str
    replicas: int
    one_copy: int  # the logical size of the parameters and optimizer state
    device: int  # bytes in device memory, over every shard on every device
    host: int  # bytes in host memory
    other_device: int  # every other array the run left alive: its bytes in device memory
    most_on_one_device: int  # the most bytes of the state on any one device

    @property
    def per_device(self) -> float:
        """The most bytes on one device as a ratio to one copy (OneDevice's footprint)."""
        return self.most_on_one_device / self.one_copy

    @property
    def device_copies(self) -> float:
        return self.device / self.one_copy

    @property
    def host_copies(self) -> float:
        return self.host / self.one_copy


def _buffers(arrays: list[jax.Array]) -> dict[tuple[int, int], tuple[str, int]]:
    """``{(device id, buffer address): (memory kind, bytes)}`` over the arrays' shards.

    Keyed by buffer, so a buffer seen through two array objects (an array and the
    single-device arrays of its shards, which `jax.live_arrays` also lists) counts once.
    """
    out = {}
    for x in arrays:
        for shard in x.addressable_shards:
            data = shard.data
            kind = data.sharding.memory_kind or "device"
            out[(shard.device.id, data.unsafe_buffer_pointer())] = (kind, data.nbytes)
    return out


def resident_bytes(arrays: list[jax.Array]) -> dict[str, int]:
    """Bytes held by the arrays' shards, by memory kind (``"device"``, ``"pinned_host"``)."""
    out: dict[str, int] = {}
    for kind, nbytes in _buffers(arrays).values():
        out[kind] = out.get(kind, 0) + nbytes
    return out


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def measure(
    name: str,
    make_strategy: Callable[[], jstrategy.Strategy],
    *,
    steps: int = 3,
    hidden: int = 512,
) -> Figures:
    """Trains `steps` steps under the strategy and reads where the state lives."""
    # Arrays alive before the run (another benchmark's, a test's) are not this run's: they
    # are held until the end, so no buffer of this run reuses one of their addresses.
    earlier = [a for a in jax.live_arrays() if not a.is_deleted()]
    strategy = make_strategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=BATCH).astype(np.int32)
    with strategy.scope():
        state = training.create_train_state(
            MLP(hidden), optax.adam(1e-3), jnp.ones((1, FEATURES)), rng=0
        )
        step = training.make_train_step(_loss)
    batch = distribute_batch(strategy, (x, y))
    for _ in range(steps):
        state, metrics = step(state, batch)
        dispatch.track(metrics)
    jax.block_until_ready((state, metrics))
    del batch
    gc.collect()
    arrays = [a for a in jax.tree.leaves((state.params, state.opt_state)) if a.size]
    one_copy = sum(a.nbytes for a in arrays)  # the global (logical) size
    resident = resident_bytes(arrays)
    device = resident.get("device", 0)
    host = sum(resident.get(k, 0) for k in HOST_KINDS)
    mine = _buffers(jax.tree.leaves(state))
    live = _buffers([a for a in jax.live_arrays() if not a.is_deleted()])
    skip = mine.keys() | _buffers(earlier).keys()
    other_device = sum(n for key, (kind, n) in live.items() if key not in skip and kind == "device")
    on_device: dict[int, int] = {}
    for (device_id, _), (kind, nbytes) in _buffers(arrays).items():
        if kind == "device":
            on_device[device_id] = on_device.get(device_id, 0) + nbytes
    most = max(on_device.values(), default=0)
    return Figures(name, strategy.num_replicas_in_sync, one_copy, device, host, other_device, most)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps before reading")
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's hidden width")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].platform}")
    print(
        f"MLP 64-{args.hidden}-{args.hidden}-10 with Adam: parameters and optimizer state "
        "resident between steps"
    )
    header = (
        f"{'strategy':<29}{'replicas':>9}{'one copy':>12}{'device mem':>13}{'host mem':>12}"
        f"{'copies dev':>12}{'copies host':>13}{'per device':>12}{'other dev':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, make in STRATEGIES.items():
        f = measure(name, make, steps=args.steps, hidden=args.hidden)
        print(
            f"{f.strategy:<29}{f.replicas:>9}{f.one_copy:>12,}{f.device:>13,}{f.host:>12,}"
            f"{f.device_copies:>12.2f}{f.host_copies:>13.2f}{f.per_device:>11.3f}x"
            f"{f.other_device:>11,}"
        )
        gc.collect()


if __name__ == "__main__":
    main()
