"""The per-rank entry point of `harness serve`: `python -m harness.serve.worker CONFIG_JSON`, started by
torchrun (or directly at world size 1). Builds the engine, then rank 0 serves HTTP and leads the engine
loop while the other ranks follow it in lockstep."""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.core.errors import ConfigError, HarnessError, RunError
from harness.core.limits import COLLECTIVE_TIMEOUT_S
from harness.core.verdict import ExitCode
from harness.engine.faults import fault_flags
from harness.engine.runtime.construct import build_engine
from harness.engine.runtime.engine import Engine
from harness.engine.runtime.parallel import ParallelState
from harness.engine.speculative.decoding import SpeculativeDecoder
from harness.engine.speculative.speculator import Speculator
from harness.formats.weights import weights_hash
from harness.records.rankreport import entry_json
from harness.serve.dialects import Limits, Vocabulary
from harness.serve.executor import execute
from harness.serve.listen import ListenError, address, bind_socket
from harness.serve.lockstep import Executor, Lockstep
from harness.serve.pd import DecodeServer, PrefillServer
from harness.serve.protocol import check_pd_role
from harness.specs.model import ModelSpec, model_from_dict
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings
from harness.specs.topology import Topology

DEFAULT_MAX_LOGPROBS = 20
KV_LOG_PREFIX = "harness-serve KV cache:"  # engines/harness-serve.yaml parses this line


def kv_capacity_line(engine: Engine, speculator: Speculator | None) -> str:
    """The startup line giving this rank's KV capacity from the pools it really allocated, as vLLM logs
    'KV cache size: N tokens': tokens a sequence pool holds (blocks x block_size x dcp: under DCP each rank
    stores 1/dcp of every sequence, counted as vLLM does), the target pool's blocks, and the bytes of every
    KV pool of the rank (the speculator's pool draws on the same memory)."""
    cache = engine.cache
    spec_bytes = speculator.cache.pool_bytes if speculator is not None else 0
    return (f"{KV_LOG_PREFIX} blocks={cache.capacity.blocks} block_size={cache.block_size} "
            f"tokens={cache.capacity.blocks * cache.block_size * engine.state.dcp} "
            f"bytes={cache.pool_bytes + spec_bytes} (per rank: target {cache.pool_bytes} bytes, "
            f"speculator {spec_bytes} bytes)")


@dataclass(frozen=True)
class ServeConfig:
    """What `harness serve` hands every rank (as JSON on its command line: to_json / from_json)."""

    model: ModelSpec
    topology: Topology
    host: str = "127.0.0.1"
    port: int = 8000
    fault: str | None = None
    dtype: str | None = None
    pool: PoolSettings = PoolSettings()
    device: str = "cpu"
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    served_model_name: str = ""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    speculative: SpeculativeSettings = SpeculativeSettings()
    pd_role: str = ""   # a disaggregated topology: "prefill" or "decode" (harness/serve/pd.py)
    pd_store: str = ""  # ... the KV store folder both servers share

    @property
    def world(self) -> Topology:
        """The layout this server's ranks run: the prefill side's for a prefill server, else the topology's."""
        if self.pd_role == "prefill" and self.topology.prefill is not None:
            return self.topology.prefill
        return self.topology

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(model=self.model.to_dict(), topology=self.topology.to_dict(), pool=self.pool.to_dict(),
                    speculative=self.speculative.to_dict())
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "ServeConfig":
        data = json.loads(text)
        model = model_from_dict("serve", data.pop("model"))
        topology = Topology.from_dict(data.pop("topology"), where="serve topology")
        pool = PoolSettings.from_dict(data.pop("pool"), where="serve pool")
        speculative = SpeculativeSettings.from_mapping(data.pop("speculative"), "serve speculative")
        return cls(model=model, topology=topology, pool=pool, speculative=speculative, **data)


def _serve_http(lockstep: Lockstep, sock: socket.socket, app: Any) -> None:
    """Rank 0: uvicorn in a thread on the socket bound at startup, the engine loop on the main thread until
    SIGTERM / SIGINT. An HTTP server that ends on its own (it failed) stops the loop too, and is a RunError."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=2))
    where = address(*sock.getsockname()[:2])
    failed: list[BaseException] = []

    def http() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # SystemExit included: uvicorn exits on a startup failure
            failed.append(exc)
        finally:
            if not server.should_exit:  # not asked to stop: no requests can come any more
                failed.append(RuntimeError("the HTTP server stopped"))
                lockstep.stop()

    thread = threading.Thread(target=http, name="http", daemon=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: lockstep.stop())
    thread.start()
    print(f"harness-serve listening on http://{where}", flush=True)
    try:
        lockstep.lead()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
    if failed:
        raise RunError(f"the HTTP server on {where} failed: {failed[0]!r}")


def _listen(state: ParallelState, config: ServeConfig) -> tuple[socket.socket | None, bool]:
    """Rank 0 binds the server's address before the engine is built: (its socket, True) on rank 0, (None,
    True) on the others. A failure (port taken, unknown host) is one ListenError on rank 0 and (None, False)
    on every other rank, all after tearing down the process group: every rank stops."""
    sock, error = None, None
    if state.rank == 0:
        try:
            sock = bind_socket(config.host, config.port)
        except ListenError as exc:
            error = str(exc)
    error = state.gather_objects(error)[0]  # every rank learns rank 0's outcome
    if error is None:
        return sock, True
    state.shutdown()
    if state.rank == 0:
        raise ListenError(error)
    return None, False


def _executor(config: ServeConfig, engine: Engine, eos_id: int | None,
              decoder: SpeculativeDecoder | None) -> Executor:
    """What runs a batch: the plain executor, or a P/D side's (harness/serve/pd.py)."""
    if config.pd_role == "prefill":
        side = PrefillServer(engine, Path(config.pd_store), fault_flags(config.fault, config.topology))
        return lambda batch, abandoned: side.execute(batch, eos_id, abandoned)
    if config.pd_role == "decode":
        pd = plan_model(model_of(config.model), config.topology).pd
        assert pd is not None  # a disaggregated topology (check_pd_role)
        decode = DecodeServer(engine, pd, Path(config.pd_store))
        return lambda batch, abandoned: decode.execute(batch, eos_id, abandoned)
    return lambda batch, abandoned: execute(engine, batch, eos_id, decoder, abandoned)


def serve(config: ServeConfig) -> None:
    from harness.serve.app import build_app  # FastAPI only where it is used

    topo = config.topology
    check_pd_role(config.pd_role, config.pd_store, topo.prefill is not None, topo.name)
    world = config.world
    state = ParallelState.from_launcher(world.tp, world.dcp, config.device, config.collective_timeout_s)
    sock, listening = _listen(state, config)
    if not listening:
        return
    if state.rank > 0:  # followers stop when rank 0 says so; a signal must not leave rank 0 mid-collective
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    spec = config.model
    settings = config.speculative
    # a prefill server runs the prefill layout with a correct model (the fault acts on the transfer: its flags)
    prefill = config.pd_role == "prefill"
    built = build_engine(state, spec, world, None if prefill else config.fault, config.pool, config.dtype, settings)
    engine, tokenizer, weights, speculator = built.engine, built.tokenizer, built.weights, built.speculator
    decoder = SpeculativeDecoder(engine, speculator, settings.k) if speculator is not None else None
    lockstep = Lockstep(state, _executor(config, engine, tokenizer.eos_id, decoder))
    layouts = state.gather_objects(engine.layout_report())
    threads = state.gather_objects(torch.get_num_threads())  # every rank's intra-op threads, rank order
    if state.rank == 0:
        pool = engine.pool
        print(kv_capacity_line(engine, speculator), flush=True)
        name = config.served_model_name or spec.name
        info = {"engine": "harness-serve", "model": spec.to_dict(), "topology": topo.to_dict(), "fault": config.fault,
                "weights_hash": weights_hash(weights), "layout": entry_json(layouts, pool.to_dict()),
                "threads_per_rank": threads, "collectives": state.collectives_path}
        limits = Limits(vocab=spec.vocab, max_model_len=pool.max_seq_len, max_logprobs=config.max_logprobs)
        vocab = Vocabulary(encode=tokenizer.encode, decode=tokenizer.decode)
        assert sock is not None
        greedy_only = (f"a disaggregated {config.pd_role} server" if config.pd_role
                       else "a speculative server" if decoder is not None else "")
        _serve_http(lockstep, sock, build_app(lockstep.inbox.put, vocab, limits, name, info,
                                              Path(config.pd_store) if config.pd_role == "decode" else None,
                                              greedy_only))
    else:
        lockstep.follow()
    state.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m harness.serve.worker CONFIG_JSON", file=sys.stderr)
        return 2
    try:
        serve(ServeConfig.from_json(args[0]))
    except HarnessError as exc:  # one line, as the CLI prints it (also when this runs as a launched rank)
        print(f"harness: error: {exc}", file=sys.stderr, flush=True)
        return ExitCode.USAGE if isinstance(exc, ConfigError) else ExitCode.ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
