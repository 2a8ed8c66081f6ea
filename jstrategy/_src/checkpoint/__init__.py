"""Checkpoints that restore under any strategy, built on orbax-checkpoint.

Every checkpoint (a step of a `CheckpointManager`, or a `save_weights` directory) holds two
orbax items:

* ``state``: the pytree, written by orbax's array handlers. Each process writes the shards it
  holds (replicated shards once), so a sharded state is never gathered on one host.
* ``jstrategy``: a small JSON record with one entry per leaf (path, dtype, shape and a
  32-bit fingerprint of its bits, and for a typed PRNG key array, saved as its raw data,
  the key's implementation), the user's metadata and the metrics.

Restoring reads the record first, restores every leaf straight into the layout the target
strategy wants (`_target_sharding`), then recomputes the fingerprints on the devices and
compares them, so a damaged file gives `CheckpointError` rather than wrong weights: orbax
and tensorstore read a checkpoint whose data bytes were overwritten without any error.

Writes are atomic: orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it
when every item is complete, so a process killed mid-write leaves the previous step as the
latest; the next `CheckpointManager` on the directory removes the leftover. Deletions are
atomic too: a step dropped by `max_to_keep` is renamed into ``.jstrategy-deleted`` before
its files are removed (see `Trash`), so a listed step is always a whole one.

One job a module:

* `manager`: `CheckpointManager`, numbered steps in one directory.
* `weights`: `save_weights` and `load_weights`, one checkpoint directory.
* `array_format`: what is written, the ``state`` item and the ``jstrategy`` record.
* `fingerprint`: the 32-bit fingerprint of a leaf's bits.
* `restore_layout`: reading each leaf into a strategy's layout, and checking it.
* `paths`: finding a `Model`'s variables by path in a checkpoint.
* `workers`: a multi-worker job's checkpoints in the chief's directory.
* `errors`: `CheckpointError`, and messages that name the checkpoint and the fix.
* `orbax_compat`: every orbax workaround, with the orbax versions it is for.
"""

from jstrategy._src.checkpoint.errors import CheckpointError
from jstrategy._src.checkpoint.manager import BestMode
from jstrategy._src.checkpoint.manager import CheckpointManager
from jstrategy._src.checkpoint.weights import load_weights
from jstrategy._src.checkpoint.weights import save_weights

__all__ = ["BestMode", "CheckpointError", "CheckpointManager", "load_weights", "save_weights"]
