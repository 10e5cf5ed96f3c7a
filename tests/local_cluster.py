"""Real Ray clusters for tests: nodes started with ``ray start --block`` as separate processes,
robust under load (fresh ports and a retry when a start fails, e.g. on a port another process
took between picking and binding; readiness waited for, not assumed), and stopped precisely:
each node is the process tree of its own ``ray start``, so stopping one never touches another
cluster on the machine (``ray stop`` would stop them all).
"""

from __future__ import annotations

import os
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
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Node:
    proc: subprocess.Popen
    args: list[str]
    log: Path
    ports: dict[str, int] = field(default_factory=dict)

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


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
        """Start a worker node; returns once the GCS lists it alive."""
        import json

        before = self.alive_nodes()
        ports = {"agent_http": free_port(), "agent_grpc": free_port(), "metrics": free_port(),
                 "runtime_env": free_port()}
        args = [f"--address={self.gcs_address}", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                f"--dashboard-agent-listen-port={ports['agent_http']}",
                f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--metrics-export-port={ports['metrics']}",
                f"--runtime-env-agent-port={ports['runtime_env']}", "--disable-usage-stats"]
        if resources:
            args.append(f"--resources={json.dumps(resources)}")
        node = self._start(args, ports, lambda n: self.alive_nodes() > before, attempts, timeout_s,
                           f"worker{len(self.workers)}")
        self.workers.append(node)
        return node

    def add_nodes(self, count: int, num_cpus: int, num_gpus: int = 0, resources: dict[str, float] | None = None,
                  timeout_s: float = 180, wave: int = 2) -> list[Node]:
        """Start ``count`` worker nodes, ``wave`` at a time (a wave starts in the time of one node;
        more at once can overload the GCS of a busy machine); returns once the GCS lists them all
        alive. A node whose ``ray start`` fails is started again on fresh ports, twice at most."""
        started: list[Node] = []
        while len(started) < count:
            started += self._start_wave(min(wave, count - len(started)), num_cpus, num_gpus, resources, timeout_s)
        return started

    def _start_wave(self, count: int, num_cpus: int, num_gpus: int, resources: dict[str, float] | None,
                    timeout_s: float) -> list[Node]:
        import json

        before = self.alive_nodes()
        started: list[Node] = []
        for i in range(count):
            ports = {"agent_http": free_port(), "agent_grpc": free_port(), "metrics": free_port(),
                     "runtime_env": free_port()}
            args = [f"--address={self.gcs_address}", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                    f"--dashboard-agent-listen-port={ports['agent_http']}",
                    f"--dashboard-agent-grpc-port={ports['agent_grpc']}", f"--metrics-export-port={ports['metrics']}",
                    f"--runtime-env-agent-port={ports['runtime_env']}", "--disable-usage-stats"]
            if resources:
                args.append(f"--resources={json.dumps(resources)}")
            log = self.temp_dir / f"worker{len(self.workers) + i}.log"
            with open(log, "w") as out:
                proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", *args], env=self.env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            started.append(Node(proc, args, log, ports))
        deadline = time.time() + timeout_s
        retries = [0] * count
        while time.time() < deadline:
            if self.alive_nodes() >= before + count:
                self.workers.extend(started)
                return started
            for i, node in enumerate(started):
                if node.proc.poll() is not None and retries[i] < 2:  # a port race or a start timeout: again
                    retries[i] += 1
                    self._kill(node)
                    args, ports = self._fresh(node.args, node.ports)
                    with open(node.log, "a") as out:
                        proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", *args], env=self.env,
                                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                    started[i] = Node(proc, args, node.log, ports)
            time.sleep(0.5)
        for node in started:
            self._kill(node)
        logs = "\n".join(f"{n.log.name}: {n.log.read_text()[-800:]}" for n in started)
        raise RuntimeError(f"{count} nodes did not all join within {timeout_s:.0f} s:\n{logs}")

    def kill_node(self, node: Node) -> None:
        """SIGKILL a node's processes (the fault: the machine goes away)."""
        self._kill(node, hard=True)
        if node in self.workers:
            self.workers.remove(node)

    def shutdown(self) -> None:
        for node in [*self.workers, *([self.head] if self.head else [])]:
            self._kill(node)
        self.workers.clear()
        self.head = None
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

    def alive_nodes(self) -> int:
        """Nodes the GCS lists alive (through this process's Ray connection when there is one)."""
        import ray

        if ray.is_initialized():
            return sum(1 for n in ray.nodes() if n["Alive"])
        out = subprocess.run([str(BIN / "ray"), "list", "nodes", f"--address={self.dashboard_url}", "--format=json",
                              "--filter", "state=ALIVE"], env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            return -1
        import json

        try:
            return len(json.loads(out.stdout))
        except json.JSONDecodeError:
            return -1
