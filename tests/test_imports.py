"""The repository's top-level files import one another in one direction, and only at the top of a file.

- The graph of imports between the top-level .py files (every import statement, wherever it stands) has no
  cycle: an entry point (train.py, plan.py) sits on top of what it composes, and an import moved inside a
  function to dodge a cycle still counts as the edge it is.
- No import statement stands inside a function or method, except those of OPTIONAL: a third-party package
  that only some runs need, imported where it is used so that the others run without it installed.
The files are parsed (ast), not imported: the check takes milliseconds.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = sorted(name[:-3] for name in os.listdir(ROOT) if name.endswith(".py"))

OPTIONAL = {  # the package imported inside a function: why it is not at the top of its file
    "tiktoken": "GPT-2's BPE, needed only by --tokenizer gpt2 (data.get_tokenizer); byte runs work without it",
}

def _imports(module: str) -> list:
    """[(imported top-level name, line, inside a function)] of every import in `module`'s file."""
    tree = ast.parse(open(os.path.join(ROOT, f"{module}.py")).read())
    found = []

    def visit(statements, in_function):  # statements only: an import is one (expressions hold none)
        for node in statements:
            if isinstance(node, ast.Import):
                found.extend((alias.name.split(".")[0], node.lineno, in_function) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                name = (node.module or "").split(".")[0] if node.level == 0 else "."  # "from . import": none here
                found.append((name, node.lineno, in_function))
            inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):  # if, for, try, with, class, ...
                visit(getattr(node, field, ()), inside)

    visit(tree.body, False)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _graph() -> dict:
    """{module: {the repository's modules it imports}}."""
    return {m: {name for name, _, _ in IMPORTS[m] if name in MODULES and name != m} for m in MODULES}


def _tangles(graph: dict) -> list:
    """The strongly connected components of `graph` of more than one module (each holds a cycle), by
    Tarjan's algorithm: [sorted modules of one component], or [] when the graph is acyclic."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node), on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:  # the root of a component: pop it
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_the_import_graph_of_the_top_level_files_has_no_cycle():
    graph = _graph()
    tangles = _tangles(graph)
    assert not tangles, "modules that import one another in a cycle: " + "; ".join(
        ", ".join(f"{m} -> {sorted(graph[m] & set(t))}" for m in t) for t in tangles)


def test_no_import_inside_a_function_but_an_optional_package():
    lazy = [(module, line, name) for module in MODULES for name, line, in_function in IMPORTS[module]
            if in_function and name not in OPTIONAL]
    assert not lazy, "imports inside a function (move them to the top of the file): " + ", ".join(
        f"{module}.py:{line} {name}" for module, line, name in lazy)


def test_every_optional_package_is_imported_where_it_is_used():
    """The allow-list names only what some function imports (a stale entry would hide nothing, but mislead)."""
    used = {name for module in MODULES for name, _, in_function in IMPORTS[module] if in_function}
    assert set(OPTIONAL) <= used, set(OPTIONAL) - used
