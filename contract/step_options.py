"""What the site adds to every srun step the supervisor launches (the job spec's `steps` section,
contract/spec.py StepsSpec): a container through Pyxis (--container-image/-mounts/-workdir, one image
per role), the role's extra srun options, and shell setup lines run before the step's command.
Rendering here (the supervisor calls it for each launch and relaunch), and the checks at submission.

Pyxis syntax (NVIDIA/pyxis): --container-mounts=SRC:DST[:FLAGS][,SRC:DST...], flags joined by "+"
("ro+rprivate"), the target starting with "/" or ".".
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

from contract.spec import ENGINE_LAUNCHES, PATH_FLAGS, ROLES, JobSpec, StepsSpec, flag_value

# srun options slurmrl sets on every step itself (supervisor/steps.py srun_argv), or that would take
# the step out of its hands: option -> what to do instead. Short forms map to their long names.
OWNED_SRUN = {
    "--jobid": "each step runs in the job's own allocation",
    "--het-group": "the supervisor places each role in its het group",
    "--nodes": "the job spec's node counts place the steps",
    "--ntasks": "the job spec's node and GPU counts set the tasks",
    "--ntasks-per-node": "the job spec's node and GPU counts set the tasks",
    "--nodelist": "use the spec's exclude to keep nodes out",
    "--exclude": "use the spec's exclude",
    "--relative": "the supervisor picks each step's nodes",
    "--overlap": "the supervisor sets it where steps share CPUs (the router, --colocate)",
    "--exact": "every step is launched with --exact",
    "--gpus-per-node": "use the trainer's and rollout's GPU fields",
    "--gpus": "use the trainer's and rollout's GPU fields",
    "--gres": "use the trainer's and rollout's GPU fields",
    "--cpus-per-task": "use trainer.cpus_per_task / rollout.cpus_per_engine",
    "--chdir": "use steps.container_workdir (in a container); steps run from the submit directory",
    "--job-name": "the step's name is its role's (router, engine-K, trainer)",
    "--output": "each step logs to JOB_DIR/logs/NAME.log",
    "--error": "each step logs to JOB_DIR/logs/NAME.log",
    "--open-mode": "each step logs to JOB_DIR/logs/NAME.log",
    "--kill-on-bad-exit": "every step is launched with --kill-on-bad-exit=1",
    "--export": "the supervisor passes each step its environment (the job's key among it)",
    "--container-image": "use steps.container_image or steps.ROLE_container_image",
    "--container-mounts": "use steps.container_mounts",
    "--container-workdir": "use steps.container_workdir",
}
_SHORT = {"-N": "--nodes", "-n": "--ntasks", "-w": "--nodelist", "-x": "--exclude", "-r": "--relative",
          "-G": "--gpus", "-c": "--cpus-per-task", "-D": "--chdir", "-J": "--job-name", "-o": "--output",
          "-e": "--error", "-K": "--kill-on-bad-exit"}
_MIN_ABBREV = 3  # srun takes unambiguous prefixes of long options ("--nodel" is --nodelist): refuse those too
_MOUNT_FLAGS = re.compile(r"[a-z][a-z0-9_=-]*(\+[a-z][a-z0-9_=-]*)*")
SETUP_CHECK_TIMEOUT_S = 10.0  # `bash -n` on a role's rendered setup script, at submission


def srun_options(steps: StepsSpec, role: str) -> list[str]:
    """The srun options `role`'s steps get beyond slurmrl's own: Pyxis's, then the role's extra ones."""
    out = []
    image = steps.image(role)
    if image:
        out.append(f"--container-image={image}")
        if steps.container_mounts:
            out.append("--container-mounts=" + ",".join(steps.container_mounts))
        if steps.container_workdir:
            out.append(f"--container-workdir={steps.container_workdir}")
    return out + steps.srun_args(role)


def with_setup(lines: list[str], argv: list[str]) -> list[str]:
    """argv run after the setup lines in one bash (in the container, if any): a failing line fails
    the step (set -e), and exec leaves the command as the task's process, so SLURM's signals reach it."""
    if not lines:
        return list(argv)
    return ["bash", "-c", "\n".join(["set -e", *lines, "exec " + shlex.join(argv)])]


def problems(steps: StepsSpec) -> list[str]:
    """One line per problem of the steps section: field, what is wrong, the fix."""
    out = []
    images = {"container_image": steps.container_image,
              **{f"{role}_container_image": getattr(steps, f"{role}_container_image") for role in ROLES}}
    for name, image in images.items():
        if image is not None and not image.strip():
            out.append(f"steps.{name}: empty; give an image (docker URI or squashfs path) or leave it out")
        elif image is not None and (image != image.strip() or "," in image):
            out.append(f"steps.{name}: {image!r} is not one image; give one [USER@][REGISTRY#]IMAGE[:TAG] or path")
    bad = [m for m in steps.container_mounts if not _mount_ok(m)]
    if bad:
        out.append(f"steps.container_mounts: {', '.join(map(repr, bad))} not SRC:DST[:FLAGS] (DST starting with "
                   "'/', flags joined by '+', e.g. /data:/data:ro); fix or drop them")
    workdir = steps.container_workdir
    if workdir is not None and not workdir.startswith("/"):
        out.append(f"steps.container_workdir: {workdir!r} is not an absolute path in the container; give one")
    if (steps.container_mounts or workdir) and not any(steps.image(role) for role in ROLES):
        out.append("steps.container_mounts/container_workdir: apply inside a container, and no step has one; "
                   "give steps.container_image (or a role's)")
    if not steps.container_python.strip():
        out.append("steps.container_python: empty; give the interpreter in the images (e.g. python3)")
    if steps.engine_launch not in ENGINE_LAUNCHES:
        out.append(f"steps.engine_launch: {steps.engine_launch!r}; give one of {', '.join(ENGINE_LAUNCHES)}")
    for role in ROLES:
        refused = refused_srun_options(steps.srun_args(role))
        owners = [OWNED_SRUN[owned] for arg in refused if (owned := _long(arg))]
        if refused:
            out.append(f"steps.{role}_srun_args: {', '.join(refused)} set by slurmrl itself "
                       f"({owners[0]}); remove them")
        if any(not line.strip() for line in steps.setup_lines(role)):
            out.append(f"steps.setup/{role}_setup: an empty line; drop it")
        elif steps.setup_lines(role):
            error = _shell_syntax_error(with_setup(steps.setup_lines(role), ["true"])[2])
            if error:
                out.append(f"steps.setup/{role}_setup: bash cannot parse the {role} step's setup ({error}); "
                           "fix the quoting")
    return out


def mount_notes(spec: JobSpec) -> list[str]:
    """A finalized spec's job dir and trainer paths that no mount shows at the same path inside the
    containers (slurmrl passes host paths): a note, not a problem, since the image or enroot's own
    mounts may hold them; this machine cannot tell."""
    if not any(spec.steps.image(role) for role in ROLES):
        return []
    same = [Path(m.split(":")[0]) for m in spec.steps.container_mounts if m.split(":")[0] == m.split(":")[1]]
    paths = [spec.job_dir] + [flag_value(spec.trainer.train_args, flag) for flag in PATH_FLAGS]
    unseen = [p for p in dict.fromkeys(paths) if p and not any(Path(p).is_relative_to(root) for root in same)]
    if not unseen:
        return []
    top = "/" + Path(unseen[0]).parts[1]
    return [f"steps.container_mounts: {', '.join(unseen)} under no SRC:DST mount with DST = SRC; the steps in "
            f"containers see them only if the image or enroot's own mounts hold them (add e.g. {top}:{top})"]


def refused_srun_options(args: list[str]) -> list[str]:
    """The options among args that slurmrl owns (as the user wrote them)."""
    return [arg for arg in args if _long(arg) in OWNED_SRUN]


def _long(arg: str) -> str | None:
    """The owned long option `arg` names (exact, abbreviated, or short), else None."""
    if arg.startswith("--"):
        name = arg.split("=", 1)[0]
        if name in OWNED_SRUN:
            return name
        if len(name) - 2 >= _MIN_ABBREV:
            hits = [owned for owned in OWNED_SRUN if owned.startswith(name)]
            return hits[0] if hits else None
        return None
    if arg.startswith("-") and len(arg) >= 2:
        return _SHORT.get(arg[:2])
    return None


def _mount_ok(mount: str) -> bool:
    parts = mount.split(":")
    if len(parts) not in (2, 3) or "," in mount:
        return False
    src, dst = parts[0], parts[1]
    return bool(src) and dst.startswith(("/", ".")) and (len(parts) == 2 or bool(_MOUNT_FLAGS.fullmatch(parts[2])))


def _shell_syntax_error(script: str) -> str | None:
    """bash's own complaint about script (parsed, not run), or None."""
    try:
        out = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True,
                             timeout=SETUP_CHECK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"not checked: {err}"
    return " ".join(out.stderr.split()) or None if out.returncode else None
