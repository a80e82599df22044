"""`python -m rollout.cpu_engine --model-path P --host H --port N [...]`: load the model (the port
stays closed meanwhile), serve, warm up, print SGLang's ready line."""

from __future__ import annotations

import sys

from rollout.cpu_engine.args import ServerArgs, parse_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported after the flags are checked, so a bad command line fails at once.
    import torch

    from rollout.cpu_engine.device import DeviceError
    from rollout.cpu_engine.engine import EngineLoadError, load_engine
    from rollout.cpu_engine.server import EngineServer

    torch.set_num_threads(args.num_threads)
    _report_ignored(args)
    link = None
    if args.nnodes > 1:  # SGLang's multi-node engine: rank 0 serves, the others follow it
        from rollout.cpu_engine import node_link

        if args.node_rank > 0:
            return node_link.follow(args)
        try:
            link = node_link.lead(args)
        except node_link.NodeLinkError as err:
            print(f"cpu_engine: error: {err}", file=sys.stderr)
            return 1
    try:
        engine = load_engine(args)
    except (EngineLoadError, DeviceError) as err:
        print(f"cpu_engine: error: {err}", file=sys.stderr)
        return 1
    engine.link = link
    engine.scheduler.start()
    server = EngineServer(engine)
    try:
        server.run()
    finally:
        engine.scheduler.stop()
        for group in engine.groups.values():
            group.close()
    return 1 if server.warmup_failed or not server.started else 0


def _report_ignored(args: ServerArgs) -> None:
    defaults = parse_args(["--model-path", args.model_path]).without_effect()
    changed = {k: v for k, v in args.without_effect().items() if v != defaults[k]
               and not (k == "tp_size" and v == args.nnodes)}  # one rank per node: as many as it has
    if changed:
        shown = ", ".join(f"--{k.replace('_', '-')}={v}" for k, v in changed.items())
        print(f"cpu_engine: no effect on the stand-in engine on {args.device}, ignored: {shown}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
