"""The repository explains itself: every name a docstring or comment puts in backticks exists.

A backticked span that reads like a Python reference (a name, "name()", "module.name", "Class.method",
"handle.attribute") must resolve:
- "module.rest": the module is a file of this repository (or an importable package: torch, numpy, ...; dist, F,
  nn, np as the files import them), and each further part is found on it: a module member at import, else an
  attribute some class of the repository defines (a method, a field, an assigned "self.part");
- "receiver.attribute" (a variable such as run, layout, self): every part after the first is an attribute some
  class of the repository defines;
- a bare name: something the repository defines (a function, class, method, attribute, module-level or local
  name, parameter, keyword argument, string constant such as a group name or a preset), a Python builtin, or a
  torch.distributed / torch function; "name()" must be something callable of those.
File names, flags (--fp8), shell commands, formulas and expressions are not references and are skipped.
The README and DESIGN.md are checked the same way.
"""

import ast
import builtins
import importlib
import io
import keyword
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(os.path.join(folder, f) for folder, dirs, files in os.walk(ROOT)
                 if not any(part.startswith((".", "__")) for part in os.path.relpath(folder, ROOT).split(os.sep)[1:])
                 and not os.path.relpath(folder, ROOT).startswith((".git", ".ci")) for f in files if f.endswith(".py"))
# The trainer's own modules (bench and tests aside), by import name: "model", "accounting.memory", ...
PACKAGES = sorted(d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d))
                  and not d.startswith(".") and d not in ("tests", "bench", "__pycache__"))
MODULE_PATHS = {os.path.relpath(p, ROOT)[:-3].replace(os.sep, "."): p for p in SOURCES
                if os.path.dirname(p) == ROOT or os.path.relpath(p, ROOT).split(os.sep)[0] in PACKAGES}
DOCUMENTS = [os.path.join(ROOT, name) for name in ("README.md", "DESIGN.md")]
REFERENCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\(\))?$")
FILES = re.compile(r"\.(py|md|json|pt|bin|txt|sh|safetensors)$")  # a file name, not a reference
COMMANDS = {"torchrun", "pytest", "python", "python3", "pip"}
ALIASES = {"dist": "torch.distributed", "F": "torch.nn.functional", "nn": "torch.nn", "np": "numpy"}
EXTERNAL = ("torch", "numpy", "tiktoken", "pytest", "math", "os", "sys", "time", "json", "argparse", "threading",
            "random", "functools", "itertools", "collections", "dataclasses", "contextlib", "subprocess", "signal",
            "hashlib", "fcntl", "inspect", "typing", "safetensors", "transformers")


def _definitions():
    """(names, functions, attributes): everything the repository defines, by kind. Attributes are what an
    instance can have: methods and class-level names of its classes, assigned attributes, keyword names."""
    names, functions, attributes = set(), set(), set()
    for path in SOURCES:
        if path == os.path.abspath(__file__):
            continue  # this file names missing things on purpose
        tree = ast.parse(open(path).read())
        names.add(os.path.splitext(os.path.basename(path))[0])
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name), functions.add(node.name)
                args = node.args
                names.update(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs,
                                             *filter(None, [args.vararg, args.kwarg])])
            elif isinstance(node, ast.ClassDef):
                names.add(node.name), functions.add(node.name)
                for item in node.body:  # methods, fields, class attributes
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        attributes.add(item.name)
                    targets = [item.target] if isinstance(item, ast.AnnAssign) else getattr(item, "targets", [])
                    attributes.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                attributes.add(node.attr)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg), attributes.add(node.arg)  # dict(h=...): transformer.h
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)  # group names, presets, modes, file markers
    return names, functions, attributes


NAMES, FUNCTIONS, ATTRIBUTES = _definitions()


def _top_level(path) -> set:
    """The names a repository module defines itself (imported names are not its own)."""
    out = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        for target in ([node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])):
            out.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
    return out


OWN = {name: _top_level(path) for name, path in MODULE_PATHS.items()}
# A folder's module may be named by its file's name alone where that is unique ("zero.persistent_bytes"); a
# top-level module keeps its name ("pipeline" is pipeline.py, report/pipeline.py is "report.pipeline").
BY_BASENAME = {}
for _name in sorted(OWN, key=lambda n: n.count(".")):
    BY_BASENAME.setdefault(_name.rsplit(".", 1)[-1], _name)


def _module_of(parts: list):
    """(module import name, the parts after it) for a dotted reference that starts with a module, else None."""
    if parts[0] in PACKAGES and len(parts) > 1 and f"{parts[0]}.{parts[1]}" in OWN:
        return f"{parts[0]}.{parts[1]}", parts[2:]
    if parts[0] in BY_BASENAME:
        return BY_BASENAME[parts[0]], parts[1:]
    return None


def _texts(path):
    """(line, text) of every docstring and comment of a source file, or the whole of a document."""
    source = open(path).read()
    if not path.endswith(".py"):
        return [(1, source)]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            out.append((token.start[0], token.string))
    return out


def _resolves(reference: str) -> bool:
    call = reference.endswith("()")
    parts = reference.removesuffix("()").split(".")
    head = parts[0]
    if len(parts) == 1:
        import torch
        import torch.distributed

        external = any(hasattr(m, head) for m in (torch, torch.distributed, torch.nn.functional, torch.nn.utils))
        if call:
            return head in FUNCTIONS or head in NAMES or callable(getattr(builtins, head, None)) or external
        return (head in NAMES or head in ATTRIBUTES or hasattr(builtins, head) or keyword.iskeyword(head)
                or external or head in COMMANDS)
    own = _module_of(parts)
    if own is not None:
        module, rest = own
        if not rest:
            return True
        if rest[0] not in OWN[module]:
            # Not the module's own: a variable named like it (`mesh.shape` of a Mesh), or a name the module only
            # imports ("train.train_step": defined in step.py), which fails.
            return all(part in ATTRIBUTES for part in rest)
        parts = [module, *rest]
    else:
        module = ALIASES.get(head, head)
    if own is not None or module.split(".")[0] in EXTERNAL:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            return module.split(".")[0] in ("safetensors", "transformers")  # optional packages
        for i, part in enumerate(parts[1:], start=1):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            try:  # a submodule: torch.distributed.pipelining
                obj = importlib.import_module(".".join([module, *parts[1:i + 1]]))
            except ImportError:
                return all(p in ATTRIBUTES for p in parts[i:])  # an instance attribute of a repo class
        return True
    return all(part in ATTRIBUTES for part in parts[1:])  # receiver.attribute: a variable's attributes


def _references():
    for path in [*SOURCES, *DOCUMENTS]:
        for line, text in _texts(path):
            text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks: commands, not references
            for span in re.findall(r"`([^`\n]+)`", text):
                span = span.strip()
                if FILES.search(span):
                    continue
                if REFERENCE.match(span) and not span.startswith("-"):
                    yield os.path.relpath(path, ROOT), line, span


def test_every_backticked_name_resolves():
    unresolved = sorted({(path, line, span) for path, line, span in _references() if not _resolves(span)})
    assert not unresolved, "\n".join(f"{path}:{line}: `{span}` names nothing in the repository"
                                     for path, line, span in unresolved)


def test_the_checker_can_fail():
    """Names that do not exist are caught (made-up examples), and real ones are not."""
    for missing in ("train.train_step", "ReplicatedUpdate", "not_recording()", "mesh.no_such_helper",
                    "torch.no_such_function"):
        assert not _resolves(missing), missing
    for present in ("train.compose", "shard.counts_here", "dist.all_reduce", "ShardInfo", "shard_of()",
                    "torch.distributed.pipelining", "layout.grad_pieces", "F.scaled_dot_product_attention"):
        assert _resolves(present), present


@pytest.mark.parametrize("document", ["README.md", "DESIGN.md"])
def test_the_repository_documents_itself(document):
    """The README points to the repository's own design document, and neither names a folder outside it."""
    text = open(os.path.join(ROOT, document)).read()
    assert "../" not in text and "shared folder" not in text, document
    if document == "README.md":
        assert "DESIGN.md" in text


def test_the_default_suite_leaves_out_the_slow_tests_and_ci_runs_both():
    """The README's two test commands: plain pytest deselects the tests marked slow (pytest.ini registers the
    marker and adds `-m "not slow"`), `-m slow` selects them, and CI (.ci/run) runs both, so every test runs there
    and none twice."""
    import configparser

    ini = configparser.ConfigParser()
    ini.read(os.path.join(ROOT, "pytest.ini"))
    assert any(line.strip().startswith("slow:") for line in ini["pytest"].get("markers", "").splitlines())
    assert '-m "not slow"' in ini["pytest"]["addopts"]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        runs = [line.split() for line in f if "pytest" in line and not line.lstrip().startswith("#")]
    options = [run[run.index("pytest") + 1:] for run in runs]  # after `python3 -m pytest`
    assert sorted(" ".join(given) for given in options) == ["-q", "-q -m slow"], runs
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "python3 -m pytest -q -m slow  " in readme and "python3 -m pytest -q  " in readme


def test_design_says_where_every_file_is_tested():
    """DESIGN.md's "Where each file is tested" paragraph names every module of the repository (a folder's by its
    path: experts/eplb), and each file it says has a test file of its name has one, in the folder of its name."""
    text = open(os.path.join(ROOT, "DESIGN.md")).read()
    paragraph = " ".join(text.split("Where each file is tested:")[1].split("\n\n")[0].split())
    unnamed = [m for m in MODULE_PATHS
               if not re.search(rf"(?<![\w./]){re.escape(m.replace('.', '/'))}(\.py)?\b", paragraph)]
    assert not unnamed, f"DESIGN.md does not say where these are tested: {unnamed}"
    own = paragraph.split("so on:")[1].split(");")[0]
    for name in (n.strip() for n in own.split(",")):
        folder, _, base = name.rpartition("/")
        assert os.path.isfile(os.path.join(ROOT, "tests", folder, f"test_{base}.py")), name


def test_every_top_level_file_fits_one_sitting():
    """A concept file is read in one sitting: at most 650 lines, its docstring included. One that outgrows it
    splits along a concept (what a shard is, what a printout is) rather than compressing its prose."""
    top_level = list(MODULE_PATHS.values())
    too_long = [f"{os.path.basename(path)} ({count})" for path in top_level
                if (count := len(open(path, encoding="utf-8").read().splitlines())) > 650]
    assert not too_long, "files over 650 lines: " + ", ".join(too_long)


def test_every_line_of_the_sources_fits_120_columns():
    """The 120-column convention, counted in characters (Σ, ←, × are one each): a file that needs more room
    splits along a concept rather than packing long lines."""
    long_lines = [f"{os.path.relpath(path, ROOT)}:{number} ({len(line)})" for path in SOURCES
                  for number, line in enumerate(open(path, encoding="utf-8").read().splitlines(), 1)
                  if len(line) > 120]
    assert not long_lines, "lines over 120 columns: " + ", ".join(long_lines)


def test_every_flag_says_its_default_and_has_its_row_in_the_readme():
    """--help states each flag's default (cli/flags.py's HelpWithDefaults, or the help's own words when the default
    is derived), and README.md's Flags table names every flag and every choice a flag offers."""
    from cli import flags

    parser = flags.build_parser()
    formatter = parser._get_formatter()
    actions = [a for a in parser._actions if a.option_strings and a.option_strings[0] != "-h"]
    silent = [a.option_strings[0] for a in actions if "default" not in formatter._get_help_string(a)]
    assert not silent, f"flags whose --help does not say their default: {silent}"
    table = open(os.path.join(ROOT, "README.md")).read().split("## Flags")[1].split("\n## ")[0]
    named = set(re.findall(r"--[a-z0-9][a-z0-9-]*", table))
    assert not [a.option_strings[0] for a in actions if a.option_strings[0] not in named]
    choices = [(a.option_strings[0], c) for a in actions for c in a.choices or ()
               if not re.search(rf"(?<![\w-]){re.escape(str(c))}(?![\w-])", table)]
    presets = [(name, "--preset") for name in __import__("model").PRESETS if name not in table]
    assert not choices and not presets, (choices, presets)

