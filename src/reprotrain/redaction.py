"""Secrets out of every line: a URI's password, a password in its query, MLflow's password.

    redact("http://user:p@ss@host/x")       # "http://user:***@host/x"
    redact("postgresql://u@h/db?password=pw")  # "postgresql://u@h/db?password=***"

A URI's user information runs to the last `@` before the host, so a password that holds `@`,
`:` or `/` (written raw, as people do, or %-encoded) is hidden whole; the user name before the
first `:` stays. A query parameter that names a secret (`password=`, `token=`, ...) is hidden
too, and so is the value of MLFLOW_TRACKING_PASSWORD (raw or %-encoded) wherever it appears.
Standard library only: the error line every command prints (errors.report_and_exit) uses it.
"""

from __future__ import annotations

import os
import re
import urllib.parse

HIDDEN = "***"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"  # MLflow's basic-auth password for a server
SHORTEST_FOUND = 4  # a shorter MLFLOW_TRACKING_PASSWORD cannot be told from ordinary text

# scheme://userinfo@ with userinfo as long as it can be inside one word: up to the last @.
USERINFO = re.compile(r"(?<=://)([^\s'\"<>@]*(?:@[^\s'\"<>@]*)*)@")
SECRET_PARAMETERS = (
    "password",
    "passwd",
    "pwd",
    "pass",
    "secret",
    "token",
    "access_token",
    "api_key",
    "apikey",
    "sslpassword",
)
QUERY_SECRET = re.compile(rf"(?i)([?&;](?:{'|'.join(SECRET_PARAMETERS)})=)[^&;#\s'\"<>]*")


def redact(text: str) -> str:
    """`text` with every URI password, secret query value and MLFLOW_TRACKING_PASSWORD hidden."""
    text = USERINFO.sub(_hide_password, text)
    text = QUERY_SECRET.sub(rf"\1{HIDDEN}", text)
    password = os.environ.get(PASSWORD_ENV, "")
    if len(password) >= SHORTEST_FOUND:
        for form in dict.fromkeys([password, urllib.parse.quote(password, safe="")]):
            text = text.replace(form, HIDDEN)
    return text


def _hide_password(found: re.Match[str]) -> str:
    user, colon, _password = found.group(1).partition(":")
    return f"{user}:{HIDDEN}@" if colon else found.group(0)
