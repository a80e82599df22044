"""Weight routes: from disk, over a gloo or NCCL group (init/begin/update/end/destroy), by reference from
a trainer on the same GPU or node (/update_weights_from_tensor), the version tag, and reading a
parameter back. Every update answers {"success", "message"}: 200 or 400.

A distributed bucket is answered once it is received (every receive queued before any is waited on)
and checked against the model; it loads in the background (BucketLoads) while the trainer sends the
next, and the versioned last bucket answers once every bucket has loaded.

/update_weights_from_distributed takes SGLang's `load_format` (SGLang >= the release with PR #13824,
ModelRunner._update_bucketed_weights_from_distributed):
- absent or null: one broadcast per tensor, in the order of `names` (SGLang's default);
- "flattened_bucket": ONE broadcast of a uint8 buffer of every tensor's bytes back to back in the
  order of `names`, each then viewed as its dtype and shape (SGLang's FlattenedTensorBucket; mixed
  dtypes allowed, no padding: rollout/weight_group.py).
Any other value is refused (400) before anything is received. SGLang itself would receive per
tensor for an unknown value; the stand-in is stricter, so that a trainer's misspelt format fails
here instead of hanging the group on a real engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeGuard

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout.cpu_engine.engine import Engine
from rollout.cpu_engine.faults import FAIL, Faults
from rollout.cpu_engine.http_util import BodyError, EarlyResponse, error, read_json, run_on_scheduler
from rollout.cpu_engine.weights import WeightError, copy_plan, load_into, plan_load, read_safetensors_folder
from rollout.tensor_handles import TensorHandleError, deserialize, reconstruct
from rollout.weight_group import FLATTENED_BUCKET, WeightSyncError, create_group, parse_dtype

DEFAULT_GROUP = "weight_update_group"
DISTRIBUTED_FORMATS = (None, FLATTENED_BUCKET)  # /update_weights_from_distributed's load_format


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class BucketLoads:
    """The buckets of one distributed update, loaded in order in the background: the engine answers a
    bucket once it is received and checked, so the trainer's next bucket arrives while this one loads.
    The first failure is kept (later buckets are then not loaded) for the call that settles them."""

    def __init__(self) -> None:
        self._tail: asyncio.Task[None] | None = None
        self._failure: str | None = None

    def add(self, load: Callable[[], Awaitable[None]]) -> None:
        previous = self._tail

        async def after_previous() -> None:
            if previous is not None:
                await previous
            if self._failure is None:
                try:
                    await load()
                except WeightError as err:
                    self._failure = str(err)
        self._tail = asyncio.create_task(after_previous())

    async def settle(self) -> str | None:
        """Wait for every bucket added; the first failure, or None (and start afresh)."""
        if self._tail is not None:
            await self._tail
        failure, self._tail, self._failure = self._failure, None, None
        return failure


def outside_update(route: str) -> JSONResponse:
    """A bucket sent outside an update: SGLang (since 0.5.23) takes them only inside one."""
    return _result(False, f"{route} must sit between /begin_weight_update and /end_weight_update")


def add_weight_routes(app: FastAPI, engine: Engine, faults: Faults) -> None:
    scheduler = engine.scheduler
    group_lock = asyncio.Lock()  # one group operation at a time: they share the trainer's stream
    bucket_loads = BucketLoads()

    async def weight_body(request: Request) -> dict[str, Any]:
        """The JSON body; a bad one ends the route in the weight routes' {"success": false} shape."""
        try:
            return await read_json(request)
        except BodyError as err:
            raise EarlyResponse(_result(False, str(err))) from None

    async def apply(tensors: dict, complete: bool, version: Any) -> JSONResponse | None:
        """Load on the scheduler thread once no request runs (or generation is paused)."""
        def load() -> None:
            load_into(engine.model, tensors, complete=complete)
            if version is not None and not faults.version_stuck:
                scheduler.weight_version = version
        try:
            await run_on_scheduler(engine, load, needs_idle=True)
        except WeightError as err:
            return _result(False, f"Failed to update weights: {err}; the previous weights are kept.")
        return None

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await weight_body(request)
        path, version = body.get("model_path"), body.get("weight_version")
        if not isinstance(path, str) or not path:
            return _result(False, "model_path (an HF safetensors folder) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return _result(False, f"load_format {body['load_format']!r} is not supported; use auto or safetensors")
        if version is not None and not isinstance(version, str):
            return _result(False, "weight_version must be a string")
        if faults.update == FAIL:
            return _result(False, "Failed to update weights: the engine's test fault (slurmrl_fault update fail)")
        if body.get("abort_all_requests", False):
            await run_on_scheduler(engine, lambda: scheduler.abort(None, "aborted for a weight update"))
        try:
            tensors = await asyncio.to_thread(read_safetensors_folder, path)
        except WeightError as err:
            return _result(False, f"Failed to update weights: {err}; the previous weights are kept.")
        failed = await apply(tensors, complete=True, version=version)
        if failed:
            return failed
        engine.model_path = path
        return _result(True, "Succeeded to update model weights.")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await weight_body(request)
        address, port = body.get("master_address"), body.get("master_port")
        offset, world = body.get("rank_offset"), body.get("world_size")
        name = body.get("group_name", DEFAULT_GROUP)
        if not (isinstance(address, str) and address and _is_int(port) and _is_int(offset) and _is_int(world)
                and isinstance(name, str) and name):
            return _result(False, "need master_address (str), master_port, rank_offset, world_size (ints) "
                                  "and a group_name")
        # On the CPU always gloo, whatever `backend` asked for (nccl needs GPUs); on a GPU what was asked.
        backend = engine.device.update_backend(body.get("backend"))
        async with group_lock:
            if name in engine.groups:
                return _result(False, f"group {name!r} already exists; destroy it first")
            try:
                # This process is rank 0 of its engine; node rank R joins as offset + R (node_link.py).
                engine.tell_followers("join", master_address=address, master_port=port, rank_offset=offset,
                                      world_size=world, group_name=name)
                engine.groups[name] = await asyncio.to_thread(create_group, address, port, offset, world, name,
                                                              engine.args.weight_update_group_timeout, backend)
            except WeightSyncError as err:
                return _result(False, str(err))
        # One line per group joined: which transport the weights take, and when (a rebuilt group is a new line).
        print(f"cpu_engine joined weight update group {name} backend={backend} rank={offset} world_size={world}",
              flush=True)
        return _result(True, f"Succeeded to initialize custom process group {name!r} ({backend}).")

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> JSONResponse:
        body = await weight_body(request)
        if body.get("selector", "all") != "all":
            return _result(False, f"selector {body['selector']!r} is not supported; use all")
        if engine.weight_update_open:
            return _result(False, "a weight update is already open; call /end_weight_update first")
        engine.weight_update_open = True
        # New requests wait from now on; running ones finish first (unless generation is paused).
        await run_on_scheduler(engine, lambda: scheduler.hold_admission(+1))
        await run_on_scheduler(engine, lambda: None, needs_idle=True)
        return _result(True, "Weight update begun; new requests wait until /end_weight_update.")

    @app.post("/end_weight_update")
    async def end_weight_update() -> JSONResponse:
        if not engine.weight_update_open:
            return _result(False, "no weight update is open; call /begin_weight_update first")
        failure = await bucket_loads.settle()  # new requests must meet whole buckets
        await run_on_scheduler(engine, lambda: scheduler.hold_admission(-1))
        engine.weight_update_open = False
        if failure:
            return _result(False, f"Weight update ended; a bucket failed to load: {failure}")
        return _result(True, "Weight update ended.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await weight_body(request)
        if not engine.weight_update_open:
            return outside_update("update_weights_from_distributed")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        name, version = body.get("group_name", DEFAULT_GROUP), body.get("weight_version")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and all(isinstance(n, str) for n in names)
                and all(isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in shapes)):
            return _result(False, "names, dtypes and shapes must be lists of the same length "
                                  "(strings, dtype names, lists of sizes)")
        if version is not None and not isinstance(version, str):
            return _result(False, "weight_version must be a string")
        load_format = body.get("load_format")
        if load_format not in DISTRIBUTED_FORMATS:
            return _result(False, f"load_format {load_format!r} is not supported; use null (one broadcast per "
                                  f"tensor) or {FLATTENED_BUCKET!r} (one broadcast per bucket)")
        flattened = load_format == FLATTENED_BUCKET
        try:
            torch_dtypes = [parse_dtype(d) for d in dtypes]
        except WeightSyncError as err:
            return _result(False, str(err))
        async with group_lock:
            group = engine.groups.get(name)
            if group is None:
                return _result(False, f"no group {name!r}; call /init_weights_update_group first")
            try:
                # Receive everything even if a name is wrong, so the trainer's broadcasts complete.
                engine.tell_followers("receive", group_name=name, names=names, dtypes=dtypes, shapes=shapes,
                                      flattened=flattened)
                receive = group.receive_flat if flattened else group.receive
                tensors = await asyncio.to_thread(receive, names, torch_dtypes, shapes,
                                                  engine.device.receive_device(group.backend))
            except (RuntimeError, WeightSyncError) as err:
                return _result(False, f"broadcast failed: {err}")
        try:
            plan = plan_load(engine.model, tensors, complete=False)
        except WeightError as err:
            return _result(False, f"Failed to update weights: {err}; the previous weights are kept.")
        bucket_loads.add(lambda: run_on_scheduler(engine, lambda: copy_plan(plan), needs_idle=True))
        received = f"{len(names)} parameters in " + ("one broadcast" if flattened else f"{len(names)} broadcasts")
        if version is None:  # loads while the next bucket is received; the versioned (last) one settles them
            return _result(True, f"Received {received}; loading them.")
        failure = await bucket_loads.settle()
        if failure:
            return _result(False, f"Failed to update weights: {failure}")
        if not faults.version_stuck:
            await run_on_scheduler(engine, lambda: setattr(scheduler, "weight_version", version))
        return _result(True, f"Succeeded to update {received}.")

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        # SGLang's route for colocated trainers: tensors by reference (rollout/tensor_handles.py), one
        # serialized list of (name, tensor), or flattened bucket, per tensor-parallel rank; copied into the
        # model at once.
        body = await weight_body(request)
        if not engine.weight_update_open:
            return outside_update("update_weights_from_tensor")
        payloads, version = body.get("serialized_named_tensors"), body.get("weight_version")
        if not (isinstance(payloads, list) and len(payloads) == 1 and isinstance(payloads[0], str)):
            return _result(False, "serialized_named_tensors must be a list of one serialized (name, tensor) list "
                                  "per tensor-parallel rank: this engine has one")
        if engine.link is not None:
            return _result(False, "update_weights_from_tensor reaches this process's memory only; an engine over "
                                  "several nodes takes its weights from disk or a weight-update group")
        load_format = body.get("load_format")
        if load_format not in (None, FLATTENED_BUCKET):
            return _result(False, f"load_format {load_format!r} is not supported; use null (a list of (name, tensor)) "
                                  f"or {FLATTENED_BUCKET!r} (one tensor and each name's place in it)")
        if version is not None and not isinstance(version, str):
            return _result(False, "weight_version must be a string")
        if faults.update == FAIL:
            return _result(False, "Failed to update weights: the engine's test fault (slurmrl_fault update fail)")
        try:
            named = await asyncio.to_thread(deserialize, payloads[0])
            tensors = dict(reconstruct(named) if load_format == FLATTENED_BUCKET else named)
        except (TensorHandleError, TypeError, ValueError) as err:
            return _result(False, f"Failed to update weights: {err}; the previous weights are kept.")
        failed = await apply(tensors, complete=False, version=version)
        return failed or _result(True, f"Succeeded to update {len(tensors)} parameters from tensors.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await weight_body(request)
        name = body.get("group_name", DEFAULT_GROUP)
        async with group_lock:
            group = engine.groups.pop(name, None)
            if group is None:
                return _result(False, f"no group {name!r}")
            group.close()
            engine.tell_followers("destroy", group_name=name)
        return _result(True, f"Succeeded to destroy group {name!r}.")

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await weight_body(request)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            return _result(False, "new_version (a non-empty string) is required")

        def update() -> None:
            if body.get("abort_all_requests", True):
                scheduler.abort(None, "aborted for a weight version update")
            scheduler.weight_version = version
        await run_on_scheduler(engine, update)
        return _result(True, f"Weight version updated to {version}", new_version=version)

    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request) -> JSONResponse:
        # SGLang's route for checking a weight update: the first truncate_size rows of a parameter.
        body = await read_json(request)
        name, size = body.get("name"), body.get("truncate_size", 100)
        params = engine.model.state_dict(keep_vars=True)
        if name not in params or not _is_int(size) or size < 1:
            return error(f"no parameter {name!r} (or a bad truncate_size)")
        values = await run_on_scheduler(engine, lambda: params[name].detach()[:size].tolist())
        return JSONResponse(values)
