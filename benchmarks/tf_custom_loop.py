"""TF's custom-loop style against the same step hand-written: what threading state costs.

Both run one data-parallel step of the same MLP per call: gradients all-reduced, SGD with
momentum, and the running accuracy (correct predictions and rows) summed over replicas.
The hand-written steps are `jax.jit(jax.shard_map(...))` programs that take and return the
parameters, the optimizer state and the accuracy counters (donated): the fastest one fuses
every all-reduce into one; "TF's program" does what the tutorial's code asks for (the
loss divided by the global count of real rows, all-reduced first; the metric counted per
replica and summed when read). The TF-style step
is what TF's custom-training tutorial writes: a `jstrategy.Model`, a
`jstrategy.optimizers.SGD` whose `apply_gradients` aggregates, a stateful
`SparseCategoricalAccuracy`, all closed over by the function given to `strategy.run`, which
threads their state through its program. Timings are interleaved medians from one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/tf_custom_loop.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
from overhead import MLP

import jstrategy

SAME = "hand-written, TF's program"


def main(argv: list[str] | None = None) -> None:
    args = _common.mlp_step_arguments(__doc__.splitlines()[0], argv)

    strategy = jstrategy.MirroredStrategy()
    mesh, axis = strategy.mesh, strategy.axis_name
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=(args.batch,)).astype(np.int32)
    (batch,) = strategy.experimental_distribute_dataset([(x, y)])

    # TF's style ------------------------------------------------------------------------
    with strategy.scope():
        model = jstrategy.Model(MLP(args.width), input_shape=(64,), seed=0)
        optimizer = jstrategy.optimizers.SGD(0.01, momentum=0.9)
        accuracy = jstrategy.metrics.SparseCategoricalAccuracy()
        loss_object = jstrategy.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="none"
        )

    def train_step(inputs):
        images, labels = inputs

        def forward(variables):
            logits = model(images, training=True, trainable_variables=variables)
            return jstrategy.compute_average_loss(loss_object(labels, logits)), logits

        (loss, logits), grads = jax.value_and_grad(forward, has_aux=True)(model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        accuracy.update_state(labels, logits)
        return loss

    def run_tf_style(_):
        return strategy.run(train_step, args=(batch,))

    # Hand-written ----------------------------------------------------------------------
    module, tx = MLP(args.width), optax.sgd(0.01, momentum=0.9)
    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(jnp.copy, model.state.params)  # its own buffers: they are donated
    hand = {
        "params": params,
        "opt": jax.device_put(tx.init(params), replicated),
        "counts": jax.device_put(jnp.zeros(2, jnp.float32), replicated),
    }
    x_dev, y_dev = batch[0].value, batch[1].value

    def body(p, s, counts, xb, yb):
        p_local = jax.tree.map(lambda v: jax.lax.pcast(v, axis, to="varying"), p)

        def forward(q):
            logits = module.apply({"params": q}, xb)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).sum()
            return loss / args.batch, logits

        (loss, logits), grads = jax.value_and_grad(forward, has_aux=True)(p_local)
        hits = jnp.sum(jnp.argmax(logits, -1) == yb).astype(jnp.float32)
        rows = jnp.float32(yb.shape[0])
        grads, hits_rows = jax.lax.psum((grads, jnp.stack([hits, rows])), axis)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, counts + hits_rows, loss[None]

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P(), P(), P(axis), P(axis)),
            out_specs=(P(), P(), P(), P(axis)),
        ),
        donate_argnums=(0, 1, 2),
    )

    def run_hand(_):
        hand["params"], hand["opt"], hand["counts"], loss = step(
            hand["params"], hand["opt"], hand["counts"], x_dev, y_dev
        )
        return loss

    # Hand-written global view: jax.jit with NamedShardings, XLA inserts the all-reduce.
    rows = NamedSharding(mesh, P(axis))
    glob = {k: jax.tree.map(jnp.copy, v) for k, v in hand.items()}

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def jit_step(p, s, counts, xb, yb):
        def forward(q):
            logits = module.apply({"params": q}, xb)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
            return loss, logits

        (loss, logits), grads = jax.value_and_grad(forward, has_aux=True)(p)
        hits = jnp.sum(jnp.argmax(logits, -1) == yb).astype(jnp.float32)
        updates, s = tx.update(grads, s, p)
        counts = counts + jnp.stack([hits, jnp.float32(yb.shape[0])])
        return optax.apply_updates(p, updates), s, counts, loss

    x_rows, y_rows = jax.device_put(x, rows), jax.device_put(y, rows)

    def run_jit(_):
        glob["params"], glob["opt"], glob["counts"], loss = jit_step(
            glob["params"], glob["opt"], glob["counts"], x_rows, y_rows
        )
        return loss

    # Hand-written with TF's program: the same math as the TF-style step (a mask-aware
    # mean whose row count is all-reduced first, then the gradients; each replica adds to
    # its own part of the metric's counters, summed when read, as TF's metric variables),
    # so the ratio to it is what threading the state through run costs.
    mask_dev = batch[0].mask
    n = strategy.num_replicas_in_sync
    same = {k: jax.tree.map(jnp.copy, v) for k, v in hand.items() if k != "counts"}
    same["counts"] = jax.device_put(jnp.zeros((n, 2), jnp.float32), strategy.batch_sharding())

    def same_body(p, s, counts, xb, yb, mask):
        p_local = jax.tree.map(lambda v: jax.lax.pcast(v, axis, to="varying"), p)
        weight = mask.astype(jnp.float32)
        real = jax.lax.psum(jnp.sum(weight), axis)

        def forward(q):
            logits = module.apply({"params": q}, xb)
            per_row = optax.softmax_cross_entropy_with_integer_labels(logits, yb)
            return jnp.sum(per_row * weight) / real, logits

        (loss, logits), grads = jax.value_and_grad(forward, has_aux=True)(p_local)
        grads = jax.lax.psum(grads, axis)
        updates, s = tx.update(grads, s, p)
        hits = jnp.sum((jnp.argmax(logits, -1) == yb) * weight)
        counts = counts + jnp.stack([hits, jnp.sum(weight)])[None]
        return optax.apply_updates(p, updates), s, counts, loss[None]

    same_step = jax.jit(
        jax.shard_map(
            same_body,
            mesh=mesh,
            in_specs=(P(), P(), P(axis), P(axis), P(axis), P(axis)),
            out_specs=(P(), P(), P(axis), P(axis)),
        ),
        donate_argnums=(0, 1, 2),
    )

    def run_same(_):
        same["params"], same["opt"], same["counts"], loss = same_step(
            same["params"], same["opt"], same["counts"], x_dev, y_dev, mask_dev
        )
        return loss

    # Same numbers first.
    for i in range(10):
        run_tf_style(i)
        run_hand(i)
        run_same(i)
        run_jit(i)
    for a, b in zip(model.trainable_variables, jax.tree.leaves(hand["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    total, count = accuracy.variables
    np.testing.assert_allclose([float(total), float(count)], np.asarray(hand["counts"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(same["counts"]).sum(0), np.asarray(hand["counts"]))

    for a, b in zip(jax.tree.leaves(same["params"]), jax.tree.leaves(hand["params"]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    medians = _common.compare(
        {
            "hand-written jax.jit": run_jit,
            "hand-written shard_map": run_hand,
            SAME: run_same,
            "TF style via strategy.run": run_tf_style,
        },
        steps=args.steps,
        repeats=args.repeats,
    )
    _common.print_step_table(medians, args, strategy.num_replicas_in_sync)
    print(
        "threading the model, optimizer and metric through run: "
        f"{medians['TF style via strategy.run'] / medians[SAME]:.3f}"
        "x the same program hand-written"
    )


if __name__ == "__main__":
    main()
