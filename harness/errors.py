"""The one kind of error a user can fix.

Everything the user chose (flags, profiles, baselines, paths) and everything the machine must offer (privileges,
qdiscs, an engine) is checked before anything is created on the host; what fails such a check raises a
`UserError` whose message is one sentence naming the fix. The CLI prints it as one line and exits 2. Every other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class UserError(Exception):
    """Bad input or a missing capability; the message is one sentence naming the fix."""


def read_yaml(path: Path, what: str, error: type[UserError]) -> Any:
    """The YAML file a user wrote (a profile, a baseline); `error` names what is wrong with it, and where."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise error(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{what} {path} is not a text file (byte {err.start} is not UTF-8); pass the YAML file itself"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise error(f"{what} {path} is not valid YAML{where}; fix the syntax") from None
