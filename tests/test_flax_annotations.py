"""Flax's own sharding annotations under the sharded strategies (issue 19, item 3/4)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
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
    assert state.params["Dense_0"]["kernel"].sharding.spec == P("replica")


def test_scope_sets_jax_mesh_so_nnx_annotations_shard_eagerly():
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
