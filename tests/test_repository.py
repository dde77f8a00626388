"""What the docs claim about the code itself, checked on the source.

The calls every rank makes together under torchrun are marked `# every rank` (train_lean.py's and
grpo/distributed.py's docstrings, README "Where things are"): a reader must see, without following
the call, which lines may not move under `if rank == 0` or into a branch that one rank skips.
"""
import ast
import functools
import glob
import io
import os
import tokenize

from grpo.variants import EVERY_RANK, POINTS
from helpers import REPO

DISTRIBUTED = "grpo/distributed.py"
# torch.distributed's queries: the rest of it (all_reduce, barrier, init_process_group, ...) waits
# for the other ranks
QUERIES = {"is_initialized", "get_rank", "get_world_size", "get_backend"}
MARK = "# every rank"


def sources() -> list:
    """The files whose call sites are checked: the loop, the algorithm and the harness (not
    grpo/distributed.py, which makes the collectives rather than calls them)."""
    found = glob.glob("grpo/*.py", root_dir=REPO) + glob.glob("harness/*.py", root_dir=REPO)
    return ["train_lean.py", *sorted(p for p in found if p != DISTRIBUTED)]


def parse(path: str) -> ast.Module:
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return ast.parse(f.read(), path)


class Module:
    """One source file: its functions and methods, and the names it imports."""

    def __init__(self, path: str):
        self.path, self.tree = path, parse(path)
        self.name = path[:-3].replace("/", ".")
        self.modules, self.imported = {}, {}   # alias -> module; name -> (module, name)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:   # `from grpo import distributed` imports a module
                    self.imported[a.asname or a.name] = (node.module, a.name)
                    self.modules[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self.modules[a.asname or a.name.split(".")[0]] = a.name
        # (class or None, name) -> the def; a class's __init__ is what calling the class runs
        self.defs = {}
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef):
                self.defs[None, node.name] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        self.defs[node.name, item.name] = item


@functools.cache
def communicating() -> frozenset:
    """The public functions of grpo/distributed.py that wait for the other ranks: each calls a
    torch.distributed function other than a query, or another such function of the file."""
    module, found, grew = Module(DISTRIBUTED), set(), True
    torch_dist = {alias for alias, name in module.modules.items() if name == "torch.distributed"}

    def waits(f) -> bool:
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            return f.value.id in torch_dist and f.attr not in QUERIES
        return isinstance(f, ast.Name) and f.id in found

    while grew:
        grew = False
        for (cls, name), node in module.defs.items():
            if cls is None and name not in found and any(
                    isinstance(c, ast.Call) and waits(c.func) for c in ast.walk(node)):
                found.add(name)
                grew = True
    return frozenset(name for name in found if not name.startswith("_"))


def collective(call: ast.Call, module: Module, known: set, cls=None) -> bool:
    """Whether `call` is of a collective: a communicating function of grpo/distributed.py, or a
    function or method in `known` ((module, class or None, name)). A method is matched by name
    (`guard.fit(...)` is Guard.fit wherever the guard came from), a function through the import
    or the module that names it."""
    f = call.func
    owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
    if owner == "on" and f.attr in POINTS:   # `on.point(...)`: the variants' additions there
        return f.attr in EVERY_RANK
    if owner in module.modules:   # module.f(): that module's function
        target = module.modules[owner]
        if target == "grpo.distributed":
            return f.attr in communicating()
        return any((m, None, f.attr) == (target, c, n) for m, c, n in known)
    if isinstance(f, ast.Attribute):   # a method: self.m() is this class's, obj.m() any class's
        if owner == "self":
            return (module.name, cls, f.attr) in known
        # (super().__init__() is no Run(): a constructor is matched by its class's name)
        return not f.attr.startswith("__") and any(c is not None and n == f.attr
                                                   for _, c, n in known)
    if isinstance(f, ast.Name):   # a function of this module or imported, or a class constructed
        where, name = module.imported.get(f.id, (module.name, f.id))
        return (where, None, name) in known or (where, name, "__init__") in known
    return False


def collectives(modules: list) -> set:
    """Every function and method of train_lean.py, grpo/ and harness/ that makes a collective anywhere
    in its body (a condition around it is the same on every rank, or the run would hang), found to a
    fixed point: (module, class or None, name)."""
    known, grew = set(), True
    while grew:
        grew = False
        for m in modules:
            for (cls, name), node in m.defs.items():
                if (m.path, name) == ("train_lean.py", "main"):   # the run, called once by every rank
                    continue
                key = (m.name, cls, name)
                if key not in known and any(
                        isinstance(c, ast.Call) and collective(c, m, known, cls)
                        for c in ast.walk(node)):
                    known.add(key)
                    grew = True
    return known


def call_sites(module: Module, known: set) -> list:
    """(first line, last line, source) of each call of a collective in the file, and of each
    collective of grpo/distributed.py handed on uncalled (`stack.push(distributed.close)`)."""
    sites, called = [], set()

    def visit(node, cls=None):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.ClassDef) else cls
            if isinstance(child, ast.Call) and collective(child, module, known, inner):
                name = ast.unparse(child.func) + "(...)"
                sites.append((child.lineno, child.end_lineno, name))
                called.add(id(child.func))
            visit(child, inner)

    visit(module.tree)
    for node in ast.walk(module.tree):
        if (isinstance(node, ast.Attribute) and id(node) not in called
                and isinstance(node.value, ast.Name)
                and module.modules.get(node.value.id) == "grpo.distributed"
                and node.attr in communicating()):
            sites.append((node.lineno, node.end_lineno, ast.unparse(node)))
    return sites


def marked_lines(path: str) -> set:
    """The lines whose comment starts with the mark."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        tokens = tokenize.generate_tokens(io.StringIO(f.read()).readline)
        return {t.start[0] for t in tokens
                if t.type == tokenize.COMMENT and t.string.startswith(MARK)}


def check() -> tuple:
    """(the call sites without the mark, the marks on no call site's first or last line)."""
    modules = [Module(p) for p in sources()]
    known = collectives(modules)
    unmarked, stray = [], []
    for m in modules:
        sites, marked = call_sites(m, known), marked_lines(m.path)
        unmarked += [f"{m.path}:{first}: {name}" for first, last, name in sites
                     if not {first, last} & marked]
        ends = {line for first, last, _ in sites for line in (first, last)}
        stray += [f"{m.path}:{line}" for line in sorted(marked - ends)]
    return unmarked, stray


def test_every_call_of_a_collective_is_marked_every_rank():
    """A call of a collective carries a comment that starts `# every rank` on the line where the
    call starts or on the line where it ends (a call over several lines: `f(  # every rank` or
    `...)  # every rank`). A collective: a function of grpo/distributed.py that talks to the other
    ranks (found in the file: all_sum, gather_objects, ...; not the rank() and world_size()
    queries), and any function or method of grpo/ or harness/ that calls one (Guard.fit agrees on
    a retry over ranks, so reference_logprobs and update() are collectives, and so is Run.steps).
    Checked in train_lean.py, grpo/ and harness/; the defs themselves are not call sites. A mark
    on no such line is a false claim too (a collective moved or gone)."""
    unmarked, stray = check()
    assert not unmarked, "calls of a collective without `# every rank`:\n" + "\n".join(unmarked)
    assert not stray, "`# every rank` where no collective is called:\n" + "\n".join(stray)


def test_the_check_knows_the_collectives():
    """What the check must find, so that a mistake in it cannot pass every call unmarked."""
    found = communicating()
    assert {"init", "all_sum", "any_rank", "gather_objects", "sum_gradients", "close"} <= found
    assert not {"rank", "world_size", "is_main"} & found
    known = collectives([Module(p) for p in sources()])
    assert {("harness.guards", "Guard", "fit"), ("harness.run", "Run", "steps"),
            ("harness.run", "Run", "check_rewards"), ("train_lean", None, "update"),
            ("grpo.passes", None, "reference_logprobs"),
            ("harness.run", "Run", "end_step")} <= known   # every rank's RNG states when a step ends
    assert ("harness.checkpoint", "Saver", "save") not in known   # rank 0 alone writes


def test_a_variant_adds_a_collective_only_where_every_rank_runs_it():
    """A switch's addition at a point outside grpo/variants.py EVERY_RANK runs where ranks may
    differ (inside guard.fit's retry, in the loss): it must make no collective. Each switch of
    SWITCHES and of the tables' choices, checked."""
    from grpo import variants
    known = collectives([Module(p) for p in sources()])
    from train_lean import TABLES
    chosen = [variants.declared(f, "switch") for table in TABLES.values() for f in table.values()]
    switches = [*variants.SWITCHES.values(), *chosen]
    added = [(point, getattr(s, point)) for s in switches if s is not None for point in POINTS
             if getattr(s, point) is not None and point not in EVERY_RANK]
    assert added   # the check sees them
    for point, f in added:
        f = f[1] if isinstance(f, tuple) else getattr(f, "func", f)   # a penalty's (name, f)
        assert (f.__module__, None, f.__name__) not in known, (point, f.__name__)
