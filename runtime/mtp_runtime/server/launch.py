"""Wire ServeArgs into a running server: tokenizer, engine thread, app, uvicorn.

uvicorn starts listening before the model is loaded, so /health answers 503
"loading" during a long load (Kubernetes probes see progress, not a refused
connection). On SIGTERM: /health turns 503 "draining", new requests get 503,
in-flight ones get --shutdown_timeout seconds, then are cancelled (which
aborts them in the engine), and the process exits 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading

import uvicorn

from ..signal_stop import SignalStop
from .app import create_app
from .args import ServeArgs, resolve_dtype
from .async_engine import AsyncEngine
from .chat_template import ChatTemplateError, load_chat_template
from .metrics import ServerMetrics
from .request_builder import RequestBuilder

log = logging.getLogger("mtp.serve")

EXIT_LOAD_FAILED = 3


class ServerSetupError(RuntimeError):
    """A model-directory problem found before serving; the message names the file."""


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ServerSetupError(f"{path}: {exc}") from None


def build_request_builder(args: ServeArgs) -> RequestBuilder:
    from tokenizers import Tokenizer

    config = _read_json(os.path.join(args.model, "config.json"))
    tokenizer_path = os.path.join(args.model, "tokenizer.json")
    if not os.path.isfile(tokenizer_path):
        raise ServerSetupError(f"--model: {tokenizer_path} is missing; the server needs the model's tokenizer")
    try:
        tokenizer = Tokenizer.from_file(tokenizer_path)
    except Exception as exc:  # tokenizers raises a bare Exception subclass
        raise ServerSetupError(f"{tokenizer_path}: not a tokenizers file: {exc}") from None
    context = config.get("max_position_embeddings")
    if not isinstance(context, int) or context < 1:
        raise ServerSetupError(f"{args.model}/config.json: max_position_embeddings is missing or not a positive int")
    max_model_len = min(context, args.max_model_len or context)
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ServerSetupError(f"{args.model}/config.json: vocab_size is missing or not a positive int")
    try:
        chat_template = load_chat_template(args.model)
    except ChatTemplateError as exc:
        raise ServerSetupError(str(exc)) from None
    return RequestBuilder(tokenizer, chat_template, max_model_len, vocab_size)


def engine_factory(args: ServeArgs, max_model_len: int):
    def build():
        from mtp_runtime.engine.config import EngineConfig
        from mtp_runtime.engine.llm_engine import LLMEngine

        return LLMEngine(EngineConfig(
            model=args.model, draft_model=args.draft_model,
            num_speculative_tokens=args.num_speculative_tokens,
            device=args.devices[0], dtype=resolve_dtype(args.dtype, args.devices[0]),
            max_memory_utilization=args.max_memory_utilization,
            max_tokens_per_batch=args.max_tokens_per_batch, max_seqs_per_batch=args.max_seqs_per_batch,
            block_size=args.block_size, enable_prefix_cache=args.enable_prefix_cache,
            enable_chunked_prefill=args.enable_chunked_prefill, max_model_len=max_model_len,
            enable_graph=args.enable_graph, aot_step=args.aot_step, speculative_adaptive=args.speculative_adaptive,
            single_thread_tokens=args.single_thread_tokens,
        ))
    return build


class _GracefulServer(uvicorn.Server):
    """uvicorn's own graceful shutdown, plus: refuse new work the moment SIGTERM arrives.

    The drain (`on_exit_signal`) takes the engine's lock, which the main thread may hold where the signal
    interrupts it; so the handler only sets a SignalStop, and the drain runs on a thread of its own."""

    def __init__(self, config: uvicorn.Config, on_exit_signal) -> None:
        super().__init__(config)
        self._exit_signal = SignalStop()
        self._exit_signal.call_when_set(on_exit_signal, name="drain-on-signal")

    def handle_exit(self, sig, frame) -> None:
        self._exit_signal.set()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the signal after a graceful stop, so the process would die of
        # SIGTERM (-15); a pod that drained cleanly should exit 0 instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def serve(args: ServeArgs, log_level: str = "info") -> int:
    group = None
    if args.nnodes > 1:  # multi-node: rank 0 leads the group, the other ranks follow its step plans
        from mtp_runtime.multinode.serve_group import GroupMember, fail_requests_hook, serve_worker

        if args.node_rank != 0:
            return serve_worker(args, log_level)
        group = GroupMember(args)
    builder = build_request_builder(args)
    metrics = ServerMetrics(args.num_speculative_tokens, args.speculative_adaptive)
    build = engine_factory(args, builder.max_model_len)
    engine = AsyncEngine(group.leader_build(build) if group else build, metrics,
                         max_in_flight=args.max_seqs_per_batch + args.max_waiting_requests,
                         node_state=group.state if group else None)
    if group:
        group.on_failure(fail_requests_hook(engine.abort_all))
    health_extra = {"model": args.served_model_name, "num_speculative_tokens": args.num_speculative_tokens,
                    "speculative_policy": "adaptive" if args.speculative_adaptive else "fixed"}
    app = create_app(engine, builder, args.served_model_name, args.model, args.api_key, health_extra,
                     max_request_bytes=args.max_request_bytes)

    def on_exit_signal() -> None:
        if app.state.draining:
            return
        log.info("shutdown requested: no new requests; in-flight ones get %.1fs", args.shutdown_timeout)
        app.state.draining = True
        engine.stop_accepting()
        deadline = threading.Timer(args.shutdown_timeout, engine.abort_all, ("the server is shutting down",))
        deadline.daemon = True
        deadline.start()

    # uvicorn's own deadline is only a backstop: ours ends each response with finish_reason "abort" first.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5.0, lifespan="off")
    server = _GracefulServer(config, on_exit_signal)
    exit_code = {"value": 0}

    def on_load_failure() -> None:
        exit_code["value"] = EXIT_LOAD_FAILED
        server.should_exit = True

    engine.on_load_failure = on_load_failure
    # uvicorn re-raises the signal it handled once it has shut down; with a handler in place
    # (not the default action) that is harmless, and the process exits through the code below.
    signal.signal(signal.SIGTERM, server.handle_exit)
    engine.start()
    try:
        server.run()
    finally:
        engine.shutdown()
        if group:
            group.leave()
    if exit_code["value"]:
        log.error("exiting: the model failed to load: %s", engine.load_error)
    return exit_code["value"]
