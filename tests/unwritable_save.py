"""Helper for tests/test_checkpoint.py: a process that saves where it cannot write.

Run as ``python tests/unwritable_save.py DIRECTORY MODE`` with DIRECTORY made read-only by
the caller (``chmod 0o555``). Modes:

* ``wait``: ``CheckpointManager(DIRECTORY).save(...)``, then ``wait_until_finished()``;
* ``exit``: the same save, but the program ends without waiting for it;
* ``weights``: ``save_weights(DIRECTORY/weights, ...)``.

It prints ``ERROR <type>: <message>`` for the error it caught, then ``END`` as the last
line of `main`; the caller checks that the process then exits, within a time limit.

Root ignores permission bits (through the capability CAP_DAC_OVERRIDE), so this process
first drops that capability and CAP_DAC_READ_SEARCH from its effective set: the directory
is then read-only for root too. For other users this changes nothing.
"""

import ctypes
import sys

_CAPABILITY_VERSION_3 = 0x20080522
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_permission_override() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    header = _Header(_CAPABILITY_VERSION_3, 0)
    data = (_Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    data[0].effective &= ~((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH))
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


def main(directory: str, mode: str) -> int:
    drop_permission_override()
    import jax.numpy as jnp

    import jstrategy

    state = {"w": jnp.ones(1000)}
    try:
        if mode == "weights":
            jstrategy.save_weights(f"{directory}/weights", state)
        else:
            manager = jstrategy.CheckpointManager(directory)
            manager.save(1, state)
            if mode == "wait":
                manager.wait_until_finished()
    except Exception as e:  # what the user sees
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
    print("END", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
