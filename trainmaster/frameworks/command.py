"""``command``: every role is an arbitrary command; the controller adds only the TM_* variables.

``frameworkParams.indexVariables`` (a list of variable names) also sets each of them to the
instance's index in its role: how a Volcano Job's ``env`` plugin (``VK_TASK_INDEX``,
``VC_TASK_INDEX``) is honoured.
"""

from __future__ import annotations

import re
from typing import Any

from trainmaster.frameworks.base import Framework, InstanceContext

_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


class CommandFramework(Framework):
    name = "command"

    def validate(self, spec: dict[str, Any], roles: list[dict[str, Any]]) -> list[str]:
        errors = super().validate(spec, roles)
        params = spec.get("frameworkParams")
        names = params.get("indexVariables", []) if isinstance(params, dict) else []
        if not isinstance(names, list) or not all(isinstance(n, str) and _VARIABLE.fullmatch(n) for n in names):
            errors.append("spec.frameworkParams.indexVariables: must be a list of environment "
                          "variable names (letters, digits, '_')")
        return errors

    def environment(self, ctx: InstanceContext) -> dict[str, str]:
        return {name: str(ctx.index) for name in ctx.params.get("indexVariables", [])}
