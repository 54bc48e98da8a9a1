"""The shape of the code, checked: which module may import which (the layers of DESIGN.md), and no
function so long that it cannot be read on a screen or two. Imports are read with `ast`, including
those inside functions: a lazy import is an arrow too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pretrain", "monitoring")
# The command layer wires everything together; the rest of `pretrain` is the library.
COMMAND_LAYER = ("pretrain.cli", "pretrain.demo", "pretrain.bench", "pretrain.__main__")
MAX_FUNCTION_LINES = 100


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pretrain import train`
    return found


def within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(allowed) -> list[str]:
    """`allowed(importer, imported)` -> None if fine, else why not; every arrow that breaks it."""
    out = []
    for importer, path in modules().items():
        for imported in sorted(imports_of(path)):
            if (why := allowed(importer, imported)) is not None:
                out.append(f"{path.relative_to(ROOT)} imports {imported}: {why}")
    return out


def test_the_walker_sees_imports_including_lazy_ones():
    train = imports_of(ROOT / "pretrain" / "train.py")
    assert "monitoring.protocol" in train and "pretrain.checkpoint.checkpointer" in train
    assert "pretrain.cli" in train  # the `python -m pretrain.train` entry, inside its __main__ guard
    assert "deepspeed.utils" in train  # imported inside layer_grad_squares


def test_the_library_speaks_to_monitoring_through_the_protocol_only():
    def allowed(importer, imported):
        library = within(importer, ("pretrain",)) and not within(importer, COMMAND_LAYER)
        if library and within(imported, ("monitoring",)) and not within(imported, ("monitoring.protocol",)):
            return "the library imports only monitoring.protocol from monitoring"
        return None

    assert violations(allowed) == []


def test_monitoring_never_imports_the_loop_or_the_command_layer():
    forbidden = ("pretrain.train", "pretrain.pretraining", "pretrain.finetune", *COMMAND_LAYER)

    def allowed(importer, imported):
        if within(importer, ("monitoring",)) and within(imported, forbidden):
            return "monitoring sees metrics in and actions out, never the trainer or the CLI"
        if importer == "monitoring.protocol" and within(imported, ("pretrain", "monitoring")):
            return "the protocol is what both sides share: it depends on neither"
        return None

    assert violations(allowed) == []


# Modules and what they must never import (DESIGN.md, "Where things live"); the loop's pieces are
# testable without the loop, so none of them imports it.
NEVER = {
    "pretrain.config": ("torch", "deepspeed", "pretrain.model"),
    "pretrain.model": ("deepspeed", "pretrain.data", "monitoring"),
    "pretrain.flops": ("deepspeed",),
    "pretrain.hf": ("deepspeed",),
    "pretrain.tokenizer": ("pretrain.model",),
    "pretrain.data": ("pretrain.model", "pretrain.engine"),
    "pretrain.engine": ("pretrain.data",),
    "pretrain.distributed": ("pretrain.train",),
    "pretrain.faults": ("pretrain.train",),
    "pretrain.monitor_link": ("pretrain.train",),
    "pretrain.evaluation": ("pretrain.train",),
    "pretrain.checkpoint": ("pretrain.train",),
    "pretrain.train": COMMAND_LAYER[1:],  # (its __main__ guard runs the CLI: that is the entry)
}


@pytest.mark.parametrize("owner", sorted(NEVER))
def test_each_module_keeps_to_its_layer(owner):
    def allowed(importer, imported):
        if within(importer, (owner,)) and within(imported, NEVER[owner]):
            return f"{owner} never imports {', '.join(NEVER[owner])}"
        return None

    assert violations(allowed) == []


def test_no_function_is_longer_than_a_screen_or_two():
    long = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert long == []


def test_the_training_loop_reads_on_one_screen():
    tree = ast.parse((ROOT / "pretrain" / "train.py").read_text())
    (train,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train"]
    assert train.end_lineno - train.lineno + 1 <= 60
