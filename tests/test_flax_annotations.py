"""Flax's own sharding annotations under the sharded strategies (issue 19, item 3/4)."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jstrategy
import jstrategy.training
from jstrategy.experimental import DeviceMesh
from jstrategy.experimental import FSDPStrategy
from jstrategy.experimental import LayoutMap
from jstrategy.experimental import ModelParallelStrategy

_INIT = nn.initializers.lecun_normal()


class _Annotated(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, kernel_init=nn.with_partitioning(_INIT, (None, "model")))(x)
        w2 = self.param("W2", nn.with_logical_partitioning(_INIT, ("hidden", "embed")), (16, 4))
        return jnp.tanh(h) @ w2  # type: ignore[operator]  # unboxed by Flax on read


def _strategy(**kwargs):
    layout_map = kwargs.pop("layout_map", None) or LayoutMap(DeviceMesh((2, 4), ("data", "model")))
    return ModelParallelStrategy(layout_map, batch_dim_name="data", **kwargs)


def _specs(tree):
    return jax.tree.map(lambda x: x.sharding.spec, tree)


@pytest.mark.slow
def test_linen_annotations_place_variables_under_model_parallel():
    strategy = _strategy(logical_axis_rules=[("hidden", "model")])
    with strategy.scope():
        state = jstrategy.training.create_train_state(
            _Annotated(), optax.adam(1e-2), jnp.ones((1, 8))
        )
    # Plain arrays in the state (no boxes, so no ".../value" paths), laid out as annotated.
    assert _specs(state.params) == {
        "Dense_0": {"kernel": P(None, "model"), "bias": P()},
        "W2": P("model", None),
    }
    mu = state.opt_state[0].mu
    assert mu["W2"].sharding.spec == P("model", None)  # moments follow their parameter


@pytest.mark.slow
def test_logical_rules_from_flax_context_and_layout_map_overrides():
    layout_map = LayoutMap(DeviceMesh((2, 4), ("data", "model")))
    layout_map["^Dense_0/kernel$"] = ("model", None)  # anchored keys match user paths
    strategy = _strategy(layout_map=layout_map)
    with strategy.scope(), nn.logical_axis_rules([("embed", "model")]):
        state = jstrategy.training.create_train_state(
            _Annotated(), optax.sgd(0.1), jnp.ones((1, 8))
        )
    assert state.params["Dense_0"]["kernel"].sharding.spec == P("model", None)
    assert state.params["W2"].sharding.spec == P(None, "model")


def test_a_layout_key_that_matches_nothing_is_an_error_naming_the_nearest_paths():
    layout_map = LayoutMap(DeviceMesh((2, 4), ("data", "model")))
    layout_map["Dense_0/kernal"] = (None, "model")
    strategy = _strategy(layout_map=layout_map)
    with pytest.raises(ValueError, match=r"'Dense_0/kernal' matches no variable.*'Dense_0/kernel'"):
        jstrategy.training.create_train_state(
            _Plain(), optax.sgd(0.1), jnp.ones((1, 4)), strategy=strategy
        )


class _Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(x)


def test_annotations_and_rules_naming_missing_mesh_axes_are_errors():
    with pytest.raises(ValueError, match=r"names mesh axes \['tensor'\] that the mesh lacks"):
        _strategy(logical_axis_rules=[("hidden", "tensor")])
    strategy = _strategy()

    class Wrong(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, kernel_init=nn.with_partitioning(_INIT, (None, "tensor")))(x)

    with pytest.raises(ValueError, match=r"Variable 'Dense_0/kernel' is annotated"):
        jstrategy.training.create_train_state(
            Wrong(), optax.sgd(0.1), jnp.ones((1, 4)), strategy=strategy
        )


def test_fsdp_honours_an_annotations_data_axis():
    strategy = FSDPStrategy()

    class Fsdp(nn.Module):
        @nn.compact
        def __call__(self, x):
            # Small (below min_shard_size) and split on its smaller dimension by annotation.
            return nn.Dense(16, kernel_init=nn.with_partitioning(_INIT, ("data", "model")))(x)

    state = jstrategy.training.create_train_state(
        Fsdp(), optax.sgd(0.1), jnp.ones((1, 8)), strategy=strategy
    )
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.sharding.is_equivalent_to(NamedSharding(strategy.mesh, P("replica")), 2)


def test_nnx_annotations_made_in_the_scope_place_the_state():
    strategy = _strategy()
    with strategy.scope():
        model = nnx.Linear(
            8, 16, kernel_init=nnx.with_partitioning(_INIT, (None, "model")), rngs=nnx.Rngs(0)
        )
        state = jstrategy.training.create_nnx_train_state(model, optax.sgd(0.1))
    assert state.params["kernel"][...].sharding.spec == P(None, "model")
    assert state.params["bias"][...].sharding.spec == P()


def _constraint_count(strategy):
    class Constrained(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16)(x)
            return nn.Dense(4)(nn.with_logical_constraint(jnp.tanh(h), (None, "hidden")))

    with strategy.scope():
        state = jstrategy.training.create_train_state(
            Constrained(), optax.sgd(0.1), jnp.ones((1, 8))
        )
    step = jstrategy.training.make_train_step(
        jstrategy.losses.MeanSquaredError(), strategy=strategy
    )
    batch = (jnp.ones((8, 8)), jnp.zeros((8, 4)))
    # Traced outside the scope: the step itself sets the strategy's rules.
    text = step.lower(state, batch).as_text()
    state, logs = step(state, batch)
    assert jnp.isfinite(logs["loss"])
    return text.count("model")


@pytest.mark.slow
def test_logical_constraints_in_the_step_use_the_strategys_rules():
    with_rules = _constraint_count(_strategy(logical_axis_rules=[("hidden", "model")]))
    without = _constraint_count(_strategy())
    assert with_rules > without


# Annotations for one mesh, under every strategy (issue 34) ---------------------------------
class _ForAnotherMesh(nn.Module):
    """Annotated for a ("data", "model") mesh: a kernel split over both, a logical
    constraint on the activations."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, kernel_init=nn.with_partitioning(_INIT, ("data", "model")))(x)
        return nn.Dense(4)(nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp")))


_RULES = [("batch", "data"), ("mlp", "model")]


@pytest.mark.parametrize(
    "make",
    [
        lambda: jstrategy.OneDeviceStrategy("cpu:0"),
        lambda: jstrategy.MirroredStrategy(),
        lambda: jstrategy.CentralStorageStrategy(),
        lambda: FSDPStrategy(min_shard_size=0),
    ],
    ids=["one_device", "mirrored", "central_storage", "fsdp"],
)
def test_a_model_annotated_for_another_mesh_is_created_and_trained_in_any_scope(make):
    """Inside the scope (where it stopped at JAX's "Resource axis: model ... is not found
    in mesh"), by the user's own init and by create_train_state alike."""
    strategy = make()
    x = jnp.ones((8, 8))
    with nn.logical_axis_rules(_RULES), strategy.scope():
        variables = _ForAnotherMesh().init(jax.random.key(0), x[:1])
        assert variables["params"]["Dense_0"]["kernel"].names == ("data", "model")
        state = jstrategy.training.create_train_state(_ForAnotherMesh(), optax.sgd(0.1), x[:1])
        step = jstrategy.training.make_train_step("mse")
        state, logs = step(state, (x, jnp.zeros((8, 4))))
    assert np.isfinite(float(logs["loss"]))
    kernel = state.params["Dense_0"]["kernel"]
    # FSDP splits the annotation's data axis over its replicas; the others keep one copy.
    if isinstance(strategy, FSDPStrategy):
        assert kernel.sharding.is_equivalent_to(NamedSharding(strategy.mesh, P("replica")), 2)
    else:
        assert kernel.sharding.is_fully_replicated


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_an_axis_the_mesh_lacks_is_the_projects_error_inside_the_scope_too(where):
    """ModelParallel's mesh is the user's own: an annotation it cannot place is refused
    by name, not by JAX's raw error (which it was inside the scope)."""

    class Wrong(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, kernel_init=nn.with_partitioning(_INIT, (None, "tensor")))(x)

    strategy = _strategy()
    scope = strategy.scope() if where == "inside" else contextlib.nullcontext()
    match = r"Variable 'Dense_0/kernel' is annotated .* names mesh axes \['tensor'\] that the mesh lacks; its axes are \('data', 'model'\)"
    with scope, pytest.raises(ValueError, match=match):
        jstrategy.training.create_train_state(
            Wrong(), optax.sgd(0.1), jnp.ones((1, 4)), strategy=strategy
        )
    with strategy.scope(), pytest.raises(ValueError, match=match):
        jstrategy.Model(Wrong(), input_shape=(4,))


def test_layout_keys_may_spell_an_nnx_variable_with_its_value():
    """The README's NNX key form, ``dense1/kernel/value``, names ``dense1/kernel``."""
    layout_map = LayoutMap(DeviceMesh((2, 4), ("data", "model")))
    layout_map["dense1/kernel/value"] = (None, "model")
    strategy = _strategy(layout_map=layout_map)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense1 = nnx.Linear(8, 16, rngs=rngs)

        def __call__(self, x):
            return self.dense1(x)

    with strategy.scope():
        state = jstrategy.training.create_nnx_train_state(Net(nnx.Rngs(0)), optax.sgd(0.1))
    assert state.params["dense1"]["kernel"][...].sharding.spec == P(None, "model")
    assert layout_map["dense1/kernel"] == P(None, "model")


def test_each_strategy_reads_an_annotations_axes_on_its_own_mesh():
    fsdp = FSDPStrategy()
    assert [fsdp.annotation_axis(a) for a in ("data", "fsdp", "batch", "model", "replica")] == [
        "replica", "replica", "replica", None, "replica",
    ]  # fmt: skip
    mp = _strategy()
    assert [mp.annotation_axis(a) for a in ("data", "model", "tensor")] == ["data", "model", None]
    mirrored = jstrategy.MirroredStrategy()
    assert mirrored.annotation_axis("data") is None
    from jstrategy._src.flax_annotations import step_rules

    with nn.logical_axis_rules(_RULES):
        assert step_rules(mirrored) == ()
        assert step_rules(fsdp) == (("batch", "replica"), ("mlp", None))
        assert step_rules(mp) == (("batch", "data"), ("mlp", "model"))
