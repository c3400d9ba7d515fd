"""An MLflow Model for a run, loadable with `mlflow.pytorch.load_model("runs:/<id>/model")`.

    info = log_pytorch_model(model, inputs[:4], registered_name=None)   # to the active run

The model is saved with torch.export (MLflow's default "pt2" format): the traced graph and
its weights, loaded without the model's Python class and without unpickling code. A model
torch.export cannot trace (a Python `if` on tensor values, say) is saved with pickle instead,
which imports the model's classes when loaded. Either way the MLflow Model carries the source
of every class it uses that is not an installed package (`code_paths`: MLflow copies it into
the model's `code/` folder and puts that folder first on `sys.path` when it loads the model),
so a model whose class lives in the user's project folder loads from anywhere.
"""

from __future__ import annotations

import copy
import importlib.metadata
import shutil
import site
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow.models import infer_signature

from reprotrain.tasks import logits_of
from reprotrain.tracking.failures import is_store_failure

MODEL_NAME = "model"  # the artifact path: runs:/<run id>/model
EXAMPLE_ROWS = 4  # rows of the input example kept in the MLflow Model
MODEL_ERROR_TAG = "reprotrain.model_error"  # why mlflow.pyfunc cannot serve the logged model


def log_pytorch_model(model: Any, input_example: Any, registered_name: str | None = None) -> Any:
    """Log `model` (a torch.nn.Module) as the active run's MLflow Model under `model`, with a
    signature inferred from `input_example` (a batch of inputs) and the model's output;
    register it as a new version of `registered_name` if given. Returns MLflow's ModelInfo."""
    # Imported once a model is logged, after the last step: where Lightning is installed,
    # importing mlflow.pytorch imports it too (its autologging), seconds no step should wait.
    import mlflow.pytorch  # noqa: PLC0415

    # A CPU copy in eval mode: loadable on any machine, and the caller's model is untouched.
    snapshot = copy.deepcopy(model).to("cpu").eval()
    example = example_batch(input_example)
    raw = called(snapshot, example) if example is not None else None
    output = logits_of(raw).detach().numpy() if raw is not None else None
    refusal = pyfunc_refusal(example, raw)
    signature = infer_signature(example, output) if example is not None else None
    if output is None:  # the model needs more than its inputs (a recurrent model's state):
        example = None  # no example MLflow would try to call it on
    requirements = pinned_requirements(snapshot)

    with tempfile.TemporaryDirectory(prefix="reprotrain-code-") as scratch:
        code = carried_code(snapshot, Path(scratch))

        def log(serialization_format: str) -> Any:
            return mlflow.pytorch.log_model(
                snapshot,
                name=MODEL_NAME,
                signature=signature,
                input_example=example,
                pip_requirements=requirements,
                code_paths=code or None,
                registered_model_name=registered_name,
                serialization_format=serialization_format,
            )

        if refusal is not None:
            # The model is logged all the same (mlflow.pytorch.load_model loads it); the tag
            # says why `mlflow.pyfunc` (and `mlflow models serve`) cannot serve it.
            mlflow.set_tag(MODEL_ERROR_TAG, refusal)
        if not isinstance(example, np.ndarray):  # torch.export traces one tensor input here
            return log("pickle")
        try:
            return log("pt2")
        except Exception as error:
            if is_store_failure(error):  # the store, not the model: nothing to retry here
                raise
            _drop_failed_model()  # torch.export could not trace the model
            print(
                f"reprotrain: warning: torch.export could not trace "
                f"{type(model).__name__} ({str(error).splitlines()[0][:200]}); its MLflow "
                "Model is saved with pickle and the code it imports",
                file=sys.stderr,
                flush=True,
            )
            return log("pickle")


def pinned_requirements(model: Any) -> list[str]:
    """Explicit pins: otherwise MLflow infers the requirements by importing the model. torch,
    MLflow, and each installed distribution a class of the model comes from (transformers for
    a Hugging Face model). A local version label (2.13.0+cpu) is dropped: it names a wheel
    index, not code."""
    pins = {"torch": torch.__version__.split("+")[0], "mlflow": mlflow.__version__}
    distributions = importlib.metadata.packages_distributions()
    for top in sorted({type(part).__module__.partition(".")[0] for part in model.modules()}):
        place = _source_place(sys.modules.get(top))
        for name in (
            distributions.get(top, []) if place is not None and _is_installed(place) else []
        ):
            pins.setdefault(name, importlib.metadata.version(name).split("+")[0])
    return [f"{name}=={version}" for name, version in pins.items()]


def example_batch(input_example: Any) -> Any:
    """A few rows of the model's inputs on the CPU: an array, or a dict of arrays (None: no
    example). Two rows at least: torch.export keeps the batch dimension dynamic only when
    the example has more than one row."""
    if input_example is None:
        return None
    if isinstance(input_example, dict):
        return {k: example_batch(v) for k, v in input_example.items()}
    if hasattr(input_example, "detach"):  # a torch.Tensor, on any device
        input_example = input_example.detach().cpu().numpy()
    batch = np.asarray(input_example)[:EXAMPLE_ROWS]
    return np.concatenate([batch, batch]) if len(batch) == 1 else batch


def called(model: Any, example: Any) -> Any:
    """What the model returns for the example (None when it cannot be called on the inputs
    alone: a recurrent model that needs a state)."""
    try:
        with torch.no_grad():
            if isinstance(example, dict):
                output = model(**{k: torch.from_numpy(v) for k, v in example.items()})
            else:
                output = model(torch.from_numpy(example))
        logits_of(output)
        return output
    except (RuntimeError, TypeError, ValueError):
        return None


def pyfunc_refusal(example: Any, output: Any) -> str | None:
    """Why `mlflow.pyfunc` cannot serve the model (its PyTorch flavour calls the model on one
    array and returns a tensor output as an array), or None when it can."""
    load = "load it with mlflow.pytorch.load_model and call it as in training"
    if example is None:
        return None  # nothing to tell from
    if output is None:
        return f"pyfunc cannot serve it: the model needs more than its inputs (a state); {load}"
    if isinstance(example, dict):
        return (
            f"pyfunc cannot serve it: the model takes {len(example)} named inputs "
            f"({', '.join(example)}) where mlflow.pyfunc's PyTorch flavour passes one array; "
            f"{load}"
        )
    if not isinstance(output, torch.Tensor):
        return (
            f"pyfunc cannot serve it: the model returns a {type(output).__name__}, not one "
            f"tensor, which mlflow.pyfunc's PyTorch flavour requires; {load}"
        )
    return None


def carried_code(model: Any, scratch: Path) -> list[str]:
    """The code paths that make the classes of `model` and its submodules importable by their
    own names: each one's top-level module or package, unless it is installed (site-packages)
    or in the standard library. A single-file module goes as it is; of a package, only the
    modules this process imported from it are copied into `scratch` (not data files that may
    sit in its folders)."""
    paths = []
    for name in sorted({type(part).__module__.partition(".")[0] for part in model.modules()}):
        top = sys.modules.get(name)
        place = _source_place(top)
        if top is None or place is None or _is_installed(place):
            continue
        if place.is_file():
            paths.append(str(place))
        else:
            paths.append(str(_copy_imported_modules(name, place, scratch)))
    return paths


def _source_place(module: ModuleType | None) -> Path | None:
    """The file of a single-file module, or the folder of a package; None for `__main__`
    (pickled by value) and for modules without a file (built in)."""
    if module is None or module.__name__ == "__main__":
        return None
    file = getattr(module, "__file__", None)
    if file is not None:
        path = Path(file).resolve()
        return path.parent if path.name == "__init__.py" else path
    folders = list(getattr(module, "__path__", []))  # a namespace package: one folder only
    return Path(folders[0]).resolve() if len(folders) == 1 else None


def _is_installed(place: Path) -> bool:
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]]
    roots += [*site.getsitepackages(), site.getusersitepackages()]
    return any(place.is_relative_to(Path(root).resolve()) for root in roots if root)


def _copy_imported_modules(package: str, folder: Path, scratch: Path) -> Path:
    target = scratch / package
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file is None or not (name == package or name.startswith(package + ".")):
            continue
        source = Path(file).resolve()
        if source.suffix == ".py" and source.is_relative_to(folder):
            destination = target / source.relative_to(folder)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
    return target


def logged_model_of(client: Any, run_id: str) -> Any:
    """The run's READY MLflow Model, if an earlier try logged it; entries a try killed while
    logging left (not READY) are removed, so the run lists one model."""
    experiment_id = client.get_run(run_id).info.experiment_id
    ready = None
    for logged in client.search_logged_models([experiment_id]):
        if logged.source_run_id != run_id or logged.name != MODEL_NAME:
            continue
        if str(logged.status) == "READY" and ready is None:
            ready = logged
        else:
            client.delete_logged_model(logged.model_id)
    return ready


def _drop_failed_model() -> None:
    """Remove the LoggedModel entry a failed attempt left (status FAILED), so the run lists
    only the model that was saved."""
    failed, run = mlflow.last_logged_model(), mlflow.active_run()
    if (
        failed is not None
        and run is not None
        and failed.source_run_id == run.info.run_id
        and failed.status == "FAILED"
    ):
        mlflow.MlflowClient().delete_logged_model(failed.model_id)
