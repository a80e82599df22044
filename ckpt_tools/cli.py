"""`python -m ckpt_tools hf-to-torch-dist | torch-dist-to-hf | inspect | verify` (also `slurmrl ckpt
...`): CPU-only checkpoint tools."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ckpt_tools.shard_size import DEFAULT_MAX_SHARD_SIZE, parse_shard_size

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
HELP = "Hugging Face <-> Megatron torch_dist conversion (CPU only)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt_tools", description=HELP)
    _add_actions(parser)
    args = parser.parse_args(argv)
    return args.func(args)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    _add_actions(subparsers.add_parser("ckpt", help=HELP))


def _add_actions(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)

    to_td = actions.add_parser("hf-to-torch-dist", help="convert an HF safetensors folder into a Megatron save folder")
    to_td.add_argument("--hf", type=Path, required=True, help="HF model folder (config.json + safetensors)")
    to_td.add_argument("--out", type=Path, required=True,
                       help="new folder; gets iter_0000000/ (or release/) and the tracker")
    to_td.add_argument("--release", action="store_true", help="write the release/ layout instead of iter_0000000/")
    to_td.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
                       help="pad the vocabulary to a multiple of N, as Megatron does (default %(default)s)")
    to_td.add_argument("--mtp-num-layers", type=int, default=0, metavar="N",
                       help="keep the first N multi-token prediction layers of config.json's num_nextn_predict_layers "
                            "(DeepSeek-V3, GLM-4.5/4.7), as slime's --mtp-num-layers; 0 leaves them out "
                            "(default %(default)s)")
    _common(to_td)
    to_td.add_argument("--threads", type=int, default=4, help="parallel writer threads (default %(default)s)")

    to_hf = actions.add_parser("torch-dist-to-hf", help="convert a Megatron torch_dist checkpoint into HF safetensors")
    to_hf.add_argument("--ckpt", type=Path, required=True,
                       help="a save folder (with the tracker) or one iter_XXXXXXX folder")
    to_hf.add_argument("--ckpt-step", type=int, help="which iteration of the save folder (default: the tracker's)")
    to_hf.add_argument("--out", type=Path, required=True, help="new folder for the HF model")
    to_hf.add_argument("--hf-config", type=Path, required=True,
                       help="folder with the model's config.json (and tokenizer)")
    to_hf.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
                       help="largest safetensors shard, as HF's max_shard_size: bytes or a number with a unit "
                            "(KB, MB, GB decimal; KiB, MiB, GiB binary); a larger tensor gets its own shard "
                            "(default %(default)s)")
    _common(to_hf)
    to_hf.add_argument("--threads", type=int, default=4, help="parallel reader/writer threads (default %(default)s)")

    inspect = actions.add_parser("inspect", help="keys, shapes, dtypes, iteration and sizes of a checkpoint")
    inspect.add_argument("path", type=Path, help="an HF folder, a Megatron save folder or an iter_XXXXXXX folder")

    verify = actions.add_parser("verify", help="check HF -> torch_dist -> HF is bit-identical and Megatron's "
                                               "logits on the converted checkpoint equal HF's")
    verify.add_argument("--hf", type=Path, required=True, help="HF model folder")
    verify.add_argument("--make-vocab-size-divisible-by", type=int, default=128, metavar="N")
    verify.add_argument("--atol", type=float, default=1e-4, help="largest |Megatron - HF| logit (default %(default)s)")
    verify.add_argument("--no-logits", action="store_true", help="only the round trip (no megatron-core needed)")
    parser.set_defaults(func=run, prog=parser.prog)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast weights (default: keep the source dtype)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    # Imported here so that other commands (and --help) do not pay for torch.
    import torch

    from ckpt_tools.convert import hf_to_torch_dist, torch_dist_to_hf
    from ckpt_tools.hf_checkpoint import CheckpointError
    from ckpt_tools.inspect import describe
    from ckpt_tools.verify import verify

    dtype = getattr(torch, DTYPES[args.dtype]) if getattr(args, "dtype", None) else None
    try:
        if args.action == "hf-to-torch-dist":
            _positive(args.prog, "--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by)
            _positive(args.prog, "--threads", args.threads)
            if args.mtp_num_layers < 0:
                print(f"{args.prog}: error: --mtp-num-layers must be 0 or more, got {args.mtp_num_layers}",
                      file=sys.stderr)
                return 1
            folder = hf_to_torch_dist(args.hf, args.out, iteration=None if args.release else 0,
                                      dtype=dtype, threads=args.threads, mtp_layers=args.mtp_num_layers,
                                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                      progress=not args.no_progress)
            print(f"wrote {folder}")
        elif args.action == "torch-dist-to-hf":
            _positive(args.prog, "--threads", args.threads)
            shard_bytes = _shard_size(args.prog, args.max_shard_size)
            folder = torch_dist_to_hf(args.ckpt, args.out, args.hf_config, step=args.ckpt_step, threads=args.threads,
                                      dtype=dtype, shard_bytes=shard_bytes,
                                      progress=not args.no_progress)
            print(f"wrote {folder}")
        elif args.action == "inspect":
            print(describe(args.path))
        else:
            verdict = verify(args.hf, args.make_vocab_size_divisible_by, logits=not args.no_logits)
            if verdict.roundtrip_problems:
                print("round trip differs:\n  " + "\n  ".join(verdict.roundtrip_problems), file=sys.stderr)
                return 1
            print(f"{args.hf}: HF -> torch_dist -> HF is bit-identical")
            if verdict.logits_max_diff is None:
                print(verdict.note)
            elif verdict.logits_max_diff > args.atol:
                print(f"Megatron logits differ from HF by {verdict.logits_max_diff:.3g} > --atol {args.atol}",
                      file=sys.stderr)
                return 1
            else:
                print(f"Megatron logits equal HF's: max difference {verdict.logits_max_diff:.3g} <= {args.atol}")
    except (CheckpointError, FileNotFoundError) as err:
        print(f"{args.prog}: error: {err}", file=sys.stderr)
        return 1
    return 0


def _positive(prog: str, flag: str, value: int) -> None:
    if value < 1:
        print(f"{prog}: error: {flag} must be 1 or more, got {value}", file=sys.stderr)
        sys.exit(1)


def _shard_size(prog: str, text: str) -> int:
    try:
        return parse_shard_size(text)
    except ValueError as err:
        print(f"{prog}: error: --max-shard-size {err}", file=sys.stderr)
        sys.exit(1)
