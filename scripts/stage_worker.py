#!/usr/bin/env python3
"""Stage the folder wrangler uploads the reference Worker's modules from (wrangler.toml's
``[build] command``; ``base_dir`` points at the output).

For a Python main, wrangler uploads every ``**/*.py`` under the module root (the main's folder,
or ``base_dir``), and no setting narrows that: user ``[[rules]]`` may not be of type
``PythonModule``, and ``[python_modules] exclude`` covers ``python_modules/`` only. So the
module root is a copy of the main's folder that leaves out what the Worker never imports::

    python3 scripts/stage_worker.py --main src/entry.py --out build/worker \\
        --exclude semaphore/testing --exclude semaphore/simulate

The output folder is made to hold exactly every file under the main's folder except the main
itself (wrangler uploads it as the main module, from ``main``; a copy in the module root would
be uploaded a second time under the same name), ``__pycache__/`` folders, ``*.pyc`` files and
each ``--exclude`` path (relative to the main's folder; a folder leaves out everything under
it). Files already right are left alone, changed ones are replaced atomically, files and
folders no longer wanted are removed, so two runs at once give the same result. wrangler's
module rules then decide what of the folder is uploaded, as they would for ``src/``.

Paths are relative to the working directory: wrangler runs the build command in its own
(``[build] cwd`` unset), i.e. run ``npx wrangler ...`` from the project root.
``semaphore.testing.workerd.generate_config`` runs the same command in the folder of
``wrangler.toml``. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


def wanted_files(source: Path, main: Path, excludes: list[str]) -> dict[str, Path]:
    """``relative name -> source file`` of every file the output must hold."""
    skip = [tuple(Path(e).parts) for e in excludes]
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(source):
        here = Path(dirpath)
        rel_dir = here.relative_to(source).parts
        dirnames[:] = sorted(d for d in dirnames
                             if d != "__pycache__" and (*rel_dir, d) not in skip)
        for name in sorted(filenames):
            path = here / name
            parts = (*rel_dir, name)
            if name.endswith(".pyc") or parts in skip or path.resolve() == main:
                continue
            found["/".join(parts)] = path
    return found


def sync(out: Path, wanted: dict[str, Path]) -> tuple[int, int]:
    """Make ``out`` hold exactly ``wanted``; return (files written, files removed)."""
    written = removed = 0
    for rel, src in wanted.items():
        dest = out / rel
        content = src.read_bytes()
        if dest.is_file() and not dest.is_symlink() and dest.read_bytes() == content:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
        os.replace(tmp, dest)
        written += 1
    for dirpath, _dirnames, filenames in os.walk(out, topdown=False):
        here = Path(dirpath)
        for name in filenames:
            rel = (here / name).relative_to(out).as_posix()
            if rel not in wanted and not (name.startswith(".") and name.endswith(".tmp")):
                (here / name).unlink(missing_ok=True)
                removed += 1
        if here != out:
            try:
                here.rmdir()  # only if empty
            except OSError:
                pass
    return written, removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main", required=True, help="the Worker's main module (wrangler.toml main)")
    parser.add_argument("--out", required=True, help="the folder to fill (wrangler.toml base_dir)")
    parser.add_argument("--exclude", action="append", default=[], metavar="PATH",
                        help="a file or folder under the main's folder to leave out (repeatable)")
    args = parser.parse_args(argv)
    main_path = Path(args.main).resolve()
    source, out = main_path.parent, Path(args.out).resolve()
    if not main_path.is_file():
        print(f"stage_worker: main module {args.main} does not exist", file=sys.stderr)
        return 2
    if out == source or source in out.parents or out in source.parents:
        print(f"stage_worker: --out {args.out} must lie outside {source} and not contain it",
              file=sys.stderr)
        return 2
    for exclude in args.exclude:
        if Path(exclude).is_absolute() or ".." in Path(exclude).parts:
            print(f"stage_worker: --exclude {exclude} must be relative to {source}", file=sys.stderr)
            return 2
    wanted = wanted_files(source, main_path, args.exclude)
    out.mkdir(parents=True, exist_ok=True)
    written, removed = sync(out, wanted)
    print(f"stage_worker: {args.out}: {len(wanted)} files from {source.name}/ "
          f"({written} written, {removed} removed; left out: {', '.join(args.exclude) or 'nothing'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
