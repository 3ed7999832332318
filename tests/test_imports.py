"""The package's imports point one way: no cycles, and no room (a top-level module or subpackage of
`llamarl_jax`) imports a room of its own layer or above. Every import statement counts, the ones
inside functions included (a lazy import is still a dependency). A new room must be given a layer
here; docs/ARCHITECTURE.md draws the same layers."""

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llamarl_jax"

# bottom first: a room may import only rooms of lower layers (and itself)
LAYERS = (
    ("compat", "gpu_paths", "ports", "stats", "schedule", "compile_cache", "parallel", "metrics", "time_breakdown",
     "tokenizer", "replay", "checkpoint", "tools", "live", "loss_terms", "field_rules"),  # loss_terms: the losses'
    # shared pieces; field_rules: the configuration fields' rules
    ("batch", "distributed", "losses", "advantages"),  # the batch contract; losses are pure functions
    ("model", "mismatch"),
    ("transfer", "rewards", "train_config"),  # train_config: the trainer's section of the configuration
    ("config",),
    ("generation", "train"),
    ("envs", "data", "shapes"),
    ("executors", "config_check"),
    ("multiprocess", "build"),  # build: the composition root (a RunConfig -> the executors)
    ("memory_plan", "runners"),
    ("controller",),
    ("experiment",),
    ("measure",),  # the step-time model, byte accounting, decode cost: no runtime module imports it
)
LAYER = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}


def _modules() -> dict[str, Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def import_graph() -> dict[str, set[str]]:
  """module -> the package's modules it imports (absolute and relative, at any depth of the file)."""
  mods = _modules()
  graph = collections.defaultdict(set)
  for name, path in mods.items():
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
          base = ".".join(up + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
      for t in targets:
        while t not in mods and "." in t:
          t = t.rsplit(".", 1)[0]
        if t in mods and t != name and t.startswith("llamarl_jax"):
          graph[name].add(t)
  return graph


def _room(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else parts[0]


def cycles(graph) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
  index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
  for root in list(graph):
    if root in index:
      continue
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = counter[0]
    counter[0] += 1
    stack.append(root)
    on.add(root)
    while work:
      v, it = work[-1]
      w = next(it, None)
      if w is not None:
        if w not in index:
          index[w] = low[w] = counter[0]
          counter[0] += 1
          stack.append(w)
          on.add(w)
          work.append((w, iter(sorted(graph[w]))))
        elif w in on:
          low[v] = min(low[v], index[w])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[v])
      if low[v] == index[v]:
        comp = []
        while True:
          w = stack.pop()
          on.discard(w)
          comp.append(w)
          if w == v:
            break
        if len(comp) > 1:
          out.append(sorted(comp))
  return out


def test_the_scan_sees_lazy_imports_and_finds_a_cycle():
  """The scanner itself: a function-level import counts, and a two-module loop is a cycle."""
  graph = import_graph()
  assert "llamarl_jax.parallel" in graph["llamarl_jax.batch"]  # RolloutBatch.to_host's import, inside a method
  assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
  assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
  assert cycles(import_graph()) == []


def test_every_room_has_a_layer_and_imports_only_below_it():
  graph = import_graph()
  rooms = {_room(m) for m in _modules()} - {"llamarl_jax"}
  assert rooms <= set(LAYER), f"rooms without a layer in tests/test_imports.py: {sorted(rooms - set(LAYER))}"
  upward = sorted({(a, b) for a, targets in graph.items() for b in targets
                   if _room(a) != _room(b) and _room(a) in LAYER and LAYER[_room(b)] >= LAYER[_room(a)]})
  assert upward == [], f"imports of a room at or above the importer's layer: {upward}"


# `llamarl_jax/compat.py` is the one module that reaches into other packages' internals (JAX's, gin's);
# os._exit is public (the underscore is its name)
PRIVATE_READS_ALLOWED = {"llamarl_jax/compat.py"}
PUBLIC_UNDERSCORED = {"os._exit"}


def test_no_module_or_script_reads_another_objects_private_attributes():
  """`x._name` only on self / cls: code that needs another module's internals goes through a public
  method, or through compat.py when the module is a third party's."""
  root = PACKAGE.parent
  found = []
  for base in ("llamarl_jax", "scripts"):
    for path in sorted((root / base).rglob("*.py")):
      rel = str(path.relative_to(root))
      if rel in PRIVATE_READS_ALLOWED:
        continue
      for node in ast.walk(ast.parse(path.read_text(), rel)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            and ast.unparse(node) not in PUBLIC_UNDERSCORED):
          found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
  assert found == [], found


def test_the_docs_name_every_room_with_its_layer():
  """docs/ARCHITECTURE.md's layer table lists each room at its layer here; README's Layout names every
  package directory."""
  root = PACKAGE.parent
  arch = (root / "docs" / "ARCHITECTURE.md").read_text()
  rows = {int(line.split("|")[1]): line.split("|")[2] for line in arch.splitlines()
          if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
  for room, layer in LAYER.items():
    name = f"`{room}/`" if (PACKAGE / room).is_dir() else f"`{room}`"
    assert name in rows.get(layer, ""), f"docs/ARCHITECTURE.md: {name} not in layer {layer}'s row"
  readme = (root / "README.md").read_text()
  for d in sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
    assert f"llamarl_jax/{d}/" in readme, f"README's Layout does not name llamarl_jax/{d}/"
