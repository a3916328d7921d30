"""The package's layout rules, read from the source with `ast` (no module is imported or executed):

(a) no import cycle among specjax's modules, counting imports inside functions (a cycle hidden behind a
    function-level import is still a cycle: the two modules cannot be understood, tested or moved apart);
(b) `specjax/models/` imports only `specjax.models.*`, the standard library and third-party packages
    (the models are the bottom layer: nothing of the decoding, drafting or distillation above them);
(c) no function under `specjax/` takes more than MAX_PARAMETERS parameters (every parameter counts:
    positional, keyword-only, *args and **kwargs; a method's `self` / `cls` does not): a longer list is
    a group of settings that wants a name (a frozen dataclass, as the loop's static settings);
(d) no function under `specjax/` is longer than MAX_LINES lines, from `def` to its last line (a longer
    one does several things that want names: read in one sitting, as gemma's sampler loop).

What counts as an import of module M: `import M`, `from M import name` (an edge to `M.name` where that is
a module of the package, else to M), and the relative forms, anywhere in the file (module level, inside
functions, classes, `try` blocks). Imports under `if TYPE_CHECKING:` are not executed at run time and do
not count. Importing `a.b.c` also runs the packages `a` and `a.b`; those implicit edges are not counted
(every module would then sit in a cycle with `specjax/__init__.py`): only the module named.

Each failure message lists every offence with its file and line, so that one run shows all that is left.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "specjax"
MAX_PARAMETERS = 8
MAX_LINES = 60


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _sources() -> dict[str, pathlib.Path]:
  """{module name: its file} for every module of the package."""
  return {_module_name(path): path for path in sorted((ROOT / PACKAGE).rglob("*.py"))}


MODULES = _sources()


def _is_type_checking(test: ast.expr) -> bool:
  return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or
          (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


class _Imports(ast.NodeVisitor):
  """Every import statement of one module (outside `if TYPE_CHECKING:`): (absolute dotted name, the
  names imported from it (empty for `import x`), line, the enclosing function or None)."""
  def __init__(self, module: str, is_package: bool):
    self.package = module if is_package else module.rpartition(".")[0]
    self.found: list[tuple[str, tuple[str, ...], int, str | None]] = []
    self.functions: list[str] = []

  def visit_If(self, node: ast.If):
    if _is_type_checking(node.test):
      for child in node.orelse:
        self.visit(child)
      return
    self.generic_visit(node)

  def _function(self, node):
    self.functions.append(node.name)
    self.generic_visit(node)
    self.functions.pop()

  visit_FunctionDef = visit_AsyncFunctionDef = _function

  def _where(self) -> str | None:
    return ".".join(self.functions) if self.functions else None

  def visit_Import(self, node: ast.Import):
    for alias in node.names:
      self.found.append((alias.name, (), node.lineno, self._where()))

  def visit_ImportFrom(self, node: ast.ImportFrom):
    if node.level:
      base = self.package.split(".")
      base = base[:len(base) - (node.level - 1)]
      name = ".".join(base + ([node.module] if node.module else []))
    else:
      name = node.module or ""
    self.found.append((name, tuple(alias.name for alias in node.names), node.lineno, self._where()))


def _imports(module: str) -> list[tuple[str, tuple[str, ...], int, str | None]]:
  path = MODULES[module]
  visitor = _Imports(module, path.name == "__init__.py")
  visitor.visit(ast.parse(path.read_text(), filename=str(path)))
  return visitor.found


def _package_targets(name: str, names: tuple[str, ...]) -> list[str]:
  """The package's modules an import statement names (see the module docstring)."""
  if name != PACKAGE and not name.startswith(PACKAGE + "."):
    return []
  if names:
    submodules = [f"{name}.{n}" for n in names if f"{name}.{n}" in MODULES]
    if len(submodules) < len(names) or not submodules:  # some name is an attribute of `name` itself
      submodules.append(name)
    return [m for m in submodules if m in MODULES]
  while name not in MODULES and "." in name:  # `import specjax.a.b` of a name that is no module
    name = name.rpartition(".")[0]
  return [name] if name in MODULES else []


def _where(module: str, line: int, function: str | None) -> str:
  place = f"{MODULES[module].relative_to(ROOT)}:{line}"
  return f"{place} (inside {function}())" if function else place


def _graph() -> dict[str, dict[str, tuple[int, str | None]]]:
  """{module: {imported module of the package: (line, enclosing function) of its first import}}."""
  graph = {}
  for module in MODULES:
    edges = {}
    for name, names, line, function in _imports(module):
      for target in _package_targets(name, names):
        if target != module:
          edges.setdefault(target, (line, function))
    graph[module] = edges
  return graph


def _cycles(graph: dict[str, dict[str, tuple[int, str | None]]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each as a shortest cycle
  through its first module (sorted), members in import order."""
  index, low, stack, on_stack, components = {}, {}, [], set(), []

  def connect(node: str):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in graph[node]:
      if target not in index:
        connect(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        components.append(sorted(component))

  limit = sys.getrecursionlimit()
  sys.setrecursionlimit(max(limit, 10 * len(graph)))
  try:
    for node in sorted(graph):
      if node not in index:
        connect(node)
  finally:
    sys.setrecursionlimit(limit)

  cycles = []
  for component in sorted(components):
    start, members = component[0], set(component)
    parents, frontier = {start: None}, [start]
    while frontier and start not in [t for f in frontier for t in graph[f]]:  # breadth first back to start
      next_frontier = []
      for node in frontier:
        for target in sorted(graph[node]):
          if target in members and target not in parents:
            parents[target] = node
            next_frontier.append(target)
      frontier = next_frontier
    last = next(node for node in frontier if start in graph[node])
    cycle = [last]
    while parents[cycle[-1]] is not None:
      cycle.append(parents[cycle[-1]])
    cycles.append(cycle[::-1])
  return cycles


def _short(module: str) -> str:
  return str(MODULES[module].relative_to(ROOT / PACKAGE))


def test_no_import_cycle():
  graph = _graph()
  problems = []
  for cycle in _cycles(graph):
    steps = [f"    {_where(a, *graph[a][b])} imports {b}" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
    problems.append(" <-> ".join(_short(m) for m in cycle) + "\n" + "\n".join(steps))
  assert not problems, (f"{len(problems)} import cycle(s) among specjax's modules (imports inside functions "
                        f"count):\n" + "\n".join(problems))


def test_models_import_only_models_the_standard_library_and_third_party_packages():
  problems = []
  for module in MODULES:
    if not (module == f"{PACKAGE}.models" or module.startswith(f"{PACKAGE}.models.")):
      continue
    for name, names, line, function in _imports(module):
      if name == PACKAGE and set(names) == {"models"}:
        continue
      if (name == PACKAGE or name.startswith(PACKAGE + ".")) and not (name == f"{PACKAGE}.models" or
                                                                      name.startswith(f"{PACKAGE}.models.")):
        what = f"{name} ({', '.join(names)})" if names else name
        problems.append(f"  {_where(module, line, function)} imports {what}")
  assert not problems, ("specjax/models/ may import only specjax.models.*, the standard library and "
                        f"third-party packages; {len(problems)} upward import(s):\n" + "\n".join(problems))


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> list[str]:
  args = function.args
  names = [a.arg for a in args.posonlyargs + args.args]
  if in_class and names and names[0] in ("self", "cls"):
    names = names[1:]
  names += [a.arg for a in args.kwonlyargs]
  names += [f"*{args.vararg.arg}"] if args.vararg else []
  names += [f"**{args.kwarg.arg}"] if args.kwarg else []
  return names


def _functions(tree: ast.AST):
  """(qualified name, function node, whether it is defined directly in a class) for every def."""
  def walk(node, prefix, in_class):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        name = f"{prefix}{child.name}"
        yield name, child, in_class
        yield from walk(child, f"{name}.", False)
      elif isinstance(child, ast.ClassDef):
        yield from walk(child, f"{prefix}{child.name}.", True)
      else:
        yield from walk(child, prefix, in_class)

  yield from walk(tree, "", False)


def test_no_function_takes_more_than_eight_parameters():
  problems = []
  for module, path in MODULES.items():
    for name, function, in_class in _functions(ast.parse(path.read_text(), filename=str(path))):
      parameters = _parameters(function, in_class)
      if len(parameters) > MAX_PARAMETERS:
        problems.append((len(parameters), f"  {path.relative_to(ROOT)}:{function.lineno} {name}: "
                         f"{len(parameters)} parameters"))
  problems.sort(key=lambda p: (-p[0], p[1]))
  assert not problems, (f"{len(problems)} function(s) under specjax/ take more than {MAX_PARAMETERS} parameters "
                        "(self/cls excluded; group the settings):\n" + "\n".join(p for _, p in problems))


def test_no_function_is_longer_than_sixty_lines():
  problems = []
  for path in MODULES.values():
    for name, function, _ in _functions(ast.parse(path.read_text(), filename=str(path))):
      lines = function.end_lineno - function.lineno + 1
      if lines > MAX_LINES:
        problems.append(f"  {path.relative_to(ROOT)}:{function.lineno} {name}: {lines} lines")
  assert not problems, (f"{len(problems)} function(s) under specjax/ are longer than {MAX_LINES} lines:\n" +
                        "\n".join(problems))


def test_the_rules_see_what_they_check():
  """The readers themselves: a function-level import is an edge, a TYPE_CHECKING one is not, and the
  known modules are there (a parser that found nothing would pass the rules above)."""
  source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n  from specjax import metrics\n"
            "def f(a, b, *c, d, **e):\n  from specjax.speculative import loop\n  from . import sampling\n")
  visitor = _Imports("specjax.generation", is_package=False)
  visitor.visit(ast.parse(source))
  assert [(n, names, f) for n, names, _, f in visitor.found] == [("typing", ("TYPE_CHECKING",), None),
                                                                 ("specjax.speculative", ("loop",), "f"),
                                                                 ("specjax", ("sampling",), "f")]
  assert _package_targets("specjax.speculative", ("loop",)) == ["specjax.speculative.loop"]
  assert _package_targets("specjax.sampling", ("probabilities",)) == ["specjax.sampling"]
  [(_, function, _)] = list(_functions(ast.parse(source)))
  assert _parameters(function, in_class=False) == ["a", "b", "d", "*c", "**e"]
  assert {"specjax.speculative.loop", "specjax.models.attention", "specjax.models.transformer"} <= set(MODULES)
  graph = {"a": {"b": (1, None)}, "b": {"c": (1, None)}, "c": {"a": (1, None)}, "d": {"a": (1, None)}}
  assert _cycles(graph) == [["a", "b", "c"]]
