"""Re-run a past run from the config it recorded, and say whether its losses match.

    python -m reprotrain.reproduce <run id>
    python -m reprotrain.reproduce <run id> --tracking-uri sqlite:////abs/mlflow.db

The new run is recorded too (tag `reproduces` = the old run id). A recorded config is code
that anyone who can write the run's artifacts can change: every `_target_` in it is listed
before anything is built, and one that is not trusted (reprotrain.trust: named by conf/, this
project's own code, a module listed in pyproject.toml, or torch's and reprotrain's modules,
optimizers and schedulers) is refused unless you pass --trust. It is read without
resolvers that reach outside it (`${oc.env:...}`): a config.yaml that uses one is refused
unless you pass --allow-resolvers. With the same torch build, the same device
(on the CPU: the same kernel set, tag device.cpu_capability) and train.deterministic=true, the
losses match bit for bit; the exit code is 0 when they do and 1 when they do not (the first
differing step is printed, with what differs between the two runs' machines and the fix).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from reprotrain.data import file_md5
from reprotrain.errors import DataError, TrackingError, UserError, report_and_exit
from reprotrain.project import default_tracking_uri, put_project_on_path
from reprotrain.provenance import NOT_COMPUTED
from reprotrain.run import Run
from reprotrain.schema import validate
from reprotrain.trust import recorded_targets, refuse_untrusted

# The fix for a recorded config.yaml that cannot be what reprotrain.train wrote.
CHANGED = (
    "it was changed after the run; reproduce another run, or re-run with "
    "python -m reprotrain.train and the overrides of that run"
)


def recorded_config(client, run_id: str):
    try:
        run = client.get_run(run_id)
    except Exception as error:  # MLflow raises its own exception for an unknown id
        raise TrackingError(
            f"run {run_id!r} was not found in the tracking store ({error})",
            hint="check the run id in the MLflow UI, or pass --tracking-uri",
        ) from None
    with tempfile.TemporaryDirectory() as folder:
        try:
            path = client.download_artifacts(run_id, "config.yaml", folder)
        except Exception:
            raise DataError(
                f"run {run_id} has no config.yaml artifact to reproduce from",
                hint="only runs recorded by reprotrain.train can be reproduced",
            ) from None
        try:
            tree = OmegaConf.load(path)
        except Exception as error:  # YAML's and OmegaConf's own errors: a damaged artifact
            raise DataError(
                f"run {run_id}'s config.yaml artifact cannot be read "
                f"({type(error).__name__}: {str(error).splitlines()[0][:160]})",
                hint=CHANGED,
            ) from None
    return run, tree


# The sections reproduce sets itself; validate() reports any other that is missing.
SET_HERE = ("train", "tracking", "runtime")


def check_sections(tree: Any, run_id: str) -> None:
    """A recorded config is a mapping of sections, holding at least those set here."""
    if not isinstance(tree, DictConfig):
        raise DataError(
            f"run {run_id}'s config.yaml artifact is a {type(tree).__name__}, not a mapping "
            "of config sections",
            hint=CHANGED,
        )
    missing = [name for name in SET_HERE if not isinstance(tree.get(name), DictConfig)]
    if missing:
        raise DataError(
            f"run {run_id}'s config.yaml artifact has no {missing[0]!r} section (got "
            f"{tree.get(missing[0])!r}); a recorded config has {', '.join(SET_HERE)} and the "
            "_target_ sections",
            hint=CHANGED,
        )


def show_targets(tree: DictConfig, run_id: str, trust: bool) -> None:
    """Print every `_target_` the recorded config would import and call; refuse (one line)
    one that is not trusted, unless `trust`. Nothing of the config is imported before."""
    try:
        plain = OmegaConf.to_container(tree, resolve=True)
    except OmegaConfBaseException as error:
        raise DataError(
            f"run {run_id}'s config.yaml artifact cannot be resolved "
            f"({type(error).__name__}: {str(error).splitlines()[0][:160]})",
            hint=CHANGED,
        ) from None
    targets = recorded_targets(plain)
    print(f"reproduce: the recorded config builds {len(targets)} _target_s:", flush=True)
    for target in targets:
        print(target.line(), flush=True)
    if not trust:
        refuse_untrusted(targets)
        return
    untrusted = [target for target in targets if not target.trusted]
    if untrusted:
        names = ", ".join(f"{target.key}={target.path}" for target in untrusted)
        print(
            f"reproduce: --trust: building {len(untrusted)} untrusted _target_"
            f"{'s' if len(untrusted) > 1 else ''} as the recorded config names: {names}",
            flush=True,
        )


# A reference within the config (${train.steps}): the only interpolation a recorded config may
# hold. Anything else that starts with ${ reaches outside it or builds a name that may: a
# resolver (${oc.env:NAME}), a nested interpolation (${${task._args_.0}:NAME}).
PLAIN_REFERENCE = re.compile(r"\$\{\s*[\w.\-\[\]]+\s*\}")


def outside_references(tree: Any, allow: bool) -> None:
    """A recorded config resolves only within itself: an interpolation through a resolver
    (`${oc.env:AWS_SECRET_ACCESS_KEY}`, a custom one) reaches outside it, and a tampered
    artifact could use it to leak a secret into a run name. Refused unless `allow`."""
    if allow:
        return
    found = [
        (key, value)
        for key, value in _leaves(OmegaConf.to_container(tree, resolve=False))
        if isinstance(value, str) and reaches_outside(value)
    ]
    if found:
        key, value = found[0]
        raise DataError(
            f"the recorded config.yaml reads from outside itself: {key}={value!r} "
            f"({len(found)} such value{'s' if len(found) > 1 else ''})",
            hint="check that artifact; if you trust it, pass --allow-resolvers",
        )


def reaches_outside(value: str) -> bool:
    """Does a recorded value hold an interpolation other than a plain reference?"""
    return value.count("${") > len(PLAIN_REFERENCE.findall(value))


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [leaf for key, child in node.items() for leaf in _leaves(child, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [leaf for i, child in enumerate(node) for leaf in _leaves(child, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), node)]


# What decides a run's float results besides its config and data, as the run's tags record it.
MACHINE_TAGS = (
    "device.type",
    "device.name",
    "device.cpu_capability",
    "device.threads",
    "torch.version",
    "cuda.version",
)


def machine_differences(recorded: dict[str, str], now: dict[str, str]) -> str:
    """What differs between the machines of two runs, as their tags say, and how to compare
    them anyway; '' where nothing both recorded differs (a run from before a tag existed
    has nothing to compare for it)."""
    changed = [
        f"{tag} ({recorded[tag]!r} recorded, {now.get(tag, 'none')!r} now)"
        for tag in MACHINE_TAGS
        if tag in recorded and recorded[tag] != now.get(tag)
    ]
    if not changed:
        return ""
    text = (
        f"the runs differ in {', '.join(changed)}: kernels for another device or build sum "
        "floats in another order"
    )
    capability = recorded.get("device.cpu_capability")
    if capability and capability != now.get("device.cpu_capability"):
        text += (
            f"; to compare here, rerun with ATEN_CPU_CAPABILITY={capability.lower()} "
            "(it works where this CPU supports that set)"
        )
    return text


def data_difference(recorded: dict[str, str], now: dict[str, str], data: dict[str, Any]) -> str:
    """What the data says about a mismatch, for data built in memory (no data.file, whose md5
    is checked before the run): its content hashes (tag data.hash) differ, or it has none."""
    if data.get("file"):
        return ""
    before, after = recorded.get("data.hash"), now.get("data.hash")
    source = f"data._target_={data.get('_target_')}"
    if NOT_COMPUTED in (before, after):
        return (
            f"the data ({source}) has no content hash to compare (a streamed dataset is not "
            "read twice): data that changed since is the likely cause"
        )
    if before and after and before != after:
        return (
            f"the data differs ({source} built data with hash {after}, the run recorded "
            f"{before}): what it reads changed since"
        )
    return ""


def losses(client, run_id: str) -> list[float]:
    history = client.get_metric_history(run_id, "train/loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m reprotrain.reproduce",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_id")
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--output-dir", default=None, help="default: outputs/reproduce/<run id>")
    parser.add_argument(
        "--allow-resolvers",
        action="store_true",
        help="resolve ${oc.env:...} and other resolvers in the recorded config (off: refused)",
    )
    parser.add_argument(
        "--trust",
        action="store_true",
        help="build every _target_ the recorded config names (off: only trusted ones; see "
        "the list it prints)",
    )
    args = parser.parse_args(argv)
    uri = args.tracking_uri or default_tracking_uri()
    put_project_on_path()  # this project's own code and conf/, for the trust check and the build
    try:
        client = MlflowClient(uri)
        old, tree = recorded_config(client, args.run_id)
        outside_references(tree, args.allow_resolvers)
        check_sections(tree, args.run_id)
        show_targets(tree, args.run_id, args.trust)
        tree.tracking.uri = uri
        tree.tracking.run_name = f"reproduce-{args.run_id[:8]}"
        tree.train.output_dir = args.output_dir or f"outputs/reproduce/{args.run_id}"
        tree.train.resume = None
        tree.runtime.mode = "local"
        if tree.train.threads == "auto" and old.data.tags.get("device.threads"):
            tree.train.threads = int(old.data.tags["device.threads"])  # what auto was there
        config = validate(tree)
        data_file = config.data.get("file")
        if data_file:
            recorded = old.data.tags.get("data.hash")
            now = file_md5(Path(data_file)) if Path(data_file).is_file() else None
            if recorded and now != recorded:
                raise DataError(
                    f"data file {data_file!r} is not the one run {args.run_id} "
                    f"used (md5 {now or 'missing'}, recorded {recorded})",
                    hint="check out the data of that run's commit: git checkout <commit> && dvc checkout",
                )
        result = Run(config).execute()
    except UserError as error:
        report_and_exit(error)
    before, after = losses(client, args.run_id), losses(client, result["run_id"])
    match = before == after
    client.set_tag(result["run_id"], "reproduces", args.run_id)
    client.set_tag(result["run_id"], "reproduced.match", str(match).lower())
    if match:
        print(
            f"reproduce: losses match bit for bit ({len(after)} steps); new run {result['run_id']}"
        )
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
        min(len(before), len(after)),
    )
    detail = (
        f"step {first + 1}: recorded {before[first]!r}, now {after[first]!r}"
        if first < min(len(before), len(after))
        else f"{len(before)} vs {len(after)} steps"
    )
    now_tags = client.get_run(result["run_id"]).data.tags
    why = "; ".join(
        filter(
            None,
            [
                data_difference(old.data.tags, now_tags, config.data),
                machine_differences(old.data.tags, now_tags),
            ],
        )
    )
    if not why and not config.train.deterministic:
        why = "the run was recorded with train.deterministic=false, which promises no match"
    print(
        f"reproduce: losses differ from {detail}; {why + '; ' if why else ''}"
        f"new run {result['run_id']}",
        file=sys.stderr,
    )
    raise SystemExit(1)


if __name__ == "__main__":
    main()
