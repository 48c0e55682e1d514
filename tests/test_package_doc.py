"""``megatron_ext/__init__.py``'s docstring is the package's table of contents: it names every
subpackage and top-level module that exists, so a new one is added there too."""
from __future__ import annotations

import os

import megatron_ext


def test_the_package_docstring_names_every_subpackage_and_module():
    root = os.path.dirname(megatron_ext.__file__)
    parts = sorted(f"``{name}/``" if os.path.isdir(os.path.join(root, name)) else f"``{name}``"
                   for name in os.listdir(root)
                   if name.endswith(".py") and name != "__init__.py"
                   or os.path.isfile(os.path.join(root, name, "__init__.py")))
    missing = [p for p in parts if p not in megatron_ext.__doc__]
    assert not missing, f"megatron_ext/__init__.py's docstring does not name {', '.join(missing)}"
