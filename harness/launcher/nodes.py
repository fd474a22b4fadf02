"""Cells larger than one node: the embedded engine over several machines via torchrun's rendezvous.

`harness run ... --nnodes N --node-rank R --rdzv-endpoint HOST:PORT` runs on every node with the
same arguments but R; `--nnodes env` reads N, R and HOST from the allocation (Slurm's node list, a JobSet's
stable pod hostnames: nodes_from_env), so one command serves every node. A cell whose world size
divides by N runs N x (world / N) ranks: each node
starts its own local ranks, torchrun's TCP-store rendezvous at HOST joins them (node R holds global
ranks R*local .. R*local+local-1, so global rank 0, which writes the artifacts, is on node 0).
Node 0 runs everything else (references, cells that do not divide by N), compares and writes the
report; the other nodes only lend their ranks and write no results. The k-th cell of the plan
rendezvouses on PORT + k, so the agents of consecutive cells never meet a previous cell's store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from harness.core.errors import ConfigError

MULTINODE_ENGINES = ("embedded", "embedded-topk")  # engines this harness launches itself

_ENDPOINT_RE = re.compile(r"^\[?([A-Za-z0-9_.:-]+?)\]?:(\d+)$")


@dataclass(frozen=True)
class Nodes:
    """This machine's place in a multi-node run."""

    nnodes: int
    node_rank: int
    host: str
    port: int
    join_timeout_s: float = 900.0

    def spans(self, world_size: int) -> bool:
        """Whether a cell of `world_size` ranks runs over all the nodes (else on node 0 alone)."""
        return self.nnodes > 1 and world_size % self.nnodes == 0

    def launch(self, index: int) -> NodeLaunch:
        return NodeLaunch(self.nnodes, self.node_rank, self.host, self.port + index, self.join_timeout_s)


@dataclass(frozen=True)
class NodeLaunch:
    """The rendezvous of one launch (one cell) over the nodes."""

    nnodes: int
    node_rank: int
    host: str
    port: int
    join_timeout_s: float

    def torchrun_args(self, world_size: int) -> list[str]:
        """torchrun's arguments for this node's share of `world_size` ranks."""
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}",
                f"--nproc-per-node={world_size // self.nnodes}", "--rdzv-backend=static",
                f"--rdzv-endpoint={self.host}:{self.port}", f"--rdzv-id=harness-{self.port}",
                f"--rdzv-conf=timeout={int(self.join_timeout_s)}"]


def parse_nodes(nnodes: int, node_rank: int, endpoint: str | None, cells: int = 1,
                join_timeout_s: float = 900.0) -> Nodes | None:
    """None for a one-node run; every inconsistent combination is one ConfigError."""
    if nnodes < 1:
        raise ConfigError(f"--nnodes {nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} must be between 0 and --nnodes - 1 = {nnodes - 1}")
    if nnodes == 1:
        if endpoint:
            raise ConfigError("--rdzv-endpoint needs --nnodes > 1")
        return None
    if not endpoint:
        raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, reachable "
                          "from every node)")
    match = _ENDPOINT_RE.match(endpoint.strip())
    if not match or not 1 <= int(match.group(2)) <= 65535 - cells:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT with PORT in 1..{65535 - cells} "
                          f"(this run uses PORT .. PORT+{cells - 1}), e.g. 10.0.0.1:29400")
    return Nodes(nnodes, node_rank, match.group(1), int(match.group(2)), join_timeout_s)


def check_engine(engine: str, nodes: Nodes | None) -> None:
    """Multi-node runs launch the embedded engine; an external engine launches its own nodes."""
    if nodes is not None and engine.split(":", 1)[0] not in MULTINODE_ENGINES:
        raise ConfigError(f"--nnodes {nodes.nnodes} works with the engines {', '.join(MULTINODE_ENGINES)}, not "
                          f"{engine!r}: an external engine's template describes its own multi-node launch")


NODES_ENV = "env"
RDZV_PORT_ENV = "HARNESS_RDZV_PORT"
DEFAULT_RDZV_PORT = 29400


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ('gpu[07-09,12],cpu1' -> 'gpu07'; zero padding kept)."""
    text = nodelist.strip()
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", text)
    if not match or not match.group(1):
        raise ConfigError(f"--nnodes env: SLURM_JOB_NODELIST={nodelist!r} is not a Slurm node list")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "").strip()
    if not text.isdigit():
        raise ConfigError(f"--nnodes env: {name}={text!r} is not a whole number")
    return int(text)


def nodes_from_env(env: Mapping[str, str], cells: int = 1, join_timeout_s: float = 900.0) -> Nodes | None:
    """A multi-node run's place from its allocation instead of a hand-started command per node:

    - Slurm (`srun` in an allocation of N nodes): SLURM_NNODES (or SLURM_JOB_NUM_NODES), SLURM_NODEID, and node 0
      the first host of SLURM_JOB_NODELIST;
    - a JobSet or Indexed Job with stable pod hostnames: JOB_COMPLETION_INDEX is the node rank, HARNESS_NNODES the
      node count, HARNESS_RDZV_HOST node 0's hostname (the template spells it: JOBSET-JOB-0-0.SUBDOMAIN).

    The port is $HARNESS_RDZV_PORT (default 29400). No allocation's variables is one ConfigError."""
    port = _int(env, RDZV_PORT_ENV) if env.get(RDZV_PORT_ENV) else DEFAULT_RDZV_PORT
    if "SLURM_NODEID" in env and ("SLURM_JOB_NODELIST" in env or "SLURM_NODELIST" in env):
        count = "SLURM_NNODES" if "SLURM_NNODES" in env else "SLURM_JOB_NUM_NODES"
        nnodes, rank = _int(env, count), _int(env, "SLURM_NODEID")
        host = first_host(env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"])
    elif "HARNESS_RDZV_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        nnodes, rank = _int(env, "HARNESS_NNODES"), _int(env, "JOB_COMPLETION_INDEX")
        host = env["HARNESS_RDZV_HOST"].strip()
    else:
        raise ConfigError("--nnodes env: no allocation's variables are set (Slurm: SLURM_NODEID, SLURM_NNODES, "
                          "SLURM_JOB_NODELIST; a JobSet: JOB_COMPLETION_INDEX, HARNESS_NNODES, HARNESS_RDZV_HOST)")
    return parse_nodes(nnodes, rank, f"{host}:{port}" if nnodes > 1 else None, cells, join_timeout_s)
