"""The mixture-of-experts rows of benchmarks/maxtext_compare.py: a small Mixtral-shaped decoder.

`maxtext_compare.py`'s decoder with each layer's MLP replaced by a mixture of 8 SwiGLU
experts, top-2, capacity factor 1.25, on both sides:

* **MaxText 0.2.5**: ``decoder_block=mixtral`` (its ``MixtralDecoderLayer``: the llama2
  layer's norms and attention, ``RoutedMoE`` for the MLP) with ``num_experts=8
  num_experts_per_tok=2 sparse_matmul=false megablox=false capacity_factor=1.25
  load_balance_loss_weight=0.01``: its dense-matmul path, which drops tokens (the
  ``BSM,BSEC->EBCM`` dispatch einsum over a ``[batch, seq, experts, capacity]`` mask).
* **jstrategy**: ``jstrategy.experimental.MoE(num_experts=8, top_k=2, hidden_dim=mlp,
  capacity_factor=1.25, softmax="after_top_k", load_balance_weight=0.01 / (2 * L),
  z_loss_weight=0)``.

The settings, side by side (MaxText's read from its ``layers/moe.py``):

* Router: a ``(d, E)`` kernel, no bias, float32 logits; top-k of the logits, then a
  softmax over the k chosen (MaxText's ``get_topk`` for a non-DeepSeek block; jstrategy's
  ``"after_top_k"``). No renormalization after drops (``norm_topk_prob=false``), no routed
  scaling (``routed_scaling_factor`` is DeepSeek's only).
* Capacity: per batch row, ``int(max(ceil(seq * k / E) * 1.25, 1.25))`` slots an expert
  (MaxText's ``generate_masks``; jstrategy's `expert_capacity`), 40 at sequence 128; slots
  filled in token-major, rank-minor order on both; a dropped assignment adds nothing.
* Load balance: MaxText's loss is ``mean_{b,e}(f_e / k * P_e) * E**2 * w`` per layer,
  averaged over the layers; jstrategy's is ``E * sum_e(f_e * P_e) * w'`` per layer (``f``
  summing to k: k times MaxText's definition), summed over the layers. So ``w' = w / (k L)``
  gives the same term in the loss.
* Router z-loss: MaxText has none; jstrategy's is off (``z_loss_weight=0``).
* What differs and cannot match: the initializers (MaxText's truncated normal, fan in, for
  the router and experts; jstrategy's LeCun normal), which move no peak or time.

Layouts: ``moe`` (FSDP 8: ``ici_fsdp_parallelism=8``; ``FSDPStrategy()``), ``moe_ep4``
(expert 4 x fsdp 2: ``ici_expert_parallelism=4 ici_fsdp_parallelism=2``;
``FSDPStrategy(experts=4)``) and ``moe_ep8`` (expert 8: ``ici_expert_parallelism=8``;
``FSDPStrategy(experts=8)``).

The dropped fraction (the row's note): the assignments (token, rank) dropped at capacity
1.25 over all layers, of ``tokens * k`` a layer, on the synthetic batch at jstrategy's
initial weights. jstrategy's from its layer's own count (`moe_dropped_fraction` of the
``"intermediates"`` it sows); MaxText's from MaxText's own routing (its ``RoutedMoE``'s
``get_topk``, ``reshape_and_update_weights`` and ``generate_masks``) on the same router
logits (each layer's MoE input times its router kernel, from jstrategy's forward pass):
MaxText sows no drop count, and its weights start elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import maxtext_compare as mc
import numpy as np

import jstrategy
from jstrategy.experimental import MoE
from jstrategy.experimental import moe_dropped_fraction

LAYOUTS = {"moe": 1, "moe_ep4": 4, "moe_ep8": 8}  # layout: expert degree
LABELS = {
    "moe": "MoE, FSDP 8",
    "moe_ep4": "MoE, expert 4 x fsdp 2",
    "moe_ep8": "MoE, expert 8",
}
LOAD_BALANCE = 0.01  # MaxText's load_balance_loss_weight


@dataclasses.dataclass(frozen=True)
class MoEShape(mc.Shape):
    """`mc.Shape` with grouped-query heads and the experts (``mlp`` is each expert's)."""

    kv_heads: int = 4
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25

    def parameters(self) -> int:
        """Embedding, L layers (two norms, q/k/v/out, the router, E experts' three
        kernels), final norm, output projection."""
        d, m, e, hd = self.d_model, self.mlp, self.experts, self.head_dim
        attention = 2 * d * self.heads * hd + 2 * d * self.kv_heads * hd
        layer = 2 * d + attention + d * e + 3 * e * d * m
        return 2 * self.vocab * d + self.layers * layer + d


# The jstrategy side ----------------------------------------------------------------------
class Attention(nn.Module):
    """`mc.Attention` with ``kv_heads`` key/value heads (grouped queries, as MaxText's)."""

    heads: int
    kv_heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        head_dim = x.shape[-1] // self.heads

        def project(name: str, heads: int) -> jax.Array:
            return nn.DenseGeneral((heads, head_dim), use_bias=False, name=name)(x)

        q = mc.rotary(project("query", self.heads))
        k = mc.rotary(project("key", self.kv_heads))
        y = jax.nn.dot_product_attention(q, k, project("value", self.kv_heads), is_causal=True)
        return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, name="out")(y)


class Layer(nn.Module):
    """One Mixtral layer: `mc.Layer` with `MoE` for the MLP. Sows the MoE's input into
    ``"intermediates"`` (when mutable) for the drop count's router logits."""

    shape: MoEShape
    scanned: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> Any:
        s = self.shape
        norm = lambda name: nn.RMSNorm(epsilon=1e-5, name=name)  # noqa: E731
        x = x + Attention(s.heads, s.kv_heads, name="self_attention")(
            norm("pre_self_attention_norm")(x)
        )
        h = norm("post_self_attention_norm")(x)
        self.sow("intermediates", "moe_input", h)
        x = x + MoE(
            num_experts=s.experts,
            top_k=s.top_k,
            hidden_dim=s.mlp,
            capacity_factor=s.capacity_factor,
            softmax="after_top_k",
            load_balance_weight=LOAD_BALANCE / (s.top_k * s.layers),
            z_loss_weight=0.0,
            name="MoeBlock_0",
        )(h)
        return (x, None) if self.scanned else x


class Decoder(mc.Decoder):
    """`mc.Decoder` of Mixtral layers, ``"scanned"`` or ``"unrolled"``; scanned, each layer's
    aux losses and drop counts are scanned too (one a layer)."""

    shape: MoEShape
    layer_class: ClassVar[type[nn.Module]] = Layer
    scanned_collections: ClassVar[tuple[str, ...]] = ("params", "losses", "intermediates")

    def layer(self, block: Any, scanned: bool, **kwargs: Any) -> Any:
        return block(self.shape, scanned, **kwargs)


def jstrategy_side(shape: MoEShape, layout: str, scan: str, rows: np.ndarray) -> mc.Side:
    experts = LAYOUTS[layout]
    strategy = jstrategy.experimental.FSDPStrategy(experts=experts)
    return mc.jstrategy_side(
        shape, layout, scan, rows, model=Decoder(shape, scan), strategy=strategy
    )


# The MaxText side ------------------------------------------------------------------------
def maxtext_overrides(shape: MoEShape, layout: str, scan: str, batch: int) -> list[str]:
    """`mc.maxtext_overrides`' FSDP row, with Mixtral's layer, the experts and the layout."""
    settings = dict(item.split("=", 1) for item in mc.maxtext_overrides(shape, "fsdp", scan, batch))
    experts = LAYOUTS[layout]
    settings.update(
        decoder_block="mixtral",
        base_num_kv_heads=str(shape.kv_heads),
        num_experts=str(shape.experts),
        base_moe_mlp_dim=str(shape.mlp),
        num_experts_per_tok=str(shape.top_k),
        sparse_matmul="false",
        megablox="false",
        capacity_factor=str(shape.capacity_factor),
        load_balance_loss_weight=str(LOAD_BALANCE),
        ici_expert_parallelism=str(experts),
        ici_fsdp_parallelism=str(jax.device_count() // experts),
    )
    return [f"{key}={value}" for key, value in settings.items()]


def maxtext_side(shape: MoEShape, layout: str, scan: str, rows: np.ndarray) -> mc.Side:
    found: dict[str, Any] = {}

    def keep(model: Any, mesh: Any, rules: Any) -> None:
        from flax import nnx
        from maxtext.layers.moe import RoutedMoE

        blocks = [node for _, node in nnx.iter_graph(model) if isinstance(node, RoutedMoE)]
        found.update(block=blocks[0], mesh=mesh, rules=rules)
        print("  MaxText mesh:", {k: v for k, v in mesh.shape.items() if v > 1}, flush=True)

    overrides = maxtext_overrides(shape, layout, scan, len(rows))
    side = mc.maxtext_side(shape, layout, scan, rows, overrides=overrides, inspect=keep)
    (ours, theirs), (our_loss, their_loss) = routed_on_the_same_logits(shape, scan, rows, **found)
    side.note = (
        f"dropped at {shape.capacity_factor}: jstrategy {100 * ours:.2f}%, "
        f"MaxText {100 * theirs:.2f}%; load-balance term {our_loss:.6f} / {their_loss:.6f}"
    )
    return side


# The dropped fractions -------------------------------------------------------------------
def routed_on_the_same_logits(
    shape: MoEShape, scan: str, rows: np.ndarray, *, block: Any, mesh: Any, rules: Any
) -> tuple[tuple[float, float], tuple[float, float]]:
    """((jstrategy's, MaxText's) fraction of assignments dropped on `rows`, (their
    load-balancing terms in the loss)), each side's by its own code on the same router
    logits: jstrategy's model at its initial weights (module docstring)."""
    from flax.core.spmd import logical_axis_rules

    model = Decoder(shape, scan)
    tokens = jnp.asarray(rows[:, :-1])
    variables = model.init(jax.random.key(0), tokens[:1])
    _, state = model.apply(variables, tokens, mutable=["intermediates", "losses"])
    ours = moe_dropped_fraction(state["intermediates"])
    our_loss = float(sum(jnp.sum(leaf) for leaf in jax.tree.leaves(state["losses"])))
    logits = []
    for path, h in jax.tree_util.tree_leaves_with_path(state["intermediates"]):
        keys = [getattr(k, "key", None) for k in path]
        if "moe_input" in keys:
            layer = variables["params"][keys[keys.index("moe_input") - 1]]
            router = nn.unbox(layer["MoeBlock_0"]["router"])
            # Scanned: [layers, rows, seq, d] and [layers, d, E]: the layers become rows
            # (each routed on its own, on both sides).
            z = jnp.einsum("...bsd,...de->...bse", h, router)
            logits.append(z.reshape(-1, tokens.shape[1], shape.experts))
    z = jnp.concatenate(logits)  # [layers * rows, seq, E]
    with jax.set_mesh(mesh), logical_axis_rules(rules):
        weights, indices = block.get_topk(z, None)
        dispatch, _ = block.generate_masks(
            indices, block.reshape_and_update_weights(weights, indices)
        )
        # Its mean over the rows here is its mean over the layers of each layer's mean.
        their_loss = float(block.load_balance_loss(indices, jax.nn.softmax(z, axis=-1)))
    theirs = 1 - float(jnp.sum(dispatch)) / indices.size
    return (ours, theirs), (our_loss, their_loss)
