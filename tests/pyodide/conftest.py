"""The modules under tests/pyodide/py/ run INSIDE Pyodide (they import `js`, `workers`,
`pyodide`), driven by tests/test_pyodide_tier.py; host pytest must not import them."""

collect_ignore_glob = ["py/*.py", "*.py"]
