"""The mesh axis names every strategy lays its devices on: one home for each name.

A strategy's mesh has some of these axes, always under these names, so a variable's
layout, a model's annotation, a batch's split and a layer's collective mean the same axis
whatever strategy made the mesh (MaxText's ``ici_*`` axes and torchtitan's
``ParallelDims`` have one name each too):

* `REPLICA_AXIS`: whole copies of the model (the data axis, `Strategy.axis_name`);
* `FSDP_AXIS`: variables split (ZeRO-3) within a replica, its rows split too;
* `EXPERT_AXIS`: the experts of the expert layers split (`jstrategy.experimental.MoE`), the
  rows split too, as over ``"fsdp"``;
* `CONTEXT_AXIS`: each sequence split (ring attention);
* `TENSOR_AXIS`: layers split Megatron-style, as a `LayoutMap` or annotations say;
* `STAGE_AXIS`: a `Repeated` block's layers split into pipeline stages.

`DATA_AXES` are the names users write for data parallelism in annotations for other meshes
(Flax's guides' ``"data"``, MaxText's ``"fsdp"``, ``"batch"``).

Example:

>>> ROW_AXES
('replica', 'fsdp', 'expert')
"""

from __future__ import annotations

__all__ = [
    "CONTEXT_AXIS",
    "DATA_AXES",
    "EXPERT_AXIS",
    "FSDP_AXIS",
    "REPLICA_AXIS",
    "ROW_AXES",
    "STAGE_AXIS",
    "TENSOR_AXIS",
]

REPLICA_AXIS = "replica"
FSDP_AXIS = "fsdp"
EXPERT_AXIS = "expert"
CONTEXT_AXIS = "context"
TENSOR_AXIS = "tensor"
STAGE_AXIS = "stage"

#: The axes a batch's rows are split over, in this order, where a mesh has them.
ROW_AXES = (REPLICA_AXIS, FSDP_AXIS, EXPERT_AXIS)

#: Data-parallel axis names of annotations written for other meshes.
DATA_AXES = ("data", "fsdp", "batch")
