"""python -m megatron_async.serve --model CKPT [--host H] [--port P] [the main job's engine and model flags]

Serves the checkpoint over an OpenAI-compatible HTTP API (see app.py). ``--port 0`` picks a free
port; the line ``megatron_async.serve: serving NAME on http://HOST:PORT`` on stdout says which,
once the server takes requests. The engine runs on a thread of this process; HTTP is served by
``--api-server-count`` front-end processes on this process's listening socket (launch.py), or
with 0 by this process's own event loop. Tensor parallelism: ``torchrun --nproc-per-node T -m
megatron_async.serve --tensor-parallel-size T ...``; rank 0 serves HTTP and the other ranks
follow its engine steps.

Engines behind a data-parallel coordinator (docs/PARALLEL.md): ``--listen tcp://HOST:PORT``
starts a coordinator there and serves this engine through it, ``--join ADDR`` serves this engine
through a running one (either way no HTTP here: clients use ``megatron_async.client``); ``--engine
ADDR`` serves HTTP over the engines of the coordinator at ADDR, with no engine in this process
(``--model`` then names the checkpoint for its tokenizer and chat template only)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megatron_async.cli import flags
from megatron_async.serve.http_guard import add_http_args, policy_from_args, refusal
from megatron_async.serve.chat_output import REASONING_PARSERS, TOOL_CALL_PARSERS, choose_parser
from megatron_async.serve.lora_modules import add_lora_module_args, load_lora_modules, resolve_lora_args

log = logging.getLogger("megatron_async.serve")
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
BODY_SHARE = {"auto": None, "on": True, "off": False}
"""--body-share -> EngineLoop's ``share``."""
DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.5
"""With Python's 5 ms, an engine thread that waited for a device step then waits for the GIL
behind a busy event loop: python -m benchmarks gil-switch (2-core CPU) put its steps 1.6-1.9x
their ideal period apart at 5 ms, 1.1-1.2x at 0.5 ms."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_async.serve", description=__doc__.splitlines()[0],
                                formatter_class=flags.HelpFormatter)
    flags.add_model_args(p)
    flags.add_parallel_args(p)
    flags.add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: all)")
    g.add_argument("--port", type=flags.checked(int, 0, 65535, name="port"), default=8000,
                   help="0 = a free port (printed at start)")
    g.add_argument("--api-server-count", type=flags.checked(int, 0, 64, name="api-server-count"), default=1,
                   help="HTTP front-end processes (uvicorn and the OpenAI API each, on the one port) that hand "
                        "requests to the engine in this process (default 1); 0: serve HTTP from this process's event "
                        "loop, beside the engine thread")
    g.add_argument("--served-model-name", default=None, help="default: the checkpoint directory's name")
    g.add_argument("--seed", type=flags.checked(int, 0, 2**63 - 1), default=0,
                   help="seeds the per-request seeds of requests that give none")
    g.add_argument("--max-request-bytes", type=flags.checked(int, 1, name="max-request-bytes"),
                   default=DEFAULT_MAX_REQUEST_BYTES, help="largest request body taken (HTTP 413 beyond it)")
    g.add_argument("--gil-switch-interval-ms", type=flags.checked(float, 0.01, 100.0, name="gil-switch-interval-ms"),
                   default=DEFAULT_GIL_SWITCH_INTERVAL_MS, help="how long one thread may hold the GIL while "
                   "another waits for it (Python's sys.setswitchinterval; Python's own default is 5 ms). The engine "
                   "thread waits up to this long for the GIL after each step it waited for on the device, while "
                   "a busy event loop writes chunks; python -m benchmarks gil-switch measures the effect")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="server log level")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template that replaces the checkpoint's for /v1/chat/completions and /tokenize "
                        "(e.g. one that renders tools, for a model whose own template does not)")
    g.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *TOOL_CALL_PARSERS],
                   help="reads tool calls out of chat answers to requests with tools (hermes: "
                        "<tool_call>{json}</tool_call>); auto: hermes when the chat template mentions <tool_call>")
    add_lora_module_args(g)
    g.add_argument("--enable-admin-endpoints", action="store_true",
                   help="serve POST /pause_generation, /resume_generation, /update_weights, /suspend, /resume, "
                        "/init_weight_transfer, /update_weights_from_distributed, /update_weights_from_ipc, "
                        "/destroy_weight_transfer, /abort_requests, /v1/load_lora_adapter, /v1/unload_lora_adapter, "
                        "/update_lora_from_distributed, /update_lora_from_ipc "
                        "(for an RL driver; guarded by --admin-api-key, which a host other than loopback needs)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="splits a chat answer's <think>...</think> section into reasoning_content")
    g.add_argument("--body-share", default="auto", choices=["auto", "on", "off"],
                   help="while several request bodies have requests in the engine, each runs at most --max-requests "
                        "/ (their number) of them; its others keep their KV and wait (README, fairness between "
                        "request bodies); auto: on for a CPU engine, whose step time grows with its rows")
    add_http_args(p)
    c = p.add_argument_group("data-parallel coordinator")
    where = c.add_mutually_exclusive_group()
    where.add_argument("--listen", default=None, metavar="ADDR",
                       help="tcp://HOST:PORT (loopback unless MEGATRON_ASYNC_CLIENT_SECRET is set) or ipc://PATH: start "
                            "a coordinator there and serve this engine through it (no HTTP here)")
    where.add_argument("--join", default=None, metavar="ADDR",
                       help="serve this engine through the running coordinator at ADDR (no HTTP here)")
    where.add_argument("--engine", default=None, metavar="ADDR",
                       help="serve HTTP over the engines behind the coordinator at ADDR (no engine in this process)")
    c.add_argument("--engine-name", default=None, help="how the coordinator calls this engine (default host:pid)")
    c.add_argument("--role", default="mixed", choices=["mixed", "prefill", "decode"],
                   help="with --join: this engine computes prompts and decodes them (mixed), or only computes "
                        "prompts and their first token (prefill) or only decodes what a prefill engine hands it "
                        "(decode): docs/DISAGGREGATION.md")
    c.add_argument("--kv-transfer-backend", default=None, choices=["auto", "nccl", "gloo", "ipc"],
                   help="with --role prefill|decode: how KV blocks move between the engines (default: "
                        "InferenceConfig.kv_transfer_backend, auto: nccl on CUDA, gloo on the CPU)")
    c.add_argument("--kv-transfer-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="with --role prefill|decode on CUDA: one Triton launch a side per chunk of blocks "
                        "(InferenceConfig.kv_transfer_kernel, default on)")
    c.add_argument("--kv-send-mid-step", action=argparse.BooleanOptionalAction, default=None,
                   help="with --role prefill: start KV sends while a step runs, not only between steps "
                        "(InferenceConfig.kv_send_mid_step, default on)")
    return p


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).resolve().name if args.model else args.default_model


def resolve_launch_ahead(args: argparse.Namespace) -> None:
    """The HTTP server's own engine on a CPU runs serial steps unless --launch-ahead: a CPU
    computes a launch at once, so launching step N+1 before landing step N overlaps nothing and
    hands N's tokens out a whole step later (docs/PERFORMANCE.md, "One body beside the others":
    a short request behind a big body 0.71 -> 0.54 s, a big body alone 259 -> 275 tok/s). Engines
    served through a coordinator (--listen, --join) keep the engine's default."""
    if args.launch_ahead is None and not (args.listen or args.join) and args.device.startswith("cpu"):
        args.launch_ahead = False


def template_refusal(args: argparse.Namespace) -> str | None:
    """Why ``--chat-template`` cannot be served (None: it can, or none was given)."""
    if args.chat_template is None:
        return None
    from megatron_async.models.chat_template import ChatTemplateError, load_chat_template

    try:
        load_chat_template(args.model, args.chat_template)
    except (OSError, ChatTemplateError, UnicodeDecodeError) as e:
        return f"--chat-template {args.chat_template!r}: {e}"
    return None


def build_state(llm, args: argparse.Namespace):
    from megatron_async.models.chat_template import load_chat_template
    from megatron_async.serve.app import ServerState
    from megatron_async.serve.engine_loop import EngineLoop
    from megatron_async.serve.metrics import ServerMetrics

    name = served_name(args)
    kv_tokens = llm.context.allocator.capacity * llm.config.block_size_tokens
    state = ServerState(
        engine_loop=EngineLoop(llm.engine, ServerMetrics(name), llm.communicator, update_weights=llm.update_weights,
                               share=BODY_SHARE[args.body_share]),
        model_name=name, tokenizer=llm.tokenizer, chat_template=load_chat_template(args.model, args.chat_template),
        max_model_len=min(llm.config.max_sequence_length, kv_tokens), max_requests=llm.config.max_requests,
        max_request_bytes=args.max_request_bytes, admin_endpoints=args.enable_admin_endpoints,
        policy=policy_from_args(args),
    )
    state.tool_call_parser = choose_parser(args.tool_call_parser, state.chat_template)
    state.reasoning_parser = args.reasoning_parser
    if llm.engine.masks.enabled:  # request handlers compile constraints off the engine thread
        state.grammars = llm.engine.masks.grammars
    return state


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """The server; ``own_process``: run as ``python -m megatron_async.serve`` (``flags.own_process``)."""
    args = build_parser().parse_args(argv)
    if why := refusal(args, policy_from_args(args)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    if why := template_refusal(args):
        print(f"error: {why}", file=sys.stderr)
        return 2
    flags.resolve_device_args(args)
    if why := resolve_lora_args(args, served_name(args)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.engine:  # a front-end of the coordinator: no model here, no torch
        from megatron_async.serve.client_loop import serve_over_client

        return serve_over_client(args, served_name(args))
    from megatron_async.cli.main_job import load_llm
    from megatron_async.serve.launch import Serving, serve_until_stopped

    resolve_launch_ahead(args)
    if own_process:
        flags.own_process(args)
    llm = load_llm(args, stream_text=True)  # SSE deltas come from RequestUpdate.new_text
    if why := load_lora_modules(llm, args):  # every rank loads them, before any request
        print(f"error: {why}", file=sys.stderr)
        llm.close()
        return 2
    if args.listen or args.join:
        from megatron_async.dp_engine.join import serve_engine

        return serve_engine(llm, args)
    try:
        if not llm.is_leader:  # tensor parallelism: rank 0 serves, this rank follows its steps
            from megatron_async.dp_engine.engine_ops import follow_rank0

            follow_rank0(llm.engine, llm.communicator, llm.update_weights)
            return 0
        sys.setswitchinterval(args.gil_switch_interval_ms / 1000)
        serving = Serving(build_state(llm, args), args.host, args.port, args.api_server_count, args.log_level)
        return serve_until_stopped(serving, args.host, args.port)
    finally:
        llm.close()


if __name__ == "__main__":
    code = main(own_process=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # all is closed: skip the interpreter's teardown of torch, which takes seconds
