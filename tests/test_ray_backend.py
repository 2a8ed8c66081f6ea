"""ParameterServerStrategy(backend="ray") on one machine listens on loopback only."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiprocess

# Started in a fresh process: the Ray instance must be the one the backend starts.
_PROGRAM = """
import warnings
warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
import jax.numpy as jnp
import psutil
import jstrategy
from jstrategy.coordinator import ClusterCoordinator, local_cluster_resolver

strategy = jstrategy.ParameterServerStrategy(
    local_cluster_resolver(num_workers=2, num_ps=1), backend="ray"
)
coordinator = ClusterCoordinator(strategy)
variables = strategy.create_variables({"w": jnp.ones(3)})
total = coordinator.schedule(lambda: variables.read()["w"].sum())
assert float(total.fetch(timeout=120)) == 3.0
me = psutil.Process()
for proc in [me, *me.children(recursive=True)]:
    for conn in proc.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN:
            print("LISTEN", proc.pid, proc.name(), conn.laddr.ip, conn.laddr.port, flush=True)
coordinator.shutdown()
strategy._backend.shutdown()
"""


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


@pytest.mark.timeout(240)
def test_a_local_ray_backend_listens_on_loopback_only():
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TF_CONFIG")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    listeners = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("LISTEN")]
    print("listeners:", listeners)
    # GCS, raylet, agents, the driver's and the actors' workers.
    assert len(listeners) >= 5, done.stdout
    assert all(_is_loopback(ip) for _, _, ip, _ in listeners), listeners
