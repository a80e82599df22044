"""HF safetensors <-> Megatron torch_dist, streaming: one layer (or expert) slice in memory per
writer thread, output built in a temporary folder and renamed into place only when complete."""

from __future__ import annotations

import functools
import io
import itertools
import json
import os
import re
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ckpt_tools.hf_checkpoint import CheckpointError, HFCheckpoint
from ckpt_tools.mapping import (
    Rule,
    hf_slice_shapes,
    legacy_norm_key,
    rules,
    stacking,
    to_hf,
    to_megatron,
)
from ckpt_tools.model_shape import ModelShape
from ckpt_tools.original_checkpoint import read_original
from ckpt_tools.qwen3_5_config import language_model_config
from ckpt_tools.safetensors_stream import StreamingSafetensorsWriter
from ckpt_tools.shard_size import DEFAULT_MAX_SHARD_SIZE, parse_shard_size
from ckpt_tools.torch_dist import (
    Chunk,
    read_metadata,
    read_regions,
    tensor_entries,
    write_chunks,
    write_megatron_files,
)
from ckpt_tools.tracker import iteration_dirname, resolve_checkpoint, write_tracker
from contract.job_dir import MODEL_FILES, fsync_dir

EXTRA_STATE = "_extra_state"
DEFAULT_SHARD_BYTES = parse_shard_size(DEFAULT_MAX_SHARD_SIZE)


def _extra_state_payload() -> bytes:
    """What megatron-core 0.16.1 stores for a local-spec linear's (empty) extra state."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def _indices(rule: Rule, shape: ModelShape) -> list[tuple[int, ...]]:
    """The stacking index of every slice of a rule: (), (l,), (e,) or (l, e)."""
    return list(itertools.product(*(range(n) for n in stacking(rule, shape))))


def _extra_state_shards(rule: Rule, shape: ModelShape, index: tuple[int, ...], stack: tuple[int, ...]
                        ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, stacking) of each linear module's extra state in a slice: one, or each expert's of fused ones."""
    if not rule.all_experts:
        return [(index, stack)]
    return [((*index, e), (*stack, shape.num_experts)) for e in range(shape.num_experts)]


def _hf_names(rule: Rule, index: tuple[int, ...]) -> list[str]:
    return rule.hf_names(index[0] if rule.per_layer else None, index[-1] if rule.per_expert else None)


def _read_as_megatron(hf: HFCheckpoint, rule: Rule, names: list[str], shape: ModelShape) -> torch.Tensor:
    """One chunk's data: its HF tensors, read now, in Megatron's layout."""
    return to_megatron(rule, hf.read(names), shape)


def _prepare_out(out_dir: Path) -> Path:
    """Refuse an existing --out; return a temporary sibling folder to build into."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"--out {out_dir} already exists; remove it or choose another folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))


def _publish(tmp: Path, out_dir: Path) -> None:
    fsync_dir(tmp)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)


def hf_to_torch_dist(hf_dir: Path, out_dir: Path, *, iteration: int | None = 0, dtype: torch.dtype | None = None,
                     make_vocab_size_divisible_by: int = 1, mtp_layers: int = 0, threads: int = 4,
                     progress: bool = True) -> Path:
    """Convert an HF checkpoint into a Megatron save folder: OUT/iter_0000000 (or OUT/release) with
    the tracker, with its first `mtp_layers` MTP layers (--mtp-num-layers; the rest are left out).
    Everything is checked before a byte is written; OUT appears only when complete."""
    hf = HFCheckpoint(hf_dir, make_vocab_size_divisible_by, mtp_layers)
    shape = hf.shape
    chunks: list[Chunk] = []
    extra: dict[str, bytes] = {}
    payload = _extra_state_payload()
    for rule in (r for r in rules(shape) if not r.repeat):
        stack = stacking(rule, shape)
        for index in _indices(rule, shape):
            names = _hf_names(rule, index)
            slice_shape = hf_slice_shapes(rule, shape, [hf.shapes[n] for n in names])
            out_dtype = dtype or hf.dtypes[names[0]]
            chunks.append(Chunk(
                key=rule.megatron, global_shape=(*stack, *slice_shape), offsets=(*index, *[0] * len(slice_shape)),
                sizes=(*[1] * len(stack), *slice_shape), dtype=out_dtype,
                produce=functools.partial(_read_as_megatron, hf, rule, names, shape),
            ))
            if rule.linear:
                module = rule.megatron.rsplit(".", 1)[0]
                for where, over in _extra_state_shards(rule, shape, index, stack):
                    # megatron names an unstacked module's extra state as one of shape (1,)
                    offsets, sizes = ".".join(map(str, where or (0,))), ".".join(map(str, over or (1,)))
                    extra[f"{module}.{EXTRA_STATE}/shard_{offsets}_{sizes}"] = payload
    tmp = _prepare_out(out_dir)
    try:
        folder = tmp / iteration_dirname(iteration)
        total = sum(c.nbytes for c in chunks)
        with tqdm(total=total, unit="B", unit_scale=True, desc="hf -> torch_dist", disable=not progress) as bar:
            write_chunks(folder, chunks, extra, threads, on_written=bar.update)
        write_megatron_files(folder, {"iteration": iteration or 0, "checkpoint_version": 3.0})
        fsync_dir(folder)
        write_tracker(tmp, iteration)
        _publish(tmp, Path(out_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out_dir) / iteration_dirname(iteration)


@dataclass(frozen=True)
class _Slice:
    """One stored Megatron slice and the HF tensors (name, shape, dtype) it becomes."""

    rule: Rule
    index: tuple[int, ...]
    outputs: list[tuple[str, tuple[int, ...], torch.dtype]]


def torch_dist_to_hf(ckpt: Path, out_dir: Path, hf_config_dir: Path, *, step: int | None = None,
                     dtype: torch.dtype | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                     threads: int = 4, progress: bool = True) -> Path:
    """Convert a Megatron torch_dist checkpoint into an HF safetensors folder, sharded as HF does
    (`shard_bytes` cap, index). `threads` workers each read, convert and write one slice at a time
    straight into its shard. Config and tokenizer come from --hf-config."""
    config_path = Path(hf_config_dir) / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path} not found: --hf-config must be a folder with the model's config.json")
    try:
        folder = resolve_checkpoint(Path(ckpt), step)
    except FileNotFoundError as err:
        raise CheckpointError(str(err)) from None
    stored = tensor_entries(read_metadata(folder))
    try:
        config = language_model_config(json.loads(config_path.read_text()))
        shape = ModelShape.from_hf_config(config, _stored_vocab_multiple(stored, config), _stored_mtp_layers(stored))
    except ValueError as err:
        raise CheckpointError(f"{config_path}: {err}") from None
    original = read_original(Path(hf_config_dir), shape)
    shape = replace(shape, fused_experts=original.fused_experts)
    slices = _plan_slices(stored, shape, folder, config_path, dtype)

    def load(item: _Slice) -> list[torch.Tensor]:
        key = _stored_key(stored, item.rule.megatron)
        md = stored[key]
        lead = len(item.index)
        region = ((*item.index, *[0] * (len(md.size) - lead)), (*[1] * lead, *md.size[lead:]))
        data = read_regions(folder, {key: region})[key]
        parts = to_hf(item.rule, data.reshape(tuple(md.size[lead:])), shape)
        return [p.to(d).contiguous() for p, (_, _, d) in zip(parts, item.outputs)]

    tmp = _prepare_out(out_dir)
    try:
        writer = StreamingSafetensorsWriter(tmp, [o for item in slices for o in item.outputs] + original.carried,
                                            shard_bytes)
        with tqdm(total=writer.total_bytes, unit="B", unit_scale=True, desc="torch_dist -> hf",
                  disable=not progress) as bar, ThreadPoolExecutor(threads) as pool:
            lock = threading.Lock()

            def convert(item: _Slice | str) -> None:
                # Each thread reads, converts and writes its slice (or a carried tensor) at its place: one slice in
                # memory per thread.
                pairs = ([(item, original.read(item))] if isinstance(item, str)
                         else zip([name for name, _, _ in item.outputs], load(item)))
                for name, tensor in pairs:
                    writer.write(name, tensor)
                    with lock:
                        bar.update(tensor.numel() * tensor.element_size())

            for _ in pool.map(convert, [*slices, *(name for name, _, _ in original.carried)]):
                pass
        writer.close()
        for side in MODEL_FILES:
            if (Path(hf_config_dir) / side).is_file():
                shutil.copy2(Path(hf_config_dir) / side, tmp / side)
        _publish(tmp, Path(out_dir))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out_dir)


def _plan_slices(stored: dict, shape: ModelShape, folder: Path, config_path: Path,
                 dtype: torch.dtype | None) -> list[_Slice]:
    """Every stored slice in HF write order, checked against the config before anything is read."""
    slices = []
    for rule in rules(shape):
        md = stored.get(_stored_key(stored, rule.megatron))
        if md is None:
            raise CheckpointError(f"{folder} lacks {rule.megatron}, which {config_path} ({shape.architecture}) needs: "
                                  "the checkpoint and --hf-config describe different models")
        stack = stacking(rule, shape)
        if tuple(md.size[: len(stack)]) != stack:
            raise CheckpointError(f"{rule.megatron} is stacked as {list(md.size)}, but {config_path} implies "
                                  f"{list(stack)} leading: the checkpoint and --hf-config disagree")
        probe = to_hf(rule, torch.empty(tuple(md.size[len(stack):]), device="meta"), shape)
        out_dtype = dtype or md.properties.dtype
        for index in _indices(rule, shape):
            outputs = [(name, tuple(t.shape), out_dtype) for name, t in zip(_hf_names(rule, index), probe)]
            slices.append(_Slice(rule, index, outputs))
    return slices


def _stored_key(stored: dict, key: str) -> str:
    """The key `key`'s tensor is stored under: itself, or in a checkpoint slurmrl wrote before it keyed
    a MoE layer's pre-MLP norm as slime does, the key it wrote it under (mapping.legacy_norm_key)."""
    legacy = legacy_norm_key(key)
    return legacy if key not in stored and legacy is not None and legacy in stored else key


def _stored_mtp_layers(stored: dict) -> int:
    """How many MTP layers the checkpoint holds (each has its input projection)."""
    return sum(1 for key in stored if re.fullmatch(r"mtp\.layers\.\d+\.eh_proj\.weight", key))


def _stored_vocab_multiple(stored: dict, config: dict) -> int:
    """The padded vocab the checkpoint holds, expressed as the divisor ModelShape expects."""
    embedding = stored.get("embedding.word_embeddings.weight")
    return int(embedding.size[0]) if embedding is not None and embedding.size[0] != config["vocab_size"] else 1
