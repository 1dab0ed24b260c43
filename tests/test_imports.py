"""The house: the card's files at the root, the rest in folders by concept, and imports that go one way.

A reader opens one file to learn one axis, so what that file pulls in is the reader's burden. The checks:
- The graph of imports between the repository's modules (every import statement, wherever it stands, a
  folder's module named by its path: `experts.router`) has no cycle, and no import statement stands inside a
  function or method, except those of OPTIONAL: an import moved inside a function to dodge a cycle still
  counts as the edge it is.
- model.py imports nothing of the repository, as nanoGPT's.
- The layers (DESIGN.md, "The files"): an axis (a card file that splits the work, or a module of the parallel/,
  experts/, precision/, resilience/ and interop/ folders) imports only the primitives, the model and other axes:
  never the accounting, the printouts, the planner, the command line or an entry point. Those observe the axes,
  and the axes tell them what happened through the observer hooks (step.ForwardObserver, ...).
- Each card file's closure (itself and every module it imports, transitively) holds at most CARD_FILES files and
  CARD_LINES lines (train.py, the composition, is exempt); the root holds at most ROOT_FILES .py files; the
  modules a reader opens for one DDP + ZeRO-3 step hold at most READING_LINES lines.
The files are parsed (ast), not imported: the checks take milliseconds.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = sorted(d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)) and not d.startswith((".", "_"))
                 and d not in ("tests", "bench"))
PATHS = {f[:-3]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
PATHS.update({f"{d}.{f[:-3]}": os.path.join(ROOT, d, f) for d in FOLDERS
              for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py")})
MODULES = sorted(PATHS)
LINES = {m: len(open(p, encoding="utf-8").read().splitlines()) for m, p in PATHS.items()}

CARD = ("model", "ddp", "zero", "tensor_parallel", "pipeline", "context_parallel", "moe", "fp8", "ckpt", "mfu")
PRIMITIVES = ("shard", "mesh", "data", "step", "optim", "mfu")  # what every axis may need
AXES = ("ddp", "zero", "tensor_parallel", "pipeline", "context_parallel", "moe", "fp8", "ckpt")
AXIS_FOLDERS = ("parallel", "experts", "precision", "resilience", "interop", "optimizers")
OBSERVING = ("accounting", "report", "planner")  # import the axes; no axis imports them
ENTRY_POINTS = ("train", "plan", "sample", "export_hf", "plot")
CARD_FILES, CARD_LINES, ROOT_FILES, READING_LINES = 6, 2000, 20, 2500
READING_PATH = ("step", "model", "parallel.zero3")  # one DDP + ZeRO-3 step: its closure is what a reader opens

OPTIONAL = {  # the package (or module) imported inside a function: why it is not at the top of its file
    "tiktoken": "GPT-2's BPE, needed only by --tokenizer gpt2 (data.get_tokenizer); byte runs work without it",
    "torch.utils.tensorboard": "needs the tensorboard package, not a requirement: only --tensorboard imports it"
                               " (report/metrics.py), and a run without the package says so and goes on",
}


def _optional(name: str) -> str | None:
    """The OPTIONAL entry an imported name falls under ("torch.utils.tensorboard.SummaryWriter"), or None."""
    return next((entry for entry in OPTIONAL if name == entry or name.startswith(entry + ".")), None)


def _imports(module: str) -> list:
    """[(imported name, dotted as written, line, inside a function)] of every import in `module`'s file."""
    tree = ast.parse(open(PATHS[module], encoding="utf-8").read())
    found = []

    def visit(statements, in_function):  # statements only: an import is one (expressions hold none)
        for node in statements:
            if isinstance(node, ast.Import):
                found.extend((alias.name, alias.name, node.lineno, in_function) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                found.extend((f"{base}.{alias.name}", base, node.lineno, in_function) for alias in node.names)
            inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):  # if, for, try, with, class, ...
                visit(getattr(node, field, ()), inside)

    visit(tree.body, False)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _module_of(name: str) -> str | None:
    """The repository module an imported name lands in ("experts.router.route" → "experts.router"), or None."""
    while name:
        if name in PATHS:
            return name
        name = name.rpartition(".")[0]
    return None


GRAPH = {m: {d for name, _, _, _ in IMPORTS[m] if (d := _module_of(name)) is not None and d != m} for m in MODULES}


def closure(module: str) -> set:
    """Every module `module` imports, transitively (itself aside)."""
    seen, stack = set(), [module]
    while stack:
        for nxt in GRAPH[stack.pop()] - seen - {module}:
            seen.add(nxt)
            stack.append(nxt)
    return seen


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


def _is_axis(module: str) -> bool:
    return module in AXES or module.split(".")[0] in AXIS_FOLDERS


def test_the_import_graph_has_no_cycle():
    tangles = _tangles(GRAPH)
    assert not tangles, "modules that import one another in a cycle: " + "; ".join(
        ", ".join(f"{m} -> {sorted(GRAPH[m] & set(t))}" for m in t) for t in tangles)


def test_no_import_inside_a_function_but_an_optional_package():
    lazy = [(module, line, name) for module in MODULES for name, _, line, in_function in IMPORTS[module]
            if in_function and _optional(name) is None]
    assert not lazy, "imports inside a function (move them to the top of the file): " + ", ".join(
        f"{module}:{line} {name}" for module, line, name in lazy)


def test_every_optional_package_is_imported_where_it_is_used():
    """The allow-list names only what some function imports (a stale entry would hide nothing, but mislead)."""
    used = {_optional(name) for module in MODULES for name, _, _, in_function in IMPORTS[module] if in_function}
    assert set(OPTIONAL) <= used, set(OPTIONAL) - used


def test_the_model_imports_nothing_of_the_repository():
    assert not GRAPH["model"], sorted(GRAPH["model"])


def test_no_folder_shadows_a_root_module():
    assert not set(FOLDERS) & set(PATHS), set(FOLDERS) & set(PATHS)


def test_the_axes_import_no_accounting_printout_planner_or_entry_point():
    """An axis reads the primitives, the model and other axes only; the primitives read each other only."""
    above = lambda m: m.split(".")[0] in (*OBSERVING, "cli") or m in ENTRY_POINTS
    wrong = {m: sorted(d for d in GRAPH[m] if above(d)) for m in MODULES if _is_axis(m)}
    wrong.update({m: sorted(d for d in GRAPH[m] if d not in PRIMITIVES) for m in PRIMITIVES})
    wrong = {m: deps for m, deps in wrong.items() if deps}
    assert not wrong, f"imports against the layers: {wrong}"


def test_every_module_has_its_layer():
    """A new module lands in a named place (or this test and DESIGN.md's table learn the new place)."""
    placed = lambda m: (m in (*CARD, *PRIMITIVES, *ENTRY_POINTS) or _is_axis(m)
                        or m.split(".")[0] in (*OBSERVING, "cli"))
    assert all(placed(m) for m in MODULES), [m for m in MODULES if not placed(m)]


def test_each_card_file_is_readable_with_what_it_pulls_in():
    """The reader's burden: a card file and its closure in at most CARD_FILES files and CARD_LINES lines."""
    over = {}
    for card in CARD:
        pulled = closure(card)
        lines = LINES[card] + sum(LINES[m] for m in pulled)
        if len(pulled) + 1 > CARD_FILES or lines > CARD_LINES:
            over[card] = (len(pulled) + 1, lines, sorted(pulled))
    assert not over, f"card files over {CARD_FILES} files or {CARD_LINES} lines: {over}"


def test_the_root_is_the_card_and_a_ddp_zero3_step_reads_in_one_sitting():
    root = [m for m in MODULES if "." not in m]
    assert len(root) <= ROOT_FILES, f"{len(root)} .py files at the root: {root}"
    path = set(READING_PATH).union(*(closure(m) for m in READING_PATH))
    lines = sum(LINES[m] for m in path)
    assert lines <= READING_LINES, (lines, sorted(path))
