"""The HTTP API (reference/sglang-http.md): health, generate, info, pause/continue/abort, cache;
weight routes live in weight_routes.py. Also the uvicorn server with SGLang's start-up sequence."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
import uuid
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from rollout.cpu_engine import disagg
from rollout.cpu_engine.engine import SHUTTING_DOWN, STARTING, UNHEALTHY, UP, Engine
from rollout.cpu_engine.faults import Faults
from rollout.cpu_engine.generate_io import GenerateError, parse_generate, render
from rollout.cpu_engine.http_util import add_error_handlers, error, read_json, run_on_scheduler
from rollout.cpu_engine.memory_routes import add_memory_routes
from rollout.cpu_engine.profile_routes import add_profile_routes
from rollout.cpu_engine.sampling import SamplingParams
from rollout.cpu_engine.scheduler import PAUSE_MODES
from rollout.cpu_engine.sequence import Sequence
from rollout.cpu_engine.weight_routes import add_weight_routes

VERSION = "0.1.0-slurmrl-cpu-engine"
READY_LINE = "The server is fired up and ready to roll!"
_WARMUP_TEXT = "The capital city of France is"


class BearerAuth:
    """With --api-key every route needs `Authorization: Bearer KEY` (401 otherwise), except, as in
    SGLang's own middleware, OPTIONS and /health* and /metrics*: sglang-router 0.3.2 probes
    /health without the key even when POST /workers gave it one (it sends it to /server_info)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        exempt = scope.get("method") == "OPTIONS" or scope.get("path", "").startswith(("/health", "/metrics"))
        if scope["type"] == "http" and not exempt:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="slurmrl cpu_engine", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    if engine.args.api_key:
        app.add_middleware(BearerAuth, api_key=engine.args.api_key)
    scheduler = engine.scheduler
    faults = Faults.at_start(engine.args.host, engine.args.port)  # test-only: POST /slurmrl_fault
    faults.add_route(app)
    pd_mode, rooms = engine.args.disaggregation_mode, disagg.Rooms()
    if pd_mode == disagg.PREFILL:
        disagg.BootstrapServer(engine.args.host, engine.args.disaggregation_bootstrap_port, rooms,
                               engine.args.api_key).start()

    async def disaggregated(body: dict[str, Any], seqs: list[Sequence]) -> None:
        """A prefill engine keeps each first token under its room; a decode engine starts after it."""
        where = disagg.bootstraps(body, len(seqs))  # ValueError: a 400
        if pd_mode == disagg.PREFILL:
            disagg.prefill_only(seqs)
            scheduler.submit(seqs)
            await asyncio.wait([asyncio.wrap_future(seq.done) for seq in seqs])
            for seq, (_, _, room) in zip(seqs, where):
                rooms.put(room, disagg.room_payload(seq))
            return
        async with disagg.client_session(engine.args.api_key) as http:  # per request: nothing left open
            payloads = await asyncio.gather(*(disagg.fetch_room(http, *w) for w in where))
        for seq, payload in zip(seqs, payloads):
            disagg.continue_from(seq, payload, scheduler.weight_version)  # DisaggError: a 500
        scheduler.submit(seqs)
        await asyncio.wait([asyncio.wrap_future(seq.done) for seq in seqs])

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        # SGLang's probe: a 1-token generation through the scheduler; healthy if any forward
        # pass ends within the timeout (another request's counts too).
        if engine.status in (STARTING, SHUTTING_DOWN) or engine.released:
            return Response(status_code=503)  # released memory: SGLang ignores the probe (503)
        probe = internal_sequence(engine, f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], max_new_tokens=1)
        progressed = asyncio.wrap_future(scheduler.output_after(time.monotonic()))
        scheduler.submit([probe])
        done, _ = await asyncio.wait({progressed}, timeout=engine.health_timeout_s)
        progressed.cancel()
        scheduler.call(lambda: scheduler.abort(probe.rid, "health check over"))
        if engine.status == SHUTTING_DOWN:
            return Response(status_code=503)
        engine.status = UP if done else UNHEALTHY
        return Response(status_code=200 if done else 503)

    @app.get("/ping")
    async def ping() -> Response:
        return Response(status_code=200 if engine.status == UP else 503)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if engine.status == UP and not engine.paused else 503)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        if (instead := await faults.before_generate()) is not None:
            return instead
        body = await read_json(request)
        try:
            parsed = parse_generate(body, engine.codec, engine.vocab_size, engine.context_len, engine.seeds)
        except GenerateError as err:
            return JSONResponse(err.body, status_code=400)
        if pd_mode != "null":
            if parsed.seqs[0].params.n != 1:
                return error("n > 1 is not supported by a disaggregated engine; send n copies of the prompt")
            try:
                await disaggregated(body, parsed.seqs)
            except ValueError as err:
                return error(str(err))
            except disagg.DisaggError as err:
                return error(str(err), status=500)
        else:
            scheduler.submit(parsed.seqs)
            await asyncio.wait([asyncio.wrap_future(seq.done) for seq in parsed.seqs])
        outputs = [render(seq, engine.codec) for seq in parsed.seqs]
        return JSONResponse(outputs[0] if parsed.single else outputs)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        config = engine.model.config
        return {"model_path": engine.model_path, "served_model_name": engine.args.served_model_name,
                "tokenizer_path": engine.args.tokenizer_path, "is_generation": True,
                "weight_version": scheduler.weight_version, "model_type": config.model_type,
                "architectures": config.architectures}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        # `internal_states` as SGLang nests scheduler state; forward_passes shows batching at work, and
        # memory_usage (on a GPU) what this engine holds there. device: SGLang's --device; a trainer on
        # a GPU forms a gloo update group with a cpu engine, an NCCL one with a cuda engine.
        return {**engine.args.public(), "device": engine.device.name, "model_path": engine.model_path,
                "context_length": engine.context_len, "weight_version": scheduler.weight_version,
                "internal_states": [{**scheduler.stats(), "memory_usage": engine.device.memory_usage()}],
                "version": faults.version or VERSION}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # There is no prefix cache to drop; like SGLang, refuse while requests are in flight.
        queued = await run_on_scheduler(engine, scheduler.queued)
        if queued:
            return PlainTextResponse(f"Cache not flushed: {queued} requests are running or waiting.\n",
                                     status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        mode = (await read_json(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            return error(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await run_on_scheduler(engine, lambda: scheduler.pause(mode))
        engine.paused = True
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation() -> Response:
        await run_on_scheduler(engine, scheduler.resume)
        engine.paused = False
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if abort_all is True:
            await run_on_scheduler(engine, lambda: scheduler.abort(None))
        elif isinstance(rid, str) and rid:
            await run_on_scheduler(engine, lambda: scheduler.abort(rid))
        else:
            return error("give a non-empty rid, or abort_all: true")
        return Response(status_code=200)

    add_weight_routes(app, engine, faults)
    add_memory_routes(app, engine)
    add_profile_routes(app, engine)
    return app


def internal_sequence(engine: Engine, rid: str, prompt: list[int], max_new_tokens: int) -> Sequence:
    return Sequence(rid=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0),
                    generator=torch.Generator(), internal=True)


# Idle keep-alive connections outlive sglang-router's pool idle timeout (50 s). With uvicorn's 5 s
# a request the router sends on a connection the engine is just closing fails ("error sending
# request"): any 5 s pause between rollouts (a supervisor restart, a slow save) dropped engines.
KEEP_ALIVE_S = 75
_ROUTER_GRPC_PROBE = "Invalid HTTP request received."


class EngineServer(uvicorn.Server):
    """uvicorn with SGLang's start-up: the port opens once weights are loaded, /health answers 503
    until a warmup generation went through, then the ready line is printed."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(uvicorn.Config(build_app(engine), host=engine.args.host, port=engine.args.port,
                                        log_level="info", access_log=False, timeout_graceful_shutdown=5,
                                        timeout_keep_alive=KEEP_ALIVE_S))
        # sglang-router probes each new worker over gRPC (an HTTP/2 preface) as well as HTTP; uvicorn
        # would log that preface as "Invalid HTTP request received" at the top of every engine log.
        logging.getLogger("uvicorn.error").addFilter(lambda record: record.getMessage() != _ROUTER_GRPC_PROBE)
        self.engine = engine
        self.warmup_failed = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            threading.Thread(target=self._warm_up, name="cpu-engine-warmup", daemon=True).start()

    def _warm_up(self) -> None:
        engine = self.engine
        if not engine.args.skip_server_warmup:
            warmup = internal_sequence(engine, "WARMUP", engine.codec.encode(_WARMUP_TEXT), max_new_tokens=8)
            engine.scheduler.submit([warmup])
            reason = warmup.done.result().finish_reason
            if reason["type"] == "abort":
                print(f"cpu_engine: error: warmup failed: {reason['message']}", flush=True)
                self.warmup_failed = True
                self.should_exit = True
                return
        if engine.status == STARTING:
            engine.status = UP
            print(READY_LINE, flush=True)

    def handle_exit(self, sig, frame) -> None:
        # End in-flight requests (as aborted) so that uvicorn's graceful shutdown does not wait on
        # them; from a thread, since this runs in a signal handler.
        self.engine.status = SHUTTING_DOWN
        threading.Thread(target=self.engine.scheduler.call,
                         args=(lambda: self.engine.scheduler.abort(None, "the server is shutting down"),),
                         daemon=True).start()
        super().handle_exit(sig, frame)
