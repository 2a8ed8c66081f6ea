"""Communication options for multi-worker collectives, as `tf.distribute.experimental`."""

from __future__ import annotations

import dataclasses
import enum

from jstrategy._src.reduce_util import enum_from_value

__all__ = [
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "check_communication_options",
]


class CommunicationImplementation(enum.Enum):
    """Which collective implementation multi-worker all-reduces use.

    ``AUTO`` lets XLA choose; ``RING`` is a reduce-scatter followed by an all-gather;
    ``NCCL`` is the platform's all-reduce (NCCL on GPUs, gloo on CPUs).

    Example:

    >>> from jstrategy.experimental import CollectiveCommunication, CommunicationImplementation
    >>> CollectiveCommunication is CommunicationImplementation, CollectiveCommunication("RING")
    (True, <CommunicationImplementation.RING: 'RING'>)
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    @classmethod
    def from_value(cls, value: CommunicationImplementation | str) -> CommunicationImplementation:
        """Coerces a member or its name (any case) to a member.

        Raises:
          ValueError: if `value` names no implementation.
        """
        return enum_from_value(cls, value, argument="implementation")


#: TF's older name for `CommunicationImplementation`, kept for ported programs.
CollectiveCommunication = CommunicationImplementation


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How multi-worker collectives communicate.

    Args:
      bytes_per_pack: concatenate gradients into buffers of at most this many bytes, one
        collective per buffer; 0 lets XLA pack.
      timeout_seconds: how long any wait on another worker may last before it becomes an
        error instead of a hang: the start-up (every task must arrive within it; the error
        names the missing one), a peer that stops responding (the distributed runtime's
        heartbeat), a collective on CPU that a peer does not join (XLA's
        ``--xla_cpu_collective_timeout_seconds``, so leave room for the workers' skew,
        compilation included), and checkpoints' coordination. None keeps the defaults:
        300 s to start and for checkpoints, 100 s of silence, no bound on collectives.
      implementation: a `CommunicationImplementation` or its name.

    Example:

    >>> CommunicationOptions(implementation="ring").implementation
    <CommunicationImplementation.RING: 'RING'>
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "implementation", CommunicationImplementation.from_value(self.implementation)
        )
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(
                f"`bytes_per_pack` must be a non-negative int; got {self.bytes_per_pack!r}."
            )
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(
                f"`timeout_seconds` must be positive or None; got {self.timeout_seconds!r}. "
                "Pass None for JAX's default heartbeat timeout (100 s)."
            )


def check_communication_options(options: CommunicationOptions | None) -> CommunicationOptions:
    """`options`, or the default `CommunicationOptions()` for None; a `TypeError` otherwise."""
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise TypeError(
            "`communication_options` must be a jstrategy.experimental.CommunicationOptions; "
            f"got {type(options).__name__}."
        )
    return options
