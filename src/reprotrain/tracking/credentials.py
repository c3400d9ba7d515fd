"""Passwords stay out of every line printed and every file written.

    redact("http://user:secret@host")      # "http://user:***@host"; MLFLOW_TRACKING_PASSWORD too
    RedactSecrets()                         # a logging filter (failures.quiet_mlflow_logs)
    hide_run_links(uri)                     # MLflow prints none with a password in them
    full_uri(recorded, given)               # a spool's redacted URI with its password again

A password comes in a URI (`tracking.uri=http://user:pass@host`, `postgresql://user:pass@...`)
or in MLFLOW_TRACKING_PASSWORD. Messages, tags, params, log records and spool files carry the
URI with `***` for its password; `replay` puts the password back from the environment.
"""

from __future__ import annotations

import logging
import os
import urllib.parse

from reprotrain.errors import TrackingError
from reprotrain.redaction import HIDDEN, PASSWORD_ENV, redact


class RedactSecrets(logging.Filter):
    """Rewrites a log record's message and traceback without passwords (MLflow's error texts
    name the server's URL as it was given, user:password@ included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if redact(message) != message:
            record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            text = logging.Formatter().formatException(record.exc_info)
            if redact(text) != text:
                record.exc_text = redact(text)  # what formatters print instead of exc_info
        return True


def hide_run_links(uri: str) -> None:
    """No run links printed by MLflow (`View run ... at: <uri>/...`) when `uri` carries a
    password: they hold the URI as given."""
    if redact(uri) != uri:
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def hidden_password(uri: str) -> bool:
    """The URI names a user whose password was replaced by `***`."""
    return urllib.parse.urlsplit(uri).password == HIDDEN


def with_password(uri: str, password: str) -> str:
    """`uri` with `password` (quoted as a URI needs) in place of its `***`."""
    parts = urllib.parse.urlsplit(uri)
    host = parts.netloc.rpartition("@")[2]
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    netloc = f"{user}:{urllib.parse.quote(password, safe='')}@{host}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def full_uri(recorded: str, given: str | None) -> str:
    """The URI to send a spool to: `given` (--tracking-uri); else the spool's own, which
    records `***` for a password, with the password from MLFLOW_TRACKING_URI (when it names the
    same store) or MLFLOW_TRACKING_PASSWORD."""
    if given:
        return given
    if not hidden_password(recorded):
        return recorded
    environment_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if environment_uri and redact(environment_uri) == recorded:
        return environment_uri
    if os.environ.get(PASSWORD_ENV):
        return with_password(recorded, os.environ[PASSWORD_ENV])
    raise TrackingError(
        f"the spool names its store without the password ({recorded}); allowed: the password "
        f"in {PASSWORD_ENV}, or the whole URI in --tracking-uri or MLFLOW_TRACKING_URI",
        hint=f"export {PASSWORD_ENV}=<password> and run the replay again",
    )
