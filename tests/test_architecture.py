"""The import rules of the layout (ARCHITECTURE.md): ``contract`` imports none of the other packages and names no
backend; ``baselines`` and ``mok_kernels`` import ``contract`` but never the harness or each other; the harness reaches
the backends only through the registry's import targets (no import statement), and their options modules are
torch-free; the ground truth (``harness/measure/reference.py``) leans on no baseline; nothing imports ``mok_tools`` (the
tools that use both the kernels and the harness); no .py file under mok_kernels/ grows past about 550 lines; no import
circle; every module is placed in ARCHITECTURE.md. Inside the harness, by wing: the configuration (``config/``) imports
neither measuring (``measure/``) nor launching (``launch/``); measuring and reporting (``report/``) never import each
other; the ground (``core/``) imports no wing; the harness's top level holds at most 8 .py files."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("contract", "harness", "baselines", "mok_kernels", "mok_tools")


def first_party_imports(path: Path) -> set[str]:
    """The top-level first-party packages a module imports anywhere in it (lazy imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return out


FORBIDDEN = {
    "contract": {"harness", "baselines", "mok_kernels", "mok_tools"},
    "baselines": {"harness", "mok_kernels", "mok_tools"},
    "mok_kernels": {"harness", "baselines", "mok_tools"},
    "harness": {"mok_tools", "baselines", "mok_kernels"},  # backends: through the registry's import targets only
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_down_the_layers(package):
    bad = {str(p.relative_to(ROOT)): sorted(first_party_imports(p) & FORBIDDEN[package])
           for p in (ROOT / package).rglob("*.py")}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"imports against the layers: {bad}"


def test_the_reference_leans_on_no_baseline():
    assert "baselines" not in first_party_imports(ROOT / "harness" / "measure" / "reference.py")


def test_kernel_files_stay_small():
    big = {name: n for p in (ROOT / "mok_kernels").rglob("*.py")
           if (name := str(p.relative_to(ROOT))) and (n := len(p.read_text().splitlines())) > 550}
    assert not big, f"split these by what they do: {big}"


def test_a_backend_that_misses_part_of_the_protocol_is_refused_when_loaded():
    from contract import check_backend

    class Incomplete:
        name = "incomplete"
        directions = ("fwd", "sideways")

        def __init__(self, case, group):
            pass

        def setup(self, inputs):
            pass

    with pytest.raises(TypeError) as e:
        check_backend(Incomplete, "incomplete")
    msg = str(e.value)
    assert "directions" in msg and "unsupported_reason" in msg and "no method `forward`" in msg

    from harness.core.backends import BACKENDS, load_backend

    for key in ("reference", "nccl", "mok_hopper"):  # importable everywhere: checked for real
        check_backend(load_backend(key), key)
    assert set(BACKENDS) >= {"reference", "nccl", "mok_hopper"}


def test_results_hold_no_code():
    """results/ is evidence (logs, CSVs, notes): scripts live in the packages, where the tests import them."""
    assert not [str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*") if p.suffix in (".py", ".sh")]


def _module_level_imports(path: Path) -> set[str]:
    """The modules a file imports at module level (not inside a function)."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_charts_do_not_import_the_report():
    """harness.report.plots draws what harness.report.claims computes, with harness.report.labels's names; the report
    writes both. No cycle: plots imports neither the report nor anything that imports it."""
    assert not {"harness.report.report"} & first_party_modules(ROOT / "harness" / "report" / "plots.py")
    for name in ("labels", "claims"):
        assert not {"harness.report.report", "harness.report.plots"} & first_party_modules(
            ROOT / "harness" / "report" / f"{name}.py"), name
    assert "harness.report.plots" not in _module_level_imports(ROOT / "harness" / "report" / "report.py")


def first_party_modules(path: Path) -> set[str]:
    """The harness modules a file imports anywhere (``from harness import x`` counts as ``harness.x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | ({f"{node.module}.{a.name}" for a in node.names} if node.module == "harness"
                                    else set())
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("harness.")}


def test_no_private_name_crosses_modules():
    """A name with a leading underscore stays in its module: no ``from harness.x import _y`` and no ``x._y`` on an
    imported first-party module, in the harness or the benchmarks (a shared helper gets a public name in
    the module it belongs to)."""
    bad = []
    files = [*(ROOT / "harness").rglob("*.py"), *(ROOT / "mok_tools").rglob("*.py")]
    for path in files:
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
                bad += [f"{path.relative_to(ROOT)}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
                aliases |= {a.asname or a.name for a in node.names}
            elif isinstance(node, ast.Import):
                aliases |= {(a.asname or a.name).split(".")[0] for a in node.names
                            if a.name.split(".")[0] in PACKAGES}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, bad


def test_every_backend_signature_is_typed_with_the_contract():
    """Each registered backend class takes a ``contract.Case`` and ``contract.LayerInputs``, not ``Any``."""
    from harness.core.backends import BACKENDS

    untyped = []
    for key, target in BACKENDS.items():
        module, _, cls_name = target.partition(":")
        tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        want = {"unsupported_reason": ("case", "Case"), "__init__": ("case", "Case"),
                "setup": ("inputs", "LayerInputs")}
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name in want:
                arg, ann = want[fn.name]
                got = next((a.annotation for a in fn.args.args if a.arg == arg), None)
                if got is None or ast.unparse(got) != ann:
                    untyped.append(f"{key}.{fn.name}({arg}: {ast.unparse(got) if got is not None else '-'})")
    assert not untyped, untyped


def _wheel(path: Path, name: str, files: dict[str, str]) -> None:
    """A minimal wheel (dist-info METADATA / WHEEL / RECORD beside ``files``), as pip installs one."""
    import zipfile

    info = f"{name}-1.0.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)


def test_gpu_env_installs_wheel_folders_joins_parts_and_follows_pth_files(tmp_path):
    """scripts/gpu_env.sh, as every GPU call sources it: the wheels of several folders into MOKBENCH_SITE (a wheel
    split into parts joined first), and the folder a wheel's .pth names on PYTHONPATH (pip --target runs no .pth;
    nvidia-cutlass-dsl's Python package is found only that way)."""
    a, b, site = tmp_path / "a", tmp_path / "b", tmp_path / "site"
    a.mkdir()
    b.mkdir()
    _wheel(a / "plain_pkg-1.0-py3-none-any.whl", "plain_pkg", {"plain_pkg/__init__.py": "X = 1\n"})
    whole = tmp_path / "pth_pkg-1.0-py3-none-any.whl"
    _wheel(whole, "pth_pkg", {"pth_pkg.pth": "pth_pkg/inner", "pth_pkg/inner/hidden_mod.py": "Y = 2\n"})
    data = whole.read_bytes()
    (b / f"{whole.name}.part-aa").write_bytes(data[: len(data) // 2])
    (b / f"{whole.name}.part-ab").write_bytes(data[len(data) // 2:])
    script = (f"source scripts/gpu_env.sh {a} {b} || exit 3; echo \"$PYTHONPATH\"; "
              f"{sys.executable} -c 'import plain_pkg, hidden_mod; print(plain_pkg.X + hidden_mod.Y)'")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=dict(env, MOKBENCH_SITE=str(site)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    path, out = r.stdout.strip().splitlines()
    assert path.split(":")[:2] == [str(site), str(site / "pth_pkg" / "inner")] and out == "3"
    assert (b / whole.name).read_bytes() == data  # the parts joined


def _module_graph() -> dict[str, set[str]]:
    """Every first-party module (``package.sub.module``) and the first-party modules it imports anywhere in it
    (lazy imports included; ``from package import name`` counts as the submodule ``name`` where one exists)."""
    modules = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {}
    for name, p in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_anywhere_in_the_tree():
    """A package's __init__ that loads its submodules lazily is the package itself importing them: it counts."""
    assert _cycles(_module_graph()) == []


# The harness's wings (ARCHITECTURE.md): the ground (core/) and the five wings a sweep point flows through.
WINGS = ("core", "config", "measure", "launch", "report", "gate")
WING_RULES = {
    "core": set(WINGS) - {"core"},  # the ground imports no wing
    "config": {"measure", "launch"},  # the configuration is read by the measuring and the launching, never the reverse
    "measure": {"report"},  # measuring and reporting never import each other: rows are what passes between them
    "report": {"measure"},
}


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "harness" and parts[1] in WINGS else None


def wing_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a harness module against :data:`WING_RULES`, as ``importer -> imported``."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if (w := _wing(m)) and _wing(d) in WING_RULES.get(w, ()))


def test_the_wings_import_by_their_rules():
    """Configuration imports neither measuring nor launching; measuring and reporting never import each other; the
    ground imports no wing (lazy imports included)."""
    graph = _module_graph()
    assert {_wing(m) for m in graph} >= set(WINGS), "a wing is missing: update WINGS and ARCHITECTURE.md"
    assert wing_violations(graph) == []


def test_the_wing_check_sees_a_crossing():
    assert wing_violations({"harness.config.point": {"harness.measure.runner", "harness.core.results"},
                            "harness.measure.memory": {"harness.report.labels"},
                            "harness.report.claims": {"harness.measure"},
                            "harness.core.results": {"harness.gate.compare"},
                            "harness.launch.cli": {"harness.measure.runner"}}) == [
        "harness.config.point -> harness.measure.runner", "harness.core.results -> harness.gate.compare",
        "harness.measure.memory -> harness.report.labels", "harness.report.claims -> harness.measure"]


def test_the_harness_top_level_holds_few_files():
    """The harness's top level is its entry points; everything else lives in a wing."""
    top = sorted(p.name for p in (ROOT / "harness").glob("*.py"))
    assert len(top) <= 8, f"move these into a wing: {top}"
    assert not [p.name for p in (ROOT / "harness").iterdir()
                if p.is_dir() and p.name != "__pycache__" and p.name not in WINGS + ENTRY_PACKAGES]


ENTRY_PACKAGES = ("compare", "slurm")  # `python -m harness.compare` / `harness.slurm`: a __main__ each, nothing else


def test_the_entry_packages_hold_only_their_command():
    for name in ENTRY_PACKAGES:
        assert sorted(p.name for p in (ROOT / "harness" / name).glob("*.py")) == ["__init__.py", "__main__.py"], name


def test_the_circle_check_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_architecture_md_places_every_module():
    """Every module of the packages and scripts/ is named in ARCHITECTURE.md (by its path or its file name)."""
    import re

    arch = (ROOT / "ARCHITECTURE.md").read_text()
    missing = [str(p.relative_to(ROOT)) for d in (*PACKAGES, "hydra_plugins", "scripts")
               for p in sorted((ROOT / d).rglob("*.py"))
               if p.name != "__init__.py" and str(p.relative_to(ROOT)) not in arch
               and not re.search(r"(?<![\w/.])" + re.escape(p.name) + r"(?!\w)", arch)]
    assert not missing, f"place these in ARCHITECTURE.md: {missing}"


def test_contract_names_no_backend_and_case_holds_no_backend_option():
    """What one backend alone chooses is that backend's option: no backend key, option or alias in contract/, and no
    such field in ``Case``."""
    import dataclasses
    import importlib.util
    import re

    from contract.case import Case
    from contract.options import option_specs
    from harness.config.backend_options import option_backends
    from harness.core.backends import REGISTRY

    names = {k for k in REGISTRY if k != "reference"}  # the reference is the harness's own
    fields = set()
    for cls in option_backends().values():
        for field, spec in option_specs(cls).items():
            names |= {spec.alias} if spec.alias else set()
            fields.add(field)
    # a key that is also an importable library's name (``torch``) cannot be told from the library in the text
    names = {n for n in names if importlib.util.find_spec(n) is None}
    assert "nccl" in names and "mok_hopper" in names
    found = [f"{p.relative_to(ROOT)}: {n}" for p in sorted((ROOT / "contract").glob("*.py")) for n in sorted(names)
             if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", p.read_text())]
    assert not found, found
    assert not {f.name for f in dataclasses.fields(Case)} & (names | fields)


def test_the_backends_options_load_without_torch():
    """The harness builds its schema from every backend's options: their modules import no torch (nor the backend)."""
    from harness.core.backends import REGISTRY

    targets = sorted({s.options for s in REGISTRY.values() if s.options})
    assert targets, "no backend declares options"
    code = ("import importlib, sys\n"
            f"for t in {targets!r}:\n"
            "    m, _, a = t.partition(':'); getattr(importlib.import_module(m), a)\n"
            "print(sorted(n for n in sys.modules if n == 'torch' or n.split('.')[0] in ('baselines', 'mok_kernels')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    loaded = eval(out)  # noqa: S307 (our own subprocess's list of names)
    assert "torch" not in loaded, loaded
    assert not [n for n in loaded if n.endswith((".nccl", ".backend", ".common", ".fp8_gemm"))], loaded


def test_every_function_architecture_md_names_exists():
    """Each ``name()`` ARCHITECTURE.md names is defined somewhere in the packages (a renamed or removed function fails
    here, not in a reader's search)."""
    import re

    text = (ROOT / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"(\w+)\(\)", text))
    # the functions of validate.py, which it lists by name
    named |= set(re.findall(r"`(\w+)`", text[text.index("`validate.py`"):text.index("`point.py`")]))
    assert len(named) > 10
    defined = set()
    for d in PACKAGES:
        for p in (ROOT / d).rglob("*.py"):
            defined |= {n.name for n in ast.walk(ast.parse(p.read_text()))
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    assert not named - defined, sorted(named - defined)


MAX_FUNCTION_LINES = 80


def long_functions(folder: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Every function or method (nested ones too) in the .py files under ``folder``, at any depth, longer than
    ``limit`` lines from its ``def`` line to its last line: ``path:line name`` -> lines."""
    out = {}
    for p in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out[f"{p.relative_to(folder)}:{node.lineno} {node.name}"] = n
    return out


def test_no_harness_function_grows_past_80_lines():
    long = long_functions(ROOT / "harness")
    assert not long, f"split these into named steps, {MAX_FUNCTION_LINES} lines at most: {long}"


def test_the_length_check_sees_a_long_method_in_a_sub_package(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # with the def line: one too many
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.py").write_text("class C:\n    def short(self):\n        pass\n\n"
                                           f"    def long(self):\n{body}")
    assert long_functions(tmp_path) == {"sub/m.py:5 long": MAX_FUNCTION_LINES + 1}
    assert long_functions(tmp_path, MAX_FUNCTION_LINES + 1) == {}
