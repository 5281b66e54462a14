"""Each tier's state has one owner: the store and the server ask a tier (`tiers/dram.py`,
`nvme.py`, `nvmeindex.py`, `peer.py`) through its methods and never reach into what it holds
(its allocator, arena, pins, index, leases, facts, peer network).

The check reads the source, not a run: it parses every module of `kvpool.agent.store` and
`kvpool.agent.server` and fails on an attribute of a tier's private state (the `PRIVATE`
list, or any `_name`) taken from a tier object: an expression named for its tier (`dram`,
`self.dram`, `nvme`, `self.nvme.nvme`, `peer`, ...) or a local name bound to one
(`d = self.dram`). The store's objects are named for the tier they hold, so the names are
the types here."""

from __future__ import annotations

import ast
from pathlib import Path

from ..support import REPO_ROOT

AGENT = REPO_ROOT / "agent" / "kvpool" / "agent"
CHECKED = [AGENT / "store", AGENT / "server"]
TIER_NAMES = {"dram", "nvme", "peer"}
"""The names a tier object goes by (`ChunkStore.dram`, `Demotion.nvme`, `ChunkStore.peer`):
`ChunkStore.nvme` is the `Demotion` over the NVMe tier, held to the same rule."""
PRIVATE = {
    # DramTier
    "alloc", "arena", "pins", "index", "writes", "reads", "held", "fenced", "draining",
    "published", "facts",
    # NvmeIndex (behind NvmeTier.index)
    "table",
    # PeerTier
    "network", "directory",
}
"""What a tier holds and only it changes or reads (`tiers/`)."""


def _names_a_tier(node: ast.expr, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in TIER_NAMES or node.id in aliases
    return isinstance(node, ast.Attribute) and node.attr in TIER_NAMES


def _private(attr: str) -> bool:
    return attr in PRIVATE or (attr.startswith("_") and not attr.startswith("__"))


def _aliases(scope: ast.AST) -> set[str]:
    """Local names bound to a tier object in `scope` (`d = self.dram`), to a fixed point."""
    aliases: set[str] = set()
    binds = [(n.targets[0].id, n.value) for n in ast.walk(scope)
             if isinstance(n, ast.Assign) and len(n.targets) == 1
             and isinstance(n.targets[0], ast.Name)]
    while True:
        more = {name for name, value in binds if _names_a_tier(value, aliases)} - aliases
        if not more:
            return aliases
        aliases |= more


def reaches(source: str, filename: str) -> list[str]:
    """`file:line: expression` for each access to a tier's private state in `source`."""
    tree = ast.parse(source, filename)
    found: set[tuple[int, str]] = set()
    scopes: list[ast.AST] = [tree, *(n for n in ast.walk(tree)
                                     if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))]
    for scope in scopes:
        aliases = _aliases(scope) if scope is not tree else set()
        for node in ast.walk(scope):
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and _names_a_tier(node.value, aliases)):
                found.add((node.lineno, ast.unparse(node)))
    return [f"{filename}:{line}: {expr}" for line, expr in sorted(found)]


def test_the_store_and_the_server_reach_no_tiers_private_state() -> None:
    found = [hit for package in CHECKED for path in sorted(package.rglob("*.py"))
             for hit in reaches(path.read_text(), str(path.relative_to(REPO_ROOT)))]
    assert not found, "ask the tier (a method in tiers/) instead of reaching into it:\n" + \
        "\n".join(found)


def test_the_check_finds_a_reach_direct_chained_or_through_a_local() -> None:
    source = """
class S:
    def f(self, k):
        self.dram.alloc.free([])
        n = self.nvme.nvme
        n.index.get(k)
        d = self.dram
        e = d
        return e.pins, self.peer._t, self.dram.get(k), self.nvme.entry(k), self.space.index
"""
    assert reaches(source, "s.py") == [
        "s.py:4: self.dram.alloc", "s.py:6: n.index", "s.py:9: e.pins", "s.py:9: self.peer._t"]


def test_every_name_of_the_private_list_is_a_tiers_attribute() -> None:
    # A name the tiers no longer hold would guard nothing: keep the list to what they hold.
    held: set[str] = set()
    for path in (AGENT / "tiers").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                held.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                held.add(node.target.id)
    assert held >= PRIVATE, PRIVATE - held


def test_the_checked_packages_exist() -> None:
    assert all(isinstance(p, Path) and (p / "__init__.py").exists() for p in CHECKED)
