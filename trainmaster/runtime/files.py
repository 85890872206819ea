"""The small files through which an instance runtime tells its backend how it is doing.

``launch.json`` (written by the controller) says what to run; ``ready`` appears when the wait
step has passed and the role's command started; ``exit_code`` holds the command's exit status;
``reason`` a machine reason and a human message when the runtime itself gave up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class InstanceFiles:
    def __init__(self, instance_dir: str | Path):
        self.dir = Path(instance_dir)
        self.launch = self.dir / "launch.json"
        self.ready = self.dir / "ready"
        self.exit_code = self.dir / "exit_code"
        self.reason = self.dir / "reason"

    def reset_attempt(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in (self.ready, self.exit_code, self.reason):
            path.unlink(missing_ok=True)

    def write_launch(self, launch: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.launch, json.dumps(launch))

    def read_launch(self) -> dict[str, Any]:
        return json.loads(self.launch.read_text())

    def mark_ready(self) -> None:
        _atomic_write(self.ready, "")

    def write_exit_code(self, code: int) -> None:
        _atomic_write(self.exit_code, str(code))

    def read_exit_code(self) -> int | None:
        try:
            return int(self.exit_code.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def write_reason(self, reason: str, message: str) -> None:
        _atomic_write(self.reason, json.dumps({"reason": reason, "message": message}))

    def read_reason(self) -> tuple[str, str]:
        try:
            data = json.loads(self.reason.read_text())
            return data["reason"], data["message"]
        except (FileNotFoundError, ValueError, KeyError):
            return "", ""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
