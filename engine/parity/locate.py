"""The first-divergence locator: where, in one step, a layout's arithmetic leaves one process's.

Both runs recorded the same step from the same weights (engine/observe/record.py); their records are
put in the one-process view (engine/parity/assemble.py) and compared module by module in forward
order (the order outputs are produced, so a module comes after its children) and gradient by
gradient in backward order, each as ``max|a - b| / max|b|`` (engine/parity/compare.py) against the
single-step tolerance of the precision.

The culprit: the first module whose output differs. If its input agrees, the difference arises in
its own forward. If its input already differs, it arose in code between modules: the locator names
the innermost enclosing module whose input still agrees (e.g. ``layers.0.attention`` when the rotary
embedding or the attention kernel between ``wv`` and ``wo`` is wrong).
"""

from __future__ import annotations

from engine.parity.assemble import AssemblyError, View, assemble, load_records
from engine.parity.compare import tensor_difference, tolerance


def _rows(got: dict, want: dict, names: list[str], tol: float, label: str) -> tuple[list[dict], list[str]]:
    rows, skipped = [], []
    for name in names:
        if name not in want or name not in got:
            if name in want or name in got:
                skipped.append(f"{name}{label}: recorded by {'one process' if name in want else 'the layout'} only")
            continue
        a, b = got[name], want[name]
        if a.shape != b.shape:
            skipped.append(f"{name}{label}: shape {tuple(a.shape)}, one process {tuple(b.shape)}")
            continue
        max_abs, rel = tensor_difference(a, b)
        rows.append({"name": name, "max_abs": max_abs, "rel": rel, "differs": rel > tol})
    return rows, skipped


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def compare_views(layout: View, reference: View, precision: str) -> dict:
    """The locator's findings for two views of the same step.

    Returns:
        {"tolerance", "modules": [{"name", "max_abs", "rel", "differs", "input_rel"}] in forward
        order, "grads": [{"name", "max_abs", "rel", "differs"}] in backward order, "first_module"
        (row or None), "culprit" (module name or None), "explanation", "first_grad" (row or None),
        "not_compared": [reasons]}
    """
    tol = tolerance(1, precision)
    modules, skipped = _rows(layout.outputs, reference.outputs, reference.order, tol, " (output)")
    inputs, skipped_in = _rows(layout.inputs, reference.inputs, reference.order, tol, " (input)")
    input_rel = {row["name"]: row for row in inputs}
    for row in modules:
        row["input_rel"] = input_rel[row["name"]]["rel"] if row["name"] in input_rel else None
    grad_names = reference.grad_order + sorted(set(reference.grads) - set(reference.grad_order))
    grads, skipped_g = _rows(layout.grads, reference.grads, grad_names, tol, " (gradient)")
    first = next((row for row in modules if row["differs"]), None)
    culprit, explanation = None, "every compared module output agrees"
    if first is not None:
        culprit, explanation = _culprit(first, input_rel)
    first_grad = next((row for row in grads if row["differs"]), None)
    not_compared = skipped + skipped_in + skipped_g + [f"{k}: {v}" for k, v in
                                                       {**reference.skipped, **layout.skipped}.items()]
    return {"tolerance": tol, "modules": modules, "grads": grads, "first_module": first, "culprit": culprit,
            "explanation": explanation, "first_grad": first_grad, "not_compared": not_compared}


def _culprit(first: dict, inputs: dict) -> tuple[str, str]:
    name = first["name"]
    own = inputs.get(name)
    if own is None:
        return name, f"{name}'s output is the first to differ (its input could not be compared)"
    if not own["differs"]:
        return name, f"its input agrees: the difference arises in {name}'s forward"
    for parent in _parents(name):
        row = inputs.get(parent)
        if row is not None and not row["differs"]:
            return parent, (f"its input already differs while {parent}'s agrees: the difference arises in "
                            f"{parent}'s own forward before {name}")
    return name, f"its input already differs and no enclosing module's input agrees: look before {name}"


def locate(layout_folder: str, reference_folder: str, precision: str) -> dict:
    """Assemble and compare two record folders (the layout's, the one process's) of the same step.

    Returns:
        :func:`compare_views`'s dict plus ``"step"``; on records that cannot be put together (the
        layout trained other samples) ``{"step", "error"}`` instead.

    Raises:
        AssemblyError: a folder without records.
    """
    ref_records = load_records(reference_folder)
    reference = assemble(ref_records)
    records = load_records(layout_folder)
    step = records[0]["step"]
    try:
        view = assemble(records, reference)
    except AssemblyError as error:
        return {"step": step, "error": str(error)}
    return {"step": step, **compare_views(view, reference, precision)}


def format_findings(layout_name: str, found: dict, start: str) -> str:
    """The locator's lines for one layout (``start``: where both runs began the step)."""
    head = f"locate {layout_name}, step {found['step']} ({start}):"
    if "error" in found:
        return f"{head}\n  {found['error']}"
    lines = [head]
    first = found["first_module"]
    if first is None:
        lines.append(f"  no module output differs beyond {found['tolerance']:g}")
    else:
        lines.append(f"  first differing module output (forward order): {first['name']}  max abs "
                     f"{first['max_abs']:.2e}  rel {first['rel']:.2e}; {found['explanation']}")
        lines.append(f"  => {found['culprit']}")
    grad = found["first_grad"]
    if grad is None:
        lines.append("  no gradient differs")
    else:
        why = ("(downstream of the differing forward)" if first is not None else
               "; the forward agrees: the difference arises in the backward or the gradient reduction")
        lines.append(f"  first differing gradient (backward order): {grad['name']}  max abs {grad['max_abs']:.2e}  "
                     f"rel {grad['rel']:.2e} {why}".replace(" ;", ";"))
        if first is None:
            lines.append(f"  => {grad['name']} (gradient)")
    differ = sum(row["differs"] for row in found["modules"])
    lines.append(f"  {len(found['modules'])} module outputs compared ({differ} differ), "
                 f"{sum(row['differs'] for row in found['grads'])}/{len(found['grads'])} gradients differ, "
                 f"{len(found['not_compared'])} tensors not comparable (--json lists all)")
    return "\n".join(lines)
