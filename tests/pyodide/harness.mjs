#!/usr/bin/env node
// Tier 2 harness: run one Python test module inside Pyodide (npm `pyodide`, offline) with the
// real `workers` SDK (python_modules/, from workers-runtime-sdk) and the JS stand-ins of
// standins.mjs playing the Workers runtime.
//
//   node tests/pyodide/harness.mjs [--only a,b] [--timeout S] [--list] tests/pyodide/py/test_x.py
//
// Prints one line per test: "@@PYODIDE-TIER@@ {json}", then "N passed, N failed[, N skipped]".
// Exit status: 0 all passed, 1 a test failed, 2 the environment is missing (run scripts/setup).
//
// Environment overrides (optional): PYODIDE_TIER_PYODIDE_DIR (folder of pyodide.mjs),
// PYODIDE_TIER_SDK_DIR (folder holding the `workers` package), PYODIDE_TIER_SRC_DIR.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, "..", "..");
const MARK = "@@PYODIDE-TIER@@";

function die(msg, code = 2) {
  process.stderr.write(`pyodide tier: ${msg}\n`);
  process.exit(code);
}

// The Workers runtime runs Python with JSPI (stack switching: run_sync works in handlers).
// Node 24 has it behind a V8 flag that must be given on the command line: re-exec with it.
if (typeof WebAssembly.Suspending !== "function") {
  if (process.env.PYODIDE_TIER_REEXEC) die("WebAssembly JSPI is unavailable even with --experimental-wasm-jspi");
  const r = spawnSync(process.execPath,
    ["--experimental-wasm-jspi", ...process.execArgv, fileURLToPath(import.meta.url), ...process.argv.slice(2)],
    { stdio: "inherit", env: { ...process.env, PYODIDE_TIER_REEXEC: "1" } });
  process.exit(r.status ?? 1);
}

// ---- arguments ----------------------------------------------------------------------------
const argv = process.argv.slice(2);
let only = [], timeout = 30, listOnly = false, modulePath = null;
for (let i = 0; i < argv.length; i++) {
  const a = argv[i];
  if (a === "--only") only = argv[++i].split(",").filter(Boolean);
  else if (a === "--timeout") timeout = Number(argv[++i]);
  else if (a === "--list") listOnly = true;
  else if (a.startsWith("-")) die(`unknown option ${a}`);
  else modulePath = path.resolve(a);
}
if (!modulePath) die("usage: harness.mjs [--only a,b] [--timeout S] [--list] MODULE.py");
if (!fs.existsSync(modulePath)) die(`no such test module: ${modulePath}`);

// ---- environment --------------------------------------------------------------------------
const [major] = process.versions.node.split(".").map(Number);
if (major < 24) die(`needs Node >= 24 (node:sqlite), this is ${process.version}: run scripts/setup and use .venv/bin/node`);

const pyodideDir = process.env.PYODIDE_TIER_PYODIDE_DIR || path.join(REPO, "node_modules", "pyodide");
const sdkDir = process.env.PYODIDE_TIER_SDK_DIR || path.join(REPO, "python_modules");
const srcDir = process.env.PYODIDE_TIER_SRC_DIR || path.join(REPO, "src");
if (!fs.existsSync(path.join(pyodideDir, "pyodide.mjs"))) die(`Pyodide not found at ${pyodideDir}: run scripts/setup`);
if (!fs.existsSync(path.join(sdkDir, "workers", "__init__.py"))) die(`workers SDK not found in ${sdkDir}: run scripts/setup`);

const { clock, Runtime, makeCloudflareWorkersModule } = await import(pathToFileURL(path.join(HERE, "standins.mjs")).href);
clock.install();

// ---- boot Pyodide -------------------------------------------------------------------------
const { loadPyodide } = await import(pathToFileURL(path.join(pyodideDir, "pyodide.mjs")).href);
const t0 = performance.now();
const py = await loadPyodide({
  indexURL: pyodideDir + path.sep,
  stdout: (line) => process.stdout.write(line + "\n"),
  stderr: (line) => process.stderr.write(line + "\n"),
});
const bootMs = performance.now() - t0;

const mounts = [
  ["/tier/tests", path.dirname(modulePath)],
  ["/tier/support", HERE],
  ["/tier/src", srcDir],
  ["/tier/python_modules", sdkDir],
];
for (const [mountPoint, root] of mounts) {
  if (!fs.existsSync(root)) continue;
  py.FS.mkdirTree(mountPoint);
  // NODEFS does not follow a symlinked root (a git worktree linking python_modules/ to a
  // main checkout): mount the directory it points to.
  py.FS.mount(py.FS.filesystems.NODEFS, { root: fs.realpathSync(root) }, mountPoint);
}

// ---- what workerd registers before importing the worker -----------------------------------
let currentRuntime = null;
const cloudflareWorkers = makeCloudflareWorkersModule(() => currentRuntime);

async function callPy(fn, relaxed, args) {
  // workerd calls Python entrypoints with callWithOptions({relaxed, promising: true}).
  if (typeof fn.callWithOptions === "function") return await fn.callWithOptions({ relaxed, promising: true }, ...args);
  return relaxed ? await fn.callRelaxed(...args) : await fn(...args);
}

const entrypointHelper = {
  async doAnImport(name) {
    if (name === "cloudflare:workers") return cloudflareWorkers;
    if (name === "cloudflare:sockets") return {};
    throw new Error(`stand-in: cannot import ${name}`);
  },
  cloudflareWorkersModule: cloudflareWorkers,
  cloudflareSocketsModule: {},
  workerEntrypoint: cloudflareWorkers.WorkerEntrypoint,
  patchWaitUntil(ctx) { /* only ExecutionContext objects are patched in workerd; none here */ },
  *patch_env_helper(patch) {
    const env = cloudflareWorkers.env;
    const saved = new Map();
    for (const [k, v] of (patch instanceof Map ? patch.entries() : Object.entries(patch))) {
      saved.set(k, Object.getOwnPropertyDescriptor(env, k));
      env[k] = v;
    }
    try { yield; } finally {
      for (const [k, d] of saved) { if (d) Object.defineProperty(env, k, d); else delete env[k]; }
    }
  },
};
py.registerJsModule("_pyodide_entrypoint_helper", entrypointHelper);
// Compatibility flags the SDK reads (values for a recent compatibility date).
py.registerJsModule("_cloudflare_compat_flags", {
  python_workflows_implicit_dependencies: true,
  python_request_headers_preserve_commas: true,
});
py.registerJsModule("_standin_js", {
  clock,
  newRuntime(autoAlarms, dispatchProxy, fetchProxy) {
    const rt = new Runtime({ callPy, autoAlarms });
    rt.setDispatch(
      (inst, method, args) => callPy(dispatchProxy, false, [inst, method, ...args]),
      (inst, request) => callPy(fetchProxy, false, [inst, request]));
    currentRuntime = rt;
    return rt;
  },
});

py.runPython(`
import sys
sys.dont_write_bytecode = True
for p in reversed(["/tier/tests", "/tier/support", "/tier/src", "/tier/python_modules"]):
    if p not in sys.path:
        sys.path.insert(0, p)
`);

// ---- run ----------------------------------------------------------------------------------
const counts = { passed: 0, failed: 0, skipped: 0 };
function emit(s) {
  const ev = JSON.parse(s);
  if (ev.event === "result") counts[ev.outcome] = (counts[ev.outcome] ?? 0) + 1;
  process.stdout.write(`${MARK} ${s}\n`);
}

const moduleName = path.basename(modulePath, ".py");
const t1 = performance.now();
let status;
try {
  const runner = py.pyimport("tier_runner");
  status = await callPy(runner.main, false, [moduleName, py.toPy(only), timeout, emit, listOnly]);
} catch (e) {
  process.stderr.write(`pyodide tier: runner crashed: ${e?.message ?? e}\n`);
  status = 1;
}
const runMs = performance.now() - t1;
process.stdout.write(`${MARK} ${JSON.stringify({ event: "timing", bootMs: Math.round(bootMs), runMs: Math.round(runMs) })}\n`);
if (!listOnly) {
  process.stdout.write(`${counts.passed} passed, ${counts.failed} failed` + (counts.skipped ? `, ${counts.skipped} skipped` : "") + "\n");
}
process.exit(status === 0 && counts.failed === 0 ? 0 : 1);
