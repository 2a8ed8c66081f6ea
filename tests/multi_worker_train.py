"""A worker of the multi-worker tests: trains under MultiWorkerMirroredStrategy from TF_CONFIG.

Run by tests/test_multi_worker.py through the launcher (or directly with TF_CONFIG set). It
trains the custom-loop example's MLP and, on every worker, writes the final parameters and
losses to ``OUT/worker-<index>.npz``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--implementation", default="AUTO")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--forever", action="store_true", help="train until killed")
    parser.add_argument("--fit", action="store_true", help="train with Model.fit instead")
    parser.add_argument("--tensorboard", help="with --fit: log to this TensorBoard directory")
    parser.add_argument("--restore", help="restore this checkpoint directory instead")
    parser.add_argument(
        "--fsdp", action="store_true", help="FSDPStrategy over every worker's devices instead"
    )
    parser.add_argument(
        "--pipeline",
        nargs="?",
        const="gpipe",
        choices=["gpipe", "1f1b"],
        help="with --fit: PipelineStrategy, 2 stages (one per worker) x 4 replicas, on this "
        "schedule (default gpipe), instead",
    )
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="HybridStrategy (2 replicas, one per worker, x FSDP 2 x tensor 2) instead",
    )
    parser.add_argument(
        "--model-parallel",
        choices=sorted(MESHES),
        help="ModelParallelStrategy (a Megatron MLP's layout map) over this mesh instead",
    )
    args = parser.parse_args()

    import numpy as np

    import jstrategy

    options = jstrategy.experimental.CommunicationOptions(
        implementation=args.implementation, timeout_seconds=args.timeout
    )
    start = time.perf_counter()
    if args.pipeline:
        strategy = pipeline_strategy(args.pipeline, communication_options=options)
        processes = [[d.process_index for d in row] for row in strategy.mesh.devices]
        print(f"mesh {dict(strategy.mesh.shape)} processes {processes}", flush=True)
    elif args.fsdp:
        strategy = jstrategy.experimental.FSDPStrategy(
            min_shard_size=0, communication_options=options
        )
    elif args.hybrid:
        strategy = hybrid_strategy(communication_options=options)
        processes = np.vectorize(lambda d: d.process_index)(strategy.mesh.devices).tolist()
        print(f"mesh {dict(strategy.mesh.shape)} processes {processes}", flush=True)
    elif args.model_parallel:
        strategy = model_parallel_strategy(
            args.model_parallel, communication_options=options, checkpoint=bool(args.restore)
        )
        processes = [[d.process_index for d in row] for row in strategy.mesh.devices]
        print(f"mesh {dict(strategy.mesh.shape)} processes {processes}", flush=True)
    else:
        strategy = jstrategy.MultiWorkerMirroredStrategy(communication_options=options)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    print(
        f"worker {task['index']}: {strategy.num_replicas_in_sync} replicas over "
        f"{strategy.num_workers} workers, chief={strategy.is_chief}",
        flush=True,
    )
    import custom_training_loop

    if args.restore:
        import jax
        import numpy as np

        from jstrategy._src.values import to_host

        with jstrategy.CheckpointManager(args.restore) as manager:
            restored = manager.restore(strategy=strategy)
        leaves = jax.tree.leaves(restored)
        assert all(leaf.sharding.device_set == set(strategy.mesh.devices.flat) for leaf in leaves)
        if args.model_parallel:
            # Read into the layout map's layout: this process read (and holds) its part only.
            for name in ("w", "b"):
                leaf = restored[name]
                want = strategy.variable_sharding(leaf, (name,))
                assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)
                n = leaf.shape[0]
                rows = sorted({r for s in leaf.addressable_shards for r in range(n)[s.index[0]]})
                print(
                    f"worker {task['index']}: {name} {leaf.sharding.spec}, rows {rows} here",
                    flush=True,
                )
        elif args.fsdp:
            # Read into the split layout: this process holds (and read) its rows only.
            w = restored["w"]
            rows = sorted({r for s in w.addressable_shards for r in range(4)[s.index[0]]})
            print(f"worker {task['index']}: w {w.sharding.spec}, rows {rows} here", flush=True)
        else:
            assert all(leaf.sharding == strategy.replicated_sharding() for leaf in leaves)
        np.savez(
            Path(args.out) / f"worker-{task['index']}.npz",
            **{f"w{i}": np.asarray(leaf) for i, leaf in enumerate(to_host(leaves))},
        )
        print(f"worker {task['index']}: restored", flush=True)
        return 0
    if args.fit:
        import numpy as np

        if args.pipeline:
            weights = fit_pipelined(strategy, save=Path(args.out) / "model")
        else:
            weights = fit_model(
                strategy, tensorboard=args.tensorboard, save=Path(args.out) / "model"
            )
        np.savez(
            Path(args.out) / f"worker-{task['index']}.npz",
            **{f"w{i}": w for i, w in enumerate(weights)},
        )
        print(f"worker {task['index']}: fit done", flush=True)
        return 0
    if args.forever:
        step = 0
        while True:
            custom_training_loop.train(strategy, 5)
            step += 5
            print(f"worker {task['index']}: step {step}", flush=True)
    losses, params = custom_training_loop.train(strategy, args.steps)
    import numpy as np

    flat = {"/".join(k): v for k, v in _flatten(params)}
    np.savez(
        Path(args.out) / f"worker-{task['index']}.npz",
        losses=np.array(losses),
        seconds=time.perf_counter() - start,
        **flat,
    )
    print(f"worker {task['index']}: final loss {losses[-1]:.6f}", flush=True)
    return 0


def fit_model(strategy, tensorboard=None, save=None):
    """`Model.fit` on data every worker generates alike; returns the final weights.

    With `tensorboard`, a `jstrategy.callbacks.TensorBoard` logs to that directory (per
    batch too), which every worker is given and only the chief writes. With `save`, every
    worker then saves the model there (`model.save`) and loads it back (`load_model`).
    """
    import flax.linen as nn
    import numpy as np
    import optax

    import jstrategy

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 10)).astype(np.float32)
    y = (x[:, :1] + 0.5 * x[:, 1:2] > 0).astype(np.float32)

    def module():
        return nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(1)])

    with strategy.scope():
        model = jstrategy.Model(module(), input_shape=(10,), seed=0)
        model.compile(
            optax.sgd(0.2), jstrategy.losses.BinaryCrossentropy(from_logits=True), ["accuracy"]
        )
    # 200 rows at batch 32: the last batch of each epoch is partial (8 rows).
    callbacks = []
    if tensorboard:
        callbacks.append(jstrategy.callbacks.TensorBoard(tensorboard, update_freq="batch"))
    model.fit(x, y, batch_size=32, epochs=3, shuffle=True, verbose=0, callbacks=callbacks)
    kernel = model.state.params["layers_0"]["kernel"]
    local = sum(s.data.size for s in kernel.addressable_shards)
    print(f"kernel {kernel.sharding.spec}: this process holds {local} of {kernel.size}", flush=True)
    # The distinct pieces this process holds (one copy of each: replicas over "batch" agree).
    pieces = {str(s.index): s.data.size for s in kernel.addressable_shards}
    print(
        f"kernel pieces here: {len(pieces)} of {sum(pieces.values())} elements, "
        f"{max(pieces.values())} per device",
        flush=True,
    )
    weights = model.get_weights()
    if save is not None:
        model.save(save)
        with strategy.scope():
            loaded = jstrategy.models.load_model(
                save, module(), custom_objects={"optimizer": optax.sgd(0.2)}
            )
        for a, b in zip(loaded.get_weights(), weights, strict=True):
            np.testing.assert_array_equal(a, b)
        print("saved and loaded", flush=True)
    return weights


def pipeline_strategy(schedule="gpipe", communication_options=None):
    """``--pipeline``'s strategy: 2 stages x 4 replicas, 2 microbatches per replica. Over
    2 processes x 4 devices each process is one stage (the stage axis crosses them)."""
    import jstrategy

    return jstrategy.experimental.PipelineStrategy(
        num_stages=2,
        num_microbatches=2,
        schedule=schedule,
        communication_options=communication_options,
    )


def fit_pipelined(strategy, save=None):
    """`Model.fit` of a model whose 4 residual layers are a `Repeated` block; returns the
    final weights. Prints which layers this process holds, and with `save` saves the model
    there and loads it back (each process writing and reading its stage's layers)."""
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jstrategy

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + jnp.tanh(nn.Dense(x.shape[-1])(x))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            h = jstrategy.experimental.Repeated(Block(), num_layers=4)(nn.Dense(8)(x))
            return nn.Dense(1)(h)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 10)).astype(np.float32)
    y = (x[:, :1] + 0.5 * x[:, 1:2] > 0).astype(np.float32)
    with strategy.scope():
        model = jstrategy.Model(Net(), input_shape=(10,), seed=0)
        model.compile(optax.adam(0.01), jstrategy.losses.BinaryCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=32, epochs=2, shuffle=True, verbose=0)
    kernel = model.state.params["Repeated_0"]["stacked_layers"]["Dense_0"]["kernel"]
    layers = sorted({i for s in kernel.addressable_shards for i in range(4)[s.index[0]]})
    print(f"stacked kernel {kernel.sharding.spec}: layers {layers} here", flush=True)
    weights = model.get_weights()
    if save is not None:
        model.save(save)
        with strategy.scope():
            loaded = jstrategy.models.load_model(
                save, Net(), custom_objects={"optimizer": optax.adam(0.01)}
            )
        for a, b in zip(loaded.get_weights(), weights, strict=True):
            np.testing.assert_array_equal(a, b)
        print("saved and loaded", flush=True)
    return weights


#: The meshes of ``--model-parallel``. Over 2 processes x 4 devices the first axis crosses
#: the processes (`jax.make_mesh` keeps each process's devices together): under
#: "batch2xmodel4" each process is one replica, its four devices one slice each of every
#: split kernel; under "model2xbatch4" each process holds one half of every split kernel
#: (on each of its four replicas), and every replica spans both processes.
MESHES = {
    "batch2xmodel4": ((2, 4), ("batch", "model")),
    "model2xbatch4": ((2, 4), ("model", "batch")),
}


def model_parallel_strategy(mesh, communication_options=None, *, checkpoint=False):
    """`ModelParallelStrategy` over `MESHES[mesh]`, the layout map a Megatron MLP's.

    `fit_model`'s ``nn.Sequential``: the first kernel (and its bias) split on its output
    dimension over "model", the second kernel on its input dimension; the second bias
    replicated. With `checkpoint`, the layout map is instead that of the ``{"w", "b"}``
    state of tests/test_multi_worker.py's checkpoints: both split over "model" (a model's
    layout map must match its variables).
    """
    import jstrategy

    shape, axes = MESHES[mesh]
    layout_map = jstrategy.experimental.LayoutMap(jstrategy.experimental.DeviceMesh(shape, axes))
    if checkpoint:
        layout_map["^w$"] = ("model", None)
        layout_map["^b$"] = ("model",)
    else:
        layout_map["layers_0/kernel"] = (None, "model")
        layout_map["layers_0/bias"] = ("model",)
        layout_map["layers_2/kernel"] = ("model", None)
    return jstrategy.experimental.ModelParallelStrategy(
        layout_map, communication_options=communication_options
    )


def hybrid_strategy(communication_options=None, **kwargs):
    """`HybridStrategy` (replicas 2 x FSDP 2 x tensor 2) over every worker's devices, with
    `fit_model`'s Megatron layout; over 2 processes x 4 devices each process is one host
    holding one replica (``dcn_replicas`` = the processes)."""
    import jstrategy

    # The mesh only names the axes (built lazily: never, before the job is joined).
    mesh = jstrategy.experimental.DeviceMesh((2, 2, 2), ("replica", "fsdp", "tensor"))
    layout_map = jstrategy.experimental.LayoutMap(mesh)
    layout_map["layers_0/kernel"] = (None, "tensor")
    layout_map["layers_0/bias"] = ("tensor",)
    layout_map["layers_2/kernel"] = ("tensor", None)
    return jstrategy.experimental.HybridStrategy(
        replicas=2,
        fsdp=2,
        tensor=2,
        layout_map=layout_map,
        min_shard_size=0,
        communication_options=communication_options,
        **kwargs,
    )


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, (*prefix, str(k)))
    else:
        yield prefix, tree


if __name__ == "__main__":
    raise SystemExit(main())
