"""Describe a checkpoint (HF or torch_dist) and compare two HF checkpoints tensor by tensor."""

from __future__ import annotations

from pathlib import Path

import torch

from ckpt_tools.hf_checkpoint import HFCheckpoint
from ckpt_tools.torch_dist import read_metadata, tensor_entries
from ckpt_tools.tracker import TRACKER, resolve_checkpoint


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    raise AssertionError


def describe(path: Path) -> str:
    path = Path(path)
    if (path / "config.json").is_file() and not (path / ".metadata").exists():
        hf = HFCheckpoint(path)
        rows = [(n, list(hf.shapes[n]), str(hf.dtypes[n]).removeprefix("torch."), hf.weight_map[n])
                for n in sorted(hf.shapes)]
        total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        head = [f"HF checkpoint {path}: {hf.shape.architecture}, {hf.shape.num_layers} layers, "
                f"{len(rows)} tensors, {_size(total)}"]
    else:
        folder = resolve_checkpoint(path)
        entries = tensor_entries(read_metadata(folder))
        tracker = path / TRACKER
        iteration = tracker.read_text().strip() if tracker.is_file() else folder.name
        total = sum(f.stat().st_size for f in folder.glob("*.distcp"))
        rows = [(k, list(md.size), str(md.properties.dtype).removeprefix("torch."), f"{len(md.chunks)} chunks")
                for k, md in sorted(entries.items())]
        head = [f"torch_dist checkpoint {folder}: iteration {iteration}, {len(rows)} tensors, {_size(total)}"]
    width = max(len(r[0]) for r in rows)
    return "\n".join(head + [f"  {n:<{width}}  {str(s):<22} {d:<9} {where}" for n, s, d, where in rows])


def roundtrip_differences(a_dir: Path, b_dir: Path) -> list[str]:
    """Every way two HF checkpoints differ (names, dtypes, shapes, bytes); [] if bit-identical."""
    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    problems = [f"{n} only in {a_dir}" for n in sorted(set(a.shapes) - set(b.shapes))]
    problems += [f"{n} only in {b_dir}" for n in sorted(set(b.shapes) - set(a.shapes))]
    for name in sorted(set(a.shapes) & set(b.shapes)):
        x, y = a.read([name])[0], b.read([name])[0]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            problems.append(f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
    return problems
