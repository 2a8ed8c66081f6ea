"""``python -m jstrategy.launch``: run a multi-worker job as local processes.

See `jstrategy._src.launch.launch` for what it does, or run it with ``--help``.
"""

from jstrategy._src.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
