"""How the processes of a multi-worker job meet before JAX's distributed runtime starts.

`jax.distributed.initialize` alone is a poor first contact: a task that never starts makes
every other process wait its `initialization_timeout` (300 s) and then abort (a fatal log,
not a Python error); a coordinator port taken by another program fails with an obscure gRPC
error on one side and the same five-minute abort on the others.

So the processes meet first in a small handshake of their own, on the coordinator's
address: process 0 listens there (which checks at once that the port is free and that the
address is this machine's), every other process connects and says which process it is, and
process 0 answers "go" once all of them are there. Every failure is a
`ClusterStartupError` that names the address, the task concerned and the fix, after at most
`timeout` seconds: a port in use, a task that never comes, two processes claiming the same
task, processes that disagree on the cluster, something other than jstrategy answering on
the port. Only then does `jax.distributed.initialize` run, with every process present.

A connection that does not speak this protocol (a port scanner, a stranger) is dropped and
changes nothing. The handshake adds one TCP round trip to start-up.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import selectors
import socket
import time
from collections.abc import Sequence

__all__ = ["ClusterStartupError", "is_loopback_host", "meet", "split_address"]

_PROTOCOL = "jstrategy-rendezvous/1"
# How long a process that connected waits past its deadline for the coordinator's verdict
# (which the coordinator sends at its own, nearly equal, deadline).
_VERDICT_GRACE_S = 3.0
_RETRY_INTERVAL_S = 0.2
_MAX_LINE = 4096


class ClusterStartupError(RuntimeError):
    """The processes of a multi-worker job could not all start; the message says why.

    A task that never arrives, a port in use, or two processes claiming one task, before
    the job's deadline.

    Example:

    >>> import jstrategy
    >>> issubclass(jstrategy.ClusterStartupError, RuntimeError)
    True
    """


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as ``(host, port)``."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback_host(host: str) -> bool:
    """Whether `host` is ``localhost`` or a loopback address (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolves_to_loopback_only(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(is_loopback_host(a) for a in addresses)


def _task(tasks: Sequence[tuple[str, int, str]], process_id: int) -> str:
    task_type, index, address = tasks[process_id]
    return f"{task_type} {index} ({address})"


def _wait_hint(timeout: float) -> str:
    return (
        f"or wait longer than {timeout:g} s with "
        "jstrategy.experimental.CommunicationOptions(timeout_seconds=...)"
    )


def meet(
    tasks: Sequence[tuple[str, int, str]],
    process_id: int,
    *,
    bind_address: str,
    timeout: float,
) -> None:
    """Returns once every training process has reached this point, or raises.

    Args:
      tasks: every training process as ``(task_type, index, "host:port")``, in process id
        order; process 0 is the coordinator.
      process_id: this process's index in `tasks`.
      bind_address: where process 0 listens (its own address, unless overridden).
      timeout: seconds to wait for all processes.

    Raises:
      ClusterStartupError: if they did not all meet within `timeout`, or cannot.
    """
    deadline = time.monotonic() + timeout
    if process_id == 0:
        _coordinate(tasks, bind_address, deadline, timeout)
    else:
        _join(tasks, process_id, deadline, timeout)


# Process 0 ------------------------------------------------------------------------------
def _listen(tasks: Sequence[tuple[str, int, str]], bind_address: str) -> socket.socket:
    host, port = split_address(bind_address)
    me = _task(tasks, 0)
    others = [address for _, _, address in tasks[1:]]
    remote = [a for a in others if not is_loopback_host(split_address(a)[0])]
    if (
        remote
        and _resolves_to_loopback_only(host)
        and host not in {split_address(a)[0] for a in remote}
    ):
        raise ClusterStartupError(
            f"MultiWorkerMirroredStrategy cannot start: {me} coordinates the job and would "
            f"listen on {bind_address}, but {host!r} is a loopback address on this machine, "
            f"which the tasks on other hosts ({', '.join(remote)}) cannot reach. Name this "
            "task in TF_CONFIG by an address the other hosts reach, or set "
            f"JAX_COORDINATOR_BIND_ADDRESS=<this host's address>:{port}."
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=len(tasks) + 8)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = "that port is in use by another program"
            fix = (
                f"Give {tasks[0][0]} {tasks[0][1]} a free port in TF_CONFIG (`python -m "
                "jstrategy.launch` picks free ones), or stop the program that holds it."
            )
        elif e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
            why = f"this machine has no address {host!r}"
            fix = (
                f"Run {tasks[0][0]} {tasks[0][1]} on the host TF_CONFIG names for it, or set "
                f"JAX_COORDINATOR_BIND_ADDRESS=<an address of this host>:{port}."
            )
        else:
            why = "it cannot listen there"
            fix = "Check the address in TF_CONFIG."
        raise ClusterStartupError(
            f"MultiWorkerMirroredStrategy cannot start: {me} coordinates the job and must "
            f"listen on {bind_address}, but {why} ({type(e).__name__}: {e}). {fix}"
        ) from e


def _coordinate(
    tasks: Sequence[tuple[str, int, str]], bind_address: str, deadline: float, timeout: float
) -> None:
    listener = _listen(tasks, bind_address)
    meeting = _Meeting(tasks)
    try:
        listener.setblocking(False)
        meeting.selector.register(listener, selectors.EVENT_READ)
        while len(meeting.members) < len(tasks) - 1 and meeting.error is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                meeting.error = (
                    f"MultiWorkerMirroredStrategy cannot start: after {timeout:g} s, the "
                    f"coordinator, {_task(tasks, 0)}, has not heard from "
                    f"{', '.join(meeting.missing())}. Start every task of TF_CONFIG's "
                    f"cluster, each with its own task index, check that they can reach "
                    f"{bind_address}, {_wait_hint(timeout)}."
                )
                break
            for key, _ in meeting.selector.select(timeout=min(remaining, 1.0)):
                if key.fileobj is listener:
                    with contextlib.suppress(OSError):
                        conn, _ = listener.accept()
                        meeting.add(conn)
                else:
                    meeting.receive(key.fileobj)  # type: ignore[arg-type]
                if meeting.error is not None:
                    break
        if meeting.error is not None:
            meeting.tell({"error": meeting.error})
            raise ClusterStartupError(meeting.error)
        meeting.tell({"go": True})
        # The others close first, so that the port is free at once for JAX's service.
        for conn in meeting.members.values():
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.settimeout(2.0)
                conn.recv(1)
    finally:
        meeting.close()
        listener.close()


class _Meeting:
    """Process 0's side: the connections, who has said hello, and the first error."""

    def __init__(self, tasks: Sequence[tuple[str, int, str]]):
        self.tasks = tasks
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytes] = {}
        self.members: dict[int, socket.socket] = {}
        # Connections that said hello, members or not: they hear the verdict.
        self.audience: list[socket.socket] = []
        self.error: str | None = None

    def missing(self) -> list[str]:
        return [_task(self.tasks, i) for i in range(1, len(self.tasks)) if i not in self.members]

    def add(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        self.selector.register(conn, selectors.EVENT_READ)
        self.buffers[conn] = b""

    def drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        self.buffers.pop(conn, None)
        if conn in self.audience:
            self.audience.remove(conn)
        for pid, member in list(self.members.items()):
            if member is conn:  # it left before "go" (killed, restarted): wait for it again
                del self.members[pid]
        conn.close()

    def tell(self, message: dict) -> None:
        line = json.dumps(message).encode() + b"\n"
        for conn in self.audience:
            with contextlib.suppress(OSError):
                conn.setblocking(True)
                conn.settimeout(2.0)
                conn.sendall(line)
                conn.setblocking(False)

    def receive(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(_MAX_LINE)
        except OSError:
            data = b""
        if not data:
            self.drop(conn)
            return
        buffer = self.buffers[conn] + data
        self.buffers[conn] = buffer
        if b"\n" not in buffer:
            if len(buffer) > _MAX_LINE:
                self.drop(conn)  # not our protocol
            return
        if conn in self.audience:
            return  # said hello already; nothing else is expected
        try:
            hello = json.loads(buffer.split(b"\n", 1)[0])
        except ValueError:
            hello = None
        if not isinstance(hello, dict) or hello.get("protocol") != _PROTOCOL:
            self.drop(conn)  # a stranger: ignore it
            return
        self.audience.append(conn)
        pid, count, task = hello.get("process_id"), hello.get("num_processes"), hello.get("task")
        if count != len(self.tasks) or not isinstance(pid, int) or not 0 < pid < len(self.tasks):
            self.error = (
                f"MultiWorkerMirroredStrategy cannot start: the processes disagree on the "
                f"cluster: {task} says it is process {pid} of {count}, but the coordinator, "
                f"{_task(self.tasks, 0)}, counts {len(self.tasks)} training processes. Give "
                "every process the same TF_CONFIG cluster."
            )
        elif pid in self.members:
            self.error = (
                f"MultiWorkerMirroredStrategy cannot start: two processes say they are "
                f"{_task(self.tasks, pid)}. Give each process its own task index in TF_CONFIG."
            )
        else:
            self.members[pid] = conn
            self.tell({"waiting_for": self.missing()})

    def close(self) -> None:
        for conn in self.buffers:
            conn.close()
        self.selector.close()


# Other processes -------------------------------------------------------------------------
def _join(
    tasks: Sequence[tuple[str, int, str]], process_id: int, deadline: float, timeout: float
) -> None:
    address = tasks[0][2]
    host, port = split_address(address)
    me, coordinator = _task(tasks, process_id), _task(tasks, 0)
    hello = {"protocol": _PROTOCOL, "process_id": process_id, "num_processes": len(tasks)}
    hello["task"] = me
    last = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ClusterStartupError(
                f"MultiWorkerMirroredStrategy cannot start: {me} could not reach the "
                f"coordinator, {coordinator}, within {timeout:g} s ({last}). Start that task "
                f"(the chief, or worker 0 without a chief), check that this machine reaches "
                f"{address} (TF_CONFIG's address for it, firewalls), {_wait_hint(timeout)}."
            )
        try:
            conn = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
            time.sleep(min(_RETRY_INTERVAL_S, max(0.0, remaining)))
            continue
        with conn:
            try:
                conn.sendall(json.dumps(hello).encode() + b"\n")
                if _await_verdict(conn, deadline, timeout, me, coordinator, address):
                    return
            except OSError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                last = "the coordinator closed the connection"
        time.sleep(min(_RETRY_INTERVAL_S, max(0.0, deadline - time.monotonic())))


def _await_verdict(
    conn: socket.socket, deadline: float, timeout: float, me: str, coordinator: str, address: str
) -> bool:
    """True on "go"; False if the coordinator went away (try again); raises otherwise."""
    # The coordinator listened before this connection, so its own deadline (when it says
    # who is missing) is at most `timeout` from now; it may have started later than this
    # process, so once it has answered, its deadline decides.
    answered_by = deadline + _VERDICT_GRACE_S
    verdict_by = time.monotonic() + timeout + _VERDICT_GRACE_S
    answered = False
    buffer = b""
    while True:
        while b"\n" not in buffer:
            remaining = (verdict_by if answered else answered_by) - time.monotonic()
            if remaining <= 0 and answered:
                raise ClusterStartupError(
                    f"MultiWorkerMirroredStrategy cannot start: {me} reached the coordinator, "
                    f"{coordinator}, but it stopped answering (stopped or overloaded). "
                    f"Restart the job."
                )
            if remaining <= 0:
                raise ClusterStartupError(
                    f"MultiWorkerMirroredStrategy cannot start: {me} connected to {address}, "
                    f"the coordinator's address, but no jstrategy coordinator answered within "
                    f"{timeout:g} s: another program may hold that port. Check that "
                    f"{coordinator} runs and is the only program on that port, "
                    f"{_wait_hint(timeout)}."
                )
            conn.settimeout(min(remaining, 1.0))
            try:
                chunk = conn.recv(_MAX_LINE)
            except TimeoutError:
                continue
            if not chunk:
                return False
            buffer += chunk
            if len(buffer) > _MAX_LINE:
                break
        line, _, buffer = buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise ClusterStartupError(
                f"MultiWorkerMirroredStrategy cannot start: {me} connected to {address}, the "
                f"coordinator's address, and another program answered ({line[:80]!r}). "
                f"Give {coordinator} a free port in TF_CONFIG."
            )
        if message.get("go") is True:
            return True
        if isinstance(message.get("error"), str):
            raise ClusterStartupError(message["error"])
        if isinstance(message.get("waiting_for"), list):
            answered = True
