"""The exportable modules' source, handled for export.py with `ast`, never with text search:

- dependencies: `from mla_tune.X import a` names the dependency X; `module_closure` reads
  the modules a submission needs and orders each after everything it imports;
- imports: top-level `import`/`from` statements are cut out of each module (whole lines,
  exactly the statement's span) and written once at the top of the file;
- protocol names: a backend's PROTOCOL_NAMES (NAME, CAPABILITIES, build, validate, ...)
  become `_NAME_<backend>`, `_CAPABILITIES_<backend>`, `_build_<backend>`, ... by replacing
  exactly the tokens that refer to the module-level name (local variables of the same name
  are left);
- collisions: two modules defining one top-level name differently is refused, naming both.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mla_tune.backends import get_backend, known_backends
from mla_tune.errors import MlaTuneError

PROTOCOL_NAMES = ("NAME", "unavailable_reason", "candidates", "validate", "build",
                  "default_variant", "compile_shape", "warmup", "SPACE_KEYS",
                  "dedupe_key", "CAPABILITIES", "build_serving", "default_serving_variant",
                  "serving_candidates", "serving_q_reference", "vendor_drift_note")
# Names the exported file's own code (export/__init__.py's template) defines; a module may
# not (tests/test_export.py checks the list against the rendered template).
GENERATED_NAMES = frozenset({
    "input_t", "output_t", "custom_kernel", "_EXPORT_TABLE_TEXT", "_EXPORT_TABLE", "_EXPORT_BUILDERS",
    "_EXPORT_RAGGED_BACKENDS", "_EXPORT_DISPATCHER", "_EXPORT_IS_PRIOR", "_EXPORT_SCALED",
    "_export_fallback", "_export_at_scale", "_export_scaled", "_export_what"})
_THIRD_PARTY_OK = {"torch", "triton"}


class ExportError(MlaTuneError, ValueError):
    """The table cannot be exported as asked; the message says what and how to fix it."""


@dataclass
class _Module:
    name: str
    path: Path
    lines: list[str]
    tree: ast.Module
    backend: str | None = None
    deps: list[str] = field(default_factory=list)
    renames: dict[str, str] = field(default_factory=dict)


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        return str(path)


def _is_exportable(name: str) -> bool:
    if name in ("mla_tune.core", "mla_tune.tables.dispatch"):
        return True
    parts = name.split(".")
    return len(parts) == 3 and parts[:2] in (["mla_tune", "kernels"], ["mla_tune", "backends"])


def _read(name: str, backend: str | None = None) -> _Module:
    if not _is_exportable(name):
        raise ExportError(f"{name} is not an exportable module (core, kernels/*, backends/*, "
                          "dispatch); import from one of those instead")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or spec.submodule_search_locations is not None:
        raise ExportError(f"cannot find the source of {name}")
    path = Path(spec.origin)
    return module_from_source(name, path, path.read_text(encoding="utf-8"), backend)


def module_from_source(name: str, path: Path, source: str, backend: str | None = None) -> _Module:
    """Parse one exportable module and find its mla_tune dependencies (checked)."""
    module = _Module(name, path, source.splitlines(keepends=True), ast.parse(source, str(path)), backend)
    for node in ast.walk(module.tree):
        where = f"{_display(path)} line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mla_tune" for a in node.names):
            raise ExportError(f"{where}: `import mla_tune...` cannot be exported; use "
                              "`from mla_tune.<module> import name, ...`")
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mla_tune")):
            if node not in module.tree.body:
                raise ExportError(f"{where}: an mla_tune import inside a function cannot be "
                                  "exported; move it to the top of the module")
            if node.level:
                raise ExportError(f"{where}: relative imports cannot be exported; use absolute ones")
            if any(a.asname for a in node.names) or any(a.name == "*" for a in node.names):
                raise ExportError(f"{where}: exported modules import mla_tune names without "
                                  "`as` or `*`; list the names as they are")
            module.deps.append(node.module)
    return module


def module_closure(roots: list[tuple[str, str | None]]) -> list[_Module]:
    """Modules in dependency order (each after everything it imports), DFS post-order."""
    done: dict[str, _Module] = {}
    visiting: set[str] = set()

    def visit(name: str, backend: str | None, chain: tuple[str, ...]) -> None:
        if name in done:
            return
        if name in visiting:
            raise ExportError(f"import cycle between exportable modules: {' -> '.join(chain + (name,))}")
        visiting.add(name)
        module = _read(name, backend)
        for dep in module.deps:
            visit(dep, _backend_of(dep), chain + (name,))
        visiting.discard(name)
        done[name] = module

    for name, backend in roots:
        visit(name, backend, ())
    return list(done.values())


def _backend_of(module_name: str) -> str | None:
    for backend in known_backends():
        try:
            if get_backend(backend).__name__ == module_name:
                return backend
        except ModuleNotFoundError:
            continue
    return None


# ----------------------------------------------------------------- renaming by scope
def _bound(nodes: list[ast.AST], args: set[str]) -> set[str]:
    """Names bound in a function or class body (not inside nested scopes), minus `global`s."""
    names, declared_global = set(args), set()
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Global):
            declared_global.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        stack.extend(ast.iter_child_nodes(node))
    return names - declared_global


def _arg_names(args: ast.arguments) -> set[str]:
    every = args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
    return {a.arg for a in every if a is not None}


def _global_refs(tree: ast.Module, targets: set[str]) -> list[tuple[int, int, str]]:
    """(line, byte column, name) of every Name token that refers to a module-level target."""
    found: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, scopes: list[set[str]]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                outer = list(child.args.defaults) + [d for d in child.args.kw_defaults if d]
                if not isinstance(child, ast.Lambda):
                    outer += child.decorator_list + ([child.returns] if child.returns else [])
                    outer += [a.annotation for a in child.args.posonlyargs + child.args.args
                              + child.args.kwonlyargs if a.annotation]
                for expr in outer:
                    walk_expr(expr, scopes)
                body = child.body if isinstance(child.body, list) else [child.body]
                inner = scopes + [_bound(body, _arg_names(child.args))]
                for stmt in body:
                    walk_expr(stmt, inner)
            elif isinstance(child, ast.ClassDef):
                for expr in child.decorator_list + child.bases + [k.value for k in child.keywords]:
                    walk_expr(expr, scopes)
                # A class body's names are not visible inside its methods, so only its
                # direct statements see them; methods are walked with the outer scopes.
                own = scopes + [_bound(child.body, set())]
                for stmt in child.body:
                    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        holder = ast.Module(body=[stmt], type_ignores=[])
                        walk(holder, scopes)
                    else:
                        walk_expr(stmt, own)
            elif isinstance(child, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                targets_here = {n.id for g in child.generators for n in ast.walk(g.target)
                                if isinstance(n, ast.Name)}
                walk(child, scopes + [targets_here])
            elif isinstance(child, ast.Name):
                if child.id in targets and not any(child.id in s for s in scopes):
                    found.append((child.lineno, child.col_offset, child.id))
            else:
                walk(child, scopes)

    def walk_expr(node: ast.AST, scopes: list[set[str]]) -> None:
        walk(ast.Module(body=[node], type_ignores=[]) if not isinstance(node, ast.Module) else node,
             scopes)

    walk(tree, [])
    return found


def _def_name_refs(module: _Module, targets: set[str]) -> list[tuple[int, int, str]]:
    found = []
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in targets:
            line = module.lines[node.lineno - 1].encode()
            match = re.compile(rb"(async\s+)?(def|class)\s+").match(line, node.col_offset)
            if not match:
                raise ExportError(f"{_display(module.path)} line {node.lineno}: cannot locate "
                                  f"the name of `{node.name}`")
            found.append((node.lineno, match.end(), node.name))
    return found


def _apply_renames(module: _Module) -> None:
    if not module.renames:
        return
    targets = set(module.renames)
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.Global, ast.Nonlocal)) and targets & set(node.names):
            raise ExportError(f"{_display(module.path)} line {node.lineno}: `global` of a "
                              "backend protocol name cannot be exported; drop the statement")
    refs = _global_refs(module.tree, targets) + _def_name_refs(module, targets)
    for lineno, col, name in sorted(refs, key=lambda r: (r[0], -r[1])):
        line = module.lines[lineno - 1].encode()
        if line[col:col + len(name)] != name.encode():
            raise ExportError(f"{_display(module.path)} line {lineno}: expected `{name}` at "
                              f"column {col}; cannot rename it")
        line = line[:col] + module.renames[name].encode() + line[col + len(name):]
        module.lines[lineno - 1] = line.decode()


# -------------------------------------------------------------- imports and collisions
def _top_level_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(stmt, (ast.If, ast.Try, ast.With)):
        return sorted(_bound(list(ast.iter_child_nodes(stmt)), set()))
    return []


def _cut_imports(modules: list[_Module]) -> dict[str, str]:
    """Blank out every top-level import in the modules; return the imports to hoist, as
    {bound name: statement}."""
    plain: dict[str, str] = {}  # bound name -> import statement text
    origin: dict[str, str] = {}
    for module in modules:
        body = module.tree.body
        for index, stmt in enumerate(body):
            if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                continue
            where = f"{_display(module.path)} line {stmt.lineno}"
            shares = (index > 0 and body[index - 1].end_lineno >= stmt.lineno) or (
                index + 1 < len(body) and body[index + 1].lineno <= stmt.end_lineno)
            if stmt.col_offset or shares:
                raise ExportError(f"{where}: an import must stand on its own lines to be cut")
            for i in range(stmt.lineno - 1, stmt.end_lineno):
                module.lines[i] = ""
            if isinstance(stmt, ast.ImportFrom) and stmt.module.split(".")[0] in ("__future__", "mla_tune"):
                continue
            root = (stmt.module if isinstance(stmt, ast.ImportFrom) else stmt.names[0].name).split(".")[0]
            if root not in sys.stdlib_module_names and root not in _THIRD_PARTY_OK:
                raise ExportError(f"{where}: exported modules import only the standard library, "
                                  f"torch and triton at top level, not {root}; import it inside "
                                  "the function that needs it")
            for alias in stmt.names:
                if isinstance(stmt, ast.ImportFrom):
                    bound, text = alias.asname or alias.name, ast.unparse(
                        ast.ImportFrom(module=stmt.module, names=[alias], level=0))
                else:
                    bound = alias.asname or alias.name.split(".")[0]
                    text = ast.unparse(ast.Import(names=[alias]))
                if plain.get(bound, text) != text:
                    raise ExportError(f"{where}: `{text}` binds {bound}, which {origin[bound]} "
                                      f"binds with `{plain[bound]}`; use one spelling")
                plain.setdefault(bound, text)
                origin.setdefault(bound, where)
    return plain


def _check_collisions(modules: list[_Module], imported: set[str]) -> None:
    seen: dict[str, tuple[str, str]] = {}  # name -> (where, ast dump)
    for module in modules:
        for stmt in module.tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                continue
            for name in _top_level_names(stmt):
                name = module.renames.get(name, name)
                where = f"{_display(module.path)} line {stmt.lineno}"
                if name in imported or name in GENERATED_NAMES:
                    raise ExportError(f"{where} defines `{name}`, which the exported file "
                                      "already uses (an import or its own code); rename it")
                dump = ast.dump(stmt)
                if name in seen and seen[name][1] != dump:
                    raise ExportError(
                        f"top-level name `{name}` is defined both in {seen[name][0]} and in "
                        f"{where}; exported modules share one namespace, so rename one (prefix "
                        "private helpers with the module's short name)")
                seen.setdefault(name, (where, dump))


def vendor_libraries(modules: list[_Module]) -> list[str]:
    found = []
    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            found += [r for r in roots if r not in sys.stdlib_module_names
                      and r not in _THIRD_PARTY_OK and r not in ("mla_tune", "__future__")]
    return sorted(set(found))


def prepare_modules(modules: list[_Module]) -> list[str]:
    """Rename each backend's protocol names, cut every top-level import, refuse colliding
    top-level names; return the import statements to write once at the top."""
    for module in modules:
        if module.backend:
            defined = {n for s in module.tree.body for n in _top_level_names(s)}
            module.renames = {n: f"_{n}_{module.backend}" for n in PROTOCOL_NAMES if n in defined}
    for module in modules:  # names a module imports from a backend module are renamed too
        for stmt in module.tree.body:
            if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("mla_tune"):
                source = next((m for m in modules if m.name == stmt.module), None)
                if source is None:
                    raise ExportError(f"{_display(module.path)} line {stmt.lineno}: imports "
                                      f"{stmt.module}, which is not among the exported modules")
                for alias in stmt.names:
                    if alias.name in source.renames:
                        if module.renames.get(alias.name, source.renames[alias.name]) != source.renames[alias.name]:
                            raise ExportError(f"{_display(module.path)} line {stmt.lineno}: imports "
                                              f"`{alias.name}` from {stmt.module} and defines its own")
                        module.renames[alias.name] = source.renames[alias.name]
    hoisted = _cut_imports(modules)
    _check_collisions(modules, set(hoisted) | {"annotations"})
    for module in modules:
        _apply_renames(module)
    return list(dict.fromkeys(hoisted.values()))
