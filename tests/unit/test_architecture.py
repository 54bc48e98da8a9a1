"""The shape of the code, checked: which module may import which (the layers of
docs/architecture.md: command layer → library → `monitoring.protocol`, and no cycle anywhere), and
no function so long that it cannot be read on a screen or two. Imports are read with `ast`,
including those inside functions: a lazy import is an arrow too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pretrain", "monitoring")
# The command layer wires everything together; the rest of `pretrain` is the library. The
# `__main__` modules are entries (`python -m pretrain.train` is `pretrain train`): command layer too.
COMMAND_LAYER = (
    "pretrain.cli",
    "pretrain.bench",
    "pretrain.__main__",
    "pretrain.train.__main__",
    "pretrain.finetune.__main__",
)
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
    loop = imports_of(ROOT / "pretrain" / "train" / "loop.py")
    assert "monitoring.protocol" in loop and "pretrain.checkpoint.checkpointer" in loop
    assert "deepspeed.utils" in loop  # imported inside layer_grad_squares
    assert "pretrain.cli" in imports_of(ROOT / "pretrain" / "train" / "__main__.py")  # inside its guard


def resolved(imported: str, known) -> str | None:
    """The project module an import names (`pretrain.data.WindowStream` is `pretrain.data`)."""
    while imported and imported not in known:
        imported = imported.rpartition(".")[0]
    return imported or None


def import_cycles() -> list[list[str]]:
    """Groups of modules that import each other, directly or around a loop (Tarjan's strongly
    connected components of the import graph, lazy imports included)."""
    known = modules()
    graph = {m: {r for i in imports_of(p) if (r := resolved(i, known)) and r != m} for m, p in known.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_imports_run_one_way_with_no_cycle():
    """A module never imports, even lazily or through others, a module that imports it: each can be
    read, tested and changed knowing only what is below it."""
    assert import_cycles() == []


def test_the_library_never_imports_the_command_layer():
    def allowed(importer, imported):
        if not within(importer, COMMAND_LAYER) and within(imported, COMMAND_LAYER):
            return "the library is below the command layer: commands import it, never the reverse"
        return None

    assert violations(allowed) == []


def test_the_library_speaks_to_monitoring_through_the_protocol_and_its_settings_only():
    def allowed(importer, imported):
        library = within(importer, ("pretrain",)) and not within(importer, COMMAND_LAYER)
        shared = ("monitoring.protocol", "monitoring.config")
        if library and within(imported, ("monitoring",)) and not within(imported, shared):
            return "the library imports only monitoring.protocol and monitoring.config from monitoring"
        return None

    assert violations(allowed) == []


def test_monitoring_never_imports_the_loop_or_the_command_layer():
    forbidden = ("pretrain.train", "pretrain.pretraining", "pretrain.finetune", *COMMAND_LAYER)

    def allowed(importer, imported):
        if within(importer, ("monitoring",)) and within(imported, forbidden):
            return "monitoring sees metrics in and actions out, never the trainer or the CLI"
        if importer in ("monitoring.protocol", "monitoring.config") and within(
            imported, ("pretrain", "monitoring", "torch", "deepspeed")
        ):
            return "the protocol and the monitor's settings are what both sides share: they depend on neither"
        return None

    assert violations(allowed) == []


# Modules and what they must never import (docs/architecture.md, "Where things live"); the loop's
# pieces are testable without the loop, so none of them imports it.
NEVER = {
    "pretrain.config": ("torch", "deepspeed", "pretrain.model"),
    "pretrain.config.schema": (
        "yaml",
        "omegaconf",
        "pretrain.config.loading",
    ),  # what a run is, not how it is read
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
    "pretrain.train": ("pretrain.pretraining", "pretrain.finetune"),  # the loop, not what builds it
    "pretrain.run_builder": ("pretrain.pretraining", "pretrain.finetune"),  # the lifecycle, not a task
    "pretrain.train.hooks": ("pretrain.train.loop",),  # the hooks are testable without the loop
    "pretrain.train.monitor_hook": ("pretrain.train.loop",),
}


@pytest.mark.parametrize("owner", sorted(NEVER))
def test_each_module_keeps_to_its_layer(owner):
    def allowed(importer, imported):
        if (
            within(importer, (owner,))
            and not within(importer, COMMAND_LAYER)
            and within(imported, NEVER[owner])
        ):
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
    tree = ast.parse((ROOT / "pretrain" / "train" / "loop.py").read_text())
    (train,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train"]
    assert train.end_lineno - train.lineno + 1 <= 60


def test_the_supervisor_uses_the_services_public_methods_only():
    """The supervisor asks the monitoring service's state through its methods (`supervise`,
    `job_started`, `overdue`, `last_step`, `record_restart`, ...), never by taking its lock or
    reading and setting its fields: the service keeps its own invariants."""
    import inspect

    from monitoring.service import MonitorState

    public = {name for name, member in inspect.getmembers(MonitorState, callable) if not name.startswith("_")}
    used = []
    for node in ast.walk(ast.parse((ROOT / "monitoring" / "supervisor.py").read_text())):
        value = getattr(node, "value", None)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(value, ast.Attribute)
            and value.attr == "state"
            and isinstance(value.value, ast.Name)
            and value.value.id == "self"
        ):
            used.append(node.attr)
    assert used and set(used) <= public, sorted(set(used) - public)


def test_events_are_built_only_as_the_protocols_types():
    """No module spells an events.jsonl line as a dict (`{"type": "rollback", ...}`): every writer
    builds a `monitoring.protocol.Event`, so a field is named in one place."""
    from monitoring.protocol import EVENT_TYPES

    found = []
    for path in [*modules().values(), *(ROOT / "scripts").glob("*.py")]:
        if path.name == "protocol.py" and path.parent.name == "monitoring":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if (
                        isinstance(key, ast.Constant)
                        and key.value == "type"
                        and isinstance(value, ast.Constant)
                        and value.value in EVENT_TYPES
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} builds a {value.value!r} event")
    assert not found, found
