"""``fedge new DIR``: a Flower app project around the user's own ``task.py`` (like ``flwr new``).

The project is a Flower app whose components are Fedge's ServerApp and ClientApp; the only code in
it is ``task.py`` (model, data, partitioning, loss, metrics). ``flwr run .`` runs it on Flower's
default local simulation; ``fedge demo --app DIR`` and ``fedge local-cluster --app DIR`` on Fedge's
launchers. The templates ship inside the package (``fedge.server.cli/templates``) and use data that
ships inside scikit-learn, so a new project trains offline.
"""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path
from string import Template

__all__ = ["TEMPLATES", "ScaffoldError", "new_project"]

#: template -> (task class, partitioning, learning rate)
TEMPLATES = {
    "classification": ("WineTask", "dirichlet:alpha=1.0,min_size=5", 0.05),  # 133 samples: 10 devices of 5+
    "regression": ("DiabetesTask", "iid", 0.02),
}
_FILES = ("pyproject.toml", "task.py", "README.md")


class ScaffoldError(ValueError):
    """The project cannot be written where asked; nothing was written."""


def project_name(directory: Path) -> str:
    """A Python-package-like name from the directory's (``My App`` -> ``my-app``)."""
    name = re.sub(r"[^a-z0-9]+", "-", directory.resolve().name.lower()).strip("-")
    return name or "fedge-app"


def new_project(directory: str | Path, template: str = "classification", force: bool = False) -> list[Path]:
    """Write the project's files into ``directory``; return their paths. An existing non-empty
    directory is refused unless ``force`` (then only the template's files are replaced)."""
    if template not in TEMPLATES:
        raise ScaffoldError(f"unknown template {template!r}; templates: {', '.join(TEMPLATES)}")
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise ScaffoldError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ScaffoldError(f"{target} is not empty; choose a new directory (or --force to overwrite "
                            f"{', '.join(_FILES)} there)")
    task_class, partitioning, lr = TEMPLATES[template]
    values = {"name": project_name(target), "publisher": "me", "template": template,
              "task": f"task:{task_class}", "partitioning": partitioning, "lr": repr(lr)}
    source = files("fedge.server.cli").joinpath("templates", template)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name in _FILES:
        text = source.joinpath(name).read_text(encoding="utf-8")
        if name != "task.py":  # task.py is Python, written as it is
            text = Template(text).substitute(values)
        path = target / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
