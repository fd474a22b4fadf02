"""`harness serve --model M --topo T [--fault F] [--port P] [--host H]`: the embedded engine behind an
HTTP server in vLLM's OpenAI-compatible dialect (/v1/completions with token-id prompts, prompt_logprobs,
logprobs; /health, /v1/models, /metrics) and SGLang's native /generate. Rank 0 serves; the other ranks
follow in lockstep. Binds 127.0.0.1 unless --host says otherwise; an address it cannot bind is one error
line and exit 2. Stops on SIGTERM / Ctrl-C."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from harness.arch.model import model_of
from harness.arch.plan import plan_model
from harness.cli.checks import bounded_int, positive_int, require_store_folder
from harness.core.errors import ConfigError
from harness.core.limits import MAX_KV_BUDGET_MIB, MAX_SEQ_LEN
from harness.engine.faults import fault_flags
from harness.formats.locate import load_model
from harness.serve.listen import check_listen
from harness.serve.protocol import PD_SERVE_ROLES, check_pd_role
from harness.specs.loader import did_you_mean
from harness.specs.model import DTYPES
from harness.specs.pool import PoolSettings
from harness.specs.speculative import SpeculativeSettings
from harness.specs.topology import load_catalog

MIB = 1024 ** 2
# attention backends: "lse" returns each partial's log-sum-exp (what a DCP merge needs); "no-lse" does not,
# so a DCP topology is refused at startup, as vLLM refuses DCP on a backend without it (its CPU backend)
ATTENTION_BACKENDS: tuple[str, ...] = ("lse", "no-lse")
MAX_LOGPROBS = 1 << 20  # more top-k entries per position than any vocabulary the harness runs
ATTENTION_ENV = "HARNESS_SERVE_ATTENTION_BACKEND"  # the default of --attention-backend (cf. VLLM_ATTENTION_BACKEND)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the embedded engine over HTTP (vLLM / SGLang dialects)",
                       description=__doc__)
    p.add_argument("--model", required=True, help="shipped model name, model spec .yaml, checkpoint or .gguf")
    p.add_argument("--topo", required=True, help="one topology, e.g. tp4dcp4 or tp2-draft")
    p.add_argument("--fault", default=None, help="inject a known layout bug (see `harness list faults`)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: the model's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--kv-budget-mib", type=bounded_int(MAX_KV_BUDGET_MIB, "MiB"), default=256,
                   help="KV pool budget per rank, MiB")
    p.add_argument("--max-seq-len", type=bounded_int(MAX_SEQ_LEN, "tokens"), default=1024,
                   help="tokens per sequence slot (max_model_len)")
    p.add_argument("--max-logprobs", type=bounded_int(MAX_LOGPROBS, "logprobs"), default=20,
                   help="most logprobs a request may ask for")
    p.add_argument("--served-model-name", default="", help="model id in /v1/models (default: the model's name)")
    p.add_argument("--attention-backend", default=os.environ.get(ATTENTION_ENV, "lse"),
                   help=f"lse (default) or no-lse: an attention without log-sum-exp output, which refuses "
                        f"DCP at startup like vLLM's CPU backend (default from ${ATTENTION_ENV})")
    p.add_argument("--spec-k", type=positive_int, default=None, help="draft tokens per verify step (-draft/-mtp)")
    p.add_argument("--pd-role", choices=PD_SERVE_ROLES, default="",
                   help="a disaggregated --topo PREFILL>DECODE: serve its prefill side (prompts' KV into --pd-store) "
                        "or its decode side (generations load it from there); see docs/pd.md")
    p.add_argument("--pd-store", default="", help="the KV store folder the prefill and decode servers share")
    p.set_defaults(func=run)


def refuse_unsupported(attention_backend: str, dcp: int) -> None:
    """A topology this server's attention cannot run is refused at startup in one line."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend {attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
                          f"{did_you_mean(attention_backend, ATTENTION_BACKENDS)} (also ${ATTENTION_ENV})")
    if dcp > 1 and attention_backend == "no-lse":
        raise ConfigError(f"DCP requires an attention backend that returns the softmax LSE for decode, but "
                          f"attention backend no-lse does not (dcp={dcp} refused)")


SERVE_WORKER = "harness.serve.worker"


def torchrun_argv(config_json: str, world_size: int) -> list[str]:
    """torchrun starting every rank of the server (CUDA, or HARNESS_LAUNCHER=torchrun); the ranks write
    to this process's stdout/stderr (the server log)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            "--max-restarts=0", "-m", SERVE_WORKER, config_json]


def _divide_cores(ranks: int) -> None:
    """Give each rank run from this process the intra-op threads a launch gives its ranks (cores //
    ranks; HARNESS_THREADS_PER_PROCESS overrides), unless the environment sets OMP_NUM_THREADS itself:
    forked ranks inherit it, and without it every rank took all the cores."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    from harness.launcher.launch import thread_env

    torch.set_num_threads(int(thread_env(ranks, dict(os.environ))["OMP_NUM_THREADS"]))


def start_ranks(config_json: str, world_size: int, launcher: str) -> int:
    """Run the server's ranks from this process: the worker itself at world size 1, the ranks forked
    from here by the fork launcher, else torchrun replacing this process. In every case signals reach
    the process that stops the ranks. This interpreter has imported torch and the engine already, so
    running in it (not exec'ing a fresh one that imports them again) halves a CPU server's start: tiny-gqa
    at tp1 was ready after ~6 s, about half of it the second `import torch`."""
    sys.stdout.flush()
    if world_size == 1 or launcher == "fork":
        _divide_cores(world_size)
    if world_size == 1:
        from harness.serve.worker import main as worker_main

        return worker_main([config_json])
    if launcher == "fork":
        from harness.launcher.forkrun import launch_ranks

        return launch_ranks(world_size, None, [config_json], SERVE_WORKER)
    argv = torchrun_argv(config_json, world_size)
    os.execv(argv[0], argv)  # torchrun replaces this process: signals reach its agent directly
    return 0  # not reached


def run(args: argparse.Namespace) -> int:
    from harness.serve.worker import ServeConfig

    model = load_model(args.model)
    topos = load_catalog().resolve(args.topo)
    if len(topos) != 1:
        raise ConfigError(f"--topo {args.topo!r} names {len(topos)} topologies; serve takes exactly one")
    topo = topos[0]
    plan_model(model_of(model), topo)  # an impossible layout (of any component) is one clear error
    refuse_unsupported(args.attention_backend, topo.dcp)
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ConfigError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}{did_you_mean(args.dtype, DTYPES)}")
    fault_flags(args.fault, topo)
    check_pd_role(args.pd_role, args.pd_store, topo.prefill is not None, topo.name)
    if args.pd_store:  # a file, or a folder under one, is one error now, not an HTTP 500 at the first request
        require_store_folder(Path(args.pd_store), "--pd-store", writes=args.pd_role == "prefill")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a port number (0..65535)")
    check_listen(args.host, args.port)  # a taken port or a bad host: one line, exit 2, before any rank starts
    config = ServeConfig(model=model, topology=topo, host=args.host, port=args.port,
                         fault=args.fault, dtype=args.dtype, device=args.device,
                         pool=PoolSettings(budget_bytes=args.kv_budget_mib * MIB, max_seq_len=args.max_seq_len),
                         served_model_name=args.served_model_name, max_logprobs=args.max_logprobs,
                         speculative=SpeculativeSettings(k=args.spec_k) if args.spec_k else SpeculativeSettings(),
                         pd_role=args.pd_role, pd_store=str(Path(args.pd_store).resolve()) if args.pd_store else "")
    from harness.launcher.launch import LAUNCHER_ENV, launcher_choice

    world = config.world.tp  # a prefill server's ranks: the prefill layout's
    return start_ranks(config.to_json(), world, launcher_choice(args.device, False, os.environ.get(LAUNCHER_ENV)))
