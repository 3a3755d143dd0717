// Runs the script of the /dashboard page in Node against a real server, with just enough of a browser around it
// (elements, localStorage, fetch relative to the server). Usage: node dashboard_page.js PAGE.html BASE_URL KEY
// Prints one JSON line per step: no key stored, a wrong key typed, the right key typed, the page reloaded.
"use strict";
const fs = require("fs");
const vm = require("vm");

const [page, base, key] = process.argv.slice(2);
const script = fs.readFileSync(page, "utf8").match(/<script>([\s\S]*)<\/script>/)[1];
const store = new Map();
const requests = [];
const pending = new Set();

function get(path, options) {
  // The whole answer is read before the page sees it, so settle() knows when the page has what it asked for.
  requests.push({path, headers: options.headers});
  const done = (async () => {
    const r = await fetch(base + path, options);
    const body = await r.text();
    return {status: r.status, ok: r.ok, json: async () => JSON.parse(body), text: async () => body};
  })();
  pending.add(done);
  done.finally(() => pending.delete(done)).catch(() => {});
  return done;
}

function element() {
  return {
    value: "", textContent: "", rows: [], listeners: {},
    addEventListener(type, f) { this.listeners[type] = f; },
    replaceChildren() { this.rows = []; },
    insertRow() { const row = {cells: [], appendChild(c) { this.cells.push(c); }}; this.rows.push(row); return row; },
    focus() {},
  };
}

function browser() {
  const elements = {};
  const context = {
    document: {
      getElementById: (id) => (elements[id] ||= element()),
      createElement: (tag) => ({tag, textContent: ""}),
    },
    localStorage: {
      getItem: (k) => (store.has(k) ? store.get(k) : null),
      setItem: (k, v) => store.set(k, String(v)),
      removeItem: (k) => store.delete(k),
    },
    fetch: get,
    setInterval: () => 0,
    Error, Object, String, Promise, console,
  };
  vm.runInNewContext(script, context);
  return elements;
}

async function settle() {
  // Wait for every request the page made, then let its continuations run.
  do {
    await Promise.allSettled([...pending]);
    for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r));
  } while (pending.size);
}

function report(step, elements) {
  const table = (id) => (elements[id] ? elements[id].rows.map((r) => r.cells.map((c) => c.textContent)) : []);
  const last = requests[requests.length - 1];
  console.log(JSON.stringify({step, message: elements.message.textContent, status: table("status"),
                              envs: table("envs"), last_request: last, stored: store.get("rollhub.apiKey") || null}));
}

async function type(elements, value) { elements.key.value = value; elements.key.listeners.input(); await settle(); }

(async () => {
  let elements = browser();
  await settle();
  report("no key", elements);
  await type(elements, "wrong-" + key);
  report("wrong key", elements);
  await type(elements, key);
  report("right key", elements);
  elements = browser();  // a reload: the key comes back from localStorage
  await settle();
  report("reloaded", elements);
})().catch((e) => { console.error(e); process.exit(1); });
