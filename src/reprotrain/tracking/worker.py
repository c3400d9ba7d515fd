"""The MLflow run, kept by a process of its own beside the one that trains.

    start_early()                      # python -m reprotrain.train, before torch is imported
    worker = take_worker(uri)          # that worker (or a new one): it opens the store
    ...                                # meanwhile this process builds the model and data
    with worker.open("reprotrain", "mlp-adamw-cpu", tags, params) as run:
        run.log_metric("train/loss", 0.7, step=1)   # buffered here, sent in batches
        run.log_model(model, inputs)                # logged by the worker
    # the run ends FINISHED, FAILED or KILLED as in TrackedRun; worker.close() if never opened

Importing MLflow, opening a sqlite store, importing what logs an MLflow Model and a
process's first torch.export take seconds of Python work (~1.5, ~1, ~1.5 and ~2 s here). On
a thread they would hold the interpreter's lock and stall this process; in a process of
their own, started before this one imports torch, they run on another core while this one
imports, composes and builds; whatever the worker will need that does not wait for a message
(what logs an MLflow Model, the export warm-up) it does while it waits for one (Ahead). The
worker answers that the run is open only once it is idle, and the loop's timing window waits
for that answer (loop.py): none of the worker's work shares the CPU with a timed step.

The worker runs a TrackedRun (mlflow_run.py): spooling, resumed runs and end statuses are
the same. Messages are pickled over two pipes, each framed by its length, and answered in
order. Metric points are written before the loop goes on (in time/tracking_s, as when this
process wrote them itself: a write beside the loop would take CPU from it); the MLflow Model
is handed over without waiting, and logged while this process evaluates and writes its
outputs. The worker ignores Ctrl-C and SIGTERM (this process ends the run with the right
status); if this process dies without ending it (kill -9, the OOM killer), the worker ends
the run KILLED on its own and exits.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from reprotrain.errors import TrackingError
from reprotrain.heap import long_lived
from reprotrain.tracking.mlflow_model import stand_in_export
from reprotrain.tracking.mlflow_run import MAX_TEXT, TrackedRun
from reprotrain.tracking.orphans import owner_tags
from reprotrain.tracking.recorder import MAX_BATCH, MetricBuffer, Point, describe_error, end_status
from reprotrain.tracking.spool import Spool
from reprotrain.tracking.store import prepare_store, redact, run_status

# The run's error tag when the training process ended without ending its run.
GONE = "the training process (pid {pid}) ended without ending its run (killed, or out of memory)"
# The worker ignores Ctrl-C and SIGTERM from its first line: they reach the whole process group,
# and the training process ends the run with the right status.
WORKER = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
    "import sys; "
    "from reprotrain.tracking.worker import serve; "
    "serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == 'model')"
)
HEADER = struct.Struct("!Q")  # a message's length in bytes, before its pickle
# The worker's exit status when the training process stopped it while it worked ahead (it
# ended before opening its run); otherwise 0.
DISMISSED = 3
# What mlflow.pytorch imports only for Lightning's autolog (import_model_logging).
LIGHTNING = ("pytorch_lightning", "lightning")


class Channel:
    """Pickled messages over a pair of pipe ends, each framed by its length. What is read off
    the pipe waits in `pending` until a whole message is there, so that `readable` sees a
    message already read off the pipe as well as one still in it."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.writer: BinaryIO = os.fdopen(write_fd, "wb")
        self.pending = bytearray()
        self.ended = False  # the other end has closed its side

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(HEADER.pack(len(data)) + data)
        self.writer.flush()

    def recv(self) -> Any:
        (size,) = HEADER.unpack(self._take(HEADER.size, "the other end closed the pipe"))
        data = self._take(size, "the other end closed the pipe mid-message")
        return pickle.loads(data)  # noqa: S301 - our own process at the other end

    def readable(self) -> bool:
        """Whether a message (or the other end's close) waits to be read, without waiting."""
        return bool(self.pending) or self.ended or self._waiting()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a pipe whose reader is gone: nothing to flush
            self.writer.close()
        with contextlib.suppress(OSError):
            os.close(self.read_fd)

    def _waiting(self) -> bool:
        return bool(select.select([self.read_fd], [], [], 0)[0])

    def _fill(self) -> None:
        chunk = os.read(self.read_fd, 1 << 16)
        self.pending += chunk
        self.ended = not chunk

    def _take(self, size: int, short: str) -> bytes:
        while len(self.pending) < size:
            if self.ended:
                raise EOFError(short)
            self._fill()
        data = bytes(self.pending[:size])
        del self.pending[:size]
        return data


class TrackingWorker:
    """This side of the worker: starts it, opens the run through it (`open`), calls the run's
    methods (`ask`, then `settle` for the answers), and stops it."""

    def __init__(self, model_likely: bool = True) -> None:
        """Start the worker; `model_likely`: whether it may import what logs an MLflow Model
        before `prepare` says if one is logged (Ahead)."""
        self.uri = ""
        to_worker_read, to_worker = os.pipe()
        from_worker, from_worker_write = os.pipe()
        self.process = subprocess.Popen(  # noqa: S603 - this interpreter, reprotrain's own code
            [
                sys.executable,
                "-c",
                WORKER,
                str(to_worker_read),
                str(from_worker_write),
                str(os.getpid()),  # the parent's, even if it dies before the worker starts
                "model" if model_likely else "none",
            ],
            pass_fds=(to_worker_read, from_worker_write),
            stdin=subprocess.DEVNULL,
            stdout=_stderr_fd(),  # MLflow prints run links to stdout: not on this one's
        )
        os.close(to_worker_read)
        os.close(from_worker_write)
        self.channel = Channel(from_worker, to_worker)
        self.owed: list[str] = []  # calls made with `ask` whose answers are not read yet
        self.broken = False  # a message was cut short (a signal mid-read): the pipe is unusable
        self.closed = False
        self.opened = False  # a run was opened through it

    def prepare(self, uri: str, log_model: bool = True) -> TrackingWorker:
        """Name the store (the worker opens it now), say whether an MLflow Model will be
        logged (the worker imports what that needs now), and hand over this process's import
        path (the user's project, where a model's classes come from)."""
        self.uri = uri
        self.post(("prepare", uri, log_model, list(sys.path)))
        return self

    def open(
        self,
        experiment: str,
        run_name: str,
        tags: dict[str, str],
        params: dict[str, Any],
        flush_every_s: float = 5.0,
        resume_run_id: str = "",
        spool_dir: Path | None = None,
        checkpoint_dir: Path | None = None,
    ) -> WorkerRun:
        """Open (or continue) the run in the worker: the arguments of TrackedRun."""
        arguments = dict(
            uri=self.uri,
            experiment=experiment,
            run_name=run_name,
            tags={**{key: str(value) for key, value in tags.items()}, **owner_tags()},
            params={key: None if value is None else str(value) for key, value in params.items()},
            flush_every_s=flush_every_s,
            resume_run_id=resume_run_id,
            spool_dir=spool_dir,
            checkpoint_dir=checkpoint_dir,
        )
        self.opened = True
        self.post(("open", arguments))
        self.ask("opened")  # answered once the run is open and the worker has warmed up
        return WorkerRun(self, flush_every_s, spool_dir)

    def run_status(self, run_id: str) -> Callable[[], str | None]:
        """Ask for run `run_id`'s status in the prepared store, read by the worker (a resumed
        run's check imports no MLflow here either); the call returned waits for the answer
        (None: no such run), so that this process can build meanwhile."""
        self.ask("run_status", self.uri, run_id)
        return lambda: self.settle()["run_status"]

    def post(self, message: tuple[Any, ...]) -> None:
        """Send without waiting for an answer."""
        if self.broken:
            raise self._gone()
        try:
            self.channel.send(message)
        except OSError:  # BrokenPipeError: the worker is gone
            raise self._gone() from None
        except BaseException:  # a signal mid-write: what the worker reads next is cut short
            self.broken = True
            raise

    def ask(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Call `name` without waiting: its answer is read by the next `settle`."""
        self.post(("call", name, args, kwargs))
        self.owed.append(name)

    def settle(self) -> dict[str, Any]:
        """Read every answer owed, oldest first: {call name: its value}; or raise the first
        error among them (after reading them all)."""
        values: dict[str, Any] = {}
        failure: BaseException | None = None
        while self.owed:
            if self.broken:
                raise self._gone()
            try:
                outcome, value = self.channel.recv()
            except (EOFError, OSError):
                raise self._gone() from None
            except BaseException:  # a signal mid-read: the rest of the answer is unread
                self.broken = True
                raise
            name = self.owed.pop(0)
            if outcome == "error":
                failure = failure or value
            else:
                values[name] = value
        if failure is not None:
            raise failure
        return values

    def close(self) -> None:
        """Stop the worker. A run it holds and was not ended through it ends KILLED, as if
        this process had died. One that has not been given a store yet is killed; one that
        has is waited for: killed while it creates a new sqlite store's tables, it would
        leave the store half made. One never asked to open a run stops what it does ahead
        at once (SIGUSR1: nothing of that touches the store)."""
        if self.closed:
            return
        if not self.uri:  # only importing, no store touched yet: nothing of it is needed
            self.process.kill()
        elif not self.opened and self.process.poll() is None:
            self.process.send_signal(signal.SIGUSR1)
        self.closed = True
        self.channel.close()
        self.process.wait()

    def gone(self) -> bool:
        """Whether the worker has exited (or its pipe is unusable)."""
        return self.broken or self.process.poll() is not None

    def describe_exit(self) -> str:
        code = self.process.poll()
        how = (
            "not answering"
            if code is None
            else f"killed by {signal.Signals(-code).name}"
            if code < 0
            else f"exit code {code}"
        )
        return (
            f"the tracking process (pid {self.process.pid}) for store "
            f"{redact(self.uri or '?')} stopped ({how})"
        )

    def _gone(self) -> TrackingError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)  # a closed pipe comes just before the exit status
        return TrackingError(
            self.describe_exit(),
            hint="look at the lines above for its reason, or run with tracking.enabled=false",
        )


def _stderr_fd() -> int | None:
    """This process's stderr, where the worker's lines go (None: inherit, if stderr is not a
    file here, as under a test runner that captures it)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


_early: TrackingWorker | None = None  # started by start_early, not yet taken


def start_early(model_likely: bool = True) -> None:
    """Start this process's worker now, before torch is imported, so that MLflow's import
    runs beside it; a worker nobody takes is stopped when this process exits. Not under a
    torchrun job of several processes: their ranks share the CPU already, and rank 0 (the one
    that records) starts its worker when it opens the run, not before the others' checks."""
    global _early
    if _early is None and os.environ.get("WORLD_SIZE", "1") == "1":
        _early = TrackingWorker(model_likely)
        atexit.register(discard_early)


def take_worker(uri: str, log_model: bool = True) -> TrackingWorker:
    """The worker started early, if any, else a new one; prepared for the store at `uri`."""
    global _early
    worker, _early = _early, None
    return (worker or TrackingWorker(log_model)).prepare(uri, log_model)


def discard_early() -> None:
    """Stop the early worker: this process records nothing itself (tracking off, a container
    records the run, a rank other than 0)."""
    global _early
    if _early is not None:
        _early.close()
        _early = None


class WorkerRun:
    """The Recorder the loop sees (recorder.py) for a run the worker keeps. Metric points wait
    in a MetricBuffer here and go to the worker in batches.

    If the worker dies once the run is open (killed, out of memory), training goes on: the
    rest of the record (points, artifacts, the final status) goes to the run's spool file,
    which `python -m reprotrain.replay` sends, as when the store itself is away (spool.py).
    The MLflow Model is not spooled: a warning says it was not logged."""

    def __init__(
        self, worker: TrackingWorker, flush_every_s: float, spool_dir: Path | None = None
    ) -> None:
        self.worker, self.spool_dir = worker, spool_dir
        # Points wait here while the worker warms up: it answers once it is done.
        self.metrics = MetricBuffer(self._send, MAX_BATCH, flush_every_s, when=self.poll)
        self._run_id = ""
        self.experiment_id = ""
        self.waiting: Path | None = None  # the spool file left for replay, once ended
        self.spool: Spool | None = None  # where the record goes once the worker is gone
        self.model_pending = False  # the MLflow Model was handed over, not yet logged

    def __enter__(self) -> WorkerRun:
        return self

    def start(self) -> None:
        """The worker opens the run as soon as it is asked (`TrackingWorker.open`)."""

    def poll(self) -> bool:
        """Whether the run is open and the worker idle, without waiting; raises what opening
        the run hit. Until then metric points wait here (the worker is busy warming up)."""
        if not self._run_id and self.worker.channel.readable():
            self._settle()
        return bool(self._run_id)

    def ready(self) -> None:
        """Wait until the run is open (and the worker has warmed up); raise what opening it
        hit."""
        if not self._run_id:
            self._settle()

    def _settle(self) -> dict[str, Any]:
        values = self.worker.settle()
        if "opened" in values:
            self._run_id, self.experiment_id = values["opened"]
        if "log_model" in values:
            self.model_pending = False
        return values

    def _call(self, name: str, *args: Any) -> Any:
        self.worker.ask(name, *args)
        return self._settle()[name]

    def _spooling(self) -> bool:
        """True once the worker is gone and the rest of the record goes to the run's spool
        file (made, and said, the first time); False while the worker is there, or if there
        is no open run to keep a record for."""
        if self.spool is None:
            if not self.worker.gone() or not self._run_id or self.spool_dir is None:
                return False
            self.spool = Spool(
                self.spool_dir / f"{self._run_id}.jsonl", self.worker.uri, self._run_id
            )
            print(
                f"reprotrain: warning: {self.worker.describe_exit()}; training goes on, the "
                f"rest of run {self._run_id}'s record is kept in {self.spool.path}",
                file=sys.stderr,
                flush=True,
            )
        return True

    @property
    def run_id(self) -> str:
        self.ready()
        return self._run_id

    def log_metric(self, key: str, value: float, step: int) -> None:
        self.metrics.add(key, value, step)

    def log_metrics(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.metrics.add(key, value, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        self._call("set_tags", tags)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        where = Path(path).resolve()
        self._keep_or_call({"artifact": str(where)}, "log_artifact", where, artifact_path)

    def log_model(self, model: Any, input_example: Any, registered_name: str | None = None) -> Any:
        """Hand `model` to the worker, which logs it while this process goes on; what that
        hits is raised by the next call that waits (an artifact, the run's end)."""
        try:
            if not self._spooling():
                self.worker.ask("log_model", model, input_example, registered_name)
                self.model_pending = True
                return
        except TrackingError:
            if not self._spooling():
                raise
        self.model_pending = True  # said at the end: it cannot be spooled

    def unsent(self) -> list[Point]:
        """Points logged here and not yet handed to the worker (a checkpoint keeps them)."""
        return list(self.metrics.points)

    def resend(self, points: list[Any]) -> None:
        self.metrics.extend(points)

    def _send(self, points: list[Point]) -> None:
        """Points go to the store before the loop goes on (this wait is part of
        time/tracking_s): a write the worker did beside the loop would take CPU from it."""
        self._keep_or_call({"metrics": [list(point) for point in points]}, "send", points)

    def _keep_or_call(self, record: dict[str, Any], name: str, *args: Any) -> None:
        """Call `name` in the worker; once it is gone, spool `record` instead (a write it may
        have made before it died is then sent again: the store keeps one of identical
        points)."""
        try:
            if not self._spooling():
                self._call(name, *args)
                return
        except TrackingError:
            if not self._spooling():
                raise
        self.spool.append(record)  # type: ignore[union-attr]

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        status = end_status(error)
        message = describe_error(error)[:MAX_TEXT] if error is not None else ""
        try:
            self.metrics.flush()
            if not self._spooling():
                self.waiting = self._call("close", status, message, error is not None)
        except Exception as failure:
            gone = isinstance(failure, TrackingError) and self._spooling()
            if not gone and error is None:
                raise  # otherwise the error in flight says what went wrong
        finally:
            self.worker.close()
        if self.spool is not None:
            if self.model_pending:
                print(
                    f"reprotrain: warning: the MLflow Model of run {self._run_id} was not "
                    f"logged: {self.worker.describe_exit()}",
                    file=sys.stderr,
                    flush=True,
                )
            self.spool.append({"status": status, "error": message})
            self.waiting = self.spool.path
            print(
                f"reprotrain: warning: run {self._run_id} ends {status} once you send the "
                f"rest with: python -m reprotrain.replay {self.spool.path}",
                file=sys.stderr,
                flush=True,
            )


def serve(read_fd: int, write_fd: int, parent: int, model_likely: bool = True) -> None:
    """The worker's side: answer the training process (pid `parent`) until it ends the run or
    is gone. While nothing is asked of it, it does ahead what the run will need (Ahead)."""
    channel = Channel(read_fd, write_fd)
    ahead = Ahead(model_likely)
    signal.signal(signal.SIGUSR1, ahead.dismiss)
    with long_lived():  # MLflow, SQLAlchemy, ...: kept for the worker's life (heap.py)
        import_mlflow()
    run: TrackedRun | None = None
    status = 0
    while True:
        try:
            if not channel.readable() and ahead.step():  # nothing asked yet: work ahead
                continue
        except Dismissed:  # the training process ended before opening its run
            status = DISMISSED
            break
        try:
            message = channel.recv()
        except (EOFError, OSError):  # the training process is gone, or closed us unopened
            if run is not None:
                end_abandoned(run, parent)
            break
        kind = message[0]
        if kind == "prepare":
            _, uri, ahead.log_model, paths = message  # log_model: an MLflow Model at the end
            sys.path[:] = paths  # the user's project too: their model classes unpickle here
            with long_lived():
                open_store(uri)
        elif kind == "open":
            run = TrackedRun(**message[1])
            run.start()
            if ahead.log_model:
                with contextlib.suppress(Exception):  # the run's open reports its own failure
                    run.ready()  # the run's own record comes before the warm-up
                ahead.warm_up_export()
        elif kind == "call":
            _, name, args, kwargs = message
            try:
                reply = ("ok", answer(run, name, args, kwargs))  # type: ignore[arg-type]
            except Exception as error:
                reply = ("error", portable(error))
            try:
                channel.send(reply)
            except OSError:  # BrokenPipeError: the training process died before the answer
                if run is not None and (name != "close" or reply[0] == "error"):
                    end_abandoned(run, parent)
                break
            if name == "close":
                break
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the exit's full collection would walk all of MLflow and torch: ~1 s
    os._exit(status)  # noqa: SLF001 - nothing is left to write: the run is ended and flushed


class Dismissed(BaseException):
    """Raised in the worker's work ahead when the training process stops it (SIGUSR1)."""


class Ahead:
    """What the worker does before it is asked, while the training process imports, composes
    and builds: import what logs an MLflow Model (before the store is named, if a model is
    likely: tracking.log_model is on unless the command line turned it off), then, once a
    model is known to be logged, the export warm-up. Each is done once, ahead or when the run
    needs it; a message that arrives waits at most for the one step under way, and a training
    process that ends before opening its run stops that step at once (`dismiss`)."""

    def __init__(self, model_likely: bool) -> None:
        self.model_likely = model_likely
        self.log_model: bool | None = None  # None: not said yet ("prepare" says it)
        self.imported = self.warm = False
        self.busy = False  # in a step: one that may be stopped

    def step(self) -> bool:
        """Do the next piece of work ahead; False when there is none (wait for a message)."""
        wanted = self.model_likely if self.log_model is None else self.log_model
        if wanted and not self.imported:
            work = self.import_model_logging
        elif self.log_model and not self.warm:  # a model is logged: no longer a guess
            work = self.warm_up_export
        else:
            return False
        self.busy = True
        try:
            work()
        finally:
            self.busy = False
        return True

    def dismiss(self, _signum: int, _frame: object) -> None:
        """SIGUSR1: stop the step under way (its scratch folder is removed on the way out);
        between steps the closed pipe ends the worker."""
        if self.busy:
            raise Dismissed

    def import_model_logging(self) -> None:
        if not self.imported:
            with long_lived():  # torch, mlflow.pytorch: kept for the worker's life (heap.py)
                import_model_logging()
            self.imported = True

    def warm_up_export(self) -> None:
        """Save a two-weight stand-in model the way the run's model will be logged
        (torch.export, into a scratch folder, nothing in the store): the first export loads
        torch.export's and MLflow's machinery (~2 s here), so the run's own, at its end, takes
        a fraction of that."""
        if self.warm:
            return
        self.import_model_logging()
        with contextlib.suppress(Exception), tempfile.TemporaryDirectory() as scratch:
            stand_in_export(Path(scratch) / "model")
        self.warm = True


def answer(run: TrackedRun, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if name == "run_status":  # a resumed run's, asked before the run is opened
        return run_status(*args)
    if name == "opened":
        return run.run_id, run.experiment_id
    if name == "send":  # metric points, sent to the store (or spooled) before answering
        run.metrics.extend(args[0])
        run.metrics.flush()
        return None
    if name == "close":
        status, message, failing = args
        run.close(status, message, failing)
        return run.waiting
    if name == "log_model":
        run.log_model(*args, **kwargs)
        return None  # MLflow's ModelInfo stays here: the caller reads the run, not it
    return getattr(run, name)(*args, **kwargs)  # set_tags, log_artifact


def end_abandoned(run: TrackedRun, parent: int) -> None:
    """The training process died without ending its run: end it KILLED, with what was sent."""
    try:
        run.close("KILLED", GONE.format(pid=parent), failing=True)
    except Exception as error:  # the store is away too: the orphan sweep ends it later
        print(
            f"reprotrain: warning: the run of training process {parent} could not be ended "
            f"KILLED after it died ({describe_error(error)[:200]})",
            file=sys.stderr,
            flush=True,
        )


def import_mlflow() -> None:
    """MLflow's client, imported while the training process imports torch and composes."""
    from mlflow.tracking import MlflowClient  # noqa: F401


def open_store(uri: str) -> None:
    """Open the store while the training process builds (a new sqlite store's schema is
    created once, under a file lock: runs started together race for it); what fails here is
    met again, and reported, when the run opens."""
    from mlflow.tracking import MlflowClient

    with contextlib.suppress(Exception):  # reported by TrackedRun's open, with its retries
        prepare_store(uri)
        MlflowClient(uri)


def import_model_logging() -> None:
    """torch and mlflow.pytorch, for the MLflow Model at the end: imported before the run is
    said to be open (the next message), so that the end of the run waits only for the export
    itself.

    Where Lightning is installed, mlflow.pytorch's import also imports it (~2.4 s here), only
    to offer its autolog checkpoint callback, which reprotrain does not use; it catches the
    ImportError when Lightning is absent. Lightning is held back for this one import (a None
    entry in sys.modules is Python's way to make an import fail), then released: a
    LightningModule's own unpickling imports it as usual."""
    held = [name for name in LIGHTNING if name not in sys.modules]
    sys.modules.update(dict.fromkeys(held))
    try:
        with contextlib.suppress(Exception):  # log_model imports it again, reports what fails
            import mlflow.pytorch  # noqa: F401
    finally:
        for name in held:
            if sys.modules.get(name, "") is None:
                del sys.modules[name]


def portable(error: BaseException) -> BaseException:
    """`error` if it can cross the pipe; otherwise a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
