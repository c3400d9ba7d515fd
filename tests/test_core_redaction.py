"""Secrets out of every line (reprotrain.redaction): any password a URI carries, whatever its
characters, a secret in its query, and MLFLOW_TRACKING_PASSWORD raw or %-encoded; also the
one error line every command prints."""

from __future__ import annotations

import pytest

from reprotrain.errors import ConfigError, report_and_exit
from reprotrain.redaction import redact

CASES = {
    # an @ in the password: everything up to the last @ before the host is user information
    "http://u:p@ss-1@127.0.0.1:5000/x": "http://u:***@127.0.0.1:5000/x",
    "http://u:a:b/c@host/p": "http://u:***@host/p",  # a : and a / in it
    "http://user:p%40ss%3Aw%2Frd@host": "http://user:***@host",  # %-encoded
    "postgresql://mlu:PW@db:5432/db?sslmode=disable": (
        "postgresql://mlu:***@db:5432/db?sslmode=disable"
    ),
    "see postgresql://u@h/db?password=sek&x=1 there": "see postgresql://u@h/db?password=***&x=1 there",
    "mysql://h/db?user=u&Token=t0k#f": "mysql://h/db?user=u&Token=***#f",
    # no password: left as it is
    "http://host/path?email=a@b": "http://host/path?email=a@b",
    "sqlite:////tmp/a@b/mlflow.db": "sqlite:////tmp/a@b/mlflow.db",
    "http://127.0.0.1:5000/#/experiments/1/runs/abc": "http://127.0.0.1:5000/#/experiments/1/runs/abc",
}


@pytest.mark.parametrize("text", list(CASES))
def test_every_password_a_uri_carries_is_hidden(text: str) -> None:
    assert redact(text) == CASES[text]


def test_mlflow_tracking_password_is_hidden_raw_and_encoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "p@ss:w/rd%x")
    assert redact("a p@ss:w/rd%x b p%40ss%3Aw%2Frd%25x c") == "a *** b *** c"


def test_the_error_line_carries_no_password(capsys: pytest.CaptureFixture[str]) -> None:
    """An override Hydra cannot parse, a store that does not answer: the line names the URI
    without what is secret in it."""
    error = ConfigError(
        "tracking.uri='postgresql://mlu:P@W:1@db/x?sslmode=disable&password=Q' cannot be parsed",
        hint="quote it",
    )
    with pytest.raises(SystemExit):
        report_and_exit(error)
    line = capsys.readouterr().err
    assert "P@W" not in line and "=Q" not in line and "W:1" not in line
    assert "postgresql://mlu:***@db/x?sslmode=disable&password=***" in line


def test_the_printed_link_to_a_server_carries_no_credentials() -> None:
    from reprotrain.tracking.store import where_to_look

    line = where_to_look("http://ci:p@ss:w@127.0.0.1:5000/", "1", "abc")
    assert (
        line == "open http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning"
    )
