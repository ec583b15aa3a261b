"""The plugin registry against the list of llm-d-router types not implemented here."""

from __future__ import annotations

import subprocess
import sys

from evergreen_trio.picker.plugins import ALPHA_TYPES, NOT_IMPLEMENTED, NOT_IMPLEMENTED_LIST, PLUGIN_TYPES


def test_a_type_is_registered_or_listed_not_implemented_never_both() -> None:
    assert not set(NOT_IMPLEMENTED_LIST) & set(PLUGIN_TYPES)
    assert set(NOT_IMPLEMENTED_LIST) == NOT_IMPLEMENTED and len(NOT_IMPLEMENTED_LIST) == len(NOT_IMPLEMENTED)
    assert set(PLUGIN_TYPES) | NOT_IMPLEMENTED >= ALPHA_TYPES


def test_importing_the_picker_registers_every_type_its_configs_name() -> None:
    """A fresh process that imports only the package sees the whole registry (no type is registered
    by a module a config parse would not import)."""
    script = ("import evergreen_trio.picker\nfrom evergreen_trio.picker.plugins import PLUGIN_TYPES\n"
              "print(sorted(PLUGIN_TYPES))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(PLUGIN_TYPES))
