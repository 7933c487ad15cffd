"""The code's shape: imports go one way, the framework never imports the bundled study, functions stay short."""

import ast
import re

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

MODULES = {path.stem: path for path in REPO.glob("*.py") if path.stem != "setup"}
STUDY = {"gaussian", "gaussian_study"}  # the bundled study's own modules
MAY_IMPORT_THE_STUDY = STUDY | {"settings_training", "settings_analysis"}
# The study kit, written on the framework; studies are written on it.
KIT = {
    "nre_study",
    "nre_analysis",
    "inference_schema",
    "nre_figures",
    "priors",
    "networks",
    "posterior",
    "sampler",
    "rounds",
}
FRAMEWORK = {
    "nnpd",
    "jobs",
    "output_root",
    "store",
    "runtime",
    "trainer",
    "study",
    "settings",
    "results",
    "timings",
    "probes",
    "launcher",
    "designs",
    "case_scores",
    "case_blocks",
    "hpd",
    "analysis_metrics",
    "infer",
    "contrast",
    "c2st",
    "ddp",
    "training_state",
    "training_hooks",
    "fingerprint",
    "flatness",
    "study_loading",
}
# A function a reader can hold, counted in statements (nested ones too) rather than lines, which the
# formatter decides: pyproject.toml's [tool.ruff.lint.pylint] max-statements says the same for `make lint`.
MAX_FUNCTION_STATEMENTS = 40
MAX_NNPD_STATEMENTS = 350  # nnpd.py is the command line and the orchestration, nothing more


def imported(path):
    """Project modules a file imports anywhere (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {name for name in found if name in MODULES and name != path.stem}


GRAPH = {name: imported(path) for name, path in MODULES.items()}


def cycle_from(start):
    """An import cycle through start, as a list of modules, or None."""
    pending = [(start, [start])]
    seen = set()
    while pending:
        name, path = pending.pop()
        for child in GRAPH[name]:
            if child == start:
                return path + [start]
            if child not in seen:
                seen.add(child)
                pending.append((child, path + [child]))
    return None


def test_no_module_is_part_of_an_import_cycle():
    # One test for the rule: a failure lists every cycle found (each from one of its modules).
    cycles = [cycle for cycle in map(cycle_from, sorted(MODULES)) if cycle]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_the_store_imports_nothing_from_the_project_and_restore_stays_there():
    assert GRAPH["store"] == set()
    assert "restore" in {
        node.name for node in ast.parse(MODULES["store"].read_text()).body if isinstance(node, ast.FunctionDef)
    }


def test_only_the_study_and_the_settings_files_import_the_bundled_study():
    importers = {name for name, imports in GRAPH.items() if imports & STUDY}
    assert importers <= MAY_IMPORT_THE_STUDY, importers - MAY_IMPORT_THE_STUDY
    assert "gaussian" in GRAPH["gaussian_study"] and {"output_root", "jobs"} <= GRAPH["nnpd"]  # the scan sees imports


def test_the_public_posterior_does_not_import_the_analysis():
    # restore(run).posterior(x) needs the shared design, scoring and flatness modules, not the whole analysis.
    assert "nre_analysis" not in GRAPH["posterior"] and "nre_analysis" not in GRAPH["infer"]
    assert {"case_blocks", "flatness"} <= GRAPH["posterior"]


def test_the_framework_knows_no_study():
    assert FRAMEWORK <= set(MODULES) and KIT <= set(MODULES)
    for name in sorted(FRAMEWORK):
        assert not GRAPH[name] & (STUDY | KIT), (name, GRAPH[name] & (STUDY | KIT))
        assert "gaussian" not in MODULES[name].read_text().lower(), name  # nor names one
    assert not any(GRAPH[name] & STUDY for name in KIT)  # the kit knows no study either
    examples = {path.stem for path in REPO.glob("examples/**/*.py")} - {"settings_training", "settings_analysis"}
    for name in sorted(FRAMEWORK | KIT):
        tree = ast.parse(MODULES[name].read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert examples and not names & examples, (name, names & examples)


def test_the_scan_counts_imports_inside_functions(tmp_path):
    module = tmp_path / "sample.py"
    module.write_text("import os\n\ndef late():\n    from store import restore\n    import output_root.x\n")
    assert imported(module) == {"store", "output_root"}


def statements(node):
    """The statements inside a function or module, nested ones included."""
    return sum(isinstance(inner, ast.stmt) for inner in ast.walk(node)) - isinstance(node, ast.stmt)


def long_functions(path):
    """(name, statements) of the functions of a file holding more than MAX_FUNCTION_STATEMENTS."""
    return [
        (node.name, statements(node))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and statements(node) > MAX_FUNCTION_STATEMENTS
    ]


FILES = sorted(
    set(REPO.glob("*.py"))
    | set(REPO.glob("tests/*.py"))
    | set(REPO.glob("bench/*.py"))
    | set(REPO.glob("examples/**/*.py"))
)


def test_no_function_holds_more_statements_than_the_limit():
    # One test for the rule: a failure lists every file's long functions (name, lines).
    too_long = {}
    for path in FILES:
        allowed = {"base_settings", "make_settings"} if path.name.startswith("settings_") else set()
        found = [(name, lines) for name, lines in long_functions(path) if name not in allowed]
        if found:
            too_long[str(path.relative_to(REPO))] = found
    assert len(FILES) > len(MODULES)  # the scan sees the files
    assert not too_long, f"functions over {MAX_FUNCTION_STATEMENTS} statements: " + "; ".join(
        f"{file} {found}" for file, found in too_long.items()
    )


def test_nnpd_py_stays_a_readable_command_line():
    assert statements(ast.parse(MODULES["nnpd"].read_text())) <= MAX_NNPD_STATEMENTS


def bound_names(body):
    """The names a module's top-level statements bind (inside top-level if/try blocks too)."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= bound_names(node.body + node.orelse + getattr(node, "finalbody", []))
    return names


def declared_all(path):
    """The names of a module's top-level `__all__` list, or None when it declares none."""
    for node in ast.parse(path.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
            return ast.literal_eval(node.value)
    return None


def test_every_module_lists_its_public_names_in_all_and_each_exists():
    # One test for the rule: a failure names every module without __all__ and every name it lacks.
    problems = []
    for name in sorted(MODULES):
        listed = declared_all(MODULES[name])
        if listed is None:
            problems.append(f"{name}: no __all__")
            continue
        missing = sorted(set(listed) - bound_names(ast.parse(MODULES[name].read_text()).body))
        problems += [f"{name}: __all__ lists {missing} it does not define"] if missing else []
    assert not problems, "; ".join(problems)


BROAD = {"Exception", "NnpdError", "BaseException"}  # handlers that would also catch runtime.Interrupted


def caught_names(handler):
    """The class names an except clause names (the last part of a dotted name)."""
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {kind.attr if isinstance(kind, ast.Attribute) else getattr(kind, "id", None) for kind in kinds}


def swallowing_handlers(path):
    """(line, names) of every broad except clause of a module that can end without raising and that no
    earlier clause of its try lets a KeyboardInterrupt pass."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Try):
            continue
        for handler in node.handlers:
            names = caught_names(handler) if handler.type is not None else {"BaseException"}
            if "KeyboardInterrupt" in names or "Interrupted" in names or "Preempted" in names:
                break
            if names & BROAD and not isinstance(handler.body[-1], ast.Raise):
                found.append((handler.lineno, sorted(names & BROAD)))
    return found


def test_no_handler_of_nnpd_swallows_a_stop():
    # A stop is an NnpdError (and so an Exception); every broad handler lets it pass first (docs/extending.md).
    swallowing = {name: found for name in sorted(MODULES) if (found := swallowing_handlers(MODULES[name]))}
    assert not swallowing, f"broad except clauses with no `except KeyboardInterrupt: raise` before them: {swallowing}"


def members_read(owner):
    """(member, module) for every `<owner>.member` the framework and kit read: owner a name, an attribute
    (ctx.problem) or a call (self.problem()), in every module but the bundled study's own."""
    found = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())) if name not in STUDY else ():
            if isinstance(node, ast.Attribute):
                value = node.value.func if isinstance(node.value, ast.Call) else node.value
                if getattr(value, "id", None) == owner or getattr(value, "attr", None) == owner:
                    found.add((node.attr, name))
    return found


def contract_members(protocol):
    """The members a Protocol of study.py declares: its annotations and its methods."""
    return set(protocol.__annotations__) | {
        name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")
    }


def test_the_contracts_list_every_member_of_a_problem_and_a_prior_that_is_read():
    # A member read but not declared reaches a study only as an AttributeError at analysis time.
    import study

    problem = contract_members(study.ProblemContract) | set(study.PROBLEM_OPTIONAL)
    prior = contract_members(study.PriorContract) | set(study.PRIOR_OPTIONAL)
    assert {"names", "parameter_count", "simulate", "log_likelihood", "describe"} <= problem
    assert sorted(read for read in members_read("problem") if read[0] not in problem) == []
    assert sorted(read for read in members_read("prior") if read[0] not in prior) == []


def test_make_typecheck_names_every_module():
    import tomllib

    files = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert sorted(files) == sorted(f"{name}.py" for name in MODULES), set(files) ^ {f"{m}.py" for m in MODULES}


def test_every_module_is_on_the_architecture_page_once():
    # Each module's line: "- `name.py`: what it holds" (or two names sharing one line).
    lines = [line for line in (REPO / "docs" / "architecture.md").read_text().splitlines() if line.startswith("- `")]
    listed = [name for line in lines for name in re.findall(r"`(\w+)\.py`", line.split(":")[0])]
    assert sorted(set(listed) & set(MODULES)) == sorted(MODULES), set(MODULES) - set(listed)
    assert all(listed.count(name) == 1 for name in MODULES), [n for n in MODULES if listed.count(n) != 1]
