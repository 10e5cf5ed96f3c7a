"""Real Ray clusters for tests: nodes started with ``ray start --block`` as separate processes,
robust under load (fresh ports and a retry when a start fails, e.g. on a port another process
took between picking and binding; readiness waited for, not assumed), and stopped precisely:
each node is the process tree of its own ``ray start``, so stopping one never touches another
cluster on the machine (``ray stop`` would stop them all).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from xema_ray.net import free_port

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
#: "1" keeps each cluster's temp dir (its nodes' logs) after ``shutdown`` and says where, to read a failure
KEEP_LOGS_ENV = "XEMA_KEEP_CLUSTER_LOGS"


@dataclass
class Node:
    proc: subprocess.Popen
    args: list[str]
    log: Path
    ports: dict[str, int] = field(default_factory=dict)
    node_id: str | None = None  # the GCS's, once it joined

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


@dataclass
class NodeInfo:
    """A node as the GCS lists it."""

    node_id: str
    alive: bool
    metrics_port: int | None = None  # None: not known (listed through the state API)


def _token_available(env: dict[str, str]) -> bool:
    """Whether Ray started with ``env`` finds an auth token (the variables, else ``~/.ray/auth_token``)."""
    if env.get("RAY_AUTH_TOKEN"):
        return True
    path = env.get("RAY_AUTH_TOKEN_PATH")
    return Path(path).is_file() if path else (Path.home() / ".ray" / "auth_token").is_file()


class LocalCluster:
    """A head and any number of worker nodes on this machine.

    Args:
        env: extra environment for every node (the raylet passes it to workers and actors).
        auth_mode: ``RAY_AUTH_MODE`` of the nodes; None keeps this process's (a driver in this
            process must match the nodes, and Ray reads the mode once, at import). "token" is
            what ``ray job submit`` against a local head needs once ``~/.ray/auth_token`` exists.

    Example::

        cluster = LocalCluster()
        cluster.start_head(num_cpus=2, num_gpus=2)
        cluster.add_node(num_cpus=2, num_gpus=2, resources={"node_b": 1})
        ...
        cluster.shutdown()
    """

    def __init__(self, env: dict[str, str] | None = None, auth_mode: str | None = None) -> None:
        # Ray's unix sockets live under the temp dir and their paths must stay under 108 bytes
        self.temp_dir = Path(tempfile.mkdtemp(prefix="xr-", dir="/tmp"))
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT),
                    **({"RAY_AUTH_MODE": auth_mode} if auth_mode else {}), **(env or {})}
        if auth_mode == "token" and not _token_available(self.env):
            # token mode needs a token: on a machine where no local Ray made ~/.ray/auth_token yet
            # (a fresh CI machine), the cluster gets one of its own, in its temp dir, never in ~
            token = self.temp_dir / "auth_token"
            token.write_text(secrets.token_hex(32))
            token.chmod(0o600)
            self.env["RAY_AUTH_TOKEN_PATH"] = str(token)
        self.head: Node | None = None
        self.workers: list[Node] = []

    @property
    def gcs_address(self) -> str:
        assert self.head is not None
        return f"127.0.0.1:{self.head.ports['gcs']}"

    @property
    def dashboard_url(self) -> str:
        assert self.head is not None
        return f"http://127.0.0.1:{self.head.ports['dashboard']}"

    # ------------------------------------------------------------------ nodes
    def _start(self, args: list[str], ports: dict[str, int], ready: callable, attempts: int, timeout_s: float,
               name: str) -> Node:
        errors = []
        for attempt in range(attempts):
            log = self.temp_dir / f"{name}-{attempt}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", *args], env=self.env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            node = Node(proc, args, log, dict(ports))
            deadline = time.time() + timeout_s
            while time.time() < deadline and proc.poll() is None:
                if ready(node):
                    return node
                time.sleep(0.5)
            errors.append(f"attempt {attempt + 1}: rc={proc.poll()} {log.read_text()[-1500:]}")
            self._kill(node)
            args, ports = self._fresh(args, ports)
        raise RuntimeError(f"`ray start` for {name} failed {attempts} times:\n" + "\n".join(errors))

    @staticmethod
    def _fresh(args: list[str], ports: dict[str, int]) -> tuple[list[str], dict[str, int]]:
        """The same arguments with new port numbers (a collision is the usual failure under load)."""
        new = {k: free_port() for k in ports}
        out = []
        for a in args:
            for k, old in ports.items():
                if a.endswith(f"={old}"):
                    a = a[: -len(str(old))] + str(new[k])
            out.append(a)
        return out, new

    def start_head(self, num_cpus: int, num_gpus: int = 0, dashboard: bool = True, attempts: int = 3,
                   timeout_s: float = 90, resources: dict[str, float] | None = None) -> Node:
        ports = {"gcs": free_port(), "dashboard": free_port(), "agent_http": free_port(), "agent_grpc": free_port(),
                 "metrics": free_port(), "runtime_env": free_port()}
        args = [f"--head", f"--port={ports['gcs']}", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                f"--include-dashboard={'true' if dashboard else 'false'}", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={ports['dashboard']}",
                # the agents' ports default to fixed numbers another local cluster may hold
                f"--dashboard-agent-listen-port={ports['agent_http']}",
                f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--metrics-export-port={ports['metrics']}",
                f"--runtime-env-agent-port={ports['runtime_env']}", f"--temp-dir={self.temp_dir}",
                "--disable-usage-stats"]
        if resources:
            import json

            args.append(f"--resources={json.dumps(resources)}")

        def ready(node: Node) -> bool:
            return self._port_up(node.ports["gcs"]) and (not dashboard or self._port_up(node.ports["dashboard"]))

        self.head = self._start(args, ports, ready, attempts, timeout_s, "head")
        return self.head

    def add_node(self, num_cpus: int, num_gpus: int = 0, resources: dict[str, float] | None = None,
                 attempts: int = 3, timeout_s: float = 90) -> Node:
        """Start a worker node; returns once the GCS lists *this* node alive (see ``add_nodes``)."""
        return self.add_nodes(1, num_cpus, num_gpus, resources, timeout_s=timeout_s, wave=1, attempts=attempts)[0]

    def add_nodes(self, count: int, num_cpus: int, num_gpus: int = 0, resources: dict[str, float] | None = None,
                  timeout_s: float = 180, wave: int = 1, attempts: int = 3) -> list[Node]:
        """Start ``count`` worker nodes, ``wave`` at a time (one by default: on a 2-core machine two
        raylets starting together can each miss Ray's fixed 30 s registration window, and `ray start`
        then exits with "The current node timed out during startup"); returns once the GCS lists each of
        them alive, or raises with each missing node's ``ray start`` output and raylet log.

        A node counts as joined only when the GCS lists a node alive that was not there before it
        started and that has its metrics port — not when the number of alive nodes grew: a node
        killed a moment ago stays listed alive until the GCS's health check gives up on it, and
        counting would miss a new node that joins while the old one is being declared dead (the
        join "failure" this used to report). A node whose ``ray start`` exits or that has not
        joined within ``timeout_s`` is started again on fresh ports, up to ``attempts`` starts."""
        started: list[Node] = []
        while len(started) < count:
            started += self._start_wave(min(wave, count - len(started)), num_cpus, num_gpus, resources,
                                        timeout_s, attempts)
        return started

    def _worker_args(self, num_cpus: int, num_gpus: int, resources: dict[str, float] | None,
                     ) -> tuple[list[str], dict[str, int]]:
        import json

        ports = {"agent_http": free_port(), "agent_grpc": free_port(), "metrics": free_port(),
                 "runtime_env": free_port()}
        args = [f"--address={self.gcs_address}", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                f"--dashboard-agent-listen-port={ports['agent_http']}",
                f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--metrics-export-port={ports['metrics']}",
                f"--runtime-env-agent-port={ports['runtime_env']}", "--disable-usage-stats",
                # every node of this machine writes to the head's session directory, which the
                # head's log monitor already tails: one per node would read (and publish) every
                # file again, once per node (Ray: "only one log monitor ... per physical host")
                "--include-log-monitor=false"]
        if resources:
            args.append(f"--resources={json.dumps(resources)}")
        return args, ports

    def _spawn(self, args: list[str], log: Path, mode: str = "w") -> subprocess.Popen:
        with open(log, mode) as out:
            return subprocess.Popen([str(BIN / "ray"), "start", "--block", *args], env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def _start_wave(self, count: int, num_cpus: int, num_gpus: int, resources: dict[str, float] | None,
                    timeout_s: float, attempts: int) -> list[Node]:
        known = {n.node_id for n in self.node_list()}  # dead or alive: a new node has a new id
        started: list[Node] = []
        deadlines: list[float] = []
        tries = [1] * count
        for i in range(count):
            args, ports = self._worker_args(num_cpus, num_gpus, resources)
            log = self.temp_dir / f"worker{len(self.workers) + i}.log"
            started.append(Node(self._spawn(args, log), args, log, ports))
            deadlines.append(time.time() + timeout_s)
        joined: list[str | None] = [None] * count
        failures: list[str] = []
        while True:
            listed = [n for n in self.node_list() if n.alive and n.node_id not in known]
            for i, node in enumerate(started):
                if joined[i] is None:
                    joined[i] = next((n.node_id for n in listed if n.metrics_port in (None, node.ports["metrics"])
                                      and n.node_id not in joined), None)
                    node.node_id = joined[i]
            if all(joined):
                self.workers.extend(started)
                return started
            for i, node in enumerate(started):
                if joined[i] is not None or (node.proc.poll() is None and time.time() < deadlines[i]):
                    continue
                why = (f"`ray start` exited with {node.proc.returncode}" if node.proc.poll() is not None
                       else f"not listed alive by the GCS within {timeout_s:.0f} s")
                failures.append(f"{node.log.name} attempt {tries[i]} ({why}):\n{self._node_logs(node)}")
                self._kill(node)
                if tries[i] >= attempts:
                    for other in started:
                        self._kill(other)
                    raise RuntimeError(f"a worker node of the local cluster at {self.gcs_address} did not join "
                                       f"after {attempts} starts:\n" + "\n".join(failures))
                tries[i] += 1
                # the usual causes: a port race (fresh ports) or a machine too busy for the raylet to
                # register in Ray's 30 s (a pause lets the start that failed finish dying first)
                time.sleep(5.0 * (tries[i] - 1))
                args, ports = self._fresh(node.args, node.ports)
                with open(node.log, "a") as out:
                    out.write(f"\n--- attempt {tries[i]} on fresh ports ---\n")
                started[i] = Node(self._spawn(args, node.log, "a"), args, node.log, ports)
                deadlines[i] = time.time() + timeout_s
            time.sleep(0.5)

    def _node_logs(self, node: Node) -> str:
        """What a node that did not join said: its ``ray start`` output, and the newest raylet log
        of the cluster's session directory (where a worker node's raylet writes, too)."""
        out = [f"  ray start: {node.log.read_text()[-1200:]}"]
        logs = sorted(self.temp_dir.glob("session_*/logs/raylet*.out"), key=lambda p: p.stat().st_mtime)
        if logs:
            out.append(f"  {logs[-1]}: {logs[-1].read_text(errors='replace')[-1200:]}")
        return "\n".join(out)

    def kill_node(self, node: Node) -> None:
        """SIGKILL a node's processes (the fault: the machine goes away)."""
        self._kill(node, hard=True)
        if node in self.workers:
            self.workers.remove(node)

    def connect(self, attempts: int = 3, **init_kwargs: object) -> None:
        """``ray.init`` this process as a driver of the cluster, tried ``attempts`` times: on a loaded
        2-core machine the head's GCS can miss the driver's first request (``ray.init`` then raises
        "Timed out while waiting for GCS to become available"); raises with every attempt's error."""
        import ray

        errors = []
        for attempt in range(attempts):
            try:
                ray.init(address=self.gcs_address, **init_kwargs)
                return
            except (RuntimeError, ConnectionError, ray.exceptions.RpcError) as e:
                errors.append(f"attempt {attempt + 1}: {e!r}"[:600])
                if ray.is_initialized():
                    ray.shutdown()
                time.sleep(2.0)
        raise RuntimeError(f"ray.init could not connect to the local cluster at {self.gcs_address} "
                           f"in {attempts} attempts:\n" + "\n".join(errors))

    def shutdown(self) -> None:
        for node in [*self.workers, *([self.head] if self.head else [])]:
            self._kill(node)
        self.workers.clear()
        self.head = None
        if os.environ.get(KEEP_LOGS_ENV) == "1":
            print(f"LocalCluster: logs kept in {self.temp_dir} ({KEEP_LOGS_ENV}=1)", file=sys.stderr)
            return
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _kill(node: Node, hard: bool = False) -> None:
        procs = node.tree()
        for p in procs:
            try:
                p.kill() if hard else p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    @staticmethod
    def _port_up(port: int) -> bool:
        import socket

        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def node_list(self) -> list[NodeInfo]:
        """The nodes the GCS lists, dead or alive (through this process's Ray connection when
        there is one, else the state API of the head's dashboard)."""
        import ray

        if ray.is_initialized():
            return [NodeInfo(node_id=n["NodeID"], alive=bool(n["Alive"]), metrics_port=n.get("MetricsExportPort"))
                    for n in ray.nodes()]
        out = subprocess.run([str(BIN / "ray"), "list", "nodes", f"--address={self.dashboard_url}", "--format=json"],
                             env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            return []
        import json

        try:
            return [NodeInfo(node_id=n["node_id"], alive=n["state"] == "ALIVE") for n in json.loads(out.stdout)]
        except (json.JSONDecodeError, KeyError, TypeError):
            return []

    def alive_nodes(self) -> int:
        """Nodes the GCS lists alive."""
        return sum(n.alive for n in self.node_list())
