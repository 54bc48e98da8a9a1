"""The shape of the code, checked: which module may import which (the layers of
docs/architecture.md: command layer → library → `monitoring.protocol`, and no cycle anywhere), and
no function so long that it cannot be read on a screen or two, every module in docs/development.md's
table, no dead code (vulture). Imports are read with `ast`, including those inside functions: a lazy
import is an arrow too."""

import ast
import functools
import re
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
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


@functools.cache
def syntax_tree(path: Path) -> ast.Module:
    """Each module parsed once per worker: every test below walks them."""
    return ast.parse(path.read_text())


@functools.cache
def imports_of(path: Path) -> frozenset[str]:
    found = set()
    for node in ast.walk(syntax_tree(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from pretrain import train`
    return frozenset(found)


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
    "pretrain.model": ("deepspeed", "pretrain.data", "pretrain.parallel", "monitoring"),
    "pretrain.planning.flops": ("deepspeed",),
    "pretrain.tokenizer": ("pretrain.model",),
    "pretrain.data": ("pretrain.model", "pretrain.parallel.engine", "pretrain.checkpoint"),
    "pretrain.parallel": ("pretrain.data",),
    "pretrain.parallel.distributed": ("pretrain.train",),
    "pretrain.stability": ("pretrain.train",),
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


# The layers, lowest first (docs/architecture.md, "Layers"): a module imports only from its own
# layer or those below it, so each package can be read and tested knowing only what is beneath it.
# A module is in the layer of the longest prefix that names it.
LAYERS = (
    # foundations: errors, atomic writes, the typed settings, the messages both sides share, URLs
    ("pretrain", "pretrain.errors", "pretrain.atomic", "pretrain.config", "pretrain.object_store",
     "monitoring.protocol", "monitoring.config", "pretrain.stability.settings", "pretrain.train.settings"),
    # what everything reports through, the process group, the tokenizer
    ("pretrain.reporting", "pretrain.parallel.distributed", "pretrain.parallel.deepspeed_ops", "pretrain.tokenizer"),
    # the parts: data, the model, checkpoints on disk, the run directory, optimizers, plans
    ("pretrain.data", "pretrain.model", "pretrain.checkpoint", "pretrain.run_dir", "pretrain.optim",
     "pretrain.planning"),
    # what the loop is built from: the engine and its parallel groups, stability, evaluation
    ("pretrain.parallel", "pretrain.stability", "pretrain.evaluation", "pretrain.initial_model",
     "pretrain.lifeline", "pretrain.monitor_link"),
    ("pretrain.train",),  # the one loop and its step hooks
    ("pretrain.run_builder", "pretrain.pretraining", "pretrain.finetune"),  # the runs
    ("monitoring",),  # the service and the supervisor, beside the runs they watch
    COMMAND_LAYER,
)  # fmt: skip


def layer_of(module: str) -> int:
    best, layer = "", None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if within(module, (prefix,)) and len(prefix) > len(best):
                best, layer = prefix, index
    assert layer is not None, f"{module} is in no layer of LAYERS: add it"
    return layer


def test_imports_never_run_up_the_layers():
    known = modules()

    def allowed(importer, imported):
        target = resolved(imported, known)
        if target is None or layer_of(target) <= layer_of(importer):
            return None
        return f"layer {layer_of(importer)} imports layer {layer_of(target)} (LAYERS: imports run downwards)"

    assert violations(allowed) == []


MAX_ROOT_MODULES = 14  # besides __init__ and __main__: the rest live in packages by concern


def test_the_package_shows_its_architecture():
    """At most MAX_ROOT_MODULES modules directly in pretrain/: the model, parallelism, optimizers,
    stability, planning, reporting, evaluation, data, checkpoints, the loop and the commands each
    have a folder (docs/development.md, Layout), so a newcomer finds a room by its name."""
    root = sorted(
        p.name for p in (ROOT / "pretrain").glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert len(root) <= MAX_ROOT_MODULES, root


def test_no_function_is_longer_than_a_screen_or_two():
    long = []
    for path in modules().values():
        for node in ast.walk(syntax_tree(path)):
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
        for node in ast.walk(syntax_tree(path)):
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


# The module table of docs/development.md ("Layout") names every module of the packages and every
# file of launch/ and scripts/: a row's first cell names a path (`pretrain/data/`) or files
# (`monitoring/detectors.py`, `policy.py`: the bare name is in the directory before it), and a
# directory's row names its modules (`loader.py`) anywhere in the row.
DEVELOPMENT = ROOT / "docs" / "development.md"
TABLED_DIRECTORIES = ("launch", "scripts")  # every file, whatever its kind


def table_rows() -> list[tuple[str, list[str], set[str], set[str]]]:
    """Each row of the Layout table: its first cell, the directories that cell names (with a
    trailing /), the paths the row names (the first cell's, and each `token` of the row in each of
    those directories), and of those the ones that must exist (the first cell's, each `name.py`)."""
    section = DEVELOPMENT.read_text().split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| ") or "`" not in line.split(" | ", 1)[0]:
            continue  # the header, its rule, a line that is not a row
        first, rest = line.split(" | ", 1)
        directories, named, current, modules_named = [], set(), "", set()
        for token in re.findall(r"`([^`]+)`", first):
            if "/" in token:
                current = token if token.endswith("/") else token.rpartition("/")[0] + "/"
                named.add(token)
            else:
                named.add(current + token)
            if current not in directories:
                directories.append(current)
        modules_named |= named
        for token in re.findall(r"`([^`]+)`", rest):
            paths = {token} if "/" in token else {d + token for d in directories}
            named |= paths
            modules_named |= {token} if token.endswith(".py") else set()
        rows.append((first.removeprefix("| ").strip(), directories, named, modules_named))
    return rows


def tabled_files() -> list[str]:
    """What the table must name: each package's modules (not `__init__.py`, `__main__.py`: the
    package's row names it) and each file of launch/ and scripts/."""
    found = [
        str(path.relative_to(ROOT))
        for path in modules().values()
        if path.name not in ("__init__.py", "__main__.py")
    ]
    for directory in TABLED_DIRECTORIES:
        found += [
            f"{directory}/{path.name}"
            for path in (ROOT / directory).iterdir()
            if path.is_file() and not path.name.startswith(".")
        ]
    return sorted(found)


def test_the_module_table_names_every_module():
    rows = table_rows()
    named = set().union(*(names for _, _, names, _ in rows))
    missing = []
    for path in tabled_files():
        if path in named:
            continue
        directory = path.rpartition("/")[0] + "/"
        row = next((first for first, *_ in rows if f"`{directory}`" in first), None)  # its package's row
        where = (
            f"name `{path.rpartition('/')[2]}` and what it holds in the row that starts {row}"
            if row
            else f"add a row for it: | `{path}` | what it holds |"
        )
        missing.append(f"{path} is not in docs/development.md's Layout table: {where}")
    assert not missing, "\n".join(missing)


def test_the_module_table_names_only_what_exists():
    """A row's paths and the modules it names exist (a module that is gone leaves the table with it)."""
    gone = []
    for first, directories, _, must_exist in table_rows():
        for token in sorted(must_exist):
            name = token.rpartition("/")[2] or token
            if not any((ROOT / d / name).exists() for d in directories) and not (ROOT / token).exists():
                gone.append(f"docs/development.md's Layout row {first} names {name}, which does not exist")
    assert not gone, "\n".join(gone)


# Dead code: vulture reads the product (the packages, launch/, scripts/; not the tests: a name only a
# test uses is dead in the product) and reports every name nothing uses. Names are matched as
# strings, so what it reports is unused everywhere. Below: what it reports that is in use in a way
# it cannot see, with why; each entry is (file, names, why).
MAX_TABLE_ROW = 400  # characters: two lines on a wide screen
# A commit as the docs write one: 7 to 40 lowercase hex digits with at least one digit and one
# letter, so neither a number nor a word matches.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def doc_lines():
    for path in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(ROOT)}:{number}", line.lstrip()


def test_the_docs_are_a_reference():
    """The docs say what is true now, in tables a reader can scan: no row over two lines, and a
    commit named only in the row of the figure measured at it (history is in the commit messages)."""
    long_rows = [
        f"{where}: a table row of {len(line)} characters (at most {MAX_TABLE_ROW}): say it tighter or split it"
        for where, line in doc_lines()
        if line.startswith("|") and len(line) > MAX_TABLE_ROW
    ]
    hashes = [
        f"{where}: commit {commit} outside a measurement's table row"
        for where, line in doc_lines()
        if not line.startswith("|")
        for commit in COMMIT.findall(line)
    ]
    assert not long_rows + hashes, "\n".join(long_rows + hashes)


DEAD_CODE_PATHS = ("pretrain", "monitoring", "launch", "scripts")
NOT_DEAD = (
    ("monitoring/config.py",
     "on_nonfinite on_loss_spike on_grad_norm_surge on_divergence on_grad_norm_spike on_instability_precursor",
     "the response to each finding, read as getattr(config, f'on_{finding}')"),
    ("monitoring/protocol.py",
     "documents_unavailable matches_checkpoint resume_from moved_to requested_by tried accumulation",
     "event fields: asdict writes them to events.jsonl for the reader (the page, a person, jq)"),
    ("monitoring/protocol.py", "layer_grad_norms",
     "a field of the trainer's report: asdict shows it in /status's `latest` for the reader"),
    ("monitoring/service.py", "server_version protocol_version disable_nagle_algorithm log_message do_GET do_POST",
     "http.server's request handler reads or calls them by name"),
    ("monitoring/service.py", "explain", "send_error's parameter, as http.server calls it"),
    ("monitoring/supervisor.py", "frame", "a signal handler's parameter"),
    ("pretrain/optim/muon.py", "get_grad_norm_direct",
     "DeepSpeed's ZeRO optimizer calls it by name; clip_adamw_half_only wraps it on the instance"),
    ("pretrain/cli/deepspeed_runner.py", "frame", "a signal handler's parameter"),
    ("pretrain/parallel/distributed.py", "frame", "a signal handler's parameter"),
    ("pretrain/parallel/distributed.py", "fill_uninitialized_memory benchmark", "torch settings, set for torch to read"),
    ("pretrain/bench/train.py", "use_cache", "a transformers config setting, set for transformers to read"),
    ("pretrain/parallel/norm_gate.py", "overflow", "DeepSpeed's ZeRO optimizer's flag, set for its step() to read"),
    ("pretrain/tokenizer.py", "encode_special_tokens", "a tokenizers setting, set for tokenizers to read"),
    ("pretrain/tokenizer.py", "mtime_ns", "part of lru_cache's key: a changed file is read again"),
    ("pretrain/checkpoint/background.py", "commit", "DeepSpeed's CheckpointEngine interface, which it calls"),
    ("pretrain/evaluation/harness.py",
     "max_batch_size get_model_info loglikelihood loglikelihood_rolling generate_until",
     "lm-evaluation-harness's LM interface, which it calls (and the keyword its loader passes)"),
    ("pretrain/data/__init__.py", "__getattr__", "a module's lazy attributes (PEP 562), which Python calls"),
    ("pretrain/planning/flops.py", "attention_projections attention_scores attention_weighted_sum",
     "FlopsBreakdown's parts: asdict sums them and writes them to the report"),
    ("pretrain/planning/scaling.py", "tokens_per_gpu_per_step exposed_seconds",
     "Projection's fields: asdict writes them to the report"),
    ("pretrain/train/hooks.py", "before_eval before_checkpoint",
     "step hook methods the loop calls by name (Trainer.ask('before_eval', ...))"),
    ("pretrain/train/monitor_hook.py", "before_eval before_checkpoint",
     "step hook methods the loop calls by name (Trainer.ask('before_eval', ...))"),
    ("pretrain/train/replica_hook.py", "before_checkpoint",
     "a step hook method the loop calls by name (Trainer.ask('before_checkpoint', ...))"),
    ("monitoring/protocol.py", "rolled_back_to", "ReplicaMismatch's field: asdict writes it to events.jsonl"),
    ("pretrain/data/mixture.py", "source_counts",
     "read by tests/unit/test_mixture.py only: the windows each source served, which the test checks"),
    ("pretrain/parallel/engine.py", "has_moe_layers", "DeepSpeed's engine's flag, which its checkpoint code reads"),
    ("pretrain/parallel/experts.py",
     "expert_groups ep_size num_experts expert_group_name num_local_experts set_deepspeed_parallelism "
     "use_data_before_expert_parallel_",
     "DeepSpeed's engine finds its MoE marker among the model's modules, reads its attributes and calls "
     "set_deepspeed_parallelism by name"),
    ("pretrain/stability/skip_step.py", "global_mean",
     "the module's documented helper for a loop whose all-reduce comes after engine.step(); "
     "tests/integration/test_skip_step.py's loop uses it"),
)  # fmt: skip


@functools.cache
def unused_code() -> tuple[tuple[str, str, str], ...]:
    """(file, name, vulture's line) for everything vulture finds unused in the product."""
    import vulture

    checker = vulture.Vulture()
    checker.scavenge([str(ROOT / p) for p in DEAD_CODE_PATHS])
    return tuple(
        (
            str(Path(item.filename).relative_to(ROOT)),
            item.name,
            f"{item.message} ({item.confidence}% confidence)",
        )
        for item in checker.get_unused_code(min_confidence=60)
    )


def test_no_dead_code():
    allowed = {(path, name) for path, names, _ in NOT_DEAD for name in names.split()}
    dead = [f"{path}: {message}" for path, name, message in unused_code() if (path, name) not in allowed]
    assert not dead, (
        "delete what nothing uses; if something uses it where vulture cannot see (a framework calls it "
        "by name, asdict writes it), add (file, name, why) to NOT_DEAD in tests/unit/test_architecture.py:\n"
        + "\n".join(dead)
    )


def test_the_dead_code_allowances_are_all_still_needed():
    found = {(path, name) for path, name, _ in unused_code()}
    stale = [
        f"{path}: {name}"
        for path, names, _ in NOT_DEAD
        for name in names.split()
        if (path, name) not in found
    ]
    assert not stale, (
        "vulture no longer reports these: remove them from NOT_DEAD in tests/unit/test_architecture.py:\n"
        + "\n".join(stale)
    )
