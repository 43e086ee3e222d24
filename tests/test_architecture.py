"""The house rules of docs/architecture.md, checked by reading the source (no imports of the subject).

Each rule names the offending file and line, so a failure says what to move where.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "ddp_hpc"
#: a backstop against a module that holds several ideas, not a target to split at (docs/architecture.md)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

#: variables that carry rank or job facts; only ddp_hpc/env/ may read them. SLURM_CONF is no job
#: fact: it says which cluster Slurm's commands talk to, and ddp_hpc/slurm/conf.py checks it
FACT_VAR = re.compile(r"^(SLURM_(?!CONF$)\w+|SUBMITIT_\w+|TORCHELASTIC_\w+|RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE"
                      r"|GROUP_RANK|GROUP_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|DDP_HPC_(LOG_DIR|JOB_ID|LAUNCHER"
                      r"|NUM_NODES|MASTER_PORT|JOB_END_TIME|RESTART_BASE))$")
SLURM_COMMANDS = {"sbatch", "srun", "squeue", "sacct", "scontrol", "sinfo", "scancel", "sbcast", "salloc",
                  "sacctmgr", "sstat"}
#: written-down exceptions to "only slurm/cli.py starts Slurm commands": the test cluster sets up the
#: very Slurm that slurm/cli talks to (docs/architecture.md, "Rules")
SLURM_RUNNER_EXCEPTIONS = ("ddp_hpc/slurm/cli.py", "ddp_hpc/testcluster/")


def _modules() -> list[tuple[str, ast.Module, str]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        src = path.read_text()
        out.append((str(path.relative_to(REPO)), ast.parse(src), src))
    return out


MODULES = _modules()


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _fact_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """``X.get("SLURM_...")``, ``os.getenv("RANK")``, ``environ["MASTER_PORT"]`` (a load) and
    ``"RANK" in environ``: reads of a fact variable. Writes for child processes are not reads."""
    hits = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and node.args:
            func = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if func in ("get", "getenv"):
                name = _const_str(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            name = _const_str(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            name = _const_str(node.left)
        if name and FACT_VAR.match(name):
            hits.append((node.lineno, name))
    return hits


def test_only_env_reads_rank_and_job_facts_from_the_environment():
    offenders = [f"{rel}:{line} reads {name}" for rel, tree, _ in MODULES
                 if not rel.startswith(("ddp_hpc/env/", "ddp_hpc/testcluster/"))
                 for line, name in _fact_reads(tree)]
    assert not offenders, "read these through ddp_hpc.env (DistEnv, job_facts):\n" + "\n".join(offenders)


def test_the_scan_finds_a_fact_read():
    """The rule above must be able to fail: a read in each of the three shapes is found."""
    tree = ast.parse("import os\nos.environ.get('SLURM_JOB_ID')\nos.environ['RANK']\n'MASTER_PORT' in os.environ\n"
                     "env['RANK'] = '0'\n")
    assert [n for _, n in _fact_reads(tree)] == ["SLURM_JOB_ID", "RANK", "MASTER_PORT"]


def _slurm_argv(tree: ast.Module) -> list[tuple[int, str]]:
    """An argv about to be run: a list/tuple literal that starts with a Slurm command and is passed
    to a call or carries an option (``-x``/``--x``); a plain tuple of names is not one."""
    call_args = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) for a in n.args}
    return [(node.lineno, node.elts[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.List, ast.Tuple)) and node.elts
            and _const_str(node.elts[0]) in SLURM_COMMANDS
            and (id(node) in call_args or any((_const_str(e) or "").startswith("-") for e in node.elts[1:]))]


def test_only_slurm_cli_starts_slurm_commands():
    offenders = [f"{rel}:{line} builds a `{cmd}` command" for rel, tree, _ in MODULES
                 if not rel.startswith(SLURM_RUNNER_EXCEPTIONS) for line, cmd in _slurm_argv(tree)]
    assert not offenders, "run Slurm commands through ddp_hpc.slurm.cli.SlurmCLI:\n" + "\n".join(offenders)
    found = _slurm_argv(ast.parse("subprocess.run(['scontrol', 'requeue', '1'])\nargv = ['squeue', '-h']\n"
                                  "A, B = ('squeue', 'sacct')\n"))
    assert sorted(found) == [(1, "scontrol"), (2, "squeue")]


def test_modules_and_functions_stay_small():
    too_long = []
    for rel, tree, src in MODULES:
        n = len(src.splitlines())
        if n > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {n} lines (max {MAX_MODULE_LINES})")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}() {length} lines (max {MAX_FUNCTION_LINES})")
    assert not too_long, "split these:\n" + "\n".join(too_long)


def _docstring_nodes(tree: ast.Module) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and _const_str(node.body[0].value) is not None}


def test_one_error_format():
    """Errors are ``HintError(problem, hint)``; only ddp_hpc/errors.py spells the HINT line."""
    offenders = []
    for rel, tree, _ in MODULES:
        if rel == "ddp_hpc/errors.py":
            continue
        docs = _docstring_nodes(tree)
        offenders += [f"{rel}:{node.lineno}" for node in ast.walk(tree)
                      if id(node) not in docs and "HINT:" in (_const_str(node) or "")]
    assert not offenders, "pass the hint as HintError's second argument:\n" + "\n".join(offenders)


def test_one_free_port_and_no_dunder_import():
    homes = [rel for rel, tree, _ in MODULES for n in ast.walk(tree)
             if isinstance(n, ast.FunctionDef) and n.name == "free_port"]
    assert homes == ["ddp_hpc/env/ports.py"], homes
    dunder = [f"{rel}:{n.lineno}" for rel, tree, _ in MODULES for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "__import__"]
    assert not dunder, dunder


#: The import layers, lowest first: a module imports modules of its own layer and the layers below,
#: never one above. A name is a top-level module of ddp_hpc/ or a package (every module in it);
#: "__init__" is ddp_hpc/__init__.py. A name with no file yet is allowed; a file whose name is in
#: no layer fails the rule (place it when you add it).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "fsutil", "text", "parsing", "exits"),                  # leaves: no ddp_hpc imports
    ("slurm", "examples"),                                             # Slurm commands; the demo
    ("env", "config"),                                                 # rank and job facts; job config
    ("runlogs", "judge", "records", "data", "dist"),                   # run logs written, judged; records, data, groups
    ("exec", "launch", "supervise"),                                   # wrapper, local launch, fault recovery
    ("train", "progress", "checkpoint", "preemption", "run", "instrument", "integrations"),  # training, the script API
    ("backends",),                                                     # a job's spec and the backends that run it
    ("status", "testcluster"),                                         # job status; the test cluster
    ("submit",),                                                       # submit, cancel, the Python API (ask status)
    ("cli", "__main__", "__init__"),                                   # ddp-hpc; the lazy public names
)


def _module_files(root: Path) -> dict[str, Path]:
    """``ddp_hpc.x.y`` -> its file (a package: its ``__init__.py``), for the tree under ``root``."""
    out = {}
    for path in sorted((root / "ddp_hpc").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(node: ast.AST, module: str, files: dict[str, Path]) -> list[str]:
    """The ddp_hpc modules an import statement (or ``import_module("...")``) loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module if files[module].name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                pkg = pkg.rpartition(".")[0]
            base = f"{pkg}.{base}" if base else pkg
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
    elif (isinstance(node, ast.Call) and node.args and _const_str(node.args[0])
          and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
        names = [_const_str(node.args[0])]
    else:
        return []
    out = []
    for name in names:
        while name not in files and "." in name:
            name = name.rpartition(".")[0]
        if name in files and name not in out:
            out.append(name)
    return out


def _import_edges(root: Path) -> tuple[dict[str, Path], list[tuple[str, str, int]]]:
    """Every import between ddp_hpc modules, at the top or inside a function: (importer, imported,
    line)."""
    files = _module_files(root)
    edges = []
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            edges += [(module, target, node.lineno) for target in _targets(node, module, files)
                      if target != module]
    return files, edges


def _layer(module: str) -> int | None:
    name = module.split(".")[1] if "." in module else "__init__"
    return next((i for i, names in enumerate(LAYERS) if name in names), None)


def _cycles(edges: list[tuple[str, str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_violations(root: Path) -> list[str]:
    """What breaks the layer rule under ``root``: unplaced modules, upward imports, cycles;
    each names file:line and the import."""
    files, edges = _import_edges(root)
    rel = {m: p.relative_to(root) for m, p in files.items()}
    out = [f"{rel[m]}: {m} is in no layer of LAYERS" for m in files if _layer(m) is None]
    for a, b, line in edges:
        la, lb = _layer(a), _layer(b)
        if la is not None and lb is not None and lb > la:
            out.append(f"{rel[a]}:{line} imports {b} (layer {lb}) from layer {la}: move the code "
                       f"that needs it up, or what it needs down")
    for component in _cycles(edges):
        inside = [f"{rel[a]}:{line} imports {b}" for a, b, line in edges
                  if a in component and b in component]
        out.append(f"import cycle {' <-> '.join(component)}: " + "; ".join(inside))
    return out


def test_imports_run_down_the_layers_without_cycles():
    problems = layer_violations(REPO)
    assert not problems, "the layer rule (LAYERS above) is broken:\n" + "\n".join(problems)


def test_the_layer_rule_finds_an_upward_import_and_a_cycle(tmp_path):
    """The rule must be able to fail: a planted tree with a low module importing a high one inside
    a function, a two-module cycle (one side relative), and a module placed in no layer."""
    tree = {"__init__.py": "", "errors.py": "", "slurm/__init__.py": "", "status/__init__.py": "",
            "status/view.py": "from ddp_hpc.errors import HintError\n",
            "slurm/cli.py": "import os\n\n\ndef run():\n    from ddp_hpc.status.view import render\n",
            "env/__init__.py": "", "env/a.py": "from . import b\n", "env/b.py": "x = 1\n\n\n"
            "def f():\n    import ddp_hpc.env.a\n", "nowhere.py": ""}
    for name, text in tree.items():
        (tmp_path / "ddp_hpc" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ddp_hpc" / name).write_text(text)
    problems = layer_violations(tmp_path)
    assert problems == [
        "ddp_hpc/nowhere.py: ddp_hpc.nowhere is in no layer of LAYERS",
        "ddp_hpc/slurm/cli.py:5 imports ddp_hpc.status.view (layer 7) from layer 1: move the code "
        "that needs it up, or what it needs down",
        "import cycle ddp_hpc.env.a <-> ddp_hpc.env.b: ddp_hpc/env/a.py:1 imports ddp_hpc.env.b; "
        "ddp_hpc/env/b.py:5 imports ddp_hpc.env.a",
    ], problems


def test_status_may_not_ask_the_submit_commands_but_the_backends_below_it(tmp_path):
    """Status sits between the backends (which it asks about a job) and the commands that submit
    and cancel (which ask it): a status module importing ``ddp_hpc.submit`` breaks the rule, one
    importing ``ddp_hpc.backends`` does not; a backend importing status breaks it too."""
    tree = {"__init__.py": "", "status/__init__.py": "", "submit/__init__.py": "", "backends/__init__.py": "",
            "status/targets.py": "from ddp_hpc import backends\nfrom ddp_hpc.submit import api\n",
            "submit/api.py": "from ddp_hpc.status import targets\n",
            "backends/local.py": "from ddp_hpc.status import targets\n"}
    for name, text in tree.items():
        (tmp_path / "ddp_hpc" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ddp_hpc" / name).write_text(text)
    problems = [p for p in layer_violations(tmp_path) if not p.startswith("import cycle")]
    assert problems == [
        "ddp_hpc/backends/local.py:1 imports ddp_hpc.status.targets (layer 7) from layer 6: move the "
        "code that needs it up, or what it needs down",
        "ddp_hpc/status/targets.py:2 imports ddp_hpc.submit.api (layer 8) from layer 7: move the code "
        "that needs it up, or what it needs down",
    ], problems


def test_the_documented_tree_lists_every_module():
    """docs/architecture.md's tree names each module of ddp_hpc/ under its own package."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    block = doc.split("## The tree", 1)[1].split("```")[1]
    entries: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        if re.match(r"^  \S", line):
            name = line.split()[0]
        entries[name] = entries.get(name, "") + line + "\n"
    missing = [str(path.relative_to(REPO)) for path in sorted(PKG.rglob("*.py"))
               if (path.parent == PKG and path.name not in entries)
               or (path.parent != PKG and path.name != "__init__.py"
                   and not re.search(rf"\b{re.escape(path.name)}",
                                     entries.get(f"{path.parent.relative_to(PKG).as_posix()}/", "")))]
    assert not missing, "add these to the tree in docs/architecture.md:\n" + "\n".join(missing)


COMMANDS = ["submit", "env", "launch", "run", "exec", "data", "status", "cancel", "records", "testcluster"]


def _ddp_hpc(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("ddp-hpc")
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "ddp_hpc"]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120)


def test_ddp_hpc_help_lists_every_subcommand():
    p = _ddp_hpc("--help")
    assert p.returncode == 0, p.stderr
    for name in COMMANDS:
        assert re.search(rf"^\s+{name}\s+\S", p.stdout, re.M), f"`ddp-hpc --help` does not list {name}:\n{p.stdout}"


@pytest.mark.parametrize("name", COMMANDS)
def test_each_subcommand_has_clean_help(name):
    p = _ddp_hpc(name, "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"usage: ddp-hpc {name}"), p.stdout[:200]
    for clutter in ("(default: None)", "(default: False)", "``", "see the package docstring"):
        assert clutter not in p.stdout, (clutter, p.stdout)
    options = p.stdout.split("options:", 1)[-1]
    # an option line with no two-space gap (no help beside it) and no indented help below it
    bare = re.findall(r"^  (-(?:[^ \n]| (?! ))*)\n(?!\s{6,}\S)", options + "\n", re.M)
    assert not bare, f"options without a help text: {bare}"


def test_unknown_subcommand_is_refused_with_the_list():
    p = _ddp_hpc("sumbit")
    assert p.returncode == 2
    assert "invalid choice: 'sumbit'" in p.stderr and "submit" in p.stderr


def _duplicate_class_names(modules) -> dict[str, list[str]]:
    """Public class names defined in more than one place: ``name -> [file:line, ...]``."""
    where: dict[str, list[str]] = {}
    for rel, tree, _ in modules:
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and not n.name.startswith("_"):
                where.setdefault(n.name, []).append(f"{rel}:{n.lineno}")
    return {name: places for name, places in where.items() if len(places) > 1}


def test_public_class_names_are_unique():
    """One class name, one meaning: a reader (or an import) never has to ask which ``Progress``."""
    dupes = _duplicate_class_names(MODULES)
    assert not dupes, "give each class a name that says what it is:\n" + "\n".join(
        f"{name}: {', '.join(places)}" for name, places in sorted(dupes.items()))
    planted = [("a.py", ast.parse("class Progress:\n    pass\n"), ""),
               ("b.py", ast.parse("def f():\n    class Progress:\n        pass\n"), ""),
               ("c.py", ast.parse("class _Local:\n    pass\n"), ""),
               ("d.py", ast.parse("class _Local:\n    pass\n"), "")]
    assert _duplicate_class_names(planted) == {"Progress": ["a.py:1", "b.py:2"]}


MAX_PARAMETERS = 8
#: public keyword APIs that keep their documented signatures; each builds the one value its
#: internals pass along (TrainParts, StageRequest, LocalRun)
PARAMETER_EXCEPTIONS = {
    "ddp_hpc/train/api.py:fit": "ddp_hpc.fit(model, dataset, config=..., ...): README, docs/training.md",
    "ddp_hpc/train/api.py:train_ddp": "train_ddp(rank, world_size, model_class, data, epochs, ...): docs/training.md",
    "ddp_hpc/data/stage.py:stage": "stage(src, dest, job_id=..., ...): docs/architecture.md",
    "ddp_hpc/launch/local.py:run_local": "run_local(argv, nodes=, procs_per_node=, ...): docs/architecture.md",
}


def _long_parameter_lists(modules, limit: int) -> dict[str, int]:
    """``file:function -> parameters`` over ``limit`` (positional and keyword-only, not self or
    cls; a ``*args`` or ``**kwargs`` catch-all is not counted)."""
    out = {}
    for rel, tree, _ in modules:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = n.args
                names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
                count = len(names) - (names[:1] in (["self"], ["cls"]))
                if count > limit:
                    out[f"{rel}:{n.name}"] = count
    return out


def test_no_long_parameter_lists():
    """A function that needs more than MAX_PARAMETERS values takes the value they make together
    (a frozen dataclass) instead; only the public keyword APIs above keep longer signatures."""
    long = _long_parameter_lists(MODULES, MAX_PARAMETERS)
    offenders = {k: v for k, v in long.items() if k not in PARAMETER_EXCEPTIONS}
    assert not offenders, f"pass one value instead of more than {MAX_PARAMETERS} parameters: {offenders}"
    stale = sorted(set(PARAMETER_EXCEPTIONS) - set(long))
    assert not stale, f"no longer long, drop from PARAMETER_EXCEPTIONS: {stale}"
    planted = ("class T:\n    def __init__(self, a, b, c, d, e, f, g, h):\n        pass\n"
               "def nine(a, b, c, d, e, f, g, *, h=1, i=2):\n    pass\n"
               "def seven(a, b, c, d, e, f, g, *h, **i):\n    pass\n")
    assert _long_parameter_lists([("p.py", ast.parse(planted), planted)], MAX_PARAMETERS) == {"p.py:nine": 9}
#: one idea, one home: the functions that spell it and the module that holds them
ONE_HOME = {"ddp_hpc/exits.py": {"signal_name", "signal_number", "signal_text", "exit_status_of_signal",
                                 "signal_of_exit_status", "exit_status_of_returncode"},
            "ddp_hpc/parsing.py": {"to_int", "to_float"},
            "ddp_hpc/dist.py": {"group_initialized", "group_has_peers"}}
#: written-down exceptions: the same name with another meaning, built on the home's function
ONE_HOME_EXCEPTIONS: set[tuple[str, str]] = set()


def _is_number_parser(node: ast.AST) -> bool:
    """``def f(v): try: return int(v) except ...: return <a default>`` (or ``float``, of ``v`` or
    ``str(v).strip()``): a copy of parsing's."""
    if not (isinstance(node, ast.FunctionDef) and len(node.body) == 1 and isinstance(node.body[0], ast.Try)):
        return False
    body, handlers = node.body[0].body, node.body[0].handlers
    call = body[0].value if len(body) == 1 and isinstance(body[0], ast.Return) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in ("int", "float")
            and len(call.args) == 1):
        return False
    params = {a.arg for a in node.args.args} | {"str"}
    of_a_param = all((not isinstance(n, (ast.Name, ast.Attribute, ast.Subscript)))
                     or (isinstance(n, ast.Name) and n.id in params)
                     or (isinstance(n, ast.Attribute) and n.attr == "strip") for n in ast.walk(call.args[0]))
    return of_a_param and all(len(h.body) == 1 and isinstance(h.body[0], ast.Return)
                              and isinstance(h.body[0].value, (ast.Constant, ast.Name)) for h in handlers)


def _one_home_offenders(modules) -> list[str]:
    """Each idea spelled outside its home: a home's function defined again, a number parser copied,
    ``signal.Signals``, the exit code 75, ``dist.is_initialized()``, the name ``local-driver.out``."""
    homes = {name: home for home, names in ONE_HOME.items() for name in names}
    out = []
    for rel, tree, _ in modules:
        docs = _docstring_nodes(tree)
        out += [f"{rel}:{n.lineno} defines {n.name}(): use {homes[n.name]}'s" for n in tree.body
                if isinstance(n, ast.FunctionDef) and homes.get(n.name, rel) != rel
                and (rel, n.name) not in ONE_HOME_EXCEPTIONS]
        for n in ast.walk(tree):
            line = getattr(n, "lineno", 0)
            if _is_number_parser(n) and rel != "ddp_hpc/parsing.py":
                out.append(f"{rel}:{line} {n.name}() parses a number: use ddp_hpc.parsing")
            elif isinstance(n, ast.Attribute) and n.attr == "Signals" and rel != "ddp_hpc/exits.py":
                out.append(f"{rel}:{line} signal.Signals: use ddp_hpc.exits")
            elif (isinstance(n, ast.Constant) and type(n.value) is int and n.value == 75
                  and rel != "ddp_hpc/exits.py"):
                out.append(f"{rel}:{line} 75: use ddp_hpc.exits.EX_TEMPFAIL")
            elif (isinstance(n, ast.Attribute) and n.attr == "is_initialized" and isinstance(n.value, ast.Name)
                  and n.value.id == "dist" and rel != "ddp_hpc/dist.py"):
                out.append(f"{rel}:{line} dist.is_initialized(): use ddp_hpc.dist.group_initialized()")
            elif (id(n) not in docs and "local-driver.out" == _const_str(n)
                  and rel != "ddp_hpc/runlogs/schema.py"):
                out.append(f"{rel}:{line} 'local-driver.out': use ddp_hpc.runlogs.schema.LOCAL_DRIVER_OUT")
    return out


def test_each_idea_has_one_home():
    offenders = _one_home_offenders(MODULES)
    assert not offenders, "spell these through their one home:\n" + "\n".join(offenders)


def test_the_one_home_scan_finds_each_copy():
    """The rule above must be able to fail: each kind of copy, planted in a module, is found."""
    planted = ast.parse(
        "def signal_name(n):\n    return signal.Signals(n).name\n"
        "def _int(v):\n    try:\n        return int(str(v).strip())\n    except (TypeError, ValueError):\n"
        "        return None\n"
        "def _jsonable(v):\n    try:\n        return float(v)\n    except ValueError:\n        return str(v)\n"
        "def read_pid(p):\n    try:\n        return int(p.read_text())\n    except ValueError:\n        return None\n"
        "class R:\n    def signal_text(self):\n        return signal_text(self.signal)\n"
        "REQUEUED = 75\nok = dist.is_initialized() and torch.cuda.is_initialized()\n"
        "out = 'local-driver.out'\n")
    found = sorted(_one_home_offenders([("ddp_hpc/x.py", planted, "")]), key=lambda o: int(o.split(":")[1].split()[0]))
    assert [o.split(" ", 1)[1] for o in found] == [
        "defines signal_name(): use ddp_hpc/exits.py's", "signal.Signals: use ddp_hpc.exits",
        "_int() parses a number: use ddp_hpc.parsing", "75: use ddp_hpc.exits.EX_TEMPFAIL",
        "dist.is_initialized(): use ddp_hpc.dist.group_initialized()",
        "'local-driver.out': use ddp_hpc.runlogs.schema.LOCAL_DRIVER_OUT"], found
    at_home = ast.parse("def signal_name(n):\n    return signal.Signals(n).name\nEX_TEMPFAIL = 75\n")
    assert not _one_home_offenders([("ddp_hpc/exits.py", at_home, "")])
