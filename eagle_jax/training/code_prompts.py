"""Code prompts from the Python standard library and installed packages, for self-distillation
(`--sources stdlib-code` and `--sources package-code`).

The held-out code prompts are HumanEval problems: "Complete the following Python function", a
signature and a docstring. Training data of that shape is scarce (HumanEval's 124 training
problems), so these sources write more from code every machine already has and nothing needs to
download: each public function (and public method of a public class) with a docstring, in the
interpreter's standard library or in an installed package, becomes a prompt of the same form, its
body left out. The target writes the body itself (self-distillation), so only the question comes
from the library.

    stdlib_functions()            every standard-library candidate, in a stable (path, line) order
    package_functions(packages)   every candidate of installed packages (DEFAULT_PACKAGES)
    stdlib_code_prompts(n, seed)  a seeded choice of n standard-library prompts ({"id", "prompt", "source"})
    choose(candidates, n, seed)   the same choice from candidates already read

The candidates depend on the Python and package versions (ids name the module and the qualified
name, e.g. `stdlib-json.dumps`, `pkg-toolz.itertoolz.partition`), so a stored dataset records its
prompts and does not need them rebuilt.
"""

from __future__ import annotations

import ast
import copy
import importlib.machinery
import sysconfig
from pathlib import Path
from typing import Collection, Iterator, Optional, Sequence

import numpy as np

# Top-level stdlib packages left out: tests, GUIs, tools and generated tables.
SKIP_TOP = frozenset({"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages",
                      "dist-packages", "__pycache__", "encodings", "pydoc_data", "venv", "__phello__",
                      "unittest", "this.py", "antigravity.py"})
# package-code's default packages: installed with eagle_jax, general-purpose, documented pure Python
# (sympy, also installed, is left out: its 2669 candidates are nearly all symbolic algebra)
DEFAULT_PACKAGES = ("networkx", "numpy", "mpmath", "jinja2", "fsspec", "rich", "setuptools", "requests", "click",
                    "pygments", "markdown_it", "pyparsing", "huggingface_hub", "toolz", "tqdm", "packaging",
                    "dateutil")
MIN_DOC, MAX_DOC = 40, 800  # docstring characters: enough to say what the code does, short enough to read


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _stub(fn: ast.FunctionDef) -> ast.FunctionDef:
    """The function with its body cut to its docstring, re-indented to the body (decorators dropped)."""
    lines = ast.get_docstring(fn).splitlines()  # cleaned: common indentation removed
    rest = ["    " + ln if ln else "" for ln in lines[1:]]
    doc = "\n".join([lines[0], *rest, "    "]) if rest else lines[0]
    stub = copy.deepcopy(fn)
    stub.body = [ast.Expr(ast.Constant(doc))]
    stub.decorator_list = []
    return stub


def _keep(fn, min_args: int) -> bool:
    if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
        return False
    if any(not (isinstance(d, ast.Name) and d.id == "staticmethod") for d in fn.decorator_list):
        return False  # properties, class methods, wrappers: not a plain "complete this function"
    doc = ast.get_docstring(fn)
    return doc is not None and MIN_DOC <= len(doc) <= MAX_DOC and len(fn.args.args) >= min_args


def _candidates(tree: ast.Module) -> Iterator[tuple[str, Optional[ast.ClassDef], ast.FunctionDef]]:
    for node in tree.body:
        if _keep(node, 1):
            yield node.name, None, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for fn in node.body:
                static = bool(getattr(fn, "decorator_list", None))
                if _keep(fn, 1 if static else 2):  # a method: self and at least one argument
                    yield f"{node.name}.{fn.name}", node, fn


def code_prompt(fn: ast.FunctionDef, cls: Optional[ast.ClassDef] = None) -> str:
    """The HumanEval-style request for `fn` (a method is shown inside its class's header)."""
    src = ast.unparse(_stub(fn))
    if cls is None:
        return ("Complete the following Python function. Reply with the full function in a Python code "
                f"block.\n\n```python\n{src}\n```")
    bases = ", ".join(ast.unparse(b) for b in cls.bases)
    header = f"class {cls.name}({bases}):" if bases else f"class {cls.name}:"
    body = "\n".join("    " + ln if ln.strip() else ln for ln in src.splitlines())
    return (f"Complete the following method of the Python class {cls.name}. Reply with the full method in a "
            f"Python code block.\n\n```python\n{header}\n    ...\n\n{body}\n```")


def _scan(root: Path, id_prefix: str, module_prefix: str, source: str, skip_top: Collection[str] = ()) -> list[dict]:
    out, seen = [], set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if (rel.parts[0] in skip_top or rel.parts[0].startswith("config-")
                or any(p.startswith("test") or p.startswith("_") and p != "__init__.py" for p in rel.parts)):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a file this interpreter cannot parse (e.g. lib2to3 test data) is not a source
        module = ".".join(filter(None, [module_prefix, _module_name(rel)]))
        for qual, cls, fn in _candidates(tree):
            pid = f"{id_prefix}-{module}.{qual}"
            if pid in seen:  # a name defined twice (platform branches): the first definition
                continue
            seen.add(pid)
            out.append({"id": pid, "prompt": code_prompt(fn, cls), "source": source,
                        "module": module, "name": qual})
    return out


def stdlib_functions(root: Optional[Path] = None) -> list[dict]:
    """Every candidate of the standard library at `root` (default: this interpreter's), in path
    and line order: {"id", "prompt", "source": "stdlib-code", "module", "name"}."""
    root = Path(root) if root is not None else stdlib_root()
    return _scan(root, "stdlib", "", "stdlib-code", SKIP_TOP)


def package_functions(packages: Sequence[str], paths: Optional[Sequence[str]] = None) -> list[dict]:
    """Every candidate of the installed (pure-Python parts of) `packages`, package by package in
    the order given, each in path and line order: ids `pkg-<module>.<qualname>`, source
    "package-code". `paths` (default sys.path) is where the packages are looked for; a package
    that is not there, or is a single module rather than a package, is an error."""
    out = []
    for name in packages:
        spec = importlib.machinery.PathFinder.find_spec(name, list(paths) if paths is not None else None)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"package-code: {name!r} is not an installed package")
        root = Path(list(spec.submodule_search_locations)[0])
        out += _scan(root, "pkg", name, "package-code")
    return out


def stdlib_code_prompts(n: Optional[int] = None, seed: int = 0, root: Optional[Path] = None,
                        exclude: Collection[str] = ()) -> list[dict]:
    """A seeded choice of `n` candidates (all when n is None) among those whose id is not in
    `exclude` (e.g. the ids of stored data sets), returned in the candidates' order."""
    return choose(stdlib_functions(root), n, seed, exclude)


def choose(candidates: list[dict], n: Optional[int], seed: int = 0, exclude: Collection[str] = ()) -> list[dict]:
    """The seeded choice of `stdlib_code_prompts` from candidates already read (collect_prompts
    makes it for both code sources, after its own exclusion)."""
    items = [p for p in candidates if p["id"] not in exclude]
    if n is None or n >= len(items):
        return items
    pick = np.random.default_rng(seed).permutation(len(items))[:n]
    return [items[i] for i in sorted(pick)]
