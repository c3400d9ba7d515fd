"""Train inside reprotrain's CPU or CUDA image (runtime=docker, or auto with an engine).

The image follows the device: device=cuda -> the CUDA image with --gpus all; device=cpu ->
the CPU image; device=auto -> the CUDA image only where Docker can reach NVIDIA GPUs.
The container runs the same script on the same resolved config, with the project mounted
at the same absolute path, so the runs it records are readable from the host's MLflow UI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import uuid
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from reprotrain.checkpoint import load_resume_point
from reprotrain.containers import (
    Placement,
    container_command,
    ensure_image,
    gpu_count,
    host_has_docker_gpus,
    run_container,
)
from reprotrain.errors import ConfigError, RuntimeEnvError, UserError
from reprotrain.host import CONTAINER_ENV
from reprotrain.project import default_tracking_uri, find_root, git_state
from reprotrain.schema import Config, as_dict
from reprotrain.stopping import Interrupted
from reprotrain.tracking import (
    check_store,
    ensure_experiment,
    owner_tags,
    prepare_store,
    redact,
    sweep,
)
from reprotrain.tracking.orphans import (
    CHECKPOINT_TAG,
    CONTAINER_NAME_ENV,
    CONTAINER_TAG,
    LAUNCHER_HOST_ENV,
    LAUNCHER_HOST_TAG,
)


def image_kind(config: Config) -> str:
    if config.train.compile:  # say so here, not from inside the container after a build
        raise RuntimeEnvError(
            "train.compile=true cannot run in reprotrain's images: they have no C++ compiler "
            "for torch.compile to build kernels with",
            hint="run it in this process with runtime=local, or set train.compile=false",
        )
    if config.device.type == "mps":
        raise RuntimeEnvError(
            "device=mps cannot run inside a Linux container (no Metal there)",
            hint="use runtime=local on the Mac, or device=cpu",
        )
    if config.device.type == "cuda":
        if not host_has_docker_gpus():  # say so now, not after building a 4 GB image
            raise RuntimeEnvError(
                "device=cuda with runtime=docker, but Docker on this host cannot hand NVIDIA GPUs "
                "to containers (nvidia-smi lists none, or no NVIDIA Container Toolkit: "
                '`docker run --gpus all` fails with: could not select device driver "" with '
                "capabilities: [[gpu]])",
                hint="install the NVIDIA Container Toolkit and restart Docker, or use device=cpu "
                "or runtime=local",
            )
        return "cuda"
    if config.device.type == "auto" and host_has_docker_gpus():
        return "cuda"
    return "cpu"


def run_in_docker(config: Config) -> dict[str, Any]:
    """Build (or reuse) the image, run the training script in it; returns its run.json."""
    root = find_root()
    kind = image_kind(config)
    resumed = resumed_run_id(config)  # a missing or mismatched checkpoint fails before a build
    image = ensure_image(kind, root)
    uri = config.tracking.uri or default_tracking_uri()
    name = f"reprotrain-{kind}-{uuid.uuid4().hex[:12]}"
    run_id = ""
    if config.tracking.enabled:
        check_store(uri, config.tracking.connect_timeout_s)
        prepare_store(uri)
        run_id = resumed or create_run(config, uri, kind, name)
    env = container_env(root, uri, kind, name, image.id, run_id)
    network = config.runtime.network
    if network == "auto":  # a store on the network (a server, a database) needs the host's
        network = "none" if uri.startswith(("sqlite:", "file:")) else "host"
    if network == "none":  # torchrun's ranks meet on the loopback, the only interface there
        env["GLOO_SOCKET_IFNAME"] = "lo"
    config_file = write_launch_config(root, config)
    where = Placement(
        root,
        env,
        network=network,
        shm_size=config.runtime.shm_size,
        cpus=config.runtime.cpus,
        name=name,
        mounts=outside_paths(config, uri),
    )
    command = container_command(
        image, kind, training_argv(processes(config, kind), config_file), where
    )
    code = 1  # if run_container itself fails, the run still ends FAILED
    try:
        secrets = {k: v for k, v in env.items() if redact(v) != v}
        code = run_container(command, kind=kind, secrets=secrets)
    finally:
        config_file.unlink(missing_ok=True)
        status = end_if_running(uri, run_id, code) if run_id else ""
    check_exit(code, status, image.tag)
    return json.loads((output_folder(config) / "run.json").read_text())


def container_env(
    root: Path, uri: str, kind: str, name: str, image_id: str, run_id: str
) -> dict[str, str]:
    """What the training process in the container is told: the store, the run it records
    into, who owns it (the container, the launching host) and the host's git state."""
    commit, dirty = git_state(root)
    return {
        "MLFLOW_TRACKING_URI": uri,
        "REPROTRAIN_RUNTIME": f"docker-{kind}",
        "REPROTRAIN_IMAGE_ID": image_id,
        "REPROTRAIN_GIT_COMMIT": commit,
        "REPROTRAIN_GIT_DIRTY": dirty,
        "GIT_PYTHON_REFRESH": "quiet",  # the image has no git: MLflow's probe for it stays quiet
        CONTAINER_ENV: "1",
        CONTAINER_NAME_ENV: name,  # the run's owner, as a later run checks it is alive
        LAUNCHER_HOST_ENV: socket.gethostname(),  # where its mounted folders can be checked
        **({"REPROTRAIN_RUN_ID": run_id} if run_id else {}),
        **{
            k: v
            for k, v in os.environ.items()
            # MLflow's own settings of its system-metrics monitor reach the run inside too.
            if k.startswith(
                ("DVC_", "REPROTRAIN_SWEEP", "REPROTRAIN_PARENT", "MLFLOW_SYSTEM_METRICS_")
            )
        },
    }


def training_argv(nproc: int, config_file: Path) -> list[str]:
    """The training script on the launch config, under torchrun for several processes."""
    # --local-addr: with --network none the container's hostname resolves to no address.
    torchrun = ["torchrun", "--standalone", "--local-addr=127.0.0.1", f"--nproc-per-node={nproc}"]
    launcher = ["python"] if nproc == 1 else torchrun
    config = ["--config-dir", str(config_file.parent), "--config-name", config_file.stem]
    return [*launcher, "-m", "reprotrain.train", *config]


def check_exit(code: int, status: str, tag: str) -> None:
    """The container's exit as the launcher's: a stop as a stop, an error as one line."""
    if code in (130, 143):  # stopped by Ctrl-C / docker stop: end as a local run would
        raise Interrupted(code - 128)
    if code != 0 and status == "KILLED":  # torchrun's own exit code after its ranks stopped
        raise Interrupted(signal.SIGTERM)
    if code == UserError.exit_code:  # the container printed the one-line error: not again
        raise SystemExit(code)
    if code != 0:
        raise RuntimeEnvError(
            f"the training container ({tag}) exited with code {code}",
            hint="see its last log lines above; 137 = killed (docker kill or out of memory)",
        )


def resumed_run_id(config: Config) -> str:
    """train.resume continues the MLflow run its checkpoint belongs to: hand that run in
    rather than create one (which would be left empty, ended FAILED). The checkpoint is
    checked here exactly as the run in the container will check it."""
    state = load_resume_point(config)
    return state["run_id"] if state else ""


def output_folder(config: Config) -> Path:
    """train.output_dir: the command line sets it (Hydra's run folder) before it launches."""
    if config.train.output_dir is None:
        raise ConfigError(
            "runtime=docker needs train.output_dir, but it is not set",
            hint="set train.output_dir=<a folder>, or start the run with python -m reprotrain.train",
        )
    return Path(config.train.output_dir)


def outside_paths(config: Config, uri: str) -> tuple[Path, ...]:
    """Folders the run touches, to mount at the same paths: cwd, outputs, checkpoints, data,
    a sqlite store."""
    paths = [
        Path.cwd(),
        output_folder(config).resolve(),
        Path(config.train.checkpoint_dir).resolve(),
    ]
    if config.data.get("file"):
        paths.append(Path(config.data["file"]).resolve().parent)
    if uri.startswith("sqlite:///"):
        paths.append(Path(uri.removeprefix("sqlite:///")).parent)
    for path in paths[1:]:
        path.mkdir(parents=True, exist_ok=True)  # docker would create it owned by root
    return tuple(paths)


def write_launch_config(root: Path, config: Config) -> Path:
    """The resolved config the container reads: same values, no second composition."""
    folder = root / "outputs" / "launch"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"run-{uuid.uuid4().hex[:12]}.yaml"
    tree = as_dict(config)
    tree["runtime"]["mode"] = "local"  # inside the container: train, don't launch again
    if tree["tracking"]["uri"] and redact(tree["tracking"]["uri"]) != tree["tracking"]["uri"]:
        tree["tracking"]["uri"] = None  # a password stays off disk: MLFLOW_TRACKING_URI has it
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(tree)))
    return path


def create_run(config: Config, uri: str, kind: str, container: str) -> str:
    """Create the run on the host, so a container killed outright still leaves a status. It
    names the container about to start and this host, so a cleaner here asks the engine about
    it, and this launcher, which owns the run until the training process in the container
    tags itself: a cleaner ends it only once both are gone."""
    client = MlflowClient(uri)
    experiment_id = ensure_experiment(client, config.tracking.experiment)
    model, optimizer = (config.model["_target_"], config.optimizer["_target_"])
    default = f"{model.rsplit('.', 1)[-1]}-{optimizer.rsplit('.', 1)[-1]}-docker-{kind}".lower()
    name = config.tracking.run_name or default
    tags = {
        **owner_tags(),
        CONTAINER_TAG: container,
        LAUNCHER_HOST_TAG: socket.gethostname(),
        CHECKPOINT_TAG: str(Path(config.train.checkpoint_dir).resolve()),
    }
    run_id = client.create_run(experiment_id, run_name=name, tags=tags).info.run_id
    sweep(client, [experiment_id], exclude=run_id)  # inside the container nothing can be proved
    return run_id


def end_if_running(uri: str, run_id: str, exit_code: int) -> str:
    """End the run if the container left it RUNNING; returns its status."""
    client = MlflowClient(uri)
    status = client.get_run(run_id).info.status
    if status != "RUNNING":
        return status  # the container ended its own run
    status = "KILLED" if exit_code in (130, 137, 143) else "FAILED"
    client.set_tag(run_id, "error", f"training container exited with code {exit_code}")
    client.set_terminated(run_id, status)
    return status


def processes(config: Config, kind: str) -> int:
    """How many training processes torchrun starts in the container (train.nproc): auto is
    one per GPU in the CUDA image, 1 in the CPU image; more than the GPUs is an error."""
    asked = config.train.nproc
    if kind != "cuda":
        return 1 if asked == "auto" else asked
    gpus = gpu_count()
    if asked == "auto":
        return max(gpus, 1)
    if asked > gpus:
        raise RuntimeEnvError(
            f"train.nproc={asked} but this machine has {gpus} GPU(s); allowed: 1..{gpus} "
            "processes, one per GPU",
            hint=f"use train.nproc={gpus} or train.nproc=auto",
        )
    return asked
