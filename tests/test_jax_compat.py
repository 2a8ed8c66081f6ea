"""`_src/jax_compat.py` on the running JAX: every API it reads exists, none by a silent fallback.

Each supported JAX (0.10 to 0.12; CI runs the suite at both ends) must have every function
this module resolves; a release that removes one fails here, not somewhere downstream with
other gradient semantics or another listening address.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jstrategy._src import jax_compat


def _mesh():
    return jax.sharding.Mesh(
        np.array(jax.devices()[:4]), ("r",), axis_types=(jax.sharding.AxisType.Auto,)
    )


def test_all_gather_invariant_is_typed_the_same_on_every_replica():
    # With the plain (varying) all-gather, out_specs=P() cannot be checked under check_vma:
    # shard_map raises "out_specs which require replication which can't be statically
    # inferred". That is what RING's all-gather phase hit on jax 0.12.
    def gather(x):
        return jax_compat.all_gather_invariant(x, "r", axis=0, tiled=True)

    f = jax.jit(jax.shard_map(gather, mesh=_mesh(), in_specs=P("r"), out_specs=P()))
    x = jnp.arange(8.0)
    np.testing.assert_array_equal(f(x), x)


def test_all_gather_invariant_transposes_to_a_slice():
    # The gradient of an invariant gather is each replica's slice of the cotangent (no sum
    # over replicas, which a varying all-gather's transpose, a reduce-scatter, would add).
    def loss(x):
        full = jax_compat.all_gather_invariant(x, "r", axis=0, tiled=True)
        return jnp.sum(full * jnp.arange(8.0))

    f = jax.jit(jax.shard_map(jax.grad(loss), mesh=_mesh(), in_specs=P("r"), out_specs=P("r")))
    np.testing.assert_array_equal(f(jnp.ones(8)), np.arange(8.0))


def test_every_private_reader_exists_on_this_jax():
    assert jax_compat.distributed_client() is None  # no jax.distributed in this process
    assert jax_compat.preemption_sync_manager() is None
    jax.devices()  # starts the CPU backend in this worker, whatever ran before
    assert jax_compat.backends_started() is True
    for fn in jax_compat.cpu_collectives_internals():
        assert callable(fn)
    # A scan with one const (w), one carry and one scanned input.
    w = jnp.float32(2.0)
    jaxpr = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c * w + x, c), c, xs))(
        jnp.float32(0), jnp.ones(3)
    )
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert jax_compat.scan_counts(eqn.params) == (1, 1)


def test_inside_staging_trace_tells_jit_from_eager():
    seen = []

    @jax.jit
    def f(x):
        seen.append(jax_compat.inside_staging_trace())
        return x

    f(1.0)
    assert seen == [True]
    assert jax_compat.inside_staging_trace() is False


def test_a_missing_api_names_the_jax_version_and_the_supported_range():
    error = jax_compat._unsupported("jax.lax.some_api")
    assert isinstance(error, jax_compat.UnsupportedJaxError)
    with pytest.raises(jax_compat.UnsupportedJaxError, match=rf"jax {jax.__version__}.*<0.13"):
        raise error
