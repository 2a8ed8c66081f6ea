"""``python -m jstrategy.launch``: run a multi-worker job as local processes.

``python -m jstrategy.launch --num_workers N [--devices_per_worker D] [--chief]
[--timeout SECONDS] script.py [script args]`` starts the workers with ``TF_CONFIG`` set on
free ports of 127.0.0.1, prefixes their output with ``[worker-<i>]``, and stops all of them
(SIGTERM, then SIGKILL) when one fails, on Ctrl-C, or after the timeout. ``--help`` says
more.
"""

from jstrategy._src.cluster.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
