"""Activations placed by the strategy, not by the model (issue 46, item 1).

Under the sharded strategies the train step constrains the input of every block marked
with `jstrategy.training.remat` (and of each layer of a `Repeated` block run in order) to
its rows' split over the axes the step splits the batch over (`Strategy.activation_rows`),
as MaxText's rules pin each layer's input. Left to itself, XLA gathered every replica's
activations inside a scan over FSDP's split layers. Memory is read from the compiled
programs' memory analysis (deterministic: arguments + temporaries + outputs - aliased, per
device), against the same model with the constraint written in it by hand and against
hand-written global-view ``jax.jit`` steps with and without that constraint.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jstrategy
from jstrategy import training
from jstrategy._src import activation_rows
from jstrategy._src.placement import variable_shardings
from jstrategy._src.training.step import remat as remat_lib
from jstrategy.experimental import Repeated

D, HEADS, MLP, VOCAB, SEQ, LAYERS, ROWS = 64, 4, 256, 256, 32, 4, 16


class _Layer(nn.Module):
    """A pre-norm decoder layer (causal attention, SwiGLU), called as ``nn.scan`` calls its
    body. `rows`: the constraint a model written for a global jit would put on its input."""

    rows: NamedSharding | None = None

    @nn.compact
    def __call__(self, x, _=None):
        if self.rows is not None:
            x = jax.lax.with_sharding_constraint(x, self.rows)
        h = nn.RMSNorm()(x)
        q, k, v = (nn.DenseGeneral((HEADS, D // HEADS), use_bias=False)(h) for _ in range(3))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + nn.DenseGeneral(D, axis=(-2, -1), use_bias=False)(y)
        h = nn.RMSNorm()(x)
        gate, up = nn.Dense(MLP, use_bias=False)(h), nn.Dense(MLP, use_bias=False)(h)
        return x + nn.Dense(D, use_bias=False)(nn.silu(gate) * up), None


class _Unscanned(nn.Module):
    """`_Layer` returning its output alone (unrolled, or a `Repeated` block)."""

    @nn.compact
    def __call__(self, x):
        return _Layer()(x)[0]


class _Decoder(nn.Module):
    """Embedding, `LAYERS` layers (``"scanned"``: remat-marked under ``nn.scan``;
    ``"unrolled"``: remat-marked, named by Flax; ``"repeated"``: an unmarked `Repeated`
    block), final norm, output projection."""

    layers: str = "scanned"
    rows: NamedSharding | None = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        if self.layers == "scanned":
            block = training.remat(_Layer, prevent_cse=False)
            scan = nn.scan(
                block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
            )
            x, _ = scan(self.rows, name="layers")(x, None)
        elif self.layers == "unrolled":
            block = training.remat(_Unscanned)
            for _ in range(LAYERS):
                x = block()(x)
        else:
            x = Repeated(_Unscanned(), num_layers=LAYERS)(x)
        return nn.Dense(VOCAB, use_bias=False)(nn.RMSNorm()(x))


def _loss(y, logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(axis=-1)


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.temp_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
    )


def _tokens():
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(ROWS, SEQ + 1))
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def _step(strategy, model, remat, tx):
    with strategy.scope():
        state = training.create_train_state(model, tx, jnp.zeros((1, SEQ), jnp.int32))
        step = training.make_train_step(_loss, remat=remat)
    batch = next(iter(strategy.experimental_distribute_dataset([_tokens()])))
    return state, step, batch


def _jstrategy_peak(model, remat):
    strategy = jstrategy.experimental.FSDPStrategy()
    state, step, batch = _step(strategy, model, remat, optax.adamw(1e-3))
    return _peak(step.lower(state, batch).compile())


def _hand_written_peak(model, remat):
    """The same step as a global-view ``jax.jit`` over FSDP's layouts (the batch split by
    rows, each gradient constrained to its parameter's layout), traced with the same remat
    policy; the model as given."""
    strategy = jstrategy.experimental.FSDPStrategy()
    tx = optax.adamw(1e-3)
    with strategy.scope():
        state = training.create_train_state(model, tx, jnp.zeros((1, SEQ), jnp.int32))
    shardings = variable_shardings((state.params, state.opt_state), strategy)
    rows = NamedSharding(strategy.mesh, P(strategy.axis_name))

    def hand_written(params, opt_state, x, y):
        def mean_loss(p):
            return _loss(y, model.apply({"params": p}, x)).mean()

        loss, grads = jax.value_and_grad(mean_loss)(params)
        grads = jax.lax.with_sharding_constraint(grads, shardings[0])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    program = jax.jit(
        hand_written,
        in_shardings=(*shardings, rows, rows),
        out_shardings=(*shardings, None),
        donate_argnums=(0, 1),
    )
    x, y = jax.device_put(_tokens(), rows)
    with jax.set_mesh(strategy.mesh), remat_lib.applying(remat_lib.resolve_remat(remat)):
        return _peak(program.lower(state.params, state.opt_state, x, y).compile())


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True, None], ids=["remat", "no_remat"])
def test_fsdp_scanned_decoder_peaks_as_with_the_constraint_written_in_the_model(remat):
    rows = NamedSharding(jstrategy.experimental.FSDPStrategy().mesh, P("replica"))
    as_written = _jstrategy_peak(_Decoder(), remat)
    constrained_by_hand = _jstrategy_peak(_Decoder(rows=rows), remat)
    peer_constrained = _hand_written_peak(_Decoder(rows=rows), remat)
    peer_unconstrained = _hand_written_peak(_Decoder(), remat)
    # jax 0.12 on 8 CPU devices (MiB, remat / no remat): as written 1.765 / 3.957, the same
    # as constrained by hand (in jstrategy's step or a hand-written jit); before the step
    # placed the activations, as written 2.535 / 8.367: the unconstrained jit's peak.
    assert as_written <= constrained_by_hand, (as_written, constrained_by_hand)
    assert as_written <= peer_constrained, (as_written, peer_constrained)
    assert as_written < peer_unconstrained, (as_written, peer_unconstrained)


@pytest.mark.slow
def test_fsdp_places_each_layer_of_a_repeated_block_run_in_order():
    # The block is not marked with remat: Repeated's own loop places each layer's input.
    rows = NamedSharding(jstrategy.experimental.FSDPStrategy().mesh, P("replica"))
    as_written = _jstrategy_peak(_Decoder("repeated"), None)
    # As a hand-written jit whose layers pin their input (3.957 MiB; 8.367 before).
    assert as_written <= _hand_written_peak(_Decoder(rows=rows), None)
    assert as_written < _hand_written_peak(_Decoder("repeated"), None)


def _block_input_constraints(strategy, layers="scanned", remat=None):
    """The lowered step's sharding constraints on arrays shaped like a block's input."""
    state, step, batch = _step(strategy, _Decoder(layers), remat, optax.sgd(0.1))
    text = step.lower(state, batch).as_text()
    return [
        line
        for line in text.splitlines()
        if "sdy.sharding_constraint" in line and line.endswith(f"x{SEQ}x{D}xf32>")
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, rows",
    [
        # The replicas (the map's dimension), the rows within a replica, then the block
        # input's sequence left to XLA (open: "{?}"), and its features too where there is
        # no tensor axis; under a tensor layout the features split over it, as MaxText's
        # ``activation_embed`` (else XLA kept each layer's input whole on every device of
        # the tensor axis: 1.42x MaxText's peak for llama2-7B on a v5p-32, data 2 x tensor 8).
        (jstrategy.experimental.FSDPStrategy, '[{"replica"}, {}, {?}, {?}]'),
        (
            lambda: jstrategy.experimental.HybridStrategy(replicas=2, fsdp=2, tensor=2),
            '[{"replica"}, {"fsdp"}, {?}, {"tensor"}]',
        ),
        (
            lambda: jstrategy.experimental.ModelParallelStrategy(
                jstrategy.experimental.LayoutMap(
                    jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
                )
            ),
            '[{"batch"}, {}, {?}, {"model"}]',
        ),
    ],
    ids=["fsdp", "hybrid", "model_parallel"],
)
@pytest.mark.parametrize("layers", ["scanned", "unrolled", "repeated"])
def test_sharded_steps_constrain_each_blocks_input_by_rows(make, rows, layers):
    # remat=None: the rows are placed all the same (placement is not rematerialization and
    # needs no `remat=`), the features left to XLA (a split would only add collectives).
    unsplit = rows.replace('{"tensor"}', "{?}").replace('{"model"}', "{?}")
    constraints = _block_input_constraints(make(), layers)
    assert constraints and all(unsplit in line for line in constraints), constraints
    if layers == "scanned":  # the layers the step rematerializes (the others' names differ)
        # Under remat the features are split over a tensor axis too (the saved inputs).
        constraints = _block_input_constraints(make(), layers, remat=True)
        assert constraints and all(rows in line for line in constraints), constraints


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: jstrategy.OneDeviceStrategy("cpu:0"),
    ],
    ids=["mirrored", "one_device"],
)
def test_manual_region_steps_place_nothing(make):
    strategy = make()
    assert strategy.activation_rows is None
    assert _block_input_constraints(strategy, remat=True) == []


def test_each_strategy_names_the_axes_it_splits_rows_over():
    experimental = jstrategy.experimental
    assert experimental.FSDPStrategy().activation_rows == "replica"
    assert experimental.HybridStrategy(fsdp=4).activation_rows == ("replica", "fsdp")
    mesh = experimental.DeviceMesh((2, 4), ("batch", "model"))
    assert experimental.ModelParallelStrategy(experimental.LayoutMap(mesh)).activation_rows == (
        "batch"
    )
    assert experimental.PipelineStrategy(num_stages=2, num_microbatches=2).activation_rows == (
        "replica"
    )
    assert jstrategy.MirroredStrategy(["cpu:0", "cpu:1"]).activation_rows is None


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["scanned", "unrolled"])
def test_placed_blocks_train_as_one_device(layers):
    # Constraints move data, never change it; the placed class keeps the block's name, so
    # Flax's names (``_Unscanned_0``...) and the parameters are the block's.
    results = []
    for strategy in (
        jstrategy.OneDeviceStrategy("cpu:0"),
        jstrategy.experimental.FSDPStrategy(),
        jstrategy.experimental.HybridStrategy(replicas=2, fsdp=2, tensor=2),
    ):
        state, step, batch = _step(strategy, _Decoder(layers), None, optax.sgd(0.1))
        state, logs = step(state, batch)
        results.append((float(logs["loss"]), jax.tree.map(np.asarray, state.params)))
    (loss, params), *placed = results
    for placed_loss, placed_params in placed:
        assert placed_loss == pytest.approx(loss, rel=1e-6)
        assert jax.tree.structure(placed_params) == jax.tree.structure(params)
        for a, b in zip(jax.tree.leaves(placed_params), jax.tree.leaves(params), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_place_leaves_manual_regions_and_rows_that_do_not_divide_alone():
    strategy = jstrategy.experimental.HybridStrategy(replicas=2, fsdp=4)
    mesh = strategy.mesh

    def placed(x):
        with activation_rows.placing(mesh, strategy.activation_rows, "replica"):
            return activation_rows.place(x)

    def lowered(fn, *args):
        with jax.set_mesh(mesh):
            return jax.jit(fn).lower(*args).as_text()

    # Outside the replicas' map (the map would add "replica"): the rows over "fsdp".
    assert '[{"fsdp"}, {?}]' in lowered(placed, jnp.ones((8, 3)))
    # 6 rows do not split over 4 devices; a scalar has no rows.
    assert "sharding_constraint" not in lowered(placed, jnp.ones((6, 3)))
    assert "sharding_constraint" not in lowered(placed, jnp.ones(()))
    # Inside a shard_map, values are per device.
    manual = jax.shard_map(placed, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    assert "sharding_constraint" not in lowered(manual, jnp.ones((32, 3)))
    # Nothing outside a step, and nothing while a pipeline's stages suspend it.
    assert activation_rows.place(x := jnp.ones((8, 3))) is x
    with activation_rows.placing(mesh, "fsdp", "replica"), activation_rows.suspended():
        assert not activation_rows.current()


def _placed_text(x, split=activation_rows.TensorActivations.FEATURES):
    """The lowered text of `place(x)` under a replicas 2 x FSDP 2 x tensor 2 step's
    placement with `split`."""
    strategy = jstrategy.experimental.HybridStrategy(replicas=2, fsdp=2, tensor=2)
    mesh = strategy.mesh

    def placed(x):
        with activation_rows.placing(mesh, strategy.activation_rows, "replica", split=split):
            return activation_rows.place(x)

    with jax.set_mesh(mesh):
        return jax.jit(placed).lower(x).as_text()


def test_place_splits_a_sequence_models_features_over_the_tensor_axis_where_they_divide():
    lowered = _placed_text
    # A sequence model's block input: rows, sequence left to XLA, features over "tensor".
    assert '[{"fsdp"}, {?}, {"tensor"}]' in lowered(jnp.ones((8, 4, 6)))
    # Features that do not divide by the tensor degree, and 2-D inputs, keep them open.
    assert '[{"fsdp"}, {?}, {?}]' in lowered(jnp.ones((8, 4, 5)))
    assert '[{"fsdp"}, {?}]' in lowered(jnp.ones((8, 6)))


def test_place_splits_the_sequence_over_the_tensor_axis_with_sequence_activations():
    def lowered(x):
        return _placed_text(x, activation_rows.TensorActivations.SEQUENCE)

    # Rows over "fsdp", the sequence (dimension 1) over "tensor", the features left open.
    assert '[{"fsdp"}, {"tensor"}, {?}]' in lowered(jnp.ones((8, 4, 6)))
    # A sequence that does not divide by the tensor degree, and 2-D inputs, stay open.
    assert '[{"fsdp"}, {?}, {?}]' in lowered(jnp.ones((8, 3, 6)))
    assert '[{"fsdp"}, {?}]' in lowered(jnp.ones((8, 6)))


def _sequence_split(**degrees):
    return jstrategy.experimental.HybridStrategy(**degrees, tensor_activations="sequence")


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True, None], ids=["remat", "no_remat"])
def test_sequence_activations_split_each_blocks_input_along_the_sequence(remat):
    # With or without remat (the features' split is taken under remat only).
    sequence = _sequence_split(replicas=2, fsdp=2, tensor=2)
    constraints = _block_input_constraints(sequence, "scanned", remat)
    expected = '[{"replica"}, {"fsdp"}, {"tensor"}, {?}]'
    assert constraints and all(expected in line for line in constraints), constraints
    mesh = jstrategy.experimental.DeviceMesh((2, 4), ("batch", "model"))
    model_parallel = jstrategy.experimental.ModelParallelStrategy(
        jstrategy.experimental.LayoutMap(mesh), tensor_activations="sequence"
    )
    constraints = _block_input_constraints(model_parallel, "unrolled", remat)
    expected = '[{"batch"}, {}, {"model"}, {?}]'
    assert constraints and all(expected in line for line in constraints), constraints


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True, None], ids=["remat", "no_remat"])
def test_sequence_activations_peak_below_the_features_split(remat):
    # The norms and residuals between blocks on a tensor degree's share of the tokens. jax
    # 0.12.1, 8 CPU devices, MiB (remat / no remat): features 3.84 / 7.84, sequence 3.40 /
    # 5.46.
    def peak(strategy):
        state, step, batch = _step(strategy, _Decoder(), remat, optax.adamw(1e-3))
        return _peak(step.lower(state, batch).compile())

    features = jstrategy.experimental.HybridStrategy(replicas=2, fsdp=2, tensor=2)
    sequence = _sequence_split(replicas=2, fsdp=2, tensor=2)
    assert peak(sequence) < peak(features)


@pytest.mark.slow
def test_sequence_activations_train_as_one_device():
    results = []
    for strategy in (
        jstrategy.OneDeviceStrategy("cpu:0"),
        _sequence_split(replicas=2, fsdp=2, tensor=2),
        _sequence_split(replicas=1, fsdp=2, tensor=4),
    ):
        state, step, batch = _step(strategy, _Decoder("unrolled"), True, optax.sgd(0.1))
        for _ in range(2):
            state, logs = step(state, batch)
        results.append((float(logs["loss"]), jax.tree.map(np.asarray, state.params)))
    (loss, params), *placed = results
    for placed_loss, placed_params in placed:
        assert placed_loss == pytest.approx(loss, rel=1e-5)
        for a, b in zip(jax.tree.leaves(placed_params), jax.tree.leaves(params), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_tensor_activations_is_checked_in_the_constructor():
    experimental = jstrategy.experimental
    with pytest.raises(ValueError, match=r"`tensor_activations` must be one of .*got 'rows'"):
        experimental.HybridStrategy(fsdp=4, tensor=2, tensor_activations="rows")
    with pytest.raises(ValueError, match=r"needs a mesh axis 'model' or 'tensor' of more than"):
        experimental.HybridStrategy(fsdp=8, tensor_activations="sequence")
    with pytest.raises(ValueError, match=r"context axis already splits it \(context=2\)"):
        experimental.ParallelStrategy(
            replicas=2, context=2, tensor=2, tensor_activations="sequence"
        )
    mesh = experimental.DeviceMesh((8,), ("batch",))
    with pytest.raises(ValueError, match=r"needs a mesh axis"):
        experimental.ModelParallelStrategy(
            experimental.LayoutMap(mesh), tensor_activations=experimental.TensorActivations.SEQUENCE
        )
    strategy = experimental.HybridStrategy(fsdp=4, tensor=2, tensor_activations="SEQUENCE")
    assert strategy.tensor_activations is experimental.TensorActivations.SEQUENCE
    assert repr(strategy).endswith("tensor_activations='sequence')")
    assert "tensor_activations" not in repr(experimental.HybridStrategy(fsdp=4, tensor=2))
