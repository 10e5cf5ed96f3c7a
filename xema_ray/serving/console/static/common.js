// Shared by both pages: the API key (entered once, kept in localStorage) and calls to this origin only.
"use strict";
const KEY_NAME = "xema.apiKey";
const $ = (sel, root = document) => root.querySelector(sel);
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v;
    else if (k === "style") e.style.cssText = v;  // CSSOM: allowed under the pages' CSP (no inline style attributes)
    else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
};
const apiKey = () => localStorage.getItem(KEY_NAME) || "";

class ApiError extends Error {
  constructor(status, message, body) { super(message); this.status = status; this.body = body; }
}

// fetch on this origin with the key; JSON bodies and answers; errors carry the API's message
async function api(path, opts = {}) {
  const headers = Object.assign({}, opts.headers || {});
  if (apiKey()) headers["Authorization"] = "Bearer " + apiKey();
  let body = opts.body;
  if (body !== undefined && !(body instanceof FormData) && typeof body !== "string") {
    body = JSON.stringify(body); headers["Content-Type"] = "application/json";
  }
  const r = await fetch(path, { method: opts.method || "GET", headers, body, signal: opts.signal });
  if (opts.raw && r.ok) return r;
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (_) { data = null; }
  if (!r.ok) {
    const msg = (data && data.error && data.error.message) || (data && data.detail && JSON.stringify(data.detail)) || text || r.statusText;
    throw new ApiError(r.status, `${r.status}: ${msg}`, data);
  }
  return data;
}

const gb = (b) => b == null ? "–" : (b >= 1e9 ? (b / 1e9).toFixed(2) + " GB" : (b / 1e6).toFixed(1) + " MB");
const secs = (s) => s == null ? "–" : (s < 10 ? s.toFixed(2) : s.toFixed(1)) + " s";

// the header: navigation and the key box
function setupHeader() {
  const input = $("#api-key"), save = $("#key-save"), forget = $("#key-forget"), state = $("#key-state");
  const show = () => { state.textContent = apiKey() ? "key saved in this browser" : "no key (open API)"; input.value = ""; };
  save.addEventListener("click", () => { if (input.value.trim()) localStorage.setItem(KEY_NAME, input.value.trim()); show(); document.dispatchEvent(new Event("xema-key")); });
  forget.addEventListener("click", () => { localStorage.removeItem(KEY_NAME); show(); document.dispatchEvent(new Event("xema-key")); });
  input.addEventListener("keydown", (e) => { if (e.key === "Enter") save.click(); });
  show();
}
