"""Cells larger than one node: the embedded engine over several machines via torchrun's rendezvous.

`harness run ... --nnodes N --node-rank R --rdzv-endpoint HOST:PORT` runs on every node with the
same arguments but R. A cell whose world size divides by N runs N x (world / N) ranks: each node
starts its own local ranks, torchrun's TCP-store rendezvous at HOST joins them (node R holds global
ranks R*local .. R*local+local-1, so global rank 0, which writes the artifacts, is on node 0).
Node 0 runs everything else (references, cells that do not divide by N), compares and writes the
report; the other nodes only lend their ranks and write no results. The k-th cell of the plan
rendezvouses on PORT + k, so the agents of consecutive cells never meet a previous cell's store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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
