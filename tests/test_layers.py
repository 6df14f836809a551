"""grpo-train's internal layers: each module imports only its own layer or lower ones, and no
import cycle exists (issue #17). test_dependency_direction.py checks the same between packages.

    entry       run (the CLI's way in)
    loops       sync_loop, async_loop, ppo.ppo_loop (siblings: a loop never imports another)
    async parts collector (async_loop's generation side)
    step        step (the shared phases)
    batch       train_step, run_state, setup, ppo.ppo_step, config.checks, engine_faults, colocation
    components  rollout, policy, generation, refit, validation, ppo's value parts
    shared      records and utilities the components share (batch, checkpoint, state files, plan, ...)
    base        errors, config (schema, loader, errors), assets

A module may import its own layer, except a loop (the loops share `step.py`, never each other),
but never a higher one. `config.checks` lives in config/ yet builds optimizers
and looks at generation options, so it sits with setup. Every import counts: top level, inside
a function (a function-level import back is still a cycle in the design, only deferred) and
under TYPE_CHECKING. Parsed with ast; nothing is imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SRC = ROOT / "packages" / "grpo-train" / "src"

# Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("grpo_train.errors", "grpo_train.config", "grpo_train.assets")),
    (
        "shared",
        (
            "grpo_train.batch",
            "grpo_train.model_families",
            "grpo_train.state_io",
            "grpo_train.placement",
            "grpo_train.deadline",
            "grpo_train.loggers",
            "grpo_train.plotting",
            "grpo_train.resume_config",
            "grpo_train.advantages",
            "grpo_train.group_estimators",
            "grpo_train.plan",
            "grpo_train.actor_group",
            "grpo_train.checkpoint",
            "grpo_train.replay_buffer",
        ),
    ),
    (
        "components",
        (
            "grpo_train.rollout",
            "grpo_train.policy",
            "grpo_train.generation",
            "grpo_train.validation",
            "grpo_train.refit",
            "grpo_train.ppo.value_group",
            "grpo_train.ppo.value_worker",
            "grpo_train.ppo.value_loss",
            "grpo_train.ppo.gae",
            "grpo_train.ppo.estimators",
        ),
    ),
    (
        "batch",
        (
            "grpo_train.train_step",
            "grpo_train.run_state",
            "grpo_train.setup",
            "grpo_train.ppo.ppo_step",
            "grpo_train.config.checks",
            "grpo_train.engine_faults",
            "grpo_train.colocation",
        ),
    ),
    ("step", ("grpo_train.step",)),
    ("async parts", ("grpo_train.collector",)),
    ("loops", ("grpo_train.sync_loop", "grpo_train.async_loop", "grpo_train.ppo.ppo_loop")),
    ("entry", ("grpo_train.run",)),
]
# Layers whose modules may not import each other: the loops are siblings sharing `step.py`.
CLOSED = {"loops"}
# Package __init__ files that only group their modules (docstring, lazy re-exports).
NEUTRAL = {"grpo_train", "grpo_train.ppo"}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    where: str  # "top", "function" or "type-checking"


def module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(src: Path, package: str) -> list[Import]:
    """Every import of `package`'s own modules inside `package`, resolved to the module imported."""
    modules = {module_name(src, p): p for p in (src / package).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for source, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), str(path))
        where: dict[int, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where.update({id(sub): "function" for sub in ast.walk(node)})
            elif isinstance(node, ast.If) and _is_type_checking(node):
                where.update({id(sub): "type-checking" for stmt in node.body for sub in ast.walk(stmt)})
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] != package:
                    continue
                target = resolve(name)
                if target and target != source:
                    found.append(Import(source, target, node.lineno, where.get(id(node), "top")))
    return found


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]]) -> int | None:
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    return best


def upward_imports(imports: list[Import], layers, neutral=frozenset(), closed=frozenset()) -> list[str]:
    """Imports of a higher layer, and imports inside a `closed` layer (between two of its modules)."""
    names = [name for name, _ in layers]
    bad = []
    for imp in imports:
        if imp.source in neutral or imp.target in neutral:
            continue
        src, dst = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if src is None or dst is None:
            bad.append(f"{imp.source if src is None else imp.target}: in no layer (add it to LAYERS)")
        elif dst > src or (dst == src and names[src] in closed):
            bad.append(
                f"{imp.source} ({names[src]}) imports {imp.target} ({names[dst]}) at line {imp.line} [{imp.where}]"
            )
    return sorted(set(bad))


def cycles(imports: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_grpo_train_has_no_import_cycle():
    found = cycles(imports_of(TRAIN_SRC, "grpo_train"))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_grpo_train_imports_only_down_its_layers():
    bad = upward_imports(imports_of(TRAIN_SRC, "grpo_train"), LAYERS, NEUTRAL, CLOSED)
    assert not bad, "\n".join(bad)


def test_every_grpo_train_module_has_a_layer():
    modules = {module_name(TRAIN_SRC, p) for p in (TRAIN_SRC / "grpo_train").rglob("*.py")}
    assert sorted(m for m in modules - NEUTRAL if layer_of(m, LAYERS) is None) == []


# ---------------------------------------------------------------- the checks see a deliberate one
SYNTHETIC_LAYERS = [
    ("base", ("pkg.errors",)),
    ("components", ("pkg.rollout", "pkg.policy")),
    ("loops", ("pkg.loop", "pkg.other_loop")),
]


def synthetic_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"pkg/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


CLEAN = {
    "pkg/errors.py": "class E(Exception): ...\n",
    "pkg/rollout/__init__.py": "from pkg.rollout.multi import multi\nfrom pkg.errors import E\n",
    "pkg/rollout/multi.py": "from pkg.errors import E\n",
    "pkg/policy.py": "import pkg.errors\nimport os\n",
    "pkg/loop.py": "from pkg import rollout, policy\n",
}


def test_clean_synthetic_tree_passes(tmp_path):
    imports = imports_of(synthetic_tree(tmp_path, CLEAN), "pkg")
    assert {(i.source, i.target) for i in imports} == {
        ("pkg.rollout", "pkg.rollout.multi"),
        ("pkg.rollout", "pkg.errors"),
        ("pkg.rollout.multi", "pkg.errors"),
        ("pkg.policy", "pkg.errors"),
        ("pkg.loop", "pkg.rollout"),
        ("pkg.loop", "pkg.policy"),
    }
    assert cycles(imports) == []
    assert upward_imports(imports, SYNTHETIC_LAYERS, closed={"loops"}) == []


def test_a_loop_importing_a_loop_is_found(tmp_path):
    # the old ppo_loop -> sync_loop shape: a loop borrowing another loop's helpers
    tree = synthetic_tree(tmp_path, {**CLEAN, "pkg/other_loop.py": "from pkg.loop import helper\n"})
    imports = imports_of(tree, "pkg")
    assert upward_imports(imports, SYNTHETIC_LAYERS) == []  # an open layer allows it
    assert upward_imports(imports, SYNTHETIC_LAYERS, closed={"loops"}) == [
        "pkg.other_loop (loops) imports pkg.loop (loops) at line 1 [top]"
    ]


def test_a_function_level_cycle_is_found(tmp_path):
    # the old rollout <-> multi_turn shape: the dispatcher imports back inside a function
    tree = synthetic_tree(
        tmp_path,
        {
            **CLEAN,
            "pkg/rollout/multi.py": (
                "from pkg.errors import E\n\ndef again():\n    from pkg.rollout import dispatch\n"
            ),
        },
    )
    assert cycles(imports_of(tree, "pkg")) == [["pkg.rollout", "pkg.rollout.multi"]]


def test_an_upward_import_is_found(tmp_path):
    # the old policy/group -> setup shape: a component reaching up for an error type
    tree = synthetic_tree(
        tmp_path, {**CLEAN, "pkg/policy.py": ("import os\n\ndef place():\n    from pkg.loop import StartupError\n")}
    )
    imports = imports_of(tree, "pkg")
    assert upward_imports(imports, SYNTHETIC_LAYERS) == [
        "pkg.policy (components) imports pkg.loop (loops) at line 4 [function]"
    ]
    assert cycles(imports) == [["pkg.loop", "pkg.policy"]]


def test_type_checking_imports_count(tmp_path):
    tree = synthetic_tree(
        tmp_path,
        {
            **CLEAN,
            "pkg/errors.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.policy import P\n"),
        },
    )
    assert upward_imports(imports_of(tree, "pkg"), SYNTHETIC_LAYERS) == [
        "pkg.errors (base) imports pkg.policy (components) at line 3 [type-checking]"
    ]
