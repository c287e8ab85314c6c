"""The import plan of docs/architecture.md, drawn from the code: floors only import downwards, and no circles.

Every import counts, wherever it stands: at the top, inside a function, under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvfleet_agent": ROOT / "agent", "kvfleet_kernels": ROOT / "kernels", "kvfleet_contract": ROOT / "contract",
            "kvfleet_operator": ROOT / "operator", "kvfleet_router": ROOT / "router"}

# Each package's floors, lowest first: a module may import its own floor or lower ones, never higher.
# A prefix names a module or a whole folder; the longest matching prefix decides.
FLOORS: dict[str, list[list[str]]] = {
    "kvfleet_agent": [
        ["kvfleet_agent.config", "kvfleet_agent.sampling_params", "kvfleet_agent.outputs",
         "kvfleet_agent.structured_outputs", "kvfleet_agent.spec_config"],  # plain data
        ["kvfleet_agent.core"],  # requests, scheduler, KV bookkeeping: no torch
        ["kvfleet_agent.layers"],  # torch modules and their tensor-parallel group
        ["kvfleet_agent.models"],  # model definitions, loader, tokenizer
        ["kvfleet_agent.worker"],  # runner, step batches, sampler, executor and rank processes
        ["kvfleet_agent.engine"],  # the step loop and AsyncLLM
        ["kvfleet_agent", "kvfleet_agent.llm", "kvfleet_agent.server", "kvfleet_agent.bench", "kvfleet_agent.cli"],
    ],
    "kvfleet_operator": [
        ["kvfleet_operator.rules", "kvfleet_operator.core_types", "kvfleet_operator.models", "kvfleet_operator.status",
         "kvfleet_operator.crd", "kvfleet_operator.router_rules", "kvfleet_operator.router_models",
         "kvfleet_operator.router_tier_rules", "kvfleet_operator.router_tier_models", "kvfleet_operator.model_sources",
         "kvfleet_operator.speculative_models", "kvfleet_operator.quantization_models"],
        ["kvfleet_operator.builders", "kvfleet_operator.ownership", "kvfleet_operator.kube",
         "kvfleet_operator.metrics", "kvfleet_operator.config", "kvfleet_operator.peering",
         "kvfleet_operator.router_builders"],
        ["kvfleet_operator.autoscaling"],
        ["kvfleet_operator.plan", "kvfleet_operator.router_plan", "kvfleet_operator.router_tiers"],
        ["kvfleet_operator.reconcile", "kvfleet_operator.router_reconcile"],
        ["kvfleet_operator.autoscaling.loop"],
        ["kvfleet_operator", "kvfleet_operator.state", "kvfleet_operator.handlers", "kvfleet_operator.__main__"],
    ],
    "kvfleet_router": [
        ["kvfleet_router.picker", "kvfleet_router.prefix", "kvfleet_router.hold_queue", "kvfleet_router.metrics",
         "kvfleet_router.kube", "kvfleet_router.tier_config", "kvfleet_router.classifier",
         "kvfleet_router.agreement", "kvfleet_router.promotion"],
        ["kvfleet_router.fleet", "kvfleet_router.tiering"],
        ["kvfleet_router.quality"],
        ["kvfleet_router.proxy", "kvfleet_router.discovery"],
        ["kvfleet_router", "kvfleet_router.cli", "kvfleet_router.bench", "kvfleet_router.cost_report",
         "kvfleet_router.cost_figures", "kvfleet_router.cost_workload"],
    ],
}
# Which packages each package may import: the contract and the kernels sit below everything, and neither
# the operator nor the router loads the agent (nor torch through it).
MAY_IMPORT = {"kvfleet_contract": set(), "kvfleet_kernels": set(),
              "kvfleet_agent": {"kvfleet_kernels", "kvfleet_contract"}, "kvfleet_operator": {"kvfleet_contract"},
              "kvfleet_router": {"kvfleet_contract"}}
TORCH_FREE = ("kvfleet_agent.core", "kvfleet_agent.config", "kvfleet_agent.sampling_params",
              "kvfleet_agent.structured_outputs",
              "kvfleet_agent.outputs", "kvfleet_contract", "kvfleet_operator", "kvfleet_router")


def modules() -> dict[str, Path]:
    """Every module of our packages, by dotted name (a package by its own name)."""
    found = {}
    for package, root in PACKAGES.items():
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The modules `name` imports, as dotted names: our modules resolved exactly, others as written."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield sub if sub in known else base


def floor_of(module: str) -> int | None:
    """The floor of one of our modules (None for a package without floors)."""
    package = module.split(".")[0]
    best: tuple[int, int] | None = None  # (prefix length, floor)
    for level, prefixes in enumerate(FLOORS.get(package, [])):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    if package in FLOORS and best is None:
        raise AssertionError(f"{module} sits on no floor: add it to FLOORS and to docs/architecture.md")
    return None if best is None else best[1]


def graph() -> dict[str, set[str]]:
    """Our modules and the ones of ours each imports."""
    found = modules()
    known = set(found)
    return {name: {m for m in imports(name, path, known) if m in known and m != name} for name, path in found.items()}


def all_imports() -> dict[str, set[str]]:
    """Every import of every module of ours, ours or not."""
    found = modules()
    return {name: set(imports(name, path, set(found))) for name, path in found.items()}


def test_every_module_sits_on_a_floor() -> None:
    for name in modules():
        floor_of(name)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_packages_import_only_what_lies_below(package: str) -> None:
    wrong = [f"{a} imports {b}" for a, targets in all_imports().items() if a.split(".")[0] == package
             for b in targets
             if (top := b.split(".")[0]) in PACKAGES and top != package and top not in MAY_IMPORT[package]]
    assert not wrong, "\n".join(wrong)


def test_no_import_runs_back_up() -> None:
    upward = []
    for importer, targets in graph().items():
        mine = floor_of(importer)
        for target in targets:
            theirs = floor_of(target)
            if importer.split(".")[0] == target.split(".")[0] and mine is not None and theirs is not None \
                    and theirs > mine:
                upward.append(f"{importer} (floor {mine}) imports {target} (floor {theirs})")
    assert not upward, "\n".join(upward)


def test_no_circles() -> None:
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(g):
        if start not in state:
            visit(start, [start])
    assert not circles, "\n".join(circles)


def test_bookkeeping_and_operator_import_no_torch() -> None:
    heavy = [f"{name} imports {target}" for name, targets in all_imports().items()
             if name.startswith(TORCH_FREE) for target in targets
             if target.split(".")[0] in ("torch", "numpy", "triton", "kvfleet_kernels")]
    assert not heavy, "\n".join(heavy)
