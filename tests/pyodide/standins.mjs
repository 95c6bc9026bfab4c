// JavaScript stand-ins for the Workers runtime objects a Python Durable Object touches.
//
// These mimic the *JavaScript surface* workerd hands to Pyodide (class names, camelCase members,
// promises vs plain values, JS value types), so that the real `workers` SDK wraps them exactly as
// it does in production. The storage is REAL SQLite (Node 24's `node:sqlite`), gated like workerd:
// an authorizer refuses BEGIN/COMMIT/ROLLBACK/SAVEPOINT/RELEASE, most PRAGMAs and `_cf_` names,
// at most 100 bound parameters, 100 KB statements. See README.md for what is NOT reproduced.

import sqlite, { DatabaseSync } from "node:sqlite";
import { createHash, randomBytes } from "node:crypto";
import v8 from "node:v8";

const C = sqlite.constants;

export const LIMITS = {
  maxBindings: 100,
  maxStatementBytes: 100_000,
  maxValueBytes: 2_000_000,
};

// ---------------------------------------------------------------------------------------------
// Clock: Date.now() (and so Python's time.time(), which Emscripten reads from Date.now) can be
// moved forward by tests. Timers (setTimeout, asyncio sleeps) keep running on real time.
// ---------------------------------------------------------------------------------------------

const realDateNow = Date.now.bind(Date);

export const clock = {
  offset: 0,
  listeners: new Set(),
  now() {
    return realDateNow() + this.offset;
  },
  advance(ms) {
    if (typeof ms !== "number" || !(ms >= 0)) throw new TypeError("clock.advance(ms) needs ms >= 0");
    this.offset += ms;
    for (const fn of this.listeners) fn();
    return this.now();
  },
  reset() {
    this.offset = 0;
    for (const fn of this.listeners) fn();
  },
  install() {
    Date.now = () => clock.now();
  },
};

// ---------------------------------------------------------------------------------------------
// SQL
// ---------------------------------------------------------------------------------------------

const TXN_MESSAGE =
  "To execute a transaction, please use the state.storage.transaction() or " +
  "state.storage.transactionSync() APIs instead of the SQL BEGIN TRANSACTION or SAVEPOINT " +
  "statements. The JavaScript API is safer because it will automatically roll back on " +
  "exceptions, and because it interacts correctly with Durable Objects' automatic atomic " +
  "write coalescing.";

// PRAGMAs a Durable Object may run (read-only introspection and a few harmless settings).
const ALLOWED_PRAGMAS = new Set([
  "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
  "foreign_key_list", "foreign_key_check", "foreign_keys", "defer_foreign_keys",
  "quick_check", "integrity_check", "optimize", "legacy_alter_table", "case_sensitive_like",
]);

const SQLITE_CODE_NAMES = {
  1: "SQLITE_ERROR", 2: "SQLITE_INTERNAL", 3: "SQLITE_PERM", 4: "SQLITE_ABORT", 5: "SQLITE_BUSY",
  6: "SQLITE_LOCKED", 7: "SQLITE_NOMEM", 8: "SQLITE_READONLY", 9: "SQLITE_INTERRUPT",
  10: "SQLITE_IOERR", 11: "SQLITE_CORRUPT", 13: "SQLITE_FULL", 17: "SQLITE_SCHEMA",
  18: "SQLITE_TOOBIG", 19: "SQLITE_CONSTRAINT", 20: "SQLITE_MISMATCH", 21: "SQLITE_MISUSE",
  23: "SQLITE_AUTH", 25: "SQLITE_RANGE",
};

// workerd reports SQLite failures as a plain Error whose message ends with the code name,
// e.g. "UNIQUE constraint failed: t.id: SQLITE_CONSTRAINT".
function sqlError(e) {
  if (e && typeof e.errcode === "number") {
    const name = SQLITE_CODE_NAMES[e.errcode & 0xff] ?? `SQLITE_${e.errcode}`;
    return new Error(`${e.message}: ${name}`);
  }
  return e;
}

/**
 * Split a SQL string into statements the way sqlite3_prepare's tail handling would, honouring
 * quotes, comments and CREATE TRIGGER ... BEGIN ... END bodies.
 */
export function splitStatements(sql) {
  const out = [];
  const n = sql.length;
  let start = 0, i = 0;
  let words = [], lastWord = "", isTrigger = false, hasToken = false;
  const push = (end) => {
    if (hasToken) out.push({ text: sql.slice(start, end), firstWord: words[0] ?? "", words: words.slice() });
    words = []; lastWord = ""; isTrigger = false; hasToken = false;
  };
  while (i < n) {
    const c = sql[i];
    if (c === "'" || c === '"' || c === "`") {
      hasToken = true; lastWord = "";
      i++;
      while (i < n) {
        if (sql[i] === c) {
          if (sql[i + 1] === c) { i += 2; continue; }
          i++; break;
        }
        i++;
      }
      continue;
    }
    if (c === "[") {
      hasToken = true; lastWord = "";
      const j = sql.indexOf("]", i + 1);
      i = j < 0 ? n : j + 1;
      continue;
    }
    if (c === "-" && sql[i + 1] === "-") {
      const j = sql.indexOf("\n", i);
      i = j < 0 ? n : j + 1;
      continue;
    }
    if (c === "/" && sql[i + 1] === "*") {
      const j = sql.indexOf("*/", i + 2);
      i = j < 0 ? n : j + 2;
      continue;
    }
    if (/[A-Za-z_]/.test(c)) {
      let j = i;
      while (j < n && /[A-Za-z0-9_$]/.test(sql[j])) j++;
      const w = sql.slice(i, j).toUpperCase();
      if (words.length < 6) words.push(w);
      if (w === "TRIGGER" && words[0] === "CREATE" && words.length <= 4) isTrigger = true;
      lastWord = w; hasToken = true;
      i = j;
      continue;
    }
    if (c === ";") {
      if (!isTrigger || lastWord === "END") {
        push(i);
        start = i + 1;
      }
      lastWord = "";
      i++;
      continue;
    }
    if (!/\s/.test(c)) { hasToken = true; lastWord = ""; }
    i++;
  }
  push(n);
  return out;
}

function countParameters(statementText) {
  // Highest parameter index a statement uses: ?NNN, ?, :name, @name, $name (outside quotes).
  let count = 0, max = 0;
  const n = statementText.length;
  for (let i = 0; i < n; i++) {
    const c = statementText[i];
    if (c === "'" || c === '"' || c === "`") {
      i++;
      while (i < n && !(statementText[i] === c && statementText[i + 1] !== c)) {
        if (statementText[i] === c) i++;
        i++;
      }
      continue;
    }
    if (c === "-" && statementText[i + 1] === "-") { const j = statementText.indexOf("\n", i); i = j < 0 ? n : j; continue; }
    if (c === "/" && statementText[i + 1] === "*") { const j = statementText.indexOf("*/", i + 2); i = j < 0 ? n : j + 1; continue; }
    if (c === "?") {
      let j = i + 1;
      while (j < n && /[0-9]/.test(statementText[j])) j++;
      if (j > i + 1) { max = Math.max(max, Number(statementText.slice(i + 1, j))); i = j - 1; }
      else { count++; max = Math.max(max, count); }
    } else if ((c === ":" || c === "@" || c === "$") && /[A-Za-z_]/.test(statementText[i + 1] ?? "")) {
      count++; max = Math.max(max, count);
    }
  }
  return max;
}

function checkBinding(value, index) {
  // workerd's binding type is  ArrayBuffer(View) | string | number | null  (undefined -> null).
  if (value === null || value === undefined) return null;
  if (typeof value === "string") {
    if (Buffer.byteLength(value) > LIMITS.maxValueBytes) throw new Error("string or blob too big: SQLITE_TOOBIG");
    return value;
  }
  if (typeof value === "number") return value;
  if (value instanceof ArrayBuffer) {
    if (value.byteLength > LIMITS.maxValueBytes) throw new Error("string or blob too big: SQLITE_TOOBIG");
    return new Uint8Array(value.slice(0));
  }
  if (ArrayBuffer.isView(value)) {
    if (value.byteLength > LIMITS.maxValueBytes) throw new Error("string or blob too big: SQLITE_TOOBIG");
    return new Uint8Array(value.buffer.slice(value.byteOffset, value.byteOffset + value.byteLength));
  }
  const what = typeof value === "bigint"
    ? "a BigInt (a Python int outside +-2**53)"
    : typeof value === "boolean" ? "a boolean (convert to 0/1 yourself)"
    : typeof value === "object" ? `an object (${value?.constructor?.name ?? "Object"})` : typeof value;
  throw new TypeError(
    `sql.exec() binding ${index + 1} is ${what}; bind only str, int (< 2**53), float, bytes or None`);
}

function wrapValue(v) {
  // workerd turns INTEGER into a double (precision lost above 2**53) and BLOB into ArrayBuffer.
  if (typeof v === "bigint") return Number(v);
  if (v instanceof Uint8Array) return v.buffer.slice(v.byteOffset, v.byteOffset + v.byteLength);
  return v;
}

export class SqlStorageCursor {
  #iter = null;      // node:sqlite iterator of row arrays, or null when finished
  #pending = null;   // prefetched next row (array), like workerd's one-step look-ahead
  #columnNames = [];
  #rowsRead = 0;
  #rowsWritten = 0;

  constructor(internal) {
    if (internal !== CURSOR_TOKEN) throw new TypeError("Illegal constructor");
  }

  static _open(storage, statements, bindings) {
    const cur = new SqlStorageCursor(CURSOR_TOKEN);
    cur.#start(storage, statements, bindings);
    return cur;
  }

  #start(storage, statements, bindings) {
    const db = storage._db;
    // All statements but the last run to completion right away (as workerd's prepareMulti).
    for (let k = 0; k < statements.length - 1; k++) {
      const st = storage._prepare(statements[k].text);
      const r = st.run();
      this.#rowsWritten += Number(r.changes);
    }
    const last = statements[statements.length - 1];
    const st = storage._prepare(last.text);
    const cols = st.columns().map((c) => c.name);
    let r;
    try {
      if (cols.length === 0) {
        r = st.run(...bindings);
        this.#rowsWritten += Number(r.changes);
        this.#iter = null;
      } else {
        st.setReadBigInts(true);
        st.setReturnArrays(true);
        this.#columnNames = cols;
        this.#iter = st.iterate(...bindings);
        this.#isWrite = ["INSERT", "UPDATE", "DELETE", "REPLACE"].includes(last.firstWord);
        this.#prefetch();    // the statement runs (and its writes happen) at exec() time
      }
    } catch (e) {
      throw sqlError(e);
    }
  }

  #isWrite = false;

  #prefetch() {
    if (!this.#iter) { this.#pending = null; return; }
    let step;
    try {
      step = this.#iter.next();
    } catch (e) {
      this.#iter = null;
      throw sqlError(e);
    }
    if (step.done) {
      this.#iter.return?.();
      this.#iter = null;
      this.#pending = null;
    } else {
      this.#pending = step.value;
      if (this.#isWrite) this.#rowsWritten++; else this.#rowsRead++;
    }
  }

  #nextValues() {
    if (this.#pending === null) return null;
    const values = this.#pending;
    this.#prefetch();
    return values.map(wrapValue);
  }

  #rowObject(values) {
    const row = {};
    this.#columnNames.forEach((name, i) => { row[name] = values[i]; });
    return row;
  }

  next() {
    const values = this.#nextValues();
    return values === null ? { done: true, value: undefined } : { done: false, value: this.#rowObject(values) };
  }

  toArray() {
    const out = [];
    for (let v = this.#nextValues(); v !== null; v = this.#nextValues()) out.push(this.#rowObject(v));
    return out;
  }

  one() {
    const v = this.#nextValues();
    if (v === null) throw new Error("Expected exactly one result from SQL query, but got no results.");
    if (this.#pending !== null) {
      this.#iter?.return?.();
      this.#iter = null;
      this.#pending = null;
      throw new Error("Expected exactly one result from SQL query, but got multiple results.");
    }
    return this.#rowObject(v);
  }

  raw() {
    return new RawIterator(() => this.#nextValues());
  }

  [Symbol.iterator]() {
    return this;
  }

  get columnNames() { return this.#columnNames.slice(); }
  // Approximations: workerd counts rows SQLite scanned/wrote (index rows included); here
  // rowsRead = result rows of a read, rowsWritten = changed rows (or RETURNING rows).
  get rowsRead() { return this.#rowsRead; }
  get rowsWritten() { return this.#rowsWritten; }
}
const CURSOR_TOKEN = Symbol("cursor");

// cursor.raw(): rows as arrays (a class instance, as workerd's RawIterator, so the SDK keeps it
// as an iterable JS object instead of converting it to a dict).
export class RawIterator {
  #pull;
  constructor(pull) { this.#pull = pull; }
  next() {
    const v = this.#pull();
    return v === null ? { done: true, value: undefined } : { done: false, value: v };
  }
  [Symbol.iterator]() { return this; }
}

export class SqlStorage {
  #storage;
  constructor(storage) { this.#storage = storage; }

  exec(query, ...bindings) {
    if (typeof query !== "string") throw new TypeError("sql.exec(): the query must be a string");
    if (Buffer.byteLength(query) > LIMITS.maxStatementBytes) {
      throw new Error("string or blob too big: SQLITE_TOOBIG");
    }
    const statements = splitStatements(query);
    if (statements.length === 0) throw new Error("sql.exec(): the query contains no statement");
    const values = bindings.map(checkBinding);
    if (values.length > LIMITS.maxBindings) {
      throw new Error(`too many SQL variables (${values.length} > ${LIMITS.maxBindings}): SQLITE_ERROR`);
    }
    for (const st of statements) {
      if (countParameters(st.text) > LIMITS.maxBindings) {
        throw new Error(`too many SQL variables (statement uses more than ${LIMITS.maxBindings}): SQLITE_ERROR`);
      }
    }
    if (statements.length > 1 && values.length > 0) {
      throw new Error(
        "stand-in: sql.exec() with several statements AND bindings is not supported " +
        "(run the statements separately)");
    }
    return SqlStorageCursor._open(this.#storage, statements, values);
  }

  get databaseSize() {
    const db = this.#storage._db;
    return this.#storage._trusted(() => {
      const pc = db.prepare("PRAGMA page_count").get().page_count;
      const fc = db.prepare("PRAGMA freelist_count").get().freelist_count;
      const ps = db.prepare("PRAGMA page_size").get().page_size;
      return (Number(pc) - Number(fc)) * Number(ps);
    });
  }
}

// ---------------------------------------------------------------------------------------------
// Storage
// ---------------------------------------------------------------------------------------------

export class DurableObjectStorage {
  #sql;
  #txnDepth = 0;

  constructor(record) {
    this._record = record;
    this._db = record.db;
    this.#sql = new SqlStorage(this);
    // One authorizer per database, its state on the record: shared by every storage object
    // over that database (a new instance after eviction AND the tasks an evicted instance
    // leaves running, which would otherwise find their SAVEPOINTs refused).
    this._gate = record.sqlGate;
    if (!this._gate) {
      this._gate = record.sqlGate = { trustedDepth: 0, deniedTxn: false };
      this._db.setAuthorizer((code, a1, a2) => this.#authorize(code, a1, a2));
    }
  }

  #authorize(code, a1, a2) {
    if (this._gate.trustedDepth > 0) return C.SQLITE_OK;
    if (code === C.SQLITE_TRANSACTION || code === C.SQLITE_SAVEPOINT) {
      this._gate.deniedTxn = true;
      return C.SQLITE_DENY;
    }
    if (code === C.SQLITE_PRAGMA) {
      return ALLOWED_PRAGMAS.has(String(a1).toLowerCase()) ? C.SQLITE_OK : C.SQLITE_DENY;
    }
    let table = "";
    switch (code) {
      case C.SQLITE_CREATE_INDEX: case C.SQLITE_CREATE_TEMP_INDEX: case C.SQLITE_DROP_INDEX:
      case C.SQLITE_DROP_TEMP_INDEX: case C.SQLITE_CREATE_TRIGGER: case C.SQLITE_CREATE_TEMP_TRIGGER:
      case C.SQLITE_DROP_TRIGGER: case C.SQLITE_DROP_TEMP_TRIGGER: case C.SQLITE_ALTER_TABLE:
        table = a2; break;
      default:
        table = a1;
    }
    if (typeof table === "string" && table.startsWith("_cf_")) return C.SQLITE_DENY;
    return C.SQLITE_OK;
  }

  _trusted(fn) {
    this._gate.trustedDepth++;
    try { return fn(); } finally { this._gate.trustedDepth--; }
  }

  _prepare(text) {
    this._gate.deniedTxn = false;
    try {
      return this._db.prepare(text);
    } catch (e) {
      if (this._gate.deniedTxn) throw new Error(TXN_MESSAGE);
      throw sqlError(e);
    }
  }

  get sql() { return this.#sql; }

  transactionSync(closure) {
    if (typeof closure !== "function") throw new TypeError("transactionSync() needs a function");
    const name = `_cf_txn_${++this.#txnDepth}`;
    this._trusted(() => this._db.exec(`SAVEPOINT ${name}`));
    let result;
    try {
      result = closure();
      if (result && typeof result.then === "function") {
        // A Python coroutine / JS promise: the closure was async. Refuse it (workerd needs a
        // synchronous callback; an async one would commit before its body ran).
        try { result.destroy?.(); } catch { /* ignore */ }
        throw new TypeError("transactionSync() callback must be synchronous; it returned an awaitable");
      }
    } catch (e) {
      this._trusted(() => this._db.exec(`ROLLBACK TO ${name}; RELEASE ${name}`));
      this.#txnDepth--;
      throw e;
    }
    this._trusted(() => this._db.exec(`RELEASE ${name}`));
    this.#txnDepth--;
    return result;
  }

  async transaction(closure) {
    throw new Error("stand-in: storage.transaction(async fn) is not implemented; use transactionSync");
  }

  // --- alarms (one per object; the time survives eviction, like real storage) ---
  async getAlarm(options) {
    return this._record.alarm === null ? null : this._record.alarm;
  }

  async setAlarm(scheduledTime, options) {
    let t = scheduledTime;
    if (t instanceof Date) t = t.getTime();
    if (typeof t !== "number" || !Number.isFinite(t)) {
      throw new TypeError("setAlarm() needs a number of epoch milliseconds or a Date");
    }
    this._record.setAlarm(t);
  }

  async deleteAlarm(options) {
    this._record.setAlarm(null);
  }

  // --- KV API (stored in SQLite as in SQLite-backed objects) ---
  #kv() {
    return this._trusted(() => {
      this._db.exec("CREATE TABLE IF NOT EXISTS _cf_KV (key TEXT PRIMARY KEY, value BLOB) WITHOUT ROWID");
      return this._db;
    });
  }

  async get(keys) {
    const db = this.#kv();
    return this._trusted(() => {
      const one = (k) => {
        const row = db.prepare("SELECT value FROM _cf_KV WHERE key = ?").get(String(k));
        return row ? v8.deserialize(row.value) : undefined;
      };
      if (Array.isArray(keys)) {
        const m = new Map();
        for (const k of keys) { const v = one(k); if (v !== undefined) m.set(k, v); }
        return m;
      }
      return one(keys);
    });
  }

  async put(key, value) {
    const db = this.#kv();
    const entries = typeof key === "object" && key !== null ? Object.entries(key) : [[key, value]];
    this._trusted(() => {
      for (const [k, v] of entries) {
        db.prepare("INSERT OR REPLACE INTO _cf_KV (key, value) VALUES (?, ?)").run(String(k), v8.serialize(structuredClone(v)));
      }
    });
  }

  async delete(keys) {
    const db = this.#kv();
    return this._trusted(() => {
      const list = Array.isArray(keys) ? keys : [keys];
      let n = 0;
      for (const k of list) n += Number(db.prepare("DELETE FROM _cf_KV WHERE key = ?").run(String(k)).changes);
      return Array.isArray(keys) ? n : n > 0;
    });
  }

  async list(options = {}) {
    const db = this.#kv();
    return this._trusted(() => {
      const rows = db.prepare("SELECT key, value FROM _cf_KV ORDER BY key").all();
      let items = rows.filter((r) =>
        (options.prefix === undefined || r.key.startsWith(options.prefix)) &&
        (options.start === undefined || r.key >= options.start) &&
        (options.end === undefined || r.key < options.end));
      if (options.reverse) items.reverse();
      if (options.limit !== undefined) items = items.slice(0, options.limit);
      return new Map(items.map((r) => [r.key, v8.deserialize(r.value)]));
    });
  }

  async deleteAll() {
    this._trusted(() => {
      const tables = this._db.prepare(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'").all();
      for (const { name } of tables) this._db.exec(`DROP TABLE IF EXISTS "${name.replaceAll('"', '""')}"`);
    });
  }

  async sync() {}

  getCurrentBookmark() { return Promise.resolve("stand-in-bookmark"); }
}

// ---------------------------------------------------------------------------------------------
// Ids, state (ctx), namespaces and stubs
// ---------------------------------------------------------------------------------------------

export class DurableObjectId {
  #hex; #name;
  constructor(hex, name) { this.#hex = hex; this.#name = name; }
  toString() { return this.#hex; }
  equals(other) { return other instanceof DurableObjectId && other.toString() === this.#hex; }
  get name() { return this.#name; }
}

export class DurableObjectState {
  #record;
  #waitUntil = [];
  constructor(record) {
    this.#record = record;
    this.id = record.id;
    this.storage = new DurableObjectStorage(record);
  }
  get [Symbol.toStringTag]() { return "DurableObjectState"; }

  waitUntil(promise) {
    this.#waitUntil.push(Promise.resolve(promise).catch(() => {}));
  }

  async blockConcurrencyWhile(callback) {
    // Delivery of new events to this object waits until the callback settles.
    let release;
    const gate = new Promise((r) => { release = r; });
    this.#record.gates.push(gate);
    try {
      return await callback();
    } catch (e) {
      // workerd resets an object whose blockConcurrencyWhile callback throws.
      this.#record.runtime._evictRecord(this.#record, "blockConcurrencyWhile callback threw");
      throw e;
    } finally {
      this.#record.gates.splice(this.#record.gates.indexOf(gate), 1);
      release();
    }
  }

  abort(reason) {
    this.#record.runtime._evictRecord(this.#record, reason ?? "aborted");
  }

  acceptWebSocket() { throw new Error("stand-in: WebSockets are not implemented"); }
  getWebSockets() { return []; }
}

// The ctx of a WorkerEntrypoint.
export class ExecutionContext {
  #pending = [];
  get [Symbol.toStringTag]() { return "ExecutionContext"; }
  waitUntil(promise) { this.#pending.push(Promise.resolve(promise).catch(() => {})); }
  passThroughOnException() {}
  get props() { return {}; }
  async _drain() { await Promise.allSettled(this.#pending); }
}

// An RPC error crosses the boundary through the V8 serializer: only standard error names
// survive (PythonError becomes Error), message and stack are kept, extra fields are dropped.
function cloneErrorForRpc(e) {
  try {
    return structuredClone(e);
  } catch {
    return new Error(String(e?.message ?? e));
  }
}

function cloneForRpc(value, what) {
  try {
    return structuredClone(value);
  } catch (e) {
    // structuredClone throws DataCloneError (a DOMException); report it like the runtime does.
    const err = new Error(`${what} could not be serialized for RPC: ${e.message}`);
    err.name = e.name === "DataCloneError" ? "DataCloneError" : "TypeError";
    throw err;
  }
}

function makeStub(namespace, id) {
  const target = new DurableObject(namespace, id);
  return new Proxy(target, {
    get(t, prop, receiver) {
      if (typeof prop !== "string") return Reflect.get(t, prop, receiver);
      // Own members (id, name, fetch) run with the target as `this` (they read private fields).
      if (prop in t) return Reflect.get(t, prop, t);
      if (prop === "then") return undefined; // a stub is not itself awaitable
      return (...args) => namespace._runtime._rpc(namespace, id, prop, args);
    },
  });
}

// The class of a namespace stub is named DurableObject in workerd.
export class DurableObject {
  #namespace; #id;
  constructor(namespace, id) { this.#namespace = namespace; this.#id = id; }
  get id() { return this.#id; }
  get name() { return this.#id.name; }
  fetch() { throw new Error("stand-in: stub.fetch() is not implemented; call RPC methods"); }
}

export class DurableObjectNamespace {
  constructor(runtime, binding) {
    this._runtime = runtime;
    this._binding = binding;
  }

  idFromName(name) {
    if (typeof name !== "string") throw new TypeError("idFromName() needs a string");
    const hex = createHash("sha256").update(`${this._binding}\0${name}`).digest("hex");
    return new DurableObjectId(hex, name);
  }

  newUniqueId() {
    return new DurableObjectId(randomBytes(32).toString("hex"), undefined);
  }

  idFromString(hex) {
    if (!/^[0-9a-f]{64}$/.test(hex)) throw new TypeError("Invalid Durable Object ID: must be 64 hex digits");
    return this._runtime._knownIds.get(hex) ?? new DurableObjectId(hex, undefined);
  }

  get(id) {
    if (!(id instanceof DurableObjectId)) throw new TypeError("get() needs a DurableObjectId");
    this._runtime._knownIds.set(id.toString(), id);
    return makeStub(this, id);
  }

  getByName(name) {
    return this.get(this.idFromName(name));
  }

  jurisdiction() { return this; }
}

// ---------------------------------------------------------------------------------------------
// Runtime: owns the objects of every namespace, instantiates the Python classes the way
// workerd's python-entrypoint-helper does, and delivers RPC calls and alarms.
// ---------------------------------------------------------------------------------------------

class ObjectRecord {
  constructor(runtime, binding, id) {
    this.runtime = runtime;
    this.binding = binding;
    this.id = id;
    this.db = new DatabaseSync(":memory:");
    this.alarm = null;
    this.alarmRetry = 0;
    this.alarmTimer = null;
    this.alarmRunning = false;
    this.alarmSetDuringRun = false;
    this.state = null;
    this.instance = null;  // Promise of the Python instance (PyProxy)
    this.gates = [];
    this.generation = 0;
    this.log = [];
  }

  setAlarm(t) {
    this.alarm = t;
    if (this.alarmRunning) this.alarmSetDuringRun = true;
    this.runtime._armAlarm(this);
  }
}

export class Runtime {
  constructor({ callPy, autoAlarms = true } = {}) {
    // callPy(pyCallable, relaxed, args) -> Promise; provided by the harness (callWithOptions).
    this._callPy = callPy;
    this._classes = new Map();   // binding -> { pyClass, className }
    this._records = new Map();   // `${binding}/${hex}` -> ObjectRecord
    this._knownIds = new Map();
    this._dispatch = null;       // Python dispatch function (see standins.py)
    this.autoAlarms = autoAlarms;
    this.env = {};
    this.events = [];            // [{kind, binding, name, ...}] for tests to inspect
    this.closed = false;
    this._onClock = () => { for (const r of this._records.values()) this._armAlarm(r); };
    clock.listeners.add(this._onClock);
  }

  setDispatch(fn, fetchFn) { this._dispatch = fn; this._fetchDispatch = fetchFn; }

  /**
   * Deliver an HTTP request to a WorkerEntrypoint class (e.g. the `Default` front): a fresh
   * instance per request with (ExecutionContext, env), then `fetch(request)` the way workerd
   * calls it (relaxed call; the SDK turns the JS Request into workers.Request and the returned
   * workers.Response back into a JS Response).
   */
  async fetchEntrypoint(pyClass, request) {
    const ctx = new ExecutionContext();
    const inst = await this._callPy(pyClass, false, [ctx, this.env]);
    try {
      if (typeof inst.fetch !== "function") throw new TypeError("Method fetch does not exist");
      return await this._fetchDispatch(inst, request);
    } finally {
      await ctx._drain();
    }
  }

  define(binding, pyClass, className) {
    this._classes.set(binding, { pyClass, className });
    this.env[binding] = new DurableObjectNamespace(this, binding);
  }

  setEnvValue(name, value) { this.env[name] = value; }

  _record(binding, id) {
    const key = `${binding}/${id.toString()}`;
    let r = this._records.get(key);
    if (!r) {
      r = new ObjectRecord(this, binding, id);
      this._records.set(key, r);
    }
    return r;
  }

  recordFor(binding, nameOrId) {
    const ns = this.env[binding];
    if (!ns) throw new Error(`no Durable Object binding named ${binding}`);
    const id = nameOrId instanceof DurableObjectId ? nameOrId : ns.idFromName(String(nameOrId));
    return this._record(binding, id);
  }

  async _instance(record) {
    if (this.closed) throw new Error("stand-in runtime is closed");
    if (!record.instance) {
      const { pyClass } = this._classes.get(record.binding);
      record.state = new DurableObjectState(record);
      record.generation++;
      this.events.push({ kind: "construct", binding: record.binding, name: record.id.name, generation: record.generation });
      // As workerd: construct the Python class with (ctx, env) from JS; the SDK wraps both.
      record.instance = this._callPy(pyClass, false, [record.state, this.env]);
      record.instance.catch(() => { record.instance = null; });
    }
    return record.instance;
  }

  // For Python callers: awaiting a promise of a PyProxy in Python consumes (destroys) that
  // proxy, so hand out a copy and keep the runtime's own reference alive.
  async instanceForPython(record) {
    const inst = await this._instance(record);
    return inst.copy();
  }

  async _awaitGates(record) {
    while (record.gates.length) await Promise.allSettled(record.gates);
  }

  async _rpc(namespace, id, method, args) {
    const record = this._record(namespace._binding, id);
    // Arguments are copied by the V8 serializer (structured clone), as JS RPC does.
    const cloned = cloneForRpc(args, `Arguments of ${method}()`);
    await this._awaitGates(record);
    const inst = await this._instance(record);
    // As workerd's entrypoint proxy: only callable attributes are RPC methods. The stand-in also
    // refuses names starting with "_" (private by Python convention, never part of an RPC API).
    if (method.startsWith("_") || typeof inst[method] !== "function") {
      throw new TypeError(`Method ${method} does not exist`);
    }
    let result;
    try {
      result = await this._dispatch(inst, method, cloned);
    } catch (e) {
      this.events.push({ kind: "rpc_error", binding: record.binding, name: id.name, method, message: String(e?.message ?? e) });
      throw cloneErrorForRpc(e);
    }
    return cloneForRpc(result, `The result of ${method}()`);
  }

  _armAlarm(record) {
    if (record.alarmTimer) { clearTimeout(record.alarmTimer); record.alarmTimer = null; }
    if (!this.autoAlarms || this.closed || record.alarm === null || record.alarmRunning) return;
    const delay = Math.max(0, record.alarm - clock.now());
    record.alarmTimer = setTimeout(() => {
      record.alarmTimer = null;
      // A timer can fire a millisecond (or, if clock.offset moved back, more) before clock.now()
      // reaches the alarm: fireAlarm would answer "not fired" and nothing would re-arm it, so
      // the alarm would never fire by itself. Wait for the rest of the time instead.
      if (record.alarm !== null && !record.alarmRunning && record.alarm > clock.now()) {
        this._armAlarm(record);
        return;
      }
      this.fireAlarm(record).catch(() => {});
    }, delay);
  }

  /**
   * Run the object's alarm handler now if an alarm is set (and due, unless force).
   * Returns {fired, error, retryScheduled}. Mirrors workerd: the alarm is cleared before the
   * handler runs (getAlarm() returns null inside it unless setAlarm is called again); when the
   * handler throws, it is retried with exponential backoff (2 s, 4 s, ... up to 6 retries).
   */
  async fireAlarm(record, { force = false } = {}) {
    if (record.alarm === null || record.alarmRunning) return { fired: false };
    if (!force && record.alarm > clock.now()) return { fired: false };
    if (record.alarmTimer) { clearTimeout(record.alarmTimer); record.alarmTimer = null; }
    const retryCount = record.alarmRetry;
    record.alarm = null;
    record.alarmRunning = true;
    record.alarmSetDuringRun = false;
    this.events.push({ kind: "alarm", binding: record.binding, name: record.id.name, retryCount });
    let error = null;
    try {
      await this._awaitGates(record);
      const inst = await this._instance(record);
      if (typeof inst.alarm !== "function") throw new TypeError("Handler does not export an alarm() function.");
      // Alarm is a known DO handler: relaxed call with a plain JS alarmInfo, no RPC conversion.
      await this._callPy(inst.alarm, true, [{ retryCount, isRetry: retryCount > 0 }]);
      record.alarmRetry = 0;
    } catch (e) {
      error = e;
    } finally {
      record.alarmRunning = false;
    }
    let retryScheduled = false;
    if (error) {
      this.events.push({ kind: "alarm_error", binding: record.binding, name: record.id.name, message: String(error?.message ?? error) });
      if (retryCount < 6 && !record.alarmSetDuringRun) {
        record.alarmRetry = retryCount + 1;
        record.alarm = clock.now() + 2000 * 2 ** retryCount;
        retryScheduled = true;
      } else {
        record.alarmRetry = 0;
      }
    }
    this._armAlarm(record);
    return { fired: true, error: error ? String(error?.message ?? error) : null, retryScheduled };
  }

  /**
   * Stop firing alarms by themselves and wait (real time, up to timeoutMs) until no alarm handler
   * is running, so a test can end without handlers still touching storage after close().
   */
  async quiesce(timeoutMs = 20000) {
    this.autoAlarms = false;
    for (const r of this._records.values()) {
      if (r.alarmTimer) { clearTimeout(r.alarmTimer); r.alarmTimer = null; }
    }
    const deadline = performance.now() + timeoutMs;
    while ([...this._records.values()].some((r) => r.alarmRunning)) {
      if (performance.now() > deadline) throw new Error("quiesce: alarm handlers still running");
      await new Promise((resolve) => setTimeout(resolve, 5));
    }
  }

  async fireDueAlarms() {
    let n = 0;
    for (const r of [...this._records.values()]) {
      const res = await this.fireAlarm(r);
      if (res.fired) n++;
    }
    return n;
  }

  // Direct SQL on an object's database for test assertions (bypasses the authorizer).
  rawQuery(binding, nameOrId, query, ...args) {
    const record = this.recordFor(binding, nameOrId);
    const run = () => {
      const st = record.db.prepare(query);
      if (st.columns().length === 0) { st.run(...args.map(checkBinding)); return []; }
      st.setReadBigInts(true);
      return st.all(...args.map(checkBinding)).map((row) => {
        const out = {};
        for (const [k, v] of Object.entries(row)) out[k] = wrapValue(v);
        return out;
      });
    };
    const gate = record.sqlGate;   // set once any instance has opened the storage
    if (!gate) return run();
    gate.trustedDepth++;
    try { return run(); } finally { gate.trustedDepth--; }
  }

  _evictRecord(record, reason) {
    this.events.push({ kind: "evict", binding: record.binding, name: record.id.name, reason });
    record.instance = null;
    record.state = null;
    record.gates = [];
  }

  evict(binding, nameOrId, reason = "evicted by test") {
    this._evictRecord(this.recordFor(binding, nameOrId), reason);
  }

  close() {
    this.closed = true;
    clock.listeners.delete(this._onClock);
    for (const r of this._records.values()) {
      if (r.alarmTimer) clearTimeout(r.alarmTimer);
      try { r.db.close(); } catch { /* ignore */ }
    }
  }
}

// The `cloudflare:workers` module as Python's import_from_javascript sees it.
export function makeCloudflareWorkersModule(getRuntime) {
  class WorkerEntrypoint { constructor(ctx, env) { this.ctx = ctx; this.env = env; } }
  class DurableObjectBase { constructor(ctx, env) { this.ctx = ctx; this.env = env; } }
  class RpcTarget {}
  return {
    get env() { return getRuntime()?.env ?? {}; },
    waitUntil(p) { Promise.resolve(p).catch(() => {}); },
    WorkerEntrypoint,
    DurableObject: DurableObjectBase,
    RpcTarget,
  };
}
