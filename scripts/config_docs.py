#!/usr/bin/env python
"""Write the generated key reference of engine/docs/configuration.md from engine/config/schema*.py.

    python scripts/config_docs.py            # rewrite the part between the page's markers
    python scripts/config_docs.py --check    # exit 1, naming this command, when the page is out of date

The rendering (engine/config/reference.py) is the schema's own docs, the same ``--help`` prints; prose
outside the markers stays as written. tests/unit/test_config_docs.py runs the same comparison.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` compare) the page; returns the exit status: 0 up to date or written,
    1 out of date under ``--check``, 2 a page without its markers."""
    from engine.config.reference import PAGE, REGENERATE, render_page

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when the page differs")
    parser.add_argument("--page", default=os.path.join(REPO, PAGE), help="the page (default: %(default)s)")
    args = parser.parse_args(argv)
    with open(args.page, encoding="utf-8") as f:
        text = f.read()
    try:
        rendered = render_page(text)
    except ValueError as error:
        print(f"config_docs: {args.page}: {error}", file=sys.stderr)
        return 2
    if args.check:
        if rendered != text:
            print(f"config_docs: {args.page} differs from engine/config/schema*.py; regenerate it: {REGENERATE}",
                  file=sys.stderr)
            return 1
        print(f"{args.page} is up to date")
        return 0
    if rendered != text:
        with open(args.page, "w", encoding="utf-8") as f:
            f.write(rendered)
        print(f"wrote {args.page}")
    else:
        print(f"{args.page} is up to date")
    return 0


if __name__ == "__main__":
    from scripts.project_env import use_project_python

    use_project_python()  # the system Python of a fresh machine lacks the dependencies: re-run under .venv's
    sys.exit(main())
