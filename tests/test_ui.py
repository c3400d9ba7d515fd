"""A fresh run's page in MLflow's UI, as a new user opens it: the link reprotrain prints, in a
real browser (Debian's chromium through playwright) with a fresh profile, against `mlflow ui`.
Screenshots go to $REPROTRAIN_SCREENSHOT_DIR (docs/ holds the last ones)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import (
    BIN,
    CHROMIUM_FLAGS,
    Store,
    child_env,
    empty_store_file,
    require_chromium,
    train,
)
from teamserver import free_port, stop_group, wait_until

SCREENSHOTS = Path(os.environ.get("REPROTRAIN_SCREENSHOT_DIR", tempfile.gettempdir()))
WAIT_MS = 90_000  # the UI draws slowly on a loaded 2-core machine

pytestmark = pytest.mark.e2e  # `mlflow ui` and Chromium


@pytest.fixture(scope="module")
def ui_store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """The store the run records in and `mlflow ui` serves, its schema made before the two
    open it side by side (a fresh sqlite store created by two processes at once breaks)."""
    return Store(tmp_path_factory.mktemp("ui")).create_from(empty_store_file())


@pytest.fixture(scope="module")
def mlflow_ui(ui_store: Store) -> Iterator[tuple[str, subprocess.Popen]]:
    """`mlflow ui` on a free 127.0.0.1 port over the run's store, in its own process group:
    started, not yet answering (trained waits for it)."""
    port = free_port()
    command = ["ui", "--backend-store-uri", ui_store.uri, "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), *command],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_group(proc)  # the server and its job-consumer children


@pytest.fixture(scope="module")
def trained(ui_store: Store, mlflow_ui: tuple[str, subprocess.Popen]) -> tuple[Store, str, str]:
    """A run long enough for MLflow's system-metrics monitor to sample it a few times (its
    interval set through MLflow's own variable), trained while `mlflow ui` starts; the link
    the run printed, and the UI's address once it answers."""
    store = ui_store
    env = {**child_env(), "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "0.5"}
    result = train(store.path.parent, store, "train.steps=1500", "data.num_samples=4096", env=env)
    (link,) = re.findall(r"then open (\S+)", result.stderr)
    url, proc = mlflow_ui
    health = f"{url}/health"
    wait_until(lambda: urllib.request.urlopen(health, timeout=2).status == 200, "ui", proc)
    return store, link, url


@pytest.mark.browser
def test_printed_link_opens_model_training_with_loss_first_system_metrics_and_datasets(
    trained: tuple[Store, str, str],
) -> None:
    chromium = require_chromium()
    from playwright.sync_api import sync_playwright

    store, link, mlflow_ui = trained
    run = store.only_run()
    assert link.endswith(f"/runs/{run.info.run_id}?workflowType=machine_learning")
    page_url = link.replace("http://127.0.0.1:5000", mlflow_ui)  # the UI's port here
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()  # fresh
        page.goto(page_url)
        page.get_by_text(run.data.tags["device.name"]).first.wait_for(timeout=WAIT_MS)
        page.get_by_text("synthetic-train").first.wait_for(timeout=WAIT_MS)
        overview = page.inner_text("body")
        # Model training's sidebar (Runs, Models, Model registry), not GenAI's (Evaluation runs).
        assert "Model registry" in overview and "Evaluation runs" not in overview
        assert run.info.run_name in overview and "Training" in overview  # the dataset's context
        page.screenshot(path=str(SCREENSHOTS / "mlflow-run-overview.png"))

        page.goto(page_url.replace("?", "/model-metrics?"))
        page.locator(".js-plotly-plot svg.main-svg").first.wait_for(timeout=WAIT_MS)
        page.get_by_text("Add chart").first.wait_for(timeout=WAIT_MS)
        body = page.inner_text("body").split("Auto-refresh", 1)[1]
        sections = re.findall(r"^(\S[^\n]*)\n\((\d+)\)$", body, re.MULTILINE)
        # train/* first (its charts by name: loss, step_ms), then val/*, then the summaries.
        assert [name for name, _ in sections] == ["train", "val", "Model metrics"], sections
        page.screenshot(path=str(SCREENSHOTS / "mlflow-run-loss.png"))

        page.goto(page_url.replace("?", "/system-metrics?"))
        page.get_by_text("cpu_utilization_percentage").first.wait_for(timeout=WAIT_MS)
        page.locator(".js-plotly-plot svg.main-svg").first.wait_for(timeout=WAIT_MS)
        page.screenshot(path=str(SCREENSHOTS / "mlflow-run-system-metrics.png"))
        browser.close()
